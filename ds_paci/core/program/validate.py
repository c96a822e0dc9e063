"""One check of a program against the PACI contract: :func:`validate`.

What runs is what is checked: the engine executes the lowered program (:mod:`ds_paci.core.program.passes`), and
:func:`validate` reads that same program. Per stage (:func:`stage_violations`): forward before backward
of every micro-batch, loads only on the first and last stage and before the forward, in-flight
``<= P - s + k_s`` (``k_s``: slack links at or after ``s``), a local step after exactly every ``window``-th backward of a window (counting the ones a
segment carries in; the segment's first window may be a partial one, the step phase's, of a size the caller
states; a final partial window may close at the end), step versions consecutive, drift
``<= ceil((P-1-s+k_s)/window)``, activation buffers never reused while occupied, the forwards' facts
(``window_fill``, ``crosses_step``, ``open_window``) true, a tied post right before its step and no tied window applied
before its lag allows. Across stages (:func:`pairing_violations`): sends and receives pair up, in order.
Tied timing (``tied`` given): :func:`ds_paci.core.program.tied_timing.tied_wait_violations`.

Every function returns a list of messages; empty means valid. Pure data.
"""

from .actions import Kind
from .stream import buffer_of, drift_bound, slack_count

__all__ = ["validate", "stage_violations", "stream_violations", "pairing_violations"]


class _StageCheck:
    """The running state of :func:`stage_violations` over one stage's actions."""

    def __init__(self, stages, stage_id, window, start_version, start_fill, start_target=None, slack=()):
        self.stages, self.stage_id, self.window, self.slack = stages, stage_id, window, tuple(slack)
        self.limit = stages - stage_id + slack_count(slack, stage_id)  # most micro-batches in flight
        # right after a slack link the input buffer of m holds its gradient until the later SEND_GRAD
        self.held_to_send = stage_id > 0 and slack_count(slack, stage_id - 1) > slack_count(slack, stage_id)
        self.target = window if start_target is None else start_target  # the open window's size
        self.bound = drift_bound(stages, stage_id, window, slack)
        self.fwd_version, self.occupied, self.crossing_tag = {}, {}, {}
        self.done, self.loaded = set(), set()
        self.version, self.fill = start_version, start_fill
        self.posted = None  # the tied window posted since the last step
        self.out = []

    def where(self, t, action):
        return f"stage {self.stage_id} tick {t} {action}"

    def load(self, t, a):
        if 0 < self.stage_id < self.stages - 1:
            self.out.append(f"{self.where(t, a)}: a middle stage loads data")
        self.loaded.add(a.micro_batch)

    def forward(self, t, a):
        m, where = a.micro_batch, self.where(t, a)
        if m in self.fwd_version or m in self.done:
            self.out.append(f"{where}: forward twice")
        if (self.stage_id == 0 or self.stage_id == self.stages - 1) and m not in self.loaded:
            self.out.append(f"{where}: forward before load")
        b = buffer_of(self.stages, self.stage_id, m, self.slack)
        if b in self.occupied:
            self.out.append(f"{where}: buffer {b} still holds micro-batch {self.occupied[b]}")
        self.occupied[b] = m
        self.fwd_version[m] = self.version
        if a.window_fill is not None:
            if a.window_fill != self.fill:
                self.out.append(f"{where}: tagged window_fill {a.window_fill}, the open window holds {self.fill}")
            tagged = self.window if a.open_window is None else a.open_window
            if tagged != self.target:
                self.out.append(f"{where}: tagged open window {tagged}, the open window closes after {self.target}")
            self.crossing_tag[m] = a.crosses_step
        if len(self.fwd_version) > self.limit:
            self.out.append(f"{where}: {len(self.fwd_version)} in flight > {self.limit}")

    def backward(self, t, a):
        m, where = a.micro_batch, self.where(t, a)
        if m not in self.fwd_version:
            self.out.append(f"{where}: backward without forward")
            return
        drift = self.version - self.fwd_version.pop(m)
        if drift > self.bound:
            self.out.append(f"{where}: drift {drift} > bound {self.bound}")
        if m in self.crossing_tag and self.crossing_tag.pop(m) != (drift >= 1):
            self.out.append(f"{where}: forward tagged crosses_step={not drift >= 1} but crossed {drift} steps")
        if not self.held_to_send:
            self.release(m)
        self.done.add(m)
        self.fill += 1

    def release(self, m):
        b = buffer_of(self.stages, self.stage_id, m, self.slack)
        if self.occupied.get(b) == m:
            del self.occupied[b]

    def step(self, t, a, last):
        where = self.where(t, a)
        if a.version != self.version + 1:
            self.out.append(f"{where}: version {a.version} after {self.version}")
        self.version = a.version
        if self.fill != self.target and not (last and 0 < self.fill < self.target):
            detail = "" if self.target == self.window else f" (a partial window of {self.target})"
            self.out.append(f"{where}: step after {self.fill} backwards, window is {self.window}{detail}")
        if self.posted not in (None, a.version):
            self.out.append(f"{where}: the tied window posted before it is {self.posted}")
        self.fill, self.posted, self.target = 0, None, self.window

    def tied(self, t, a, next_step):
        where = self.where(t, a)
        if a.kind is Kind.TIED_POST:
            if a.version != next_step:
                self.out.append(f"{where}: posts window {a.version} before step {next_step}")
            self.posted = a.version
        elif not a.apply_all and a.lag is not None and max(a.windows) > (next_step or 0) - a.lag:
            self.out.append(f"{where}: applies window {max(a.windows)} before its lag {a.lag} allows "
                            f"(next step {next_step})")


