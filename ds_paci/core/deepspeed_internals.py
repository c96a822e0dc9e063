"""The one place ds_paci reaches into DeepSpeed's internals: the list to re-check for a new DeepSpeed version.

Everything below is a private DeepSpeed name (a ``_name`` method or field of DeepSpeed's objects) or a public
field of a DeepSpeed object that is no part of DeepSpeed's documented API (the optimizer wrappers' partitions,
the pipeline engine's per-call loss fields, ...). Each is reached through one named function here; no other
module of ds_paci (nor ``launch/``, ``scripts/``) names them: ``tests/test_deepspeed_seam.py`` derives the
private names from the installed DeepSpeed's source and fails on any use elsewhere, and scans for the fields of
:data:`INTERNAL_FIELDS` the same way. Checked against DeepSpeed 0.16.0 to 0.19.8 (the supported range,
:data:`ds_paci.core.compat.SUPPORTED`); what differs between those versions is :mod:`ds_paci.core.compat`'s
business, which asks this module for the names.

To support a new DeepSpeed version, re-read each of these in its source (``deepspeed/runtime/pipe/engine.py``,
``runtime/engine.py``, ``runtime/bf16_optimizer.py``, ``runtime/zero/stage_1_and_2.py``,
``runtime/pipe/module.py``, ``runtime/pipe/topology.py``) and check that it still means what the docstring here
says:

**Engine methods** (``PipelineEngine`` / ``DeepSpeedEngine``), called as DeepSpeed's own code (unbound, on the
PACI engine, where the stream interprets an instruction): ``_exec_load_micro_batch``, ``_exec_forward_pass``,
``_exec_backward_pass``, ``_exec_send_activations``, ``_exec_recv_activations``, ``_exec_send_grads``,
``_exec_recv_grads`` (each ``(self, buffer_id)``), ``_exec_reduce_grads``, ``_exec_reduce_tied_grads``,
``_exec_optimizer_step`` (which runs ``_take_model_step``), ``_reserve_pipe_buffers(n)``, ``_next_batch``,
``_backward_prologue_per_tensor`` (0.18.3 on; an instance attribute read by ``DeepSpeedEngine.forward``).
Methods the PACI engine *overrides* (DeepSpeed calls them from inside its own code, so their contract is a
dependency too): :data:`OVERRIDDEN_ENGINE_METHODS`.

``_get_ckpt_name`` (the model-states file name).

**Engine fields**: ``_config._param_dict`` (the raw config dict), ``_config.gradient_clipping`` (read by
``gradient_clipping()``), ``_config.monitor_config``; ``_global_grad_norm`` (``get_global_grad_norm()``),
``_step_applied`` (``was_step_applied()``, set by ``_take_model_step``), ``_compute_loss`` (the forward
computes the loss); the per-call loss fields ``total_loss``, ``total_additional_losses``, ``fwd_outputs``,
``agg_additional_losses``, ``agg_train_loss`` and the stage output ``loss``; ``pipe_buffers``, ``batch_fn``,
``checkpoint_engine``, ``pipeline_enable_backward_allreduce``, ``mpu``; ``PipelineModule``'s ``_layer_specs``, ``tied_modules``, ``tied_weight_attrs``; a
parameter's ``ds_pipe_replicated`` flag; ``PipelineParallelGrid``'s ``_topo`` and ``pipe_groups``;
``DeepSpeedConfig._param_dict`` (the ``config_class`` DeepSpeed hands the engine).

**Optimizer-wrapper fields**: ``BF16_Optimizer``'s ``bf16_groups``, ``bf16_partitioned_groups``,
``fp32_groups_flat_partition``, ``fp32_groups_gradients``, ``fp32_groups_gradients_flat``,
``fp32_groups_gradient_flat_partition``, ``fp32_groups_has_gradients``, ``real_dp_process_group``, ``mpu``,
``norm_type``, ``clip_grad``, ``clear_lp_grads()``, ``clear_hp_grads()``, ``get_grads_for_norm()``,
``update_lp_params()``; a
wrapped parameter's ``_hp_mapping`` (``hp_fragment_address``, ``lp_fragment_address``, ``hp_fragment``); the ZeRO-1
``DeepSpeedZeroOptimizer``'s ``bit16_groups``, ``bit16_groups_flat``, ``single_partition_of_fp32_groups``,
``parallel_partitioned_bit16_groups``, ``round_robin_bit16_groups``, ``round_robin_bit16_meta``,
``round_robin_bit16_offsets``, ``real_dp_process_group``, ``averaged_gradients``, ``cpu_offload``,
``model_parallel_group``, ``model_parallel_rank``, ``model_parallel_world_size``, ``clip_grad``,
``has_overflow()``, ``use_grad_accum_attribute``, ``partition_gradients``,
``get_gradient_for_reduction()``; both wrappers' ``overflow``.

**Schedule internals**: ``PipelineEngine._INSTRUCTION_MAP`` (instruction class to ``_exec_*`` function, read
by ``_exec_schedule`` through ``self``, so an engine instance may carry its own table).

Imports only torch and DeepSpeed (``ds_paci.core``'s rule).
"""

