"""The one place ds_paci reaches into DeepSpeed's internals: the list to re-check for a new DeepSpeed version.

Everything below is a private DeepSpeed name (a ``_name`` method or field of DeepSpeed's objects) or a public
field of a DeepSpeed object that is no part of DeepSpeed's documented API (the optimizer wrappers' partitions,
the pipeline engine's per-call loss fields, ...). Each is reached through one named function here; no other
module of ds_paci (nor ``launch/``, ``scripts/``) names them: ``tests/test_deepspeed_seam.py`` derives the
private names from the installed DeepSpeed's source and fails on any use elsewhere, and scans for the fields of
:data:`INTERNAL_FIELDS` the same way. Checked against DeepSpeed 0.16.0 to 0.19.8 (the supported range,
:data:`ds_paci.core.seam.compat.SUPPORTED`); what differs between those versions is :mod:`ds_paci.core.seam.compat`'s
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
``checkpoint_engine``, ``pipeline_enable_backward_allreduce``, ``mpu``; the point-to-point state
``first_output_send``, ``pipe_recv_buf``, ``grad_layer`` (the backward's received gradient), ``has_attention_mask``,
``has_bool_tensors``, ``is_pipe_partitioned``, ``is_grad_partitioned``, ``dynamic_shape`` and the methods
``_send_tensor_meta(buffer, stage)`` / ``_recv_tensor_meta(stage)`` (the first call's shape exchange); ``PipelineModule``'s ``_layer_specs``, ``tied_modules``, ``tied_weight_attrs``; a
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
``get_gradient_for_reduction()``, ``clear_backward_seen_flag()`` and a parameter's ``grad_accum`` (its
window's gradients when ``use_grad_accum_attribute``); both wrappers' ``overflow``.

**Schedule internals**: ``PipelineEngine._INSTRUCTION_MAP`` (instruction class to ``_exec_*`` function, read
by ``_exec_schedule`` through ``self``, so an engine instance may carry its own table).

One package, three files: this one (the list, :data:`OVERRIDDEN_ENGINE_METHODS`, :data:`INTERNAL_FIELDS`), its
``engine`` half and its ``wrappers`` half, whose functions it re-exports: callers use ``deepspeed_internals.<name>``.
Imports only torch and DeepSpeed (``ds_paci.core``'s rule).
"""

from .engine import *  # noqa: F401,F403 (the seam's functions, one namespace)
from .engine import __all__ as _engine_names
from .wrappers import *  # noqa: F401,F403
from .wrappers import __all__ as _wrapper_names

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
    # PipelineEngine's point-to-point state (the non-blocking transfers use it as DeepSpeed does)
    "first_output_send", "pipe_recv_buf", "grad_layer", "has_attention_mask", "has_bool_tensors",
    "is_pipe_partitioned", "is_grad_partitioned", "dynamic_shape",
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
    "get_gradient_for_reduction", "use_grad_accum_attribute", "partition_gradients", "grad_accum",
    "clear_backward_seen_flag",
    # both wrappers
    "real_dp_process_group", "mpu", "clip_grad", "overflow",
)

__all__ = ["OVERRIDDEN_ENGINE_METHODS", "INTERNAL_FIELDS"] + list(_engine_names) + list(_wrapper_names)
