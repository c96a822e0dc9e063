"""``paci_stats()``: one stage's telemetry in one dict.

Keys: the telemetry's summary (version, local steps, drift and its bound, window), then the stream's position
(``in_flight``, ``ticks``, ``next_micro_batch``, ``window_fill``, ``step_phase``, ``open_window``, ``lr_steps``), the
calls (``train_batch_calls``, ``loss_calls``, ``drains``, ``global_steps``), the non-finite guard
(``skipped_steps``, ``consecutive_skips``, ``max_consecutive_skips``, ``grad_norm``), the age of the last returned
loss (``loss_origin_call``, ``loss_age``), and the parts' own stats (``collective_check``, ``tied``,
``first_exchange``, ``lookahead``).
"""

from ..seam import deepspeed_internals as ds


def stage_stats(engine):
    """The dict ``engine.paci_stats()`` returns (read only: nothing of the engine changes)."""
    stats = engine.telemetry.summary()
    guard, norm = engine._collective_guard, ds.global_grad_norm(engine)
    origin = None if engine._last_loss is None else engine._last_loss[1]
    stats.update(in_flight=engine._stream.in_flight(),
                 ticks=engine._stream.ticks_emitted,
                 next_micro_batch=engine._stream.next_micro_batch(),
                 train_batch_calls=engine._calls,
                 loss_calls=engine._loss_calls,
                 drains=engine._drains,
                 skipped_steps=engine._skips.total,
                 window_fill=engine._stream.window_fill,
                 step_phase=engine._step_phase, open_window=engine._stream.window_target,
                 lr_steps=engine._stream.lr_count,
                 global_steps=engine.global_steps,
                 collective_check=None if guard is None else guard.summary(),
                 consecutive_skips=engine._skips.consecutive,
                 max_consecutive_skips=engine._skips.limit,
                 grad_norm=None if norm is None else float(norm),
                 loss_origin_call=origin,
                 loss_age=None if origin is None else engine._loss_calls - origin,
                 tied=None if engine._tied is None else engine._tied.stats(),
                 first_exchange=dict(engine._first_exchange),
                 lookahead=engine._lookahead.stats() if engine._lookahead is not None else {"enabled": False})
    return stats
