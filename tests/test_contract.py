"""The DeepSpeed engine contract on PACI (issue 7): real engines in real processes over gloo.

A loss on every rank without a blocking wait, DeepSpeed's and Megatron's calling patterns, sync mode equal to
the stock engine on DeepSpeed's default clipping, refusals that building the class directly cannot bypass.
"""

import math

import pytest

import contract_workers
from harness import run_world


def loss_bound(stages, stage, gas):
    """Calls by which stage ``stage``'s loss can lag the last stage's, from the pipeline's data dependencies."""
    return math.ceil((stages - stage) / (2 * gas))


@pytest.mark.parametrize("stages,gas", [(2, 2), (4, 4)], ids=["P2", "P4"])
def test_loss_on_every_rank_and_deepspeeds_calling_patterns(stages, gas, tmp_path):
    calls = 10
    results = run_world(contract_workers.calling_patterns, stages, stages, gas, calls, str(tmp_path / "ckpt"),
                        timeout=300)
    last = results[-1]
    last_losses = [c["loss"] for c in last["plain"]]
    assert all(math.isfinite(x) for x in last_losses) and last_losses[-1] < last_losses[0]
    for s, r in enumerate(results):
        assert r["stage"] == s
        plain = r["plain"]
        assert all(c["loss_dim"] == 0 for c in plain)  # a 0-dim tensor on every rank, never None
        assert all(c["applied"] for c in plain), "was_step_applied() is False only after a skipped step"
        # a number for the loggers from the first local step on: the stage's own norm
        assert all(c["norm"] is not None and math.isfinite(c["norm"]) and c["norm"] > 0 for c in plain[2:])
        ages = contract_workers.loss_ages([c["loss"] for c in plain], last_losses)
        if s == stages - 1:
            assert ages == [0] * calls
            continue
        bound = loss_bound(stages, s, gas)
        print(f"stage {s} of {stages}: loss ages {ages} (bound {bound})")
        assert ages[0] is None or ages[0] == 0  # NaN before the first value arrives
        seen = [a for a in ages if a is not None]
        assert seen and min(seen) >= 0
        assert max(seen) <= bound + 1, (ages, bound)  # one call of slack for the side channel's delivery
        assert sum(a <= bound for a in seen) >= len(seen) // 2, (ages, bound)
        # the stage's reported age matches, and the additional losses travel with the loss
        assert [c["age"] for c in plain if not math.isnan(c["loss"])] == seen
        for c, age, k in zip(plain, ages, range(calls)):
            if age is not None:
                assert c["aux"] == last["plain"][k - age]["aux"]
    # the stages' norms are their own (stage-local), not one global value
    assert len({round(r["plain"][-1]["norm"], 6) for r in results}) == stages
    # set_train_batch_size(<unchanged>) before every call: no drain, identical training
    for r in results:
        assert r["drains_after_unchanged"] == 0
        assert [c["loss"] for c in r["megatron"]] == [c["loss"] for c in r["plain"]]
    # eval_batch and save_checkpoint under torch.no_grad() in the middle of async training
    assert math.isfinite(last["eval"]) and all(r["eval"] == last["eval"] for r in results)
    assert (tmp_path / "ckpt" / "mid").is_dir()
    for r in results:
        assert r["drains_after_eval_save"] == 2  # one drain each: eval_batch and save_checkpoint
        assert all(math.isfinite(c["loss"]) for c in r["after_save"])
        # a real change of the batch size drains once and continues with twice the micro-batches
        assert r["drains_after_resize"] == 3
        assert r["micro_batches_after_resize"] == (2 * gas, 2 * gas)
        assert math.isfinite(r["after_resize"][-1]["loss"])
        assert r["stats"]["micro_batches"] == (calls + 2) * gas + 2 * 2 * gas - r["stats"]["in_flight"]
    # sync mode: every rank returns the call's own loss (the stock engine broadcasts it)
    sync_last = [c["loss"] for c in last["sync"]]
    for r in results:
        assert [c["loss"] for c in r["sync"]] == sync_last
        assert all(c["age"] == 0 for c in r["sync"])
