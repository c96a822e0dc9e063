"""The non-finite guard (issue 10, item 1) and the watchdog's wording (item 5), on real engines.

A NaN micro-batch is injected by a test-only wrapper around the model's loss (contract_workers.poison_loss).
"""

import math

import pytest

import contract_workers
from ds_paci.core.seam import compat
from harness import run_world

pytestmark = pytest.mark.process  # every test here starts processes (tests/conftest.py)


def test_a_nan_micro_batch_is_skipped_on_every_stage_never_applied():
    stages, gas, calls, bad = 2, 2, 6, 5  # micro-batch 5 lies in window 2 (micro-batches 4, 5): local step 3
    cases = ["torch.optim", "configured-AdamW", "bf16", "zero1"]  # DeepSpeed's wrappers skip by themselves
    # only from 0.19.8; before, PACI checks their gradients (ds_paci.core.seam.compat)
    if compat.DS_BF16_GETS_UNFUSED:
        cases.remove("bf16")  # refused on this DeepSpeed version (asserted by test_config)
    results = run_world(contract_workers.nonfinite_guard, stages, stages, gas, calls, bad, cases, timeout=300)
    for case in cases:
        last = results[-1][case]
        # the last stage reports the NaN loss of the call that computed it
        nan_calls = [k for k, r in enumerate(last["records"]) if math.isnan(r["loss"])]
        assert nan_calls == [bad // gas], (case, last["records"])
        assert last["stats"]["nonfinite_losses"] == 1
        for rank in results:
            r = rank[case]
            assert r["finite"], f"{case}: a non-finite gradient was applied"
            assert r["stats"]["skipped_steps"] == 1 and r["skipped_steps"] == 1, case
            assert r["global_steps"] == r["stats"]["local_steps"] == calls, case
            applied = [rec["applied"] for rec in r["records"]]
            assert applied.count(False) == 1, (case, r["records"])
            skipped_at = applied.index(False)
            assert r["records"][skipped_at]["skipped"] == 1
            assert all(rec["norm"] is not None for rec in r["records"][skipped_at:])  # loggers get a number
            assert math.isfinite(float(r["records"][-1]["norm"]))
            if case == "bf16":
                assert r["optimizer"] == "BF16_Optimizer"
            if case == "zero1":
                assert r["optimizer"] == "DeepSpeedZeroOptimizer"
        # the skipped step still advanced the LR schedule: every stage has the same learning rate at every call
        for k in range(calls):
            assert len({rank[case]["records"][k]["lr"] for rank in results}) == 1, case
        assert len({rank[case]["lr"] for rank in results}) == 1
        assert math.isfinite(last["records"][-1]["loss"])


def test_consecutive_skips_stop_every_rank_with_one_line():
    limit = 2
    status, out, logs = run_world(contract_workers.consecutive_skips_stop, 3, 3, 2, 4, limit, timeout=240,
                                  expect_failure=True)
    for rank in range(3):
        assert status[rank] == "error", status
        lines = [l for l in out[rank].splitlines() if "PACINonFiniteError" in l]
        assert lines, out[rank][-2000:]
        line = lines[-1]
        assert "training stopped: stage" in line and "local steps in a row" in line, line
        assert f'"paci.max_consecutive_skips" is {limit}' in line and "Try a lower learning rate" in line
        assert f"rank {rank} (stage {rank} of 3" in line  # every rank says who it is


def test_no_checkpoint_is_written_from_nonfinite_weights(tmp_path):
    results = run_world(contract_workers.save_refuses_nonfinite_weights, 2, str(tmp_path / "ckpt"), timeout=180)
    for r in results:
        assert r["error"] and "refusing to save a checkpoint" in r["error"] and "stage(s) [0, 1]" in r["error"]
        assert r["applied"]  # sync mode is DeepSpeed's engine: fp32 applies the step
    assert not (tmp_path / "ckpt" / "latest").exists() and not (tmp_path / "ckpt" / "bad").exists()


def test_watchdog_says_a_rank_is_stuck_in_its_own_forward():
    status, out, logs = run_world(contract_workers.stuck_in_forward, 2, timeout=90, expect_failure=True)
    assert status[0] == "exit 86", status
    log = open(logs[0]).read()
    assert "rank 0 (stage 0 of 2" in log and "stuck in its own computation" in log, log[-2000:]
    assert "waiting for stage" not in log.split("[ds_paci watchdog]")[1]
