"""PACIPipelineEngine: DeepSpeed's PipelineEngine running persistent PACI streams.

Contract (see also ``docs``/README):

* ``train_batch(data_iter=None)`` advances every stage by ``2*M`` ticks of its
  persistent 1F1B stream (``M = gradient_accumulation_steps``). Nothing is flushed;
  micro-batches of this call may still be in flight when it returns. Each stage
  applies its own optimizer step after every ``a``-th local backward
  (``a = paci.accumulation_window``, default ``M``), at the place its step phase says
  (``paci.step_phase``: ``"aligned"`` or ``"diagonal"``, :mod:`ds_paci.core.program.stream`). No collective spanning two
  stages runs: the only cross-stage traffic is the pipeline's own point-to-point
  transfers. Data-parallel replicas of a stage reduce gradients among themselves
  at each local step.
* Return value, on **every** rank a 0-dim float tensor on the engine's device (never ``None``):
  on the last stage, the mean loss (averaged over its data-parallel group) of the micro-batches whose
  forward completed during this call, or its most recent such value if none did; on every other stage,
  the most recent value the last stage of its own pipeline has published on the loss side channel
  (:mod:`ds_paci.core.engine.loss_channel`), taken without waiting. Before the first value arrives: NaN.
  Staleness on stage ``s``: the value is from at most ``ceil((P-s)/(2M))`` calls earlier once delivered
  (stage ``s`` ends call ``k`` only after the last stage has passed tick ``~2Mk-(P-1-s)``), plus any
  transport delay of the side channel; :meth:`paci_stats` reports it as ``loss_age``. In sync mode every
  rank waits for the call's own loss, as the stock engine's broadcast does. ``get_additional_losses()``
  follows the same rule.
* ``drain()`` completes all in-flight micro-batches and closes every open window
  (a partial window is stepped as is: the end of training); ``drain(close_window=False)``
  completes them and leaves a partial window open for the next call. It returns like
  ``train_batch`` and enables gradients for its own backward passes, so ``eval_batch``,
  ``save_checkpoint`` and ``load_checkpoint`` (which drain first, without closing the
  window) work under ``torch.no_grad()``. So evaluation and checkpoints never add an
  optimizer or scheduler step: a stage steps after every ``a`` of its backward passes
  however often the run is drained. ``set_train_batch_size`` drains only when the size
  changes, and then closes the window (the window and the learning-rate unit follow ``M``);
  ``reset_activation_shape`` drains only when something is in flight. A drained engine has
  nothing in flight, like a synchronous run at a step boundary, plus possibly an open window.
* Counters as in DeepSpeed's engine: every ``train_batch`` adds 1 to ``global_steps`` and
  ``train_batch_size()`` to ``global_samples`` (default checkpoint tags ``global_step<N>``,
  the monitors' x-axis); the same on every stage, whatever ``a``. The LR scheduler follows the
  samples a stage has consumed, one scheduler step per ``M`` micro-batches its local steps
  took (``Action.lr_steps`` of its ``STEP`` actions, :mod:`ds_paci.core.program.stream`); with ``a = M`` that is one per
  local step. ``skipped_steps`` counts this stage's skipped local steps.
* Checkpoints are atomic (:mod:`ds_paci.core.checkpoint.atomic`): ``latest`` only ever
  names a complete checkpoint, and ``load_checkpoint`` verifies completeness first.
  A checkpoint taken with a window open keeps its gradients (:mod:`ds_paci.core.step.window_state`),
  so a resume continues exactly as the uninterrupted run.
* Backward passes of micro-batches that cross a local step use the *current*
  weights (PACI "perf" semantics) on stock PyTorch: optimizers step through
  ``.data`` (see :mod:`ds_paci.core.step.local_step`), so autograd's version check never fires.
* Sync mode (``drain_every_batch`` with ``a = M``) is the stock engine: DeepSpeed's
  norms, clipping (default 1.0 when the key is absent, over the whole pipeline),
  overflow handling, tied-gradient all-reduce and scheduler; its local steps wait for
  the end of the call, as DeepSpeed's ``OptimizerStep`` does. Async mode: clipping by
  each stage's own norm when ``gradient_clipping`` is set, none when the key is absent
  (said in the start-up line, :mod:`ds_paci.core.engine.startup`); a local step whose gradient is not finite is skipped
  (the scheduler still follows its rule), ``was_step_applied()`` says so, and
  ``paci.max_consecutive_skips`` skips in a row stop every rank (:mod:`ds_paci.core.step.guard`).
* On a DeepSpeed newer than the newest tested (or with ``DS_PACI_CHECK_COLLECTIVES=1``), the first
  async local step runs under :class:`~ds_paci.core.seam.collective_guard.StageCollectiveGuard`: a
  collective whose group spans two stages is refused, before it is entered, with one line.
* ``was_step_applied()``: False only after a skipped step (True before the first one).
  ``get_global_grad_norm()``: the stage's own gradient norm at its last local step
  (async; over its data-parallel group, never across stages), DeepSpeed's value in
  sync mode.
* Tied layers on several stages (``TiedLayerSpec``): the owners exchange their window
  gradients point to point and apply the same total ``L`` windows late, so the copies stay
  bit-identical with no stage waiting for another, through non-finite windows (every owner skips
  the same tied totals) and with clipping (the tied total clipped by its own norm); see
  :mod:`ds_paci.core.tied.weights`.
* Refusals (:func:`ds_paci.core.config.validate_run`) run in ``__init__`` too, before
  DeepSpeed builds the optimizer, so building the class directly fails the same way.
* Look-ahead (``paci.lookahead``, on by default in async mode; :mod:`ds_paci.core.lookahead.predict`):
  the forward of a micro-batch whose backward comes after the stage's next local step (the
  stream tags it, ``crosses_step``) runs on a prediction of the next weights (Adam/AdamW, SGD,
  Muon; clipping included), which are restored before the next instruction, whatever raised.
  Every other forward, every backward, eval and checkpoints see the real weights. Sync mode
  never predicts.
* Telemetry: :meth:`paci_stats` (version, local steps, drift histogram, ``tied``, look-ahead),
  :meth:`paci_trace` / :meth:`write_trace` (per-instruction times when
  ``paci.trace`` is on), and a line per stage every ``steps_per_print`` calls (stdout, data-parallel rank 0 of
  each stage, from the stage's own counters: drift histogram and bound, look-ahead; :meth:`StageTelemetry.describe`).
"""

