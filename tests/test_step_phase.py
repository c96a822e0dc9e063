"""The step phase of PACI streams (issue 27, item 1): ``"diagonal"`` makes the local steps of all stages, and so their
data-parallel reduces, fall in one tick of the program; the validator, the drift bound, the LR rule, the stream's
checkpointed state, the text form, the config key and the simulator cover it. Pure data, no process.
"""

import pytest

from ds_paci.core.config import PACIConfig, PACIConfigError, check_config, parse_paci_section
from ds_paci.core.program.actions import Kind, format_stage, parse_stage
from ds_paci.core.program.passes import lower_call
from ds_paci.core.program.reduce_ticks import step_ticks
from ds_paci.core.program.stream import PACIStream, drift_bound, step_phase
from ds_paci.core.program.validate import stage_violations, validate
from ds_paci.tools.sim.links import Link, LinkModel
from ds_paci.tools.sim.simulate import CostModel, long_run_period

SHAPES = [(2, 2, 2), (3, 4, 4), (4, 4, 4), (4, 8, 3), (5, 8, 5), (8, 4, 4), (8, 8, 8), (8, 16, 7), (8, 8, 3),
          (16, 16, 16), (16, 64, 16)]


def lowered_program(P, M, a, rule, calls):
    """The engine's program (streams through :func:`lower_call`, async, untied): ``calls`` calls, then a drain."""
    streams = [PACIStream(P, s, a, M, step_phase(rule, s, a)) for s in range(P)]
    program = [[] for _ in range(P)]
    for _ in range(calls):
        for s, st in enumerate(streams):
            program[s] += lower_call(st.advance(2 * M))
    for s, st in enumerate(streams):
        program[s] += lower_call([], st.drain())
    return program


def steady(ticks):
    """Each stage's reduce ticks without its first step and the drain's (the fill and the drain are not steady)."""
    inner = [t[1:-1] for t in ticks]
    lo, hi = max(t[0] for t in inner), min(t[-1] for t in inner)
    return [[x for x in t if lo <= x <= hi] for t in inner], lo, hi


