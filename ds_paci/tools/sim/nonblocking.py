"""Non-blocking point-to-point transfers for the simulator: ``simulate(..., transfers="nonblocking")``.

:func:`run_nonblocking` executes a whole pipeline's program like
:func:`ds_paci.core.program.interpreter.run_program` (each stage runs its actions in program order, tick boundaries
are not barriers, local actions cost what the handler says, a deadlock names each stuck stage) and returns the
same :class:`~ds_paci.core.program.interpreter.Run`, but with the point-to-point semantics of isend/irecv (issue 27,
item 3; the order ``tests/nccl_program.py::hoisted_nonblocking`` checks against the NCCL model). A *link* is one
direction between neighbours: activations ``s -> s+1``, gradients ``s+1 -> s``; its ``k``-th send pairs with its
``k``-th receive.

* ``SA``/``SG`` issues an isend at its position in the program and the sender goes on. At most one send is in
  flight per link: issuing send ``k`` first waits for send ``k - 1`` to complete (a ``wait`` event on the sender).
* Receive ``k`` is posted one micro-batch ahead: receive ``0`` at the start of the run, receive ``k`` when the
  receiver reaches ``RA``/``RG`` ``k - 1`` (where it waits for that one).
* Transfer ``k`` occupies the link from ``max(issue_k, posted_k)`` for ``handler.transfer_time(sender, receiver)``
  (send ``k - 1`` has completed by ``issue_k``); it costs neither stage any compute time.
* ``RA``/``RG`` ``k`` waits for transfer ``k``'s completion (a ``wait`` event on the receiver); the forward or
  backward after it then uses the data.
* At the end of its program a stage waits for its sends still in flight (their buffers must outlive them).

A program with tied exchanges (``TPOST``/``TAPPLY``) is refused: the non-blocking timing does not model them.
Pure Python; imports only :mod:`ds_paci.core.program`.
"""

from collections import deque

from ds_paci.core.program.actions import P2P_PARTNER, Kind, format_action
from ds_paci.core.program.interpreter import Run, Stuck

__all__ = ["run_nonblocking"]

_SENDS = {Kind.SEND_ACT: +1, Kind.SEND_GRAD: -1}
_RECVS = {Kind.RECV_ACT: -1, Kind.RECV_GRAD: +1}
_END = None  # a stage waiting at its end for its sends in flight


def _link(stage, action):
    """``(sender, receiver)`` of the link a p2p ``action`` on ``stage`` uses."""
    if action.kind in _SENDS:
        return stage, stage + _SENDS[action.kind]
    return stage + _RECVS[action.kind], stage


class _Link:
    """One link's transfers by index: issue, posted, completion times and the micro-batch ids on both sides."""

    def __init__(self):
        self.issue, self.send_mb, self.posted, self.recv_mb, self.complete = [], [], [0.0], [], []

    def resolve(self, duration):
        """Completion times of every transfer whose send is issued and whose receive is posted; ``True`` if any."""
        progressed = False
        k = len(self.complete)
        while k < len(self.issue) and k < len(self.posted):
            self.complete.append(max(self.issue[k], self.posted[k]) + duration)
            k += 1
            progressed = True
        return progressed


def _flatten(program):
    ops = []
    for s, ticks in enumerate(program):
        flat = []
        for t, tick in enumerate(ticks):
            for i, a in enumerate(tick):
                if a.kind in (Kind.TIED_POST, Kind.TIED_APPLY):
                    raise ValueError(f"stage {s} tick {t}: {format_action(a)}: transfers='nonblocking' does not "
                                     "time tied exchanges; simulate this program with transfers='blocking'")
                if a.kind in P2P_PARTNER and not 0 <= s + P2P_PARTNER[a.kind][0] < len(program):
                    raise ValueError(f"stage {s} tick {t}: {format_action(a)} has no neighbour stage to pair with")
                flat.append((t, i, a))
        ops.append(flat)
    return ops


