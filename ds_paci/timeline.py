"""Pipeline timelines, drawn the same way from real runs and from the simulator.

A *record* is one executed instruction of one rank::

    {"rank": 0, "stage": 0, "instr": "F3", "start": 1700000000.10, "end": 1700000000.12}

``instr`` is the text form of :mod:`ds_paci.schedule` (``F3``, ``B3``, ``SA3``, ``RG3``,
``L3``, ``ACC3``, ``STEP1``; the simulator adds ``REDUCE_GRADS``/``REDUCE_TIED`` for stock
DeepSpeed), ``start``/``end`` are seconds (wall clock for engine traces, comparable
across the processes of one machine). The engine writes one JSON-lines file per rank;
:func:`records_from_sim` turns a simulation into the same records.

Renderers: :func:`to_chrome_trace` (Perfetto / chrome://tracing), :func:`to_png`
(matplotlib) and :func:`to_text_grid` (terminal). Each shows one row per stage
(one per rank where several data-parallel ranks share a stage), stage 0 first.
Time spent inside a send or receive counts as idle: it is waiting on a neighbour.
"""

import argparse
import glob
import json
import os
import re
import sys
from collections import defaultdict

__all__ = [
    "kind_of", "micro_batch_in", "load_records", "records_from_sim", "to_chrome_trace", "to_png", "to_text_grid",
    "main"
]

_PREFIX_KIND = [
    ("STEP", "step"),
    ("ACC", "step"),
    ("REDUCE", "step"),
    ("SA", "send"),
    ("SG", "send"),
    ("RA", "recv"),
    ("RG", "recv"),
    ("L", "load"),
    ("F", "forward"),
    ("B", "backward"),
]
_NUMBER = re.compile(r"(\d+)$")
COMPUTE_KINDS = ("forward", "backward", "step", "load")


def kind_of(instr):
    """Kind of an instruction text: forward, backward, step, load, send, recv, or other."""
    for prefix, kind in _PREFIX_KIND:
        if instr.startswith(prefix):
            return kind
    return "other"


def micro_batch_in(instr):
    """Micro-batch id in an instruction text (``F3`` -> 3), ``None`` for steps and reductions."""
    if kind_of(instr) == "step":
        return None
    match = _NUMBER.search(instr)
    return int(match.group(1)) if match else None


# -- sources ----------------------------------------------------------------------------


def load_records(paths_or_dir):
    """Records from JSON-lines files (one per rank) or a directory of ``*.jsonl`` files.

    Accepts a path or a list of paths; a ``.json`` file may also hold a JSON list of
    records. Returns the records sorted by (stage, rank, start).
    """
    if isinstance(paths_or_dir, (str, os.PathLike)):
        paths_or_dir = [paths_or_dir]
    files = []
    for path in map(str, paths_or_dir):
        if os.path.isdir(path):
            found = sorted(glob.glob(os.path.join(path, "*.jsonl")))
            if not found:
                raise FileNotFoundError(f"no *.jsonl trace files in {path}")
            files.extend(found)
        else:
            files.append(path)
    records = []
    for path in files:
        with open(path) as f:
            if path.endswith(".json"):
                records.extend(json.load(f))
            else:
                records.extend(json.loads(line) for line in f if line.strip())
    for rec in records:
        missing = {"rank", "stage", "instr", "start", "end"} - rec.keys()
        if missing:
            raise ValueError(f"trace record {rec} lacks {sorted(missing)}")
    records.sort(key=lambda r: (r["stage"], r["rank"], r["start"]))
    return records


def records_from_sim(result, seconds_per_unit=1.0):
    """The records an engine would have written for a :class:`ds_paci.simulate.SimResult`.

    One record per executed instruction; rank = stage. A simulated wait and the
    transfer that follows it become one send/recv record, as an engine timing the
    blocking call would see it.
    """
    records = []
    for stage, events in enumerate(result.events):
        wait_start = None
        for e in events:
            if e.kind == "wait":
                wait_start = e.start
                continue
            start = e.start if wait_start is None else wait_start
            wait_start = None
            records.append({
                "rank": stage,
                "stage": stage,
                "instr": e.text,
                "start": start * seconds_per_unit,
                "end": e.end * seconds_per_unit
            })
    return records


def _rows(records):
    """{(stage, rank): records} in display order, and each row's label."""
    rows = defaultdict(list)
    for rec in records:
        rows[(rec["stage"], rec["rank"])].append(rec)
    keys = sorted(rows)
    ranks_per_stage = defaultdict(int)
    for stage, _ in keys:
        ranks_per_stage[stage] += 1
    labels = {k: f"stage {k[0]}" if ranks_per_stage[k[0]] == 1 else f"stage {k[0]} rank {k[1]}" for k in keys}
    return {k: rows[k] for k in keys}, labels


