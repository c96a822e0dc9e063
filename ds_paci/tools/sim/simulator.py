"""The simulator: a timing handler of :func:`ds_paci.core.program.interpreter.run_program` under a :class:`CostModel`.

Runs the very programs the engines execute, without processes or tensors: PACI's streams
(:func:`ds_paci.tools.sim.simulate.paci_programs`) and DeepSpeed's own ``TrainSchedule``
(:func:`ds_paci.tools.sim.simulate.stock_programs`, converted with :func:`ds_paci.core.program.actions.from_deepspeed`),
and measures bubble, in-flight activations, weight-version drift, tied waits and deadlocks.

The execution semantics are the interpreter's (:mod:`ds_paci.core.program.interpreter`): stages run their actions in
order, tick boundaries are not barriers, p2p actions are blocking rendezvous (FIFO per link and direction), a
``TIED_APPLY`` waits for the other owners' posts, a deadlock names each stuck stage. This module adds time:

* forward, backward, step and load occupy the stage for their cost; everything else (``ACC``,
  ``REDUCE_GRADS``, ``REDUCE_TIED``, ``TPOST``) is free and stage-local;
* a transfer starts when both sides have arrived and occupies both for ``cost.transfer_time`` (the earlier
  side waits meanwhile: a ``wait`` event);
* ``tied`` (a :class:`~ds_paci.tools.sim.tied.TiedExchange`) places the tied-weight exchange on the program
  (:func:`~ds_paci.tools.sim.tied.add_tied_exchange`): an owner posts its window at the start of each local
  step and, before its ``k``-th step, waits until every other owner has posted ``k - lag``; the drained last
  step waits for every owner's last post. The time an owner spends there is ``tied_wait`` (the last step's
  separately, ``tied_drain_wait``).

With ``transfers="nonblocking"`` the program runs under :func:`~ds_paci.tools.sim.nonblocking.run_nonblocking`
instead (isend/irecv: a send never holds its stage; see that module); everything else is the same.

Micro-batch ids of paired p2p actions must agree; disagreements are reported as mismatches. ``STEP`` (PACI's
local step, DeepSpeed's ``OptimizerStep``) counts as a weight version (drift is measured in those).
"""

import bisect
from collections import Counter
from dataclasses import dataclass, field
from typing import List, NamedTuple, Optional

from ds_paci.core.program.actions import Action, Kind, from_deepspeed
from ds_paci.core.program.interpreter import Handler, run_program

from .records import COMPUTE_KINDS, instr_text
from .cost import CostModel
from .nonblocking import run_nonblocking
from .tied import add_tied_exchange

__all__ = ["Event", "StuckStage", "Deadlock", "DeadlockError", "PairingError", "SimResult", "simulate"]


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


# -- the timing handler -----------------------------------------------------------------

_EVENT_KIND = {Kind.FORWARD: "forward", Kind.BACKWARD: "backward", Kind.STEP: "step", Kind.LOAD: "load",
               Kind.ACCUMULATE: "step", Kind.REDUCE_GRADS: "step", Kind.REDUCE_TIED: "step",
               Kind.SEND_ACT: "send", Kind.SEND_GRAD: "send", Kind.RECV_ACT: "recv", Kind.RECV_GRAD: "recv"}
_FREE = frozenset({Kind.ACCUMULATE, Kind.REDUCE_GRADS, Kind.REDUCE_TIED, Kind.TIED_POST})


@dataclass
class _StageTiming:
    """What the simulator measures on one stage."""

    forward: float
    backward: float
    step: float
    events: list = field(default_factory=list)
    ends: list = field(default_factory=list)  # end time of every executed action, in program order
    busy: float = 0.0
    version: int = 0
    forward_version: dict = field(default_factory=dict)
    in_flight: int = 0
    peak: int = 0
    drift: Counter = field(default_factory=Counter)
    tied_wait: float = 0.0
    tied_drain_wait: float = 0.0

    def duration(self, action, load):
        kind = action.kind
        if kind is Kind.FORWARD:
            self.forward_version[action.micro_batch] = self.version
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
            return self.forward
        if kind is Kind.BACKWARD:
            start_version = self.forward_version.pop(action.micro_batch, None)
            if start_version is not None:
                self.drift[self.version - start_version] += 1
            self.in_flight -= 1
            return self.backward
        if kind is Kind.STEP:
            self.version += 1
            return self.step
        return load if kind is Kind.LOAD else 0.0


