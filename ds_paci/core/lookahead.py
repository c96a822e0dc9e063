"""Window-informed look-ahead: forwards that cross a local step run on a prediction of the next weights.

Under PACI, the forward of a micro-batch that crosses its stage's next local step runs
on version ``v`` of the weights while its backward runs through ``v + 1``. Immediately
before such a forward, :class:`LookAhead` moves the stage's weights to a prediction of
``v + 1``, the forward runs, and the real weights are restored (in a ``finally``). The
backward is unchanged: it runs through the real ``v + 1``.

Public contract
---------------
* :func:`make_lookahead` ``(engine, enabled, restore)`` returns a :class:`LookAhead` for
  engines whose optimizer is supported, or ``None`` (look-ahead off, or an unsupported
  optimizer: then one log line, from rank 0, says why).
* :meth:`LookAhead.applied` ``(window_fill, window)``: context manager around one crossing
  forward (``window_fill``: backward passes already in the open window of ``window``). On
  exit, normal or by exception, the weights are the real weights again. Outside it they
  always are: eval, checkpoints, backward passes and every other forward see real weights.
* :meth:`LookAhead.before_step` / :meth:`LookAhead.after_step`: around each local
  optimizer step (prediction-error telemetry only; they never change weights).
* :meth:`LookAhead.stats`: telemetry (see there).
* :meth:`LookAhead.predict_next` ``(window_fill, window)``: the predicted next master weights
  as new tensors (for tests and diagnostics; the engine does not call it).

The prediction (Adam / AdamW with the optimizer's own hyper-parameters)
-----------------------------------------------------------------------
For each tensor the optimizer steps, with step count ``t``, moments ``m``, ``v`` and the
learning rate in its param group now (the one the next step will use: DeepSpeed steps
the LR scheduler right after the optimizer)::

    g   = a * G / n          G: the open window's accumulated gradient, n = backward passes
                             already in it (each scaled by 1/a), a = the window
    g  += wd * theta         (Adam with L2 weight decay only)
    m'  = b1 m + (1 - b1) g,  v' = b2 v + (1 - b2) g^2   (v' = max(v_max, v') with amsgrad)
    u   = lr / (1 - b1^(t+1)) * m' / (sqrt(v' / (1 - b2^(t+1))) + eps)
    theta_next = theta * (1 - lr * wd) - u      (decoupled weight decay: AdamW)
               = theta - u                       (otherwise)

With ``n = 0`` (nothing in the window yet) the gradient estimate is the optimizer's own
bias-corrected first moment ``m / (1 - b1^t)``; with no optimizer state yet either, that
tensor is not predicted. With ``n = a`` and a single data-parallel replica the
prediction is the optimizer's actual next step (up to rounding; tests check <= 1e-6).
Gradient clipping, when configured, is not predicted. Only one version ahead is
predicted (a forward crossing two steps, possible when ``a < P-1-s``, sees ``v + 1``).

Where the tensors live (no new communication anywhere)
------------------------------------------------------
* ``torch.optim`` ``Adam``/``AdamW`` (passed by the user, or DeepSpeed's ``torch_adam``)
  and DeepSpeed's ``FusedAdam`` on fp32 parameters: the optimizer steps
  :class:`~ds_paci.core.local_step.ParamAliases` (``param.data``); the window's gradient
  is ``param.grad`` (DeepSpeed accumulates into it across micro-batches). The forward
  reads the parameters themselves, so they are changed in place and restored either by
  recomputing the same ``u`` (``restore="recompute"``: ``theta = (theta_next + u) /
  (1 - lr wd)``, no extra memory, exact up to rounding) or from a copy of the stage's
  weights held during the forward (``restore="copy"``: exact). Adam with L2 weight decay
  cannot recompute ``u`` (it depends on ``theta``) and always uses the copy.
* ``bf16`` (DeepSpeed's ``BF16_Optimizer``): the prediction is made on the fp32 master
  partition (``fp32_groups_flat_partition``) with the fp32 accumulated gradient
  (``fp32_groups_gradient_flat_partition``: the engine adds each backward's bf16
  gradients into it), written into the bf16 parameters, and restored exactly by copying
  the master back (DeepSpeed keeps the bf16 parameters equal to the rounded master).
* ZeRO stage 1 (``DeepSpeedZeroOptimizer``): each rank holds the optimizer state of its
  own partition only, so each rank predicts exactly that partition of the flat parameter
  buffer (the gradient is the rank's local, not yet reduced ``param.grad``, or
  ``param.grad_accum``), and restores it from the fp32 master partition. The other
  partitions keep their real weights on this rank: predicting them would need the other
  ranks' moments, i.e. new communication. With ``d`` data-parallel replicas each replica
  therefore predicts ``1/d`` of its stage's weights.

With data parallelism (every path), the gradient is the replica's own local sum over the
window so far: each replica predicts from its own data; no reduce is added.

Non-finite values: a tensor (or chunk) whose window gradient is not finite is left
unpredicted (and counted in ``nonfinite_chunks``).

Cost: the prediction takes six multi-tensor passes over the stage's weights plus one
to apply it; the recompute restore as many again, the copy restore two. Tensors are
processed in chunks and batches (:data:`CHUNK`, :data:`BATCH`) so that temporaries stay
bounded.

Telemetry (:meth:`stats`)
-------------------------
``predicted_forwards`` (crossing forwards that ran on predicted weights),
``seconds`` (time spent predicting and restoring), ``prediction_error`` (mean over
windows of the relative prediction error, see below), ``error_windows``, and
``nonfinite_chunks``. The relative error of a window compares the weights predicted for
each of its ``J`` crossing forwards with the real next weights:
``sqrt(mean_j ||theta_pred_j - theta_next||^2) / ||theta_next - theta||``, where 0 is a
perfect prediction and 1 is what running the forward on the old weights amounts to. It is
measured on one window in ``ERROR_EVERY`` (8), on every ``ERROR_STRIDE``-th element of the
stage's master weights (a 1/32 sample of coordinates): 2/32 of a weight copy while such a
window is open and a few strided passes.
"""

