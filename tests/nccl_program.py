"""Each rank's communication operations for a whole run, derived from the lowered program the engine runs, in the
operation language of ``tests/nccl_model.py``.

The run: ``P`` stages times ``D`` data-parallel replicas (global rank ``s * D + d``, DeepSpeed's pipe-major
topology), a list of engine calls (``"train"``, ``"eval"``, ``"save"``, ``"close"``), each lowered per stage exactly
as :meth:`PACIPipelineEngine.lower` lowers it (the same :class:`PACIStream`, windows, lag and passes). What each
action and each call issues (and where the host waits), as the engine does it on NCCL:

* ``SA``/``RA``/``SG``/``RG``: DeepSpeed's blocking ``p2p.send``/``p2p.recv`` on the default group, i.e. torch's
  ``send``/``recv``: enqueued on the communicator's stream, the compute stream waits for them, the host does not.
  The first ``SA`` of a rank sends the activation's shape first, and the first ``RA`` receives it and reads it on
  the host (DeepSpeed's ``_recv_tensor_meta``); eval resets them (its own first call).
* ``LOAD`` (first and last stage): a blocking host-to-device copy, which waits for the compute stream: ``sync``.
* ``STEP``: the data-parallel reduce (a collective, ``D > 1``), then the finite check: ``sync``. A tied owner in
  async mode then posts its window to every other owner in :func:`~ds_paci.core.tied.transport.posting_order` on the
  tied group, waits for (and reads) the windows its ``TAPPLY`` names, and waits on its sends of windows
  ``<= v - L`` (all at a closing step). Sync mode with ``a = M``: DeepSpeed's tied all-reduce over the owners'
  group, then the reduce, then its step.
* End of a call: a tied owner's drain settles everything in flight (``sync``); the last stage averages the loss
  over its data-parallel group and reads it (``sync``). In sync mode it sends it to every other stage of its
  pipeline on the loss channel, and they wait for it; in async mode the channel never waits and is a gloo group
  (no NCCL stream), so it is left out.
* ``"eval"``: a drain that keeps the window, then DeepSpeed's ``InferenceSchedule`` (its own shape exchange) and the
  loss broadcast over the pipeline; ``"save"``: such a drain, then barriers on the world.

Start-up (``startup=``): DeepSpeed's constructor exchange with the pipeline neighbours and its broadcast over the
data-parallel group always; ``"ours"`` adds :func:`ds_paci.core.engine.first_exchange.plan` of every group the
engine lists (``PACIPipelineEngine._first_exchange_items``), ``"deepspeed"`` nothing more (before it existed).
"""

import itertools

from deepspeed.runtime.pipe.schedule import InferenceSchedule, TrainSchedule

from ds_paci.core.config import auto_window
from ds_paci.core.engine import first_exchange
from ds_paci.core.program.actions import Kind, from_deepspeed
from ds_paci.core.program.passes import lower_call
from ds_paci.core.program.stream import PACIStream
from ds_paci.core.program.tied_timing import tied_lag
from ds_paci.core.tied.transport import posting_order


def windows_of(P, M, window, owners, sync, slack=()):
    """Every stage's accumulation window, by the engine's rule (``"auto"`` per stage unless sync or tied)."""
    if window == "auto":
        per_stage = not sync and not owners
        return [auto_window(P, M, s if per_stage else None, len(slack)) for s in range(P)]
    return [window or M] * P


def lowered_calls(P, M, window, calls, owners=(), sync=False, nonblocking=False, slack=()):
    """``[(call, [stage s's lowered program])]``, as the engine lowers each call (``nonblocking``: the engine's
    ``"nonblocking_transfers"``, which sync mode ignores; ``slack``: ``"slack_links"``, refused in sync mode and with
    tied layers)."""
    if slack and (sync or owners):
        raise ValueError("the engine refuses slack links in sync mode and with tied layers")
    windows = windows_of(P, M, window, owners, sync, slack)
    streams = [PACIStream(P, s, windows[s], M, slack=slack) for s in range(P)]
    stock = [sync and windows[s] == M for s in range(P)]
    pending = {s: [] for s in owners}
    out = []
    for call in calls:
        programs = []
        for s, stream in enumerate(streams):
            if call == "train":
                ticks = stream.advance(2 * M)
                drain, carry = (stream.drain(stock[s]), not stock[s]) if sync else (None, False)
            else:
                ticks, drain, carry = [], stream.drain(close_window=call == "close"), call != "close"
            tied = None
            if s in pending and not stock[s]:
                tied = (list(pending[s]), tied_lag(P, owners, windows[s]))
            program = lower_call(ticks, drain, sync_steps=stock[s], tied=tied, carry=carry,
                                 nonblocking=nonblocking and not sync)
            if tied is not None:
                for a in (a for tick in program for a in tick):
                    if a.kind is Kind.TIED_POST:
                        pending[s].append(a.version)
                    elif a.kind is Kind.TIED_APPLY:
                        pending[s] = [w for w in pending[s] if w not in a.windows]
            programs.append(program)
        out.append((call, programs))
    return out, windows


