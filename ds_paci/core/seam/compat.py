"""Everything in ds_paci that depends on the installed DeepSpeed version.

Supported: ``deepspeed >= 0.16.0, <= 0.19.8`` (:data:`SUPPORTED`, declared in ``setup.py``; the versions
actually tested are listed in ``docs/deepspeed-versions.md``). Each difference below is detected from DeepSpeed's
own code (a method or constant being there), not from the version number, so a patched or in-between release
gets the behaviour it actually has. The versions named are those whose source was read.

1. **Who scales the last stage's loss by 1/M** (``M = gradient_accumulation_steps``).
   Before 0.18.3 (0.16.0, 0.16.9, 0.17.0, 0.17.6, 0.18.0) nobody: ``DeepSpeedEngine._backward_prologue``
   divides the loss by ``M`` only when ``enable_backward_allreduce`` is on, and ``PipelineEngine`` turns it
   off, so the stock pipeline's gradient is the *sum* over the ``M`` micro-batches. From 0.18.3 on,
   ``DeepSpeedEngine.forward`` registers a backward hook on the module's outputs
   (``_backward_prologue_per_tensor``) that divides their gradient by ``M``: the *mean*.
   PACI's contract is the mean over the accumulation window of ``a`` micro-batches on every version
   (:func:`last_stage_loss_factor`); sync mode with ``a = M`` leaves the stock engine's scaling alone,
   so on < 0.18.3 it sums, as the stock engine of that version does.
2. **Non-last stages divide again** (0.18.3 to 0.19.2): that hook also fires on the outputs of the other
   stages, so each stage boundary divides the gradient by ``M`` once more (stage ``s`` of ``P`` gets
   ``1/M**(P-s)``). 0.19.3 added ``PipelineEngine._backward_prologue_per_tensor``, which scales on the
   last stage only. On the versions without it, async PACI installs the same rule on its engine
   (:func:`adapt_engine`); sync mode keeps the stock engine's behaviour of that version.
3. **bf16 gets the wrong wrapper** (0.17.6, 0.18.0, 0.18.3; not 0.16.x, 0.17.0, >= 0.18.9):
   ``constants.DDP_BFLOAT16`` equals ``BFLOAT16`` (``"bf16"``), so ``_configure_optimizer`` matches the
   ``[FP16, DDP_BFLOAT16]`` branch first and a bf16 pipeline gets ``FP16_UnfusedOptimizer`` (bf16) instead
   of ``BF16_Optimizer``, with or without ZeRO-1. Its norm and overflow check span every stage and PACI
   cannot confine them: :func:`refusal` refuses bf16 on these versions (one line naming the fix).
4. **Non-finite gradients in DeepSpeed's wrappers** (before 0.19.8): ``BF16_Optimizer`` and the ZeRO-1
   ``DeepSpeedZeroOptimizer`` (fp32/bf16) do not skip a step whose gradient is not finite: BF16 masks the
   norm to -1 and fails ``assert all_groups_norm > 0``; ZeRO-1 checks overflow only in fp16 and applies the
   step. 0.19.8 (``deepspeed.runtime.utils.is_invalid_grad_norm``) makes both skip and set ``overflow``.
   On older versions PACI's async guard asks the wrapper before its step, with the wrapper's own tensors
   and groups (:func:`wrapper_gradients_finite`), and skips the step itself; sync mode is left alone.
   ``BF16_Optimizer.zero_grad`` exists only after 0.16.0: :func:`discard_wrapper_gradients` clears its
   low- and high-precision gradients directly.
5. **Default ``gradient_clipping``** (:data:`DS_DEFAULT_CLIPPING`): 0 (no clipping) before 0.19.3, 1.0 from
   0.19.3 on. Sync mode is the stock engine either way; async PACI never applies the default (a global
   norm crosses stages) and says so in its start-up line only where the default clips.

6. **ZeRO-1's flat-buffer layout** (:func:`zero_lookahead_problem`): the look-ahead predicts this rank's
   partition of ZeRO-1's flat buffer from per-parameter offsets (``round_robin_bit16_offsets``) and the
   unreduced gradients (``get_gradient_for_reduction``); DeepSpeed 0.16.0 keeps neither, so there ZeRO-1 runs
   without the look-ahead (one log line), as for any optimizer it cannot predict.

Not worked around (the stock engine fails the same way): DeepSpeed 0.18.9 builds ZeRO-1's flat parameter
buffer without ``detach()``, so with data parallelism its step's ``all_gather`` into views of that buffer
raises under torch 2.13 ("Output 0 of Split is a view and is being modified inplace"); 0.19.0 detaches it.
"""

from packaging.version import Version

import deepspeed
from deepspeed.runtime import constants as _ds_constants
from deepspeed.runtime import utils as _ds_utils
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from deepspeed.utils import logger

from . import deepspeed_internals as ds

SUPPORTED = (Version("0.16.0"), Version("0.19.8"))  # inclusive; setup.py says the same
DS_VERSION = Version(deepspeed.__version__)

# 1. DeepSpeed divides the output gradient by M (>= 0.18.3).
DS_SCALES_BY_GAS = ds.engine_scales_output_gradients()
# 2. ... and on every stage, not only the last (0.18.3 .. 0.19.2).
DS_SCALES_EVERY_STAGE = DS_SCALES_BY_GAS and not ds.pipeline_engine_scales_last_stage_only()
# 3. bf16 pipelines get FP16_UnfusedOptimizer (DDP_BFLOAT16 == BFLOAT16).
DS_BF16_GETS_UNFUSED = getattr(_ds_constants, "DDP_BFLOAT16", None) == _ds_constants.BFLOAT16

