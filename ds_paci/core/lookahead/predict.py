"""Window-informed look-ahead: forwards that cross a local step run on a prediction of the next weights.

Under PACI, the forward of a micro-batch that crosses its stage's next local step runs
on version ``v`` of the weights while its backward runs through ``v + 1``. Immediately
before such a forward, :class:`LookAhead` moves the stage's weights to a prediction of
``v + 1``, the forward runs, and the real weights are restored. The backward is
unchanged: it runs through the real ``v + 1``.

Public contract
---------------
* :func:`make_lookahead` ``(engine, enabled, restore)`` returns a :class:`LookAhead` for
  engines whose optimizer is predicted, or ``None`` (look-ahead off, or an optimizer not
  predicted: then one log line, from rank 0, names the reason and the fallback, plain PACI).
* :func:`lookahead_for_torch_optimizer` ``(optimizer, aliases, restore, max_norm)``: the same
  for one ``torch.optim`` optimizer stepped outside the engine (the replay), or ``None``.
* :meth:`LookAhead.applied` ``(window_fill, window)``: context manager around one crossing
  forward (``window_fill``: backward passes already in the open window of ``window``).
  **Exception safe**: whatever raises while the prediction is computed or written, inside
  the forward, or in the restore, the real weights are back (bit for bit with the ``copy``
  and ``master`` restores) before the exception leaves it. If they cannot be restored (the
  restore failed twice), :class:`PACILookAheadError` says so and every later use raises it.
  Outside it the weights always are the real ones: eval, checkpoints, backward passes and
  every other forward see real weights.
* :meth:`LookAhead.before_step` / :meth:`LookAhead.after_step`: around each local
  optimizer step (telemetry and bookkeeping; they never change weights).
* :meth:`LookAhead.stats`: telemetry (see there); :meth:`LookAhead.predict_next`: the
  predicted next master weights as new tensors (tests and diagnostics).

The prediction
--------------
The optimizer's own next step (:mod:`ds_paci.core.lookahead.rules`: Adam/AdamW, SGD,
Muon; exact optimizer types only) with the hyper-parameters in its param groups now (the
learning rate the scheduler set for the next step), the window's gradient estimated as
``g = coef * a * G / n`` (``G``: the open window's accumulated gradient, ``n`` backward
passes in it; ``n = 0``: from the optimizer's state). ``coef`` is the stage's clip
coefficient when gradient clipping is on: ``max_norm / (a/n * ||G|| + 1e-6)`` when below 1,
the local step's own formula applied to the window's norm estimate (1 otherwise). With
``n = a`` and a single data-parallel replica the prediction is the optimizer's actual next
step, clipping included (up to rounding; tests check <= 1e-6).

What is not moved: with ``n > 0``, a parameter without a gradient is predicted exactly as
the optimizer will step it: in the engine DeepSpeed's reduce gives it a zero gradient
(``zero_filled``), stepped directly ``torch.optim`` skips it (not predicted). With ``n = 0``,
a parameter the last step did not step is not predicted (outside the engine). When the
window's gradient is not finite anywhere the local step will be skipped, so nothing is
predicted (``nonfinite_forwards``). Only one version ahead is predicted. A tied owner's tied weights are not
predicted (:mod:`~ds_paci.core.lookahead.slots`; one line at start-up), every other parameter of it is.

Where the tensors live and how they get back (no new communication anywhere)
----------------------------------------------------------------------------
See :mod:`ds_paci.core.lookahead.slots`. fp32 weights stepped directly are changed in place
and restored by ``restore="copy"`` (the default: a copy of each batch of weights taken just
before it is written, copied back; exact; costs one fp32 copy of the stage's weights while
the forward runs) or ``"recompute"`` (recompute the same update and undo it: no copy, exact
only up to rounding, about twice the prediction's time). ``make_lookahead`` uses ``"copy"``
wherever copies must stay bit-identical (data-parallel replicas, owners of tied layers), and
for updates that depend on the weights (L2 decay). bf16 and ZeRO-1: predicted on the fp32
master partition, written into the (bf16 or fp32) weights the forward reads, restored
exactly from the master.

Order of operations (exception safety): each batch's update is computed first (nothing
written yet), then its undo record is taken (the copy), then it is written; the restore
undoes exactly the recorded batches, each failed undo is retried once tensor by tensor.

Cost: the prediction takes about six multi-tensor passes over the stage's weights (Adam;
SGD two to four) plus one to write it and one read pass to check the window's gradient is
finite (and one for the norm with clipping); the copy restore two more. Muon runs the
optimizer's Newton-Schulz iteration on every matrix, the same cost as its step's. Tensors
are processed in chunks and batches (:data:`CHUNK`, :data:`BATCH`; Muon: whole matrices) so
that temporaries stay bounded.

Telemetry (:meth:`stats`)
-------------------------
``predicted_forwards``, ``clipped_forwards`` (predicted with ``coef < 1``), ``nonfinite_forwards``, ``seconds``
(predicting and restoring), ``tied_unpredicted`` (this owner's tied keys) and ``unpredicted_elements`` (their
elements here), ``prediction_error`` (over windows, below; it counts the unpredicted tied elements), ``error_windows``.
The relative error of a window compares the weights predicted for each of its ``J`` crossing forwards with the real
next weights: ``sqrt(mean_j ||theta_pred_j - theta_next||^2) / ||theta_next - theta||``: 0 is
a perfect prediction, 1 what running the forward on the old weights amounts to. Measured on
one window in ``ERROR_EVERY`` (8), on every ``ERROR_STRIDE``-th element of the master weights.
"""

