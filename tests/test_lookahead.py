"""Window-informed look-ahead: the predictor math (pure, in one process) and the engine (real processes over gloo).

Engine-level checks use real DeepSpeed engines; the pure tests check the predictor
against the real optimizers' own ``step()``.
"""

import pytest
import torch

import workers
from harness import run_world
from ds_paci.core.lookahead.predict import AdamRule, LookAhead, _Slot, adam_update
from ds_paci.core.program.actions import Kind
from ds_paci.core.program.stream import PACIStream, crosses_local_step
from ds_paci.core.program.validate import stream_violations


# -- pure: the predictor equals the optimizer's next step given the complete window's gradient ----------------
def _params(seed, shapes=((7, 5), (5, ), (3, 4, 2))):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g) for s in shapes]


def _lookahead_for(opt, params, grads, rule_of, restore="recompute"):
    slots = [_Slot(p, opt, group, rule_of, grad=lambda gr=gr: gr)
             for group in opt.param_groups for p, gr in zip(group["params"], grads)]
    return LookAhead(slots, restore, "torch")


def _check_next_step(make_opt, rule_of, steps=4, window=4, seed=0):
    """Before each step, predict with n = a (the complete window's gradient), step, compare."""
    params = _params(seed)
    opt = make_opt(params)
    worst = 0.0
    for k in range(steps):
        # the engine accumulates a micro-batches' gradients, each scaled by 1/a
        grads = [sum(torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * k + i * 10 + j)) / window
                     for j in range(window)) for i, p in enumerate(params)]
        la = _lookahead_for(opt, params, grads, rule_of)
        predicted = la.predict_next(window, window)
        before = [p.clone() for p in params]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        worst = max(worst, max((a - b).abs().max().item() for a, b in zip(predicted, params)))
        # the step moved the weights far more than the prediction misses by
        assert min((a - b).abs().max().item() for a, b in zip(params, before)) > 1e-4
    return worst


@pytest.mark.parametrize("name,make", [
    ("AdamW", lambda ps: torch.optim.AdamW(ps, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)),
    ("AdamW-amsgrad", lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01, amsgrad=True)),
    ("Adam", lambda ps: torch.optim.Adam(ps, lr=1e-3)),
    ("Adam-L2", lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=0.05)),
    ("Adam-maximize", lambda ps: torch.optim.Adam(ps, lr=1e-3, maximize=True)),
    ("AdamW-foreach", lambda ps: torch.optim.AdamW(ps, lr=2e-3, weight_decay=0.1, foreach=True)),
])
def test_predictor_equals_torch_optimizer_step_with_the_complete_window(name, make):
    assert _check_next_step(make, AdamRule.of_torch) <= 1e-6


@pytest.mark.process
def test_predictor_equals_deepspeed_fused_adam_step():
    """DeepSpeed's FusedAdam (its CPU kernel here; JIT-built once into TORCH_EXTENSIONS_DIR), AdamW and L2 modes."""
    from deepspeed.ops.adam import FusedAdam
    assert _check_next_step(lambda ps: FusedAdam(ps, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1),
                            AdamRule.of_fused) <= 1e-6
    assert _check_next_step(lambda ps: FusedAdam(ps, lr=1e-3, weight_decay=0.05, adam_w_mode=False),
                            AdamRule.of_fused) <= 1e-6


def test_predictor_follows_the_optimizer_through_a_checkpoint_load():
    """``load_state_dict`` (every checkpoint load) replaces the param-group dicts and the LR scheduler then sets
    the learning rate on the new ones: the look-ahead built before must predict with them (found by Megatron's
    resume, tests/megatron)."""
    params = _params(1)
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)
    grads = [torch.full_like(p, 0.5) for p in params]
    la = _lookahead_for(opt, params, grads, AdamRule.of_torch)  # built once, as the engine builds it
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()
    opt.load_state_dict(opt.state_dict())  # what DeepSpeed's load_checkpoint does to the optimizer
    for group in opt.param_groups:
        group["lr"] = 5e-3  # what the scheduler does next
    predicted = la.predict_next(1, 1)
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()
    assert max((a - b).abs().max().item() for a, b in zip(predicted, params)) <= 1e-6


