"""Candidate look-ahead variants for the replay (issue 30): options, not the engine's behaviour.

The engine's look-ahead (:mod:`ds_paci.core.lookahead.predict`) predicts a crossing forward's weights as the
optimizer's next step with the window's gradient extrapolated from the open window (``a G / n``). The variants
here run in the single-process replay only (:func:`ds_paci.tools.replay.replayer.replay`, ``candidate=``), so that
they can be measured before anything changes in the engine:

* ``estimator``: how the window's gradient is estimated for the prediction
  (:func:`window_gradient_estimate`): ``"window"`` (the engine's ``a G / n``; ``n = 0``: Adam's bias-corrected
  first moment), ``"moment"`` (always the bias-corrected first moment: a Nesterov-style step along the
  optimizer's momentum, PipeNAG's idea on Adam), ``"blend"`` (what the open window holds plus the
  momentum for the ``a - n`` backward passes still to come: ``G + (a - n)/a * m_hat``);
* ``feedback``: error feedback on the prediction: after each local step the stage keeps the residual
  ``r = (theta_next - theta) - delta_raw`` of its last predicted forward (``delta_raw``: that prediction
  without feedback), and the next window's predictions add ``feedback * r`` (:class:`CandidateLookAhead`);
* ``lr_power``: per-stage learning-rate compensation for windows longer than ``M`` (fewer optimizer
  steps per sample than the stock engine): ``lr_s = lr * (a_s / M) ** lr_power`` where ``a_s > M``
  (:func:`lr_compensation`);
* ``lr_slowest``: the opposite, ``lr_s = lr * a_s / max(a)`` (:func:`lr_to_slowest`);
* ``adaptive``: an :class:`AdaptiveWindows` rule that moves each stage between two window sets at drains,
  from its measured prediction error.

Only ``torch.optim.Adam``/``AdamW`` without L2 decay, amsgrad or maximize is predicted here (the sweep's
optimizer); anything else raises ``ValueError``. With ``estimator="window"`` and ``feedback=0`` the
prediction is the engine's (``tests/test_candidates.py`` checks it against ``LookAhead.predict_next``).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

ESTIMATORS = ("window", "moment", "blend")


@dataclass(frozen=True)
class Candidate:
    """One candidate's options (defaults: the engine's look-ahead)."""

    name: str = "engine"
    estimator: str = "window"
    feedback: float = 0.0
    lr_power: float = 0.0
    lr_slowest: bool = False  # lr_s = lr * a_s / max(a): every stage at the slowest stage's rate per sample
    window: object = "auto"  # the replay's window (see stage_windows); "uniform-max": max of auto's, every stage
    adaptive: object = None  # an AdaptiveWindows, or None
    sync_fraction: float = 0.0  # the first fraction of the calls run synchronously (stock's schedule), then PACI
    sync_calls: object = 0  # or the first ``sync_calls`` calls (the larger of the two); "auto": the engine's rule

    def __post_init__(self):
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"unknown estimator {self.estimator!r}; use one of {', '.join(ESTIMATORS)}")

    @property
    def custom_prediction(self) -> bool:
        """Whether the prediction differs from the engine's (else the engine's own LookAhead runs)."""
        return self.estimator != "window" or self.feedback != 0.0 or self.adaptive is not None


def lr_compensation(windows, micro_batches, power) -> list:
    """Per-stage factors on the learning rate: ``(a_s / M) ** power`` where ``a_s > M``, else 1.

    A stage with window ``a_s`` steps ``M / a_s`` times per ``M`` micro-batches, stock once; for Adam the
    step's size does not grow with the window, so per sample it moves ``M / a_s`` as far. ``power = 1``
    restores stock's distance per sample, ``0.5`` the square-root rule of batch-size scaling for Adam.
    """
    return [(a / micro_batches) ** power if a > micro_batches else 1.0 for a in windows]


def lr_to_slowest(windows) -> list:
    """Per-stage factors ``a_s / max(a)``: every stage moves as far per sample as the stage with the longest
    window (with Adam, per-sample distance goes as ``lr / a_s``). The opposite of :func:`lr_compensation`: it
    slows the stages that step more often instead of speeding up those that step less, as one uniform window
    ``max(a)`` does, but keeps each stage's window."""
    top = max(windows)
    return [a / top for a in windows]


