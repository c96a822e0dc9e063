"""Tied weights at scale (issue 16): through non-finite windows, with clipping, with bounded and NCCL-safe transfers."""

import math

import pytest
import torch

import nccl_model
import tied_workers
from ds_paci.core.tied.weights import posting_order
from harness import run_world
from spy import cross_stage_collectives


def assert_identical(a, b, what):
    assert a.keys() == b.keys() and a, what
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs by {(a[k] - b[k]).abs().max().item()}"


def check_run(ranks, steps, lag, owners):
    """Every owner: the same digest after every local step, the same final state; every rank: finite weights,
    trained to the end, no collective across stages; the NaN window skipped as it should be."""
    owned = [r for r in ranks if r["owner"]]
    assert len(owned) == owners
    for r in owned:
        assert sorted(r["digests"]) == list(range(1, steps + 1))
        assert r["digests"] == owned[0]["digests"], "the tied copies diverged during training"
        assert_identical(r["tied"], owned[0]["tied"], "after the drain")
    for r in ranks:
        assert r["finite"], f"stage {r['stage']}: a non-finite gradient was applied"
        assert not cross_stage_collectives(r["calls"], r["stage_of_rank"])
        st = r["stats"]
        assert st["local_steps"] == steps and r["global_steps"] == steps
        # the stage's own NaN window; an owner also skips the tied total of that window, L local steps (calls) later
        skipped = [k for k, rec in enumerate(r["records"]) if not rec["applied"]]
        assert st["skipped_steps"] == len(skipped) == (2 if r["owner"] else 1), (r["stage"], st, skipped)
        if r["owner"]:
            assert skipped[1] - skipped[0] == lag, skipped
        if r["owner"]:
            tied = st["tied"]
            assert tied["skipped_windows"] == 1 and tied["fault_steps"] == 1, tied
            assert tied["windows_exchanged"] == steps
    for k in range(len(ranks[0]["records"])):  # every stage keeps the same learning rate through the skips
        assert len({r["records"][k]["lr"] for r in ranks}) == 1
    assert math.isfinite(ranks[-1]["records"][-1]["loss"])


@pytest.mark.process
def test_one_nan_micro_batch_keeps_tied_copies_identical_on_every_optimizer_path(tmp_path):
    """2 stages, tied first/last layer, clipping on, micro-batch 5 NaN (window 3 of a = 2, L = 1): every owner
    skips its own window-3 gradient at step 3 and the window-3 tied total at step 4, copies stay bit-identical
    (weights, Adam moments and step counters), and a checkpoint taken after it resumes with identical copies."""
    cases = ["torch.optim", "configured-AdamW", "bf16", "zero1"]
    stages, gas, calls, bad, clip = 2, 2, 6, 5, 0.05
    results = run_world(tied_workers.tied_mlp_nonfinite, stages, stages, gas, calls, bad, cases, clip,
                        str(tmp_path / "ckpt"), timeout=420)
    for case in cases:
        ranks = [r[case] for r in results]
        check_run(ranks, steps=calls, lag=1, owners=2)
        for r in ranks:
            assert r["stats"]["tied"]["clipped_windows"] > 0, (case, r["stats"]["tied"])  # the clip is live
        if case in ("torch.optim", "configured-AdamW"):
            assert "w.0.step" in ranks[0]["tied"]  # torch's per-parameter step counter is part of the check
        expected = {"bf16": "BF16_Optimizer", "zero1": "DeepSpeedZeroOptimizer"}.get(case, "AdamW")
        assert ranks[0]["optimizer"] == expected
    resumed = [r["zero1"]["resumed"] for r in results]
    assert_identical(resumed[0]["tied"], resumed[1]["tied"], "after resuming")
    assert all(r["checks"] >= 2 for r in resumed) and all(math.isfinite(x) for x in resumed[1]["losses"])


@pytest.mark.process
def test_four_stage_tied_gpt_trains_on_through_a_nan_with_clipping():
    """Tiny GPT on 4 stages, embedding and LM head tied (L = 2 at a = 2), DeepSpeed's AdamW, clipping 0.5."""
    stages, gas, window, calls, bad = 4, 2, 2, 8, 5
    results = run_world(tied_workers.tied_gpt_nonfinite, stages, stages, gas, window, calls, bad, 0.5, timeout=420)
    check_run(results, steps=calls, lag=2, owners=2)
    owner = results[0]
    assert owner["stats"]["tied"]["lag_windows"] == 2 and owner["stats"]["tied"]["clipped_windows"] > 0
    assert {"embed.0.exp_avg", "embed.0.exp_avg_sq", "embed.0.step"} <= set(owner["tied"])


@pytest.mark.process
def test_a_nan_on_one_data_parallel_replica_is_skipped_by_every_replica_and_owner():
    """PP = 2 x DP = 2 under ZeRO-1: the NaN reaches replica 0 only; the finite flag is combined over the replicas
    before the exchange, so all four copies (two stages x two replicas) take the same decisions."""
    results = run_world(tied_workers.tied_dp_nonfinite, 4, 2, 5, 5, 0.05, timeout=300)
    assert sorted((r["stage"], r["dp"]) for r in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    check_run(results, steps=5, lag=1, owners=4)


@pytest.mark.process
def test_pending_tied_sends_stay_bounded_over_50_local_steps_without_a_drain():
    """a = 1 on 2 stages (L = 2), 25 calls of M = 2: 50 local steps, no drain. Each rank holds at most L + 1 tied
    messages alive (before issue 16 every send stayed pending until the drain: one more per step). The order of
    the transfers, as recorded, cannot deadlock under NCCL's semantics."""
    results = run_world(tied_workers.tied_sends_without_drain, 2, 2, 2, 1, 25, timeout=240)
    for r in results:
        lag = r["lag"]
        assert lag == 2 and r["version"] == 50
        assert max(r["alive"]) <= lag + 1 and r["alive"][-1] == r["alive"][10], r["alive"]
        assert r["alive_after_drain"] == 0
    programs = {r["rank"]: [(op[1:], peer, i) for i, (op, peer) in enumerate(r["order"])] for r in results}
    assert all(len(p) >= 2 * 50 for p in programs.values())
    for streams in ("pair", "group"):
        assert nccl_model.run(programs, streams) is None


@pytest.mark.parametrize("ranks", [(0, 1), (0, 2, 5), (1, 3, 4, 7)], ids=["2-owners", "3-owners", "4-owners"])
def test_the_exchange_order_cannot_deadlock_under_nccl(ranks):
    """NCCL's model (tests/nccl_model.py): ordered by rank, every exchange completes with one stream per pair or per
    group, for every lag; the former receive-then-send order deadlocks at the first window."""
    for lag in (1, 2, 3):
        for streams in ("pair", "group"):
            ours = nccl_model.exchange_programs(ranks, windows=6, lag=lag, order=posting_order)
            assert nccl_model.run(ours, streams) is None, (lag, streams, nccl_model.run(ours, streams))
            old = nccl_model.exchange_programs(ranks, windows=6, lag=lag, order=nccl_model.recv_first)
            stuck = nccl_model.run(old, streams)
            assert stuck and "recv" in stuck, (lag, streams)
    assert posting_order(3, [7, 1]) == [("recv", 1), ("send", 1), ("send", 7), ("recv", 7)]
