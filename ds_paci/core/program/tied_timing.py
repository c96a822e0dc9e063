"""When may a tied-weight owner wait for its peers' window gradients? Pure timing over PACI streams.

A ``TiedLayerSpec`` whose copies live on several stages (GPT-2's embedding and LM head on the
first and last stage) needs the owners to apply the same total gradient. PACI's policy
(:mod:`ds_paci.core.tied.weights`): at its local step producing window ``k`` of a segment, every owner
posts its window-``k`` tied gradient to the other owners (non-blocking) and applies the sum, over
all owners, of window ``k - L``. This module answers which lag ``L`` makes that wait free: the
peers' window-``k - L`` gradients must already have been *posted* when an owner reaches its
step ``k``, guaranteed by the pipeline's own data dependencies, so waiting for them is transport
latency only, never a wait on another stage (with blocking rendezvous point-to-point transfers, a
wait on another stage can deadlock).

The rule (:func:`tied_lag`), from the stream timing (stage ``s`` of ``P``: forward of ``m`` at
tick ``2m + s``, backward at ``2m + 2P - s - 1``; window ``k`` closes after the backward of
``ka - 1``, so owner ``s`` posts at tick ``2ka + 2P - s - 3``):

* An earlier owner ``i`` waiting for a later owner ``j > i``: ``j``'s step ``k - L`` follows its
  backward of ``(k - L)a - 1``, whose input gradient flows back to ``i`` before ``i``'s own
  backward of that micro-batch and hence before ``i``'s step ``k - L <= k``. Any ``L >= 0`` is
  safe.
* A later owner ``j`` waiting for an earlier owner ``i < j``: the first message that leaves ``i``
  after its step ``k - L`` is the activation of micro-batch ``m' = (k - L)a + P - i - 1`` (the
  next forward); it reaches ``j`` at ``j``'s forward of ``m'`` (tick ``2m' + j``). That precedes
  ``j``'s step ``k`` iff ``La >= j - i + 1``. In a drain, ``m'`` exists only if it is below the
  number ``n`` of micro-batches started; step ``k`` is not the segment's last as soon as
  ``n >= ka + 1``, so the guarantee holds for every ``n`` iff ``m' <= ka``, i.e. ``La >= P - i - 1``.

Hence, with ``i`` the first and ``j`` the last owner stage, the same lag for all owners (they
must apply the same total)::

    L = ceil(max(j - i + 1, P - i - 1) / a)

GPT-2 tied on the first and last stage: ``L = ceil(P / a)``, so ``L = 1`` whenever ``a >= P``
(the default ``a = M = 4`` on 2 or 4 stages); ``a = P - 1`` needs ``L = 2``; ``a = 1`` on 4
stages needs ``L = 4``. The segment's last step of every owner is not covered: the engine runs
it after the drain's last tick, where every owner posts before it waits.

:func:`tied_wait_violations` checks a lag against actual streams by executing them with vector
clocks (only send -> receive edges count, so the result holds for buffered and rendezvous
transports alike); the tests run it over a grid of ``P``, ``a``, ``M``, calls and owner sets and
find the formula exact (``L - 1`` fails). Pure Python: no process group, no tensor.

**Windows carried across drains** (evaluation and checkpoints leave the accumulation window open and
the exchange keeps its last ``L`` windows pending into the next segment, :mod:`ds_paci.core.tied.weights`):
windows are then numbered over the whole stream, and a segment may start with ``f`` backward passes
already in its open window. The argument above is unchanged: both ``m'`` and the backward of window
``k`` shift by ``f``, so ``La >= j - i + 1`` still covers the steady state, and a step with a later
micro-batch in its segment is covered by ``La >= P - i - 1``. A window due from an earlier segment was
posted before the drain ended, which precedes every step of the next segment (each follows a transfer
of that segment from the peer's side of the pipeline). The only step not covered is a segment's last
step when it follows the segment's last backward: the engine defers it to after the drain.
``tied_wait_violations(..., carried=True)`` checks exactly this.
"""

import math

from .actions import Kind
from .interpreter import Handler, run_program

__all__ = ["tied_lag", "tied_wait_violations", "minimal_tied_lag"]


def tied_lag(stages, owner_stages, window):
    """Windows ``L`` by which the tied gradients lag (0 when fewer than two stages own the weights)."""
    owners = sorted(set(owner_stages))
    if len(owners) < 2:
        return 0
    if owners[0] < 0 or owners[-1] >= stages:
        raise ValueError(f"owner stages {owners} outside 0..{stages - 1}")
    if window < 1:
        raise ValueError(f"accumulation window must be >= 1, got {window}")
    first, last = owners[0], owners[-1]
    return math.ceil(max(last - first + 1, stages - first - 1) / window)