import time

import torch
from deepspeed.runtime.pipe.engine import TRAIN_BATCH_TIMER, PipelineEngine

from ..seam import compat
from ..seam import deepspeed_internals as ds
from ..seam.collective_guard import CrossStageCollectiveError, StageCollectiveGuard, check_reason
from ..config import check_accumulation_window, engine_config, parse_paci_section, validate_run
from .checkpoints import EngineCheckpoints
from .losses import CallLosses
from .feed import MicroBatchFeed
from ..step.guard import PACINonFiniteError, SkipCounter
from ..step.local_step import clipping_policy, guarded_step, make_stage_local, step_lr
from ..step.overlap import armed_for, dp_reduce, make_overlap
from ..lookahead.predict import make_lookahead
from .loss_channel import LossChannel, pipeline_groups
from . import first_exchange
from .transfers import make_transfers, transfer_op
from .monitor import LastStageMonitor
from ..program.passes import lower_call
from ..program.actions import Kind, format_action
from ..program.stream import PACIStream, drift_bound, step_phase
from .stage_context import StageContext
from .stage_stats import stage_stats
from .startup import announce, say, watch_open_window
from .telemetry import StageTelemetry
from . import warm_start
from ..tied.weights import TiedWeights
from ..tied.layout import tied_owner_stages
from ..health.watchdog import Watchdog


def _describe_instruction(instruction):
    return instruction if isinstance(instruction, str) else format_action(instruction, facts=False)


class PACIStreamError(RuntimeError):
    """An instruction of a PACI stream failed; the message says which rank, stage, instruction and tick."""


def _buffer_op(fn):
    """A DeepSpeed instruction (:mod:`ds_paci.core.seam.deepspeed_internals`) on a buffer, run for an action."""

    def run(engine, action):
        return fn(engine, action.micro_batch % engine._stream.nbuf)

    run.__name__ = fn.__name__
    return run


