"""The benchmark: its arithmetic, its measuring tools, its reports, and one end-to-end smoke run.

No timing is asserted anywhere: speed targets live in the benchmark's reports only.
"""

import json
import os
from types import SimpleNamespace

import pytest
import torch

from ds_paci.tools.bench import analysis, cli, config, meters, report

# -- arithmetic ------------------------------------------------------------------------------


def test_ideal_ratio_and_share_of_ideal():
    assert analysis.ideal_ratio(8, 8) == pytest.approx(15 / 8)
    assert analysis.ideal_ratio(4, 4) == pytest.approx(7 / 4)
    assert analysis.ideal_ratio(2, 4) == pytest.approx(5 / 4)
    assert analysis.share_of_ideal(1.5, 8, 8) == pytest.approx(1.5 / 1.875)
    assert analysis.share_of_ideal(analysis.ideal_ratio(4, 4), 4, 4) == pytest.approx(1.0)


def test_expected_seconds_per_batch_counts_3f_per_micro_batch_and_block():
    assert analysis.expected_seconds_per_batch("paci", 4, 4, 0.02) == pytest.approx(4 * 3 * 0.02)
    assert analysis.expected_seconds_per_batch("stock", 4, 4, 0.02) == pytest.approx(7 * 3 * 0.02)
    assert analysis.expected_seconds_per_batch("stock", 4, 4, 0.02, blocks_per_stage=2) == pytest.approx(2 * 7 * 3 * 0.02)


def test_per_round_ratios_and_median_skip_missing_values():
    assert analysis.per_round_ratios([2.0, 3.0, None], [1.0, 2.0, 4.0]) == [2.0, 1.5, None]
    assert analysis.per_round_ratios([1.0], [0.0]) == [None]
    assert analysis.median_of([3.0, None, 1.0, 2.0]) == 2.0
    assert analysis.median_of([None, None]) is None


def test_steady_state_span_skips_warmup_calls_of_every_segment():
    calls = [(float(i), i + 0.9) for i in range(10)]  # call i runs from i to i + 0.9
    segments = [{"first_call": 0, "calls": 6}, {"first_call": 6, "calls": 4}]
    count, seconds = analysis.steady_state_span(calls, segments, warmup=2)
    assert count == 4 + 2
    assert seconds == pytest.approx((5.9 - 2.0) + (9.9 - 8.0))
    # a segment no longer than the warm-up contributes nothing
    assert analysis.steady_state_span(calls, [{"first_call": 0, "calls": 2}], warmup=2) == (0, 0.0)


def test_time_to_target_interpolates_at_the_first_crossing():
    points = [(0, 0.0, 5.0), (10, 10.0, 4.0), (20, 30.0, 3.0), (30, 40.0, 3.5), (40, 50.0, 2.0)]
    seconds, steps = analysis.time_to_target(points, 3.5)
    assert seconds == pytest.approx(20.0) and steps == pytest.approx(15.0)  # halfway between 4.0 and 3.0
    # the first crossing counts even if the curve goes back up later
    assert analysis.time_to_target(points, 3.0) == pytest.approx((30.0, 20.0))
    assert analysis.time_to_target(points, 1.0) is None
    assert analysis.time_to_target(points, 6.0) == (0.0, 0.0)


def test_speedups_at_reference_levels_time_each_loss_the_reference_reached():
    stock = [(0, 0.0, 5.0), (10, 10.0, 4.0), (20, 20.0, 3.0)]
    paci = [(0, 0.0, 5.0), (10, 5.0, 4.5), (20, 10.0, 3.5)]
    levels = analysis.speedups_at_reference_levels(stock, paci)
    assert levels[0] == pytest.approx((4.0, 10.0, 7.5, 10.0 / 7.5))  # 4.0 is halfway between 4.5 and 3.5
    assert levels[1] == (3.0, 20.0, None, None)


def test_default_target_is_a_factor_over_stocks_median_final_loss():
    assert analysis.default_target_loss([2.0, 3.0, 2.5]) == pytest.approx(1.02 * 2.5)
    assert analysis.relative_difference(2.04, 2.0) == pytest.approx(0.02)


# -- configurations ----------------------------------------------------------------------------


