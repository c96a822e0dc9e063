"""Discrete-event simulation of per-stage pipeline instruction streams.

Runs the very instruction streams the engines execute, without processes or tensors:
PACI's :class:`~ds_paci.core.schedule.PACIStream` (see :func:`paci_programs`) and DeepSpeed's
own ``TrainSchedule`` (see :func:`stock_programs`), under a :class:`CostModel`, and
measures bubble, in-flight activations, weight-version drift and deadlocks.

Execution semantics (what :func:`simulate` models):

* A *program* is one list of ticks per stage; a tick is a list of instructions. Each
  stage executes its instructions in order. Tick boundaries are **not** barriers.
* Point-to-point transfers are blocking rendezvous, as with gloo: ``SendActivation``
  on stage ``s`` pairs with the next ``RecvActivation`` on ``s+1``, ``SendGrad`` on
  ``s`` with the next ``RecvGrad`` on ``s-1`` (FIFO per link and direction). The
  transfer starts when both sides have arrived and occupies both for ``cost.transfer_time``
  (``latency``, plus the link model's time when ``links`` is given);
  the earlier side waits meanwhile.
* Forward, backward, step and load occupy the stage for their cost. Everything else
  (``LocalAccumulate``, ``ReduceGrads``, ``ReduceTiedGrads``) is free and stage-local:
  a single data-parallel replica and no tied modules, unless ``tied`` is given.
* ``tied`` (a :class:`TiedExchange`) adds PACI's tied-weight exchange
  (:mod:`ds_paci.core.tied`): an owner stage posts its window at the start of each local
  step; before its ``k``-th step it waits until every other owner has posted step ``k - lag``,
  and the program's last step (after the drain) waits for every owner's last post. The time
  an owner spends there is ``tied_wait`` (the last step's separately, ``tied_drain_wait``).
* When no stage can progress and some still have instructions, the run is a
  deadlock: the result names each stuck stage, its instruction and its position.
  Paired send/receive that both carry ``micro_batch_id`` must agree; disagreements
  are reported as mismatches.

DeepSpeed's stock instructions carry only a ``buffer_id``; the simulator numbers their
micro-batches by order of appearance per instruction type and stage, which is exact
for FIFO 1F1B. ``OptimizerStep`` and PACI's ``LocalStep`` both count as a weight
version (drift is measured in those).
"""

import argparse
import bisect
import json
import sys
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import List, NamedTuple, Optional, Sequence, Union

from deepspeed.runtime.pipe.schedule import (BackwardPass, ForwardPass, LoadMicroBatch, OptimizerStep, RecvActivation,
                                             RecvGrad, ReduceGrads, ReduceTiedGrads, SendActivation, SendGrad,
                                             TrainSchedule)

from ds_paci.core.program import Action, Kind, format_action
from ds_paci.core.schedule import PACIStream

from .records import COMPUTE_KINDS, records_from_sim
from .render import to_chrome_trace, to_png, to_text_grid

__all__ = [
    "CostModel", "TiedExchange", "Event", "StuckStage", "Deadlock", "DeadlockError", "PairingError", "SimResult",
    "simulate", "stock_programs", "paci_programs", "simulate_stock", "simulate_paci", "simulate_schedule",
    "long_run_period", "reference_rows", "comparison_rows", "markdown_table", "main"
]

Number = Union[int, float]

# -- cost model -------------------------------------------------------------------------


@dataclass(frozen=True)
class CostModel:
    """Durations, in arbitrary time units, of what a stage does.

    ``forward`` and ``backward`` are a scalar or one value per stage; ``backward``
    defaults to twice ``forward``. ``overhead`` is added to every forward (per
    micro-batch cost), ``latency`` to every point-to-point transfer (on both sides),
    ``step`` to every ``LocalStep``/``OptimizerStep``, ``load`` to every
    ``LoadMicroBatch``. ``links`` (a :class:`ds_paci.tools.links.LinkModel`) adds to
    every transfer its link's latency plus bytes over bandwidth, and to every step the
    stage's data-parallel all-reduce (all of it, or what the overlap leaves).
    """

    forward: Union[Number, Sequence[Number]] = 1.0
    backward: Optional[Union[Number, Sequence[Number]]] = None
    latency: float = 0.0
    overhead: float = 0.0
    step: float = 0.0
    load: float = 0.0
    links: Optional[object] = None

    def transfer_time(self, a, b):
        """A point-to-point transfer between stages ``a`` and ``b``."""
        return self.latency + (self.links.transfer_time(a, b) if self.links is not None else 0.0)

    def step_time(self, stage):
        """A ``LocalStep``/``OptimizerStep`` on ``stage`` (its window's last backward may hide the all-reduce)."""
        if self.links is None:
            return self.step
        return self.step + self.links.step_delay(self.backward_time(stage))

    @staticmethod
    def _per_stage(value, stage):
        if isinstance(value, (int, float)):
            return float(value)
        return float(value[stage])

    def forward_time(self, stage):
        return self._per_stage(self.forward, stage) + self.overhead

    def backward_time(self, stage):
        if self.backward is None:
            return 2.0 * self._per_stage(self.forward, stage)
        return self._per_stage(self.backward, stage)


