"""Analysis of finished runs: steady-state throughput, time to a target loss, memory, the ideal ratio and the targets.

Pure functions over the plain data the ranks return; nothing here starts a process.
"""

from __future__ import annotations

import statistics

from .config import BenchConfig, PACI_ENGINES, engines_in


TARGET_LOSS_FACTOR = 1.02


def ideal_ratio(stages: int, micro_batches: int) -> float:
    """Throughput PACI/stock when the bubble is removed and nothing else changes: ``(M+P-1)/M``."""
    return (micro_batches + stages - 1) / micro_batches


def share_of_ideal(ratio: float, stages: int, micro_batches: int) -> float:
    """``ratio`` as a fraction of :func:`ideal_ratio` (1.0 = the whole bubble removed)."""
    return ratio / ideal_ratio(stages, micro_batches)


def expected_seconds_per_batch(engine: str, stages: int, micro_batches: int, device_time: float,
                               blocks_per_stage: float = 1.0) -> float:
    """Emulated seconds per ``train_batch`` if only device time counted.

    A micro-batch costs ``3 f b`` per stage (forward ``f``, backward ``2f``, ``b`` blocks):
    PACI's steady state spends ``M`` of those per batch, the stock engine ``M + P - 1``.
    """
    per_micro_batch = 3.0 * device_time * blocks_per_stage
    slots = micro_batches if engine in PACI_ENGINES else micro_batches + stages - 1
    return slots * per_micro_batch


def per_round_ratios(numerators: list, denominators: list) -> list:
    """``[a / b for each round]``; a round with a missing or zero value gives ``None``."""
    return [None if a is None or not b else a / b for a, b in zip(numerators, denominators)]


def median_of(values: list):
    """Median of the non-``None`` values, or ``None`` if there are none."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def steady_state_span(calls: list, segments: list, warmup: int) -> tuple[int, float]:
    """Timed calls and seconds of one rank's steady state.

    ``calls``: ``[(start, end), ...]`` of every ``train_batch`` call; ``segments``: dicts
    with ``first_call`` and ``calls`` (the calls between two evaluations). In each
    segment the first ``warmup`` calls are skipped and the rest timed as one span,
    start of the first timed call to end of the last. Returns ``(count, seconds)``.
    """
    count, seconds = 0, 0.0
    for seg in segments:
        first = seg["first_call"] + warmup
        last = seg["first_call"] + seg["calls"] - 1
        if first > last:
            continue
        count += last - first + 1
        seconds += calls[last][1] - calls[first][0]
    return count, seconds


def time_to_target(points: list, target: float):
    """When a validation curve first reaches ``target``: ``(seconds, steps)`` or ``None``.

    ``points``: ``[(step, training seconds, loss), ...]`` in training order. The crossing
    is the first point with ``loss <= target``; between it and the point before, time
    and steps are interpolated linearly in the loss. A first point already at the
    target gives its own time and step.
    """
    previous = None
    for step, seconds, loss in points:
        if loss <= target:
            if previous is None or previous[2] <= loss:
                return float(seconds), float(step)
            p_step, p_seconds, p_loss = previous
            frac = (p_loss - target) / (p_loss - loss)
            return p_seconds + frac * (seconds - p_seconds), p_step + frac * (step - p_step)
        previous = (step, seconds, loss)
    return None


def speedups_at_reference_levels(reference: list, other: list) -> list:
    """How fast ``other`` reaches each validation loss ``reference`` reached after step 0.

    Both curves are ``[(step, seconds, loss), ...]``. Returns ``[(loss, reference seconds,
    other seconds or None, reference seconds / other seconds or None), ...]``; the
    reference's own time is its evaluation time, the other's is :func:`time_to_target`.
    """
    levels = []
    for _, seconds, loss in reference[1:]:
        reached = time_to_target(other, loss)
        other_seconds = None if reached is None else reached[0]
        speedup = None if not other_seconds else seconds / other_seconds
        levels.append((loss, seconds, other_seconds, speedup))
    return levels


def default_target_loss(stock_final_losses: list, factor: float = TARGET_LOSS_FACTOR) -> float:
    """The default target: ``factor`` x the stock engine's final validation loss (median over rounds)."""
    return factor * median_of(stock_final_losses)


