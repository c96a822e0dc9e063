"""A tied owner's optimizer step: the stage's own gradient and the tied total decided apart, on every path.

At its local step an owner of a tied weight applies two gradients of different windows: its own
(non-tied) gradient of window ``k`` and the tied total of window ``k - L`` (:mod:`ds_paci.core.tied.weights`).
The first is the stage's business (its norm, its clipping, its non-finite verdict); the second must
get the same treatment on every owner, or the copies drift apart. :class:`TiedOptimizer` keeps them
apart on each optimizer path PACI supports (``torch.optim`` or DeepSpeed's basic optimizer through
:class:`~ds_paci.core.step.local_step.ParamAliases`: "fp32"; ``BF16_Optimizer``: "bf16"; ZeRO-1's
``DeepSpeedZeroOptimizer``: "zero"):

* **The stage never sees the tied gradient.** :meth:`clear` zeroes the tied gradients the optimizer
  would read (``p.grad``; BF16's fp32 ``_hp_grad``; under ZeRO ``p.grad`` before its reduce), so the
  stage's norm, clipping and non-finite check (:func:`~ds_paci.core.step.local_step.guarded_step`, or the
  wrapper's own) are about its non-tied gradient only, on every owner alike. (DeepSpeed marks the
  later owners' tied modules ``ds_pipe_replicated`` so that its global norm counts them once; async
  norms are stage-local, so :class:`~ds_paci.core.tied.weights.TiedWeights` clears the mark: every owner
  counts its own non-tied parameters, such as a tied module's bias.)
* **The tied total enters at the innermost step.** A step pre-hook on the optimizer that updates
  the parameters (the inner optimizer of BF16/ZeRO, which steps flat fp32 partitions) writes the
  tied total into the tied slots of its gradients, after every wrapper-level reduction, norm and
  clip. The total is bit-identical on every owner (and replica), so is its update.
* **Every owner steps exactly once per local step.** Adam's step counters (per parameter in
  ``torch.optim``; per flat partition under BF16/ZeRO; FusedAdam uses the counter of the last
  parameter of a group for the whole group) are shared between tied and non-tied elements, so they
  can stay identical across owners only if they count local steps. When the stage's own gradient
  is not finite (its step is skipped), the owner still runs its optimizer once, on zero gradients
  plus the tied total, and restores every non-tied weight and optimizer state element exactly
  (:meth:`_fault_step`, from a CPU copy of the stage's master weights and state, taken only then).
* **A skipped tied part is restored.** When the owners agree to skip the tied total (a non-finite
  window on some owner), its slots get zero gradients and their weights, fp32 masters and optimizer
  state elements are put back bit for bit after the step (a small copy of the tied slices only).

Restoring is exact (copies of the bits); counters are never restored. The price of a skip on a
tied owner: one extra optimizer step over zero gradients and a host copy of the stage's optimizer
state, on that local step only.
"""

import torch

from ..seam import deepspeed_internals as ds
from ..step.local_step import guarded_step

__all__ = ["TiedOptimizer"]


class _Slot:
    """Where the elements ``lp_start:lp_start+numel`` of tied parameter ``param`` live in ``target``
    (the tensor the stepping optimizer updates), starting at ``start`` of its flattened view."""

    __slots__ = ("param", "target", "start", "numel", "lp_start")

    def __init__(self, param, target, start, numel, lp_start):
        self.param, self.target, self.start, self.numel, self.lp_start = param, target, start, numel, lp_start

    def view(self, tensor):
        return tensor.view(-1).narrow(0, self.start, self.numel)


class _TotalWriter:
    """Step pre-hook: writes each tied parameter's total (or zeros) into its slot of the stepped gradients."""

    def __init__(self, slots, totals):
        self.slots = slots
        self.totals = totals
        self.written = set()

    def __call__(self, optimizer, args, kwargs):
        for n, s in enumerate(self.slots):
            if s.target.grad is None:
                continue  # ZeRO steps one group per call; this slot's group comes in another call
            if n in self.written:
                raise RuntimeError("ds_paci: the optimizer stepped the tied parameters twice in one local step")
            total = self.totals[id(s.param)]
            grad = s.view(s.target.grad)
            if total is None:
                grad.zero_()
            else:
                grad.copy_(total.view(-1).narrow(0, s.lp_start, s.numel))
            self.written.add(n)

    @property
    def fired(self):
        return bool(self.written)

    @property
    def complete(self):
        return len(self.written) == len(self.slots)


