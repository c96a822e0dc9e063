"""The look-ahead's optimizer rules: for each optimizer type it predicts, that optimizer's next step.

Public contract
---------------
* :func:`rule_reader` ``(optimizer)`` returns ``(reader, None)`` for an optimizer of one of
  the exact types below, or ``(None, reason)``. ``reader(optimizer, group)`` builds the rule
  of one param group from the group's hyper-parameters *now* (the learning rate the
  scheduler set for the next step).
* A rule predicts the optimizer's next step of a list of tensors of one param group as
  ``(decay, alpha, u)``: the next weights are ``theta * decay - alpha * u``, one ``u`` (a
  new tensor) per ``theta``. Given the complete window's gradient (``grad_scale`` 1) the
  prediction is the optimizer's own step up to rounding (tests: <= 1e-6).
* Rule attributes: ``chunked`` (element-wise: tensors may be cut into chunks and batched),
  ``recomputable`` (``u`` does not depend on ``theta``, so the same ``u`` can be recomputed
  to undo the prediction), ``steps_without_grad`` (the optimizer steps a parameter whose
  ``grad`` is ``None`` as if its gradient were zero; ``torch.optim`` skips it).

Exact types only: a subclass can step differently (its own ``step``, ``_init_group``, ...), so
it is not predicted. The types:

* ``torch.optim.Adam`` / ``AdamW`` and DeepSpeed's ``FusedAdam`` (:class:`AdamRule`);
* ``torch.optim.SGD``, with momentum, dampening, Nesterov, weight decay, maximize (:class:`SGDRule`);
* ``torch.optim.Muon`` (:class:`MuonRule`): momentum (Nesterov or not), Newton-Schulz
  orthogonalisation by torch's own function, ``adjust_lr_fn``, decoupled weight decay;
* DeepSpeed's ``MuonWithAuxAdam`` (the optimizer of ``"optimizer": {"type": "Muon"}``):
  :class:`DeepSpeedMuonRule` for its ``use_muon`` groups (DeepSpeed's own ``muon_update``),
  :class:`AdamRule` for the others (its auxiliary FusedAdam, or its inline Adam).

The window's gradient
---------------------
``grads`` are the open window's accumulated gradients (each backward scaled by ``1/a``) and
``grad_scale = coef * a / n`` (``coef``: the clip coefficient, 1 without clipping); ``grads
is None`` (``n = 0``) estimates the gradient from the optimizer's state: Adam's bias-corrected
first moment, SGD's momentum buffer (``buf * (1 - momentum) / (1 - dampening)``), Muon's
momentum buffer (Newton-Schulz is invariant to its scale). With no state either, a tensor is
not predicted.
"""

import math
import sys

import torch

__all__ = ["AdamRule", "SGDRule", "MuonRule", "DeepSpeedMuonRule", "adam_moments", "adam_update", "rule_reader",
           "SUPPORTED"]

SUPPORTED = ("torch.optim Adam, AdamW, SGD and Muon, DeepSpeed's FusedAdam and its Muon (MuonWithAuxAdam), "
             "exact types")
_DS_MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"


def _scalar(x):
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def _state(optimizer, master):
    return optimizer.state.get(master) or {}


