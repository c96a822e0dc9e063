"""The tied-weight exchange for the simulator: which stages own tied weights, and the lowering that places it.

:class:`TiedExchange` names the owners and the lag; :func:`add_tied_exchange` lowers a program with the
engine's own passes (:mod:`ds_paci.core.program.passes`), so the simulator times the program the engine runs. On each
owner stage:

* ``drained`` (the program ends with a drain that closes the window): the last ``STEP`` moves into a tick
  after the drain (:func:`~ds_paci.core.program.passes.defer_tied_last_step`), where the engine runs it;
* before every ``STEP v``: ``TPOST v`` (the owner posts its window ``v`` at the start of the step) and, where
  windows are due, ``TAPPLY`` (``v - lag``; every pending window at the deferred last step, ``apply_all``)
  (:func:`~ds_paci.core.program.passes.add_tied_exchange`).

The waiting itself is the interpreter's (:mod:`ds_paci.core.program.interpreter`: an apply waits for every other
owner's posts of its windows); the simulator only times it.
"""

from dataclasses import dataclass

from ds_paci.core.program import passes

__all__ = ["TiedExchange", "add_tied_exchange"]


@dataclass(frozen=True)
class TiedExchange:
    """Tied-weight owners (stages) and the lag of their exchange, for :func:`ds_paci.tools.sim.simulate.simulate`.

    ``drained``: the program ends with a drain, so its last step of every owner waits for
    every owner's last post (the engine runs it after the drain's last tick).
    """

    owners: tuple
    lag: int
    drained: bool = True


def add_tied_exchange(program, tied):
    """``program`` (one segment of Actions per stage) with ``tied``'s exchange placed on its owners."""
    owners = set(tied.owners)
    out = []
    for s, ticks in enumerate(program):
        ticks = [list(t) for t in ticks]
        if s in owners:
            if tied.drained:
                ticks = passes.defer_tied_last_step(ticks, carry=False)
            ticks = passes.add_tied_exchange(ticks, [], tied.lag, carry=False)
        out.append(ticks)
    return out