@dataclass(frozen=True)
class TiedExchange:
    """Tied-weight owners (stages) and the lag of their exchange, for :func:`simulate`.

    ``drained``: the program ends with a drain, so its last step of every owner waits for
    every owner's last post (the engine runs it after the drain's last tick).
    """

    owners: tuple
    lag: int
    drained: bool = True


# -- results ----------------------------------------------------------------------------


class Event(NamedTuple):
    """One interval of a stage's timeline.

    ``kind`` is one of ``forward``, ``backward``, ``step``, ``load``, ``send``,
    ``recv`` (the transfer itself) or ``wait`` (blocked in a send/recv until the
    partner arrives; ``text`` names that send/recv).
    """

    start: float
    end: float
    text: str
    kind: str


@dataclass(frozen=True)
class StuckStage:
    """A stage blocked forever: ``text`` at position (``tick``, ``index``), waiting for ``partner``."""

    stage: int
    tick: int
    index: int
    text: str
    partner: int

    def __str__(self):
        return (f"stage {self.stage} stuck at tick {self.tick} instruction {self.index} ({self.text}), "
                f"waiting for stage {self.partner}")


@dataclass(frozen=True)
class Deadlock:
    """No stage can progress at ``time`` although the ``stuck`` stages have instructions left."""

    time: float
    stuck: List[StuckStage]

    def __str__(self):
        return f"deadlock at t={self.time:g}: " + "; ".join(str(s) for s in self.stuck)


class DeadlockError(RuntimeError):
    """Raised by :meth:`SimResult.raise_for_errors` for a deadlocked program; ``.deadlock`` holds the details."""

    def __init__(self, deadlock):
        super().__init__(str(deadlock))
        self.deadlock = deadlock


class PairingError(ValueError):
    """Raised by :meth:`SimResult.raise_for_errors` when paired send/recv name different micro-batches."""




@dataclass
class SimResult:
    """Outcome of :func:`simulate`.

    * ``events[s]``: stage ``s``'s timeline, a list of :class:`Event`;
    * ``makespan``: time at which the last stage finished;
    * ``busy[s]``: time stage ``s`` spent on forward, backward, step and load;
      ``idle[s] = makespan - busy[s]`` (waiting, transferring, or done early);
    * ``bubble_fraction``: ``1 - sum(busy) / (P * makespan)``;
    * ``steady_state_bubble``: the same share over ``steady_window`` only (see
      :func:`simulate`), ``None`` when no window was asked for or it is empty;
    * ``peak_in_flight[s]``: most micro-batches forwarded but not yet backwarded;
    * ``drift[s]``: Counter {weight versions crossed between forward and backward:
      micro-batches};
    * ``micro_batches``: backward passes completed on stage 0;
    * ``deadlock``: a :class:`Deadlock` or ``None``; ``mismatches``: pairing errors;
    * ``tick_start[s][t]``: time stage ``s`` began tick ``t``.
    """

    stages: int
    events: List[List[Event]]
    makespan: float
    busy: List[float]
    idle: List[float]
    bubble_fraction: float
    peak_in_flight: List[int]
    drift: List[Counter]
    micro_batches: int
    tick_start: List[List[float]]
    deadlock: Optional[Deadlock] = None
    mismatches: List[str] = field(default_factory=list)
    steady_window: Optional[tuple] = None
    steady_state_bubble: Optional[float] = None
    tied_wait: List[float] = field(default_factory=list)
    tied_drain_wait: List[float] = field(default_factory=list)

    @property
    def ok(self):
        return self.deadlock is None and not self.mismatches

    @property
    def max_drift(self):
        return max((max(c) for c in self.drift if c), default=0)

    def raise_for_errors(self):
        """Raise :class:`DeadlockError` or :class:`PairingError` if the run was not clean."""
        if self.deadlock is not None:
            raise DeadlockError(self.deadlock)
        if self.mismatches:
            raise PairingError("; ".join(self.mismatches))
        return self


