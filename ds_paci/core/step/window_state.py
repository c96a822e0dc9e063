"""A stage's open accumulation window as data, so that a checkpoint taken with a window open resumes exactly.

Evaluation and checkpoints drain the stream without stepping a partial window
(:mod:`ds_paci.core.program.stream`, "Windows across drains"), so a drained engine may hold gradients of
``window_fill`` micro-batches that no local step has taken yet, and a tied-weight owner may hold the last
``L`` windows of the tied exchange not applied yet (:mod:`ds_paci.core.tied.weights`). DeepSpeed's checkpoint
keeps weights and optimizer state, not gradients, so :meth:`PACIPipelineEngine.save_checkpoint` writes
them into the checkpoint folder as one more file per rank (:func:`file_name`, from the rank's
coordinates), and :meth:`PACIPipelineEngine.load_checkpoint` puts them back.

What a rank's file holds (:func:`capture`), per optimizer path:

* every parameter's ``.grad`` of the stage's module (torch.optim and DeepSpeed's fp32 optimizer accumulate
  there; so does ZeRO-1, whose reduce runs only at the local step; under ``BF16_Optimizer`` the bf16
  gradients of the last micro-batch);
* under ``BF16_Optimizer``: its fp32 accumulated gradients (``fp32_groups_gradients_flat``) and which of
  them hold a value (``fp32_groups_has_gradients``);
* on a tied owner: the exchange's pending windows, each owner's message (its tied gradient and its finite
  flag, :mod:`ds_paci.core.tied.weights`) by owner stage, so a resume applies them with the same verdicts and factors;
* the data-parallel size: the gradients of the open window are each replica's own, not yet reduced, so a
  checkpoint with an open window resumes only on as many replicas (:func:`restore` refuses otherwise,
  naming the fix). A checkpoint whose windows are closed (``engine.drain()`` before the save) has no such
  file and resumes on any layout DeepSpeed accepts.

Imports torch and DeepSpeed only.
"""

import os

import torch
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

from ..seam import compat
from ..seam import deepspeed_internals as ds
from .local_step import is_wrapped

FORMAT = 1


class WindowStateError(RuntimeError):
    """A checkpoint's open window cannot be restored on this run (the message names the fix)."""


def file_name(engine):
    """This rank's file in a checkpoint folder: named by its stage, data-parallel and tensor-parallel coordinates."""
    grid = engine.grid
    return (f"ds_paci_window_stage{engine.stage_id:02d}_dp{grid.data_parallel_id:03d}_"
            f"tp{grid.get_slice_parallel_rank():02d}.pt")


def needed(engine):
    """True when this rank holds something a checkpoint must keep: an open window or tied windows not applied."""
    tied = getattr(engine, "_tied", None)
    return engine._stream.window_fill > 0 or (tied is not None and any(ex.pending for ex in tied.exchanges))


def capture(engine):
    """This rank's open window as CPU tensors (see the module docstring)."""
    opt = engine.optimizer
    state = {
        "format": FORMAT,
        "window_fill": engine._stream.window_fill,
        "dp_size": engine.dp_world_size,
        "grads": [None if p.grad is None else p.grad.detach().cpu().clone() for p in engine.module.parameters()],
    }
    if isinstance(opt, BF16_Optimizer):
        state["hp_grads"] = [flat.detach().cpu().clone() for flat in ds.fp32_gradients_flat(opt)]
        state["hp_has"] = [list(flags) for flags in ds.fp32_has_gradients(opt)]
    tied = getattr(engine, "_tied", None)
    if tied is not None:
        state["tied"] = _tied_pending(tied)
    return state


def discard(engine):
    """Drop the open window's gradients (a load replaces them), on every optimizer path."""
    if is_wrapped(engine.optimizer):
        compat.discard_wrapper_gradients(engine.optimizer)
    else:
        engine.zero_grad()
    tied = getattr(engine, "_tied", None)
    if tied is not None:
        _load_tied_pending(tied, None)


def read(engine, folder):
    """This rank's file from checkpoint ``folder``, or ``None`` when the save left none for it."""
    path = os.path.join(folder, file_name(engine))
    if not os.path.exists(path):
        return None
    return torch.load(path, map_location="cpu", weights_only=False)


def restore(engine, state, where):
    """Put a captured window back (after DeepSpeed loaded weights and optimizer state). ``where``: for messages."""
    if state.get("format") != FORMAT:
        raise WindowStateError(f"{where}: open-window file of format {state.get('format')!r}, this ds_paci reads "
                               f"format {FORMAT}")
    if state["dp_size"] != engine.dp_world_size:
        raise WindowStateError(
            f"{where} was saved with an open accumulation window on {state['dp_size']} data-parallel replicas; this "
            f"run has {engine.dp_world_size}: resume with {state['dp_size']} replicas, or save a checkpoint whose "
            "windows are closed (engine.drain() right before save_checkpoint) to change the layout")
    params = list(engine.module.parameters())
    if len(params) != len(state["grads"]):
        raise WindowStateError(f"{where}: the open window holds gradients of {len(state['grads'])} parameters, this "
                               f"stage has {len(params)}; load it into the same model")
    with torch.no_grad():
        for p, g in zip(params, state["grads"]):
            if g is None:
                p.grad = None
            elif p.grad is None:
                p.grad = g.to(device=p.device, dtype=p.dtype)
            else:
                p.grad.copy_(g)
        opt = engine.optimizer
        if "hp_grads" in state:
            for flat, saved in zip(ds.fp32_gradients_flat(opt), state["hp_grads"]):
                flat.copy_(saved)
            for i, flags in enumerate(state["hp_has"]):
                ds.fp32_has_gradients(opt)[i] = list(flags)
    tied = getattr(engine, "_tied", None)
    if tied is not None:
        _load_tied_pending(tied, state.get("tied"))


def _tied_pending(tied):
    """A drained owner's pending tied windows (own and received parts, by owner stage), as CPU tensors.

    After a drain every receive has completed (:meth:`TiedWeights.finish_drain` waits for them).
    """
    out = []
    for ex in tied.exchanges:
        pending = {}
        for version, entry in ex.pending.items():
            pending[version] = {"own": entry["own"].cpu().clone(),
                                "recv": {ex.stages[ex.ranks.index(r)]: buf.cpu().clone()
                                         for r, (_, buf) in entry["recv"].items()}}
        out.append({"keys": list(ex.keys), "pending": pending})
    return out


def _load_tied_pending(tied, state):
    """Replace the pending windows by ``state`` (from :func:`_tied_pending`; ``None``: none pending)."""
    if state is not None and len(state) != len(tied.exchanges):
        raise WindowStateError(f"the checkpoint's pending tied windows are for {len(state)} exchanges, this rank has "
                               f"{len(tied.exchanges)}; load it into the same model")
    pending = None
    if state is not None:
        pending = []
        for ex, saved in zip(tied.exchanges, state):
            if list(saved["keys"]) != list(ex.keys):
                raise WindowStateError(f"the checkpoint's pending tied windows are for keys {saved['keys']}, this "
                                       f"rank exchanges {list(ex.keys)}; load it into the same model")
            pending.append({int(version): {"own": entry["own"],
                                           "recv": {ex.ranks[ex.stages.index(stage)]: message
                                                    for stage, message in entry["recv"].items()}}
                            for version, entry in saved["pending"].items()})
    tied.load_pending(pending)
