"""Loading a checkpoint into a PACI engine: the checkpoint's PACI state checked against the engine and agreed by every
rank before anything changes, then put in place after DeepSpeed's load.

Contract
--------
* :func:`plan` (every rank, before the drain and DeepSpeed's load): reads the ds_paci state DeepSpeed will hand
  back (``client_state['ds_paci']`` of this rank's model-states file, memory-mapped) and this rank's open-window
  file (:mod:`ds_paci.core.step.window_state`), and checks them against the engine: the number of pipeline stages,
  the tied layers, the window an open window was saved with, and the open-window file itself (format,
  data-parallel size, parameters and shapes, where DeepSpeed keeps the gradients, the tied exchanges). A rank that
  cannot read its state says so as its problem; nothing raises yet.
* :func:`agree`: every rank's verdict gathered over the whole world (``all_gather_object``; loading is not the
  training path, and the checkpoint choice just before it is the same kind of collective), and the first rank's
  refusal raised on every rank, the same one line everywhere (:class:`WindowStateError`, or
  :class:`~ds_paci.core.checkpoint.files.CheckpointError` for a checkpoint that lacks a file), before the engine
  has drained or DeepSpeed has loaded anything: the weights, ``global_steps``, the scheduler, the stream (its
  micro-batches in flight included) and the skip counters are as they were, and training may go on.
* :func:`apply` (after DeepSpeed's load): the saved stream position, open window, skip counters and tied pending
  windows with the lag they were posted under (a smaller lag now, from a larger window: the first local step
  catches up, as after ``set_train_batch_size``).
* ``load_module_only=True`` takes the weights alone, as DeepSpeed does (it keeps the engine's own counters and
  scheduler): nothing of the checkpoint's PACI state is checked or used, the engine's own open window and tied
  pending windows are dropped, its stream goes on from its own position with the window closed. A fresh engine
  thus starts a fresh stream.
* A checkpoint without ds_paci state (DeepSpeed's own): the stream goes on from where it was, window closed.
* DeepSpeed's universal checkpoints are read by DeepSpeed from another layout: their ds_paci state comes from the
  ``client_state`` DeepSpeed returns, checked and agreed the same way, but only after DeepSpeed's load.
"""

import os

import torch

from ..checkpoint.files import CheckpointError
from ..seam import deepspeed_internals as ds
from ..step import window_state
from ..step.window_state import WindowStateError
from ..tied.layout import tied_owner_stages
from . import warm_start

_KINDS = {"WindowStateError": WindowStateError, "CheckpointError": CheckpointError}
_CLOSE_FIX = "or save a checkpoint whose windows are closed (engine.drain() right before save_checkpoint)"


class Plan:
    """One rank's view of the checkpoint's PACI state: ``saved`` (its ds_paci state or ``None``), ``window`` (its
    open-window file or ``None``), ``problem`` (``(kind, line)`` or ``None``)."""

    def __init__(self, folder, module_only, saved=None, window=None, problem=None):
        self.folder, self.module_only = folder, module_only
        self.saved, self.window, self.problem = saved, window, problem


def saved_state(engine):
    """What a save writes under ``client_state['ds_paci']`` besides the stream position."""
    tied = getattr(engine, "_tied", None)
    return {"stages": engine.num_stages, "stage": engine.stage_id, "dp_size": engine.dp_world_size,
            "tied": {key: list(stages) for key, stages in tied_owner_stages(engine.module).items()},
            "tied_lag": None if tied is None else tied.lag,
            "warm_start": warm_start.state_dict(engine),
            "skips": {"total": engine._skips.total, "consecutive": engine._skips.consecutive,
                      "last_skipped_step": engine._skips.last_skipped_step}}


def plan(engine, load_dir, tag, module_only):
    """This rank's :class:`Plan` for checkpoint ``load_dir``/``tag``, read before DeepSpeed's load; never raises."""
    folder = os.path.join(load_dir, str(tag))
    if module_only:
        return Plan(folder, True)
    path = ds.model_states_file_namer(engine)(load_dir, tag)
    if not os.path.exists(path):
        return Plan(folder, False, problem=("CheckpointError", (
            f"checkpoint {folder} has no {os.path.basename(path)} for {engine._describe_rank()}: it was saved with "
            "another pipeline layout; resume with the saving run's stages, or load_checkpoint(..., "
            "load_module_only=True) for its weights alone (a fresh stream)")))
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        except RuntimeError:  # not a zip-format file: read it whole, as DeepSpeed will
            state = ds.checkpoint_engine(engine).load(path, map_location=torch.device("cpu"))
        return checked(engine, folder, (state or {}).get("ds_paci"))
    except Exception as e:  # noqa: BLE001 (every rank must reach agree(); the line says what failed)
        return Plan(folder, False, problem=("CheckpointError", f"checkpoint {folder}: {engine._describe_rank()} "
                                            f"cannot read its ds_paci state: {type(e).__name__}: {e}"))


