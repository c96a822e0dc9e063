"""The ``"paci"`` section of a DeepSpeed config: parsing, validation, clear errors.

Example (JSON)::

    "paci": {
        "enabled": true,
        "accumulation_window": 8,
        "drain_every_batch": false,
        "watchdog_seconds": 300,
        "max_consecutive_skips": 5,
        "trace": false
    }

Keys (every one optional except ``enabled``):

``enabled`` (bool)
    Use the PACI engine. Without the section, or with ``false``, ``ds_paci.initialize``
    returns DeepSpeed's stock ``PipelineEngine``.
``accumulation_window`` (int >= 1, default ``gradient_accumulation_steps``)
    ``a``: each stage takes its own optimizer step after every ``a`` of its backward
    passes. Drift is bounded by ``ceil((P-1-s)/a)``; ``a >= P-1`` keeps it at one
    version. Gradients are averaged over the window (the last stage scales the loss
    by ``1/a``).
``drain_every_batch`` (bool, default false)
    Sync mode: drain after every ``train_batch``. Reproduces the stock engine exactly.
``watchdog_seconds`` (number >= 0, default 300; 0 turns it off)
    A stage that waits longer than this inside one instruction prints where it is
    stuck (rank, stage, instruction, tick) and aborts, instead of hanging.
``max_consecutive_skips`` (int >= 0, default 5; 0 never stops)
    Async mode skips a local step whose gradient is not finite (see :mod:`ds_paci.core.guard`); after
    this many skips in a row at one stage, every rank stops with one line naming the stage and the step.
``trace`` (bool, default false)
    Record start and end time of every instruction (for timelines); the most recent
    million records are kept.
``trace_dir`` (path, default none)
    Where ``engine.write_trace()`` writes ``trace_rank<R>.jsonl`` when called without a path.

Everything that cannot be honoured fails in :func:`validate_run` with a message that
names the key, the value and what is allowed. ``ds_paci.initialize`` and
``PACIPipelineEngine.__init__`` both call it (the engine before DeepSpeed builds its
optimizer), so building the engine class directly fails the same way.
"""

import copy
import json
import os
from dataclasses import dataclass
from typing import Optional

PACI_SECTION = "paci"


class PACIConfigError(ValueError):
    """A ``paci`` setting, or a combination with the rest of the run, that PACI cannot honour."""


@dataclass(frozen=True)
class PACIConfig:
    enabled: bool = False
    accumulation_window: Optional[int] = None
    drain_every_batch: bool = False
    watchdog_seconds: float = 300.0
    max_consecutive_skips: int = 5
    trace: bool = False
    trace_dir: Optional[str] = None

    def window(self, gradient_accumulation_steps):
        """The effective accumulation window ``a``."""
        return self.accumulation_window or gradient_accumulation_steps


_KEYS = {
    "enabled": "true or false",
    "accumulation_window": "an integer >= 1 (default: gradient_accumulation_steps)",
    "drain_every_batch": "true or false",
    "watchdog_seconds": "a number of seconds >= 0 (0 turns the watchdog off)",
    "max_consecutive_skips": "an integer >= 0 (0: never stop on skipped non-finite steps)",
    "trace": "true or false",
    "trace_dir": "a directory path",
}


def _is_bool(v):
    return isinstance(v, bool)


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def parse_paci_section(section):
    """Validate the ``"paci"`` section (a dict, or ``None`` when absent) into a :class:`PACIConfig`."""
    if section is None:
        return PACIConfig()
    if not isinstance(section, dict):
        raise PACIConfigError(f'"paci" must be an object like {{"enabled": true}}, got {section!r}')
    unknown = sorted(set(section) - set(_KEYS))
    if unknown:
        allowed = ", ".join(f'"{k}"' for k in _KEYS)
        raise PACIConfigError(f'unknown key(s) {", ".join(repr(k) for k in unknown)} in "paci"; allowed keys: {allowed}')

    def bad(key, value):
        return PACIConfigError(f'"paci.{key}" = {value!r} is not allowed; use {_KEYS[key]}')

    kw = {}
    for key in ("enabled", "drain_every_batch", "trace"):
        if key in section:
            if not _is_bool(section[key]):
                raise bad(key, section[key])
            kw[key] = section[key]
    if "accumulation_window" in section:
        a = section["accumulation_window"]
        if a is not None and (not _is_int(a) or a < 1):
            raise bad("accumulation_window", a)
        kw["accumulation_window"] = a
    if "watchdog_seconds" in section:
        w = section["watchdog_seconds"]
        if not (_is_int(w) or isinstance(w, float)) or isinstance(w, bool) or w < 0:
            raise bad("watchdog_seconds", w)
        kw["watchdog_seconds"] = float(w)
    if "max_consecutive_skips" in section:
        n = section["max_consecutive_skips"]
        if not _is_int(n) or n < 0:
            raise bad("max_consecutive_skips", n)
        kw["max_consecutive_skips"] = n
    if "trace_dir" in section:
        d = section["trace_dir"]
        if d is not None and (not isinstance(d, str) or not d):
            raise bad("trace_dir", d)
        kw["trace_dir"] = d
    return PACIConfig(**kw)


