"""Today's default in every sweep cell: ``"accumulation_window": "auto"`` with its ``"auto"`` warm start (issue 30).

The engine's default ``"auto"`` (:func:`ds_paci.core.config.auto_window`) runs a synchronous warm start until the
mean loss of the last 8 calls is below 0.9 x the labels' unigram entropy (:mod:`ds_paci.core.program.warm_end`),
then the look-ahead with one window ``max(P-1, ceil(M/3))``, per stage where ``M < P-1`` (``a_s = max(min(M, P-1),
P-1-s, ceil(M/3))``). The sweep (``runs.jsonl``) has no such run: they are the candidates study's ``syncauto-auto``
runs of the sweep's cells (``docs/results/quality-candidates``, :mod:`ds_paci.tools.studies.candidates`;
:func:`candidate_runs` checks that every field is the sweep's configuration), against the sweep's stock runs (the
candidates study's stock runs that the sweep also stored agree with it to the figure :func:`agreement` gives, not
bit for bit). The default before this change (the same windows without a warm start: one window ``P-1`` everywhere)
is shown per seed where stored, from the sweep or the candidates' ``uniform-max`` runs. Cells without a run are
listed (:func:`missing_runs`).

``python -m ds_paci.tools.studies.quality --part default --out docs/results/quality [--candidates
docs/results/quality-candidates]`` writes ``<out>/default.md``.
"""

from __future__ import annotations

import glob
import json
import os
import statistics

from .grid import DEPTHS, EVALS_PER_RUN, MODEL, SEEDS, STEPS, auto_windows, cell_lrs, micro_batch_counts, window_label

CANDIDATES_DIR = "docs/results/quality-candidates"
#: The candidates that are the plain engine (no prediction or learning-rate change): name -> engine of the sweep.
PLAIN = {"stock": "stock", "uniform-max": "lookahead", "syncauto-auto": "lookahead+warm"}
WITHIN = (0.01, 0.02)  # the bounds: every cell within 1%, the M = P/2 cells at stock's best lr within 2%