def checked(engine, folder, saved, module_only=False):
    """A :class:`Plan` from ``saved`` (a checkpoint's ds_paci state or ``None``), checked against ``engine``."""
    out = Plan(folder, module_only, saved)
    if module_only or saved is None:
        return out
    problem = _layout_problem(engine, folder, saved)
    if problem is None:
        stream = saved["stream"]
        fill = int(stream.get("window_fill", 0))
        out.window = window_state.read(engine, folder)
        if out.window is None and fill:
            out.problem = ("CheckpointError", (
                f"checkpoint {folder} was saved with an open accumulation window ({fill} backward passes) but has no "
                f"{window_state.file_name(engine)} for {engine._describe_rank()}; load a complete checkpoint"))
        elif out.window is not None:
            problem = window_state.check(engine, out.window, f"checkpoint {folder}")
    if problem is not None:
        out.problem = ("WindowStateError", problem)
    return out


def _layout_problem(engine, folder, saved):
    """Stages, tied layers and the window of an open window: the saving run's against this one."""
    stages = saved.get("stages", (saved.get("telemetry") or {}).get("stages"))
    if stages is not None and stages != engine.num_stages:
        return (f"checkpoint {folder} was saved on {stages} pipeline stages; this run has {engine.num_stages}: resume "
                "on as many stages, or load_checkpoint(..., load_module_only=True) for its weights alone (a fresh "
                "stream)")
    tied = saved.get("tied")
    mine = {key: list(st) for key, st in tied_owner_stages(engine.module).items()}
    if tied is not None and tied != mine:
        return (f"checkpoint {folder} was saved with tied layers {tied or 'none'} (key: owner stages); this model "
                f"ties {mine or 'none'}: load it into a model with the same tied layers")
    stream = saved["stream"]
    fill, window = int(stream.get("window_fill", 0)), stream.get("window", engine.accumulation_window)
    if fill and window != engine.accumulation_window:
        return (f"checkpoint {folder} was saved with an open accumulation window ({fill} of {window} backward "
                f"passes) on stage {engine.stage_id}; this run's window is {engine.accumulation_window} there: resume "
                f"with accumulation window {window} (\"auto\": the same M), {_CLOSE_FIX}")
    phase = int(stream.get("phase", 0))  # states saved before the step phase existed are aligned
    if fill and phase != engine._stream.phase:
        # Catching up would need a window of more than a micro-batches or a step the saving run never takes.
        return (f"checkpoint {folder} was saved with an open accumulation window on stage {engine.stage_id} under "
                f"step phase {phase} (\"paci.step_phase\" {'aligned' if phase == 0 else 'diagonal'}); this run's "
                f"phase there is {engine._stream.phase} (\"{engine._step_phase}\"): resume with the saving run's "
                f"\"step_phase\", {_CLOSE_FIX}")
    return None


def agree(engine, mine):
    """Raise the first rank's refusal on every rank (a collective over the whole world), or return."""
    import torch.distributed as tdist
    view = mine.problem
    views = [view]
    if tdist.is_initialized() and tdist.get_world_size() > 1:
        views = [None] * tdist.get_world_size()
        tdist.all_gather_object(views, view)
    for view in views:
        if view is not None:
            kind, line = view
            raise _KINDS[kind](line)


def apply(engine, agreed):
    """After DeepSpeed's load: the agreed state in place of the engine's own (see the module docstring)."""
    window_state.discard(engine)  # the drained engine's own open window does not continue
    saved = agreed.saved
    if not agreed.module_only:  # a module-only load starts its own warm start afresh
        warm_start.load_state_dict(engine, None if saved is None else saved.get("warm_start"))
    if agreed.module_only or saved is None:
        engine._stream.window_fill = 0
        return
    stream = engine._stream
    stream.load_state_dict(saved["stream"])
    if stream.micro_batches != engine.micro_batches:  # resumed with another batch size: the rule's unit
        stream.set_micro_batches(engine.micro_batches)
    engine.telemetry.version = stream.version
    skips = saved.get("skips")
    if skips is not None:
        engine._skips.total, engine._skips.consecutive = int(skips["total"]), int(skips["consecutive"])
        engine._skips.last_skipped_step = skips["last_skipped_step"]
    if agreed.window is not None:
        tied = getattr(engine, "_tied", None)
        lag = saved.get("tied_lag")
        if lag is None and tied is not None:  # saved before the lag was written: the saving run's window says it
            lag = tied.lag_for(saved["stream"].get("window", engine.accumulation_window))
        window_state.restore(engine, agreed.window, f"checkpoint {agreed.folder}", lag=lag)
