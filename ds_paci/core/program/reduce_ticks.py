"""When the local steps of a program run, counted in local steps: :func:`step_ticks`.

A local step holds the stage's data-parallel reduce; across nodes that reduce costs far more than the pipeline's
compute between two steps. :func:`step_ticks` runs a program on the one interpreter
(:mod:`ds_paci.core.program.interpreter`: blocking rendezvous transfers, program order per stage) with every
``STEP`` lasting one unit and every other action none, and returns the time each ``STEP`` starts: its *reduce tick*,
the number of steps that must finish before it can start. Steps with the same reduce tick run at the same time
whatever their reduces cost; in the long run a program costs ``r`` (one reduce) per distinct reduce tick. Under the
``"aligned"`` step phase the steps of one window chain along the gradient path (stage ``s+1``'s step delays the
gradient stage ``s`` needs before its own), so the ticks of one wave spread over ``min(P, a)`` values; under
``"diagonal"`` (:mod:`ds_paci.core.program.stream`) every stage's ``k``-th step of the steady state has the same tick.

Pure: imports only the interpreter.
"""

from .actions import Kind
from .interpreter import Handler, run_program

__all__ = ["step_ticks"]


class _StepClock(Handler):

    def __init__(self, stages):
        self.ticks = [[] for _ in range(stages)]

    def run(self, stage, action, now):
        if action.kind is Kind.STEP:
            self.ticks[stage].append(now)
            return 1.0
        return None


def step_ticks(program):
    """``ticks[s][k]``: the reduce tick of stage ``s``'s ``k``-th ``STEP`` (see the module docstring); integers.

    Raises ``RuntimeError`` if the program does not run to its end (a deadlock or unpaired transfers)."""
    clock = _StepClock(len(program))
    run = run_program(program, clock)
    if not run.ok:
        raise RuntimeError("the program does not run: " + "; ".join([str(x) for x in run.stuck] + run.mismatches))
    return [[int(t) for t in ticks] for ticks in clock.ticks]
