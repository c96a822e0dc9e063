"""Tables of the sweep (``docs/results/quality/sweep.md``): the stock learning-rate sweep, every cell, the window
rules against the best fixed window, and the time to stock's final loss.

Pure functions over the result lines of :mod:`ds_paci.tools.studies.quality.sweep`. Final losses are read at the
depth's common step count (the same samples for every engine). "vs stock" is relative to stock's median over
the seeds both ran in the same cell; a rule's comparison with the best fixed window uses the first seed, on which every
window ran.
"""

from __future__ import annotations

import os
import statistics

from .grid import (ALL_RULES, DEPTHS, FIXED_RULES, MUON_DEPTHS, PACI_RULE, SEEDS, SWEEP_LRS, cell_lrs, lr_sweep_runs,
                   make_run, micro_batch_counts, muon_runs, rule_windows, window_label)
from .sweep import load_results
from ds_paci.tools.bench.analysis import loss_at_step

RULE_TOLERANCE = 0.005  # "auto" within 0.5% of the best fixed window
STOCK_TOLERANCE = 0.01  # and within 1% of stock
COMMAND = "python -m ds_paci.tools.studies.quality --part sweep --out docs/results/quality"


def _rel(x, ref):
    return None if x is None or ref is None else (x - ref) / ref


def _pct(x):
    return "-" if x is None else f"{x * 100:+.2f}%"


def _find(results, stages, micro_batches, engine, windows, lr, pair, overrun=False):
    row = results.get(make_run(stages, micro_batches, engine, windows, lr, pair, overrun=overrun).key())
    if row is None and engine != "stock":  # the same run, trained past the common step count
        row = results.get(make_run(stages, micro_batches, engine, windows, lr, pair, overrun=not overrun).key())
    return row


def _median(vals):
    present = [v for v in vals if v is not None]
    return statistics.median(present) if present else None


def _paired(vals, stock):
    """Median over the seeds both have, relative to stock's median over the same seeds (``None``: no common seed)."""
    pairs = [(v, s) for v, s in zip(vals, stock) if v is not None and s is not None]
    if not pairs:
        return None
    return _rel(statistics.median(v for v, _ in pairs), statistics.median(s for _, s in pairs))


def cell_summary(results: dict, stages: int, micro_batches: int, lr: float, rules=("auto", )) -> dict:
    """Everything the tables say about one cell (missing runs give ``None``)."""
    def finals(engine, windows, seeds=SEEDS):
        rows = [_find(results, stages, micro_batches, engine, windows, lr, pair) for pair in seeds]
        return [None if r is None else r["final"] for r in rows], rows

    stock, stock_rows = finals("stock", None)
    paci, paci_rows = finals("paci", rule_windows(PACI_RULE, stages, micro_batches))
    stock_med = _median(stock)
    fixed = {}
    for name in ALL_RULES:
        windows = rule_windows(name, stages, micro_batches)
        (first, ), _ = finals("lookahead", windows, SEEDS[:1])
        fixed[name] = {"windows": windows, "final": first}
    present = {n: fixed[n] for n in FIXED_RULES if fixed[n]["final"] is not None}
    best = min(present, key=lambda n: present[n]["final"]) if len(present) == len(FIXED_RULES) else None
    out = {"stages": stages, "micro_batches": micro_batches, "lr": lr, "stock": stock, "stock_median": stock_med,
           "paci": paci, "paci_vs_stock": _paired(paci, stock),
           "fixed": fixed, "best_fixed": best, "rules": {}, "rows": {"stock": stock_rows, "paci": paci_rows}}
    for rule in rules:
        windows = rule_windows(rule, stages, micro_batches)
        vals, rows = finals("lookahead", windows)
        vs_best = None if best is None or vals[0] is None else _rel(vals[0], fixed[best]["final"])
        vs_stock = _paired(vals, stock)
        out["rules"][rule] = {"windows": windows, "final": vals, "median": _median(vals), "vs_stock": vs_stock,
                              "vs_best_fixed": vs_best, "rows": rows,
                              "holds": (None if vs_stock is None or vs_best is None else
                                        vs_best <= RULE_TOLERANCE and vs_stock <= STOCK_TOLERANCE)}
    return out


