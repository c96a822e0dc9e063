"""PACI instruction streams: persistent, bubble-free 1F1B per pipeline stage.

A *stream* is the sequence of *ticks* one stage executes; a tick is a list of
instructions (DeepSpeed's own :mod:`deepspeed.runtime.pipe.schedule` vocabulary plus
PACI's :class:`LocalAccumulate` and :class:`LocalStep`). Streams are pure data: no
process group and no tensor is touched here, so the engine, the simulator and the
tests all consume the very same streams.

Timing (DeepSpeed's 1F1B tick formula with an unbounded micro-batch count), for
stage ``s`` of ``P`` and segment-local micro-batch ``m``::

    forward  of m at tick 2*m + s
    backward of m at tick 2*m + 2*P - s - 1

so stage ``s`` never holds more than ``P - s`` micro-batches in flight, and between
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

**The learning-rate rule.** Every :class:`LocalStep` carries ``lr_steps`` (not part of
the text form): how many times the LR scheduler steps right after it. The stock
engine steps its scheduler once per ``train_batch``, i.e. once per ``M``
micro-batches; a PACI stage brings its scheduler, at each local step, to
``floor(n / M)`` where ``n`` counts the micro-batches whose gradients its local steps
have taken so far (kept across a change of ``M``: :meth:`PACIStream.set_micro_batches`).
With ``a = M`` that is one scheduler step per local step.

Text form (round-trips with :func:`parse_instruction` / :func:`format_instruction`)::

    L7   load micro-batch 7            F7   forward 7       B7   backward 7
    SA7  send activation of 7          RA7  receive activation of 7
    SG7  send gradient of 7            RG7  receive gradient of 7
    ACC7 gradient of 7 joins the open window
    STEP3 local step producing weight version 3

A tick prints as its instructions joined by ``,`` (``-`` when empty), a stream as
its ticks joined by `` | ``.

Every :class:`ForwardPass` a :class:`PACIStream` generates carries two attributes
(not part of the text form): ``window_fill``, the backward passes already in the
stage's open window when the forward runs, and ``crosses_step``, whether a local
step falls between the forward and its backward (see :func:`crosses_local_step`).
The engine's look-ahead reads them.
"""

import math
import re

from deepspeed.runtime.pipe.schedule import (BackwardPass, BufferOpInstruction, ForwardPass, LoadMicroBatch,
                                             PipeInstruction, RecvActivation, RecvGrad, SendActivation, SendGrad)

__all__ = [
    "LocalAccumulate", "LocalStep", "PACIStream", "num_buffers", "drift_bound", "crosses_local_step",
    "format_instruction", "parse_instruction", "format_tick", "parse_tick", "format_stream", "parse_stream",
    "micro_batch_of", "stream_violations", "pairing_violations"
]


class LocalAccumulate(BufferOpInstruction):
    """The gradient of the micro-batch in ``buffer_id`` joins the stage's open window.

    Issued right after the micro-batch's :class:`BackwardPass`. The engine records the
    micro-batch's drift here (weight versions crossed since its forward).
    """


class LocalStep(PipeInstruction):
    """Stage-local optimizer step that produces weight version ``version``.

    Data-parallel gradient reduce within the stage's DP group, stage-local clipping,
    optimizer step, ``lr_steps`` LR-scheduler steps (see the module docstring), zero
    grads. No other stage takes part.
    """

    def __init__(self, version, lr_steps=1, **kwargs):
        super().__init__(version=version, **kwargs)
        self.lr_steps = lr_steps


# Text codes. Order matters for parsing: longer prefixes first.
_CODES = [
    ("STEP", LocalStep),
    ("ACC", LocalAccumulate),
    ("SA", SendActivation),
    ("RA", RecvActivation),
    ("SG", SendGrad),
    ("RG", RecvGrad),
    ("L", LoadMicroBatch),
    ("F", ForwardPass),
    ("B", BackwardPass),
]
_CODE_OF = {cls: code for code, cls in _CODES}
_CLASS_OF = {code: cls for code, cls in _CODES}
_TOKEN = re.compile(r"^(STEP|ACC|SA|RA|SG|RG|L|F|B)(\d+)$")


def num_buffers(stages, stage_id):
    """Activation buffers stage ``stage_id`` needs: its 1F1B in-flight limit ``P - s`` (at least 2)."""
    return max(2, stages - stage_id)


def drift_bound(stages, stage_id, window):
    """Most weight versions a micro-batch can cross between forward and backward at a stage."""
    return math.ceil((stages - 1 - stage_id) / window)


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


def micro_batch_of(instr):
    """Micro-batch id an instruction refers to, or ``None`` for :class:`LocalStep`."""
    return getattr(instr, "micro_batch_id", None)


def _make(cls, micro_batch, nbuf):
    return cls(micro_batch % nbuf, micro_batch_id=micro_batch)


