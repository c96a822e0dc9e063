"""The peer study's report: ``<out>.md`` with every cell, the simulator beside the measurements, and the figure.

Everything here is computed from the stored cells (``<out>/cells/*.json``); ``<out>/notes.md``, when present, is
the hand-written part (explanations of the simulator's misses) and is copied into the report as it is.
"""

from __future__ import annotations

import datetime
import json
import os

from ds_paci.tools.sim.peer_schedules import PEERS, action_lists, action_strings
from .model import PeerCell
from .simcheck import simulated_ratios, simulator_table

TITLES = {"stock": "stock 1F1B-flush (DeepSpeed)", "paci": "PACI", "paci+lookahead": "PACI + look-ahead",
          **{name: peer.title for name, peer in PEERS.items()}}
CURVES = {(4, 4): "emulated_P4_M4_curves.json", (8, 8): "emulated_P8_M8_curves.json"}


def _cell(entry) -> PeerCell:
    return PeerCell(**entry["cell"])


def _mib(nbytes) -> str:
    return f"{nbytes / 2**20:.1f}"


def summary_rows(entries) -> list:
    """Per cell: best synchronous peer, PACI and PACI + look-ahead tokens/s and their ratios to the peer."""
    rows = []
    for e in entries:
        r, eng = e["ratios"], e["engines"]
        best = r.get("best_synchronous")
        if best is None or "paci+lookahead" not in eng:
            continue
        la = r["paci+lookahead_vs_best_synchronous"]
        limit = e["bubble_free_tokens_per_second"]
        rows.append({"cell": e["name"], "label": e["label"], "best": best,
                     "best_tps": eng[best]["tokens_per_second"]["median"],
                     "paci_tps": eng["paci"]["tokens_per_second"]["median"] if "paci" in eng else None,
                     "la_tps": eng["paci+lookahead"]["tokens_per_second"]["median"], "la_vs_best": la["median"],
                     "la_vs_best_rounds": la["per_round"],
                     "limit_vs_best": None if limit is None else limit / eng[best]["tokens_per_second"]["median"]})
    return rows


def summary_table(entries) -> str:
    lines = ["| cell | best synchronous peer (tokens/s) | PACI tokens/s | PACI + look-ahead tokens/s | "
             "**look-ahead / best peer** (per round) | bubble-free limit / best peer |", "|---|---|---|---|---|---|"]
    for row in summary_rows(entries):
        rounds = ", ".join(f"{x:.2f}" for x in row["la_vs_best_rounds"])
        limit = "-" if row["limit_vs_best"] is None else f"{row['limit_vs_best']:.2f}"
        paci = "-" if row["paci_tps"] is None else f"{row['paci_tps']:.0f}"
        lines.append(f"| {row['label']} | {TITLES[row['best']]} ({row['best_tps']:.0f}) | {paci} | "
                     f"{row['la_tps']:.0f} | **{row['la_vs_best']:.2f}** ({rounds}) | {limit} |")
    return "\n".join(lines)


def _executed_matches(entry, engine) -> str:
    if engine not in PEERS:
        return ""
    expected = action_strings(action_lists(engine, entry["cell"]["stages"], entry["cell"]["micro_batches"]))
    executed = entry["engines"][engine]["executed"]
    return "yes" if all(executed[r] == expected[r] for r in expected) else "NO"


def round_loads(entry) -> str:
    """The 1-minute load average of each round, as the lowest-highest of the values taken after each engine's run."""
    per_round = list(zip(*(s["loadavg_per_round"] for s in entry["engines"].values())))
    return ", ".join(f"{min(r):.0f}-{max(r):.0f}" for r in per_round)


def cell_load(entry) -> float:
    """Median of every 1-minute load average taken in the cell (after each engine's run of each round)."""
    import statistics
    return statistics.median(x for s in entry["engines"].values() for x in s["loadavg_per_round"])


