"""Side-by-side benchmark: DeepSpeed's stock ``PipelineEngine`` against ``PACIPipelineEngine``.

``python -m ds_paci.bench --preset headline`` (or ``python launch/bench.py ...``) trains
the same GPT-2 on the same Shakespeare micro-batches with both engines, alternating
stock, PACI, stock, PACI, ... for ``--repeats`` rounds. Every run is a fresh world of
``P`` processes (one pipeline stage each, one thread each, gloo, fp32, AdamW with
``torch_adam``, no gradient clipping). Both engines get the same model seed, data
seed, micro-batch size and ``M = gradient_accumulation_steps``; PACI uses the window
``a = M``.

Two modes:

* ``real``: real compute only (2 stages on the 2 cores of a CPU machine).
* ``emulated``: one transformer block per stage, small, plus an
  :class:`ds_paci.emulate.EmulatedDeviceTime` layer after each block that waits ``f``
  seconds in forward and ``2f`` in backward without using the CPU, identical for both
  engines. The math still runs, so losses are real; times are **emulated**, and every
  figure of this mode says so.

What is measured (per run, inside every rank):

* **Throughput**: training is cut into segments by the periodic evaluations. In each
  segment the first ``warmup`` ``train_batch`` calls are excluded (first-call
  allocations; PACI's pipeline fill after a drain); the rest are timed as one span,
  from the start of the first timed call to the end of the last, on every rank. A
  run's time is the largest rank's sum of spans; tokens/s = timed calls x M x
  micro-batch size x sequence length / time. Evaluation, PACI's drain and the
  warm-up calls are outside this clock.
* **Time to accuracy**: validation loss (``engine.eval_batch`` on a fixed set of
  validation micro-batches) at step 0, every ``eval_every`` steps and at the end.
  The training clock runs over every ``train_batch`` call *and* PACI's drain before
  each evaluation (the drain finishes real training work, and the bubble it opens is
  a cost of evaluating PACI mid-run); evaluation itself is excluded. A segment's time
  is its longest rank's. The time to a target loss is interpolated linearly between
  the two evaluations around its first crossing (:func:`time_to_target`).
* **Memory**: :class:`ActivationMeter` counts the bytes of tensors saved for backward
  (``torch.autograd.graph.saved_tensors_hooks``, deduplicated by storage, parameters
  excluded), and, after each forward of the stage, the union of those with the
  engine's ``pipe_buffers`` and the stage output; the peaks of both, the process's
  peak RSS (``ru_maxrss``), parameter and optimizer-state bytes, and whether every
  optimizer tensor shares storage with a module parameter (no weight copies).
* **Timelines** (``--trace``): per-instruction records of the first round's runs,
  from ``paci.trace`` for PACI and from wrapped ``PipelineEngine._INSTRUCTION_MAP``
  functions (inside the stock worker processes only) for the stock engine.

Outputs under ``--out``: ``<config>.json`` per configuration, ``summary.md``,
``<config>_throughput.png``, ``<config>_loss.png``, ``ratios.png`` and, with
``--trace``, ``<config>_timeline_{stock,paci}.png`` / ``.json`` (Chrome trace).
Speed targets are reported against, never enforced.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass

from ds_paci import world

ENGINES = ("stock", "paci")
ENGINE_TITLES = {"stock": "stock 1F1B-flush", "paci": "PACI"}
TARGET_LOSS_FACTOR = 1.02

# ----------------------------------------------------------------------------- configurations


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark configuration: model, data, pipeline shape and the run schedule.

    ``device_time`` > 0 only in ``emulated`` mode (seconds of emulated device time per
    block in forward; backward waits twice as long).
    """

    name: str
    mode: str  # "real" or "emulated"
    stages: int
    micro_batches: int
    micro_batch_size: int
    seq_len: int
    n_layer: int
    n_embd: int
    n_head: int
    device_time: float
    steps: int
    warmup: int
    eval_every: int
    eval_batches: int = 2  # eval_batch calls (of M micro-batches each) per validation
    lr: float = 1e-3
    seed: int = 1234
    data_seed: int = 7
    tokenizer: str = "byte"

    @property
    def emulated(self) -> bool:
        return self.mode == "emulated"

    @property
    def tokens_per_batch(self) -> int:
        return self.micro_batches * self.micro_batch_size * self.seq_len

    @property
    def blocks_per_stage(self) -> float:
        return self.n_layer / self.stages

    def label(self) -> str:
        """Human-readable name; emulated configurations always say "emulated"."""
        shape = f"P={self.stages} M={self.micro_batches}"
        if self.emulated:
            return f"emulated {shape} (f={self.device_time * 1000:g} ms/block)"
        return f"real {shape}"


def validate_config(cfg: BenchConfig) -> BenchConfig:
    """Raise ``ValueError`` for a configuration that cannot run; returns ``cfg``."""
    if cfg.mode not in ("real", "emulated"):
        raise ValueError(f"mode must be 'real' or 'emulated', got {cfg.mode!r}")
    for name in ("stages", "micro_batches", "micro_batch_size", "seq_len", "n_layer", "n_embd", "n_head", "steps",
                 "eval_batches"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(cfg, name)}")
    if cfg.stages < 2:
        raise ValueError("a pipeline benchmark needs at least 2 stages")
    if cfg.n_embd % cfg.n_head:
        raise ValueError(f"n_embd ({cfg.n_embd}) must be divisible by n_head ({cfg.n_head})")
    if cfg.n_layer < cfg.stages:
        raise ValueError(f"n_layer ({cfg.n_layer}) must be >= stages ({cfg.stages}): each stage needs a block")
    if cfg.warmup < 0 or cfg.eval_every < 0:
        raise ValueError("warmup and eval_every must be >= 0")
    segment = cfg.eval_every or cfg.steps
    if min(segment, cfg.steps) <= cfg.warmup:
        raise ValueError(f"every training segment ({min(segment, cfg.steps)} steps between evaluations) must be longer "
                         f"than warmup ({cfg.warmup}); raise --steps/--eval-every or lower --warmup")
    if cfg.emulated and cfg.device_time <= 0:
        raise ValueError("emulated mode needs --device-time > 0")
    if not cfg.emulated and cfg.device_time != 0:
        raise ValueError("real mode runs without emulated device time; use --mode emulated for --device-time")
    return cfg


