"""Counters mean what they mean in DeepSpeed; draining never changes training; the collective guard (issue 16).

Real engines in real processes over gloo (items 6 and 8); the stream-level properties are in test_schedule.py
(windows carried across drains, the learning-rate rule) and test_tied.py (the tied lag with carried windows).
"""

import csv
import math
import os
import time

import pytest

import counter_workers
from harness import run_world
from ds_paci.core.seam import compat

ENV = "DS_PACI_CHECK_COLLECTIVES"  # ds_paci.core.seam.collective_guard.ENV, spelled out: it is part of the contract


def assert_same_weights(a, b, what):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].equal(b[k]), f"{what}: {k} differs"


def training_state(record):
    """A call's record without the returned loss and this engine's own telemetry (micro-batches seen, loss age)."""
    out = {k: v for k, v in record.items() if k not in ("loss", "micro_batches", "age", "after_eval")}
    if "after_eval" in record:
        out["after_eval"] = training_state(record["after_eval"])
    return out


@pytest.mark.process
def test_counters_follow_calls_and_drains_add_no_step(tmp_path):
    """P = 4, M = 1, "auto" (a = 3), tied weights: per-call counters and scheduler as on the stock engine; evaluation
    after every call adds no optimizer or scheduler step; a save with a window open resumes exactly."""
    calls, save_at = 12, 5
    results = run_world(counter_workers.drains_do_not_change_training, 4, str(tmp_path / "ckpt"), str(tmp_path),
                        calls, save_at, timeout=300)
    last = results[-1]
    tbs = last["tbs"]
    for r in results:
        assert r["window"] == 3
        ref, ev, res = r["reference"], r["evaluated"], r["resumed"]
        for run in (ref, ev):
            # global_steps / global_samples: one step and train_batch_size() samples per call, on every stage
            assert [x["global_steps"] for x in run] == list(range(1, calls + 1))
            assert [x["global_samples"] for x in run] == [tbs * k for k in range(1, calls + 1)]
            # one local step per 3 micro-batches however often the run drains, and 3 scheduler steps per local step
            # (one per M = 1 micro-batches, as the stock engine's one per call), never ahead of the calls
            for k, x in enumerate(run, start=1):
                assert x["version"] == x["micro_batches"] // 3 and x["lr_count"] == 3 * x["version"] <= k, (k, x)
        for k, x in enumerate(ev, start=1):  # each evaluation drained: every micro-batch so far, no extra step
            after = x["after_eval"]
            assert after["micro_batches"] == k and after["version"] == k // 3 and after["window_fill"] == k % 3
        for end in (r["reference_end"], r["evaluated_end"], r["resumed_end"]):
            assert (end["global_steps"], end["version"], end["lr_count"]) == (calls, calls // 3, calls)
        assert r["evaluated_end"]["drains"] == calls + 1 and r["evaluated_end"]["copy_checks"] >= calls
        # the checkpoint was taken with a window open (2 of 3 micro-batches) and resumes exactly
        assert r["saved_fill"] == save_at % 3 == 2
        assert r["resumed_from"] == (save_at, save_at, 2)
        assert [training_state(x) for x in res] == [training_state(x) for x in ev[save_at:]]  # eval losses included
        assert_same_weights(r["resumed_end"]["weights"], r["evaluated_end"]["weights"], "resumed")
    # the last stage's own losses (the other stages' come over the side channel whenever they arrive)
    assert all(math.isfinite(x["loss"]) for x in last["reference"][1:] + last["evaluated"][1:] + last["resumed"][1:])
    # each call returns the loss of the micro-batches its evaluation's drain completed (a fresh engine: NaN first)
    assert [x["loss"] for x in last["resumed"][1:]] == [x["loss"] for x in last["evaluated"][save_at + 1:]]
    # the default tag names the calls, as DeepSpeed's does
    assert (tmp_path / "ckpt" / f"global_step{save_at}").is_dir()
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == f"global_step{save_at}"
    # the last stage's train-loss events are plotted at the call's global_samples, as the stock engine does
    with open(tmp_path / "reference" / "Train_Samples_train_loss.csv") as f:
        rows = list(csv.reader(f))[1:]
    fresh = [k for k, x in enumerate(last["reference"], start=1) if x["age"] == 0]
    assert len(fresh) == calls - 1  # the first call completes no micro-batch on the last of 4 stages (M = 1)
    assert [int(float(x)) for x, _ in rows] == [tbs * k for k in fresh]


BF16 = [] if compat.DS_BF16_GETS_UNFUSED else ["bf16"]


OVERLAPPED = ("torch.optim", "configured")  # fp32 without ZeRO: the overlapped data-parallel reduce (docs/engine.md)


@pytest.mark.process
def test_every_optimizer_path_passes_the_collective_check_and_resumes_an_open_window(tmp_path):
    """PP = 2 x DP = 2, a = 3, M = 2, check forced on: torch.optim, DeepSpeed's AdamW, BF16_Optimizer, ZeRO-1."""
    paths = ("torch.optim", "configured", *BF16, "zero1")
    results = run_world(counter_workers.every_path_checked_and_resumed, 4, str(tmp_path), paths,
                        env={ENV: "1"}, timeout=420)
    expected = {"torch.optim": "AdamW", "configured": "AdamW", "bf16": "BF16_Optimizer",
                "zero1": "DeepSpeedZeroOptimizer"}
    for path in paths:
        by_stage = {}
        for r in results:
            x = r[path]
            assert x["optimizer"] == expected[path]
            # the check ran once, at the first local step, and saw only this stage's groups: the DP reduce where it
            # runs at the step (bf16, ZeRO-1); the fp32 paths reduce under the window's last backward
            # ("overlap_reduce", on by default), so their step enters no collective at all
            check = x["check"]
            assert check["done"] and f"checked because {ENV}=1" in check["reason"]
            if path in OVERLAPPED:
                assert check["collectives"] == [], (path, check["collectives"])
            else:
                assert all(set(ranks) <= set(x["stage_ranks"]) for _, ranks in check["collectives"])
                assert any(len(ranks) == 2 for _, ranks in check["collectives"]), (path, check["collectives"])
            # 4 micro-batches before the save: one local step of 3, one micro-batch in the open window
            assert x["fill"] == 1
            if x["stage"] == 1:  # the last stage's own losses (averaged over its replicas)
                assert [y["loss"] for y in x["resumed"]] == [y["loss"] for y in x["after"]], path
            assert [(y["global_steps"], y["version"], y["lr_count"]) for y in x["resumed"]] == \
                [(y["global_steps"], y["version"], y["lr_count"]) for y in x["after"]]
            assert_same_weights(x["resumed_weights"], x["weights"], f"{path} resumed")
            by_stage.setdefault(x["stage"], []).append(x["weights"])
        for stage, (w0, w1) in by_stage.items():  # the replicas of a stage stayed identical
            assert_same_weights(w0, w1, f"{path} stage {stage} replicas")


@pytest.mark.process
@pytest.mark.skipif(compat.DS_BF16_GETS_UNFUSED, reason="bf16 is refused on this DeepSpeed version")
def test_a_cross_stage_collective_in_a_local_step_is_refused_with_one_line():
    started = time.monotonic()
    status, out, logs = run_world(counter_workers.unconfined_bf16_wrapper, 2, env={ENV: "1"}, timeout=120,
                                  expect_failure=True)
    assert time.monotonic() - started < 110
    assert set(status.values()) == {"error"}, status  # every rank ends with an exception: none hangs
    refusals = [o for o in out.values() if "CrossStageCollectiveError" in o]
    assert refusals, out
    line = next(l for l in refusals[0].splitlines() if l.startswith("ds_paci.core.seam.collective_guard"))
    assert "all_reduce on a group of ranks [0, 1] (stages [0, 1]) inside its first local step" in line
    assert f"checked because {ENV}=1" in line and "Fix: install a tested DeepSpeed (pip install 'deepspeed>=" in line


def test_when_the_collective_check_runs():
    from ds_paci.core.seam.collective_guard import ENV as env, check_reason
    assert env == ENV
    newest = compat.SUPPORTED[1]
    assert check_reason(newest, {}) is None  # the newest tested version: not checked
    newer = f"{newest.major}.{newest.minor}.{newest.micro + 1}"
    assert "newer than the newest version ds_paci was tested with" in check_reason(newer, {})
    assert "newer than" in check_reason(f"{newer}+cu124", {})
    assert check_reason(newer, {ENV: "0"}) is None  # turned off explicitly
    assert f"because {ENV}=1" in check_reason(newest, {ENV: "1"})
    assert check_reason("0.16.0", {}) is None
