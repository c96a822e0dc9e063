"""torch.distributed.pipelining's schedules as data: their own per-rank action lists, timed under a cost model.

The peers of the PACI study (``python -m ds_paci.tools.bench --study peers``) are torch's ``ScheduleGPipe``,
``Schedule1F1B``, ``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble`` (ZB1P), ``ScheduleZBVZeroBubble``
(ZB-V) and ``ScheduleDualPipeV`` (:data:`PEERS`). This module

* builds each schedule's compute action lists (``pipeline_order``: ``F``, ``I``, ``W``, ``B`` and DualPipeV's
  ``OVERLAP_F_B`` per stage and micro-batch) with torch's own constructors, without processes
  (:func:`action_lists`); a schedule that refuses a shape (1F1B with ``M < P``, DualPipeV with ``M < 2P``) raises
  :class:`ScheduleUnavailable` with torch's reason;
* times those lists (:func:`time_actions`) with a small lowering of its own: every rank runs its compute actions
  in order (the ``None`` placeholders are skipped, as torch's runtime skips them); ``F`` of stage ``k+1`` waits
  for ``F`` of stage ``k``; ``I``/``B`` of stage ``k`` for ``I``/``B`` of stage ``k+1`` (the last stage for its own
  ``F``); ``W`` for ``I`` of the same stage and micro-batch; a transfer between ranks adds ``latency``. Sends never
  block (torch's runtime waits for them at the end of the step). :func:`long_run_period` repeats the step to get
  the time per step of a long run (the next step's first forwards may start while the last ranks still finish).
* produces rows comparable to :func:`ds_paci.tools.sim.simulate.comparison_rows` (:func:`peer_rows`).

Costs are per *stage* of the schedule (:class:`StageCosts`). torch's first stage, whose input needs no gradient,
computes nothing in its ``I`` action and its whole backward in ``W`` (``stage.backward_weight_one_chunk``);
:func:`stage_costs` models that (``torch_first_stage=True``) because the measured engines do it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["PEERS", "PeerSchedule", "ScheduleUnavailable", "StageCosts", "action_lists", "action_strings",
           "rank_stages", "stage_costs", "costs_from_ranks", "time_actions", "long_run_period", "peak_in_flight",
           "peer_rows"]


@dataclass(frozen=True)
class PeerSchedule:
    """A torch schedule: class name, virtual stages per rank and their placement (``loop`` or ``v``)."""

    cls: str
    title: str
    stages_per_rank: int
    style: str


#: The study's torch schedules, keyed by the names the study uses.
PEERS = {
    "gpipe": PeerSchedule("ScheduleGPipe", "GPipe (torch)", 1, "loop"),
    "1f1b": PeerSchedule("Schedule1F1B", "1F1B (torch)", 1, "loop"),
    "interleaved-1f1b": PeerSchedule("ScheduleInterleaved1F1B", "interleaved 1F1B", 2, "loop"),
    "zb1p": PeerSchedule("ScheduleInterleavedZeroBubble", "ZB1P", 2, "loop"),
    "zbv": PeerSchedule("ScheduleZBVZeroBubble", "ZB-V", 2, "v"),
    "dualpipev": PeerSchedule("ScheduleDualPipeV", "DualPipeV", 2, "v"),
}


class ScheduleUnavailable(ValueError):
    """torch's schedule refuses this shape; the message is torch's reason."""


def rank_stages(name: str, ranks: int, rank: int) -> list:
    """The virtual stage indices ``rank`` holds under schedule ``name`` (torch's placement)."""
    from torch.distributed.pipelining._utils import generate_rank_to_stage_mapping
    peer = PEERS[name]
    return generate_rank_to_stage_mapping(ranks, ranks * peer.stages_per_rank, style=peer.style)[rank]


class _StageShape:
    """What torch's schedule constructors read from a stage to plan (its shape), without a process group."""

    def __init__(self, stage_index: int, num_stages: int, ranks: int, rank: int):
        import torch
        self.stage_index, self.num_stages = stage_index, num_stages
        self.group_size, self.group_rank = ranks, rank
        self.submod = torch.nn.Identity()
        self.stage_index_to_group_rank = {}


def action_lists(name: str, ranks: int, micro_batches: int) -> dict:
    """``{rank: [action, ...]}``: the schedule's ``pipeline_order`` as torch computes it (``None`` kept).

    ``1f1b`` is the exception: torch 2.13's ``Schedule1F1B.pipeline_order`` is not what its runtime runs (for
    the last rank it starts at ``F1`` and lists ``F<M>``), so its list here is the order
    ``Schedule1F1B._step_microbatches`` executes (:func:`_runtime_1f1b`), which the study records and checks.
    Raises :class:`ScheduleUnavailable` when torch's constructor refuses ``(ranks, micro_batches)``.
    """
    from torch.distributed.pipelining import schedules
    peer = PEERS[name]
    cls = getattr(schedules, peer.cls)
    num_stages = ranks * peer.stages_per_rank
    mine = rank_stages(name, ranks, 0)
    stages = [_StageShape(s, num_stages, ranks, 0) for s in mine]
    try:
        if peer.stages_per_rank == 1:
            schedule = cls(stages[0], n_microbatches=micro_batches)
        else:
            schedule = cls(stages, n_microbatches=micro_batches)
    except ValueError as e:
        raise ScheduleUnavailable(" ".join(str(e).replace("\\", " ").split())) from e
    if name == "1f1b":
        return {rank: _runtime_1f1b(rank, ranks, micro_batches) for rank in range(ranks)}
    return {rank: list(actions) for rank, actions in schedule.pipeline_order.items()}


def _runtime_1f1b(stage: int, stages: int, micro_batches: int) -> list:
    """The compute order of ``Schedule1F1B._step_microbatches`` on ``stage``: ``min(M, P - stage)`` forwards, then
    alternately one backward and one forward, then the remaining backwards."""
    from torch.distributed.pipelining.schedules import _Action, _ComputationType
    forward, backward = _ComputationType.FORWARD, _ComputationType.FULL_BACKWARD
    warmup = min(micro_batches, stages - stage)
    order = [_Action(stage, forward, m) for m in range(warmup)]
    for b in range(micro_batches):
        order.append(_Action(stage, backward, b))
        if warmup + b < micro_batches:
            order.append(_Action(stage, forward, warmup + b))
    return order


def action_strings(actions: dict) -> dict:
    """``{rank: ["0F0", "0I0", ...]}``: torch's text form of every compute action in execution order (``None``
    dropped, ``OVERLAP_F_B`` as its sub-actions, which torch's runtime runs one after the other)."""
    return {rank: [f"{s}{k}{m}" for a in acts for s, k, m in _compute_ops(a)] for rank, acts in actions.items()}


# -- timing --------------------------------------------------------------------------------------------------------

class StageCosts(NamedTuple):
    """Per virtual stage: forward, input-gradient and weight-gradient time (``B`` costs ``input + weight``)."""

    forward: tuple
    input_grad: tuple
    weight_grad: tuple


def stage_costs(block_times, head_times, stages: int, blocks: int, torch_first_stage: bool = True,
                forward_overhead: float = 0.0) -> StageCosts:
    """Costs of ``stages`` equal stages over ``blocks`` blocks of ``block_times = (F, B, W)`` each; the last stage
    adds ``head_times``. ``torch_first_stage``: stage 0's ``I`` is free and its ``W`` carries ``B + W``.
    ``forward_overhead`` is added to every stage's forward (host time per micro-batch, as ``CostModel.overhead``)."""
    per = blocks // stages
    cost = [[per * block_times[0] + forward_overhead, per * block_times[1], per * block_times[2]]
            for _ in range(stages)]
    cost[-1] = [c + h for c, h in zip(cost[-1], head_times)]
    if torch_first_stage:
        cost[0] = [cost[0][0], 0.0, cost[0][1] + cost[0][2]]
    return StageCosts(*(tuple(c[i] for c in cost) for i in range(3)))


def costs_from_ranks(forward, backward, weight_share: float, num_stages: int,
                     torch_first_stage: bool = True) -> StageCosts:
    """Costs of ``num_stages`` stages from per-rank costs of a one-stage-per-rank pipeline (DeepSpeed's stage ``r``
    holds the layers of virtual stages ``r*v .. r*v+v-1``, ``v = num_stages / ranks``): each virtual stage gets
    ``1/v`` of its rank's forward and backward, the backward split ``1 - weight_share`` : ``weight_share`` into
    ``I`` and ``W``."""
    ranks = len(forward)
    per = num_stages // ranks
    cost = [[forward[k // per] / per, backward[k // per] * (1 - weight_share) / per,
             backward[k // per] * weight_share / per] for k in range(num_stages)]
    if torch_first_stage:
        cost[0] = [cost[0][0], 0.0, cost[0][1] + cost[0][2]]
    return StageCosts(*(tuple(c[i] for c in cost) for i in range(3)))


def _compute_ops(action):
    """The compute actions an entry runs, in order (``OVERLAP_F_B`` runs its sub-actions one after the other)."""
    if action is None:
        return []
    kind = action.computation_type.value
    if kind == "OVERLAP_F_B":
        return [(a.stage_index, a.computation_type.value, a.microbatch_index) for a in action.sub_actions]
    if kind in ("F", "I", "W", "B"):
        return [(action.stage_index, kind, action.microbatch_index)]
    return []


def _duration(op, costs: StageCosts) -> float:
    stage, kind, _ = op
    if kind == "F":
        return costs.forward[stage]
    if kind == "I":
        return costs.input_grad[stage]
    if kind == "W":
        return costs.weight_grad[stage]
    return costs.input_grad[stage] + costs.weight_grad[stage]  # B


def _dependencies(op, num_stages: int):
    """``[(stage, kinds, micro-batch), ...]``: one of ``kinds`` of that stage and micro-batch must be done first."""
    stage, kind, mb = op
    if kind == "F":
        return [(stage - 1, ("F", ), mb)] if stage > 0 else []
    if kind in ("I", "B"):
        return [(stage + 1, ("I", "B"), mb)] if stage < num_stages - 1 else [(stage, ("F", ), mb)]
    return [(stage, ("I", ), mb)]  # W


def time_actions(actions: dict, costs: StageCosts, latency: float = 0.0, steps: int = 1, step_time: float = 0.0,
                 durations: dict | None = None):
    """Start and end of every compute action of ``steps`` consecutive steps.

    ``actions``: :func:`action_lists`; step ``k`` re-runs every list with micro-batch ids offset by ``k * M``;
    ``step_time`` is each rank's optimizer step after its last action of a step; ``durations`` (``{"0F1":
    seconds, ...}``) replaces the cost model's time of those actions (a replay of measured durations). Returns
    ``(ends, rank_busy, rank_end)``: ``ends[(stage, kind, mb)] = (rank, start, end)``, busy time and finishing time
    per rank. Raises ``RuntimeError`` naming the stuck actions if the lists cannot complete (a deadlock).
    """
    num_stages = len(costs.forward)
    per_rank = {rank: [op for a in acts for op in _compute_ops(a)] for rank, acts in actions.items()}
    mbs = 1 + max((op[2] for ops in per_rank.values() for op in ops), default=-1)
    queues = {rank: [(s, k, m + step * mbs, step, i == len(ops) - 1) for step in range(steps)
                     for i, (s, k, m) in enumerate(ops)] for rank, ops in per_rank.items()}
    where = {op[0]: rank for rank, ops in per_rank.items() for op in ops}
    ends, pos = {}, {rank: 0 for rank in queues}
    clock = {rank: 0.0 for rank in queues}
    busy = {rank: 0.0 for rank in queues}
    progress = True
    while progress:
        progress = False
        for rank, queue in queues.items():
            while pos[rank] < len(queue):
                stage, kind, mb, _, last_of_step = queue[pos[rank]]
                ready = clock[rank]
                deps = _dependencies((stage, kind, mb), num_stages)
                done = [next((ends[(s, k, m)] for k in kinds if (s, k, m) in ends), None) for s, kinds, m in deps]
                if any(d is None for d in done):
                    break
                for (s, _, _), d in zip(deps, done):
                    ready = max(ready, d[2] + (latency if where[s] != rank else 0.0))
                text = f"{stage}{kind}{mb % mbs}"
                length = durations[text] if durations and text in durations else _duration((stage, kind, mb), costs)
                ends[(stage, kind, mb)] = (rank, ready, ready + length)
                clock[rank] = ready + length + (step_time if last_of_step else 0.0)
                busy[rank] += length
                pos[rank] += 1
                progress = True
    stuck = {rank: queue[pos[rank]][:3] for rank, queue in queues.items() if pos[rank] < len(queue)}
    if stuck:
        raise RuntimeError(f"schedule deadlocks: rank -> stuck action {stuck}")
    return ends, busy, clock


def long_run_period(actions: dict, costs: StageCosts, latency: float = 0.0, step_time: float = 0.0) -> float:
    """Time per step of a long run: the growth of the finishing time from 2 to 4 repeated steps."""
    def finish(n):
        return max(time_actions(actions, costs, latency, steps=n, step_time=step_time)[2].values())
    return (finish(4) - finish(2)) / 2


def peak_in_flight(actions: dict, num_stages: int) -> dict:
    """Per rank: most micro-batches whose forward ran and whose weight gradient (``W`` or ``B``) has not, summed
    over the rank's stages, walking the rank's own order (activation memory in stage-activations)."""
    peaks = {}
    for rank, acts in actions.items():
        held, peak = 0, 0
        for op in (op for a in acts for op in _compute_ops(a)):
            held += 1 if op[1] == "F" else (-1 if op[1] in ("W", "B") else 0)
            peak = max(peak, held)
        peaks[rank] = peak
    return peaks


def peer_rows(ranks: int, micro_batches: int, costs: StageCosts, stock_period: float, latency: float = 0.0,
              step_time: float = 0.0) -> list:
    """One row per peer schedule (same keys as :func:`ds_paci.tools.sim.simulate.comparison_rows`' rows).

    ``throughput_vs_stock`` = ``stock_period`` (time per micro-batch, as
    :func:`ds_paci.tools.sim.simulate.long_run_period` gives it) / this schedule's :func:`long_run_period` per
    micro-batch; ``bubble_fraction`` =
    idle share of the busiest rank over one long-run step; ``peak_in_flight``: the most micro-batch activations
    any rank holds, in units of one rank's share of the model (a virtual stage of a two-stage-per-rank schedule
    counts half). ``costs(num_stages)`` gives the :class:`StageCosts` of a schedule's stage count. A schedule torch
    refuses gives a row with ``unavailable`` (torch's reason).
    """
    rows = []
    for name, peer in PEERS.items():
        row = {"P": ranks, "M": micro_batches, "schedule": f"{peer.title} (torch action list)", "steady_state_bubble":
               None, "max_drift": 0, "ideal_ratio": (micro_batches + ranks - 1) / micro_batches}
        try:
            actions = action_lists(name, ranks, micro_batches)
        except ScheduleUnavailable as e:
            rows.append({**row, "unavailable": str(e), "bubble_fraction": None, "throughput_vs_stock": None,
                         "peak_in_flight": None})
            continue
        stage_cost = costs(ranks * peer.stages_per_rank)
        period = long_run_period(actions, stage_cost, latency, step_time)
        _, busy, _ = time_actions(actions, stage_cost, latency, steps=1, step_time=step_time)
        rows.append({**row, "bubble_fraction": 1.0 - max(busy.values()) / period,
                     "throughput_vs_stock": stock_period * micro_batches / period,
                     "peak_in_flight": max(peak_in_flight(actions, len(stage_cost.forward)).values())
                     / peer.stages_per_rank,
                     "period": period})
    return rows
