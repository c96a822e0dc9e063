"""Where the look-ahead's tensors live: the slots of an engine's optimizer, and the clip norm's sources.

Public contract
---------------
* :class:`Slot`: one tensor an optimizer steps (the *master*), its param group, its rule
  reader (:func:`~ds_paci.core.lookahead.rules.rule_reader`), its accumulated window gradient
  (``grad()``), and the low-precision tensor the forward reads (``target``; ``None``: the
  master itself). ``zero_filled``: a missing gradient reaches the optimizer as zeros.
* :class:`ClipSource`: the stage's clip threshold now (``max_norm()``) and the norm of its
  local window gradient so far (``norm()``), computed as the stage's local step computes it.
* :func:`torch_slots`, :func:`engine_slots`: the slots of a ``torch.optim``/FusedAdam
  optimizer stepping ``.data`` aliases, and of an engine's optimizer (fp32, DeepSpeed's
  ``BF16_Optimizer``, ZeRO stage 1), or the reason (one phrase) why it is not predicted.
* Tied owners (:mod:`ds_paci.core.tied`): the step applies to a tied weight the owners' total of window
  ``k - L``, not the open window's own gradient, and that total is not known at a crossing forward (the
  peers' messages of that window may not have been posted yet; waiting for them would stall the
  pipeline). So the tied weights are **not predicted**: their elements are a slot's ``fixed`` ranges
  (a whole slot on the fp32 path, fragments of the flat partitions under bf16/ZeRO), which the
  prediction leaves at their current values. The clip norm and the finiteness check leave the tied
  gradients out, as the real step does (:meth:`~ds_paci.core.tied.optimizer.TiedOptimizer.clear` zeroes
  them before the stage's norm), so every other parameter of an owner is predicted as on any stage.

The paths (no new communication anywhere):

* fp32 with a ``torch.optim`` or FusedAdam optimizer (or DeepSpeed's MuonWithAuxAdam): the
  optimizer steps :class:`~ds_paci.core.step.local_step.ParamAliases` (``param.data``); the window's
  gradient is ``param.grad``. In the engine, DeepSpeed's gradient reduce gives every trainable
  parameter without a gradient a zero one before the step (``_get_gradients_for_reduction``),
  so the optimizer moves it by its momentum: the prediction does the same (``zero_filled``).
  Stepped outside the engine (the replay), ``torch.optim`` skips such a parameter: so does the
  prediction.
* ``bf16`` (``BF16_Optimizer``): the fp32 master partition (``fp32_groups_flat_partition``) with
  the fp32 accumulated gradient (``fp32_groups_gradient_flat_partition``), written into the bf16
  parameters. Element-wise rules only (Adam, SGD).
* ZeRO stage 1 (``DeepSpeedZeroOptimizer``): each rank predicts its own partition of the flat
  parameter buffer from its local, not yet reduced ``param.grad`` (or ``grad_accum``); the other
  partitions keep their real weights on this rank. Element-wise rules only.
"""

import torch
from deepspeed import comm as dist
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from deepspeed.utils import logger

from ..seam import compat
from ..seam import deepspeed_internals as ds
from ..step.local_step import stage_grad_norm
from .rules import rule_reader

__all__ = ["Slot", "ClipSource", "torch_slots", "engine_slots", "inner_optimizer", "tied_unpredicted"]


class Slot:
    """One tensor the optimizer steps (the master), its state and group, and where the forward reads it."""

    __slots__ = ("master", "optimizer", "group_index", "reader", "grad", "target", "zero_filled", "sample",
                 "had_grad", "fixed")

    def __init__(self, master, optimizer, group, reader, grad, target=None, zero_filled=False):
        self.master = master
        self.optimizer = optimizer
        # The group by position, not the dict: ``optimizer.load_state_dict`` (a checkpoint load) replaces the
        # param-group dicts, and the LR scheduler then sets the learning rate on the new ones.
        self.group_index = next(i for i, g in enumerate(optimizer.param_groups) if g is group)
        self.reader = reader
        self.grad = grad
        self.target = target
        self.zero_filled = zero_filled
        self.sample = None  # error telemetry: sum of predicted deltas on the sampled coordinates
        self.had_grad = True  # whether the last local step stepped it (a gradient in the last window)
        self.fixed = ()  # ``(start, numel)`` ranges of the flattened master left unpredicted (tied weights)

    @property
    def unpredicted(self):
        """Whether no element of the slot is predicted (every element in a ``fixed`` range)."""
        return sum(n for _, n in self.fixed) >= self.master.numel()

    def free_pieces(self, grad):
        """The pieces of ``grad`` (this slot's window gradient) outside the ``fixed`` ranges, as a list of views."""
        if not self.fixed:
            return [grad]
        flat = grad.view(-1) if grad.is_contiguous() else grad.reshape(-1)
        pieces, at = [], 0
        for start, numel in sorted(self.fixed):
            if start > at:
                pieces.append(flat.narrow(0, at, start - at))
            at = max(at, start + numel)
        if at < flat.numel():
            pieces.append(flat.narrow(0, at, flat.numel() - at))
        return pieces

    @property
    def group(self):
        return self.optimizer.param_groups[self.group_index]

    def rule(self):
        return self.reader(self.optimizer, self.group)


