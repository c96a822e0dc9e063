"""``python -m ds_paci.tools.studies.quality --part sweep|report --out docs/results/quality``.

``sweep`` runs (or resumes) the depth x batch sweep of :mod:`ds_paci.tools.studies.quality.grid` on the replay,
appending one JSON line per finished run to ``<out>/runs.jsonl``; ``report`` writes the tables;
``phase`` runs the step-phase spot cells (``grid.phase_spot_runs``: ``"aligned"`` against ``"diagonal"``) into
``<out>/runs.jsonl`` and prints them side by side; ``time-to-final`` runs the PACI engines of the benchmark's P = 4 and P = 8 curve study past stock's step count
(:mod:`ds_paci.tools.studies.quality.time_to_final`); ``larger`` the 8 x 256 model (:mod:`ds_paci.tools.studies.quality.larger`);
``default`` today's default window in every sweep cell from the stored runs (:mod:`ds_paci.tools.studies.quality.default`); ``doc`` assembles
``docs/results/quality.md`` from the hand-written ``intro.md``/``findings.md`` of ``--out`` and every table.
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ds_paci.tools.studies.quality", description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=["sweep", "report", "phase", "time-to-final", "larger", "default", "doc"], required=True)
    p.add_argument("--out", default="docs/results/quality")
    p.add_argument("--workers", type=int, default=2, help="replay processes at once")
    p.add_argument("--depths", type=int, nargs="*", help="only these P (default: all of grid.DEPTHS)")
    p.add_argument("--runs", nargs="*", help="with --part larger: only these runs (names of larger.RUNS)")
    p.add_argument("--candidates", default="docs/results/quality-candidates",
                   help="with --part default: the candidates study's results (runs the sweep lacks)")
    args = p.parse_args(argv)
    if args.part == "sweep":
        from .sweep import run_sweep
        run_sweep(args.out, workers=args.workers, depths=tuple(args.depths) if args.depths else None,
                  echo=lambda line: print(line, flush=True))
        return 0
    if args.part == "phase":
        from .grid import phase_spot_runs
        from .sweep import run_sweep
        results = run_sweep(args.out, workers=args.workers, plan_fn=lambda res: phase_spot_runs(),
                            echo=lambda line: print(line, flush=True))
        print(phase_table(results))
        return 0
    if args.part == "doc":
        from .doc import assemble_doc
        assemble_doc(args.out)
        return 0
    if args.part == "larger":
        from . import larger
        larger.run_all(args.out, echo=lambda line: print(line, flush=True), names=args.runs)
        print(larger.write_report(args.out))
        return 0
    if args.part == "default":
        from . import default
        print(default.write_report(args.out, args.candidates))
        return 0
    if args.part == "time-to-final":
        from . import time_to_final
        time_to_final.run_all(args.out, echo=lambda line: print(line, flush=True))
        print(time_to_final.write_report(args.out))
        return 0
    from .report import write_report
    print(write_report(args.out))
    return 0


def phase_table(results: dict) -> str:
    """Markdown: the spot cells' final losses, ``"aligned"`` and ``"diagonal"`` side by side."""
    import dataclasses

    from .grid import phase_spot_runs
    lines = ["| P | M | windows | lr | aligned | diagonal | diagonal vs aligned |", "|---:|---:|---|---:|---:|---:|---:|"]
    for run in phase_spot_runs():
        if run.step_phase != "aligned":
            continue
        a = results.get(run.key())
        d = results.get(dataclasses.replace(run, step_phase="diagonal").key())
        if a is None or d is None:
            continue
        lines.append(f"| {run.stages} | {run.micro_batches} | {','.join(map(str, run.windows))} | {run.lr:g} "
                     f"| {a['final']:.4f} | {d['final']:.4f} | {100 * (d['final'] / a['final'] - 1):+.2f}% |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
