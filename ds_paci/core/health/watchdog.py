"""Hang watchdog: a stage stuck inside one instruction says where it is and aborts.

Blocking point-to-point transfers make a mis-paired stream, or a dead peer, hang
forever (or until the process-group timeout, 30 minutes by default). The engine
tells the watchdog which instruction it is executing; a daemon thread checks that
no single instruction takes longer than ``timeout`` seconds. When one does, it
prints the rank, the stage, the instruction (text form) and its tick in the stream
to stderr, and terminates the process with :data:`EXIT_CODE`. Terminating closes
the rank's connections, so its peers fail promptly too and report their own
positions.

The message says what the rank is stuck on, from the engine's ``explain(instruction)``:
in its own computation (forward, backward, data loading, its local step) or waiting
for a named neighbouring stage (a send or a receive), and, when another stage has
announced that it stopped the run, that stage's reason.
"""

import os
import sys
import threading
import time

EXIT_CODE = 86


class Watchdog:
    """Watches one process's current instruction. ``timeout <= 0`` disables it (no thread)."""

    def __init__(self, timeout, describe_rank, describe_instruction, explain=None):
        self.timeout = float(timeout)
        self._describe_rank = describe_rank
        self._describe_instruction = describe_instruction
        self._explain = explain
        self._current = None  # (instruction, tick) or None when idle
        self._detail = None  # what the instruction is waiting for, when it says (see note())
        self._since = 0.0
        self._last_done = None
        self._stop = threading.Event()
        self._thread = None
        if self.timeout > 0:
            self._thread = threading.Thread(target=self._watch, name="ds_paci-watchdog", daemon=True)
            self._thread.start()

    def enter(self, instruction, tick):
        self._since = time.monotonic()
        self._detail = None
        self._current = (instruction, tick)

    def note(self, detail):
        """Say what the current instruction waits for (``None`` clears it); the report names it."""
        self._detail = detail

    def done(self):
        self._last_done = self._current
        self._current = None
        self._detail = None

    def idle(self):
        self._current = None
        self._detail = None

    def close(self):
        self._stop.set()

    def message(self, waited):
        instruction, tick = self._current
        last = "none" if self._last_done is None else self._describe_instruction(self._last_done[0])
        detail = f", {self._detail}" if self._detail else ""
        if self._explain is not None:
            try:
                why = self._explain(instruction)
            except Exception as e:  # the message must come out whatever happens
                why = f"; (could not tell why: {type(e).__name__})"
        else:
            why = "; a neighbouring stage is stuck, dead or running a different stream"
        return (f"[ds_paci watchdog] {self._describe_rank()} has waited {waited:.0f}s in "
                f"{self._describe_instruction(instruction)} at tick {tick} of its stream{detail} "
                f"(last completed: {last}){why}. Aborting this rank (exit code {EXIT_CODE}).")

    def _watch(self):
        period = min(1.0, self.timeout / 4)
        while not self._stop.wait(period):
            current, since = self._current, self._since
            if current is None:
                continue
            waited = time.monotonic() - since
            if waited > self.timeout and self._current is current:
                sys.stderr.write(self.message(waited) + "\n")
                sys.stderr.flush()
                sys.stdout.flush()
                os._exit(EXIT_CODE)
