"""Side-by-side benchmark: DeepSpeed's stock ``PipelineEngine`` against ``PACIPipelineEngine``.

``python -m ds_paci.tools.bench --preset headline`` (``make bench``) trains
the same GPT-2 on the same Shakespeare micro-batches with both engines, alternating
stock, PACI, stock, PACI, ... for ``--repeats`` rounds. Every run is a fresh world of
``P`` processes (one pipeline stage each, one thread each, gloo, fp32, AdamW with
``torch_adam``, no gradient clipping). Both engines get the same model seed, data
seed, micro-batch size and ``M = gradient_accumulation_steps``; PACI uses the window
``a = M``.

Two modes:

* ``real``: real compute only (2 stages on the 2 cores of a CPU machine).
* ``emulated``: one transformer block per stage, small, plus an
  :class:`ds_paci.workload.emulate.EmulatedDeviceTime` layer after each block that waits ``f``
  seconds in forward and ``2f`` in backward without using the CPU, identical for both
  engines. The math still runs, so losses are real; times are **emulated**, and every
  figure of this mode says so.

What is measured (per run, inside every rank):

* **Throughput**: training is cut into segments by the periodic evaluations. In each
  segment the first ``warmup`` ``train_batch`` calls are excluded (first-call
  allocations; PACI's pipeline fill after a drain); the rest are timed as one span,
  from the start of the first timed call to the end of the last, on every rank. A
  run's time is the largest rank's sum of spans; tokens/s = timed calls x M x
  micro-batch size x sequence length / time. Evaluation, PACI's drain and the
  warm-up calls are outside this clock.
* **Time to accuracy**: validation loss (``engine.eval_batch`` on a fixed set of
  validation micro-batches) at step 0, every ``eval_every`` steps and at the end.
  The training clock runs over every ``train_batch`` call *and* PACI's drain before
  each evaluation (the drain finishes real training work, and the bubble it opens is
  a cost of evaluating PACI mid-run); evaluation itself is excluded. A segment's time
  is its longest rank's. The time to a target loss is interpolated linearly between
  the two evaluations around its first crossing (:func:`time_to_target`).
* **Memory**: :class:`ActivationMeter` counts the bytes of tensors saved for backward
  (``torch.autograd.graph.saved_tensors_hooks``, deduplicated by storage, parameters
  excluded), and, after each forward of the stage, the union of those with the
  engine's pipe buffers and the stage output; the peaks of both, the process's
  peak RSS (``ru_maxrss``), parameter and optimizer-state bytes, and whether every
  optimizer tensor shares storage with a module parameter (no weight copies).
* **Timelines** (``--trace``): per-instruction records of the first round's runs,
  from ``paci.trace`` for PACI and, for the stock engine, from DeepSpeed's instruction functions wrapped in a
  table of that engine's own (DeepSpeed's class table is left unchanged).

Outputs under ``--out``: ``<config>.json`` per configuration, ``summary.md``,
``<config>_throughput.png``, ``<config>_loss.png``, ``ratios.png`` and, with
``--trace``, ``<config>_timeline_{stock,paci}.png`` / ``.json`` (Chrome trace).
Speed targets are reported against, never enforced.

``python -m ds_paci.tools.bench --study peers`` (``make peers``; its own options: ``--study peers --help``) is
the peer study of issue 17: PACI against torch.distributed.pipelining's synchronous schedules (GPipe, 1F1B,
interleaved 1F1B, ZB1P, ZB-V, DualPipeV) with emulated F, B and W time (:mod:`.peers`).

Modules: :mod:`.config` (configurations and presets), :mod:`.meters` (what a rank
measures), :mod:`.runner` (a rank's run, worlds, rounds), :mod:`.analysis` (pure
functions over the results), :mod:`.report` (markdown), :mod:`.plots` (figures and
timelines), :mod:`.cli` (the command line).
"""