@pytest.mark.parametrize("P,M,a", SHAPES)
def test_diagonal_steps_of_all_stages_fall_in_one_tick(P, M, a):
    calls = max(3, -(-(6 * a + 2 * P) // M))  # the fill, then at least six windows
    diagonal, lo, hi = steady(step_ticks(lowered_program(P, M, a, "diagonal", calls)))
    assert hi - lo >= 3
    for s, ticks in enumerate(diagonal):
        # every stage steps in every tick of the steady state, once: all P reduces run at the same time
        assert ticks == list(range(lo, hi + 1)), (s, ticks)
    aligned = step_ticks(lowered_program(P, M, a, "aligned", calls))
    for s, ticks in enumerate(aligned):
        # aligned: the steps of one window chain along the gradient path, min(P, a) reduces one after another
        gaps = {b - x for x, b in zip(ticks[1:-2], ticks[2:-1])}
        assert gaps == {min(P, a)}, (s, ticks)
    if P > 1:
        assert len({tuple(t) for t in steady(aligned)[0]}) > 1  # not one tick


@pytest.mark.parametrize("P", [2, 3, 4, 7, 8, 16])
def test_validator_and_drift_bound_cover_every_phase(P):
    for M in (1, 2, 4, 8, 16, 32):
        for a in sorted({1, 2, 3, max(P - 1, 1), P, M, 2 * P}):
            for rule in ("aligned", "diagonal"):
                phases = [step_phase(rule, s, a) for s in range(P)]
                streams = [PACIStream(P, s, a, M, phases[s]) for s in range(P)]
                worst = [0] * P
                for segment in range(4):  # drains leaving the window open and closing it, alternately
                    starts = [(st.version, st.window_fill, st.window_target) for st in streams]
                    program = [st.advance(2 * M) + st.advance(2 * M) + st.drain(close_window=segment % 2 == 1)
                               for st in streams]
                    problems = validate(program, a, start_versions=[x[0] for x in starts],
                                        start_fills=[x[1] for x in starts], start_targets=[x[2] for x in starts],
                                        expect_drained=True)
                    problems = [p for p in problems if "window left open" not in p or segment % 2 == 1]
                    assert not problems, (P, M, a, rule, segment, problems[:3])
                    for s, ticks in enumerate(program):
                        worst[s] = max(worst[s], _max_drift(ticks, starts[s][0]))
                for s in range(P):
                    assert worst[s] <= drift_bound(P, s, a), (P, M, a, rule, s)


def _max_drift(ticks, version):
    seen, worst = {}, 0
    for tick in ticks:
        for x in tick:
            if x.kind is Kind.FORWARD:
                seen[x.micro_batch] = version
            elif x.kind is Kind.BACKWARD:
                worst = max(worst, version - seen.pop(x.micro_batch))
            elif x.kind is Kind.STEP:
                version = x.version
    return worst


def test_the_validator_catches_a_wrong_phase_and_a_wrong_window_fact():
    P, M, a = 4, 4, 4
    program = lowered_program(P, M, a, "diagonal", 2)
    phases = [step_phase("diagonal", s, a) for s in range(P)]
    assert validate(program, a, phases=phases) == []
    # read as aligned, stage 1's first step (after 1 backward pass) breaks the window
    assert any("stage 1" in p and "step after 1 backwards" in p for p in validate(program, a))
    # a forward of the partial window that does not say so is caught (the look-ahead would mis-scale)
    ticks = [[x.with_(open_window=None) if x.kind is Kind.FORWARD else x for x in tick] for tick in program[2]]
    assert any("tagged open window 4" in p for p in stage_violations(ticks, P, 2, a, start_target=2))


def test_partial_windows_count_only_their_micro_batches_in_the_lr_rule():
    P, M, a = 4, 4, 4
    for s in range(P):
        st = PACIStream(P, s, a, M, step_phase("diagonal", s, a))
        ticks = st.advance(2 * M * 5) + st.drain()
        taken = lr = 0
        for tick in ticks:
            for x in tick:
                if x.kind is Kind.ACCUMULATE:
                    taken += 1
                elif x.kind is Kind.STEP:
                    lr += x.lr_steps
                    assert lr == taken // M, (s, taken, lr)  # one scheduler step per M micro-batches stepped
        assert taken == st.segment_base and lr == taken // M
        steps = [x for tick in ticks for x in tick if x.kind is Kind.STEP]
        assert len(steps) == (1 if s % a else 0) + -(-(taken - s % a) // a)  # the partial first window, then a's


def test_text_form_carries_the_partial_window():
    st = PACIStream(4, 3, 4, 4, step_phase("diagonal", 3, 4))
    ticks = st.advance(16)
    text = format_stage(ticks)
    assert "w3]" in text and parse_stage(text, 3) == ticks


def test_stream_state_resumes_exactly_and_changes_phase_only_when_closed():
    P, a, M = 4, 3, 2
    for s in range(P):
        phase = step_phase("diagonal", s, a)
        whole = PACIStream(P, s, a, M, phase)
        first = whole.advance(2 * M) + whole.drain(close_window=False)
        state = whole.state_dict()
        resumed = PACIStream(P, s, a, M, phase)
        resumed.load_state_dict(state)
        assert resumed.advance(6 * M) + resumed.drain() == whole.advance(6 * M) + whole.drain(), s
        assert first
        other = PACIStream(P, s, a, M, 0)
        if state["window_fill"] and phase:
            with pytest.raises(ValueError, match="phase"):
                other.load_state_dict(state)
        else:  # the same phase (stage 0, stage a), or nothing open: it goes on in its own phase
            other.load_state_dict(state)
            assert other.window_target == (state["window_target"] if not phase else a)
    # a state saved before the phase existed reads as aligned
    legacy = {k: v for k, v in PACIStream(P, 1, a, M).state_dict().items() if k not in ("phase", "window_target")}
    st = PACIStream(P, 1, a, M)
    st.load_state_dict(legacy)
    assert st.window_target == a and st.phase == 0


def test_config_key():
    assert parse_paci_section({"step_phase": "diagonal"}).step_phase == "diagonal"
    assert PACIConfig().phase_rule(stock_step=False) in ("aligned", "diagonal")
    assert PACIConfig(step_phase="diagonal").phase_rule(stock_step=True) == "aligned"
    assert PACIConfig(step_phase="diagonal").phase_rule(stock_step=False, tied=True) == "aligned"
    for bad in ("diag", 1, True, "ALIGNED"):
        with pytest.raises(PACIConfigError) as e:
            parse_paci_section({"step_phase": bad})
        assert "\n" not in str(e.value) and '"paci.step_phase"' in str(e.value) and '"diagonal"' in str(e.value)
    sync = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4,
            "paci": {"drain_every_batch": True, "step_phase": "diagonal"}}
    with pytest.raises(PACIConfigError, match="drain_every_batch"):
        check_config(sync)
    sync["paci"]["accumulation_window"] = 2  # drained every call but not the stock step: a phase is allowed
    assert check_config(sync).step_phase == "diagonal"


def test_simulator_the_reduce_costs_r_per_window_with_the_diagonal():
    # an unoverlapped all-reduce r at every local step: aligned chains min(P, a) of them per window, the diagonal one
    lm = LinkModel(Link(0.0, 1e30), Link(0.0, 1e9), ranks_per_node=1, activation_bytes=0, grad_bytes=0.5e9, dp=2)
    r = lm.allreduce_time()
    for P, M in ((4, 8), (3, 6), (6, 4)):
        base, linked = CostModel(forward=1.0), CostModel(forward=1.0, links=lm)
        extra = {phase: long_run_period("paci", P, M, cost=linked, phase=phase) -
                 long_run_period("paci", P, M, cost=base, phase=phase) for phase in ("aligned", "diagonal")}
        assert extra["aligned"] == pytest.approx(min(P, M) * r / M)
        assert extra["diagonal"] == pytest.approx(r / M)
