"""Issue 30's candidate look-aheads (ds_paci/tools/replay/candidates.py): each candidate's arithmetic against the
optimizer it predicts, and the replay running them (one process, fast tier)."""

import pytest
import torch

from ds_paci.core.lookahead.predict import lookahead_for_torch_optimizer
from ds_paci.core.step.local_step import ParamAliases
from ds_paci.tools.replay.candidates import (AdaptiveWindows, Candidate, CandidateLookAhead, adam_next,
                                             lr_compensation, lr_to_slowest, window_gradient_estimate)


def _setup(make_opt, seed=0, shapes=((6, 4), (4, ))):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in shapes]
    opt = make_opt(params)
    aliases = ParamAliases(opt)
    return params, opt, aliases


def _grads(params, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g) for p in params]


def _step(params, opt, aliases, grads):
    for p, gr in zip(params, grads):
        p.grad = gr.clone()
    aliases.bind_grads()
    opt.step()
    aliases.release_grads()
    for p in params:
        p.grad = None


ADAMW = lambda ps: torch.optim.AdamW(ps, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)  # noqa: E731


@pytest.mark.parametrize("make", [ADAMW, lambda ps: torch.optim.Adam(ps, lr=1e-2)])
def test_adam_next_is_the_optimizers_step(make):
    params, opt, aliases = _setup(make)
    for k in range(4):  # the first step (no state yet) and later ones
        grads = _grads(params, k)
        predicted = [adam_next(alias, g, opt.state.get(alias, {}), opt.param_groups[0])
                     for (_, alias), g in zip(aliases.pairs, grads)]
        before = [p.detach().clone() for p in params]
        _step(params, opt, aliases, grads)
        assert max((a - p).abs().max().item() for a, p in zip(predicted, params)) <= 1e-6
        assert min((p - b).abs().max().item() for p, b in zip(params, before)) > 1e-4


def test_window_estimator_is_the_engines_prediction():
    params, opt, aliases = _setup(ADAMW)
    for k in range(2):
        _step(params, opt, aliases, _grads(params, k))
    engine = lookahead_for_torch_optimizer(opt, aliases, "copy")
    mine = CandidateLookAhead(opt, aliases, Candidate(estimator="window"))
    for fill, window in ((0, 4), (1, 4), (3, 4), (4, 4)):
        for p, g in zip(params, _grads(params, 10 + fill)):
            p.grad = None if fill == 0 else g / window * fill
        ours, theirs = mine.predict_next(fill, window), engine.predict_next(fill, window)
        assert max((a - b).abs().max().item() for a, b in zip(ours, theirs)) <= 1e-6


def test_moment_prediction_is_the_next_step_when_the_gradient_is_the_momentum():
    """Under a constant gradient Adam's bias-corrected first moment is that gradient, so the Nesterov-style
    prediction (the step along the moment) is the optimizer's next step whatever the open window holds."""
    params, opt, aliases = _setup(ADAMW)
    constant = _grads(params, 7)
    for _ in range(3):
        _step(params, opt, aliases, constant)
    la = CandidateLookAhead(opt, aliases, Candidate(estimator="moment"))
    for p, g in zip(params, _grads(params, 99)):  # one noisy micro-batch in the open window: ignored
        p.grad = g / 4
    predicted = la.predict_next(1, 4)
    window_pred = CandidateLookAhead(opt, aliases, Candidate(estimator="window")).predict_next(1, 4)
    _step(params, opt, aliases, constant)
    assert max((a - p).abs().max().item() for a, p in zip(predicted, params)) <= 1e-6
    assert max((a - p).abs().max().item() for a, p in zip(window_pred, params)) > 1e-4  # the window's guess is off


def test_blend_is_the_open_window_plus_the_moment_for_the_rest():
    state = {"step": torch.tensor(3.0), "exp_avg": torch.full((3, ), 0.5), "exp_avg_sq": torch.ones(3)}
    grad = torch.tensor([1.0, -2.0, 0.0])  # two of four backward passes, each scaled by 1/4
    m_hat = 0.5 / (1 - 0.9 ** 3)
    got = window_gradient_estimate("blend", grad, state, 0.9, 2, 4)
    assert torch.allclose(got, grad + m_hat * 0.5)
    assert torch.equal(window_gradient_estimate("blend", grad, state, 0.9, 4, 4), grad)  # complete: exact
    assert torch.allclose(window_gradient_estimate("window", grad, state, 0.9, 2, 4), grad * 2)
    assert torch.allclose(window_gradient_estimate("moment", grad, state, 0.9, 2, 4), torch.full((3, ), m_hat))
    assert torch.allclose(window_gradient_estimate("blend", None, state, 0.9, 0, 4), torch.full((3, ), m_hat))
    assert window_gradient_estimate("blend", None, {}, 0.9, 0, 4) is None  # nothing to predict from


