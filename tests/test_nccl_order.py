"""The NCCL-order check of the whole program (issue 27, item 3): every rank's communication operations, derived from
the lowered program the engine runs (``tests/nccl_program.py``), executed in the model of NCCL's point-to-point
semantics (``tests/nccl_model.py``) with one stream per pair or per group and with communicators created eagerly or
lazily: every operation completes (no deadlock) and every transfer meets the transfer it is meant for (no shape
mismatch). The start-up exchange (:mod:`ds_paci.core.engine.first_exchange`) is what makes lazy creation safe.

Coverage: P = 2..8, M = 1..16, windows 1..2P, ``"auto"`` and the default, tied weights (first and last stage; three
owners), 1 or 2 data-parallel replicas, evaluation and checkpoint drains, closing drains, sync mode (``a = M``: the
stock step; ``a < M``: drained every call), and DeepSpeed's own ``TrainSchedule``. Every (P, M) cell is checked
for one window drawn per cell; the full window range of each P for a few M (the grid is sampled to keep the test
under a few seconds per P; ``NCCL_ORDER_FULL=1`` runs every window of every cell). The look-ahead changes which
weights a forward reads, never a transfer (its package issues no communication), so its program is the one checked.
The non-blocking transfers (``"nonblocking_transfers"``, step B of the item) are checked over the same grid, from the
program lowered with :func:`ds_paci.core.program.passes.hoist_sends`.
"""

import itertools
import os
import random

import pytest

import nccl_model
import nccl_program

MODES = [(streams, comms) for streams in ("pair", "group") for comms in ("eager", "lazy")]
CALLS = {  # every run ends with drain(), as training does (a run cut short leaves transfers waiting, not stuck)
    "train": ["train"] * 3 + ["close"],
    "eval-save": ["train", "eval", "train", "save", "train", "close"],
    "close-twice": ["train", "train", "close", "train", "close"],
}


def check(programs, where):
    """No deadlock and no mismatched transfer, in every mode."""
    for streams, comms in MODES:
        matches = []
        stuck = nccl_model.run(programs, streams, comms, matches)
        assert stuck is None, f"{where}, {streams} streams, {comms} communicators: deadlock: {stuck[:400]}"
        wrong = [(a, b) for a, b in matches if a[1] != b[1]]
        assert not wrong, f"{where}, {streams} streams, {comms} communicators: mismatched transfers {wrong[:3]}"


