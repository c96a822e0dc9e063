"""PACIPipelineEngine in real processes over gloo, with real DeepSpeed engines, models and data."""

import math
import time

import pytest
import torch

import contract_workers
import workers
from harness import run_world
from mlp import layer_weights, run_streams_by_hand
from ds_paci.core.seam import compat
from ds_paci.core.program.stream import drift_bound
from spy import POINT_TO_POINT, cross_stage_collectives, pipeline_transfers, side_channel_transfers

pytestmark = pytest.mark.process  # every test here starts processes (tests/conftest.py)


def max_weight_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


# -- sync mode is the stock engine --------------------------------------------------------
# DeepSpeed versions that give bf16 pipelines FP16_UnfusedOptimizer: PACI refuses bf16 there (test_config asserts it)
BF16_REFUSED = pytest.mark.skipif(compat.DS_BF16_GETS_UNFUSED, reason="bf16 is refused on this DeepSpeed version")


@pytest.mark.parametrize("stages,bf16,client_optimizer",
                         [(2, False, True), (4, False, False), pytest.param(2, True, False, marks=BF16_REFUSED)],
                         ids=["P2-fp32-torch.optim", "P4-fp32-configured-AdamW", "P2-bf16-configured-AdamW"])
def test_sync_mode_reproduces_stock_engine(stages, bf16, client_optimizer):
    results = run_world(workers.stock_vs_sync, stages, stages, 5, 4, bf16, client_optimizer, timeout=240)
    last = results[-1]
    assert last["stock"]["type"] == "PipelineEngine" and last["sync"]["type"] == "PACIPipelineEngine"
    stock, sync = last["stock"]["losses"], last["sync"]["losses"]
    assert len(stock) == 5 and all(x is not None for x in sync)
    assert max(abs(a - b) for a, b in zip(stock, sync)) <= 1e-6, (stock, sync)
    assert stock[-1] < stock[0]  # it trained
    for rank, r in enumerate(results):
        assert max_weight_diff(r["stock"]["weights"], r["sync"]["weights"]) <= 1e-6, f"stage {rank}"
    # the spy catches the stock engine's cross-stage collectives (loss broadcast). Sync mode is the stock engine:
    # in fp32 with clipping 0 stock has no norm collective and sync-mode PACI issues none; in bf16 both compute
    # DeepSpeed's norm over the pipeline (BF16_Optimizer always does), and that is all sync mode adds.
    for r in results:
        stock_crossing = cross_stage_collectives(r["stock"]["calls"], r["stock"]["stage_of_rank"])
        sync_crossing = cross_stage_collectives(r["sync"]["calls"], r["sync"]["stage_of_rank"])
        assert stock_crossing
        if bf16:
            assert sync_crossing and sync_crossing == [c for c in stock_crossing if c[0] == "all_reduce"]
        else:
            assert not sync_crossing


def test_pipeline_with_data_parallel_replicas_and_zero1():
    """2 stages x 2 replicas, ZeRO-1: sync mode equals stock; async reduces only within each stage's DP group."""
    results = run_world(workers.stock_vs_sync, 4, 2, 4, 2, False, False, 1, ("stock", "sync", "async"), timeout=300)
    assert {r["sync"]["optimizer"] for r in results} == {"DeepSpeedZeroOptimizer"}
    last = [r for r in results if r["sync"]["stage"] == 1]
    assert max(abs(a - b) for a, b in zip(last[0]["stock"]["losses"], last[0]["sync"]["losses"])) <= 1e-6
    for r in results:
        assert max_weight_diff(r["stock"]["weights"], r["sync"]["weights"]) <= 1e-6
        crossing = cross_stage_collectives(r["async"]["calls"], r["async"]["stage_of_rank"])
        assert not crossing, crossing[:5]
        assert any(op == "all_reduce" or op.startswith("all_gather") for op, _, _ in r["async"]["calls"])
    # the replicas of a stage saw different data but hold identical weights: the DP reduce ran
    by_stage = {}
    for r in results:
        by_stage.setdefault(r["async"]["stage"], []).append(r["async"]["weights"])
    for stage, (w1, w2) in by_stage.items():
        assert max_weight_diff(w1, w2) == 0.0, f"stage {stage}"
    # get_global_grad_norm() under ZeRO-1: the stage's own norm, the same on its replicas, different across stages
    norms = {}
    for r in results:
        norms.setdefault(r["async"]["stage"], set()).add(r["async"]["norm"])
    assert all(len(v) == 1 and math.isfinite(next(iter(v))) for v in norms.values()), norms
    assert norms[0] != norms[1]
    assert all(math.isfinite(x) for x in last[0]["async"]["losses"] if x is not None)
    # the look-ahead under ZeRO-1: each replica of stage 0 predicted its own partition, and only that
    for r in results:
        if r["async"]["stage"] == 0:
            assert r["async"]["lookahead"]["predicted_forwards"] == 3 and len(r["async"]["predicted"]) == 3
            assert all(changed and inside for changed, inside in r["async"]["predicted"]), r["async"]["predicted"]
        else:
            assert r["async"]["lookahead"]["predicted_forwards"] == 0


