"""``python -m ds_paci.tools.sim.timeline``: render timelines of engine traces or of a simulation.

    python -m ds_paci.tools.sim.timeline TRACE_DIR --png t.png --text
    python -m ds_paci.tools.sim.timeline --simulate --stages 4 --micro-batches 4 --schedule stock
"""

import argparse
import sys

from .records import load_records, records_from_sim
from .render import to_chrome_trace, to_png, to_text_grid
from .simulate import CostModel, simulate_schedule

__all__ = ["main"]


def _parser():
    p = argparse.ArgumentParser(prog="python -m ds_paci.tools.sim.timeline",
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
        cost = CostModel(forward=args.forward, backward=args.backward, latency=args.latency)
        result, title = simulate_schedule(args.schedule, args.stages, args.micro_batches, args.window, args.calls, cost)
        if result.deadlock:
            print(result.deadlock, file=sys.stderr)
        records = records_from_sim(result)
        title = args.title or title
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
