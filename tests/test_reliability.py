"""The fault suite: each fault is injected for real and its outcome asserted (table: docs/reliability.md).

Checkpoint faults run real DeepSpeed engines over gloo (tiny MLP pipelines); stop faults
run the main job as users do (`deepspeed --num_gpus 2 launch/train.py ...`, a tiny GPT-2 on
a small corpus) and signal its runner, launcher or ranks; bad inputs call the main job's
``main()`` in this process and check that it ends before any process group exists.
"""

import io
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from contextlib import redirect_stderr, redirect_stdout

import pytest
import torch

import fault_workers
import reliability_cases
from harness import REPO_ROOT as ROOT, run_world
from ds_paci.core.checkpoint import atomic as checkpoint
from ds_paci.core.health import lifecycle
from ds_paci.core.config import PACIConfigError, check_accumulation_window, parse_paci_section
from ds_paci.tools.studies.savekill import TINY, Run, kill_during_save, small_corpus, step_of

pytestmark = pytest.mark.xdist_group("reliability")  # one worker: the checkpoint tests share the protocol fixture's world


# == checkpoints ===================================================================================
@pytest.fixture(scope="module")
def protocol(tmp_path_factory):
    """One 2-rank world: saves observed at every disk step, broken copies, stock-engine interplay, stop agreement."""
    root = tmp_path_factory.mktemp("protocol")
    return run_world(fault_workers.save_protocol, 2, str(root), timeout=300)


@pytest.mark.process
def test_every_disk_step_of_a_save_leaves_latest_complete(protocol):
    kinds = {e for r in protocol for e, _ in r["events"]}
    assert kinds == {"write", "written", "manifest", "rename", "link", "latest"}, kinds
    snaps = protocol[0]["snapshots"]
    assert snaps == protocol[1]["snapshots"]  # both ranks loaded every copy alike
    # one copy per disk step of both ranks, plus a cut-file copy per written file
    n_events = sum(len(r["events"]) for r in protocol)
    n_written = sum(1 for r in protocol for e, _ in r["events"] if e == "written")
    assert len(snaps) == n_events + n_written >= 30
    for name, s in snaps.items():
        assert s["status"] == "complete", (name, s)
        assert s["which"] in ("A", "B", "B2") and s["weights"] == s["which"], (name, s)
    # a kill before the new checkpoint is committed keeps the old one; after, the new one
    assert snaps["r0-06-latest"]["which"] == "A" and snaps["r1-07-written-cut"]["which"] == "B"
    # during a same-tag re-save, `latest` names the complete staging folder while <tag> is swapped
    swap = [s for n, s in snaps.items() if n.startswith("r0-") and "link" in n]
    assert swap and all(s["latest"].startswith(checkpoint.HIDDEN_PREFIX + "staging.") and s["which"] == "B2"
                        for s in swap)


@pytest.mark.process
def test_deepspeed_layout_and_stock_engine_interplay(protocol):
    out = protocol[0]
    assert out["files"] == ["A", "B", "latest"]  # no staging leftovers
    files = out["manifest"]["files"]
    assert set(files) == {"layer_00-model_states.pt", "layer_01-model_states.pt", "mp_rank_00_model_states.pt",
                          "mp_rank_01_model_states.pt"}
    assert all(size > 0 for size in files.values()) and out["manifest"]["tag"] == "B"
    for r in protocol:  # DeepSpeed's own engine and API read the PACI checkpoint
        assert r["stock_latest"] == ("B2", "B2") and r["stock_tag"] == ("A", "A")
        assert r["stock_save"] == ("global_step2", "complete") and r["stock_reload"] == ("stock", "stock")


