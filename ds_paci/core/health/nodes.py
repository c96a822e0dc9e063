"""Which node a rank runs on, as its launcher says, and how messages name ranks by node.

DeepSpeed's launcher (``deepspeed --hostfile H ...``, over ssh or once per node with ``--no_ssh --node_rank R``)
starts one ``deepspeed.launcher.launch`` per node, which gives each of its ranks ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_SIZE``, ``CROSS_RANK`` (the node's position in the hostfile) and ``CROSS_SIZE`` (the number
of nodes). torchrun gives ``GROUP_RANK`` (the node) and ``LOCAL_WORLD_SIZE``. Public contract:

* :func:`node_label` is ``"node <CROSS_RANK>"`` under DeepSpeed's launcher, ``"node <GROUP_RANK>"`` under torchrun,
  else ``"host <hostname>"``. Host names are never used when the launcher names the node, so several "nodes" may
  share one machine (as in the tests).
* :func:`launched_nodes` is the number of nodes the launcher says the run spans (``CROSS_SIZE``, or torchrun's
  ``WORLD_SIZE / LOCAL_WORLD_SIZE``), 1 when it says nothing. It needs no process group.
* :class:`NodeMap` holds every rank's label (:func:`gather_node_map` collects them: a collective on the default
  group) and names sets of ranks in messages: ``"node 1 (ranks 2, 3)"``.

This module imports nothing of the package; the checkpoint protocol and the peer watch use it.
"""

import os
import socket


def node_label(environ=None):
    """This rank's node, as its launcher names it (see the module docstring)."""
    env = os.environ if environ is None else environ
    for key in ("CROSS_RANK", "GROUP_RANK"):
        value = env.get(key, "").strip()
        if value.isdigit():
            return f"node {int(value)}"
    return f"host {socket.gethostname()}"


def launched_nodes(environ=None):
    """How many nodes the launcher says this run spans (1 when it does not say)."""
    env = os.environ if environ is None else environ
    cross = env.get("CROSS_SIZE", "").strip()
    if cross.isdigit() and int(cross) > 0:
        return int(cross)
    world, local = env.get("WORLD_SIZE", "").strip(), env.get("LOCAL_WORLD_SIZE", "").strip()
    if env.get("GROUP_RANK", "").strip().isdigit() and world.isdigit() and local.isdigit() and int(local) > 0:
        return max(1, int(world) // int(local))
    return 1


def rank_list(ranks):
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    ranks = sorted(set(int(r) for r in ranks))
    parts, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if j == i else (f"{ranks[i]}, {ranks[j]}" if j == i + 1 else
                                                    f"{ranks[i]}-{ranks[j]}"))
        i = j + 1
    return ", ".join(parts)


class NodeMap:
    """Every rank's node label (``labels[rank]``), with helpers that name ranks by node."""

    def __init__(self, labels):
        self.labels = list(labels)

    @property
    def nodes(self):
        """The distinct labels in rank order of their first rank."""
        return list(dict.fromkeys(self.labels))

    def ranks_of(self, label):
        return [r for r, lab in enumerate(self.labels) if lab == label]

    def describe(self, ranks):
        """``"node 1 (ranks 2, 3)"``; several nodes joined by ``"; "``."""
        ranks = sorted(set(ranks))
        by_node = {}
        for r in ranks:
            by_node.setdefault(self.labels[r], []).append(r)
        out = []
        for label, rs in by_node.items():
            word = "rank" if len(rs) == 1 else "ranks"
            out.append(f"{label} ({word} {rank_list(rs)})")
        return "; ".join(out)


def gather_node_map():
    """Every rank's :func:`node_label` (a collective on the default group: every rank calls it)."""
    import torch.distributed as tdist
    labels = [None] * tdist.get_world_size()
    tdist.all_gather_object(labels, node_label())
    return NodeMap(labels)
