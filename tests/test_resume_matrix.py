"""Every resume exact or refused, on every rank, before anything changes (issue 28, items 1, 2, 4-7).

A checkpoint saved with an open accumulation window is resumed into engines that differ from the saving one in one
thing at a time: the window, M (with "auto"), the number of stages, the data-parallel size, ``load_module_only``,
ZeRO's optimizer offload, tied or untied layers. Each case either continues exactly as the uninterrupted run (losses,
counters, skip counters, weights bit for bit) or is refused with the same one line on every rank within seconds,
the engine left as it was (weights, counters, scheduler, stream) and able to train on.

Two worlds of real engines over gloo (``resume_workers``): two ranks (P = 2), then four (P = 2 x DP = 2, P = 4).
"""

import pytest

import resume_workers
from harness import run_world

pytestmark = pytest.mark.xdist_group("resume_matrix")  # one worker: the tests share the module fixture's world

REFUSAL_SECONDS = 30  # "within seconds" on a loaded two-core machine; a hang would be the gloo timeout (60 s) or more


@pytest.fixture(scope="module")
def two_rank_world(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume_two")
    return run_world(resume_workers.two_ranks, 2, str(root), timeout=600), root


def without_loss(records):
    return [{k: v for k, v in x.items() if k != "loss"} for x in records]


def assert_continues(resumed, reference, what):
    """Counters per call, the last stage's losses (other stages learn them late, over the side channel), weights."""
    assert "error" not in resumed, f"{what}: {resumed.get('error')}"
    assert without_loss(resumed["records"]) == without_loss(reference["records"]), what
    if reference["last"]:
        assert [x["loss"] for x in resumed["records"]] == [x["loss"] for x in reference["records"]], what
    assert resumed["end"] == reference["end"], what
    assert resumed["weights"].keys() == reference["weights"].keys()
    for k in reference["weights"]:
        assert resumed["weights"][k].equal(reference["weights"][k]), f"{what}: {k} differs"


def assert_refused(results, case, *needles):
    """Every rank refused with the same one line (naming ``needles``), quickly, and the engine is as it was."""
    errors = {r[case]["error"] for r in results}
    assert len(errors) == 1 and None not in errors, f"{case}: not one refusal on every rank: {errors}"
    error = errors.pop()
    assert "\n" not in error, error
    for needle in needles:
        assert needle in error, (case, needle, error)
    for r in results:
        x = r[case]
        assert x["seconds"] < REFUSAL_SECONDS, (case, x["seconds"])
        assert x["weights_kept"], f"{case}: stage {x['stage']}'s weights changed by a refused load"
        assert x["position_after"] == x["position_before"], case
        assert x["trained_after"]
    return error


@pytest.mark.process
def test_two_ranks_offload_tied_lag_module_only(two_rank_world):
    results, _ = two_rank_world
    for r in results:
        # item 1: bf16 + ZeRO-1 + CPU offload keeps the window in param.grad_accum; it is saved and put back
        assert r["offload_ref"]["saved"]["fill"] == 1
        assert_continues(r["offload_same"], r["offload_ref"], "offload resumed")
        # item 2: a = M = 1 -> 2 with windows pending: the lag L 2 -> 1 catches up as set_train_batch_size does
        assert r["tied_pending"], "the tied case must save pending windows"
        assert_continues(r["tied_m2"], r["tied_ref"], "tied, M 1 -> 2")
        # item 4: load_module_only is the checkpoint's weights and nothing else (no pending window, no counter)
        assert_continues(r["tied_module_only"], r["tied_fresh"], "tied, load_module_only")
    # the open window's gradients were kept where DeepSpeed keeps them, so the saved path must match
    assert_refused(results, "offload_removed", "WindowStateError", "open accumulation window", "offload")
    assert_refused(results, "tied_into_untied", "WindowStateError", "tied")
    assert_refused(results, "untied_into_tied", "WindowStateError", "tied")


@pytest.mark.process
def test_four_ranks_window_stages_replicas_module_only_auto(two_rank_world, tmp_path):
    _, root = two_rank_world
    results = run_world(resume_workers.four_ranks, 4, str(tmp_path), str(root / "p2dp1"), timeout=600)
    for r in results:
        ref = r["ref"]
        assert ref["saved"]["fill"] == 1
        # item 6: the skip counters go on across the save (a NaN window before it, one right after it)
        after = ref["records"]
        assert max(x["consecutive_skips"] for x in after) == 2, after  # two windows in a row: one each side
        assert_continues(r["same"], ref, "resumed unchanged")
        # item 4: load_module_only = a fresh engine holding the checkpoint's weights
        assert_continues(r["module_only"], r["fresh"], "load_module_only")
    # item 5: refused before DeepSpeed's load, the engine untouched
    assert_refused(results, "window", "WindowStateError", "accumulation window 3", "this run's window is 2")
    assert_refused(results, "stages", "WindowStateError", "saved on 2 pipeline stages", "this run has 4", "load_module_only=True")
    assert_refused(results, "dp", "WindowStateError", "1 data-parallel replicas", "this run has 2")
    # item 7: "auto" with M 10 -> 1 changes every stage's window (4 -> 3); every rank refuses alike
    assert [r["auto_saved"] for r in results] == [(4, 2)] * 4
    assert [r["auto_window"] for r in results] == [3, 3, 3, 3]
    assert_refused(results, "auto", "WindowStateError", "accumulation window")
