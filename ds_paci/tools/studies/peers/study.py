"""``python -m ds_paci.tools.bench --study peers``: PACI against the strongest synchronous schedules, in one run.

Engines (:data:`ENGINES`): DeepSpeed's stock 1F1B-flush, PACI, PACI + look-ahead, and torch.distributed.pipelining's
GPipe, 1F1B, interleaved 1F1B, ZB1P, ZB-V and DualPipeV, on the same GPT-2 blocks, initial weights, data order,
micro-batching, loss scaling and optimizer (:mod:`.peers_worker`). Emulated device time per block is split into
``F``, ``B``, ``W`` (:class:`~ds_paci.workload.emulate.EmulatedSplitTime`): DeepSpeed's engines pay ``B + W`` in
their backward, torch's split schedules pay ``B`` in the input-gradient pass and ``W`` in the weight-gradient pass.

Grid (:func:`grid`): emulated ``P`` in {4, 8} x ``M`` in {P/2, P, 2P} x ``F:B:W`` in {1:1:1, 1:2:1 with a slow
last stage} (f = 40 ms per block: host work on a shared 2-core machine stays small beside it), and real compute at ``P = 2`` with ``M`` in {1, 2, 4}. A schedule torch refuses
for a shape is left out of that cell with torch's reason (1F1B needs ``M >= P``, DualPipeV ``M >= 2P``).

Each cell is one world of ``P`` processes running every engine in turn for ``--rounds`` rounds (the order rotates
every round); its results go to ``<out>/cells/<cell>.json`` as soon as the cell finishes, and a later run skips
cells already there (``--force`` reruns them), so an interrupted study resumes per cell. ``--part report`` (also
run at the end) writes ``<out>.md`` (default ``docs/results/peers.md``) and the figure from the stored cells.
``--smoke``: one tiny emulated ``P = 2`` cell with stock and ZB-V, a few steps (the test suite's check).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import tempfile
import time

from ds_paci.tools.processes import world
from ds_paci.tools.sim.peer_schedules import PEERS, ScheduleUnavailable, action_lists
from .analysis import summarize_cell
from .model import PeerCell, check_cell
from .worker import CellJob, run_cell_rank
from ...bench.report import machine_facts

ENGINES = ("stock", "paci", "paci+lookahead") + tuple(PEERS)
TITLES = {"stock": "stock 1F1B-flush (DeepSpeed)", "paci": "PACI", "paci+lookahead": "PACI + look-ahead",
          **{name: peer.title for name, peer in PEERS.items()}}
DEFAULT_OUT = "docs/results/peers"


def grid(rounds_steps: dict | None = None) -> list:
    """The study's cells, in run order (cheap cells first)."""
    cells = [PeerCell(stages=2, micro_batches=m, ratio="real", unit=0.0, micro_batch_size=8, seq_len=128, n_embd=128,
                      steps=8, warmup=2) for m in (1, 2, 4)]
    for p in (4, 8):
        for ratio, slow in (("1:1:1", False), ("1:2:1", True)):
            for m in (p // 2, p, 2 * p):
                cells.append(PeerCell(stages=p, micro_batches=m, ratio=ratio, unit=0.04, slow_last=slow, steps=5))
    return [check_cell(dataclasses.replace(c, **(rounds_steps or {}))) for c in cells]


def smoke_cell() -> PeerCell:
    """An emulated P = 2, M = 2 cell (2 ms per block and pass) of a few steps: seconds."""
    return check_cell(PeerCell(stages=2, micro_batches=2, ratio="1:1:1", unit=0.002, micro_batch_size=2, seq_len=32,
                               n_embd=32, n_head=2, steps=3, warmup=1, val_batches=2))


def runnable(cell: PeerCell, engines) -> tuple[list, dict]:
    """``(engines that can run the cell, {engine: torch's reason} for those that cannot)``."""
    ok, skipped = [], {}
    for engine in engines:
        if engine in PEERS:
            try:
                action_lists(engine, cell.stages, cell.micro_batches)
            except ScheduleUnavailable as e:
                skipped[engine] = str(e)
                continue
        ok.append(engine)
    return ok, skipped


def prepare_data(path: str) -> dict:
    """Byte-tokenized Shakespeare train/validation split, saved for the workers (as the benchmark does)."""
    from ...bench.config import make_config
    from ...bench.runner import prepare_tokens
    return prepare_tokens(make_config("emulated", stages=2), path)


def validation_batches(cell: PeerCell, data_path: str) -> list:
    import torch

    from ds_paci.workload.data import eval_micro_batches
    tokens = torch.load(data_path)
    return eval_micro_batches(tokens["val"].long(), cell.micro_batch_size, cell.seq_len, count=cell.val_batches)


def run_cell(cell: PeerCell, engines, rounds: int, data_path: str, log_dir: str, timeout: float,
             max_load: float = 0.0, max_wait: float = 0.0) -> dict:
    """One world running the cell's engines; returns the cell's JSON entry."""
    ok, skipped = runnable(cell, engines)
    load_before = list(os.getloadavg())
    began, started = time.monotonic(), datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    job = CellJob(cell=cell, engines=tuple(ok), rounds=rounds, data_path=data_path, max_load=max_load,
                  max_wait=max_wait)
    ranks = world.run_world(run_cell_rank, cell.stages, job, timeout=timeout + rounds * max_wait, log_dir=log_dir,
                            gloo_timeout_s=max_wait + 900, accelerator=None)
    summary = summarize_cell(cell, ranks, ok, validation_batches(cell, data_path))
    return {"cell": dataclasses.asdict(cell), "name": cell.name, "label": cell.label(), "rounds": rounds,
            "engines": ok, "skipped": skipped, **summary, "max_load": max_load,
            "waited_for_quiet_seconds": ranks[0]["waited_for_quiet_seconds"], "started_utc": started,
            "wall_seconds": time.monotonic() - began, "loadavg_before": load_before,
            "loadavg_after": list(os.getloadavg())}


def _write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(payload, f, indent=1)
    os.replace(path + ".tmp", path)


def load_cells(out: str, cells: list) -> list:
    """The stored entries of ``cells`` (in order) that exist under ``out/cells``."""
    entries = []
    for cell in cells:
        path = os.path.join(out, "cells", f"{cell.name}.json")
        if os.path.exists(path):
            with open(path) as f:
                entries.append(json.load(f))
    return entries


def is_peers_study(argv) -> bool:
    """Whether a ``python -m ds_paci.tools.bench`` command line asks for this study."""
    argv = list(argv)
    return "--study=peers" in argv or any(a == "--study" and b == "peers" for a, b in zip(argv, argv[1:]))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ds_paci.tools.studies.peers", description=__doc__.split("\n")[0])
    p.add_argument("--study", choices=["peers"], default="peers",
                   help="accepted for the older entry `python -m ds_paci.tools.bench --study peers`")
    p.add_argument("--part", choices=["run", "report", "all"], default="all")
    p.add_argument("--out", default=DEFAULT_OUT, help="folder of the cell results; the report is <out>.md")
    p.add_argument("--cells", help="comma-separated cell names of the grid to run (default: all)")
    p.add_argument("--engines", help=f"comma-separated subset of {','.join(ENGINES)}")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, help="steps per run (default: the cell's)")
    p.add_argument("--force", action="store_true", help="rerun cells whose results are stored")
    p.add_argument("--smoke", action="store_true", help="one tiny emulated P=2 cell (stock and ZB-V unless --engines)")
    p.add_argument("--timeout", type=float, default=5400.0, help="seconds before a cell's world is killed")
    p.add_argument("--max-load", type=float, default=0.0,
                   help="before each round wait until the 1-minute load average is below this (0: never wait)")
    p.add_argument("--max-wait", type=float, default=900.0, help="seconds a round waits for --max-load at most")
    p.add_argument("--log-dir", help="per-rank logs (default: a new temporary folder)")
    return p