import math
import time
from contextlib import contextmanager

import torch
from deepspeed import comm as dist
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from deepspeed.utils import logger

from . import compat

__all__ = ["AdamRule", "LookAhead", "make_lookahead", "lookahead_for_torch_optimizer", "adam_update", "adam_moments",
           "RESTORE_MODES"]

CHUNK = 1 << 20  # tensors are cut into chunks of at most this many elements
BATCH = 1 << 22  # elements predicted by one round of multi-tensor ops: bounds the temporaries
ERROR_STRIDE = 32  # the prediction error is measured on every ERROR_STRIDE-th element (CHUNK is a multiple)
ERROR_EVERY = 8  # ... of one window in ERROR_EVERY (the first, the ninth, ...)
RESTORE_MODES = ("recompute", "copy")


class AdamRule:
    """The hyper-parameters of one Adam/AdamW param group, read when a prediction is made."""

    __slots__ = ("lr", "beta1", "beta2", "eps", "weight_decay", "decoupled", "amsgrad", "maximize",
                 "bias_correction")

    def __init__(self, lr, beta1, beta2, eps, weight_decay, decoupled, amsgrad=False, maximize=False,
                 bias_correction=True):
        self.lr = float(lr)
        self.beta1 = float(beta1)
        self.beta2 = float(beta2)
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        self.decoupled = bool(decoupled)
        self.amsgrad = bool(amsgrad)
        self.maximize = bool(maximize)
        self.bias_correction = bool(bias_correction)

    @property
    def decay(self):
        """Factor on ``theta`` of the decoupled weight decay (1.0 without it)."""
        return 1.0 - self.lr * self.weight_decay if self.decoupled and self.weight_decay else 1.0

    @property
    def l2(self):
        """Adam's coupled (L2) weight decay: ``wd * theta`` joins the gradient."""
        return not self.decoupled and self.weight_decay != 0.0

    @classmethod
    def of_torch(cls, optimizer, group):
        """torch.optim.Adam / AdamW (AdamW is Adam with ``decoupled_weight_decay``)."""
        beta1, beta2 = group["betas"]
        decoupled = group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW))
        return cls(_scalar(group["lr"]), _scalar(beta1), _scalar(beta2), group["eps"], _scalar(group["weight_decay"]),
                   decoupled, group.get("amsgrad", False), group.get("maximize", False))

    @classmethod
    def of_fused(cls, optimizer, group):
        """DeepSpeed FusedAdam (CUDA or CPU kernel): ``adam_w_mode`` on the optimizer, decay applied when > 0."""
        beta1, beta2 = group["betas"]
        wd = float(group["weight_decay"])
        return cls(group["lr"], beta1, beta2, group["eps"], wd if wd > 0 else 0.0, bool(optimizer.adam_w_mode),
                   bias_correction=group.get("bias_correction", True))


