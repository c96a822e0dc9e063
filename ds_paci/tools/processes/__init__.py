"""Processes that tests and tools start: one place for launching and fail-fast worlds.

``world`` (``run_world``: real ranks over gloo, per-rank results, a failure names every rank's status; ``free_port``),
``launched`` (a command launched as from a terminal, output kept), ``local_nodes`` (several "nodes" on one
machine: one launcher per node, node-local disks) and ``netns`` (two "nodes" joined by a real, bandwidth-limited
link: network namespaces and a tbf-limited veth); ``rank_job`` (a driver that runs itself again as every rank's job).
"""