# -- the simulation ---------------------------------------------------------------------

# Operation codes (one per instruction family the simulator distinguishes).
_FWD, _BWD, _STEP, _LOAD, _FREE, _SEND_ACT, _RECV_ACT, _SEND_GRAD, _RECV_GRAD = range(9)
_ACTION_CODE = {
    Kind.FORWARD: _FWD, Kind.BACKWARD: _BWD, Kind.STEP: _STEP, Kind.LOAD: _LOAD, Kind.ACCUMULATE: _FREE,
    Kind.SEND_ACT: _SEND_ACT, Kind.RECV_ACT: _RECV_ACT, Kind.SEND_GRAD: _SEND_GRAD, Kind.RECV_GRAD: _RECV_GRAD,
}
_CODE_OF = {
    ForwardPass: _FWD,
    BackwardPass: _BWD,
    OptimizerStep: _STEP,
    LoadMicroBatch: _LOAD,
    ReduceGrads: _FREE,
    ReduceTiedGrads: _FREE,
    SendActivation: _SEND_ACT,
    RecvActivation: _RECV_ACT,
    SendGrad: _SEND_GRAD,
    RecvGrad: _RECV_GRAD,
}
_KIND_OF = {_FWD: "forward", _BWD: "backward", _STEP: "step", _LOAD: "load", _FREE: "step"}
_P2P_KIND = {_SEND_ACT: "send", _SEND_GRAD: "send", _RECV_ACT: "recv", _RECV_GRAD: "recv"}
# p2p code -> (partner stage offset, partner's matching code)
_PARTNER = {
    _SEND_ACT: (+1, _RECV_ACT),
    _RECV_ACT: (-1, _SEND_ACT),
    _SEND_GRAD: (-1, _RECV_GRAD),
    _RECV_GRAD: (+1, _SEND_GRAD),
}
_STOCK_TEXT = {ReduceGrads: "REDUCE_GRADS", ReduceTiedGrads: "REDUCE_TIED"}
_TEXT_CODE = {LoadMicroBatch: "L", ForwardPass: "F", BackwardPass: "B", SendActivation: "SA", RecvActivation: "RA",
              SendGrad: "SG", RecvGrad: "RG"}


class _Op(NamedTuple):
    code: int
    micro_batch: int  # explicit micro_batch_id, or inferred by order for stock instructions
    explicit: bool  # whether the instruction itself carried micro_batch_id
    text: str
    tick: int
    index: int


def _lower(stage, ticks, stages):
    """Flatten one stage's ticks into :class:`_Op`s (validating p2p partners exist)."""
    ops = []
    ordinal = Counter()  # per instruction class, for instructions without micro_batch_id
    for t, tick in enumerate(ticks):
        for i, ins in enumerate(tick):
            if isinstance(ins, Action):  # PACI's programs (until the simulator runs on core.program_run)
                if ins.kind in (Kind.TIED_POST, Kind.TIED_APPLY):
                    continue
                code = _ACTION_CODE[ins.kind]
                if code in _PARTNER and not 0 <= stage + _PARTNER[code][0] < stages:
                    raise ValueError(f"stage {stage} tick {t}: {ins!r} has no neighbour stage to pair with")
                mb = ins.version if code == _STEP else ins.micro_batch
                ops.append(_Op(code, mb, code != _STEP, format_action(ins, facts=False), t, i))
                continue
            code = _CODE_OF.get(type(ins))
            if code is None:
                raise ValueError(f"stage {stage} tick {t}: the simulator does not model {ins!r}")
            if code in _PARTNER and not 0 <= stage + _PARTNER[code][0] < stages:
                raise ValueError(f"stage {stage} tick {t}: {ins!r} has no neighbour stage to pair with")
            cls = type(ins)
            ordinal[cls] += 1
            if code == _STEP:
                mb, explicit = ordinal[cls], False
                text = f"STEP{mb}"
            elif cls in _STOCK_TEXT:
                mb, explicit, text = -1, False, _STOCK_TEXT[cls]
            elif getattr(ins, "micro_batch_id", None) is not None:
                mb, explicit = ins.micro_batch_id, True
                text = f"{_TEXT_CODE[cls]}{mb}"
            else:
                mb, explicit = ordinal[cls] - 1, False
                text = f"{_TEXT_CODE[cls]}{mb}"
            ops.append(_Op(code, mb, explicit, text, t, i))
    return ops


