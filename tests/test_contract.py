"""The DeepSpeed engine contract on PACI (issue 7): real engines in real processes over gloo.

A loss on every rank without a blocking wait, DeepSpeed's and Megatron's calling patterns, sync mode equal to
the stock engine on DeepSpeed's default clipping, refusals that building the class directly cannot bypass.
"""

import math

import pytest

import contract_workers
from harness import run_world
from ds_paci.core.seam import compat

pytestmark = pytest.mark.process  # every test here starts processes (tests/conftest.py)


def loss_bound(stages, stage, gas):
    """Calls by which stage ``stage``'s loss can lag the last stage's, from the pipeline's data dependencies."""
    return math.ceil((stages - stage) / (2 * gas))


@pytest.mark.parametrize("stages,gas", [(2, 2), (4, 4)], ids=["P2", "P4"])
def test_loss_on_every_rank_and_deepspeeds_calling_patterns(stages, gas, tmp_path):
    calls = 10
    results = run_world(contract_workers.calling_patterns, stages, stages, gas, calls, str(tmp_path / "ckpt"),
                        timeout=300)
    last = results[-1]
    last_losses = [c["loss"] for c in last["plain"]]
    assert all(math.isfinite(x) for x in last_losses)
    for s, r in enumerate(results):
        assert r["stage"] == s
        plain = r["plain"]
        assert all(c["loss_dim"] == 0 for c in plain)  # a 0-dim tensor on every rank, never None
        assert all(c["applied"] for c in plain), "was_step_applied() is False only after a skipped step"
        # a number for the loggers from the first local step on: the stage's own norm
        assert all(c["norm"] is not None and math.isfinite(c["norm"]) and c["norm"] > 0 for c in plain[2:])
        ages = contract_workers.loss_ages([c["loss"] for c in plain], last_losses)
        if s == stages - 1:
            assert ages == [0] * calls
            continue
        bound = loss_bound(stages, s, gas)
        print(f"stage {s} of {stages}: loss ages {ages} (bound {bound})")
        assert ages[0] is None or ages[0] == 0  # NaN before the first value arrives
        seen = [a for a in ages if a is not None]
        assert seen and min(seen) >= 0
        assert max(seen) <= bound + 1, (ages, bound)  # one call of slack for the side channel's delivery
        assert sum(a <= bound for a in seen) >= len(seen) // 2, (ages, bound)
        # the stage's reported age matches, and the additional losses travel with the loss
        assert [c["age"] for c in plain if not math.isnan(c["loss"])] == seen
        for c, age, k in zip(plain, ages, range(calls)):
            if age is not None:
                assert c["aux"] == last["plain"][k - age]["aux"]
    # the stages' norms are their own (stage-local), not one global value
    assert len({round(r["plain"][-1]["norm"], 6) for r in results}) == stages
    # set_train_batch_size(<unchanged>) before every call: no drain, identical training
    for r in results:
        assert r["drains_after_unchanged"] == 0
    assert [c["loss"] for c in last["megatron"]] == last_losses
    # eval_batch and save_checkpoint under torch.no_grad() in the middle of async training
    assert math.isfinite(last["eval"]) and all(r["eval"] == last["eval"] for r in results)
    assert (tmp_path / "ckpt" / "mid").is_dir()
    for r in results:
        assert r["drains_after_eval_save"] == 2  # one drain each: eval_batch and save_checkpoint
        assert all(math.isfinite(c["loss"]) for c in r["after_save"])
        # a real change of the batch size drains once and continues with twice the micro-batches
        assert r["drains_after_resize"] == 3
        assert r["micro_batches_after_resize"] == (2 * gas, 2 * gas)
        assert math.isfinite(r["after_resize"][-1]["loss"])
    first = results[0]["stats"]  # stage 0 loaded every micro-batch it was given, at both sizes
    assert first["micro_batches"] + first["in_flight"] == (calls + 2) * gas + 2 * 2 * gas
    # sync mode: every rank returns the call's own loss (the stock engine broadcasts it)
    sync_last = [c["loss"] for c in last["sync"]]
    for r in results:
        assert [c["loss"] for c in r["sync"]] == sync_last
        assert all(c["age"] == 0 for c in r["sync"])


def max_weight_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_sync_mode_is_the_stock_engine_with_deepspeeds_default_clipping():
    """Clipping absent (DeepSpeed's default over the whole pipeline: 1.0 from 0.19.3, 0 before), 1.0 and 0.0; fp32
    and bf16."""
    from spy import cross_stage_collectives
    cases = [("absent", False), (1.0, False), (0.0, False), ("absent", True)]
    if compat.DS_BF16_GETS_UNFUSED:
        cases.remove(("absent", True))  # bf16 is refused on this DeepSpeed version (asserted by test_config)
    results = run_world(contract_workers.sync_vs_stock_clipping, 2, 2, 4, 2, cases, timeout=400)
    for case in cases:
        stock, sync = results[-1][case + ("stock",)], results[-1][case + ("sync",)]
        assert stock["type"] == "PipelineEngine" and sync["type"] == "PACIPipelineEngine"
        assert max(abs(a - b) for a, b in zip(stock["losses"], sync["losses"])) <= 1e-6, (case, stock, sync)
        for r in results:
            s, y = r[case + ("stock",)], r[case + ("sync",)]
            clip = compat.DS_DEFAULT_CLIPPING if case[0] == "absent" else case[0]
            assert s["clip"] == y["clip"] == clip
            assert max_weight_diff(s["weights"], y["weights"]) <= 1e-6, case
            if clip == 0.0 and not case[1]:  # stock has no norm collective here, and neither has sync mode
                assert not cross_stage_collectives(y["calls"], y["stage_of_rank"])
            else:  # DeepSpeed's global norm: the same cross-stage all_reduce in both, nothing more in sync mode
                stock_norm = [c for c in cross_stage_collectives(s["calls"], s["stage_of_rank"]) if c[0] == "all_reduce"]
                assert stock_norm and cross_stage_collectives(y["calls"], y["stage_of_rank"]) == stock_norm
    # the clipping cases differ from each other: the comparison above is not vacuous
    last = results[-1]
    default = ("absent", False, "sync")
    assert last[default]["losses"] == last[(compat.DS_DEFAULT_CLIPPING, False, "sync")]["losses"]
    if not compat.DS_SCALES_EVERY_STAGE:  # 0.18.3-0.19.2 divide stage 0's gradient by M twice: 1.0 does not clip here
        assert last[(1.0, False, "sync")]["losses"][-1] != last[(0.0, False, "sync")]["losses"][-1]


def test_building_the_class_directly_refuses_what_initialize_refuses():
    results = run_world(contract_workers.rebound_engine_refusals, 2, timeout=180)
    for r in results:
        assert r == results[0]  # the same decision on every rank
    for name, (via_initialize, via_rebind) in results[0].items():
        assert via_initialize and via_rebind == via_initialize, (name, via_initialize, via_rebind)
    assert "\"zero_optimization.offload_optimizer.device\" = \"cpu\" with tied layers ['w'] on stages [0, 1]" in (
        results[0]["tied"][1])
    assert '"zero_optimization.stage" = 2' in results[0]["zero2"][1]
    assert '"paci.accumulation_window" = 0' in results[0]["bad_section"][1]