class _Timing(Handler):
    """Adds the cost model's time to :func:`run_program`'s execution and records every stage's timeline."""

    def __init__(self, stages, cost):
        self.cost = cost
        self.stages = [_StageTiming(cost.forward_time(s), cost.backward_time(s), cost.step_time(s))
                       for s in range(stages)]

    def run(self, stage, action, now):
        st = self.stages[stage]
        duration = st.duration(action, self.cost.load)
        end = now + duration
        if action.kind is not Kind.TIED_POST:
            st.events.append(Event(now, end, instr_text(action), _EVENT_KIND[action.kind]))
        if action.kind not in _FREE:
            st.busy += duration
        st.ends.append(end)
        return duration

    def transfer(self, sender, send, receiver, recv, arrivals):
        start = max(arrivals)
        end = start + self.cost.transfer_time(sender, receiver)
        for s, action, arrival in ((sender, send, arrivals[0]), (receiver, recv, arrivals[1])):
            st, text = self.stages[s], instr_text(action)
            if arrival < start:
                st.events.append(Event(arrival, start, text, "wait"))
            st.events.append(Event(start, end, text, _EVENT_KIND[action.kind]))
            st.ends.append(end)
        return end

    # the non-blocking transfers' hooks (:func:`~ds_paci.tools.sim.nonblocking.run_nonblocking`)
    def transfer_time(self, sender, receiver):
        return self.cost.transfer_time(sender, receiver)

    def waited(self, stage, action, start, end):
        self.stages[stage].events.append(Event(start, end, "sends" if action is None else instr_text(action), "wait"))

    def ended(self, stage, action, end):
        self.stages[stage].ends.append(end)

    def tied_wait(self, stage, action, now, posts):
        st = self.stages[stage]
        until = max([now] + list(posts.values()))
        if until > now:
            # named after the step it guards, as the engine's watchdog does
            step = max(action.windows) if action.apply_all else action.windows[0] + (action.lag or 0)
            st.events.append(Event(now, until, f"TIED{step}", "wait"))
            if action.apply_all:
                st.tied_drain_wait += until - now
            else:
                st.tied_wait += until - now
        st.ends.append(until)
        return until


# -- the simulation ---------------------------------------------------------------------


def simulate(programs, cost=None, *, drain_tick=None, tied=None, transfers="blocking"):
    """Simulate ``programs`` (``programs[s]`` = stage ``s``'s list of ticks) under ``cost``.

    ``programs`` hold :class:`~ds_paci.core.program.actions.Action` ticks; a stage of DeepSpeed instructions (its own
    ``TrainSchedule``) is converted with :func:`~ds_paci.core.program.actions.from_deepspeed`.

    Never hangs: a deadlock is returned in :attr:`SimResult.deadlock` (call
    :meth:`SimResult.raise_for_errors` to turn it into :class:`DeadlockError`).

    ``drain_tick`` (the index of the first drain tick, e.g. ``2*M*calls`` for
    :func:`~ds_paci.tools.sim.simulate.paci_programs`) enables the steady-state measurement. The steady window
    runs from the start of stage 0's first backward pass (stage 0 is the last stage
    to enter 1F1B, so from then on every stage alternates forward and backward) to the
    time stage 0 begins ``drain_tick`` (it stops admitting micro-batches there, which
    is the first stage to leave the steady state). ``steady_state_bubble`` is
    ``1 - (compute time of all stages inside the window) / (P * window length)``.

    ``tied`` (a :class:`~ds_paci.tools.sim.tied.TiedExchange`) adds the tied-weight exchange (see the module
    docstring); a program that already carries ``TPOST``/``TAPPLY`` actions is timed with them as it is.

    ``transfers``: ``"blocking"`` (the module docstring's rendezvous, DeepSpeed's ``p2p.send``/``recv``) or
    ``"nonblocking"`` (isend/irecv, :mod:`ds_paci.tools.sim.nonblocking`: a send never occupies a stage, at most one
    in flight per link, receives posted one ahead; no tied exchange).
    """
    if transfers not in ("blocking", "nonblocking"):
        raise ValueError(f"transfers must be 'blocking' or 'nonblocking', got {transfers!r}")
    cost = cost or CostModel()
    program = [ticks if all(isinstance(a, Action) for tick in ticks for a in tick) else from_deepspeed(s, ticks)
               for s, ticks in enumerate(programs)]
    if tied is not None:
        program = add_tied_exchange(program, tied)
    has_tied = tied is not None or any(a.kind is Kind.TIED_APPLY for ticks in program for t in ticks for a in t)
    P = len(program)
    timing = _Timing(P, cost)
    run = run_program(program, timing) if transfers == "blocking" else run_nonblocking(program, timing)
    deadlock = None
    if run.stuck:
        deadlock = Deadlock(time=run.deadlock_time,
                            stuck=[StuckStage(x.stage, x.tick, x.index, instr_text(x.action), x.waits_for)
                                   for x in run.stuck])
    stages = timing.stages
    makespan = max(run.clock, default=0.0)
    busy = [st.busy for st in stages]
    result = SimResult(
        stages=P,
        events=[st.events for st in stages],
        makespan=makespan,
        busy=busy,
        idle=[makespan - b for b in busy],
        bubble_fraction=(1.0 - sum(busy) / (P * makespan)) if makespan > 0 else 0.0,
        peak_in_flight=[st.peak for st in stages],
        drift=[st.drift for st in stages],
        micro_batches=sum(1 for _, _, a in run.positions[0][:run.executed[0]] if a.kind is Kind.BACKWARD) if P else 0,
        tick_start=[_tick_starts(run.positions[s], stages[s].ends, len(program[s])) for s in range(P)],
        deadlock=deadlock,
        mismatches=run.mismatches,
        tied_wait=[st.tied_wait for st in stages] if has_tied else [],
        tied_drain_wait=[st.tied_drain_wait for st in stages] if has_tied else [],
    )
    if drain_tick is not None and deadlock is None:
        _measure_steady_state(result, drain_tick)
    return result


def _tick_starts(positions, ends, n_ticks):
    """Start time of every tick: when the stage finished all actions of earlier ticks."""
    ends = ends + [0.0] * (len(positions) - len(ends))  # actions a deadlock left unrun count as ending at 0
    starts = [0.0] * (n_ticks + 1)
    last_end = 0.0
    k = 0
    for t in range(n_ticks + 1):
        while k < len(positions) and positions[k][0] < t:
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
