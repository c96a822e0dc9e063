"""The start-up exchange on real engines (issue 27, item 3; :mod:`ds_paci.core.engine.first_exchange`): every group a
rank communicates on gets its first transfer while the engine is built, and training is bit-identical to the engine
without it. Why it is needed (lazily created NCCL communicators) is checked in the NCCL model:
``tests/test_nccl_order.py``."""

import pytest
import torch

import tied_workers
from harness import run_world

BLOCKING = ("send", "recv")  # the exchange's (the loss channel posts irecvs while it is built)


def expected(stage, stages, dp):
    """What :func:`first_exchange.run` reports on ``stage``: pipeline neighbours, the data-parallel group, the tied
    owners (first and last stage), the loss channel (every pair of the pipeline)."""
    neighbours = (stage > 0) + (stage < stages - 1)
    tied = 1 if stage in (0, stages - 1) else 0
    return {"pairs": neighbours + tied + (stages - 1), "collectives": int(dp > 1),
            "groups": neighbours + tied + 1 + int(dp > 1)}


@pytest.mark.process
@pytest.mark.parametrize("stages,dp,window", [(2, 2, None), (4, 1, 2)], ids=["P2-DP2", "P4-a2"])
def test_every_group_gets_its_first_exchange_and_training_is_unchanged(stages, dp, window):
    results = run_world(tied_workers.first_exchange_training, stages * dp, stages, 4, window, 3, timeout=300)
    for r in results:
        got, without = r["with"], r["without"]
        where = f"stage {got['stage']} dp {got['dp']}"
        assert got["exchange"] == expected(got["stage"], stages, dp), (where, got["exchange"])
        assert without["exchange"] == {"pairs": 0, "collectives": 0, "groups": 0}
        side = [c for c in got["built"] if c.op in BLOCKING and not c.default_group]
        assert not [c for c in without["built"] if c.op in BLOCKING and not c.default_group], where
        if got["owner"]:  # a transfer with the other owner on a group of just the owners (the tied group)
            other = [c for c in side if len(c.ranks) == 2 and c.peer in c.ranks]
            assert other, (where, side)
        if got["stage"] == stages - 1:  # (other stages return the newest loss the side channel has delivered)
            assert got["losses"] == without["losses"], (where, got["losses"], without["losses"])
            assert all(x == x for x in got["losses"]), got["losses"]
        assert got["tied"].keys() == without["tied"].keys()
        for k in got["tied"]:
            assert torch.equal(got["tied"][k], without["tied"][k]), (where, k)
    owners = [r["with"] for r in results if r["with"]["owner"]]
    assert len(owners) == 2 * dp