import math
import time
from contextlib import contextmanager
from typing import NamedTuple, Optional

import torch
from deepspeed.utils import logger

from .rules import AdamRule, adam_moments, adam_update, rule_reader  # noqa: F401 (public names)
from .slots import ClipSource, Slot, _norm_of, engine_slots, fixed_in, keep_fixed, tied_unpredicted, torch_slots

__all__ = ["AdamRule", "LookAhead", "PACILookAheadError", "make_lookahead", "lookahead_for_torch_optimizer",
           "adam_update", "adam_moments", "RESTORE_MODES"]

_Slot = Slot  # the name the tests and older callers use
CHUNK = 1 << 20  # tensors are cut into chunks of at most this many elements (element-wise rules)
BATCH = 1 << 22  # elements predicted by one round of multi-tensor ops: bounds the temporaries
ERROR_STRIDE = 32  # the prediction error is measured on every ERROR_STRIDE-th element (CHUNK is a multiple)
ERROR_EVERY = 8  # ... of one window in ERROR_EVERY (the first, the ninth, ...)
RESTORE_MODES = ("copy", "recompute")


class PACILookAheadError(RuntimeError):
    """The stage's real weights could not be restored after a predicted forward."""


def _chunks(tensor, size=CHUNK):
    """Flat chunk views of a large contiguous tensor; a small or non-contiguous tensor is one chunk (itself)."""
    if tensor.numel() <= size or not tensor.is_contiguous():
        return [tensor]
    flat = tensor.view(-1)
    return [flat.narrow(0, s, min(size, flat.numel() - s)) for s in range(0, flat.numel(), size)]


def _flat(tensor):
    return tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1)


class _Chunk(NamedTuple):
    """One chunk of a slot's master: where it sits (``offset`` in the slot) and its matching pieces of the window
    gradient, of each optimizer state the rule reads, and of the weights the forward reads (``target``)."""

    slot: object
    offset: int
    theta: torch.Tensor
    grad: Optional[torch.Tensor]
    states: tuple
    target: Optional[torch.Tensor]


class _Batch:
    """Chunks of one param group with one state layout: what one round of the rule's multi-tensor ops predicts."""

    __slots__ = ("rule", "key", "slots", "offsets", "thetas", "grads", "states", "targets", "scale")

    def __init__(self, rule, key, chunks):
        self.rule, self.key = rule, key
        self.scale = 1.0  # the factor on ``grads``: ``coef * a / n`` (see LookAhead._plan)
        self.slots = [c.slot for c in chunks]
        self.offsets = [c.offset for c in chunks]
        self.thetas = [c.theta for c in chunks]

        def column(values):
            return None if values[0] is None else list(values)

        self.grads = column([c.grad for c in chunks])
        self.states = tuple(column([c.states[i] for c in chunks]) for i in range(len(chunks[0].states)))
        self.targets = column([c.target for c in chunks])


