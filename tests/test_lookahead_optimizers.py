"""The look-ahead's optimizer rules (pure, one process): SGD and Muon given the complete window equal the
optimizer's own ``step()``, clipping is predicted, only exact optimizer types are predicted, and parameters the
optimizer does not step are not moved. (The engine paths: tests/test_lookahead.py.)"""

import pytest
import torch

from ds_paci.core.step.local_step import ParamAliases
from ds_paci.core.lookahead.predict import FALLBACK, LookAhead, lookahead_for_torch_optimizer
from ds_paci.core.lookahead.rules import SUPPORTED, rule_reader
from ds_paci.core.lookahead.slots import Slot

MIXED = ((7, 5), (5, ), (3, 4, 2))
MATRICES = ((7, 5), (4, 9), (6, 6))


def _window_grads(params, k, window):
    """The accumulated gradient of a window of ``window`` micro-batches, each scaled by 1/a (as the engine does)."""
    return [sum(torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * k + 10 * i + j)) / window
                for j in range(window)) for i, p in enumerate(params)]


def _clip_(params, max_norm):
    """The local step's clipping (``local_step.clip_by_norm``: DeepSpeed's formula)."""
    norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])))
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for p in params:
            p.grad.mul_(coef)
    return coef


def _errors(make, shapes=MIXED, steps=4, window=4, max_norm=0.0, predicted_norm=None):
    """Before each step predict with n = a, then step (clipped to ``max_norm`` if > 0). Returns the worst absolute
    difference and the worst relative error ``||pred - next|| / ||next - before||``; ``predicted_norm``: the clip
    the predictor is told about (default ``max_norm``)."""
    params = [torch.nn.Parameter(torch.randn(*s, generator=torch.Generator().manual_seed(i))) for i, s in
              enumerate(shapes)]
    opt = make(params)
    aliases = ParamAliases(opt)
    la = lookahead_for_torch_optimizer(opt, aliases, "copy", max_norm if predicted_norm is None else predicted_norm)
    assert la is not None, type(opt).__name__
    worst, rel, coefs = 0.0, 0.0, []
    for k in range(steps):
        for p, g in zip(params, _window_grads(params, k, window)):
            p.grad = g
        predicted = la.predict_next(window, window)
        before = [p.detach().clone() for p in params]
        if max_norm:
            coefs.append(_clip_(params, max_norm))
        aliases.bind_grads()
        opt.step()
        aliases.release_grads()
        after = [p.detach() for p in params]
        worst = max(worst, max((a - b).abs().max().item() for a, b in zip(predicted, after)))
        miss = sum(float((a - b).pow(2).sum()) for a, b in zip(predicted, after))
        move = sum(float((a - b).pow(2).sum()) for a, b in zip(after, before))
        assert move > 1e-8, "the step moved the weights"
        rel = max(rel, (miss / move)**0.5)
    if max_norm:
        assert max(coefs) < 0.5, "clipping was active at every step"
    return worst, rel


SGD_AND_MUON = {
    "SGD": lambda ps: torch.optim.SGD(ps, lr=1e-2),
    "SGD maximize": lambda ps: torch.optim.SGD(ps, lr=1e-2, maximize=True),
    "SGD momentum, dampening, decay": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, dampening=0.3,
                                                                  weight_decay=0.1),
    "SGD Nesterov, decay": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01),
    "SGD momentum, foreach": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.8, foreach=True),
    "Muon": lambda ps: torch.optim.Muon(ps, lr=2e-2),
    "Muon without Nesterov, match_rms_adamw, decay": lambda ps: torch.optim.Muon(
        ps, lr=2e-2, nesterov=False, adjust_lr_fn="match_rms_adamw", weight_decay=0.05),
    "Muon, 3 Newton-Schulz steps, momentum 0.8": lambda ps: torch.optim.Muon(ps, lr=1e-2, momentum=0.8, ns_steps=3),
}


@pytest.mark.parametrize("name", list(SGD_AND_MUON))
def test_sgd_and_muon_predictions_with_the_complete_window_equal_the_optimizer_step(name):
    shapes = MATRICES if name.startswith("Muon") else MIXED
    assert _errors(SGD_AND_MUON[name], shapes)[0] <= 1e-6