# -- async mode: trains, drift within bound, no cross-stage collective ------------------------
@pytest.mark.parametrize("stages", [2, 4])
def test_async_trains_with_bounded_drift_and_no_cross_stage_collective(stages):
    gas, batches = 4, 14
    results = run_world(workers.async_training, stages, stages, batches, gas, timeout=240)
    last = results[-1]
    losses = [x for x in last["losses"] if x is not None]
    assert len(losses) == batches
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses
    for s, r in enumerate(results[:-1]):  # every stage returns the last stage's loss, a bounded number of calls late
        assert all(isinstance(x, float) for x in r["losses"])
        ages = contract_workers.loss_ages(r["losses"], last["losses"])
        assert all(age is None or age >= 0 for age in ages) and ages[-1] is not None, (s, ages)
    for s, r in enumerate(results):
        st = r["stats"]
        assert st["stage"] == s
        bound = drift_bound(stages, s, gas)
        assert st["drift_bound"] == bound and st["max_drift"] <= bound
        assert max(d for _, d in r["recent"]) <= bound
        if s < stages - 1:
            assert st["max_drift"] == bound, "steady-state micro-batches cross a local step at every non-last stage"
        # a = M: one local step per call in steady state, everything completes after the drain
        assert st["micro_batches"] == batches * gas and st["local_steps"] == batches and st["in_flight"] == 0
        if s == 0:  # nothing was flushed at the call boundaries
            assert r["stats_before_drain"]["in_flight"] == stages - 1
        # the spy: collectives inside train_batch stay within one stage; p2p only to neighbours
        crossing = cross_stage_collectives(r["calls"], r["stage_of_rank"])
        assert not crossing, f"stage {s} issued cross-stage collectives: {crossing[:5]}"
        assert any(op in POINT_TO_POINT for op, _, _ in r["calls"])
        peers = {r["stage_of_rank"][p] for op, _, p in pipeline_transfers(r["calls"])}
        assert peers <= {s - 1, s + 1}
        # the loss side channel: non-blocking point-to-point on a group of its own, last stage <-> the others
        side = side_channel_transfers(r["calls"])
        assert side and {op for op, _, _ in side} <= {"isend", "irecv"}
        assert all(set(ranks) == set(r["stage_of_rank"]) for _, ranks, _ in side)
        side_peers = {r["stage_of_rank"][p] for _, _, p in side}
        assert side_peers == ({stages - 1} if s < stages - 1 else set(range(stages - 1)))


def test_async_with_window_smaller_than_pipeline_depth_respects_bound():
    """a = 1 on 4 stages: stage 0 crosses up to 3 versions, and still trains."""
    results = run_world(workers.async_training, 4, 4, 6, 2, 1, timeout=240)
    for s, r in enumerate(results):
        assert r["stats"]["max_drift"] == drift_bound(4, s, 1) == 3 - s
        assert r["stats"]["local_steps"] == 6 * 2
    losses = results[-1]["losses"]
    assert all(math.isfinite(x) for x in losses)


