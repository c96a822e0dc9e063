"""A synchronous warm start (``"paci": {"sync_warmup_calls": K or "auto"}``, :mod:`ds_paci.core.engine.warm_start`).

The keys' parsing, defaults and refusals; the ``"auto"`` rule (:mod:`ds_paci.core.program.warm_end`) on its own; in
the replay, the first ``K`` calls are sync mode's to the bit and the rest differ from a run without the warm start,
and an ``"auto"`` warm start ends at the call the rule computes from sync mode's own losses and labels; on real
engines (P = 2, gloo): the first ``K`` calls run on stock's schedule (window ``M``, nothing left in flight), then the
configured window, and a checkpoint saved inside the warm start resumes exactly, ``"auto"`` included (its rule's
state travels with the checkpoint). The engine against the replay, bit for bit: ``tests/test_replay_engine.py``.
"""

import math

import pytest

import warmup_workers
from harness import run_world
from test_resume_matrix import assert_continues
from ds_paci.core.config import PACIConfig, PACIConfigError, check_config, parse_paci_section


def test_the_key_is_an_integer_of_at_least_zero_or_auto_and_refused_in_sync_mode():
    assert PACIConfig().sync_warmup_calls == 0
    assert parse_paci_section({"sync_warmup_calls": 40}).sync_warmup_calls == 40
    assert parse_paci_section({"sync_warmup_calls": "auto"}).sync_warmup_calls == "auto"
    for bad in (-1, True, 2.5, "40", None, "AUTO"):
        with pytest.raises(PACIConfigError, match=r'"paci.sync_warmup_calls" = .* is not allowed; use an integer >= 0'):
            parse_paci_section({"sync_warmup_calls": bad})
    sync = {"gradient_accumulation_steps": 4, "paci": {"drain_every_batch": True, "sync_warmup_calls": 5}}
    with pytest.raises(PACIConfigError, match="has no effect in sync mode"):
        check_config(sync)
    sync["paci"]["accumulation_window"] = 6  # drain_every_batch with a != M is PACI: the warm start applies
    assert check_config(sync).sync_warmup_calls == 5


def test_auto_warm_start_is_the_default_of_the_auto_window_only():
    assert parse_paci_section({"accumulation_window": "auto"}).sync_warmup_calls == "auto"
    assert parse_paci_section({"accumulation_window": "auto", "sync_warmup_calls": 0}).warm_start is False
    for section in ({}, {"accumulation_window": 3}, {"accumulation_window": "auto", "drain_every_batch": True}):
        assert parse_paci_section(section).sync_warmup_calls == 0, section
    sync = {"gradient_accumulation_steps": 4, "paci": {"drain_every_batch": True, "accumulation_window": "auto"}}
    assert check_config(sync).warm_start is False  # sync mode with the "auto" window: no warm start, no refusal
    from ds_paci.core.program.warm_end import DEFAULT_RATIO
    assert parse_paci_section({"sync_warmup_calls": "auto"}).sync_warmup_loss_ratio == DEFAULT_RATIO
    assert parse_paci_section({"sync_warmup_calls": "auto", "sync_warmup_loss_ratio": 1}).sync_warmup_loss_ratio == 1.0
    for bad in (0, -0.5, math.inf, math.nan, "0.9", True):
        with pytest.raises(PACIConfigError, match=r'"paci.sync_warmup_loss_ratio" = .* is not allowed; use a number > 0'):
            parse_paci_section({"sync_warmup_calls": "auto", "sync_warmup_loss_ratio": bad})
    for section in ({"sync_warmup_calls": 5, "sync_warmup_loss_ratio": 0.8}, {"sync_warmup_loss_ratio": 0.8}):
        with pytest.raises(PACIConfigError, match='applies only to "sync_warmup_calls": "auto"'):
            parse_paci_section(section)


