"""The "paci" section and ds_paci.initialize refuse what PACI cannot honour, with messages that name the fix."""

import json

import pytest

import workers
from harness import run_world
from ds_paci.core.seam import compat
from ds_paci.core.config import PACIConfig, PACIConfigError, load_config, parse_paci_section


def test_defaults_and_valid_section():
    assert parse_paci_section(None) == PACIConfig()
    cfg = parse_paci_section({"enabled": True, "accumulation_window": 8, "drain_every_batch": True,
                              "watchdog_seconds": 30, "trace": True, "trace_dir": "runs/t", "max_consecutive_skips": 0,
                              "check_tied_copies": True})
    assert cfg.enabled and cfg.accumulation_window == 8 and cfg.watchdog_seconds == 30.0 and cfg.trace
    assert cfg.max_consecutive_skips == 0 and PACIConfig().max_consecutive_skips == 5
    assert cfg.check_tied_copies and not PACIConfig().check_tied_copies
    assert cfg.window(4) == 8 and PACIConfig(enabled=True).window(4) == 4
    # the look-ahead is on by default and can be switched off; the restore mode is validated
    assert PACIConfig().lookahead and PACIConfig().lookahead_restore == "copy"
    off = parse_paci_section({"enabled": True, "lookahead": False, "lookahead_restore": "copy"})
    assert not off.lookahead and off.lookahead_restore == "copy"


