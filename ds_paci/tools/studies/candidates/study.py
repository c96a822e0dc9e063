"""Issue 30's candidates measured on the hard cells (M < P at stock's best learning rate), one replay at a time.

``python -m ds_paci.tools.studies.candidates --out docs/results/quality-candidates [--cells ...] [--only ...]
[--steps N]`` runs every (cell, candidate) not yet stored: one JSON file per run,
``<out>/<cell>/<candidate>.json`` (so a killed study loses only the run in progress), then writes
``<out>/table.md``. ``--steps`` shortens every cell (the files record the steps; a different count is a
different run, stored under ``<candidate>@<steps>``).

Cells (:data:`CELLS`):

* ``unseen-lr2e-3`` / ``unseen-lr6.67e-4``: the issue's model the rules were not chosen on (8 stages of one
  GPT-2 block of width 64, 4 heads, byte tokens, sequence 64, micro-batch 4, M = 4, AdamW betas (0.9, 0.999),
  constant learning rate, 300 calls, validation every 50 calls on 16 micro-batches, draining first as
  ``eval_batch`` does; seeds 1234/7, ``-s2``: 4321/8; the look-ahead restores by copy, the engine's default);
* ``sweep-P4M2`` / ``sweep-P8M4``: the sweep's M = P/2 cells at stock's best learning rate 3e-3
  (:data:`ds_paci.tools.studies.quality.grid.MODEL`, 240 calls, validations without draining, as the sweep;
  restore by recompute, as the sweep), first seed; ``...-s2``: second seed; ``sweep-P16M8``: P = 16 (120 calls);
* ``-s3`` / ``-s4`` (:data:`SEEDS`) of ``unseen-lr2e-3`` and the three sweep cells; ``held-w48x2`` (``-s2`` to
  ``-s4``): a second model kept aside, the unseen cell with two blocks of width 48 (4 heads) per stage;
* ``sweep-P4M2-lr1e-3`` (and ``P8M4``, ``P16M8``; ``-s2``): the same M = P/2 cells at the sweep's lower learning
  rate, 1e-3.

Candidates (:data:`CANDIDATES`): ``stock``; ``auto`` (the look-ahead with ``"auto"``'s per-stage windows before
issue 30, :func:`per_stage_auto`); ``uniform-max`` (the largest of those on every stage: the engine's ``"auto"``
since issue 30); ``ef`` (error feedback), ``moment`` (Nesterov-style
prediction from Adam's first moment), ``blend`` (the open window plus the moment for the rest), ``lr-sqrt`` /
``lr-lin`` (learning-rate compensation for ``a_s > M``), ``adaptive`` (windows between ``"auto"``'s and
``uniform-max`` from the measured prediction error), each on ``"auto"``'s windows (``ef-half``: feedback 0.5); ``uniform-blend``;
``lr-slowest`` (``"auto"``'s windows, every stage's learning rate scaled to the slowest stage's rate per sample,
``a_s / max(a)``) and ``ef-lr-slowest`` (that with error feedback); ``uniform-lr-sqrt`` / ``uniform-lr-lin``
(today's ``"auto"`` windows with the learning rate scaled by ``(a / M) ** 0.5`` or ``a / M``); a synchronous warm
start (the replay's ``sync_calls``, the engine's ``"sync_warmup_calls"``): ``sync10-*``, ``sync20-*`` (that share of
the calls) and ``sync48c-*``, ``sync100c-*`` (that many calls), then ``"auto"``'s per-stage windows (``-auto``) or one
window (``-uniform``); cells ``sweep-P32M16`` (and ``-s2``, ``-lr1e-3``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass

from ds_paci.tools.replay.candidates import AdaptiveWindows, Candidate


@dataclass(frozen=True)
class Cell:
    stages: int
    micro_batches: int
    lr: float
    steps: int
    n_embd: int
    n_head: int
    seq_len: int
    micro_batch_size: int
    val_micro_batches: int
    seed: int
    data_seed: int
    eval_every: int
    drains: bool  # validations drain first (eval_batch) or read the current weights (the sweep)
    restore: str
    blocks_per_stage: int = 1


#: Seeds per cell suffix: no suffix is the first seed pair, ``-s2`` the second, ...
SEEDS = {"": (1234, 7), "-s2": (4321, 8), "-s3": (2468, 9), "-s4": (1357, 10)}


def _unseen(lr, seeds=(1234, 7)):
    return Cell(8, 4, lr, 300, 64, 4, 64, 4, 16, seeds[0], seeds[1], 50, True, "copy")


def _held(seeds=(1234, 7)):
    """The second model kept aside: the unseen cell's setting with two blocks of width 48 (4 heads) per stage."""
    return Cell(8, 4, 2e-3, 300, 48, 4, 64, 4, 16, seeds[0], seeds[1], 50, True, "copy", blocks_per_stage=2)


