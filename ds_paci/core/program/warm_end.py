"""When a synchronous warm start ends (``"paci": {"sync_warmup_calls": "auto"}``): on the loss, not on a count.

A language model first learns the labels' unigram distribution: its loss falls to the labels' unigram entropy
``H1`` (the best a model that ignores its context can do) and can sit there, on a plateau, before it learns to use
the context. PACI's asynchrony delays that escape (issue 30, ``docs/results/quality-candidates.md``); a
synchronous warm start long enough to cover it leaves PACI's streams at stock's quality, one that ends on the
plateau is worse than none. So the warm start ends after the first call at which the mean loss of the last
``span`` calls is below ``ratio * H1``: the model has left the plateau clearly. ``H1`` is the plug-in entropy
(nats) of the label counts seen in the warm start's calls; the loss is what ``train_batch`` returns (the mean
cross-entropy in nats over the call's micro-batches).

:class:`WarmEnd` holds that decision's state: pure Python (the caller counts labels), saved with a checkpoint
(:meth:`state_dict`) so that a resumed run ends its warm start at the same call as an uninterrupted one. The
engine (:mod:`ds_paci.core.engine.warm_start`) and the replay (:mod:`ds_paci.tools.replay.replayer`) both use it.
"""

import math
import operator
from collections import deque

AUTO = "auto"
DEFAULT_RATIO = 0.9  # loss below 0.9 x H1: clearly off the unigram plateau (docs/results/quality-candidates.md)
SPAN = 8  # calls averaged: one call's loss is a few micro-batches, too noisy to end on


def unigram_entropy(counts) -> float:
    """Plug-in entropy (nats) of a histogram ``counts`` (a sequence of non-negative numbers); ``nan`` if empty."""
    total = float(sum(counts))
    if total <= 0:
        return math.nan
    # H = log(total) - sum(c log c) / total: one log per non-zero count (a vocabulary of 50k costs milliseconds)
    return math.log(total) - math.fsum(c * math.log(c) for c in counts if c > 0) / total


class WarmEnd:
    """The end of an ``"auto"`` warm start: feed each warm call's label histogram (:meth:`observe_labels`) and loss
    (:meth:`observe_loss`); :meth:`due` says whether the warm start ends after this call.

    ``ratio``: the warm start ends once the mean of the last ``span`` call losses is below ``ratio * H1``.
    A non-finite loss never ends it (it enters the mean, which is then non-finite).
    """

    def __init__(self, ratio: float = DEFAULT_RATIO, span: int = SPAN):
        if not ratio > 0 or span < 1:
            raise ValueError(f"ratio must be > 0 and span >= 1, got {ratio} and {span}")
        self.ratio, self.span = float(ratio), int(span)
        self.counts = []  # label id -> count over the warm start's calls
        self.losses = deque(maxlen=self.span)

    def observe_labels(self, histogram) -> None:
        """Add a histogram of label ids (a list of ints, ``histogram[i]``: how many labels equal ``i``); the engine
        adds one per call."""
        histogram = list(histogram)
        if len(histogram) > len(self.counts):
            self.counts.extend([0] * (len(histogram) - len(self.counts)))
        head = list(map(operator.add, self.counts, histogram))  # as long as the shorter: histogram's
        self.counts[:len(head)] = head

    def observe_loss(self, loss: float) -> None:
        """Record one warm call's loss."""
        self.losses.append(float(loss))

    @property
    def entropy(self) -> float:
        return unigram_entropy(self.counts)

    @property
    def mean_loss(self) -> float:
        return sum(self.losses) / len(self.losses) if self.losses else math.nan

    def due(self) -> bool:
        """Whether the warm start ends now: ``span`` calls seen and their mean loss below ``ratio * H1``."""
        if len(self.losses) < self.span:
            return False
        mean, entropy = self.mean_loss, self.entropy
        return math.isfinite(mean) and math.isfinite(entropy) and mean < self.ratio * entropy

    def describe(self) -> str:
        """The numbers behind :meth:`due`, for the line that says the warm start ended."""
        return (f"mean loss of the last {len(self.losses)} calls {self.mean_loss:.4f} < {self.ratio:g} x the labels' "
                f"unigram entropy {self.entropy:.4f}")

    def state_dict(self) -> dict:
        return {"ratio": self.ratio, "span": self.span, "counts": list(self.counts), "losses": list(self.losses)}

    def load_state_dict(self, state: dict) -> None:
        self.counts = [int(c) for c in state.get("counts", [])]
        self.losses = deque((float(x) for x in state.get("losses", [])), maxlen=self.span)
