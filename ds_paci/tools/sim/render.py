"""Timeline renderers: the same pictures from engine traces and from the simulator.

:func:`to_chrome_trace` (Perfetto / chrome://tracing), :func:`to_png` (matplotlib) and
:func:`to_text_grid` (terminal) take records (:mod:`ds_paci.tools.sim.records`). Each shows
one row per stage (one per rank where several data-parallel ranks share a stage),
stage 0 first. Time spent inside a send or receive counts as idle: it is waiting on a
neighbour.
"""

import json
from collections import defaultdict

from .records import COMPUTE_KINDS, kind_of, micro_batch_in

__all__ = ["to_chrome_trace", "to_png", "to_text_grid"]


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