def mode_defaults(mode: str, stages: int | None = None) -> dict:
    """Default shape of a configuration of ``mode``; emulated runs get one block per stage."""
    if mode == "real":
        return dict(mode="real", stages=stages or 2, micro_batches=4, micro_batch_size=8, seq_len=128, n_layer=4,
                    n_embd=128, n_head=4, device_time=0.0, steps=100, warmup=2, eval_every=20, eval_batches=4)
    if mode == "emulated":
        p = stages or 4
        return dict(mode="emulated", stages=p, micro_batches=p, micro_batch_size=4, seq_len=64, n_layer=p, n_embd=64,
                    n_head=4, device_time=0.02, steps=100, warmup=2, eval_every=20, eval_batches=max(1, 16 // p))
    raise ValueError(f"unknown mode {mode!r}; use 'real' or 'emulated'")


def config_name(cfg_fields: dict) -> str:
    """File-name stem of a configuration, e.g. ``emulated_P8_M8``."""
    return f"{cfg_fields['mode']}_P{cfg_fields['stages']}_M{cfg_fields['micro_batches']}"


def make_config(mode: str, **overrides) -> BenchConfig:
    """A validated configuration: :func:`mode_defaults` of ``mode`` with ``overrides`` (``None`` values ignored)."""
    overrides = {k: v for k, v in overrides.items() if v is not None}
    fields = mode_defaults(mode, overrides.get("stages"))
    if mode == "emulated" and "stages" in overrides:
        fields["micro_batches"] = overrides["stages"]
    fields.update(overrides)
    if mode == "emulated" and "n_layer" not in overrides:
        fields["n_layer"] = fields["stages"]
    fields.setdefault("name", config_name(fields))
    return validate_config(BenchConfig(**fields))


@dataclass(frozen=True)
class Preset:
    configs: tuple
    repeats: int
    trace: bool


def presets() -> dict[str, Preset]:
    """Named presets. ``headline``: the three issue configurations (~25 min on 2 cores); ``smoke``: < 90 s.

    Headline choices: emulated P=4 uses f = 50 ms so the engines' fixed per-micro-batch
    host overhead (about 10 ms per stage in forward+backward on 2 cores, plus transfers) is
    small next to 3f; emulated P=8 uses f = 20 ms to fit 8 processes x 6 worlds in the budget.
    """
    return {
        "headline":
            Preset(configs=(make_config("real", stages=2, micro_batches=4, steps=100),
                            make_config("emulated", stages=4, micro_batches=4, device_time=0.05, steps=60),
                            make_config("emulated", stages=8, micro_batches=8, device_time=0.02, steps=100)),
                   repeats=3,
                   trace=True),
        "smoke":
            Preset(configs=(make_config("emulated", stages=2, micro_batches=2, micro_batch_size=2, seq_len=32,
                                        n_embd=32, n_head=2, device_time=0.01, steps=6, warmup=1, eval_every=3,
                                        eval_batches=1),),
                   repeats=1,
                   trace=True),
    }


# ----------------------------------------------------------------------------- pure math


def ideal_ratio(stages: int, micro_batches: int) -> float:
    """Throughput PACI/stock when the bubble is removed and nothing else changes: ``(M+P-1)/M``."""
    return (micro_batches + stages - 1) / micro_batches


def share_of_ideal(ratio: float, stages: int, micro_batches: int) -> float:
    """``ratio`` as a fraction of :func:`ideal_ratio` (1.0 = the whole bubble removed)."""
    return ratio / ideal_ratio(stages, micro_batches)


def expected_seconds_per_batch(engine: str, stages: int, micro_batches: int, device_time: float,
                               blocks_per_stage: float = 1.0) -> float:
    """Emulated seconds per ``train_batch`` if only device time counted.

    A micro-batch costs ``3 f b`` per stage (forward ``f``, backward ``2f``, ``b`` blocks):
    PACI's steady state spends ``M`` of those per batch, the stock engine ``M + P - 1``.
    """
    per_micro_batch = 3.0 * device_time * blocks_per_stage
    slots = micro_batches if engine == "paci" else micro_batches + stages - 1
    return slots * per_micro_batch


def per_round_ratios(numerators: list, denominators: list) -> list:
    """``[a / b for each round]``; a round with a missing or zero value gives ``None``."""
    return [None if a is None or not b else a / b for a, b in zip(numerators, denominators)]


def median_of(values: list):
    """Median of the non-``None`` values, or ``None`` if there are none."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def steady_state_span(calls: list, segments: list, warmup: int) -> tuple[int, float]:
    """Timed calls and seconds of one rank's steady state.

    ``calls``: ``[(start, end), ...]`` of every ``train_batch`` call; ``segments``: dicts
    with ``first_call`` and ``calls`` (the calls between two evaluations). In each
    segment the first ``warmup`` calls are skipped and the rest timed as one span,
    start of the first timed call to end of the last. Returns ``(count, seconds)``.
    """
    count, seconds = 0, 0.0
    for seg in segments:
        first = seg["first_call"] + warmup
        last = seg["first_call"] + seg["calls"] - 1
        if first > last:
            continue
        count += last - first + 1
        seconds += calls[last][1] - calls[first][0]
    return count, seconds


def time_to_target(points: list, target: float):
    """When a validation curve first reaches ``target``: ``(seconds, steps)`` or ``None``.

    ``points``: ``[(step, training seconds, loss), ...]`` in training order. The crossing
    is the first point with ``loss <= target``; between it and the point before, time
    and steps are interpolated linearly in the loss. A first point already at the
    target gives its own time and step.
    """
    previous = None
    for step, seconds, loss in points:
        if loss <= target:
            if previous is None or previous[2] <= loss:
                return float(seconds), float(step)
            p_step, p_seconds, p_loss = previous
            frac = (p_loss - target) / (p_loss - loss)
            return p_seconds + frac * (seconds - p_seconds), p_step + frac * (step - p_step)
        previous = (step, seconds, loss)
    return None


def speedups_at_reference_levels(reference: list, other: list) -> list:
    """How fast ``other`` reaches each validation loss ``reference`` reached after step 0.

    Both curves are ``[(step, seconds, loss), ...]``. Returns ``[(loss, reference seconds,
    other seconds or None, reference seconds / other seconds or None), ...]``; the
    reference's own time is its evaluation time, the other's is :func:`time_to_target`.
    """
    levels = []
    for _, seconds, loss in reference[1:]:
        reached = time_to_target(other, loss)
        other_seconds = None if reached is None else reached[0]
        speedup = None if not other_seconds else seconds / other_seconds
        levels.append((loss, seconds, other_seconds, speedup))
    return levels


def default_target_loss(stock_final_losses: list, factor: float = TARGET_LOSS_FACTOR) -> float:
    """The default target: ``factor`` x the stock engine's final validation loss (median over rounds)."""
    return factor * median_of(stock_final_losses)


def relative_difference(value: float, reference: float) -> float:
    """``(value - reference) / reference``."""
    return (value - reference) / reference


# ----------------------------------------------------------------------------- inside a rank: memory


def _storage_of(tensor):
    """``(data_ptr, nbytes)`` of the storage behind ``tensor``, or ``None`` when it has none."""
    try:
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):
        return None


def _tensors_in(obj):
    """Every tensor in a tensor / (nested) tuple or list / ``None``."""
    import torch
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _tensors_in(item)


class _SavedForBackward:
    """What autograd keeps instead of a saved tensor while the meter is on; its death releases the bytes."""

    __slots__ = ("tensor", "key", "meter")

    def __init__(self, tensor, key, meter):
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self):
        try:
            self.meter._release(self.key)
        except Exception:  # interpreter shutdown
            pass


class ActivationMeter:
    """Peak activation bytes of one pipeline stage, measured identically for every engine.

    * ``peak_saved_bytes``: most bytes ever held at once by tensors autograd saved for
      backward, counted once per storage, parameters excluded. Tracked at every save.
    * ``peak_held_bytes``: most bytes of the union of those saved storages, the
      engine's ``pipe_buffers`` (inputs, labels, outputs) and the stage output, sampled
      right after each training forward of the stage (when a 1F1B stage holds most).

    Use :meth:`training` around training calls only; evaluation is not counted.
    """

    def __init__(self, engine):
        self._engine = engine
        self._param_storages = {_storage_of(p)[0] for p in engine.module.parameters()}
        self._saved = {}  # storage data_ptr -> [references, nbytes]
        self.saved_bytes = 0
        self.peak_saved_bytes = 0
        self.peak_held_bytes = 0
        self._active = False
        engine.module.register_forward_hook(self._after_stage_forward)

    def training(self):
        """Context manager: count saved tensors and sample held bytes inside it."""
        import contextlib

        import torch

        @contextlib.contextmanager
        def scope():
            self._active = True
            try:
                with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                    yield
            finally:
                self._active = False

        return scope()

    def _pack(self, tensor):
        storage = _storage_of(tensor)
        if storage is None or storage[0] in self._param_storages:
            return tensor
        key, nbytes = storage
        entry = self._saved.get(key)
        if entry is None:
            self._saved[key] = [1, nbytes]
            self.saved_bytes += nbytes
            self.peak_saved_bytes = max(self.peak_saved_bytes, self.saved_bytes)
        else:
            entry[0] += 1
        return _SavedForBackward(tensor, key, self)

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _SavedForBackward) else packed

    def _release(self, key):
        entry = self._saved[key]
        entry[0] -= 1
        if entry[0] == 0:
            del self._saved[key]
            self.saved_bytes -= entry[1]

    def _after_stage_forward(self, module, inputs, output):
        import torch
        if not (self._active and module.training and torch.is_grad_enabled()):
            return
        held = {key: entry[1] for key, entry in self._saved.items()}
        buffers = self._engine.pipe_buffers
        for tensor in _tensors_in([list(slots) for slots in buffers.values()] + [output]):
            storage = _storage_of(tensor)
            if storage is not None and storage[0] not in self._param_storages:
                held[storage[0]] = storage[1]
        self.peak_held_bytes = max(self.peak_held_bytes, sum(held.values()))


