"""The ``"paci"`` section of a DeepSpeed config: parsing, validation, clear errors.

Example (JSON)::

    "paci": {
        "enabled": true,
        "accumulation_window": 8,
        "lookahead": true,
        "drain_every_batch": false,
        "step_phase": "aligned",
        "watchdog_seconds": 300,
        "max_consecutive_skips": 5,
        "trace": false,
        "check_tied_copies": false,
        "overlap_reduce": true,
        "nonblocking_transfers": false,
        "slack_links": [],
        "sync_warmup_calls": "auto",
        "sync_warmup_loss_ratio": 0.9
    }

Keys (every one optional):

``enabled`` (bool, default true)
    Use the PACI engine. A ``"paci"`` section turns PACI on unless it says ``"enabled": false``;
    without the section, or with ``false``, ``ds_paci.initialize`` returns DeepSpeed's stock
    ``PipelineEngine`` (and says so in one line). A top-level key that differs from ``"paci"``
    only in case (``"PACI"``), or another paci-like key DeepSpeed would silently ignore
    (``"paci_config"``, ``"ds_paci"``), is refused (:func:`check_section_key`).
``accumulation_window`` (int >= 1 or ``"auto"``, default ``gradient_accumulation_steps``)
    ``a``: each stage takes its own optimizer step after every ``a`` of its backward
    passes. Drift is bounded by ``ceil((P-1-s)/a)``; ``a >= P-1`` keeps it at one
    version. Gradients are averaged over the window (the last stage scales the loss
    by ``1/a``). ``"auto"``: ``a = max(P-1, ceil(M/3))`` (:func:`auto_window`; per stage at ``M < P-1`` after
    a warm start, which ``"auto"`` turns on: ``sync_warmup_calls``): drift <= 1 on every stage.
    At most ``MAX_WINDOW_CALLS`` (64) x ``gradient_accumulation_steps``, i.e. every stage
    steps at least once every 64 ``train_batch`` calls (:func:`check_accumulation_window`);
    a larger window is refused, not warned about.
``lookahead`` (bool, default true)
    Window-informed look-ahead (:mod:`ds_paci.core.lookahead.predict`): a forward that will cross
    its stage's next local step runs on a prediction of the next weights (Adam/AdamW, SGD,
    Muon: :mod:`ds_paci.core.lookahead.rules`; gradient clipping included), which are
    restored right after it. Other optimizers run plain PACI (one log line says so).
``lookahead_restore`` (``"copy"`` or ``"recompute"``, default ``"copy"``)
    How fp32 weights stepped directly by the optimizer get back after a predicted forward: from a copy of the
    stage's weights held during that forward (exact; one fp32 copy while it runs), or by recomputing the same
    update and undoing it (no copy, about twice the prediction's time, exact only up to rounding). ``"recompute"``
    applies only to a stage without data-parallel replicas that owns no tied layers shared with another stage
    (elsewhere the stage copies; one log line). bf16 and ZeRO-1 restore exactly from their fp32 master weights.
``drain_every_batch`` (bool, default false)
    Sync mode: drain after every ``train_batch``. Reproduces the stock engine exactly.
``step_phase`` (``"aligned"`` or ``"diagonal"``; default :data:`DEFAULT_STEP_PHASE` in async mode, ``"aligned"``
    in sync mode and with tied layers on several stages, which refuse ``"diagonal"``)
    Where each stage's local steps fall (:mod:`ds_paci.core.program.stream`, "Step phase"). ``"aligned"``: every
    stage steps after its ``a``-th, ``2a``-th, ... backward pass; the stages' steps (and their data-parallel
    reduces) then run one after another along the gradient path. ``"diagonal"``: stage ``s`` steps after its
    ``c``-th backward pass with ``c = s (mod a)`` (a partial first window of ``s mod a`` micro-batches), so the
    steps of all stages run at the same time: across nodes the reduce costs about ``r / a`` per micro-batch instead
    of ``min(P, a) r / a``. Same drift bound; the partial first window is stepped as a closing drain steps one.
    A checkpoint saved with an open window resumes only under the phase it was saved with (one line says so);
    one whose windows are closed resumes under either.
``watchdog_seconds`` (0, or a finite number >= 1; default 300; 0 turns it off)
    A stage that waits longer than this inside one instruction prints where it is
    stuck (rank, stage, instruction, tick) and aborts, instead of hanging.
``max_consecutive_skips`` (int >= 0, default 5; 0 never stops)
    Async mode skips a local step whose gradient is not finite (see :mod:`ds_paci.core.step.guard`); after
    this many skips in a row at one stage, every rank stops with one line naming the stage and the step.
``trace`` (bool, default false)
    Record start and end time of every instruction (for timelines); the most recent
    million records are kept.
``trace_dir`` (path, default none)
    Where ``engine.write_trace()`` writes ``trace_rank<R>.jsonl`` when called without a path.
``check_tied_copies`` (bool, default false)
    With tied layers on several stages (see :mod:`ds_paci.core.tied.weights`): after every drain and
    after loading a checkpoint, the owning stages compare digests of their copies (weights and
    optimizer state) point to point and raise if any bit differs. A debugging aid (it hashes the
    tied parameters and their optimizer state at every drain); the tests turn it on.

``overlap_reduce`` (bool, default true)
    Async mode with data-parallel replicas: the window's last backward pass (``B7[dp]`` in the program)
    all-reduces the gradients in buckets as they become final (asynchronous, from post-accumulate-grad
    hooks), and the local step waits for them instead of reducing (:mod:`ds_paci.core.step.overlap`).
    Bit-identical to the reduce at the step with two replicas; with more, equal up to the order of each
    element's sum (fp32 rounding); replicas always identical. fp32 optimizers without ZeRO only: with
    ``BF16_Optimizer`` or ZeRO-1 the reduce stays at the step and one start-up line says so. ``false``:
    DeepSpeed's reduce at each local step.
``overlap_bucket_elements`` (int >= 1, default 4194304)
    Gradient elements per bucket of the overlapped reduce.
``nonblocking_transfers`` (bool, default false)
    Async mode: activations and gradients move with ``isend``/``irecv`` on a two-rank process group per link
    and direction, each send right after its forward or backward (the pass
    :func:`ds_paci.core.program.passes.hoist_sends`), each receive posted one micro-batch ahead, everything
    waited for at a drain (:mod:`ds_paci.core.engine.transfers`, whose docstring argues why the order cannot
    deadlock on NCCL). Sync mode keeps DeepSpeed's blocking transfers.
``slack_links`` (list of link ids, default ``[]``)
    Links that get one micro-batch of slack (:mod:`ds_paci.core.program.stream`, "Slack links"): link ``b`` joins
    stage ``b`` to stage ``b+1``; list the links between nodes (8 GPUs a node, a stage a GPU: ``[7, 15, ...]``).
    Stage ``s`` holds ``k_s`` (listed links at or after ``s``) more micro-batches in flight than 1F1B, so that with
    ``nonblocking_transfers`` a transfer over a listed link leaves the dependence chain (simulated: P = 16, M = 4P,
    100 Gb/s, 7.92 -> 7.36 ms per micro-batch, ``docs/results/scale.md``). Costs: stage 0 holds ``P + k_0``
    micro-batches' activations, drift bound ``ceil((P-1-s+k_s)/a)``, ``"auto"`` widens to ``P-1+k_0``. Async
    mode only, not with tied layers on several stages (refused at start-up, one line each).
``sync_warmup_calls`` (int >= 0 or ``"auto"``; default ``"auto"`` with ``"accumulation_window": "auto"``, else 0)
    A synchronous warm start: the first calls run on stock's schedule (window ``M``, a drain every call: nothing is
    predicted, each costs stock's bubble), then the configured streams (:mod:`ds_paci.core.engine.warm_start`).
    ``K``: the first ``K`` calls (``global_steps < K``). ``"auto"``: until the mean loss of the last 8 calls is
    below ``sync_warmup_loss_ratio`` x the labels' unigram entropy (:mod:`ds_paci.core.program.warm_end`), off
    the plateau where PACI from the first step often stayed (issue 30); integer labels (token ids) only, else it
    ends after one call (one line says so). Async mode only (in sync mode an explicit value is refused).
``sync_warmup_loss_ratio`` (number > 0, default 0.9)
    The ``"auto"`` warm start's end (above); refused with a count or without a warm start.

Everything that cannot be honoured fails in :func:`validate_run` with a message that names the key, the value
and what is allowed. ``ds_paci.initialize`` and ``PACIPipelineEngine.__init__`` both call it (the engine before
DeepSpeed builds its optimizer). The run-level checks are also pure functions of the config
(:func:`check_batch_keys`, :func:`check_zero_stage`, :func:`check_fp16`, :func:`check_accumulation_window`), so a
launcher can run them before any process group exists.
"""