@pytest.mark.process
def test_partial_checkpoint_is_refused_with_one_line(protocol):
    for r in protocol:
        for case in ("truncated", "missing", "absent"):
            assert r[case] is not None and "\n" not in r[case], (case, r[case])
        assert "broken/B/mp_rank_01_model_states.pt is truncated (100 of" in r["truncated"]
        assert "broken/A/layer_00-model_states.pt is missing" in r["missing"]
        assert "broken/C does not exist" in r["absent"]
        for case in ("truncated", "missing", "absent"):
            assert "no complete checkpoint is in this folder" in r[case]
        assert r["legacy"] == "B2"


@pytest.mark.process
def test_stop_agreement_bound(protocol):
    for r in protocol:
        assert r["agreement"] == {"boundary": 3, "code": signal.SIGTERM, "rank": 1}


def _write_ckpt(folder, tag, files, saved_at, cut=None, manifest=True):
    os.makedirs(os.path.join(folder, tag))
    sizes = {}
    for name, size in files.items():
        with open(os.path.join(folder, tag, name), "wb") as f:
            f.write(b"x" * (size if name != cut else size // 2))
        sizes[name] = size
    if manifest:
        with open(os.path.join(folder, tag, checkpoint.MANIFEST), "w") as f:
            json.dump({"format": checkpoint.MANIFEST_FORMAT, "tag": tag, "saved_at": saved_at, "files": sizes}, f)


def test_resume_plan_falls_back_to_the_last_complete_checkpoint(tmp_path):
    files = {"mp_rank_00_model_states.pt": 40, "layer_00-model_states.pt": 30}
    d = str(tmp_path / "ckpt")
    _write_ckpt(d, "global_step2", files, 1.0)
    _write_ckpt(d, "global_step4", files, 2.0)
    _write_ckpt(d, "global_step6", files, 3.0, cut="layer_00-model_states.pt")
    with open(os.path.join(d, "latest"), "w") as f:
        f.write("global_step4")
    assert checkpoint.resume_tag(d) == ("global_step4", None)
    with open(os.path.join(d, "latest"), "w") as f:
        f.write("global_step6")
    tag, note = checkpoint.resume_tag(d)
    assert tag == "global_step4" and "'latest' names 'global_step6'" in note and "truncated (15 of 30 bytes)" in note
    assert "resuming from the last complete checkpoint 'global_step4'" in note
    with pytest.raises(checkpoint.CheckpointError, match="the last complete checkpoint is 'global_step4'"):
        checkpoint.resolve_tag(d)
    os.remove(os.path.join(d, "latest"))
    assert checkpoint.resume_tag(d)[0] == "global_step4"
    # a manifest-less checkpoint is loaded unverified, and says so
    _write_ckpt(d, "legacy", files, 0.0, manifest=False)
    with open(os.path.join(d, "latest"), "w") as f:
        f.write("legacy")
    tag, note = checkpoint.resume_tag(d)
    assert tag == "legacy" and "unverified" in note
    # nothing complete
    e = str(tmp_path / "none")
    _write_ckpt(e, "global_step6", files, 3.0, cut="mp_rank_00_model_states.pt")
    with open(os.path.join(e, "latest"), "w") as f:
        f.write("global_step6")
    with pytest.raises(checkpoint.CheckpointError, match="holds no complete checkpoint"):
        checkpoint.resume_tag(e)


@pytest.mark.process
def test_a_rank_killed_during_a_save_leaves_a_resumable_checkpoint(tmp_path):
    # (victim, disk step, which occurrence, cut the file first, re-save of the same tag) -> content resumed
    scenarios = [
        ((1, "written", 2, True, False), "A"),  # stage 1 dies while writing its model-states file of save B
        ((0, "rename", 1, False, False), "A"),  # rank 0 dies with B complete in staging, not yet renamed
        ((0, "rename", 2, False, True), "A2"),  # rank 0 dies mid-swap of a same-tag re-save: latest names staging
    ]
    folders = []
    for i, (args, _) in enumerate(scenarios):
        root = str(tmp_path / f"kill{i}")
        status, out, logs = run_world(fault_workers.killed_during_save, 2, root, *args, timeout=150,
                                      expect_failure=True)
        victim = args[0]
        assert status[victim] == f"exit {-signal.SIGKILL}", status
        assert status[1 - victim] in ("error", "killed"), status  # the survivor fails fast, no hang
        folders.append(os.path.join(root, "ckpt"))
    resumed = run_world(fault_workers.resume_each, 2, folders, timeout=180)
    for folder, (args, which) in zip(folders, scenarios):
        for r in resumed:
            assert r[folder]["which"] == which and r[folder]["trained"], (args, r[folder])
            assert r[folder]["note"] is None  # `latest` itself named a complete checkpoint


# == stops ==========================================================================================
def _main_job_args(tmp_path, *extra):
    data = small_corpus(str(tmp_path.parent / "corpus.txt"))
    return TINY + ["--data", data, "--metrics", str(tmp_path / "metrics.jsonl"), "--log-interval", "5"] + list(extra)


def _stop_step(run):
    line = run.wait_for(r"stopped at step \d+", timeout=30)
    assert line, run.output[-3000:]
    return int(line.split("stopped at step ")[1].split()[0])


@pytest.mark.process
def test_stop_signal_to_one_rank_saves_and_resume_continues(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    # 1. SIGTERM to stage 1 only: every rank stops after the same step and saves there (no --save-interval)
    run = Run(_main_job_args(tmp_path, "--checkpoint-dir", ckpt, "--steps", "100000"))
    try:
        assert run.wait_for(r"step +10/", timeout=240), run.output[-3000:]
        run.send("rank1", signal.SIGTERM)
        gone = run.wait_gone(timeout=30, who=run.ranks())
        code = run.finish(timeout=30)
    finally:
        run.kill_all()
    out = run.output
    assert gone is not None and gone < 10, (gone, out[-3000:])
    assert code == 128 + signal.SIGTERM, out[-3000:]
    step = _stop_step(run)
    assert f"stopping: SIGTERM on rank 1; every rank stops after step {step}" in out
    assert "[ds_paci] rank 1: SIGTERM received" in out and "Traceback" not in out
    tag = checkpoint.read_latest(ckpt)
    assert checkpoint.verify(os.path.join(ckpt, tag))[0] == "complete" and step_of(ckpt, tag) == step

    # 2. resume from it; SIGKILL a random rank at a random moment of a save (--save-interval 1)
    run = Run(_main_job_args(tmp_path, "--checkpoint-dir", ckpt, "--steps", "100000", "--save-interval", "1",
                             "--resume"))
    try:
        line = run.wait_for(r"resumed from|error:", timeout=240)
        assert line and f"at step {step}" in line, run.output[-3000:]
        assert run.wait_for(r"checkpoint saved", timeout=60), run.output[-3000:]
        kill = kill_during_save(run, ckpt, random.Random(7), max_delay=0.03)
        run.finish(timeout=30)
    finally:
        run.kill_all()
    assert kill is not None and kill["ranks_gone_s"] is not None and kill["ranks_gone_s"] < 10, kill
    assert kill["all_gone_s"] is not None  # the launcher ends too
    tag, note = checkpoint.resume_tag(ckpt)
    assert note is None and checkpoint.verify(os.path.join(ckpt, tag))[0] == "complete"
    killed_at = step_of(ckpt, tag)
    assert killed_at > step

    # 3. the next --resume continues from what `latest` names and runs to the end
    run = Run(_main_job_args(tmp_path, "--checkpoint-dir", ckpt, "--steps", str(killed_at + 3), "--resume"))
    try:
        code = run.finish(timeout=300)
    finally:
        run.kill_all()
    assert code == 0, run.output[-3000:]
    assert f"at step {killed_at}" in run.wait_for(r"resumed from", timeout=1)
    assert "==== summary" in run.output


@pytest.mark.process
def test_launched_jobs_see_sigint_as_from_a_terminal_even_when_the_suite_ignores_it():
    # `make test &` in a shell without job control starts the suite with SIGINT and SIGQUIT ignored; the jobs the
    # stop tests launch must not inherit that, or DeepSpeed's runner ignores the SIGINT they send it
    probe = ("import signal; from ds_paci.tools.processes.launched import Launched; import sys; "
             "signal.signal(signal.SIGINT, signal.SIG_IGN); signal.signal(signal.SIGQUIT, signal.SIG_IGN); "
             "job = Launched([sys.executable, '-c', 'import signal; print(signal.getsignal(signal.SIGINT) is "
             "signal.default_int_handler, signal.getsignal(signal.SIGQUIT) is signal.SIG_DFL)']); "
             "job.finish(timeout=60); print(job.output)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split()[-2:] == ["True", "True"], (out.stdout, out.stderr[-2000:])


@pytest.mark.process
@pytest.mark.parametrize("target,sig", [("runner", signal.SIGTERM), ("runner", signal.SIGINT),
                                        ("launcher", signal.SIGKILL)],
                         ids=["runner-SIGTERM", "runner-SIGINT", "launcher-SIGKILL"])
def test_signal_to_runner_or_launcher_ends_every_rank(tmp_path, target, sig):
    ckpt = str(tmp_path / "ckpt")
    run = Run(_main_job_args(tmp_path, "--checkpoint-dir", ckpt, "--steps", "100000"))
    try:
        assert run.wait_for(r"step +10/", timeout=240), run.output[-3000:]
        run.tree()
        run.send(target, sig)
        gone = run.wait_gone(timeout=30, who=run.ranks())
        launcher_gone = run.wait_gone(timeout=30, who=("launcher",))
        run.finish(timeout=30)
    finally:
        run.kill_all()
    out = run.output
    assert gone is not None and gone < 10, (gone, out[-3000:])
    assert launcher_gone is not None, out[-3000:]  # no orphaned launcher either
    step = _stop_step(run)  # a clean stop, not a crash: agreed step, checkpoint saved
    tag = checkpoint.read_latest(ckpt)
    assert checkpoint.verify(os.path.join(ckpt, tag))[0] == "complete" and step_of(ckpt, tag) == step
    # the runner's death is seen by the 1 s poll; the launcher's by the parent-death signal: both name the launcher
    assert "stopping: launcher exit on rank" in out, out[-2000:]


def _lifecycle_script(body):
    """A Python program that loads ds_paci/core/health/lifecycle.py alone (stdlib only: starts in a fraction of a second)."""
    path = os.path.join(ROOT, "ds_paci", "core", "health", "lifecycle.py")
    return textwrap.dedent(f"""
        import importlib.util, os, signal, sys, time, ctypes
        spec = importlib.util.spec_from_file_location("lifecycle", {path!r})
        lifecycle = importlib.util.module_from_spec(spec); spec.loader.exec_module(lifecycle)
    """) + textwrap.dedent(body)


def _spawn(body, **kw):
    return subprocess.Popen([sys.executable, "-c", _lifecycle_script(body)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def _ready(proc):
    assert proc.stdout.readline().strip() == "ready"


@pytest.mark.process
def test_stop_controller_modes_and_deadline():
    blocked = textwrap.dedent("""
        libc = ctypes.CDLL(None)
        print("ready", flush=True)
        while True:
            libc.sleep(60)  # the main thread sits in C; only the helper thread sees the signal
    """)
    # start-up (not graceful): the first signal ends the process at once with 128+signal
    p = _spawn("c = lifecycle.StopController(graceful=False).install()\n" + blocked)
    _ready(p)
    t = time.monotonic()
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=10) == 128 + signal.SIGTERM and time.monotonic() - t < 3
    assert "SIGTERM received; exiting (exit code 143)" in p.stderr.read()
    # graceful: the job sees the request and exits with 128+signal itself
    p = _spawn("""
        c = lifecycle.StopController(graceful=True, timeout=30).install()
        print("ready", flush=True)
        while not c.requested.wait(0.05):
            pass
        print("stopping:", c.reason, flush=True)
        sys.exit(c.exit_code)
    """)
    _ready(p)
    p.send_signal(signal.SIGINT)
    assert p.wait(timeout=10) == 128 + signal.SIGINT
    assert "stopping: SIGINT received" in p.stdout.read()
    # graceful but the job never gets to its stop (blocked): the deadline ends it
    p = _spawn("c = lifecycle.StopController(graceful=True, timeout=1).install()\n" + blocked)
    _ready(p)
    t = time.monotonic()
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=10) == 128 + signal.SIGTERM and 0.9 < time.monotonic() - t < 4
    assert "did not stop within 1s" in p.stderr.read()
    # a second signal soon after the first counts as the same; a later one ends the process at once
    p = _spawn("c = lifecycle.StopController(graceful=True, timeout=30, escalate_after=0.5).install()\n" + blocked)
    _ready(p)
    p.send_signal(signal.SIGINT)
    time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert p.poll() is None
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=10) == 128 + signal.SIGTERM
    assert "again while stopping; exiting now" in p.stderr.read()


@pytest.mark.process
def test_a_process_whose_parent_dies_exits():
    assert lifecycle.is_launcher(["/v/bin/python", "/v/bin/deepspeed", "--num_gpus", "2", "train.py"])
    assert lifecycle.is_launcher(["/v/bin/python", "-u", "-m", "deepspeed.launcher.launch", "--world_info=x"])
    assert not lifecycle.is_launcher(["/v/bin/python", "-u", "train.py", "--local_rank=0"])
    assert not lifecycle.is_launcher(["/v/bin/python", "-m", "pytest", "tests"])
    child = """
        os.environ["DS_PACI_WATCH_PIDS"] = str(os.getppid())
        print(lifecycle.watch_launchers(interval=0.2), flush=True)
        time.sleep(60)
    """
    parent = f"""
        import subprocess
        c = subprocess.Popen([sys.executable, "-c", {_lifecycle_script(child)!r}], stdout=subprocess.PIPE, text=True)
        print(c.pid, c.stdout.readline().strip(), flush=True)
        time.sleep(60)
    """
    p = _spawn(parent, start_new_session=True)
    child_pid, watched = p.stdout.readline().split(" ", 1)
    assert watched.strip() == f"[{p.pid}]"
    t = time.monotonic()
    p.kill()
    p.wait()
    while time.monotonic() - t < 10:
        stat = lifecycle._proc_stat(int(child_pid))
        if stat is None or stat[0] == "Z":
            break
        time.sleep(0.05)
    assert time.monotonic() - t < 5, "the orphan kept running"


# == bad input ========================================================================================
def _config(tmp_path, base="paci.json", **changes):
    cfg = json.load(open(os.path.join(ROOT, "configs", base)))
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        elif key == "paci":
            cfg["paci"].update(value)
        else:
            cfg[key] = value
    path = tmp_path / f"cfg{len(os.listdir(tmp_path))}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_bad_flags_and_keys_end_before_any_process_group(tmp_path, monkeypatch):
    from ds_paci.mainjob import job as train  # the main job launch/train.py runs
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    incomplete = tmp_path / "incomplete"
    _write_ckpt(str(incomplete), "global_step6", {"mp_rank_00_model_states.pt": 10}, 1.0,
                cut="mp_rank_00_model_states.pt")
    (incomplete / "latest").write_text("global_step6")
    flags = [
        (["--log-interval", "0"], ["--log-interval 0", "an integer >= 1"]),
        (["--eval-batches", "0"], ["--eval-batches 0", "an integer >= 1"]),
        (["--eval-interval", "-1"], ["--eval-interval -1", ">= 0"]),
        (["--save-interval", "-1"], ["--save-interval -1", ">= 0"]),
        (["--save-interval", "5"], ["--save-interval 5 needs --checkpoint-dir"]),
        (["--threads", "0"], ["--threads 0", ">= 1"]),
        (["--device-time", "-1"], ["--device-time -1.0", "finite number of seconds >= 0"]),
        (["--device-time", "nan"], ["--device-time nan", "finite"]),
        (["--seq-len", "0"], ["--seq-len 0", "from 1 to --n-positions"]),
        (["--steps", "0"], ["--steps 0", "an integer >= 1"]),
        (["--n-layer", "0"], ["--n-layer 0", ">= 1"]),
        (["--stages", "0"], ["--stages 0", ">= 1"]),
        (["--stop-timeout", "0"], ["--stop-timeout 0.0", "> 0"]),
        (["--checkpoint-dir", str(a_file)], [f"--checkpoint-dir {a_file} is a file, not a folder"]),
        (["--checkpoint-dir", str(a_file / "sub")], [f"--checkpoint-dir {a_file / 'sub'} is not writable"]),
        (["--checkpoint-dir", str(incomplete), "--resume"],
         [f"--checkpoint-dir {incomplete} holds no complete checkpoint", "global_step6", "truncated"]),
    ]
    keys = [
        (dict(gradient_accumulation_steps=0), ['"gradient_accumulation_steps" = 0', "integer >= 1"]),
        (dict(train_micro_batch_size_per_gpu="8"), ['"train_micro_batch_size_per_gpu" = \'8\'', "integer >= 1"]),
        (dict(gradient_accumulation_steps=None), ['missing: "gradient_accumulation_steps"']),
        (dict(fp16={"enabled": True}), ['"fp16.enabled" = true', "bf16"]),
        (dict(zero_optimization={"stage": 2}), ['"zero_optimization.stage" = 2', "use stage 0 or 1"]),
        (dict(paci={"watchdog_seconds": float("nan")}), ['"paci.watchdog_seconds" = nan']),
        (dict(paci={"watchdog_seconds": 1e-9}), ['"paci.watchdog_seconds" = 1e-09', "must be >= 1"]),
        (dict(paci={"accumulation_window": 10**9}), ['"paci.accumulation_window" = 1000000000', "use at most 256"]),
    ]
    cases = [(["--deepspeed_config", "configs/paci.json"] + f, n) for f, n in flags]
    cases += [(["--deepspeed_config", _config(tmp_path, **k)], n) for k, n in keys]
    # the stock engine's config too: no DeepSpeed pipeline supports ZeRO >= 2
    cases.append((["--deepspeed_config", _config(tmp_path, base="flush.json", zero_optimization={"stage": 3})],
                  ['"zero_optimization.stage" = 3']))
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        for argv, needles in cases:
            out, err = io.StringIO(), io.StringIO()
            with redirect_stdout(out), redirect_stderr(err):
                code = train.main(argv)
            text = out.getvalue() + err.getvalue()
            lines = [l for l in text.splitlines() if l.strip()]
            assert code == 2, (argv, text)
            assert len(lines) == 1 and lines[0].startswith("error: "), (argv, text)
            for needle in needles:
                assert needle in lines[0], (argv, lines[0])
    finally:
        os.chdir(cwd)
    assert not torch.distributed.is_initialized()


def test_paci_section_bounds():
    for value in (float("nan"), float("inf"), 1e-9, 0.5, -1):
        with pytest.raises(PACIConfigError, match='"paci.watchdog_seconds"'):
            parse_paci_section({"enabled": True, "watchdog_seconds": value})
    assert parse_paci_section({"enabled": True, "watchdog_seconds": 0}).watchdog_seconds == 0
    assert parse_paci_section({"enabled": True, "watchdog_seconds": 1}).watchdog_seconds == 1
    check_accumulation_window(None, 4)
    check_accumulation_window(256, 4)
    with pytest.raises(PACIConfigError, match=r"more than 64 x gradient_accumulation_steps \(4\) = 256"):
        check_accumulation_window(257, 4)


# == the page ==========================================================================================
def test_reliability_page_matches_the_suite():
    assert reliability_cases.problems() == []