def candidate_lr_factors(candidate, windows, micro_batches) -> list:
    """Per-stage factors on the learning rate a candidate asks for (``lr_power``, ``lr_slowest``; else 1)."""
    factors = [1.0] * len(windows)
    if candidate.lr_power:
        factors = [x * f for x, f in zip(factors, lr_compensation(windows, micro_batches, candidate.lr_power))]
    if candidate.lr_slowest:
        factors = [x * f for x, f in zip(factors, lr_to_slowest(windows))]
    return factors


def _bias_corrected_first_moment(state, beta1):
    t = int(float(state["step"]))
    return state["exp_avg"] / (1.0 - beta1 ** t)


def window_gradient_estimate(estimator, grad, state, beta1, window_fill, window):
    """The window's gradient (mean over its ``window`` micro-batches) estimated for the prediction, or ``None``
    (nothing to predict from). ``grad``: the open window's accumulated gradient ``G`` (each backward scaled by
    ``1 / window``; ``None`` if none yet), ``window_fill``: backward passes in it, ``state``: the optimizer's
    state of the tensor (may be empty)."""
    has_state = "exp_avg" in state
    if grad is None or window_fill <= 0:
        return _bias_corrected_first_moment(state, beta1) if has_state else None
    if estimator == "window" or not has_state:
        return grad * (window / window_fill)
    m_hat = _bias_corrected_first_moment(state, beta1)
    if estimator == "moment":
        return m_hat
    return grad + m_hat * ((window - window_fill) / window)


def adam_next(theta, g, state, group):
    """Adam/AdamW's next value of ``theta`` (a new tensor) for gradient ``g``, as ``torch.optim`` steps it."""
    beta1, beta2 = group["betas"]
    lr, eps, wd = float(group["lr"]), group["eps"], group["weight_decay"]
    if "exp_avg" in state:
        t = int(float(state["step"])) + 1
        m = state["exp_avg"] * beta1 + g * (1.0 - beta1)
        v = state["exp_avg_sq"] * beta2 + g * g * (1.0 - beta2)
    else:
        t, m, v = 1, g * (1.0 - beta1), g * g * (1.0 - beta2)
    bc1, bc2 = 1.0 - beta1 ** t, 1.0 - beta2 ** t
    out = theta * (1.0 - lr * wd) if wd else theta.clone()
    denom = (v.sqrt() / math.sqrt(bc2)).add_(eps)
    return out.addcdiv_(m, denom, value=-lr / bc1)


def _check_optimizer(optimizer):
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        raise ValueError(f"candidate look-aheads predict torch.optim.Adam/AdamW only, not {type(optimizer).__name__}")
    for group in optimizer.param_groups:
        if group.get("amsgrad") or group.get("maximize"):
            raise ValueError("candidate look-aheads do not predict amsgrad or maximize")
        decoupled = group.get("decoupled_weight_decay", type(optimizer) is torch.optim.AdamW)
        if group["weight_decay"] and not decoupled:
            raise ValueError("candidate look-aheads do not predict Adam's L2 decay")


