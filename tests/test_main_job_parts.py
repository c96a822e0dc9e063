"""The main job's pieces without processes: the loop's cadence, the running account, the lines and the summary,
the checks that hand the config to core, the package's size limits, and launch/train.py as the thin entry point.

The job end to end (real engines in real processes) is tests/test_train.py; its bad inputs are in
tests/test_reliability.py and tests/test_train.py.
"""

import ast
import json
import math
import os
import subprocess
import sys
from argparse import Namespace

import pytest

from ds_paci.core.seam import compat
from ds_paci.core.config import PACIConfigError, check_accumulation_window
from ds_paci.mainjob import inputs
from ds_paci.mainjob.loop import Cadence
from ds_paci.mainjob.metrics import JobShape, TrainingMetrics, drift_text, progress_line
from ds_paci.mainjob.options import UsageError
from ds_paci.mainjob.summary import summary_lines, summary_record
from harness import REPO_ROOT as ROOT


# == the cadence =========================================================================================
def _after(cadence, what):
    return [s for s in range(1, cadence.steps + 1) if getattr(cadence, what)(s)]


def test_cadence_logs_every_interval_and_the_last_step():
    assert _after(Cadence(10, 4), "logs_after") == [4, 8, 10]
    assert _after(Cadence(8, 4), "logs_after") == [4, 8]
    assert _after(Cadence(3, 1), "logs_after") == [1, 2, 3]


def test_cadence_leaves_the_last_step_to_the_end_of_the_run():
    # the end of the run validates and saves once (finish); the loop never does it a second time at --steps
    assert _after(Cadence(10, 1, eval_interval=5), "evaluates_after") == [5]
    assert _after(Cadence(10, 1, eval_interval=3), "evaluates_after") == [3, 6, 9]
    assert _after(Cadence(10, 1, eval_interval=0), "evaluates_after") == []
    assert _after(Cadence(10, 1, save_interval=4, saves=True), "saves_after") == [4, 8]
    assert _after(Cadence(10, 1, save_interval=5, saves=True), "saves_after") == [5]
    assert _after(Cadence(10, 1, save_interval=0, saves=True), "saves_after") == []
    assert _after(Cadence(10, 1, save_interval=4, saves=False), "saves_after") == []  # no --checkpoint-dir


def test_cadence_from_the_flags():
    args = Namespace(steps=12, log_interval=5, eval_interval=6, save_interval=4, checkpoint_dir="ckpt")
    assert Cadence.from_args(args) == Cadence(12, 5, 6, 4, True)
    assert not Cadence.from_args(Namespace(**{**vars(args), "checkpoint_dir": None})).saves


# == the running account ===================================================================================
class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_metrics_keep_the_last_ten_finite_losses_and_count_own_nonfinite_steps():
    clock = Clock()
    m = TrainingMetrics(tokens_per_step=1000, clock=clock)
    assert math.isnan(m.train_loss())
    m.observe(1, None, own_loss=True)  # no loss known yet (a first stage's first call)
    assert m.last_loss is None and m.recent_losses == []
    for step in range(2, 14):
        m.observe(step, float(step), own_loss=True)
    assert m.recent_losses == [float(s) for s in range(4, 14)] and m.train_loss() == sum(range(4, 14)) / 10
    m.observe(14, float("nan"), own_loss=False)  # a stale NaN another stage passed on is not this step's
    m.observe(15, float("inf"), own_loss=True)
    assert m.nonfinite_steps == [15] and m.window_nonfinite == [15]
    assert math.isinf(m.last_loss) and len(m.recent_losses) == 10 and 15.0 not in m.recent_losses
    m.keep(2.5)  # the drain's tail
    assert m.recent_losses[-1] == 2.5 and len(m.recent_losses) == 10


def test_metrics_throughput_window():
    clock = Clock()
    m = TrainingMetrics(tokens_per_step=1000, clock=clock)
    m.start_window()
    for step in (1, 2, 3, 4):
        m.observe(step, 1.0, own_loss=True)
    m.observe(5, float("nan"), own_loss=True)
    clock.now += 2.0
    tps, eta, nonfinite = m.close_window(steps_left=10)
    assert tps == 5 * 1000 / 2.0 and eta == 10 * 2.0 / 5 and nonfinite == [5]
    assert m.window_nonfinite == [] and m.nonfinite_steps == [5]
    m.start_window()
    assert m.window_steps == 0 and m.window_start == clock.now