def test_partial_window_and_moments_alone():
    """n < a scales the partial gradient by a/n; n = 0 uses the bias-corrected first moment; no state, no grad: None."""
    rule = AdamRule(1e-2, 0.9, 0.99, 1e-8, 0.0, decoupled=True)
    gen = torch.Generator().manual_seed(0)  # its own draws: the suite's order must not change the inputs
    theta, partial = torch.randn(10, generator=gen), torch.randn(10, generator=gen)
    m, v = torch.randn(10, generator=gen) * 0.1, torch.rand(10, generator=gen) * 0.01
    # updates are ~1e-2; an element near 0 differs by rounding only, hence the absolute floor far below any bug
    u_partial = adam_update(rule, 5, theta, partial, m, v, grad_scale=4 / 3)
    u_full = adam_update(rule, 5, theta, partial * (4 / 3), m, v)
    assert torch.allclose(u_partial, u_full, rtol=1e-6, atol=1e-9)
    u_moments = adam_update(rule, 5, theta, None, m, v)
    m_hat = m / (1 - 0.9**5)
    assert torch.allclose(u_moments, adam_update(rule, 5, theta, m_hat, m, v), rtol=1e-6, atol=1e-9)
    assert adam_update(rule, 0, theta, None, None, None) is None
    # first step, no state yet: m' = (1-b1) g, v' = (1-b2) g^2, bias-corrected: a sign-like step of size lr
    u0 = adam_update(rule, 0, theta, partial, None, None)
    assert torch.allclose(u0, 1e-2 * partial / (partial.abs() + 1e-8), rtol=1e-5)


def test_prediction_error_telemetry_is_zero_for_a_perfect_prediction_and_one_for_none():
    params = [torch.randn(4096)]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
    params[0].grad = torch.randn(4096)
    opt.step()
    grad = [torch.randn(4096)]
    la = _lookahead_for(opt, params, grad, AdamRule.of_torch, "copy")
    for _ in range(2):  # two crossing forwards with the complete window: both predict the step exactly
        with la.applied(4, 4):
            pass
    la.before_step()
    params[0].grad = grad[0].clone()
    opt.step()
    la.after_step()
    assert la.error_windows == 1 and la.stats()["prediction_error"] < 1e-3
    # a window whose crossing forward predicted nothing (zero update) scores 1.0
    zero = [torch.zeros(4096)]
    la2 = _lookahead_for(opt, params, zero, AdamRule.of_torch, "copy")
    la2.slots[0].reader = lambda o, g: AdamRule(0.0, 0.9, 0.999, 1e-8, 0.0, True)  # lr 0: predicts no move
    with la2.applied(4, 4):
        pass
    la2.before_step()
    params[0].grad = torch.randn(4096)
    opt.step()
    la2.after_step()
    assert abs(la2.stats()["prediction_error"] - 1.0) < 1e-6