def test_error_feedback_keeps_the_residual_and_adds_it_to_the_next_prediction():
    params, opt, aliases = _setup(ADAMW)
    _step(params, opt, aliases, _grads(params, 0))
    la = CandidateLookAhead(opt, aliases, Candidate(estimator="window", feedback=0.5))
    plain = CandidateLookAhead(opt, aliases, Candidate(estimator="window"))
    for p, g in zip(params, _grads(params, 1)):
        p.grad = g / 4
    with la.applied(1, 4):
        predicted = [p.detach().clone() for p in params]
    before = [p.detach().clone() for p in params]
    la.before_step()
    _step(params, opt, aliases, _grads(params, 2))
    la.after_step()
    residual = [(p - b) - (q - b) for p, b, q in zip(params, before, predicted)]
    assert all(torch.allclose(r, x, atol=1e-7) for r, x in zip(residual, la.residual))
    assert max(r.abs().max().item() for r in residual) > 1e-5
    for p, g in zip(params, _grads(params, 3)):
        p.grad = g / 4
    with_feedback, without = la.predict_next(1, 4), plain.predict_next(1, 4)
    assert all(torch.allclose(w, x + 0.5 * r, atol=1e-7) for w, x, r in zip(with_feedback, without, residual))
    assert la.errors and la.errors[0] > 0
    # the next residual is measured against the prediction without feedback (else it random-walks)
    with la.applied(1, 4):
        pass
    before = [p.detach().clone() for p in params]
    la.before_step()
    _step(params, opt, aliases, _grads(params, 4))
    la.after_step()
    raw = [x - b for x, b in zip(without, before)]
    assert all(torch.allclose(r, (p - b) - d, atol=1e-7) for r, p, b, d in zip(la.residual, params, before, raw))


def test_lr_compensation_scales_only_windows_longer_than_m():
    assert lr_compensation([7, 6, 5, 4, 4], 4, 1.0) == [7 / 4, 6 / 4, 5 / 4, 1.0, 1.0]
    assert lr_compensation([7, 4], 4, 0.5) == [(7 / 4) ** 0.5, 1.0]
    assert lr_compensation([3, 3], 4, 1.0) == [1.0, 1.0]  # a window shorter than M steps more often: not scaled


def test_lr_to_slowest_gives_every_stage_the_longest_windows_rate_per_sample():
    factors = lr_to_slowest([7, 6, 5, 4])
    assert factors == [1.0, 6 / 7, 5 / 7, 4 / 7]
    assert len({f / a for f, a in zip(factors, [7, 6, 5, 4])}) == 1  # lr_s / a_s: the same at every stage


def test_adaptive_windows_take_the_high_window_where_the_error_is_high():
    rule = AdaptiveWindows(threshold=0.3)
    assert rule.windows([7, 6, 5, 4], [7, 7, 7, 7], [0.5, 0.2, 0.31, None]) == [7, 6, 7, 4]


def test_replay_runs_every_candidate_and_adaptive_windows_change_at_drains():
    from ds_paci.tools.replay.replayer import replay
    from ds_paci.workload.data import ByteTokenizer, MicroBatchIterator, encode_documents, load_corpus
    from ds_paci.workload.gpt2 import gpt2_config, gpt2_reference_model
    cfg = gpt2_config("tiny", vocab_size=257, n_positions=16, n_embd=16, n_layer=4, n_head=2)
    tokens = encode_documents(load_corpus()[:1], ByteTokenizer())
    val = [next(MicroBatchIterator(tokens, 2, 16, seed=99)) for _ in range(2)]

    def run(candidate):
        return replay(gpt2_reference_model(cfg, seed=3), 4, 2, MicroBatchIterator(tokens, 2, 16, seed=5), val, 6,
                      mode="lookahead", window=[3, 2, 2, 2], lr=1e-2, eval_every=6, candidate=candidate)

    engine = run(None)
    assert run(Candidate("auto")).curve == engine.curve  # no option set: the engine's look-ahead
    finals = {}
    for c in (Candidate(estimator="moment"), Candidate(estimator="blend"), Candidate(feedback=1.0),
              Candidate(lr_power=1.0), Candidate(lr_slowest=True)):
        finals[c] = run(c).curve[-1][1]
        assert finals[c] == finals[c] and finals[c] != engine.curve[-1][1]
    adaptive = run(Candidate(adaptive=AdaptiveWindows(every=2, threshold=0.0)))
    assert adaptive.windows == [3, 3, 3, 2]  # "auto"'s per-stage windows before issue 30; stage 3 never crosses