def _span(records):
    return min(r["start"] for r in records), max(r["end"] for r in records)


# -- Chrome / Perfetto ------------------------------------------------------------------


def to_chrome_trace(records, path, label=None):
    """Write a Chrome trace-event JSON file (open in https://ui.perfetto.dev or chrome://tracing).

    One process (named ``label``), one thread per row (``tid`` = row index, which is
    the stage when each stage has one rank), one complete event (``"ph": "X"``) per
    record with microsecond timestamps from the earliest start, category = kind.
    """
    rows, labels = _rows(records)
    t0 = _span(records)[0] if records else 0.0
    events = [{"ph": "M", "pid": 0, "tid": 0, "name": "process_name", "args": {"name": label or "ds_paci"}}]
    for tid, (key, recs) in enumerate(rows.items()):
        events.append({"ph": "M", "pid": 0, "tid": tid, "name": "thread_name", "args": {"name": labels[key]}})
        events.append({"ph": "M", "pid": 0, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}})
        for rec in recs:
            args = {"stage": rec["stage"], "rank": rec["rank"]}
            mb = micro_batch_in(rec["instr"])
            if mb is not None:
                args["micro_batch"] = mb
            events.append({
                "ph": "X",
                "pid": 0,
                "tid": tid,
                "name": rec["instr"],
                "cat": kind_of(rec["instr"]),
                "ts": (rec["start"] - t0) * 1e6,
                "dur": max(0.0, rec["end"] - rec["start"]) * 1e6,
                "args": args,
            })
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    return path


# -- PNG --------------------------------------------------------------------------------

COLORS = {
    "forward": "#4C72B0",
    "backward": "#55A868",
    "step": "#C44E52",
    "load": "#8172B2",
    "idle": "#E6E6E6",
}
_LABEL_TEXT = {"forward": "forward", "backward": "backward", "step": "local/optimizer step", "load": "load",
               "idle": "idle (send/recv wait, gaps)"}