def simulate(programs, cost=None, *, drain_tick=None, tied=None):
    """Simulate ``programs`` (``programs[s]`` = stage ``s``'s list of ticks) under ``cost``.

    Never hangs: a deadlock is returned in :attr:`SimResult.deadlock` (call
    :meth:`SimResult.raise_for_errors` to turn it into :class:`DeadlockError`).

    ``drain_tick`` (the index of the first drain tick, e.g. ``2*M*calls`` for
    :func:`paci_programs`) enables the steady-state measurement. The steady window
    runs from the start of stage 0's first backward pass (stage 0 is the last stage
    to enter 1F1B, so from then on every stage alternates forward and backward) to the
    time stage 0 begins ``drain_tick`` (it stops admitting micro-batches there, which
    is the first stage to leave the steady state). ``steady_state_bubble`` is
    ``1 - (compute time of all stages inside the window) / (P * window length)``.

    ``tied`` (a :class:`TiedExchange`) adds the tied-weight exchange (see the module docstring).
    """
    cost = cost or CostModel()
    P = len(programs)
    ops = [_lower(s, ticks, P) for s, ticks in enumerate(programs)]
    n_ops = [len(o) for o in ops]
    fwd_time = [cost.forward_time(s) for s in range(P)]
    bwd_time = [cost.backward_time(s) for s in range(P)]
    step_time = [cost.step_time(s) for s in range(P)]

    events = [[] for _ in range(P)]
    op_end = [[0.0] * n for n in n_ops]
    clock = [0.0] * P
    pos = [0] * P
    arrived = [None] * P  # arrival time at the p2p op a stage is blocked on
    busy = [0.0] * P
    version = [0] * P
    forward_version = [{} for _ in range(P)]
    in_flight = [0] * P
    peak = [0] * P
    drift = [Counter() for _ in range(P)]
    mismatches = []
    owners = sorted(set(tied.owners)) if tied else []
    total_steps = {s: sum(op.code == _STEP for op in ops[s]) for s in owners}
    if tied and tied.drained:  # an owner's last step runs after the drain's last tick, as in the engine
        for s in owners:
            last = max((i for i, op in enumerate(ops[s]) if op.code == _STEP), default=None)
            if last is not None:
                op = ops[s].pop(last)
                ops[s].append(op._replace(tick=max(op.tick, ops[s][-1].tick if ops[s] else 0)))
    step_count = [0] * P  # steps started (posted) per stage
    posted = {}  # (stage, k) -> time of the post
    tied_blocked = [None] * P  # (needed posts, arrival time) of an owner waiting before a step
    tied_cleared = [False] * P
    tied_wait = [0.0] * P
    tied_drain_wait = [0.0] * P

    def tied_needs(s, k):
        last = tied.drained and k == total_steps[s]
        due = total_steps[s] if last else k - tied.lag
        if due < 1:
            return [], last
        return [(q, due) for q in owners if q != s], last

    def run_local(s):
        """Execute stage ``s`` until it blocks at a p2p op (recording its arrival) or ends."""
        stage_ops, ends, evs = ops[s], op_end[s], events[s]
        i, now = pos[s], clock[s]
        while i < n_ops[s]:
            op = stage_ops[i]
            code = op.code
            if code in _PARTNER:
                arrived[s] = now
                break
            if code == _FWD:
                dur = fwd_time[s]
                forward_version[s][op.micro_batch] = version[s]
                in_flight[s] += 1
                if in_flight[s] > peak[s]:
                    peak[s] = in_flight[s]
            elif code == _BWD:
                dur = bwd_time[s]
                start_version = forward_version[s].pop(op.micro_batch, None)
                if start_version is not None:
                    drift[s][version[s] - start_version] += 1
                in_flight[s] -= 1
            elif code == _STEP:
                if s in total_steps and not tied_cleared[s]:
                    if tied_blocked[s] is None:  # first arrival: post this window
                        step_count[s] += 1
                        posted[(s, step_count[s])] = now
                        wake(s)
                    needs, last = tied_needs(s, step_count[s])
                    missing = [n for n in needs if n not in posted]
                    if missing:
                        tied_blocked[s] = (needs, now)
                        break
                    tied_blocked[s] = None
                    until = max([now] + [posted[n] for n in needs])
                    if until > now:
                        evs.append(Event(now, until, f"TIED{step_count[s]}", "wait"))
                        if last:
                            tied_drain_wait[s] += until - now
                        else:
                            tied_wait[s] += until - now
                        now = until
                tied_cleared[s] = False
                dur = step_time[s]
                version[s] += 1
            elif code == _LOAD:
                dur = cost.load
            else:
                dur = 0.0
            end = now + dur
            evs.append(Event(now, end, op.text, _KIND_OF[code]))
            if code != _FREE:
                busy[s] += dur
            ends[i] = now = end
            i += 1
        pos[s], clock[s] = i, now

    def wake(poster):
        """Owners blocked before a step whose needed posts are all in: let them run again."""
        for q in owners:
            if tied_blocked[q] is None or q == poster:
                continue
            needs, arrival = tied_blocked[q]
            if all(n in posted for n in needs):
                tied_blocked[q] = None
                until = max([arrival] + [posted[n] for n in needs])
                if until > arrival:
                    events[q].append(Event(arrival, until, f"TIED{step_count[q]}", "wait"))
                    if tied_needs(q, step_count[q])[1]:
                        tied_drain_wait[q] += until - arrival
                    else:
                        tied_wait[q] += until - arrival
                clock[q] = until
                tied_cleared[q] = True
                if not queued[q]:
                    queued[q] = True
                    ready.append(q)

    def rendezvous(a, b):
        """Pair stage ``a``'s and stage ``b``'s blocked p2p ops; advance both."""
        op_a, op_b = ops[a][pos[a]], ops[b][pos[b]]
        start = max(arrived[a], arrived[b])
        end = start + cost.transfer_time(a, b)
        for s, op in ((a, op_a), (b, op_b)):
            if arrived[s] < start:
                events[s].append(Event(arrived[s], start, op.text, "wait"))
            events[s].append(Event(start, end, op.text, _P2P_KIND[op.code]))
            op_end[s][pos[s]] = end
            clock[s] = end
            pos[s] += 1
            arrived[s] = None
        if op_a.explicit and op_b.explicit and op_a.micro_batch != op_b.micro_batch:
            mismatches.append(f"stage {a} tick {op_a.tick} instruction {op_a.index} ({op_a.text}) paired with "
                              f"stage {b} tick {op_b.tick} instruction {op_b.index} ({op_b.text})")

    ready = deque(range(P))
    queued = [True] * P

    def partner(s):
        op = ops[s][pos[s]]
        if op.code in _PARTNER:
            return s + _PARTNER[op.code][0]
        return next(q for q, k in tied_blocked[s][0] if (q, k) not in posted)

    while ready:
        s = ready.popleft()
        queued[s] = False
        run_local(s)
        if pos[s] == n_ops[s] or tied_blocked[s] is not None:
            continue
        offset, wanted = _PARTNER[ops[s][pos[s]].code]
        q = s + offset
        if arrived[q] is not None and ops[q][pos[q]].code == wanted:
            rendezvous(s, q)
            for x in (s, q):
                if not queued[x]:
                    queued[x] = True
                    ready.append(x)

    deadlock = None
    stuck = [s for s in range(P) if pos[s] < n_ops[s]]
    if stuck:
        deadlock = Deadlock(
            time=max(clock),
            stuck=[
                StuckStage(s, ops[s][pos[s]].tick, ops[s][pos[s]].index, ops[s][pos[s]].text, partner(s))
                for s in stuck
            ])

    makespan = max(clock, default=0.0)
    tick_start = [_tick_starts(ops[s], op_end[s], len(programs[s])) for s in range(P)]
    result = SimResult(
        stages=P,
        events=events,
        makespan=makespan,
        busy=busy,
        idle=[makespan - b for b in busy],
        bubble_fraction=(1.0 - sum(busy) / (P * makespan)) if makespan > 0 else 0.0,
        peak_in_flight=peak,
        drift=drift,
        micro_batches=sum(1 for op in ops[0][:pos[0]] if op.code == _BWD) if P else 0,
        tick_start=tick_start,
        deadlock=deadlock,
        mismatches=mismatches,
        tied_wait=tied_wait if tied else [],
        tied_drain_wait=tied_drain_wait if tied else [],
    )
    if drain_tick is not None and deadlock is None:
        _measure_steady_state(result, drain_tick)
    return result


