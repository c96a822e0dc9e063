"""Emulated accelerator time.

On a CPU-only machine the interesting part of a pipeline schedule — stages
overlapping their device work — cannot be observed with real compute, because a
few cores run every stage. :class:`EmulatedDeviceTime` adds a fixed, CPU-free wait
instead: each pipeline layer followed by one spends ``f`` extra seconds in its
forward and ``2f`` in its backward, as if it ran on its own device. Timings,
throughputs and bubbles measured with it are **emulated**, not hardware results,
and must be reported as such.
"""

from __future__ import annotations

import time

import torch

__all__ = ["EmulatedDeviceTime"]


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
