"""The program: immutable actions that the engine runs and every tool reads.

A *program* is, per pipeline stage, a list of *ticks*; a tick is a list of :class:`Action`. The engine
executes its stage's ticks in order; the simulator, the tied-timing check, the validators and the replay
read the very same lists (:mod:`ds_paci.core.program.interpreter` is the one interpreter they share). Everything
the engine needs to run an action is a field of the action, so a parsed program runs exactly as the one
that was built.

Vocabulary (:class:`Kind`; its value is the text code)::

    L7   load micro-batch 7             F7   forward 7          B7   backward 7
    SA7  send activation of 7           RA7  receive activation of 7
    SG7  send gradient of 7             RG7  receive gradient of 7
    B7[dp] backward 7, the window's last before its step: the data-parallel reduce runs under it
    ACC7 gradient of 7 joins the open window
    STEP3 local step producing weight version 3 (DeepSpeed's OptimizerStep in stock programs)
    TPOST3 a tied owner posts its window-3 tied gradient to the other owners
    TAPPLY2 a tied owner applies the owners' total of window 2 (``TAPPLY1+2``: several; waits for them)
    REDUCE_GRADS, REDUCE_TIED   DeepSpeed's reductions (stock programs only)

Facts, in brackets after the code, only where the action has them:

* forward: ``F7[1,x]``: one backward pass was already in the stage's open window (``window_fill``) and a
  local step falls between this forward and its backward (``crosses_step``, ``x``; ``-`` when not);
  the look-ahead predicts for exactly those forwards. ``F7[0,x,w3]``: the open window is a partial one that
  closes after 3 backward passes (``open_window``; present only where it differs from the stage's window ``a``:
  the first window of a stage whose step phase is not 0, :mod:`ds_paci.core.program.stream`).
* backward: ``B7[dp]``: the data-parallel reduce of the window overlaps this backward (``reduce_overlap``;
  :func:`ds_paci.core.program.passes.mark_reduce_backward`, ``"paci": {"overlap_reduce": true}``).
* step: ``STEP3[lr2]``: the LR scheduler steps twice right after it (``lr_steps``; omitted when 1);
  ``STEP3[lr1,drain]``: a tied owner's last step of a segment, run after the drain (``in_drain``).
* tied: ``TPOST3[L1]`` / ``TAPPLY2[L1]``: the exchange's lag ``L``; ``TAPPLY1+2[L1,all]``: the closing
  drain's step that applies every pending window (``apply_all``).

A tick prints as its actions joined by ``,`` (``-`` when empty), a stage as its ticks joined by `` | ``.
:func:`parse_stage` inverts :func:`format_stage` exactly (``parse_stage(format_stage(t), s) == t``).

Pure data: no process group and no tensor.
"""

import enum
import re
from dataclasses import dataclass, replace
from typing import Optional, Tuple

__all__ = [
    "Kind", "Action", "P2P_PARTNER", "format_action", "parse_action", "format_tick", "parse_tick",
    "format_stage", "parse_stage", "format_program", "parse_program", "from_deepspeed"
]


class Kind(enum.Enum):
    """What an action does; the value is its text code."""

    LOAD = "L"
    FORWARD = "F"
    BACKWARD = "B"
    SEND_ACT = "SA"
    RECV_ACT = "RA"
    SEND_GRAD = "SG"
    RECV_GRAD = "RG"
    ACCUMULATE = "ACC"
    STEP = "STEP"
    TIED_POST = "TPOST"
    TIED_APPLY = "TAPPLY"
    REDUCE_GRADS = "REDUCE_GRADS"
    REDUCE_TIED = "REDUCE_TIED"


# p2p kind -> (partner stage offset, the partner's matching kind)
P2P_PARTNER = {
    Kind.SEND_ACT: (+1, Kind.RECV_ACT),
    Kind.RECV_ACT: (-1, Kind.SEND_ACT),
    Kind.SEND_GRAD: (-1, Kind.RECV_GRAD),
    Kind.RECV_GRAD: (+1, Kind.SEND_GRAD),
}
_MICRO_BATCH_KINDS = frozenset({Kind.LOAD, Kind.FORWARD, Kind.BACKWARD, Kind.SEND_ACT, Kind.RECV_ACT, Kind.SEND_GRAD,
                                Kind.RECV_GRAD, Kind.ACCUMULATE})
_TIED_KINDS = frozenset({Kind.TIED_POST, Kind.TIED_APPLY})


