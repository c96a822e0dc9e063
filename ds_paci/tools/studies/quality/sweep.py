"""Running the sweep: one replay per :class:`~ds_paci.tools.studies.quality.grid.SweepRun`, resumable, on a few processes.

Results are one JSON line per finished run in ``<out>/runs.jsonl`` (appended by the parent only, so a
killed sweep loses at most the runs in progress); a restart skips every key already there.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import multiprocessing as mp
import os
import time

from .grid import MODEL, SweepRun, run_cost, sweep_plan
from .rows import append_row, load_rows

_TOKENS = {}
RESTORE = "recompute"  # the look-ahead's restore in every sweep run (the engine's default when the sweep began)


def _tokens():
    if "train" not in _TOKENS:
        from ds_paci.tools.replay.replayer import load_tokens
        train, val, _ = load_tokens("byte", main_split=False)
        _TOKENS.update(train=train, val=val)
    return _TOKENS["train"], _TOKENS["val"]


def execute(run: SweepRun, model=MODEL) -> dict:
    """One run in this process; returns its result line (curve, final loss at the common step count, telemetry)."""
    import torch

    from ds_paci.tools.replay.replayer import Evaluation, replay
    from ds_paci.workload.data import MicroBatchIterator, eval_micro_batches
    from ds_paci.workload.gpt2 import gpt2_config, gpt2_reference_model
    torch.set_num_threads(1)
    train, val = _tokens()
    cfg = gpt2_config("tiny", vocab_size=257, n_positions=model.seq_len, n_embd=model.n_embd, n_layer=run.stages,
                      n_head=model.n_head)
    net = gpt2_reference_model(cfg, seed=run.seed)
    train_iter = MicroBatchIterator(train, model.micro_batch_size, model.seq_len, seed=run.data_seed)
    val_batches = eval_micro_batches(val, model.micro_batch_size, model.seq_len, count=model.val_micro_batches)
    mode = {"stock": "sync", "paci": "paci", "lookahead": "lookahead"}[run.engine]
    evaluation = Evaluation(every=run.eval_every, drains=False,
                            drain_at=(run.common_steps, ) if run.steps > run.common_steps else ())
    result = replay(net, run.stages, run.micro_batches, train_iter, val_batches, run.steps, mode=mode,
                    window=list(run.windows), lr=run.lr, betas=model.betas, weight_decay=model.weight_decay,
                    evaluation=evaluation, optimizer=run.optimizer, restore=RESTORE, step_phase=run.step_phase)
    final = dict(result.curve)[run.common_steps]
    errors = [s.get("prediction_error") for s in result.lookahead if isinstance(s, dict)]
    errors = [e for e in errors if e is not None]
    return {**run.as_dict(), "curve": result.curve, "final": final, "local_steps": result.local_steps,
            "prediction_error": errors, "seconds": round(result.seconds, 1),
            "loadavg": [round(x, 2) for x in os.getloadavg()], "model": dataclasses.asdict(model)}


def load_results(path: str) -> dict:
    """``{key: result line}`` of a results file (missing file: empty)."""
    return load_rows(path)


def run_sweep(out: str, workers: int = 2, depths=None, plan_fn=None, echo=print, model=MODEL) -> dict:
    """Run every pending run of the plan on ``workers`` processes, re-planning as runs finish (phase 2 of a
    depth starts once its learning-rate sweep is in). Returns all results."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "runs.jsonl")
    results = load_results(path)
    plan_fn = plan_fn or (lambda res: sweep_plan(res, **({"depths": depths} if depths else {})))
    running = {}
    began = time.time()
    ctx = mp.get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        while True:
            pending = [r for r in plan_fn(results) if r.key() not in results and r.key() not in running]
            while pending and len(running) < workers:
                run = pending.pop(0)
                running[run.key()] = (pool.submit(execute, run, model), time.time())
            if not running:
                break
            done, _ = cf.wait([f for f, _ in running.values()], return_when=cf.FIRST_COMPLETED)
            for key in [k for k, (f, _) in running.items() if f in done]:
                future, started = running.pop(key)
                row = future.result()
                append_row(path, row)
                results[key] = row
                left = [r for r in plan_fn(results) if r.key() not in results]
                echo(f"[{time.time() - began:7.0f} s] {key}: final {row['final']:.4f} ({row['seconds']:.0f} s); "
                     f"{len(left)} planned runs left (cost {sum(run_cost(r) for r in left):.3g}), "
                     f"load {os.getloadavg()[0]:.2f}")
    return results