# -- Adam ---------------------------------------------------------------------------------
class AdamRule:
    """The hyper-parameters of one Adam/AdamW param group, read when a prediction is made."""

    chunked = True
    steps_without_grad = False
    __slots__ = ("lr", "beta1", "beta2", "eps", "weight_decay", "decoupled", "amsgrad", "maximize",
                 "bias_correction", "group_step")

    def __init__(self, lr, beta1, beta2, eps, weight_decay, decoupled, amsgrad=False, maximize=False,
                 bias_correction=True, group_step=False):
        self.lr = float(lr)
        self.beta1 = float(beta1)
        self.beta2 = float(beta2)
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        self.decoupled = bool(decoupled)
        self.amsgrad = bool(amsgrad)
        self.maximize = bool(maximize)
        self.bias_correction = bool(bias_correction)
        self.group_step = bool(group_step)  # FusedAdam: one step count for the whole group (see gather)

    @property
    def decay(self):
        """Factor on ``theta`` of the decoupled weight decay (1.0 without it)."""
        return 1.0 - self.lr * self.weight_decay if self.decoupled and self.weight_decay else 1.0

    @property
    def l2(self):
        """Adam's coupled (L2) weight decay: ``wd * theta`` joins the gradient."""
        return not self.decoupled and self.weight_decay != 0.0

    @property
    def recomputable(self):
        return not self.l2

    @classmethod
    def of_torch(cls, optimizer, group):
        """torch.optim.Adam / AdamW (AdamW is Adam with ``decoupled_weight_decay``)."""
        beta1, beta2 = group["betas"]
        decoupled = group.get("decoupled_weight_decay", type(optimizer) is torch.optim.AdamW)
        return cls(_scalar(group["lr"]), _scalar(beta1), _scalar(beta2), group["eps"], _scalar(group["weight_decay"]),
                   decoupled, group.get("amsgrad", False), group.get("maximize", False))

    @classmethod
    def of_fused(cls, optimizer, group):
        """DeepSpeed FusedAdam (CUDA or CPU kernel): ``adam_w_mode`` on the optimizer, decay applied when > 0."""
        beta1, beta2 = group["betas"]
        wd = float(group["weight_decay"])
        return cls(group["lr"], beta1, beta2, group["eps"], wd if wd > 0 else 0.0, bool(optimizer.adam_w_mode),
                   bias_correction=group.get("bias_correction", True), group_step=True)

    @classmethod
    def of_inline(cls, optimizer, group):
        """The inline Adam of DeepSpeed's MuonWithAuxAdam (no FusedAdam): bias-corrected, ``adam_w_mode`` on it."""
        beta1, beta2 = group["betas"]
        return cls(group["lr"], beta1, beta2, group["eps"], group["weight_decay"], bool(optimizer.adam_w_mode))

    def gather(self, optimizer, master, group, has_grad, cache):
        """``(key, (exp_avg, exp_avg_sq, max_exp_avg_sq))`` for one tensor, or ``None`` (nothing to predict from)."""
        state = _state(optimizer, master)
        if "exp_avg" not in state:
            return None if not has_grad else ((0, False, False), (None, None, None))
        if self.group_step:
            # FusedAdam advances only the step of the last parameter of a group it steps and uses that count for
            # the whole group; the others keep their initial count. The group's step is therefore the largest.
            key = id(group)
            if key not in cache:
                states = optimizer.state
                cache[key] = max(int(_scalar(states[p].get("step", 0))) for p in group["params"] if p in states)
            t = cache[key]
        else:
            t = int(_scalar(state.get("step", 0)))
        vmax = state.get("max_exp_avg_sq") if self.amsgrad else None
        return (t, True, vmax is not None), (state["exp_avg"], state["exp_avg_sq"], vmax)

    def update(self, key, thetas, grads, states, grad_scale):
        m, d, step = adam_moments(self, key[0], thetas, grads, *states, grad_scale=grad_scale)
        torch._foreach_div_(m, d)
        return self.decay, step, m


