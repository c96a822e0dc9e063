"""The simulator's cost model: what each action of a stage costs, in arbitrary time units
(:func:`ds_paci.tools.sim.simulate.simulate`)."""

from dataclasses import dataclass
from typing import Optional, Sequence, Union

__all__ = ["CostModel"]

Number = Union[int, float]


@dataclass(frozen=True)
class CostModel:
    """Durations, in arbitrary time units, of what a stage does.

    ``forward`` and ``backward`` are a scalar or one value per stage; ``backward``
    defaults to twice ``forward``. ``overhead`` is added to every forward (per
    micro-batch cost), ``latency`` to every point-to-point transfer (on both sides),
    ``step`` to every ``STEP`` (PACI's local step, DeepSpeed's ``OptimizerStep``), ``load`` to every
    ``LoadMicroBatch``. ``links`` (a :class:`ds_paci.tools.sim.links.LinkModel`) adds to
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
        """A ``STEP`` on ``stage`` (its window's last backward may hide the all-reduce)."""
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
