"""The simulator's non-blocking transfers (``simulate(..., transfers="nonblocking")``), on literal programs timed by
hand: a send never holds its stage, at most one send in flight per link, receives posted one ahead, the consumer
waits for its receive; blocking timing unchanged."""

import pytest

from ds_paci.core.program.actions import Action, Kind
from ds_paci.core.program.stream import parse_stream
from ds_paci.tools.sim.simulate import CostModel, long_run_period, paci_programs, simulate, simulate_paci

UNIT = CostModel(forward=1, backward=2, latency=0.5)


def _run(texts, cost=UNIT, transfers="nonblocking"):
    return simulate([parse_stream(t, s) for s, t in enumerate(texts)], cost, transfers=transfers)


def _waits(result, stage):
    return [(e.text, e.start, e.end) for e in result.events[stage] if e.kind == "wait"]


def test_one_micro_batch_has_the_blocking_timing():
    texts = ["L0,F0 | SA0 | RG0,B0,ACC0,STEP1", "RA0,L0,F0 | B0,ACC0,STEP1 | SG0"]
    # F0 0-1, SA0 1-1.5, F0 1.5-2.5, B0 2.5-4.5, SG0 4.5-5, B0 5-7: nothing to overlap, same as blocking
    for transfers in ("blocking", "nonblocking"):
        result = _run(texts, transfers=transfers).raise_for_errors()
        assert result.makespan == pytest.approx(7.0)
    result = _run(texts)
    assert _waits(result, 1) == [("RA0", 0.0, 1.5), ("sends", 4.5, 5.0)]
    assert _waits(result, 0) == [("RG0", 1.0, 5.0)]
    assert result.busy == pytest.approx([3.0, 3.0])
    assert result.micro_batches == 1


def test_the_sender_goes_on_where_blocking_deadlocks():
    texts = ["F0 | SA0 | F1 | SA1 | RG0,B0 | RG1,B1", "RA0,F0 | B0 | SG0 | RA1,F1 | B1 | SG1"]
    # blocking: stage 0 waits in SA1 for RA1, which stage 1 reaches only after SG0, which waits for RG0
    assert _run(texts, transfers="blocking").deadlock is not None
    result = _run(texts).raise_for_errors()
    # stage 0: F0 0-1, SA0 issued at 1 (done 1.5), F1 1-2, SA1 issued at 2 (receive 1 posted at 0: done 2.5),
    #          RG0 waits 2-5, B0 5-7, RG1 waits 7-8, B1 8-10
    # stage 1: RA0 waits 0-1.5, F0 1.5-2.5, B0 2.5-4.5, SG0 issued 4.5 (done 5), RA1 done since 2.5, F1 4.5-5.5,
    #          B1 5.5-7.5, SG1 issued 7.5 (stage 0 posted its second gradient receive at 2: done 8)
    assert result.makespan == pytest.approx(10.0)
    assert _waits(result, 0) == [("RG0", 2.0, 5.0), ("RG1", 7.0, 8.0)]
    assert _waits(result, 1) == [("RA0", 0.0, 1.5), ("sends", 7.5, 8.0)]


def test_at_most_one_send_in_flight_per_link():
    texts = ["F0 | SA0 | F1 | SA1", "RA0,F0 | RA1,F1"]
    slow = CostModel(forward=1, backward=2, latency=5)
    result = _run(texts, slow).raise_for_errors()
    # SA0 issued at 1, done 6; SA1 (reached at 2) waits for it, issued at 6, done 11; stage 1 F1 11-12
    assert _waits(result, 0) == [("SA1", 2.0, 6.0), ("sends", 6.0, 11.0)]
    assert _waits(result, 1) == [("RA0", 0.0, 6.0), ("RA1", 7.0, 11.0)]
    assert result.makespan == pytest.approx(12.0)
    # blocking: SA0 1-6, both F 6-7, SA1 7-12, F1 12-13
    assert _run(texts, slow, "blocking").makespan == pytest.approx(13.0)


