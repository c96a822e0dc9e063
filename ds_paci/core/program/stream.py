"""PACI instruction streams: persistent, bubble-free 1F1B per pipeline stage.

A *stream* is the sequence of *ticks* one stage executes; a tick is a list of
:class:`~ds_paci.core.program.actions.Action` (the program's vocabulary: loads, forwards,
backwards, the four transfers, ``ACC`` and ``STEP``). Streams are pure data: no
process group and no tensor is touched here, so the engine, the simulator and the
tests all consume the very same streams (after the lowering passes of
:mod:`ds_paci.core.program.passes`, which place what the runtime must reorder).

Timing (DeepSpeed's 1F1B tick formula with an unbounded micro-batch count), for
stage ``s`` of ``P`` and segment-local micro-batch ``m``::

    forward  of m at tick 2*m + s
    backward of m at tick 2*m + 2*P - s - 1

(without slack links, below) so stage ``s`` never holds more than ``P - s`` micro-batches in flight, and between
a micro-batch's forward and its backward the stage runs exactly ``min(m, P-1-s)``
other backward passes. With a local optimizer step after every ``window``-th
backward, a micro-batch crosses at most ``ceil((P-1-s)/window)`` steps (its drift).

A stream is cut into calls by :meth:`PACIStream.advance` (``2*M`` ticks per
``train_batch``, identical on every stage, so the cuts line up and point-to-point
pairs match) and ended by :meth:`PACIStream.drain`, the finite tail that completes
everything in flight. After a drain a new *segment* starts; micro-batch ids keep
increasing across calls and segments.

**Windows across drains.** ``drain(close_window=False)`` (what evaluation and
checkpoints use) leaves a partial accumulation window open: the next segment starts
with ``window_fill > 0`` and its first local step follows the ``(a - window_fill)``-th
backward of that segment, so a stage takes one local step per ``a`` backward passes
however often the stream is drained. ``drain()`` (``close_window=True``) steps the
partial window as it is (the end of training, a change of ``M``).

**The learning-rate rule.** Every ``STEP`` action carries ``lr_steps`` (``STEP3[lr2]`` in
the text form; omitted when 1): how many times the LR scheduler steps right after it. The stock
engine steps its scheduler once per ``train_batch``, i.e. once per ``M``
micro-batches; a PACI stage brings its scheduler, at each local step, to
``floor(n / M)`` where ``n`` counts the micro-batches whose gradients its local steps
have taken so far (kept across a change of ``M``: :meth:`PACIStream.set_micro_batches`).
With ``a = M`` that is one scheduler step per local step.

**Step phase** (``"paci": {"step_phase": ...}``). A stage's *phase* ``phi`` (``0 <= phi < a``) moves its local
steps: its first window (and the first after every closing drain) is a partial one of ``phi`` backward passes
when ``phi > 0``, every later one has ``a``; so the stage steps after its ``c``-th backward of a segment family
exactly when ``c = phi (mod a)``. ``"aligned"`` is ``phi = 0`` on every stage (every stage steps after the
backward of segment-local micro-batch ``k*a - 1``). ``"diagonal"`` is ``phi_s = s mod a``: stage ``s`` steps after
the backward of micro-batch ``m = k*a + s - 1``, at tick ``2m + 2P - s - 1``. Why that makes the steps of all
stages coincide: stage ``s`` sends the gradient of ``m`` (to ``s-1``) only after its step, and ``s-1`` needs it for
its backward of ``m``, which in the diagonal comes *after* ``s-1``'s own step (that one follows its backward of
``m-1``); and ``s``'s step follows nothing of ``s-1`` later than ``s-1``'s forward of ``m + P-1-s``, which comes
before ``s-1``'s step. So no step waits for another one of its wave: the ``P`` steps (and the data-parallel
reduces inside them) run at the same time, where ``"aligned"`` chains them along the gradient path (stage
``s+1``'s step delays the gradient ``s`` needs before its own step), ``min(P, a)`` of them one after another.
:func:`ds_paci.core.program.reduce_ticks.step_ticks` measures this on a program. The partial first window counts
only its real micro-batches in the LR rule, and its gradient is what the engine does with any partial window: the
sum of its backward passes' gradients, each scaled by ``1/a`` (as a closing drain steps one). The drift bound is
unchanged: within a segment consecutive steps are ``a`` backward passes apart and the first comes at most ``a``
after the segment's start, so ``n`` consecutive backward passes hold at most ``ceil(n/a)`` steps. Forwards in a
partial window carry its size (``open_window``) for the look-ahead.

**Slack links** (``"paci": {"slack_links": [...]}``). A bubble-free stream has no slack: stage ``s+1`` needs the
activation stage ``s`` computed one slot before, and ``s`` the gradient ``s+1`` computed one slot before, so every
micro-batch waits for one transfer over each link of the dependence chain (with non-blocking transfers as well:
only the sender stops waiting). Over a slow link (between nodes) that transfer adds to every micro-batch. A slack
link ``b`` (stage ``b`` to ``b+1``) gives it one micro-batch more: every stage ``s <= b`` runs one more forward
before its backward, i.e. with ``k_s`` the slack links at or after ``s``::

    forward  of m at tick 2*m + s                   (unchanged)
    backward of m at tick 2*m + 2*P - s - 1 + 2*k_s

Stage ``s`` then holds ``P - s + k_s`` micro-batches in flight (stage 0, the peak, ``P + k_0``) and a micro-batch
crosses at most ``ceil((P-1-s+k_s)/a)`` local steps. Across a slack link stage ``b`` receives the gradient of ``m``
two ticks after stage ``b+1`` computed it; the stream puts ``b+1``'s send at the tick of ``b``'s receive (a blocking
send one tick after the backward, as without slack, would meet ``b`` in a send of its own and deadlock), and its
input buffer of ``m`` holds that gradient until then (one buffer more there). With non-blocking transfers the send
is hoisted to right after the backward and the transfer overlaps the extra slot, which is the point; blocking
transfers gain nothing (both ends wait for it). The drain is ``2 k_0`` ticks longer on every stage.

Text form: :mod:`ds_paci.core.program.actions` (``L7``, ``F7[0,x]``, ``B7``, ``SA7``, ``RG7``,
``ACC7``, ``STEP3``; a tick joined by ``,``, a stream by `` | ``).

Every forward a :class:`PACIStream` generates carries two facts: ``window_fill``, the
backward passes already in the stage's open window when the forward runs, and
``crosses_step``, whether a local step falls between the forward and its backward (see
:func:`crosses_local_step`). The engine's look-ahead reads them.
"""
import math