def _scalar(x):
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def adam_moments(rule, t, thetas, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs=None, grad_scale=1.0):
    """The next Adam/AdamW step of a list of tensors as ``(m, d, step)``: the optimizer's next weights are
    ``theta * rule.decay - step * m / d`` (``m``: the next first moment, ``d``: its denominator).

    Lists of same-shaped tensors, all of one param group with step count ``t`` (steps
    taken so far). ``grads``: the accumulated window gradients (``None``: estimate the
    gradient by the bias-corrected first moment); ``grad_scale``: ``a / n``;
    ``exp_avgs``/``exp_avg_sqs``: the moments (``None`` before the first step). Nothing
    passed in is modified. Multi-tensor (``torch._foreach_*``) ops, six passes over the
    weights' size (eight with L2 decay). Returns ``None`` when there is nothing to predict from.

    ``u = step * m / d`` equals ``lr / (1 - b1^(t+1)) * m / (sqrt(v / (1 - b2^(t+1))) + eps)``:
    with ``c = sqrt(1 - b2^(t+1))``, ``d = sqrt(v) + eps * c`` and ``step = lr * c / (1 - b1^(t+1))``.
    """
    b1, b2 = rule.beta1, rule.beta2
    if grads is None:
        if exp_avgs is None or t < 1:
            return None
        g, scale = exp_avgs, (1.0 / (1.0 - b1**t) if rule.bias_correction else 1.0)
    else:
        g = [x if x.dtype == torch.float32 else x.float() for x in grads]
        scale = -grad_scale if rule.maximize else grad_scale
        if rule.l2:
            g = torch._foreach_mul(g, scale)
            torch._foreach_add_(g, thetas, alpha=rule.weight_decay)
            scale = 1.0
    if exp_avgs is None:
        m = torch._foreach_mul(g, (1.0 - b1) * scale)
        v = torch._foreach_mul(g, g)
        torch._foreach_mul_(v, (1.0 - b2) * scale * scale)
    else:
        m = torch._foreach_mul(exp_avgs, b1)
        torch._foreach_add_(m, g, alpha=(1.0 - b1) * scale)
        v = torch._foreach_mul(exp_avg_sqs, b2)
        torch._foreach_addcmul_(v, g, g, value=(1.0 - b2) * scale * scale)
    if rule.amsgrad and max_exp_avg_sqs is not None:
        v = torch._foreach_maximum(max_exp_avg_sqs, v)
    bc1 = 1.0 - b1**(t + 1) if rule.bias_correction else 1.0
    c = math.sqrt(1.0 - b2**(t + 1)) if rule.bias_correction else 1.0
    torch._foreach_sqrt_(v)
    torch._foreach_add_(v, rule.eps * c)
    return m, v, rule.lr * c / bc1


def adam_update(rule, t, theta, grad, exp_avg, exp_avg_sq, max_exp_avg_sq=None, grad_scale=1.0):
    """``u`` with next weights ``theta * rule.decay - u`` for one tensor (see :func:`adam_moments`), or ``None``."""

    def one(x):
        return None if x is None else [x]

    out = adam_moments(rule, t, [theta], one(grad), one(exp_avg), one(exp_avg_sq), one(max_exp_avg_sq), grad_scale)
    if out is None:
        return None
    (m, ), (d, ), step = out
    return m.div_(d).mul_(step)


def _chunks(tensor, size=CHUNK):
    """Flat chunk views of a large contiguous tensor; a small or non-contiguous tensor is one chunk (itself)."""
    if tensor.numel() <= size or not tensor.is_contiguous():
        return [tensor]
    flat = tensor.view(-1)
    return [flat.narrow(0, s, min(size, flat.numel() - s)) for s in range(0, flat.numel(), size)]


def _flat(tensor):
    return tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1)


