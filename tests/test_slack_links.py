"""Slack links (``"paci": {"slack_links": [...]}``, issue 27): one more micro-batch in flight upstream of each listed
link, so that with non-blocking transfers a slow link's transfer leaves the pipeline's dependence chain. The stream's
program (in flight ``P - s + k_s``, buffers, the gradient sent when the stage before receives it, drains), the
validator and drift bound, the simulator (no deadlock either way), ``"auto"``'s window, the config key and its
refusals. Real engines: the replay's equality (``tests/test_replay_engine.py``), blocking = non-blocking
(``tests/test_nonblocking_transfers.py``); the NCCL order: ``tests/test_nccl_order.py``; the simulated gain:
``tests/test_links.py``.
"""

import itertools

import pytest

import transfer_workers
from harness import run_world
from ds_paci.core.config import PACIConfig, PACIConfigError, auto_window, parse_paci_section
from ds_paci.core.program.actions import Kind
from ds_paci.core.program.passes import lower_call
from ds_paci.core.program.stream import PACIStream, drift_bound, num_buffers, slack_count, step_phase
from ds_paci.core.program.validate import validate
from ds_paci.tools.sim.simulate import CostModel, simulate


def program(P, M, a, slack, rule="aligned", calls=2, close=True):
    streams = [PACIStream(P, s, a, M, step_phase(rule, s, a), slack) for s in range(P)]
    out = [[] for _ in range(P)]
    for _ in range(calls):
        for s, st in enumerate(streams):
            out[s] += st.advance(2 * M)
    for s, st in enumerate(streams):
        out[s] += st.drain(close_window=close)
    return out, streams


def peak_in_flight(ticks):
    live, peak = set(), 0
    for tick in ticks:
        for a in tick:
            if a.kind is Kind.FORWARD:
                live.add(a.micro_batch)
                peak = max(peak, len(live))
            elif a.kind is Kind.BACKWARD:
                live.discard(a.micro_batch)
    return peak


def slack_sets(P):
    links = range(P - 1)
    return [c for r in range(1, min(3, P - 1) + 1) for c in itertools.combinations(links, r)]


@pytest.mark.parametrize("P", range(2, 8))
def test_slack_programs_are_valid_and_run_blocking_and_nonblocking(P):
    cost = CostModel(forward=1.0, backward=2.0, latency=0.3)
    for slack in slack_sets(P):
        for a, M, rule, close in ((1, P, "aligned", True), (P - 1 or 1, 2 * P + 1, "diagonal", True),
                                  (P + 1, 2, "aligned", False), (2, P, "diagonal", False)):
            prog, streams = program(P, M, a, slack, rule, close=close)
            where = f"P={P} slack={slack} a={a} M={M} {rule} close={close}"
            phases = [step_phase(rule, s, a) for s in range(P)]
            problems = validate(prog, a, phases=phases, slack=slack)
            # a drain that keeps the window open leaves it open: the only complaint allowed
            assert all(not close and "window left open" in p for p in problems), (where, problems[:3])
            for s, ticks in enumerate(prog):
                k = slack_count(slack, s)
                # the stream runs exactly the in-flight it promises, on the buffers it reserves
                assert peak_in_flight(ticks) == min(P - s + k, 2 * M), where
                assert streams[s].nbuf == num_buffers(P, s, slack) >= P - s + k, where
                assert streams[s].in_flight() == 0
            # both transports: every send meets its receive, no deadlock
            simulate(prog, cost).raise_for_errors()
            simulate([lower_call(t, nonblocking=True) for t in prog], cost, transfers="nonblocking").raise_for_errors()


def test_the_validator_holds_a_slack_program_to_its_own_limits():
    """Read without its slack, a slack program breaks the 1F1B limits: the check can fail."""
    prog, _ = program(4, 8, 3, (1, ))
    assert validate(prog, 3, slack=(1, )) == []
    problems = validate(prog, 3)
    assert any("in flight > " in p for p in problems), problems[:3]
    assert any("still holds" in p for p in problems), problems[:3]


def test_drift_bound_window_and_gradient_timing():
    assert drift_bound(16, 0, 15) == 1 and drift_bound(16, 0, 15, (7, )) == 2 and drift_bound(16, 8, 15, (7, )) == 1
    assert auto_window(16, 16) == 15 and auto_window(16, 16, extra=1) == 16
    assert PACIConfig(accumulation_window="auto", slack_links=(7, )).window(16, 16) == 16
    # the stage after a slack link sends the gradient of m two ticks after the tick that follows its backward
    P, slack = 4, (1, )
    after = PACIStream(P, 2, 4, 4, slack=slack)
    ticks = after.advance(16)
    backward = {a.micro_batch: t for t, tick in enumerate(ticks) for a in tick if a.kind is Kind.BACKWARD}
    sent = {a.micro_batch: t for t, tick in enumerate(ticks) for a in tick if a.kind is Kind.SEND_GRAD}
    assert sent and all(sent[m] == backward[m] + 3 for m in sent)
    before = PACIStream(P, 1, 4, 4, slack=slack).advance(16)
    received = {a.micro_batch: t for t, tick in enumerate(before) for a in tick if a.kind is Kind.RECV_GRAD}
    assert all(received[m] == sent[m] for m in sent)


def test_config_key():
    assert parse_paci_section({}).slack_links == ()
    assert parse_paci_section({"slack_links": [7, 3, 7]}).slack_links == (3, 7)
    for bad in ([-1], "7", [True], [1.5], 7):
        with pytest.raises(PACIConfigError, match="slack_links.*link ids"):
            parse_paci_section({"slack_links": bad})
    with pytest.raises(ValueError, match="do not exist"):
        PACIStream(4, 0, 2, slack=(3, ))


@pytest.mark.process
def test_the_engine_refuses_slack_it_cannot_honour():
    results = run_world(transfer_workers.slack_refusals, 2, 2, timeout=180)
    for r in results:
        assert "tied layers" in r["tied"] and "slack_links" in r["tied"], r
        assert "does not have" in r["range"] and "0..0" in r["range"], r
        assert "drain_every_batch" in r["sync"], r