@dataclass(frozen=True, repr=False)
class Action:
    """One action of one stage: immutable, hashable, with a lossless text form (see the module docstring).

    ``micro_batch``: the global micro-batch id (micro-batch kinds). ``version``: the weight version a
    ``STEP`` produces, the window a ``TIED_POST`` posts. ``windows``: the windows a ``TIED_APPLY`` applies.
    The rest are the facts the engine acts on: ``window_fill``, ``crosses_step`` and ``open_window`` (forward; the
    last only for a partial window, ``None`` otherwise), ``lr_steps`` and ``in_drain`` (step), ``lag`` and
    ``apply_all`` (tied), ``reduce_overlap`` (backward).
    """

    stage: int
    kind: Kind
    micro_batch: Optional[int] = None
    version: Optional[int] = None
    windows: Tuple[int, ...] = ()
    window_fill: Optional[int] = None
    crosses_step: Optional[bool] = None
    open_window: Optional[int] = None
    lr_steps: int = 1
    in_drain: bool = False
    lag: Optional[int] = None
    apply_all: bool = False
    reduce_overlap: bool = False

    def __post_init__(self):
        kind = self.kind
        if kind in _MICRO_BATCH_KINDS and (self.micro_batch is None or self.micro_batch < 0):
            raise ValueError(f"{kind.name} needs a micro-batch id >= 0, got {self.micro_batch!r}")
        if kind is Kind.STEP and (self.version is None or self.version < 1):
            raise ValueError(f"STEP needs a weight version >= 1, got {self.version!r}")
        if kind is Kind.TIED_POST and (self.version is None or self.version < 1):
            raise ValueError(f"TIED_POST needs a window >= 1, got {self.version!r}")
        if kind is Kind.TIED_APPLY and (not self.windows or min(self.windows) < 1):
            raise ValueError(f"TIED_APPLY needs windows >= 1, got {self.windows!r}")
        if (self.window_fill is None) != (self.crosses_step is None) or (self.window_fill is not None
                                                                         and kind is not Kind.FORWARD):
            raise ValueError("window_fill and crosses_step go together, on forwards only")
        if self.open_window is not None and (self.window_fill is None or self.open_window < 1):
            raise ValueError(f"open_window needs the forward's window facts and >= 1, got {self.open_window!r}")
        if self.reduce_overlap and kind is not Kind.BACKWARD:
            raise ValueError("reduce_overlap marks a backward only")

    def with_(self, **changes):
        """A copy with ``changes`` (actions are immutable)."""
        return replace(self, **changes)

    def __str__(self):
        return format_action(self)

    def __repr__(self):
        return f"Action(stage {self.stage}: {format_action(self)})"


# -- text form --------------------------------------------------------------------------------------------
_TOKEN = re.compile(r"^(REDUCE_GRADS|REDUCE_TIED|TPOST|TAPPLY|STEP|ACC|SA|RA|SG|RG|L|F|B)([0-9+]*)(?:\[([^\]]*)\])?$")


def format_action(action, facts=True):
    """Compact text of one action, e.g. ``F3[0,-]``, ``STEP2[lr2]``, ``TAPPLY1+2[L1,all]``.

    ``facts=False``: the code and number only (``F3``, ``STEP2``): the name traces and messages use."""
    kind, with_facts = action.kind, facts
    facts = []
    if kind in (Kind.REDUCE_GRADS, Kind.REDUCE_TIED):
        number = ""
    elif kind is Kind.TIED_APPLY:
        number = "+".join(str(w) for w in action.windows)
    elif kind in (Kind.STEP, Kind.TIED_POST):
        number = str(action.version)
    else:
        number = str(action.micro_batch)
    if not with_facts:
        return f"{kind.value}{number}"
    if action.window_fill is not None:
        facts += [str(action.window_fill), "x" if action.crosses_step else "-"]
        if action.open_window is not None:
            facts.append(f"w{action.open_window}")
    if action.reduce_overlap:
        facts.append("dp")
    if kind is Kind.STEP:
        if action.lr_steps != 1:
            facts.append(f"lr{action.lr_steps}")
        if action.in_drain:
            facts.append("drain")
    if kind in _TIED_KINDS:
        if action.lag is not None:
            facts.append(f"L{action.lag}")
        if action.apply_all:
            facts.append("all")
        if action.in_drain:
            facts.append("drain")
    return f"{kind.value}{number}" + (f"[{','.join(facts)}]" if facts else "")


