"""PACIPipelineEngine: DeepSpeed's PipelineEngine running persistent PACI streams.

Contract (see also ``docs``/README):

* ``train_batch(data_iter=None)`` advances every stage by ``2*M`` ticks of its
  persistent 1F1B stream (``M = gradient_accumulation_steps``). Nothing is flushed;
  micro-batches of this call may still be in flight when it returns. Each stage
  applies its own optimizer step after every ``a``-th local backward
  (``a = paci.accumulation_window``, default ``M``). No collective spanning two
  stages runs: the only cross-stage traffic is the pipeline's own point-to-point
  transfers. Data-parallel replicas of a stage reduce gradients among themselves
  at each local step.
* Return value: on the last stage, the mean loss (a 0-dim tensor, averaged over
  data-parallel replicas) of the micro-batches whose forward completed during this
  call; ``None`` if none did (the first call of a deep pipeline with few
  micro-batches). On every other stage: ``None`` (they never wait for the loss).
* ``drain()`` completes all in-flight micro-batches and closes every open window
  (a partial window is stepped as is). ``eval_batch``, ``save_checkpoint``,
  ``load_checkpoint``, ``set_train_batch_size`` and ``reset_activation_shape``
  drain first. A drained engine is in the state a synchronous run reaches at a
  step boundary.
* Backward passes of micro-batches that cross a local step use the *current*
  weights (PACI "perf" semantics) on stock PyTorch: optimizers step through
  ``.data`` (see :mod:`ds_paci.core.local_step`), so autograd's version check never fires.
* Look-ahead (``paci.lookahead``, on by default; :mod:`ds_paci.core.lookahead`): the
  forward of a micro-batch whose backward comes after the stage's next local step (the
  stream tags it, ``crosses_step``) runs on a prediction of the next weights (Adam/AdamW),
  which are restored before the next instruction, whatever happens. Every other forward,
  every backward, eval and checkpoints see the real weights.
* Gradient clipping (``gradient_clipping > 0``) is stage-local: each stage clips by
  the norm of its own gradients. The PACI default is no clipping.
* Telemetry: :meth:`paci_stats` (version, local steps, drift histogram, look-ahead),
  :meth:`paci_trace` / :meth:`write_trace` (per-instruction times when
  ``paci.trace`` is on), and a log line per stage every ``steps_per_print`` calls.
"""

import time

import torch
from deepspeed import comm as dist
from deepspeed.runtime.pipe.engine import TRAIN_BATCH_TIMER, PipelineEngine
from deepspeed.runtime.pipe.schedule import (BackwardPass, ForwardPass, LoadMicroBatch, RecvActivation, RecvGrad,
                                             SendActivation, SendGrad)
from deepspeed.utils import logger

from .config import parse_paci_section
from .feed import MicroBatchFeed
from .local_step import clip_stage_gradients, make_stage_local
from .lookahead import make_lookahead
from .monitor import LastStageMonitor
from .schedule import LocalAccumulate, LocalStep, PACIStream, drift_bound, format_instruction
from .telemetry import StageTelemetry
from .watchdog import Watchdog


class PACIStreamError(RuntimeError):
    """An instruction of a PACI stream failed; the message says which rank, stage, instruction and tick."""


def _buffer_op(fn):

    def run(engine, cmd):
        return fn(engine, cmd.buffer_id)

    run.__name__ = fn.__name__
    return run


