"""The multi-process test harness: :mod:`ds_paci.world` (real processes over gloo, fail fast, per-rank logs)."""

from ds_paci.world import WorldFailure, free_port, run_world  # noqa: F401
