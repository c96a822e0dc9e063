"""Run a function on N real processes joined by a gloo process group, and fail fast.

``run_world(fn, world_size, *args)`` spawns one process per rank (``spawn`` start
method), sets the launcher environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``DS_ACCELERATOR=cpu``), starts
DeepSpeed's process group with a short timeout, calls ``fn(rank, *args)`` and
returns the per-rank results. Each rank's stdout and stderr go to
``<log_dir>/rank<R>.log``. If any rank fails, exits, or the whole run exceeds
``timeout`` seconds, every process is killed and :class:`WorldFailure` is raised
with each rank's status and the tail of its log, so a hang says who was where.
"""

import multiprocessing as mp
import os
import queue
import socket
import tempfile
import time
import traceback

DEFAULT_TIMEOUT = 120


class WorldFailure(AssertionError):
    pass


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, log_path, fn, args, results, env, gloo_timeout_s):
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    import datetime

    import torch
    torch.set_num_threads(1)
    import deepspeed

    import ds_paci
    try:
        ds_paci.skip_cpu_jit_ops()
        deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=gloo_timeout_s))
        out = fn(rank, *args)
        results.put((rank, "ok", _pack(out)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        raise SystemExit(1)
    finally:
        import sys
        sys.stdout.flush()
        sys.stderr.flush()
    try:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    except Exception:
        pass


def _pack(obj):
    """Results travel as bytes: torch's shared-memory tensor pickling dies with the sending process."""
    import io

    import torch
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unpack(data):
    import io

    import torch
    return torch.load(io.BytesIO(data), weights_only=False)


def _tail(path, lines=25):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return "<no log>"


def run_world(fn, world_size, *args, timeout=DEFAULT_TIMEOUT, log_dir=None, env=None, gloo_timeout_s=60,
              expect_failure=False):
    """Run ``fn(rank, *args)`` on ``world_size`` processes; returns ``[result of rank 0, ...]``.

    With ``expect_failure=True`` returns ``(statuses, logs)`` instead of raising when
    ranks fail (statuses: rank -> "ok" | "error" | "exit <code>" | "killed"), still
    bounded by ``timeout``.
    """
    log_dir = log_dir or tempfile.mkdtemp(prefix="ds_paci_world_")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = []
    for rank in range(world_size):
        log_path = os.path.join(log_dir, f"rank{rank}.log")
        p = ctx.Process(target=_entry,
                        args=(rank, world_size, port, log_path, fn, args, results, dict(env or {}), gloo_timeout_s),
                        daemon=False)
        p.start()
        procs.append(p)
    deadline = time.monotonic() + timeout
    status, out = {}, {}
    while len(status) < world_size and time.monotonic() < deadline:
        try:
            rank, kind, value = results.get(timeout=0.5)
            status[rank] = kind
            out[rank] = value
        except queue.Empty:
            for rank, p in enumerate(procs):
                if rank not in status and p.exitcode is not None:
                    # give a rank that just exited a moment to deliver its result
                    try:
                        r2, kind, value = results.get(timeout=1.0)
                        status[r2], out[r2] = kind, value
                    except queue.Empty:
                        pass
                    if rank not in status:
                        status[rank] = f"exit {p.exitcode}"
        if not expect_failure and any(v != "ok" for v in status.values()):
            break
    for rank in range(world_size):
        status.setdefault(rank, "killed (timeout)" if time.monotonic() >= deadline else "killed")
    for p in procs:
        p.join(timeout=10 if all(v == "ok" for v in status.values()) else 0.5)
        if p.is_alive():
            p.kill()
            p.join()
    logs = {rank: os.path.join(log_dir, f"rank{rank}.log") for rank in range(world_size)}
    if expect_failure:
        return status, {r: (_unpack(v) if status[r] == "ok" else v) for r, v in out.items()}, logs
    if any(v != "ok" for v in status.values()):
        report = []
        for rank in range(world_size):
            detail = out.get(rank) if status[rank] == "error" else _tail(logs[rank])
            report.append(f"--- rank {rank}: {status[rank]}\n{detail}")
        raise WorldFailure(f"world of {world_size} failed (logs in {log_dir}):\n" + "\n".join(report))
    return [_unpack(out[r]) for r in range(world_size)]