from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.pipe.engine import PipelineEngine

# Methods of DeepSpeed's PipelineEngine (or its bases) that PACIPipelineEngine overrides. DeepSpeed's own code
# calls several of them (``_next_batch`` from ``_exec_load_micro_batch``, ``reset_activation_shape`` from
# ``set_dataiterator``/``eval_batch``): a new DeepSpeed that
# renames or stops calling one changes the PACI engine silently. The seam test checks this list against the
# engine class and the installed PipelineEngine.
OVERRIDDEN_ENGINE_METHODS = (
    "__init__",
    "_next_batch",
    "destroy",
    "eval_batch",
    "get_global_grad_norm",
    "load_checkpoint",
    "reset_activation_shape",
    "save_checkpoint",
    "set_train_batch_size",
    "train_batch",
    "was_step_applied",
)

# Public names of DeepSpeed objects that are internals (not DeepSpeed's documented API): the seam test fails
# where one is used outside this module (an attribute of ``self`` in a class of ds_paci's own that is not a
# DeepSpeed subclass is that class's own field, not DeepSpeed's). The loss ``loss`` field is left out of the scan
# (too common a name); it is reached through :func:`stage_loss` / :func:`set_stage_loss` all the same.
INTERNAL_FIELDS = (
    # PipelineEngine
    "pipe_buffers", "total_loss", "total_additional_losses", "fwd_outputs", "agg_additional_losses",
    "agg_train_loss", "batch_fn", "checkpoint_engine", "pipeline_enable_backward_allreduce",
    # PipelineModule, its parameters, PipelineParallelGrid
    "tied_modules", "tied_weight_attrs", "ds_pipe_replicated", "pipe_groups",
    # BF16_Optimizer
    "bf16_groups", "bf16_partitioned_groups", "fp32_groups_flat_partition", "fp32_groups_gradients",
    "fp32_groups_gradients_flat", "fp32_groups_gradient_flat_partition", "fp32_groups_has_gradients",
    "clear_lp_grads", "clear_hp_grads", "get_grads_for_norm", "norm_type", "update_lp_params",
    # a wrapped parameter's fp32 mapping (``_hp_mapping``, a tensor_fragment)
    "hp_fragment_address", "lp_fragment_address", "hp_fragment",
    # DeepSpeedZeroOptimizer (ZeRO-1)
    "bit16_groups", "bit16_groups_flat", "single_partition_of_fp32_groups", "parallel_partitioned_bit16_groups",
    "round_robin_bit16_groups", "round_robin_bit16_meta", "round_robin_bit16_offsets", "averaged_gradients",
    "cpu_offload", "model_parallel_group", "model_parallel_rank", "model_parallel_world_size", "has_overflow",
    "get_gradient_for_reduction", "use_grad_accum_attribute", "partition_gradients",
    # both wrappers
    "real_dp_process_group", "mpu", "clip_grad", "overflow",
)

# -- engine methods: the stream's instructions, as DeepSpeed executes them ----------------------------------------


def exec_load_micro_batch(engine, buffer_id):
    """DeepSpeed's ``LoadMicroBatch``: the next batch (``engine._next_batch()``) into pipe buffer ``buffer_id``."""
    PipelineEngine._exec_load_micro_batch(engine, buffer_id)


def exec_forward_pass(engine, buffer_id):
    """DeepSpeed's ``ForwardPass`` on buffer ``buffer_id`` (the last stage adds its loss to ``total_loss``)."""
    PipelineEngine._exec_forward_pass(engine, buffer_id)


def exec_backward_pass(engine, buffer_id):
    """DeepSpeed's ``BackwardPass`` on buffer ``buffer_id`` (the last stage backpropagates ``engine.loss``)."""
    PipelineEngine._exec_backward_pass(engine, buffer_id)


def exec_send_activations(engine, buffer_id):
    """DeepSpeed's ``SendActivation`` of buffer ``buffer_id`` to the next stage."""
    PipelineEngine._exec_send_activations(engine, buffer_id)


def exec_recv_activations(engine, buffer_id):
    """DeepSpeed's ``RecvActivation`` into buffer ``buffer_id`` from the previous stage."""
    PipelineEngine._exec_recv_activations(engine, buffer_id)