def _tick_starts(stage_ops, ends, n_ticks):
    """Start time of every tick: when the stage finished all instructions of earlier ticks."""
    starts = [0.0] * (n_ticks + 1)
    last_end = 0.0
    k = 0
    for t in range(n_ticks + 1):
        while k < len(stage_ops) and stage_ops[k].tick < t:
            last_end = ends[k]
            k += 1
        starts[t] = last_end
    return starts


def _measure_steady_state(result, drain_tick):
    first_backward = next((e.start for e in result.events[0] if e.kind == "backward"), None)
    if first_backward is None or drain_tick >= len(result.tick_start[0]):
        return
    begin, end = first_backward, result.tick_start[0][drain_tick]
    if end <= begin:
        return
    inside = 0.0
    for stage_events in result.events:
        starts = [e.start for e in stage_events]
        # events are in time order per stage; skip those ending before the window
        for e in stage_events[max(0, bisect.bisect_left(starts, begin) - 1):]:
            if e.start >= end:
                break
            if e.kind in COMPUTE_KINDS:
                inside += max(0.0, min(e.end, end) - max(e.start, begin))
    result.steady_window = (begin, end)
    result.steady_state_bubble = 1.0 - inside / (result.stages * (end - begin))


# -- programs ---------------------------------------------------------------------------


