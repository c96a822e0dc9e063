"""A model of NCCL's point-to-point semantics, to check the tied exchange's transfer order without a GPU.

What it models (NCCL's documented behaviour for ungrouped ``ncclSend``/``ncclRecv``, as torch issues
``isend``/``irecv``): every operation is enqueued on the stream of a communicator and runs in issue
order on that stream; an operation completes only when its counterpart on the peer runs at the same
time (NCCL matches the n-th send from ``a`` to ``b`` with the n-th receive at ``b`` from ``a``; tags are
ignored). ``streams="pair"``: one communicator (stream) per pair of ranks, as torch creates for single
point-to-point calls; ``"group"``: one stream per rank for all its peers (the group's communicator).
A program may also ``("block", op_id)``: the host waits for that operation to complete (a ``wait()``
followed by reading the result, e.g. ``bool(isfinite(total).all())``) before it issues anything else.
"""


def run(programs, streams="pair"):
    """``programs``: ``{rank: [("send"|"recv", peer, op_id) | ("block", op_id)]}``.

    Returns ``None`` when every operation completes, else a line naming what each stuck rank waits for.
    """
    pos = {r: 0 for r in programs}
    queues = {}
    ordinal = {}
    posted = {}  # (src, dst, kind, n) -> (rank, stream key)
    done = set()
    where = {}

    def key(rank, peer):
        return (rank, min(rank, peer), max(rank, peer)) if streams == "pair" else (rank,)

    progress = True
    while progress:
        progress = False
        for r, prog in programs.items():  # hosts issue until they block
            while pos[r] < len(prog):
                op = prog[pos[r]]
                if op[0] == "block":
                    if op[1] not in done:
                        break
                else:
                    kind, peer, op_id = op
                    src, dst = (r, peer) if kind == "send" else (peer, r)
                    n = ordinal[(src, dst, kind)] = ordinal.get((src, dst, kind), 0) + 1
                    entry = (kind, src, dst, n, op_id)
                    queues.setdefault(key(r, peer), []).append(entry)
                    where[entry] = key(r, peer)
                pos[r] += 1
                progress = True
        for k, q in list(queues.items()):  # streams run their head operation when the counterpart is at its head
            if not q:
                continue
            kind, src, dst, n, op_id = q[0]
            other = "recv" if kind == "send" else "send"
            peer_rank = dst if kind == "send" else src
            peer_key = key(peer_rank, k[0]) if streams == "pair" else (peer_rank,)
            pq = queues.get(peer_key, [])
            if pq and pq[0][:4] == (other, src, dst, n):
                done.add(op_id)
                done.add(pq[0][4])
                q.pop(0)
                pq.pop(0)
                progress = True
    stuck = [f"rank {r} at {programs[r][pos[r]]}" for r in programs if pos[r] < len(programs[r])]
    stuck += [f"stream {k} at {q[0][:4]}" for k, q in queues.items() if q]
    return "; ".join(stuck) or None


def exchange_programs(ranks, windows, lag, order):
    """The tied exchange as each owner runs it: per window, post to every peer in ``order(me, peers)``, then block
    on the peers' messages of window ``k - lag`` and on its own sends of that window; the last window waits on all."""
    programs = {}
    for me in ranks:
        peers = [r for r in ranks if r != me]
        prog = []
        for k in range(1, windows + 1):
            for op, peer in order(me, peers):
                prog.append((op, peer, (me, op, peer, k)))
            due = range(1, windows + 1) if k == windows else [k - lag] if k - lag >= 1 else []
            for v in due:
                for peer in peers:
                    prog += [("block", (me, "recv", peer, v)), ("block", (me, "send", peer, v))]
        programs[me] = prog
    return programs


def recv_first(me, peers):
    """The order of the tied exchange before issue 16: for each peer, receive, then send."""
    return [x for r in sorted(peers) for x in (("recv", r), ("send", r))]
