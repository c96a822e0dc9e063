"""The PACI engine: everything a training script runs.

``schedule`` (PACI instruction streams, pure data) -> ``engine`` (interprets them on
a DeepSpeed ``PipelineEngine``) with ``local_step`` (stage-local optimizer step),
``feed`` (paired micro-batches), ``telemetry`` (versions, drift, trace), ``watchdog``
(hangs), ``monitor`` (last-stage loss events), ``tied`` with ``tied_timing`` (tied layers on
several stages); ``config`` (the ``"paci"`` section),
``runtime`` (process set-up) and ``initialize`` (the drop-in for
``deepspeed.initialize``). Depends on torch and DeepSpeed only, never on
:mod:`ds_paci.tools`, :mod:`ds_paci.workload` or :mod:`ds_paci.integrations`.
"""
