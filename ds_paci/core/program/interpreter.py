"""The one interpreter of a whole pipeline's program, all stages in one process.

:func:`run_program` executes ``program[s]`` (stage ``s``'s ticks of :class:`~ds_paci.core.program.actions.Action`)
for every stage and leaves *what an action costs or computes* to a handler (:class:`Handler`): the
simulator's handler adds time from its cost model, the tied-timing check's keeps vector clocks, a replay's
does the math. Semantics, the same for every handler:

* Each stage runs its actions in program order. Tick boundaries are **not** barriers.
* Point-to-point actions (:data:`~ds_paci.core.program.actions.P2P_PARTNER`) are blocking rendezvous, as with gloo:
  ``SA`` on stage ``s`` pairs with ``RA`` on ``s+1``, ``SG`` on ``s`` with ``RG`` on ``s-1``. A stage that
  reaches one waits until the partner stage stands at the matching action; since both sides wait in
  program order, pairs form first-in first-out per link and direction. Paired actions naming different
  micro-batches are reported in :attr:`Run.mismatches` (the transfer still happens).
* *Owners* are the stages whose program has ``TIED_POST`` actions. ``TPOST w`` on an owner posts its
  window ``w`` (never blocks). ``TAPPLY W`` on an owner waits until every *other* owner has executed
  ``TPOST w`` for every ``w`` in ``W``. For an ``apply_all`` apply (the closing drain's step, which
  applies every pending window) only windows the other owner posts at all are waited for: the closing
  apply takes what exists, so owners with different window counts do not hang there (each owner posts its
  windows in order, so waiting for its post of ``max(W)`` implies the earlier ones).
* When no stage can progress while some still have actions, the run is a deadlock: :attr:`Run.stuck` names
  each stuck stage, its tick, position and action, and the stage it waits for.

Time is the handler's: each stage has a clock (a float) that the hooks advance; handlers that do not keep
time return ``None``/``0``. The order in which stages are interleaved is an implementation detail: hooks are
called in each stage's program order, a transfer when both sides have arrived, an apply when its posts are
in, so any handler whose results depend only on those orders gives the same result whatever the
interleaving. Pure Python: imports only :mod:`ds_paci.core.program.actions`.
"""

from collections import deque
from dataclasses import dataclass, field
from typing import List, Optional

from .actions import P2P_PARTNER, Action, Kind, format_action

__all__ = ["Handler", "Stuck", "Run", "run_program"]


class Handler:
    """Hooks :func:`run_program` calls; subclass and override. Each is called once per action, in the stage's
    program order (a transfer counts once for each of its two stages)."""

    def run(self, stage, action, now):
        """A local action (not p2p, not ``TIED_APPLY``) starting at ``now``: its duration, or ``None`` for 0."""
        return None

    def transfer(self, sender, send, receiver, recv, arrivals):
        """A rendezvous of ``send`` (on ``sender``) with ``recv`` (on ``receiver``); ``arrivals`` = (sender's,
        receiver's) clock when it reached the action. Returns the time both stages leave it."""
        return max(arrivals)

    def tied_wait(self, stage, action, now, posts):
        """A ``TIED_APPLY`` whose posts are all in, reached at ``now``; ``posts`` = {(owner, window): time of the
        post}. Returns the time the stage leaves it."""
        return max([now] + list(posts.values()))


@dataclass(frozen=True)
class Stuck:
    """A stage blocked forever at ``action`` (position ``index`` of tick ``tick``), waiting for ``waits_for``."""

    stage: int
    tick: int
    index: int
    action: Action
    waits_for: int

    def __str__(self):
        return (f"stage {self.stage} stuck at tick {self.tick} instruction {self.index} "
                f"({format_action(self.action)}), waiting for stage {self.waits_for}")


@dataclass
class Run:
    """Outcome of :func:`run_program`: ``positions[s][i]`` = (tick, index, action) of stage ``s``'s ``i``-th action
    in program order; ``executed[s]`` how many of them ran; ``clock[s]`` the stage's clock at the end."""

    positions: List[list]
    executed: List[int]
    clock: List[float]
    stuck: List[Stuck] = field(default_factory=list)
    mismatches: List[str] = field(default_factory=list)

    @property
    def ok(self):
        return not self.stuck and not self.mismatches

    @property
    def deadlock_time(self):
        return max(self.clock, default=0.0)


@dataclass
class _Stage:
    """One stage's interpreter state."""

    ops: list
    pos: int = 0
    clock: float = 0.0
    at_p2p: bool = False  # waiting at the p2p action at ``pos``
    tied_needs: Optional[list] = None  # the posts a blocked TIED_APPLY at ``pos`` waits for
    queued: bool = True

    @property
    def done(self):
        return self.pos == len(self.ops)

    @property
    def head(self):
        return self.ops[self.pos][2]