def cells(P):
    """The sampled grid of one P: ``(M, window, owners, D, sync, calls)``."""
    rng = random.Random(P)
    windows = list(range(1, 2 * P + 1)) + ["auto", None]
    owner_sets = [(), (0, P - 1)] + ([(0, P // 2, P - 1)] if P > 2 else [])
    full = os.environ.get("NCCL_ORDER_FULL") == "1"
    out = []
    for M in range(1, 17):
        for window in (windows if full or M in (1, P, 16) else [rng.choice(windows)]):
            owners = rng.choice(owner_sets)
            sync = rng.random() < 0.25
            out.append((M, window, owners, rng.choice((1, 2)), sync, rng.choice(sorted(CALLS))))
    return out


@pytest.mark.parametrize("P", range(2, 9))
def test_the_whole_program_cannot_deadlock_under_nccl(P):
    for M, window, owners, D, sync, calls in cells(P):
        where = f"P={P} M={M} window={window} owners={owners} D={D} sync={sync} calls={calls}"
        check(nccl_program.derive(P, M, window, CALLS[calls], D=D, owners=owners, sync=sync), where)


@pytest.mark.parametrize("P,M", [(2, 1), (2, 4), (3, 4), (4, 4), (4, 8), (8, 8)])
def test_deepspeeds_own_train_schedule_passes_the_same_check(P, M):
    """The sanity case: DeepSpeed's ``TrainSchedule`` (with its constructor's exchange, tied all-reduce and data-parallel
    reduce) completes in every mode of the model."""
    for D, owners in itertools.product((1, 2), ((), (0, P - 1))):
        check(nccl_program.deepspeed_train_schedule(P, M, D=D, owners=owners), f"TrainSchedule P={P} M={M} D={D}")


@pytest.mark.parametrize("P", [2, 3, 4, 6])
def test_lazy_tied_communicators_deadlocked_without_the_start_up_exchange(P):
    """The deadlock of issue 27: without the start-up exchange the last stage's first tied ``irecv`` waits to create the
    pair's communicator while stage 0 waits in its local step for a gradient the last stage sends after it; eagerly
    created communicators hid it. With the start-up exchange every mode completes."""
    for window in (1, 2, None):
        before = nccl_program.derive(P, 4, window, ["train"] * 4 + ["close"], owners=(0, P - 1), startup="deepspeed")
        stuck = nccl_model.run(before, "pair", "lazy")
        assert stuck is not None and f"rank {P - 1} at ('irecv', 0" in stuck and "tied0" in stuck, (window, stuck)
        assert nccl_model.run(before, "pair", "eager") is None
        check(nccl_program.derive(P, 4, window, ["train"] * 4 + ["close"], owners=(0, P - 1), startup="ours"),
              f"window {window}")


def test_the_model_sees_lazy_creation_and_host_waits():
    """The model itself: a lazily created pair communicator is a rendezvous of both hosts; a host wait on an operation
    that a peer's blocked host would complete later is a deadlock; an un-waited isend is not part of a sync."""
    # rank 1 waits to create the pair's communicator, rank 0 waits on rank 1's send that comes after it
    programs = {0: [("recv", 1, "a", "g1"), ("block", "a"), ("send", 1, "b", "g2")],
                1: [("recv", 0, "c", "g2"), ("send", 0, "d", "g1")]}
    assert nccl_model.run(programs, "pair", "eager") is None
    assert "rank 1 at ('recv', 0, 'c', 'g2')" in nccl_model.run(programs, "pair", "lazy")
    # the same with a first exchange on g2 before anything else
    first = {0: [("send", 1, "x", "g2"), ("recv", 1, "y", "g2")], 1: [("recv", 0, "x2", "g2"), ("send", 0, "y2", "g2")]}
    assert nccl_model.run({r: first[r] + programs[r] for r in programs}, "pair", "lazy") is None
    # a sync waits for blocking transfers, not for an isend nobody waited on
    assert nccl_model.run({0: [("isend", 1, "s", "g")], 1: []}, "pair", "eager") is not None
    assert nccl_model.run({0: [("isend", 1, "s", "g"), ("sync",)], 1: [("sync",)]}, "pair", "eager").startswith("stream")
    assert "rank 0 at ('sync',)" in nccl_model.run({0: [("send", 1, "s", "g"), ("sync",)], 1: []}, "pair", "eager")
    # a collective needs every member at its head
    coll = {r: [("coll", (0, 1, 2), f"c{r}", "dp")] for r in range(3)}
    assert nccl_model.run(coll, "pair", "lazy") is None
    assert nccl_model.run({0: coll[0], 1: coll[1], 2: []}, "group", "eager") is not None


def test_the_start_up_order_is_one_global_order():
    """:func:`first_exchange.plan`: a rank's steps follow the items' keys, the lower rank of a pair sends first, and
    ranks outside an item do nothing for it."""
    from ds_paci.core.engine.first_exchange import Item, plan
    items = [Item((2, (0, 3)), (0, 3), "pairs"), Item((0, (0, 1)), (0, 1), "pairs"),
             Item((1, (0, 4)), (0, 4), "collective"), Item((3, (0, 1, 3)), (0, 1, 3), "pairs")]
    assert [(op, peer) for op, peer, _ in plan(items, 0)] == [
        ("send", 1), ("recv", 1), ("coll", (0, 4)), ("send", 3), ("recv", 3), ("send", 1), ("recv", 1), ("send", 3),
        ("recv", 3)]
    assert [(op, peer) for op, peer, _ in plan(items, 3)] == [("recv", 0), ("send", 0), ("recv", 0), ("send", 0),
                                                             ("recv", 1), ("send", 1)]
    assert plan(items, 7) == []
    with pytest.raises(ValueError, match="unknown kind"):
        plan([Item((0,), (0, 1), "bogus")], 0)


@pytest.mark.parametrize("P", range(2, 9))
def test_the_nonblocking_program_cannot_deadlock_under_nccl(P):
    """``"paci": {"nonblocking_transfers": true}``: the program lowered with :func:`hoist_sends` (each send right after
    its forward or backward), run as :mod:`ds_paci.core.engine.transfers` runs it (receives posted one ahead within a
    call, one send in flight per link, a two-rank group per link and direction with its start-up exchange, drained at
    every drain), over the same grid as the blocking program; sync mode keeps the blocking transfers."""
    for M, window, owners, D, sync, calls in cells(P):
        where = f"P={P} M={M} window={window} owners={owners} D={D} sync={sync} calls={calls} nonblocking"
        check(nccl_program.derive(P, M, window, CALLS[calls], D=D, owners=owners, sync=sync, nonblocking=True), where)


@pytest.mark.parametrize("P", range(2, 9))
def test_slack_links_cannot_deadlock_under_nccl(P):
    """``"slack_links"``: stages upstream of a listed link hold more micro-batches in flight, and the stage after it
    sends the gradient of ``m`` at the tick the stage before receives it (blocking), or right after its backward,
    ahead of that receive (non-blocking: two gradient sends may be issued before the first is received). Both
    programs over the sampled grid (async, untied: slack is refused elsewhere), one slack set drawn per cell, and
    every link at once."""
    rng = random.Random(1000 + P)
    links = list(range(P - 1))
    for M, window, _, D, _, calls in cells(P):
        for slack in (tuple(sorted(rng.sample(links, rng.randint(1, len(links))))), tuple(links)):
            for nonblocking in (False, True):
                where = f"P={P} M={M} window={window} D={D} calls={calls} slack={slack} nonblocking={nonblocking}"
                check(nccl_program.derive(P, M, window, CALLS[calls], D=D, nonblocking=nonblocking, slack=slack), where)


def test_nonblocking_transfers_need_a_group_per_link_and_direction():
    """Why the transport has a group per link and direction: on one group for everything, a receive posted ahead sits
    on the pair's stream before a send the peer waits for, and the run deadlocks; one group per direction still
    deadlocks with one stream per group (on 4 stages: a stage's receive from ``s-1`` is ahead of its send to
    ``s+1``)."""
    one = nccl_program.derive(3, 4, None, CALLS["train"], nonblocking=True, groups="one")
    assert all(nccl_model.run(one, streams, comms) for streams, comms in MODES)
    direction = nccl_program.derive(4, 4, None, CALLS["train"], nonblocking=True, groups="direction")
    assert nccl_model.run(direction, "pair", "eager") is None
    assert nccl_model.run(direction, "group", "eager") is not None
    check(nccl_program.derive(4, 4, None, CALLS["train"], nonblocking=True), "link")


def test_a_slack_link_needs_the_gradient_sent_when_it_is_received(monkeypatch):
    """Why the stage after a slack link sends the gradient of ``m`` at the tick the stage before receives it: sent
    one tick after its backward, as without slack, the blocking program deadlocks (both neighbours in a send)."""
    from ds_paci.core.program import stream
    program = nccl_program.derive(4, 4, 3, CALLS["train"], slack=(1, ))
    check(program, "slack (1,)")
    build = stream.PACIStream.__init__

    def one_tick_after(self, *args, **kwargs):
        build(self, *args, **kwargs)
        if self.stage_id:
            self.up_lag = self.lag + 1

    monkeypatch.setattr(stream.PACIStream, "__init__", one_tick_after)
    naive = nccl_program.derive(4, 4, 3, CALLS["train"], slack=(1, ))
    assert nccl_model.run(naive, "pair", "eager") is not None
