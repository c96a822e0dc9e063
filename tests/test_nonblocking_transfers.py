"""Non-blocking transfers on real engines (issue 27 item 3): ``"paci": {"nonblocking_transfers": true}`` runs the
program lowered with :func:`~ds_paci.core.program.passes.hoist_sends` through :mod:`ds_paci.core.engine.transfers`
(isend/irecv on a two-rank group per link and direction). The arithmetic is the blocking engine's, so the losses,
the evaluation loss and the final weights are equal bit for bit. P = 2 and 4, DP = 2, tied weights, an evaluation
and a checkpoint save (drains that keep the window open) between calls, a closing drain. The order's NCCL safety is
``tests/test_nccl_order.py``'s; the pass is ``tests/test_hoist_sends.py``'s.
"""

import pytest
import torch

import transfer_workers
from harness import run_world
from ds_paci.core.config import PACIConfigError, parse_paci_section


def test_config_key():
    assert parse_paci_section({}).nonblocking_transfers is False
    assert parse_paci_section({"nonblocking_transfers": True}).nonblocking_transfers is True
    with pytest.raises(PACIConfigError, match="nonblocking_transfers.*true or false"):
        parse_paci_section({"nonblocking_transfers": "yes"})


@pytest.mark.process
@pytest.mark.xdist_group("nonblocking")
@pytest.mark.parametrize("stages,gas,window,slack", [(2, 3, 2, ()), (4, 4, 3, ()), (4, 4, 3, (1, ))])
def test_nonblocking_transfers_equal_the_blocking_engine(stages, gas, window, slack):
    """Tied weights without slack links; with a slack link (refused with tied layers) untied: the gradient of ``m``
    leaves the stage after the link two ticks before the stage before it receives it, so two gradient sends can be
    issued ahead of their receives; still equal to the blocking engine's program, where that send waits."""
    results = run_world(transfer_workers.blocking_vs_nonblocking, 2 * stages, stages, not slack, gas, window, slack,
                        timeout=300)
    for r in results:
        stage = r["blocking"]["stage"]
        extra = sum(1 for b in slack if b >= stage)
        assert r["nonblocking"]["slack"] == tuple(slack)
        # in flight P - s + k_s, one buffer more right after a slack link (its gradient waits there)
        after = stage > 0 and sum(1 for b in slack if b >= stage - 1) > extra
        assert r["nonblocking"]["nbuf"] == max(2, stages - stage + extra + after), (stage, r["nonblocking"]["nbuf"])
    for r in results:
        blocking, nonblocking = r["blocking"], r["nonblocking"]
        assert blocking["stats"] is None and nonblocking["in_flight"] == 0
        assert nonblocking["eval"] == blocking["eval"]
        if blocking["stage"] == stages - 1:  # an earlier stage returns the newest loss its side channel has brought
            assert nonblocking["losses"] == blocking["losses"]
        for k, v in blocking["weights"].items():
            assert torch.equal(v, nonblocking["weights"][k]), (r["blocking"]["stage"], k)
        sends = nonblocking["stats"]["sends"]
        assert sends > 0 and nonblocking["stats"]["receives"] > 0, nonblocking["stats"]
