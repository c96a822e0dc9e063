"""Record every torch.distributed call a process makes (op name, the global ranks of its group, peer).

Each record is a :class:`Call`: it unpacks as ``(op, ranks, peer)`` and its ``default_group``
tells the default (world) group, which the pipeline's own transfers use, from a dedicated group
with the same ranks; ``group`` is a token naming the group object (:func:`group_token`), so two
dedicated groups with the same ranks (e.g. the loss side channel and the tied exchange on two
stages) can be told apart.
"""

import contextlib

import torch.distributed as tdist

COLLECTIVES = [
    "all_reduce", "all_reduce_coalesced", "broadcast", "broadcast_object_list", "barrier", "monitored_barrier",
    "all_gather", "all_gather_into_tensor", "all_gather_object", "_all_gather_base", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "_reduce_scatter_base", "all_to_all", "all_to_all_single", "scatter", "gather",
    "batch_isend_irecv"
]
POINT_TO_POINT = ["send", "recv", "isend", "irecv"]


class Call(tuple):
    """One recorded call: unpacks as ``(op, ranks, peer)``; ``default_group`` says whether it used the default group."""

    def __new__(cls, op, ranks, peer, default_group, group=None):
        self = super().__new__(cls, (op, ranks, peer))
        self.default_group = default_group
        self.group = group
        return self

    def __getnewargs__(self):  # pickling (results travel between processes)
        return (*self, self.default_group, self.group)

    op = property(lambda self: self[0])
    ranks = property(lambda self: self[1])
    peer = property(lambda self: self[2])


def _is_default(group):
    return group is None or group is tdist.GroupMember.WORLD


def group_token(group):
    """``"world"`` for the default group, else a token unique to the group object within its process."""
    return "world" if _is_default(group) else f"group@{id(group):x}"


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
            calls.append(Call(name, _group_ranks(group), peer, _is_default(group), group_token(group)))
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


def side_channel_transfers(calls):
    """Point-to-point calls made on a group of their own (not the pipeline's default group)."""
    return [c for c in calls if c.op in POINT_TO_POINT and not c.default_group]


def pipeline_transfers(calls):
    """Point-to-point calls on the default group: the pipeline's activations and gradients."""
    return [c for c in calls if c.op in POINT_TO_POINT and c.default_group]


def cross_stage_collectives(calls, stage_of_rank):
    """The collectives among ``calls`` whose group holds ranks of more than one pipeline stage."""
    return [(op, ranks) for op, ranks, _ in calls
            if op in COLLECTIVES and len({stage_of_rank[r] for r in ranks}) > 1]
