"""Discrete-event simulation of per-stage pipeline programs: the command line, and every public name.

The simulator is split by responsibility; this module keeps them importable from one place and is
``python -m ds_paci.tools.sim.simulate``:

* :mod:`ds_paci.tools.sim.cost`: :class:`CostModel`, what every action costs;
* :mod:`ds_paci.tools.sim.tied`: :class:`TiedExchange` and the pass placing the tied exchange on a program;
* :mod:`ds_paci.tools.sim.simulator`: :func:`simulate` (a timing handler of :mod:`ds_paci.core.program.interpreter`, the
  one interpreter of programs) and its results (:class:`SimResult`, :class:`Event`, :class:`Deadlock`, ...);
* :mod:`ds_paci.tools.sim.nonblocking`: the non-blocking transfers (``simulate(..., transfers="nonblocking")``);
* :mod:`ds_paci.tools.sim.programs`: stock and PACI programs, long-run periods, the published reference
  formulas and the comparison table.
"""

import argparse
import json
import sys

from .records import records_from_sim
from .render import to_chrome_trace, to_png, to_text_grid
from .cost import CostModel
from .programs import (ZB_SOURCE, comparison_rows, long_run_period, markdown_table, paci_programs, reference_rows,
                           simulate_paci, simulate_schedule, simulate_stock, stock_programs)
from .tied import TiedExchange, add_tied_exchange
from .simulator import Deadlock, DeadlockError, Event, PairingError, SimResult, StuckStage, simulate

__all__ = [
    "CostModel", "TiedExchange", "add_tied_exchange", "Event", "StuckStage", "Deadlock", "DeadlockError",
    "PairingError", "SimResult", "simulate", "stock_programs", "paci_programs", "simulate_stock", "simulate_paci",
    "simulate_schedule", "long_run_period", "ZB_SOURCE", "reference_rows", "comparison_rows", "markdown_table", "main"
]


def _parser():
    p = argparse.ArgumentParser(prog="python -m ds_paci.tools.sim.simulate",
                                description="Simulate stock DeepSpeed 1F1B-flush vs PACI streams; print one "
                                "markdown table over the grid of stages x micro-batches.")
    p.add_argument("--stages", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--window", type=int, default=None, help="PACI accumulation window a (default: M)")
    p.add_argument("--calls", type=int, default=8, help="train_batch calls (PACI) / batches (stock)")
    p.add_argument("--forward", type=float, default=1.0, help="forward time per stage")
    p.add_argument("--backward", type=float, default=None, help="backward time per stage (default 2*forward)")
    p.add_argument("--latency", type=float, default=0.0, help="p2p transfer time")
    p.add_argument("--overhead", type=float, default=0.0, help="per-micro-batch time added to each forward")
    p.add_argument("--step-time", type=float, default=0.0, help="optimizer/local step time")
    p.add_argument("--step-phase", nargs="+", choices=["aligned", "diagonal"], default=["aligned"],
                   help="PACI's paci.step_phase: one PACI row each (the timeline: the first)")
    p.add_argument("--peers", action="store_true",
                   help="add torch.distributed.pipelining's schedules, timed from their own action lists")
    p.add_argument("--weight-share", type=float, default=0.5,
                   help="with --peers: share of the backward that is the weight gradient (W)")
    p.add_argument("--json", metavar="OUT", help="also write the rows as JSON")
    one = p.add_argument_group("one configuration (first --stages and --micro-batches value)")
    one.add_argument("--schedule", choices=["paci", "stock"], default="paci")
    one.add_argument("--timeline", action="store_true", help="print a text timeline grid")
    one.add_argument("--width", type=int, default=100, help="text timeline columns")
    one.add_argument("--chrome", metavar="OUT", help="write a Chrome/Perfetto trace JSON")
    one.add_argument("--png", metavar="OUT", help="write a PNG timeline")
    return p


def main(argv=None):
    args = _parser().parse_args(argv)
    cost = CostModel(forward=args.forward, backward=args.backward, latency=args.latency, overhead=args.overhead,
                     step=args.step_time)
    rows = []
    for P in args.stages:
        for M in args.micro_batches:
            rows.extend(comparison_rows(P, M, args.window, args.calls, cost, args.peers, args.weight_share,
                                        tuple(args.step_phase)))
    print(markdown_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.timeline or args.chrome or args.png:
        result, title = simulate_schedule(args.schedule, args.stages[0], args.micro_batches[0], args.window, args.calls,
                                          cost, args.step_phase[0])
        if result.deadlock:
            print(result.deadlock, file=sys.stderr)
        records = records_from_sim(result)
        if args.timeline:
            print()
            print(title)
            print(to_text_grid(records, width=args.width))
        if args.chrome:
            to_chrome_trace(records, args.chrome, label=title)
        if args.png:
            to_png(records, args.png, title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