def test_deepspeed_muon_with_its_inline_adam_part_is_predicted():
    """DeepSpeed's MuonWithAuxAdam: DeepSpeed's own muon_update on the matrices, Adam on the rest. Dynamo is off
    here (its torch.compile of muon_update costs about a minute on a cold CPU cache): the predictor calls the very
    function the step calls, compiled or not."""
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    def make(ps):
        return MuonWithAuxAdam([
            dict(params=[p for p in ps if p.ndim == 2], use_muon=True, lr=2e-2, momentum=0.9, weight_decay=0.01),
            dict(params=[p for p in ps if p.ndim != 2], use_muon=False, lr=1e-2, betas=(0.9, 0.95), eps=1e-10,
                 weight_decay=0.1)
        ])

    with torch._dynamo.config.patch(disable=True):
        assert _errors(make)[0] <= 1e-6


@pytest.mark.parametrize("name,make,shapes", [
    ("AdamW", lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1), MIXED),
    ("Adam, L2 decay", lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.05), MIXED),
    ("SGD momentum", lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9), MIXED),
    ("Muon", lambda ps: torch.optim.Muon(ps, lr=2e-2), MATRICES),
])
def test_the_clipped_step_is_predicted(name, make, shapes):
    """With clipping active at every step the prediction with n = a equals the clipped step (<= 1e-6); a
    prediction that ignores the clip (what the look-ahead did before) is far off for Adam and SGD (Muon's
    Newton-Schulz is scale-invariant, so there it matters only through the momentum)."""
    worst, rel = _errors(make, shapes, max_norm=0.2)
    assert worst <= 1e-6 and rel < 1e-4, (worst, rel)
    if name != "Muon":
        _, rel_ignored = _errors(make, shapes, max_norm=0.2, predicted_norm=0.0)
        assert rel_ignored > 0.3, rel_ignored


def test_the_clip_coefficient_comes_from_the_window_norm_estimate():
    """n < a: the clip coefficient is ``max_norm / (a/n ||G|| + 1e-6)`` (1 when that is >= 1); n = 0: none."""
    p = torch.nn.Parameter(torch.zeros(10))
    opt = torch.optim.SGD([p], lr=1.0)
    la = lookahead_for_torch_optimizer(opt, ParamAliases(opt), max_norm=1.0)
    p.grad = torch.full((10, ), 0.1)  # ||G|| = 0.316: with a/n = 4 the estimate is 1.26
    assert la._clip_coef(4.0) == pytest.approx(1.0 / (4.0 * 10**0.5 * 0.1 + 1e-6), rel=1e-6)
    assert la._clip_coef(2.0) == 1.0 and la._clip_coef(None) == 1.0
    # the prediction steps with g = coef * a/n * G: SGD's next weights are -lr * g
    (predicted, ) = la.predict_next(1, 4)
    assert torch.allclose(predicted, -p.grad * 4.0 * la._clip_coef(4.0), rtol=1e-6)


class _OwnStep(torch.optim.AdamW):

    def step(self, closure=None):
        return super().step(closure)


class _SameStep(torch.optim.SGD):
    pass


def test_only_exact_optimizer_types_are_predicted():
    """A subclass (with or without its own step) and any other optimizer get no look-ahead and one reason."""
    for make, words in [(lambda ps: _OwnStep(ps), "subclass of torch.optim.adamw.AdamW"),
                        (lambda ps: _SameStep(ps, lr=0.1), "subclass of torch.optim.sgd.SGD"),
                        (lambda ps: torch.optim.RMSprop(ps), "not one the look-ahead predicts")]:
        opt = make([torch.nn.Parameter(torch.zeros(3, 3))])
        reader, reason = rule_reader(opt)
        assert reader is None and words in reason, reason
        assert lookahead_for_torch_optimizer(opt, ParamAliases(opt)) is None
    assert "Muon" in SUPPORTED and "SGD" in SUPPORTED
    assert "plain PACI" in FALLBACK  # the engine's line names the fallback
    for opt in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Muon):
        assert rule_reader(opt([torch.nn.Parameter(torch.zeros(3, 3))], lr=0.1))[0] is not None, opt