def relative_difference(value: float, reference: float) -> float:
    """``(value - reference) / reference``."""
    return (value - reference) / reference


def throughput_of_run(ranks: list, cfg: BenchConfig) -> dict:
    """Steady-state throughput of one run: the slowest rank's time over the timed calls."""
    spans = [steady_state_span(r["calls"], r["segments"], cfg.warmup) for r in ranks]
    count = spans[0][0]
    seconds = max(s for _, s in spans)
    return {
        "timed_calls": count,
        "timed_seconds": seconds,
        "tokens_per_second": count * cfg.tokens_per_batch / seconds,
        "seconds_per_batch": seconds / count,
    }


def training_clock(ranks: list) -> list:
    """Cumulative training seconds at the end of each segment (each segment: its longest rank)."""
    clock, total = [], 0.0
    for i in range(len(ranks[0]["segments"])):
        total += max(r["segments"][i]["end"] - r["segments"][i]["start"] for r in ranks)
        clock.append(total)
    return clock


def validation_curve(ranks: list) -> list:
    """``[(step, training seconds, validation loss), ...]`` from step 0 to the end."""
    clock = [0.0] + training_clock(ranks)
    return [(step, clock[i], loss) for i, (step, loss) in enumerate(ranks[-1]["evals"])]


def train_loss_curve(ranks: list) -> list:
    """``[(training seconds at the end of the call, loss), ...]`` of the last stage's ``train_batch`` calls."""
    last = ranks[-1]
    base = [0.0] + training_clock(ranks)
    curve = []
    for i, seg in enumerate(last["segments"]):
        for c in range(seg["first_call"], seg["first_call"] + seg["calls"]):
            if last["losses"][c] is not None:
                curve.append((base[i] + last["calls"][c][1] - seg["start"], last["losses"][c]))
    return curve


def memory_of_run(ranks: list) -> list:
    """Per stage (stage order): the memory figures each rank measured."""
    return [dict(stage=r["stage"], **r["memory"]) for r in sorted(ranks, key=lambda r: r["stage"])]


def summarize_run(ranks: list, cfg: BenchConfig, engine: str, wall_seconds: float) -> dict:
    """The figures of one run (one engine, one round)."""
    curve = validation_curve(ranks)
    summary = {
        "engine": engine,
        "engine_type": ranks[0]["engine_type"],
        "throughput": throughput_of_run(ranks, cfg),
        "validation": [{"step": s, "train_seconds": t, "loss": v} for s, t, v in curve],
        "final_val_loss": curve[-1][2],
        "train_seconds_total": curve[-1][1],
        "train_loss": [{"train_seconds": t, "loss": v} for t, v in train_loss_curve(ranks)],
        "memory": memory_of_run(ranks),
        "world_wall_seconds": wall_seconds,
    }
    if engine in PACI_ENGINES:
        summary["paci_stats"] = [r.get("paci_stats") for r in ranks]
    return summary


def lookahead_seconds_per_batch(run: dict) -> float | None:
    """Look-ahead time per ``train_batch`` call of a run: the largest stage's predict + restore seconds / calls."""
    stats = [s for s in run.get("paci_stats") or [] if s and s.get("lookahead", {}).get("enabled")]
    if not stats:
        return None
    return max(s["lookahead"]["seconds"] / max(1, s["train_batch_calls"]) for s in stats)


