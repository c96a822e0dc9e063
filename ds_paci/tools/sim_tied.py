"""The tied-weight exchange as explicit program actions, for the simulator.

:class:`TiedExchange` names the owners and the lag; :func:`add_tied_exchange` is the lowering pass that places
the exchange on a program (until house lands: the lead's ``add_tied_exchange`` pass in
:mod:`ds_paci.core.schedule` will place the same actions on the engine's programs, and this one goes). What it
places, per owner stage and its ``k``-th local step (windows are numbered by step, from 1):

* before the step ``TPOST k``: the owner posts its window ``k`` at the start of the step;
* then, where ``k - lag >= 1``, ``TAPPLY k-lag``: the step waits for every other owner's post of ``k - lag``;
* ``drained``: the program's last step of every owner runs after the drain's last tick, as in the engine: it
  moves, with its post, to the end of the stage's last non-empty tick (or stays in its own tick, if later), and its apply becomes the closing
  ``TAPPLY k-lag..k[all]`` (every pending window; :mod:`ds_paci.core.program_run` makes it wait for every
  other owner's last post).

The waiting itself is the interpreter's (:mod:`ds_paci.core.program_run`); the simulator only times it.
"""

from dataclasses import dataclass

from ds_paci.core.program import Action, Kind

__all__ = ["TiedExchange", "add_tied_exchange"]


@dataclass(frozen=True)
class TiedExchange:
    """Tied-weight owners (stages) and the lag of their exchange, for :func:`ds_paci.tools.simulate.simulate`.

    ``drained``: the program ends with a drain, so its last step of every owner waits for
    every owner's last post (the engine runs it after the drain's last tick).
    """

    owners: tuple
    lag: int
    drained: bool = True


def _owner_ticks(stage, ticks, lag, drained):
    steps = sum(a.kind is Kind.STEP for tick in ticks for a in tick)
    out, k, closing, closing_tick = [], 0, None, 0
    for t, tick in enumerate(ticks):
        row = []
        for action in tick:
            if action.kind is not Kind.STEP:
                row.append(action)
                continue
            k += 1
            post = Action(stage, Kind.TIED_POST, version=k, lag=lag)
            if drained and k == steps:
                apply = Action(stage, Kind.TIED_APPLY, windows=tuple(range(max(1, k - lag), k + 1)), lag=lag,
                               apply_all=True)
                closing, closing_tick = [post, apply, action.with_(in_drain=True)], t
                continue
            row.append(post)
            if k - lag >= 1:
                row.append(Action(stage, Kind.TIED_APPLY, windows=(k - lag,), lag=lag))
            row.append(action)
        out.append(row)
    if closing:
        # the end of the last tick with an action, or the step's own tick if that comes later
        last = max([closing_tick] + [t for t, row in enumerate(out) if row])
        out[last].extend(closing)
    return out


def add_tied_exchange(program, tied):
    """``program`` (Actions) with ``tied``'s exchange placed on its owners (see the module docstring)."""
    owners = set(tied.owners)
    return [_owner_ticks(s, ticks, tied.lag, tied.drained) if s in owners else [list(t) for t in ticks]
            for s, ticks in enumerate(program)]
