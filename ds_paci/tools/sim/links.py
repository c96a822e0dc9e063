"""The links between pipeline ranks, for the simulator: latency plus bytes over bandwidth per transfer.

Public contract:

* :class:`Link`: one kind of link, ``time(nbytes) = latency + nbytes / bandwidth`` (seconds, bytes per second).
* :class:`LinkModel`: where the ranks sit and what crosses between them. Pipeline rank ``r`` is on node
  ``r // ranks_per_node`` (consecutive stages share a node, as DeepSpeed's pipe-outer topology places them);
  two ranks on one node use ``intra``, others ``inter``. Every point-to-point transfer carries one micro-batch's
  activation (forward) or its gradient (backward), ``activation_bytes`` either way. At every optimizer step a
  stage all-reduces ``grad_bytes`` over its ``dp`` data-parallel replicas (a ring: ``2(dp-1)`` latencies and
  ``2(dp-1)/dp * grad_bytes`` over the bandwidth of ``dp_link``, the replicas being on different nodes or on one).
  With ``overlap`` the all-reduce runs during the window's last backward (bucketed, as DDP does; with
  accumulation it cannot start earlier), so the step waits only for what sticks out: ``max(0, all-reduce -
  backward)``; without it (DeepSpeed's pipeline engine and PACI's local step reduce at the step) the step waits
  for all of it. Links are not shared: two transfers on one link at the same time each get its full bandwidth.
* :meth:`LinkModel.transfer_time` and :meth:`LinkModel.step_delay` are the two numbers the simulator asks for
  (``CostModel(links=...)`` in :mod:`ds_paci.tools.sim.simulate`; the ZB-V timing in :mod:`ds_paci.tools.studies.scale`).
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    """``latency`` seconds per transfer plus bytes over ``bandwidth`` (bytes per second)."""

    latency: float
    bandwidth: float

    def time(self, nbytes):
        return self.latency + float(nbytes) / self.bandwidth


@dataclass(frozen=True)
class LinkModel:
    """See the module docstring."""

    intra: Link
    inter: Link
    ranks_per_node: int
    activation_bytes: float
    grad_bytes: float = 0.0
    dp: int = 1
    dp_link: str = "inter"
    overlap: bool = False

    def __post_init__(self):
        if self.ranks_per_node < 1 or self.dp < 1:
            raise ValueError("ranks_per_node and dp must be >= 1")
        if self.dp_link not in ("inter", "intra"):
            raise ValueError(f"dp_link must be 'inter' or 'intra', got {self.dp_link!r}")

    def node_of(self, rank):
        return rank // self.ranks_per_node

    def link(self, a, b):
        return self.intra if self.node_of(a) == self.node_of(b) else self.inter

    def transfer_time(self, a, b, nbytes=None):
        """Seconds to move one micro-batch's activation (or gradient) from rank ``a`` to rank ``b``; 0 when a == b."""
        if a == b:
            return 0.0
        return self.link(a, b).time(self.activation_bytes if nbytes is None else nbytes)

    def allreduce_time(self):
        """One stage's data-parallel gradient all-reduce (a ring over ``dp`` replicas)."""
        if self.dp == 1 or self.grad_bytes <= 0:
            return 0.0
        link = self.inter if self.dp_link == "inter" else self.intra
        return 2 * (self.dp - 1) * link.latency + 2 * (self.dp - 1) / self.dp * self.grad_bytes / link.bandwidth

    def step_delay(self, last_backward):
        """What the all-reduce adds to a step whose window ended with a backward of ``last_backward`` seconds."""
        reduce = self.allreduce_time()
        return max(0.0, reduce - last_backward) if self.overlap else reduce