def compare_engines(cfg: BenchConfig, rounds: list, target_loss: float | None) -> dict:
    """Medians, per-round ratios, share of ideal, memory, time to target and issue targets of one configuration.

    ``rounds``: ``[{"stock": run summary, "paci": run summary, ...}, ...]`` (the engines
    present in the first round are compared, each against ``stock``). ``target_loss``
    ``None`` selects :func:`default_target_loss`. The top-level ``ratio``, ``speedup``
    and ``final_val_loss_relative_difference`` are PACI's; every engine's are under
    ``ratios``, ``time_to_target.speedups`` and ``final_val_loss_relative_differences``.
    """
    engines = engines_in(rounds[0])
    others = [e for e in engines if e != "stock"]
    tps = {e: [r[e]["throughput"]["tokens_per_second"] for r in rounds] for e in engines}
    spb = {e: [r[e]["throughput"]["seconds_per_batch"] for r in rounds] for e in engines}
    ratios = {e: per_round_ratios(tps[e], tps["stock"]) for e in others}
    ideal = ideal_ratio(cfg.stages, cfg.micro_batches)
    finals = {e: [r[e]["final_val_loss"] for r in rounds] for e in engines}
    rule = "given by --target-loss"
    if target_loss is None:
        target_loss = default_target_loss(finals["stock"])
        rule = f"{TARGET_LOSS_FACTOR} x the stock engine's final validation loss (median over rounds)"
    tta = {e: [time_to_target([(p["step"], p["train_seconds"], p["loss"]) for p in r[e]["validation"]], target_loss)
               for r in rounds] for e in engines}
    tta_seconds = {e: [None if x is None else x[0] for x in tta[e]] for e in engines}
    tta_steps = {e: [None if x is None else x[1] for x in tta[e]] for e in engines}
    speedups = {e: per_round_ratios(tta_seconds["stock"], tta_seconds[e]) for e in others}
    curves = [{e: [(p["step"], p["train_seconds"], p["loss"]) for p in r[e]["validation"]] for e in engines}
              for r in rounds]
    levels = {}
    for e in others:
        per_round_levels = [speedups_at_reference_levels(c["stock"], c[e]) for c in curves]
        levels[e] = []
        for i, (loss, *_) in enumerate(per_round_levels[0]):
            column = [lv[i] for lv in per_round_levels]
            levels[e].append({"stock_step": curves[0]["stock"][i + 1][0], "loss": loss,
                              "stock_seconds": median_of([x[1] for x in column]),
                              "paci_seconds": median_of([x[2] for x in column]),
                              "speedup": median_of([x[3] for x in column])})
    final = {e: median_of(finals[e]) for e in engines}
    differences = {e: relative_difference(final[e], final["stock"]) for e in others}
    ratio = {e: median_of(ratios[e]) for e in others}
    comparison = {
        "engines": engines,
        "tokens_per_second": {e: {"median": median_of(tps[e]), "per_round": tps[e]} for e in engines},
        "seconds_per_batch": {e: {"median": median_of(spb[e]), "per_round": spb[e]} for e in engines},
        "ratio": {"median": ratio.get("paci"), "per_round": ratios.get("paci")},
        "ratios": {e: {"median": ratio[e], "per_round": ratios[e]} for e in others},
        "ideal_ratio": ideal,
        "share_of_ideal": None if ratio.get("paci") is None else share_of_ideal(ratio["paci"], cfg.stages,
                                                                                  cfg.micro_batches),
        "shares_of_ideal": {e: None if ratio[e] is None else share_of_ideal(ratio[e], cfg.stages, cfg.micro_batches)
                            for e in others},
        "memory": memory_comparison(rounds),
        "time_to_target": {
            "target_loss": target_loss,
            "rule": rule,
            "seconds": {e: {"median": median_of(tta_seconds[e]), "per_round": tta_seconds[e]} for e in engines},
            "steps": {e: {"median": median_of(tta_steps[e]), "per_round": tta_steps[e]} for e in engines},
            "speedup": {"median": median_of(speedups["paci"]), "per_round": speedups["paci"]},
            "speedups": {e: {"median": median_of(speedups[e]), "per_round": speedups[e]} for e in others},
            "final_val_loss": final,
            "final_val_loss_relative_difference": differences["paci"],
            "final_val_loss_relative_differences": differences,
            "at_stock_levels": levels["paci"],
            "at_stock_levels_by_engine": levels,
        },
    }
    lookahead = [lookahead_seconds_per_batch(r[e]) for r in rounds for e in others]
    if any(x is not None for x in lookahead):
        comparison["lookahead_seconds_per_batch"] = median_of(lookahead)
    if cfg.emulated:
        comparison["expected_seconds_per_batch"] = {
            e: expected_seconds_per_batch(e, cfg.stages, cfg.micro_batches, cfg.device_time, cfg.blocks_per_stage)
            for e in engines
        }
        comparison["measured_over_expected"] = {
            e: comparison["seconds_per_batch"][e]["median"] / comparison["expected_seconds_per_batch"][e]
            for e in engines
        }
    comparison["targets"] = issue_targets(cfg, comparison)
    return comparison