import copy
import json
import math
import os
from dataclasses import dataclass
from typing import Optional

PACI_SECTION = "paci"

# A stage steps at least once every MAX_WINDOW_CALLS train_batch calls: a larger window is a
# mistake (no step at all for a long time, an LR schedule that never moves), refused up front.
MAX_WINDOW_CALLS = 64


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
    check_tied_copies: bool = False
    lookahead: bool = True
    lookahead_restore: str = "copy"
    overlap_reduce: bool = True
    overlap_bucket_elements: int = 1 << 22
    nonblocking_transfers: bool = False
    step_phase: Optional[str] = None  # None: DEFAULT_STEP_PHASE in async mode, "aligned" in sync mode
    slack_links: tuple = ()  # links b (stage b -> b+1) with one micro-batch of slack, sorted
    sync_warmup_calls: object = None  # int K or "auto" (engine.warm_start); None: the default, see __post_init__
    sync_warmup_loss_ratio: float = 0.9  # the "auto" warm start's end (program.warm_end)

    def __post_init__(self):
        if self.sync_warmup_calls is None:  # the default: "auto" goes with the "auto" window, in async mode
            auto = self.accumulation_window == AUTO and not self.drain_every_batch
            object.__setattr__(self, "sync_warmup_calls", AUTO if auto else 0)

    @property
    def warm_start(self) -> bool:
        """Whether the run starts synchronously (``sync_warmup_calls`` ``"auto"`` or ``K > 0``)."""
        return self.sync_warmup_calls == AUTO or self.sync_warmup_calls > 0

    def phase_rule(self, stock_step, tied=False):
        """The step phase a run uses: ``"aligned"`` in sync mode (``stock_step``) and where tied layers span stages
        (``tied``: the tied exchange's lag assumes it), else the key or the default."""
        return "aligned" if stock_step or tied else (self.step_phase or DEFAULT_STEP_PHASE)

    def window(self, gradient_accumulation_steps, stages=1, stage=None):
        """The accumulation window ``a`` of stage ``stage`` for ``M = gradient_accumulation_steps`` on ``stages``
        stages (``stage=None``: one window for every stage, see :func:`auto_window`)."""
        if self.accumulation_window == AUTO:
            return auto_window(stages, gradient_accumulation_steps, stage, extra=len(self.slack_links),
                               per_stage=self.warm_start)
        return self.accumulation_window or gradient_accumulation_steps