def test_configurations_are_validated_and_emulated_gets_a_block_per_stage():
    cfg = config.make_config("emulated", stages=8)
    assert (cfg.stages, cfg.micro_batches, cfg.n_layer, cfg.name) == (8, 8, 8, "emulated_P8_M8")
    assert "emulated" in cfg.label()
    assert "emulated" not in config.make_config("real").label()
    with pytest.raises(ValueError, match="device-time"):
        config.make_config("emulated", device_time=0.0)
    with pytest.raises(ValueError, match="warmup"):
        config.make_config("real", steps=4, eval_every=2, warmup=2)
    with pytest.raises(ValueError, match="n_layer"):
        config.make_config("real", stages=8)
    headline = config.presets()["headline"].configs
    assert [(c.mode, c.stages, c.micro_batches) for c in headline] == [("real", 2, 4), ("emulated", 4, 4),
                                                                       ("emulated", 8, 8)]
    overridden = config.override_config(headline[2], {"stages": 4, "steps": None})
    assert (overridden.stages, overridden.n_layer, overridden.name) == (4, 4, "emulated_P4_M8")
    tied = config.override_config(headline[0], {"tie_embeddings": True})
    assert tied.name == "real_P2_M4_tied" and "tied embeddings" in tied.label() and not headline[0].tie_embeddings


def test_three_engines_differ_only_in_the_paci_section():
    from ds_paci.tools.bench import runner
    cfg = config.make_config("emulated", stages=4)
    stock, paci, lookahead = (runner.ds_config(cfg, e, trace=False) for e in config.ENGINES)
    assert "paci" not in stock
    assert paci["paci"]["lookahead"] is False and lookahead["paci"]["lookahead"] is True
    assert {k: v for k, v in paci.items() if k != "paci"} == stock == {k: v for k, v in lookahead.items() if k != "paci"}


def test_curve_runs_keep_model_data_and_micro_batching_and_drop_only_the_wait():
    study = config.studies()["lookahead"]
    throughput = {c.name: c for c in study.throughput}
    assert set(throughput) == {"real_P2_M4", "emulated_P4_M4", "emulated_P8_M8"}
    curves = study.curve_configs()
    assert len(curves) == 3 * 2 * 2  # configurations x learning rates x seeds
    for c in curves:
        base = throughput[c.name]
        assert c.loss_curves and c.device_time == 0.0 and c.steps == 300 and "no wait" in c.label()
        for field in ("stages", "micro_batches", "micro_batch_size", "seq_len", "n_layer", "n_embd", "n_head"):
            assert getattr(c, field) == getattr(base, field), field
    for name, lrs in study.lrs.items():
        assert len(lrs) == 2 and lrs[0] == pytest.approx(3 * lrs[1]), "one near stock's best, one 3x lower"
    with pytest.raises(ValueError, match="device_time 0"):
        config.validate_config(config.BenchConfig(**{**curves[0].__dict__, "device_time": 0.01}))


# -- measuring tools -----------------------------------------------------------------------------


def test_activation_meter_counts_saved_storages_once_and_releases_them_after_backward():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    engine = SimpleNamespace(module=module, pipe_buffers={"inputs": [], "outputs": []})
    meter = meters.ActivationMeter(engine)
    x = torch.randn(8, 16)
    with meter.training():
        first = module(x)
        after_one = meter.saved_bytes
        second = module(x)
        assert meter.saved_bytes == 2 * after_one - x.nbytes  # the shared input storage counts once
        first.sum().backward()
        second.sum().backward()
    # saved: x (by the first Linear) and Tanh's output (by Tanh and, same storage, the second Linear);
    # the weights are parameters and do not count
    assert after_one == x.nbytes + 8 * 32 * 4
    assert meter.saved_bytes == 0
    assert meter.peak_saved_bytes == 2 * after_one - x.nbytes
    assert meter.peak_held_bytes >= meter.peak_saved_bytes


def test_activation_meter_ignores_evaluation():
    module = torch.nn.Linear(4, 4)
    meter = meters.ActivationMeter(SimpleNamespace(module=module, pipe_buffers={}))
    with torch.no_grad():
        module(torch.randn(2, 4))
    with meter.training(), torch.no_grad():
        module(torch.randn(2, 4))
    assert meter.peak_saved_bytes == 0 and meter.peak_held_bytes == 0


def test_stock_tracer_names_instructions_like_the_paci_trace():
    tracer = meters.StockInstructionTracer(rank=0, stage=0)
    texts = [tracer._text(name) for name in ("LoadMicroBatch", "ForwardPass", "SendActivation", "LoadMicroBatch",
                                             "ForwardPass", "RecvGrad", "BackwardPass", "ReduceGrads",
                                             "OptimizerStep", "OptimizerStep")]
    assert texts == ["L0", "F0", "SA0", "L1", "F1", "RG0", "B0", "REDUCE_GRADS", "STEP1", "STEP2"]