def _write(thetas, decay, alpha, us):
    """``theta <- theta * decay - alpha * u`` in place (two multi-tensor passes, nothing allocated)."""
    if decay != 1.0:
        torch._foreach_mul_(thetas, decay)
    if all(u.dtype == t.dtype for u, t in zip(us, thetas)):
        torch._foreach_add_(thetas, us, alpha=-alpha)
    else:  # Muon's bf16 orthogonalised update, added as torch.optim.Muon adds it
        for t, u in zip(thetas, us):
            t.add_(u, alpha=-alpha)


class LookAhead:
    """Predict-forward-restore for one stage (see the module docstring for the contract)."""

    def __init__(self, slots, restore, kind, clip=None, tied_keys=()):
        if restore not in RESTORE_MODES:
            raise ValueError(f"restore must be one of {RESTORE_MODES}, got {restore!r}")
        self.slots = slots
        self.restore = restore
        self.kind = kind
        self.clip = clip
        self.tied_keys = list(tied_keys)  # this owner's tied keys: their weights are not predicted (see slots)
        self.predicted_forwards = 0
        self.clipped_forwards = 0
        self.nonfinite_forwards = 0
        self.seconds = 0.0
        self.error_sum = 0.0
        self.error_windows = 0
        self.unrestored = None  # why the real weights could not be restored, once that happened
        self._window = 0  # local steps seen: the index of the open window
        self._crossings = 0  # crossing forwards predicted in the open window, if it is sampled (error telemetry)
        self._sq_sum = 0.0
        self._before = None
        self.active = False  # True only while a crossing forward runs on predicted weights

    # -- the forward ---------------------------------------------------------------
    @contextmanager
    def applied(self, window_fill, window):
        """Run the body on weights predicted from ``window_fill`` of ``window`` backward passes; the real weights
        are back on exit, whatever raised (see the module docstring)."""
        self.check_restored()
        began = time.perf_counter()
        scale = None if window_fill <= 0 else window / window_fill
        undo = []
        self.active = True
        try:
            self._apply(scale, undo)
            self.seconds += time.perf_counter() - began
            yield
        finally:
            began = time.perf_counter()
            try:
                self._restore(undo)
            finally:
                self.active = False
                self.seconds += time.perf_counter() - began
        self.predicted_forwards += 1
        if self._sampled:
            self._crossings += 1

    def check_restored(self):
        """Raise :class:`PACILookAheadError` if a restore ever failed (the weights are not the real ones)."""
        if self.unrestored is not None:
            raise PACILookAheadError(self.unrestored)

    @property
    def _sampled(self):
        """Whether the open window's prediction error is measured (one window in :data:`ERROR_EVERY`)."""
        return self._window % ERROR_EVERY == 0

    @torch.no_grad()
    def _apply(self, scale, undo):
        batches, clipped = self._plan(scale)
        if batches is None:
            self.nonfinite_forwards += 1
            return
        self.clipped_forwards += clipped
        for batch in batches:
            decay, alpha, us = self._compute(batch)  # may raise: nothing of this batch written yet
            if self._sampled:
                self._sample(batch, decay, alpha, us)
            if batch.targets is not None:  # low-precision weights the forward reads; the masters stay real
                pred = torch._foreach_mul(batch.thetas, decay)
                torch._foreach_add_(pred, us, alpha=-alpha)
                keep_fixed(batch.slots, batch.offsets, batch.thetas, pred)
                undo.append(("master", batch.thetas, batch.targets))
                torch._foreach_copy_(batch.targets, pred)
                continue
            if self.restore == "recompute" and batch.rule.recomputable:
                undo.append(("recompute", batch.thetas, batch))
            else:
                undo.append(("copy", batch.thetas, [x.clone() for x in batch.thetas]))
            _write(batch.thetas, decay, alpha, us)

    def _compute(self, batch):
        """``(decay, alpha, u)`` of one batch (deterministic: the same inputs give the same ``u``)."""
        return batch.rule.update(batch.key, batch.thetas, batch.grads, batch.states, batch.scale)

    @torch.no_grad()
    def _restore(self, undo):
        """Undo every record (last first); retry each failed one once, tensor by tensor; then re-raise the failure."""
        failed = []
        for record in reversed(undo):
            try:
                self._undo(record, careful=False)
            except Exception as e:  # noqa: BLE001 - every record must be tried before anything propagates
                failed.append((record, e))
        for record, _ in failed:
            try:
                self._undo(record, careful=True)
            except Exception as e:
                self.unrestored = (f"the look-ahead could not restore the real weights after a predicted forward "
                                   f"({type(e).__name__}: {e}); this stage's weights are wrong: stop and resume "
                                   "from the last checkpoint (no checkpoint is saved from this state)")
                raise PACILookAheadError(self.unrestored) from e
        if failed:
            raise failed[0][1]  # the weights are real again; the failure itself still leaves the engine

    def _undo(self, record, careful):
        how, thetas, other = record
        if how == "recompute":
            decay, alpha, us = self._compute(other)
            torch._foreach_add_(thetas, [u.to(t.dtype) for u, t in zip(us, thetas)], alpha=alpha)
            if decay != 1.0:
                torch._foreach_div_(thetas, decay)
            return
        dst, src = (other, thetas) if how == "master" else (thetas, other)  # master: the real master, rounded
        if careful:
            for d, s in zip(dst, src):
                d.copy_(s)
        else:
            torch._foreach_copy_(dst, src)

    # -- what is predicted -------------------------------------------------------------
    def _plan(self, scale):
        """``(batches, clipped)``: the open window's prediction cut into :class:`_Batch` es, and whether the clip
        coefficient is below 1; ``(None, False)`` when the window's gradient is not finite (the local step will be
        skipped: nothing to predict).

        Chunks of the slots are grouped by optimizer, param group and what is known (state,
        gradient), and cut into batches of at most :data:`BATCH` elements. Deterministic.
        """
        groups, rules, cache, grads = {}, {}, {}, []
        for slot in self.slots:
            if slot.unpredicted:
                continue  # a tied weight: left at its current value (see slots)
            rk = (id(slot.optimizer), slot.group_index)
            if rk not in rules:
                rules[rk] = slot.rule()
            rule = rules[rk]
            steps_missing = slot.zero_filled or rule.steps_without_grad
            grad = slot.grad() if scale is not None else None
            if scale is not None and grad is None:
                if not steps_missing:
                    continue  # the optimizer skips a parameter without a gradient
                grad = torch.zeros_like(slot.master)
            if scale is None and not (slot.had_grad or steps_missing):
                continue
            got = rule.gather(slot.optimizer, slot.master, slot.group, scale is not None, cache)
            if got is None:
                continue  # nothing to predict from
            key, states = got
            if grad is not None:
                grads.extend(slot.free_pieces(grad))  # the tied gradients are the exchange's, not the stage's
            split = _chunks if rule.chunked else (lambda x: [x])
            thetas = split(slot.master)
            none = [None] * len(thetas)
            grad_parts, target_parts = (none if x is None else split(x) for x in (grad, slot.target))
            state_parts = [none if x is None else split(x) for x in states]
            chunks = groups.setdefault((rk, key, slot.target is None), (rule, key, []))[2]
            offset = 0
            for n, theta in enumerate(thetas):
                chunks.append(_Chunk(slot, offset, theta, grad_parts[n], tuple(p[n] for p in state_parts),
                                     target_parts[n]))
                offset += theta.numel()
        if grads and not math.isfinite(_norm_of(grads)):
            return None, False
        coef = self._clip_coef(scale)
        batches = []
        for rule, key, chunks in groups.values():
            start, size = 0, 0
            for i, chunk in enumerate(chunks):
                if i > start and size + chunk.theta.numel() > BATCH:
                    batches.append(_Batch(rule, key, chunks[start:i]))
                    start, size = i, 0
                size += chunk.theta.numel()
            if chunks:
                batches.append(_Batch(rule, key, chunks[start:]))
        for batch in batches:
            batch.scale = 1.0 if scale is None else coef * scale
            if coef != 1.0 and batch.grads is not None and batch.grads[0].dtype != torch.float32:
                # the local step scales a low-precision gradient in its own dtype (rounded), then steps with it
                batch.grads, batch.scale = torch._foreach_mul(batch.grads, coef), scale
        return batches, coef != 1.0

    def _clip_coef(self, scale):
        """The stage's clip coefficient for the window's norm estimate ``a/n ||G||`` (1.0: no clipping)."""
        max_norm = self.clip.max_norm() if self.clip is not None and scale is not None else 0.0
        if max_norm <= 0.0:
            return 1.0
        coef = max_norm / (self.clip.norm() * scale + 1e-6)  # the local step's formula
        return coef if coef < 1.0 else 1.0

    # -- error telemetry ------------------------------------------------------------
    def _sample(self, batch, decay, alpha, us):
        """Add this forward's predicted deltas on the sampled coordinates to each slot's running sum."""
        stride = ERROR_STRIDE
        delta = torch._foreach_mul([_flat(u)[::stride].float() for u in us], -alpha)
        if decay != 1.0:
            torch._foreach_add_(delta, [_flat(t)[::stride] for t in batch.thetas], alpha=decay - 1.0)
        for slot, offset, theta, x in zip(batch.slots, batch.offsets, batch.thetas, delta):  # unpredicted: no delta
            for lo, hi in fixed_in(slot, offset, theta.numel()):
                first, end = -(-lo // stride), -(-hi // stride)
                x.narrow(0, first, end - first).zero_()
        sums = []
        for slot, offset, x in zip(batch.slots, batch.offsets, delta):
            if slot.sample is None:
                slot.sample = torch.zeros(-(-slot.master.numel() // stride), dtype=torch.float32,
                                          device=slot.master.device)
            sums.append(slot.sample.narrow(0, offset // stride, x.numel()))
        torch._foreach_add_(sums, delta)
        self._sq_sum += float(torch.stack(torch._foreach_norm(delta)).pow(2).sum())

    @torch.no_grad()
    def before_step(self):
        """Before a local step: which tensors it steps (see ``had_grad``), and the sampled real weights."""
        for slot in self.slots:
            if not slot.zero_filled:
                slot.had_grad = slot.grad() is not None
        if self._crossings:
            self._before = [_flat(s.master)[::ERROR_STRIDE].float().clone() for s in self.slots]

    @torch.no_grad()
    def after_step(self):
        """After a local step: fold the window's prediction error into the running mean, start a new window."""
        if self._before is not None:
            actual_sq = cross = 0.0
            for slot, before in zip(self.slots, self._before):
                actual = _flat(slot.master)[::ERROR_STRIDE].float() - before  # never in place: a view of the weights
                actual_sq += float(actual.pow(2).sum())
                if slot.sample is not None:
                    cross += float(torch.dot(slot.sample, actual))
            j = self._crossings
            if actual_sq > 0.0:
                mean_sq = max(0.0, (self._sq_sum - 2.0 * cross + j * actual_sq) / j)
                self.error_sum += math.sqrt(mean_sq / actual_sq)
                self.error_windows += 1
        self._before = None
        self._crossings = 0
        self._sq_sum = 0.0
        self._window += 1
        for slot in self.slots:
            slot.sample = None

    # -- tests and diagnostics -------------------------------------------------------
    @torch.no_grad()
    def predict_next(self, window_fill, window):
        """The predicted next master weights (new tensors, one per slot); nothing is changed."""
        scale = None if window_fill <= 0 else window / window_fill
        out = {id(slot): slot.master.detach().clone() for slot in self.slots}
        batches, _ = self._plan(scale)
        for batch in batches or []:
            decay, alpha, us = self._compute(batch)
            preds = [theta.mul(decay).add_(u, alpha=-alpha) for theta, u in zip(batch.thetas, us)]
            keep_fixed(batch.slots, batch.offsets, batch.thetas, preds)
            for slot, offset, theta, pred in zip(batch.slots, batch.offsets, batch.thetas, preds):
                _flat(out[id(slot)]).narrow(0, offset, theta.numel()).copy_(_flat(pred))
        return [out[id(slot)] for slot in self.slots]

    def masters(self):
        """The tensors the optimizer steps, in slot order (the real weights)."""
        return [s.master for s in self.slots]

    def stats(self):
        return {
            "enabled": True,
            "optimizer": self.kind,
            "restore": self.restore if self.slots and self.slots[0].target is None else "master",
            "predicted_forwards": self.predicted_forwards,
            "clipped_forwards": self.clipped_forwards,
            "nonfinite_forwards": self.nonfinite_forwards,
            "prediction_error": self.error_sum / self.error_windows if self.error_windows else None,
            "error_windows": self.error_windows,
            "error_every": ERROR_EVERY,
            "seconds": self.seconds,
            "tied_unpredicted": self.tied_keys,
            "unpredicted_elements": sum(min(s.master.numel(), sum(n for _, n in s.fixed)) for s in self.slots),
        }


# -- building one -------------------------------------------------------------------------
FALLBACK = ("training continues with plain PACI: forwards that cross a local step run on the current weights, one "
            "version behind their backward (at P = 8 and stock's best learning rate that ended 20-30% above stock; "
            "see README, \"The look-ahead\")")


def lookahead_for_torch_optimizer(optimizer, aliases, restore="copy", max_norm=0.0, clip_params=None):
    """A :class:`LookAhead` over fp32 parameters stepped by ``optimizer`` through ``aliases``
    (:class:`~ds_paci.core.step.local_step.ParamAliases`), or ``None`` if that optimizer is not predicted
    (:func:`~ds_paci.core.lookahead.rules.rule_reader` says why).

    For programs that run stage-local steps outside the engine (the single-process replay): a
    parameter without a gradient is skipped, as ``torch.optim`` skips it. ``max_norm`` > 0: the
    caller scales the window's gradient by ``max_norm / (norm + 1e-6)`` when that is below 1
    (DeepSpeed's formula; ``norm``: the 2-norm of the gradients of ``clip_params``, default the
    aliased parameters; pass all of a stage's parameters when several optimizers share them)
    before each step, and the prediction does the same.
    """
    slots, reason = torch_slots(optimizer, aliases)
    if reason:
        return None
    params = list(clip_params) if clip_params is not None else [p for p, _ in aliases.pairs]
    clip = ClipSource(lambda: float(max_norm), lambda: _norm_of(p.grad for p in params)) if max_norm > 0 else None
    return LookAhead(slots, restore, "torch", clip)


def _exact_restore(ctx, restore, kind):
    """``"copy"`` where copies must stay bit-identical (data-parallel replicas, tied owners); else ``restore``."""
    if restore != "recompute" or kind != "torch":
        return restore
    tied = ctx.tied
    replicas = ctx.dp_world_size > 1
    owner = tied is not None and bool(tied.exchanges)
    if (replicas or owner) and ctx.global_rank == 0:
        logger.info(f"ds_paci: \"lookahead_restore\": \"recompute\" is exact only up to rounding; stages with "
                    f"data-parallel replicas (here {ctx.dp_world_size}) or tied copies on several stages restore by "
                    "\"copy\" instead, so that their copies stay bit-identical")
    return "copy" if replicas or owner else restore


def make_lookahead(ctx, enabled, restore="copy"):
    """A :class:`LookAhead` for the stage of ``ctx`` (a :class:`~ds_paci.core.engine.stage_context.StageContext`), or ``None`` (disabled, or an optimizer we cannot predict).

    When the optimizer is not predicted, one line (from rank 0) names the reason and the
    fallback, and training continues without look-ahead.
    """
    if not enabled:
        return None
    if restore not in RESTORE_MODES:
        raise ValueError(f"restore must be one of {RESTORE_MODES}, got {restore!r}")
    slots, kind, clip, reason = engine_slots(ctx)
    if reason is not None:
        if ctx.global_rank == 0:
            logger.warning(f"ds_paci: stage {ctx.stage_id}: look-ahead off: {reason}; {FALLBACK} (set \"paci\": "
                           "{\"lookahead\": false} to silence this line)")
        return None
    tied_keys = tied_unpredicted(ctx, slots)  # (one line from rank 0 where tied layers span stages)
    return LookAhead(slots, _exact_restore(ctx, restore, kind), kind, clip, tied_keys)
