"""Run a function on N local processes joined by a gloo process group, and fail fast.

``run_world(fn, world_size, *args)`` starts one process per rank, sets the launcher environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; ``DS_ACCELERATOR`` as asked; and
``DS_PACI_WATCH_PIDS`` = the parent, so a rank whose parent dies stops), starts
DeepSpeed's process group with a bounded timeout, calls ``fn(rank, *args)``
and returns the per-rank results. ``fn`` must be importable by the spawned
processes (a module-level function). Each rank's stdout and stderr go to
``<log_dir>/rank<R>.log``. If any rank fails or exits, or the whole run exceeds
``timeout`` seconds, every process is killed and :class:`WorldFailure` is raised
with each rank's status and the tail of its log, so a hang says who was where.

``accelerator="cpu"`` (the default, which the tests rely on: gloo) forces DeepSpeed's CPU
accelerator; ``accelerator=None`` uses what DeepSpeed detects (CUDA with NCCL where present,
else the CPU with gloo; ``DS_ACCELERATOR`` in the environment still overrides), which is what
the benchmark passes.

**Start method.** A world on the CPU accelerator with no extra environment starts its ranks from a ``forkserver``
that has already imported torch and DeepSpeed (``PRELOAD``; the server is started once per parent process, with
:data:`CHILD_ENV` and ``DS_ACCELERATOR=cpu`` in its environment, so what torch and DeepSpeed read at import is what a
spawned rank would read): each rank is a fork of it and skips the 1-2 s of CPU those imports cost, which the test
suite's hundreds of worlds pay otherwise. Any other world (``accelerator=None``, or ``env`` given, which torch or
DeepSpeed may read at import) is spawned: a fresh interpreter that imports them itself.

Used by the benchmark and by the multi-process tests.
"""

import io
import multiprocessing as mp
import os
import queue
import random
import socket
import tempfile
import time
import traceback

# Set in the parent around the spawn, so children see them before importing torch.
CHILD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
# What the forkserver imports before it forks a rank (see the module docstring).
PRELOAD = ["torch", "deepspeed"]
_forkserver = None


def _context(accelerator, env):
    """The multiprocessing context for a world (see the module docstring)."""
    global _forkserver
    if accelerator != "cpu" or env:
        return mp.get_context("spawn")
    if _forkserver is None:
        _forkserver = mp.get_context("forkserver")
        _forkserver.set_forkserver_preload(PRELOAD)
    return _forkserver


class WorldFailure(AssertionError):
    """A rank failed, exited early, or the world timed out; the message has every rank's status and log tail."""


_PORTS = random.SystemRandom()  # not the `random` module's generator, which tests and jobs seed


def _ephemeral_low():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port():
    """A TCP port free on 127.0.0.1 now, for a rendezvous (``MASTER_PORT``) that a process binds a moment later.

    Drawn at random below the kernel's ephemeral range (from 20000 up to it): a port the kernel hands out for
    ``bind(0)`` or for an outgoing connection (gloo's pair listeners and connections take hundreds of them) can be
    taken by another test's processes between this call and the bind, and a rank then reaches a stranger ("Connection
    reset by peer" in ``TCPStore``); below the range only another caller of this function can pick the same port.
    """
    high = _ephemeral_low() - 1
    for _ in range(200):
        port = _PORTS.randint(20000, high) if high > 20000 else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pack(obj):
    """Results travel as bytes: torch's shared-memory tensor pickling dies with the sending process."""
    import torch
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unpack(data):
    import torch
    return torch.load(io.BytesIO(data), weights_only=False)


def _entry(rank, world_size, port, log_path, fn, args, results, environ, gloo_timeout_s, parent_pid):
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.clear()  # a forked rank has its server's environment: the parent's of now replaces it
    os.environ.update(environ)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_PACI_WATCH_PIDS=str(parent_pid))
    import datetime
    import sys

    import torch
    torch.set_num_threads(1)
    import deepspeed

    from ds_paci.core.runtime import skip_cpu_jit_ops
    try:
        skip_cpu_jit_ops()
        backend = deepspeed.get_accelerator().communication_backend_name()
        if backend == "ccl" or deepspeed.get_accelerator().device_name() == "cpu":
            backend = "gloo"  # pipelines need point-to-point transfers, which oneCCL lacks
        deepspeed.init_distributed(dist_backend=backend, timeout=datetime.timedelta(seconds=gloo_timeout_s))
        out = fn(rank, *args)
        results.put((rank, "ok", _pack(out)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        results.close()
        results.join_thread()  # os._exit below would drop what the queue's feeder thread has not sent
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    except Exception:
        pass


def _tail(path, lines=25):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return "<no log>"


def run_world(fn, world_size, *args, timeout=120, log_dir=None, env=None, gloo_timeout_s=60, expect_failure=False,
              accelerator="cpu"):
    """Run ``fn(rank, *args)`` on ``world_size`` processes; returns ``[result of rank 0, ...]``.

    With ``expect_failure=True`` returns ``(statuses, outputs, log_paths)`` instead of
    raising when ranks fail (status per rank: ``"ok"``, ``"error"`` (output = the
    traceback), ``"exit <code>"`` or ``"killed"``), still bounded by ``timeout``.
    """
    log_dir = log_dir or tempfile.mkdtemp(prefix="ds_paci_world_")
    os.makedirs(log_dir, exist_ok=True)
    ctx = _context(accelerator, env)
    results = ctx.Queue()
    port = free_port()
    procs = []
    child_env = dict(CHILD_ENV)
    if accelerator is not None:
        child_env["DS_ACCELERATOR"] = accelerator
    saved_env = {k: os.environ.get(k) for k in child_env}
    os.environ.update(child_env)
    environ = {**os.environ, **(env or {})}
    try:
        for rank in range(world_size):
            log_path = os.path.join(log_dir, f"rank{rank}.log")
            p = ctx.Process(target=_entry,
                            args=(rank, world_size, port, log_path, fn, args, results, environ, gloo_timeout_s,
                                  os.getpid()))
            p.start()
            procs.append(p)
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    deadline = time.monotonic() + timeout
    status, out = {}, {}

    def collect(wait):
        rank, kind, value = results.get(timeout=wait)
        status[rank], out[rank] = kind, value

    while len(status) < world_size and time.monotonic() < deadline:
        try:
            collect(0.5)
        except queue.Empty:
            for rank, p in enumerate(procs):
                if rank not in status and p.exitcode is not None:
                    try:  # a rank that just exited may still be delivering its result
                        collect(1.0)
                    except queue.Empty:
                        pass
                    status.setdefault(rank, f"exit {p.exitcode}")
        if not expect_failure and any(v != "ok" for v in status.values()):
            break
    timed_out = time.monotonic() >= deadline
    for rank in range(world_size):
        status.setdefault(rank, "killed (timeout)" if timed_out else "killed")
    clean = all(v == "ok" for v in status.values())
    for p in procs:
        p.join(timeout=10 if clean else 0.5)
        if p.is_alive():
            p.kill()
            p.join()
    logs = {rank: os.path.join(log_dir, f"rank{rank}.log") for rank in range(world_size)}
    if expect_failure:
        return status, {r: (_unpack(v) if status[r] == "ok" else v) for r, v in out.items()}, logs
    if not clean:
        report = []
        for rank in range(world_size):
            detail = out.get(rank) if status[rank] == "error" else _tail(logs[rank])
            report.append(f"--- rank {rank}: {status[rank]}\n{detail}")
        raise WorldFailure(f"world of {world_size} failed (logs in {log_dir}):\n" + "\n".join(report))
    return [_unpack(out[r]) for r in range(world_size)]