def _last_step_index(ticks):
    """Index of the last tick with a backward or a step (a final partial window may close there or later)."""
    return max((t for t, tick in enumerate(ticks) for a in tick if a.kind in (Kind.BACKWARD, Kind.STEP)),
               default=-1)


def stage_violations(ticks, stages, stage_id, window, expect_drained=True, start_version=0, start_fill=0,
                     expect_closed=None, start_target=None, slack=()):
    """Check one segment of one stage's ticks against the PACI contract (see the module docstring).

    A segment is what runs between two drains (or from the start); ``start_version`` is the weight version
    it starts at and ``start_fill`` the backward passes already in its open window (a window carried across
    the drain before it). ``start_target``: the size of that open window (default ``window``; the step phase's
    partial first window: :mod:`ds_paci.core.program.stream`). ``slack``: the stream's slack links (in-flight limit,
    buffers and drift bound grow with them). ``expect_drained``: nothing in flight at the end;
    ``expect_closed`` (by default ``expect_drained``): no open window at the end.
    """
    if expect_closed is None:
        expect_closed = expect_drained
    check = _StageCheck(stages, stage_id, window, start_version, start_fill, start_target, slack)
    flat = [(t, a) for t, tick in enumerate(ticks) for a in tick]
    steps_after = {}  # position -> version of the next STEP
    upcoming = None
    for n in range(len(flat) - 1, -1, -1):
        steps_after[n] = upcoming
        if flat[n][1].kind is Kind.STEP:
            upcoming = flat[n][1].version
    last_tick = _last_step_index(ticks)
    for n, (t, a) in enumerate(flat):
        kind = a.kind
        if kind is Kind.LOAD:
            check.load(t, a)
        elif kind is Kind.FORWARD:
            check.forward(t, a)
        elif kind is Kind.BACKWARD:
            check.backward(t, a)
        elif kind is Kind.SEND_GRAD and check.held_to_send:
            check.release(a.micro_batch)
        elif kind is Kind.ACCUMULATE and a.micro_batch not in check.done:
            check.out.append(f"{check.where(t, a)}: accumulate before backward")
        elif kind is Kind.STEP:
            check.step(t, a, last=t in (len(ticks) - 1, last_tick))
        elif kind in (Kind.TIED_POST, Kind.TIED_APPLY):
            check.tied(t, a, steps_after[n])
        if n + 1 == len(flat) or flat[n + 1][0] != t:
            if check.fill > check.target:
                check.out.append(f"stage {stage_id} tick {t}: {check.fill} backwards without a step (window "
                                 f"{check.target})")
    if expect_drained and check.fwd_version:
        check.out.append(f"stage {stage_id}: still in flight at the end: {sorted(check.fwd_version)}")
    if expect_closed and check.fill:
        check.out.append(f"stage {stage_id}: window left open with {check.fill} backwards")
    return check.out


stream_violations = stage_violations  # the name the tests and tools have used


def pairing_violations(program):
    """Sends and receives pair up, in order, between neighbouring stages (``program[s]``: stage ``s``'s ticks)."""
    out = []

    def seq(ticks, kind):
        return [a.micro_batch for tick in ticks for a in tick if a.kind is kind]

    for s in range(len(program) - 1):
        sa, ra = seq(program[s], Kind.SEND_ACT), seq(program[s + 1], Kind.RECV_ACT)
        if sa != ra:
            out.append(f"activations {s}->{s + 1}: sent {sa} but received {ra}")
        sg, rg = seq(program[s + 1], Kind.SEND_GRAD), seq(program[s], Kind.RECV_GRAD)
        if sg != rg:
            out.append(f"gradients {s + 1}->{s}: sent {sg} but received {rg}")
    return out


def validate(program, window, expect_drained=True, start_versions=None, start_fills=None, tied_owners=None,
             tied_lag=None, start_targets=None, phases=None, slack=()):
    """Every check over one segment of a whole program (``program[s]`` = stage ``s``'s ticks).

    ``window``: ``a`` (one for all stages, or a list per stage); ``start_versions`` / ``start_fills`` /
    ``start_targets``: per stage, as :func:`stage_violations` takes them; ``phases``: per stage, the step phase of a
    program that starts a segment family (the start, or after a closing drain): its first window's size is the
    phase, or ``a`` where the phase is 0 (used where ``start_targets`` is not given); ``tied_owners`` and ``tied_lag``: also check that the
    lag makes every tied wait free (:func:`ds_paci.core.program.tied_timing.tied_wait_violations`); ``slack``: the
    streams' slack links (:mod:`ds_paci.core.program.stream`).
    """
    P = len(program)
    windows = window if isinstance(window, (list, tuple)) else [window] * P
    if start_targets is None and phases is not None:
        start_targets = [phase or a for phase, a in zip(phases, windows)]
    out = []
    for s, ticks in enumerate(program):
        out += stage_violations(ticks, P, s, windows[s], expect_drained=expect_drained,
                                start_version=(start_versions or [0] * P)[s], start_fill=(start_fills or [0] * P)[s],
                                start_target=(start_targets or [None] * P)[s], slack=slack)
    out += pairing_violations(program)
    if tied_owners:
        from .tied_timing import tied_wait_violations
        out += tied_wait_violations([[ticks] for ticks in program], tied_owners, tied_lag,
                                    last_segment_drained=expect_drained)
    return out