def format_instruction(instr):
    """Compact text of one instruction, e.g. ``F3`` or ``STEP1``."""
    code = _CODE_OF.get(type(instr))
    if code is None:
        raise ValueError(f"no text form for instruction {instr!r}")
    if isinstance(instr, LocalStep):
        return f"STEP{instr.version}"
    return f"{code}{instr.micro_batch_id}"


def parse_instruction(token, nbuf):
    """Inverse of :func:`format_instruction`; ``nbuf`` is the stage's buffer count (see :func:`num_buffers`)."""
    match = _TOKEN.match(token.strip())
    if not match:
        raise ValueError(f"not an instruction: {token!r} (expected e.g. F3, B3, SA3, RG3, L3, ACC3, STEP1)")
    code, number = match.group(1), int(match.group(2))
    if code == "STEP":
        return LocalStep(number)
    return _make(_CLASS_OF[code], number, nbuf)


def format_tick(tick):
    return ",".join(format_instruction(i) for i in tick) or "-"


def parse_tick(text, nbuf):
    text = text.strip()
    if text == "-":
        return []
    return [parse_instruction(tok, nbuf) for tok in text.split(",")]


def format_stream(ticks):
    """One stage's ticks as text, e.g. ``L0,F0 | SA0 | RG0,B0,ACC0,STEP1``."""
    return " | ".join(format_tick(t) for t in ticks)


def parse_stream(text, nbuf):
    if not text.strip():
        return []
    return [parse_tick(t, nbuf) for t in text.split("|")]


