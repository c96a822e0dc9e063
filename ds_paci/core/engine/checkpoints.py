"""The engine's checkpoints: DeepSpeed's own save and load, drained first, atomic, with the stream position and
an open window's gradients.

:class:`EngineCheckpoints` is a part of :class:`~ds_paci.core.engine.pipeline_engine.PACIPipelineEngine` (a mixin over DeepSpeed's
``save_checkpoint`` / ``load_checkpoint``, which it calls through ``super()``); see :mod:`ds_paci.core.checkpoint.atomic`
and :mod:`ds_paci.core.step.window_state`; a load is checked and agreed by every rank before anything changes
(:mod:`ds_paci.core.engine.resume`).
"""

import os

from ..checkpoint import atomic as checkpoint
from ..step import window_state
from . import resume
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
        state["ds_paci"] = {"stream": self._stream.state_dict(), "telemetry": self.telemetry.summary(),
                            **resume.saved_state(self)}
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
        """Verify the checkpoint is complete (:class:`~ds_paci.core.checkpoint.atomic.CheckpointError` otherwise) and
        that its PACI state fits this engine, agreed by every rank before anything changes
        (:mod:`ds_paci.core.engine.resume`: one line on every rank, the engine untouched); then drain, load it, and
        resume the stream where the saved (drained) one stopped, with its open window, skip counters and pending
        tied windows. ``load_module_only=True``: the weights alone, the stream goes on with its window closed."""
        module_only = bool(kwargs.get("load_module_only", False))
        tag = checkpoint.verified_tag(self, load_dir, tag) or tag
        universal = getattr(self, "load_universal_checkpoint", lambda: False)()
        agreed = None
        if tag is not None and not universal:
            agreed = resume.plan(self, load_dir, tag, module_only)
            resume.agree(self, agreed)
        self.drain(close_window=False)
        path, client_state = super().load_checkpoint(load_dir, tag=tag, **kwargs)
        self._clipping = clipping_policy(self, stock=self._stock_step)  # wrappers restore their saved clip value
        if path is not None:
            if agreed is None:  # a universal checkpoint: its ds_paci state is known only now
                agreed = resume.checked(self, os.path.dirname(path), (client_state or {}).get("ds_paci"), module_only)
                resume.agree(self, agreed)
            resume.apply(self, agreed)
        self._feed.clear()
        if self._tied is not None and self._tied.check:
            self._tied.verify("after loading a checkpoint")
        return path, client_state