# -- the PACI gradient ---------------------------------------------------------------------
def reference_paci_mlp(P, layers, gas, window, calls, lr, stale=False, seed=7):
    """PACI on the tanh MLP, written out by hand (no autograd).

    Each stage follows its PACI stream in tick order. A forward uses the weights current
    at that moment and saves each layer's input and output. A backward computes weight
    gradients from those saved activations and passes the input gradient through the
    weights current *at backward time* (``stale=True``: the weights of the forward, as a
    weight-stashing scheme would). The last stage's loss is scaled by ``1/window``.
    """
    W = [list(map(lambda t: t.double(), layer_weights(i, seed))) for i in range(layers)]
    gW = [[torch.zeros_like(w), torch.zeros_like(b)] for w, b in W]

    def step(s, ins, mine):
        for i in mine:
            W[i][0] -= lr * gW[i][0]
            W[i][1] -= lr * gW[i][1]
            gW[i][0].zero_()
            gW[i][1].zero_()

    losses = run_streams_by_hand(P, layers, gas, window, calls, W, gW, workers.MICRO, step, stale=stale)
    return W, losses


@pytest.mark.parametrize("stages,window", [(2, 1), (3, 1), (3, 2)])
def test_micro_batches_crossing_a_local_step_get_the_paci_gradient(stages, window, tmp_path):
    """The engine's weights equal a hand-written PACI run: current-weight backward, gradients averaged over the window.

    window = gas (3-2) tells the mean over the window from DeepSpeed's own scaling, which differs by version
    (the stock pipeline sums micro-batches before DeepSpeed 0.18.3; see ds_paci.core.seam.compat).
    """
    layers, gas, calls, lr = 2 * stages, 2, 5, 0.2
    results = run_world(workers.mlp_training, stages, stages, layers, gas, window, calls, lr, timeout=180,
                        log_dir=str(tmp_path))
    # plain PACI ("lookahead": false; the look-ahead's own tests: tests/test_lookahead*.py)
    assert all(not r["stats"]["lookahead"]["enabled"] for r in results)
    W, _ = reference_paci_mlp(stages, layers, gas, window, calls, lr)
    W_stale, _ = reference_paci_mlp(stages, layers, gas, window, calls, lr, stale=True)
    assert results[0]["stats"]["max_drift"] >= 1, "no micro-batch crossed a local step: the test would be vacuous"
    diff_paci = diff_stale = 0.0
    for r in results:
        start, stop = r["layers"]
        for local, i in enumerate(range(start, stop)):
            w = r["weights"][f"{i}.linear.weight"].double()
            b = r["weights"][f"{i}.linear.bias"].double()
            diff_paci = max(diff_paci, (w - W[i][0]).abs().max().item(), (b - W[i][1]).abs().max().item())
            diff_stale = max(diff_stale, (w - W_stale[i][0]).abs().max().item())
    assert diff_paci < 2e-6, diff_paci
    assert diff_stale > 100 * max(diff_paci, 1e-7), "current-weight and stale-weight gradients must differ here"
    engine_losses = [x for x in results[-1]["losses"] if x is not None]
    assert len(engine_losses) >= 1


@pytest.mark.parametrize("bf16,client", [(False, "sgd"),
                                         pytest.param(True, "sgd", marks=BF16_REFUSED),
                                         pytest.param(True, "configured", marks=BF16_REFUSED)],
                         ids=["fp32-torch.optim", "bf16-torch.optim", "bf16-configured"])
def test_backward_through_current_weights_on_stock_pytorch(bf16, client):
    """With a = 1 on 3 stages every non-last micro-batch crosses a step; autograd's version check must not fire."""
    results = run_world(workers.mlp_training, 3, 3, 3, 2, 1, 4, 0.1, bf16, client, timeout=180)
    assert results[0]["stats"]["max_drift"] == 2
    if bf16:
        assert results[0]["optimizer"] == "BF16_Optimizer"
    assert all(math.isfinite(x) for x in results[-1]["losses"] if x is not None)


