"""Clean stops: stop signals, launcher deaths, and a stop step every rank agrees on.

How DeepSpeed 0.19's launch chain behaves without this module (``deepspeed`` runner ->
``python -m deepspeed.launcher.launch`` -> one process per rank):

* the runner installs no signal handler for a single-node run: SIGTERM kills it alone,
  SIGINT raises ``KeyboardInterrupt`` in it alone; the launcher and every rank keep
  training as orphans;
* the launcher's SIGINT/SIGTERM handler terminates its ranks (SIGTERM, then SIGKILL
  after 30 s); when a rank exits non-zero it terminates the others the same way;
* a rank stops on SIGTERM at once (nothing saved); SIGINT raises ``KeyboardInterrupt``
  only when the main thread returns to Python (not while it blocks in a transfer).

Public contract
---------------
:func:`watch_launchers` (started by :func:`ds_paci.initialize`, so every script using
ds_paci gets it; idempotent; ``DS_PACI_WATCH_LAUNCHERS=0`` turns it off) finds the chain of
launcher processes above this one (DeepSpeed's runner and launcher, ``torchrun``, plus
the pids in ``DS_PACI_WATCH_PIDS``), asks the kernel to send SIGTERM when the direct
parent dies (``PR_SET_PDEATHSIG`` on Linux) and polls every watched process once a second
(a dead, zombie or reused pid counts as gone). When one is gone it calls
:meth:`StopController.request_stop` of the installed controller, or, without one, sends
SIGTERM to this process (whose default action ends it). Either way a rank whose launcher
dies stops within about one second plus whatever its stop policy does.

:class:`StopController` (installed from the main thread by a job that wants a clean
stop) turns SIGINT/SIGTERM into a stop request seen by a helper thread at once, even while
the main thread is blocked inside a transfer (``signal.set_wakeup_fd``):

* ``graceful=False`` (start-up): print one line and exit ``128 + signal`` immediately;
* ``graceful=True``: set :attr:`StopController.requested` and start a deadline of
  ``timeout`` seconds; the job polls it between steps, finishes what it must (drain, save)
  and exits with :attr:`StopController.exit_code`. If the deadline passes first, the
  process prints one line and exits ``128 + signal`` without waiting (an atomic checkpoint
  cut off by this keeps the previous complete one as ``latest``);
* a further signal more than ``escalate_after`` (2) seconds after the first ends the
  process at once. Signals within that grace period count as one (Ctrl-C in a terminal
  delivers SIGINT to every process, then the launcher adds SIGTERM).

:class:`StopAgreement` lets every rank stop at the same step when a signal reached only
some of them, without any collective inside ``train_batch``: at each step boundary every
rank starts a non-blocking all-reduce (MAX, on a dedicated gloo group) of its own stop
code, and waits for the one started at the previous boundary. A stop requested on any
rank before its boundary ``k`` is therefore known to every rank at boundary ``k + 1``: the
bound is at most two ``train_batch`` calls after the signal. Every rank must call
:meth:`StopAgreement.poll` at every boundary and :meth:`StopAgreement.close` once at the
end, in the same order.
"""

import atexit
import os
import select
import signal
import sys
import threading
import time

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
PARENT_DEATH = 1000  # stop code of a launcher death (exits like SIGTERM)

_controller = None
_watcher = None
_lock = threading.Lock()
_exit_hooks = []


def on_exit(hook):
    """Run ``hook()`` before this module ends the process with ``os._exit`` (e.g. the peer watch's farewell)."""
    if hook not in _exit_hooks:
        _exit_hooks.append(hook)


def _exit(code):
    for hook in list(_exit_hooks):
        try:
            hook()
        except Exception:
            pass
    os._exit(code)


def _say(line):
    try:
        sys.stdout.flush()
    except Exception:
        pass
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except Exception:
        pass


def _rank_text():
    rank = os.environ.get("RANK")
    return f"rank {rank}" if rank is not None else f"process {os.getpid()}"


def signal_name(code):
    if code == PARENT_DEATH:
        return "launcher exit"
    try:
        return signal.Signals(code).name
    except ValueError:
        return f"signal {code}"


def exit_code_for(code):
    return 128 + (signal.SIGTERM if code == PARENT_DEATH else code)