def lr_sweep_table(results: dict) -> str:
    lines = ["| P | " + " | ".join(f"stock, lr {lr:g}" for lr in SWEEP_LRS) + " | learning rates of the cells |",
             "|---|" + "---|" * (len(SWEEP_LRS) + 1)]
    for stages in DEPTHS:
        cells = [results.get(r.key()) for r in lr_sweep_runs(stages)]
        lrs = cell_lrs(results, stages)
        lines.append(f"| {stages} | " + " | ".join("-" if c is None else f"{c['final']:.4f}" for c in cells)
                     + f" | {'-' if lrs is None else ', '.join(f'{x:g}' for x in lrs)} |")
    return "\n".join(lines)


def _fmt(vals):
    return ", ".join("-" if v is None else f"{v:.4f}" for v in vals)


def cells_table(summaries: list) -> str:
    """Every cell: stock, plain PACI, PACI + look-ahead per window (first seed), best fixed window."""
    names = list(ALL_RULES)
    head = ("| P | M | lr | stock (seeds) | PACI a=max(M,P-1) vs stock | " + " | ".join(f"look-ahead {n}" for n in names)
            + " | best fixed (of the first four) |")
    lines = [head, "|---|---|---|---|---|" + "---|" * len(names) + "---|"]
    for c in summaries:
        ref = c["stock"][0]
        cols = []
        for n in names:
            f = c["fixed"][n]
            cols.append("-" if f["final"] is None else
                        f"a={window_label(f['windows'])}: {f['final']:.4f} ({_pct(_rel(f['final'], ref))})")
        best = "-" if c["best_fixed"] is None else c["best_fixed"]
        lines.append(f"| {c['stages']} | {c['micro_batches']} | {c['lr']:g} | {_fmt(c['stock'])} | "
                     f"{_fmt(c['paci'])} ({_pct(c['paci_vs_stock'])}) | " + " | ".join(cols) + f" | {best} |")
    return "\n".join(lines)


def rule_table(summaries: list, rule: str) -> str:
    """One rule in every cell: its windows, finals on both seeds, vs stock (medians), vs the best fixed window."""
    lines = [f"| P | M | lr | {rule}: a | final (seeds) | vs stock (seeds both ran) | vs best fixed (seed 1) | holds |",
             "|---|---|---|---|---|---|---|---|"]
    for c in summaries:
        r = c["rules"][rule]
        holds = "-" if r["holds"] is None else ("yes" if r["holds"] else "**NO**")
        lines.append(f"| {c['stages']} | {c['micro_batches']} | {c['lr']:g} | {window_label(r['windows'])} | "
                     f"{_fmt(r['final'])} | {_pct(r['vs_stock'])} | {_pct(r['vs_best_fixed'])} | {holds} |")
    return "\n".join(lines)


def muon_table(results: dict) -> str:
    """The Muon cells (:func:`~.grid.muon_runs`, first seed) beside the same cells under AdamW."""
    lines = ["| P | M | lr | optimizer | stock | PACI a=max(M,P-1) (vs stock) | look-ahead auto: a | look-ahead auto "
             "(vs stock) |", "|---|---|---|---|---|---|---|---|"]
    for stages in MUON_DEPTHS:
        lrs = cell_lrs(results, stages)
        if lrs is None:
            continue
        runs = muon_runs(stages, lrs[0])
        for M in micro_batch_counts(stages):
            for opt in ("adamw", "muon"):
                finals = {}
                for run in (r for r in runs if r.micro_batches == M):
                    row = _find(results, stages, M, run.engine, list(run.windows), run.lr, SEEDS[0]) if opt == "adamw" \
                        else results.get(run.key())
                    finals[run.engine] = (None if row is None else row["final"], run.windows)
                stock = finals["stock"][0]

                def cell(engine):
                    v = finals[engine][0]
                    return "-" if v is None else f"{v:.4f} ({_pct(_rel(v, stock))})"
                lines.append(f"| {stages} | {M} | {lrs[0]:g} | {opt} | {'-' if stock is None else f'{stock:.4f}'} | "
                             f"{cell('paci')} | {window_label(finals['lookahead'][1])} | {cell('lookahead')} |")
    return "\n".join(lines)