class _VectorClocks(Handler):
    """Happens-before of every local step: vector clocks over program order and send -> receive edges only (so
    the result holds for buffered and rendezvous transports alike)."""

    def __init__(self, segment_of, last_backward):
        P = len(segment_of)
        self.segment_of, self.last_backward = segment_of, last_backward
        self.clock = [[0] * P for _ in range(P)]
        self.position = [0] * P
        self.steps = {}  # (stage, segment, window) -> clock
        self.windows = [dict() for _ in range(P)]  # stage -> {segment: windows so far}
        self.by_version = {}  # (stage, version) -> (segment, clock, whether a backward follows it in the segment)

    def _advance(self, stage):
        i = self.position[stage]
        self.position[stage] += 1
        self.clock[stage][stage] += 1
        return i

    def run(self, stage, action, now):
        i = self._advance(stage)
        if action.kind is Kind.STEP:
            g, vc = self.segment_of[stage][i], list(self.clock[stage])
            k = self.windows[stage][g] = self.windows[stage].get(g, 0) + 1
            self.steps[(stage, g, k)] = vc
            self.by_version[(stage, action.version)] = (g, vc, i < self.last_backward[stage].get(g, -1))
        return None

    def transfer(self, sender, send, receiver, recv, arrivals):
        self._advance(sender)
        message = self.clock[sender]
        self.clock[receiver] = [max(x, y) for x, y in zip(self.clock[receiver], message)]
        self._advance(receiver)
        return 0.0


def _execute(segments):
    """Vector clocks of every local step: ``{(stage, segment, window): clock}``, windows per segment, and
    ``{(stage, version): (segment, clock, followed by a backward in its segment)}``; runs on
    :func:`~ds_paci.core.program.interpreter.run_program`."""
    program, segment_of, last_backward = [], [], []
    for s, stage_segments in enumerate(segments):
        ticks, of, last = [], [], {}
        for g, seg in enumerate(stage_segments):
            for tick in seg:
                for action in tick:
                    if action.kind is Kind.BACKWARD:
                        last[g] = len(of)
                    of.append(g)
                ticks.append(list(tick))
        program.append(ticks)
        segment_of.append(of)
        last_backward.append(last)
    clocks = _VectorClocks(segment_of, last_backward)
    run = run_program(program, clocks)
    if run.stuck:
        raise ValueError(f"streams deadlock (stages {[x.stage for x in run.stuck]} wait for messages that are never "
                         "sent)")
    return clocks.steps, clocks.windows, clocks.by_version


def _carried_violations(by_version, owners, lag, n_segments, last_segment_drained):
    out = []
    last_of = {}
    for (o, version), (g, _, _) in by_version.items():
        last_of[(o, g)] = max(version, last_of.get((o, g), 0))
    for (o, version), (g, mine, followed) in sorted(by_version.items()):
        if o not in owners or version - lag < 1:
            continue
        drained = g < n_segments - 1 or last_segment_drained
        if drained and version == last_of[(o, g)] and not followed:
            continue  # deferred to after the drain
        for q in owners:
            if q != o and by_version[(q, version - lag)][1][q] > mine[q]:
                out.append(f"segment {g}: stage {o} at its step {version} would wait for stage {q}'s window "
                           f"{version - lag}, which the streams do not guarantee has been posted")
    return out


def tied_wait_violations(segments, owner_stages, lag, last_segment_drained=True, carried=False):
    """Waits of the tied exchange that the streams do not make free; empty when ``lag`` is safe.

    ``segments[s]`` is stage ``s``'s list of segments (the ticks between two drains, as
    :meth:`PACIStream.advance` and :meth:`PACIStream.drain` return them). For every owner and
    every step ``k`` of a segment with ``k - lag >= 1`` (except the last step of a drained
    segment, which runs after the drain) each peer's step ``k - lag`` must happen before it.
    ``carried``: windows are numbered over the whole stream (the ``STEP``'s version; the exchange
    carries pending windows across drains), and only a drained segment's last step that no backward
    pass follows is exempt (see the module docstring).
    """
    steps, windows, by_version = _execute(segments)
    owners = sorted(set(owner_stages))
    n_segments = max(len(seg) for seg in segments)
    if carried:
        return _carried_violations(by_version, owners, lag, n_segments, last_segment_drained)
    out = []
    for g in range(n_segments):
        counts = {o: windows[o].get(g, 0) for o in owners}
        if len(set(counts.values())) > 1:
            out.append(f"segment {g}: owners took different numbers of steps {counts}")
            continue
        total = counts[owners[0]] if owners else 0
        drained = g < n_segments - 1 or last_segment_drained
        for o in owners:
            for k in range(1, total + 1):
                if k - lag < 1 or (drained and k == total):
                    continue
                mine = steps[(o, g, k)]
                for q in owners:
                    if q != o and steps[(q, g, k - lag)][q] > mine[q]:
                        out.append(f"segment {g}: stage {o} at its step {k} would wait for stage {q}'s window "
                                   f"{k - lag}, which the streams do not guarantee has been posted")
    return out


def minimal_tied_lag(segments, owner_stages, last_segment_drained=True):
    """The smallest lag with no violation on these streams (at most one more than the number of steps)."""
    lag = 0
    while tied_wait_violations(segments, owner_stages, lag, last_segment_drained):
        lag += 1
    return lag