class _Rank:
    """One rank's operations as they are derived."""

    def __init__(self, rank, ids):
        self.rank, self.ops, self._ids = rank, [], ids
        self.sent_meta = self.got_meta = False
        self.evals = self.calls = 0
        self.tied_sends, self.tied_recvs = {}, {}  # window -> {peer: op id}
        self.in_flight = {}  # non-blocking transfers: (direction, peer) -> the op id of its send not yet waited for

    def op(self, kind, peer, group="default", what=None):
        op_id = (next(self._ids), what)
        self.ops.append((kind, peer, op_id, group))
        return op_id

    def coll(self, members, group):
        if len(members) > 1:
            self.ops.append(("coll", tuple(members), (next(self._ids), "coll"), group))

    def block(self, op_id):
        self.ops.append(("block", op_id))

    def sync(self):
        self.ops.append(("sync",))


def link_group(kind, a, b, groups="link"):
    """The group of non-blocking transfers between ranks ``a`` and ``b`` in one direction (``"act"``: towards the
    later stage, ``"grad"``: towards the earlier one). ``groups``: ``"link"`` (the engine's: a two-rank group per
    link and direction), or the orders it replaces: ``"one"`` (the default group), ``"direction"`` (one group for
    all activations, one for all gradients)."""
    return {"link": f"{kind}{min(a, b)}-{max(a, b)}", "direction": kind, "one": "default"}[groups]


def derive(P, M, window, calls, D=1, owners=(), sync=False, startup="ours", nonblocking=False, groups="link",
           slack=()):
    """``{rank: operations}`` for the run (see the module docstring); ``startup``: ``"ours"`` or ``"deepspeed"``;
    ``nonblocking``: ``"paci": {"nonblocking_transfers": true}`` (async mode only; :func:`_nonblocking_call`), its
    transfers on ``groups`` (:func:`link_group`; only ``"link"`` groups get a start-up exchange of their own)."""
    nonblocking = nonblocking and not sync
    lowered, windows = lowered_calls(P, M, window, calls, owners, sync, nonblocking, slack)
    ids = itertools.count()
    rank = {(s, d): s * D + d for s in range(P) for d in range(D)}
    ranks = {r: _Rank(r, ids) for r in rank.values()}
    dp = {s: [rank[(s, d)] for d in range(D)] for s in range(P)}
    pipe = {d: [rank[(s, d)] for s in range(P)] for d in range(D)}
    tied = {d: sorted(rank[(s, d)] for s in owners) for d in range(D)}
    lags = [tied_lag(P, owners, w) for w in windows] if owners else None
    for (s, d), r in rank.items():
        me = ranks[r]
        me.groups = groups
        prev, nxt = rank.get((s - 1, d)), rank.get((s + 1, d))
        for first, peer in ((True, nxt), (False, prev)) if s % 2 == 0 else ((False, prev), (True, nxt)):
            if peer is not None:  # DeepSpeed's constructor: "Initialize pipeline communicators. Just send a 0."
                me.op("send" if first else "recv", peer, what="constructor")
        me.coll(dp[s], f"dp{s}")  # DeepSpeed broadcasts the model over the data-parallel group
        if startup == "ours":
            items = [first_exchange.Item((first_exchange.PIPE, (a, b)), (a, b), "pairs", "default")
                     for a, b in ((r, nxt), (prev, r)) if a is not None and b is not None]
            items.append(first_exchange.Item((first_exchange.DATA_PARALLEL, tuple(dp[s])), tuple(dp[s]), "collective",
                                             f"dp{s}"))
            if nonblocking and groups == "link":
                items += [first_exchange.Item(first_exchange.link_key(kind, a, b), (a, b), "pairs",
                                              link_group(kind, a, b))
                          for a, b in ((r, nxt), (prev, r)) if a is not None and b is not None
                          for kind in ("act", "grad")]
            if s in owners:
                items.append(first_exchange.Item((first_exchange.TIED, tuple(tied[d])), tuple(tied[d]), "pairs",
                                                 f"tied{d}"))
            items.append(first_exchange.Item((first_exchange.LOSS_CHANNEL, tuple(pipe[d])), tuple(pipe[d]), "pairs",
                                             f"loss{d}"))
            for op, peer, item in first_exchange.plan(items, r):
                if op == "coll":
                    me.coll(peer, item.group)
                else:
                    me.op(op, peer, item.group, ("first", item.key))
        me.sync()
    for call, programs in lowered:
        for (s, d), r in rank.items():
            _call(ranks[r], s, d, P, M, call, programs[s], rank, dp, pipe, tied, sync, windows[s] == M,
                  lags[s] if lags else None, nonblocking)
    return {r: x.ops for r, x in ranks.items()}


