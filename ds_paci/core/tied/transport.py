"""The tied exchange's transport: one window's point-to-point messages to every other owner, issued in an order
that cannot deadlock under NCCL's in-order matching (peers by ascending rank, the lower rank of each pair sending
first; the argument is in :mod:`ds_paci.core.tied.weights`), and one exchange's state (its owners, parameters and the
windows in flight)."""

from collections import deque

import torch.distributed as tdist

__all__ = ["Received", "posting_order", "post_ordered", "Exchange"]


class Received:
    """A receive that has completed (waited for at a drain, or a pending window restored from a checkpoint)."""

    def wait(self):
        return True

    def is_completed(self):
        return True


def posting_order(me, peers):
    """``[(op, peer)]`` in the order rank ``me`` issues one window's transfers: peers by ascending rank, with
    each the lower rank ``"send"`` first, the higher ``"recv"`` first (see the module docstring)."""
    out = []
    for r in sorted(peers):
        out += [("send", r), ("recv", r)] if me < r else [("recv", r), ("send", r)]
    return out


def post_ordered(me, peers, payload, buffers, group, tag):
    """Issue the transfers of one message to every peer in :func:`posting_order`; ``{peer: (send, recv)}``."""
    works = {}
    for op, r in posting_order(me, peers):
        send, recv = works.get(r, (None, None))
        if op == "send":
            send = tdist.isend(payload, dst=r, group=group, tag=tag)
        else:
            recv = tdist.irecv(buffers[r], src=r, group=group, tag=tag)
        works[r] = (send, recv)
    return works


class Exchange:
    """The tied parameters this rank shares with one set of owner ranks, and the windows in flight."""

    def __init__(self, ranks, stages, group, keys, params, me):
        self.ranks = ranks  # global ranks of the owners, in stage order
        self.stages = stages
        self.group = group
        self.keys = keys
        self.params = params
        self.peers = sorted(r for r in ranks if r != me)
        self.numel = sum(p.numel() for p in params)
        self.device = params[0].device
        self.pending = {}  # version -> {"own": message, "recv": {rank: (work, message)}}
        self.sends = {r: deque() for r in self.peers}  # (version, work, message), oldest first
