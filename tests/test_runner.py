"""`python -m ds_paci.run`: an unmodified DeepSpeed script (tests/scripts/ds_pipeline_script.py) on the PACI engine."""

import json
import math
import os
import shutil
import subprocess

import pytest

from ds_paci.integrations.runner import split_argv
from harness import BIN, REPO_ROOT as ROOT, launch_command

SCRIPT = os.path.join("tests", "scripts", "ds_pipeline_script.py")


def _configs(tmp_path):
    base = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10**6,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}}}
    paci = dict(base, paci={"enabled": True})
    paths = {}
    for name, cfg in (("paci", paci), ("stock", base)):
        paths[name] = str(tmp_path / f"{name}.json")
        with open(paths[name], "w") as f:
            json.dump(cfg, f)
    return paths


def _run(cmd, tmp_path, extra_env=None):
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", **(extra_env or {}))
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    return [json.load(open(tmp_path / "out" / f"rank{r}.json")) for r in range(2)]


@pytest.mark.process
def test_unmodified_script_through_the_deepspeed_launcher(tmp_path):
    cfg = _configs(tmp_path)
    cmd = launch_command(2, "--module", "ds_paci.run", SCRIPT, "--deepspeed_config", cfg["paci"], "--then-config",
                         cfg["stock"], "--out", tmp_path / "out", "--steps", "6")
    ranks = _run(cmd, tmp_path)
    for rank, r in enumerate(ranks):
        # the script ran as `deepspeed script.py` runs it
        assert r["main"] == "__main__" and r["argv"][0] == SCRIPT and r["argv"][1] == f"--local_rank={rank}"
        assert r["path0"] == os.path.join(ROOT, "tests", "scripts")
        paci, stock = r["runs"]
        assert paci["engine"] == "PACIPipelineEngine"  # "paci": {"enabled": true} -> ds_paci.initialize
        assert stock["engine"] == "PipelineEngine"  # no "paci" section -> DeepSpeed's own initialize
    last = ranks[1]["runs"][0]["losses"]
    assert all(math.isfinite(x) for x in last) and last[-1] < last[0]  # it trained
    first = ranks[0]["runs"][0]["losses"]  # loss.item() on stage 0 worked on every call
    assert all(math.isnan(x) or x in last for x in first) and not math.isnan(first[-1])


@pytest.mark.process
@pytest.mark.skipif(shutil.which("torchrun", path=BIN) is None, reason="torchrun not installed")
def test_megatron_style_config_dict_under_torchrun(tmp_path):
    cfg = _configs(tmp_path)
    cmd = launch_command(2, "-m", "ds_paci.run", SCRIPT, "--deepspeed_config", cfg["paci"], "--megatron-style",
                         "--out", tmp_path / "out", "--steps", "4", launcher="torchrun")
    ranks = _run(cmd, tmp_path, {"LOCAL_SIZE": "2"})
    assert [r["runs"][0]["engine"] for r in ranks] == ["PACIPipelineEngine"] * 2
    assert ranks[1]["runs"][0]["losses"][-1] < ranks[1]["runs"][0]["losses"][0]


def test_argument_handling_matches_the_deepspeed_launcher():
    # the launcher puts --local_rank before the script when it runs a module; the script gets it after its path
    assert split_argv(["--local_rank=1", "s.py", "--x", "1"]) == (["--local_rank=1"], ("path", "s.py"), ["--x", "1"])
    assert split_argv(["s.py", "--local_rank=0"]) == ([], ("path", "s.py"), ["--local_rank=0"])
    assert split_argv(["-m", "pkg.mod", "a"]) == ([], ("module", "pkg.mod"), ["a"])
    with pytest.raises(SystemExit, match="usage"):
        split_argv([])


def test_router_is_recursion_safe_and_idempotent():
    import inspect

    import deepspeed

    from ds_paci.integrations import runner
    current = deepspeed.initialize
    original = inspect.unwrap(current)  # DeepSpeed's own (import ds_paci wraps it with the stock-engine warning)
    try:
        assert runner.install() is original and runner.install() is original
        assert deepspeed.initialize is not original and inspect.unwrap(deepspeed.initialize) is original
        assert not getattr(deepspeed.initialize.__wrapped__, "ds_paci_watch", False)  # the router replaces the warning
    finally:
        deepspeed.initialize = current
