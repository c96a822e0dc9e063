"""Lowering passes: what the runtime used to reorder, placed on the program before it runs.

A :class:`~ds_paci.core.program.stream.PACIStream` gives one call's ticks (``advance``, then ``drain`` when the
call drains). The engine runs them only after :func:`lower_call`, so the program that
:func:`ds_paci.core.program.validate.validate` checks, the simulator times and the text form prints is the one
that executes. Each pass is a pure function from ticks to new ticks (actions are immutable):

* :func:`defer_steps` (sync mode, ``drain_every_batch`` with ``a = M``): every ``STEP`` of the call moves
  to the end of the call's last tick, as DeepSpeed's ``OptimizerStep`` ends its ``TrainSchedule``.
* :func:`defer_tied_last_step` (a tied owner, async): the segment's last ``STEP`` of a drain moves into a
  tick after the drain's last, marked ``in_drain``: every owner has posted its last window by then, so
  its wait is free (:mod:`ds_paci.core.program.tied_timing`). A drain that leaves the window open (evaluation,
  checkpoints) keeps a step that backward passes follow in place: the exchange carries it.
* :func:`add_tied_exchange` (a tied owner, async): before each ``STEP v``, ``TPOST v`` (this owner posts
  its window-``v`` tied gradient) and ``TAPPLY w...`` (the owners' totals it applies: the windows
  ``<= v - L`` still pending; every pending one at the step of a closing drain, ``apply_all``). The engine
  runs the post and the apply inside the local step that follows them (after the step's data-parallel
  reduce, where the gradient is final), and refuses to run if its own bookkeeping of pending windows
  disagrees with the program's.
* :func:`mark_reduce_backward` (``"paci": {"overlap_reduce": true}``, where supported): the last ``BACKWARD``
  before each ``STEP`` (with no other ``STEP`` between them) is marked ``reduce_overlap`` (``B7[dp]``): the
  engine runs the data-parallel reduce of that window under it (:mod:`ds_paci.core.step.overlap`). A step with
  no backward before it in the call (a closing drain of a window whose backwards ran in earlier calls) reduces
  at the step, as without the overlap. Runs last, so it sees the steps where the other passes put them.
* :func:`hoist_sends` (``"paci": {"nonblocking_transfers": true}``): each ``SEND_ACT`` moves right after its
  ``FORWARD`` and each ``SEND_GRAD`` right after its ``BACKWARD`` (so before the ``ACC``, ``TPOST``, ``TAPPLY``
  and ``STEP`` that follow it): the engine issues them as non-blocking sends there
  (:mod:`ds_paci.core.engine.transfers`). A send whose forward or backward ran in an earlier call (the stream puts
  a send one tick after its compute, which may be the next call's first tick) moves to the front of the call:
  nothing of the program runs between the two. Only the position of each send changes: the sends of each kind
  keep their order, so the pairing with the neighbour's receives is the same. Blocking sends must not run in
  this order (a stage would send ahead of the receive its neighbour posts only after a send of its own).
"""

from .actions import Action, Kind

__all__ = ["defer_steps", "defer_tied_last_step", "add_tied_exchange", "mark_reduce_backward", "hoist_sends",
           "lower_call"]

_SENT_AFTER = {Kind.SEND_ACT: Kind.FORWARD, Kind.SEND_GRAD: Kind.BACKWARD}


def defer_steps(ticks):
    """Every ``STEP`` moved, in order, to the end of the last tick (none: ``ticks`` unchanged)."""
    steps = [a for tick in ticks for a in tick if a.kind is Kind.STEP]
    if not steps:
        return ticks
    out = [[a for a in tick if a.kind is not Kind.STEP] for tick in ticks]
    out[-1] += steps
    return out


def defer_tied_last_step(ticks, carry):
    """The drain's last ``STEP`` moved into a tick after the drain, marked ``in_drain`` (see the module docstring).

    ``carry``: the drain leaves the window open; the step is then moved only if no backward pass follows it.
    """
    last, after = None, False
    for t, tick in enumerate(ticks):
        for n, a in enumerate(tick):
            if a.kind is Kind.STEP:
                last, after = (t, n), False
            elif a.kind is Kind.BACKWARD:
                after = True
    if last is None or (carry and after):
        return ticks
    t, n = last
    step = ticks[t][n]
    out = [list(tick) for tick in ticks]
    del out[t][n]
    return out + [[step.with_(in_drain=True)]]