def test_auto_window_keeps_drift_at_most_one_on_every_stage_within_its_floors():
    from ds_paci.core.config import auto_window
    from ds_paci.core.program.stream import drift_bound
    auto = parse_paci_section({"enabled": True, "accumulation_window": "auto", "sync_warmup_calls": 0})
    for P in range(2, 17):
        for M in range(1, 33):
            windows = [auto.window(M, P, s) for s in range(P)]
            assert windows == [auto_window(P, M, s) for s in range(P)]
            assert all(drift_bound(P, s, a) <= 1 for s, a in enumerate(windows)), (P, M, windows)
            # one window on every stage, M < P-1 included (issue 30): P-1 where M <= 3(P-1), about three
            # times stock's steps at most beyond
            assert windows == [max(P - 1, -(-M // 3))] * P, (P, M, windows)
            assert windows[0] == P - 1 or M > 3 * (P - 1), (P, M, windows)
            # one window for every stage (tied layers across stages, sync mode): stage 0's, drift <= 1 everywhere
            uniform = auto.window(M, P)
            assert uniform == windows[0] and all(drift_bound(P, s, uniform) <= 1 for s in range(P))
    assert auto.window(8, 1) == 8  # one stage: no drift, the stock engine's window
    assert [auto_window(8, 4, s) for s in range(8)] == [7] * 8  # issue 30: 7,6,5,4,4,4,4,4 until then
    assert [auto_window(4, 2, s) for s in range(4)] == [3] * 4 and [auto_window(16, 8, s) for s in range(16)] == [15] * 16
    assert [auto_window(P, 2 * P, 0) for P in (4, 8, 16, 32)] == [3, 7, 15, 31]  # the sweep's M = 2P cells: P-1
    assert auto_window(2, 8) == 3 and auto_window(4, 12) == 4  # the guard ceil(M/3), beyond the sweep


@pytest.mark.parametrize("section,needle", [
    ({"enabled": True, "acumulation_window": 4}, "unknown key(s) 'acumulation_window'"),
    ({"enabled": True, "accumulation_window": 0}, '"paci.accumulation_window" = 0'),
    ({"enabled": True, "accumulation_window": 2.5}, "an integer >= 1"),
    ({"enabled": True, "accumulation_window": True}, '"paci.accumulation_window" = True'),
    ({"enabled": "yes"}, '"paci.enabled" = \'yes\''),
    ({"enabled": True, "watchdog_seconds": -1}, "seconds >= 0"),
    ({"enabled": True, "trace_dir": ""}, '"paci.trace_dir"'),
    ({"enabled": True, "max_consecutive_skips": -1}, '"paci.max_consecutive_skips" = -1'),
    ({"enabled": True, "max_consecutive_skips": 2.5}, "an integer >= 0"),
    ({"enabled": True, "check_tied_copies": 1}, '"paci.check_tied_copies" = 1'),
    ({"enabled": True, "lookahead": "on"}, '"paci.lookahead" = \'on\''),
    ({"enabled": True, "lookahead_restore": "exact"}, '"copy" or "recompute"'),
    ({"enabled": True, "accumulation_window": "automatic"}, 'or "auto"'),
    ([1, 2], '"paci" must be an object'),
])
def test_bad_sections_name_key_value_and_what_is_allowed(section, needle):
    with pytest.raises(PACIConfigError) as err:
        parse_paci_section(section)
    assert needle in str(err.value)
    assert any(w in str(err.value) for w in ("allowed", "use", "like"))


def test_load_config_from_dict_path_and_args(tmp_path):
    cfg = {"train_batch_size": 4, "paci": {"enabled": True}}
    assert load_config(cfg) == cfg and load_config(cfg) is not cfg
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cfg))

    class Args:
        deepspeed_config = str(path)

    assert load_config(None, Args()) == cfg
    with pytest.raises(PACIConfigError, match="both"):
        load_config(cfg, Args())
    with pytest.raises(PACIConfigError, match="does not exist"):
        load_config(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_batch_size": 4,}')
    with pytest.raises(PACIConfigError, match="not valid JSON"):
        load_config(str(bad))
    with pytest.raises(PACIConfigError, match="no DeepSpeed config"):
        load_config(None, None)


@pytest.mark.process
def test_initialize_refuses_unsupported_runs_on_every_rank():
    results = run_world(workers.initialize_errors, 2, timeout=120)
    for out in results:  # identical decisions on both ranks: nobody is left waiting
        assert out == results[0]
    out = results[0]
    assert "needs a deepspeed.pipe.PipelineModule, got Linear" in out["not_pipeline"]
    assert '"zero_optimization.stage" = 2' in out["zero2"] and "use stage 0 or 1" in out["zero2"]
    assert '"fp16.enabled" = true' in out["fp16"] and "bf16" in out["fp16"]
    assert '"paci.accumulation_window" = 0' in out["window0"]
    assert "acumulation_window" in out["unknown"] and '"accumulation_window"' in out["unknown"]
    # tied layers across stages are supported, with clipping too (issue 16); ZeRO's optimizer offload is refused
    assert all("no tied-weight policy" not in str(v) for v in out.values())
    assert out["tied_type"] == "PACIPipelineEngine" and out["tied_stats"]["owner_stages"] == {"w": [0, 1]}
    assert out["tied_stats"]["lag_windows"] == 1
    assert out["tied_clip"] is None
    assert ('"zero_optimization.offload_optimizer.device" = "cpu" with tied layers [\'w\'] on stages [0, 1]'
            in out["tied_offload"])
    assert "remove the offload or untie the layers" in out["tied_offload"]
    assert out["stock_type"] == "PipelineEngine" and out["disabled_type"] == "PipelineEngine"
    assert out["zero1_type"] == "PACIPipelineEngine" and out["zero1_clip"] == 0.0
    # bf16 is refused exactly on the DeepSpeed versions whose stock pipeline gets FP16_UnfusedOptimizer for it
    if out["bf16_stock_optimizer"] == "FP16_UnfusedOptimizer":
        assert compat.DS_BF16_GETS_UNFUSED
        assert out["bf16"] and "FP16_UnfusedOptimizer" in out["bf16"] and ">= 0.18.9" in out["bf16"], out["bf16"]
    else:
        assert out["bf16_stock_optimizer"] == "BF16_Optimizer" and not compat.DS_BF16_GETS_UNFUSED
        assert out["bf16"] is None, out["bf16"]


def test_auto_window_is_one_window_on_every_stage_tied_or_not_sync_or_not():
    from types import SimpleNamespace

    import torch
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    from ds_paci.core.engine.pipeline_engine import PACIPipelineEngine

    def engine(stage, tied, sync=False, warm=False):
        layer = torch.nn.Identity
        specs = [TiedLayerSpec("e", layer) if tied else LayerSpec(layer)] + [LayerSpec(layer)] * 6 + \
            [TiedLayerSpec("e", layer) if tied else LayerSpec(layer)]
        module = SimpleNamespace(parts=list(range(9)), _layer_specs=specs, num_stages=8)
        paci = parse_paci_section({"enabled": True, "accumulation_window": "auto", "drain_every_batch": sync,
                                   **({} if warm else {"sync_warmup_calls": 0})})
        return SimpleNamespace(paci=paci, micro_batches=4, num_stages=8, stage_id=stage, module=module)

    window = PACIPipelineEngine._configured_window
    # M = 4 < P-1: one window P-1 since issue 30 (the per-stage 7,6,5,4,4,4,4,4 before it)
    assert [window(engine(s, tied=False)) for s in range(8)] == [7] * 8
    assert [window(engine(s, tied=True)) for s in range(8)] == [7] * 8  # tied owners step together
    assert [window(engine(s, tied=False, sync=True)) for s in range(8)] == [7] * 8
    # the default "auto" warm start: per stage after it (late stages step every M); tied owners still together
    assert [window(engine(s, tied=False, warm=True)) for s in range(8)] == [7, 6, 5, 4, 4, 4, 4, 4]
    assert [window(engine(s, tied=True, warm=True)) for s in range(8)] == [7] * 8


def test_the_main_job_and_initialize_share_one_model_free_config_check():
    """``core.config.check_config`` is the one model-free check: the main job's refusal is its line, word for word,
    and ``validate_run`` (what ``ds_paci.initialize`` runs) raises the same line for the same config."""
    from deepspeed.pipe import PipelineModule

    from ds_paci.core.config import check_config, validate_run
    from ds_paci.mainjob.inputs import check_config as job_check_config
    from ds_paci.mainjob.options import UsageError
    base = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4, "paci": {"enabled": True}}
    bad = [
        {"zero_optimization": {"stage": 2}},
        {"fp16": {"enabled": True}},
        {"gradient_accumulation_steps": 0},
        {"paci": {"enabled": True, "accumulation_window": 10**6}},
        {"paci": {"enabled": True, "no_such_key": 1}},
    ]
    # validate_run's config checks run before it reads the model; building one would need a process group
    model = PipelineModule.__new__(PipelineModule)
    for change in bad:
        cfg = {**base, **change}
        with pytest.raises(PACIConfigError) as core_error:
            check_config(cfg)
        with pytest.raises(UsageError) as job_error:
            job_check_config(cfg, world_size=1, stages=1, config_path="c.json")
        assert str(job_error.value) == str(core_error.value), change
        if "no_such_key" not in json.dumps(change):  # validate_run takes the parsed section
            with pytest.raises(PACIConfigError) as run_error:
                validate_run(cfg, model, parse_paci_section(cfg["paci"]))
            assert str(run_error.value) == str(core_error.value), change
    assert check_config(base).enabled and not check_config({"gradient_accumulation_steps": 2}).enabled
