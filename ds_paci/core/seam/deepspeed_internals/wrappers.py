"""The seam's optimizer-wrapper half: the fields of DeepSpeed's ``BF16_Optimizer`` and ZeRO-1
``DeepSpeedZeroOptimizer`` (the list to re-check is :mod:`ds_paci.core.seam.deepspeed_internals`)."""

__all__ = [
    "set_wrapper_mpu", "wrapper_mpu", "set_zero_model_parallel", "clip_grad", "set_clip_grad", "overflow",
    "bf16_groups", "bf16_partitioned_groups", "fp32_flat_partitions", "fp32_gradients", "fp32_gradients_flat",
    "fp32_gradient_flat_partitions", "fp32_has_gradients", "clear_wrapper_gradients", "grads_for_norm", "norm_type",
    "real_dp_process_group", "use_grad_accum_attribute", "update_lp_params", "hp_fragment",
    "zero_partitions_gradients", "bit16_groups", "bit16_groups_flat", "fp32_partitions", "partitioned_bit16_groups",
    "round_robin_groups", "round_robin_params", "has_flat_offsets", "gradient_for_reduction", "zero_cpu_offload",
    "zero_has_overflow", "discard_zero_averaged_gradients", "grad_accum", "set_grad_accum", "zero_reset_backward_flags"
]


# -- optimizer-wrapper fields -------------------------------------------------------------------------------------


def set_wrapper_mpu(optimizer, mpu):
    """Point ``BF16_Optimizer.mpu`` (its norm's and overflow check's model-parallel view) at ``mpu``."""
    optimizer.mpu = mpu


def wrapper_mpu(optimizer):
    """``BF16_Optimizer.mpu``."""
    return optimizer.mpu


def set_zero_model_parallel(optimizer, group, world_size, rank):
    """Set ZeRO's ``model_parallel_group`` / ``_world_size`` / ``_rank`` (its norm's and overflow check's group)."""
    optimizer.model_parallel_group = group
    optimizer.model_parallel_world_size = world_size
    optimizer.model_parallel_rank = rank


def clip_grad(optimizer):
    """A wrapper's ``clip_grad`` (its gradient clipping threshold; 0 = none)."""
    return optimizer.clip_grad


def set_clip_grad(optimizer, value):
    """Set a wrapper's ``clip_grad``."""
    optimizer.clip_grad = value


def overflow(optimizer):
    """A wrapper's ``overflow`` after its step (True: the step was skipped); False where it has none."""
    return bool(getattr(optimizer, "overflow", False))


def bf16_groups(optimizer):
    """``BF16_Optimizer.bf16_groups``: per param group, the module's low-precision parameters."""
    return optimizer.bf16_groups


def bf16_partitioned_groups(optimizer):
    """``BF16_Optimizer.bf16_partitioned_groups``: per group, each DP rank's view of the flat bf16 buffer."""
    return optimizer.bf16_partitioned_groups


def fp32_flat_partitions(optimizer):
    """``BF16_Optimizer.fp32_groups_flat_partition``: per group, this rank's fp32 master partition."""
    return optimizer.fp32_groups_flat_partition


def fp32_gradients(optimizer):
    """``BF16_Optimizer.fp32_groups_gradients``: per group, per parameter, its fp32 accumulated gradient."""
    return optimizer.fp32_groups_gradients


def fp32_gradients_flat(optimizer):
    """``BF16_Optimizer.fp32_groups_gradients_flat``: per group, the flat fp32 accumulated gradient."""
    return optimizer.fp32_groups_gradients_flat


def fp32_gradient_flat_partitions(optimizer):
    """``BF16_Optimizer.fp32_groups_gradient_flat_partition``: per group, this rank's part of that gradient."""
    return optimizer.fp32_groups_gradient_flat_partition


def fp32_has_gradients(optimizer):
    """``BF16_Optimizer.fp32_groups_has_gradients``: per group, per parameter, whether it holds a gradient (mutable)."""
    return optimizer.fp32_groups_has_gradients


def clear_wrapper_gradients(optimizer):
    """``BF16_Optimizer.clear_lp_grads()`` then ``clear_hp_grads()``: drop both gradients, as its skip does."""
    optimizer.clear_lp_grads()
    optimizer.clear_hp_grads()


def grads_for_norm(optimizer):
    """``BF16_Optimizer.get_grads_for_norm()[0]``: the fp32 gradients its norm counts (tied copies once)."""
    return optimizer.get_grads_for_norm()[0]


def norm_type(optimizer):
    """``BF16_Optimizer.norm_type`` (2.0: the gradient norm's order)."""
    return optimizer.norm_type