class StopController:
    """Turns SIGINT/SIGTERM (and launcher deaths) into a stop request; see the module docstring."""

    def __init__(self, timeout=8.0, graceful=False, escalate_after=2.0, on_request=None):
        self.timeout = float(timeout)
        self.graceful = graceful
        self.escalate_after = float(escalate_after)
        self.on_request = on_request  # called (in the helper thread) with (code, reason) on the first request
        self.requested = threading.Event()
        self.code = None
        self.reason = None
        self.requested_at = None
        self._lock = threading.Lock()
        self._timer = None
        self._pipe = None
        self._previous = {}
        self._previous_fd = None

    # -- installation --------------------------------------------------------------------------
    def install(self):
        """Install the signal handlers (main thread only). Returns ``self``; also the process-wide controller."""
        global _controller
        r, w = os.pipe()
        os.set_blocking(w, False)
        self._pipe = (r, w)
        for sig in _STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, _python_level_handler)
        self._previous_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        threading.Thread(target=self._read_signals, name="ds_paci-signals", daemon=True).start()
        _controller = self
        atexit.register(self._restore_at_exit)  # while the interpreter tears down, signals act as by default again
        return self

    def _restore_at_exit(self):
        if self._previous:
            try:
                self.uninstall()
            except (ValueError, OSError):
                pass

    def uninstall(self):
        global _controller
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(self._previous_fd if self._previous_fd is not None else -1)
        self._previous.clear()
        if _controller is self:
            _controller = None
        self.cancel_deadline()

    def _read_signals(self):
        r = self._pipe[0]
        while True:
            try:
                select.select([r], [], [])
                data = os.read(r, 64)
            except (OSError, ValueError):
                return
            if not data:
                return
            for code in data:
                if code in _STOP_SIGNALS:
                    reason = f"{signal_name(code)} received"
                    watcher = _watcher
                    gone = None
                    if code == signal.SIGTERM and watcher is not None:
                        # the parent-death signal: the kernel reparents this process before sending it, while the
                        # dead launcher may not look dead in /proc yet
                        gone = watcher.parent if os.getppid() != watcher.parent else watcher.gone()
                    if gone is not None:
                        code, reason = PARENT_DEATH, f"launcher process {gone} is gone (SIGTERM received)"
                    self.request_stop(code, reason)

    # -- requests ----------------------------------------------------------------------------------
    @property
    def exit_code(self):
        return exit_code_for(self.code) if self.code is not None else 0

    def request_stop(self, code, reason, announce=True):
        """First request: stop now (not graceful) or flag it and start the deadline; later ones may escalate."""
        with self._lock:
            first = self.code is None
            if first:
                self.code, self.reason, self.requested_at = code, reason, time.monotonic()
            elapsed = time.monotonic() - self.requested_at
        if not first:
            if elapsed > self.escalate_after and code != PARENT_DEATH:
                _say(f"[ds_paci] {_rank_text()}: {reason} again while stopping; exiting now "
                     f"(exit code {exit_code_for(code)})")
                _exit(exit_code_for(code))
            return
        if not self.graceful:
            _say(f"[ds_paci] {_rank_text()}: {reason}; exiting (exit code {self.exit_code})")
            _exit(self.exit_code)
        if announce:
            _say(f"[ds_paci] {_rank_text()}: {reason}; stopping at a step all ranks agree on (within two steps), "
                 f"then exiting (at most {self.timeout:g}s)")
        self.requested.set()
        self._timer = threading.Timer(self.timeout, self._deadline)
        self._timer.daemon = True
        self._timer.start()
        if self.on_request is not None:
            self.on_request(code, reason)

    def cancel_deadline(self):
        if self._timer is not None:
            self._timer.cancel()

    def _deadline(self):
        _say(f"[ds_paci] {_rank_text()}: did not stop within {self.timeout:g}s of '{self.reason}'; exiting now "
             f"(exit code {self.exit_code}); the last complete checkpoint stays the latest")
        _exit(self.exit_code)

    def local_code(self):
        return self.code or 0


def _python_level_handler(signum, frame):
    """The C-level handler has already woken the helper thread through the wakeup fd; nothing to do here."""


def current_controller():
    return _controller


# -- launcher deaths --------------------------------------------------------------------------------
_LAUNCHER_MODULES = ("deepspeed.launcher.launch", "deepspeed.launcher.runner", "torch.distributed.run",
                     "torch.distributed.launch")
_LAUNCHER_SCRIPTS = ("deepspeed", "torchrun", "ds")


