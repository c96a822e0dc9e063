"""The depth x batch sweep: its grid, its resumable runner and its report (ds_paci.tools.studies.quality)."""

import dataclasses
import json
import os

import pytest

from ds_paci.core.program.stream import drift_bound
from ds_paci.tools.studies.quality import grid, report, sweep


def _fake_results(finals):
    """Phase-1 results of every depth with lr 3e-3 best, plus ``finals`` {key: final}."""
    out = {}
    for stages in grid.DEPTHS:
        for run in grid.lr_sweep_runs(stages):
            out[run.key()] = {**run.as_dict(), "final": 2.0 if run.lr == 3e-3 else 2.5, "curve": []}
    for key, final in finals.items():
        out[key] = {"key": key, "final": final, "curve": []}
    return out


def test_plan_runs_phase_one_first_then_every_cell_with_every_window():
    assert all(r.engine == "stock" and r.micro_batches == r.stages for r in grid.sweep_plan({}))
    plan = grid.sweep_plan(_fake_results({}))
    keys = [r.key() for r in plan]
    assert len(keys) == len(set(keys))
    cell = [r for r in plan if (r.stages, r.micro_batches, r.lr, r.optimizer) == (8, 4, 3e-3, "adamw")]
    windows = {r.windows for r in cell if r.engine == "lookahead"}
    for rule in list(grid.ALL_RULES) + ["auto"]:
        assert tuple(grid.rule_windows(rule, 8, 4)) in windows
    assert {r.seed for r in cell if r.engine in ("stock", "paci")} == {1234, 4321}  # P = 8: both seeds
    auto = [r for r in cell if r.engine == "lookahead" and list(r.windows) == grid.auto_windows(8, 4)]
    assert {r.steps for r in auto} == {int(1.5 * grid.STEPS[8])} and len(auto) == 2  # past stock's steps
    assert {r.lr for r in plan if r.stages == 8} == {3e-3, 1e-3, 9e-3}  # best and best/3 (and the sweep's)
    assert {(r.seed, r.lr) for r in plan if r.stages == 32 and r.micro_batches == 64} == {
        (seed, lr) for seed, _ in grid.SEEDS for lr in (3e-3, 1e-3)}  # the whole grid, every depth
    muon = [r for r in plan if r.optimizer == "muon"]
    assert {(r.stages, r.engine) for r in muon} == {(8, e) for e in ("stock", "paci", "lookahead")} and len(muon) == 9
    # order: the first seed at the best lr (every depth), Muon, the second seed there, then the other lr
    first_tier = [r for r in plan if r.seed == 1234 and r.lr == 3e-3 and r.optimizer == "adamw"]
    assert keys.index(first_tier[-1].key()) < keys.index(muon[0].key())
    assert keys.index(muon[-1].key()) < keys.index(next(r.key() for r in plan if r.seed == 4321))
    assert keys.index(next(r.key() for r in plan if r.seed == 4321 and r.lr == 3e-3)) < keys.index(
        next(r.key() for r in plan if r.lr == 1e-3 and r.micro_batches != r.stages))
    for stages in grid.DEPTHS:  # the auto rule keeps drift <= 1 everywhere
        for M in grid.micro_batch_counts(stages):
            assert all(drift_bound(stages, s, a) <= 1 for s, a in enumerate(grid.auto_windows(stages, M)))


def test_report_names_the_best_fixed_window_and_whether_the_rule_holds():
    P, M, lr = 4, 2, 3e-3
    finals = {}
    for i, pair in enumerate(grid.SEEDS):
        finals[grid.make_run(P, M, "stock", None, lr, pair).key()] = 2.60 + 0.01 * i
        finals[grid.make_run(P, M, "paci", grid.rule_windows(grid.PACI_RULE, P, M), lr, pair, True).key()] = 2.9
        finals[grid.make_run(P, M, "lookahead", grid.auto_windows(P, M), lr, pair, True).key()] = 2.62 + 0.01 * i
    values = {"a=M": 2.61, "a=2max(M,P-1)": 2.80}  # a = P-1 is "auto" itself at M < P-1 (issue 30)
    for name, value in values.items():
        run = grid.make_run(P, M, "lookahead", grid.rule_windows(name, P, M), lr, grid.SEEDS[0])
        finals.setdefault(run.key(), value)
    c = report.cell_summary(_fake_results(finals), P, M, lr)
    assert c["best_fixed"] == "a=M" and c["stock_median"] == 2.605
    auto = c["rules"]["auto"]
    assert abs(auto["vs_best_fixed"] - (2.62 - 2.61) / 2.61) < 1e-12 and auto["holds"]  # 0.38% and +0.77%
    table = report.rule_table([c], "auto")
    assert "| 4 | 2 | 0.003 | 3 | 2.6200, 2.6300 | +0.77% | +0.38% | yes |" in table
    assert report.steps_to([(0, 3.0), (10, 2.0), (20, 1.0)], 1.5) == 15.0 and report.steps_to([(0, 3.0)], 1) is None


