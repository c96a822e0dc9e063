"""``docs/results/quality.md``: the hand-written ``intro.md`` and ``findings.md`` of the results folder, then every
generated table (the sweep, today's default window in every cell, the time to stock's final loss, the larger model,
the engine confirmations)."""

from __future__ import annotations

import os
import re

from . import default
from . import larger
from . import time_to_final
from .grid import window_label
from .report import write_report


def confirmations_table(out: str) -> str:
    """Engine confirmations (``<out>/confirmations.jsonl``, lines of ``python -m ds_paci.tools.replay.check``)."""
    import json
    path = os.path.join(out, "confirmations.jsonl")
    rows = [json.loads(x) for x in open(path).read().splitlines() if x.strip()] if os.path.exists(path) else []
    lines = ["| P | M | mode | window | steps | engine windows | per-call losses identical | validation gap | weights "
             "identical | engine final | load |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s = r["spec"]
        lines.append(f"| {s['stages']} | {s['micro_batches']} | {s['mode']} | {s['window']} | {s['steps']} | "
                     f"{window_label(r['windows']['engine'])} | {'yes' if r['call_losses_identical'] else 'NO'} | "
                     f"{r['curve_gap']:.3g} | {'yes' if r['weights_identical'] else 'NO'} | {r['engine_final']:.4f} | "
                     f"{r['loadavg'][0]:.1f} |")
    return "\n".join(lines) if rows else "(none stored yet)"


def assemble_doc(out: str, target: str = "docs/results/quality.md") -> str:
    """``target`` from ``<out>/intro.md``, ``<out>/findings.md`` (hand-written) and the generated tables."""
    def read(name):
        path = os.path.join(out, name)
        return open(path).read().strip() if os.path.exists(path) else f"({name}: not generated yet; see \"Not measured in this round\")"

    def demote(text):  # the generated pages' headings one level down; their images found from the target's folder
        text = re.sub(r"!\[([^\]]*)\]\(([^)/:]+)\)",
                      lambda m: f"![{m.group(1)}]({os.path.relpath(os.path.join(out, m.group(2)), os.path.dirname(target) or '.')})",
                      text)
        return "\n".join("#" + line if line.startswith("#") else line for line in text.splitlines())

    write_report(out)
    if os.path.exists(os.path.join(out, "time_to_final.jsonl")):
        time_to_final.write_report(out)
    if os.path.exists(os.path.join(out, "larger.jsonl")):
        larger.write_report(out)
    if os.path.exists(os.path.join(out, "runs.jsonl")):  # the candidates study beside the results folder
        default.write_report(out, os.path.join(os.path.dirname(os.path.normpath(out)), "quality-candidates"))
    parts = [read("intro.md"), read("findings.md"), demote(read("sweep.md")), demote(read("default.md")),
             demote(read("time_to_final.md")), demote(read("larger.md")), "## Engine confirmations of sweep cells", "",
             confirmations_table(out), ""]
    markdown = "\n\n".join(parts)
    with open(target, "w") as f:
        f.write(markdown)
    return markdown