def test_plateau_finds_where_a_run_stalls_while_stock_trains():
    from ds_paci.tools.studies.candidates.study import plateau
    stock = [(0, 5.5), (50, 2.83), (100, 2.69), (150, 2.62), (200, 2.57), (250, 2.55), (300, 2.52)]
    auto = [(0, 5.5), (50, 3.30), (100, 3.30), (150, 3.296), (200, 3.295), (250, 3.289), (300, 3.07)]
    assert plateau(auto, stock) == (50, 250)
    assert plateau(stock, stock) is None
    close = [(s, x * 1.05) for s, x in stock]  # above stock but training: no plateau
    assert plateau(close, stock) is None


def test_the_table_reads_the_stored_runs_and_summarises_each_candidate(tmp_path):
    import json
    from ds_paci.tools.studies.candidates.study import write_table
    runs = {"stock": [(0, 5.5), (150, 2.6), (300, 2.5)], "auto": [(0, 5.5), (150, 3.3), (300, 3.29)],
            "uniform-max": [(0, 5.5), (150, 2.7), (300, 2.525)]}
    (tmp_path / "unseen-lr2e-3").mkdir()
    for name, curve in runs.items():
        (tmp_path / "unseen-lr2e-3" / f"{name}.json").write_text(json.dumps({"curve": curve, "final": curve[-1][1]}))
    text = write_table(str(tmp_path), ["unseen-lr2e-3"], list(runs), lambda cell: 300)
    assert "| unseen-lr2e-3 | 300 | 2.5000 | 3.2900 (+31.6%) **plateau 150-300** | 2.5250 (+1.0%) |" in text
    assert "| auto | 1 | +31.6% | 0 | 0 | 1 |" in text and "| uniform-max | 1 | +1.0% | 1 | 1 | 0 |" in text


def test_the_table_averages_each_cell_over_its_seeds(tmp_path):
    import json
    from ds_paci.tools.studies.candidates.study import seedless, write_table
    assert [seedless(c) for c in ("sweep-P8M4", "sweep-P8M4-s3", "held-w48x2-s2")] == [
        "sweep-P8M4", "sweep-P8M4", "held-w48x2"]
    finals = {"sweep-P8M4": (2.0, 2.04), "sweep-P8M4-s2": (2.0, 2.08), "sweep-P8M4-s3": (2.5, 2.5)}
    for cell, (stock, auto) in finals.items():
        (tmp_path / cell).mkdir()
        for name, final in (("stock", stock), ("auto", auto)):
            curve = [(0, 5.0), (240, final)]
            (tmp_path / cell / f"{name}.json").write_text(json.dumps({"curve": curve, "final": final}))
    text = write_table(str(tmp_path), list(finals), ["stock", "auto"], lambda cell: 240)
    assert "| sweep-P8M4 | +2.0% (3; 0) |" in text  # (2% + 4% + 0%) / 3 over three seeds, none on a plateau
    assert "| auto | 3 | +4.0% | 1 | 2 | 0 |" in text


def test_the_lower_lr_cells_are_the_sweep_cells_at_1e_3_and_the_uniform_lr_candidates_scale_todays_window():
    from ds_paci.core.config import auto_window
    from ds_paci.tools.replay.candidates import lr_compensation
    from ds_paci.tools.studies.candidates.study import CANDIDATES, CELLS, per_stage_auto
    for P in (4, 8, 16):
        for tag in ("", "-s2"):
            high, low = CELLS[f"sweep-P{P}M{P // 2}{tag}"](), CELLS[f"sweep-P{P}M{P // 2}-lr1e-3{tag}"]()
            assert (high.lr, low.lr) == (3e-3, 1e-3)
            assert {**low.__dict__, "lr": None} == {**high.__dict__, "lr": None}
        M = P // 2
        window = max(per_stage_auto(P, M))
        assert window == auto_window(P, M)  # "uniform-max" is the engine's "auto"
        for name, power in (("uniform-lr-sqrt", 0.5), ("uniform-lr-lin", 1.0)):
            c = CANDIDATES[name]
            assert (c.window, c.lr_power) == ("uniform-max", power)
            assert lr_compensation([window] * P, M, c.lr_power) == [(window / M) ** power] * P