def test_muon_table_sets_each_muon_cell_beside_the_same_adamw_cell():
    finals = {}
    for run in grid.muon_runs(8, 3e-3):
        finals[run.key()] = {"stock": 2.5, "paci": 2.6, "lookahead": 2.45}[run.engine]
        adamw = dataclasses.replace(run, optimizer="adamw")
        if run.engine != "stock":  # the sweep's AdamW PACI runs train past stock's steps
            adamw = grid.make_run(8, run.micro_batches, run.engine, list(run.windows), run.lr, grid.SEEDS[0], True)
        finals[adamw.key()] = {"stock": 2.4, "paci": 3.0, "lookahead": 2.52}[run.engine]
    table = report.muon_table(_fake_results(finals))
    assert "| 8 | 4 | 0.003 | muon | 2.5000 | 2.6000 (+4.00%) | 7 | 2.4500 (-2.00%) |" in table
    assert "| 8 | 4 | 0.003 | adamw | 2.4000 | 3.0000 (+25.00%) | 7 | 2.5200 (+5.00%) |" in table
    assert len(table.splitlines()) == 2 + 6


@pytest.mark.process
def test_sweep_runs_resume_from_their_json_lines(tmp_path):
    # per-stage windows (what "auto" gave at M < P-1 before issue 30; a sweep row may carry any)
    tiny = dataclasses.replace(grid.make_run(4, 2, "lookahead", [3, 2, 2, 2], 3e-3, grid.SEEDS[0]),
                               steps=6, common_steps=4)
    stock = dataclasses.replace(grid.make_run(4, 2, "stock", None, 3e-3, grid.SEEDS[0]), steps=4, common_steps=4)
    small = dataclasses.replace(grid.MODEL, n_embd=16, n_head=2, seq_len=16, val_micro_batches=4)
    plan = lambda results: [stock, tiny]  # noqa: E731
    lines = []
    sweep.run_sweep(str(tmp_path), workers=1, plan_fn=plan, echo=lines.append, model=small)
    rows = [json.loads(x) for x in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert [r["key"] for r in rows] == [stock.key(), tiny.key()] and len(lines) == 2
    la = rows[1]
    # a = 3,2,2,2 over 12 micro-batches with a drain at step 4 (8 micro-batches): stage 0 steps 2 + the partial
    # window, then 1 + the partial window at the end
    assert la["local_steps"] == [5, 6, 6, 6] and la["curve"][-1][0] == 6
    assert la["final"] == dict((s, v) for s, v in la["curve"])[4]  # read at the common step count
    sweep.run_sweep(str(tmp_path), workers=1, plan_fn=plan, echo=lines.append, model=small)  # nothing left
    assert len((tmp_path / "runs.jsonl").read_text().splitlines()) == 2 and len(lines) == 2


def test_time_to_final_report_checks_the_replay_against_the_stored_engine_curves(tmp_path):
    from ds_paci.tools.studies.quality import time_to_final as ttf
    source, out = tmp_path / "stored", tmp_path / "out"
    source.mkdir()
    out.mkdir()
    stock = [(s, 3.0 - s / 300) for s in range(0, 301, 25)]  # ends at 2.0
    paci = [(s, 3.0 - s / 330) for s in range(0, 451, 25)]  # reaches 2.0 at step 330
    for shape in ttf.SHAPES:
        runs = {}
        for lr in ttf.LRS:
            for seed, data_seed in ttf.SEEDS:
                for engine, curve in (("stock", stock), ("paci", paci), ("paci+lookahead", paci)):
                    runs[f"lr={lr:g} seed={seed} data_seed={data_seed} engine={engine}"] = {
                        "validation": [{"step": s, "loss": v} for s, v in curve if s <= 300]}
        (source / f"{shape}_curves.json").write_text(json.dumps({"runs": runs}))
        spb = {e: {"median": m} for e, m in (("stock", 2.0), ("paci", 1.0), ("paci+lookahead", 1.0))}
        (source / f"{shape}.json").write_text(json.dumps({"comparison": {"seconds_per_batch": spb}}))
    lines = []
    seed, data_seed = ttf.SEEDS[0]
    for engine in ("paci", "paci+lookahead"):
        curve = paci if engine == "paci" else [(s, v + (1e-3 if s == 100 else 0)) for s, v in paci]
        lines.append({"key": ttf._key(ttf.SHAPES[0], engine, ttf.LRS[0], seed), "shape": ttf.SHAPES[0],
                      "engine": engine, "lr": ttf.LRS[0], "seed": seed, "data_seed": data_seed, "curve": curve})
    (out / "time_to_final.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    agreement = {a["key"].split()[1]: a for a in ttf.engine_agreement({x["key"]: x for x in lines}, str(source))}
    assert agreement["paci"]["identical"] and not agreement["paci+lookahead"]["identical"]
    assert abs(agreement["paci+lookahead"]["gap"] - 1e-3) < 1e-9
    markdown = ttf.write_report(str(out), str(source))
    assert "1 of 2 runs identical" in markdown and "PACI runs pending" in markdown
    # stock's final loss (2.0 at step 300, 2 s per batch) reached at step 330 at 1 s per batch: 1.82x sooner
    assert "| 0.002 | 300 (100%) | 2.0000 | PACI | 330 | 330.0 s | 1.82x |" in markdown


def test_assembled_page_finds_the_generated_pages_images_from_its_own_folder(tmp_path):
    from ds_paci.tools.studies.quality.doc import assemble_doc
    out = tmp_path / "results" / "quality"
    out.mkdir(parents=True)
    (out / "intro.md").write_text("# intro")
    (out / "larger.md").write_text("# larger\n\n![curves](larger.png)\n")
    markdown = assemble_doc(str(out), target=str(tmp_path / "results" / "quality.md"))
    assert "![curves](quality/larger.png)" in markdown and "## larger" in markdown


def test_todays_auto_is_the_old_per_stage_rule_wherever_m_is_at_least_p_minus_1():
    from ds_paci.tools.studies.candidates.study import per_stage_auto
    from ds_paci.tools.studies.quality import default
    for stages in range(2, 41):
        for m in range(1, 4 * stages + 1):
            old, new = default.old_auto_windows(stages, m), grid.auto_windows(stages, m)
            assert old == per_stage_auto(stages, m)  # the candidates study's "auto": the same rule
            assert (old == new) == (m >= stages - 1), (stages, m, old, new)  # stage by stage
            assert old[0] == new[0]  # stage 0 always had P-1 (or the guard)
    changed = {(c["stages"], c["micro_batches"]): c["differ"] for c in default.window_changes()}
    assert set(changed) == {(p, m) for p in grid.DEPTHS for m in grid.micro_batch_counts(p)}
    assert {k for k, v in changed.items() if v} == {(4, 2), (8, 4), (16, 8), (32, 16)}  # M = P/2 only
    assert changed[(8, 4)] == [1, 2, 3, 4, 5, 6, 7]


def test_default_cells_read_the_warm_started_runs_and_list_the_missing_ones(tmp_path):
    from ds_paci.tools.studies.quality import default
    pair1, pair2 = grid.SEEDS
    finals = {}
    for pair, s in ((pair1, 2.0), (pair2, 2.2)):
        finals[grid.make_run(8, 4, "stock", None, 3e-3, pair).key()] = s
    # the default before the warm start (7 everywhere), trained past the common steps; a decoy with other windows
    finals[grid.make_run(8, 4, "lookahead", [7] * 8, 3e-3, pair1, overrun=True).key()] = 2.04
    finals[grid.make_run(8, 4, "lookahead", default.old_auto_windows(8, 4), 3e-3, pair2).key()] = 1.0
    results = _fake_results(finals)
    windows = default.default_windows(8, 4)
    assert windows == [7, 6, 5, 4, 4, 4, 4, 4]  # per stage after the warm start, as the engine's "auto"
    # the candidates study's warm-started runs in the sweep's configuration are the default; one that validates
    # after a drain (not the sweep's configuration) and a modified candidate do not count
    sweep_cell = {"stages": 8, "micro_batches": 4, "lr": 3e-3, "steps": 240, "n_embd": 32, "n_head": 4, "seq_len": 32,
                  "micro_batch_size": 2, "val_micro_batches": 32, "seed": pair1[0], "data_seed": pair1[1],
                  "eval_every": 24, "drains": False, "restore": "recompute"}
    for folder, name, cell_dict, final in (("a", "syncauto-auto", sweep_cell, 2.01), ("a", "ef", sweep_cell, 0.5),
                                           ("b", "syncauto-auto", {**sweep_cell, "drains": True}, 0.5)):
        path = tmp_path / folder / f"{name}.json"
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps({"cell": cell_dict, "steps": 240, "windows": windows, "final": final,
                                    "warm_calls": 60}))
    candidates = default.candidate_runs(str(tmp_path))
    assert len(candidates) == 1

    def cell_of(candidates):
        return next(c for c in default.default_cells(results, candidates=candidates)
                    if (c["stages"], c["micro_batches"], c["lr"]) == (8, 4, 3e-3))
    cell = cell_of(candidates)
    assert cell["windows"] == windows and cell["default"] == [2.01, None] and cell["vs_stock"] is None
    assert cell["warm_calls"] == [60, None] and cell["per_seed"][0] == pytest.approx(0.005)
    assert cell["old_per_seed"] == [pytest.approx(0.02), None]  # the uniform window before, where stored
    assert (8, 4, 3e-3, pair2[0], windows) in default.missing_runs([cell])
    path = tmp_path / "c" / "syncauto-auto.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"cell": {**sweep_cell, "seed": pair2[0], "data_seed": pair2[1]}, "steps": 240,
                                "windows": windows, "final": 2.2, "warm_calls": 240}))
    cell = cell_of(default.candidate_runs(str(tmp_path)))
    assert cell["vs_stock"] == pytest.approx((2.01 + 2.2) / (2.0 + 2.2) - 1) and cell["warm_calls"] == [60, 240]
    assert not default.missing_runs([cell])