def _p2p(me, a, s, d, rank, phase="train"):
    """A pipeline transfer action of stage ``s``: DeepSpeed's blocking send/recv on the default group. Each operation
    is labelled with what it carries (matched transfers must carry the same)."""
    what = (phase, a.kind in (Kind.SEND_ACT, Kind.RECV_ACT), a.micro_batch)
    if a.kind is Kind.SEND_ACT:
        if not me.sent_meta:
            me.sent_meta = True
            me.op("send", rank[(s + 1, d)], what=(phase, "shape"))
        me.op("send", rank[(s + 1, d)], what=what)
    elif a.kind is Kind.RECV_ACT:
        if not me.got_meta:
            me.got_meta = True
            me.block(me.op("recv", rank[(s - 1, d)], what=(phase, "shape")))
        me.op("recv", rank[(s - 1, d)], what=what)
    elif a.kind is Kind.SEND_GRAD:
        me.op("send", rank[(s - 1, d)], what=what)
    elif a.kind is Kind.RECV_GRAD:
        me.op("recv", rank[(s + 1, d)], what=what)


_LINK = {Kind.SEND_ACT: ("act", +1), Kind.RECV_ACT: ("act", -1), Kind.SEND_GRAD: ("grad", -1),
         Kind.RECV_GRAD: ("grad", +1)}


def _nonblocking_call(me, s, d, program, rank, drains):
    """The engine's non-blocking transfers (:mod:`ds_paci.core.engine.transfers`) over one call's ``program``:
    ``{action index: [operations]}`` to issue at each transfer action, and the operations at the end of the call.

    Each link and direction has its two-rank group (:func:`link_group`). Receives: the call's first of each
    direction is posted at the call's start (the first activation's shape is received there first, on the default
    group, as DeepSpeed does; a gradient's only once an activation was sent since the last reset, else at its
    action), the next when the current one is waited for, right before its compute; none crosses the end of a
    call. Sends: an ``isend`` at the hoisted position, after waiting for the previous send on the same
    link; the last one of each link is waited for at the end of a call that drains."""
    actions = [a for tick in program for a in tick]
    recvs = {kind: [n for n, a in enumerate(actions) if a.kind is kind] for kind in (Kind.RECV_ACT, Kind.RECV_GRAD)}
    posted, at, start = {}, {}, []

    def post(kind, index, into):
        if index < len(recvs[kind]):
            a = actions[recvs[kind][index]]
            name, step = _LINK[kind]
            peer = rank[(s + step, d)]
            if kind is Kind.RECV_ACT and not me.got_meta:
                me.got_meta = True
                into.append(("block", _queue(into, me, "recv", peer, "default", ("train", "shape"))))
            posted[kind] = _queue(into, me, "irecv", peer, link_group(name, me.rank, peer, me.groups),
                                  ("train", name == "act", a.micro_batch))

    for kind in recvs:  # a gradient's buffers take their shapes from an activation sent since the last reset
        if kind is Kind.RECV_ACT or me.sent_meta:
            post(kind, 0, start)
    for n, a in enumerate(actions):
        if a.kind not in _LINK:
            continue
        ops = at[n] = []
        name, step = _LINK[a.kind]
        peer = rank[(s + step, d)]
        group = link_group(name, me.rank, peer, me.groups)
        if a.kind in recvs:
            if a.kind not in posted:
                post(a.kind, recvs[a.kind].index(n), ops)
            ops.append(("block", posted.pop(a.kind)))
            post(a.kind, recvs[a.kind].index(n) + 1, ops)
            continue
        if a.kind is Kind.SEND_ACT and not me.sent_meta:
            me.sent_meta = True
            _queue(ops, me, "send", peer, "default", ("train", "shape"))
        if (name, peer) in me.in_flight:
            ops.append(("block", me.in_flight.pop((name, peer))))
        me.in_flight[(name, peer)] = _queue(ops, me, "isend", peer, group, ("train", name == "act", a.micro_batch))
    end = []
    if drains:
        end = [("block", op_id) for op_id in me.in_flight.values()]
        me.in_flight.clear()
    return start, at, end


def _queue(into, me, kind, peer, group, what):
    op_id = (next(me._ids), what)
    into.append((kind, peer, op_id, group))
    return op_id