def weight_storage_report(engine) -> dict:
    """Parameter and optimizer-state bytes of this stage, and whether the optimizer holds any weight copy.

    ``extra_weight_bytes`` counts optimizer parameter tensors whose storage is not a
    module parameter's (0 = the optimizer updates the module's own weights).
    ``aliases_share_storage`` (PACI's ``engine._aliases`` only): every alias has its
    parameter's ``data_ptr``; ``None`` when the engine has no aliases.
    """
    import torch
    params = list(engine.module.parameters())
    module_storages = {_storage_of(p)[0] for p in params}
    extra = 0
    for group in engine.optimizer.param_groups:
        for p in group["params"]:
            storage = _storage_of(p)
            if storage[0] not in module_storages:
                extra += storage[1]
    state_bytes = 0
    for state in engine.optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                state_bytes += value.numel() * value.element_size()
    aliases = getattr(engine, "_aliases", None)
    shared = None
    if aliases is not None:
        shared = all(alias.data_ptr() == p.data_ptr() for p, alias in aliases.pairs)
    return {
        "param_bytes": sum(p.numel() * p.element_size() for p in params),
        "param_count": sum(p.numel() for p in params),
        "optimizer_state_bytes": state_bytes,
        "extra_weight_bytes": extra,
        "aliases_share_storage": shared,
    }


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports ``ru_maxrss`` in KiB)."""
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ----------------------------------------------------------------------------- inside a rank: stock trace


class StockInstructionTracer:
    """Per-instruction records of the stock engine, in :mod:`ds_paci.timeline`'s format.

    :meth:`install` wraps the functions of ``PipelineEngine._INSTRUCTION_MAP`` of *this
    process* (benchmark workers only). Records are taken while :attr:`active`.
    Micro-batch ids are counted per instruction type, which 1F1B executes in
    micro-batch order; the optimizer step prints as ``STEP<n>`` (n = steps so far).
    """

    _CODES = {
        "LoadMicroBatch": "L",
        "ForwardPass": "F",
        "BackwardPass": "B",
        "SendActivation": "SA",
        "RecvActivation": "RA",
        "SendGrad": "SG",
        "RecvGrad": "RG",
    }
    _NAMES = {"ReduceGrads": "REDUCE_GRADS", "ReduceTiedGrads": "REDUCE_TIED"}

    def __init__(self, rank: int, stage: int):
        self.rank, self.stage = rank, stage
        self.records = []
        self.active = False
        self._counts = Counter()

    def install(self):
        from deepspeed.runtime.pipe.engine import PipelineEngine
        table = PipelineEngine._INSTRUCTION_MAP
        for cls, fn in list(table.items()):
            table[cls] = self._timed(cls.__name__, fn)

    def _timed(self, type_name, fn):
        tracer = self

        def run(engine, **kwargs):
            if not tracer.active:
                return fn(engine, **kwargs)
            start = time.time()
            result = fn(engine, **kwargs)
            tracer.records.append({"rank": tracer.rank, "stage": tracer.stage, "instr": tracer._text(type_name),
                                   "start": start, "end": time.time()})
            return result

        return run

    def _text(self, type_name):
        n = self._counts[type_name]
        self._counts[type_name] += 1
        if type_name in self._CODES:
            return f"{self._CODES[type_name]}{n}"
        if type_name == "OptimizerStep":
            return f"STEP{n + 1}"
        return self._NAMES.get(type_name, type_name.upper())


# ----------------------------------------------------------------------------- inside a rank: the run


@dataclass(frozen=True)
class RunJob:
    """Everything one world needs: configuration, engine, data file, whether to trace, where results go."""

    config: BenchConfig
    engine: str  # "stock" or "paci"
    data_path: str
    trace: bool
    gloo_timeout_s: float


def ds_config(cfg: BenchConfig, engine: str, trace: bool) -> dict:
    """The DeepSpeed config of a run: identical for both engines apart from the ``paci`` section."""
    config = {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.micro_batches,
        "steps_per_print": 10**9,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": cfg.lr, "torch_adam": True, "weight_decay": 0.0}},
    }
    if engine == "paci":
        config["paci"] = {"enabled": True, "accumulation_window": cfg.micro_batches, "trace": trace}
    return config


def build_engine(cfg: BenchConfig, engine: str, trace: bool):
    """GPT-2 pipeline (with emulated device time in emulated mode) wrapped by ``ds_paci.initialize``."""
    import ds_paci
    from ds_paci.models import gpt2_config, gpt2_pipeline
    model_cfg = gpt2_config("tiny", vocab_size=257, n_positions=cfg.seq_len, n_embd=cfg.n_embd, n_layer=cfg.n_layer,
                            n_head=cfg.n_head)
    model = gpt2_pipeline(model_cfg, num_stages=cfg.stages, seed=cfg.seed, device_time=cfg.device_time)
    result, *_ = ds_paci.initialize(model=model, model_parameters=model.parameters(),
                                    config=ds_config(cfg, engine, trace))
    return result


def validation_loss(engine, batches: list, micro_batches: int) -> float:
    """Mean loss of ``engine.eval_batch`` over ``batches``, ``micro_batches`` at a time (drains PACI first)."""
    losses = []
    for i in range(0, len(batches), micro_batches):
        losses.append(float(engine.eval_batch(iter(batches[i:i + micro_batches]))))
    return sum(losses) / len(losses)


def train_with_evaluations(engine, cfg: BenchConfig, train_iter, val_batches, meter, tracer) -> dict:
    """Train ``cfg.steps`` batches with a validation at step 0, every ``eval_every`` steps and at the end.

    Returns per-call ``(start, end)`` times, per-call losses (``None`` where the engine
    returned none), the segments between evaluations (``first_call``, ``calls``,
    ``start``, ``end``: training time including PACI's drain) and ``evals``
    (``[step, loss]``).
    """
    from ds_paci import PACIPipelineEngine
    is_paci = isinstance(engine, PACIPipelineEngine)
    calls, losses, segments = [], [], []
    evals = [[0, validation_loss(engine, val_batches, cfg.micro_batches)]]
    step = 0
    while step < cfg.steps:
        length = min(cfg.eval_every or cfg.steps, cfg.steps - step)
        first_call = len(calls)
        segment_start = time.time()
        if tracer is not None:
            tracer.active = True
        with meter.training():
            for _ in range(length):
                start = time.time()
                loss = engine.train_batch(train_iter)
                calls.append((start, time.time()))
                losses.append(None if loss is None else float(loss))
            if is_paci:
                engine.drain()
        if tracer is not None:
            tracer.active = False
        segments.append({"first_call": first_call, "calls": length, "start": segment_start, "end": time.time()})
        step += length
        evals.append([step, validation_loss(engine, val_batches, cfg.micro_batches)])
    return {"calls": calls, "losses": losses, "segments": segments, "evals": evals}


def _trace_of_first_segment(records: list, segment: dict) -> list:
    return [r for r in records if segment["start"] <= r["start"] and r["end"] <= segment["end"]]


def run_rank(rank: int, job: RunJob) -> dict:
    """Body of one rank: build the engine, train with evaluations, measure; returns plain JSON data."""
    import torch

    from ds_paci.data import MicroBatchIterator, eval_micro_batches
    cfg = job.config
    engine = build_engine(cfg, job.engine, job.trace)
    stage = engine.stage_id
    tracer = None
    if job.trace and job.engine == "stock":
        tracer = StockInstructionTracer(rank, stage)
        tracer.install()
    meter = ActivationMeter(engine)
    train_iter, val_batches = None, [None] * (cfg.eval_batches * cfg.micro_batches)
    if engine.is_first_stage() or engine.is_last_stage():
        tokens = torch.load(job.data_path)
        train_iter = MicroBatchIterator(tokens["train"].long(), cfg.micro_batch_size, cfg.seq_len,
                                        seed=cfg.data_seed)
        val_batches = eval_micro_batches(tokens["val"].long(), cfg.micro_batch_size, cfg.seq_len,
                                         count=cfg.eval_batches * cfg.micro_batches)
    run = train_with_evaluations(engine, cfg, train_iter, val_batches, meter, tracer)
    result = {
        "rank": rank,
        "stage": stage,
        "engine_type": type(engine).__name__,
        **run,
        "memory": {
            "peak_saved_bytes": meter.peak_saved_bytes,
            "peak_held_bytes": meter.peak_held_bytes,
            "peak_rss_bytes": peak_rss_bytes(),
            **weight_storage_report(engine),
        },
    }
    if job.engine == "paci":
        result["paci_stats"] = engine.paci_stats()
    if job.trace:
        records = tracer.records if tracer is not None else engine.paci_trace()
        result["trace"] = _trace_of_first_segment(records, run["segments"][0])
    return result


# ----------------------------------------------------------------------------- spawning a world


def run_world(job: RunJob, log_dir: str, timeout: float) -> list[dict]:
    """Run ``job`` on ``job.config.stages`` processes (see :mod:`ds_paci.world`); per-rank results in rank order."""
    return world.run_world(run_rank, job.config.stages, job, timeout=timeout, log_dir=log_dir,
                           gloo_timeout_s=job.gloo_timeout_s)


# ----------------------------------------------------------------------------- summarising a run


def throughput_of_run(ranks: list, cfg: BenchConfig) -> dict:
    """Steady-state throughput of one run: the slowest rank's time over the timed calls."""
    spans = [steady_state_span(r["calls"], r["segments"], cfg.warmup) for r in ranks]
    count = spans[0][0]
    seconds = max(s for _, s in spans)
    return {
        "timed_calls": count,
        "timed_seconds": seconds,
        "tokens_per_second": count * cfg.tokens_per_batch / seconds,
        "seconds_per_batch": seconds / count,
    }


def training_clock(ranks: list) -> list:
    """Cumulative training seconds at the end of each segment (each segment: its longest rank)."""
    clock, total = [], 0.0
    for i in range(len(ranks[0]["segments"])):
        total += max(r["segments"][i]["end"] - r["segments"][i]["start"] for r in ranks)
        clock.append(total)
    return clock


def validation_curve(ranks: list) -> list:
    """``[(step, training seconds, validation loss), ...]`` from step 0 to the end."""
    clock = [0.0] + training_clock(ranks)
    return [(step, clock[i], loss) for i, (step, loss) in enumerate(ranks[-1]["evals"])]


def train_loss_curve(ranks: list) -> list:
    """``[(training seconds at the end of the call, loss), ...]`` of the last stage's ``train_batch`` calls."""
    last = ranks[-1]
    base = [0.0] + training_clock(ranks)
    curve = []
    for i, seg in enumerate(last["segments"]):
        for c in range(seg["first_call"], seg["first_call"] + seg["calls"]):
            if last["losses"][c] is not None:
                curve.append((base[i] + last["calls"][c][1] - seg["start"], last["losses"][c]))
    return curve


def memory_of_run(ranks: list) -> list:
    """Per stage (stage order): the memory figures each rank measured."""
    return [dict(stage=r["stage"], **r["memory"]) for r in sorted(ranks, key=lambda r: r["stage"])]


def summarize_run(ranks: list, cfg: BenchConfig, engine: str, wall_seconds: float) -> dict:
    """The figures of one run (one engine, one round)."""
    curve = validation_curve(ranks)
    summary = {
        "engine": engine,
        "engine_type": ranks[0]["engine_type"],
        "throughput": throughput_of_run(ranks, cfg),
        "validation": [{"step": s, "train_seconds": t, "loss": v} for s, t, v in curve],
        "final_val_loss": curve[-1][2],
        "train_seconds_total": curve[-1][1],
        "train_loss": [{"train_seconds": t, "loss": v} for t, v in train_loss_curve(ranks)],
        "memory": memory_of_run(ranks),
        "world_wall_seconds": wall_seconds,
    }
    if engine == "paci":
        summary["paci_stats"] = [r.get("paci_stats") for r in ranks]
    return summary


# ----------------------------------------------------------------------------- comparing engines


def compare_engines(cfg: BenchConfig, rounds: list, target_loss: float | None) -> dict:
    """Medians, per-round ratios, share of ideal, memory, time to target and issue targets of one configuration.

    ``rounds``: ``[{"stock": run summary, "paci": run summary}, ...]``. ``target_loss``
    ``None`` selects :func:`default_target_loss`.
    """
    tps = {e: [r[e]["throughput"]["tokens_per_second"] for r in rounds] for e in ENGINES}
    spb = {e: [r[e]["throughput"]["seconds_per_batch"] for r in rounds] for e in ENGINES}
    ratios = per_round_ratios(tps["paci"], tps["stock"])
    ratio = median_of(ratios)
    ideal = ideal_ratio(cfg.stages, cfg.micro_batches)
    finals = {e: [r[e]["final_val_loss"] for r in rounds] for e in ENGINES}
    rule = "given by --target-loss"
    if target_loss is None:
        target_loss = default_target_loss(finals["stock"])
        rule = f"{TARGET_LOSS_FACTOR} x the stock engine's final validation loss (median over rounds)"
    tta = {e: [time_to_target([(p["step"], p["train_seconds"], p["loss"]) for p in r[e]["validation"]], target_loss)
               for r in rounds] for e in ENGINES}
    tta_seconds = {e: [None if x is None else x[0] for x in tta[e]] for e in ENGINES}
    tta_steps = {e: [None if x is None else x[1] for x in tta[e]] for e in ENGINES}
    speedups = per_round_ratios(tta_seconds["stock"], tta_seconds["paci"])
    curves = [{e: [(p["step"], p["train_seconds"], p["loss"]) for p in r[e]["validation"]] for e in ENGINES}
              for r in rounds]
    per_round_levels = [speedups_at_reference_levels(c["stock"], c["paci"]) for c in curves]
    levels = []
    for i, (loss, *_) in enumerate(per_round_levels[0]):
        column = [lv[i] for lv in per_round_levels]
        levels.append({"stock_step": curves[0]["stock"][i + 1][0], "loss": loss,
                       "stock_seconds": median_of([x[1] for x in column]),
                       "paci_seconds": median_of([x[2] for x in column]),
                       "speedup": median_of([x[3] for x in column])})
    final_stock, final_paci = median_of(finals["stock"]), median_of(finals["paci"])
    comparison = {
        "tokens_per_second": {e: {"median": median_of(tps[e]), "per_round": tps[e]} for e in ENGINES},
        "seconds_per_batch": {e: {"median": median_of(spb[e]), "per_round": spb[e]} for e in ENGINES},
        "ratio": {"median": ratio, "per_round": ratios},
        "ideal_ratio": ideal,
        "share_of_ideal": None if ratio is None else share_of_ideal(ratio, cfg.stages, cfg.micro_batches),
        "memory": memory_comparison(rounds),
        "time_to_target": {
            "target_loss": target_loss,
            "rule": rule,
            "seconds": {e: {"median": median_of(tta_seconds[e]), "per_round": tta_seconds[e]} for e in ENGINES},
            "steps": {e: {"median": median_of(tta_steps[e]), "per_round": tta_steps[e]} for e in ENGINES},
            "speedup": {"median": median_of(speedups), "per_round": speedups},
            "final_val_loss": {"stock": final_stock, "paci": final_paci},
            "final_val_loss_relative_difference": relative_difference(final_paci, final_stock),
            "at_stock_levels": levels,
        },
    }
    if cfg.emulated:
        comparison["expected_seconds_per_batch"] = {
            e: expected_seconds_per_batch(e, cfg.stages, cfg.micro_batches, cfg.device_time, cfg.blocks_per_stage)
            for e in ENGINES
        }
        comparison["measured_over_expected"] = {
            e: comparison["seconds_per_batch"][e]["median"] / comparison["expected_seconds_per_batch"][e]
            for e in ENGINES
        }
    comparison["targets"] = issue_targets(cfg, comparison)
    return comparison


def memory_comparison(rounds: list) -> dict:
    """Per stage and engine: median over rounds of each memory figure; plus the weight-copy checks."""
    out = {}
    for engine in ENGINES:
        per_stage = []
        for s in range(len(rounds[0][engine]["memory"])):
            rows = [r[engine]["memory"][s] for r in rounds]
            per_stage.append({
                "stage": s,
                "peak_saved_bytes": median_of([x["peak_saved_bytes"] for x in rows]),
                "peak_held_bytes": median_of([x["peak_held_bytes"] for x in rows]),
                "peak_rss_bytes": median_of([x["peak_rss_bytes"] for x in rows]),
                "param_bytes": rows[0]["param_bytes"],
                "optimizer_state_bytes": rows[0]["optimizer_state_bytes"],
                "extra_weight_bytes": max(x["extra_weight_bytes"] for x in rows),
                "aliases_share_storage": rows[0]["aliases_share_storage"],
            })
        out[engine] = per_stage
    stock, paci = out["stock"], out["paci"]
    out["paci_saved_le_stock_every_stage"] = all(p["peak_saved_bytes"] <= s["peak_saved_bytes"]
                                                 for p, s in zip(paci, stock))
    out["paci_held_le_stock_every_stage"] = all(p["peak_held_bytes"] <= s["peak_held_bytes"]
                                                for p, s in zip(paci, stock))
    out["same_param_bytes_every_stage"] = all(p["param_bytes"] == s["param_bytes"] for p, s in zip(paci, stock))
    out["no_extra_weight_copies"] = (all(x["extra_weight_bytes"] == 0 for x in stock + paci)
                                     and all(x["aliases_share_storage"] in (True, None) for x in paci))
    return out


# Issue targets, keyed by (mode, P, M): reported against, never enforced.
_THROUGHPUT_TARGETS = {("emulated", 8, 8): 1.75, ("emulated", 4, 4): 1.65, ("real", 2, 4): 1.15}


def issue_targets(cfg: BenchConfig, comparison: dict) -> list:
    """The issue's targets that apply to ``cfg``: ``[{"target", "measured", "unit", "met"}, ...]``.

    ``unit``: ``"ratio"`` (a plain number), ``"relative"`` (a fraction shown as a
    percentage) or ``"bool"``; ``measured`` is ``None`` when it was not reached.
    """
    targets = []
    key = (cfg.mode, cfg.stages, cfg.micro_batches)
    ratio = comparison["ratio"]["median"]
    if key in _THROUGHPUT_TARGETS:
        goal = _THROUGHPUT_TARGETS[key]
        targets.append({"target": f"PACI/stock throughput >= {goal}", "measured": ratio, "unit": "ratio",
                        "met": ratio is not None and ratio >= goal})
    mem = comparison["memory"]
    targets.append({"target": "PACI peak activation bytes <= stock's on every stage (saved for backward)",
                    "measured": mem["paci_saved_le_stock_every_stage"], "unit": "bool",
                    "met": mem["paci_saved_le_stock_every_stage"]})
    if cfg.emulated:
        over = comparison["measured_over_expected"]["paci"]
        targets.append({"target": "PACI seconds per batch within 10% of M*3f (emulated); measured/expected",
                        "measured": over, "unit": "ratio", "met": abs(over - 1.0) <= 0.10})
    if key == ("emulated", 8, 8):
        tta = comparison["time_to_target"]
        speedup = tta["speedup"]["median"]
        targets.append({"target": "time to target validation loss >= 1.5x shorter than stock", "measured": speedup,
                        "unit": "ratio", "met": speedup is not None and speedup >= 1.5})
        diff = tta["final_val_loss_relative_difference"]
        targets.append({"target": "PACI final validation loss within 2% of stock's", "measured": diff,
                        "unit": "relative", "met": abs(diff) <= 0.02})
    return targets


def format_measured(value, unit: str) -> str:
    """Text of a target's measured value: ``not reached`` for ``None``, percentages for relative values."""
    if value is None:
        return "not reached"
    if unit == "bool":
        return "yes" if value else "no"
    if unit == "relative":
        return f"{value:+.2%}"
    return f"{value:.3f}"


# ----------------------------------------------------------------------------- machine facts


def machine_facts() -> dict:
    """CPU count, load average, library versions, date: recorded with every result."""
    import deepspeed
    import torch
    import transformers
    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "loadavg": list(os.getloadavg()),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "transformers": transformers.__version__,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


# ----------------------------------------------------------------------------- data


def prepare_tokens(cfg: BenchConfig, path: str) -> dict:
    """Encode the Shakespeare train/validation split once and save it for the workers; returns its sizes."""
    import torch

    from ds_paci.data import encode_documents, get_tokenizer, load_corpus, split_documents
    train_docs, val_docs = split_documents(load_corpus(), val_fraction=0.1, seed=0)
    tokenizer = get_tokenizer(cfg.tokenizer, train_docs)
    dtype = torch.int16 if tokenizer.vocab_size <= 32767 else torch.int32
    train = encode_documents(train_docs, tokenizer).to(dtype)
    val = encode_documents(val_docs, tokenizer).to(dtype)
    torch.save({"train": train, "val": val}, path)
    return {"tokenizer": tokenizer.name, "train_tokens": train.numel(), "val_tokens": val.numel(),
            "train_documents": len(train_docs), "val_documents": len(val_docs)}


# ----------------------------------------------------------------------------- plots


def _engine_colors():
    return {"stock": "#8C8C8C", "paci": "#4C72B0"}


def plot_throughput(cfg: BenchConfig, comparison: dict, path: str) -> str:
    """Bars of each engine's median tokens/s with per-round dots, the measured ratio and the ideal."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    colors = _engine_colors()
    tps = comparison["tokens_per_second"]
    fig, ax = plt.subplots(figsize=(5.5, 4.2))
    for x, engine in enumerate(ENGINES):
        ax.bar(x, tps[engine]["median"], color=colors[engine], width=0.6, label=ENGINE_TITLES[engine])
        ax.scatter([x] * len(tps[engine]["per_round"]), tps[engine]["per_round"], color="black", s=12, zorder=3)
    ideal_paci = tps["stock"]["median"] * comparison["ideal_ratio"]
    ax.hlines(ideal_paci, 0.65, 1.35, colors="#C44E52", linestyles="--",
              label=f"ideal PACI = stock x (M+P-1)/M = {comparison['ideal_ratio']:.3f}")
    ax.set_xticks(range(len(ENGINES)))
    ax.set_xticklabels([ENGINE_TITLES[e] for e in ENGINES])
    ax.set_ylabel("training tokens/s (steady state" + (", emulated)" if cfg.emulated else ")"))
    ratio = comparison["ratio"]["median"]
    ax.set_title(f"{cfg.label()}\nPACI/stock {ratio:.3f} ({comparison['share_of_ideal']:.0%} of ideal)", fontsize=10)
    ax.set_ylim(0, 1.3 * max(ideal_paci, max(tps["paci"]["per_round"])))
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_loss(cfg: BenchConfig, rounds: list, comparison: dict, path: str) -> str:
    """Training loss (last stage, per call) and validation loss against training wall time, first round."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    colors = _engine_colors()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for engine in ENGINES:
        run = rounds[0][engine]
        ax.plot([p["train_seconds"] for p in run["train_loss"]], [p["loss"] for p in run["train_loss"]],
                color=colors[engine], alpha=0.35, linewidth=0.8)
        ax.plot([p["train_seconds"] for p in run["validation"]], [p["loss"] for p in run["validation"]],
                color=colors[engine], marker="o", markersize=3.5, label=f"{ENGINE_TITLES[engine]} validation")
    tta = comparison["time_to_target"]
    ax.axhline(tta["target_loss"], color="#C44E52", linestyle="--", linewidth=0.9,
               label=f"target {tta['target_loss']:.3f}")
    for engine in ENGINES:
        seconds = tta["seconds"][engine]["per_round"][0]
        if seconds is not None:
            ax.axvline(seconds, color=colors[engine], linestyle=":", linewidth=0.9)
    clock = "training wall time, evaluation excluded (s" + (", emulated)" if cfg.emulated else ")")
    ax.set_xlabel(clock)
    ax.set_ylabel("loss (nats/token); faint: training loss per call")
    speed = tta["speedup"]["median"]
    ax.set_title(f"{cfg.label()}: loss vs time" + (f", time to target {speed:.2f}x shorter with PACI" if speed else ""),
                 fontsize=10)
    finals = [rounds[0][e]["final_val_loss"] for e in ENGINES]
    ax.set_ylim(min(finals) - 0.15, max(p["loss"] for p in rounds[0]["stock"]["validation"]) + 0.1)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_ratios(entries: list, path: str) -> str:
    """Measured PACI/stock throughput ratio next to the ideal, one group per configuration."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(1.9 * len(entries) + 2.5, 4.0))
    xs = range(len(entries))
    measured = [e["comparison"]["ratio"]["median"] for e in entries]
    ideal = [e["comparison"]["ideal_ratio"] for e in entries]
    ax.bar([x - 0.18 for x in xs], measured, width=0.36, color="#4C72B0", label="measured PACI/stock (median)")
    ax.bar([x + 0.18 for x in xs], ideal, width=0.36, color="#DDDDDD", edgecolor="#888888",
           label="ideal (M+P-1)/M")
    for x, m, i in zip(xs, measured, ideal):
        ax.text(x - 0.18, m, f"{m:.2f}", ha="center", va="bottom", fontsize=8)
        ax.text(x + 0.18, i, f"{i:.2f}", ha="center", va="bottom", fontsize=8)
    ax.axhline(1.0, color="black", linewidth=0.6)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([BenchConfig(**e["config"]).label().replace(" (", "\n(") for e in entries], fontsize=8)
    ax.set_ylabel("throughput ratio PACI / stock")
    ax.set_title("PACI vs stock DeepSpeed pipeline (emulated rows: emulated device time)", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def render_timelines(cfg: BenchConfig, traces: dict, stock_seconds_per_batch: float, out: str, batches: int = 2):
    """PNG, Chrome trace and text grid of each engine's trace over the same wall-clock window.

    The window starts at the first steady-state call on stage 0 and lasts ``batches``
    stock batches (so PACI shows how much more it completes in the same time).
    Returns ``{engine: {"png", "chrome", "text"}}``.
    """
    from ds_paci import timeline
    window = batches * stock_seconds_per_batch
    rendered = {}
    for engine, (records, start) in traces.items():
        chosen = [r for r in records if r["start"] >= start and r["end"] <= start + window]
        if not chosen:
            continue
        title = (f"{ENGINE_TITLES[engine]}, {cfg.label()}: {window:.2f} s of steady state"
                 f" ({batches} stock batches)")
        png = timeline.to_png(chosen, os.path.join(out, f"{cfg.name}_timeline_{engine}.png"), title)
        chrome = timeline.to_chrome_trace(chosen, os.path.join(out, f"{cfg.name}_timeline_{engine}.json"),
                                          label=title)
        rendered[engine] = {"png": os.path.basename(png), "chrome": os.path.basename(chrome),
                            "text": timeline.to_text_grid(chosen, width=100), "title": title}
    return rendered


# ----------------------------------------------------------------------------- markdown


def _mb(nbytes) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.2f} MiB"


def _num(value, fmt="{:.3f}") -> str:
    return "-" if value is None else fmt.format(value)


def throughput_table(entries: list) -> str:
    """Markdown table: tokens/s, s/batch (and expected for emulated rows), ratio, ideal, share of ideal."""
    head = ("| configuration | stock tokens/s | PACI tokens/s | PACI/stock (median of rounds) | per round | ideal "
            "(M+P-1)/M | share of ideal | stock s/batch (expected) | PACI s/batch (expected) |\n"
            "|---|---|---|---|---|---|---|---|---|")
    rows = []
    for e in entries:
        cfg, c = BenchConfig(**e["config"]), e["comparison"]
        tps, spb = c["tokens_per_second"], c["seconds_per_batch"]
        expected = c.get("expected_seconds_per_batch", {})

        def spb_cell(engine):
            cell = f"{spb[engine]['median']:.3f}"
            if engine in expected:
                cell += f" ({expected[engine]:.3f}, x{c['measured_over_expected'][engine]:.3f})"
            return cell

        per_round = ", ".join(_num(x) for x in c["ratio"]["per_round"])
        rows.append(f"| {cfg.label()} | {tps['stock']['median']:.0f} | {tps['paci']['median']:.0f} | "
                    f"{c['ratio']['median']:.3f} | {per_round} | {c['ideal_ratio']:.3f} | "
                    f"{c['share_of_ideal']:.1%} | {spb_cell('stock')} | {spb_cell('paci')} |")
    return "\n".join([head] + rows)


def memory_table(entries: list) -> str:
    """Markdown table: per stage, peak saved/held activation bytes, peak RSS and parameter bytes of both engines."""
    head = ("| configuration | stage | saved for backward stock / PACI | held incl. pipe buffers stock / PACI | "
            "peak RSS stock / PACI | params stock / PACI | extra weight copies |\n|---|---|---|---|---|---|---|")
    rows = []
    for e in entries:
        cfg, mem = BenchConfig(**e["config"]), e["comparison"]["memory"]
        for s, p in zip(mem["stock"], mem["paci"]):
            extra = "none" if s["extra_weight_bytes"] == 0 and p["extra_weight_bytes"] == 0 and \
                p["aliases_share_storage"] in (True, None) else f"{s['extra_weight_bytes']} / {p['extra_weight_bytes']}"
            rows.append(f"| {cfg.label()} | {s['stage']} | {_mb(s['peak_saved_bytes'])} / {_mb(p['peak_saved_bytes'])}"
                        f" | {_mb(s['peak_held_bytes'])} / {_mb(p['peak_held_bytes'])} | {_mb(s['peak_rss_bytes'])} / "
                        f"{_mb(p['peak_rss_bytes'])} | {_mb(s['param_bytes'])} / {_mb(p['param_bytes'])} | {extra} |")
    return "\n".join([head] + rows)


def accuracy_table(entries: list) -> str:
    """Markdown table: target loss, time and steps to it for each engine, speedup, final validation losses."""
    head = ("| configuration | target val loss | stock time / steps to target | PACI time / steps to target | "
            "time speedup PACI (median, per round) | final val loss stock / PACI (diff) |\n|---|---|---|---|---|---|")
    rows = []
    for e in entries:
        cfg, t = BenchConfig(**e["config"]), e["comparison"]["time_to_target"]

        def reached(engine):
            seconds, steps = t["seconds"][engine]["median"], t["steps"][engine]["median"]
            return "not reached" if seconds is None else f"{seconds:.1f} s / {steps:.1f}"

        per_round = ", ".join(_num(x, "{:.2f}") for x in t["speedup"]["per_round"])
        speedup = t["speedup"]["median"]
        finals = t["final_val_loss"]
        rows.append(f"| {cfg.label()} | {t['target_loss']:.4f} | {reached('stock')} | {reached('paci')} | "
                    f"{_num(speedup, '{:.2f}x')} ({per_round}) | {finals['stock']:.4f} / {finals['paci']:.4f} "
                    f"({t['final_val_loss_relative_difference']:+.2%}) |")
    return "\n".join([head] + rows)


def levels_table(entries: list) -> str:
    """Markdown table: for each validation loss the stock engine reached, PACI's time to it and the speedup."""
    head = ("| configuration | stock step | stock val loss | stock time | PACI time to that loss | speedup |\n"
            "|---|---|---|---|---|---|")
    rows = []
    for e in entries:
        label = BenchConfig(**e["config"]).label()
        for lv in e["comparison"]["time_to_target"]["at_stock_levels"]:
            rows.append(f"| {label} | {lv['stock_step']} | {lv['loss']:.4f} | {lv['stock_seconds']:.1f} s | "
                        f"{_num(lv['paci_seconds'], '{:.1f} s') if lv['paci_seconds'] is not None else 'not reached'} "
                        f"| {_num(lv['speedup'], '{:.2f}x')} |")
    return "\n".join([head] + rows)


def targets_table(entries: list) -> str:
    """Markdown table of the issue targets that apply to each configuration (reported, not enforced)."""
    head = "| configuration | target | measured | met |\n|---|---|---|---|"
    rows = []
    for e in entries:
        label = BenchConfig(**e["config"]).label()
        for t in e["comparison"]["targets"]:
            shown = format_measured(t["measured"], t.get("unit", "ratio"))
            rows.append(f"| {label} | {t['target']} | {shown} | {'yes' if t['met'] else 'NO'} |")
    return "\n".join([head] + rows)


def summary_markdown(entries: list, facts: dict, command: str) -> str:
    """The whole ``summary.md``: machine, command, method notes, tables, plots and timelines."""
    commands = sorted({e.get("command", command) for e in entries})
    lines = ["# ds_paci benchmark: PACI vs stock DeepSpeed pipeline engine", "",
             "Command: " + "; ".join(f"`{c}`" for c in commands), "",
             f"Machine: {facts['cpu_count']} CPUs ({facts['cpus_usable']} usable), {facts['platform']}, Python "
             f"{facts['python']}, torch {facts['torch']}, deepspeed {facts['deepspeed']}, transformers "
             f"{facts['transformers']}; started {facts['date_utc']}, load average at start "
             f"{', '.join(f'{x:.2f}' for x in facts['loadavg'])}.", "",
             "Rows marked **emulated** add emulated device time (a CPU-free wait of f per block in forward and 2f in "
             "backward, identical for both engines); their times are emulated, not hardware results. Real math runs "
             "in every mode, so losses are real.", "",
             "Throughput: steady state, warm-up calls of each segment between evaluations excluded, only the "
             "`train_batch` loop timed (slowest rank). Time to target: training wall clock including PACI's drain "
             "before each evaluation, evaluation time excluded.", "",
             "## Throughput", "", throughput_table(entries), "",
             "## Time to accuracy", "", accuracy_table(entries), "",
             "Time for PACI to reach each validation loss the stock engine reached (medians over rounds):", "",
             levels_table(entries), "",
             "## Memory per stage (median over rounds)", "", memory_table(entries), "",
             "## Issue targets (reported, not enforced)", "", targets_table(entries), ""]
    for e in entries:
        cfg = BenchConfig(**e["config"])
        lines += [f"## {cfg.label()}", "",
                  f"Rounds: {len(e['rounds'])}; steps {cfg.steps}, eval every {cfg.eval_every}, warm-up {cfg.warmup} "
                  f"calls per segment; micro-batch {cfg.micro_batch_size} x {cfg.seq_len} tokens; GPT-2 "
                  f"{cfg.n_layer} blocks, n_embd {cfg.n_embd}; AdamW lr {cfg.lr:g}. Invocation started "
                  f"{e['machine']['date_utc']} "
                  f"(`{e.get('command', command)}`); load average before/after {e['loadavg_before']} / "
                  f"{e['loadavg_after']}.", "",
                  f"![throughput]({e['plots']['throughput']})", "", f"![loss]({e['plots']['loss']})", ""]
        for engine, t in e.get("timelines", {}).items():
            lines += [f"![{engine} timeline]({t['png']})", "", "```", t["title"], t["text"], "```", ""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- orchestration


def run_engine(cfg: BenchConfig, engine: str, round_index: int, *, trace: bool, data_path: str, log_root: str,
               timeout: float) -> tuple[dict, list]:
    """One world of ``engine`` for round ``round_index``; returns its :func:`summarize_run` and the raw rank results."""
    run_dir = os.path.join(log_root, cfg.name, f"{engine}_round{round_index}")
    job = RunJob(config=cfg, engine=engine, data_path=data_path, trace=trace, gloo_timeout_s=min(timeout, 600))
    began = time.monotonic()
    ranks = run_world(job, run_dir, timeout)
    return summarize_run(ranks, cfg, engine, time.monotonic() - began), ranks


def run_rounds(cfg: BenchConfig, *, repeats: int, trace: bool, data_path: str, log_root: str, timeout: float,
               echo=print) -> tuple[list, dict]:
    """Run stock, PACI, stock, PACI, ... for ``repeats`` rounds.

    Returns ``(rounds, traces)``: ``rounds[r][engine]`` is a run summary; ``traces[engine]``
    is ``(records of the first round, start of its first steady-state call on rank 0)``
    when ``trace`` is on.
    """
    rounds, traces = [], {}
    for r in range(repeats):
        runs = {}
        for engine in ENGINES:
            traced = trace and r == 0
            runs[engine], ranks = run_engine(cfg, engine, r, trace=traced, data_path=data_path, log_root=log_root,
                                             timeout=timeout)
            if traced:
                traces[engine] = ([rec for rank in ranks for rec in rank["trace"]], ranks[0]["calls"][cfg.warmup][0])
            tp = runs[engine]["throughput"]
            echo(f"[{cfg.name}] round {r + 1}/{repeats} {engine:5s}: {tp['tokens_per_second']:8.0f} tokens/s, "
                 f"{tp['seconds_per_batch']:.3f} s/batch, final val loss {runs[engine]['final_val_loss']:.4f}, "
                 f"world {runs[engine]['world_wall_seconds']:.0f} s, load {os.getloadavg()[0]:.2f}")
        rounds.append(runs)
    return rounds, traces


def configuration_entry(cfg: BenchConfig, rounds: list, traces: dict, target_loss, out: str) -> dict:
    """Compare the engines over ``rounds``, draw the plots and timelines into ``out``; returns the JSON entry."""
    comparison = compare_engines(cfg, rounds, target_loss)
    entry = {"config": dataclasses.asdict(cfg), "label": cfg.label(), "emulated": cfg.emulated,
             "repeats": len(rounds), "comparison": comparison, "rounds": rounds}
    stem = os.path.join(out, cfg.name)
    entry["plots"] = {
        "throughput": os.path.basename(plot_throughput(cfg, comparison, f"{stem}_throughput.png")),
        "loss": os.path.basename(plot_loss(cfg, rounds, comparison, f"{stem}_loss.png")),
    }
    if traces:
        stock_seconds = comparison["seconds_per_batch"]["stock"]["per_round"][0]
        entry["timelines"] = render_timelines(cfg, traces, stock_seconds, out)
    return entry


def write_json(path: str, payload: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(payload, f, indent=1)
    os.replace(path + ".tmp", path)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ds_paci.bench",
                                description="Side-by-side benchmark of DeepSpeed's stock pipeline engine and PACI.")
    p.add_argument("--preset", choices=sorted(presets()), help="named set of configurations (flags below override)")
    p.add_argument("--mode", choices=["real", "emulated"],
                   help="without --preset: real compute or emulated device time; with it: keep only that mode")
    p.add_argument("--summary-only", action="store_true",
                   help="run nothing: recompute comparisons, plots and summary.md from the JSON files in --out")
    p.add_argument("--only", help="comma-separated configuration names of the preset to (re)run, e.g. emulated_P8_M8; "
                                  "summary.md still lists the preset's other configurations from their JSON in --out")
    p.add_argument("--stages", type=int, help="pipeline stages P (one process each)")
    p.add_argument("--micro-batches", type=int, help="M = gradient_accumulation_steps (PACI window a = M)")
    p.add_argument("--micro-batch-size", type=int)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--n-embd", type=int)
    p.add_argument("--n-layer", type=int)
    p.add_argument("--steps", type=int, help="train_batch calls per run")
    p.add_argument("--warmup", type=int, help="calls excluded from throughput at the start of each segment")
    p.add_argument("--repeats", type=int, help="rounds of (stock, PACI)")
    p.add_argument("--device-time", type=float, help="emulated device seconds per block in forward (2x in backward)")
    p.add_argument("--eval-every", type=int, help="validate every this many steps (0: only at start and end)")
    p.add_argument("--eval-batches", type=int, help="eval_batch calls of M micro-batches per validation")
    p.add_argument("--lr", type=float)
    p.add_argument("--target-loss", type=float,
                   help=f"validation loss to time (default: {TARGET_LOSS_FACTOR} x stock's final validation loss)")
    p.add_argument("--trace", action=argparse.BooleanOptionalAction, default=None,
                   help="record and render timelines of the first round (preset default)")
    p.add_argument("--out", default="docs/results", help="output folder")
    p.add_argument("--log-dir", help="per-rank logs (default: a new temporary folder)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds before a world is killed")
    return p


_OVERRIDES = ("stages", "micro_batches", "micro_batch_size", "seq_len", "n_embd", "n_layer", "steps", "warmup",
              "device_time", "eval_every", "eval_batches", "lr")


def override_config(cfg: BenchConfig, overrides: dict) -> BenchConfig:
    """``cfg`` with the non-``None`` ``overrides``; an emulated ``stages`` override keeps one block per stage."""
    given = {k: v for k, v in overrides.items() if v is not None}
    if cfg.emulated and "stages" in given and "n_layer" not in given:
        given["n_layer"] = given["stages"]
    fields = {**dataclasses.asdict(cfg), **given}
    fields["name"] = config_name(fields)
    return validate_config(BenchConfig(**fields))


def configurations_from_args(args) -> tuple[list, int, bool]:
    """``(configs, repeats, trace)`` from the parsed command line."""
    overrides = {k: getattr(args, k) for k in _OVERRIDES}
    if args.preset:
        preset = presets()[args.preset]
        configs = [override_config(c, overrides) for c in preset.configs]
        if args.mode:
            configs = [c for c in configs if c.mode == args.mode]
        repeats, trace = preset.repeats, preset.trace
    else:
        configs = [make_config(args.mode or "emulated", **overrides)]
        repeats, trace = 1, False
    if args.repeats is not None:
        repeats = args.repeats
    if args.trace is not None:
        trace = args.trace
    if not configs or repeats < 1:
        raise SystemExit("nothing to run: check --preset/--mode and --repeats")
    return configs, repeats, trace


def load_entries(out: str, configs: list, fresh: dict) -> list:
    """Entries of ``configs`` in order: from ``fresh`` (this invocation) or from ``out/<name>.json`` if present."""
    entries = []
    for cfg in configs:
        if cfg.name in fresh:
            entries.append(fresh[cfg.name])
            continue
        path = os.path.join(out, f"{cfg.name}.json")
        if os.path.exists(path):
            with open(path) as f:
                entries.append(json.load(f))
    return entries


def write_summary(entries: list, out: str, command: str) -> str:
    """Write ``summary.md`` (and ``ratios.png`` for several configurations) into ``out``; returns the markdown."""
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    facts = dict(machine_facts(), date_utc_end=now)
    markdown = summary_markdown(entries, entries[0]["machine"], command)
    if len(entries) > 1:
        ratios = os.path.basename(plot_ratios(entries, os.path.join(out, "ratios.png")))
        markdown += f"\n## All configurations\n\n![ratios]({ratios})\n"
    markdown += (f"\nSummary written {facts['date_utc_end']}, load average then "
                 f"{', '.join(f'{x:.2f}' for x in facts['loadavg'])}.\n")
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(markdown)
    return markdown


def reanalyse(out: str, configs: list, target_loss) -> dict:
    """Recompute each stored entry's comparison and plots from its per-round data; rewrites its JSON.

    The target loss stays what the stored entry used unless ``target_loss`` is given.
    Timelines are left as they are (their traces are not stored in the JSON).
    """
    fresh = {}
    for entry in load_entries(out, configs, {}):
        cfg = BenchConfig(**entry["config"])
        stored = entry["comparison"]["time_to_target"]
        target = target_loss if target_loss is not None else (
            None if stored["rule"].startswith(str(TARGET_LOSS_FACTOR)) else stored["target_loss"])
        entry["comparison"] = compare_engines(cfg, entry["rounds"], target)
        plot_throughput(cfg, entry["comparison"], os.path.join(out, entry["plots"]["throughput"]))
        plot_loss(cfg, entry["rounds"], entry["comparison"], os.path.join(out, entry["plots"]["loss"]))
        write_json(os.path.join(out, f"{cfg.name}.json"), entry)
        fresh[cfg.name] = entry
    return fresh


def main(argv=None) -> int:
    """Command line entry point (see the module docstring and ``--help``)."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        all_configs, repeats, trace = configurations_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    configs = [c for c in all_configs if not args.only or c.name in args.only.split(",")]
    if not configs:
        raise SystemExit(f"--only {args.only} matches none of {', '.join(c.name for c in all_configs)}")
    command = "python -m ds_paci.bench " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.summary_only:
        fresh = reanalyse(args.out, configs, args.target_loss)
        if not fresh:
            raise SystemExit(f"no stored results of {', '.join(c.name for c in configs)} in {args.out}")
        print(write_summary(load_entries(args.out, all_configs, fresh), args.out, command))
        return 0
    os.makedirs(args.out, exist_ok=True)
    log_root = args.log_dir or tempfile.mkdtemp(prefix="ds_paci_bench_")
    os.makedirs(log_root, exist_ok=True)
    facts = machine_facts()
    print(f"ds_paci.bench: {len(configs)} configuration(s) x {repeats} round(s); logs in {log_root}", flush=True)
    fresh, data = {}, {}
    for cfg in configs:
        data_path = os.path.join(log_root, f"tokens_{cfg.tokenizer}.pt")
        if cfg.tokenizer not in data:
            data[cfg.tokenizer] = prepare_tokens(cfg, data_path)
        loadavg_before = [round(x, 2) for x in os.getloadavg()]
        try:
            rounds, traces = run_rounds(cfg, repeats=repeats, trace=trace, data_path=data_path, log_root=log_root,
                                        timeout=args.timeout, echo=lambda line: print(line, flush=True))
        except world.WorldFailure as e:
            print(f"ds_paci.bench: {e}", file=sys.stderr)
            return 1
        entry = configuration_entry(cfg, rounds, traces, args.target_loss, args.out)
        entry.update(machine=facts, command=command, data=data[cfg.tokenizer], loadavg_before=loadavg_before,
                     loadavg_after=[round(x, 2) for x in os.getloadavg()])
        write_json(os.path.join(args.out, f"{cfg.name}.json"), entry)
        fresh[cfg.name] = entry
        markdown = write_summary(load_entries(args.out, all_configs, fresh), args.out, command)
    print(markdown.split("## ")[0])
    entries = load_entries(args.out, all_configs, fresh)
    for title, table in (("Throughput", throughput_table(entries)), ("Time to accuracy", accuracy_table(entries)),
                         ("Memory", memory_table(entries)), ("Issue targets", targets_table(entries))):
        print(f"\n## {title}\n\n{table}")
    if not args.log_dir:
        shutil.rmtree(log_root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    from ds_paci.bench import main as _main  # the importable module, so spawned workers resolve its functions
    sys.exit(_main())
