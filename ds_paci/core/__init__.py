"""The PACI engine: everything a training script runs, in packages by concern.

``program`` (the stream, passes, validator and interpreter: pure data) -> ``step``, ``tied``, ``lookahead``
(what a stage does at and around its local step) -> ``engine`` (runs the program on a DeepSpeed
``PipelineEngine``); ``checkpoint`` (atomic saves), ``health`` (watchdog, peer watch, clean stops, nodes),
``seam`` (every DeepSpeed internal and version difference); top level ``config`` (the ``"paci"`` section),
``runtime`` (process set-up) and ``initialize`` (the drop-in for ``deepspeed.initialize``). Which package may
import which is checked by ``tests/test_layout.py``; the map is ``docs/architecture.md``. Depends on torch and
DeepSpeed only, never on :mod:`ds_paci.tools`, :mod:`ds_paci.workload` or :mod:`ds_paci.integrations`.
"""
