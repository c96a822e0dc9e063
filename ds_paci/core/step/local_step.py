"""Stage-local optimizer steps: everything a local step needs besides the engine's loop.

Two problems are solved here:

1. **No cross-stage collective.** DeepSpeed computes gradient norms and overflow
   flags over its "model parallel" group, which in a pipeline grid spans every
   stage of a replica. :class:`StageLocalMPU` is a view of the grid in which the
   model-parallel group is the stage's own tensor-parallel slice (a single rank
   when TP = 1) and the pipeline has one stage, so norms, clipping and overflow
   checks stay on the stage. It is handed to the optimizer wrappers only; the
   engine keeps the real grid (checkpoint file names depend on it).

2. **Backward through the current weights on stock PyTorch.** A micro-batch whose
   backward runs after a local step must use the updated weights (PACI's
   semantics), but a ``torch.optim`` step updates parameters in place and bumps
   autograd's version counter, so the pending backward would raise "modified by an
   inplace operation". :class:`ParamAliases` lets the optimizer step on aliases
   made with ``param.data``: they share storage with the parameters (so the update
   is visible to everyone) but not the version counter. DeepSpeed's BF16 and ZeRO-1
   wrappers already write parameters through ``.data`` and need no alias.

Besides, the async local step owns its **policies** (sync mode leaves all of them to DeepSpeed, so that it
is the stock engine exactly):

3. **The non-finite guard** (:func:`guarded_step`): the stage's gradient norm is computed once per local
   step (after the data-parallel reduce: every replica holds the same gradients, so every replica reaches
   the same verdict; ZeRO-1 and BF16 wrappers compute it themselves over their data-parallel partitions
   with the stage-local MPU). A non-finite norm skips the step: nothing is applied, gradients are zeroed,
   ``was_step_applied()`` is False, and the LR scheduler still follows the stream's rule, so that every
   stage's learning rate stays a function of the micro-batches it has consumed (stages skip
   independently; DeepSpeed does not step the scheduler on an overflow, which is right only when all
   stages skip together). The norm is what ``get_global_grad_norm()`` returns: the stage's own, never
   across stages.
5. **Counters and the scheduler** (:func:`held_counters`): DeepSpeed's ``_take_model_step`` steps the LR
   scheduler once and adds one to ``global_steps`` (and ``train_batch_size`` to ``global_samples``) per
   optimizer step. An async local step is not a ``train_batch`` call: the engine counts calls itself (as
   the stock engine's one step per call does), and steps the scheduler ``lr_steps`` times (the ``STEP`` action's fact)
   (:func:`step_lr`; :mod:`ds_paci.core.program.stream` states the rule).
4. **Clipping** (:func:`clipping_policy`): ``gradient_clipping`` > 0 clips by that stage-local norm. When
   the config does not set ``gradient_clipping`` (DeepSpeed's default, 1.0 from 0.19.3, clips by a norm over
   all stages, a cross-stage collective), async PACI does not clip.

DeepSpeed internals used here (``_take_model_step``'s bookkeeping, the wrappers' ``mpu`` / ``model_parallel_*`` /
``clip_grad`` / ``overflow``, ``_global_grad_norm``, the raw config) are reached through
:mod:`ds_paci.core.seam.deepspeed_internals`, the list to re-check for a new DeepSpeed version.
"""

import contextlib
import math

import torch
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from ..seam import compat
from ..seam import deepspeed_internals as ds


class StageLocalMPU:
    """A pipeline grid whose model-parallel and pipeline groups are confined to one stage.

    Every other query (data-parallel group and rank, slice group, ...) goes to the grid.
    """

    def __init__(self, grid):
        self._grid = grid

    def __getattr__(self, name):
        return getattr(self._grid, name)

    def get_model_parallel_group(self):
        return self._grid.get_slice_parallel_group()

    def get_model_parallel_rank(self):
        return self._grid.get_slice_parallel_rank()

    def get_model_parallel_world_size(self):
        return self._grid.get_slice_parallel_world_size()

    def get_pipe_parallel_world_size(self):
        return 1

    def get_pipe_parallel_rank(self):
        return 0