def exec_send_grads(engine, buffer_id):
    """DeepSpeed's ``SendGrad`` of buffer ``buffer_id``'s input gradient to the previous stage."""
    PipelineEngine._exec_send_grads(engine, buffer_id)


def exec_recv_grads(engine, buffer_id):
    """DeepSpeed's ``RecvGrad`` into buffer ``buffer_id`` from the next stage."""
    PipelineEngine._exec_recv_grads(engine, buffer_id)


def exec_reduce_grads(engine):
    """DeepSpeed's ``ReduceGrads``: the data-parallel gradient reduce (of this stage's replicas, on a pipeline)."""
    engine._exec_reduce_grads()


def exec_reduce_tied_grads(engine):
    """DeepSpeed's ``ReduceTiedGrads``: all-reduce of tied gradients over each tied group (spans the owners)."""
    engine._exec_reduce_tied_grads()


def exec_optimizer_step(engine):
    """DeepSpeed's ``OptimizerStep``: ``_take_model_step`` (clip, wrapper step, scheduler, counters, zero_grad)."""
    engine._exec_optimizer_step()


def reserve_pipe_buffers(engine, n):
    """Grow the engine's pipe buffers (inputs, labels, outputs) to ``n`` slots, as DeepSpeed's schedule asks."""
    engine._reserve_pipe_buffers(n)


def stock_next_batch(engine):
    """DeepSpeed's own ``PipelineEngine._next_batch`` (the data iterator, then ``batch_fn``), bypassing overrides."""
    return PipelineEngine._next_batch(engine)


def backward_prologue_per_tensor(engine):
    """The engine's ``_backward_prologue_per_tensor`` (bound; 0.18.3 on): divides an output gradient by ``M``."""
    return engine._backward_prologue_per_tensor


def set_backward_prologue_per_tensor(engine, hook):
    """Replace it on this engine only (``DeepSpeedEngine.forward`` reads it from the instance at every call)."""
    engine._backward_prologue_per_tensor = hook


def engine_scales_output_gradients():
    """Whether ``DeepSpeedEngine`` has ``_backward_prologue_per_tensor`` (the output-gradient hook; 0.18.3 on)."""
    return hasattr(DeepSpeedEngine, "_backward_prologue_per_tensor")


def pipeline_engine_scales_last_stage_only():
    """Whether ``PipelineEngine`` defines its own ``_backward_prologue_per_tensor`` (last stage only; 0.19.3 on)."""
    return "_backward_prologue_per_tensor" in vars(PipelineEngine)


# -- engine fields ------------------------------------------------------------------------------------------------


def param_dict(engine):
    """The raw DeepSpeed config dict the engine was built from (``engine._config._param_dict``)."""
    return engine._config._param_dict


def config_class_param_dict(config_class):
    """The raw dict of a ``DeepSpeedConfig`` (``config_class._param_dict``), or ``None`` when it has none."""
    value = getattr(config_class, "_param_dict", None)
    return value if isinstance(value, dict) else None


def set_config_gradient_clipping(engine, value):
    """Set what ``engine.gradient_clipping()`` returns (``engine._config.gradient_clipping``)."""
    engine._config.gradient_clipping = value


def monitor_config(engine):
    """The engine's monitor configuration (``engine._config.monitor_config``: csv, tensorboard, wandb, ...)."""
    return engine._config.monitor_config


def global_grad_norm(engine):
    """What ``get_global_grad_norm()`` returns on the stock engine (``engine._global_grad_norm``)."""
    return engine._global_grad_norm


def set_global_grad_norm(engine, value):
    """Set ``engine._global_grad_norm`` (DeepSpeed's ``_take_model_step`` sets it from the wrapper's norm)."""
    engine._global_grad_norm = value


def step_applied(engine):
    """What ``was_step_applied()`` returns on the stock engine (``engine._step_applied``)."""
    return engine._step_applied


def set_step_applied(engine, value):
    """Set ``engine._step_applied`` (``_take_model_step`` sets it to ``not overflow``)."""
    engine._step_applied = value


def set_compute_loss(engine, value):
    """Whether the last stage's forward computes the loss (``engine._compute_loss``; ``eval_batch`` may clear it)."""
    engine._compute_loss = value


def reset_call_losses(engine):
    """Clear the per-call loss fields, as ``train_batch`` does before its schedule: ``total_loss``,
    ``total_additional_losses`` (``None``), ``fwd_outputs`` (``[]``); and let the forward compute the loss."""
    engine.total_loss = None
    engine.total_additional_losses = None
    engine.fwd_outputs = []
    engine._compute_loss = True


def call_losses(engine):
    """``(total_loss, total_additional_losses, completed forwards)`` of the last stage since the last reset."""
    return engine.total_loss, engine.total_additional_losses, len(engine.fwd_outputs)


