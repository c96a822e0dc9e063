"""The main job's final summary: the metrics file's ``summary`` record and the printed lines.

Pure functions of the run's facts (:class:`~.metrics.JobShape`), its account
(:class:`~.metrics.TrainingMetrics`), the two validation losses and every rank's stats gathered after
the last step (``{"stage", "dp", "rss_mb"}`` plus the PACI engine's ``paci_stats()``).
"""


def _per_stage(stats, key, is_paci):
    """``{stage: value}`` from the first data-parallel replica of each stage; ``None`` off PACI."""
    return {s["stage"]: s.get(key) for s in stats if s["dp"] == 0} if is_paci else None


def summary_record(shape, metrics, first_val, final_val, stats):
    """The ``summary`` record: the same keys, in the same order, on every engine (``None`` where PACI-only)."""
    steps_run = shape.steps - shape.start_step
    tokens = steps_run * shape.tokens_per_step
    paci = shape.is_paci
    return {
        "engine": shape.engine_name, "stages": shape.stages, "data_parallel": shape.data_parallel,
        "steps": steps_run, "tokens": tokens, "train_seconds": metrics.train_seconds,
        "eval_seconds": metrics.eval_seconds, "tokens_per_s": tokens / max(metrics.train_seconds, 1e-9),
        "final_train_loss": metrics.train_loss(), "first_val_loss": first_val, "final_val_loss": final_val,
        "peak_rss_mb_per_stage": {s["stage"]: round(s["rss_mb"], 1) for s in stats if s["dp"] == 0},
        "drift_per_stage": _per_stage(stats, "drift_histogram", paci),
        "nonfinite_loss_steps": metrics.nonfinite_steps,
        "skipped_steps_per_stage": _per_stage(stats, "skipped_steps", paci),
        "tie_embeddings": shape.tie_embeddings,
        "tied": [s["tied"] for s in stats if s.get("tied") and s["tied"]["owner"]] if paci else None,
        "lookahead_per_stage": _per_stage(stats, "lookahead", paci),
    }


def lookahead_text(la):
    """One stage's look-ahead in the summary: ``off`` or its predicted forwards, error and seconds."""
    if not la.get("enabled"):
        return "off"
    error = "n/a" if la["prediction_error"] is None else f"{la['prediction_error']:.2f}"
    return f"{la['predicted_forwards']} predicted forwards, error {error}, {la['seconds']:.2f} s"


def _paci_lines(stats):
    first = [s for s in stats if s["dp"] == 0]
    return ["weight drift     " + " | ".join(
                f"stage {s['stage']}: {s['drift_histogram']} (bound {s['drift_bound']})" for s in first),
            "look-ahead       " + " | ".join(f"stage {s['stage']}: {lookahead_text(s['lookahead'])}" for s in first)]


def _tied_line(tied):
    t = tied[0]
    return (f"tied embedding   stages {t['owner_stages']['embed']}: gradients applied {t['lag_windows']} window(s) "
            f"late, {t['windows_exchanged']} windows exchanged, longest wait in a step "
            f"{max(x['max_wait_seconds'] for x in tied) * 1e3:.2f} ms")


def summary_lines(shape, summary, stats, recent_count, metrics_path):
    """The printed summary (one string, lines joined), from :func:`summary_record`'s record; ``recent_count``:
    how many losses the train loss is the mean of."""
    rss = " | ".join(f"stage {k}: {v:.0f} MB" for k, v in summary["peak_rss_mb_per_stage"].items())
    train_s, eval_s = summary["train_seconds"], summary["eval_seconds"]
    lines = [
        f"==== summary: {shape.engine_name}, {shape.stages} stages x {shape.data_parallel} data-parallel ====",
        f"steps            {summary['steps']} ({summary['tokens']:,} tokens)",
        f"wall time        {train_s + eval_s:.1f} s (training {train_s:.1f} s, evaluation {eval_s:.1f} s)",
        f"throughput       {summary['tokens_per_s']:,.0f} tokens/s (training time)",
        f"train loss       {summary['final_train_loss']:.4f} (mean of the last {recent_count} batches)",
        f"validation loss  {summary['first_val_loss']:.4f} at step {shape.start_step} -> "
        f"{summary['final_val_loss']:.4f} at step {shape.steps}",
        f"peak memory      {rss} (RSS)",
    ]
    if shape.is_paci:
        lines += _paci_lines(stats)
    nonfinite = summary["nonfinite_loss_steps"]
    if nonfinite or any((summary["skipped_steps_per_stage"] or {}).values()):
        lines.append(f"non-finite       loss at step(s) {nonfinite or 'none'}; skipped local steps per stage "
                     f"{summary['skipped_steps_per_stage']}")
    tied = [t for t in summary["tied"] or [] if t]
    if tied:
        lines.append(_tied_line(tied))
    lines.append(f"metrics          {metrics_path}")
    return "\n".join(lines)