class ClipSource:
    """``max_norm()``: the clip threshold now (0: no clipping); ``norm()``: the local window gradient's 2-norm."""

    def __init__(self, max_norm, norm):
        self.max_norm = max_norm
        self.norm = norm


def _norm_of(tensors):
    tensors = [t for t in tensors if t is not None]
    if not tensors:
        return 0.0
    norms = torch._foreach_norm([t if t.dtype == torch.float32 else t.float() for t in tensors])
    return float(torch.linalg.vector_norm(torch.stack(norms)))


def torch_slots(optimizer, aliases, zero_filled=lambda p: False):
    """``(slots, reason)``: fp32 parameters stepped by ``optimizer`` through ``aliases`` (``reason``: why not)."""
    reader, reason = rule_reader(optimizer)
    if reader is None:
        return None, reason
    param_of = {id(alias): p for p, alias in aliases.pairs}
    slots = []
    for group in optimizer.param_groups:
        for alias in group["params"]:
            p = param_of[id(alias)]
            if alias.dtype != torch.float32:
                return None, f"parameters in {alias.dtype} without DeepSpeed's bf16 optimizer"
            slots.append(Slot(alias, optimizer, group, reader, grad=lambda p=p: p.grad, zero_filled=zero_filled(p)))
    return slots, None


def _elementwise_problem(inner, reader):
    for group in inner.param_groups:
        if not reader(inner, group).chunked:
            return (f"{type(inner).__name__} under a DeepSpeed wrapper (bf16 or ZeRO) steps flat partitions; the "
                    "look-ahead predicts it in fp32 without ZeRO only")
    return None


def _not_replicated(param):
    return not ds.pipe_replicated(param)


def fixed_in(slot, offset, numel):
    """The ``(lo, hi)`` ranges, relative to a chunk at ``offset`` of ``numel`` elements of ``slot``'s master, of
    its ``fixed`` (unpredicted) elements."""
    out = []
    for start, n in slot.fixed:
        lo, hi = max(offset, start), min(offset + numel, start + n)
        if lo < hi:
            out.append((lo - offset, hi - offset))
    return out


def keep_fixed(slots, offsets, thetas, preds):
    """Copy the current values (``thetas``: chunks of the masters) into ``preds`` where a slot is not predicted."""
    for slot, offset, theta, pred in zip(slots, offsets, thetas, preds):
        for lo, hi in fixed_in(slot, offset, theta.numel()):
            pred.view(-1).narrow(0, lo, hi - lo).copy_(theta.reshape(-1).narrow(0, lo, hi - lo))


def _tied_params(ctx):
    """The ids of this rank's tied parameters whose gradients the owner's step zeroes before its norm (none
    off an owner)."""
    tied = ctx.tied
    return set() if tied is None or not tied.exchanges else {id(p) for p in tied.optimizer.params}


def tied_unpredicted(ctx, slots):
    """Mark the tied weights of an owner unpredicted (each slot's ``fixed`` ranges, from where the tied
    optimizer finds them); returns the tied keys of this rank (empty off an owner). Where tied layers span
    stages, rank 0 says so in one line."""
    tied = ctx.tied
    if tied is not None and ctx.global_rank == 0:
        owners = ", ".join(f"{k} (stages {list(v)})" for k, v in sorted(tied.owners.items()))
        logger.warning(f"ds_paci: look-ahead: tied weights are not predicted ({owners}): their step applies the "
                       "owners' total of an earlier window (the tied lag), which a crossing forward cannot know yet, "
                       "so crossing forwards read them at their current version; every other parameter is "
                       "predicted (see docs/lookahead.md, \"Not predicted\")")
    if tied is None or not tied.exchanges:
        return []
    ranges = {}
    for s in tied.optimizer.slots:  # the fp32 alias (whole), or a fragment of a flat fp32 partition
        ranges.setdefault(id(s.target), []).append((s.start, s.numel))
    for slot in slots:
        slot.fixed = tuple(ranges.get(id(slot.master), ()))
        if slot.fixed and slot.target is None and not slot.unpredicted:
            raise RuntimeError("ds_paci: a tied weight shares an fp32 tensor with untied ones (unexpected layout); "
                               "set \"paci\": {\"lookahead\": false} or untie the layers")
    return sorted({k for ex in tied.exchanges for k in ex.keys})


