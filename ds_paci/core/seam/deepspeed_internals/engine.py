"""The seam's engine half: DeepSpeed's ``PipelineEngine`` / ``DeepSpeedEngine`` methods and fields, the pipeline
module's and grid's, and the instruction table (the list to re-check is :mod:`ds_paci.core.seam.deepspeed_internals`)."""

from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.pipe.engine import PipelineEngine

__all__ = [
    "exec_load_micro_batch", "exec_forward_pass", "exec_backward_pass", "exec_send_activations",
    "exec_recv_activations", "exec_send_grads", "exec_recv_grads", "exec_reduce_grads", "exec_reduce_tied_grads",
    "exec_optimizer_step", "reserve_pipe_buffers", "stock_next_batch", "backward_prologue_per_tensor",
    "set_backward_prologue_per_tensor", "engine_scales_output_gradients", "pipeline_engine_scales_last_stage_only",
    "param_dict", "config_class_param_dict", "set_config_gradient_clipping", "monitor_config", "global_grad_norm",
    "set_global_grad_norm", "step_applied", "set_step_applied", "set_compute_loss", "reset_call_losses",
    "call_losses", "additional_losses", "set_additional_losses", "set_train_loss", "stage_loss", "set_stage_loss",
    "zero_fills_missing_gradients", "batch_fn", "pipe_buffers", "checkpoint_engine", "set_checkpoint_engine",
    "engine_mpu", "model_states_file_namer", "layer_specs", "tied_modules", "tied_weight_attrs", "pipe_replicated",
    "set_pipe_replicated", "grid_topology", "pipe_groups", "stock_instruction_map", "set_engine_instruction_map",
    "reduce_scaling", "send_tensor_meta", "recv_tensor_meta", "p2p_field", "set_p2p_field"
]

_P2P_FIELDS = ("first_output_send", "pipe_recv_buf", "grad_layer", "has_attention_mask", "has_bool_tensors",
               "is_pipe_partitioned", "is_grad_partitioned", "dynamic_shape")


def send_tensor_meta(engine, buffer, stage):
    """``PipelineEngine._send_tensor_meta``: the activation's shapes and dtypes, blocking, to ``stage``."""
    PipelineEngine._send_tensor_meta(engine, buffer, stage)


def recv_tensor_meta(engine, stage):
    """``PipelineEngine._recv_tensor_meta``: buffers shaped as ``stage``'s activation (a tensor or a tuple)."""
    return PipelineEngine._recv_tensor_meta(engine, stage)


def p2p_field(engine, name):
    """One of the engine's point-to-point fields (``first_output_send``, ``pipe_recv_buf``, ``grad_layer``, ...)."""
    assert name in _P2P_FIELDS, name
    return getattr(engine, name)


def set_p2p_field(engine, name, value):
    """Set one of :func:`p2p_field`'s fields."""
    assert name in _P2P_FIELDS, name
    setattr(engine, name, value)


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


def reduce_scaling(engine):
    """How ``DeepSpeedEngine.allreduce_bucket`` scales a data-parallel reduce: ``(average, postscale, predivide,
    comm_dtype)`` = ``gradient_average``, ``postscale_gradients()``, ``gradient_predivide_factor()`` and
    ``communication_data_type`` (average and postscale: divide by ``predivide``, sum, multiply by
    ``predivide / dp``; average without postscale: divide by ``dp``, then sum; no average: sum)."""
    return (bool(engine.gradient_average), bool(engine.postscale_gradients()), float(engine.gradient_predivide_factor()),
            engine.communication_data_type)


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


# -- schedule internals -------------------------------------------------------------------------------------------


def stock_instruction_map():
    """A copy of ``PipelineEngine._INSTRUCTION_MAP`` (instruction class to DeepSpeed's ``_exec_*`` function)."""
    return dict(PipelineEngine._INSTRUCTION_MAP)


def set_engine_instruction_map(engine, table):
    """Give one engine its own instruction table (an instance attribute; ``_exec_schedule`` reads
    ``self._INSTRUCTION_MAP``): DeepSpeed's class table, and so every other engine, is unchanged."""
    engine._INSTRUCTION_MAP = dict(table)
