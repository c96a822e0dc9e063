"""The main job's training loop as an object: its state in attributes, one method per thing it does.

:class:`Cadence` says, as pure arithmetic, after which steps the loop writes a progress line, validates
and saves. :class:`TrainingLoop` runs one rank's part: the first validation, the steps, the periodic
validations and saves, the stop every rank agrees on (``ds_paci.core.health.lifecycle``) and the end (drain,
last validation, last save, the summary). The order of engine calls is the job's contract with the
engine's results: the same flags give the same losses, bit for bit.
"""

import math
import resource
import time
from dataclasses import dataclass, replace

import torch

from .metrics import TrainingMetrics, drift_text, progress_line
from .summary import summary_lines, summary_record


@dataclass(frozen=True)
class Cadence:
    """After which steps (1..``steps``) the loop logs, validates and saves; the last step does all three
    once, in the loop's end (:meth:`TrainingLoop.finish`), never twice."""
    steps: int
    log_interval: int
    eval_interval: int = 0  # 0: validate only at the start and the end
    save_interval: int = 0  # 0: save only at the end
    saves: bool = False  # a --checkpoint-dir was given

    @classmethod
    def from_args(cls, args):
        return cls(args.steps, args.log_interval, args.eval_interval, args.save_interval, bool(args.checkpoint_dir))

    def logs_after(self, step):
        return step % self.log_interval == 0 or step == self.steps

    def evaluates_after(self, step):
        return bool(self.eval_interval) and step % self.eval_interval == 0 and step != self.steps

    def saves_after(self, step):
        return self.saves and bool(self.save_interval) and step % self.save_interval == 0 and step != self.steps


