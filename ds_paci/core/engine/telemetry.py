"""Per-stage telemetry recorded by the PACI engine: weight versions, drift, optional instruction trace.

The engine writes; timelines, logs and the benchmark read (never the other way round).
"""

import json
import os
from collections import Counter, deque

TRACE_LIMIT = 1_000_000  # records kept (the most recent); about 200 MB at the limit


class StageTelemetry:
    """Counters of one pipeline stage.

    * ``version``: local optimizer steps applied so far (the stage's weight version);
    * ``drift``: histogram {versions crossed between a micro-batch's forward and its
      backward at this stage: count};
    * ``recent``: the last ``keep`` (micro-batch id, drift) pairs;
    * ``trace``: per-instruction records ``{"rank", "stage", "instr", "start", "end"}``
      (wall-clock seconds) when tracing is on; the most recent :data:`TRACE_LIMIT` are kept.
    """

    def __init__(self, rank, stage, stages, window, bound, trace=False, keep=1024):
        self.rank = rank
        self.stage = stage
        self.stages = stages
        self.window = window
        self.bound = bound
        self.version = 0
        self.micro_batches = 0
        self.nonfinite_losses = 0  # last stage: calls whose loss was NaN or inf
        self.drift = Counter()
        self.recent = []
        self.keep = keep
        self._forward_version = {}
        self.tracing = trace
        self.trace = deque(maxlen=TRACE_LIMIT)

    def forward(self, buffer_id):
        self._forward_version[buffer_id] = self.version

    def accumulate(self, buffer_id, micro_batch_id):
        drift = self.version - self._forward_version.pop(buffer_id)
        self.drift[drift] += 1
        self.micro_batches += 1
        self.recent.append((micro_batch_id, drift))
        if len(self.recent) > self.keep:
            del self.recent[:len(self.recent) - self.keep]
        return drift

    def stepped(self):
        self.version += 1

    def record(self, instr, start, end):
        self.trace.append({"rank": self.rank, "stage": self.stage, "instr": instr, "start": start, "end": end})

    @property
    def max_drift(self):
        return max(self.drift) if self.drift else 0

    def summary(self):
        return {
            "rank": self.rank,
            "stage": self.stage,
            "stages": self.stages,
            "window": self.window,
            "version": self.version,
            "local_steps": self.version,
            "micro_batches": self.micro_batches,
            "drift_histogram": dict(sorted(self.drift.items())),
            "max_drift": self.max_drift,
            "drift_bound": self.bound,
            "nonfinite_losses": self.nonfinite_losses,
        }

    def describe(self, lookahead=None, calls=None):
        """The stage's progress line from its own counters (no other stage is asked): version, micro-batches, drift
        histogram and bound, and the look-ahead (``lookahead``: its stats, or ``None`` when off)."""
        hist = ", ".join(f"{d}:{n}" for d, n in sorted(self.drift.items())) or "none"
        look = "off"
        if lookahead is not None:
            look = f"on, {lookahead.get('predicted_forwards', 0)} forwards on predicted weights"
        at = f"train_batch {calls} " if calls is not None else ""
        return (f"ds_paci: {at}stage {self.stage}/{self.stages} rank {self.rank}: version {self.version}, "
                f"{self.micro_batches} micro-batches, drift histogram {{{hist}}} (bound {self.bound}), "
                f"look-ahead {look}")

    def write_trace(self, directory):
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"trace_rank{self.rank}.jsonl")
        with open(path, "w") as f:
            for rec in self.trace:
                f.write(json.dumps(rec) + "\n")
        return path