def steps_to(curve, target):
    """Steps until ``curve`` (``[(step, loss), ...]``) first reaches ``target`` (linear between validations)."""
    prev = None
    for step, loss in curve:
        if loss <= target:
            if prev is None or prev[1] <= loss:
                return float(step)
            return prev[0] + (prev[1] - target) / (prev[1] - loss) * (step - prev[0])
        prev = (step, loss)
    return None


def time_to_final_table(summaries: list, rule: str = "auto") -> str:
    """Time to stock's final loss (and to its loss at 25/50/75% of its run) in the ideal-bubble time model."""
    lines = ["| P | M | lr | engine | seed | " + " | ".join(f"to stock@{int(f * 100)}%" for f in (0.25, 0.5, 0.75))
             + " | to stock's final loss | speedup at the final loss (ideal bubble time) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in summaries:
        P, M = c["stages"], c["micro_batches"]
        ideal = (M + P - 1) / M
        for label, rows in (("PACI", c["rows"]["paci"]), ("look-ahead " + rule, c["rules"][rule]["rows"])):
            for i, (row, stock) in enumerate(zip(rows, c["rows"]["stock"])):
                if row is None or stock is None or row["steps"] <= row["common_steps"]:
                    continue
                n = stock["steps"]
                cols = []
                for frac in (0.25, 0.5, 0.75):
                    target = loss_at_step(stock["curve"], n * frac)
                    got = steps_to(row["curve"], target)
                    cols.append("-" if got is None else f"{got:.0f}")
                got = steps_to(row["curve"], stock["final"])
                if got is None:
                    best_step, best = min(row["curve"], key=lambda p: p[1])
                    final = f"not reached ({_pct(_rel(best, stock['final']))} above at step {best_step})"
                    speed = "-"
                else:
                    final = f"{got:.0f} steps ({got / n:.2f}x stock's)"
                    speed = f"{n * ideal / got:.2f}x"
                lines.append(f"| {P} | {M} | {c['lr']:g} | {label} | {SEEDS[i][0]} | " + " | ".join(cols)
                             + f" | {final} | {speed} |")
    return "\n".join(lines)


def all_cells(results: dict, rules=("auto", )) -> list:
    out = []
    for stages in DEPTHS:
        lrs = cell_lrs(results, stages)
        for lr in lrs or ():
            for M in micro_batch_counts(stages):
                out.append(cell_summary(results, stages, M, lr, rules))
    return out


def write_report(out: str, rules=("auto", "a=max(M,P-1)")) -> str:
    """``<out>/sweep.md`` from ``<out>/runs.jsonl``; returns the markdown."""
    results = load_results(os.path.join(out, "runs.jsonl"))
    cells = all_cells(results, rules)
    parts = ["# Depth x batch sweep (replay)", "", f"Command: `{COMMAND}` (resumable; {len(results)} runs stored).",
             "", "## Stock learning-rate sweep (M = P, first seed)", "", lr_sweep_table(results), "",
             "## Every cell: final validation loss at the common step count (first seed vs stock's first seed)", "",
             cells_table(cells), ""]
    for rule in rules:
        parts += [f"## Rule `{rule}` in every cell", "", rule_table(cells, rule), ""]
    parts += ["## Muon (torch.optim.Muon on the blocks' matrices, AdamW on the rest; first seed) beside AdamW", "",
              muon_table(results), ""]
    parts += ["## Time to stock's final loss (P <= 8; PACI engines trained 1.5x stock's step count)", "",
              time_to_final_table([c for c in cells if c["stages"] <= 8], rules[0]), ""]
    markdown = "\n".join(parts)
    with open(os.path.join(out, "sweep.md"), "w") as f:
        f.write(markdown)
    return markdown