def _sweep(P, seeds=(1234, 7), lr=3e-3, M=None):
    from ds_paci.tools.studies.quality.grid import MODEL, STEPS
    return Cell(P, M or P // 2, lr, STEPS[P], MODEL.n_embd, MODEL.n_head, MODEL.seq_len, MODEL.micro_batch_size,
                MODEL.val_micro_batches, seeds[0], seeds[1], STEPS[P] // 10, False, "recompute")


CELLS = {
    "unseen-lr2e-3": lambda: _unseen(2e-3),
    "unseen-lr6.67e-4": lambda: _unseen(6.67e-4),
    "unseen-lr2e-3-s2": lambda: _unseen(2e-3, SEEDS["-s2"]),
    "sweep-P4M2": lambda: _sweep(4),
    "sweep-P8M4": lambda: _sweep(8),
    "sweep-P16M8": lambda: _sweep(16),
    "sweep-P4M2-s2": lambda: _sweep(4, SEEDS["-s2"]),
    "sweep-P8M4-s2": lambda: _sweep(8, SEEDS["-s2"]),
    "sweep-P16M8-s2": lambda: _sweep(16, SEEDS["-s2"]),
}
for _tag in ("-s3", "-s4"):
    CELLS[f"unseen-lr2e-3{_tag}"] = (lambda seeds: lambda: _unseen(2e-3, seeds))(SEEDS[_tag])
    for _P in (4, 8, 16):
        CELLS[f"sweep-P{_P}M{_P // 2}{_tag}"] = (lambda P, seeds: lambda: _sweep(P, seeds))(_P, SEEDS[_tag])
# The sweep's M = P/2 cells at its lower learning rate (1e-3), where one window max(P-1, ...) on every stage takes
# half of stock's optimizer steps per sample (today's "auto" there: +5-20% over stock on the first seed).
for _tag in ("", "-s2"):
    for _P in (4, 8, 16):
        CELLS[f"sweep-P{_P}M{_P // 2}-lr1e-3{_tag}"] = (lambda P, seeds: lambda: _sweep(P, seeds, 1e-3))(_P,
                                                                                                 SEEDS[_tag])
# P = 32, M = 16 (the sweep's deepest M = P/2 cell), both learning rates, the sweep's two seeds
for _tag in ("", "-s2"):
    CELLS[f"sweep-P32M16{_tag}"] = (lambda seeds: lambda: _sweep(32, seeds))(SEEDS[_tag])
    CELLS[f"sweep-P32M16-lr1e-3{_tag}"] = (lambda seeds: lambda: _sweep(32, seeds, 1e-3))(SEEDS[_tag])
# The sweep's M = P and M = 2P cells (issue 30: the default's "auto" warm start must hold there too), both
# learning rates and the sweep's two seeds
for _P in (4, 8, 16, 32):
    for _M in (_P, 2 * _P):
        for _lr, _lrtag in ((3e-3, ""), (1e-3, "-lr1e-3")):
            for _tag in ("", "-s2"):
                CELLS[f"sweep-P{_P}M{_M}{_lrtag}{_tag}"] = (lambda P, M, lr, seeds: lambda: _sweep(P, seeds, lr, M))(
                    _P, _M, _lr, SEEDS[_tag])
for _tag, _seeds in SEEDS.items():
    CELLS[f"held-w48x2{_tag}"] = (lambda seeds: lambda: _held(seeds))(_seeds)

CANDIDATES = {
    "stock": None,
    "auto": Candidate("auto"),
    "uniform-max": Candidate("uniform-max", window="uniform-max"),
    "ef": Candidate("ef", feedback=1.0),
    "ef-half": Candidate("ef-half", feedback=0.5),
    "moment": Candidate("moment", estimator="moment"),
    "blend": Candidate("blend", estimator="blend"),
    "lr-sqrt": Candidate("lr-sqrt", lr_power=0.5),
    "lr-lin": Candidate("lr-lin", lr_power=1.0),
    "adaptive": Candidate("adaptive", adaptive=AdaptiveWindows()),
    "uniform-blend": Candidate("uniform-blend", estimator="blend", window="uniform-max"),
    "lr-slowest": Candidate("lr-slowest", lr_slowest=True),
    "ef-lr-slowest": Candidate("ef-lr-slowest", feedback=1.0, lr_slowest=True),
    # today's "auto" windows with the learning rate compensated for a > M (Adam's square-root and linear rules)
    "uniform-lr-sqrt": Candidate("uniform-lr-sqrt", window="uniform-max", lr_power=0.5),
    "uniform-lr-lin": Candidate("uniform-lr-lin", window="uniform-max", lr_power=1.0),
}
# A synchronous warm start (the replay's sync_calls): a share of the calls (sync10-*, sync20-*) or a count of calls
# (sync48c-*, sync100c-*) on stock's schedule, then the look-ahead with the per-stage windows (-auto) or today's one
# window (-uniform); only the combinations the fourth round ran (docs/results/quality-candidates.md).
for _name, _share, _calls, _window in (("sync10-auto", 0.1, 0, "auto"), ("sync10-uniform", 0.1, 0, "uniform-max"),
                                       ("sync20-auto", 0.2, 0, "auto"), ("sync48c-auto", 0.0, 48, "auto"),
                                       ("sync48c-uniform", 0.0, 48, "uniform-max"),
                                       ("sync100c-auto", 0.0, 100, "auto"), ("syncauto-auto", 0.0, "auto", "auto")):
    CANDIDATES[_name] = Candidate(_name, window=_window, sync_fraction=_share, sync_calls=_calls)


def per_stage_auto(stages: int, micro_batches: int) -> list:
    """``"auto"``'s windows before issue 30, ``a_s = max(min(M, P-1), P-1-s, ceil(M/3))``: the study's ``auto``
    and the windows of every candidate not named ``uniform-*`` (the engine's ``"auto"`` is now ``uniform-max``)."""
    return [max(min(micro_batches, stages - 1), stages - 1 - s, -(-micro_batches // 3), 1) for s in range(stages)]


def run_one(cell: Cell, name: str, steps: int) -> dict:
    """One replay of ``cell`` with candidate ``name``; returns its result dict."""
    import torch

    from ds_paci.tools.replay.replayer import Evaluation, load_tokens, replay
    from ds_paci.workload.data import MicroBatchIterator, eval_micro_batches
    from ds_paci.workload.gpt2 import gpt2_config, gpt2_reference_model
    torch.set_num_threads(1)
    train, val, _ = load_tokens("byte", main_split=False)
    cfg = gpt2_config("tiny", vocab_size=257, n_positions=cell.seq_len, n_embd=cell.n_embd,
                      n_layer=cell.stages * cell.blocks_per_stage,
                      n_head=cell.n_head)
    net = gpt2_reference_model(cfg, seed=cell.seed)
    train_iter = MicroBatchIterator(train, cell.micro_batch_size, cell.seq_len, seed=cell.data_seed)
    val_batches = eval_micro_batches(val, cell.micro_batch_size, cell.seq_len, count=cell.val_micro_batches)
    candidate = CANDIDATES[name]
    mode, window = ("sync", None) if candidate is None else ("lookahead", per_stage_auto(cell.stages, cell.micro_batches))
    if candidate is not None and candidate.window == "uniform-max":
        window = max(window)
    result = replay(net, cell.stages, cell.micro_batches, train_iter, val_batches, steps, mode=mode, window=window,
                    lr=cell.lr, betas=(0.9, 0.999), weight_decay=0.0,
                    evaluation=Evaluation(every=cell.eval_every, drains=cell.drains), restore=cell.restore,
                    candidate=candidate,
                    sync_calls=0 if candidate is None else candidate.sync_calls if candidate.sync_calls == "auto" else
                    min(steps, max(candidate.sync_calls, round(candidate.sync_fraction * steps))))
    errors = [s.get("prediction_error") if isinstance(s, dict) else None for s in result.lookahead]
    return {"candidate": name, "cell": dict(cell.__dict__), "steps": steps, "curve": result.curve,
            "final": result.curve[-1][1], "local_steps": result.local_steps, "windows": result.windows,
            "prediction_error": errors, "warm_calls": result.warm_calls, "seconds": round(result.seconds, 1),
            "loadavg": [round(x, 2) for x in os.getloadavg()]}


def _path(out, cell_name, name, steps, default_steps):
    tag = name if steps == default_steps else f"{name}@{steps}"
    return os.path.join(out, cell_name, f"{tag}.json")


def plateau(curve, stock_curve, margin=0.10):
    """The validation steps ``(first, last)`` of the longest stretch where a run sits on a plateau while stock
    trains, or ``None``: consecutive validations (after step 0) at which the run is more than ``margin``
    (relative) above stock's loss at the same step and fell less than 1% since the previous one."""
    stock = dict(stock_curve)
    points = [(s, x) for s, x in curve if s in stock and s > 0]
    flat = [s for (_, a), (s, b) in zip(points, points[1:]) if b > stock[s] * (1 + margin) and (a - b) < 0.01 * a]
    best, run = None, []
    steps = [s for s, _ in points]
    for s in flat:
        run = run + [s] if run and steps.index(s) == steps.index(run[-1]) + 1 else [s]
        if best is None or len(run) > len(best):
            best = list(run)
    if best is None:
        return None
    return (steps[steps.index(best[0]) - 1], best[-1])


def seedless(cell_name: str) -> str:
    """The cell's name without its seed suffix (``-s2``, ``-s3``, ...): the cell whose seeds are averaged."""
    head, _, tail = cell_name.rpartition("-s")
    return head if head and tail.isdigit() else cell_name


def _load(path):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def write_table(out, cells, names, steps_of) -> str:
    """``<out>/table.md``: final loss and % over stock per cell and candidate (runs stored so far)."""
    lines = ["| cell | calls | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for cell_name in cells:
        steps = steps_of(cell_name)
        default = CELLS[cell_name]().steps
        rows = {}
        for name in names:
            path = _path(out, cell_name, name, steps, default)
            if os.path.exists(path):
                with open(path) as f:
                    rows[name] = json.load(f)
        stock = rows.get("stock")
        cols = []
        for name in names:
            r = rows.get(name)
            if r is None:
                cols.append("-")
            elif stock is None or name == "stock":
                cols.append(f"{r['final']:.4f}")
            else:
                pct = 100 * (r["final"] / stock["final"] - 1)
                flat = plateau(r["curve"], stock["curve"])
                flag = f" **plateau {flat[0]}-{flat[1]}**" if flat else ""
                cols.append(f"{r['final']:.4f} ({pct:+.1f}%){flag}")
        lines.append(f"| {cell_name} | {steps} | " + " | ".join(cols) + " |")
    pcts = {}  # (cell, candidate) -> (% over stock, on a plateau); "within" compares the % as printed
    for cell_name in cells:
        steps, default = steps_of(cell_name), CELLS[cell_name]().steps
        stock = _load(_path(out, cell_name, "stock", steps, default))
        for name in names:
            run = None if stock is None or name == "stock" else _load(_path(out, cell_name, name, steps, default))
            if run is not None:
                pcts[cell_name, name] = (100 * (run["final"] / stock["final"] - 1),
                                         plateau(run["curve"], stock["curve"]) is not None)
    lines += ["", "| candidate | cells | worst % over stock | cells within 1% | cells within 2% | plateaus |",
              "|---|---|---|---|---|---|"]
    for name in names:
        got = [v for (c, n), v in pcts.items() if n == name]
        if got:
            worst = max(p for p, _ in got)
            lines.append(f"| {name} | {len(got)} | {worst:+.1f}% | {sum(round(p, 1) <= 1.0 for p, _ in got)} | "
                         f"{sum(round(p, 1) <= 2.0 for p, _ in got)} | {sum(f for _, f in got)} |")
    others = [n for n in names if n != "stock"]
    lines += ["", "Mean % over stock across the seeds stored (seeds; runs on a plateau):", "",
              "| cell | " + " | ".join(others) + " |", "|---|" + "---|" * len(others)]
    for base in dict.fromkeys(seedless(c) for c in cells):
        cols = []
        for name in others:
            got = [v for (c, n), v in pcts.items() if n == name and seedless(c) == base]
            cols.append("-" if not got else f"{sum(p for p, _ in got) / len(got):+.1f}% ({len(got)}; "
                        f"{sum(f for _, f in got)})")
        lines.append(f"| {base} | " + " | ".join(cols) + " |")
    text = "\n".join(lines) + "\n"
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(text)
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ds_paci.tools.studies.candidates", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="docs/results/quality-candidates")
    p.add_argument("--cells", nargs="*", default=list(CELLS)[:4], help=f"of {', '.join(CELLS)}")
    p.add_argument("--only", nargs="*", default=list(CANDIDATES), help=f"of {', '.join(CANDIDATES)}")
    p.add_argument("--steps", type=int, help="calls per run (default: each cell's)")
    p.add_argument("--table", action="store_true", help="only write the table of what is stored")
    args = p.parse_args(argv)
    bad = [c for c in args.cells if c not in CELLS] + [n for n in args.only if n not in CANDIDATES]
    if bad:
        print(f"unknown cell or candidate: {', '.join(bad)}", file=sys.stderr)
        return 2
    steps_of = (lambda c: args.steps or CELLS[c]().steps)
    if not args.table:
        for cell_name in args.cells:
            cell = CELLS[cell_name]()
            for name in args.only:
                path = _path(args.out, cell_name, name, steps_of(cell_name), cell.steps)
                if os.path.exists(path):
                    continue
                began = time.time()
                row = run_one(cell, name, steps_of(cell_name))
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path + ".tmp", "w") as f:
                    json.dump(row, f)
                os.replace(path + ".tmp", path)
                print(f"{cell_name} {name}: final {row['final']:.4f} ({time.time() - began:.0f} s)", flush=True)
    print(write_table(args.out, args.cells, args.only, steps_of))
    return 0
