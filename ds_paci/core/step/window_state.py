"""A stage's open accumulation window as data, so that a checkpoint taken with a window open resumes exactly.

Evaluation and checkpoints drain the stream without stepping a partial window
(:mod:`ds_paci.core.program.stream`, "Windows across drains"), so a drained engine may hold gradients of
``window_fill`` micro-batches that no local step has taken yet, and a tied-weight owner may hold the last
``L`` windows of the tied exchange not applied yet (:mod:`ds_paci.core.tied.weights`). DeepSpeed's checkpoint
keeps weights and optimizer state, not gradients, so :meth:`PACIPipelineEngine.save_checkpoint` writes
them into the checkpoint folder as one more file per rank (:func:`file_name`, from the rank's
coordinates), and :meth:`PACIPipelineEngine.load_checkpoint` puts them back.

What a rank's file holds (:func:`capture`), per optimizer path (:func:`gradient_path`: where DeepSpeed keeps
the window's gradients):

* every parameter's ``.grad`` of the stage's module (torch.optim and DeepSpeed's fp32 optimizer accumulate
  there; so does ZeRO-1, whose reduce runs only at the local step; under ``BF16_Optimizer`` the bf16
  gradients of the last micro-batch);
* under ``BF16_Optimizer``: its fp32 accumulated gradients (``fp32_groups_gradients_flat``) and which of
  them hold a value (``fp32_groups_has_gradients``);
* under ZeRO-1 with a separate accumulation dtype (``use_grad_accum_attribute``: bf16 with
  ``data_types.grad_accum_dtype`` fp32, which DeepSpeed runs on ZeRO's own optimizer when the optimizer is
  offloaded): every parameter's ``grad_accum``, where that path accumulates (``.grad`` is empty there);
* on a tied owner: the exchange's pending windows, each owner's message (its tied gradient and its finite
  flag, :mod:`ds_paci.core.tied.weights`) by owner stage, so a resume applies them with the same verdicts and factors;
* the data-parallel size: the gradients of the open window are each replica's own, not yet reduced, so a
  checkpoint with an open window resumes only on as many replicas. A checkpoint whose windows are closed
  (``engine.drain()`` before the save) has no such file and resumes on any layout DeepSpeed accepts.

:func:`check` says, without changing anything, why a file cannot be restored on this engine (format,
data-parallel size, parameters and their shapes, where the gradients live, the tied exchanges), so that a load
is refused before DeepSpeed's load (:mod:`ds_paci.core.engine.resume`); :func:`restore` runs it again and puts
the window back.

Imports torch and DeepSpeed only.
"""

import os

import torch
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

from ..seam import compat
from ..seam import deepspeed_internals as ds
from .local_step import is_wrapped

FORMAT = 2  # 2: the gradient path and ZeRO's grad_accum; format 1 files (no path) are read as their keys say
READABLE = (1, 2)
PATHS = {
    "param.grad": "the parameters' .grad",
    "BF16_Optimizer": "BF16_Optimizer's fp32 gradient buffers",
    "grad_accum": "ZeRO's param.grad_accum (bf16 with fp32 gradient accumulation and offload_optimizer)",
}


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


def gradient_path(optimizer):
    """Where DeepSpeed keeps a window's gradients under ``optimizer``: a key of :data:`PATHS`."""
    if isinstance(optimizer, BF16_Optimizer):
        return "BF16_Optimizer"
    if ds.use_grad_accum_attribute(optimizer):
        return "grad_accum"
    return "param.grad"


def _saved_path(state):
    return state.get("path") or ("BF16_Optimizer" if "hp_grads" in state else "param.grad")


def _cpu(tensors):
    return [None if t is None else t.detach().cpu().clone() for t in tensors]


def capture(engine):
    """This rank's open window as CPU tensors (see the module docstring)."""
    opt = engine.optimizer
    params = list(engine.module.parameters())
    state = {
        "format": FORMAT,
        "path": gradient_path(opt),
        "window_fill": engine._stream.window_fill,
        "dp_size": engine.dp_world_size,
        "grads": _cpu(p.grad for p in params),
    }
    if state["path"] == "grad_accum":
        state["grad_accum"] = _cpu(ds.grad_accum(p) for p in params)
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