def add_tied_exchange(ticks, pending, lag, carry):
    """``TPOST``/``TAPPLY`` before every ``STEP`` of a tied owner (see the module docstring).

    ``pending``: the windows posted and not yet applied when the ticks begin (a checkpoint or an open-window
    drain carries them); ``lag``: ``L`` (:func:`ds_paci.core.program.tied_timing.tied_lag`); ``carry``: whether the
    drain in ``ticks`` (if any) leaves the window open, so that even its last step applies only what the lag
    allows. Returns the new ticks.
    """
    pending = sorted(pending)
    out = []
    for tick in ticks:
        row = []
        for a in tick:
            if a.kind is Kind.STEP:
                final = a.in_drain and not carry
                pending.append(a.version)
                due = list(pending) if final else [w for w in pending if w <= a.version - lag]
                pending = [w for w in pending if w not in due]
                row.append(Action(a.stage, Kind.TIED_POST, version=a.version, lag=lag, in_drain=a.in_drain))
                if due:
                    row.append(Action(a.stage, Kind.TIED_APPLY, windows=tuple(due), lag=lag, apply_all=final,
                                      in_drain=a.in_drain))
            row.append(a)
        out.append(row)
    return out


def mark_reduce_backward(ticks):
    """The last ``BACKWARD`` before each ``STEP`` marked ``reduce_overlap`` (see the module docstring)."""
    out = [list(tick) for tick in ticks]
    last = None  # (tick, index) of the latest backward since the last step
    for t, tick in enumerate(out):
        for n, a in enumerate(tick):
            if a.kind is Kind.BACKWARD:
                last = (t, n)
            elif a.kind is Kind.STEP:
                if last is not None:
                    lt, ln = last
                    out[lt][ln] = out[lt][ln].with_(reduce_overlap=True)
                last = None
    return out


def hoist_sends(ticks):
    """Each send right after the forward or backward it sends the result of; a send of an earlier call's compute
    first in the call (see the module docstring). Ticks keep their number (a tick may become empty)."""
    computed = {(a.kind, a.micro_batch) for tick in ticks for a in tick if a.kind in _SENT_AFTER.values()}
    sends = {(a.kind, a.micro_batch) for tick in ticks for a in tick if a.kind in _SENT_AFTER}
    orphans, out = [], []
    for tick in ticks:
        row = []
        for a in tick:
            if a.kind in _SENT_AFTER:
                if (_SENT_AFTER[a.kind], a.micro_batch) not in computed:
                    orphans.append(a)
                continue
            row.append(a)
            for send, after in _SENT_AFTER.items():
                if a.kind is after and (send, a.micro_batch) in sends:
                    row.append(Action(a.stage, send, micro_batch=a.micro_batch))
        out.append(row)
    if orphans:
        out[0] = orphans + out[0]
    return out


def lower_call(ticks, drain_ticks=None, *, sync_steps=False, tied=None, carry=False, overlap_reduce=False,
               nonblocking=False):
    """One call's program for one stage: the stream's ``ticks`` (``advance``), then ``drain_ticks`` if the call
    drains, with the passes the stage needs.

    ``nonblocking``: :func:`hoist_sends` over the whole call first. ``sync_steps``: :func:`defer_steps` over the
    whole call. ``tied``: ``(pending, lag)`` on a tied owner in async mode: :func:`defer_tied_last_step` over the
    drain, then :func:`add_tied_exchange` over the call. ``overlap_reduce``: :func:`mark_reduce_backward` last.
    """
    drain_ticks = list(drain_ticks or [])
    if tied is not None and drain_ticks:
        drain_ticks = defer_tied_last_step(drain_ticks, carry)
    program = list(ticks) + drain_ticks
    if nonblocking:
        program = hoist_sends(program)
    if sync_steps:
        program = defer_steps(program)
    if tied is not None:
        pending, lag = tied
        program = add_tied_exchange(program, pending, lag, carry)
    if overlap_reduce:
        program = mark_reduce_backward(program)
    return program