def memory_comparison(rounds: list) -> dict:
    """Per stage and engine: median over rounds of each memory figure; plus the weight-copy checks."""
    out = {}
    engines = engines_in(rounds[0])
    for engine in engines:
        per_stage = []
        for s in range(len(rounds[0][engine]["memory"])):
            rows = [r[engine]["memory"][s] for r in rounds]
            per_stage.append({
                "stage": s,
                "peak_saved_bytes": median_of([x["peak_saved_bytes"] for x in rows]),
                "peak_held_bytes": median_of([x["peak_held_bytes"] for x in rows]),
                "peak_rss_bytes": median_of([x["peak_rss_bytes"] for x in rows]),
                "param_bytes": rows[0]["param_bytes"],
                "optimizer_state_bytes": rows[0]["optimizer_state_bytes"],
                "extra_weight_bytes": max(x["extra_weight_bytes"] for x in rows),
                "aliases_share_storage": rows[0]["aliases_share_storage"],
            })
        out[engine] = per_stage
    stock, paci = out["stock"], out["paci"]
    out["paci_saved_le_stock_every_stage"] = all(p["peak_saved_bytes"] <= s["peak_saved_bytes"]
                                                 for p, s in zip(paci, stock))
    out["paci_held_le_stock_every_stage"] = all(p["peak_held_bytes"] <= s["peak_held_bytes"]
                                                for p, s in zip(paci, stock))
    out["same_param_bytes_every_stage"] = all(p["param_bytes"] == s["param_bytes"] for p, s in zip(paci, stock))
    paci_engines = [e for e in engines if e in PACI_ENGINES]
    out["no_extra_weight_copies"] = (all(x["extra_weight_bytes"] == 0 for e in engines for x in out[e])
                                     and all(x["aliases_share_storage"] in (True, None)
                                             for e in paci_engines for x in out[e]))
    if "paci+lookahead" in out:
        out["lookahead_saved_le_stock_every_stage"] = all(
            p["peak_saved_bytes"] <= s["peak_saved_bytes"] for p, s in zip(out["paci+lookahead"], stock))
    return out


_THROUGHPUT_TARGETS = {("emulated", 8, 8): 1.75, ("emulated", 4, 4): 1.65, ("real", 2, 4): 1.15}


def issue_targets(cfg: BenchConfig, comparison: dict) -> list:
    """The issue's targets that apply to ``cfg``: ``[{"target", "measured", "unit", "met"}, ...]``.

    ``unit``: ``"ratio"`` (a plain number), ``"relative"`` (a fraction shown as a
    percentage) or ``"bool"``; ``measured`` is ``None`` when it was not reached.
    """
    targets = []
    key = (cfg.mode, cfg.stages, cfg.micro_batches)
    ratio = comparison["ratio"]["median"]
    if key in _THROUGHPUT_TARGETS:
        goal = _THROUGHPUT_TARGETS[key]
        targets.append({"target": f"PACI/stock throughput >= {goal}", "measured": ratio, "unit": "ratio",
                        "met": ratio is not None and ratio >= goal})
    mem = comparison["memory"]
    targets.append({"target": "PACI peak activation bytes <= stock's on every stage (saved for backward)",
                    "measured": mem["paci_saved_le_stock_every_stage"], "unit": "bool",
                    "met": mem["paci_saved_le_stock_every_stage"]})
    if cfg.emulated:
        over = comparison["measured_over_expected"]["paci"]
        targets.append({"target": "PACI seconds per batch within 10% of M*3f (emulated); measured/expected",
                        "measured": over, "unit": "ratio", "met": abs(over - 1.0) <= 0.10})
    share = comparison.get("shares_of_ideal", {}).get("paci+lookahead")
    if share is not None:
        targets.append({"target": "PACI + look-ahead throughput >= 95% of the ideal (M+P-1)/M", "measured": share,
                        "unit": "relative_share", "met": share >= 0.95})
    if key == ("emulated", 8, 8):
        tta = comparison["time_to_target"]
        speedup = tta["speedup"]["median"]
        targets.append({"target": "time to target validation loss >= 1.5x shorter than stock", "measured": speedup,
                        "unit": "ratio", "met": speedup is not None and speedup >= 1.5})
        diff = tta["final_val_loss_relative_difference"]
        targets.append({"target": "PACI final validation loss within 2% of stock's", "measured": diff,
                        "unit": "relative", "met": abs(diff) <= 0.02})
    return targets


