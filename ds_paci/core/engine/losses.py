"""The end of a call on every rank: the loss each rank returns, the side channel, the stop check, the progress line.

:class:`CallLosses` is a part of :class:`~ds_paci.core.engine.pipeline_engine.PACIPipelineEngine` (a mixin: it reads the engine's
loss bookkeeping, its loss side channel and its telemetry); the contract it implements is the engine's: see the
return value of ``train_batch`` in :mod:`ds_paci.core.engine.pipeline_engine`.
"""

import math
from collections import OrderedDict

import torch
from deepspeed import comm as dist
from deepspeed.runtime.pipe.engine import TRAIN_BATCH_TIMER

from ..seam import deepspeed_internals as ds
from ..step.guard import PACINonFiniteError, stop_message
from ..program.actions import Kind
from .startup import emit


class CallLosses:
    """A part of the engine (see the module docstring)."""

    def _begin_losses(self):
        ds.reset_call_losses(self)

    def _finish_call(self):
        """End of a ``train_batch``/``drain`` call: the loss every rank returns, the side channel, the stop check."""
        self._loss_calls += 1
        self._loss_fresh = False
        if self.is_last_stage():
            computed = self._last_stage_loss()
            if computed is not None:
                self._last_loss = (computed, self._loss_calls)
                self._loss_fresh = True
                if not math.isfinite(float(computed)):
                    self.telemetry.nonfinite_losses += 1
            if self._channel.active:
                loss, origin = self._last_loss if self._last_loss is not None else (None, 0)
                extras = list((ds.additional_losses(self) or {}).values()) if self._loss_fresh else self._last_extras
                self._last_extras = extras
                self._channel.publish(loss, origin, extras)
        elif self._channel.active:
            if self.paci.drain_every_batch:
                self._watchdog.enter("the loss of the last stage (sync mode)", self._stream.ticks_emitted)
                try:
                    self._channel.wait_for(self._loss_calls)
                finally:
                    self._watchdog.idle()
            else:
                self._channel.poll()
            msg = self._channel.latest
            if (msg is not None and msg.origin_call > 0  # origin 0: the last stage had no value yet either
                    and (self._last_loss is None or self._last_loss[1] != msg.origin_call)):
                value = torch.tensor(msg.value, dtype=torch.float32, device=self.device)
                self._last_loss = (value, msg.origin_call)
                ds.set_additional_losses(self, self._named_additional(msg.extras))
        self._check_stop()
        if self._last_loss is None:
            loss = torch.tensor(math.nan, dtype=torch.float32, device=self.device)
        else:
            loss = self._last_loss[0].clone()
        ds.set_train_loss(self, loss)
        return loss

    _last_extras = ()

    def _last_stage_loss(self):
        """Mean loss (and additional losses) of the micro-batches completed in this call, averaged over DP; or None."""
        total_loss, total_additional, n = ds.call_losses(self)
        if not n or not torch.is_tensor(total_loss):
            return None
        with torch.no_grad():
            loss = (total_loss / n).detach().clone()
            extras = OrderedDict((k, (v / n).detach().clone()) for k, v in (total_additional or {}).items()
                                 if torch.is_tensor(v))
            if self.is_data_parallel and not extras:  # as DeepSpeed's _aggregate_total_loss reduces it
                dist.all_reduce(loss, group=self.grid.get_data_parallel_group())
                loss /= self.dp_world_size
            elif self.is_data_parallel:  # one reduce for the loss and the additional losses, as DeepSpeed does
                flat = torch.cat([loss.reshape(-1)] + [v.reshape(-1) for v in extras.values()])
                dist.all_reduce(flat, group=self.grid.get_data_parallel_group())
                flat /= self.dp_world_size
                loss = flat[:loss.numel()].clone().reshape(loss.shape)
                offset = loss.numel()
                for k, v in extras.items():
                    extras[k] = flat[offset:offset + v.numel()].clone().reshape(v.shape)
                    offset += v.numel()
        ds.set_additional_losses(self, extras or None)
        return loss

    def _named_additional(self, values):
        """Additional losses from the side channel, named as the module names them (as DeepSpeed's engine does)."""
        names = self.module.get_additional_losses()
        if not names or not values:
            return None
        return OrderedDict((name, torch.tensor(v, dtype=torch.float32, device=self.device))
                           for name, v in zip(names.keys(), values))

    def _check_stop(self):
        """Raise :class:`PACINonFiniteError` if this stage, or another stage of its pipeline, stops the run."""
        if self._stop_request is not None:
            step, count, limit = self._stop_request
            if self._channel.active:
                self._channel.announce_stop(step, count, limit)
            raise PACINonFiniteError(stop_message(self.stage_id, step, count, limit, self._describe_rank()))
        notice = self._channel.stop_notice() if self._channel.active else None
        if notice is not None:
            raise PACINonFiniteError(self._stop_text(notice))

    def _stop_text(self, notice):
        return stop_message(notice.stage, notice.step, notice.count, notice.limit, self._describe_rank())

    def _explain_wait(self, instruction):
        """Watchdog: what a rank stuck in ``instruction`` is waiting for."""
        notice = self._channel.sniff_stop() if self._channel.active else None
        if notice is not None:
            return "; " + self._stop_text(notice)
        kind = getattr(instruction, "kind", None)
        if kind in (Kind.SEND_ACT, Kind.RECV_GRAD):
            return (f"; it is waiting for stage {self.stage_id + 1}, which is stuck, dead or running a different "
                    "stream")
        if kind in (Kind.SEND_GRAD, Kind.RECV_ACT):
            return (f"; it is waiting for stage {self.stage_id - 1}, which is stuck, dead or running a different "
                    "stream")
        if kind in (Kind.STEP, Kind.TIED_POST, Kind.TIED_APPLY):
            return ("; it is stuck in its own local step (optimizer, or the gradient reduce with its data-parallel "
                    "replicas)")
        if isinstance(instruction, str) and instruction.startswith("the loss"):
            return f"; it is waiting for stage {self.num_stages - 1}, the last stage of its pipeline"
        if isinstance(instruction, str):
            return "; it is waiting for the peer named above"
        return "; it is stuck in its own computation (forward, backward or data loading), not waiting for a peer"

    def _report(self, loss):
        if self._loss_monitor is not None and self._loss_fresh:
            self._loss_monitor.write_events([("Train/Samples/train_loss", loss.item(), self.global_samples)])
        every = self.steps_per_print()
        if not every or self._calls % every:
            return
        if self.grid.data_parallel_id == 0:  # every stage's own line, from its own counters (shown: stdout)
            look = self._lookahead.stats() if self._lookahead is not None else None
            emit(self.telemetry.describe(look, self._calls))
        if self.is_last_stage() and self.grid.data_parallel_id == 0:
            elapsed = self.timers(TRAIN_BATCH_TIMER).elapsed(reset=True) / 1000.0
            emit(f"ds_paci: train_batch {self._calls} loss {loss.item():.4f} version {self.telemetry.version} "
                 f"samples/sec {self.train_batch_size() * every / max(elapsed, 1e-9):.1f}")