def cell_table(entry) -> str:
    """One cell: every engine's throughput, simulated ratio, memory, losses and the checks."""
    cell = _cell(entry)
    sim = simulated_ratios(cell, entry["engines"]) if cell.emulated else {}
    limit = entry["bubble_free_tokens_per_second"]
    lines = [f"### {entry['label']}", "",
             f"Cell `{entry['name']}`: {cell.stages} ranks, {cell.n_layer} blocks, {cell.micro_batches} micro-batches "
             f"of {cell.micro_batch_size} x {cell.seq_len} tokens, {cell.steps} steps ({cell.warmup} untimed), "
             f"{entry['rounds']} rounds; run {entry['started_utc']}, {entry['wall_seconds']:.0f} s, load average "
             f"{entry['loadavg_before'][0]:.1f} -> {entry['loadavg_after'][0]:.1f}, per round (1-minute load after "
             f"each engine's run, lowest-highest) {round_loads(entry)}"
             + (f"; bubble-free limit {limit:.0f} tokens/s." if limit else "."), "",
             "| engine | tokens/s (median) | per round | vs stock | simulated vs stock | of the limit | activation MiB "
             "(max rank; per rank) | val loss | vs stock: loss, weights | executed = action list |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for engine in entry["engines"]:
        s = entry["engines"][engine]
        tps = s["tokens_per_second"]
        vs = entry["ratios"]["vs_stock"][engine]
        agree = entry["agreement"].get(engine)
        check = ("-" if agree is None else
                 f"{agree['loss_relative']:.1e}, {agree['weights_absolute']:.1e} "
                 f"{'(agrees)' if agree['agrees'] else '**DISAGREES**'}")
        act = s["activation_bytes_per_rank"]
        simulated = f"{sim[engine]:.3f}" if engine in sim else "-"
        share = f"{tps['median'] / limit:.0%}" if limit else "-"
        lines.append(f"| {TITLES[engine]} | {tps['median']:.0f} | {', '.join(f'{x:.0f}' for x in tps['per_round'])} "
                     f"| {vs:.3f} | {simulated} | {share} | {_mib(max(act))} ({', '.join(_mib(x) for x in act)}) | "
                     f"{s['validation_loss']:.4f} | {check} | {_executed_matches(entry, engine)} |")
    for engine, reason in entry["skipped"].items():
        lines.append(f"| {TITLES[engine]} | not run: {reason} | | | | | | | | |")
    return "\n".join(lines)


def _curve_runs(path: str) -> tuple[dict, list, list, int]:
    with open(path) as f:
        stored = json.load(f)
    runs, lrs, seeds = {}, [], []
    for key, run in stored["runs"].items():
        fields = dict(part.split("=") for part in key.split())
        lr, seed = float(fields["lr"]), int(fields["seed"])
        runs[(lr, seed, fields["engine"])] = [(p["step"], p["loss"]) for p in run["validation"]]
        lrs += [lr] if lr not in lrs else []
        seeds += [seed] if seed not in seeds else []
    return runs, lrs, seeds, stored["steps"]


def time_to_loss_rows(entries, curves_dir: str) -> list:
    """Time to stock's loss at 25/50/75% of the curve study's run: PACI + look-ahead vs the best synchronous peer.

    Every synchronous schedule has stock's loss at every step (checked per cell), so its steps to a loss are
    stock's; times are steps x this study's measured seconds per step of the 1:1:1 cell with the curve study's
    ``P`` and ``M``.
    """
    from ...bench.analysis import study_comparison
    rows = []
    for e in entries:
        cell = _cell(e)
        name = CURVES.get((cell.stages, cell.micro_batches))
        path = None if name is None else os.path.join(curves_dir, name)
        if cell.ratio != "1:1:1" or path is None or not os.path.exists(path):
            continue
        best = e["ratios"]["best_synchronous"]
        spb = {"stock": e["engines"][best]["seconds_per_step_median"],
               "paci": e["engines"]["paci"]["seconds_per_step_median"],
               "paci+lookahead": e["engines"]["paci+lookahead"]["seconds_per_step_median"]}
        runs, lrs, seeds, steps = _curve_runs(path)
        comparison = study_comparison(runs, lrs, seeds, ("stock", "paci", "paci+lookahead"), steps, spb)
        for lr, per_lr in comparison.items():
            for target in per_lr["paci+lookahead"]["targets"]:
                rows.append({"cell": e["name"], "best": best, "lr": lr, "fraction": target["fraction"],
                             "steps": target["steps"], "speedup": target["speedup"]["median"], "curves": path})
    return rows


def time_to_loss_table(rows) -> str:
    lines = ["| cell | best peer | lr | stock's loss at | look-ahead steps to it (per seed) | "
             "time to it, best peer / look-ahead |", "|---|---|---|---|---|---|"]
    for row in rows:
        speed = "not reached" if row["speedup"] is None else f"{row['speedup']:.2f}x"
        lines.append(f"| {row['cell']} | {TITLES[row['best']]} | {row['lr']:.3g} | {row['fraction']:.0%} of its run | "
                     f"{', '.join('-' if s is None else f'{s:.0f}' for s in row['steps'])} | {speed} |")
    return "\n".join(lines)


def load_paragraph(entries) -> str:
    """What the shared machine's load was per cell and what it does to the figures (host time vs emulated time)."""
    from .simcheck import fitted_host_time
    parts = []
    for e in entries:
        cell = _cell(e)
        host = (fitted_host_time(cell, e["engines"]["stock"]["seconds_per_step_median"])
                if cell.emulated and "stock" in e["engines"] else None)
        parts.append(f"`{e['name']}` {cell_load(e):.0f}" + ("" if host is None else f" (h = {host * 1000:.0f} ms)"))
    return ("**Load.** The machine has 2 cores shared with other jobs; the median 1-minute load average in each cell "
            "(and, for emulated cells, the host time h per micro-batch and rank that makes the simulated stock step "
            "as long as the measured one): " + ", ".join(parts) + ". The emulated waits (F, B, W) use no CPU and do "
            "not stretch with the load; everything else does: Python, autograd of the small blocks, gloo copies, "
            "the optimizer. In emulated cells that host share is small beside 40 ms per block and pass but grows "
            "with the load, and since the ranks of a world share 2 cores their host work cannot overlap the way "
            "their emulated waits do: a schedule that keeps more ranks busy at once asks for more CPU at once. "
            "Host time therefore pulls every schedule's gain over stock below its emulated value (PACI's and the "
            "zero-bubble peers' alike; see the simulator section), more at higher load: the emulated ratios are "
            "lower bounds of what F, B, W alone give. Real-compute cells (P = 2) are all host time: their tokens/s "
            "inflate directly with the load, per round, which is why their rounds scatter and only the medians of "
            "alternating rounds are compared.")


def closing_note(entries) -> str:
    """Per cell, PACI + look-ahead over the best synchronous peer (the cells below 1 named)."""
    rows = summary_rows(entries)
    below = [r for r in rows if r["la_vs_best"] < 1.0]
    lines = ["## Closing note: PACI + look-ahead over the best synchronous peer", "",
             "Median tokens/s of PACI + look-ahead over the median of the fastest synchronous schedule of the same "
             "cell (the schedule named; every synchronous schedule computes stock's losses):", ""]
    for r in rows:
        lines.append(f"- `{r['cell']}`: **{r['la_vs_best']:.2f}x** over {TITLES[r['best']]}"
                     + (" (below 1)" if r["la_vs_best"] < 1.0 else ""))
    lines += ["", f"Below 1 in {len(below)} of {len(rows)} cells"
              + (": " + ", ".join(f"`{r['cell']}`" for r in below) if below else "") + "."]
    return "\n".join(lines)


def write_report(entries, out: str, command: str, curves_dir: str | None = None) -> str:
    """Write ``<out>.md`` and ``<out>/throughput_P8.png``; returns the markdown. ``curves_dir``: the look-ahead
    curve study (default: ``lookahead/`` beside ``out``)."""
    curves_dir = curves_dir or os.path.join(os.path.dirname(os.path.abspath(out)), "lookahead")
    from .plots import plot_throughput_vs_m
    figure = plot_throughput_vs_m(entries, 8, os.path.join(out, "throughput_P8.png"))
    started = sorted(e["started_utc"] for e in entries)
    loads = [x for e in entries for x in (e["loadavg_before"][0], e["loadavg_after"][0])]
    machine = entries[0]["machine"]
    lines = ["# PACI against the strongest synchronous schedules", "",
             f"Command: `{command}` (cells run {started[0]} to {started[-1]} UTC; load average "
             f"{min(loads):.1f}-{max(loads):.1f} on {machine['cpu_count']} cores; torch {machine['torch']}, "
             f"DeepSpeed {machine['deepspeed']}). Report written "
             f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}.", "",
             "Emulated cells add CPU-free waits per block (F forward, B input gradient, W weight gradient; DeepSpeed's "
             "engines pay B + W in one backward, torch's split schedules each in its own pass): their times are "
             "**emulated**, their losses real. Every engine of a cell runs in the same world, same blocks, initial "
             "weights, data, micro-batching, loss scaling and AdamW; rounds alternate the order.", "",
             "## PACI + look-ahead against the best synchronous peer, per cell", "", summary_table(entries), "",
             load_paragraph(entries), ""]
    if figure:
        lines += [f"![throughput against M at P = 8]({os.path.relpath(figure, os.path.dirname(out) or '.')})", ""]
    rows = time_to_loss_rows(entries, curves_dir)
    if rows:
        lines += ["## Time to the same loss", "",
                  f"Loss curves: the look-ahead curve study ({os.path.relpath(curves_dir)}, 300 steps, 2 seeds, its "
                  "own model of one block per stage); the synchronous peers' steps are stock's (same loss at every "
                  "step, checked in every cell below); times: this study's measured seconds per step.", "",
                  time_to_loss_table(rows), ""]
    lines += ["## Every cell", ""]
    for e in entries:
        lines += [cell_table(e), ""]
    lines += ["## The simulator against the measurements", "",
              "Simulated: each schedule's own action list (torch's `pipeline_order`; for torch's 1F1B the order its "
              "runtime executes) and DeepSpeed's and PACI's instruction streams, timed with the cell's emulated F, B, "
              "W and nothing else (`ds_paci.tools.sim.peer_schedules`, `ds_paci.tools.sim.simulate`). With host time: plus "
              "h per micro-batch and rank, fitted on stock. Replay: the first timed step of round 0 timed with its own "
              "measured action durations (`ds_paci.tools.studies.peers.simcheck`).", "",
              simulator_table(entries, TITLES), ""]
    lines += [closing_note(entries), ""]
    notes = os.path.join(out, "notes.md")
    if os.path.exists(notes):
        with open(notes) as f:
            lines += [f.read().strip(), ""]
    markdown = "\n".join(lines)
    with open(out.rstrip("/") + ".md", "w") as f:
        f.write(markdown)
    return markdown