# -- pure: which forwards cross, from the stream -----------------------------------------------------------
def test_crossing_forwards_are_tagged_from_the_stream():
    """Tags agree with the drift each micro-batch actually has (grid); steady state: P-1-s forwards per window."""
    for P in range(1, 7):
        for M in range(1, 9):
            for a in range(1, 9):
                for s in range(P):
                    st = PACIStream(P, s, a)
                    ticks = st.advance(2 * M) + st.advance(2 * M) + st.drain()
                    assert not stream_violations(ticks, P, s, a), (P, M, a, s)
    P, M, a = 4, 8, 8
    for s in range(P):
        st = PACIStream(P, s, a)
        ticks = st.advance(2 * M) + st.advance(2 * M) + st.advance(2 * M)
        crossing = [i.micro_batch for t in ticks for i in t if i.kind is Kind.FORWARD and i.crosses_step]
        # the first P-1-s micro-batches of every window after the first: forwarded (last) before the step that
        # closes the previous window, back-propagated after it
        expected = [m for m in range(a, 3 * M) if m % a < P - 1 - s]
        assert crossing == expected, (s, crossing)
    # the validator catches a wrong tag
    st = PACIStream(2, 0, 2)
    ticks = st.advance(8) + st.drain()
    forward = next(i for t in ticks for i in t if i.kind is Kind.FORWARD and i.crosses_step)
    ticks = [[i.with_(crosses_step=False) if i is forward else i for i in t] for t in ticks]  # actions are immutable
    assert any("crosses_step" in e for e in stream_violations(ticks, 2, 0, 2))
    assert crosses_local_step(4, 3, 1) and not crosses_local_step(4, 2, 1)


# -- engine: real DeepSpeed engines in real processes ------------------------------------------------------
@pytest.mark.process
def test_crossing_forwards_see_predicted_weights_everything_else_sees_real_weights(tmp_path):
    """P=2, a=M=2, torch.optim AdamW, recompute restore (the default).

    Crossing forwards (from the schedule) see the prediction (checked against an independent float64 reference);
    every other forward, every backward, eval and the checkpoint see the real weights; an exception inside a
    crossing forward leaves the real weights in place."""
    import lookahead_workers as lw
    stages, gas, calls = 2, 2, 6
    results = run_world(lw.views, stages, stages, gas, calls, "recompute", str(tmp_path / "ckpt"), timeout=240)
    tol = 1e-6  # recompute restore is exact up to rounding; predictions move weights by ~lr = 2e-2
    for r in results:
        s = r["stage"]
        train = [x for x in r["records"] if x["phase"] in ("train", "train2")]
        fwd = [x for x in train if x["kind"] == "forward"]
        crossing = [x for x in fwd if x["active"]]
        # the engine predicted exactly the forwards the schedule says cross a step (stage 0: one per call)
        assert len([x for x in crossing if x["phase"] == "train"]) == r["expected_crossings"]
        assert r["stats"]["lookahead"]["predicted_forwards"] == r["expected_crossings"]
        if s == 0:
            assert r["expected_crossings"] == calls - 1
            for x in crossing:
                assert x["window_fill"] == 1
                for k in x["seen"]:
                    assert (x["seen"][k] - x["reference"][k]).abs().max() <= tol, k
                    assert (x["seen"][k] - x["real"][k]).abs().max() > 100 * tol, "the prediction moved nothing"
            assert r["stats"]["lookahead"]["error_windows"] == 1  # one window in 8 is measured: the first
            assert 0 <= r["stats"]["lookahead"]["prediction_error"] < 1.0
        else:
            assert r["expected_crossings"] == 0 and not crossing
        for x in [x for x in fwd if not x["active"]] + [x for x in train if x["kind"] == "backward"]:
            assert not x["active"]
            assert max((x["seen"][k] - x["real"][k]).abs().max().item() for k in x["seen"]) <= tol
        # eval: no prediction, real weights
        evals = [x for x in r["records"] if x["phase"] == "eval" and x["kind"] == "forward"]
        assert evals and all(not x["active"] and not x["training"] for x in evals)
        assert all(max((x["seen"][k] - x["real"][k]).abs().max().item() for k in x["seen"]) <= tol for x in evals)
        # the checkpoint holds the real weights
        assert r["at_save"].keys() <= r["saved"].keys()  # the folder holds every stage's layer files
        assert max((r["saved"][k] - r["real_at_save"][k]).abs().max().item() for k in r["at_save"]) <= tol
        # the injected failures: the engine reports where, and the weights are the real ones
        assert r["error"] is not None and ("injected failure" in r["error"])
        assert not r["active_after_failure"]
        assert max((r["after_failure"][k] - r["real_at_failure"][k]).abs().max().item()
                   for k in r["after_failure"]) <= tol
    assert "inside a crossing forward" in results[0]["error"] and "F" in results[0]["error"].split(" in ")[1]