def test_the_auto_rule_ends_once_the_mean_of_its_span_is_below_ratio_times_the_unigram_entropy():
    from ds_paci.core.program.warm_end import WarmEnd, unigram_entropy
    assert unigram_entropy([5, 5, 5, 5]) == pytest.approx(math.log(4))
    assert unigram_entropy([0, 7, 0]) == 0.0 and math.isnan(unigram_entropy([]))
    rule = WarmEnd(ratio=0.5, span=3)
    rule.observe_labels([10, 10])  # H1 = ln 2: ends below 0.5 ln 2 = 0.3466
    rule.observe_labels([0, 0, 0])  # a longer histogram with nothing new: the same entropy
    assert rule.entropy == pytest.approx(math.log(2))
    for loss in (0.1, 0.1):
        rule.observe_loss(loss)
        assert not rule.due()  # fewer than span calls
    rule.observe_loss(0.9)  # mean 0.3667 > 0.3466
    assert not rule.due()
    rule.observe_loss(0.2)  # mean of the last 3: 0.4
    assert not rule.due()
    rule.observe_loss(0.0)  # (0.9 + 0.2 + 0) / 3 = 0.3667
    assert not rule.due()
    rule.observe_loss(0.1)  # (0.2 + 0 + 0.1) / 3 = 0.1
    assert rule.due() and "0.1000 < 0.5 x" in rule.describe()
    copy = WarmEnd(ratio=0.5, span=3)
    copy.load_state_dict(rule.state_dict())
    assert copy.state_dict() == rule.state_dict() and copy.due()
    rule.observe_loss(math.nan)  # a non-finite loss never ends it
    assert not rule.due()
    with pytest.raises(ValueError):
        WarmEnd(ratio=0)


def test_label_histograms_take_integer_ids_and_leave_the_rest_out():
    import torch

    from ds_paci.core.engine.warm_start import label_histogram
    assert label_histogram(torch.tensor([[0, 2], [2, -100]])) == [1, 0, 2]  # an ignore_index is left out
    mask = torch.ones(2, 2)
    assert label_histogram((torch.tensor([[1, 1], [3, 1]]), mask)) == [0, 3, 0, 1]  # Megatron's (labels, loss_mask)
    assert label_histogram(torch.randn(2, 3)) is None and label_histogram(None) is None
    assert label_histogram(torch.tensor([True])) is None


def test_auto_is_per_stage_after_a_warm_start_where_m_is_below_p_minus_1():
    warm = PACIConfig(enabled=True, accumulation_window="auto", sync_warmup_calls=8)
    cold = PACIConfig(enabled=True, accumulation_window="auto", sync_warmup_calls=0)
    assert [PACIConfig(enabled=True, accumulation_window="auto").window(4, 8, s) for s in range(8)] == [7, 6, 5, 4, 4, 4,
                                                                                                      4, 4]  # default
    assert [warm.window(4, 8, s) for s in range(8)] == [7, 6, 5, 4, 4, 4, 4, 4]  # late stages step every M
    assert [cold.window(4, 8, s) for s in range(8)] == [7] * 8
    for P, M in ((4, 4), (8, 8), (8, 16), (16, 15)):  # M >= P - 1: the same one window either way
        assert {warm.window(M, P, s) for s in range(P)} == {cold.window(M, P, 0)}
    # drift stays <= 1 on every stage, slack links included
    from ds_paci.core.program.stream import drift_bound
    slack = PACIConfig(enabled=True, accumulation_window="auto", sync_warmup_calls=8, slack_links=(3,))
    assert all(drift_bound(8, s, slack.window(4, 8, s), (3,)) <= 1 for s in range(8))


def _replay(sync_calls, mode="lookahead", steps=6, ratio=0.9, record=None):
    import torch

    from ds_paci.tools.replay.replayer import Evaluation, load_tokens, replay
    from ds_paci.workload.data import MicroBatchIterator, eval_micro_batches
    from ds_paci.workload.gpt2 import gpt2_config, gpt2_reference_model
    torch.set_num_threads(1)
    train, val, _ = load_tokens("byte", main_split=False)
    cfg = gpt2_config("tiny", vocab_size=257, n_positions=16, n_embd=16, n_layer=4, n_head=2)
    model = gpt2_reference_model(cfg, seed=1)
    train_iter = MicroBatchIterator(train, 2, 16, seed=2)
    if record is not None:  # the labels each call draws (sync mode: exactly its M micro-batches)
        train_iter = _Recorded(train_iter, record)
    result = replay(model, 4, 2, train_iter, eval_micro_batches(val, 2, 16, count=2), steps, mode=mode,
                    window=None if mode == "sync" else "auto", lr=3e-3, evaluation=Evaluation(every=0),
                    sync_calls=sync_calls, warm_ratio=ratio)
    return result.call_losses, model.state_dict(), result.warm_calls


class _Recorded:
    def __init__(self, inner, labels):
        self.inner, self.labels = inner, labels

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.inner)
        self.labels.append(batch[1])
        return batch


def test_the_replay_runs_sync_mode_for_the_first_calls_then_the_streams():
    warm, warm_weights, _ = _replay(3)
    sync, _, _ = _replay(0, mode="sync")
    cold, cold_weights, _ = _replay(0)
    assert warm[:3] == sync[:3]  # stock's schedule, to the bit
    assert warm[:3] != cold[:3]  # (the look-ahead from the first call is another run: the check can fail)
    assert warm[3:] != sync[3:]  # then PACI: windows of P - 1 = 3 across calls
    assert any(not warm_weights[k].equal(cold_weights[k]) for k in warm_weights)
    all_sync, _, _ = _replay(6)
    assert all_sync == sync  # a warm start as long as the run is sync mode


