"""``python -m ds_paci.tools.quality --part sweep|report --out docs/results/quality``.

``sweep`` runs (or resumes) the depth x batch sweep of :mod:`ds_paci.tools.quality.grid` on the replay,
appending one JSON line per finished run to ``<out>/runs.jsonl``; ``report`` writes the tables.
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ds_paci.tools.quality", description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=["sweep", "report"], required=True)
    p.add_argument("--out", default="docs/results/quality")
    p.add_argument("--workers", type=int, default=2, help="replay processes at once")
    p.add_argument("--depths", type=int, nargs="*", help="only these P (default: all of grid.DEPTHS)")
    args = p.parse_args(argv)
    if args.part == "sweep":
        from .sweep import run_sweep
        run_sweep(args.out, workers=args.workers, depths=tuple(args.depths) if args.depths else None,
                  echo=lambda line: print(line, flush=True))
        return 0
    from .report import write_report
    print(write_report(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