def check(engine, state, where):
    """Why ``state`` (from :func:`read`) cannot be restored on ``engine``, in one line, or ``None``. Changes nothing.
    ``where``: for messages."""
    if state.get("format") not in READABLE:
        return f"{where}: open-window file of format {state.get('format')!r}, this ds_paci reads formats {READABLE}"
    if state["dp_size"] != engine.dp_world_size:
        return (f"{where} was saved with an open accumulation window on {state['dp_size']} data-parallel replicas; "
                f"this run has {engine.dp_world_size}: resume with {state['dp_size']} replicas, or save a checkpoint "
                "whose windows are closed (engine.drain() right before save_checkpoint) to change the layout")
    params = list(engine.module.parameters())
    shapes = [None if g is None else tuple(g.shape) for g in state["grads"]]
    mine = [tuple(p.shape) for p in params]
    if len(shapes) != len(mine) or any(s is not None and s != m for s, m in zip(shapes, mine)):
        return (f"{where}: the open window holds gradients of {len(shapes)} parameters of shapes {shapes}, this stage "
                f"has {len(mine)} of shapes {mine}; load it into the same model")
    saved, mine = _saved_path(state), gradient_path(engine.optimizer)
    if state.get("window_fill") and saved != mine:
        return (f"{where} was saved with an open accumulation window whose gradients DeepSpeed kept in {PATHS[saved]}; "
                f"this run keeps them in {PATHS[mine]} (another bf16, zero_optimization.offload_optimizer or "
                "data_types.grad_accum_dtype setting): resume with the saving run's optimizer settings, or save a "
                "checkpoint whose windows are closed (engine.drain() right before save_checkpoint)")
    if "hp_grads" in state and mine == "BF16_Optimizer":
        flats = [tuple(f.shape) for f in ds.fp32_gradients_flat(engine.optimizer)]
        if flats != [tuple(f.shape) for f in state["hp_grads"]]:
            return (f"{where}: the open window's fp32 gradient buffers {[tuple(f.shape) for f in state['hp_grads']]} "
                    f"do not fit this optimizer's {flats}; load it into the same model")
    return _tied_problem(getattr(engine, "_tied", None), state.get("tied"), where)


def restore(engine, state, where, lag=None):
    """Put a captured window back (after DeepSpeed loaded weights and optimizer state). ``where``: for messages;
    ``lag``: the tied lag the pending windows were posted under (the first step catches up if it shrank)."""
    problem = check(engine, state, where)
    if problem is not None:
        raise WindowStateError(problem)
    params = list(engine.module.parameters())
    opt = engine.optimizer
    with torch.no_grad():
        for p, g in zip(params, state["grads"]):
            if g is None:
                p.grad = None
            elif p.grad is None:
                p.grad = g.to(device=p.device, dtype=p.dtype)
            else:
                p.grad.copy_(g)
        if "grad_accum" in state:
            ds.zero_reset_backward_flags(opt)  # else the next forward drops what is put back here
            for p, g in zip(params, state["grad_accum"]):
                ds.set_grad_accum(p, None if g is None else g.to(device=p.device))
        if "hp_grads" in state:
            for flat, saved in zip(ds.fp32_gradients_flat(opt), state["hp_grads"]):
                flat.copy_(saved)
            for i, flags in enumerate(state["hp_has"]):
                ds.fp32_has_gradients(opt)[i] = list(flags)
    tied = getattr(engine, "_tied", None)
    if tied is not None:
        _load_tied_pending(tied, state.get("tied"), lag)


def _tied_problem(tied, state, where):
    """Why the saved pending tied windows ``state`` do not fit this rank's exchanges, or ``None``."""
    exchanges = [] if tied is None else tied.exchanges
    if not state:
        return None
    if len(state) != len(exchanges):
        return (f"{where}: the checkpoint's pending tied windows are for {len(state)} exchanges, this rank has "
                f"{len(exchanges)}; load it into a model with the same tied layers")
    for ex, saved in zip(exchanges, state):
        if list(saved["keys"]) != list(ex.keys):
            return (f"{where}: the checkpoint's pending tied windows are for keys {saved['keys']}, this rank "
                    f"exchanges {list(ex.keys)}; load it into a model with the same tied layers")
        peers = {ex.stages[ex.ranks.index(r)] for r in ex.peers}
        for entry in saved["pending"].values():
            if entry["own"].numel() != ex.numel + 1 or set(entry["recv"]) != peers:
                return (f"{where}: the checkpoint's pending tied windows for keys {list(ex.keys)} do not fit this "
                        "rank's tied parameters; load it into the same model")
    return None


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


def _load_tied_pending(tied, state, lag=None):
    """Replace the pending windows by ``state`` (from :func:`_tied_pending`, checked by :func:`_tied_problem`;
    ``None``: none pending), posted under tied lag ``lag``."""
    pending = None
    if state:
        pending = []
        for ex, saved in zip(tied.exchanges, state):
            pending.append({int(version): {"own": entry["own"],
                                           "recv": {ex.ranks[ex.stages.index(stage)]: message
                                                    for stage, message in entry["recv"].items()}}
                            for version, entry in saved["pending"].items()})
    tied.load_pending(pending, lag)