def old_auto_windows(stages: int, micro_batches: int) -> list:
    """The per-stage ``"auto"`` before issue 30 (guard ``ceil(M/3)`` since 2026-12-01)."""
    return [max(min(micro_batches, stages - 1), stages - 1 - s, -(-micro_batches // 3), 1) for s in range(stages)]


def sweep_shapes(depths=DEPTHS) -> list:
    """Every (P, M) of the sweep grid."""
    return [(stages, m) for stages in depths for m in micro_batch_counts(stages)]


def window_changes(depths=DEPTHS) -> list:
    """Per sweep shape: the old per-stage windows, today's, and the stages where they differ."""
    out = []
    for stages, m in sweep_shapes(depths):
        old, new = old_auto_windows(stages, m), auto_windows(stages, m)
        out.append({"stages": stages, "micro_batches": m, "old": old, "new": new,
                    "differ": [s for s in range(stages) if old[s] != new[s]]})
    return out


def _rel(x, ref):
    return (x - ref) / ref


def _is_sweep_configuration(cell: dict, steps: int) -> bool:
    """Whether a candidates-study cell is a sweep run's configuration (model, data, step count, validations)."""
    from .sweep import RESTORE
    P = cell.get("stages")
    return (P in STEPS and steps == STEPS[P] and cell.get("steps") == steps
            and cell.get("blocks_per_stage", 1) == 1 and cell.get("n_embd") == MODEL.n_embd
            and cell.get("n_head") == MODEL.n_head and cell.get("seq_len") == MODEL.seq_len
            and cell.get("micro_batch_size") == MODEL.micro_batch_size
            and cell.get("val_micro_batches") == MODEL.val_micro_batches
            and cell.get("eval_every") == max(1, STEPS[P] // EVALS_PER_RUN) and cell.get("drains") is False
            and cell.get("restore") == RESTORE)


def candidate_runs(directory: str = CANDIDATES_DIR) -> dict:
    """``{(P, M, engine, windows, lr, seed, data_seed): row}`` of the candidates study's plain runs (:data:`PLAIN`)
    made in a sweep configuration (:func:`_is_sweep_configuration`); ``row`` has ``final`` and ``source``."""
    out = {}
    for path in sorted(glob.glob(os.path.join(directory, "*", "*.json"))):
        name = os.path.splitext(os.path.basename(path))[0]
        if name not in PLAIN:
            continue
        with open(path) as f:
            row = json.load(f)
        cell = row["cell"]
        if not _is_sweep_configuration(cell, row["steps"]):
            continue
        key = (cell["stages"], cell["micro_batches"], PLAIN[name], tuple(row["windows"]), float(cell["lr"]),
               cell["seed"], cell["data_seed"])
        out[key] = {"final": row["final"], "source": os.path.relpath(path, os.path.dirname(directory) or "."),
                    "warm_calls": row.get("warm_calls")}
    return out


def agreement(results: dict, candidates: dict) -> dict:
    """The candidates study's runs that the sweep stored too: how many, and the largest relative gap of the
    final losses (the replay is not bit-reproducible across the two studies' machines and sessions)."""
    from .report import _find
    gaps = []
    for (P, M, engine, windows, lr, seed, data_seed), row in candidates.items():
        if engine not in ("stock", "lookahead"):
            continue
        mine = _find(results, P, M, engine, list(windows), lr, (seed, data_seed))
        if mine is not None:
            gaps.append(abs(_rel(row["final"], mine["final"])))
    return {"runs": len(gaps), "max_gap": max(gaps) if gaps else None}


def default_windows(stages: int, micro_batches: int) -> list:
    """The default's windows after its warm start: ``"auto"`` per stage (:func:`ds_paci.core.config.auto_window`)."""
    from ds_paci.core.config import auto_window
    return [auto_window(stages, micro_batches, s, per_stage=True) for s in range(stages)]


def default_cells(results: dict, depths=DEPTHS, candidates=None) -> list:
    """One dict per sweep cell (P, M, lr): per seed stock's final loss (the sweep's) and the default's (the
    candidates study's ``syncauto-auto``, ``None``: not run), its warm calls, the two seeds' mean against stock's
    (both present only), and per seed the default before the warm start (one window ``P-1``) against stock."""
    from .report import _find
    candidates = candidates or {}
    cells = []
    for stages in depths:
        lrs = cell_lrs(results, stages)
        if lrs is None:
            continue
        for lr in lrs:
            for m in micro_batch_counts(stages):
                windows, before = default_windows(stages, m), auto_windows(stages, m)
                stock, default, warm, old = [], [], [], []
                for pair in SEEDS:
                    s = _find(results, stages, m, "stock", None, lr, pair)
                    d = candidates.get((stages, m, "lookahead+warm", tuple(windows), float(lr)) + tuple(pair))
                    o = _find(results, stages, m, "lookahead", before, lr, pair) or candidates.get(
                        (stages, m, "lookahead", tuple(before), float(lr)) + tuple(pair))
                    stock.append(None if s is None else s["final"])
                    default.append(None if d is None else d["final"])
                    warm.append(None if d is None else d.get("warm_calls"))
                    old.append(None if o is None or s is None else _rel(o["final"], s["final"]))
                both = all(v is not None for v in stock + default)
                mean_vs = _rel(statistics.mean(default), statistics.mean(stock)) if both else None
                cells.append({"stages": stages, "micro_batches": m, "lr": lr, "best_lr": lr == lrs[0],
                              "windows": windows, "stock": stock, "default": default, "warm_calls": warm,
                              "steps": STEPS[stages],
                              "per_seed": [None if d is None or s is None else _rel(d, s)
                                           for d, s in zip(default, stock)],
                              "vs_stock": mean_vs, "old_per_seed": old})
    return cells


def missing_runs(cells: list) -> list:
    """``(P, M, lr, seed, windows)`` of every look-ahead run today's rule needs that is not stored."""
    return [(c["stages"], c["micro_batches"], c["lr"], pair[0], c["windows"]) for c in cells
            for pair, d in zip(SEEDS, c["default"]) if d is None]


def _pct(x):
    return "-" if x is None else f"{100 * x:+.2f}%"


def _loss(x, source="runs.jsonl"):
    return "not stored" if x is None else f"{x:.4f}" + ("" if source == "runs.jsonl" else " (c)")


def _yes(x, bound):
    return "-" if x is None else ("yes" if x <= bound else "**no**")


def write_report(out: str, candidates_dir: str = CANDIDATES_DIR) -> str:
    """``<out>/default.md`` from ``<out>/runs.jsonl`` (and the candidates study's plain runs in ``candidates_dir``
    where the sweep has no run); returns the markdown."""
    from .sweep import load_results
    results = load_results(os.path.join(out, "runs.jsonl"))
    candidates = candidate_runs(candidates_dir)
    agree = agreement(results, candidates)
    cells = default_cells(results, candidates=candidates)
    gap = "-" if agree["max_gap"] is None else f"{100 * agree['max_gap']:.3f}%"
    seeds = " / ".join(str(s) for s, _ in SEEDS)
    lines = ["# Today's default in every sweep cell: `\"auto\"` with its warm start", "", __doc__.split("\n\n")[1]
             .replace("\n", " "), "",
             f"Final losses at the common step count, seeds {seeds}; \"vs stock\" is the mean over both seeds of the "
             "default against stock's mean (both seeds stored only), \"per seed\" each seed's own. \"best lr\": stock's "
             "best learning rate of the depth. \"warm calls\": the calls the warm start lasted, per seed, of the run's "
             f"calls (all of them: it never ended, and the run is stock's). Of the candidates study's {agree['runs']} "
             f"stock and plain look-ahead runs that the sweep also stored, the largest gap in final loss is {gap}.", "",
             "| P | M | lr | windows after the warm start | stock | default | warm calls | per seed | vs stock (both "
             "seeds) | within 1% | within 2% | before (no warm start), per seed |",
             "|---:|---:|---:|---|---|---|---|---|---:|---|---|---|"]
    for c in cells:
        lr = f"{c['lr']:g}" + (" (best)" if c["best_lr"] else "")
        warm = " / ".join("-" if w is None else str(w) for w in c["warm_calls"]) + f" of {c['steps']}"
        lines.append(f"| {c['stages']} | {c['micro_batches']} | {lr} | {window_label(c['windows'])} | "
                     f"{' / '.join(map(_loss, c['stock']))} | {' / '.join(_loss(d, 'c') for d in c['default'])} | "
                     f"{warm} | {' / '.join(map(_pct, c['per_seed']))} | {_pct(c['vs_stock'])} | "
                     f"{_yes(c['vs_stock'], WITHIN[0])} | {_yes(c['vs_stock'], WITHIN[1])} | "
                     f"{' / '.join(map(_pct, c['old_per_seed']))} |")
    missing = missing_runs(cells)
    lines += ["", f"## Runs not made ({len(missing)})", ""]
    lines += [f"- P = {p}, M = {m}, lr {lr:g}, seed {seed}: the default (`syncauto-auto`), windows {window_label(w)}"
              for p, m, lr, seed, w in missing] or ["(none)"]
    over = [c for c in cells if c["vs_stock"] is not None and c["vs_stock"] > WITHIN[0]]
    half = [c for c in cells if c["best_lr"] and 2 * c["micro_batches"] == c["stages"]]
    lines += ["", "## Against the issue's bounds", "",
              f"Cells with both seeds stored: {sum(c['vs_stock'] is not None for c in cells)} of {len(cells)}; "
              f"within 1% of stock over both seeds: {sum(c['vs_stock'] is not None and c['vs_stock'] <= WITHIN[0] for c in cells)}.",
              "", "Not within 1% over both seeds:", ""]
    lines += [f"- P = {c['stages']}, M = {c['micro_batches']}, lr {c['lr']:g}: {_pct(c['vs_stock'])} "
              f"(seeds {' / '.join(map(_pct, c['per_seed']))})" for c in over] or ["(none)"]
    split = [c for c in cells if c["vs_stock"] is not None and c["vs_stock"] <= WITHIN[0]
             and max(c["per_seed"]) > WITHIN[0]]
    lines += ["", "Within 1% over both seeds, one seed not:", ""]
    lines += [f"- P = {c['stages']}, M = {c['micro_batches']}, lr {c['lr']:g}: {_pct(c['vs_stock'])} "
              f"(seeds {' / '.join(map(_pct, c['per_seed']))})" for c in split] or ["(none)"]
    lines += ["", "M = P/2 at stock's best learning rate against the 2% bound:", ""]
    lines += [f"- P = {c['stages']}, M = {c['micro_batches']}, lr {c['lr']:g}: "
              + (f"{_pct(c['vs_stock'])} over both seeds ({'within' if c['vs_stock'] <= WITHIN[1] else 'not within'} 2%)"
                 if c["vs_stock"] is not None else
                 f"seed {SEEDS[0][0]} {_pct(c['per_seed'][0])}, the other seed not stored")
              for c in half]
    markdown = "\n".join(lines) + "\n"
    with open(os.path.join(out, "default.md"), "w") as f:
        f.write(markdown)
    return markdown
