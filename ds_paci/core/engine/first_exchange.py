"""The start-up exchange: one first transfer on every process group PACI communicates on, in an order that cannot
deadlock, so that no communicator is ever created lazily in the middle of a PACI stream.

Why: on NCCL a communicator that was not created eagerly (torch without a bound ``device_id``) is created when a
rank issues its first operation on it, and creating it blocks that rank's host until every member of the
communicator has issued an operation on it too. In a stream that is a hidden rendezvous: with tied weights the last
stage's first tied ``irecv`` (posted inside its local step) waits for stage 0's first operation on that pair, while
stage 0's host waits in the finite check of its own local step for a gradient the last stage sends only after that
step: a deadlock (``tests/test_nccl_order.py`` shows it in the NCCL model of ``tests/nccl_model.py``). DeepSpeed
gives its pipeline neighbours such a first exchange in its constructor; this module gives one to every group.

Contract
--------
* **Items.** An :class:`Item` is a group with a key that orders it among all items of the world (the same key on
  every rank, computed from ranks only) and a kind: ``"pairs"`` (point-to-point groups: one exchange per pair of
  member ranks, so that a per-pair communicator exists for every pair that may talk) or ``"collective"`` (one
  one-element all-reduce: the group's communicator).
* **Order** (:func:`plan`). Every rank runs the items it belongs to by ascending key; inside a ``"pairs"`` item the
  pairs by ascending ``(low, high)`` rank, the lower rank sending first and then receiving, the higher the reverse.
  Deadlock-free for blocking rendezvous transports (gloo) and for NCCL's issue-ordered streams, with communicators
  created eagerly or lazily: take the smallest step, in that one global order, that some rank has not finished.
  Each of its members has finished every smaller step of its own, so it stands at this one (or passes it once the
  others arrive): every member reaches it, and it completes.
* **Cost.** One one-element tensor per pair and direction, once per engine; :func:`run` returns what it did
  (``paci_stats()["first_exchange"]``).
"""

from dataclasses import dataclass
from typing import Tuple

import torch
import torch.distributed as tdist

__all__ = ["Item", "plan", "run", "engine_items", "run_for", "link_key"]

PIPE, DATA_PARALLEL, TIED, LOSS_CHANNEL, LINK = 0, 1, 2, 3, 4  # the first field of an item's key


def link_key(direction, a, b):
    """The key of the two-rank group of non-blocking transfers between ranks ``a`` and ``b`` in ``direction``
    (``"act"`` or ``"grad"``; :mod:`ds_paci.core.engine.transfers`)."""
    return (LINK, (min(a, b), max(a, b)), direction)


@dataclass(frozen=True)
class Item:
    """One group's first exchange: ``key`` = ``(kind of group, ranks)`` orders the items of the world; ``ranks``: the
    global ranks of the group that take part; ``kind``: ``"pairs"`` or ``"collective"``; ``group``: the process group
    (``None``: the default group)."""

    key: Tuple
    ranks: Tuple[int, ...]
    kind: str
    group: object = None


def plan(items, me):
    """What rank ``me`` runs, in order: ``[(op, peer_or_ranks, item)]`` with ``op`` in ``send``, ``recv``, ``coll``
    (see the module docstring)."""
    out = []
    for item in sorted(items, key=lambda i: i.key):
        ranks = sorted(set(item.ranks))
        if me not in ranks or len(ranks) < 2:
            continue
        if item.kind == "collective":
            out.append(("coll", tuple(ranks), item))
            continue
        if item.kind != "pairs":
            raise ValueError(f"unknown kind of first exchange {item.kind!r} (pairs or collective)")
        for low in ranks:
            for high in ranks:
                if low < high and me in (low, high):
                    peer = high if me == low else low
                    ops = ("send", "recv") if me == low else ("recv", "send")
                    out += [(op, peer, item) for op in ops]
    return out


def run(items, me, device):
    """Run :func:`plan` for rank ``me``: blocking ``send``/``recv``/``all_reduce`` of one element (on the CPU for a
    gloo group, on ``device`` otherwise). Returns ``{"pairs": n, "collectives": n, "groups": n}``."""
    done = {"pairs": 0, "collectives": 0, "groups": 0}
    seen = set()
    for op, peer, item in plan(items, me):
        on = torch.device("cpu") if tdist.get_backend(item.group) == "gloo" else device
        buf = torch.zeros(1, device=on)
        if op == "coll":
            tdist.all_reduce(buf, group=item.group)
            done["collectives"] += 1
        elif op == "send":
            tdist.send(buf, peer, group=item.group)
        else:
            tdist.recv(buf, peer, group=item.group)
            done["pairs"] += 1
        if item.key not in seen:
            seen.add(item.key)
            done["groups"] += 1
    return done


def engine_items(engine, loss_group):
    """Every group ``engine``'s rank communicates on: its pipeline neighbours (the default group), its data-parallel
    group, its tied-owner groups (``engine._tied``), its non-blocking transfers' link groups (``engine._transfers``)
    and its loss side channel (``loss_group``: ``(group, ranks)`` of
    :func:`~ds_paci.core.engine.loss_channel.pipeline_groups`)."""
    items = []
    me, stage = engine.global_rank, engine.stage_id
    for other in (stage - 1, stage + 1):
        if 0 <= other < engine.num_stages:
            pair = tuple(sorted((me, engine.grid.stage_to_global(stage_id=other))))
            items.append(Item((PIPE, pair), pair, "pairs"))
    if engine.dp_world_size > 1:
        group = engine.grid.get_data_parallel_group()
        ranks = tuple(sorted(tdist.get_process_group_ranks(group)))
        items.append(Item((DATA_PARALLEL, ranks), ranks, "collective", group))
    for ex in (engine._tied.exchanges if engine._tied is not None else ()):
        ranks = tuple(sorted(ex.ranks))
        items.append(Item((TIED, ranks), ranks, "pairs", ex.group))
    if getattr(engine, "_transfers", None) is not None:  # the non-blocking transfers' two-rank link groups
        items += engine._transfers.items()
    group, ranks = loss_group
    if group is not None:
        ranks = tuple(sorted(ranks))
        items.append(Item((LOSS_CHANNEL, ranks), ranks, "pairs", group))
    return items


def run_for(engine, loss_group):
    """:func:`run` of :func:`engine_items` on ``engine``'s rank (what the engine's constructor calls)."""
    return run(engine_items(engine, loss_group), engine.global_rank, engine.device)
