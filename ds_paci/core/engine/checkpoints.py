"""The engine's checkpoints: DeepSpeed's own save and load, drained first, atomic, with the stream position and
an open window's gradients.

:class:`EngineCheckpoints` is a part of :class:`~ds_paci.core.engine.pipeline_engine.PACIPipelineEngine` (a mixin over DeepSpeed's
``save_checkpoint`` / ``load_checkpoint``, which it calls through ``super()``); see :mod:`ds_paci.core.checkpoint.atomic`
and :mod:`ds_paci.core.step.window_state`.
"""

import os

from ..checkpoint import atomic as checkpoint
from ..step import window_state
from ..seam import deepspeed_internals as ds
from ..step.guard import assert_finite_weights
from ..step.local_step import clipping_policy


class EngineCheckpoints:
    """A part of the engine (see the module docstring)."""

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True, exclude_frozen_parameters=False):
        """Drain (window left open), then atomically save an ordinary DeepSpeed checkpoint with the stream position
        under ``client_state['ds_paci']`` (see :mod:`ds_paci.core.checkpoint.atomic`), and an open window's gradients in
        one more file per rank (:mod:`ds_paci.core.step.window_state`). The default tag is ``global_step<N>``, ``N`` the
        ``train_batch`` calls so far, as on the stock engine.

        Refuses (on every rank, before writing anything) to save non-finite weights, and (on a rank whose
        look-ahead could not restore the real weights) weights that are not the real ones.
        """
        if self._lookahead is not None:
            self._lookahead.check_restored()
        self.drain(close_window=False)
        assert_finite_weights(self)
        state = dict(client_state or {})
        state["ds_paci"] = {"stream": self._stream.state_dict(), "telemetry": self.telemetry.summary()}
        parent_save = super().save_checkpoint
        window = window_state.capture(self) if window_state.needed(self) else None

        def write(staging_tag, save_latest):
            if window is not None:  # before DeepSpeed's save, which ends with the barrier the commit relies on
                folder = os.path.join(save_dir, staging_tag)
                os.makedirs(folder, exist_ok=True)
                ds.checkpoint_engine(self).save(window, os.path.join(folder, window_state.file_name(self)))
            return parent_save(save_dir, tag=staging_tag, client_state=state, save_latest=save_latest,
                               exclude_frozen_parameters=exclude_frozen_parameters)

        return checkpoint.atomic_save(self, save_dir, tag, save_latest, write)

    def load_checkpoint(self, load_dir, tag=None, **kwargs):
        """Drain, verify the checkpoint is complete (:class:`~ds_paci.core.checkpoint.atomic.CheckpointError` otherwise),
        load it, and resume the stream where the saved (drained) one stopped, with its open window if it had one
        (:class:`~ds_paci.core.step.window_state.WindowStateError` when that cannot be restored on this layout)."""
        self.drain(close_window=False)
        tag = checkpoint.verified_tag(self, load_dir, tag) or tag
        path, client_state = super().load_checkpoint(load_dir, tag=tag, **kwargs)
        self._clipping = clipping_policy(self, stock=self._stock_step)  # wrappers restore their saved clip value
        if path is not None:
            self._load_window(os.path.dirname(path), (client_state or {}).get("ds_paci"))
        self._feed.clear()
        if self._tied is not None and self._tied.check:
            self._tied.verify("after loading a checkpoint")
        return path, client_state

    def _load_window(self, folder, saved):
        """After DeepSpeed's load: the saved stream position and open window (or none), replacing the current one."""
        window_state.discard(self)  # the drained engine's own open window does not continue
        if saved is None:  # not a ds_paci checkpoint: the stream goes on from where it was, window closed
            self._stream.window_fill = 0
            return
        saved_window = saved["stream"].get("window", self._stream.window)
        if saved["stream"].get("window_fill") and saved_window != self._stream.window:
            raise window_state.WindowStateError(
                f"checkpoint {folder} was saved with an open accumulation window ({saved['stream']['window_fill']} of "
                f"{saved_window} backward passes); this run's window is {self._stream.window}: resume with "
                f"accumulation window {saved_window}, or save a checkpoint whose windows are closed (engine.drain() "
                "right before save_checkpoint)")
        self._stream.load_state_dict(saved["stream"])
        if self._stream.micro_batches != self.micro_batches:  # resumed with another batch size: the rule's unit
            self._stream.set_micro_batches(self.micro_batches)
        self.telemetry.version = self._stream.version
        state = window_state.read(self, folder)
        if state is not None:
            window_state.restore(self, state, f"checkpoint {folder}")
        elif self._stream.window_fill:
            raise checkpoint.CheckpointError(
                f"checkpoint {folder} was saved with an open accumulation window ({self._stream.window_fill} backward "
                f"passes) but has no {window_state.file_name(self)} for {self._describe_rank()}; load a complete "
                "checkpoint")
