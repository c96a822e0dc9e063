"""The data-parallel reduce overlapped with the window's last backward (issue 27 item 2).

Pure checks of the program pass and the bucket plan, then real engines over gloo (P = 2 x DP = 2, with and without
tied weights): the overlapped engine's losses and weights equal the engine that reduces at the step, bit for bit
(two replicas: each element's sum is one addition, see ds_paci.core.step.overlap), replicas stay identical, and
a drain in the middle of a window (left open) and a closing drain (a partial window) still reduce correctly.
"""

import pytest
import torch

import overlap_workers
from harness import run_world
from ds_paci.core.config import PACIConfigError, parse_paci_section
from ds_paci.core.program.actions import Kind, format_stage, parse_stage
from ds_paci.core.program.passes import lower_call, mark_reduce_backward
from ds_paci.core.program.stream import PACIStream
from ds_paci.core.step.overlap import plan_buckets


def _marked_before_each_step(ticks):
    """For each STEP: the micro-batch of the backward it follows and whether that backward is marked."""
    out, last = [], None
    for tick in ticks:
        for a in tick:
            if a.kind is Kind.BACKWARD:
                last = a
            elif a.kind is Kind.STEP:
                out.append(None if last is None else (last.micro_batch, last.reduce_overlap))
                last = None
    return out


@pytest.mark.parametrize("P,M,window", [(2, 4, 4), (3, 4, 2), (4, 8, 3), (4, 2, 5)])
def test_the_window_last_backward_is_marked_before_every_step(P, M, window):
    for s in range(P):
        stream = PACIStream(P, s, window, M)
        calls = [lower_call(stream.advance(2 * M), overlap_reduce=True) for _ in range(3)]
        calls.append(lower_call([], stream.drain(False), carry=True, overlap_reduce=True))  # eval/save: window open
        calls.append(lower_call(stream.advance(2 * M), stream.drain(True), overlap_reduce=True))  # closing drain
        for ticks in calls:
            marked = [a for t in ticks for a in t if a.kind is Kind.BACKWARD and a.reduce_overlap]
            steps = _marked_before_each_step(ticks)
            assert all(x is not None and x[1] for x in steps), (s, format_stage(ticks))
            assert len(marked) == len(steps)
            assert parse_stage(format_stage(ticks), s) == ticks
        plain = lower_call(PACIStream(P, s, window, M).advance(2 * M))
        assert not any(a.reduce_overlap for t in plain for a in t)


def test_the_mark_reads_and_prints_as_dp():
    ticks = parse_stage("RG0,B0,ACC0 | RG1,B1,ACC1,STEP1 | B2 | STEP2 | STEP3", 1)
    marked = mark_reduce_backward(ticks)
    assert format_stage(marked) == "RG0,B0,ACC0 | RG1,B1[dp],ACC1,STEP1 | B2[dp] | STEP2 | STEP3"
    assert parse_stage(format_stage(marked), 1) == marked
    with pytest.raises(ValueError):
        parse_stage("F0[dp]", 0)


def test_buckets_cover_every_parameter_once_in_reverse_order_one_dtype_each():
    params = [torch.zeros(10), torch.zeros(3, 3), torch.zeros(4, dtype=torch.bfloat16), torch.zeros(5), torch.zeros(2)]
    buckets = plan_buckets(params, 8)
    assert sorted(i for b in buckets for i in b) == list(range(5))
    assert [i for b in buckets for i in b] == [4, 3, 2, 1, 0]
    assert all(len({params[i].dtype for i in b}) == 1 for b in buckets)
    assert buckets == [[4, 3], [2], [1], [0]]
    assert plan_buckets(params[:2], 10**9) == [[1, 0]]


def test_config_keys():
    assert parse_paci_section({}).overlap_reduce is True
    assert parse_paci_section({"overlap_reduce": False}).overlap_reduce is False
    assert parse_paci_section({"overlap_bucket_elements": 7}).overlap_bucket_elements == 7
    for bad in ({"overlap_reduce": 1}, {"overlap_bucket_elements": 0}, {"overlap_bucket_elements": True}):
        with pytest.raises(PACIConfigError, match="overlap_"):
            parse_paci_section(bad)


