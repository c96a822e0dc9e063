"""Record every torch.distributed call a process makes (op name, the global ranks of its group, peer).

Each record is a :class:`Call` ``(op, ranks, peer, default_group)``; ``default_group`` tells the
default (world) group, which the pipeline's own transfers use, from a dedicated group with the
same ranks.
"""

import contextlib
from typing import NamedTuple, Optional, Tuple

import torch.distributed as tdist

COLLECTIVES = [
    "all_reduce", "all_reduce_coalesced", "broadcast", "broadcast_object_list", "barrier", "monitored_barrier",
    "all_gather", "all_gather_into_tensor", "all_gather_object", "_all_gather_base", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "_reduce_scatter_base", "all_to_all", "all_to_all_single", "scatter", "gather",
    "batch_isend_irecv"
]
POINT_TO_POINT = ["send", "recv", "isend", "irecv"]


class Call(NamedTuple):
    op: str
    ranks: Tuple[int, ...]
    peer: Optional[int]
    default_group: bool


def _is_default(group):
    return group is None or group is tdist.GroupMember.WORLD


def _group_ranks(group):
    if group is None or group is tdist.GroupMember.WORLD:
        return tuple(range(tdist.get_world_size()))
    return tuple(tdist.get_process_group_ranks(group))


@contextlib.contextmanager
def record_distributed_calls():
    """Yields a list that fills with a :class:`Call` for every call made inside the block."""
    calls = []
    originals = {}

    def wrap(name, fn):

        def spy(*args, **kwargs):
            group = kwargs.get("group")
            peer = None
            if name in POINT_TO_POINT:
                peer = kwargs.get("dst", kwargs.get("src"))
                if peer is None and len(args) > 1:
                    peer = args[1]
            calls.append(Call(name, _group_ranks(group), peer, _is_default(group)))
            return fn(*args, **kwargs)

        return spy

    for name in COLLECTIVES + POINT_TO_POINT:
        if hasattr(tdist, name):
            originals[name] = getattr(tdist, name)
            setattr(tdist, name, wrap(name, originals[name]))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(tdist, name, fn)


def cross_stage_collectives(calls, stage_of_rank):
    """The collectives among ``calls`` whose group holds ranks of more than one pipeline stage."""
    return [(c.op, c.ranks) for c in calls if c.op in COLLECTIVES and len({stage_of_rank[r] for r in c.ranks}) > 1]