# == the lines =============================================================================================
def test_progress_line():
    line = progress_line(3, 6, float("nan"), 1234.4, 1.5e-3, "", [3], 0, 75)
    assert line == "step      3/6 | loss nan | 1,234 tokens/s | lr 1.50e-03 | non-finite loss at step 3 | eta 1m15s"
    line = progress_line(6, 6, 4.25, 10.0, 1e-4, " | drift 1 (bound 1, all stages as of step 0)", [], 1, 0)
    assert line == ("step      6/6 | loss 4.2500 | 10 tokens/s | lr 1.00e-04 | drift 1 (bound 1, all stages as of step "
                    "0) | skipped steps 1 (non-finite gradients; this stage) | eta 0s")
    assert progress_line(1, 2, None, 0.0, 1.0, "", [], 0, 5).startswith("step      1/2 | loss    n/a |")


def test_drift_text_takes_the_largest_over_every_rank():
    stats = [{"max_drift": 0, "drift_bound": 1}, {"max_drift": 2, "drift_bound": 3}, {}]
    assert drift_text(stats, 8) == " | drift 2 (bound 3, all stages at step 8)"
    assert drift_text(stats, 8, 8) == " | drift 2 (bound 3, all stages at step 8)"
    # older than the line: labelled with where the figures come from (issue 29 item 3)
    assert drift_text(stats, 8, 12) == " | drift 2 (bound 3, all stages at the validation of step 8)"


def _stats(lookahead=True, tied=False, skipped=0):
    out = []
    for stage in (0, 1):
        for dp in (0, 1):
            s = {"stage": stage, "dp": dp, "rss_mb": 300.04 + stage, "drift_histogram": {"0": 3, "1": 5},
                 "drift_bound": 1, "skipped_steps": skipped if stage == 0 else 0,
                 "lookahead": ({"enabled": True, "predicted_forwards": 14 - stage, "prediction_error": None if stage
                                else 0.123, "seconds": 0.5} if lookahead else {"enabled": False})}
            if tied:
                s["tied"] = {"owner": True, "owner_stages": {"embed": [0, 1]}, "lag_windows": 1,
                             "windows_exchanged": 16, "max_wait_seconds": 0.001 * (1 + stage)}
            out.append(s)
    return out


def _account(nonfinite=()):
    m = TrainingMetrics(tokens_per_step=4096)
    for step, loss in enumerate([5.0, 4.0, 3.0], 1):
        m.observe(step, loss, own_loss=True)
    m.nonfinite_steps = list(nonfinite)
    m.train_seconds, m.eval_seconds = 8.0, 2.0
    return m


def test_summary_of_a_paci_run():
    shape = JobShape("PACI (a=4) + look-ahead", True, 2, 2, start_step=4, steps=16, tokens_per_step=4096,
                     tie_embeddings=True)
    stats = _stats(tied=True, skipped=1)
    summary = summary_record(shape, _account(nonfinite=[7]), 6.5, 4.25, stats)
    assert list(summary) == ["engine", "stages", "data_parallel", "steps", "tokens", "train_seconds", "eval_seconds",
                             "tokens_per_s", "final_train_loss", "first_val_loss", "final_val_loss",
                             "peak_rss_mb_per_stage", "drift_per_stage", "nonfinite_loss_steps",
                             "skipped_steps_per_stage", "tie_embeddings", "tied", "lookahead_per_stage"]
    assert summary["steps"] == 12 and summary["tokens"] == 12 * 4096 and summary["tokens_per_s"] == 12 * 4096 / 8.0
    assert summary["final_train_loss"] == 4.0 and summary["peak_rss_mb_per_stage"] == {0: 300.0, 1: 301.0}
    assert summary["skipped_steps_per_stage"] == {0: 1, 1: 0} and len(summary["tied"]) == 4
    json.dumps(summary)  # the metrics file's record
    text = summary_lines(shape, summary, stats, 3, "runs/paci/metrics.jsonl")
    assert text.splitlines() == [
        "==== summary: PACI (a=4) + look-ahead, 2 stages x 2 data-parallel ====",
        "steps            12 (49,152 tokens)",
        "wall time        10.0 s (training 8.0 s, evaluation 2.0 s)",
        "throughput       6,144 tokens/s (training time)",
        "train loss       4.0000 (mean of the last 3 batches)",
        "validation loss  6.5000 at step 4 -> 4.2500 at step 16",
        "peak memory      stage 0: 300 MB | stage 1: 301 MB (RSS)",
        "weight drift     stage 0: {'0': 3, '1': 5} (bound 1) | stage 1: {'0': 3, '1': 5} (bound 1)",
        "look-ahead       stage 0: 14 predicted forwards, error 0.12, 0.50 s | stage 1: 13 predicted forwards, "
        "error n/a, 0.50 s",
        "non-finite       loss at step(s) [7]; skipped local steps per stage {0: 1, 1: 0}",
        "tied embedding   stages [0, 1]: gradients applied 1 window(s) late, 16 windows exchanged, longest wait in a "
        "step 2.00 ms",
        "metrics          runs/paci/metrics.jsonl",
    ]


