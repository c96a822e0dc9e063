"""Issue 29, "Never silent": what a new user meets first. PACI on or off is said in one line on rank 0, a "paci"
section turns PACI on unless it says "enabled": false, a misspelt section is refused, a "paci" config handed to
deepspeed.initialize warns, the drift advice, the per-stage telemetry line. Real engines in real processes (torchrun,
gloo) for everything about the engine; the config rules in process."""

import json
import os
import subprocess

import pytest

from ds_paci.core.config import PACIConfig, PACIConfigError, check_config, check_section_key, parse_paci_section
from ds_paci.core.engine.startup import startup_lines
from harness import REPO_ROOT as ROOT, launch_command

USER_SCRIPT = os.path.join("tests", "scripts", "new_user_script.py")
RUNNER_SCRIPT = os.path.join("tests", "scripts", "ds_pipeline_script.py")
BASE = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}}}


def _config(tmp_path, name, **extra):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(dict(BASE, **extra)))
    return str(path)


def torchrun(args, expect_rc=0, nproc=2):
    """``torchrun --nproc_per_node NPROC ARGS``; returns its stdout + stderr (asserting the exit code)."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", LOCAL_SIZE=str(nproc))
    cmd = launch_command(nproc, *args, launcher="torchrun")
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    out = run.stdout + run.stderr
    assert (run.returncode == 0) == (expect_rc == 0), out[-4000:]
    return out


def lines_with(out, prefix):
    return [line for line in out.splitlines() if line.startswith(prefix)]


# -- the config rules (in process) ----------------------------------------------------------------------------------
def test_a_paci_section_turns_paci_on_unless_it_says_enabled_false():
    assert parse_paci_section(None) == PACIConfig() and not PACIConfig().enabled  # no section: the stock engine
    assert parse_paci_section({}).enabled  # the section alone: PACI
    assert parse_paci_section({"accumulation_window": 4}).enabled
    assert not parse_paci_section({"enabled": False}).enabled
    assert check_config(dict(BASE, paci={})).enabled and not check_config(dict(BASE)).enabled


@pytest.mark.parametrize("key", ["PACI", "Paci", "paci_config", "ds_paci", "pacI"])
def test_a_section_key_deepspeed_would_ignore_is_refused_in_one_line(key):
    for check in (check_section_key, check_config):
        with pytest.raises(PACIConfigError) as e:
            check(dict(BASE, **{key: {"enabled": True}}))
        text = str(e.value)
        assert "\n" not in text and repr(key) in text and 'rename it to "paci"' in text, text
    check_section_key(dict(BASE, paci={}))  # the right key passes


def test_ds_paci_initialize_refuses_a_misspelt_section_before_any_engine():
    import ds_paci
    with pytest.raises(PACIConfigError, match="'PACI'.*rename it"):
        ds_paci.initialize(model=None, config=dict(BASE, PACI={"enabled": True}))


def test_start_up_line_and_the_drift_advice():
    # the issue's case: P = 4, M = 2, window 2 -> stage 0 drift up to 2, which the look-ahead does not follow
    paci = parse_paci_section({"accumulation_window": 2})
    lines = startup_lines(paci, 4, 2, [2, 2, 2, 2], True, "none", "deepspeed X")
    assert lines[0] == ("ds_paci: PACI on (async), 4 stages, M = 2 micro-batches per train_batch: accumulation window "
                        "per stage [2, 2, 2, 2], drift bound per stage [2, 1, 1, 0], look-ahead on (forwards that cross "
                        "a local step run on predicted weights); gradient clipping none; deepspeed X")
    assert len(lines) == 2 and "drift bound [2] > 1 on stage(s) [0]" in lines[1]
    # per stage after its warm start (issue 30): late stages step every M, drift <= 1
    assert "would choose windows [3, 2, 2, 2] after its synchronous warm start" in lines[1]
    tied = startup_lines(paci, 4, 2, [2] * 4, True, "none", "d", tied=True)
    assert "would choose windows [3, 3, 3, 3]" in tied[1]
    # no advice where the look-ahead is off, where "auto" already keeps drift <= 1, or in sync mode
    assert len(startup_lines(paci, 4, 2, [2] * 4, None, "none", "d")) == 1
    assert "look-ahead off (\"paci.lookahead\": false)" in startup_lines(paci, 4, 2, [2] * 4, None, "none", "d")[0]
    assert len(startup_lines(paci, 4, 2, [3, 2, 2, 2], True, "none", "d")) == 1
    sync = parse_paci_section({"drain_every_batch": True})
    only = startup_lines(sync, 4, 2, [2] * 4, None, "x", "d")
    assert len(only) == 1 and only[0].startswith("ds_paci: PACI on (sync)") and "[0, 0, 0, 0]" in only[0]


# -- real engines in real processes -------------------------------------------------------------------------------
@pytest.mark.process
def test_ds_paci_initialize_says_on_or_off_once_on_rank_0(tmp_path):
    on = _config(tmp_path, "on", paci={})
    none = _config(tmp_path, "none")
    off = _config(tmp_path, "off", paci={"enabled": False})
    out = torchrun([USER_SCRIPT, on, none, off])
    assert len(lines_with(out, "ds_paci: PACI on (async), 2 stages, M = 2")) == 1, out[-3000:]
    [on_line] = lines_with(out, "ds_paci: PACI on")
    assert "accumulation window per stage [2, 2], drift bound per stage [1, 0], look-ahead on" in on_line
    assert "gradient clipping none" in on_line and "deepspeed 0." in on_line
    assert lines_with(out, "ds_paci: PACI off: ") == [
        'ds_paci: PACI off: the DeepSpeed config has no "paci" section: DeepSpeed\'s stock engine (add "paci": {} to '
        'the config to run PACI)',
        'ds_paci: PACI off: the "paci" section says "enabled": false (remove "enabled": false to run PACI)']
    for rank in (0, 1):
        assert f"rank {rank}: engine 0 PACIPipelineEngine" in out  # "paci": {} without "enabled": PACI
        assert f"rank {rank}: engine 1 PipelineEngine" in out and f"rank {rank}: engine 2 PipelineEngine" in out
    # the per-stage telemetry line every steps_per_print (2) calls, visible, from each stage's own counters
    stage_lines = lines_with(out, "ds_paci: train_batch 2 stage ")
    assert sorted(x.split(" rank ")[0] for x in stage_lines) == ["ds_paci: train_batch 2 stage 0/2",
                                                                  "ds_paci: train_batch 2 stage 1/2"], out[-3000:]
    assert all("drift histogram {" in x and "look-ahead on, " in x for x in stage_lines), stage_lines
    assert "deepspeed.initialize builds" not in out  # ds_paci decided: no stock-engine warning


@pytest.mark.process
def test_the_engine_gives_the_drift_advice_at_start_up(tmp_path):
    # the issue's configuration: P = 4, M = 2, window 2: stage 0 drifts up to 2 versions, the look-ahead predicts one
    config = _config(tmp_path, "p4", paci={"accumulation_window": 2})
    out = torchrun([USER_SCRIPT, "--stages", "4", "--steps", "1", config], nproc=4)
    [on] = lines_with(out, "ds_paci: PACI on (async), 4 stages, M = 2")
    assert "accumulation window per stage [2, 2, 2, 2], drift bound per stage [2, 1, 1, 0], look-ahead on" in on
    [advice] = lines_with(out, "ds_paci: advice: ")
    assert "stage(s) [0]" in advice and "would choose windows [3, 2, 2, 2]" in advice, advice


@pytest.mark.process
def test_a_paci_config_reaching_deepspeed_initialize_warns_once(tmp_path):
    on = _config(tmp_path, "on", paci={})
    off = _config(tmp_path, "off", paci={"enabled": False})
    out = torchrun([USER_SCRIPT, "--init", "deepspeed", on, on, off])
    warnings = lines_with(out, "ds_paci: warning: the DeepSpeed config has a \"paci\" section")
    assert len(warnings) == 1, out[-3000:]  # once, on rank 0, for two such engines
    assert "ds_paci.initialize(...)" in warnings[0] and "python -m ds_paci.run" in warnings[0]
    assert "deepspeed --module ds_paci.run" in warnings[0]
    assert "rank 0: engine 0 PipelineEngine" in out and "ds_paci: PACI on" not in out


@pytest.mark.process
def test_the_runner_says_on_or_off_once_on_rank_0(tmp_path):
    on = _config(tmp_path, "on", paci={})
    none = _config(tmp_path, "none")
    out = torchrun(["-m", "ds_paci.run", RUNNER_SCRIPT, "--deepspeed_config", on, "--then-config", none,
                    "--out", str(tmp_path / "out"), "--steps", "3"])
    assert len(lines_with(out, "ds_paci: PACI on (async), 2 stages")) == 1, out[-3000:]
    assert len(lines_with(out, "ds_paci: PACI off: the DeepSpeed config has no \"paci\" section")) == 1
    ranks = [json.load(open(tmp_path / "out" / f"rank{r}.json")) for r in range(2)]
    assert [r["runs"][0]["engine"] for r in ranks] == ["PACIPipelineEngine"] * 2  # "paci": {} through the router
    assert [r["runs"][1]["engine"] for r in ranks] == ["PipelineEngine"] * 2


@pytest.mark.process
def test_the_runner_refuses_a_misspelt_section(tmp_path):
    upper = _config(tmp_path, "upper", PACI={"enabled": True})
    out = torchrun(["-m", "ds_paci.run", RUNNER_SCRIPT, "--deepspeed_config", upper, "--out", str(tmp_path / "o"),
                    "--steps", "1"], expect_rc=1)
    assert "PACIConfigError: the DeepSpeed config has a top-level key 'PACI'" in out, out[-3000:]