def _bf16_slots(opt, reader, tied=frozenset()):
    """DeepSpeed's BF16_Optimizer: fp32 master partitions, fp32 accumulated gradients, bf16 weights."""
    inner = opt.optimizer
    slots = []
    for i, group in enumerate(inner.param_groups):
        pid = dist.get_rank(group=ds.real_dp_process_group(opt, i))
        grad = ds.fp32_gradient_flat_partitions(opt)[i]
        slots.append(Slot(ds.fp32_flat_partitions(opt)[i], inner, group, reader, grad=lambda g=grad: g,
                          target=ds.bf16_partitioned_groups(opt)[i][pid], zero_filled=True))

    def norm():  # the full local gradients (every partition), as the wrapper's norm counts them
        return _norm_of(g for lps, gs in zip(ds.bf16_groups(opt), ds.fp32_gradients(opt))
                        for lp, g in zip(lps, gs) if _not_replicated(lp) and id(lp) not in tied)

    return slots, ClipSource(lambda: float(ds.clip_grad(opt)), norm)


def _zero_partition_grad(opt, i, partition):
    """This rank's partition of group ``i``'s flat gradient, assembled from the local (unreduced) parameter grads."""
    flat = ds.bit16_groups_flat(opt)[i]
    start = partition.storage_offset() - flat.storage_offset()
    size = partition.numel()
    out = None
    params, metas, offsets = ds.round_robin_groups(opt)
    for param, meta, offset in zip(params[i], metas[i], offsets[i]):
        lo, hi = max(offset, start), min(offset + meta.numel(), start + size)
        if lo >= hi:
            continue
        grad = ds.gradient_for_reduction(opt, param)
        if grad is None:
            continue
        if out is None:
            out = torch.zeros(size, dtype=torch.float32, device=partition.device)
        g = grad.view(-1) if grad.is_contiguous() else grad.reshape(-1)
        out.narrow(0, lo - start, hi - lo).copy_(g.narrow(0, lo - offset, hi - lo))
    return out


def _zero_slots(opt, reader, tied=frozenset()):
    """ZeRO stage 1: this rank's fp32 master partition, its optimizer state, its slice of the flat weights."""
    if ds.zero_cpu_offload(opt):
        return None, None, "ZeRO with CPU offload (the optimizer state lives with DeepSpeedCPUAdam)"
    if ds.zero_partitions_gradients(opt):
        return None, None, "ZeRO stage 2 or above"
    problem = compat.zero_lookahead_problem(opt)
    if problem:
        return None, None, problem
    inner = opt.optimizer
    slots = []
    for i, group in enumerate(inner.param_groups):
        pid = dist.get_rank(group=ds.real_dp_process_group(opt, i))
        partition = ds.partitioned_bit16_groups(opt)[i][pid]
        slots.append(Slot(ds.fp32_partitions(opt)[i], inner, group, reader,
                          grad=lambda i=i, part=partition: _zero_partition_grad(opt, i, part), target=partition,
                          zero_filled=True))

    def norm():
        return _norm_of(ds.gradient_for_reduction(opt, p) for group in ds.round_robin_params(opt) for p in group
                        if _not_replicated(p) and id(p) not in tied)

    return slots, ClipSource(lambda: float(ds.clip_grad(opt)), norm), None


def inner_optimizer(opt):
    """The optimizer inside DeepSpeed's BF16/ZeRO-1 wrapper, or ``opt`` itself."""
    if isinstance(opt, (BF16_Optimizer, DeepSpeedZeroOptimizer)):
        return opt.optimizer
    return opt


def engine_slots(ctx):
    """``(slots, kind, clip, None)`` for the stage's optimizer (``ctx``: a :class:`~ds_paci.core.engine.stage_context.StageContext`), or ``(None, None, None, reason)``.

    The clip norm counts what the local step's norm counts: on a tied owner not the tied gradients (the step
    zeroes them first). The slots' tied ranges are marked by :func:`tied_unpredicted`."""
    opt = ctx.optimizer
    tied = _tied_params(ctx)
    inner = inner_optimizer(opt)
    reader, reason = rule_reader(inner)
    if reader is None:
        return None, None, None, reason
    if isinstance(opt, (BF16_Optimizer, DeepSpeedZeroOptimizer)):
        reason = _elementwise_problem(inner, reader)
        if reason is not None:
            return None, None, None, reason
        if isinstance(opt, BF16_Optimizer):
            slots, clip = _bf16_slots(opt, reader, tied)
            return slots, "bf16", clip, None
        slots, clip, reason = _zero_slots(opt, reader, tied)
        return slots, "zero1", clip, reason
    if ctx.aliases is None:
        return None, None, None, f"optimizer wrapper {type(opt).__name__} is not supported"
    # DeepSpeed's reduce (every local step) gives each trainable parameter without a gradient a zero one
    zero = ds.zero_fills_missing_gradients(ctx.engine)
    slots, reason = torch_slots(opt, ctx.aliases, lambda p: zero and p.requires_grad and p.numel() > 0)
    if slots is None:
        return None, None, None, reason
    clip = ClipSource(lambda: float(ctx.gradient_clipping()),
                      lambda: float(stage_grad_norm(p for p in ctx.module.parameters() if id(p) not in tied)))
    return slots, "torch", clip, None