# -- loss-curve studies (stock, PACI, PACI + look-ahead over learning rates and seeds) ---------------------
STUDY_FRACTIONS = (0.25, 0.5, 0.75, 1.0)


def loss_at_step(curve: list, step: float) -> float:
    """Validation loss of ``curve`` (``[(step, loss), ...]``) at ``step``, linear between evaluations."""
    for (s0, l0), (s1, l1) in zip(curve, curve[1:]):
        if s0 <= step <= s1:
            return l0 if s1 == s0 else l0 + (l1 - l0) * (step - s0) / (s1 - s0)
    raise ValueError(f"step {step} outside the curve ({curve[0][0]}..{curve[-1][0]})")


def steps_to_loss(curve: list, target: float):
    """Steps until ``curve`` first reaches ``target`` (interpolated, see :func:`time_to_target`), or ``None``."""
    reached = time_to_target([(s, s, l) for s, l in curve], target)
    return None if reached is None else reached[1]


def study_comparison(runs: dict, lrs, seeds, engines, steps: int, seconds_per_batch: dict | None) -> dict:
    """Final losses and time to stock's losses at 25/50/75/100% of its run, per learning rate, over seeds.

    ``runs``: ``{(lr, seed, engine): [(step, validation loss), ...]}``. ``seconds_per_batch``:
    ``{engine: seconds}`` measured in the throughput runs (``None``: steps only). The time
    to a target is the steps to it times the engine's seconds per batch (the curve runs
    have no wait, so their own clock means nothing). Per learning rate, for every engine:
    ``final`` (per seed and median: the loss at ``steps``, stock's step count, also for engines
    whose curves run past it), ``final_vs_stock`` (relative difference of the
    medians), and per target fraction: stock's loss there per seed, the engine's steps and
    time to it per seed over its whole curve (``None`` = not reached, then ``short_by``: how far
    above the target the engine's best loss stayed, relative, and ``lowest_at``: the step of that
    best loss), and the median speedup over stock in time (``None`` unless every seed reached it).
    """
    out = {}
    for lr in lrs:
        per_lr = {}
        for engine in engines:
            finals = [loss_at_step(runs[(lr, seed, engine)], steps) for seed in seeds]  # PACI may run past steps
            per_lr[engine] = {"final": {"per_seed": finals, "median": median_of(finals)}, "targets": []}
        for engine in engines:
            per_lr[engine]["final_vs_stock"] = relative_difference(per_lr[engine]["final"]["median"],
                                                                   per_lr["stock"]["final"]["median"])
        for fraction in STUDY_FRACTIONS:
            at = fraction * steps
            losses = [loss_at_step(runs[(lr, seed, "stock")], at) for seed in seeds]
            for engine in engines:
                reached = [steps_to_loss(runs[(lr, seed, engine)], target) for seed, target in zip(seeds, losses)]
                lowest = [min(runs[(lr, seed, engine)], key=lambda p: p[1]) for seed in seeds]
                short = [None if r is not None else relative_difference(low[1], target)
                         for low, target, r in zip(lowest, losses, reached)]
                row = {"fraction": fraction, "stock_step": at, "target_loss": losses, "steps": reached,
                       "short_by": short, "lowest_at": [None if r is not None else low[0]
                                                        for low, r in zip(lowest, reached)]}
                if seconds_per_batch is not None:
                    spb = seconds_per_batch[engine]
                    row["seconds"] = [None if r is None else r * spb for r in reached]
                    stock_steps = [steps_to_loss(runs[(lr, seed, "stock")], t) for seed, t in zip(seeds, losses)]
                    speed = [None if r is None or s is None else (s * seconds_per_batch["stock"]) / (r * spb)
                             for r, s in zip(reached, stock_steps)]
                    row["speedup"] = {"per_seed": speed,
                                      "median": median_of(speed) if all(x is not None for x in speed) else None}
                per_lr[engine]["targets"].append(row)
        out[lr] = per_lr
    return out