class TrainingLoop:
    """One rank's training run on a built engine (see the module docstring).

    ``shape`` is the run's :class:`~.metrics.JobShape` (with ``start_step`` 0: :meth:`resume` moves it);
    ``val_batches`` the validation micro-batches (``eval_batches`` groups of ``gas``); ``stopper`` the
    installed ``lifecycle.StopController``. :meth:`run` returns the rank's exit code.
    """

    def __init__(self, engine, data, val_batches, reporter, stopper, shape, args, gas):
        self.engine, self.data, self.val_batches, self.gas = engine, data, val_batches, gas
        self.reporter, self.stopper, self.shape = reporter, stopper, shape
        self.checkpoint_dir, self.eval_batches = args.checkpoint_dir, args.eval_batches
        self.cadence = Cadence.from_args(args)
        self.metrics = TrainingMetrics(shape.tokens_per_step)
        self.saved_step = None  # the step of this run's newest save
        self.stats, self.stats_step = None, shape.start_step  # every rank's stats, and the step they were gathered
        self.first_val = None
        self.agreement = None

    def at(self, step):
        return f"step {step:>6}/{self.shape.steps}"

    # -- what the loop does ------------------------------------------------------------------------
    def resume(self, tag, note):
        """Load ``tag`` from the checkpoint folder; False (the line said) when nothing could be loaded."""
        from ds_paci.core.checkpoint import atomic as checkpoint
        path, client = checkpoint.load_checkpoint(self.engine, self.checkpoint_dir, tag=tag)
        if path is None:
            self.reporter.say(f"error: could not load a checkpoint from {self.checkpoint_dir}")
            return False
        start = client["step"]
        self.shape = replace(self.shape, start_step=start)
        self.stats_step = start
        self.data.load_state_dict(client["data"])
        self.reporter.say(f"resumed from {path} at step {start}" + (f" ({note})" if note else ""))
        return True

    def gather_stats(self, step):
        """Every rank's stats (a collective: legal here, the pipeline is drained), kept with ``step``."""
        local = {"stage": self.engine.stage_id, "dp": self.engine.grid.data_parallel_id,
                 "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
        if self.shape.is_paci:
            local.update(self.engine.paci_stats())
        out = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(out, local)
        self.stats, self.stats_step = out, step
        return out

    def evaluate(self, step):
        """The validation loss after ``step`` (its line and record written); never adds a local step."""
        t0 = time.perf_counter()
        if self.shape.is_paci:
            self.engine.drain(close_window=False)  # evaluation never adds a local step
        losses = []
        for i in range(self.eval_batches):
            group = self.val_batches[i * self.gas:(i + 1) * self.gas]
            losses.append(float(self.engine.eval_batch(iter(group))))
        val = sum(losses) / len(losses)
        self.metrics.eval_seconds += time.perf_counter() - t0
        self.reporter.say(f"{self.at(step)} | validation loss {val:.4f}")
        self.reporter.record(event="eval", step=step, val_loss=val)
        return val

    def save(self, step):
        from ds_paci.core.checkpoint import atomic as checkpoint
        checkpoint.save_checkpoint(self.engine, self.checkpoint_dir,
                                   client_state={"step": step, "data": self.data.state_dict()})
        self.saved_step = step
        self.reporter.say(f"{self.at(step)} | checkpoint saved to {self.checkpoint_dir}")

    def log(self, step):
        """The progress line and ``train`` record of the steps since the last one."""
        engine, m = self.engine, self.metrics
        tps, eta, nonfinite = m.close_window(self.shape.steps - step)
        drift = drift_text(self.stats, self.stats_step, step) if self.shape.is_paci else ""
        lr = engine.get_lr()[0]
        self.reporter.say(progress_line(step, self.shape.steps, m.last_loss, tps, lr, drift, nonfinite,
                                        engine.skipped_steps, eta))
        self.reporter.record(event="train", step=step, loss=m.last_loss, tokens_per_s=tps, lr=lr, time=time.time())
        m.start_window()

    def step(self, step):
        """One ``train_batch`` call, then whatever the cadence asks after it."""
        t0 = time.perf_counter()
        loss = self.engine.train_batch(self.data)
        self.metrics.train_seconds += time.perf_counter() - t0
        self.metrics.observe(step, loss, self.engine.is_last_stage())
        if self.cadence.logs_after(step):
            self.log(step)
        if self.cadence.evaluates_after(step):
            self.evaluate(step)
            self.gather_stats(step)
        if self.cadence.saves_after(step):
            self.save(step)

    def stop(self, step, decision):
        """Every rank agreed to stop after ``step``: drain, save, exit 128+signal (bounded by --stop-timeout)."""
        if self.stopper.code is None:  # learned from another rank: this rank's stop is bounded by the deadline too
            self.stopper.request_stop(decision.code, f"stop agreed by all ranks ({decision.describe()})",
                                      announce=False)
        self.reporter.say(f"{self.at(step)} | stopping: {decision.describe()}; every rank stops after step {step}")
        if self.shape.is_paci:
            self.engine.drain(close_window=False)  # a resume continues exactly where this stops
        if self.checkpoint_dir and self.saved_step != step:
            self.save(step)
        self.reporter.record(event="stop", step=step, reason=decision.describe(), exit_code=decision.exit_code)
        after = (f"resume with --resume --checkpoint-dir {self.checkpoint_dir}" if self.checkpoint_dir else
                 "nothing saved (no --checkpoint-dir)")
        self.reporter.say(f"stopped at step {step} of {self.shape.steps} ({decision.describe()}); {after}")
        self._end()
        return decision.exit_code

    # -- the run -----------------------------------------------------------------------------------
    def run(self):
        """The whole run from ``shape.start_step``; the rank's exit code (0, or an agreed stop's 128+signal)."""
        from ds_paci.core.health import lifecycle
        self.first_val = self.evaluate(self.shape.start_step)
        self.gather_stats(self.shape.start_step)
        self.metrics.start_window()
        self.agreement = lifecycle.StopAgreement(self.stopper)
        self.stopper.graceful = True
        self.agreement.poll()  # from here a stop requested on any rank is agreed on by all within two steps
        for step in range(self.shape.start_step + 1, self.shape.steps + 1):
            self.step(step)
            decision = self.agreement.poll()
            if decision is not None:
                return self.stop(step, decision)
        self.agreement.close()
        return self.finish()

    def finish(self):
        """After the last step: drain (closing the window), validate, save, the summary; exit code 0."""
        engine = self.engine
        tail = engine.drain() if self.shape.is_paci else None
        if tail is not None and engine.paci_stats()["loss_age"] == 0 and math.isfinite(float(tail)):
            self.metrics.keep(float(tail))
        final_val = self.evaluate(self.shape.steps)
        if self.checkpoint_dir:
            self.save(self.shape.steps)
        stats = self.gather_stats(self.shape.steps)
        summary = summary_record(self.shape, self.metrics, self.first_val, final_val, stats)
        self.reporter.record(event="summary", **summary)
        self.reporter.say(summary_lines(self.shape, summary, stats, len(self.metrics.recent_losses),
                                        self.reporter.path))
        self._end()
        return 0

    def _end(self):
        self.reporter.close()
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()