def adam_moments(rule, t, thetas, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs=None, grad_scale=1.0):
    """The next Adam/AdamW step of a list of tensors as ``(m, d, step)``: the optimizer's next weights are
    ``theta * rule.decay - step * m / d`` (``m``: the next first moment, ``d``: its denominator).

    Lists of same-shaped tensors, all of one param group with step count ``t`` (steps
    taken so far). ``grads``: the accumulated window gradients (``None``: estimate the
    gradient by the bias-corrected first moment); ``grad_scale``: ``coef * a / n``;
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


# -- SGD ----------------------------------------------------------------------------------
class SGDRule:
    """torch.optim.SGD: ``g += wd theta``; ``buf = momentum buf + (1 - dampening) g`` (the first step: ``buf = g``);
    ``u = g + momentum buf`` (Nesterov) or ``buf``; next weights ``theta - lr u``."""

    chunked = True
    steps_without_grad = False
    __slots__ = ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize")

    def __init__(self, lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False):
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.dampening = float(dampening)
        self.weight_decay = float(weight_decay)
        self.nesterov = bool(nesterov)
        self.maximize = bool(maximize)

    @classmethod
    def of_torch(cls, optimizer, group):
        return cls(_scalar(group["lr"]), _scalar(group["momentum"]), _scalar(group["dampening"]),
                   _scalar(group["weight_decay"]), group["nesterov"], group.get("maximize", False))

    @property
    def recomputable(self):
        return self.weight_decay == 0.0

    def gather(self, optimizer, master, group, has_grad, cache):
        buf = _state(optimizer, master).get("momentum_buffer") if self.momentum != 0.0 else None
        if not has_grad and buf is None:
            return None
        return (buf is not None, ), (buf, )

    def update(self, key, thetas, grads, states, grad_scale):
        (bufs, ) = states
        mu = self.momentum
        if grads is None:  # n = 0: the momentum buffer's steady state is (1 - dampening) g / (1 - momentum)
            g = torch._foreach_mul(bufs, (1.0 - mu) / (1.0 - self.dampening) if self.dampening < 1.0 else 1.0)
        else:
            g = torch._foreach_mul(grads, -grad_scale if self.maximize else grad_scale)
        if self.weight_decay != 0.0:
            torch._foreach_add_(g, thetas, alpha=self.weight_decay)
        if mu == 0.0:
            return 1.0, self.lr, g
        if bufs is None:
            buf = g if not self.nesterov else [x.clone() for x in g]  # torch: buf = clone(g), no dampening
        else:
            buf = torch._foreach_mul(bufs, mu)
            torch._foreach_add_(buf, g, alpha=1.0 - self.dampening)
        if not self.nesterov:
            return 1.0, self.lr, buf
        torch._foreach_add_(g, buf, alpha=mu)
        return 1.0, self.lr, g


# -- Muon ---------------------------------------------------------------------------------
class MuonRule:
    """torch.optim.Muon (2-D parameters): ``buf = lerp(buf, g, 1 - momentum)``; ``U = lerp(g, buf, momentum)``
    (Nesterov) or ``buf``; ``O = NS(U)`` by torch's own Newton-Schulz; next weights
    ``theta (1 - lr wd) - adjust_lr(lr, shape) O``. Not element-wise: each matrix is whole."""

    chunked = False
    recomputable = True
    steps_without_grad = False
    __slots__ = ("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps", "adjust_lr_fn")

    def __init__(self, lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn):
        self.lr = float(lr)
        self.weight_decay = float(weight_decay)
        self.momentum = float(momentum)
        self.nesterov = bool(nesterov)
        self.ns_coefficients = tuple(ns_coefficients)
        self.eps = eps
        self.ns_steps = ns_steps
        self.adjust_lr_fn = adjust_lr_fn

    @classmethod
    def of_torch(cls, optimizer, group):
        return cls(_scalar(group["lr"]), group["weight_decay"], group["momentum"], group["nesterov"],
                   group["ns_coefficients"], group["eps"], group["ns_steps"], group["adjust_lr_fn"])

    def gather(self, optimizer, master, group, has_grad, cache):
        buf = _state(optimizer, master).get("momentum_buffer")
        if not has_grad and buf is None:
            return None
        return (buf is not None, tuple(master.shape)), (buf, )

    def update(self, key, thetas, grads, states, grad_scale):
        from torch.optim import _muon
        (bufs, ) = states
        out = []
        for i, theta in enumerate(thetas):
            buf = None if bufs is None else bufs[i]
            g = buf if grads is None else grads[i].mul(grad_scale)
            b = torch.zeros_like(g) if buf is None else buf.clone()
            b.lerp_(g, 1.0 - self.momentum)
            u = g.lerp(b, self.momentum) if self.nesterov else b
            out.append(_muon._zeropower_via_newtonschulz(u, self.ns_coefficients, self.ns_steps, self.eps))
        alpha = _muon._adjust_lr(self.lr, self.adjust_lr_fn, torch.Size(key[1]))
        return 1.0 - self.lr * self.weight_decay, alpha, out


class DeepSpeedMuonRule:
    """The ``use_muon`` groups of DeepSpeed's MuonWithAuxAdam (fp32 parameters, no ZeRO): DeepSpeed's own
    ``muon_update`` (Nesterov momentum, Newton-Schulz by ``ns_method``, aspect-ratio scale) on copies of the
    gradient and momentum buffer; next weights ``theta (1 - lr wd) - lr O``. A parameter without a gradient is
    stepped with a zero one, as that optimizer does."""

    chunked = False
    recomputable = True
    steps_without_grad = True
    __slots__ = ("lr", "weight_decay", "momentum", "ns_method")

    def __init__(self, lr, weight_decay, momentum, ns_method):
        self.lr = float(lr)
        self.weight_decay = float(weight_decay)
        self.momentum = float(momentum)
        self.ns_method = ns_method

    def gather(self, optimizer, master, group, has_grad, cache):
        buf = _state(optimizer, master).get("momentum_buffer")
        if not has_grad and buf is None:
            return None
        # what the optimizer reads from the tensor it steps
        return (buf is not None, bool(getattr(master, "is_expert_group", False))), (buf, )

    def update(self, key, thetas, grads, states, grad_scale):
        muon_update = sys.modules[_DS_MUON_MODULE].muon_update  # the very function the optimizer's step calls
        (bufs, ) = states
        out = []
        for i, theta in enumerate(thetas):
            buf = torch.zeros_like(theta) if bufs is None else bufs[i].clone()
            g = buf.clone() if grads is None else grads[i].mul(grad_scale)  # muon_update writes into both
            u = muon_update(g, buf, beta=self.momentum, ns_method=self.ns_method, is_expert_group=key[1])
            out.append(u.reshape(theta.shape))
        return 1.0 - self.lr * self.weight_decay, self.lr, out


def _ds_muon_reader(optimizer, group):
    if group["use_muon"]:
        return DeepSpeedMuonRule(group["lr"], group["weight_decay"], group["momentum"], group.get("ns_method", "gram"))
    if optimizer.aux_optimizer is not None:
        return AdamRule.of_fused(optimizer.aux_optimizer, group)
    return AdamRule.of_inline(optimizer, group)


# -- which optimizer gets which rule -------------------------------------------------------
def _exact_types():
    """``{type: reader}`` of the optimizers predicted, and why another is not (see :func:`rule_reader`)."""
    types = {torch.optim.Adam: AdamRule.of_torch, torch.optim.AdamW: AdamRule.of_torch, torch.optim.SGD: SGDRule.of_torch}
    muon = getattr(torch.optim, "Muon", None)
    if muon is not None and _has_torch_newton_schulz():
        types[muon] = MuonRule.of_torch
    try:
        from deepspeed.ops.adam import FusedAdam
        types[FusedAdam] = AdamRule.of_fused
    except ImportError:  # pragma: no cover - DeepSpeed always ships it
        pass
    ds_muon = sys.modules.get(_DS_MUON_MODULE)  # imported by DeepSpeed when it builds that optimizer
    if ds_muon is not None and hasattr(ds_muon, "muon_update"):
        types[ds_muon.MuonWithAuxAdam] = _ds_muon_reader
    return types


def _has_torch_newton_schulz():
    try:
        from torch.optim import _muon
    except ImportError:  # pragma: no cover - torch without Muon
        return False
    return hasattr(_muon, "_zeropower_via_newtonschulz") and hasattr(_muon, "_adjust_lr")


def rule_reader(optimizer):
    """``(reader, None)`` for an optimizer the look-ahead predicts, else ``(None, reason)`` (one phrase)."""
    types = _exact_types()
    kind = type(optimizer)
    if kind in types:
        return types[kind], None
    base = next((t for t in kind.__mro__[1:] if t in types), None)  # the nearest predicted base class
    if base is not None:
        return None, (f"optimizer {kind.__name__} is a subclass of {base.__module__}.{base.__name__}; only the exact "
                      "types are predicted (a subclass may step differently)")
    if kind.__name__ in ("MuonWithAuxAdam", "Muon", "SingleDeviceMuon", "SingleDeviceMuonWithAuxAdam"):
        return None, (f"optimizer {kind.__module__}.{kind.__name__} is not predicted (of the Muon optimizers only "
                      f"torch.optim.Muon and {_DS_MUON_MODULE}.MuonWithAuxAdam are)")
    return None, f"optimizer {kind.__module__}.{kind.__name__} is not one the look-ahead predicts ({SUPPORTED})"