@pytest.mark.process
def test_predictor_given_the_complete_window_equals_the_next_step_for_every_optimizer_and_precision():
    """Every engine path the look-ahead predicts, on 2 stages with a = M = 2: torch.optim Adam/AdamW/SGD/Muon passed
    to initialize, DeepSpeed's configured AdamW (torch and FusedAdam), Adam with L2 decay, SGD and Muon
    (MuonWithAuxAdam with its FusedAdam part) with a warm-up LR schedule, bf16 (BF16_Optimizer), ZeRO-1 in fp32 and
    bf16, gradient clipping active at every step, and a branch whose parameters get no gradient after the first call
    (DeepSpeed's reduce gives them zeros; the optimizer moves them by momentum). Before every local step the
    predictor with n = a equals the optimizer's step (<= 1e-6); after every crossing forward the weights are the
    real ones bit for bit. An Adam subclass with its own step is not predicted, and one line says so.

    Dynamo is off in the workers (DeepSpeed's Muon compiles its muon_update, about a minute on a cold CPU cache);
    the predictor calls the very function the optimizer's step calls, compiled or not."""
    import lookahead_workers as lw
    names = list(lw.OPTIMIZER_CASES)
    results = run_world(lw.predictor_matches_step, 2, 2, 2, 4, names, timeout=400, env={"TORCHDYNAMO_DISABLE": "1"})
    expect_wrapper = {"bf16 BF16_Optimizer": "BF16_Optimizer", "bf16 ZeRO-1": "DeepSpeedZeroOptimizer",
                      "ZeRO-1 fp32": "DeepSpeedZeroOptimizer", "DeepSpeed AdamW (FusedAdam)": "FusedAdam",
                      "DeepSpeed Adam, L2 decay (FusedAdam)": "FusedAdam", "bf16 SGD (momentum)": "BF16_Optimizer",
                      "DeepSpeed SGD (momentum, dampening, decay), clipping": "SGD",
                      "torch.optim.Muon (a bias-free model)": "Muon",
                      "DeepSpeed Muon (MuonWithAuxAdam, FusedAdam part)": "MuonWithAuxAdam"}
    for stage, r in enumerate(results):
        for name in names:
            row, case = r[name], lw.OPTIMIZER_CASES[name]
            assert row["wrapper"] == expect_wrapper.get(name, row["wrapper"]), (name, row["wrapper"])
            if not case.get("predicted", True):
                assert not row["lookahead"], name
                if stage == 0:  # one line, from rank 0, naming the reason and the fallback
                    assert len(row["log"]) == 1 and "subclass" in row["log"][0] and "plain PACI" in row["log"][0]
                continue
            assert row["lookahead"] and not row["log"], name
            assert len(row["diffs"]) == 4, (name, row["diffs"])  # 4 calls (and a drain), a = M: 4 steps
            assert max(row["diffs"]) <= 1e-6, (name, row["diffs"])
            assert min(row["moved"]) > 5e-5, (name, row["moved"])  # each step really moved every master
            if case.get("clip"):  # clipping was active: the stage's norm far above the threshold
                assert min(n for n in row["norms"] if n is not None) > 2 * case["clip"], (name, row["norms"])
            if stage == 0:
                # one crossing forward per call after the first; weights really changed, then came back exactly
                assert len(row["changed"]) == 3 and min(row["changed"]) > 1e-4, (name, row["changed"])
                assert max(row["restored"]) == 0.0, (name, row["restored"])
                assert row["stats"]["predicted_forwards"] == 3
                assert row["stats"]["clipped_forwards"] == (3 if case.get("clip") else 0), name
            else:
                assert not row["changed"]
