"""The multi-process test harness: :mod:`ds_paci.tools.processes.world` (real processes over gloo, fail fast, per-rank logs)."""

from ds_paci.tools.processes.world import WorldFailure, free_port, run_world  # noqa: F401