def stock_programs(stages, micro_batches, batches=1):
    """DeepSpeed's own ``TrainSchedule`` per stage, repeated ``batches`` times (a flush after each)."""
    programs = [[] for _ in range(stages)]
    for _ in range(batches):
        for s in range(stages):
            programs[s].extend(list(TrainSchedule(micro_batches=micro_batches, stages=stages, stage_id=s)))
    return programs


def paci_programs(stages, micro_batches, window, calls, drain=True):
    """PACI streams per stage: ``calls`` times ``advance(2*M)`` (one ``train_batch`` each), then ``drain()``.

    The drain (if any) starts at tick ``2 * micro_batches * calls`` on every stage.
    """
    streams = [PACIStream(stages, s, window) for s in range(stages)]
    programs = [[] for _ in range(stages)]
    for _ in range(calls):
        for s, stream in enumerate(streams):
            programs[s].extend(stream.advance(2 * micro_batches))
    if drain:
        for s, stream in enumerate(streams):
            programs[s].extend(stream.drain())
    return programs


def simulate_stock(stages, micro_batches, batches=1, cost=None):
    """:func:`simulate` of :func:`stock_programs`."""
    return simulate(stock_programs(stages, micro_batches, batches), cost)


def simulate_schedule(schedule, stages, micro_batches, window=None, calls=1, cost=None):
    """``(result, title)`` of simulating ``schedule`` ("paci" or "stock"), for timelines and reports."""
    if schedule == "paci":
        result, label = simulate_paci(stages, micro_batches, window, calls, cost), f"PACI a={window or micro_batches}"
    else:
        result, label = simulate_stock(stages, micro_batches, calls, cost), "stock 1F1B-flush"
    return result, f"simulated {label}, P={stages}, M={micro_batches}, {calls} calls"


def simulate_paci(stages, micro_batches, window=None, calls=1, cost=None):
    """:func:`simulate` of :func:`paci_programs` (``window`` defaults to ``micro_batches``), steady state measured."""
    window = window or micro_batches
    programs = paci_programs(stages, micro_batches, window, calls)
    return simulate(programs, cost, drain_tick=2 * micro_batches * calls)


def long_run_period(schedule, stages, micro_batches, window=None, calls=4, cost=None):
    """Long-run time per micro-batch: ``(makespan(2N) - makespan(N)) / (N*M)`` with ``N = calls``.

    The difference of two run lengths cancels the one-off fill and drain, so this is
    the asymptotic period of an unbounded run. ``schedule`` is ``"paci"`` or ``"stock"``.
    """

    def makespan(n):
        if schedule == "paci":
            result = simulate_paci(stages, micro_batches, window, n, cost)
        elif schedule == "stock":
            result = simulate_stock(stages, micro_batches, n, cost)
        else:
            raise ValueError(f"unknown schedule {schedule!r} (paci or stock)")
        result.raise_for_errors()
        return result.makespan

    return (makespan(2 * calls) - makespan(calls)) / (calls * micro_batches)


# -- published reference formulas ------------------------------------------------------

ZB_SOURCE = ("Qi et al., Zero Bubble Pipeline Parallelism, arXiv 2401.10241, Table 2 (per-stage bubble time; "
             "T_B = input-gradient part, T_W = weight-gradient part)")


