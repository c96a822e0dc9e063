"""A synchronous warm start (``"paci": {"sync_warmup_calls": K}``): the first ``K`` calls on stock's schedule.

Each of the first ``K`` ``train_batch`` calls (``global_steps < K``: a resume continues the count) runs every
stage with the window ``M``, aligned steps and a drain that closes the window at the end of the call: the stock
engine's schedule, so every forward sees the weights stock's would (no forward crosses a step, so nothing is
predicted) and the call costs stock's bubble. From call ``K + 1`` the stream takes the configured window and
phase and runs continuously. Why (issue 30, ``docs/results/quality-candidates.md``): asynchrony early in
training, where the loss falls fastest, left runs on a loss plateau that stock left within its first tens of
steps; after a synchronous start, the same look-ahead ended near stock. The warm start runs PACI's own machinery
(local steps, PACI's clipping rule, its reduce), not DeepSpeed's step: it equals stock's math where those agree
(no clipping, one stage owning each parameter), which ``tests/test_sync_warmup.py`` checks against the replay.
"""

from ..program.stream import step_phase


def is_warm_call(engine) -> bool:
    """Whether the next ``train_batch`` is one of the warm start's calls (never in sync mode: it is synchronous)."""
    return engine.paci.sync_warmup_calls > engine.global_steps and not engine._stock_step


def follow(engine) -> bool:
    """Put the drained stream on the schedule of the next call; returns :func:`is_warm_call`.

    Nothing changes without a warm start. Switching needs a closed window: a stream with an open one (a checkpoint
    saved without a warm start, loaded into a run with one) is drained first with its window closed, as
    ``set_train_batch_size`` does.
    """
    if not engine.paci.sync_warmup_calls:
        return False
    warm = is_warm_call(engine)
    M = engine.micro_batches
    window = M if warm else engine._configured_window()
    phase = step_phase("aligned" if warm else engine._step_phase, engine.stage_id, window)
    stream = engine._stream
    if (stream.window, stream.phase) != (window, phase):
        if stream.window_fill or not engine.is_drained:
            engine.drain(close_window=True)
        stream.set_micro_batches(M, window, phase)
    return warm
