"""A synchronous warm start (``"paci": {"sync_warmup_calls": K or "auto"}``): the first calls on stock's schedule.

Each warm ``train_batch`` call runs every stage with the window ``M``, aligned steps and a drain that closes the
window at the end of the call: the stock engine's schedule, so every forward sees the weights stock's would (no
forward crosses a step, so nothing is predicted) and the call costs stock's bubble. After the warm start the
stream takes the configured window and phase and runs continuously. Why (issue 30,
``docs/results/quality-candidates.md``): asynchrony early in training, where the loss falls fastest, left runs
on a loss plateau that stock left within its first tens of steps; after a synchronous start, the same look-ahead
ended near stock. The warm start runs PACI's own machinery (local steps, PACI's clipping rule, its reduce), not
DeepSpeed's step: it equals stock's math where those agree (no clipping, one stage owning each parameter), which
``tests/test_sync_warmup.py`` checks against the replay.

How long:

* ``K`` (an int): the first ``K`` calls (``global_steps < K``: a resume continues the count).
* ``"auto"`` (the default with ``"accumulation_window": "auto"``): until
  :class:`~ds_paci.core.program.warm_end.WarmEnd` says the loss has left the labels' unigram plateau. The last
  stage counts the labels it loads in warm calls (:func:`seen`) and, after each warm call, feeds the call's loss
  (the value ``train_batch`` returns, already averaged over data-parallel replicas) to the rule; its decision is
  agreed over its data-parallel group (all must say "end") and broadcast to every stage of its pipeline
  (:func:`observed`): two collectives per warm call, legal there because a warm call ends drained, as DeepSpeed's
  own loss broadcast at the end of its calls. So every rank switches after the same call. The decision and the
  rule's state go into checkpoints (:func:`state_dict`), so a resumed run switches where an uninterrupted one
  would. Labels that are not integer token ids cannot be judged: the warm start then ends after its first call,
  and one line says so.
"""

import torch
from deepspeed import comm as dist

from ..program.stream import step_phase
from ..program.warm_end import AUTO, WarmEnd
from .startup import emit


def label_counts(labels):
    """Counts (a CPU tensor) of the label ids in ``labels`` (a tensor, or a tuple/list whose first integer tensor
    holds them, as Megatron's ``(labels, loss_mask)``), negative ids (an ``ignore_index``) left out; ``None``: no
    integer labels."""
    if isinstance(labels, (tuple, list)):
        return next((h for h in map(label_counts, labels) if h is not None), None)
    if not torch.is_tensor(labels) or labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        return None
    ids = labels.detach().reshape(-1).long()
    return torch.bincount(ids[ids >= 0].cpu())


def label_histogram(labels):
    """:func:`label_counts` as a list (``None``: no integer labels)."""
    counts = label_counts(labels)
    return None if counts is None else counts.tolist()


def _add(total, counts):
    if total is None:
        return counts
    if len(counts) > len(total):
        total, counts = counts, total
    total[:len(counts)] += counts
    return total


def _auto(engine) -> bool:
    return engine.paci.sync_warmup_calls == AUTO


def is_warm_call(engine) -> bool:
    """Whether the next ``train_batch`` is one of the warm start's calls (never in sync mode: it is synchronous)."""
    if engine._stock_step or not engine.paci.warm_start:
        return False
    if _auto(engine):
        return not engine._warm_done
    return engine.paci.sync_warmup_calls > engine.global_steps


def setup(engine) -> None:
    """The engine's warm-start state (before any call)."""
    engine._warm_done = False  # "auto": whether the warm start has ended (agreed by every rank)
    engine._warm_call = False  # whether the call in progress is a warm one
    engine._warm_end = WarmEnd(engine.paci.sync_warmup_loss_ratio) if _auto(engine) else None
    engine._warm_unjudged = False  # "auto" on labels that are not token ids
    engine._warm_labels = None  # the last stage's label counts of the warm call in progress (a tensor)


