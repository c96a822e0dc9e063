"""PACI instruction streams as data: properties, text form, and agreement with DeepSpeed's TrainSchedule."""

import itertools

import pytest
from deepspeed.runtime.pipe import schedule as ds

from ds_paci.tools.sim.simulate import simulate
from ds_paci.core.program.passes import defer_steps
from ds_paci.core.program.actions import Action, Kind, format_action, from_deepspeed, parse_action
from ds_paci.core.program.stream import PACIStream, drift_bound, format_stream, parse_stream
from ds_paci.core.program.validate import pairing_violations, stream_violations


def plain(ticks):
    """A stream's text without the actions' facts (what the text form was before facts were part of it)."""
    return " | ".join(",".join(format_action(a, facts=False) for a in tick) or "-" for tick in ticks)


def build(P, M, a, calls=3, drain=True):
    """Per stage, a list of segments; one segment = the ticks between two drains."""
    streams = [PACIStream(P, s, a) for s in range(P)]
    segments = [[[]] for _ in range(P)]
    for _ in range(calls):
        for s, st in enumerate(streams):
            segments[s][-1].extend(st.advance(2 * M))
    if drain:
        for s, st in enumerate(streams):
            segments[s][-1].extend(st.drain())
    return streams, segments


def flat(segments):
    return [tick for seg in segments for tick in seg]


@pytest.mark.parametrize("P", range(1, 9))
def test_stream_properties_over_grid(P):
    """Forward before backward, pairing, in-flight <= P-s, one step per a backwards, drift bound, empty after drain."""
    for M, a in itertools.product(range(1, 17), range(1, 17)):
        streams, segments = build(P, M, a, calls=2)
        # a second segment after the first drain: ids keep increasing, windows restart
        for s, st in enumerate(streams):
            segments[s].append(st.advance(2 * M) + st.drain())
        for s in range(P):
            version = 0
            for seg in segments[s]:
                errors = stream_violations(seg, P, s, a, start_version=version)
                assert not errors, f"P={P} M={M} a={a}: {errors[:3]}"
                version += sum(i.kind is Kind.STEP for t in seg for i in t)
            assert streams[s].in_flight() == 0 and streams[s].window_fill == 0
        errors = pairing_violations([flat(seg) for seg in segments])
        assert not errors, f"P={P} M={M} a={a}: {errors[:3]}"
        # executed with blocking point-to-point semantics, across call boundaries and both drains
        result = simulate([flat(seg) for seg in segments])
        assert result.deadlock is None and not result.mismatches, f"P={P} M={M} a={a}: {result.deadlock}"
        assert all(peak <= P - s for s, peak in enumerate(result.peak_in_flight))
        # every stage completed the same micro-batches: 3 calls of M
        for s in range(P):
            backs = [i.micro_batch for t in flat(segments[s]) for i in t if i.kind is Kind.BACKWARD]
            assert backs == list(range(3 * M))


