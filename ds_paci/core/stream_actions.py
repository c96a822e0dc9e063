"""Until house lands: PACI streams of DeepSpeed instruction objects as :class:`~ds_paci.core.program.Action` ticks.

Temporary bridge for the interpreters that already run on :mod:`ds_paci.core.program_run` while
:class:`~ds_paci.core.schedule.PACIStream` still emits DeepSpeed instructions with PACI's attributes on them.
Once ``PACIStream.advance``/``drain`` return Actions this module goes (its callers pass the ticks through).
"""

from deepspeed.runtime.pipe import schedule as ds

from .program import Action, Kind, from_deepspeed
from .schedule import LocalAccumulate, LocalStep

__all__ = ["stage_actions", "program_actions"]

_KIND = {ds.LoadMicroBatch: Kind.LOAD, ds.ForwardPass: Kind.FORWARD, ds.BackwardPass: Kind.BACKWARD,
         ds.SendActivation: Kind.SEND_ACT, ds.RecvActivation: Kind.RECV_ACT, ds.SendGrad: Kind.SEND_GRAD,
         ds.RecvGrad: Kind.RECV_GRAD, ds.ReduceGrads: Kind.REDUCE_GRADS, ds.ReduceTiedGrads: Kind.REDUCE_TIED,
         ds.OptimizerStep: Kind.STEP, LocalAccumulate: Kind.ACCUMULATE, LocalStep: Kind.STEP}


def _is_stock(ticks):
    return all(type(i) not in (LocalStep, LocalAccumulate) and getattr(i, "micro_batch_id", None) is None
               for tick in ticks for i in tick)


def stage_actions(stage, ticks):
    """One stage's ticks as actions: already actions pass through; DeepSpeed's own stock instructions (no
    ``micro_batch_id``) go through :func:`~ds_paci.core.program.from_deepspeed`; PACI's instructions keep their
    micro-batch ids, versions, ``lr_steps`` and forward facts. An instruction without a micro-batch id in a PACI
    stage is numbered by order of appearance of its type (as ``from_deepspeed`` does)."""
    if all(isinstance(a, Action) for tick in ticks for a in tick):
        return [list(tick) for tick in ticks]
    if _is_stock(ticks):
        return from_deepspeed(stage, ticks)
    seen = {}
    out = []
    for t, tick in enumerate(ticks):
        row = []
        for ins in tick:
            if isinstance(ins, Action):
                row.append(ins)
                continue
            kind = _KIND.get(type(ins))
            if kind is None:
                raise ValueError(f"stage {stage} tick {t}: no action for instruction {ins!r}")
            n = seen[type(ins)] = seen.get(type(ins), 0) + 1
            if isinstance(ins, LocalStep):
                row.append(Action(stage, kind, version=ins.version, lr_steps=ins.lr_steps))
            elif kind is Kind.STEP:
                row.append(Action(stage, kind, version=n))
            elif kind in (Kind.REDUCE_GRADS, Kind.REDUCE_TIED):
                row.append(Action(stage, kind))
            else:
                mb = getattr(ins, "micro_batch_id", None)
                facts = {}
                if kind is Kind.FORWARD and hasattr(ins, "window_fill"):
                    facts = dict(window_fill=ins.window_fill, crosses_step=bool(ins.crosses_step))
                row.append(Action(stage, kind, micro_batch=n - 1 if mb is None else mb, **facts))
        out.append(row)
    return out


def program_actions(programs):
    """:func:`stage_actions` of every stage."""
    return [stage_actions(s, ticks) for s, ticks in enumerate(programs)]
