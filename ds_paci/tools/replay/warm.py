"""The replay's synchronous warm start (its ``sync_calls``): stock's schedule first, then the run's streams.

The engine's counterpart is :mod:`ds_paci.core.engine.warm_start`; both switch every stage's
:class:`~ds_paci.core.program.stream.PACIStream` with ``set_micro_batches`` at a drained point, and an ``"auto"``
warm start ends where :class:`~ds_paci.core.program.warm_end.WarmEnd` says, on the last stage's labels and loss.
"""

from ds_paci.core.program.stream import step_phase as phase_of
from ds_paci.core.program.warm_end import AUTO, WarmEnd


def set_schedule(pipe, schedule, lr, scales):
    """Put every stage of a drained ``pipe`` on sync mode's schedule (``schedule=None``: window ``M``, aligned, no
    prediction) or on ``(mode, windows, step phase rule)``, through ``PACIStream.set_micro_batches`` as the engine's
    warm start does (:mod:`ds_paci.core.engine.warm_start`); learning rates ``lr * scales[s]``."""
    stages, micro_batches = len(pipe.stages), pipe.micro_batches
    mode, windows, rule = schedule or ("sync", [micro_batches] * stages, "aligned")
    pipe.mode = mode
    for s, st in enumerate(pipe.stages):
        st.window = windows[s]
        st.stream.set_micro_batches(micro_batches, windows[s], phase_of(rule, s, windows[s]))
        for opt in st.optimizers:
            for group in opt.param_groups:
                group["lr"] = lr * scales[s]


class WarmStart:
    """The replay's synchronous warm start (``sync_calls``, see :func:`replay`): sync mode's schedule first, then
    the run's, switched where the engine's :mod:`~ds_paci.core.engine.warm_start` switches."""

    def __init__(self, pipe, sync_calls, ratio, lr, scheduler):
        self.pipe, self.sync_calls, self.lr = pipe, sync_calls, lr
        self.on, self.calls = bool(sync_calls), 0
        self.end = WarmEnd(ratio) if self.on and sync_calls == AUTO else None
        if self.on:
            if scheduler is not None:
                raise ValueError("sync_calls with a learning-rate schedule is not supported by the replay")
            set_schedule(pipe, None, lr, [1.0] * len(pipe.stages))
            pipe.label_counts = [] if self.end is not None else None

    def before(self, step, schedule, scales):
        """Before call ``step``: switch to ``schedule`` where the warm start has ended."""
        if self.on and (self.end.due() if self.end is not None else step == self.sync_calls + 1):
            set_schedule(self.pipe, schedule, self.lr, scales)
            self.on, self.pipe.label_counts = False, None

    def after(self, loss):
        """After a call: count it, and feed an ``"auto"`` warm start's rule its labels and loss."""
        self.calls += self.on
        if self.on and self.end is not None:
            for histogram in self.pipe.label_counts:
                self.end.observe_labels(histogram)
            self.pipe.label_counts = []
            self.end.observe_loss(loss)