class _Slot:
    """One tensor the optimizer steps (the master), its state and group, and where the forward reads it.

    ``grad()``: the accumulated window gradient in the master's shape, or ``None``.
    ``target``: the low-precision tensor the forward reads (``None``: the master itself).
    """

    __slots__ = ("master", "optimizer", "group_index", "rule_of", "grad", "target", "sample")

    def __init__(self, master, optimizer, group, rule_of, grad, target=None):
        self.master = master
        self.optimizer = optimizer
        # The group by position, not the dict: ``optimizer.load_state_dict`` (a checkpoint load) replaces the
        # param-group dicts, and the LR scheduler then sets the learning rate on the new ones.
        self.group_index = next(i for i, g in enumerate(optimizer.param_groups) if g is group)
        self.rule_of = rule_of
        self.grad = grad
        self.target = target
        self.sample = None  # error telemetry: sum of predicted deltas on the sampled coordinates

    @property
    def group(self):
        return self.optimizer.param_groups[self.group_index]

    def state(self, steps):
        """``(t, exp_avg, exp_avg_sq, max_exp_avg_sq)``; ``steps`` caches per-group step counts for one prediction."""
        state = self.optimizer.state.get(self.master)
        if not state or "exp_avg" not in state:
            return 0, None, None, None
        if self.rule_of == AdamRule.of_fused:
            # FusedAdam advances only the step of the last parameter of a group it steps and uses that count for
            # the whole group; the others keep their initial count. The group's step is therefore the largest.
            key = id(self.group)
            if key not in steps:
                states = self.optimizer.state
                steps[key] = max(int(_scalar(states[p].get("step", 0))) for p in self.group["params"] if p in states)
            step = steps[key]
        else:
            step = int(_scalar(state.get("step", 0)))
        return step, state["exp_avg"], state["exp_avg_sq"], state.get("max_exp_avg_sq")

    def rule(self):
        return self.rule_of(self.optimizer, self.group)