def _proc_stat(pid):
    """``(state, start_time)`` from /proc, or ``None`` when the process does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = data[data.rfind(")") + 2:].split()
    return fields[0], fields[19]  # state, starttime


def _parent_of(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode(errors="replace")
        return int(data[data.rfind(")") + 2:].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def is_launcher(argv):
    """Whether a command line is a known launcher (DeepSpeed's runner or launcher, torchrun)."""
    head = argv[:4]
    for i, arg in enumerate(head):
        if arg in _LAUNCHER_MODULES and i > 0 and head[i - 1] == "-m":
            return True
        if os.path.basename(arg) in _LAUNCHER_SCRIPTS and (i == 0 or not head[i - 1].startswith("-")):
            return True
    return False


def launcher_chain(pid=None):
    """The launcher processes above ``pid`` (default: this process), nearest first."""
    chain = []
    parent = os.getppid() if pid is None else _parent_of(pid)
    while parent and parent > 1 and is_launcher(_cmdline(parent)):
        chain.append(parent)
        parent = _parent_of(parent)
    return chain


class _LauncherWatch:

    def __init__(self, pids, interval, on_death):
        self.parent = os.getppid()
        self.interval = interval
        self.on_death = on_death
        self.watched = {}
        for pid in pids:
            stat = _proc_stat(pid)
            if stat is not None:
                self.watched[pid] = stat[1]
        self.fired = False
        self._thread = threading.Thread(target=self._run, name="ds_paci-launcher-watch", daemon=True)
        self._thread.start()

    def gone(self):
        for pid, start in self.watched.items():
            stat = _proc_stat(pid)
            if stat is None or stat[0] in ("Z", "X", "x") or stat[1] != start:
                return pid
        return None

    def _run(self):
        while True:
            time.sleep(self.interval)
            pid = self.gone()
            if pid is not None:
                self.fired = True
                name = " ".join(_cmdline_cache.get(pid, [])[:4]) or "?"
                self.on_death(pid, name)
                return


_cmdline_cache = {}


def _default_on_death(pid, name):
    reason = f"launcher process {pid} ({name}) is gone"
    controller = current_controller()
    if controller is not None:
        controller.request_stop(PARENT_DEATH, reason)
    else:
        _say(f"[ds_paci] {_rank_text()}: {reason}; stopping this rank (SIGTERM)")
        os.kill(os.getpid(), signal.SIGTERM)


def _set_parent_death_signal(sig=signal.SIGTERM):
    """``prctl(PR_SET_PDEATHSIG, sig)``: the kernel signals this process when its parent exits (Linux only)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(1, int(sig), 0, 0, 0) == 0  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        return False


def watch_launchers(interval=1.0, on_death=None):
    """Start watching the launcher chain above this process (idempotent); returns the watched pids."""
    global _watcher
    with _lock:
        if _watcher is not None:
            return sorted(_watcher.watched)
        if os.environ.get("DS_PACI_WATCH_LAUNCHERS", "1") == "0" or not os.path.isdir("/proc/self"):
            return []
        pids = launcher_chain()
        for extra in os.environ.get("DS_PACI_WATCH_PIDS", "").split(","):
            if extra.strip().isdigit() and int(extra) not in pids and int(extra) != os.getpid():
                pids.append(int(extra))
        if not pids:
            return []
        for pid in pids:
            _cmdline_cache[pid] = _cmdline(pid)
        if pids[0] == os.getppid():
            _set_parent_death_signal()
        _watcher = _LauncherWatch(pids, interval, on_death or _default_on_death)
        if _watcher.gone() is not None:  # the parent died before we looked
            _watcher.on_death(_watcher.gone(), "?")
        return sorted(_watcher.watched)


# -- agreeing on the stop step ------------------------------------------------------------------------
class StopDecision:
    """What every rank agreed on: the stop code (signal number or :data:`PARENT_DEATH`) and one rank that asked."""

    def __init__(self, code, rank):
        self.code, self.rank = code, rank

    @property
    def exit_code(self):
        return exit_code_for(self.code)

    def describe(self):
        return f"{signal_name(self.code)} on rank {self.rank}"


class StopAgreement:
    """Per-boundary non-blocking MAX all-reduce of each rank's stop code (see the module docstring)."""

    _RANKS = 1 << 20

    def __init__(self, controller):
        import torch.distributed as tdist
        self.controller = controller
        self._dist = tdist
        self._group = tdist.new_group(backend="gloo")  # collective: every rank creates it, in the same order
        self._pending = None
        self._rank = tdist.get_rank()
        self.rounds = 0

    def poll(self):
        """Call at every step boundary on every rank. Returns a :class:`StopDecision` (the same on all ranks) or None."""
        import torch
        decision = None
        if self._pending is not None:
            work, value = self._pending
            work.wait()
            self._pending = None
            v = int(value.item())
            if v > 0:
                decision = StopDecision(v // self._RANKS, v % self._RANKS)
        if decision is None:
            code = self.controller.local_code() if self.controller is not None else 0
            value = torch.tensor([code * self._RANKS + self._rank if code else 0], dtype=torch.int64)
            work = self._dist.all_reduce(value, op=self._dist.ReduceOp.MAX, group=self._group, async_op=True)
            self._pending = (work, value)
            self.rounds += 1
        return decision

    def close(self):
        """Wait for the last exchange (every rank calls this once, after its last :meth:`poll`)."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None
