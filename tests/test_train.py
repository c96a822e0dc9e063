"""The main job as a user runs it: `deepspeed --num_gpus 2 launch/train.py --deepspeed_config ...`."""

import json
import os
import subprocess

import pytest

from harness import REPO_ROOT as ROOT, launch_command

pytestmark = pytest.mark.process  # every test here starts processes (tests/conftest.py)


def launch(args, nproc=2, timeout=360):
    env = dict(os.environ, DS_ACCELERATOR="cpu", DS_PACI_CACHE_DIR=os.path.join(ROOT, ".cache", "ds_paci"))
    cmd = launch_command(nproc, "launch/train.py", *args)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def read_metrics(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def with_csv_monitor(tmp_path, config):
    cfg = json.load(open(os.path.join(ROOT, config)))
    cfg["csv_monitor"] = {"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "job"}
    path = tmp_path / os.path.basename(config)
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize("config,tie", [("configs/paci.json", False), ("configs/flush.json", False),
                                        ("configs/paci.json", True)], ids=["paci", "flush", "paci-tied"])
def test_main_job_trains_end_to_end(tmp_path, config, tie):
    metrics = tmp_path / "metrics.jsonl"
    cfg = with_csv_monitor(tmp_path, config)
    tie_flag = ["--tie-embeddings"] if tie else []
    run = launch(["--deepspeed_config", cfg, "--steps", "16", "--eval-interval", "8", "--log-interval", "4",
                  "--metrics", str(metrics), "--checkpoint-dir", str(tmp_path / "ckpt")] + tie_flag)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    assert "==== summary" in out and "validation loss" in out and "tokens/s" in out
    engine = "PACI (a=4)" if "paci" in config else "stock 1F1B-flush"
    assert engine in out
    records = read_metrics(metrics)
    evals = [r for r in records if r["event"] == "eval"]
    trains = [r for r in records if r["event"] == "train"]
    summary = [r for r in records if r["event"] == "summary"][-1]
    assert [e["step"] for e in evals] == [0, 8, 16]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 0.5, evals
    assert trains[-1]["loss"] < trains[0]["loss"], trains
    assert summary["steps"] == 16 and summary["tokens"] == 16 * 8 * 4 * 128
    assert set(summary["peak_rss_mb_per_stage"]) == {"0", "1"}  # JSON object keys
    if "paci" in config:
        assert "weight drift" in out
        drift = summary["drift_per_stage"]
        assert max(int(d) for d in drift[next(iter(drift))]) <= 1
        # the default job runs the look-ahead: stage 0 predicts one crossing forward per step except the first after each drain (steps 1 and 9)
        assert "PACI (a=4) + look-ahead" in out and "look-ahead       stage 0: 14 predicted forwards" in out
        assert summary["lookahead_per_stage"]["0"]["predicted_forwards"] == 14
    assert summary["tie_embeddings"] == tie and (", tied LM head" in out) == tie and (", untied LM head" in out) != tie
    if tie:  # both stages own the embedding; 16 windows exchanged, applied one window late
        assert "tied embedding   stages [0, 1]: gradients applied 1 window(s) late, 16 windows exchanged" in out
        assert [t["windows_exchanged"] for t in summary["tied"]] == [16, 16]
    # DeepSpeed's CSV monitor receives the training loss (from the last stage under PACI)
    loss_csv = tmp_path / "csv" / "job" / "Train_Samples_train_loss.csv"
    rows = loss_csv.read_text().splitlines()
    assert rows[0] == "step,train_loss" and len(rows) == 1 + 16
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "global_step16"

    resumed = launch(["--deepspeed_config", cfg, "--steps", "20", "--eval-interval", "0", "--metrics",
                      str(tmp_path / "resumed.jsonl"), "--checkpoint-dir", str(tmp_path / "ckpt"), "--resume"]
                     + tie_flag)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    assert "resumed from" in resumed.stdout and "at step 16" in resumed.stdout
    summary = [r for r in read_metrics(tmp_path / "resumed.jsonl") if r["event"] == "summary"][-1]
    assert summary["steps"] == 4


def _error_line(run):
    lines = [l for l in run.stderr.splitlines() + run.stdout.splitlines() if l.startswith("error: ")]
    assert len(lines) == 1, run.stdout[-2000:] + run.stderr[-2000:]
    return lines[0]


@pytest.mark.parametrize("case",
                         ["missing-data", "empty-data", "seq-len", "stages", "bad-json", "no-checkpoint", "tied-offload"])
def test_bad_input_gets_one_clear_line_and_nonzero_exit(tmp_path, case):
    args = ["--deepspeed_config", "configs/paci.json", "--steps", "2"]
    empty = tmp_path / "empty"
    empty.mkdir()
    if case == "missing-data":
        args += ["--data", str(tmp_path / "nope.txt")]
        needles = [str(tmp_path / "nope.txt"), "no such file", "pass an existing"]
    elif case == "empty-data":
        args += ["--data", str(empty)]
        needles = [str(empty), ".txt"]
    elif case == "seq-len":
        args += ["--seq-len", "2048"]
        needles = ["--seq-len 2048", "1024 positions", "lower --seq-len"]
    elif case == "stages":
        args += ["--stages", "3"]
        needles = ["--stages 3 does not divide the 2 launched processes"]
    elif case == "bad-json":
        bad = tmp_path / "bad.json"
        bad.write_text('{"train_micro_batch_size_per_gpu": 8,, }')
        args[1] = str(bad)
        needles = [str(bad), "not valid JSON"]
    elif case == "no-checkpoint":
        args += ["--checkpoint-dir", str(empty), "--resume"]
        needles = [str(empty), "holds no checkpoint"]
    else:
        offload = tmp_path / "offload.json"
        offload.write_text(json.dumps({**json.load(open(os.path.join(ROOT, "configs/paci.json"))),
                                       "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}))
        args[1] = str(offload)
        args += ["--tie-embeddings"]
        needles = ["--tie-embeddings", '"zero_optimization.offload_optimizer.device" = "cpu"', "untie the layers"]
    run = launch(args, timeout=90)
    assert run.returncode != 0
    line = _error_line(run)
    for needle in needles:
        assert needle in line, line
