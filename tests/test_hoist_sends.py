"""The lowering pass of non-blocking transfers (issue 27 item 3): :func:`hoist_sends` puts each activation send right
after its forward and each gradient send right after its backward (before the step), a send of an earlier call's
compute first in its call; ``lower_call(..., nonblocking=True)`` applies it, and the validator accepts what it gives.
Pure data, no process.
"""

import pytest

import nccl_program
from ds_paci.core.program.actions import Kind, format_stage, parse_stage
from ds_paci.core.program.passes import hoist_sends, lower_call
from ds_paci.core.program.stream import PACIStream
from ds_paci.core.program.validate import validate

SENDS = {Kind.SEND_ACT: Kind.FORWARD, Kind.SEND_GRAD: Kind.BACKWARD}


def test_literal_stage_of_p3_m4_a2():
    ticks = parse_stage("- | RA0,F0[0,-] | SA0 | RA1,F1[0,-] | RG0,SA1,B0,ACC0 | SG0,RA2,F2[1,x] | "
                        "RG1,SA2,B1,ACC1,STEP1 | SG1,RA3,F3[0,-]", 1)
    assert format_stage(hoist_sends(ticks)) == (
        "- | RA0,F0[0,-],SA0 | - | RA1,F1[0,-],SA1 | RG0,B0,SG0,ACC0 | RA2,F2[1,x],SA2 | "
        "RG1,B1,SG1,ACC1,STEP1 | RA3,F3[0,-]")
    # the next call (a closing drain): SA3 belongs to F3 of the call before, it goes first
    drain = parse_stage("RG2,SA3,B2,ACC2 | SG2 | RG3,B3,ACC3,STEP2 | SG3", 1)
    assert format_stage(hoist_sends(drain)) == "SA3,RG2,B2,SG2,ACC2 | - | RG3,B3,SG3,ACC3,STEP2 | -"


def test_gradient_sends_go_before_the_tied_exchange_and_the_step():
    ticks = parse_stage("RG4,B4,ACC4,TPOST2[L1],TAPPLY1[L1],STEP2 | SG4", 2)
    assert format_stage(hoist_sends(ticks)) == "RG4,B4,SG4,ACC4,TPOST2[L1],TAPPLY1[L1],STEP2 | -"


def test_lower_call_hoists_only_when_asked_and_keeps_the_other_passes():
    P, M, a = 4, 4, 2
    for s in range(P):
        plain, hoisted = PACIStream(P, s, a, M), PACIStream(P, s, a, M)
        for _ in range(3):
            ticks = plain.advance(2 * M)
            assert lower_call(ticks) == ticks
            got = lower_call(hoisted.advance(2 * M), sync_steps=True, nonblocking=True)
            assert got == lower_call(hoist_sends(ticks), sync_steps=True)
            assert parse_stage(format_stage(got), s) == got


def _calls(P, M, window, calls, owners=(), nonblocking=True):
    """Every stage's lowered programs per call, as the engine lowers them (:func:`nccl_program.lowered_calls`)."""
    lowered, windows = nccl_program.lowered_calls(P, M, window, calls, owners, nonblocking=nonblocking)
    return [programs for _, programs in lowered], windows


def _flat(calls, s):
    return [a for row in calls for tick in row[s] for a in tick]


@pytest.mark.parametrize("P", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("M", [1, 2, 3, 8])
@pytest.mark.parametrize("window", [1, 3, "auto"])
@pytest.mark.parametrize("owners", [(), "tied"])
def test_hoisted_programs_validate_and_each_send_follows_its_compute(P, M, window, owners):
    owners = (0, P - 1) if owners == "tied" else owners
    script = ["train", "train", "eval", "train", "train", "close"]  # one segment: the validator reads it whole
    hoisted, windows = _calls(P, M, window, script, owners)
    blocking, _ = _calls(P, M, window, script, owners, nonblocking=False)
    whole = [[tick for row in hoisted for tick in row[s]] for s in range(P)]
    # per stage and pairing; the tied timing check runs the program with rendezvous (blocking) transfers, in which
    # a hoisted order is not meant to run: the NCCL check (tests/test_nccl_order.py) covers the tied waits
    assert validate(whole, windows) == []
    for s in range(P):
        before, after = _flat(blocking, s), _flat(hoisted, s)
        key = (lambda a: (a.kind.value, a.micro_batch, a.version))
        assert sorted(before, key=key) == sorted(after, key=key)  # only positions change
        assert [a for a in before if a.kind not in SENDS] == [a for a in after if a.kind not in SENDS]
        for c, row in enumerate(hoisted):
            actions = [a for tick in row[s] for a in tick]
            for n, a in enumerate(actions):
                if a.kind in SENDS:
                    prev = actions[n - 1] if n else None
                    right_after = prev is not None and (prev.kind, prev.micro_batch) == (SENDS[a.kind], a.micro_batch)
                    first = all(b.kind in SENDS for b in actions[:n])
                    assert right_after or first, (c, s, format_stage(row[s]))
                    if first and not right_after:  # its compute ran at the end of the previous call
                        last = [b for tick in hoisted[c - 1][s] for b in tick if b.kind is SENDS[a.kind]][-1]
                        assert last.micro_batch == a.micro_batch