# -- data pairing -----------------------------------------------------------------------
def test_inputs_and_labels_stay_paired_when_each_call_gets_a_new_iterator():
    stages, gas, batches = 4, 2, 5
    persistent = run_world(workers.pairing, stages, stages, gas, batches, False, timeout=180)
    fresh = run_world(workers.pairing, stages, stages, gas, batches, True, timeout=180)
    assert persistent[-1]["losses"] == fresh[-1]["losses"]
    for a, b in zip(persistent, fresh):
        assert max_weight_diff(a["weights"], b["weights"]) == 0.0


# -- eval, checkpoint, resume ---------------------------------------------------------------
def test_resume_in_sync_mode_reproduces_uninterrupted_losses(tmp_path):
    paci = {"enabled": True, "drain_every_batch": True}
    full = run_world(workers.train_eval_save, 2, 2, paci, 6, 0, None, timeout=180)
    part = run_world(workers.train_eval_save, 2, 2, paci, 3, 3, str(tmp_path / "ckpt"), timeout=180)
    resumed = run_world(workers.resume, 2, 2, paci, 3, str(tmp_path / "ckpt"), timeout=180)
    uninterrupted = full[-1]["losses_before"]
    assert part[-1]["losses_before"] == uninterrupted[:3]
    assert math.isfinite(part[-1]["eval"]) and part[0]["drained_after_eval"]
    # eval and save in the middle did not disturb training
    assert max(abs(a - b) for a, b in zip(part[-1]["losses_after"], uninterrupted[3:])) <= 1e-6
    # a fresh world (different init) resumes exactly
    assert resumed[-1]["path"] is not None
    assert max(abs(a - b) for a, b in zip(resumed[-1]["losses"], uninterrupted[3:])) <= 1e-6
    for a, b in zip(full, resumed):
        assert max_weight_diff(a["weights"], b["weights"]) <= 1e-6


def test_eval_and_checkpoint_in_the_middle_of_async_training(tmp_path):
    paci = {"enabled": True}
    part = run_world(workers.train_eval_save, 3, 3, paci, 4, 3, str(tmp_path / "ckpt"), timeout=180)
    resumed = run_world(workers.resume, 3, 3, paci, 2, str(tmp_path / "ckpt"), timeout=180)
    last = part[-1]
    assert math.isfinite(last["eval"]) and all(r["drained_after_eval"] for r in part)
    assert all(math.isfinite(x) for x in last["losses_after"] if x is not None)
    # after the drain every stage holds the same version, so the checkpoint tag agrees
    assert len({r["version_at_save"] for r in part}) == 1 and part[0]["version_at_save"] == 4 * 2 // 2
    for r in resumed:
        assert r["stream_state"]["next_micro_batch"] == 4 * 2
        assert r["version"] == part[0]["version_at_save"] + 2
    assert all(math.isfinite(x) for x in resumed[-1]["losses"] if x is not None)


# -- hangs fail fast ---------------------------------------------------------------------------
def test_a_hang_fails_within_a_minute_and_names_rank_and_instruction():
    started = time.monotonic()
    status, out, logs = run_world(workers.one_stage_absent, 2, 4, timeout=55, expect_failure=True)
    elapsed = time.monotonic() - started
    assert elapsed < 60
    assert status[0] == "exit 86", status
    log = open(logs[0]).read()
    assert "rank 0 (stage 0 of 2" in log and "in SA0 at tick 1" in log, log[-2000:]
    assert "waiting for stage 1" in log, log[-2000:]  # a send: it names the peer it waits for


def test_a_dead_stage_is_reported_by_its_neighbour_with_position():
    status, out, logs = run_world(workers.one_stage_dies, 2, timeout=55, expect_failure=True)
    assert status[1] == "exit 3"
    assert status[0] == "error", status
    assert "PACIStreamError: rank 0 (stage 0 of 2" in out[0] and "at tick" in out[0], out[0][-1500:]