def _check_equal_runs(results, expect_overlap=True):
    for r in results:
        step, over = r["step"], r["overlap"]
        assert step["buckets"] is None and step["launched_in_backward"] is None
        if expect_overlap:
            assert over["buckets"] >= 2, "small buckets: several per stage"
            assert over["launched_in_backward"] > 0, "buckets must start inside the marked backward"
            assert over["reduces"] == over["version"]
        assert step["fill_at_drain"] > 0, "the drain must fall inside a window"
        assert step["fill_at_close"] == 0 == over["fill_at_close"]
        # the last stage's own losses (other stages report the side channel's latest value, which depends on timing)
        assert step["stage"] != 1 or torch.equal(torch.tensor(over["losses"]).nan_to_num(-1.0), torch.tensor(step["losses"]).nan_to_num(-1.0)), \
            f"rank at stage {step['stage']} dp {step['dp']}: {over['losses']} != {step['losses']}"
        for k in step["weights"]:
            assert torch.equal(over["weights"][k], step["weights"][k]), k
        assert over["version"] == step["version"]
    by_stage = {}
    for r in results:
        by_stage.setdefault(r["overlap"]["stage"], []).append(r["overlap"]["weights"])
    for stage, replicas in by_stage.items():
        assert len(replicas) == 2
        for k in replicas[0]:
            assert torch.equal(replicas[0][k], replicas[1][k]), (stage, k)


@pytest.mark.process
@pytest.mark.xdist_group("overlap")
@pytest.mark.parametrize("tied,client,bad", [(False, "torch.optim", None), (True, "deepspeed", None),
                                             (False, "deepspeed", 3)])
def test_overlapped_reduce_equals_the_reduce_at_the_step(tied, client, bad):
    """P = 2 x DP = 2, window 3 over M = 2 (windows span calls), clipping on: bit-identical losses and weights.

    4 calls (8 micro-batches), a drain leaving 8 mod 3 = 2 in the open window, 3 calls, a closing drain stepping a
    partial window of 14 mod 3 = 2. ``bad``: a NaN in replica 0's micro-batch 3 (the second window): the guard
    skips that window on every replica and stage of both runs."""
    results = run_world(overlap_workers.overlap_vs_step, 4, 2, 4, tied, 2, 3, client, 0.5, 40, 4, 3, bad,
                        timeout=300)
    _check_equal_runs(results)
    skipped = {(r["overlap"]["stage"], r["overlap"]["skipped"], r["step"]["skipped"]) for r in results}
    if bad is None:
        assert {s for _, s, _ in skipped} == {0}
    else:  # the last stage's poisoned window; stage 0 receives the NaN gradient and skips too
        assert all(over == step >= 1 for _, over, step in skipped), skipped
    if tied:
        assert {r["overlap"]["optimizer"] for r in results} != {"BF16_Optimizer"}


@pytest.mark.process
@pytest.mark.xdist_group("overlap")
def test_real_engine_programs_mark_the_window_last_backward():
    results = run_world(overlap_workers.marked_program, 4, 2, 2, 2, True, timeout=240)
    for r in results:
        assert r["reducer"] and r["steps"] >= 1 and len(r["marked"]) == r["steps"], r["text"]
        assert "[dp]" in r["text"]


@pytest.mark.process
@pytest.mark.xdist_group("overlap")
def test_bf16_and_zero1_fall_back_to_the_reduce_at_the_step_and_say_so():
    results = run_world(overlap_workers.fallback_lines, 4, timeout=300)
    for case, wrapper in (("bf16", "BF16_Optimizer"), ("zero1", "DeepSpeedZeroOptimizer")):
        assert all(not r[case]["reducer"] and r[case]["optimizer"] == wrapper for r in results)
        lines = results[0][case]["lines"]
        assert len(lines) == 1 and "runs at each local step" in lines[0] and wrapper in lines[0], lines
        assert all(not r[case]["lines"] for r in results[1:]), "one line, on rank 0"
        by_stage = {}
        for r in results:
            by_stage.setdefault(r[case]["stage"], []).append(r[case]["weights"])
        for replicas in by_stage.values():
            assert all(torch.equal(replicas[0][k], replicas[1][k]) for k in replicas[0])
