"""Benchmark configurations: :class:`BenchConfig`, per-mode defaults, named presets, command-line overrides."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass



ENGINES = ("stock", "paci", "paci+lookahead")


ENGINE_TITLES = {"stock": "stock 1F1B-flush", "paci": "PACI", "paci+lookahead": "PACI + look-ahead"}

#: Engines that run PACI streams (``PACIPipelineEngine``); the rest are DeepSpeed's stock engine.
PACI_ENGINES = ("paci", "paci+lookahead")


def engines_in(runs) -> list:
    """The engines present in ``runs`` (a round dict or a list of names), in :data:`ENGINES` order."""
    return [e for e in ENGINES if e in runs]


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark configuration: model, data, pipeline shape and the run schedule.

    ``device_time`` > 0 only in ``emulated`` mode (seconds of emulated device time per
    block in forward; backward waits twice as long). ``tie_embeddings`` ties the LM head to
    the token embedding (first and last stage; PACI exchanges their gradients, stock all-reduces them).
    ``loss_curves``: an emulated shape run without the wait (``device_time`` 0): the same math, so
    the same losses per step, in far less time; its timings mean nothing and are not reported (see
    :func:`curves_config`).
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
    tie_embeddings: bool = False
    loss_curves: bool = False

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
        shape = f"P={self.stages} M={self.micro_batches}" + (", tied embeddings" if self.tie_embeddings else "")
        if self.loss_curves:
            return f"{self.mode} {shape} shape (loss curves, no wait)"
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
    if cfg.emulated and cfg.device_time <= 0 and not cfg.loss_curves:
        raise ValueError("emulated mode needs --device-time > 0")
    if cfg.loss_curves and cfg.device_time != 0:
        raise ValueError("loss-curve runs run without the emulated wait (device_time 0)")
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
    tied = "_tied" if cfg_fields.get("tie_embeddings") else ""
    return f"{cfg_fields['mode']}_P{cfg_fields['stages']}_M{cfg_fields['micro_batches']}{tied}"


def curves_config(cfg: BenchConfig, steps: int, eval_every: int, lr: float, seed: int, data_seed: int) -> BenchConfig:
    """``cfg``'s model, data and micro-batching without the emulated wait, for loss curves of ``steps`` steps.

    The name keeps the shape (``emulated_P8_M8``): the curve runs of a configuration
    are matched with its throughput runs by name.
    """
    fields = {**dataclasses.asdict(cfg), "device_time": 0.0, "loss_curves": True, "steps": steps,
              "eval_every": eval_every, "lr": lr, "seed": seed, "data_seed": data_seed}
    return validate_config(BenchConfig(**fields))


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


@dataclass(frozen=True)
class CurveStudy:
    """Loss curves of every engine per configuration, learning rate and seed, matched with throughput runs.

    ``throughput``: the throughput configurations (timed, alternating rounds); ``lrs``
    per configuration name; ``seeds``: ``(model seed, data seed)`` pairs. Each curve run
    is :func:`curves_config` of the throughput configuration with the same name.
    """

    throughput: tuple
    repeats: int
    steps: int
    eval_every: int
    lrs: dict
    seeds: tuple
    overrun: float = 1.0  # PACI engines train overrun x steps (time to stock's final loss); stock trains steps

    def curve_configs(self):
        """Every curve run's configuration, in run order (configuration, learning rate, seed)."""
        return [curves_config(cfg, self.steps, self.eval_every, lr, seed, data_seed)
                for cfg in self.throughput for lr in self.lrs[cfg.name] for seed, data_seed in self.seeds]

    def engine_steps(self, engine: str) -> int:
        """Steps of ``engine``'s curve runs: ``steps`` for stock, ``overrun x steps`` for PACI engines."""
        return self.steps if engine not in PACI_ENGINES or self.overrun <= 1 else math.ceil(self.overrun * self.steps)

    def past_steps(self, engine: str) -> bool:
        return self.engine_steps(engine) != self.steps


def studies() -> dict[str, CurveStudy]:
    """Named curve studies. ``lookahead``: issue 11's evidence (stock, PACI, PACI + look-ahead at real P=2 and
    emulated P=4, P=8; two seeds; 300 steps; two constant learning rates: 2e-3, the best of {1e-3, 2e-3, 3e-3} for
    the stock engine at P=8 over 300 steps (2.443, 2.365, 2.484), and 3x lower). ``time_to_final``: the
    same at P=4 and P=8 with the PACI engines trained 1.5x stock's 300 steps, for the time to stock's final
    loss (issue 19). ``smoke``: seconds."""
    return {
        "lookahead":
            CurveStudy(throughput=(make_config("real", stages=2, micro_batches=4, steps=40),
                                   make_config("emulated", stages=4, micro_batches=4, device_time=0.05, steps=40),
                                   make_config("emulated", stages=8, micro_batches=8, device_time=0.02, steps=40)),
                       repeats=3, steps=300, eval_every=25,
                       lrs={"real_P2_M4": (2e-3, 2e-3 / 3), "emulated_P4_M4": (2e-3, 2e-3 / 3),
                            "emulated_P8_M8": (2e-3, 2e-3 / 3)},
                       seeds=((1234, 7), (4321, 8))),
        "time_to_final":
            CurveStudy(throughput=(make_config("emulated", stages=4, micro_batches=4, device_time=0.05, steps=40),
                                   make_config("emulated", stages=8, micro_batches=8, device_time=0.02, steps=40)),
                       repeats=3, steps=300, eval_every=25,
                       lrs={"emulated_P4_M4": (2e-3, 2e-3 / 3), "emulated_P8_M8": (2e-3, 2e-3 / 3)},
                       seeds=((1234, 7), (4321, 8)), overrun=1.5),
        "smoke":
            CurveStudy(throughput=presets()["smoke"].configs, repeats=1, steps=6, eval_every=3,
                       lrs={"emulated_P2_M2": (1e-3, )}, seeds=((1234, 7), ), overrun=1.5),
    }


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


OVERRIDABLE_FIELDS = ("stages", "micro_batches", "micro_batch_size", "seq_len", "n_embd", "n_layer", "steps", "warmup",
              "device_time", "eval_every", "eval_batches", "lr", "tie_embeddings")


def override_config(cfg: BenchConfig, overrides: dict) -> BenchConfig:
    """``cfg`` with the non-``None`` ``overrides``; an emulated ``stages`` override keeps one block per stage."""
    given = {k: v for k, v in overrides.items() if v is not None}
    if cfg.emulated and "stages" in given and "n_layer" not in given:
        given["n_layer"] = given["stages"]
    fields = {**dataclasses.asdict(cfg), **given}
    fields["name"] = config_name(fields)
    return validate_config(BenchConfig(**fields))
