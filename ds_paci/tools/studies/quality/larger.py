"""One larger model: GPT-2 of 8 blocks x 256 on the Shakespeare corpus at the emulated P = 4, M = 4 shape.

Stock (the replay's sync mode), then PACI + look-ahead with the engine's default window ``a = M`` and with
``"auto"``, trained 1.5x stock's :data:`STEPS` (one drain at every validation, as the engine's curve study),
so that the time to stock's final loss is defined. Time = steps x seconds per batch of the ideal emulated
pipeline (``(M + P - 1)`` micro-batch slots per batch for stock, ``M`` for PACI: the bubble is the only
difference), since this model has no timed throughput rounds.

``python -m ds_paci.tools.studies.quality --part larger --out docs/results/quality`` (resumable: one JSON line per
run in ``<out>/larger.jsonl``) writes ``<out>/larger.md`` and ``<out>/larger.png``.
"""

from __future__ import annotations

import math
import os

from .rows import append_row, load_rows

STAGES, MICRO_BATCHES, N_LAYER, N_EMBD, N_HEAD, SEQ_LEN, MICRO_BATCH_SIZE = 4, 4, 8, 256, 8, 32, 2
STEPS, OVERRUN, EVERY, VAL_MICRO_BATCHES, LR, SEED, DATA_SEED = 1000, 1.5, 50, 16, 1e-3, 1234, 7
RUNS = (("stock", "sync", None), ("paci+lookahead a=M", "lookahead", None), ("paci+lookahead auto", "lookahead", "auto"))


def run_one(name: str, mode: str, window, echo=None) -> dict:
    import torch

    from ds_paci.tools.replay.replayer import Evaluation, load_tokens, replay, stage_windows
    from ds_paci.workload.data import MicroBatchIterator, eval_micro_batches
    from ds_paci.workload.gpt2 import gpt2_config, gpt2_reference_model
    torch.set_num_threads(1)
    train, val, _ = load_tokens("byte", main_split=False)
    cfg = gpt2_config("tiny", vocab_size=257, n_positions=SEQ_LEN, n_embd=N_EMBD, n_layer=N_LAYER, n_head=N_HEAD)
    model = gpt2_reference_model(cfg, seed=SEED)
    steps = STEPS if mode == "sync" else math.ceil(OVERRUN * STEPS)
    result = replay(model, STAGES, MICRO_BATCHES, MicroBatchIterator(train, MICRO_BATCH_SIZE, SEQ_LEN, seed=DATA_SEED),
                    eval_micro_batches(val, MICRO_BATCH_SIZE, SEQ_LEN, count=VAL_MICRO_BATCHES), steps, mode=mode,
                    window=window, lr=LR, betas=(0.9, 0.999), weight_decay=0.0, evaluation=Evaluation(every=EVERY), echo=echo)
    return {"name": name, "mode": mode, "windows": stage_windows(window, STAGES, MICRO_BATCHES), "steps": steps,
            "curve": result.curve, "lookahead": result.lookahead, "seconds": round(result.seconds, 1),
            "loadavg": list(os.getloadavg())}


def run_all(out: str, echo=print, names=None) -> dict:
    """Every run of :data:`RUNS` (or only ``names``) not yet in ``<out>/larger.jsonl``; returns all stored runs.
    Runs of different names may go in separate processes at once (each appends its one line when done)."""
    path = os.path.join(out, "larger.jsonl")
    done = load_rows(path, key="name")
    for name, mode, window in RUNS:
        if name in done or (names and name not in names):
            continue
        row = run_one(name, mode, window, echo=lambda line: echo(f"{name}: {line}"))
        append_row(path, row)
        done[name] = row
        echo(f"{name}: loss at {STEPS} {dict(row['curve'])[STEPS]:.4f}, last {row['curve'][-1][1]:.4f} "
             f"({row['seconds']:.0f} s)")
    return done


def write_report(out: str) -> str:
    from .report import steps_to
    done = load_rows(os.path.join(out, "larger.jsonl"), key="name")
    stock = done.get("stock")
    lines = ["# A larger model: 8 blocks x 256 (emulated P = 4, M = 4, replay)", "", __doc__.split("\n\n")[1]
             .replace("\n", " "), "",
             f"Model: GPT-2, {N_LAYER} blocks x {N_EMBD} ({N_HEAD} heads), byte tokens, sequences of {SEQ_LEN}, "
             f"micro-batches of {MICRO_BATCH_SIZE}, M = {MICRO_BATCHES}, {STAGES} stages ({N_LAYER // STAGES} blocks "
             f"each), AdamW lr {LR:g} (constant), betas (0.9, 0.999), validation on {VAL_MICRO_BATCHES} micro-batches "
             f"every {EVERY} steps.", "",
             "| run | windows | loss at step 1000 | vs stock | steps to stock's final loss | time to it (ideal bubble) "
             "| speedup | wall s |", "|---|---|---|---|---|---|---|---|"]
    ideal = (MICRO_BATCHES + STAGES - 1) / MICRO_BATCHES
    for name, _, _ in RUNS:
        row = done.get(name)
        if row is None:
            lines.append(f"| {name} | - | pending | - | - | - | - | - |")
            continue
        at = dict(row["curve"])[STEPS]
        vs = "-" if stock is None or name == "stock" else f"{(at - stock['curve'][-1][1]) / stock['curve'][-1][1]:+.2%}"
        reach = "-" if stock is None else steps_to(row["curve"], stock["curve"][-1][1])
        if reach is None:
            best_step, best = min(row["curve"], key=lambda p: p[1])
            reach_s = f"not reached ({(best - stock['curve'][-1][1]) / stock['curve'][-1][1]:+.2%} above at step " \
                      f"{best_step})"
            t = speed = "-"
        elif reach == "-":
            reach_s = t = speed = "-"
        else:
            slots = MICRO_BATCHES + STAGES - 1 if name == "stock" else MICRO_BATCHES
            reach_s = f"{reach:.0f}"
            t = f"{reach * slots:.0f} micro-batch slots"
            speed = f"{STEPS * ideal / reach:.2f}x" if name != "stock" else "1.00x"
        win = ",".join(str(a) for a in row["windows"]) if len(set(row["windows"])) > 1 else str(row["windows"][0])
        lines.append(f"| {name} | {win} | {at:.4f} | {vs} | {reach_s} | {t} | {speed} | {row['seconds']:.0f} |")
    png = _plot(done, os.path.join(out, "larger.png"))
    lines += ["", f"![curves]({os.path.basename(png)})", ""]
    markdown = "\n".join(lines)
    with open(os.path.join(out, "larger.md"), "w") as f:
        f.write(markdown)
    return markdown


def _plot(done: dict, path: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.4))
    for name, row in done.items():
        ax.plot([s for s, _ in row["curve"]], [v for _, v in row["curve"]], marker="o", markersize=2, label=name)
    ax.set_xlabel("step (train_batch calls)")
    ax.set_ylabel("validation loss (nats/token)")
    low = min(v for row in done.values() for _, v in row["curve"])
    ax.set_ylim(low - 0.05, low + 1.0)
    ax.axvline(STEPS, color="grey", linewidth=0.8, linestyle=":")
    ax.legend(fontsize=8)
    ax.set_title(f"GPT-2 {N_LAYER} x {N_EMBD}, emulated P={STAGES} M={MICRO_BATCHES} (replay)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