def test_summary_of_a_stock_run_has_no_paci_lines():
    shape = JobShape("stock 1F1B-flush", False, 2, 1, start_step=0, steps=3, tokens_per_step=4096,
                     tie_embeddings=False)
    stats = [{"stage": 0, "dp": 0, "rss_mb": 200.0}, {"stage": 1, "dp": 0, "rss_mb": 210.0}]
    summary = summary_record(shape, _account(), 7.0, 5.0, stats)
    assert [summary[k] for k in ("drift_per_stage", "skipped_steps_per_stage", "tied", "lookahead_per_stage")] == \
        [None] * 4
    lines = summary_lines(shape, summary, stats, 3, "m.jsonl").splitlines()
    assert len(lines) == 8 and lines[0] == "==== summary: stock 1F1B-flush, 2 stages x 1 data-parallel ===="
    assert not any(l.startswith(("weight drift", "look-ahead", "non-finite", "tied")) for l in lines)
    paci = JobShape("PACI (a=4)", True, 2, 2, 0, 3, 4096, False)
    off = summary_lines(paci, summary_record(paci, _account(), 7.0, 5.0, _stats(lookahead=False)),
                        _stats(lookahead=False), 3, "m.jsonl")
    assert "look-ahead       stage 0: off | stage 1: off" in off and "non-finite" not in off


# == the config goes to core's checks =======================================================================
def _paci_config(**changes):
    cfg = json.loads((ROOT / "configs" / "paci.json").read_text())
    cfg.update(changes)
    return cfg


def test_check_config_says_what_core_says():
    cfg = _paci_config()
    cfg["paci"] = dict(cfg["paci"], accumulation_window=10**9)
    with pytest.raises(PACIConfigError) as core:
        check_accumulation_window(10**9, cfg["gradient_accumulation_steps"])
    with pytest.raises(UsageError) as job:
        inputs.check_config(cfg, 2, 2, "configs/paci.json")
    assert str(job.value) == str(core.value)


def test_check_config_asks_core_what_the_installed_deepspeed_refuses(monkeypatch):
    reason = '"bf16.enabled" = true cannot be used with "paci" on this deepspeed'
    monkeypatch.setattr(compat, "refusal", lambda ds_config: reason if ds_config.get("bf16") else None)
    inputs.check_config(_paci_config(), 2, 2, "configs/paci.json")
    with pytest.raises(UsageError, match="cannot be used with"):
        inputs.check_config(_paci_config(bf16={"enabled": True}), 2, 2, "configs/paci.json")
    stock = _paci_config(bf16={"enabled": True})
    stock.pop("paci")
    inputs.check_config(stock, 2, 2, "configs/flush.json")  # the stock engine: not PACI's refusal


# == the package's size and the entry point ================================================================
def test_no_module_over_500_lines_and_no_function_over_80():
    big = []
    for path in sorted((ROOT / "ds_paci" / "mainjob").glob("*.py")) + [ROOT / "launch" / "train.py"]:
        text = path.read_text()
        if len(text.splitlines()) > 500:
            big.append(f"{path.name}: {len(text.splitlines())} lines")
        big += [f"{path.name}:{f.name}: {f.end_lineno - f.lineno + 1} lines" for f in ast.walk(ast.parse(text))
                if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.end_lineno - f.lineno + 1 > 80]
    assert not big, big


@pytest.mark.process
def test_launch_train_is_the_entry_point():
    env = dict(os.environ, WORLD_SIZE="2", RANK="0")
    run = subprocess.run([sys.executable, "launch/train.py", "--deepspeed_config", "configs/paci.json", "--steps",
                          "0"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr.strip().splitlines()[-1] == ("error: --steps 0 is not allowed; use an integer >= 1 (train_batch "
                                                   "calls to run)")
    helped = subprocess.run([sys.executable, "launch/train.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    # (importing the package imports DeepSpeed, whose accelerator line may come first)
    assert helped.returncode == 0 and any(l.startswith("usage: train.py") for l in helped.stdout.splitlines())
    assert "GPT-2 pipeline training on a real text corpus" in helped.stdout and "--stop-timeout" in helped.stdout
