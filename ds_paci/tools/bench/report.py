"""Markdown tables and the ``summary.md`` text of a benchmark, plus the machine facts recorded with it."""

from __future__ import annotations

import datetime
import os
import platform

from .analysis import STUDY_FRACTIONS, median_of
from .config import BenchConfig


def format_measured(value, unit: str) -> str:
    """Text of a target's measured value: ``not reached`` for ``None``, percentages for relative values."""
    if value is None:
        return "not reached"
    if unit == "bool":
        return "yes" if value else "no"
    if unit == "relative":
        return f"{value:+.2%}"
    if unit == "relative_share":
        return f"{value:.1%}"
    return f"{value:.3f}"


def machine_facts() -> dict:
    """CPU count, load average, library versions, date: recorded with every result."""
    import deepspeed
    import torch
    import transformers
    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "loadavg": list(os.getloadavg()),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "transformers": transformers.__version__,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _mb(nbytes) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.2f} MiB"


def _num(value, fmt="{:.3f}") -> str:
    return "-" if value is None else fmt.format(value)


def throughput_table(entries: list) -> str:
    """Markdown table: tokens/s, ratios to stock, ideal, share of ideal, s/batch (expected for emulated rows).

    Entries with the look-ahead engine also show its throughput, its ratio and the time the
    look-ahead itself took per batch (its own telemetry, slowest stage).
    """
    head = ("| configuration | stock tokens/s | PACI tokens/s | PACI/stock (median of rounds) | per round | "
            "PACI + look-ahead tokens/s | look-ahead/stock (per round) | ideal (M+P-1)/M | share of ideal PACI / "
            "look-ahead | stock s/batch (expected) | PACI s/batch (expected) | look-ahead s/batch | look-ahead's own "
            "s/batch |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    lookahead = "paci+lookahead"
    for e in entries:
        cfg, c = BenchConfig(**e["config"]), e["comparison"]
        tps, spb = c["tokens_per_second"], c["seconds_per_batch"]
        expected = c.get("expected_seconds_per_batch", {})

        def spb_cell(engine):
            if engine not in spb:
                return "-"
            cell = f"{spb[engine]['median']:.3f}"
            if engine in expected:
                cell += f" ({expected[engine]:.3f}, x{c['measured_over_expected'][engine]:.3f})"
            return cell

        per_round = ", ".join(_num(x) for x in c["ratio"]["per_round"])
        la = c.get("ratios", {}).get(lookahead)
        la_ratio = "-" if la is None else f"{la['median']:.3f} ({', '.join(_num(x) for x in la['per_round'])})"
        la_share = c.get("shares_of_ideal", {}).get(lookahead)
        share = f"{c['share_of_ideal']:.1%}" + ("" if la_share is None else f" / {la_share:.1%}")
        la_tps = "-" if lookahead not in tps else f"{tps[lookahead]['median']:.0f}"
        own = _num(c.get("lookahead_seconds_per_batch"), "{:.4f}")
        rows.append(f"| {cfg.label()} | {tps['stock']['median']:.0f} | {tps['paci']['median']:.0f} | "
                    f"{c['ratio']['median']:.3f} | {per_round} | {la_tps} | {la_ratio} | {c['ideal_ratio']:.3f} | "
                    f"{share} | {spb_cell('stock')} | {spb_cell('paci')} | {spb_cell(lookahead)} | {own} |")
    return "\n".join([head] + rows)


def memory_table(entries: list) -> str:
    """Markdown table: per stage, peak saved/held activation bytes, peak RSS and parameter bytes of both engines."""
    head = ("| configuration | stage | saved for backward stock / PACI | held incl. pipe buffers stock / PACI | "
            "peak RSS stock / PACI | params stock / PACI | extra weight copies |\n|---|---|---|---|---|---|---|")
    rows = []
    for e in entries:
        cfg, mem = BenchConfig(**e["config"]), e["comparison"]["memory"]
        for s, p in zip(mem["stock"], mem["paci"]):
            extra = "none" if s["extra_weight_bytes"] == 0 and p["extra_weight_bytes"] == 0 and \
                p["aliases_share_storage"] in (True, None) else f"{s['extra_weight_bytes']} / {p['extra_weight_bytes']}"
            rows.append(f"| {cfg.label()} | {s['stage']} | {_mb(s['peak_saved_bytes'])} / {_mb(p['peak_saved_bytes'])}"
                        f" | {_mb(s['peak_held_bytes'])} / {_mb(p['peak_held_bytes'])} | {_mb(s['peak_rss_bytes'])} / "
                        f"{_mb(p['peak_rss_bytes'])} | {_mb(s['param_bytes'])} / {_mb(p['param_bytes'])} | {extra} |")
    return "\n".join([head] + rows)


def accuracy_table(entries: list) -> str:
    """Markdown table: target loss, time and steps to it for each engine, speedup, final validation losses."""
    head = ("| configuration | target val loss | stock time / steps to target | PACI time / steps to target | "
            "time speedup PACI (median, per round) | final val loss stock / PACI (diff) |\n|---|---|---|---|---|---|")
    rows = []
    for e in entries:
        cfg, t = BenchConfig(**e["config"]), e["comparison"]["time_to_target"]

        def reached(engine):
            seconds, steps = t["seconds"][engine]["median"], t["steps"][engine]["median"]
            return "not reached" if seconds is None else f"{seconds:.1f} s / {steps:.1f}"

        per_round = ", ".join(_num(x, "{:.2f}") for x in t["speedup"]["per_round"])
        speedup = t["speedup"]["median"]
        finals = t["final_val_loss"]
        rows.append(f"| {cfg.label()} | {t['target_loss']:.4f} | {reached('stock')} | {reached('paci')} | "
                    f"{_num(speedup, '{:.2f}x')} ({per_round}) | {finals['stock']:.4f} / {finals['paci']:.4f} "
                    f"({t['final_val_loss_relative_difference']:+.2%}) |")
    return "\n".join([head] + rows)


def levels_table(entries: list) -> str:
    """Markdown table: for each validation loss the stock engine reached, PACI's time to it and the speedup."""
    head = ("| configuration | stock step | stock val loss | stock time | PACI time to that loss | speedup |\n"
            "|---|---|---|---|---|---|")
    rows = []
    for e in entries:
        label = BenchConfig(**e["config"]).label()
        for lv in e["comparison"]["time_to_target"]["at_stock_levels"]:
            rows.append(f"| {label} | {lv['stock_step']} | {lv['loss']:.4f} | {lv['stock_seconds']:.1f} s | "
                        f"{_num(lv['paci_seconds'], '{:.1f} s') if lv['paci_seconds'] is not None else 'not reached'} "
                        f"| {_num(lv['speedup'], '{:.2f}x')} |")
    return "\n".join([head] + rows)


def targets_table(entries: list) -> str:
    """Markdown table of the issue targets that apply to each configuration (reported, not enforced)."""
    head = "| configuration | target | measured | met |\n|---|---|---|---|"
    rows = []
    for e in entries:
        label = BenchConfig(**e["config"]).label()
        for t in e["comparison"]["targets"]:
            shown = format_measured(t["measured"], t.get("unit", "ratio"))
            rows.append(f"| {label} | {t['target']} | {shown} | {'yes' if t['met'] else 'NO'} |")
    return "\n".join([head] + rows)


def summary_markdown(entries: list, facts: dict, command: str) -> str:
    """The whole ``summary.md``: machine, command, method notes, tables, plots and timelines."""
    commands = sorted({e.get("command", command) for e in entries})
    lines = ["# ds_paci benchmark: PACI vs stock DeepSpeed pipeline engine", "",
             "Command: " + "; ".join(f"`{c}`" for c in commands), "",
             f"Machine: {facts['cpu_count']} CPUs ({facts['cpus_usable']} usable), {facts['platform']}, Python "
             f"{facts['python']}, torch {facts['torch']}, deepspeed {facts['deepspeed']}, transformers "
             f"{facts['transformers']}; started {facts['date_utc']}, load average at start "
             f"{', '.join(f'{x:.2f}' for x in facts['loadavg'])}.", "",
             "Rows marked **emulated** add emulated device time (a CPU-free wait of f per block in forward and 2f in "
             "backward, identical for both engines); their times are emulated, not hardware results. Real math runs "
             "in every mode, so losses are real.", "",
             "Throughput: steady state, warm-up calls of each segment between evaluations excluded, only the "
             "`train_batch` loop timed (slowest rank). Time to target: training wall clock including PACI's drain "
             "before each evaluation, evaluation time excluded.", "",
             "## Throughput", "", throughput_table(entries), "",
             "## Time to accuracy", "", accuracy_table(entries), "",
             "Time for PACI to reach each validation loss the stock engine reached (medians over rounds):", "",
             levels_table(entries), "",
             "## Memory per stage (median over rounds)", "", memory_table(entries), "",
             "## Issue targets (reported, not enforced)", "", targets_table(entries), ""]
    for e in entries:
        cfg = BenchConfig(**e["config"])
        lines += [f"## {cfg.label()}", "",
                  f"Rounds: {len(e['rounds'])}; steps {cfg.steps}, eval every {cfg.eval_every}, warm-up {cfg.warmup} "
                  f"calls per segment; micro-batch {cfg.micro_batch_size} x {cfg.seq_len} tokens; GPT-2 "
                  f"{cfg.n_layer} blocks, n_embd {cfg.n_embd}; AdamW lr {cfg.lr:g}. Invocation started "
                  f"{e['machine']['date_utc']} "
                  f"(`{e.get('command', command)}`); load average before/after {e['loadavg_before']} / "
                  f"{e['loadavg_after']}.", "",
                  f"![throughput]({e['plots']['throughput']})", "", f"![loss]({e['plots']['loss']})", ""]
        for engine, t in e.get("timelines", {}).items():
            lines += [f"![{engine} timeline]({t['png']})", "", "```", t["title"], t["text"], "```", ""]
    return "\n".join(lines)


def study_tables(label: str, comparison: dict, engines, seeds) -> str:
    """Markdown tables of one configuration's curve study: final losses, then time to stock's losses."""
    from .config import ENGINE_TITLES
    seeds = list(seeds)
    lines = [f"### {label}", "",
             "| lr | engine | final val loss per seed | median | vs stock |", "|---|---|---|---|---|"]
    for lr, per_lr in comparison.items():
        for engine in engines:
            f = per_lr[engine]["final"]
            vs = "-" if engine == "stock" else f"{per_lr[engine]['final_vs_stock']:+.2%}"
            lines.append(f"| {lr:g} | {ENGINE_TITLES[engine]} | {', '.join(f'{x:.4f}' for x in f['per_seed'])} | "
                         f"{f['median']:.4f} | {vs} |")
    lines += ["", "Time to the validation loss stock has at 25/50/75/100% of its run (per seed: steps; time = steps x "
                  "seconds per batch of the throughput runs; speedup = stock's time / this engine's, median over seeds; "
                  "a miss gives how far above the target the engine's best loss stayed):", "",
              "| lr | stock step | stock loss (per seed) | engine | steps to it (per seed) | time (median) | speedup |",
              "|---|---|---|---|---|---|---|"]
    for lr, per_lr in comparison.items():
        for i, fraction in enumerate(f"{f:.0%}" for f in STUDY_FRACTIONS):
            for engine in engines:
                row = per_lr[engine]["targets"][i]
                at = row.get("lowest_at") or [None] * len(row["steps"])
                steps = ", ".join((f"not reached ({s:+.2%} above at step {b})" if b is not None else
                                   "missed by " + f"{s:+.2%}") if r is None else f"{r:.0f}"
                                  for r, s, b in zip(row["steps"], row["short_by"], at))
                seconds = row.get("seconds")
                t = "-" if seconds is None or any(x is None for x in seconds) else f"{median_of(seconds):.1f} s"
                speed = row.get("speedup", {}).get("median")
                lines.append(f"| {lr:g} | {row['stock_step']:.0f} ({fraction}) | "
                             f"{', '.join(f'{x:.4f}' for x in row['target_loss'])} | {ENGINE_TITLES[engine]} | {steps} | "
                             f"{t} | {_num(speed, '{:.2f}x')} |")
    return "\n".join(lines)