def follow(engine) -> bool:
    """Put the drained stream on the schedule of the next call; returns :func:`is_warm_call`.

    Nothing changes without a warm start. Switching needs a closed window: a stream with an open one (a checkpoint
    saved without a warm start, loaded into a run with one) is drained first with its window closed, as
    ``set_train_batch_size`` does.
    """
    engine._warm_call = False
    if not engine.paci.warm_start:
        return False
    warm = engine._warm_call = is_warm_call(engine)
    M = engine.micro_batches
    window = M if warm else engine._configured_window()
    phase = step_phase("aligned" if warm else engine._step_phase, engine.stage_id, window)
    stream = engine._stream
    if (stream.window, stream.phase) != (window, phase):
        if stream.window_fill or not engine.is_drained:
            engine.drain(close_window=True)
        stream.set_micro_batches(M, window, phase)
    return warm


def seen(engine, batch):
    """A micro-batch the engine loads (returned as is); the last stage counts its labels in an ``"auto"`` warm call."""
    if engine._warm_call and engine._warm_end is not None and engine.is_last_stage():
        counts = label_counts(batch[1] if isinstance(batch, (tuple, list)) and len(batch) > 1 else None)
        if counts is None:
            engine._warm_unjudged = True
        else:
            engine._warm_labels = _add(engine._warm_labels, counts)
    return batch


def observed(engine, loss):
    """After a call's loss (returned as is): an ``"auto"`` warm call's loss goes to the rule, and every rank of the
    pipeline learns whether the warm start ends here (see the module docstring)."""
    if not (engine._warm_call and engine._warm_end is not None):
        return loss
    due = torch.zeros(1, dtype=torch.float32, device=engine.device)
    if engine.is_last_stage():
        if engine._warm_labels is not None:  # one histogram per call: a vocabulary of 50k costs milliseconds
            engine._warm_end.observe_labels(engine._warm_labels.tolist())
            engine._warm_labels = None
        engine._warm_end.observe_loss(float(loss))
        due.fill_(1.0 if engine._warm_unjudged or engine._warm_end.due() else 0.0)
        if engine.is_data_parallel:  # every replica must end at the same call: all of them say so
            dist.all_reduce(due, op=dist.ReduceOp.MIN, group=engine.grid.get_data_parallel_group())
    if engine.num_stages > 1:
        dist.broadcast(due, src=engine.grid.stage_to_global(engine.num_stages - 1),
                       group=engine.grid.get_pipe_parallel_group())
    if due.item() > 0:
        engine._warm_done = True
        if engine.is_last_stage() and engine.grid.data_parallel_id == 0:
            why = ("the labels are not integer token ids, so the loss cannot be judged against their unigram entropy "
                   "(set \"sync_warmup_calls\" to a count of calls instead)" if engine._warm_unjudged
                   else engine._warm_end.describe())
            emit(f"ds_paci: synchronous warm start ended after train_batch call {engine.global_steps}: {why}; "
                 "PACI's streams from the next call")
    return loss


def state_dict(engine) -> dict:
    """What a checkpoint keeps of the warm start (``client_state['ds_paci']['warm_start']``)."""
    rule = engine._warm_end
    return {"done": bool(engine._warm_done), "unjudged": bool(engine._warm_unjudged),
            "rule": None if rule is None or not engine.is_last_stage() else rule.state_dict()}


def load_state_dict(engine, state) -> None:
    """Continue the saved warm start (``state``: :func:`state_dict`'s, or ``None`` for a checkpoint saved before the
    ``"auto"`` warm start existed: a run that had trained counts as past it)."""
    if state is None:
        engine._warm_done = engine.global_steps > 0
        return
    engine._warm_done = bool(state.get("done", False))
    engine._warm_unjudged = bool(state.get("unjudged", False))
    if engine._warm_end is not None and state.get("rule") is not None:
        engine._warm_end.load_state_dict(state["rule"])