def _selection(args, parser) -> tuple[list, list]:
    engines = list(ENGINES) if not args.engines else args.engines.split(",")
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        parser.error(f"unknown engine(s) {', '.join(unknown)}; choose from {', '.join(ENGINES)}")
    if args.smoke:
        return [smoke_cell()], (engines if args.engines else ["stock", "zbv"])
    cells = grid({"steps": args.steps} if args.steps else None)
    if args.cells:
        names = args.cells.split(",")
        missing = [n for n in names if n not in {c.name for c in cells}]
        if missing:
            parser.error(f"unknown cell(s) {', '.join(missing)}; the grid has {', '.join(c.name for c in cells)}")
        cells = [c for c in cells if c.name in names]
    return cells, engines


def main(argv=None) -> int:
    """Command line of the study (see the module docstring and ``--help``)."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        cells, engines = _selection(args, parser)
    except ValueError as e:
        parser.error(str(e))
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    command = "python -m ds_paci.tools.bench " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.part in ("run", "all"):
        log_root = args.log_dir or tempfile.mkdtemp(prefix="ds_paci_peers_")
        os.makedirs(log_root, exist_ok=True)
        data_path = os.path.join(log_root, "tokens_byte.pt")
        data = prepare_data(data_path)
        facts = machine_facts()
        for cell in cells:
            path = os.path.join(args.out, "cells", f"{cell.name}.json")
            if os.path.exists(path) and not args.force:
                print(f"[peers] {cell.name}: stored, skipped (--force reruns it)", flush=True)
                continue
            print(f"[peers] {cell.name}: {cell.label()}, load {os.getloadavg()[0]:.2f}", flush=True)
            try:
                entry = run_cell(cell, engines, args.rounds, data_path, os.path.join(log_root, cell.name),
                                 args.timeout, args.max_load, args.max_wait)
            except world.WorldFailure as e:
                print(f"ds_paci.bench: cell {cell.name} failed: {e}", file=sys.stderr)
                return 1
            entry.update(command=command, machine=facts, data=data)
            _write_json(path, entry)
            print(f"[peers] {cell.name}: done in {entry['wall_seconds']:.0f} s; " + ", ".join(
                f"{e} {s['tokens_per_second']['median']:.0f}" for e, s in entry["engines"].items()) + " tokens/s",
                flush=True)
            bad = [e for e, a in entry["agreement"].items() if not a["agrees"]]
            if bad:
                print(f"[peers] {cell.name}: synchronous engines disagree with stock: {bad}", file=sys.stderr)
    if args.part in ("report", "all"):
        from .report import write_report
        entries = load_cells(args.out, cells)
        if not entries:
            raise SystemExit(f"no stored cells under {args.out}/cells: run --part run first")
        print(write_report(entries, args.out, command))
    return 0
