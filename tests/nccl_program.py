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


def windows_of(P, M, window, owners, sync):
    """Every stage's accumulation window, by the engine's rule (``"auto"`` per stage unless sync or tied)."""
    if window == "auto":
        per_stage = not sync and not owners
        return [auto_window(P, M, s if per_stage else None) for s in range(P)]
    return [window or M] * P


def lowered_calls(P, M, window, calls, owners=(), sync=False):
    """``[(call, [stage s's lowered program])]``, as the engine lowers each call."""
    windows = windows_of(P, M, window, owners, sync)
    streams = [PACIStream(P, s, windows[s], M) for s in range(P)]
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
            program = lower_call(ticks, drain, sync_steps=stock[s], tied=tied, carry=carry)
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


def derive(P, M, window, calls, D=1, owners=(), sync=False, startup="ours"):
    """``{rank: operations}`` for the run (see the module docstring); ``startup``: ``"ours"`` or ``"deepspeed"``."""
    lowered, windows = lowered_calls(P, M, window, calls, owners, sync)
    ids = itertools.count()
    rank = {(s, d): s * D + d for s in range(P) for d in range(D)}
    ranks = {r: _Rank(r, ids) for r in rank.values()}
    dp = {s: [rank[(s, d)] for d in range(D)] for s in range(P)}
    pipe = {d: [rank[(s, d)] for s in range(P)] for d in range(D)}
    tied = {d: sorted(rank[(s, d)] for s in owners) for d in range(D)}
    lags = [tied_lag(P, owners, w) for w in windows] if owners else None
    for (s, d), r in rank.items():
        me = ranks[r]
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
                  lags[s] if lags else None)
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


def _call(me, s, d, P, M, call, program, rank, dp, pipe, tied, sync, full_window, lag):
    owner = me.rank in tied[d]
    stock = sync and full_window
    peers = [q for q in tied[d] if q != me.rank]
    plan = {}  # the next step's TPOST/TAPPLY
    for a in (a for tick in program for a in tick):
        if a.kind in (Kind.SEND_ACT, Kind.RECV_ACT, Kind.SEND_GRAD, Kind.RECV_GRAD):
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


def hoisted_nonblocking(P, M, window, calls, groups):
    """A candidate order for non-blocking pipeline transfers (issue 27 item 3, step B; the engine does not run it
    yet), per rank of one pipeline: each activation ``isend`` right after its forward, each gradient ``isend`` right
    after its backward (before a step), each ``irecv`` posted one micro-batch ahead (the next is posted when the
    current one is waited for, just before its forward or backward), at most one send in flight per link (the
    previous send is waited for before the next is issued), the lowered program's ``LOAD`` and ``STEP`` host syncs.

    ``groups``: ``"one"`` (every transfer on the default group), ``"direction"`` (one group for all activations, one
    for all gradients), ``"link"`` (a two-rank group per link and direction, ``act<s>``: ``s -> s+1``, ``grad<s>``:
    ``s+1 -> s``, each with its start-up exchange of :func:`first_exchange.plan`)."""
    lowered, _ = lowered_calls(P, M, window, calls)
    ids = itertools.count()

    def group(kind, a, b):
        low = min(a, b)
        return {"one": "default", "direction": kind, "link": f"{kind}{low}"}[groups]

    programs = {}
    for s in range(P):
        me = _Rank(s, ids)
        if groups == "link":
            items = [first_exchange.Item((first_exchange.PIPE, kind, low), (low, low + 1), "pairs", f"{kind}{low}")
                     for low in (s - 1, s) if 0 <= low < P - 1 for kind in ("act", "grad")]
            for op, peer, item in first_exchange.plan(items, s):
                me.op(op, peer, item.group, ("first", item.key))
        actions = [a for _, programs_ in lowered for tick in programs_[s] for a in tick]
        order = {kind: [a.micro_batch for a in actions if a.kind is kind] for kind in (Kind.FORWARD, Kind.BACKWARD)}
        posted, last_send = {}, {}
        links = {Kind.FORWARD: (s - 1, s + 1, "act"), Kind.BACKWARD: (s + 1, s - 1, "grad")}

        def post(kind, index):
            src, _, name = links[kind]
            if 0 <= src < P and index < len(order[kind]):
                m = order[kind][index]
                posted[(kind, m)] = me.op("irecv", src, group(name, s, src), (name, m))

        for kind in links:
            post(kind, 0)
        for a in actions:
            if a.kind in links:
                src, dst, name = links[a.kind]
                if 0 <= src < P:
                    me.block(posted.pop((a.kind, a.micro_batch)))
                    post(a.kind, order[a.kind].index(a.micro_batch) + 1)
                if 0 <= dst < P:
                    if name in last_send:
                        me.block(last_send[name])
                    last_send[name] = me.op("isend", dst, group(name, s, dst), (name, a.micro_batch))
            elif a.kind in (Kind.LOAD, Kind.STEP):
                me.sync()
        for op_id in last_send.values():
            me.block(op_id)
        programs[s] = me.ops
    return programs