def real_dp_process_group(optimizer, i):
    """A wrapper's ``real_dp_process_group[i]``: the data-parallel group param group ``i`` is partitioned over."""
    return optimizer.real_dp_process_group[i]


def use_grad_accum_attribute(optimizer):
    """ZeRO's ``use_grad_accum_attribute`` (gradients kept in a separate accumulation attribute); False if none."""
    return bool(getattr(optimizer, "use_grad_accum_attribute", False))


def update_lp_params(optimizer):
    """``BF16_Optimizer.update_lp_params()``: the module's bf16 weights from the fp32 masters (and across DP)."""
    optimizer.update_lp_params()


def hp_fragment(param):
    """Where a wrapped parameter's fp32 master lives (DeepSpeed's ``param._hp_mapping``): ``(hp_start, numel,
    lp_start, fragment)`` (offset into the flat fp32 partition, length, offset into the parameter, the fp32 view),
    or ``None`` for a parameter with no fragment in this rank's partition."""
    mapping = getattr(param, "_hp_mapping", None)
    if mapping is None:
        return None
    hp, lp = mapping.hp_fragment_address, mapping.lp_fragment_address
    return hp.start, hp.numel, lp.start, mapping.hp_fragment


def zero_partitions_gradients(optimizer):
    """ZeRO's ``partition_gradients`` (stage 2 or above); False where it has none."""
    return bool(getattr(optimizer, "partition_gradients", False))


def bit16_groups(optimizer):
    """ZeRO's ``bit16_groups``: per param group, the module's parameters."""
    return optimizer.bit16_groups


def bit16_groups_flat(optimizer):
    """ZeRO's ``bit16_groups_flat``: per group, the flat buffer the parameters are views of."""
    return optimizer.bit16_groups_flat


def fp32_partitions(optimizer):
    """ZeRO's ``single_partition_of_fp32_groups``: per group, this rank's fp32 master partition."""
    return optimizer.single_partition_of_fp32_groups


def partitioned_bit16_groups(optimizer):
    """ZeRO's ``parallel_partitioned_bit16_groups``: per group, each DP rank's view of the flat buffer."""
    return optimizer.parallel_partitioned_bit16_groups


def round_robin_groups(optimizer):
    """ZeRO's ``round_robin_bit16_groups``, ``round_robin_bit16_meta``, ``round_robin_bit16_offsets``: per group,
    the parameters in flat-buffer order, their meta tensors, their offsets into the flat buffer."""
    return optimizer.round_robin_bit16_groups, optimizer.round_robin_bit16_meta, optimizer.round_robin_bit16_offsets


def round_robin_params(optimizer):
    """ZeRO's ``round_robin_bit16_groups``: per group, the parameters in flat-buffer order."""
    return optimizer.round_robin_bit16_groups


def has_flat_offsets(optimizer):
    """Whether ZeRO keeps per-parameter flat offsets and unreduced gradients (not in 0.16.0)."""
    return hasattr(optimizer, "round_robin_bit16_offsets") and hasattr(optimizer, "get_gradient_for_reduction")


def gradient_for_reduction(optimizer, param):
    """ZeRO's ``get_gradient_for_reduction(param)``: the gradient of ``param`` before the DP reduce, or None."""
    return optimizer.get_gradient_for_reduction(param)


def grad_accum(param):
    """ZeRO's ``param.grad_accum``: where it accumulates a window's gradients when ``use_grad_accum_attribute`` (the
    parameters' dtype differs from ``data_types.grad_accum_dtype``, ZeRO stage 1: bf16 with fp32 accumulation and
    ``offload_optimizer``); ``None`` where it has none."""
    return getattr(param, "grad_accum", None)


def set_grad_accum(param, value):
    """Set ZeRO's ``param.grad_accum``."""
    param.grad_accum = value


def zero_reset_backward_flags(optimizer):
    """ZeRO's ``clear_backward_seen_flag()`` (what ``DeepSpeedEngine.forward`` runs first): it drops ``grad_accum``
    if a reduce epilogue ran since, and resets the per-backward flags; nothing where the optimizer has none."""
    reset = getattr(optimizer, "clear_backward_seen_flag", None)
    if reset is not None:
        reset()


def zero_cpu_offload(optimizer):
    """ZeRO's ``cpu_offload`` (its master weights and step live on the CPU); False where it has none."""
    return bool(getattr(optimizer, "cpu_offload", False))


def zero_has_overflow(optimizer):
    """ZeRO's ``has_overflow(partition_gradients=True)``: a non-finite gradient on any DP (and MP) rank."""
    return optimizer.has_overflow(partition_gradients=True)


def discard_zero_averaged_gradients(optimizer):
    """Drop ZeRO's ``averaged_gradients`` (what its own overflow branch does; not with CPU offload)."""
    optimizer.averaged_gradients = {}