# 4. BF16 and ZeRO-1 wrappers skip a non-finite step themselves (>= 0.19.8).
DS_WRAPPERS_SKIP_NONFINITE = hasattr(_ds_utils, "is_invalid_grad_norm")
# 5. DeepSpeed's gradient_clipping when the config has no such key (0.0 before 0.19.3, 1.0 from 0.19.3).
DS_DEFAULT_CLIPPING = float(_ds_constants.GRADIENT_CLIPPING_DEFAULT)


def describe():
    """One line for logs and error messages: the DeepSpeed version and the differences that apply to it."""
    notes = []
    if not DS_SCALES_BY_GAS:
        notes.append("stock pipeline sums micro-batch gradients")
    if DS_SCALES_EVERY_STAGE:
        notes.append("stock pipeline rescales at every stage (PACI async corrects it)")
    if DS_BF16_GETS_UNFUSED:
        notes.append("bf16 refused (FP16_UnfusedOptimizer)")
    if not DS_WRAPPERS_SKIP_NONFINITE:
        notes.append("PACI checks BF16/ZeRO-1 gradients for non-finite values")
    return f"deepspeed {deepspeed.__version__}" + (f" ({'; '.join(notes)})" if notes else "")


def check_version():
    """Refuse a DeepSpeed older than :data:`SUPPORTED` (``RuntimeError``, one line with the fix); warn once for a
    newer, untested one (its pipeline internals may have moved: re-check the list in this module)."""
    global _warned
    low, high = SUPPORTED
    installed = Version(DS_VERSION.base_version)
    if installed < low:
        raise RuntimeError(f"ds_paci supports deepspeed {low} to {high}, but {deepspeed.__version__} is installed; "
                           f"install one in that range (pip install 'deepspeed>={low},<={high}')")
    if installed > high and not _warned:
        _warned = True
        logger.warning(f"ds_paci: deepspeed {deepspeed.__version__} is newer than the newest version ds_paci was "
                       f"tested with ({high}); run its engine tests before relying on it")


_warned = False


def refusal(ds_config):
    """The reason the installed DeepSpeed cannot run ``ds_config`` under PACI, or ``None``."""
    bf16 = ds_config.get("bf16", ds_config.get("bfloat16")) or {}
    if DS_BF16_GETS_UNFUSED and isinstance(bf16, dict) and bf16.get("enabled", False):
        return (f'"bf16.enabled" = true cannot be used with "paci" on deepspeed {deepspeed.__version__}: this version '
                "builds FP16_UnfusedOptimizer instead of BF16_Optimizer for bf16 (its DDP_BFLOAT16 constant equals "
                "BFLOAT16), whose norm and overflow check span every stage; use deepspeed 0.16.x, 0.17.0 or >= 0.18.9, "
                "or fp32")
    return None


def last_stage_loss_factor(micro_batches, window):
    """Factor for the last stage's loss so that a local step's gradient is the mean over ``window`` micro-batches."""
    if DS_SCALES_BY_GAS:
        return micro_batches / window  # DeepSpeed divides by M
    return 1.0 / window


def adapt_engine(engine, stock):
    """Per-engine adjustments; call once from ``PACIPipelineEngine.__init__``.

    ``stock`` (sync mode with ``a = M``): keep the stock engine's behaviour of this version. Otherwise, on
    0.18.3 .. 0.19.2, scale output gradients on the last stage only, as DeepSpeed does from 0.19.3 on.
    """
    if stock or not DS_SCALES_EVERY_STAGE:
        return
    ds_scale = ds.backward_prologue_per_tensor(engine)  # DeepSpeedEngine's bound method

    def last_stage_only(grad):
        return ds_scale(grad) if engine.is_last_stage() else grad

    ds.set_backward_prologue_per_tensor(engine, last_stage_only)


def wrapper_gradients_finite(optimizer):
    """Before a ``BF16_Optimizer``/ZeRO-1 step: ``False`` if its gradients are not finite and this DeepSpeed
    version would apply them anyway (item 4), ``True`` otherwise (including when the wrapper checks itself).

    Uses the wrapper's own tensors and groups (stage-local once confined), so every data-parallel replica
    of the stage reaches the same verdict.
    """
    if DS_WRAPPERS_SKIP_NONFINITE:
        return True
    if isinstance(optimizer, BF16_Optimizer):
        grads = ds.grads_for_norm(optimizer)
        if not grads:
            return True
        norm = float(_ds_utils.get_global_norm_of_tensors(input_tensors=grads, mpu=ds.wrapper_mpu(optimizer),
                                                           norm_type=ds.norm_type(optimizer)))
        return norm >= 0.0 and norm == norm and norm != float("inf")  # DeepSpeed masks inf/NaN as -1
    if isinstance(optimizer, DeepSpeedZeroOptimizer):
        return not ds.zero_has_overflow(optimizer)  # max over its DP and (confined) MP groups
    return True


def discard_wrapper_gradients(optimizer):
    """Drop a wrapper's accumulated gradients, as its own overflow branch does, for a step PACI skips."""
    if isinstance(optimizer, BF16_Optimizer):
        ds.clear_wrapper_gradients(optimizer)
        return
    optimizer.zero_grad()
    if isinstance(optimizer, DeepSpeedZeroOptimizer) and not ds.zero_cpu_offload(optimizer):
        ds.discard_zero_averaged_gradients(optimizer)


def zero_lookahead_problem(optimizer):
    """Why the look-ahead cannot predict this ZeRO-1 optimizer's partition on this DeepSpeed, or ``None`` (item 6)."""
    if ds.has_flat_offsets(optimizer):
        return None
    return f"ZeRO-1 on DeepSpeed {DS_VERSION} (no per-parameter offsets into its flat buffer)"