class TiedOptimizer:
    """The optimizer side of the tied-weight policy for one owning rank (see the module docstring).

    ``params``: this rank's tied parameters (every exchange's, in order).
    """

    def __init__(self, ctx, params):
        from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
        self.ctx = ctx
        self.params = list(params)
        self._tied = {id(p) for p in self.params}
        opt = ctx.optimizer
        if isinstance(opt, BF16_Optimizer):
            self.mode, self.inner = "bf16", opt.optimizer
            self._grad_slot = {id(p): (i, j) for i, group in enumerate(ds.bf16_groups(opt)) for j, p in enumerate(group)}
            self.slots = self._flat_slots(ds.bf16_groups(opt), ds.fp32_flat_partitions(opt))
        elif isinstance(opt, DeepSpeedZeroOptimizer):
            if ds.use_grad_accum_attribute(opt):
                raise TypeError("tied layers across stages are not supported with DeepSpeed's ZeRO optimizer keeping "
                                "gradients in a separate accumulation attribute (e.g. CPU offload); use ZeRO stage 0/1 "
                                "without offload, or untie the layers")
            self.mode, self.inner = "zero", opt.optimizer
            self.slots = self._flat_slots(ds.bit16_groups(opt), ds.fp32_partitions(opt))
        else:
            self.mode, self.inner = "fp32", opt
            alias = {id(p): a for p, a in ctx.aliases.pairs} if ctx.aliases is not None else {}
            self.slots = [_Slot(p, alias.get(id(p), p), 0, p.numel(), 0) for p in self.params]
        self.fault_steps = 0

    def _flat_slots(self, lp_groups, partitions):
        """The tied fragments in this replica's flat fp32 partitions (none for a parameter outside its partition)."""
        slots = []
        for p in self.params:
            fragment = ds.hp_fragment(p)
            if fragment is None:
                continue
            group = next(i for i, g in enumerate(lp_groups) if any(q is p for q in g))
            q = partitions[group]
            hp_start, numel, lp_start, hp_view = fragment
            slot = _Slot(p, q, hp_start, numel, lp_start)
            if slot.view(q).data_ptr() != hp_view.data_ptr():
                raise RuntimeError(f"ds_paci: this DeepSpeed lays out {type(self.ctx.optimizer).__name__}'s fp32 "
                                   "partitions differently than expected (tied fragment not found); untie the layers")
            slots.append(slot)
        return slots

    # -- the gradients the exchange reads ---------------------------------------------------------
    def grad(self, p):
        """The gradient of tied ``p`` the optimizer would step on (fp32 ``_hp_grad`` under BF16, else ``p.grad``)."""
        if self.mode == "bf16":
            i, j = self._grad_slot[id(p)]
            return ds.fp32_gradients(self.ctx.optimizer)[i][j]
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        return p.grad

    def read(self, params):
        """The flat fp32 concatenation of the tied gradients of ``params`` (a copy)."""
        return torch.cat([self.grad(p).detach().reshape(-1).float() for p in params]).clone()

    def clear(self, params):
        """Zero the tied gradients of ``params``: the stage's norm, clipping and skip decision never see them."""
        for p in params:
            self.grad(p).detach().zero_()
            if self.mode == "bf16":
                i, j = self._grad_slot[id(p)]
                ds.fp32_has_gradients(self.ctx.optimizer)[i][j] = True

    def stage_gradient_finite(self):
        """Whether the stage's own (non-tied) gradient is finite: after the data-parallel reduce under fp32 and
        BF16 (every replica agrees), before ZeRO's reduce (this replica's only: the caller combines)."""
        if self.mode == "bf16":
            opt = self.ctx.optimizer
            gradients, has_gradients = ds.fp32_gradients(opt), ds.fp32_has_gradients(opt)
            grads = [gradients[i][j] for i, group in enumerate(ds.bf16_groups(opt))
                     for j, p in enumerate(group) if id(p) not in self._tied and has_gradients[i][j]]
        else:
            grads = [p.grad for p in self.ctx.module.parameters() if id(p) not in self._tied and p.grad is not None]
        if not grads:
            return True
        return bool(torch.isfinite(torch.stack([torch.linalg.vector_norm(g.detach().float()) for g in grads])).all())

    # -- the step ------------------------------------------------------------------------------------
    def step(self, totals):
        """The optimizer part of the local step; returns ``(stage part applied, tied part applied)``.

        ``totals``: ``{id(p): flat fp32 total}`` for every tied parameter, ``None`` for one whose total the
        owners skip. The tied gradients must have been :meth:`clear`\\ ed.
        """
        skipped = [p for p in self.params if totals[id(p)] is None]
        saved = self._save(skipped, with_lp=self.mode != "fp32") if skipped else None
        writer = _TotalWriter(self.slots, totals)
        handle = self.inner.register_step_pre_hook(writer)
        try:
            applied = guarded_step(self.ctx.engine, before_skip=lambda: self._fault_step(writer))
        finally:
            handle.remove()
        if self.slots and not writer.complete:
            raise RuntimeError("ds_paci: the optimizer step did not reach the tied parameters (this DeepSpeed version "
                               "steps its partitions differently than expected); untie the layers")
        if saved is not None:
            self._restore(saved)
        return applied, not skipped

    def _fault_step(self, writer):
        """The stage's gradient is skipped: step once on zero gradients plus the tied totals, restore the rest."""
        if writer.fired:
            raise RuntimeError("ds_paci: the optimizer reported a skipped step after updating the parameters")
        self.fault_steps += 1
        targets = self._targets()
        before = {id(q): _copy_state(q, self.inner, "cpu") for q in targets}
        grads = {id(q): q.grad for q in targets}
        for q in targets:
            q.grad = torch.zeros_like(q)
        try:
            self.inner.step()
        finally:
            for q in targets:
                q.grad = grads[id(q)]
        applied = [p for p in self.params if writer.totals[id(p)] is not None]
        keep = self._save(applied, with_lp=False)
        for q in targets:
            _put_state(q, self.inner, before[id(q)])
        self._restore(keep)
        if self.mode != "fp32":
            ds.update_lp_params(self.ctx.optimizer)  # model weights from the masters (and over data parallelism)

    def _targets(self):
        """What the stepping optimizer updates: the flat partitions (BF16/ZeRO), or the parameters with a gradient."""
        params = [q for group in self.inner.param_groups for q in group["params"]]
        return params if self.mode != "fp32" else [q for q in params if q.grad is not None]

    def _save(self, params, with_lp):
        """Copies of the slots of ``params`` (weights, fp32 masters, elementwise optimizer state), and their model
        weights with ``with_lp`` (wrappers: every replica keeps the full parameter, partition or not)."""
        wanted = {id(p) for p in params}
        slots = [s for s in self.slots if id(s.param) in wanted]
        records = []
        for s in slots:
            state = {k: s.view(v).clone() for k, v in _elementwise(self.inner, s.target).items()}
            records.append((s, s.view(s.target.data).clone(), state))
        lp = [(p, p.data.clone()) for p in params] if with_lp else []
        return records, lp

    def _restore(self, saved):
        records, lp = saved
        for s, master, state in records:
            s.view(s.target.data).copy_(master)
            for k, v in _elementwise(self.inner, s.target).items():
                view = s.view(v)
                view.copy_(state[k]) if k in state else view.zero_()  # state born in this step: as if absent
        for p, data in lp:
            p.data.copy_(data)

    # -- the copy check -------------------------------------------------------------------------------
    def state_of(self, p):
        """``{name: fp32 CPU tensor}``: the optimizer state of tied ``p`` (collective over the stage's DP group
        under BF16/ZeRO: every replica must call it for the same parameters in the same order)."""
        ctx = self.ctx
        if self.mode == "fp32":
            slot = next(s for s in self.slots if s.param is p)
            state = self.inner.state.get(slot.target, {})
            return {k: v.detach().float().cpu().clone() for k, v in sorted(state.items()) if torch.is_tensor(v)}
        keys = sorted({k for st in self.inner.state.values() for k, v in st.items() if torch.is_tensor(v) and v.dim() > 0})
        slot = next((s for s in self.slots if s.param is p), None)
        out = {}
        for key in [None] + keys:
            buf = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
            if slot is not None:
                source = slot.target.data if key is None else self.inner.state.get(slot.target, {}).get(key)
                if source is not None:
                    buf.narrow(0, slot.lp_start, slot.numel).copy_(slot.view(source).float())
            if ctx.dp_world_size > 1:
                torch.distributed.all_reduce(buf, group=ctx.grid.get_data_parallel_group())
            out["master" if key is None else key] = buf.view_as(p).cpu()
        return out


def _elementwise(optimizer, q):
    """The state tensors of ``q`` that hold one value per element of ``q`` (Adam's moments, not its counter)."""
    return {k: v for k, v in optimizer.state.get(q, {}).items() if torch.is_tensor(v) and v.shape == q.shape}


def _copy_state(q, optimizer, device):
    state = {k: v.detach().to(device, copy=True) for k, v in optimizer.state.get(q, {}).items()
             if torch.is_tensor(v) and v.dim() > 0}
    return q.detach().to(device, copy=True), state


def _put_state(q, optimizer, saved):
    """Put ``q`` and its per-element state back (state created since: zeroed, as if absent); counters stay."""
    data, state = saved
    q.data.copy_(data)
    for k, v in optimizer.state.get(q, {}).items():
        if torch.is_tensor(v) and v.dim() > 0:
            v.copy_(state[k]) if k in state else v.zero_()