class PACIStream:
    """The persistent PACI instruction stream of one pipeline stage.

    Args:
        stages: number of pipeline stages ``P``.
        stage_id: this stage ``s`` (0-based).
        window: local accumulation window ``a``: a :class:`LocalStep` follows every
            ``a``-th backward pass of this stage.
        micro_batches: ``M``, the micro-batches of one ``train_batch`` call: the unit of
            the learning-rate rule (``LocalStep.lr_steps``). Default: ``window``.

    State advances only through :meth:`advance` and :meth:`drain`, which return the
    ticks to execute. Every stage of a pipeline must be advanced by the same tick
    counts, in the same order, so their point-to-point transfers pair up.
    """

    def __init__(self, stages, stage_id, window, micro_batches=None):
        if stages < 1 or not 0 <= stage_id < stages:
            raise ValueError(f"invalid stage {stage_id} of {stages}")
        if window < 1:
            raise ValueError(f"accumulation window must be >= 1, got {window}")
        self.stages = stages
        self.stage_id = stage_id
        self.window = window
        self.micro_batches = micro_batches or window
        self.nbuf = num_buffers(stages, stage_id)
        self.segment_tick = 0  # ticks emitted in the current segment
        self.segment_base = 0  # global id of the segment's micro-batch 0
        self.window_fill = 0  # backward passes in the open window (carried across a drain that leaves it open)
        self.version = 0  # local steps emitted so far
        self.ticks_emitted = 0  # over all segments
        self.lr_count = 0  # LR-scheduler steps emitted so far (sum of LocalStep.lr_steps)
        self._applied = 0  # micro-batches taken by local steps since the last change of M ...
        self._lr_base = 0  # ... and lr_count at that change

    # -- queries -------------------------------------------------------------------
    def loaded(self):
        """Micro-batches stage 0 has loaded in the current segment (the drain's limit)."""
        return (self.segment_tick + 1) // 2

    def in_flight(self):
        """Micro-batches forwarded but not yet backwarded at this stage."""
        t, s, P = self.segment_tick, self.stage_id, self.stages
        forwarded = max(0, (t - s + 1) // 2)  # m with 2m + s < t
        backwarded = max(0, (t - (2 * P - s - 1) + 1) // 2)
        return forwarded - backwarded

    def next_micro_batch(self):
        """Global id of the next micro-batch stage 0 will load."""
        return self.segment_base + self.loaded()

    # -- generation ----------------------------------------------------------------
    def _step_id(self, t):
        """(segment-local micro-batch, is_forward) for segment tick ``t``."""
        s, P = self.stage_id, self.stages
        if (t - s) % 2 == 0:
            return (t - s) // 2, True
        return (t - (2 * P - s - 1)) // 2, False

    def _tick(self, t, limit):
        """Instructions of segment tick ``t``; micro-batches ``>= limit`` are not started (None = unbounded)."""

        def valid(m):
            return m >= 0 and (limit is None or m < limit)

        s, P, nbuf, base = self.stage_id, self.stages, self.nbuf, self.segment_base
        m, is_forward = self._step_id(t)
        prev, _ = self._step_id(t - 1) if t > 0 else (-1, None)
        cmds = []
        if is_forward:
            if valid(prev) and s > 0:
                cmds.append(_make(SendGrad, base + prev, nbuf))
            if valid(m) and s > 0:
                cmds.append(_make(RecvActivation, base + m, nbuf))
            if valid(m) and (s == 0 or s == P - 1):
                cmds.append(_make(LoadMicroBatch, base + m, nbuf))
            if valid(m):
                forward = _make(ForwardPass, base + m, nbuf)
                # Known now, from the stream: backward passes already in the open window, and whether a local
                # step will fall between this forward and its backward (the look-ahead predicts for those).
                forward.window_fill = self.window_fill
                forward.crosses_step = crosses_local_step(self.window, self.window_fill, min(m, P - 1 - s))
                cmds.append(forward)
        else:
            if valid(m) and s < P - 1:
                cmds.append(_make(RecvGrad, base + m, nbuf))
            if valid(prev) and s < P - 1:
                cmds.append(_make(SendActivation, base + prev, nbuf))
            if valid(m):
                cmds.append(_make(BackwardPass, base + m, nbuf))
                cmds.append(_make(LocalAccumulate, base + m, nbuf))
                self.window_fill += 1
                if self.window_fill == self.window:
                    cmds.append(self._local_step())
        return cmds

    def _local_step(self):
        target = self._lr_base + (self._applied + self.window_fill) // self.micro_batches
        step = LocalStep(self.version + 1, lr_steps=target - self.lr_count)
        self._applied += self.window_fill
        self.lr_count = target
        self.window_fill = 0
        self.version += 1
        return step

    def set_micro_batches(self, micro_batches, window=None):
        """A new ``M`` (and window) from the next segment on; the stream must be drained.

        The learning-rate rule keeps its count: micro-batches stepped under the old ``M`` count in units of
        the old ``M``. Changing the window needs a closed window (``drain()``).
        """
        if self.segment_tick:
            raise RuntimeError("set_micro_batches() on a stream that is not drained; call drain() first")
        if window is not None and window != self.window and self.window_fill:
            raise RuntimeError(f"cannot change the window from {self.window} to {window} with {self.window_fill} "
                               "backward passes in the open window; drain() (close_window=True) first")
        self._lr_base += self._applied // self.micro_batches
        self._applied %= self.micro_batches
        self.micro_batches = micro_batches
        if window is not None:
            self.window = window

    def advance(self, n_ticks):
        """The next ``n_ticks`` ticks of the unbounded stream (one ``train_batch`` is ``2*M``)."""
        ticks = [self._tick(self.segment_tick + i, None) for i in range(n_ticks)]
        self.segment_tick += n_ticks
        self.ticks_emitted += n_ticks
        return ticks

    def drain(self, close_window=True):
        """The finite tail: completes every started micro-batch; with ``close_window`` also the open window.

        Returns the remaining ticks (the same count on every stage; with ``close_window``
        plus one extra tick holding only a :class:`LocalStep` where this stage's last
        backward had already run before the drain began). Afterwards nothing is in flight
        and a new segment begins. ``close_window=False`` leaves a partial window open: the
        next segment continues it (``window_fill`` > 0).
        """
        limit = self.loaded()
        end = 2 * (limit + self.stages - 1) if limit else 0
        ticks = [self._tick(t, limit) for t in range(self.segment_tick, end)]
        if self.window_fill and close_window:
            step = self._local_step()
            last_backward = limit - 1 + self.segment_base
            for tick in reversed(ticks):
                if any(isinstance(i, BackwardPass) and i.micro_batch_id == last_backward for i in tick):
                    tick.append(step)
                    break
            else:
                ticks.append([step])
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
                "applied": self._applied, "lr_base": self._lr_base}

    def load_state_dict(self, state):
        """Restore :meth:`state_dict`. States written before the learning-rate rule existed (closed windows, one
        scheduler step per local step) continue with the current ``M`` from the scheduler count they imply."""
        self.segment_base = int(state["next_micro_batch"])
        self.version = int(state["version"])
        self.ticks_emitted = int(state.get("ticks_emitted", 0))
        self.segment_tick = 0
        self.window_fill = int(state.get("window_fill", 0))
        if "lr_count" in state:
            self.micro_batches = int(state["micro_batches"])
            self.lr_count = int(state["lr_count"])
            self._applied = int(state["applied"])
            self._lr_base = int(state["lr_base"])
        else:
            self.lr_count = self.version
            self._applied = self.segment_base
            self._lr_base = self.version - self.segment_base // self.micro_batches


# -- static checks ---------------------------------------------------------------------
def stream_violations(ticks, stages, stage_id, window, expect_drained=True, start_version=0, start_fill=0,
                      expect_closed=None):
    """Check one segment of one stage's ticks against the PACI contract.

    Returns a list of messages (empty = valid). A segment is what runs between two
    drains (or from the start); ``start_version`` is the weight version it starts at and
    ``start_fill`` the backward passes already in its open window (a window carried across
    the drain before it).

    Checks: forward before backward of every micro-batch, loads only on the first
    and last stage and before the forward, in-flight <= ``P - s``, a local step after
    exactly every ``window``-th backward of a window (counting the carried ones; a final
    partial window may close at the end), step versions consecutive, drift <=
    ``ceil((P-1-s)/window)``, buffer ids never reused while occupied, (``expect_drained``)
    nothing in flight at the end, and (``expect_closed``, by default ``expect_drained``) no
    open window at the end. Forwards tagged by :class:`PACIStream` (``crosses_step``,
    ``window_fill``) must carry the truth: the fill of the open window at the forward,
    and whether a local step falls between the forward and its backward.
    """
    if expect_closed is None:
        expect_closed = expect_drained
    out = []
    bound = drift_bound(stages, stage_id, window)
    nbuf = num_buffers(stages, stage_id)
    fwd_version = {}
    occupied = {}
    done = set()
    loaded = set()
    version = start_version
    fill = start_fill
    crossing_tag = {}
    for t, tick in enumerate(ticks):
        for ins in tick:
            m = micro_batch_of(ins)
            where = f"stage {stage_id} tick {t} {format_instruction(ins)}"
            if m is not None and getattr(ins, "buffer_id", None) != m % nbuf:
                out.append(f"{where}: buffer {ins.buffer_id} != {m} % {nbuf}")
            if isinstance(ins, LoadMicroBatch):
                if 0 < stage_id < stages - 1:
                    out.append(f"{where}: a middle stage loads data")
                loaded.add(m)
            elif isinstance(ins, ForwardPass):
                if m in fwd_version or m in done:
                    out.append(f"{where}: forward twice")
                if (stage_id == 0 or stage_id == stages - 1) and m not in loaded:
                    out.append(f"{where}: forward before load")
                b = ins.buffer_id
                if b in occupied:
                    out.append(f"{where}: buffer {b} still holds micro-batch {occupied[b]}")
                occupied[b] = m
                fwd_version[m] = version
                if hasattr(ins, "window_fill") and ins.window_fill != fill:
                    out.append(f"{where}: tagged window_fill {ins.window_fill}, the open window holds {fill}")
                if hasattr(ins, "crosses_step"):
                    crossing_tag[m] = ins.crosses_step
                if len(fwd_version) > stages - stage_id:
                    out.append(f"{where}: {len(fwd_version)} in flight > {stages - stage_id}")
            elif isinstance(ins, BackwardPass):
                if m not in fwd_version:
                    out.append(f"{where}: backward without forward")
                    continue
                drift = version - fwd_version.pop(m)
                if drift > bound:
                    out.append(f"{where}: drift {drift} > bound {bound}")
                if m in crossing_tag and crossing_tag.pop(m) != (drift >= 1):
                    out.append(f"{where}: forward tagged crosses_step={not drift >= 1} but crossed {drift} steps")
                occupied.pop(ins.buffer_id, None)
                done.add(m)
                fill += 1
            elif isinstance(ins, LocalAccumulate):
                if m not in done:
                    out.append(f"{where}: accumulate before backward")
            elif isinstance(ins, LocalStep):
                if ins.version != version + 1:
                    out.append(f"{where}: version {ins.version} after {version}")
                version = ins.version
                last = t == len(ticks) - 1 or all(not isinstance(i, (BackwardPass, LocalStep))
                                                  for later in ticks[t + 1:] for i in later)
                if fill != window and not (last and 0 < fill < window):
                    out.append(f"{where}: step after {fill} backwards, window is {window}")
                fill = 0
        if fill > window:
            out.append(f"stage {stage_id} tick {t}: {fill} backwards without a step (window {window})")
    if expect_drained and fwd_version:
        out.append(f"stage {stage_id}: still in flight at the end: {sorted(fwd_version)}")
    if expect_closed and fill:
        out.append(f"stage {stage_id}: window left open with {fill} backwards")
    return out


def pairing_violations(streams):
    """Check that sends and receives pair up, in order, between neighbouring stages.

    ``streams[s]`` is stage ``s``'s list of ticks. Returns messages (empty = valid).
    """
    out = []

    def seq(ticks, cls):
        return [i.micro_batch_id for tick in ticks for i in tick if isinstance(i, cls)]

    for s in range(len(streams) - 1):
        sa, ra = seq(streams[s], SendActivation), seq(streams[s + 1], RecvActivation)
        if sa != ra:
            out.append(f"activations {s}->{s + 1}: sent {sa} but received {ra}")
        sg, rg = seq(streams[s + 1], SendGrad), seq(streams[s], RecvGrad)
        if sg != rg:
            out.append(f"gradients {s + 1}->{s}: sent {sg} but received {rg}")
    return out