def test_a_receive_is_posted_when_the_previous_one_is_waited_for():
    texts = ["F0 | SA0 | F1 | SA1", "B8 | B9 | RA0 | RA1"]
    result = _run(texts).raise_for_errors()
    # SA0 issued 1, receive 0 posted at 0: done 1.5. SA1 issued 2, but receive 1 is posted only when stage 1
    # reaches RA0 (after B8, B9: at 4), so it runs 4-4.5 and RA1 waits for it
    assert _waits(result, 1) == [("RA1", 4.0, 4.5)]
    assert _waits(result, 0) == [("sends", 2.0, 4.5)]
    assert result.makespan == pytest.approx(4.5)


def test_activation_and_gradient_links_are_separate():
    # one send in flight per link *and direction*: stage 1's gradient send does not wait for its activation send
    slow = CostModel(forward=1, backward=2, latency=5)
    texts = ["F0 | SA0 | RG9,B9", "RA0,F0 | SA0 | SG9", "RA0,F0"]
    result = _run(texts, slow).raise_for_errors()
    # stage 1: RA0 waits 0-6, F0 6-7, SA0 issued 7, SG9 issued 7 (another link), ends waiting for both until 12
    assert _waits(result, 1) == [("RA0", 0.0, 6.0), ("sends", 7.0, 12.0)]
    # stage 0: RG9 posted at 0, SG9 issued 7: done 12, B9 12-14
    assert result.makespan == pytest.approx(14.0)


def test_deadlock_and_mismatch_are_reported():
    result = _run(["RG0 | F0 | SA0", "RA0 | B0 | SG0"])
    assert [(s.stage, s.text, s.partner) for s in result.deadlock.stuck] == [(0, "RG0", 1), (1, "RA0", 0)]
    result = _run(["F0 | SA0", "RA1,F1"])
    assert result.deadlock is None and len(result.mismatches) == 1 and "RA1" in result.mismatches[0]


def test_bad_input_is_refused_in_one_line():
    with pytest.raises(ValueError, match="transfers must be"):
        _run(["F0 | SA0", "RA0,F0"], transfers="async")
    tied = [[[Action(0, Kind.TIED_POST, version=1)]], [[]]]
    with pytest.raises(ValueError, match="tied exchanges"):
        simulate(tied, UNIT, transfers="nonblocking")


def _hoisted_everywhere(programs):
    """Every send directly follows the forward or backward of its micro-batch, or opens its call's first tick."""
    for ticks in programs:
        flat = [a for tick in ticks for a in tick]
        for i, a in enumerate(flat):
            after = {Kind.SEND_ACT: Kind.FORWARD, Kind.SEND_GRAD: Kind.BACKWARD}.get(a.kind)
            if after is None:
                continue
            prev = [b for b in flat[:i] if b.kind not in (Kind.SEND_ACT, Kind.SEND_GRAD)]
            if not prev or (prev[-1].kind is after and prev[-1].micro_batch == a.micro_batch):
                continue
            ok = any(b.kind is after and b.micro_batch == a.micro_batch for b in prev)
            if not ok:
                return False
    return True


@pytest.mark.parametrize("phase", ["aligned", "diagonal"])
def test_the_engines_nonblocking_program_is_timed(phase):
    P, M = 4, 8
    programs = paci_programs(P, M, M, 2, phase=phase, nonblocking=True)
    assert _hoisted_everywhere(programs)
    # transfers free: nothing to hide, both semantics give the bubble-free period F + B
    for transfers in ("blocking", "nonblocking"):
        assert long_run_period("paci", P, M, calls=2, phase=phase, transfers=transfers) == pytest.approx(3.0)
    slow = CostModel(forward=1, backward=2, latency=0.5)
    blocking = simulate_paci(P, M, M, 3, slow, phase).raise_for_errors()
    nonblocking = simulate_paci(P, M, M, 3, slow, phase, "nonblocking").raise_for_errors()
    assert nonblocking.micro_batches == blocking.micro_batches == 3 * M
    # blocking: every transfer holds both stages; non-blocking, only the dependence chain waits for it
    assert nonblocking.makespan < blocking.makespan
    periods = [long_run_period("paci", P, M, calls=2, cost=slow, phase=phase, transfers=transfers)
               for transfers in ("blocking", "nonblocking")]
    assert 3.0 < periods[1] < periods[0]
    assert nonblocking.max_drift == blocking.max_drift
