"""The PACI engine: a DeepSpeed ``PipelineEngine`` that runs the lowered program.

``pipeline_engine`` (``PACIPipelineEngine``: lowering, the dispatch table, the public contract), ``checkpoints``
(its save and load), ``losses`` (the end of a call), ``stage_context`` (what the tied exchange and the look-ahead
may use of the engine), ``feed`` (paired micro-batches), ``telemetry``, ``monitor`` and ``loss_channel`` (the
last stage's losses to the other stages). The only package that imports every other concern of ``core``.
"""