def reference_rows(stages, micro_batches, f=1.0):
    """Bubble fractions of GPipe/1F1B, ZB-1p and ZB-2p from published formulas.

    Assumes forward ``T_F = f`` and a backward of ``2f`` that zero-bubble schedules
    split into ``T_B = f`` (input gradient) and ``T_W = f`` (weight gradient). Per-stage
    idle time ("bubble size", ``ZB_SOURCE``):

    * GPipe and 1F1B: ``(P-1)(T_F+T_B+T_W)``
    * ZB-1p: the paper's handcrafted ZB-H1 bound ``(P-1)(T_F+T_B-T_W)``, which ZB-1p
      (automatic, same 1F1B memory) matches or beats
    * ZB-2p: ZB-H2's ``(P-1)(T_F+T_B-2T_W)`` (2x activation memory)

    (With ``B`` denoting the full backward ``T_B+T_W``, as in DualPipe's README, these
    read ``(P-1)(F+B)``, ``(P-1)(F+B-2W)``, ``(P-1)(F+B-3W)``.) The fraction reported
    is idle over total stage time, comparable to :attr:`SimResult.bubble_fraction`:
    ``bubble / (M*(T_F+T_B+T_W) + bubble)``, i.e. ``(P-1)/(M+P-1)`` for 1F1B,
    ``(P-1)/(3M+P-1)`` for ZB-1p and ``0`` for ZB-2p. (The ZB README's "bubble rate"
    ``(p-1)/m``, ``(p-1)/3m`` divides by compute time instead.) Peak in-flight
    micro-batches (stage 0): GPipe ``M``, 1F1B and ZB-1p ``P``, ZB-2p ``2P-1``.
    """
    P, M = stages, micro_batches
    t_f, t_b, t_w = f, f, f
    work = M * (t_f + t_b + t_w)

    def row(name, bubble_time, peak, formula):
        bubble_time = max(0.0, bubble_time)
        return {
            "P": P,
            "M": M,
            "schedule": name,
            "bubble_time": bubble_time,
            "bubble_fraction": bubble_time / (work + bubble_time),
            "peak_in_flight": peak,
            "max_drift": 0,
            "formula": formula,
            "source": ZB_SOURCE,
        }

    return [
        row("GPipe/1F1B (formula)", (P - 1) * (t_f + t_b + t_w), M, "(P-1)(T_F+T_B+T_W) -> (P-1)/(M+P-1)"),
        row("ZB-1p (formula)", (P - 1) * (t_f + t_b - t_w), P, "(P-1)(T_F+T_B-T_W) -> (P-1)/(3M+P-1)"),
        row("ZB-2p (formula)", (P - 1) * (t_f + t_b - 2 * t_w), 2 * P - 1, "(P-1)(T_F+T_B-2T_W) -> 0"),
    ]


# -- comparison table -------------------------------------------------------------------


def comparison_rows(stages, micro_batches, window=None, calls=8, cost=None, peers=False, weight_share=0.5):
    """Rows for one (P, M): stock (DeepSpeed TrainSchedule), PACI, and the formula rows.

    ``peers``: also one row per torch.distributed.pipelining schedule, timed from its own action list
    (:func:`ds_paci.tools.peer_schedules.peer_rows`), with each stage's backward split ``1 - weight_share`` :
    ``weight_share`` into input and weight gradient.

    ``throughput_vs_stock`` is the ratio of long-run micro-batches per unit time (see
    :func:`long_run_period`); for formula rows ``(1-b)/(1-b_1F1B)`` (same compute).
    ``bubble_fraction`` of the simulated rows covers ``calls`` batches/calls, PACI's
    including its single fill and drain.
    """
    P, M = stages, micro_batches
    cost = cost or CostModel()
    window = window or M
    ideal = (M + P - 1) / M
    stock = simulate_stock(P, M, calls, cost).raise_for_errors()
    paci = simulate_paci(P, M, window, calls, cost).raise_for_errors()
    stock_period = long_run_period("stock", P, M, cost=cost)
    paci_period = long_run_period("paci", P, M, window, calls, cost)

    def sim_row(name, result, period, steady):
        return {
            "P": P,
            "M": M,
            "schedule": name,
            "bubble_fraction": result.bubble_fraction,
            "steady_state_bubble": steady,
            "throughput_vs_stock": stock_period / period,
            "peak_in_flight": max(result.peak_in_flight),
            "peak_in_flight_per_stage": result.peak_in_flight,
            "max_drift": result.max_drift,
            "ideal_ratio": ideal,
        }

    rows = [
        sim_row("stock 1F1B-flush (DeepSpeed)", stock, stock_period, None),
        sim_row(f"PACI (a={window}, {calls} calls)", paci, paci_period, paci.steady_state_bubble),
    ]
    f = cost.forward_time(0)
    one_f1b = (P - 1) / (M + P - 1)
    for ref in reference_rows(P, M, f):
        ref.update(steady_state_bubble=None,
                   throughput_vs_stock=(1 - ref["bubble_fraction"]) / (1 - one_f1b),
                   ideal_ratio=ideal)
        rows.append(ref)
    if peers:
        from .peer_schedules import costs_from_ranks, peer_rows
        forward = [cost.forward_time(s) for s in range(P)]
        backward = [cost.backward_time(s) for s in range(P)]
        rows.extend(peer_rows(P, M, lambda n: costs_from_ranks(forward, backward, weight_share, n), stock_period,
                              cost.latency, cost.step))
    return rows