# -- comparisons and reports ----------------------------------------------------------------------


def _fake_run(engine, tokens_per_second, seconds_per_batch, losses, clock, saved=1000):
    memory = [{"stage": s, "peak_saved_bytes": saved, "peak_held_bytes": saved + 10, "peak_rss_bytes": 10**8,
               "param_bytes": 500, "param_count": 125, "optimizer_state_bytes": 1000, "extra_weight_bytes": 0,
               "aliases_share_storage": True if engine == "paci" else None} for s in range(2)]
    validation = [{"step": 10 * i, "train_seconds": clock * i, "loss": v} for i, v in enumerate(losses)]
    return {"engine": engine, "throughput": {"tokens_per_second": tokens_per_second,
                                             "seconds_per_batch": seconds_per_batch},
            "validation": validation, "final_val_loss": losses[-1], "memory": memory}


def _fake_entry(cfg):
    rounds = [{"stock": _fake_run("stock", 100.0, 1.0, [5.0, 4.0, 3.0], 10.0),
               "paci": _fake_run("paci", 180.0, 0.55, [5.0, 4.0, 3.03], 5.5)},
              {"stock": _fake_run("stock", 110.0, 0.9, [5.0, 4.0, 3.0], 9.0),
               "paci": _fake_run("paci", 190.0, 0.5, [5.0, 4.0, 3.03], 5.0)}]
    import dataclasses
    return {"config": dataclasses.asdict(cfg), "comparison": analysis.compare_engines(cfg, rounds, None),
            "rounds": rounds}


def test_compare_engines_medians_ratios_and_time_to_target():
    cfg = config.make_config("emulated", stages=8)
    c = _fake_entry(cfg)["comparison"]
    assert c["ratio"]["per_round"] == pytest.approx([1.8, 190 / 110])
    assert c["ratio"]["median"] == pytest.approx((1.8 + 190 / 110) / 2)
    assert c["share_of_ideal"] == pytest.approx(c["ratio"]["median"] / 1.875)
    assert c["expected_seconds_per_batch"] == pytest.approx({"paci": 8 * 0.06, "stock": 15 * 0.06})
    t = c["time_to_target"]
    assert t["target_loss"] == pytest.approx(3.06)
    # round 1: stock crosses 3.06 at (4 - 3.06) / (4 - 3) of its last interval, PACI at (4 - 3.06) / (4 - 3.03)
    assert t["seconds"]["stock"]["per_round"][0] == pytest.approx(10 + 10 * 0.94)
    assert t["seconds"]["paci"]["per_round"][0] == pytest.approx(5.5 + 5.5 * 0.94 / 0.97)
    assert t["steps"]["paci"]["per_round"][0] == pytest.approx(10 + 10 * 0.94 / 0.97)
    assert t["final_val_loss_relative_difference"] == pytest.approx(0.01)
    assert c["memory"]["paci_saved_le_stock_every_stage"] and c["memory"]["no_extra_weight_copies"]
    met = {t["target"]: t["met"] for t in c["targets"]}
    assert met == {"PACI/stock throughput >= 1.75": True,  # median ratio 1.764
                   "PACI peak activation bytes <= stock's on every stage (saved for backward)": True,
                   "PACI seconds per batch within 10% of M*3f (emulated); measured/expected": True,  # 0.525 vs 0.48 s
                   "time to target validation loss >= 1.5x shorter than stock": True,
                   "PACI final validation loss within 2% of stock's": True}


def test_compare_engines_with_the_lookahead_engine():
    cfg = config.make_config("emulated", stages=8)
    rounds = [{"stock": _fake_run("stock", 100.0, 1.0, [5.0, 4.0, 3.0], 10.0),
               "paci": _fake_run("paci", 180.0, 0.55, [5.0, 4.0, 3.09], 5.5),
               "paci+lookahead": _fake_run("paci", 178.0, 0.56, [5.0, 3.9, 3.01], 5.6)}]
    c = analysis.compare_engines(cfg, rounds, None)
    assert c["engines"] == ["stock", "paci", "paci+lookahead"]
    assert c["ratio"]["median"] == pytest.approx(1.8) and c["ratios"]["paci+lookahead"]["median"] == pytest.approx(1.78)
    assert c["shares_of_ideal"]["paci+lookahead"] == pytest.approx(1.78 / 1.875)
    t = c["time_to_target"]
    assert t["final_val_loss_relative_differences"]["paci+lookahead"] == pytest.approx(0.01 / 3)
    assert t["speedups"]["paci"]["median"] is None  # 3.09 never reaches 1.02 x 3.0
    assert t["speedups"]["paci+lookahead"]["median"] > 1.7
    met = {x["target"]: x["met"] for x in c["targets"]}
    assert met["PACI + look-ahead throughput >= 95% of the ideal (M+P-1)/M"] is False  # 1.78 / 1.875 = 94.9%
    table = report.throughput_table([{"config": cfg.__dict__, "comparison": c}])
    assert "1.780 (1.780)" in table


