"""Issue 29, "Script end": the runner drains when the script returns; an engine left with gradients never applied
warns once at exit with their number and the call to make; a finished run exits 0 under torchrun, every time."""

import json
import os
import re
import subprocess

import pytest

from ds_paci.core.engine.startup import _warn_open, not_applied
from ds_paci.core.program.stream import PACIStream
from harness import REPO_ROOT as ROOT, launch_command

USER_SCRIPT = os.path.join("tests", "scripts", "new_user_script.py")
RUNNER_SCRIPT = os.path.join("tests", "scripts", "ds_pipeline_script.py")
WARNING = re.compile(r"ds_paci: warning: the PACI engine of rank (\d) \(stage \d of 2, data-parallel rank 0\) ended "
                     r"with (\d+) micro-batches whose gradients were never applied \((\d+) in the open accumulation "
                     r"window, (\d+) still in flight\); call engine.drain\(\) after the last train_batch")


def _config(tmp_path, **paci):
    path = tmp_path / "paci.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
                                "steps_per_print": 10**6, "paci": paci,
                                "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}}}))
    return str(path)


def torchrun(args, timeout=240, tries=3):
    """One torchrun launch on a free port; relaunched on another port (at most ``tries`` launches in all) when the
    rendezvous store could not bind its port (EADDRINUSE: another process took the free port between its pick and
    torchrun's bind, before any rank ran), which says nothing about how a run ends."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", LOCAL_SIZE="2")
    for _ in range(tries):
        cmd = launch_command(2, *args, launcher="torchrun")
        run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        if run.returncode == 0 or "EADDRINUSE" not in run.stderr:
            return run
    return run


def test_the_warning_counts_what_a_real_stream_left_open(capsys):
    # a = 8, M = 4, 5 calls on stage 0 of 2: 20 forwards issued, 19 backwards, 16 stepped -> 3 + 1 never applied
    stream = PACIStream(2, 0, 8, 4)
    for _ in range(5):
        stream.advance(8)
    assert not_applied(stream) == (3, 1)
    _warn_open(stream, "the PACI engine of rank 0 (stage 0 of 2, data-parallel rank 0)")
    assert WARNING.search(capsys.readouterr().err).groups() == ("0", "4", "3", "1")
    stream.drain(close_window=True)
    _warn_open(stream, "x")  # drained: nothing to say
    assert capsys.readouterr().err == ""


@pytest.mark.process
def test_an_unmodified_script_warns_at_exit_with_the_micro_batches_never_applied(tmp_path):
    # the case: a = 8, 21 calls; the script never calls engine.drain()
    run = torchrun([USER_SCRIPT, "--steps", "21", _config(tmp_path, accumulation_window=8)])
    out = run.stdout + run.stderr
    assert run.returncode == 0 and "terminate called" not in out, out[-4000:]
    found = {m.group(1): m.groups()[1:] for m in WARNING.finditer(out)}
    assert len(WARNING.findall(out)) == 2 and set(found) == {"0", "1"}, out[-3000:]  # once per rank
    for stage in (0, 1):  # what each stage's stream leaves after 21 calls of 2M ticks
        stream = PACIStream(2, stage, 8, 4)
        for _ in range(21):
            stream.advance(8)
        window, flying = not_applied(stream)
        assert found[str(stage)] == (str(window + flying), str(window), str(flying)), (stage, found)
    assert sum(map(int, (found["0"][0], found["1"][0]))) > 0


@pytest.mark.process
def test_the_runner_drains_when_the_script_returns(tmp_path):
    run = torchrun(["-m", "ds_paci.run", RUNNER_SCRIPT, "--deepspeed_config", _config(tmp_path, accumulation_window=8),
                    "--out", str(tmp_path / "out"), "--steps", "21"])
    out = run.stdout + run.stderr
    assert run.returncode == 0 and "terminate called" not in out, out[-4000:]
    assert "gradients were never applied" not in out, out[-3000:]  # nothing left open
    drained = [x for x in out.splitlines() if x.startswith("ds_paci.run: the script returned; engine.drain()")]
    assert len(drained) == 1 and "on stage 0:" in drained[0], out[-3000:]  # one line, rank 0


@pytest.mark.process
def test_a_finished_run_exits_0_under_torchrun_every_time(tmp_path):
    """The issue saw 1 of 7 runs abort at exit (``terminate called without an active exception``, rc 1): these 8
    runs and the 2 launches of the tests above (each asserts the same end) find a 1-in-7 failure with probability
    1 - (6/7)^10 = 79% per suite run, 95% over two (each launch costs about 7 s of CPU)."""
    config = _config(tmp_path)
    failures = []
    for i in range(8):
        run = torchrun(["-m", "ds_paci.run", RUNNER_SCRIPT, "--deepspeed_config", config, "--out",
                        str(tmp_path / f"out{i}"), "--steps", "2", "--layers", "2", "--dim", "4"], timeout=120)
        out = run.stdout + run.stderr
        if run.returncode != 0 or "terminate called" in out:
            failures.append((i, run.returncode, out[-1500:]))
    assert not failures, failures
