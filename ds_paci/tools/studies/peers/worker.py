"""One rank of the peer study: every engine of a cell, in alternating rounds, inside one world of ``P`` processes.

:func:`run_cell_rank` is the body :func:`ds_paci.tools.processes.world.run_world` runs on each rank. For each round it runs
each engine in turn (the order rotates by one every round), with a barrier between engines, and tears each engine
down before the next is built:

* DeepSpeed's engines (``stock``, ``paci``, ``paci+lookahead``): a ``PipelineModule`` of the cell's layer list
  (:func:`.peers_model.layer_specs`), ``ds_paci.initialize`` with the benchmark's DeepSpeed config
  (:func:`.runner.ds_config`: AdamW with ``torch_adam``, lr, no weight decay, no clipping; PACI with ``a = M``),
  ``train_batch`` per step on the same :class:`~ds_paci.workload.data.MicroBatchIterator`; PACI drains at the end.
* torch's schedules (:data:`ds_paci.tools.sim.peer_schedules.PEERS`): ``PipelineStage`` modules built from the *same*
  layer specs (:func:`.peers_model.stage_module`), ``torch.optim.AdamW`` with the same hyper-parameters (what
  DeepSpeed builds for ``torch_adam``), ``scale_grads=True`` (gradients divided by ``M``, as DeepSpeed 0.19.8's
  pipeline divides the loss by ``M``), ``schedule.step`` on the same ``M`` micro-batches concatenated (torch splits
  them back along dim 0), then ``optimizer.step()``.

Per run and rank it returns the per-step ``(start, end)`` times, the per-step loss (last stage), per step the
bytes saved for backward at its start and at its peak (:class:`.meters.SavedTensorMeter`, the same meter for every
engine), the emulated waits per kind, and in round 0 the final weights (for the engine-independent validation loss
and the agreement check) and the first timed step's actions: for torch's schedules each compute action as executed
(stage, kind, micro-batch) with its start and end, for DeepSpeed's engines every instruction with its times.
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass

from ds_paci.tools.sim.peer_schedules import PEERS, rank_stages
from ...bench.meters import SavedTensorMeter, StockInstructionTracer
from .model import PeerCell, emulated_waits, layer_specs, partition, stage_module
from ...bench.runner import ds_config

DEEPSPEED_ENGINES = ("stock", "paci", "paci+lookahead")


@dataclass(frozen=True)
class CellJob:
    """What one world of the study runs: the cell, its engines (in round-0 order), rounds and the token file."""

    cell: PeerCell
    engines: tuple
    rounds: int
    data_path: str
    max_load: float = 0.0  # > 0: before each round, wait (at most max_wait seconds) for a 1-minute load below it
    max_wait: float = 0.0


def rotated(engines, round_index: int) -> list:
    """``engines`` starting at position ``round_index`` (each round another engine goes first)."""
    k = round_index % len(engines)
    return list(engines[k:]) + list(engines[:k])


def _batches(job: CellJob, needed: bool):
    """The training micro-batch iterator (first/last stage only) and ``None`` elsewhere."""
    if not needed:
        return None
    import torch

    from ds_paci.workload.data import MicroBatchIterator
    tokens = torch.load(job.data_path)
    return MicroBatchIterator(tokens["train"].long(), job.cell.micro_batch_size, job.cell.seq_len,
                              seed=job.cell.data_seed)


def _stage_state(modules) -> dict:
    """Weights of ``modules`` by layer-index name, as plain CPU tensors."""
    state = {}
    for module in modules:
        state.update({k: v.detach().clone() for k, v in module.state_dict().items()})
    return state


_STOCK_TRACER = []  # one tracer per process (its instruction counts go on across cells), installed on each engine


def _stock_tracer(engine):
    if not _STOCK_TRACER:
        _STOCK_TRACER.append(StockInstructionTracer(engine.global_rank, engine.stage_id))
    tracer = _STOCK_TRACER[0]
    tracer.install(engine)
    tracer.records.clear()
    return tracer


def _run_deepspeed(job: CellJob, engine_name: str, keep_state: bool) -> dict:
    import ds_paci
    from deepspeed.pipe import PipelineModule

    from ds_paci.workload.gpt2 import lm_loss
    cell = job.cell
    specs = layer_specs(cell)
    module = PipelineModule(layers=specs, num_stages=cell.stages, loss_fn=lm_loss, partition_method="type:Block")
    expected = partition(specs, cell.stages)
    if [int(b) for b in module.parts] != expected:
        raise RuntimeError(f"DeepSpeed partitioned the layers at {list(module.parts)}, the study expects {expected}")
    engine, *_ = ds_paci.initialize(model=module, model_parameters=module.parameters(),
                                    config=ds_config(cell, engine_name, engine_name != "stock"))
    tracer = _stock_tracer(engine) if engine_name == "stock" else None
    meter = SavedTensorMeter(engine.module.parameters())
    data = _batches(job, engine.is_first_stage() or engine.is_last_stage())
    calls, losses, held, peaks = [], [], [], []
    with meter.training():
        for step in range(cell.steps):
            meter.reset_peak()
            held.append(meter.saved_bytes)
            if tracer is not None:
                tracer.active = step == cell.warmup
            start = time.time()
            loss = engine.train_batch(data)
            calls.append((start, time.time()))
            if tracer is not None:
                tracer.active = False
            peaks.append(meter.peak_saved_bytes)
            value = float(loss) if loss is not None else float("nan")
            losses.append(value if engine.is_last_stage() and value == value else None)
        if engine_name != "stock":
            engine.drain()
    lo, hi = calls[cell.warmup]
    records = tracer.records if tracer is not None else engine.paci_trace()
    result = {"calls": calls, "losses": losses, "saved_bytes": {"held_at_step_start": held, "step_peak": peaks},
              "waits": emulated_waits(engine.module), "stages": [engine.stage_id], "recorded_step": [lo, hi],
              "instructions": [(r["instr"], r["start"], r["end"]) for r in records if lo <= r["start"] <= hi]}
    if keep_state:
        result["state"] = _stage_state([engine.module])
    engine.destroy()
    return result


class _ExecutedOrder:
    """Records the compute actions a torch stage runs while :attr:`on` (``"1F0"``, ``"1I0"``, ``"1W0"``, ``"1B0"``),
    and when each started and ended (:attr:`times`, seconds since the epoch)."""

    def __init__(self):
        self.on, self.actions, self.times = False, [], []

    def attach(self, stage):
        forward, backward, weight = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk
        index = stage.stage_index

        def fwd(chunk, *args, **kwargs):
            return self._run(f"{index}F{chunk}", forward, chunk, *args, **kwargs)

        def bwd(chunk, *args, **kwargs):
            return self._run(f"{index}{'B' if kwargs.get('full_backward', True) else 'I'}{chunk}", backward, chunk,
                             *args, **kwargs)

        def wgt(chunk, *args, **kwargs):
            return self._run(f"{index}W{chunk}", weight, chunk, *args, **kwargs)

        stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk = fwd, bwd, wgt

    def _run(self, text, fn, *args, **kwargs):
        if not self.on:
            return fn(*args, **kwargs)
        start = time.time()
        try:
            return fn(*args, **kwargs)
        finally:
            self.actions.append(text)
            self.times.append((start, time.time()))


def _run_torch(job: CellJob, name: str, rank: int, keep_state: bool) -> dict:
    import torch
    from torch.distributed.pipelining import PipelineStage, schedules

    from ds_paci.workload.gpt2 import lm_loss
    cell, peer = job.cell, PEERS[name]
    specs = layer_specs(cell)
    num_stages = cell.stages * peer.stages_per_rank
    bounds = partition(specs, num_stages)
    mine = rank_stages(name, cell.stages, rank)
    modules = [stage_module(specs, bounds[s], bounds[s + 1]) for s in mine]
    stages = [PipelineStage(m, s, num_stages, torch.device("cpu")) for m, s in zip(modules, mine)]
    order = _ExecutedOrder()
    for stage in stages:
        order.attach(stage)
    cls = getattr(schedules, peer.cls)
    schedule = cls(stages if peer.stages_per_rank > 1 else stages[0], n_microbatches=cell.micro_batches,
                   loss_fn=lm_loss, scale_grads=True)
    params = [p for m in modules for p in m.parameters()]
    optimizer = torch.optim.AdamW(params, lr=cell.lr, weight_decay=0.0)
    meter = SavedTensorMeter(params)
    first, last = 0 in mine, num_stages - 1 in mine
    data = _batches(job, first or last)
    calls, losses, held, peaks = [], [], [], []
    with meter.training():
        for step in range(cell.steps):
            micro = [next(data) for _ in range(cell.micro_batches)] if data is not None else []
            args = (torch.cat([x for x, _ in micro]), ) if first else ()
            kwargs = {"target": torch.cat([y for _, y in micro]), "losses": []} if last else {}
            order.on = step == cell.warmup  # the first timed step
            meter.reset_peak()
            held.append(meter.saved_bytes)
            start = time.time()
            optimizer.zero_grad(set_to_none=True)
            schedule.step(*args, return_outputs=False, **kwargs)
            optimizer.step()
            calls.append((start, time.time()))
            peaks.append(meter.peak_saved_bytes)
            order.on = False
            losses.append(float(torch.stack(kwargs["losses"]).mean()) if last else None)
    result = {"calls": calls, "losses": losses, "saved_bytes": {"held_at_step_start": held, "step_peak": peaks},
              "stages": mine,
              "waits": {k: sum(emulated_waits(m)[k] for m in modules) for k in ("forward", "input_grad",
                                                                               "weight_grad")},
              "executed": order.actions, "executed_times": order.times,
              "recorded_step": calls[cell.warmup], "pipeline_order": [str(a) for a in schedule.pipeline_order[rank]
                                                             if a is not None and a.is_compute_op]}
    if keep_state:
        result["state"] = _stage_state(modules)
    return result


def wait_for_quiet(max_load: float, max_wait: float) -> float:
    """Sleep until the 1-minute load average is below ``max_load`` or ``max_wait`` seconds passed; the seconds waited.

    Other jobs on a shared machine take the CPU the ranks' host work needs; a round started in a quieter minute
    measures the schedules rather than the neighbours.
    """
    began = time.monotonic()
    while max_load > 0 and os.getloadavg()[0] >= max_load and time.monotonic() - began < max_wait:
        time.sleep(10)
    return time.monotonic() - began


def run_cell_rank(rank: int, job: CellJob) -> dict:
    """Body of one rank: every engine of ``job`` for ``job.rounds`` rounds; ``{"runs": {round: {engine: ...}}}``."""
    import torch.distributed as dist
    runs, waited = {}, []
    for r in range(job.rounds):
        if rank == 0:  # the others wait in the barrier below
            waited.append(wait_for_quiet(job.max_load, job.max_wait))
        runs[r] = {}
        for engine in rotated(job.engines, r):
            dist.barrier()
            began = time.time()
            if engine in DEEPSPEED_ENGINES:
                runs[r][engine] = _run_deepspeed(job, engine, keep_state=r == 0)
            else:
                runs[r][engine] = _run_torch(job, engine, rank, keep_state=r == 0)
            runs[r][engine]["order"] = rotated(job.engines, r).index(engine)
            runs[r][engine]["setup_seconds"] = runs[r][engine]["calls"][0][0] - began
            runs[r][engine]["run_seconds"] = time.time() - began
            runs[r][engine]["loadavg_1min"] = os.getloadavg()[0]
            gc.collect()
    dist.barrier()
    return {"rank": rank, "runs": runs, "waited_for_quiet_seconds": waited}