def to_png(records, path, title):
    """Write a timeline PNG: one row per stage (stage 0 on top), coloured by kind, with a legend.

    Forward, backward, step and load are drawn in their colours over an idle
    background (gaps and time blocked in send/recv); steps shorter than a pixel are
    drawn as a thin mark. Boxes wide enough show their micro-batch id.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows, labels = _rows(records)
    t0, t1 = _span(records) if records else (0.0, 1.0)
    span = max(t1 - t0, 1e-12)
    fig_width = 14.0
    fig, ax = plt.subplots(figsize=(fig_width, 0.5 * len(rows) + 1.6))
    plot_px = fig_width * fig.dpi * 0.8  # rough width of the axes in pixels
    char_px = 6.0
    for y, (key, recs) in enumerate(rows.items()):
        ax.broken_barh([(0.0, span)], (y - 0.4, 0.8), facecolors=COLORS["idle"])
        boxes = defaultdict(list)
        for rec in recs:
            kind = kind_of(rec["instr"])
            if kind not in COMPUTE_KINDS:
                continue
            x, w = rec["start"] - t0, rec["end"] - rec["start"]
            if rec["instr"].startswith("STEP") and w * plot_px / span < 1.0:
                ax.vlines(x, y - 0.45, y + 0.45, colors=COLORS["step"], linewidth=1.2)
                continue
            boxes[kind].append((x, w))
            mb = micro_batch_in(rec["instr"])
            if mb is not None and kind in ("forward", "backward") and w * plot_px / span > char_px * (len(str(mb)) + 1):
                ax.text(x + w / 2, y, str(mb), ha="center", va="center", fontsize=7, color="white")
        for kind, spans in boxes.items():
            ax.broken_barh(spans, (y - 0.4, 0.8), facecolors=COLORS[kind], edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([labels[k] for k in rows])
    ax.set_ylim(len(rows) - 0.5, -0.5)  # stage 0 on top
    ax.set_xlim(0.0, span)
    ax.set_xlabel("time since first record (s)")
    ax.set_title(title)
    ax.legend(handles=[Patch(color=COLORS[k], label=_LABEL_TEXT[k]) for k in COLORS],
              loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=fig.dpi, bbox_inches="tight")
    plt.close(fig)
    return path


# -- terminal ---------------------------------------------------------------------------

_CHAR = {"forward": "F", "backward": "B", "step": "S", "load": "L"}


def to_text_grid(records, width=100):
    """Plain-text timeline: one line per stage, time cut into ``width`` equal columns.

    Each column shows what the stage did for most of that column (``F`` forward,
    ``B`` backward, ``S`` step, ``L`` load, ``.`` idle: gaps or blocked in send/recv);
    a column holding the start of a ``STEP`` is shown as ``S`` however short the step.
    The last line is the legend with the time per column.
    """
    if not records:
        return "(no records)"
    rows, labels = _rows(records)
    t0, t1 = _span(records)
    col = max(t1 - t0, 1e-12) / width
    label_width = max(len(v) for v in labels.values())
    lines = []
    for key, recs in rows.items():
        cover = [defaultdict(float) for _ in range(width)]
        steps = set()
        for rec in recs:
            kind = kind_of(rec["instr"])
            if rec["instr"].startswith("STEP"):
                steps.add(min(width - 1, int((rec["start"] - t0) / col)))
            if kind not in _CHAR:
                continue
            a, b = rec["start"] - t0, rec["end"] - t0
            first, last = int(a / col), min(width - 1, int(b / col))
            for c in range(first, last + 1):
                overlap = min(b, (c + 1) * col) - max(a, c * col)
                if overlap > 0:
                    cover[c][kind] += overlap
        chars = []
        for c, kinds in enumerate(cover):
            if c in steps:
                chars.append("S")
                continue
            idle = col - sum(kinds.values())
            kind, most = max(kinds.items(), key=lambda kv: kv[1], default=(None, 0.0))
            chars.append(_CHAR[kind] if kind and most >= idle else ".")
        lines.append(f"{labels[key]:>{label_width}} |{''.join(chars)}|")
    lines.append(f"legend: F forward  B backward  S step  L load  . idle (send/recv wait or gap); "
                 f"1 column = {col:.4g} s, span {t1 - t0:.4g} s")
    return "\n".join(lines)


# -- command line -----------------------------------------------------------------------


def _parser():
    p = argparse.ArgumentParser(prog="python -m ds_paci.timeline",
                                description="Render pipeline timelines from engine trace records or a simulation.")
    p.add_argument("records", nargs="*", help="trace directory or *.jsonl files (one per rank)")
    p.add_argument("--chrome", metavar="OUT", help="write a Chrome/Perfetto trace JSON")
    p.add_argument("--png", metavar="OUT", help="write a PNG timeline")
    p.add_argument("--text", action="store_true", help="print a text grid (default when no output is given)")
    p.add_argument("--width", type=int, default=100, help="text grid columns")
    p.add_argument("--title", help="title (say 'emulated' for emulated-accelerator runs)")
    sim = p.add_argument_group("simulation instead of records")
    sim.add_argument("--simulate", action="store_true")
    sim.add_argument("--stages", type=int, default=4)
    sim.add_argument("--micro-batches", type=int, default=4)
    sim.add_argument("--schedule", choices=["paci", "stock"], default="paci")
    sim.add_argument("--window", type=int, default=None, help="PACI accumulation window (default: micro-batches)")
    sim.add_argument("--calls", type=int, default=2, help="train_batch calls (PACI) / batches (stock)")
    sim.add_argument("--forward", type=float, default=1.0)
    sim.add_argument("--backward", type=float, default=None)
    sim.add_argument("--latency", type=float, default=0.0)
    return p


def main(argv=None):
    args = _parser().parse_args(argv)
    if args.simulate == bool(args.records):
        _parser().error("give trace records or --simulate (not both)")
    if args.simulate:
        from ds_paci import simulate as sim  # entry point sits on top of both modules

        cost = sim.CostModel(forward=args.forward, backward=args.backward, latency=args.latency)
        P, M = args.stages, args.micro_batches
        if args.schedule == "paci":
            result = sim.simulate_paci(P, M, args.window, args.calls, cost)
            name = f"PACI a={args.window or M}"
        else:
            result = sim.simulate_stock(P, M, args.calls, cost)
            name = "stock 1F1B-flush"
        if result.deadlock:
            print(result.deadlock, file=sys.stderr)
        records = records_from_sim(result)
        title = args.title or f"simulated {name}, P={P}, M={M}, {args.calls} calls"
    else:
        records = load_records(args.records)
        title = args.title or f"trace: {', '.join(args.records)}"
    if args.chrome:
        to_chrome_trace(records, args.chrome, label=title)
        print(f"wrote {args.chrome}")
    if args.png:
        to_png(records, args.png, title)
        print(f"wrote {args.png}")
    if args.text or not (args.chrome or args.png):
        print(title)
        print(to_text_grid(records, width=args.width))
    return 0


if __name__ == "__main__":
    sys.exit(main())