class LookAhead:
    """Predict-forward-restore for one stage (see the module docstring for the contract)."""

    def __init__(self, slots, restore, kind):
        self.slots = slots
        self.restore = restore
        self.kind = kind
        self.predicted_forwards = 0
        self.nonfinite_chunks = 0
        self.seconds = 0.0
        self.error_sum = 0.0
        self.error_windows = 0
        self._window = 0  # local steps seen: the index of the open window
        self._crossings = 0  # crossing forwards predicted in the open window, if it is sampled (error telemetry)
        self._sq_sum = 0.0
        self._before = None
        self.active = False  # True only while a crossing forward runs on predicted weights

    # -- the forward ---------------------------------------------------------------
    @contextmanager
    def applied(self, window_fill, window):
        """Run the body on weights predicted from ``window_fill`` of ``window`` backward passes; the real weights
        are back on exit, whatever happens."""
        began = time.perf_counter()
        scale = None if window_fill <= 0 else window / window_fill
        undo = []
        try:
            self.active = True
            self._apply(scale, undo)
            self.seconds += time.perf_counter() - began
            yield
        finally:
            began = time.perf_counter()
            try:
                self._restore(scale, undo)
            finally:
                self.active = False
                self.seconds += time.perf_counter() - began
        self.predicted_forwards += 1
        if self._sampled:
            self._crossings += 1

    @property
    def _sampled(self):
        """Whether the open window's prediction error is measured (one window in :data:`ERROR_EVERY`)."""
        return self._window % ERROR_EVERY == 0

    def _batches(self, scale):
        """The prediction, batch by batch: ``(rule, items, (m, d, step))`` with ``items`` ``[(slot, offset, theta chunk,
        target chunk or None), ...]`` and their next step (:func:`adam_moments`; non-finite ones dropped, counted).

        Chunks of the slots are grouped by param group, step count and what is known (state,
        gradient), and cut into batches of at most :data:`BATCH` elements, so temporaries
        stay bounded. Deterministic: the same inputs give the same batches and updates.
        """
        groups, steps, rules = {}, {}, {}
        for slot in self.slots:
            t, m, v, vmax = slot.state(steps)
            grad = slot.grad() if scale is not None else None
            if grad is None and m is None:
                continue  # nothing to predict from
            key = (id(slot.group), t, m is not None, grad is not None, vmax is not None, slot.target is None)
            if key not in groups:
                if id(slot.group) not in rules:
                    rules[id(slot.group)] = slot.rule()
                groups[key] = (rules[id(slot.group)], t, [])
            thetas = _chunks(slot.master)
            none = [None] * len(thetas)
            parts = [none if x is None else _chunks(x) for x in (grad, m, v, vmax, slot.target)]
            offset = 0
            for theta, *rest in zip(thetas, *parts):
                groups[key][2].append((slot, offset, theta, *rest))
                offset += theta.numel()
        for rule, t, chunks in groups.values():
            batch, size = [], 0
            for chunk in chunks:
                if batch and size + chunk[2].numel() > BATCH:
                    yield self._predict(rule, t, batch, scale)
                    batch, size = [], 0
                batch.append(chunk)
                size += chunk[2].numel()
            if batch:
                yield self._predict(rule, t, batch, scale)

    def _predict(self, rule, t, batch, scale):
        """One batch: ``(rule, items, (m, d, step))`` (see :meth:`_batches` and :func:`adam_moments`)."""

        def column(i):
            values = [c[i] for c in batch]
            return None if values[0] is None else values

        grads = column(3) if scale is not None else None
        m, d, step = adam_moments(rule, t, column(2), grads, column(4), column(5), column(6), scale or 1.0)
        items = [(c[0], c[1], c[2], c[7]) for c in batch]
        # A finite gradient (and state) gives a finite update; check the gradient (or the moment standing in for it).
        finite = torch.isfinite(torch.stack(torch._foreach_norm(grads if grads is not None else column(4))))
        if not bool(finite.all()):
            keep = finite.tolist()
            self.nonfinite_chunks += keep.count(False)
            items = [x for x, k in zip(items, keep) if k]
            m = [x for x, k in zip(m, keep) if k]
            d = [x for x, k in zip(d, keep) if k]
        return rule, items, (m, d, step)

    def _recomputes(self, rule, items):
        return items[0][3] is None and not (self.restore == "copy" or rule.l2)

    @torch.no_grad()
    def _apply(self, scale, undo):
        for rule, items, (m, d, step) in self._batches(scale):
            if not items:
                continue
            thetas = [x[2] for x in items]
            if self._sampled:
                self._sample(rule, items, m, d, step)
            if items[0][3] is not None:  # low-precision weights the forward reads; the masters stay real
                pred = torch._foreach_mul(thetas, rule.decay)
                torch._foreach_addcdiv_(pred, m, d, -step)
                targets = [x[3] for x in items]
                torch._foreach_copy_(targets, pred)
                undo.append(("master", thetas, targets))
                continue
            if self._recomputes(rule, items):
                undo.append(("recompute", thetas, None))
            else:
                undo.append(("copy", thetas, [x.clone() for x in thetas]))
            if rule.decay != 1.0:
                torch._foreach_mul_(thetas, rule.decay)
            torch._foreach_addcdiv_(thetas, m, d, -step)

    @torch.no_grad()
    def _restore(self, scale, undo):
        recompute = False
        for how, thetas, other in undo:
            if how == "master":
                torch._foreach_copy_(other, thetas)  # the real master, rounded as DeepSpeed keeps the weights
            elif how == "copy":
                torch._foreach_copy_(thetas, other)
            else:
                recompute = True
        if not recompute:
            return
        # The same inputs (moments, step, lr, window gradient) give the same batches and update: undo it.
        for rule, items, (m, d, step) in self._batches(scale):
            if items and self._recomputes(rule, items):
                thetas = [x[2] for x in items]
                torch._foreach_addcdiv_(thetas, m, d, step)
                if rule.decay != 1.0:
                    torch._foreach_div_(thetas, rule.decay)

    # -- error telemetry ------------------------------------------------------------
    def _sample(self, rule, items, m, d, step):
        """Add this forward's predicted deltas on the sampled coordinates to each slot's running sum."""
        stride = ERROR_STRIDE
        delta = torch._foreach_div([_flat(x)[::stride] for x in m], [_flat(x)[::stride] for x in d])
        torch._foreach_mul_(delta, -step)
        if rule.decay != 1.0:
            torch._foreach_add_(delta, [_flat(x[2])[::stride] for x in items], alpha=rule.decay - 1.0)
        sums = []
        for (slot, offset, theta, _), x in zip(items, delta):
            if slot.sample is None:
                slot.sample = torch.zeros(-(-slot.master.numel() // stride), dtype=torch.float32,
                                          device=theta.device)
            sums.append(slot.sample.narrow(0, offset // stride, x.numel()))
        torch._foreach_add_(sums, delta)
        self._sq_sum += float(torch.stack(torch._foreach_norm(delta)).pow(2).sum())

    @torch.no_grad()
    def before_step(self):
        """Before a local step: remember the sampled coordinates of the real weights (if a crossing forward ran)."""
        if self._crossings:
            self._before = [_flat(s.master)[::ERROR_STRIDE].float().clone() for s in self.slots]

    @torch.no_grad()
    def after_step(self):
        """After a local step: fold the window's prediction error into the running mean, start a new window."""
        if self._before is not None:
            actual_sq = cross = 0.0
            for slot, before in zip(self.slots, self._before):
                actual = _flat(slot.master)[::ERROR_STRIDE].float() - before  # never in place: a view of the weights
                actual_sq += float(actual.pow(2).sum())
                if slot.sample is not None:
                    cross += float(torch.dot(slot.sample, actual))
            j = self._crossings
            if actual_sq > 0.0:
                mean_sq = max(0.0, (self._sq_sum - 2.0 * cross + j * actual_sq) / j)
                self.error_sum += math.sqrt(mean_sq / actual_sq)
                self.error_windows += 1
        self._before = None
        self._crossings = 0
        self._sq_sum = 0.0
        self._window += 1
        for slot in self.slots:
            slot.sample = None

    # -- tests and diagnostics -------------------------------------------------------
    @torch.no_grad()
    def predict_next(self, window_fill, window):
        """The predicted next master weights (new tensors, one per slot); nothing is changed."""
        scale = None if window_fill <= 0 else window / window_fill
        out = {id(slot): slot.master.detach().clone() for slot in self.slots}
        for rule, items, (m, d, step) in self._batches(scale):
            for (slot, offset, theta, _), mc, dc in zip(items, m, d):
                pred = theta.mul(rule.decay).addcdiv_(mc, dc, value=-step)
                _flat(out[id(slot)]).narrow(0, offset, theta.numel()).copy_(_flat(pred))
        return [out[id(slot)] for slot in self.slots]

    def masters(self):
        """The tensors the optimizer steps, in slot order (the real weights)."""
        return [s.master for s in self.slots]

    def stats(self):
        return {
            "enabled": True,
            "optimizer": self.kind,
            "restore": self.restore if self.slots and self.slots[0].target is None else "master",
            "predicted_forwards": self.predicted_forwards,
            "prediction_error": self.error_sum / self.error_windows if self.error_windows else None,
            "error_windows": self.error_windows,
            "error_every": ERROR_EVERY,
            "nonfinite_chunks": self.nonfinite_chunks,
            "seconds": self.seconds,
        }


# -- building the slots of an engine's optimizer ------------------------------------------
def _rule_of(optimizer):
    """The rule reader for an inner optimizer, or ``None`` if it is not in the Adam family we predict."""
    try:
        from deepspeed.ops.adam import FusedAdam
    except ImportError:  # pragma: no cover - DeepSpeed always ships it
        FusedAdam = ()
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except ImportError:  # pragma: no cover
        DeepSpeedCPUAdam = ()
    if DeepSpeedCPUAdam and isinstance(optimizer, DeepSpeedCPUAdam):
        return None
    if FusedAdam and isinstance(optimizer, FusedAdam):
        return AdamRule.of_fused
    if isinstance(optimizer, torch.optim.Adam):  # AdamW subclasses Adam
        return AdamRule.of_torch
    return None


def _torch_slots(optimizer, aliases):
    """fp32 parameters stepped by a torch.optim / FusedAdam optimizer through ``.data`` aliases."""
    rule_of = _rule_of(optimizer)
    param_of = {id(alias): p for p, alias in aliases.pairs}
    slots = []
    for group in optimizer.param_groups:
        for alias in group["params"]:
            p = param_of[id(alias)]
            if alias.dtype != torch.float32:
                return None, f"parameters in {alias.dtype} without DeepSpeed's bf16 optimizer"
            slots.append(_Slot(alias, optimizer, group, rule_of, grad=lambda p=p: p.grad))
    return slots, None


def lookahead_for_torch_optimizer(optimizer, aliases, restore="recompute"):
    """A :class:`LookAhead` over fp32 parameters stepped by ``optimizer`` through ``aliases``
    (:class:`~ds_paci.core.local_step.ParamAliases`), or ``None`` if it is not Adam/AdamW.

    For programs that run stage-local steps outside the engine (the single-process replay).
    """
    if _rule_of(optimizer) is None:
        return None
    slots, reason = _torch_slots(optimizer, aliases)
    return None if reason else LookAhead(slots, restore, "torch")


def _bf16_slots(opt):
    """DeepSpeed's BF16_Optimizer: fp32 master partitions, fp32 accumulated gradients, bf16 weights."""
    inner = opt.optimizer
    rule_of = _rule_of(inner)
    slots = []
    for i, group in enumerate(inner.param_groups):
        pid = dist.get_rank(group=opt.real_dp_process_group[i])
        grad = opt.fp32_groups_gradient_flat_partition[i]
        slots.append(_Slot(opt.fp32_groups_flat_partition[i], inner, group, rule_of, grad=lambda g=grad: g,
                           target=opt.bf16_partitioned_groups[i][pid]))
    return slots, None


def _zero_partition_grad(opt, i, partition):
    """This rank's partition of group ``i``'s flat gradient, assembled from the local (unreduced) parameter grads."""
    flat = opt.bit16_groups_flat[i]
    start = partition.storage_offset() - flat.storage_offset()
    size = partition.numel()
    out = None
    for param, meta, offset in zip(opt.round_robin_bit16_groups[i], opt.round_robin_bit16_meta[i],
                                   opt.round_robin_bit16_offsets[i]):
        lo, hi = max(offset, start), min(offset + meta.numel(), start + size)
        if lo >= hi:
            continue
        grad = opt.get_gradient_for_reduction(param)
        if grad is None:
            continue
        if out is None:
            out = torch.zeros(size, dtype=torch.float32, device=partition.device)
        out.narrow(0, lo - start, hi - lo).copy_(_flat(grad).narrow(0, lo - offset, hi - lo))
    return out


def _zero_slots(opt):
    """ZeRO stage 1: this rank's fp32 master partition, its optimizer state, its slice of the flat weights."""
    if getattr(opt, "cpu_offload", False):
        return None, "ZeRO with CPU offload (the optimizer state lives with DeepSpeedCPUAdam)"
    if getattr(opt, "partition_gradients", False):
        return None, "ZeRO stage 2 or above"
    problem = compat.zero_lookahead_problem(opt)
    if problem:
        return None, problem
    inner = opt.optimizer
    rule_of = _rule_of(inner)
    slots = []
    for i, group in enumerate(inner.param_groups):
        pid = dist.get_rank(group=opt.real_dp_process_group[i])
        partition = opt.parallel_partitioned_bit16_groups[i][pid]
        slots.append(_Slot(opt.single_partition_of_fp32_groups[i], inner, group, rule_of,
                           grad=lambda i=i, part=partition: _zero_partition_grad(opt, i, part), target=partition))
    return slots, None


def _inner_optimizer(opt):
    if isinstance(opt, (BF16_Optimizer, DeepSpeedZeroOptimizer)):
        return opt.optimizer
    return opt


def make_lookahead(engine, enabled, restore="recompute"):
    """A :class:`LookAhead` for ``engine``'s stage, or ``None`` (disabled, or an optimizer we cannot predict).

    When the optimizer is not supported, one line (from rank 0) says so and training
    continues without look-ahead.
    """
    if not enabled:
        return None
    if restore not in RESTORE_MODES:
        raise ValueError(f"restore must be one of {RESTORE_MODES}, got {restore!r}")
    opt = engine.optimizer
    inner = _inner_optimizer(opt)
    reason = None
    slots = None
    if _rule_of(inner) is None:
        reason = (f"optimizer {type(inner).__name__} is not Adam/AdamW (torch.optim or DeepSpeed's FusedAdam); "
                  "the look-ahead predicts Adam-family steps only")
    elif isinstance(opt, BF16_Optimizer):
        slots, reason = _bf16_slots(opt)
        kind = "bf16"
    elif isinstance(opt, DeepSpeedZeroOptimizer):
        slots, reason = _zero_slots(opt)
        kind = "zero1"
    elif getattr(engine, "_aliases", None) is not None:
        slots, reason = _torch_slots(opt, engine._aliases)
        kind = "torch"
    else:
        reason = f"optimizer wrapper {type(opt).__name__} is not supported"
    if reason is not None:
        if engine.global_rank == 0:
            logger.warning(f"ds_paci: stage {engine.stage_id}: look-ahead off: {reason}; training continues without it "
                           "(set \"paci\": {\"lookahead\": false} to silence this line)")
        return None
    return LookAhead(slots, restore, kind)