class PACIPipelineEngine(EngineCheckpoints, CallLosses, PipelineEngine):
    """DeepSpeed ``PipelineEngine`` that executes PACI streams (see the module docstring).

    Two parts live in modules of their own: :class:`~ds_paci.core.engine.checkpoints.EngineCheckpoints` (save
    and load) and :class:`~ds_paci.core.engine.losses.CallLosses` (the end of a call: losses, stop, progress)."""

    saves_atomically = True  # save_checkpoint/load_checkpoint go through ds_paci.core.checkpoint.atomic

    def __init__(self, *args, **kwargs):
        self._validate_before_build(args, kwargs)
        super().__init__(*args, **kwargs)
        self.paci = parse_paci_section(ds.param_dict(self).get("paci"))
        if not hasattr(self, "_validated"):
            validate_run(ds.param_dict(self), self.module, self.paci)
        check_accumulation_window(self.paci.accumulation_window, self.micro_batches)
        window = self._configured_window()
        # Sync mode with a = M is DeepSpeed's engine: its norms, clipping and step at the end of the call.
        self._stock_step = self.paci.drain_every_batch and window == self.micro_batches
        self._step_phase = self.paci.phase_rule(self._stock_step, tied=bool(tied_owner_stages(self.module)))
        self._stream = PACIStream(self.num_stages, self.stage_id, window, self.micro_batches,
                                  step_phase(self._step_phase, self.stage_id, window),
                                  () if self._stock_step else self.paci.slack_links)
        ds.reserve_pipe_buffers(self, self._stream.nbuf)
        self._aliases = make_stage_local(self, confine=not self._stock_step)
        compat.adapt_engine(self, stock=self._stock_step)  # what differs between DeepSpeed versions
        self._clipping = clipping_policy(self, stock=self._stock_step)
        self.telemetry = StageTelemetry(rank=self.global_rank,
                                        stage=self.stage_id,
                                        stages=self.num_stages,
                                        window=self._stream.window,
                                        bound=drift_bound(self.num_stages, self.stage_id, self._stream.window,
                                                          self._stream.slack),
                                        trace=self.paci.trace)
        self._feed = MicroBatchFeed()
        warm_start.setup(self)
        self._in_stream, self._calls = False, 0
        self._loss_calls = 0  # train_batch and drain calls: one side-channel message each
        self._drains = 0
        self._skips = SkipCounter(self.paci.max_consecutive_skips)
        self._stop_request = None
        ds.set_step_applied(self, True)  # False only once a step was actually skipped
        self._last_loss = None  # (loss tensor, origin call) most recently returned
        self._loss_fresh = False
        loss_group = pipeline_groups(self.grid)  # its channel posts receives: built after the first exchange below
        self._watchdog = Watchdog(self.paci.watchdog_seconds, self._describe_rank, _describe_instruction,
                                  explain=self._explain_wait)
        # what the tied exchange and the look-ahead may use of this engine (they never see the engine itself)
        self._ctx = StageContext(self, paci=self.paci, stock_step=self._stock_step, watchdog=self._watchdog,
                                 aliases=self._aliases, describe_rank=self._describe_rank,
                                 ticks_emitted=lambda: self._stream.ticks_emitted,
                                 window=lambda: self._stream.window)
        self._tied = self._ctx.tied = TiedWeights.create(self._ctx)  # every rank: it creates process groups
        # a first transfer on every group this rank talks on: no NCCL communicator is created lazily mid-stream
        self._transfers = make_transfers(self, self.paci, self._stock_step, say)  # non-blocking, hoisted sends
        self._first_exchange = first_exchange.run_for(self, loss_group)
        self._channel = LossChannel(*loss_group, self.stage_id)
        # A newer DeepSpeed may reach a global group inside an optimizer step: check the first local step once.
        reason = None if self._stock_step else check_reason()
        self._collective_guard = None if reason is None else StageCollectiveGuard(self, reason)
        # (make_lookahead restores by copy where copies must stay bit-identical: DP replicas, tied owners)
        self._lookahead = make_lookahead(self._ctx, self.paci.lookahead and not self._stock_step,
                                         self.paci.lookahead_restore)
        self._loss_monitor = None
        if self.monitor.enabled and self.is_last_stage() and self.grid.data_parallel_id == 0:
            self._loss_monitor = LastStageMonitor(ds.monitor_config(self))
        announce(self)  # rank 0: PACI on, per-stage windows and drift bounds, look-ahead, clipping; advice
        self._overlap = make_overlap(self, self.paci, self._stock_step, say)  # DP reduce under the last backward
        self._open_window = watch_open_window(self)  # warns if collected or at exit with gradients never applied

    def _configured_window(self):
        """This stage's ``a`` for the current M. ``"auto"`` is one window on every stage since issue 30; the stage
        is still passed only where a per-stage answer would be allowed (not in sync mode, where every stage must
        agree on running DeepSpeed's step, nor where tied layers span stages, whose owners exchange window
        gradients)."""
        per_stage = (self.paci.accumulation_window == "auto" and not self.paci.drain_every_batch
                     and not tied_owner_stages(self.module))
        return self.paci.window(self.micro_batches, self.num_stages, self.stage_id if per_stage else None)

    def _validate_before_build(self, args, kwargs):
        """The refusals of ``ds_paci.initialize``, before DeepSpeed builds the optimizer (on every rank)."""
        config = engine_config(args, kwargs)
        model = kwargs.get("model")
        if config is None or model is None:
            return  # unusual constructor call: validated after DeepSpeed's own __init__ instead
        validate_run(config, model, parse_paci_section(config.get("paci")))
        self._validated = True

    # -- public API -----------------------------------------------------------------
    @property
    def accumulation_window(self):
        return self._stream.window

    @property
    def weight_version(self):
        """Local steps this stage has taken (a skipped step counts too: it is the stream's weight version)."""
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
        sync = warm_start.follow(self) or self._stock_step  # the first paci.sync_warmup_calls: stock's schedule
        ticks = self._stream.advance(2 * self.micro_batches)
        if self.paci.drain_every_batch or sync:  # a = M: nothing is left open anyway
            self._run_call(ticks, self._stream.drain(sync), carry=not sync)
        else:
            self._run_call(ticks)
        if not self._stock_step:  # one step per call, as the stock engine counts (sync mode: DeepSpeed's step did)
            self.global_steps += 1
            self.global_samples += self.train_batch_size()
        self.timers(TRAIN_BATCH_TIMER).stop()
        loss = warm_start.observed(self, self._finish_call())  # an "auto" warm start may end here
        self._calls += 1
        self._report(loss)
        return loss

    def drain(self, close_window=True):
        """Complete everything in flight; returns like :meth:`train_batch`.

        ``close_window`` (the default, for the end of training): a partial accumulation window is stepped as
        it is. ``close_window=False`` leaves it open: the next ``train_batch`` continues it, so draining does
        not change training (what ``eval_batch`` and checkpoints do). Enables gradients for its own backward
        passes (callers may hold ``torch.no_grad()``).
        """
        self.module.train()
        self._begin_losses()
        with torch.enable_grad():
            self._run_drain(close_window)
        self._drains += 1
        return self._finish_call()

    def eval_batch(self, data_iter, *args, **kwargs):
        """Drain (window left open), then DeepSpeed's own ``eval_batch`` (its barrier and loss broadcast are legal
        once drained)."""
        self.drain(close_window=False)
        return super().eval_batch(data_iter, *args, **kwargs)

    def set_train_batch_size(self, train_batch_size):
        """Change the number of micro-batches: a no-op for the current size; otherwise drain once, then switch.

        That drain closes the open window (a partial window is stepped as is): the window and the learning-rate
        rule's unit follow ``M``. A defaulted window (and the window of sync mode) follows the new
        ``gradient_accumulation_steps``.
        """
        if train_batch_size == self.train_batch_size():
            return
        if train_batch_size % (self.train_micro_batch_size_per_gpu() * self.dp_world_size) != 0:
            super().set_train_batch_size(train_batch_size)  # DeepSpeed's own ValueError, before any drain
        self.drain(close_window=True)
        super().set_train_batch_size(train_batch_size)
        window = None
        if self.paci.accumulation_window in (None, "auto") or self._stock_step:
            window = self.micro_batches if self._stock_step else self._configured_window()
            self.telemetry.window = window
            self.telemetry.bound = drift_bound(self.num_stages, self.stage_id, window, self._stream.slack)
        phase = step_phase(self._step_phase, self.stage_id, window or self._stream.window)
        self._stream.set_micro_batches(self.micro_batches, window, phase)

    def reset_activation_shape(self):
        if hasattr(self, "_stream") and not self.is_drained:
            self.drain(close_window=False)
        super().reset_activation_shape()

    def destroy(self):
        """Stop the watchdog thread, drop the side channel's pending transfers, then DeepSpeed's own clean-up."""
        if getattr(self, "_watchdog", None) is not None:  # destroy() may run on a half-built engine
            self._watchdog.close()
        if getattr(self, "_channel", None) is not None:
            self._channel.close()
        super().destroy()

    def was_step_applied(self):
        """False only if this stage's most recent local step was skipped (a non-finite gradient, or an overflow; on a
        tied owner also a skipped tied total, see :mod:`ds_paci.core.tied.weights`)."""
        return ds.step_applied(self)

    def get_global_grad_norm(self):
        """Async: this stage's own gradient norm at its last local step (after the data-parallel reduce; never
        across stages; without tied weights shared with other stages, whose total is clipped apart). Sync mode:
        DeepSpeed's value (``None`` for a plain fp32 optimizer, as in the stock engine)."""
        return ds.global_grad_norm(self)

    def paci_stats(self):
        """This stage's telemetry: version, local steps, drift, stream position, skips, drains, loss age
        (:func:`ds_paci.core.engine.stage_stats.stage_stats` lists every key)."""
        return stage_stats(self)

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
    def _run_drain(self, close_window):
        self._run_call([], self._stream.drain(close_window), carry=not close_window)

    def lower(self, ticks, drain_ticks=None, carry=False):
        """This stage's program for one call: the stream's ticks (and a drain's) through the passes it needs
        (:func:`ds_paci.core.program.passes.lower_call`): sync mode's steps at the end of the call, a tied owner's
        exchange and its last step of a drain after the drain. What :meth:`run_program` executes."""
        tied = None
        if self._tied is not None and self._tied.exchanges and not self._stock_step:
            tied = (self._tied.pending_windows(), self._tied.lag)
        return lower_call(ticks, drain_ticks, sync_steps=self._stock_step, tied=tied, carry=carry,
                          overlap_reduce=self._overlap is not None, nonblocking=self._transfers is not None)

    def _run_call(self, ticks, drain_ticks=None, carry=False):
        first_tick = self._stream.ticks_emitted - len(ticks) - len(drain_ticks or [])
        program = self.lower(ticks, drain_ticks, carry)
        self.run_program(program, first_tick, drains=drain_ticks is not None, carry=carry)

    def run_program(self, program, first_tick=None, drains=False, carry=False):
        """Execute one call's lowered ``program`` (this stage's ticks of actions). ``drains``: it ends with a
        drain (``carry``: one that leaves the window open); the drain's bookkeeping follows it."""
        if self._transfers is not None:
            self._transfers.begin(program)
        self._run(program, first_tick)
        if drains:
            if self._transfers is not None:
                self._transfers.drain()  # nothing in flight across an evaluation, a checkpoint or a reset
            self._feed.clear()  # every micro-batch train_batch() promised has now been loaded on both ends
            if self._tied is not None:  # settle or check the exchange, compare the copies
                stepped = bool(program) and any(a.kind is Kind.STEP and a.in_drain for a in program[-1])
                self._tied.finish_drain(carry, stepped)

    def _run(self, ticks, first_tick=None):
        table = self._PACI_ACTIONS
        telemetry, watchdog = self.telemetry, self._watchdog
        if first_tick is None:
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
                        table[cmd.kind](self, cmd)
                        telemetry.record(format_action(cmd, facts=False), start, time.time())
                    else:
                        table[cmd.kind](self, cmd)
                    watchdog.done()
        except (PACINonFiniteError, CrossStageCollectiveError):
            raise
        except Exception as e:
            # A peer that stopped the run (non-finite guard) breaks our transfers: say why, not just how.
            notice = self._channel.stop_notice(wait_s=2.0) if self._channel.active else None
            if notice is not None:
                raise PACINonFiniteError(self._stop_text(notice)) from e
            raise PACIStreamError(f"{self._describe_rank()} failed in {format_action(cmd, facts=False)} at tick "
                                  f"{tick_id} of its stream: {type(e).__name__}: {e}") from e
        finally:
            watchdog.idle()
            self._in_stream = False

    def _describe_rank(self):
        return (f"rank {self.global_rank} (stage {self.stage_id} of {self.num_stages}, "
                f"data-parallel rank {self.grid.data_parallel_id})")

    def _next_batch(self):
        if not self._in_stream:
            return ds.stock_next_batch(self)
        batch = self._feed.next()
        if ds.batch_fn(self):
            batch = ds.batch_fn(self)(batch)
        return warm_start.seen(self, batch)

    def _exec_paci_forward(self, cmd):
        buffer_id = cmd.micro_batch % self._stream.nbuf
        self.telemetry.forward(buffer_id)
        if self._lookahead is not None and cmd.crosses_step:
            # this micro-batch's backward comes after the next local step: forward on the predicted next weights
            with self._lookahead.applied(cmd.window_fill, cmd.open_window or self._stream.window):
                ds.exec_forward_pass(self, buffer_id)
        else:
            ds.exec_forward_pass(self, buffer_id)

    def _exec_paci_backward(self, cmd):
        if self.is_last_stage() and not self._stock_step:
            # PACI averages over the window of a micro-batches (DeepSpeed divides by M, or not: see compat).
            factor = compat.last_stage_loss_factor(self.micro_batches, self._stream.window)
            if factor != 1.0:
                ds.set_stage_loss(self, ds.stage_loss(self) * factor)
        with armed_for(self._overlap, cmd):  # B[dp]: the window's buckets reduce as they become final
            ds.exec_backward_pass(self, cmd.micro_batch % self._stream.nbuf)

    def _exec_local_accumulate(self, cmd):
        self.telemetry.accumulate(cmd.micro_batch % self._stream.nbuf, cmd.micro_batch)

    def _exec_tied(self, cmd):
        self._tied.expect(cmd)  # TPOST/TAPPLY: run inside the local step that follows (see ds_paci.core.program.passes)

    def _local_step(self, cmd):
        """Run local step ``cmd`` (a ``STEP`` action); the first async one under the collective guard, if on."""
        guard = self._collective_guard
        if guard is not None and not guard.done:
            with guard:
                self._take_local_step(cmd)
        else:
            self._take_local_step(cmd)

    def _take_local_step(self, cmd):
        version = cmd.version
        if self._lookahead is not None:
            self._lookahead.before_step()
        if self._stock_step:  # DeepSpeed's order: tied all-reduce, then the DP reduce
            if self._tied is not None:
                ds.exec_reduce_tied_grads(self)
            ds.exec_reduce_grads(self)
        elif self._tied is not None:
            self._tied.reduce_grads(version, lambda: dp_reduce(self, self._overlap))  # DP reduce, tied exchange
        else:
            dp_reduce(self, self._overlap)  # DP group of this stage only (waits for the overlapped buckets)
        if self._aliases is not None:
            self._aliases.bind_grads()
        if self._stock_step:
            ds.exec_optimizer_step(self)  # DeepSpeed's step exactly (sync mode)
            applied = ds.step_applied(self)
        elif self._tied is not None and self._tied.exchanges:
            applied = self._tied.step()  # the stage's own gradient and the tied total, each with its verdict
        else:
            applied = guarded_step(self)
        if not self._stock_step:
            step_lr(self, cmd.lr_steps)  # applied or skipped: the scheduler follows the micro-batches consumed
        if self._aliases is not None:
            self._aliases.release_grads()
        self.telemetry.stepped()
        if self._lookahead is not None:
            self._lookahead.after_step()
        if self._skips.record(applied, version) and not self._stock_step:
            self._stop_request = (self._skips.last_skipped_step, self._skips.consecutive, self._skips.limit)

    # The one place actions meet DeepSpeed: each kind of action to what runs it (DeepSpeed's through the seam).
    _PACI_ACTIONS = {
        Kind.LOAD: _buffer_op(ds.exec_load_micro_batch),
        Kind.FORWARD: _exec_paci_forward,
        Kind.BACKWARD: _exec_paci_backward,
        Kind.SEND_ACT: transfer_op(ds.exec_send_activations),
        Kind.RECV_ACT: transfer_op(ds.exec_recv_activations),
        Kind.SEND_GRAD: transfer_op(ds.exec_send_grads),
        Kind.RECV_GRAD: transfer_op(ds.exec_recv_grads),
        Kind.ACCUMULATE: _exec_local_accumulate,
        Kind.STEP: lambda engine, cmd: engine._local_step(cmd),
        Kind.TIED_POST: _exec_tied,
        Kind.TIED_APPLY: _exec_tied,
    }