class ParamAliases:
    """Point a ``torch.optim`` optimizer at ``.data`` aliases of its parameters.

    Call :meth:`bind_grads` right before ``optimizer.step()`` and :meth:`release_grads`
    right after. Optimizer state stays keyed by position, so ``state_dict()`` and
    ``load_state_dict()`` are unchanged.
    """

    def __init__(self, optimizer):
        self.pairs = []
        for group in optimizer.param_groups:
            aliases = []
            for p in group["params"]:
                alias = p.data
                self.pairs.append((p, alias))
                aliases.append(alias)
            group["params"] = aliases
        # Optimizer state created before aliasing (e.g. a resumed client optimizer) follows its parameter.
        for p, alias in self.pairs:
            if p in optimizer.state:
                optimizer.state[alias] = optimizer.state.pop(p)

    def bind_grads(self):
        for p, alias in self.pairs:
            alias.grad = p.grad

    def release_grads(self):
        for _, alias in self.pairs:
            alias.grad = None


def make_stage_local(engine, confine=True):
    """Confine the engine's optimizer to its stage; returns a :class:`ParamAliases` or ``None``.

    ``confine=False`` (sync mode) leaves DeepSpeed's wrappers on the pipeline's model-parallel group, as
    the stock engine has them. Raises ``TypeError`` for an optimizer wrapper whose step we cannot confine.
    """
    mpu = StageLocalMPU(engine.grid)
    opt = engine.optimizer
    if opt is None:
        raise TypeError("PACI needs an optimizer: pass optimizer= to initialize or add an \"optimizer\" section")
    if isinstance(opt, BF16_Optimizer):
        if confine:
            ds.set_wrapper_mpu(opt, mpu)
        return None
    if isinstance(opt, DeepSpeedZeroOptimizer):
        if confine:
            ds.set_zero_model_parallel(opt, mpu.get_model_parallel_group(), mpu.get_model_parallel_world_size(),
                                       mpu.get_model_parallel_rank())
        return None
    if isinstance(opt, torch.optim.Optimizer):
        return ParamAliases(opt)
    raise TypeError(f"optimizer wrapper {type(opt).__name__} is not supported by PACI; use fp32 or bf16 with "
                    "ZeRO stage 0 or 1 and a torch.optim optimizer or DeepSpeed's configured one")


def is_wrapped(optimizer):
    """True for DeepSpeed's BF16 and ZeRO-1 wrappers, which compute their own norm and skip on overflow."""
    return isinstance(optimizer, (BF16_Optimizer, DeepSpeedZeroOptimizer))


def clipping_policy(engine, stock):
    """Settle ``gradient_clipping`` for the run; returns the phrase the start-up log line uses.

    ``stock`` (sync mode): DeepSpeed's own behaviour, its default when the key is absent
    (``compat.DS_DEFAULT_CLIPPING``: 1.0 from 0.19.3, 0 before), norm over the whole pipeline. Otherwise an
    absent key means no clipping (set on the engine and on the wrappers, which DeepSpeed built with the
    default), and a set value clips by the stage's own norm.
    Call again after loading a checkpoint (wrappers restore their saved clip value).
    """
    explicit = "gradient_clipping" in ds.param_dict(engine)
    if stock:
        return f"{engine.gradient_clipping()} over the whole pipeline, as DeepSpeed's engine (sync mode)"
    if not explicit:
        ds.set_config_gradient_clipping(engine, 0.0)
    clip = engine.gradient_clipping()
    if is_wrapped(engine.optimizer):
        ds.set_clip_grad(engine.optimizer, clip)
    if not explicit and compat.DS_DEFAULT_CLIPPING > 0:
        return (f"none: the config sets no \"gradient_clipping\" (DeepSpeed's default {compat.DS_DEFAULT_CLIPPING} "
                "clips by a norm over all stages, a cross-stage collective PACI does not run); set it to clip by "
                "each stage's own norm")
    if not explicit:
        return "none (no \"gradient_clipping\" in the config; this deepspeed does not clip by default either)"
    return f"{clip} by each stage's own gradient norm" if clip > 0 else "none (\"gradient_clipping\": 0)"


