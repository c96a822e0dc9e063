"""Tied weights across stages: the lag rule over the streams, and real engines keeping the copies bit-identical."""

import itertools
import math

import pytest
import torch

import tied_workers
import workers
from harness import run_world
from spy import COLLECTIVES, POINT_TO_POINT, cross_stage_collectives
from ds_paci.core.program.stream import PACIStream
from ds_paci.core.program.tied_timing import minimal_tied_lag, tied_lag, tied_wait_violations
from ds_paci.core.health.watchdog import Watchdog
from mlp import layer_weights, run_streams_by_hand
from test_engine import max_weight_diff


# -- the lag rule, over the very streams the engine runs ----------------------------------------
def segments(P, a, n, count=1, drain=True):
    """Per stage, ``count`` segments of ``n`` micro-batches each (advance, then drain)."""
    streams = [PACIStream(P, s, a) for s in range(P)]
    out = [[] for _ in range(P)]
    for _ in range(count):
        for s, st in enumerate(streams):
            out[s].append(st.advance(2 * n) + (st.drain() if drain else []))
    return out


def owner_sets(P):
    pairs = [(i, j) for i in range(P) for j in range(i + 1, P)]
    return pairs + ([(0, P // 2, P - 1)] if P > 2 else [])


@pytest.mark.parametrize("P", [2, 3, 4, 5, 6])
def test_tied_lag_is_the_smallest_lag_the_streams_make_free(P):
    """For every owner set and window: no owner ever waits on an unposted window at lag L; at L - 1 one does."""
    for a in range(1, 7):
        for owners in owner_sets(P):
            L = tied_lag(P, owners, a)
            worst = 0
            n0 = (L + 2) * a + P  # long enough for steady state; n over a whole residue class mod a
            for n in range(n0, n0 + a + 1):
                segs = segments(P, a, n, count=2 if n == n0 else 1)
                assert not tied_wait_violations(segs, owners, L), (P, a, owners, n)
                worst = max(worst, minimal_tied_lag(segs, owners))
            assert worst == L, f"P={P} a={a} owners={owners}: formula {L}, streams need {worst}"


def test_tied_lag_examples_and_what_the_drain_adds():
    assert tied_lag(2, (0, 1), 4) == 1  # the default job: a = M = 4
    assert tied_lag(4, (0, 3), 4) == 1 and tied_lag(4, (0, 3), 3) == 2 and tied_lag(4, (0, 3), 1) == 4
    assert tied_lag(8, (0, 7), 8) == 1 and tied_lag(8, (0, 7), 7) == 2
    assert tied_lag(4, (2,), 1) == 0  # one owner: nothing to exchange
    # without a drain only the steady state matters: ceil((j - i + 1) / a); the drain needs P - i - 1 too
    undrained = segments(4, 1, 12, drain=False)
    assert minimal_tied_lag(undrained, (0, 1), last_segment_drained=False) == 2
    assert tied_lag(4, (0, 1), 1) == 3 == minimal_tied_lag(segments(4, 1, 13), (0, 1))
    # a lag that is too small is reported with who would wait for whom
    errors = tied_wait_violations(segments(2, 1, 8), (0, 1), 1)
    assert errors and "stage 1 at its step" in errors[0] and "stage 0's window" in errors[0]


def test_the_lag_rule_holds_when_windows_are_carried_across_drains():
    """Evaluation and checkpoints drain without closing the window; the exchange keeps its pending windows. Every
    step except a segment's last after its last backward (deferred by the engine) finds its due window posted."""
    tight = 0
    for P in (2, 3, 4, 5):
        for a, M, pattern in itertools.product(range(1, 7), range(1, 5), [(1, 2, 3), (2, 1), (3,)]):
            streams = [PACIStream(P, s, a, M) for s in range(P)]
            segs = [[] for _ in range(P)]
            for calls in pattern:
                for s, st in enumerate(streams):
                    segs[s].append([t for _ in range(calls) for t in st.advance(2 * M)] + st.drain(close_window=False))
            for owners in owner_sets(P):
                L = tied_lag(P, owners, a)
                assert not tied_wait_violations(segs, owners, L, carried=True), (P, a, M, pattern, owners)
                tight += bool(L and tied_wait_violations(segs, owners, L - 1, carried=True))
    assert tight > 500  # one window less fails in most arrangements: the check is not vacuous


def test_simulated_tied_waits_cost_nothing_at_lag_l_and_stall_or_deadlock_below():
    """The simulator runs the streams with the exchange under random cost models: at L no owner ever waits."""
    import random
    from ds_paci.tools.sim.simulate import CostModel, TiedExchange, paci_programs, simulate
    rng = random.Random(0)
    for P, a in [(2, 4), (4, 4), (4, 3), (4, 1), (8, 8)]:
        L = tied_lag(P, (0, P - 1), a)
        programs = paci_programs(P, a, a, 5)
        for _ in range(8):
            cost = CostModel(forward=[rng.uniform(0.2, 3.0) for _ in range(P)], latency=rng.uniform(0, 0.3),
                             step=rng.uniform(0, 1))
            result = simulate(programs, cost, tied=TiedExchange((0, P - 1), L))
            assert result.ok and result.tied_wait == [0.0] * P, (P, a, result.tied_wait)
            assert result.tied_drain_wait[P - 1] > 0  # after the drain the last stage waits for stage 0's last post
        # one window less: the last stage waits for stage 0 (here: deadlocks against the pipeline, or stalls)
        below = simulate(programs, CostModel(forward=[3.0] + [1.0] * (P - 1)), tied=TiedExchange((0, P - 1), L - 1))
        if L == 1:
            # the program now carries the wait as an explicit apply (TAPPLY) right before the step
            assert below.deadlock and any(st.stage == P - 1 and st.text.startswith("TAPPLY") and st.partner == 0
                                          for st in below.deadlock.stuck), below.deadlock
        else:
            assert below.ok and below.tied_wait[P - 1] > 0


def test_the_watchdog_names_what_an_instruction_waits_for():
    from ds_paci.core.program.actions import Action, Kind, format_action
    dog = Watchdog(0, lambda: "rank 1 (stage 1 of 2)", lambda a: format_action(a, facts=False))
    dog.enter(Action(1, Kind.STEP, version=3), 17)
    dog.note("waiting for the tied gradients of weight version 2 (keys ['embed']) from rank 0 (stage 0)")
    text = dog.message(301)
    assert "in STEP3 at tick 17" in text and "tied gradients of weight version 2" in text and "rank 0 (stage 0)" in text
    dog.done()
    dog.enter(Action(1, Kind.STEP, version=4), 19)
    assert "tied" not in dog.message(1)


# -- real engines -----------------------------------------------------------------------------
def assert_identical(a, b, what):
    assert a.keys() == b.keys() and a, what
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs by {(a[k] - b[k]).abs().max().item()}"


def owners_by_replica(results, mode):
    """{dp coordinate: [tied state of each owning stage]} for ranks that own tied copies."""
    out = {}
    for r in results:
        if r[mode]["tied"]:
            out.setdefault(r[mode]["dp"], []).append(r[mode]["tied"])
    return out


def check_spy(results, mode):
    """No collective spans two stages; every cross-stage p2p that is neither the pipeline's own nor the loss side
    channel's goes to the tied group."""
    for r in results:
        m = r[mode]
        stage_of = m["stage_of_rank"]
        crossing = cross_stage_collectives(m["calls"], stage_of)
        assert not crossing, f"stage {m['stage']}: {crossing[:5]}"
        side = [c for c in m["calls"] if c.op in ("isend", "irecv")]
        loss_channel = [c for c in side if c.group == m["loss_channel_group"]]
        assert all(stage_of[c.peer] == len(set(stage_of.values())) - 1 or m["stage"] == len(set(stage_of.values())) - 1
                   for c in loss_channel), "loss side channel traffic not between the last stage and another"
        tied = [c for c in side if c.group != m["loss_channel_group"]]
        pipe = [c for c in m["calls"] if c.op in ("send", "recv")]
        assert all(c.default_group for c in pipe)
        assert {stage_of[c.peer] for c in pipe} <= {m["stage"] - 1, m["stage"] + 1}
        if m["tied"]:
            assert tied, "an owner exchanged no tied gradients"
            assert all(not c.default_group and len({stage_of[x] for x in c.ranks}) == len(c.ranks) for c in tied)
            assert {stage_of[c.peer] for c in tied} == set(m["stats"]["tied"]["owner_stages"]["embed"]) - {m["stage"]}
        else:
            assert not tied
        assert all(c.op in POINT_TO_POINT or c.op in COLLECTIVES for c in m["calls"])


@pytest.mark.process
@pytest.mark.parametrize("stages,gas,window,client", [(2, 2, None, False), (4, 2, None, True)],
                         ids=["P2-a2-L1-configured-AdamW", "P4-a2-L2-torch.optim"])
def test_async_tied_copies_stay_bit_identical(stages, gas, window, client):
    """20 async calls, tied embedding on the first and last stage: identical copies, loss falls, no global sync."""
    results = run_world(workers.tied_training, stages, stages, 20, gas, window, False, 0, client, timeout=420)
    a = window or gas
    L = tied_lag(stages, (0, stages - 1), a)
    assert L == stages // 2  # ceil(P / a)
    first, last = results[0]["async"], results[-1]["async"]
    # the copies are identical after every local step (weights and optimizer state), during training and after
    steps = 20 * gas // a
    assert sorted(first["digests"]) == sorted(last["digests"]) == list(range(1, steps + 1))
    assert first["digests"] == last["digests"]
    assert_identical(first["tied"], last["tied"], "after the drain")
    assert {"embed.0.exp_avg", "embed.0.exp_avg_sq"} <= set(first["tied"])
    assert not torch.equal(first["tied"]["embed.0.weight"], workers_init_embedding(stages)), "the embedding trained"
    losses = [x for x in last["losses"] if x is not None]
    assert len(losses) == 20 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses
    for r in results:
        st = r["async"]["stats"]["tied"]
        assert st["lag_windows"] == L and st["owner"] == bool(r["async"]["tied"])
        before = r["async"]["stats_before_drain"]["tied"]
        if st["owner"]:
            v = r["async"]["stats_before_drain"]["version"]
            assert before["pending_windows"] == list(range(v - L + 1, v + 1))  # the last L windows in flight
            assert st["pending_windows"] == [] and st["windows_exchanged"] == steps and st["copy_checks"] == 1
    check_spy(results, "async")


def workers_init_embedding(stages):
    from ds_paci.workload.gpt2 import TokenEmbedding, gpt2_config, layer_seeds
    cfg = gpt2_config("tiny", vocab_size=257, n_positions=workers.SEQ, n_embd=32, n_layer=4, n_head=2)
    return TokenEmbedding(cfg, init_seed=layer_seeds(cfg, 11)["embedding"]).wte.weight.detach().float()


@pytest.mark.process
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_tied_sync_mode_equals_stock_and_async_keeps_copies(bf16):
    results = run_world(workers.tied_training, 2, 2, 4, 4, None, bf16, 0, False, ("stock", "sync", "async"),
                        timeout=300)
    last = results[-1]
    stock, sync = last["stock"]["losses"], last["sync"]["losses"]
    assert max(abs(x - y) for x, y in zip(stock, sync)) <= 1e-6, (stock, sync)
    for r in results:
        assert max_weight_diff(r["stock"]["weights"], r["sync"]["weights"]) <= 1e-6
        # stock keeps its copies equal with an all-reduce; so does sync mode, bit for bit
        assert r["stock"]["tied"]["embed.weight"].equal(r["sync"]["weights"]["tied_modules.embed.wte.weight"])
    assert last["sync"]["optimizer"] == ("BF16_Optimizer" if bf16 else "AdamW")
    for mode in ("sync", "async"):
        assert_identical(results[0][mode]["tied"], results[1][mode]["tied"], mode)
    assert "embed.0.master" in results[0]["async"]["tied"] if bf16 else "embed.0.exp_avg" in results[0]["async"]["tied"]
    check_spy(results, "async")


@pytest.mark.process
def test_tied_with_zero1_and_data_parallel_replicas():
    """PP = 2 x DP = 2, ZeRO-1: sync equals stock; async copies identical across stages and replicas."""
    results = run_world(workers.tied_training, 4, 2, 4, 2, None, False, 1, False, ("stock", "sync", "async"),
                        timeout=420)
    assert {r["async"]["optimizer"] for r in results} == {"DeepSpeedZeroOptimizer"}
    assert {r["async"]["stats"]["tied"]["gradient_path"] for r in results} == {"zero"}
    for r in results:
        assert max_weight_diff(r["stock"]["weights"], r["sync"]["weights"]) <= 1e-6
    for mode in ("sync", "async"):
        replicas = owners_by_replica(results, mode)
        assert sorted(replicas) == [0, 1] and all(len(v) == 2 for v in replicas.values())
        states = [s for v in replicas.values() for s in v]
        for s in states[1:]:
            assert_identical(states[0], s, mode)
        assert {"embed.0.master", "embed.0.exp_avg", "embed.0.exp_avg_sq"} <= set(states[0])
    losses = [x for x in results[-1]["async"]["losses"] if x is not None]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    check_spy(results, "async")


@pytest.mark.process
def test_checkpoint_in_async_training_with_tied_layers_resumes_exactly(tmp_path):
    paci = {"enabled": True}
    part = run_world(workers.train_eval_save, 2, 2, paci, 4, 3, str(tmp_path / "ckpt"), 4, True, timeout=240)
    resumed = run_world(workers.resume, 2, 2, paci, 3, str(tmp_path / "ckpt"), 4, True, timeout=240)
    # the run that saved and went on, and the fresh world that loaded the checkpoint, train identically
    assert part[-1]["losses_after"] == resumed[-1]["losses"]
    for a, b in zip(part, resumed):
        assert max_weight_diff(a["weights"], b["weights"]) == 0.0
    for res in (part, resumed):
        assert torch.equal(res[0]["weights"]["tied_modules.embed.wte.weight"],
                           res[1]["weights"]["tied_modules.embed.wte.weight"])
        assert res[0]["tied_checks"] >= 1 and res[1]["tied_checks"] >= 1
    assert resumed[0]["version"] == part[0]["version_at_save"] + 3


@pytest.mark.process
def test_a_hang_in_the_tied_exchange_is_named_by_the_watchdog():
    status, out, logs = run_world(workers.tied_peer_never_posts, 2, 5, timeout=90, expect_failure=True)
    assert status[1] == "exit 86", status
    log = open(logs[1]).read()
    assert "rank 1 (stage 1 of 2" in log and "in STEP2" in log, log[-2000:]
    assert "waiting for the tied gradients of weight version 1 (keys ['embed']) from rank 0 (stage 0)" in log


# -- the tied update against a hand-written reference ---------------------------------------------
def reference_tied_mlp(P, layers, gas, window, calls, lr, lag, seed=7, clip=0.0):
    """PACI on the tanh MLP with layer 0's weight tied to the last layer's, written out by hand (SGD).

    Like ``test_engine.reference_paci_mlp``; in addition the first and last stage each hold a copy
    of the tied weight (and their own bias). At an owner's step producing version ``v`` its own
    window gradient of the tied weight is posted, and the copy moves by the sum of both owners'
    window ``v - lag``; the last step of the segment applies every window not yet applied.
    ``clip`` > 0: each stage's own gradient (without the tied weight) is scaled by
    ``min(1, clip / (norm + 1e-6))`` of its norm, each window's tied total likewise by its own norm.
    """

    def clipped(tensors):
        norm = torch.sqrt(sum((t * t).sum() for t in tensors)).item()
        coef = clip / (norm + 1e-6) if clip > 0 else 1.0
        return [t * coef for t in tensors] if coef < 1.0 else tensors

    W = [[t.double().clone() for t in layer_weights(0 if i in (0, layers - 1) else i, seed)] for i in range(layers)]
    gW = [[torch.zeros_like(w), torch.zeros_like(b)] for w, b in W]
    tied_of = {0: 0, P - 1: layers - 1}  # owner stage -> its layer holding the tied copy
    final = PACIStream(P, 0, window)
    for _ in range(calls):
        final.advance(2 * gas)
    final.drain()
    final = final.version
    posted, applied, deferred = {}, set(), []

    def post(s, version):
        if s in tied_of:
            posted[(s, version)] = gW[tied_of[s]][0].clone()

    def step(s, version, mine):
        own = [g for i in mine for n, g in enumerate(gW[i]) if not (s in tied_of and i == tied_of[s] and n == 0)]
        for g, c in zip(own, clipped(own)):
            g.copy_(c)
        if s in tied_of:
            i = tied_of[s]
            due = [v for v in range(1, version + 1) if v not in applied] if version == final else (
                [version - lag] if version - lag >= 1 else [])
            total = torch.zeros_like(gW[i][0])
            for v in due:
                total += clipped([posted[(0, v)] + posted[(P - 1, v)]])[0]
            gW[i][0] = total
        for i in mine:
            W[i][0] -= lr * gW[i][0]
            W[i][1] -= lr * gW[i][1]
            gW[i][0] = torch.zeros_like(gW[i][0])
            gW[i][1].zero_()

    def local_step(s, ins, mine):
        if ins.version == final and s in tied_of:
            deferred.append((s, ins.version, mine))  # runs after the drain, as in the engine
        else:
            post(s, ins.version)
            step(s, ins.version, mine)
            if s == P - 1 and ins.version - lag >= 1:
                applied.add(ins.version - lag)

    run_streams_by_hand(P, layers, gas, window, calls, W, gW, workers.MICRO, local_step)
    for s, version, _ in deferred:  # every owner posts, then applies
        post(s, version)
    for s, version, mine in deferred:
        step(s, version, mine)
    return W


@pytest.mark.process
@pytest.mark.parametrize("stages,window", [(2, 2), (2, 1), (3, 1)], ids=["P2-a2-L1", "P2-a1-L2", "P3-a1-L3"])
def test_tied_update_equals_a_hand_written_reference(stages, window):
    layers, gas, calls, lr = 2 * stages, 2, 5, 0.2
    lag = tied_lag(stages, (0, stages - 1), window)
    results = run_world(workers.mlp_training, stages, stages, layers, gas, window, calls, lr, False, "sgd", True,
                        timeout=180)
    W = reference_tied_mlp(stages, layers, gas, window, calls, lr, lag)
    W_other = reference_tied_mlp(stages, layers, gas, window, calls, lr, lag + 1)
    diff = diff_other = 0.0
    for s, r in enumerate(results):
        assert r["stats"]["tied"]["lag_windows"] == lag
        start, stop = r["layers"]
        for i in range(start, stop):
            prefix = "tied_modules.w" if i in (0, layers - 1) else str(i)
            w = r["weights"][f"{prefix}.linear.weight"].double()
            b = r["weights"][f"{prefix}.linear.bias"].double()
            diff = max(diff, (w - W[i][0]).abs().max().item(), (b - W[i][1]).abs().max().item())
            diff_other = max(diff_other, (w - W_other[i][0]).abs().max().item())
    assert diff < 2e-6, diff
    assert diff_other > 100 * max(diff, 1e-7), "another lag must give different weights: the test would be vacuous"
    assert torch.equal(results[0]["weights"]["tied_modules.w.linear.weight"],
                       results[-1]["weights"]["tied_modules.w.linear.weight"])


@pytest.mark.process
@pytest.mark.parametrize("stages,window", [(2, 1)], ids=["P2-a1-L2"])
def test_tied_clipping_equals_a_hand_written_reference(stages, window):
    """Async clipping with tied layers (issue 16): each stage clips its own gradient by its own norm, each window's
    tied total is clipped by its own norm on every owner alike; the copies stay bit-identical and really clip."""
    layers, gas, calls, lr, clip = 2 * stages, 2, 5, 0.2, 0.02
    lag = tied_lag(stages, (0, stages - 1), window)
    results = run_world(tied_workers.tied_mlp_clipping, stages, stages, layers, gas, window, calls, lr, clip,
                        timeout=180)
    W = reference_tied_mlp(stages, layers, gas, window, calls, lr, lag, clip=clip)
    W_unclipped = reference_tied_mlp(stages, layers, gas, window, calls, lr, lag)
    diff = diff_unclipped = 0.0
    for r in results:
        start, stop = r["layers"]
        for i in range(start, stop):
            prefix = "tied_modules.w" if i in (0, layers - 1) else str(i)
            for n, name in enumerate(("weight", "bias")):
                got = r["weights"][f"{prefix}.linear.{name}"].double()
                diff = max(diff, (got - W[i][n]).abs().max().item())
                diff_unclipped = max(diff_unclipped, (got - W_unclipped[i][n]).abs().max().item())
    assert diff < 2e-6, diff
    assert diff_unclipped > 100 * max(diff, 1e-7), "the clip never acted: the test would be vacuous"
    for r in (results[0], results[-1]):
        assert r["stats"]["tied"]["clipped_windows"] == r["stats"]["tied"]["windows_exchanged"] > 0
    assert torch.equal(results[0]["weights"]["tied_modules.w.linear.weight"],
                       results[-1]["weights"]["tied_modules.w.linear.weight"])
