"""One larger model: GPT-2 of 8 blocks x 256 on the Shakespeare corpus at emulated P = 4 (M = 4, 2) and P = 8 (M = 4, 8).

Stock (the replay's sync mode), then PACI + look-ahead with the engine's default window ``a = M`` and with
``"auto"`` (and, issue 30, after a synchronous warm start of ``sync_calls`` calls: ``syncK`` in a run's name;
``syncauto``: the engine's default ``"auto"`` warm start), trained 1.5x stock's :data:`STEPS` (one drain at every
validation, as the engine's curve study), so that the time to stock's final loss is defined. The ``val128`` runs
validate on 128 micro-batches instead of 16 (whose loss at one step is about 1% noisy). Time = steps x seconds per
batch of the ideal emulated pipeline (``(M + P - 1)`` micro-batch slots per batch for stock and for the calls of a
synchronous warm start, ``M`` for PACI: the bubble is the only difference), since this model has no timed throughput rounds.

``python -m ds_paci.tools.studies.quality --part larger --out docs/results/quality [--runs NAME ...]`` (resumable:
one JSON line per run in ``<out>/larger.jsonl``; each run's validation losses also go, as they come, to
``<out>/larger-logs/<run>.log``) writes ``<out>/larger.md`` and ``<out>/larger.png``; a run still going shows
its curve so far from its log, labelled partial.
"""

from __future__ import annotations

import math
import os
import re
from typing import NamedTuple

from .rows import append_row, load_rows

STAGES, MICRO_BATCHES, N_LAYER, N_EMBD, N_HEAD, SEQ_LEN, MICRO_BATCH_SIZE = 4, 4, 8, 256, 8, 32, 2
STEPS, OVERRUN, EVERY, VAL_MICRO_BATCHES, LR, SEED, DATA_SEED = 1000, 1.5, 50, 16, 1e-3, 1234, 7


class Run(NamedTuple):
    name: str
    mode: str  # the replay's mode: "sync" (stock) or "lookahead"
    window: object  # stage_windows' argument: None (a = M) or "auto" (ds_paci.core.config.auto_window, as today)
    stages: int = STAGES
    micro_batches: int = MICRO_BATCHES
    sync_calls: object = 0  # the replay's sync_calls: a synchronous warm start of that many calls, or "auto" (issue 30)
    val: int = VAL_MICRO_BATCHES  # validation micro-batches (128: a loss precise enough to judge 1%)


#: The P = 4 rows keep their first names (their stored lines in larger.jsonl have no shape fields); issue 30's
#: P = 8 rows (one block per stage) run stock and the engine's "auto" window as it resolves today.
RUNS = (Run("stock", "sync", None), Run("paci+lookahead a=M", "lookahead", None),
        Run("paci+lookahead auto", "lookahead", "auto"),
        Run("P=8 M=4 stock", "sync", None, 8, 4), Run("P=8 M=4 paci+lookahead auto", "lookahead", "auto", 8, 4),
        Run("P=8 M=8 stock", "sync", None, 8, 8), Run("P=8 M=8 paci+lookahead auto", "lookahead", "auto", 8, 8),
        Run("paci+lookahead auto sync100", "lookahead", "auto", sync_calls=100),
        Run("P=4 M=2 stock", "sync", None, 4, 2), Run("P=4 M=2 paci+lookahead auto", "lookahead", "auto", 4, 2),
        Run("P=4 M=2 paci+lookahead auto sync100", "lookahead", "auto", 4, 2, sync_calls=100),
        Run("P=4 M=2 paci+lookahead a=3 sync100", "lookahead", 3, 4, 2, sync_calls=100),
        Run("P=4 M=2 paci+lookahead auto sync200", "lookahead", "auto", 4, 2, sync_calls=200),
        Run("paci+lookahead auto syncauto", "lookahead", "auto", sync_calls="auto"),
        Run("P=4 M=2 paci+lookahead auto syncauto", "lookahead", "auto", 4, 2, sync_calls="auto"),
        # the same P = 4, M = 4 runs validated on 128 micro-batches (16 leave about 1% of noise at one step)
        Run("stock val128", "sync", None, val=128),
        Run("paci+lookahead auto syncauto val128", "lookahead", "auto", sync_calls="auto", val=128),
        Run("paci+lookahead auto val128", "lookahead", "auto", sync_calls=0, val=128))


def shapes() -> list:
    """The (P, M, validation micro-batches) of :data:`RUNS`, in order."""
    return list(dict.fromkeys((r.stages, r.micro_batches, r.val) for r in RUNS))


def stock_of(stages: int, micro_batches: int, val: int = VAL_MICRO_BATCHES) -> Run:
    return next(r for r in RUNS if r.mode == "sync" and (r.stages, r.micro_batches, r.val) == (stages, micro_batches,
                                                                                              val))


