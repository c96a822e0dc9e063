"""Emulated accelerator time.

On a CPU-only machine the interesting part of a pipeline schedule — stages
overlapping their device work — cannot be observed with real compute, because a
few cores run every stage. :class:`EmulatedDeviceTime` adds a fixed, CPU-free wait
instead: each pipeline layer followed by one spends ``f`` extra seconds in its
forward and ``2f`` in its backward, as if it ran on its own device. Timings,
throughputs and bubbles measured with it are **emulated**, not hardware results,
and must be reported as such.

:class:`EmulatedSplitTime` splits the backward the way zero-bubble schedules do: ``B`` seconds on the activation
path (paid by an input-gradient pass) and ``W`` seconds on a path to a parameter only (paid by a weight-gradient
pass), so an engine that runs one full backward pays ``B + W`` there and one that splits it pays each in its own pass.
"""

from __future__ import annotations

import time
from collections import Counter

import torch

__all__ = ["EmulatedDeviceTime", "EmulatedSplitTime", "deferred_split_wait"]


class _SleepIdentity(torch.autograd.Function):
    """Identity whose forward sleeps ``seconds`` and whose backward sleeps ``2 * seconds``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        time.sleep(seconds)
        # A copy rather than `x` itself or a view: later in-place use of the output
        # (e.g. by a pipeline engine reusing buffers) then cannot trip autograd's
        # checks on views created inside a custom Function.
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(2 * ctx.seconds)
        return grad, None


class EmulatedDeviceTime(torch.nn.Module):
    """A pipeline layer that emulates device time: forward waits ``seconds``, backward ``2 * seconds``.

    ``forward(x)`` returns a tensor equal to ``x`` and the backward passes the
    gradient through unchanged; only wall-clock time is added, with ``time.sleep``,
    which uses no CPU. ``seconds == 0`` makes it an exact identity with no sleep.
    Any timing produced with a non-zero ``seconds`` is *emulated* device time.

    The class name deliberately does not contain "Block", so DeepSpeed's
    ``partition_method="type:Block"`` does not count it as a transformer block.
    """

    def __init__(self, seconds: float):
        super().__init__()
        seconds = float(seconds)
        if not seconds >= 0.0:
            raise ValueError(f"emulated device time must be >= 0 seconds, got {seconds!r}")
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.seconds == 0.0:
            return x
        return _SleepIdentity.apply(x, self.seconds)

    def extra_repr(self) -> str:
        return f"seconds={self.seconds} (emulated: forward {self.seconds}s, backward {2 * self.seconds}s)"


def _wait(seconds: float) -> None:
    if seconds > 0:
        time.sleep(seconds)


class _WaitOnActivation(torch.autograd.Function):
    """Identity on the activation path: forward waits ``forward`` seconds, backward ``input_grad`` seconds."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, forward: float, input_grad: float, waits: Counter) -> torch.Tensor:
        ctx.input_grad, ctx.waits = input_grad, waits
        waits["forward"] += 1
        _wait(forward)
        return x.clone()  # a copy, as in _SleepIdentity

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.waits["input_grad"] += 1
        _wait(ctx.input_grad)
        return grad, None, None, None


class _WaitOnWeight(torch.autograd.Function):
    """Identity on a parameter: backward waits ``weight_grad`` seconds and passes a zero gradient on."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, weight_grad: float, waits: Counter) -> torch.Tensor:
        ctx.weight_grad, ctx.waits = weight_grad, waits
        return anchor.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.waits["weight_grad"] += 1
        _wait(ctx.weight_grad)
        return torch.zeros_like(grad), None, None


class EmulatedSplitTime(torch.nn.Module):
    """A pipeline layer whose emulated device time is split like a zero-bubble backward: ``F``, ``B``, ``W`` seconds.

    ``forward(x)`` waits ``forward`` seconds and returns ``x`` (a copy; values unchanged). Its backward has two
    parts that autograd reaches separately:

    * on the activation path (``x`` -> output): waits ``input_grad`` seconds (``B``). A pass that computes only the
      gradient of the stage input (``torch.distributed.pipelining``'s ``stage_backward_input``) pays it;
    * on the path to :attr:`anchor`, a one-element parameter fixed at zero (added to the output, so the values do not
      change): waits ``weight_grad`` seconds (``W``) and hands the anchor a zero gradient, so no optimizer ever
      moves it. A pass that computes only parameter gradients (``stage_backward_weight``) pays it.

    A full backward (DeepSpeed's engines, ``loss.backward()``) pays ``B + W``. Which pass runs a node is autograd's
    decision, not this layer's: torch's first pipeline stage, whose input needs no gradient, runs its whole
    backward in the weight pass and so pays ``B + W`` there. :attr:`waits` counts the waits per kind
    (``forward``, ``input_grad``, ``weight_grad``). Zero seconds still run the same graph (and count), without
    sleeping. Any timing produced with non-zero seconds is *emulated* device time.
    """

    def __init__(self, forward: float, input_grad: float, weight_grad: float):
        super().__init__()
        values = (float(forward), float(input_grad), float(weight_grad))
        if not all(v >= 0.0 for v in values):
            raise ValueError(f"emulated device times must be >= 0 seconds, got F, B, W = {values!r}")
        self.seconds = values
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # 1-dim: DeepSpeed views parameters as bytes to broadcast them
        self.waits = Counter()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f, b, w = self.seconds
        return _WaitOnActivation.apply(x, f, b, self.waits) + _WaitOnWeight.apply(self.anchor, w, self.waits)

    def extra_repr(self) -> str:
        f, b, w = self.seconds
        return f"F={f}s, B={b}s, W={w}s (emulated: forward F, input gradient B, weight gradient W)"


class _WaitDeferred(torch.autograd.Function):
    """Identity: forward waits ``F``; backward waits ``B``, then hands a wait of ``W`` to ``defer``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, forward: float, input_grad: float, weight_grad: float, defer) -> torch.Tensor:
        ctx.input_grad, ctx.weight_grad, ctx.defer = input_grad, weight_grad, defer
        _wait(forward)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        _wait(ctx.input_grad)
        weight_grad = ctx.weight_grad
        ctx.defer(lambda: _wait(weight_grad))
        return grad, None, None, None, None


def deferred_split_wait(x: torch.Tensor, forward: float, input_grad: float, weight_grad: float, defer=None):
    """``x`` unchanged, with emulated ``F``, ``B``, ``W`` for a program that splits its backward *itself*.

    Forward waits ``forward`` seconds; the backward waits ``input_grad`` seconds and then calls ``defer(fn)`` with
    ``fn`` waiting ``weight_grad`` seconds: ``defer`` decides when the weight part is paid. The default runs it at
    once (one backward pays ``B + W``). Megatron-DeepSpeed's ZB-H1 keeps its weight-gradient work in a queue
    (``WeightGradStore.put``: run now in a full backward, kept for the next ``WeightPass`` in a backward-only
    pass); handing ``fn`` to that queue makes the emulated ``W`` move exactly as the real weight gradients do.
    For measurements only: the times are emulated.
    """
    return _WaitDeferred.apply(x, float(forward), float(input_grad), float(weight_grad),
                               defer if defer is not None else (lambda fn: fn()))