def additional_losses(engine):
    """``engine.agg_additional_losses`` (what ``get_additional_losses()`` returns), or ``None``."""
    return engine.agg_additional_losses


def set_additional_losses(engine, value):
    """Set ``engine.agg_additional_losses``."""
    engine.agg_additional_losses = value


def set_train_loss(engine, value):
    """Set ``engine.agg_train_loss`` (the stock engine's aggregated loss of the call)."""
    engine.agg_train_loss = value


def stage_loss(engine):
    """``engine.loss``: the last stage's loss of the forward the next backward pass differentiates."""
    return engine.loss


def set_stage_loss(engine, value):
    """Set ``engine.loss`` (read by ``_exec_backward_pass`` on the last stage)."""
    engine.loss = value


def zero_fills_missing_gradients(engine):
    """``engine.pipeline_enable_backward_allreduce`` (default True): DeepSpeed's reduce gives each trainable
    parameter without a gradient a zero one."""
    return getattr(engine, "pipeline_enable_backward_allreduce", True)


def batch_fn(engine):
    """``engine.batch_fn``: the module's batch hook ``_next_batch`` applies, or ``None``."""
    return engine.batch_fn


def pipe_buffers(engine):
    """``engine.pipe_buffers``: ``{"inputs": [...], "labels": [...], "outputs": [...], ...}`` slot lists."""
    return engine.pipe_buffers


def checkpoint_engine(engine):
    """``engine.checkpoint_engine`` (``save``/``load``/``commit``, ``is_decoupled()``), or ``None``."""
    return getattr(engine, "checkpoint_engine", None)


def set_checkpoint_engine(engine, value):
    """Replace ``engine.checkpoint_engine`` (DeepSpeed's save and load read it at every call)."""
    engine.checkpoint_engine = value


def engine_mpu(engine):
    """``engine.mpu``: the model-parallel unit the engine was built with (``None`` for a plain pipeline grid)."""
    return getattr(engine, "mpu", None)


def model_states_file_namer(engine):
    """``DeepSpeedEngine._get_ckpt_name(checkpoints_path, tag)`` (the model-states file of this rank), or ``None``."""
    return getattr(engine, "_get_ckpt_name", None)


def layer_specs(module):
    """``PipelineModule._layer_specs``: the full list of layer specs (every stage's), in order."""
    return module._layer_specs


def tied_modules(module):
    """``PipelineModule.tied_modules``: key to this stage's tied module (``ModuleDict``)."""
    return module.tied_modules


def tied_weight_attrs(module):
    """``PipelineModule.tied_weight_attrs``: key to the dotted names of its tied weights."""
    return module.tied_weight_attrs


def pipe_replicated(param):
    """A parameter's ``ds_pipe_replicated`` flag (DeepSpeed counts a flagged tied copy once in its global norm)."""
    return getattr(param, "ds_pipe_replicated", False)


def set_pipe_replicated(param, value):
    """Set a parameter's ``ds_pipe_replicated`` flag."""
    param.ds_pipe_replicated = value


def grid_topology(grid):
    """``PipelineParallelGrid._topo``: its ``ProcessTopology`` (axes ``pipe``, ``data``[, ``model``])."""
    return grid._topo


def pipe_groups(grid):
    """``PipelineParallelGrid.pipe_groups``: the global ranks of every pipeline (one list per replica)."""
    return grid.pipe_groups


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


def zero_cpu_offload(optimizer):
    """ZeRO's ``cpu_offload`` (its master weights and step live on the CPU); False where it has none."""
    return bool(getattr(optimizer, "cpu_offload", False))


def zero_has_overflow(optimizer):
    """ZeRO's ``has_overflow(partition_gradients=True)``: a non-finite gradient on any DP (and MP) rank."""
    return optimizer.has_overflow(partition_gradients=True)


def discard_zero_averaged_gradients(optimizer):
    """Drop ZeRO's ``averaged_gradients`` (what its own overflow branch does; not with CPU offload)."""
    optimizer.averaged_gradients = {}


# -- schedule internals -------------------------------------------------------------------------------------------


def stock_instruction_map():
    """A copy of ``PipelineEngine._INSTRUCTION_MAP`` (instruction class to DeepSpeed's ``_exec_*`` function)."""
    return dict(PipelineEngine._INSTRUCTION_MAP)


def set_engine_instruction_map(engine, table):
    """Give one engine its own instruction table (an instance attribute; ``_exec_schedule`` reads
    ``self._INSTRUCTION_MAP``): DeepSpeed's class table, and so every other engine, is unchanged."""
    engine._INSTRUCTION_MAP = dict(table)