class PACIPipelineEngine(PipelineEngine):
    """DeepSpeed ``PipelineEngine`` that executes PACI streams (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.paci = parse_paci_section(self._config._param_dict.get("paci"))
        self._stream = PACIStream(self.num_stages, self.stage_id, self.paci.window(self.micro_batches, self.num_stages))
        self._reserve_pipe_buffers(self._stream.nbuf)
        self._aliases = make_stage_local(self)
        self._lookahead = make_lookahead(self, self.paci.lookahead, self.paci.lookahead_restore)
        self.telemetry = StageTelemetry(rank=self.global_rank,
                                        stage=self.stage_id,
                                        stages=self.num_stages,
                                        window=self._stream.window,
                                        bound=drift_bound(self.num_stages, self.stage_id, self._stream.window),
                                        trace=self.paci.trace)
        self._feed = MicroBatchFeed()
        self._in_stream = False
        self._calls = 0
        self._watchdog = Watchdog(self.paci.watchdog_seconds, self._describe_rank, format_instruction)
        self._loss_monitor = None
        if self.monitor.enabled and self.is_last_stage() and self.grid.data_parallel_id == 0:
            self._loss_monitor = LastStageMonitor(self._config.monitor_config)
        if self.global_rank == self.grid.stage_to_global(self.num_stages - 1):
            logger.info(f"ds_paci: PACI streams on {self.num_stages} stages, accumulation window "
                        f"{self._stream.window}, drain_every_batch={self.paci.drain_every_batch}, "
                        f"lookahead={self._lookahead is not None}, "
                        f"gradient_clipping={self.gradient_clipping()} (stage-local)")

    # -- public API -----------------------------------------------------------------
    @property
    def accumulation_window(self):
        return self._stream.window

    @property
    def weight_version(self):
        """Local optimizer steps this stage has applied."""
        return self.telemetry.version

    @property
    def is_drained(self):
        return self._stream.segment_tick == 0

    def train_batch(self, data_iter=None):
        """Advance this stage's stream by one batch (``2*M`` ticks); see the module docstring for the return value."""
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() requires gradients enabled. Use eval_batch() instead.")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        if self.is_first_stage() or self.is_last_stage():
            if self.data_iterator is None:
                raise ValueError(f"stage {self.stage_id} has no training data: pass data_iter to train_batch() or "
                                 "training_data to initialize()")
            self._feed.push(self.data_iterator, self.micro_batches)
        self.module.train()
        self._begin_losses()
        self.timers(TRAIN_BATCH_TIMER).start()
        self._run(self._stream.advance(2 * self.micro_batches))
        if self.paci.drain_every_batch:
            self._run_drain()
        self.timers(TRAIN_BATCH_TIMER).stop()
        loss = self._end_losses()
        self._calls += 1
        self._report(loss)
        return loss

    def drain(self):
        """Complete everything in flight and close open windows; returns the mean loss completed meanwhile (last stage)."""
        self.module.train()
        self._begin_losses()
        self._run_drain()
        return self._end_losses()

    def eval_batch(self, data_iter, *args, **kwargs):
        """Drain, then DeepSpeed's own ``eval_batch`` (its barrier and loss broadcast are legal once drained)."""
        self.drain()
        return super().eval_batch(data_iter, *args, **kwargs)

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True, exclude_frozen_parameters=False):
        """Drain, then save an ordinary DeepSpeed checkpoint with the stream position under ``client_state['ds_paci']``."""
        self.drain()
        state = dict(client_state or {})
        state["ds_paci"] = {"stream": self._stream.state_dict(), "telemetry": self.telemetry.summary()}
        return super().save_checkpoint(save_dir,
                                       tag=tag,
                                       client_state=state,
                                       save_latest=save_latest,
                                       exclude_frozen_parameters=exclude_frozen_parameters)

    def load_checkpoint(self, load_dir, tag=None, **kwargs):
        """Drain, load a DeepSpeed checkpoint, and resume the stream where the saved (drained) one stopped."""
        self.drain()
        path, client_state = super().load_checkpoint(load_dir, tag=tag, **kwargs)
        if path is not None and client_state and "ds_paci" in client_state:
            self._stream.load_state_dict(client_state["ds_paci"]["stream"])
            self.telemetry.version = self._stream.version
        self._feed.clear()
        return path, client_state

    def set_train_batch_size(self, train_batch_size):
        """Drain, change the number of micro-batches; a defaulted window follows the new ``gradient_accumulation_steps``."""
        self.drain()
        super().set_train_batch_size(train_batch_size)
        if self.paci.accumulation_window in (None, "auto"):
            window = self.paci.window(self.micro_batches, self.num_stages)
            self._stream.window = window
            self.telemetry.window = window
            self.telemetry.bound = drift_bound(self.num_stages, self.stage_id, window)

    def reset_activation_shape(self):
        if hasattr(self, "_stream") and not self.is_drained:
            self.drain()
        super().reset_activation_shape()

    def destroy(self):
        """Stop the watchdog thread, then DeepSpeed's own clean-up."""
        if getattr(self, "_watchdog", None) is not None:  # destroy() may run on a half-built engine
            self._watchdog.close()
        super().destroy()

    def paci_stats(self):
        """This stage's telemetry: version, local steps, drift histogram and bound, micro-batches, stream position."""
        stats = self.telemetry.summary()
        stats.update(in_flight=self._stream.in_flight(),
                     ticks=self._stream.ticks_emitted,
                     next_micro_batch=self._stream.next_micro_batch(),
                     train_batch_calls=self._calls,
                     lookahead=self._lookahead.stats() if self._lookahead is not None else {"enabled": False})
        return stats

    def paci_trace(self):
        """Per-instruction records ``{rank, stage, instr, start, end}`` (empty unless ``paci.trace`` is on)."""
        return list(self.telemetry.trace)

    def write_trace(self, directory=None):
        """Write this rank's trace as ``trace_rank<R>.jsonl`` into ``directory`` (default ``paci.trace_dir``)."""
        directory = directory or self.paci.trace_dir
        if not directory:
            raise ValueError("write_trace() needs a directory (or set \"paci.trace_dir\")")
        return self.telemetry.write_trace(directory)

    # -- stream execution -------------------------------------------------------------
    def _run_drain(self):
        self._run(self._stream.drain())
        self._feed.clear()  # every micro-batch train_batch() promised has now been loaded on both ends

    def _run(self, ticks):
        table = self._PACI_INSTRUCTIONS
        telemetry, watchdog = self.telemetry, self._watchdog
        first_tick = self._stream.ticks_emitted - len(ticks)
        self._in_stream = True
        cmd, tick_id = None, first_tick
        try:
            for i, tick in enumerate(ticks):
                tick_id = first_tick + i
                for cmd in tick:
                    watchdog.enter(cmd, tick_id)
                    if telemetry.tracing:
                        start = time.time()
                        table[type(cmd)](self, cmd)
                        telemetry.record(format_instruction(cmd), start, time.time())
                    else:
                        table[type(cmd)](self, cmd)
                    watchdog.done()
        except Exception as e:
            raise PACIStreamError(f"{self._describe_rank()} failed in {format_instruction(cmd)} at tick {tick_id} "
                                  f"of its stream: {type(e).__name__}: {e}") from e
        finally:
            watchdog.idle()
            self._in_stream = False

    def _describe_rank(self):
        return (f"rank {self.global_rank} (stage {self.stage_id} of {self.num_stages}, "
                f"data-parallel rank {self.grid.data_parallel_id})")

    def _next_batch(self):
        if not self._in_stream:
            return super()._next_batch()
        batch = self._feed.next()
        if self.batch_fn:
            batch = self.batch_fn(batch)
        return batch

    def _exec_paci_forward(self, cmd):
        self.telemetry.forward(cmd.buffer_id)
        if self._lookahead is not None and cmd.crosses_step:
            # this micro-batch's backward comes after the next local step: forward on the predicted next weights
            with self._lookahead.applied(cmd.window_fill, self._stream.window):
                PipelineEngine._exec_forward_pass(self, cmd.buffer_id)
        else:
            PipelineEngine._exec_forward_pass(self, cmd.buffer_id)

    def _exec_paci_backward(self, cmd):
        if self.is_last_stage() and self._stream.window != self.micro_batches:
            # DeepSpeed divides the loss by M; PACI averages over the window of a micro-batches.
            self.loss = self.loss * (self.micro_batches / self._stream.window)
        PipelineEngine._exec_backward_pass(self, cmd.buffer_id)

    def _exec_local_accumulate(self, cmd):
        self.telemetry.accumulate(cmd.buffer_id, cmd.micro_batch_id)

    def _exec_local_step(self, cmd):
        if self._lookahead is not None:
            self._lookahead.before_step()
        self._exec_reduce_grads()  # DP group of this stage only
        if self._aliases is not None:
            self._aliases.bind_grads()
        self._exec_optimizer_step()
        if self._aliases is not None:
            self._aliases.release_grads()
        self.telemetry.stepped()
        if self._lookahead is not None:
            self._lookahead.after_step()

    def clip_fp32_gradients(self):
        clip_stage_gradients(self, self.gradient_clipping())

    _PACI_INSTRUCTIONS = {
        LoadMicroBatch: _buffer_op(PipelineEngine._exec_load_micro_batch),
        ForwardPass: _exec_paci_forward,
        BackwardPass: _exec_paci_backward,
        SendActivation: _buffer_op(PipelineEngine._exec_send_activations),
        RecvActivation: _buffer_op(PipelineEngine._exec_recv_activations),
        SendGrad: _buffer_op(PipelineEngine._exec_send_grads),
        RecvGrad: _buffer_op(PipelineEngine._exec_recv_grads),
        LocalAccumulate: _exec_local_accumulate,
        LocalStep: _exec_local_step,
    }

    # -- losses and logging -----------------------------------------------------------
    def _begin_losses(self):
        self.total_loss = None
        self.total_additional_losses = None
        self.fwd_outputs = []
        self._compute_loss = True

    def _end_losses(self):
        """Mean loss of the micro-batches completed since :meth:`_begin_losses` (last stage), averaged over DP."""
        if not self.is_last_stage() or not self.fwd_outputs:
            self.agg_train_loss = None
            return None
        with torch.no_grad():
            loss = (self.total_loss / len(self.fwd_outputs)).detach().clone()
            if self.is_data_parallel:
                dist.all_reduce(loss, group=self.grid.get_data_parallel_group())
                loss /= self.dp_world_size
        self.agg_train_loss = loss
        return loss

    def _report(self, loss):
        if self._loss_monitor is not None and loss is not None:
            self._loss_monitor.write_events([("Train/Samples/train_loss", loss.item(), self.global_samples)])
        every = self.steps_per_print()
        if not every or self._calls % every:
            return
        if self.grid.data_parallel_id == 0:
            logger.info(f"ds_paci: {self.telemetry.describe()}")
        if self.is_last_stage() and self.grid.data_parallel_id == 0 and loss is not None:
            elapsed = self.timers(TRAIN_BATCH_TIMER).elapsed(reset=True) / 1000.0
            print(f"ds_paci: train_batch {self._calls} loss {loss.item():.4f} version {self.telemetry.version} "
                  f"samples/sec {self.train_batch_size() * every / max(elapsed, 1e-9):.1f}",
                  flush=True)