from .actions import Action, Kind, format_stage, parse_stage

__all__ = [
    "PACIStream", "num_buffers", "buffer_of", "drift_bound", "slack_count", "check_slack", "crosses_local_step", "format_stream", "parse_stream",
    "STEP_PHASES", "step_phase"
]

#: The values of ``"paci": {"step_phase": ...}`` (see the module docstring).
STEP_PHASES = ("aligned", "diagonal")

format_stream = format_stage  # one stage's ticks as text (see ds_paci.core.program.actions)
parse_stream = parse_stage  # (text, stage) -> ticks


def slack_count(slack, stage_id):
    """``k_s``: the slack links at or after stage ``stage_id`` (``slack``: stages ``b`` whose link to ``b+1`` has
    slack); stage ``s`` holds ``k_s`` micro-batches more in flight than 1F1B's ``P - s``."""
    return sum(1 for b in set(slack) if b >= stage_id)


def check_slack(stages, slack):
    """``slack`` as a sorted tuple; ``ValueError`` naming the problem unless every entry is a link ``0 <= b < P-1``."""
    out = tuple(sorted(set(int(b) for b in slack)))
    bad = [b for b in out if not 0 <= b < stages - 1]
    if bad:
        raise ValueError(f"slack links {bad} do not exist: a link b joins stage b to b+1, so 0 <= b <= {stages - 2}")
    return out


def num_buffers(stages, stage_id, slack=()):
    """Activation buffers stage ``stage_id`` needs: its in-flight limit ``P - s + k_s`` (at least 2), and for a stage
    right after a slack link one more (its gradient of ``m`` waits for the upstream stage's later backward)."""
    upstream = slack_count(slack, stage_id - 1) if stage_id > 0 else slack_count(slack, 0)
    return max(2, stages - stage_id + upstream)