def log_path(out: str, name: str) -> str:
    """``<out>/larger-logs/<name>.log``: one line per validation of a run, written as it trains."""
    return os.path.join(out, "larger-logs", re.sub(r"[^A-Za-z0-9.+-]+", "_", name) + ".log")


_LOG_LINE = re.compile(r"step (\d+): validation loss ([0-9.]+)")


def partial_curve(path: str) -> list:
    """The curve so far of a run from its log (:func:`log_path`): ``[(step, loss), ...]`` (empty if no log).
    A log holds the latest attempt only (:func:`run_all` truncates it when a run starts)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [(int(m.group(1)), float(m.group(2))) for m in map(_LOG_LINE.search, f) if m]


def run_one(run: Run, echo=None) -> dict:
    import torch

    from ds_paci.tools.replay.replayer import Evaluation, load_tokens, replay, stage_windows
    from ds_paci.workload.data import MicroBatchIterator, eval_micro_batches
    from ds_paci.workload.gpt2 import gpt2_config, gpt2_reference_model
    torch.set_num_threads(1)
    train, val, _ = load_tokens("byte", main_split=False)
    cfg = gpt2_config("tiny", vocab_size=257, n_positions=SEQ_LEN, n_embd=N_EMBD, n_layer=N_LAYER, n_head=N_HEAD)
    model = gpt2_reference_model(cfg, seed=SEED)
    steps = STEPS if run.mode == "sync" else math.ceil(OVERRUN * STEPS)
    result = replay(model, run.stages, run.micro_batches, MicroBatchIterator(train, MICRO_BATCH_SIZE, SEQ_LEN,
                                                                             seed=DATA_SEED),
                    eval_micro_batches(val, MICRO_BATCH_SIZE, SEQ_LEN, count=run.val), steps, mode=run.mode,
                    window=run.window, lr=LR, betas=(0.9, 0.999), weight_decay=0.0, evaluation=Evaluation(every=EVERY),
                    echo=echo, sync_calls=run.sync_calls)
    return {"name": run.name, "mode": run.mode, "stages": run.stages, "micro_batches": run.micro_batches,
            "windows": stage_windows(run.window, run.stages, run.micro_batches, per_stage=bool(run.sync_calls)),
            "steps": steps,
            "sync_calls": run.sync_calls, "warm_calls": result.warm_calls, "val": run.val,
            "curve": result.curve, "lookahead": result.lookahead, "seconds": round(result.seconds, 1),
            "loadavg": list(os.getloadavg())}


def run_all(out: str, echo=print, names=None) -> dict:
    """Every run of :data:`RUNS` (or only ``names``) not yet in ``<out>/larger.jsonl``; returns all stored runs.
    Runs of different names may go in separate processes at once (each appends its one line when done)."""
    path = os.path.join(out, "larger.jsonl")
    done = load_rows(path, key="name")
    unknown = set(names or ()) - {r.name for r in RUNS}
    if unknown:
        raise ValueError(f"unknown runs {sorted(unknown)}; names of larger.RUNS: {[r.name for r in RUNS]}")
    for run in RUNS:
        if run.name in done or (names and run.name not in names):
            continue
        log = log_path(out, run.name)
        os.makedirs(os.path.dirname(log), exist_ok=True)
        with open(log, "w") as f:
            def progress(line, f=f, name=run.name):
                f.write(line + "\n")
                f.flush()
                echo(f"{name}: {line}")
            row = run_one(run, echo=progress)
        append_row(path, row)
        done[run.name] = row
        echo(f"{run.name}: loss at {STEPS} {dict(row['curve'])[STEPS]:.4f}, last {row['curve'][-1][1]:.4f} "
             f"({row['seconds']:.0f} s)")
    return done


def _vs(loss: float, ref: float) -> str:
    return f"{(loss - ref) / ref:+.2%}"


def shape_table(done: dict, stages: int, micro_batches: int, out: str | None = None, val: int = VAL_MICRO_BATCHES) -> list:
    """Markdown lines of one shape's table: every run of the shape, a pending one with its curve so far (from
    its log under ``out``) labelled partial."""
    from .report import steps_to
    runs = [r for r in RUNS if (r.stages, r.micro_batches, r.val) == (stages, micro_batches, val)]
    stock = done.get(stock_of(stages, micro_batches, val).name)
    final = None if stock is None else stock["curve"][-1][1]
    lines = ["| run | windows | loss at step 1000 | vs stock | steps to stock's final loss | time to it (ideal bubble) "
             "| speedup | wall s |", "|---|---|---|---|---|---|---|---|"]
    for run in runs:
        row = done.get(run.name)
        if row is None:
            curve = partial_curve(log_path(out, run.name)) if out else []
            if not curve:
                lines.append(f"| {run.name} | - | pending | - | - | - | - | - |")
                continue
            step, loss = curve[-1]
            vs = "-" if final is None or run.mode == "sync" else f"{_vs(loss, final)} (at step {step})"
            lines.append(f"| {run.name} | - | partial: {loss:.4f} at step {step} | {vs} | - | - | - | running |")
            continue
        at = dict(row["curve"])[STEPS]
        vs = "-" if stock is None or run.mode == "sync" else _vs(at, final)
        reach = "-" if stock is None else steps_to(row["curve"], final)
        if reach is None:
            best_step, best = min(row["curve"], key=lambda p: p[1])
            reach_s, t, speed = f"not reached ({_vs(best, final)} above at step {best_step})", "-", "-"
        elif reach == "-":
            reach_s = t = speed = "-"
        else:
            full = micro_batches + stages - 1  # a call with the bubble: stock's, and a warm start's
            warm = reach if run.mode == "sync" else min(reach, row.get("warm_calls", row.get("sync_calls", 0)))
            slots = warm * full + (reach - warm) * micro_batches
            reach_s = f"{reach:.0f}"
            t = f"{slots:.0f} micro-batch slots"
            speed = "1.00x" if run.mode == "sync" else f"{STEPS * full / slots:.2f}x"
        win = ",".join(str(a) for a in row["windows"]) if len(set(row["windows"])) > 1 else str(row["windows"][0])
        lines.append(f"| {run.name} | {win} | {at:.4f} | {vs} | {reach_s} | {t} | {speed} | {row['seconds']:.0f} |")
    return lines


def write_report(out: str) -> str:
    done = load_rows(os.path.join(out, "larger.jsonl"), key="name")
    lines = ["# A larger model: 8 blocks x 256 (emulated P = 4 and P = 8, replay)", "", __doc__.split("\n\n")[1]
             .replace("\n", " "), "",
             f"Model: GPT-2, {N_LAYER} blocks x {N_EMBD} ({N_HEAD} heads), byte tokens, sequences of {SEQ_LEN}, "
             f"micro-batches of {MICRO_BATCH_SIZE}, AdamW lr {LR:g} (constant), betas (0.9, 0.999), validation on "
             f"{VAL_MICRO_BATCHES} micro-batches every {EVERY} steps; {N_LAYER // STAGES} blocks per stage at P = "
             f"{STAGES}, one at P = {N_LAYER}.", ""]
    for stages, micro_batches, val in shapes():
        more = "" if val == VAL_MICRO_BATCHES else f", validation on {val} micro-batches"
        lines += [f"## P = {stages}, M = {micro_batches}{more}", ""] + shape_table(done, stages, micro_batches, out,
                                                                                 val) + [""]
    partial = {r.name: partial_curve(log_path(out, r.name)) for r in RUNS if r.name not in done}
    curves = {**{n: row["curve"] for n, row in done.items()}, **{f"{n} (partial)": c for n, c in partial.items() if c}}
    for stages, micro_batches, val in shapes():
        names = {r.name for r in RUNS if (r.stages, r.micro_batches, r.val) == (stages, micro_batches, val)}
        mine = {n: c for n, c in curves.items() if n.replace(" (partial)", "") in names}
        if mine:
            png = _plot(mine, os.path.join(out, _png_name(stages, micro_batches, val)), stages, micro_batches)
            lines += [f"![curves, P = {stages}, M = {micro_batches}]({os.path.basename(png)})", ""]
    markdown = "\n".join(lines)
    with open(os.path.join(out, "larger.md"), "w") as f:
        f.write(markdown)
    return markdown


def _png_name(stages: int, micro_batches: int, val: int = VAL_MICRO_BATCHES) -> str:
    tail = "" if val == VAL_MICRO_BATCHES else f"_val{val}"
    if (stages, micro_batches, tail) == (STAGES, MICRO_BATCHES, ""):
        return "larger.png"
    return f"larger_P{stages}_M{micro_batches}{tail}.png"


def _plot(curves: dict, path: str, stages: int, micro_batches: int) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.4))
    for name, curve in curves.items():
        ax.plot([s for s, _ in curve], [v for _, v in curve], marker="o", markersize=2, label=name)
    ax.set_xlabel("step (train_batch calls)")
    ax.set_ylabel("validation loss (nats/token)")
    low = min(v for curve in curves.values() for _, v in curve)
    ax.set_ylim(low - 0.05, low + 1.0)
    ax.axvline(STEPS, color="grey", linewidth=0.8, linestyle=":")
    ax.legend(fontsize=8)
    ax.set_title(f"GPT-2 {N_LAYER} x {N_EMBD}, emulated P={stages} M={micro_batches} (replay)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
