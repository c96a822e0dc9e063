"""What the main job measures while it trains, and where it says it.

:class:`Reporter` is the job's only output (progress lines, the metrics file, the summary), active on the
last stage's first data-parallel replica. :class:`TrainingMetrics` is the running account of one rank:
the recent losses, the steps whose loss was not finite, the time spent training and evaluating, the
throughput window between two progress lines. Both are plain Python (no torch, no process group).
"""

import json
import math
import os
import time
from dataclasses import dataclass

RECENT_LOSSES = 10  # the summary's train loss is the mean of the last this many finite losses


@dataclass(frozen=True)
class JobShape:
    """The facts of a run the lines and the summary name."""
    engine_name: str
    is_paci: bool
    stages: int
    data_parallel: int
    start_step: int  # the step the run starts after (0, or the resumed checkpoint's)
    steps: int  # --steps: the run ends after this step
    tokens_per_step: int
    tie_embeddings: bool


def fmt_time(seconds):
    seconds = int(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class Reporter:
    """Progress lines, validation lines, metrics JSONL and the summary, on the last stage's first replica."""

    def __init__(self, active, path):
        self.active = active
        self.path = path
        self.file = None
        if active:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.file = open(path, "a")

    def record(self, **fields):
        if self.active:
            self.file.write(json.dumps(fields) + "\n")
            self.file.flush()

    def say(self, line):
        if self.active:
            print(line, flush=True)

    def close(self):
        if self.file:
            self.file.close()


class TrainingMetrics:
    """One rank's running account of the run (see the module docstring); ``clock`` is ``time.perf_counter``."""

    def __init__(self, tokens_per_step, clock=time.perf_counter):
        self.tokens_per_step = tokens_per_step
        self.clock = clock
        self.recent_losses = []
        self.last_loss = None
        self.nonfinite_steps = []  # every step whose loss was NaN/inf (the last stage's own, never a stale value)
        self.window_nonfinite = []  # the same since the last progress line
        self.train_seconds = 0.0
        self.eval_seconds = 0.0
        self.window_start, self.window_steps = clock(), 0

    def start_window(self):
        """The throughput window starts now (before the first step, and after each progress line)."""
        self.window_start, self.window_steps = self.clock(), 0

    def keep(self, loss):
        self.recent_losses = (self.recent_losses + [loss])[-RECENT_LOSSES:]

    def observe(self, step, loss, own_loss):
        """Step ``step`` returned ``loss`` (``None``: none known yet); ``own_loss``: this rank computed it (the last
        stage), so a non-finite value is this step's, not a stale one."""
        self.window_steps += 1
        if loss is None:
            return
        self.last_loss = float(loss)
        if math.isfinite(self.last_loss):
            self.keep(self.last_loss)
        elif own_loss:
            self.nonfinite_steps.append(step)
            self.window_nonfinite.append(step)

    def close_window(self, steps_left):
        """``(tokens/s, eta seconds, non-finite steps)`` of the window since the last progress line; the window
        is emptied (call :meth:`start_window` once the line is out)."""
        elapsed = self.clock() - self.window_start
        tps = self.tokens_per_step * self.window_steps / max(elapsed, 1e-9)
        eta = steps_left * elapsed / max(self.window_steps, 1)
        nonfinite, self.window_nonfinite = self.window_nonfinite, []
        return tps, eta, nonfinite

    def train_loss(self):
        """The mean of the recent finite losses (NaN when there is none)."""
        return sum(self.recent_losses) / len(self.recent_losses) if self.recent_losses else float("nan")


def drift_text(stats, stats_step, step=None):
    """The progress line's drift part from every rank's PACI stats, labelled with where they come from: gathered
    over all stages at ``stats_step`` (a validation: the only point where the job runs that collective, never on the
    training path). When that is older than ``step``, the label names that validation; each stage's current figures
    are its own line (``ds_paci: train_batch N stage S/P ...``, every ``steps_per_print`` calls)."""
    seen = max(s.get("max_drift", 0) for s in stats)
    bound = max(s.get("drift_bound", 0) for s in stats)
    if step is None or stats_step == step:
        return f" | drift {seen} (bound {bound}, all stages at step {stats_step})"
    return f" | drift {seen} (bound {bound}, all stages at the validation of step {stats_step})"


def progress_line(step, steps, loss, tps, lr, drift, nonfinite, skipped, eta):
    """``step N/steps | loss ... | tokens/s | lr ...[drift][guard] | eta``: the job's progress line."""
    loss_txt = f"{loss:.4f}" if loss is not None else "   n/a"
    guard = ""
    if nonfinite:
        guard = f" | non-finite loss at step {', '.join(map(str, nonfinite))}"
    if skipped:
        guard += f" | skipped steps {skipped} (non-finite gradients; this stage)"
    return (f"step {step:>6}/{steps} | loss {loss_txt} | {tps:,.0f} tokens/s | "
            f"lr {lr:.2e}{drift}{guard} | eta {fmt_time(eta)}")