def markdown_table(rows):
    """One markdown table of :func:`comparison_rows` rows."""

    def pct(x):
        return "n/a" if x is None else f"{100 * x:.1f}%"

    header = ("| P | M | schedule | bubble | steady-state bubble | throughput vs stock | peak in-flight (max) "
              "| max drift | ideal (M+P-1)/M |")
    lines = [header, "|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.get("unavailable"):
            lines.append(f"| {r['P']} | {r['M']} | {r['schedule']} | not run: {r['unavailable']} | | | | | "
                         f"{r['ideal_ratio']:.3f} |")
            continue
        lines.append(f"| {r['P']} | {r['M']} | {r['schedule']} | {pct(r['bubble_fraction'])} "
                     f"| {pct(r['steady_state_bubble'])} | {r['throughput_vs_stock']:.3f} | {r['peak_in_flight']} "
                     f"| {r['max_drift']} | {r['ideal_ratio']:.3f} |")
    return "\n".join(lines)


# -- command line -----------------------------------------------------------------------


def _parser():
    p = argparse.ArgumentParser(prog="python -m ds_paci.tools.simulate",
                                description="Simulate stock DeepSpeed 1F1B-flush vs PACI streams; print one "
                                "markdown table over the grid of stages x micro-batches.")
    p.add_argument("--stages", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--window", type=int, default=None, help="PACI accumulation window a (default: M)")
    p.add_argument("--calls", type=int, default=8, help="train_batch calls (PACI) / batches (stock)")
    p.add_argument("--forward", type=float, default=1.0, help="forward time per stage")
    p.add_argument("--backward", type=float, default=None, help="backward time per stage (default 2*forward)")
    p.add_argument("--latency", type=float, default=0.0, help="p2p transfer time")
    p.add_argument("--overhead", type=float, default=0.0, help="per-micro-batch time added to each forward")
    p.add_argument("--step-time", type=float, default=0.0, help="optimizer/local step time")
    p.add_argument("--peers", action="store_true",
                   help="add torch.distributed.pipelining's schedules, timed from their own action lists")
    p.add_argument("--weight-share", type=float, default=0.5,
                   help="with --peers: share of the backward that is the weight gradient (W)")
    p.add_argument("--json", metavar="OUT", help="also write the rows as JSON")
    one = p.add_argument_group("one configuration (first --stages and --micro-batches value)")
    one.add_argument("--schedule", choices=["paci", "stock"], default="paci")
    one.add_argument("--timeline", action="store_true", help="print a text timeline grid")
    one.add_argument("--width", type=int, default=100, help="text timeline columns")
    one.add_argument("--chrome", metavar="OUT", help="write a Chrome/Perfetto trace JSON")
    one.add_argument("--png", metavar="OUT", help="write a PNG timeline")
    return p


def main(argv=None):
    args = _parser().parse_args(argv)
    cost = CostModel(forward=args.forward, backward=args.backward, latency=args.latency, overhead=args.overhead,
                     step=args.step_time)
    rows = []
    for P in args.stages:
        for M in args.micro_batches:
            rows.extend(comparison_rows(P, M, args.window, args.calls, cost, args.peers, args.weight_share))
    print(markdown_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.timeline or args.chrome or args.png:
        result, title = simulate_schedule(args.schedule, args.stages[0], args.micro_batches[0], args.window, args.calls,
                                          cost)
        if result.deadlock:
            print(result.deadlock, file=sys.stderr)
        records = records_from_sim(result)
        if args.timeline:
            print()
            print(title)
            print(to_text_grid(records, width=args.width))
        if args.chrome:
            to_chrome_trace(records, args.chrome, label=title)
        if args.png:
            to_png(records, args.png, title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