def test_the_replay_ends_an_auto_warm_start_where_the_rule_does_on_sync_modes_own_losses_and_labels():
    from ds_paci.core.engine.warm_start import label_histogram
    from ds_paci.core.program.warm_end import WarmEnd
    ratio, steps = 1.65, 14  # ends after a few calls on this tiny model (5.5 nats at the start, H1 about 3.2)
    labels = []
    sync, _, _ = _replay(0, mode="sync", steps=steps, record=labels)
    rule, expected = WarmEnd(ratio), None
    for call, loss in enumerate(sync, start=1):
        for y in labels[2 * (call - 1):2 * call]:
            rule.observe_labels(label_histogram(y))
        rule.observe_loss(loss)
        if rule.due():
            expected = call
            break
    assert expected is not None and 8 <= expected < steps - 2, expected  # (the check can fail: it ends inside the run)
    auto, _, warm_calls = _replay("auto", steps=steps, ratio=ratio)
    assert warm_calls == expected
    assert auto[:expected] == sync[:expected] and auto[expected:] != sync[expected:]
    _, _, never = _replay("auto", steps=steps, ratio=0.5)  # a model this young never gets below half of H1
    assert never == steps


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


@pytest.mark.process
def test_engine_ends_an_auto_warm_start_on_the_rule_on_every_rank_and_resumes_its_state_exactly(tmp_path):
    import torch

    from ds_paci.core.engine.warm_start import label_histogram
    from ds_paci.core.program.warm_end import WarmEnd
    results = run_world(warmup_workers.auto_two_ranks, 2, str(tmp_path), timeout=300)
    last = next(r for r in results if r["ref"]["last"])
    losses = [float(c["loss"]) for c in last["first"] + last["ref"]["records"]]
    data = warmup_workers.ClassData()
    rule, expected = WarmEnd(warmup_workers.RATIO), None  # the rule on the last stage's own losses and labels
    for call, loss in enumerate(losses, start=1):
        for _, y in data.batches[2 * (call - 1):2 * call]:
            rule.observe_labels(label_histogram(y))
        rule.observe_loss(loss)
        if rule.due():
            expected = call
            break
    assert expected is not None and warmup_workers.AUTO_SAVE < expected < warmup_workers.AUTO_CALLS, expected
    for r in results:  # every stage switches after the same call, the one the rule names
        calls = r["first"] + r["ref"]["records"]
        assert [c["window"] for c in calls] == [2] * expected + [3] * (len(calls) - expected), (r["stage"], calls)
        assert all(c["in_flight"] == 0 for c in calls[:expected])
        # resumed from a save after call AUTO_SAVE: the rule's state came back (a fresh rule would end 8 calls later)
        assert_continues(r["resumed"], r["ref"], "resumed inside an \"auto\" warm start")
        # float labels (the MLP's regression) cannot be judged: the warm start ends after its first call
        assert [c["window"] for c in r["unjudged"]["records"]] == [2, 3, 3]
    assert torch.is_tensor(data.batches[0][1]) and not data.batches[0][1].is_floating_point()


def test_the_start_up_line_says_how_long_the_warm_start_lasts_and_how_to_turn_it_off():
    from ds_paci.core.engine.startup import warm_start_line
    auto = warm_start_line(parse_paci_section({"accumulation_window": "auto"}), stock=False)
    assert "until the mean loss of the last 8 calls is below 0.9 x the labels' unigram entropy" in auto
    assert '"sync_warmup_calls": 0 turns it off' in auto
    assert "for calls 1-40" in warm_start_line(parse_paci_section({"sync_warmup_calls": 40}), stock=False)
    assert "ignored: sync mode" in warm_start_line(parse_paci_section({"sync_warmup_calls": 40}), stock=True)


@pytest.mark.process
def test_data_parallel_replicas_end_an_auto_warm_start_after_the_same_call(tmp_path):
    results = run_world(warmup_workers.auto_two_replicas, 4, str(tmp_path), timeout=300)
    switches = {(r["dp"], i): [c["window"] for c in r["calls"]].index(3) for i, r in enumerate(results)}
    assert len(set(switches.values())) == 1, switches  # all four ranks: the same call
    assert 0 < next(iter(switches.values())) < warmup_workers.AUTO_CALLS, switches
