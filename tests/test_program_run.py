"""The one program interpreter, on hand-written programs: rendezvous pairing, FIFO, deadlocks, tied waits."""

import pytest

from ds_paci.core.program.actions import Kind, parse_program
from ds_paci.core.program.interpreter import Handler, run_program


class Timed(Handler):
    """Forward 1, backward 2, transfer 0.5; records (stage, text, start, end) of every action."""

    def __init__(self):
        self.log = []

    def run(self, stage, action, now):
        duration = {Kind.FORWARD: 1.0, Kind.BACKWARD: 2.0}.get(action.kind, 0.0)
        self.log.append((stage, str(action), now, now + duration))
        return duration

    def transfer(self, sender, send, receiver, recv, arrivals):
        start = max(arrivals)
        self.log.append((sender, str(send), start, start + 0.5))
        self.log.append((receiver, str(recv), start, start + 0.5))
        return start + 0.5

    def tied_wait(self, stage, action, now, posts):
        end = super().tied_wait(stage, action, now, posts)
        self.log.append((stage, str(action), now, end, sorted(posts)))
        return end


def test_p2p_pairs_as_rendezvous_with_timing():
    program = parse_program("0: L0,F0 | SA0 | RG0,B0\n"
                            "1: RA0,L0,F0 | B0 | SG0")
    handler = Timed()
    run = run_program(program, handler)
    assert run.ok and run.executed == [5, 5]
    log = {(s, text): (start, end) for s, text, start, end, *_ in handler.log}
    # F0@0-1 on stage 0, SA/RA 1-1.5, F0 1.5-2.5 and B0 2.5-4.5 on stage 1, SG/RG 4.5-5, B0 5-7 on stage 0
    assert log[(1, "RA0")] == (1.0, 1.5) and log[(0, "SA0")] == (1.0, 1.5)
    assert log[(1, "SG0")] == (4.5, 5.0) and log[(0, "RG0")] == (4.5, 5.0)
    assert log[(0, "B0")] == (5.0, 7.0)
    assert run.clock == [7.0, 5.0]


def test_pairs_are_fifo_per_link_and_direction():
    # stage 0 sends 0, 1, 2 in a row; stage 1 receives them in order, interleaved with its compute
    program = parse_program("0: SA0,SA1,SA2\n"
                            "1: RA0,F0 | RA1 | F1,RA2,F2")
    handler = Timed()
    run = run_program(program, handler)
    assert run.ok
    pairs = [(text, start) for s, text, start, *_ in handler.log if s == 1 and text.startswith("RA")]
    assert pairs == [("RA0", 0.0), ("RA1", 1.5), ("RA2", 3.0)]


def test_deadlock_names_every_stuck_stage_and_whom_it_waits_for():
    program = parse_program("0: L0,F0 | SA0 | RG0,B0\n"
                            "1: SG0 | RA0,L0,F0 | B0")
    run = run_program(program, Timed())
    assert not run.ok
    assert [(s.stage, str(s.action), s.tick, s.index, s.waits_for) for s in run.stuck] == [(0, "SA0", 1, 0, 1),
                                                                                         (1, "SG0", 0, 0, 0)]
    assert "stage 1 stuck at tick 0 instruction 0 (SG0), waiting for stage 0" == str(run.stuck[1])


def test_a_cycle_deadlocks_only_the_stages_in_it():
    program = parse_program("0: RG0 | SA0\n"
                            "1: RA0 | SG0\n"
                            "2: F0")
    run = run_program(program)
    # stage 0 wants the gradient first, stage 1 the activation: both stuck, stage 2 finishes
    assert [(s.stage, s.waits_for) for s in run.stuck] == [(0, 1), (1, 0)]
    assert run.executed == [0, 0, 1]


def test_micro_batch_mismatch_reported_and_transfer_still_happens():
    program = parse_program("0: L0,F0 | SA0\n"
                            "1: RA1,F1 | -")
    run = run_program(program)
    assert not run.stuck and run.executed == [3, 2]
    assert len(run.mismatches) == 1
    assert "stage 0 tick 1 instruction 0 (SA0) paired with stage 1 tick 0 instruction 0 (RA1)" == run.mismatches[0]


def test_no_neighbour_to_pair_with_is_an_error():
    with pytest.raises(ValueError, match="no neighbour"):
        run_program(parse_program("0: RA0"))


def test_tied_apply_waits_for_every_other_owners_posts():
    # stage 0 posts window 1 late (after a backward); stage 1 applies window 1 at once and must wait for it
    program = parse_program("0: B0,TPOST1[L1],TAPPLY1[L1]\n"
                            "1: TPOST1[L1],TAPPLY1[L1],F0")
    handler = Timed()
    run = run_program(program, handler)
    assert run.ok
    waits = {s: (start, end, posts) for s, text, start, end, *rest in handler.log if text.startswith("TAPPLY")
             for posts in rest}
    assert waits[1] == (0.0, 2.0, [(0, 1)])  # stage 1 waited until stage 0 posted at t=2
    assert waits[0] == (2.0, 2.0, [(1, 1)])  # stage 0 found stage 1's post in
    assert run.clock == [2.0, 3.0]


def test_tied_apply_of_a_window_never_posted_deadlocks_naming_the_owner():
    program = parse_program("0: TPOST1[L1]\n"
                            "1: F0\n"
                            "2: TPOST1[L1],TAPPLY1+2[L1]")
    run = run_program(program)
    assert [(s.stage, str(s.action), s.waits_for) for s in run.stuck] == [(2, "TAPPLY1+2[L1]", 0)]


def test_apply_all_waits_only_for_windows_the_other_owner_posts():
    # the closing apply of stage 1 lists windows 1..3; stage 0 posts only 1 and 2: it waits for those and ends
    program = parse_program("0: F0,TPOST1,F1,TPOST2\n"
                            "1: TPOST1,TPOST2,TPOST3,TAPPLY1+2+3[L1,all]")
    handler = Timed()
    run = run_program(program, handler)
    assert run.ok
    (entry,) = [e for e in handler.log if e[1].startswith("TAPPLY")]
    assert entry[3] == 2.0 and entry[4] == [(0, 1), (0, 2)]


def test_stages_without_posts_are_not_owners():
    # stage 1 posts nothing: stage 0's apply does not wait for it
    program = parse_program("0: TPOST1,TAPPLY1\n"
                            "1: F0")
    assert run_program(program).ok