class _Execution:
    """The whole pipeline's state: per stage its position and clock, per link its transfers."""

    def __init__(self, program, handler):
        self.handler = handler
        self.ops = _flatten(program)
        P = len(program)
        self.links = {}
        self.pos, self.clock = [0] * P, [0.0] * P
        self.reached = [False] * P  # the receive at pos[s] has posted the next one already
        self.finished = [False] * P
        self.mismatches = []

    def link(self, key):
        return self.links.setdefault(key, _Link())

    def wait(self, s, action, until):
        if until > self.clock[s]:
            self.handler.waited(s, action, self.clock[s], until)
            self.clock[s] = until

    def send(self, s, t, i, a, key):
        """Issue the send at ``pos[s]``; ``False`` while the previous send's completion is unknown."""
        ln = self.link(key)
        k = len(ln.issue)
        if k and len(ln.complete) < k:
            return False
        if k:
            self.wait(s, a, ln.complete[k - 1])
        ln.issue.append(self.clock[s])
        ln.send_mb.append((a.micro_batch, t, i))
        ln.resolve(self.handler.transfer_time(*key))
        self.handler.ended(s, a, self.clock[s])
        return True

    def receive(self, s, t, i, a, key):
        """Post the next receive, wait for this one; ``False`` while its completion is unknown."""
        ln = self.link(key)
        k = len(ln.recv_mb)
        if not self.reached[s]:
            self.reached[s] = True
            ln.posted.append(self.clock[s])  # receive k + 1 is posted where receive k is waited for
            ln.resolve(self.handler.transfer_time(*key))
        if len(ln.complete) <= k:
            return False
        self.reached[s] = False
        mb, ts, i_s = ln.send_mb[k]
        if mb != a.micro_batch:
            self.mismatches.append(f"stage {key[0]} tick {ts} instruction {i_s} (send of micro-batch {mb}) "
                                   f"paired with stage {s} tick {t} instruction {i} ({format_action(a)})")
        ln.recv_mb.append(a.micro_batch)
        self.wait(s, a, ln.complete[k])
        self.handler.ended(s, a, self.clock[s])
        return True

    def step(self, s):
        """Advance stage ``s`` until it blocks; returns the links it used (their other ends may go on now)."""
        changed = set()
        ops = self.ops[s]
        while self.pos[s] < len(ops):
            t, i, a = ops[self.pos[s]]
            if a.kind in _SENDS or a.kind in _RECVS:
                key = _link(s, a)
                posted = a.kind in _RECVS and not self.reached[s]
                if not (self.send if a.kind in _SENDS else self.receive)(s, t, i, a, key):
                    if posted:  # a new receive is posted: the sender may go on
                        changed.add(key)
                    return changed
                changed.add(key)
            else:
                self.clock[s] += self.handler.run(s, a, self.clock[s]) or 0.0
            self.pos[s] += 1
        if not self.finished[s]:
            mine = [ln for (snd, _), ln in self.links.items() if snd == s and ln.issue]
            if any(len(ln.complete) < len(ln.issue) for ln in mine):
                return changed
            self.wait(s, _END, max([self.clock[s]] + [ln.complete[-1] for ln in mine]))
            self.finished[s] = True
        return changed

    def stuck(self):
        out = []
        for s, ops in enumerate(self.ops):
            if self.finished[s]:
                continue
            if self.pos[s] < len(ops):
                t, i, a = ops[self.pos[s]]
                out.append(Stuck(s, t, i, a, s + P2P_PARTNER[a.kind][0]))
            else:
                t, i, a = ops[-1]
                waits = next(r for (snd, r), ln in self.links.items() if snd == s and len(ln.complete) < len(ln.issue))
                out.append(Stuck(s, t, i, a, waits))
        return out


def run_nonblocking(program, handler):
    """Execute ``program`` (``program[s]`` = stage ``s``'s ticks of actions) with non-blocking transfers.

    ``handler`` provides ``run(stage, action, now)`` (a local action's duration, as for ``run_program``),
    ``transfer_time(sender, receiver)``, ``waited(stage, action, start, end)`` (the stage stood still from
    ``start`` to ``end`` at ``action``; ``action`` is ``None`` for the final wait for sends in flight) and
    ``ended(stage, action, end)`` (``action`` left the stage at ``end``: one call per p2p action, in order).
    Returns a :class:`Run`; raises ``ValueError`` for tied actions or a p2p action without a neighbour stage."""
    ex = _Execution(program, handler)
    P = len(program)
    ready, queued = deque(range(P)), set(range(P))
    while ready:
        s = ready.popleft()
        queued.discard(s)
        for key in ex.step(s):
            for q in key:
                if q != s and q not in queued:
                    queued.add(q)
                    ready.append(q)
    return Run(ex.ops, ex.pos, ex.clock, ex.stuck(), ex.mismatches)