def _two_params(make):
    a, b = torch.nn.Parameter(torch.randn(6)), torch.nn.Parameter(torch.randn(6))
    opt = make([a, b])
    aliases = ParamAliases(opt)
    for p in (a, b):
        p.grad = torch.randn(6)
    aliases.bind_grads()
    opt.step()  # both have optimizer state now
    aliases.release_grads()
    return a, b, opt, aliases


@pytest.mark.parametrize("make", [lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
                                  lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9)])
def test_a_parameter_the_optimizer_does_not_step_is_not_moved(make):
    """Stepped directly, torch.optim skips a parameter whose grad is None: the prediction (n > 0) leaves it, and
    with n = 0 a parameter the last step skipped is left too. In the engine, DeepSpeed's reduce gives it a zero
    gradient and the optimizer moves it by momentum: a zero-filled slot predicts exactly that step."""
    a, b, opt, aliases = _two_params(make)
    la = lookahead_for_torch_optimizer(opt, aliases)
    a.grad, b.grad = torch.randn(6), None  # b: no gradient in this window
    pa, pb = la.predict_next(2, 2)
    assert torch.equal(pb, b.detach()) and not torch.equal(pa, a.detach())
    la.before_step()
    aliases.bind_grads()
    opt.step()
    aliases.release_grads()
    assert (pa - a).abs().max() <= 1e-6 and torch.equal(pb, b.detach())
    a.grad = None
    pa0, pb0 = la.predict_next(0, 2)  # n = 0: b was not stepped by the last step, a was
    assert torch.equal(pb0, b.detach()) and not torch.equal(pa0, a.detach())
    # the engine's rule: a missing gradient reaches the optimizer as zeros
    slots = [Slot(alias, opt, opt.param_groups[0], rule_reader(opt)[0], grad=lambda p=p: p.grad, zero_filled=True)
             for p, alias in aliases.pairs]
    engine_like = LookAhead(slots, "copy", "torch")
    a.grad, b.grad = torch.randn(6), None
    qa, qb = engine_like.predict_next(2, 2)
    b.grad = torch.zeros(6)
    aliases.bind_grads()
    opt.step()
    aliases.release_grads()
    assert (qa - a).abs().max() <= 1e-6 and (qb - b).abs().max() <= 1e-6
    assert not torch.equal(qb, pb)  # b moved, by its momentum


def test_a_non_finite_window_gradient_predicts_nothing():
    """A NaN anywhere in the window makes the local step a skipped one: no tensor is predicted."""
    a, b, opt, aliases = _two_params(lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    la = lookahead_for_torch_optimizer(opt, aliases)
    a.grad, b.grad = torch.randn(6), torch.full((6, ), float("nan"))
    real = [a.detach().clone(), b.detach().clone()]
    with la.applied(1, 2):
        assert torch.equal(a, real[0]) and torch.equal(b, real[1])
    assert la.stats()["nonfinite_forwards"] == 1 and la.stats()["predicted_forwards"] == 1


@pytest.mark.process
def test_the_cost_and_error_script_runs(tmp_path):
    """Smoke run of scripts/lookahead_costs.py (tiny sizes): its error figures hold (the clip predicted: exact;
    ignored: far off), so the script behind the README's table cannot rot."""
    import json
    import subprocess
    import sys
    out = tmp_path / "costs.json"
    subprocess.run([sys.executable, "scripts/lookahead_costs.py", "--smoke", "--optimizers", "muon_adamw",
                    "--out", str(out)], check=True, timeout=300, capture_output=True)
    rows = json.loads(out.read_text())["optimizers"]
    for kind, row in rows.items():
        assert row["errors"]["no clipping"]["max"] < 1e-5 and row["errors"]["clipping, predicted"]["max"] < 1e-5
        assert row["errors"]["clipping, ignored"]["median"] > 0.1 and row["errors"]["clipping, ignored"]["clip_coef_max"] < 1
        assert row["costs"]["copy"] > 0 and row["costs"]["copy_bytes"] == 4 * row["costs"]["parameters"]