def test_study_comparison_times_each_engine_to_stocks_losses():
    runs = {}
    for seed in (1, 2):
        runs[(1e-3, seed, "stock")] = [(0, 5.0), (50, 4.0), (100, 3.0), (150, 2.8), (200, 2.6)]
        runs[(1e-3, seed, "paci")] = [(0, 5.0), (50, 4.2), (100, 3.4), (150, 3.1), (200, 2.9)]
        runs[(1e-3, seed, "paci+lookahead")] = [(0, 5.0), (50, 4.0), (100, 3.0), (150, 2.8), (200, 2.6)]
    out = analysis.study_comparison(runs, [1e-3], [1, 2], config.ENGINES, 200,
                                    {"stock": 2.0, "paci": 1.0, "paci+lookahead": 1.1})
    per = out[1e-3]
    assert per["paci"]["final_vs_stock"] == pytest.approx(0.3 / 2.6)
    assert per["paci+lookahead"]["final_vs_stock"] == pytest.approx(0.0)
    quarter, last = per["paci"]["targets"][0], per["paci"]["targets"][-1]
    assert quarter["stock_step"] == 50 and quarter["target_loss"] == [4.0, 4.0]
    assert quarter["steps"] == [pytest.approx(50 + 50 * 0.2 / 0.8)] * 2  # 4.2 -> 3.4 crosses 4.0 a quarter in
    assert quarter["speedup"]["median"] == pytest.approx(50 * 2.0 / (62.5 * 1.0))
    assert last["steps"] == [None, None] and last["speedup"]["median"] is None
    assert last["short_by"] == [pytest.approx(0.3 / 2.6)] * 2
    la_last = per["paci+lookahead"]["targets"][-1]
    assert la_last["steps"] == [200, 200] and la_last["speedup"]["median"] == pytest.approx(2.0 / 1.1)
    assert analysis.loss_at_step([(0, 5.0), (10, 4.0)], 2.5) == pytest.approx(4.75)


def test_engines_trained_past_stocks_steps_are_compared_at_stocks_step_and_timed_to_its_final_loss():
    runs = {(1e-3, 1, "stock"): [(0, 5.0), (100, 3.0), (200, 2.6)],
            (1e-3, 1, "paci"): [(0, 5.0), (100, 3.2), (200, 2.7), (300, 2.5)],  # reaches 2.6 at step 250
            (1e-3, 1, "paci+lookahead"): [(0, 5.0), (100, 3.0), (200, 2.65), (300, 2.62)]}  # never does
    out = analysis.study_comparison(runs, [1e-3], [1], config.ENGINES, 200,
                                    {"stock": 2.0, "paci": 1.0, "paci+lookahead": 1.0})[1e-3]
    assert out["paci"]["final"]["per_seed"] == [2.7]  # read at stock's step count, not at the curve's end
    final = out["paci"]["targets"][-1]
    assert final["steps"] == [pytest.approx(250)] and final["speedup"]["median"] == pytest.approx(400 / 250)
    missed = out["paci+lookahead"]["targets"][-1]
    assert missed["steps"] == [None] and missed["lowest_at"] == [300]
    assert missed["short_by"] == [pytest.approx(0.02 / 2.6)]
    table = report.study_tables("x", {1e-3: out}, config.ENGINES, [1])
    assert "not reached (+0.77% above at step 300)" in table


def test_measured_values_print_with_their_unit():
    assert report.format_measured(None, "ratio") == "not reached"
    assert report.format_measured(1.8123, "ratio") == "1.812"
    assert report.format_measured(0.0557, "relative") == "+5.57%"
    assert report.format_measured(True, "bool") == "yes"


