"""The example workload: GPT-2 as a ``PipelineModule``, the Shakespeare corpus and tokenizers, emulated device time.

It knows nothing of PACI: the same model and data run on DeepSpeed's stock engine.
``gpt2`` (the model), ``data`` (corpus, tokenizers, micro-batch iterators),
``emulate`` (a pipeline layer that adds CPU-free "device" time).
"""
