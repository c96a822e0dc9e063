"""Time to stock's final loss at the benchmark's emulated P = 4 and P = 8 shapes, with PACI trained past it.

The engine curve study (``python -m ds_paci.tools.bench --study lookahead``) stopped every engine at stock's
300 steps. Here the PACI engines of the same configurations (model, data, seeds, learning rates, validations
every 25 steps, each after a drain, as the engine's) run in the replay for 1.5 x 300 steps. Their first 300
steps must equal the stored engine curves of ``docs/results/lookahead`` exactly (checked; the replay is the
engine, :mod:`ds_paci.tools.replay.check`); stock's curves are the stored engine runs. Times are steps x the
seconds per batch measured in the stored throughput rounds (emulated device time), as the curve study's.

``python -m ds_paci.tools.studies.quality --part time-to-final --out docs/results/quality`` (resumable: one JSON line
per run in ``<out>/time_to_final.jsonl``) writes ``<out>/time_to_final.md``.
"""

from __future__ import annotations

import json
import os

from .rows import append_row, load_rows

LOOKAHEAD_DIR = "docs/results/lookahead"
SHAPES = ("emulated_P4_M4", "emulated_P8_M8")
LRS = (2e-3, 2e-3 / 3)
SEEDS = ((1234, 7), (4321, 8))
ENGINES = {"paci": "paci", "paci+lookahead": "lookahead"}
STEPS, EVERY, OVERRUN = 300, 25, 1.5


def _stored(shape: str, source: str) -> dict:
    with open(os.path.join(source, f"{shape}_curves.json")) as f:
        return json.load(f)


def replay_curve(shape: str, engine: str, lr: float, seed: int, data_seed: int, steps: int) -> dict:
    """One PACI run of a stored curve-study configuration in the replay; its validation curve."""
    import torch

    from ds_paci.tools.replay.replayer import JOBS, Evaluation, load_tokens, replay
    from ds_paci.workload.data import MicroBatchIterator, eval_micro_batches
    from ds_paci.workload.gpt2 import gpt2_config, gpt2_reference_model
    torch.set_num_threads(1)
    job = JOBS[shape]
    train, val, _ = load_tokens("byte", main_split=False)
    cfg = gpt2_config("tiny", vocab_size=257, n_positions=job.seq_len, n_embd=job.n_embd, n_layer=job.n_layer,
                      n_head=job.n_head)
    model = gpt2_reference_model(cfg, seed=seed)
    result = replay(model, job.stages, job.micro_batches, MicroBatchIterator(train, job.micro_batch_size,
                                                                             job.seq_len, seed=data_seed),
                    eval_micro_batches(val, job.micro_batch_size, job.seq_len,
                                       count=job.eval_batches * job.micro_batches),
                    steps, mode=ENGINES[engine], lr=lr, betas=(0.9, 0.999), weight_decay=0.0,
                    evaluation=Evaluation(every=EVERY), restore="recompute")  # the stored runs' default
    return {"shape": shape, "engine": engine, "lr": lr, "seed": seed, "data_seed": data_seed, "steps": steps,
            "curve": result.curve, "seconds": round(result.seconds, 1), "loadavg": list(os.getloadavg())}


def _key(shape, engine, lr, seed):
    return f"{shape} {engine} lr={lr:g} seed={seed}"


def run_all(out: str, source: str = LOOKAHEAD_DIR, echo=print) -> dict:
    """Every PACI run not yet in ``<out>/time_to_final.jsonl`` (one line each); returns all of them."""
    path = os.path.join(out, "time_to_final.jsonl")
    done = load_rows(path)
    steps = int(OVERRUN * STEPS)
    order = [(lr, engine, shape, pair) for lr in LRS for engine in ("paci+lookahead", "paci") for shape in SHAPES
             for pair in SEEDS]  # the look-ahead at the better learning rate first
    for lr, engine, shape, (seed, data_seed) in order:
        key = _key(shape, engine, lr, seed)
        if key in done:
            continue
        row = {"key": key, **replay_curve(shape, engine, lr, seed, data_seed, steps)}
        append_row(path, row)
        done[key] = row
        echo(f"{key}: loss at {STEPS} {dict(row['curve'])[STEPS]:.4f}, at {steps} "
             f"{row['curve'][-1][1]:.4f} ({row['seconds']:.0f} s)")
    return done