def buffer_of(stages, stage_id, micro_batch, slack=()):
    """The activation buffer of ``micro_batch`` at stage ``stage_id`` (micro-batches rotate through them)."""
    return micro_batch % num_buffers(stages, stage_id, slack)


def step_phase(rule, stage_id, window):
    """Stage ``stage_id``'s phase under ``rule`` (one of :data:`STEP_PHASES`): ``0`` aligned, ``s mod a`` diagonal."""
    if rule == "aligned":
        return 0
    if rule == "diagonal":
        return stage_id % window
    raise ValueError(f"unknown step phase {rule!r}; use one of {', '.join(STEP_PHASES)}")


def drift_bound(stages, stage_id, window, slack=()):
    """Most weight versions a micro-batch can cross between forward and backward at a stage."""
    return math.ceil((stages - 1 - stage_id + slack_count(slack, stage_id)) / window)


def crosses_local_step(window, window_fill, backwards_between):
    """Whether a forward crosses the stage's next local step.

    The forward is issued when the open window already holds ``window_fill`` backward
    passes, and the stage runs ``backwards_between`` other backward passes (``min(m, P-1-s)``
    for segment-local micro-batch ``m``) before the forward's own backward. A step follows
    the ``window``-th backward of a window, so it falls strictly between the forward and
    its backward exactly when ``window_fill + backwards_between >= window``. (The partial
    window a drain closes is stepped after the segment's last backward, so no forward
    crosses it.)
    """
    return window_fill + backwards_between >= window