AUTO = "auto"
STEP_PHASES = ("aligned", "diagonal")  # ds_paci.core.program.stream.STEP_PHASES (config imports no program module)
#: The async step phase when the key is absent. "aligned" until the quality spot cells show "diagonal" holds
#: (docs/results/scale.md, "Coinciding local steps").
DEFAULT_STEP_PHASE = "aligned"


def auto_window(stages, micro_batches, stage=None, extra=0, per_stage=False):
    """``"accumulation_window": "auto"``: ``a = max(P-1, ceil(M/3))`` on every stage; one stage: ``M``. With
    ``per_stage`` (a run with a synchronous warm start, the default of ``"auto"``) and a ``stage``:
    ``a_s = max(min(M, P-1), P-1-s, ceil(M/3))``, which differs only where ``M < P-1`` (late stages step every
    ``M``): after a warm start it no longer sat on plateaus and kept stock's steps per sample at the lower learning
    rate, while without one it sat on plateaus in 8 of 20 runs and one window ``P-1`` in none
    (``docs/results/quality-candidates.md``). ``extra``: the slack links, which add as many micro-batches in flight
    at stage 0 (``P-1`` becomes ``P-1+extra``, so that the drift bound stays 1).

    Drift at stage ``s`` is ``ceil((P-1-s)/a)``: ``a >= P-1`` keeps it at most 1, the one version the look-ahead
    predicts. ``a = P-1`` trained as well as or better than every other window in the sweep's ``M = P`` and
    ``M = 2P`` cells; ``ceil(M/3)`` is a guard for ``M > 3(P-1)``, beyond the sweep, not evidence-based. Earlier
    rules (``max(M, P-1)`` before issue 19, the guard ``ceil(M/2)`` until 2026-12-01) and the evidence for each
    change: ``docs/results/quality.md``.
    """
    if stages <= 1:
        return max(micro_batches, 1)
    if per_stage and stage is not None:
        return max(min(micro_batches, stages - 1 + extra), stages - 1 - stage + extra, -(-micro_batches // 3), 1)
    return max(stages - 1 + extra, -(-micro_batches // 3), 1)


_KEYS = {
    "enabled": "true or false",
    "accumulation_window": "an integer >= 1 or \"auto\" (default: gradient_accumulation_steps)",
    "drain_every_batch": "true or false",
    "watchdog_seconds": "a finite number of seconds >= 0: 0 turns the watchdog off, any other value must be >= 1",
    "max_consecutive_skips": "an integer >= 0 (0: never stop on skipped non-finite steps)",
    "trace": "true or false",
    "trace_dir": "a directory path",
    "check_tied_copies": "true or false",
    "lookahead": "true or false",
    "lookahead_restore": "\"copy\" or \"recompute\"",
    "step_phase": "\"aligned\" or \"diagonal\"",
    "overlap_reduce": "true or false",
    "overlap_bucket_elements": "an integer >= 1",
    "nonblocking_transfers": "true or false",
    "slack_links": "a list of link ids b >= 0 (link b joins stage b to stage b+1), e.g. [7]",
    "sync_warmup_calls": "an integer >= 0 (train_batch calls run on the stock schedule before PACI's streams) or "
                         "\"auto\" (until the loss is off the unigram plateau)",
    "sync_warmup_loss_ratio": "a number > 0 (the \"auto\" warm start ends once the loss is below it x the labels' "
                              "unigram entropy), e.g. 0.9",
}


def _is_bool(v):
    return isinstance(v, bool)


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def parse_paci_section(section):
    """Validate the ``"paci"`` section (a dict, or ``None`` when absent) into a :class:`PACIConfig`.

    A section turns PACI on unless it says ``"enabled": false``; no section: off."""
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

    kw = {"enabled": True}
    for key in ("enabled", "drain_every_batch", "trace", "check_tied_copies", "lookahead",
                "overlap_reduce", "nonblocking_transfers"):
        if key in section:
            if not _is_bool(section[key]):
                raise bad(key, section[key])
            kw[key] = section[key]
    if "accumulation_window" in section:
        a = section["accumulation_window"]
        if a is not None and a != AUTO and (not _is_int(a) or a < 1):
            raise bad("accumulation_window", a)
        kw["accumulation_window"] = a
    if "watchdog_seconds" in section:
        w = section["watchdog_seconds"]
        if (not (_is_int(w) or isinstance(w, float)) or isinstance(w, bool) or not math.isfinite(w) or w < 0
                or 0 < w < 1):
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
    if "lookahead_restore" in section:
        r = section["lookahead_restore"]
        if r not in ("copy", "recompute"):
            raise bad("lookahead_restore", r)
        kw["lookahead_restore"] = r
    if "step_phase" in section:
        phase = section["step_phase"]
        if phase is not None and phase not in STEP_PHASES:
            raise bad("step_phase", phase)
        kw["step_phase"] = phase
    if "slack_links" in section:
        links = section["slack_links"]
        if not isinstance(links, list) or not all(_is_int(b) and b >= 0 for b in links):
            raise bad("slack_links", links)
        kw["slack_links"] = tuple(sorted(set(links)))
    for key, low in (("overlap_bucket_elements", 1), ("sync_warmup_calls", 0)):
        if key in section:
            n = section[key]
            if (not _is_int(n) or n < low) and not (key == "sync_warmup_calls" and n == AUTO):
                raise bad(key, n)
            kw[key] = n
    if "sync_warmup_loss_ratio" in section:
        r = section["sync_warmup_loss_ratio"]
        if not (_is_int(r) or isinstance(r, float)) or not math.isfinite(r) or r <= 0:
            raise bad("sync_warmup_loss_ratio", r)
        kw["sync_warmup_loss_ratio"] = float(r)
    out = PACIConfig(**kw)
    if "sync_warmup_loss_ratio" in section and out.sync_warmup_calls != AUTO:
        raise PACIConfigError(f'"paci.sync_warmup_loss_ratio" applies only to "sync_warmup_calls": "auto" (this run\'s '
                              f'warm start: {out.sync_warmup_calls!r}); remove it or set "sync_warmup_calls": "auto"')
    return out


def check_section_key(ds_config):
    """Refuse a top-level key that looks meant for ``"paci"`` but is not it (DeepSpeed would ignore it, and the run
    would silently be stock): any key other than ``"paci"`` whose lower case contains ``paci``. Pure (config only)."""
    for key in ds_config:
        if isinstance(key, str) and key != PACI_SECTION and PACI_SECTION in key.lower():
            raise PACIConfigError(f'the DeepSpeed config has a top-level key {key!r}, which neither DeepSpeed nor ds_paci '
                                  f'reads; rename it to "paci" (lower case) to configure PACI, or remove it')


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


def check_batch_keys(ds_config):
    """The batch keys that are set must be integers >= 1; the message names the key. Pure (config only)."""
    keys = {
        "train_micro_batch_size_per_gpu": "samples per micro-batch",
        "gradient_accumulation_steps": "micro-batches per train_batch call",
        "train_batch_size": "micro-batch x gradient_accumulation_steps x data-parallel size",
    }
    for key, meaning in keys.items():
        if key in ds_config:
            v = ds_config[key]
            if not _is_int(v) or v < 1:
                raise PACIConfigError(f'"{key}" = {v!r} in the DeepSpeed config is not allowed; use an integer >= 1 '
                                      f'({meaning})')


def check_zero_stage(ds_config):
    """Refuse ZeRO stage 2 or 3: no DeepSpeed pipeline engine supports them. Pure (config only)."""
    zero = ds_config.get("zero_optimization", {}) or {}
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    if isinstance(stage, (int, float)) and not isinstance(stage, bool) and stage >= 2:
        raise PACIConfigError(f'"zero_optimization.stage" = {stage} cannot be used with "paci" (nor with any DeepSpeed '
                              'pipeline); use stage 0 or 1')


def check_fp16(ds_config):
    """Refuse fp16 with PACI (dynamic loss scaling needs a cross-stage overflow check). Pure (config only)."""
    fp16 = ds_config.get("fp16", {}) or {}
    if isinstance(fp16, dict) and fp16.get("enabled", False):
        raise PACIConfigError('"fp16.enabled" = true is not supported with "paci": dynamic loss scaling needs an overflow '
                              'check shared by all stages, which PACI removes; use "bf16": {"enabled": true} or fp32')


def check_accumulation_window(window, gradient_accumulation_steps):
    """Refuse ``window > MAX_WINDOW_CALLS * gradient_accumulation_steps``. Pure; ``window=None`` means the default.

    Called wherever both numbers are known (:func:`validate_run` when the config sets
    ``gradient_accumulation_steps``, the engine otherwise, and launchers before start-up).
    """
    if window is None or window == AUTO or not _is_int(gradient_accumulation_steps) or gradient_accumulation_steps < 1:
        return
    limit = MAX_WINDOW_CALLS * gradient_accumulation_steps
    if window > limit:
        raise PACIConfigError(f'"paci.accumulation_window" = {window} is more than {MAX_WINDOW_CALLS} x '
                              f'gradient_accumulation_steps ({gradient_accumulation_steps}) = {limit}: a stage would '
                              f'step only once every {window / gradient_accumulation_steps:,.0f} train_batch calls; '
                              f'use at most {limit} (for a larger effective batch raise gradient_accumulation_steps)')


def check_step_phase(paci, gradient_accumulation_steps):
    """Refuse ``"step_phase": "diagonal"`` (and ``sync_warmup_calls``) in sync mode (``drain_every_batch`` with the
    window ``M``: the stock engine's step at the end of every call, which has no phase and needs no warm start). Pure."""
    window = paci.accumulation_window
    stock = paci.drain_every_batch and (window is None or window == gradient_accumulation_steps)
    if stock and paci.warm_start:  # (an "auto" window resolves later; stock then ignores the key, said at start-up)
        raise PACIConfigError(f'"paci.sync_warmup_calls" = {paci.sync_warmup_calls} has no effect in sync mode '
                              '("drain_every_batch": true with the window M runs the stock schedule throughout); '
                              'remove "sync_warmup_calls" or "drain_every_batch"')
    if paci.step_phase != "diagonal" or not paci.drain_every_batch:
        return
    if stock:
        raise PACIConfigError('"paci.step_phase" = "diagonal" is not allowed with "drain_every_batch": true and the '
                              'window M (sync mode is the stock engine: every stage steps at the end of the call); '
                              'remove "step_phase" or "drain_every_batch"')


def check_config(ds_config, paci=None):
    """Every check of a DeepSpeed config that needs no model and no process group; returns the ``PACIConfig``.

    The section's top-level key (:func:`check_section_key`), the ``"paci"`` section (``paci``, when already parsed,
    is not parsed again), the batch keys, ZeRO's stage, and
    with PACI enabled fp16, the accumulation window against ``gradient_accumulation_steps`` and what the installed
    DeepSpeed cannot run under PACI (``compat.refusal``). One place for these checks: :func:`validate_run` (so
    ``ds_paci.initialize`` and the engine) and the main job before any process starts (``mainjob.inputs``) call it.
    Raises :class:`PACIConfigError` with one line naming the key and the fix.
    """
    from .seam import compat
    check_section_key(ds_config)
    paci = parse_paci_section(ds_config.get("paci")) if paci is None else paci
    check_batch_keys(ds_config)
    check_zero_stage(ds_config)
    if paci.enabled:
        check_fp16(ds_config)
        check_accumulation_window(paci.accumulation_window, ds_config.get("gradient_accumulation_steps"))
        check_step_phase(paci, ds_config.get("gradient_accumulation_steps"))
        reason = compat.refusal(ds_config)  # what the installed DeepSpeed version cannot do under PACI
        if reason:
            raise PACIConfigError(reason)
    return paci


def validate_run(ds_config, model, paci):
    """Fail fast on every combination the PACI engine cannot honour; returns a copy of the config, unchanged.

    Runs identically on every rank (it reads only the config and the module's
    layer specs), so every rank raises the same error and none is left waiting.
    Called by ``ds_paci.initialize`` and again by ``PACIPipelineEngine.__init__``: :func:`check_config`, then what
    needs the model. Clipping defaults are the engine's business (see its docstring), not this function's.
    """
    from deepspeed.runtime.pipe.module import PipelineModule

    from .seam import compat
    compat.check_version()
    if not isinstance(model, PipelineModule):
        raise PACIConfigError(f'"paci.enabled" needs a deepspeed.pipe.PipelineModule, got {type(model).__name__}; '
                              'build the model as PipelineModule(layers=..., num_stages=...) or remove the "paci" section')
    check_config(ds_config, paci)
    from .model_checks import model_parallel_problem, slack_links_problem
    for problem in (model_parallel_problem(ds_config, model), slack_links_problem(paci, model)):
        if problem:
            raise PACIConfigError(problem)
    if not paci.drain_every_batch:
        from .tied.layout import tied_arrangement_problem
        tied = tied_arrangement_problem(ds_config, model)
        if tied:
            raise PACIConfigError(tied)
        if paci.step_phase == "diagonal":
            from .tied.layout import tied_owner_stages
            owners = tied_owner_stages(model)
            if owners:
                raise PACIConfigError(f'"paci.step_phase" = "diagonal" is not allowed with tied layers {sorted(owners)} '
                                      'on several stages (their exchange lag assumes aligned steps); remove '
                                      '"step_phase" or use "aligned"')
    return copy.deepcopy(ds_config)


def engine_config(args, kwargs):
    """The raw DeepSpeed config dict a ``PipelineEngine(...)`` constructor call carries, or ``None`` if unknown.

    ``deepspeed.initialize`` passes ``config`` (dict or path) and the parsed ``config_class``;
    ``args.deepspeed_config`` is the legacy route.
    """
    from .seam import deepspeed_internals  # imports DeepSpeed: not at module level (launchers check configs without it)
    config_class = kwargs.get("config_class")
    raw = None if config_class is None else deepspeed_internals.config_class_param_dict(config_class)
    if raw is not None:
        return raw
    config = kwargs.get("config", kwargs.get("config_params"))
    cli = kwargs.get("args")
    try:
        return load_config(config, None if config is not None else cli)
    except PACIConfigError:
        return None