def test_window_steps_and_drift_in_steady_state():
    P, M, a = 8, 8, 4
    streams, segments = build(P, M, a, calls=6)
    for s in range(P):
        ticks = flat(segments[s])
        steps = [i for t in ticks for i in t if i.kind is Kind.STEP]
        assert [x.version for x in steps] == list(range(1, 6 * M // a + 1))
        # the bound is attained in steady state (it is tight, not just an upper bound)
        version, fwd, drifts = 0, {}, []
        for t in ticks:
            for i in t:
                if i.kind is Kind.FORWARD:
                    fwd[i.micro_batch] = version
                elif i.kind is Kind.BACKWARD:
                    drifts.append(version - fwd.pop(i.micro_batch))
                elif i.kind is Kind.STEP:
                    version = i.version
        assert max(drifts) == drift_bound(P, s, a)


def test_every_call_advances_every_stage_by_2m_ticks_and_stage0_loads_m():
    P, M, a = 4, 3, 3
    streams = [PACIStream(P, s, a) for s in range(P)]
    for call in range(4):
        ticks = [st.advance(2 * M) for st in streams]
        assert {len(t) for t in ticks} == {2 * M}
        loads = [i.micro_batch for t in ticks[0] for i in t if i.kind is Kind.LOAD]
        assert loads == list(range(call * M, (call + 1) * M))
        assert streams[0].in_flight() <= P and streams[P - 1].in_flight() <= 1


def test_literal_streams_p2_m2_a2():
    """The whole two-stage stream for two calls and the drain, written out."""
    P, M, a = 2, 2, 2
    streams, segments = build(P, M, a, calls=2)
    assert plain(flat(segments[0])) == ("L0,F0 | SA0 | L1,F1 | RG0,SA1,B0,ACC0 | "
                                                "L2,F2 | RG1,SA2,B1,ACC1,STEP1 | L3,F3 | RG2,SA3,B2,ACC2 | "
                                                "- | RG3,B3,ACC3,STEP2")
    assert plain(flat(segments[1])) == ("- | RA0,L0,F0 | B0,ACC0 | SG0,RA1,L1,F1 | B1,ACC1,STEP1 | "
                                                "SG1,RA2,L2,F2 | B2,ACC2 | SG2,RA3,L3,F3 | B3,ACC3,STEP2 | SG3")


def test_text_form_round_trips():
    P, M, a = 5, 4, 3
    streams, segments = build(P, M, a, calls=3)
    for s in range(P):
        ticks = flat(segments[s])
        text = format_stream(ticks)
        again = parse_stream(text, s)
        assert format_stream(again) == text
        assert again == ticks  # every fact survives: the parsed stream is the stream
    for bad in ("X3", "F", "F-1", "STEPx", "F3,", "F3[1]", "F3[1,y]", "STEP2[lr]", "B3[0,x]", "STEP0"):
        with pytest.raises(ValueError):
            parse_action(bad, 0)
    assert format_action(Action(0, Kind.STEP, version=7)) == "STEP7"
    assert format_action(Action(0, Kind.ACCUMULATE, 5)) == "ACC5"


@pytest.mark.parametrize("P,M", [(1, 1), (2, 4), (3, 2), (4, 4), (5, 3), (8, 8), (8, 2)])
def test_sync_mode_equals_deepspeed_train_schedule(P, M):
    """advance(2M) + drain() with a = M runs DeepSpeed's TrainSchedule, instruction for instruction.

    Differences allowed by construction: PACI marks each backward with ACC and puts the
    step (STEP, stage-local) right after the stage's last backward instead of
    ReduceTiedGrads/ReduceGrads/OptimizerStep at the last tick; buffer ids may differ
    when M < P - s (DeepSpeed allocates min(P - s, M) buffers).
    """
    compute = (Kind.LOAD, Kind.FORWARD, Kind.BACKWARD, Kind.SEND_ACT, Kind.RECV_ACT, Kind.SEND_GRAD, Kind.RECV_GRAD)
    for s in range(P):
        st = PACIStream(P, s, M)
        ours = st.advance(2 * M) + st.drain()
        steps = list(ds.TrainSchedule(micro_batches=M, stages=P, stage_id=s).steps())
        theirs = from_deepspeed(s, steps)
        assert len(ours) == len(theirs)
        for t, (mine, stock, raw) in enumerate(zip(ours, theirs, steps)):
            assert [i.kind for i in mine if i.kind in compute] == \
                [i.kind for i in stock if i.kind in compute], f"stage {s} tick {t}: {format_stream([mine])} vs {raw}"
            nbuf = max(2, min(P - s, M))
            assert [i.micro_batch % nbuf for i in mine if i.kind in compute] == \
                [i.buffer_id for i in raw if type(i).__name__ in _DS_COMPUTE]
        assert sum(i.kind is Kind.STEP for t in ours for i in t) == 1
        # lowered for sync mode, the step ends the call's last tick, where DeepSpeed's OptimizerStep is
        lowered = defer_steps(ours)
        assert len(lowered) == len(theirs) and lowered[-1][-1].kind is Kind.STEP and theirs[-1][-1].kind is Kind.STEP
        assert [[i for i in t if i.kind is not Kind.STEP] for t in lowered] == \
            [[i for i in t if i.kind is not Kind.STEP] for t in ours]


_DS_COMPUTE = ("LoadMicroBatch", "ForwardPass", "BackwardPass", "SendActivation", "RecvActivation", "SendGrad",
               "RecvGrad")


def test_validator_catches_broken_streams():
    P, M, a = 3, 4, 2
    streams, segments = build(P, M, a, calls=2)
    ticks = flat(segments[0])
    # backward before forward: swap the first forward tick and the first backward tick
    fi = next(k for k, t in enumerate(ticks) if any(i.kind is Kind.FORWARD for i in t))
    bi = next(k for k, t in enumerate(ticks) if any(i.kind is Kind.BACKWARD for i in t))
    broken = list(ticks)
    broken[fi], broken[bi] = broken[bi], broken[fi]
    assert stream_violations(broken, P, 0, a)
    # a missing step
    no_step = [[i for i in t if not i.kind is Kind.STEP] for t in ticks]
    assert any("without a step" in e or "open" in e for e in stream_violations(no_step, P, 0, a))
    # truncated stream: still in flight
    assert any("in flight" in e for e in stream_violations(ticks[:10], P, 0, a))
    # mismatched pairing: drop one RecvActivation on stage 1
    s1 = [[i for i in t if not (i.kind is Kind.RECV_ACT and i.micro_batch == 2)]
          for t in flat(segments[1])]
    assert pairing_violations([ticks, s1, flat(segments[2])])


def test_stream_state_round_trip_and_window_change():
    st = PACIStream(4, 1, 2)
    st.advance(8)
    with pytest.raises(RuntimeError):
        st.state_dict()
    st.drain()
    state = st.state_dict()
    fresh = PACIStream(4, 1, 2)
    fresh.load_state_dict(state)
    assert format_stream(fresh.advance(6)) == format_stream(st.advance(6))
    with pytest.raises(ValueError):
        PACIStream(4, 1, 0)
    with pytest.raises(ValueError):
        PACIStream(4, 4, 1)


# -- windows carried across drains, and the learning-rate rule (issue 16, item 6) -------------------
DRAIN_PATTERNS = [(), (1,), (1, 1, 1), (2, 3), (3, 1, 2)]


def carried_run(P, M, a, pattern, calls):
    """Per stage: segments of a stream drained without closing the window after the calls listed in ``pattern``
    (cumulative call counts where a drain happens), then closed at the end."""
    streams = [PACIStream(P, s, a, M) for s in range(P)]
    segments = [[[]] for _ in range(P)]
    drains = set(itertools.accumulate(pattern))
    for c in range(1, calls + 1):
        for s, st in enumerate(streams):
            segments[s][-1].extend(st.advance(2 * M))
            if c in drains and c < calls:
                segments[s][-1].extend(st.drain(close_window=False))
                segments[s].append([])
    for s, st in enumerate(streams):
        segments[s][-1].extend(st.drain())
    return streams, segments


def steps_after(ticks):
    """(micro-batch whose backward precedes each local step, its lr_steps), in stream order."""
    out, last = [], None
    for tick in ticks:
        for i in tick:
            if i.kind is Kind.BACKWARD:
                last = i.micro_batch
            elif i.kind is Kind.STEP:
                out.append((last, i.lr_steps))
    return out


@pytest.mark.parametrize("P", [1, 2, 4])
def test_carried_windows_step_after_every_a_backwards_however_often_the_stream_is_drained(P):
    """Draining (evaluation, checkpoints) adds no local step: the steps follow the same micro-batches as an undrained
    stream, each segment validates with its carried fill, and the forwards' tags stay truthful."""
    calls = 9
    for M, a in itertools.product(range(1, 5), range(1, 6)):
        _, reference = carried_run(P, M, a, (), calls)
        for pattern in DRAIN_PATTERNS[1:]:
            streams, segments = carried_run(P, M, a, pattern, calls)
            for s in range(P):
                assert steps_after(flat(segments[s])) == steps_after(flat(reference[s])), (P, M, a, pattern, s)
                version, fill = 0, 0
                for k, seg in enumerate(segments[s]):
                    last = k == len(segments[s]) - 1
                    errors = stream_violations(seg, P, s, a, start_version=version, start_fill=fill,
                                               expect_closed=last)
                    assert not errors, (P, M, a, pattern, s, errors[:3])
                    backs = sum(i.kind is Kind.BACKWARD for t in seg for i in t)
                    steps = sum(i.kind is Kind.STEP for t in seg for i in t)
                    fill = 0 if last else (fill + backs) - a * steps
                    version += steps
                    assert 0 <= fill < a
            result = simulate([flat(seg) for seg in segments])
            assert result.deadlock is None and not result.mismatches


def test_the_learning_rate_rule_counts_one_scheduler_step_per_m_micro_batches_stepped():
    # a = M: one scheduler step per local step (the stock engine's count, today's behaviour)
    for P, M in [(2, 4), (4, 1), (3, 2)]:
        _, segs = carried_run(P, M, M, (2, 1), 6)
        assert all(n == 1 for s in range(P) for _, n in steps_after(flat(segs[s])))
    # a != M: after each local step the count is floor(micro-batches stepped / M), whatever the drains
    for M, a, pattern in [(4, 1, ()), (1, 3, (1, 1, 1)), (2, 3, (3, 1)), (3, 2, (1, 2))]:
        streams, segs = carried_run(3, M, a, pattern, 7)
        for s in range(3):
            count = 0
            for after, n in steps_after(flat(segs[s])):
                count += n
                assert count == (after + 1) // M, (M, a, s, after, count)
            assert streams[s].lr_count == count == 7  # closed at the end: every call's M micro-batches stepped
    # P = 4, M = 1, a = 3 ("auto"): 12 calls give 4 local steps and 12 scheduler steps, with or without drains
    for pattern in [(), (4, 4), (1,) * 11]:
        streams, segs = carried_run(4, 1, 3, pattern, 12)
        assert [st.version for st in streams] == [4] * 4 and [st.lr_count for st in streams] == [12] * 4
    # a change of M keeps the count (M micro-batches under either size count one scheduler step)
    st = PACIStream(2, 1, 2, 2)
    st.advance(2 * 2 * 2)  # two calls of M = 2
    st.drain()
    assert st.lr_count == 2
    st.set_micro_batches(4, window=4)
    st.advance(2 * 2 * 4)  # two calls of M = 4
    st.drain()
    assert st.lr_count == 4 and st.window == 4
    with pytest.raises(RuntimeError):  # the window cannot change under an open window
        st.advance(2)
        st.drain(close_window=False)
        st.set_micro_batches(2, window=2)


def test_stream_state_with_an_open_window_round_trips():
    st = PACIStream(3, 1, 3, 2)
    st.advance(8)
    st.drain(close_window=False)
    assert st.window_fill == 1
    state = st.state_dict()
    fresh = PACIStream(3, 1, 3, 2)
    fresh.load_state_dict(state)
    assert (fresh.window_fill, fresh.lr_count, fresh.version) == (st.window_fill, st.lr_count, st.version)
    a, b = fresh.advance(12) + fresh.drain(), st.advance(12) + st.drain()
    assert format_stream(a) == format_stream(b)
    assert steps_after(a) == steps_after(b)
    # a state saved before the rule existed (windows closed, one scheduler step per local step) continues from there
    old = {"next_micro_batch": 8, "version": 4, "ticks_emitted": 20}
    legacy = PACIStream(3, 1, 2, 2)
    legacy.load_state_dict(old)
    assert (legacy.window_fill, legacy.lr_count) == (0, 4)
    legacy.advance(4)
    legacy.drain()
    assert legacy.lr_count == 5