def test_markdown_tables_say_emulated_for_emulated_rows_only():
    entries = [_fake_entry(config.make_config("real")), _fake_entry(config.make_config("emulated", stages=4))]
    for table in (report.throughput_table(entries), report.accuracy_table(entries), report.memory_table(entries),
                  report.levels_table(entries), report.targets_table(entries)):
        rows = [line for line in table.splitlines()[2:]]
        assert rows and all(line.startswith("| ") for line in rows)
        assert any("emulated P=4 M=4" in line for line in rows)
        for line in rows:
            assert ("emulated" in line) == ("P=4" in line)
    throughput = report.throughput_table(entries)
    assert "(0.240, x" in throughput  # emulated row shows expected seconds per batch: 4 * 3f


# -- end to end ----------------------------------------------------------------------------------


@pytest.mark.process
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_smoke_preset_writes_json_markdown_and_plots(tmp_path, tied):
    out = tmp_path / "results"
    flags = ["--tie-embeddings"] if tied else []
    assert cli.main(["--preset", "smoke", "--out", str(out), "--log-dir", str(tmp_path / "logs")] + flags) == 0
    name = config.presets()["smoke"].configs[0].name + ("_tied" if tied else "")
    entry = json.loads((out / f"{name}.json").read_text())
    assert entry["emulated"] and "emulated" in entry["label"]
    assert entry["config"]["tie_embeddings"] == tied and ("tied embeddings" in entry["label"]) == tied
    c = entry["comparison"]
    for engine in config.ENGINES:
        assert c["tokens_per_second"][engine]["median"] > 0
        assert all(stage["peak_saved_bytes"] > 0 and stage["peak_held_bytes"] > 0 and stage["peak_rss_bytes"] > 0
                   for stage in c["memory"][engine])
    assert entry["rounds"][0]["paci"]["engine_type"] == "PACIPipelineEngine"
    assert entry["rounds"][0]["stock"]["engine_type"] == "PipelineEngine"
    assert c["memory"]["no_extra_weight_copies"] and c["memory"]["same_param_bytes_every_stage"]
    assert all(stage["aliases_share_storage"] for stage in c["memory"]["paci"])
    finals = c["time_to_target"]["final_val_loss"]
    assert 0 < finals["paci"] < 6 and 0 < finals["stock"] < 6
    for engine in config.ENGINES:
        validation = entry["rounds"][0][engine]["validation"]
        assert [p["step"] for p in validation] == [0, 3, 6]
        assert validation[-1]["loss"] < validation[0]["loss"]
    summary = (out / "summary.md").read_text()
    assert "emulated P=2 M=2" in summary and "Machine:" in summary
    for plot in (entry["plots"]["throughput"], entry["plots"]["loss"], entry["timelines"]["stock"]["png"],
                 entry["timelines"]["paci"]["png"]):
        assert (out / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    chrome = json.loads((out / entry["timelines"]["paci"]["chrome"]).read_text())
    assert any(e.get("name", "").startswith("STEP") for e in chrome["traceEvents"])
    assert os.path.isfile(tmp_path / "logs" / name / "paci_round0" / "rank0.log")
    # re-analysis from the stored JSON reproduces the comparison without running anything
    (out / "summary.md").unlink()
    assert cli.main(["--preset", "smoke", "--out", str(out), "--summary-only"] + flags) == 0
    assert json.loads((out / f"{name}.json").read_text())["comparison"] == c
    assert "emulated P=2 M=2" in (out / "summary.md").read_text()
    # the look-ahead engine ran on PACI streams and predicted stage 0's crossing forwards
    la_stats = entry["rounds"][0]["paci+lookahead"]["paci_stats"]
    assert la_stats[0]["lookahead"]["predicted_forwards"] > 0 and not entry["rounds"][0]["paci"]["paci_stats"][0][
        "lookahead"]["enabled"]
    if tied:
        return  # the smoke study below runs the untied preset: once is enough
    # the curve study: untimed runs per learning rate and seed (resumable), then the report with throughput-based times
    assert cli.main(["--study", "smoke", "--part", "curves", "--out", str(out)]) == 0
    stored = json.loads((out / f"{name}_curves.json").read_text())["runs"]
    assert len(stored) == 3 and all(r["validation"][-1]["step"] == (6 if r["engine"] == "stock" else 9)
                                    for r in stored.values())  # the smoke study trains PACI engines 1.5x longer
    assert cli.main(["--study", "smoke", "--part", "curves", "--out", str(out)]) == 0  # nothing left to run
    assert json.loads((out / f"{name}_curves.json").read_text())["runs"] == stored
    assert cli.main(["--study", "smoke", "--part", "report", "--out", str(out)]) == 0
    study = (out / "summary.md").read_text()
    assert "PACI + look-ahead" in study and "measured seconds per batch" in study and f"{name}_curves.png" in study
    assert (out / f"{name}_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