class PACIStream:
    """The persistent PACI instruction stream of one pipeline stage.

    Args:
        stages: number of pipeline stages ``P``.
        stage_id: this stage ``s`` (0-based).
        window: local accumulation window ``a``: a ``STEP`` follows every
            ``a``-th backward pass of this stage.
        micro_batches: ``M``, the micro-batches of one ``train_batch`` call: the unit of
            the learning-rate rule (``Action.lr_steps``). Default: ``window``.
        phase: ``0 <= phase < window`` (:func:`step_phase`): the first window (and the first after each closing
            drain) closes after ``phase`` backward passes when ``phase > 0``.
        slack: the slack links ``b`` (stage ``b`` to ``b+1``; "Slack links" above), the same on every stage.

    State advances only through :meth:`advance` and :meth:`drain`, which return the
    ticks to execute. Every stage of a pipeline must be advanced by the same tick
    counts, in the same order, so their point-to-point transfers pair up.
    """

    def __init__(self, stages, stage_id, window, micro_batches=None, phase=0, slack=()):
        if stages < 1 or not 0 <= stage_id < stages:
            raise ValueError(f"invalid stage {stage_id} of {stages}")
        if window < 1:
            raise ValueError(f"accumulation window must be >= 1, got {window}")
        if not 0 <= phase < window:
            raise ValueError(f"step phase must be in [0, {window}), got {phase}")
        self.phase = phase
        self.slack = check_slack(stages, slack)
        self.extra = slack_count(self.slack, stage_id)  # k_s: micro-batches in flight beyond 1F1B's P - s
        self.lag = 2 * stages - stage_id - 1 + 2 * self.extra  # backward of m at tick 2m + lag
        # the upstream stage receives the gradient of m at tick 2m + up_lag: this stage sends it then
        self.up_lag = 2 * stages - stage_id + 2 * slack_count(self.slack, stage_id - 1) if stage_id else None
        self.stages = stages
        self.stage_id = stage_id
        self.window = window
        self.micro_batches = micro_batches or window
        self.nbuf = num_buffers(stages, stage_id, self.slack)
        self.segment_tick = 0  # ticks emitted in the current segment
        self.segment_base = 0  # global id of the segment's micro-batch 0
        self.window_fill = 0  # backward passes in the open window (carried across a drain that leaves it open)
        self.window_target = self.first_window()  # backward passes after which the open window steps
        self.version = 0  # local steps emitted so far
        self.ticks_emitted = 0  # over all segments
        self.lr_count = 0  # LR-scheduler steps emitted so far (sum of the STEPs' lr_steps)
        self._applied = 0  # micro-batches taken by local steps since the last change of M ...
        self._lr_base = 0  # ... and lr_count at that change

    # -- queries -------------------------------------------------------------------
    def first_window(self):
        """Size of the first window of a segment family (the start, and after a closing drain): the phase, or ``a``."""
        return self.phase or self.window

    def loaded(self):
        """Micro-batches stage 0 has loaded in the current segment (the drain's limit)."""
        return (self.segment_tick + 1) // 2

    def in_flight(self):
        """Micro-batches forwarded but not yet backwarded at this stage."""
        t, s = self.segment_tick, self.stage_id
        forwarded = max(0, (t - s + 1) // 2)  # m with 2m + s < t
        backwarded = max(0, (t - self.lag + 1) // 2)
        return forwarded - backwarded

    def next_micro_batch(self):
        """Global id of the next micro-batch stage 0 will load."""
        return self.segment_base + self.loaded()

    # -- generation ----------------------------------------------------------------
    def _step_id(self, t):
        """(segment-local micro-batch, is_forward) for segment tick ``t``."""
        s = self.stage_id
        if (t - s) % 2 == 0:
            return (t - s) // 2, True
        return (t - self.lag) // 2, False

    def _tick(self, t, limit):
        """Instructions of segment tick ``t``; micro-batches ``>= limit`` are not started (None = unbounded)."""

        def valid(m):
            return m >= 0 and (limit is None or m < limit)

        s, P, base = self.stage_id, self.stages, self.segment_base
        m, is_forward = self._step_id(t)
        prev, _ = self._step_id(t - 1) if t > 0 else (-1, None)
        cmds = []
        if is_forward:
            sent = (t - self.up_lag) // 2 if s > 0 else -1  # = prev without slack
            if valid(sent) and s > 0:
                cmds.append(Action(s, Kind.SEND_GRAD, base + sent))
            if valid(m) and s > 0:
                cmds.append(Action(s, Kind.RECV_ACT, base + m))
            if valid(m) and (s == 0 or s == P - 1):
                cmds.append(Action(s, Kind.LOAD, base + m))
            if valid(m):
                # Known now, from the stream: backward passes already in the open window, and whether a local
                # step will fall between this forward and its backward (the look-ahead predicts for those).
                target = self.window_target
                cmds.append(Action(s, Kind.FORWARD, base + m, window_fill=self.window_fill,
                                   crosses_step=crosses_local_step(target, self.window_fill,
                                                                   min(m, P - 1 - s + self.extra)),
                                   open_window=None if target == self.window else target))
        else:
            if valid(m) and s < P - 1:
                cmds.append(Action(s, Kind.RECV_GRAD, base + m))
            if valid(prev) and s < P - 1:
                cmds.append(Action(s, Kind.SEND_ACT, base + prev))
            if valid(m):
                cmds.append(Action(s, Kind.BACKWARD, base + m))
                cmds.append(Action(s, Kind.ACCUMULATE, base + m))
                self.window_fill += 1
                if self.window_fill == self.window_target:
                    cmds.append(self._local_step())
        return cmds

    def _local_step(self):
        target = self._lr_base + (self._applied + self.window_fill) // self.micro_batches
        step = Action(self.stage_id, Kind.STEP, version=self.version + 1, lr_steps=target - self.lr_count)
        self._applied += self.window_fill
        self.lr_count = target
        self.window_fill = 0
        self.window_target = self.window
        self.version += 1
        return step

    def set_micro_batches(self, micro_batches, window=None, phase=None):
        """A new ``M`` (and window, and phase) from the next segment on; the stream must be drained.

        The learning-rate rule keeps its count: micro-batches stepped under the old ``M`` count in units of
        the old ``M``. Changing the window or the phase needs a closed window (``drain()``); the next window is
        then the new phase's first.
        """
        if self.segment_tick:
            raise RuntimeError("set_micro_batches() on a stream that is not drained; call drain() first")
        if window is not None and window != self.window and self.window_fill:
            raise RuntimeError(f"cannot change the window from {self.window} to {window} with {self.window_fill} "
                               "backward passes in the open window; drain() (close_window=True) first")
        new_window = self.window if window is None else window
        new_phase = self.phase if phase is None else phase
        if (new_window, new_phase) != (self.window, self.phase):
            if self.window_fill:
                raise RuntimeError(f"cannot change the step phase with {self.window_fill} backward passes in the open "
                                   "window; drain() (close_window=True) first")
            if not 0 <= new_phase < new_window:
                raise ValueError(f"step phase must be in [0, {new_window}), got {new_phase}")
        self._lr_base += self._applied // self.micro_batches
        self._applied %= self.micro_batches
        self.micro_batches = micro_batches
        if (new_window, new_phase) != (self.window, self.phase):
            self.window, self.phase = new_window, new_phase
            self.window_target = self.first_window()

    def advance(self, n_ticks):
        """The next ``n_ticks`` ticks of the unbounded stream (one ``train_batch`` is ``2*M``)."""
        ticks = [self._tick(self.segment_tick + i, None) for i in range(n_ticks)]
        self.segment_tick += n_ticks
        self.ticks_emitted += n_ticks
        return ticks

    def drain(self, close_window=True):
        """The finite tail: completes every started micro-batch; with ``close_window`` also the open window.

        Returns the remaining ticks (the same count on every stage; with ``close_window``
        plus one extra tick holding only a ``STEP`` where this stage's last
        backward had already run before the drain began). Afterwards nothing is in flight
        and a new segment begins. ``close_window=False`` leaves a partial window open: the
        next segment continues it (``window_fill`` > 0).
        """
        limit = self.loaded()
        end = 2 * (limit + self.stages - 1 + slack_count(self.slack, 0)) if limit else 0
        ticks = [self._tick(t, limit) for t in range(self.segment_tick, end)]
        if self.window_fill and close_window:
            step = self._local_step()
            last_backward = limit - 1 + self.segment_base
            for tick in reversed(ticks):
                if any(i.kind is Kind.BACKWARD and i.micro_batch == last_backward for i in tick):
                    tick.append(step)
                    break
            else:
                ticks.append([step])
        if close_window:  # the next segment starts a new family: the phase's partial first window again
            self.window_target = self.first_window()
        self.ticks_emitted += len(ticks)
        self.segment_base += limit
        self.segment_tick = 0
        return ticks

    def state_dict(self):
        """Position of a drained stream (what a checkpoint must keep), including an open window's fill."""
        if self.in_flight() or self.segment_tick:
            raise RuntimeError("state_dict() of a stream that is not drained; call drain() first")
        return {"next_micro_batch": self.segment_base, "version": self.version, "ticks_emitted": self.ticks_emitted,
                "window": self.window, "window_fill": self.window_fill, "micro_batches": self.micro_batches,
                "lr_count": self.lr_count,
                "applied": self._applied, "lr_base": self._lr_base,
                "phase": self.phase, "window_target": self.window_target}

    def load_state_dict(self, state):
        """Restore :meth:`state_dict`. States written before the learning-rate rule existed (closed windows, one
        scheduler step per local step) continue with the current ``M`` from the scheduler count they imply.

        The phase is this stream's own (the run's configuration). A state saved under the same phase and window
        continues its open window exactly (its size included); one saved under another phase or window (states
        without a phase were saved aligned) must have a closed window (``ValueError`` otherwise: a resume refuses
        it before, :mod:`ds_paci.core.engine.resume`) and continues with this phase's first window, so all stages
        are in the new phase at once (every stage of a drained pipeline has taken the same micro-batches)."""
        self.segment_base = int(state["next_micro_batch"])
        self.version = int(state["version"])
        self.ticks_emitted = int(state.get("ticks_emitted", 0))
        self.segment_tick = 0
        self.window_fill = int(state.get("window_fill", 0))
        same = (int(state.get("phase", 0)) == self.phase and int(state.get("window", self.window)) == self.window)
        if same:
            self.window_target = int(state.get("window_target", self.window))
        elif self.window_fill:
            raise ValueError(f"a stream state with an open window ({self.window_fill} backward passes) saved under phase "
                             f"{state.get('phase', 0)} of window {state.get('window', self.window)} cannot continue "
                             f"under phase {self.phase} of window {self.window}")
        else:
            self.window_target = self.first_window()
        if "lr_count" in state:
            self.micro_batches = int(state["micro_batches"])
            self.lr_count = int(state["lr_count"])
            self._applied = int(state["applied"])
            self._lr_base = int(state["lr_base"])
        else:
            self.lr_count = self.version
            self._applied = self.segment_base
            self._lr_base = self.version - self.segment_base // self.micro_batches
