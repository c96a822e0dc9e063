"""A model of NCCL's point-to-point semantics, to check transfer orders without a GPU.

What it models (NCCL's documented behaviour for ungrouped ``ncclSend``/``ncclRecv``, as torch issues
``send``/``recv``/``isend``/``irecv``, and for collectives): every operation is enqueued on the stream of a
communicator and runs in issue order on that stream; a point-to-point operation completes only when its
counterpart on the peer runs at the same time (NCCL matches the n-th send from ``a`` to ``b`` on a communicator
with the n-th receive at ``b`` from ``a`` on it; tags are ignored); a collective completes when it is at the head
of every member's stream. Every process group has communicators of its own. ``streams="pair"``: point-to-point
calls of a group run on one communicator (stream) per pair of ranks, as torch creates for single
point-to-point calls; ``"group"``: on the group's communicator, one stream per rank for all its peers (what torch
does once the group's communicator exists, e.g. created eagerly). Collectives always use the group's.

Communicators (``communicators=``): ``"eager"``: all exist before the programs start (torch with a bound
``device_id``, as DeepSpeed 0.19.8 asks on CUDA). ``"lazy"``: a communicator is created when a rank issues its
first operation on it, and creating it is itself a rendezvous: that rank's host blocks until every member of the
communicator (both ranks of a pair; all of a group) has reached an operation on it (``ncclCommInitRank``).

A program is a list of operations:

* ``("send"|"recv", peer, op_id)`` or ``("send"|"recv", peer, op_id, group)``: point to point (group
  ``"default"`` when omitted), waited for by the compute stream (torch's blocking ``send``/``recv``, or an
  ``isend``/``irecv`` whose ``wait()`` follows at once);
* ``("isend"|"irecv", peer, op_id, group)``: the same, never waited for by the compute stream until a ``block``
  names it (an ``isend``/``irecv`` whose ``wait()`` comes later);
* ``("coll", members, op_id, group)``: a collective of the ranks ``members`` (a tuple) on ``group``;
* ``("block", op_id)``: the host waits for that operation to complete (a ``wait()`` followed by reading the
  result, e.g. ``bool(isfinite(total).all())``) before it issues anything else;
* ``("sync",)``: the host waits for every operation it issued so far except the ``isend``/``irecv`` not yet
  blocked on (reading a value the compute stream produced, e.g. a local step's finite check).
"""


def _comm(op, rank, streams):
    """The communicator an operation of ``rank`` runs on, and its members."""
    if op[0] == "coll":
        return ("coll", op[3]), tuple(sorted(op[1]))
    group = op[3] if len(op) > 3 else "default"
    if streams == "pair":
        pair = (min(rank, op[1]), max(rank, op[1]))
        return ("pair", group, pair), pair
    return ("group", group), None  # members: every rank that uses the group


def run(programs, streams="pair", communicators="eager", matches=None):
    """``programs``: ``{rank: [operation, ...]}`` (see the module docstring). ``matches``: a list to which every
    completed point-to-point transfer is appended as ``(send's op_id, receive's op_id)``.

    Returns ``None`` when every operation completes, else a line naming what each stuck rank waits for.
    """
    if streams not in ("pair", "group") or communicators not in ("eager", "lazy"):
        raise ValueError(f"streams must be pair or group, communicators eager or lazy: {streams!r}, "
                         f"{communicators!r}")
    group_members = {}
    for r, prog in programs.items():
        for op in prog:
            if op[0] in ("send", "recv", "isend", "irecv"):
                group = op[3] if len(op) > 3 else "default"
                group_members.setdefault(group, set()).update((r, op[1]))
    pos = {r: 0 for r in programs}
    queues = {}  # (rank, comm) -> entries in issue order
    ordinal = {}
    done = set()
    issued = {r: [] for r in programs}  # the operations the compute stream waits for, in issue order
    synced = {r: 0 for r in programs}  # how many of them a sync found complete
    created = set()
    arrived = {}  # comm -> ranks whose host waits to create it

    def members_of(comm, members):
        return members if members is not None else tuple(sorted(group_members[comm[1]]))

    progress = True
    while progress:
        progress = False
        for r, prog in programs.items():  # hosts issue until they block
            while pos[r] < len(prog):
                op = prog[pos[r]]
                if op[0] == "block":
                    if op[1] not in done:
                        break
                elif op[0] == "sync":
                    while synced[r] < len(issued[r]) and issued[r][synced[r]] in done:
                        synced[r] += 1
                    if synced[r] < len(issued[r]):
                        break
                else:
                    comm, members = _comm(op, r, streams)
                    if communicators == "lazy" and comm not in created:
                        waiting = arrived.setdefault(comm, set())
                        if r not in waiting:
                            waiting.add(r)
                            progress = True
                        if waiting < set(members_of(comm, members)):
                            break
                        created.add(comm)
                    if op[0] == "coll":
                        n = ordinal[(comm, "coll", r)] = ordinal.get((comm, "coll", r), 0) + 1
                        entry = ("coll", members, n, None, op[2])
                    else:
                        kind, peer, op_id = op[0].lstrip("i"), op[1], op[2]
                        src, dst = (r, peer) if kind == "send" else (peer, r)
                        n = ordinal[(comm, src, dst, kind)] = ordinal.get((comm, src, dst, kind), 0) + 1
                        entry = (kind, src, dst, n, op_id)
                    queues.setdefault((r, comm), []).append(entry)
                    if op[0] in ("send", "recv", "coll"):
                        issued[r].append(op[2])
                pos[r] += 1
                progress = True
        for (rank, comm), q in list(queues.items()):  # streams run their head operation when its counterparts can
            if not q:
                continue
            head = q[0]
            if head[0] == "coll":
                others = [queues.get((m, comm), []) for m in head[1]]
                if all(o and o[0][:3] == head[:3] for o in others):
                    for o in others:
                        done.add(o.pop(0)[4])
                    progress = True
                continue
            kind, src, dst, n, op_id = head
            other = "recv" if kind == "send" else "send"
            peer_rank = dst if kind == "send" else src
            pq = queues.get((peer_rank, comm), [])
            if pq and pq[0][:4] == (other, src, dst, n):
                if matches is not None:
                    matches.append((op_id, pq[0][4]) if kind == "send" else (pq[0][4], op_id))
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
