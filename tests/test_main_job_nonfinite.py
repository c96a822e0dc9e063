"""The main job with one NaN micro-batch (issue 10): the poisoned step is skipped on both stages, never applied."""

import json
import math
import os
import subprocess

import pytest

pytestmark = pytest.mark.process  # every test here starts processes (tests/conftest.py)


def test_main_job_skips_a_nan_micro_batch_and_says_so(tmp_path, repo_root, launch_command):
    metrics = tmp_path / "metrics.jsonl"
    env = dict(os.environ, DS_ACCELERATOR="cpu", DS_PACI_CACHE_DIR=os.path.join(repo_root, ".cache", "ds_paci"))
    # configs/paci.json: M = a = 4, so micro-batch 9 lies in step 3 on both stages
    cmd = launch_command(2, "tests/scripts/nan_job.py", "--nan-at", "9", "--deepspeed_config", "configs/paci.json",
                         "--steps", "6", "--eval-interval", "0", "--eval-batches", "1", "--log-interval", "3",
                         "--metrics", metrics, "--checkpoint-dir", tmp_path / "ckpt")
    run = subprocess.run(cmd, cwd=repo_root, env=env, capture_output=True, text=True, timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    progress = [l for l in run.stdout.splitlines() if l.startswith("step      3/6 | loss")]
    assert progress and "loss nan" in progress[0] and "non-finite loss at step 3" in progress[0], out[-3000:]
    # the last stage closes that window in the next call; from then on the progress line counts the skip
    later = [l for l in run.stdout.splitlines() if l.startswith("step      6/6 | loss")]
    assert later and "skipped steps 1" in later[0] and "loss nan" not in later[0], out[-3000:]
    records = [json.loads(l) for l in open(metrics)]
    summary = [r for r in records if r["event"] == "summary"][-1]
    assert summary["nonfinite_loss_steps"] == [3]
    assert summary["skipped_steps_per_stage"] == {"0": 1, "1": 1}
    assert math.isfinite(summary["final_val_loss"]) and summary["final_val_loss"] < summary["first_val_loss"]
    assert math.isfinite(summary["final_train_loss"])
    # the final checkpoint was written: the weights are finite (a save from non-finite weights is refused)
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "global_step6"