class CandidateLookAhead:
    """The replay's look-ahead of one stage with a :class:`Candidate`'s prediction (same interface as the
    engine's :class:`~ds_paci.core.lookahead.predict.LookAhead` in the replay: ``applied``, ``before_step``,
    ``after_step``, ``stats``).

    Error feedback: ``residual`` (per aliased tensor) is ``(theta_next - theta) - delta_raw`` of the last
    crossing forward of the last window that had one, ``delta_raw`` its prediction *without* feedback;
    predictions add ``feedback * residual``. (Measured against the fed-back prediction instead, as error
    feedback for compression does, the residual obeys ``r_k = e_k - r_{k-1}`` for uncorrelated raw errors
    ``e_k`` and grew without bound in the replay: prediction errors of 20-150x the step.)
    Prediction error (every window with crossing forwards): ``sqrt(mean_j ||pred_j - theta_next||^2) /
    ||theta_next - theta||`` over the window's crossing forwards, as the engine's telemetry (all elements).
    """

    def __init__(self, optimizer, aliases, candidate: Candidate):
        _check_optimizer(optimizer)
        self.optimizer = optimizer
        self.candidate = candidate
        self.entries = []  # (param with .grad, alias the optimizer steps, its group)
        by_alias = {id(alias): p for p, alias in aliases.pairs}
        for group in optimizer.param_groups:
            for alias in group["params"]:
                self.entries.append((by_alias[id(alias)], alias, group))
        self.residual = None
        self.predicted_forwards = 0
        self.errors = []  # per window with crossing forwards
        self._deltas = []  # predicted deltas of the open window's crossing forwards (feedback included)
        self._raw_last = None  # the last one without feedback: what the residual is measured against
        self._before = None

    @torch.no_grad()
    def _raw_next(self, window_fill, window):
        """The prediction without error feedback (new tensors; unpredicted ones: a copy)."""
        out = []
        for param, alias, group in self.entries:
            state = self.optimizer.state.get(alias, {})
            g = window_gradient_estimate(self.candidate.estimator, param.grad, state, group["betas"][0],
                                         window_fill, window)
            out.append(alias.clone() if g is None else adam_next(alias, g, state, group))
        return out

    def _with_feedback(self, raw):
        if self.residual is None or not self.candidate.feedback:
            return raw
        return [r.add(res, alpha=self.candidate.feedback) for r, res in zip(raw, self.residual)]

    @torch.no_grad()
    def predict_next(self, window_fill, window):
        """Predicted next weights (new tensors, one per aliased tensor; unpredicted ones: a copy)."""
        return self._with_feedback(self._raw_next(window_fill, window))

    @contextlib.contextmanager
    def applied(self, window_fill, window):
        raw = self._raw_next(window_fill, window)
        preds = self._with_feedback(raw)
        with torch.no_grad():
            saved = [alias.clone() for _, alias, _ in self.entries]
            self._deltas.append([p - s for p, s in zip(preds, saved)])
            self._raw_last = [r - s for r, s in zip(raw, saved)]
            for (_, alias, _), pred in zip(self.entries, preds):
                alias.copy_(pred)
        try:
            yield
        finally:
            with torch.no_grad():
                for (_, alias, _), s in zip(self.entries, saved):
                    alias.copy_(s)
        self.predicted_forwards += 1

    def before_step(self):
        if self._deltas:
            self._before = [alias.detach().clone() for _, alias, _ in self.entries]

    @torch.no_grad()
    def after_step(self):
        if self._before is not None:
            actual = [alias - b for (_, alias, _), b in zip(self.entries, self._before)]
            actual_sq = sum(float(a.pow(2).sum()) for a in actual)
            if actual_sq > 0.0:
                err_sq = sum(sum(float((d - a).pow(2).sum()) for d, a in zip(deltas, actual))
                             for deltas in self._deltas) / len(self._deltas)
                self.errors.append(math.sqrt(err_sq / actual_sq))
            if self.candidate.feedback:
                self.residual = [a - d for a, d in zip(actual, self._raw_last)]
        self._before = None
        self._deltas = []
        self._raw_last = None

    def recent_error(self, last=8):
        """Mean prediction error of the last ``last`` windows measured (``None`` before any)."""
        tail = self.errors[-last:]
        return sum(tail) / len(tail) if tail else None

    def stats(self):
        return {"enabled": True, "optimizer": "candidate", "predicted_forwards": self.predicted_forwards,
                "prediction_error": sum(self.errors) / len(self.errors) if self.errors else None,
                "error_windows": len(self.errors)}


@dataclass(frozen=True)
class AdaptiveWindows:
    """Each stage's window moves between ``low`` (default: ``"auto"``'s) and ``high`` (default: the largest of
    ``"auto"``'s windows, on every stage) every ``every`` calls, at a drain that closes the windows: a stage
    whose mean prediction error over its last windows is above ``threshold`` takes ``high``, else ``low``.
    Both sets keep drift <= 1 (``high >= low`` stage by stage), so the look-ahead still predicts every
    crossing forward. Stages without crossing forwards keep ``low``."""

    every: int = 25
    threshold: float = 0.35
    start: str = "low"

    def windows(self, low, high, errors) -> list:
        """The next windows: ``errors`` per stage (``None``: not measured)."""
        return [h if e is not None and e > self.threshold else lo for lo, h, e in zip(low, high, errors)]