def parse_action(text, stage):
    """Inverse of :func:`format_action` for an action of ``stage``; a bad token raises ``ValueError``."""
    match = _TOKEN.match(text.strip())
    if not match:
        raise ValueError(f"not an action: {text!r} (expected e.g. F3, F3[0,x], B3, SA3, L3, ACC3, STEP1, TPOST2)")
    code, number, facts = match.group(1), match.group(2), match.group(3)
    kind = Kind(code)
    fields = {}
    try:
        if kind is Kind.TIED_APPLY:
            fields["windows"] = tuple(int(w) for w in number.split("+"))
        elif kind in (Kind.STEP, Kind.TIED_POST):
            fields["version"] = int(number)
        elif kind not in (Kind.REDUCE_GRADS, Kind.REDUCE_TIED):
            fields["micro_batch"] = int(number)
        elif number:
            raise ValueError(number)
    except ValueError:
        raise ValueError(f"not an action: {text!r} (bad number {number!r})") from None
    items = facts.split(",") if facts else []
    if kind is Kind.FORWARD and items:
        if (len(items) not in (2, 3) or not items[0].isdigit() or items[1] not in ("x", "-")
                or (len(items) == 3 and not re.fullmatch(r"w[1-9]\d*", items[2]))):
            raise ValueError(f"not an action: {text!r} (a forward's facts are [window_fill,x|-] or "
                             "[window_fill,x|-,w<open window>])")
        fields.update(window_fill=int(items[0]), crosses_step=items[1] == "x")
        if len(items) == 3:
            fields["open_window"] = int(items[2][1:])
        items = []
    for item in items:
        if kind is Kind.BACKWARD and item == "dp":
            fields["reduce_overlap"] = True
        elif kind is Kind.STEP and re.fullmatch(r"lr\d+", item):
            fields["lr_steps"] = int(item[2:])
        elif kind in (Kind.STEP, Kind.TIED_POST, Kind.TIED_APPLY) and item == "drain":
            fields["in_drain"] = True
        elif kind in _TIED_KINDS and re.fullmatch(r"L\d+", item):
            fields["lag"] = int(item[1:])
        elif kind in _TIED_KINDS and item == "all":
            fields["apply_all"] = True
        else:
            raise ValueError(f"not an action: {text!r} (unknown fact {item!r} for {kind.name})")
    return Action(stage, kind, **fields)


def format_tick(tick):
    return ",".join(format_action(a) for a in tick) or "-"


def parse_tick(text, stage):
    text = text.strip()
    if text == "-":
        return []
    # commas inside brackets belong to the facts
    return [parse_action(token, stage) for token in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", text)]


def format_stage(ticks):
    """One stage's ticks as text, e.g. ``L0,F0[0,-] | SA0 | RG0,B0,ACC0,STEP1``."""
    return " | ".join(format_tick(t) for t in ticks)


def parse_stage(text, stage):
    """Inverse of :func:`format_stage`."""
    if not text.strip():
        return []
    return [parse_tick(t, stage) for t in text.split("|")]


def format_program(program):
    """A whole program (``program[s]`` = stage ``s``'s ticks), one line per stage: ``s: <ticks>``."""
    return "\n".join(f"{s}: {format_stage(ticks)}" for s, ticks in enumerate(program))


def parse_program(text):
    """Inverse of :func:`format_program`."""
    program = []
    for line in text.strip().splitlines():
        head, _, body = line.partition(":")
        if not head.strip().isdigit() or int(head) != len(program):
            raise ValueError(f"program line {len(program)} must start with '{len(program)}:', got {line[:20]!r}")
        program.append(parse_stage(body, len(program)))
    return program


# -- DeepSpeed's own schedules ----------------------------------------------------------------------------
def from_deepspeed(stage, ticks):
    """DeepSpeed ``PipeInstruction`` ticks (e.g. its ``TrainSchedule``) as actions of ``stage``.

    DeepSpeed's instructions carry only a buffer id: micro-batches are numbered by order of appearance per
    instruction type, which is exact for its FIFO 1F1B; ``OptimizerStep`` becomes ``STEP<n>`` (the n-th
    weight version). Used by the simulator for stock programs; the engine never runs these.
    """
    from deepspeed.runtime.pipe import schedule as ds

    kinds = {ds.LoadMicroBatch: Kind.LOAD, ds.ForwardPass: Kind.FORWARD, ds.BackwardPass: Kind.BACKWARD,
             ds.SendActivation: Kind.SEND_ACT, ds.RecvActivation: Kind.RECV_ACT, ds.SendGrad: Kind.SEND_GRAD,
             ds.RecvGrad: Kind.RECV_GRAD, ds.ReduceGrads: Kind.REDUCE_GRADS, ds.ReduceTiedGrads: Kind.REDUCE_TIED,
             ds.OptimizerStep: Kind.STEP}
    seen = {}
    out = []
    for t, tick in enumerate(ticks):
        row = []
        for ins in tick:
            kind = kinds.get(type(ins))
            if kind is None:
                raise ValueError(f"stage {stage} tick {t}: no action for DeepSpeed instruction {ins!r}")
            n = seen[kind] = seen.get(kind, 0) + 1
            if kind is Kind.STEP:
                row.append(Action(stage, kind, version=n))
            elif kind in _MICRO_BATCH_KINDS:
                mb = getattr(ins, "micro_batch_id", None)
                row.append(Action(stage, kind, micro_batch=n - 1 if mb is None else mb))
            else:
                row.append(Action(stage, kind))
        out.append(row)
    return out