def test_larger_p8_rows_run_todays_auto_and_a_run_in_progress_shows_its_curve_so_far(tmp_path):
    from ds_paci.core.config import auto_window
    from ds_paci.tools.replay.replayer import stage_windows
    from ds_paci.tools.studies.quality import larger
    names = [r.name for r in larger.RUNS]
    assert len(names) == len(set(names)) and names[:3] == ["stock", "paci+lookahead a=M", "paci+lookahead auto"]
    assert larger.shapes() == [(4, 4, 16), (8, 4, 16), (8, 8, 16), (4, 2, 16), (4, 4, 128)]
    for run in larger.RUNS:
        if run.window == "auto":
            warm = bool(run.sync_calls)
            assert stage_windows(run.window, run.stages, run.micro_batches, per_stage=warm) == [
                auto_window(run.stages, run.micro_batches, s, per_stage=warm) for s in range(run.stages)]
    stock = larger.stock_of(8, 4)
    curve = [[0, 5.0], [1000, 2.0]]
    (tmp_path / "larger.jsonl").write_text(json.dumps({"name": stock.name, "windows": [4] * 8, "curve": curve,
                                                       "seconds": 1.0}) + "\n")
    log = larger.log_path(str(tmp_path), "P=8 M=4 paci+lookahead auto")
    os.makedirs(os.path.dirname(log))
    with open(log, "w") as f:
        f.write("step 50: validation loss 3.0000 (10 s)\nstep 100: validation loss 2.2000 (20 s)\n")
    assert larger.partial_curve(log) == [(50, 3.0), (100, 2.2)]
    table = "\n".join(larger.shape_table(larger.load_rows(str(tmp_path / "larger.jsonl"), key="name"), 8, 4,
                                         str(tmp_path)))
    assert "| P=8 M=4 paci+lookahead auto | - | partial: 2.2000 at step 100 | +10.00% (at step 100) |" in table
    assert "| P=8 M=4 stock | 4 | 2.0000 | - | 1000 |" in table


def test_larger_time_to_stocks_final_counts_a_warm_starts_calls_with_the_bubble(tmp_path):
    from ds_paci.tools.studies.quality import larger
    run = next(r for r in larger.RUNS if r.sync_calls)
    assert (run.stages, run.micro_batches, run.mode) == (4, 4, "lookahead")
    rows = [{"name": "stock", "windows": [4] * 4, "curve": [[0, 5.0], [1000, 2.0]], "seconds": 1.0},
            {"name": run.name, "windows": [3] * 4, "curve": [[0, 5.0], [500, 2.5], [600, 2.0], [1000, 1.9]], "seconds": 1.0,
             "sync_calls": run.sync_calls}]
    (tmp_path / "larger.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = "\n".join(larger.shape_table(larger.load_rows(str(tmp_path / "larger.jsonl"), key="name"), 4, 4))
    slots = run.sync_calls * 7 + (600 - run.sync_calls) * 4  # the warm start's calls cost M + P - 1 = 7 slots
    assert f"| {run.name} | 3 | 1.9000 | -5.00% | 600 | {slots} micro-batch slots | {1000 * 7 / slots:.2f}x |" in table