def stage_grad_norm(parameters):
    """2-norm of the gradients of ``parameters`` (float32, on their device).

    A tied owner's tied gradients are zero here: they are clipped and checked apart (:mod:`ds_paci.core.tied.weights`).
    """
    norms = [torch.linalg.vector_norm(p.grad.detach().float()) for p in parameters if p.grad is not None]
    if not norms:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack(norms))


def clip_by_norm(parameters, max_norm, norm):
    """Scale gradients by ``max_norm / (norm + 1e-6)`` when that is below 1 (DeepSpeed's formula)."""
    coef = float(max_norm) / (float(norm) + 1e-6)
    if coef < 1.0:
        for p in parameters:
            if p.grad is not None:
                p.grad.detach().mul_(coef)


def step_lr(engine, times=1):
    """Advance the LR scheduler ``times`` times, each the way DeepSpeed's ``_take_model_step`` does."""
    if engine.lr_scheduler is None:
        return
    for _ in range(times):
        try:
            engine.lr_scheduler.step()
        except TypeError:
            engine.lr_scheduler.step(engine.train_batch_size())


@contextlib.contextmanager
def held_counters(engine):
    """Around DeepSpeed's optimizer step in an async local step: no scheduler step, counters unchanged after it.

    Inside, DeepSpeed's bookkeeping runs as in the stock engine's step of the current call (its progress
    line and its ``Train/Samples/lr`` event at the call's ``global_samples``); afterwards ``global_steps``
    and ``global_samples`` are what they were, since the engine advances them per ``train_batch`` call.
    """
    scheduler, steps, samples = engine.lr_scheduler, engine.global_steps, engine.global_samples
    engine.lr_scheduler = None
    try:
        yield
    finally:
        engine.lr_scheduler = scheduler
        engine.global_steps, engine.global_samples = steps, samples


@contextlib.contextmanager
def held_clipping(engine):
    """DeepSpeed's step with its own clipping off (an unwrapped optimizer: :func:`guarded_step` has clipped by the
    stage's norm already; DeepSpeed's ``clip_fp32_gradients`` would clip by a norm over its model-parallel group)."""
    clip = engine.gradient_clipping()
    ds.set_config_gradient_clipping(engine, 0.0)
    try:
        yield
    finally:
        ds.set_config_gradient_clipping(engine, clip)


def skip_step(engine):
    """Skip an optimizer step: nothing applied, gradients zeroed, counted in ``skipped_steps``."""
    if is_wrapped(engine.optimizer):
        compat.discard_wrapper_gradients(engine.optimizer)
    else:
        engine.zero_grad()
    ds.set_step_applied(engine, False)
    engine.skipped_steps += 1


def guarded_step(engine, before_skip=None):
    """The async local step's optimizer part, with the non-finite guard; returns True if the step was applied.

    Call after the data-parallel reduce. Leaves the stage's norm as the engine's ``get_global_grad_norm()``. Steps neither
    the LR scheduler nor the counters (the caller does: :func:`held_counters`). ``before_skip``: called when the
    step is skipped (a tied owner still updates its tied weights there: :mod:`ds_paci.core.tied.optimizer`).
    """
    opt = engine.optimizer
    if is_wrapped(opt):
        if not compat.wrapper_gradients_finite(opt):  # DeepSpeed < 0.19.8 would apply it: skip here
            if before_skip is not None:
                before_skip()
            skip_step(engine)
            ds.set_global_grad_norm(engine, float("inf"))
            return False
        with held_counters(engine):
            ds.exec_optimizer_step(engine)  # the wrapper checks its (stage-local) norm and skips on overflow
        applied = not ds.overflow(opt)
        if not applied and before_skip is not None:
            before_skip()
        return applied
    norm = stage_grad_norm(engine.module.parameters())
    value = float(norm)
    if not math.isfinite(value):
        if before_skip is not None:
            before_skip()
        skip_step(engine)
        ds.set_global_grad_norm(engine, value)
        return False
    clip = engine.gradient_clipping()
    if clip > 0:
        clip_by_norm(engine.module.parameters(), clip, value)  # by the stage's own norm, DeepSpeed's formula
    with held_counters(engine), held_clipping(engine):
        ds.exec_optimizer_step(engine)  # DeepSpeed's step, without its clip over the whole pipeline
    ds.set_global_grad_norm(engine, value)
    return True
