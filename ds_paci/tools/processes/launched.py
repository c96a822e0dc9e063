"""Launching a command the way a user's terminal would: its own session, signals at their defaults, output kept.

:class:`Launched` starts a command in a session of its own (``kill -- -PGID`` reaches all of it) with SIGINT and
SIGQUIT at their defaults whatever this process ignores, and collects its output line by line. The fault tests,
the multi-node harness (:mod:`ds_paci.tools.processes.local_nodes`) and the save-kill study launch through it.
"""

import os
import re
import signal
import subprocess
import sys
import threading
import time

#: The repository root (launch/train.py and the configs are found from here).
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

#: Exec ``argv[1:]`` with SIGINT and SIGQUIT at their default actions. A shell without job control starts its
#: background commands with both ignored and the child inherits that: a test suite started with ``make test &``
#: would launch a ``deepspeed`` runner that ignores SIGINT (Python installs its ``KeyboardInterrupt`` handler
#: only where SIGINT is not ignored at start-up). The launched job must see signals as from a terminal.
_DEFAULT_SIGNALS_EXEC = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                         "signal.signal(signal.SIGQUIT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])")


class Launched:
    """A command in a session of its own (``kill -- -PGID`` reaches all of it), started with SIGINT and SIGQUIT at
    their defaults whatever this process ignores; output collected line by line."""

    def __init__(self, cmd, env=None, cwd=None):
        env = dict(os.environ, DS_ACCELERATOR="cpu", **(env or {}))
        self.started = time.monotonic()
        cmd = [sys.executable, "-c", _DEFAULT_SIGNALS_EXEC, _resolve(cmd[0])] + list(cmd[1:])
        self.proc = subprocess.Popen(cmd, cwd=cwd or ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.lines = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    @property
    def output(self):
        return "\n".join(self.lines)

    def wait_for(self, pattern, timeout=180):
        """The first output line matching ``pattern`` (a regex); ``None`` if the run ended or timed out first."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = 0
        with self._cond:
            while True:
                for line in self.lines[seen:]:
                    if rx.search(line):
                        return line
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    return None
                self._cond.wait(min(left, 0.5))

    def finish(self, timeout=120):
        """Wait for the command to exit; returns its exit code (kills the whole session on timeout)."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_all()
            self.proc.wait(timeout=10)
        self._reader.join(timeout=10)
        return self.proc.returncode

    def kill_all(self, sig=signal.SIGKILL):
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _resolve(program):
    """``program`` as a path ``os.execv`` can run (looked up on ``PATH`` when it has no slash)."""
    import shutil
    return program if os.sep in program else (shutil.which(program) or program)