def engine_agreement(done: dict, source: str = LOOKAHEAD_DIR) -> list:
    """Per replayed run: whether its first 300 steps equal the stored engine curve exactly, and the largest gap."""
    out = []
    for shape in SHAPES:
        stored = _stored(shape, source)["runs"]
        for key, row in done.items():
            if row["shape"] != shape:
                continue
            engine_key = f"lr={row['lr']:g} seed={row['seed']} data_seed={row['data_seed']} engine={row['engine']}"
            engine = [(p["step"], p["loss"]) for p in stored[engine_key]["validation"]]
            mine = [tuple(p) for p in row["curve"] if p[0] <= STEPS]
            gap = max(abs(a[1] - b[1]) for a, b in zip(engine, mine)) if len(engine) == len(mine) else float("inf")
            out.append({"key": key, "identical": engine == mine, "gap": gap})
    return out


def write_report(out: str, source: str = LOOKAHEAD_DIR) -> str:
    """``<out>/time_to_final.md``: the curve study's tables with PACI past stock's steps; returns the markdown."""
    from ds_paci.tools.bench.analysis import study_comparison
    from ds_paci.tools.bench.config import ENGINES as BENCH_ENGINES
    from ds_paci.tools.bench.report import study_tables
    path = os.path.join(out, "time_to_final.jsonl")
    done = load_rows(path)
    lines = ["# Time to stock's final loss (emulated P = 4 and P = 8, PACI engines trained 1.5x stock's steps)", "",
             __doc__.split("\n\n")[1].replace("\n", " "), ""]
    agreement = engine_agreement(done, source)
    same = sum(a["identical"] for a in agreement)
    lines += [f"Replay vs stored engine curves over the first {STEPS} steps: {same} of {len(agreement)} runs "
              f"identical (largest gap {max([a['gap'] for a in agreement] or [0]):.2g}).", ""]
    for shape in SHAPES:
        stored = _stored(shape, source)
        with open(os.path.join(source, f"{shape}.json")) as f:
            spb = {e: v["median"] for e, v in json.load(f)["comparison"]["seconds_per_batch"].items()}
        runs = {}
        for lr in LRS:
            for seed, data_seed in SEEDS:
                key = f"lr={lr:g} seed={seed} data_seed={data_seed} engine=stock"
                runs[(lr, seed, "stock")] = [(p["step"], p["loss"]) for p in stored["runs"][key]["validation"]]
                for engine in ENGINES:
                    row = done.get(_key(shape, engine, lr, seed))
                    if row is not None:
                        runs[(lr, seed, engine)] = [tuple(p) for p in row["curve"]]
        for lr in LRS:  # the seeds the look-ahead ran on, the engines that ran on all of them (the rest pending)
            seeds = [s for s, _ in SEEDS if (lr, s, "paci+lookahead") in runs]
            engines = [e for e in BENCH_ENGINES if seeds and all((lr, s, e) in runs for s in seeds)]
            if not seeds:
                lines += [f"### {shape}, lr {lr:g}: PACI runs pending", ""]
                continue
            comparison = study_comparison(runs, [lr], seeds, engines, STEPS, spb)
            lines += [study_tables(f"{shape}, lr {lr:g}, seeds {', '.join(map(str, seeds))} (times: measured seconds "
                                   f"per batch, emulated)", comparison, engines, seeds), ""]
    markdown = "\n".join(lines)
    with open(os.path.join(out, "time_to_final.md"), "w") as f:
        f.write(markdown)
    return markdown