def _call(me, s, d, P, M, call, program, rank, dp, pipe, tied, sync, full_window, lag, nonblocking=False):
    owner = me.rank in tied[d]
    stock = sync and full_window
    peers = [q for q in tied[d] if q != me.rank]
    plan = {}  # the next step's TPOST/TAPPLY
    if nonblocking:
        start, at, end = _nonblocking_call(me, s, d, program, rank, drains=call != "train")
        me.ops += start
    for n, a in enumerate(a for tick in program for a in tick):
        if a.kind in (Kind.SEND_ACT, Kind.RECV_ACT, Kind.SEND_GRAD, Kind.RECV_GRAD):
            if nonblocking:
                me.ops += at[n]
            else:
                _p2p(me, a, s, d, rank)
        elif a.kind is Kind.LOAD:
            me.sync()
        elif a.kind is Kind.TIED_POST:
            plan = {"post": a.version, "apply": (), "all": False}
        elif a.kind is Kind.TIED_APPLY:
            plan.update(apply=a.windows, all=a.apply_all)
        elif a.kind is Kind.STEP:
            if stock and owner:
                me.coll(tied[d], f"ds_tied{d}")
            me.coll(dp[s], f"dp{s}")
            me.sync()
            if owner and not stock:
                assert plan.get("post") == a.version, (s, a, plan)
                for op, peer in posting_order(me.rank, peers):
                    into = me.tied_sends if op == "send" else me.tied_recvs
                    into.setdefault(a.version, {})[peer] = me.op("i" + op, peer, f"tied{d}", ("tied", a.version))
                for w in plan["apply"]:
                    for peer in peers:
                        me.block(me.tied_recvs[w][peer])
                    del me.tied_recvs[w]
                    me.sync()  # reading the total's verdict
                for w in sorted(me.tied_sends):
                    if plan["all"] or w <= a.version - lag:
                        for peer in peers:
                            me.block(me.tied_sends[w][peer])
                        del me.tied_sends[w]
                plan = {}
    if nonblocking:
        me.ops += end
    if owner and not stock and (call != "train" or sync):
        me.sync()  # finish_drain: every pending receive and send of the exchange is waited for
    if call == "eval":  # DeepSpeed's eval_batch: a new shape exchange, a barrier, its schedule, the loss broadcast
        me.sent_meta = me.got_meta = False
        me.coll(sorted(rank.values()), "default")
        sched = from_deepspeed(s, list(InferenceSchedule(micro_batches=M, stages=P, stage_id=s)))
        for a in (a for tick in sched for a in tick):
            if a.kind is Kind.LOAD:
                me.sync()
            else:
                _p2p(me, a, s, d, rank, phase=("eval", me.evals))
        me.evals += 1
        me.coll(pipe[d], f"pipe{d}")
    if call == "save":  # the atomic checkpoint's barriers on the world
        me.coll(sorted(rank.values()), "default")
    last = s == P - 1
    if last:
        me.coll(dp[s], f"dp{s}")
        me.sync()
    if sync and P > 1:  # the loss channel: waited for in sync mode only
        if last:
            for q in pipe[d][:-1]:
                me.op("send", q, f"loss{d}", ("loss", me.calls))
        else:
            me.block(me.op("recv", pipe[d][-1], f"loss{d}", ("loss", me.calls)))
    me.calls += 1


def deepspeed_train_schedule(P, M, batches=2, D=1, owners=()):
    """DeepSpeed's own ``TrainSchedule`` (the sanity case), ``batches`` times, with its constructor's exchange."""
    ids = itertools.count()
    rank = {(s, d): s * D + d for s in range(P) for d in range(D)}
    ranks = {r: _Rank(r, ids) for r in rank.values()}
    dp = {s: [rank[(s, d)] for d in range(D)] for s in range(P)}
    tied = {d: sorted(rank[(s, d)] for s in owners) for d in range(D)}
    for (s, d), r in rank.items():
        me = ranks[r]
        prev, nxt = rank.get((s - 1, d)), rank.get((s + 1, d))
        for first, peer in ((True, nxt), (False, prev)) if s % 2 == 0 else ((False, prev), (True, nxt)):
            if peer is not None:
                me.op("send" if first else "recv", peer, what="constructor")
        me.coll(dp[s], f"dp{s}")
        me.sync()
        for _ in range(batches):
            for a in (a for tick in from_deepspeed(s, list(TrainSchedule(micro_batches=M, stages=P, stage_id=s)))
                      for a in tick):
                if a.kind is Kind.LOAD:
                    me.sync()
                elif a.kind is Kind.REDUCE_TIED:
                    if r in tied[d]:
                        me.coll(tied[d], f"ds_tied{d}")
                elif a.kind is Kind.REDUCE_GRADS:
                    me.coll(dp[s], f"dp{s}")
                elif a.kind is Kind.STEP:
                    me.sync()
                else:
                    _p2p(me, a, s, d, rank)
    return {r: x.ops for r, x in ranks.items()}