def _flatten(stage, ticks, stages):
    ops = []
    for t, tick in enumerate(ticks):
        for i, action in enumerate(tick):
            if not isinstance(action, Action):
                raise TypeError(f"stage {stage} tick {t}: {action!r} is not an Action")
            if action.kind in P2P_PARTNER and not 0 <= stage + P2P_PARTNER[action.kind][0] < stages:
                raise ValueError(f"stage {stage} tick {t}: {format_action(action)} has no neighbour stage to pair with")
            ops.append((t, i, action))
    return ops


class _Interpreter:

    def __init__(self, program, handler):
        self.handler = handler
        self.stages = [_Stage(_flatten(s, ticks, len(program))) for s, ticks in enumerate(program)]
        self.posted_windows = {}  # owner -> windows its program posts
        for s, st in enumerate(self.stages):
            for _, _, a in st.ops:
                if a.kind is Kind.TIED_POST:
                    self.posted_windows.setdefault(s, set()).add(a.version)
        self.owners = sorted(self.posted_windows)
        self.posts = {}  # (owner, window) -> time of the post
        self.mismatches = []
        self.ready = deque(range(len(program)))

    def needs(self, s, action):
        out = []
        for q in self.owners:
            if q != s:
                out.extend((q, w) for w in action.windows
                           if not action.apply_all or w in self.posted_windows[q])
        return out

    def enqueue(self, s):
        st = self.stages[s]
        if not st.queued:
            st.queued = True
            self.ready.append(s)

    def run_local(self, s):
        """Run stage ``s`` until it blocks (at a p2p action or an apply whose posts are missing) or ends."""
        st, handler = self.stages[s], self.handler
        while not st.done:
            action = st.head
            kind = action.kind
            if kind in P2P_PARTNER:
                st.at_p2p = True
                return
            if kind is Kind.TIED_APPLY:
                needs = self.needs(s, action)
                if any(n not in self.posts for n in needs):
                    st.tied_needs = needs
                    return
                st.tied_needs = None
                st.clock = handler.tied_wait(s, action, st.clock, {n: self.posts[n] for n in needs})
            else:
                duration = handler.run(s, action, st.clock)
                if duration is not None:
                    st.clock = st.clock + duration
                if kind is Kind.TIED_POST:
                    self.posts[(s, action.version)] = st.clock
                    self.wake_appliers()
            st.pos += 1

    def wake_appliers(self):
        for q, other in enumerate(self.stages):
            if other.tied_needs is not None and all(n in self.posts for n in other.tied_needs):
                self.enqueue(q)

    def try_pair(self, s):
        st = self.stages[s]
        offset, wanted = P2P_PARTNER[st.head.kind]
        q = s + offset
        other = self.stages[q]
        if not (other.at_p2p and other.head.kind is wanted):
            return
        sender, receiver = (s, q) if st.head.kind in (Kind.SEND_ACT, Kind.SEND_GRAD) else (q, s)
        snd, rcv = self.stages[sender], self.stages[receiver]
        send, recv = snd.head, rcv.head
        if send.micro_batch != recv.micro_batch:
            (ts, i_s, _), (tr, i_r, _) = snd.ops[snd.pos], rcv.ops[rcv.pos]
            self.mismatches.append(f"stage {sender} tick {ts} instruction {i_s} ({format_action(send)}) paired with "
                                   f"stage {receiver} tick {tr} instruction {i_r} ({format_action(recv)})")
        end = self.handler.transfer(sender, send, receiver, recv, (snd.clock, rcv.clock))
        for x in (s, q):
            x_st = self.stages[x]
            x_st.clock, x_st.at_p2p = end, False
            x_st.pos += 1
            self.enqueue(x)

    def waits_for(self, s):
        st = self.stages[s]
        if st.at_p2p:
            return s + P2P_PARTNER[st.head.kind][0]
        return next(q for q, w in st.tied_needs if (q, w) not in self.posts)

    def execute(self):
        while self.ready:
            s = self.ready.popleft()
            st = self.stages[s]
            st.queued = False
            if st.at_p2p:
                continue  # woken by a partner that could not pair yet: nothing new
            self.run_local(s)
            if st.at_p2p:
                self.try_pair(s)
        stuck = [Stuck(s, st.ops[st.pos][0], st.ops[st.pos][1], st.head, self.waits_for(s))
                 for s, st in enumerate(self.stages) if not st.done]
        return Run([st.ops for st in self.stages], [st.pos for st in self.stages], [st.clock for st in self.stages],
                   stuck, self.mismatches)


def run_program(program, handler=None):
    """Execute ``program`` (``program[s]`` = stage ``s``'s ticks of actions) with ``handler`` (see the module
    docstring); returns a :class:`Run`. Never hangs: a deadlock is reported in :attr:`Run.stuck`.

    Raises ``ValueError`` for a p2p action without a neighbour stage, ``TypeError`` for a non-action."""
    return _Interpreter(program, handler or Handler()).execute()