def load_config(config=None, args=None):
    """Resolve a DeepSpeed config the way ``deepspeed.initialize`` does: a dict, a JSON path, or ``args.deepspeed_config``.

    Returns a deep copy (the caller's dict is never modified). A path that does not
    exist or does not parse raises :class:`PACIConfigError` naming the file.
    """
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    if config is not None and from_args is not None:
        raise PACIConfigError("a DeepSpeed config was given both as --deepspeed_config and as config=; pass only one")
    config = config if config is not None else from_args
    if config is None:
        raise PACIConfigError("no DeepSpeed config: pass config=<dict or path> or --deepspeed_config <path>")
    if isinstance(config, dict):
        return copy.deepcopy(config)
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if not os.path.isfile(path):
            raise PACIConfigError(f"DeepSpeed config file {path!r} does not exist; check the --deepspeed_config path")
        try:
            with open(path) as f:
                loaded = json.load(f)
        except json.JSONDecodeError as e:
            raise PACIConfigError(f"DeepSpeed config file {path!r} is not valid JSON ({e}); fix the file "
                                  f"(JSON allows no comments or trailing commas)") from None
        if not isinstance(loaded, dict):
            raise PACIConfigError(f"DeepSpeed config file {path!r} must hold a JSON object, got {type(loaded).__name__}")
        return loaded
    raise PACIConfigError(f"config must be a dict or a path to a JSON file, got {type(config).__name__}")


def _tied_keys_across_stages(model):
    """Names of TiedLayerSpec keys whose layers live on more than one pipeline stage."""
    from deepspeed.runtime.pipe.module import TiedLayerSpec
    stages_of = {}
    parts = model.parts
    for idx, spec in enumerate(model._layer_specs):
        if isinstance(spec, TiedLayerSpec):
            stage = next(s for s in range(model.num_stages) if parts[s] <= idx < parts[s + 1])
            stages_of.setdefault(spec.key, set()).add(stage)
    return sorted(k for k, st in stages_of.items() if len(st) > 1)


def validate_run(ds_config, model, paci):
    """Fail fast on every combination the PACI engine cannot honour; returns a copy of the config, unchanged.

    Runs identically on every rank (it reads only the config and the module's
    layer specs), so every rank raises the same error and none is left waiting.
    Called by ``ds_paci.initialize`` and again by ``PACIPipelineEngine.__init__``.
    Clipping defaults are the engine's business (see its docstring), not this function's.
    """
    from deepspeed.runtime.pipe.module import PipelineModule

    from . import compat
    compat.check_version()
    if not isinstance(model, PipelineModule):
        raise PACIConfigError(f'"paci.enabled" needs a deepspeed.pipe.PipelineModule, got {type(model).__name__}; '
                              'build the model as PipelineModule(layers=..., num_stages=...) or remove the "paci" section')
    zero = ds_config.get("zero_optimization", {}) or {}
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    if stage >= 2:
        raise PACIConfigError(f'"zero_optimization.stage" = {stage} cannot be used with "paci" (nor with any DeepSpeed '
                              'pipeline); use stage 0 or 1')
    fp16 = ds_config.get("fp16", {}) or {}
    if isinstance(fp16, dict) and fp16.get("enabled", False):
        raise PACIConfigError('"fp16.enabled" = true is not supported with "paci": dynamic loss scaling needs an overflow '
                              'check shared by all stages, which PACI removes; use "bf16": {"enabled": true} or fp32')
    reason = compat.refusal(ds_config)  # what the installed DeepSpeed version cannot do under PACI
    if reason:
        raise PACIConfigError(reason)
    tied = _tied_keys_across_stages(model)
    if tied:
        raise PACIConfigError(f"tied layers {tied} span several pipeline stages; keeping tied copies identical needs a "
                              "cross-stage gradient all-reduce, which PACI does not run (no tied-weight policy is "
                              "supported yet); untie them (e.g. a separate LM head) or place the tied layers on one stage")
    return copy.deepcopy(ds_config)


def engine_config(args, kwargs):
    """The raw DeepSpeed config dict a ``PipelineEngine(...)`` constructor call carries, or ``None`` if unknown.

    ``deepspeed.initialize`` passes ``config`` (dict or path) and the parsed ``config_class``;
    ``args.deepspeed_config`` is the legacy route.
    """
    config_class = kwargs.get("config_class")
    if config_class is not None and isinstance(getattr(config_class, "_param_dict", None), dict):
        return config_class._param_dict
    config = kwargs.get("config", kwargs.get("config_params"))
    cli = kwargs.get("args")
    try:
        return load_config(config, None if config is not None else cli)
    except PACIConfigError:
        return None
