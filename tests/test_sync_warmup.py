"""A synchronous warm start (``"paci": {"sync_warmup_calls": K}``, :mod:`ds_paci.core.engine.warm_start`).

The key's parsing and refusals; in the replay, the first ``K`` calls are sync mode's to the bit and the rest differ
from a run without the warm start; on real engines (P = 2, gloo): the first ``K`` calls run on stock's schedule
(window ``M``, nothing left in flight), then the configured window, and a checkpoint saved inside the warm start
resumes exactly. The engine against the replay, bit for bit: ``tests/test_replay_engine.py``.
"""

import pytest

import warmup_workers
from harness import run_world
from test_resume_matrix import assert_continues
from ds_paci.core.config import PACIConfig, PACIConfigError, check_config, parse_paci_section


def test_the_key_is_an_integer_of_at_least_zero_and_refused_in_sync_mode():
    assert PACIConfig().sync_warmup_calls == 0
    assert parse_paci_section({"sync_warmup_calls": 40}).sync_warmup_calls == 40
    for bad in (-1, True, 2.5, "40", None):
        with pytest.raises(PACIConfigError, match=r'"paci.sync_warmup_calls" = .* is not allowed; use an integer >= 0'):
            parse_paci_section({"sync_warmup_calls": bad})
    sync = {"gradient_accumulation_steps": 4, "paci": {"drain_every_batch": True, "sync_warmup_calls": 5}}
    with pytest.raises(PACIConfigError, match="has no effect in sync mode"):
        check_config(sync)
    sync["paci"]["accumulation_window"] = 6  # drain_every_batch with a != M is PACI: the warm start applies
    assert check_config(sync).sync_warmup_calls == 5


def test_auto_is_per_stage_after_a_warm_start_where_m_is_below_p_minus_1():
    warm = PACIConfig(enabled=True, accumulation_window="auto", sync_warmup_calls=8)
    cold = PACIConfig(enabled=True, accumulation_window="auto")
    assert [warm.window(4, 8, s) for s in range(8)] == [7, 6, 5, 4, 4, 4, 4, 4]  # late stages step every M
    assert [cold.window(4, 8, s) for s in range(8)] == [7] * 8
    for P, M in ((4, 4), (8, 8), (8, 16), (16, 15)):  # M >= P - 1: the same one window either way
        assert {warm.window(M, P, s) for s in range(P)} == {cold.window(M, P, 0)}
    # drift stays <= 1 on every stage, slack links included
    from ds_paci.core.program.stream import drift_bound
    slack = PACIConfig(enabled=True, accumulation_window="auto", sync_warmup_calls=8, slack_links=(3,))
    assert all(drift_bound(8, s, slack.window(4, 8, s), (3,)) <= 1 for s in range(8))


def _replay(sync_calls, mode="lookahead", steps=6):
    import torch

    from ds_paci.tools.replay.replayer import Evaluation, load_tokens, replay
    from ds_paci.workload.data import MicroBatchIterator, eval_micro_batches
    from ds_paci.workload.gpt2 import gpt2_config, gpt2_reference_model
    torch.set_num_threads(1)
    train, val, _ = load_tokens("byte", main_split=False)
    cfg = gpt2_config("tiny", vocab_size=257, n_positions=16, n_embd=16, n_layer=4, n_head=2)
    model = gpt2_reference_model(cfg, seed=1)
    result = replay(model, 4, 2, MicroBatchIterator(train, 2, 16, seed=2), eval_micro_batches(val, 2, 16, count=2),
                    steps, mode=mode, window=None if mode == "sync" else "auto", lr=3e-3, evaluation=Evaluation(every=0), sync_calls=sync_calls)
    return result.call_losses, model.state_dict()


def test_the_replay_runs_sync_mode_for_the_first_calls_then_the_streams():
    warm, warm_weights = _replay(3)
    sync, _ = _replay(0, mode="sync")
    cold, cold_weights = _replay(0)
    assert warm[:3] == sync[:3]  # stock's schedule, to the bit
    assert warm[:3] != cold[:3]  # (the look-ahead from the first call is another run: the check can fail)
    assert warm[3:] != sync[3:]  # then PACI: windows of P - 1 = 3 across calls
    assert any(not warm_weights[k].equal(cold_weights[k]) for k in warm_weights)
    all_sync, _ = _replay(6)
    assert all_sync == sync  # a warm start as long as the run is sync mode


@pytest.mark.process
def test_engine_runs_stock_schedule_first_and_resumes_inside_the_warm_start_exactly(tmp_path):
    results = run_world(warmup_workers.two_ranks, 2, str(tmp_path), timeout=300)
    for r in results:
        first, ref, resumed = r["first"], r["ref"], r["resumed"]
        calls = first + ref["records"]
        warm = warmup_workers.WARM
        # the warm start: window M, nothing in flight after a call, one local step per call on every stage
        assert [c["window"] for c in calls] == [2] * warm + [3] * (len(calls) - warm), calls
        assert all(c["in_flight"] == 0 and c["window_fill"] == 0 for c in calls[:warm]), calls
        assert [c["version"] for c in calls[:warm]] == [1, 2, 3], calls
        assert any(c["in_flight"] for c in calls[warm:]), "after the warm start the stream runs continuously"
        # resumed inside the warm start: the same calls, counters and weights as the uninterrupted run
        assert_continues(resumed, ref, "resumed inside the warm start")
        # and without the warm start the run is another one
        assert any(not r["cold"]["weights"][k].equal(ref["weights"][k]) for k in ref["weights"])
