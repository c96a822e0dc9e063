"""Seconds per ``train_batch`` with the data-parallel reduce at the step and overlapped (issue 27 item 2).

    PYTHONPATH=$PWD DS_ACCELERATOR=cpu .venv/bin/python scripts/overlap_reduce_timing.py [--dim 512] [--layers 8]
        [--micro 32] [--gas 4] [--rounds 7] [--calls 3] [--out docs/results/overlap_reduce.json]

P = 2 x DP = 2 over gloo on this machine (loopback), a pipeline of ``--layers`` ``dim x dim`` tanh layers, SGD, each
replica its own data. Two engines are built in the same four processes, ``"overlap_reduce": false`` and ``true``
(buckets of ``dim * dim`` elements); the script alternates them ``--rounds`` times, each round ``--calls`` calls and
a drain that leaves the window open (nothing in flight when the other engine runs), and reports per rank the median
seconds per call of each, and their ratio. No timing is asserted anywhere: this is a measurement.
"""

import argparse
import json
import statistics
import time

import torch


def _batches(micro, dim, seed):
    g = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randn(micro, dim, generator=g)
        yield x, torch.tanh(x.flip(-1))


def worker(rank, dim, layers, micro, gas, rounds, calls):
    import ds_paci
    from ds_paci.tools.tanh_pipeline import tanh_pipeline
    engines = {}
    for overlap in (False, True):
        model = tanh_pipeline(dim, layers, 2, lambda out, y: ((out - y)**2).mean())
        cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas, "steps_per_print": 10**9,
               "paci": {"enabled": True, "overlap_reduce": overlap, "overlap_bucket_elements": dim * dim,
                        "watchdog_seconds": 600}}
        engine = ds_paci.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-3),
                                    config=cfg)[0]
        data = _batches(micro, dim, 3 + engine.grid.data_parallel_id)
        engine.train_batch(data)  # warm-up
        engine.drain(close_window=False)
        engines[overlap] = (engine, data)
    times = {False: [], True: []}
    for _ in range(rounds):
        for overlap in (False, True):
            engine, data = engines[overlap]
            start = time.perf_counter()
            for _ in range(calls):
                engine.train_batch(data)
            engine.drain(close_window=False)
            times[overlap].append((time.perf_counter() - start) / calls)
    engine = engines[True][0]
    return {"rank": rank, "stage": engine.stage_id, "dp": engine.grid.data_parallel_id,
            "buckets": len(engine._overlap.buckets), "in_backward": engine._overlap.launched_in_backward,
            "step_s": times[False], "overlap_s": times[True]}


def main():
    from ds_paci.tools.processes.world import run_world
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--micro", type=int, default=32)
    ap.add_argument("--gas", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--out")
    a = ap.parse_args()
    results = run_world(worker, 4, a.dim, a.layers, a.micro, a.gas, a.rounds, a.calls, timeout=1800)
    rows = []
    for r in results:
        step, over = statistics.median(r["step_s"]), statistics.median(r["overlap_s"])
        rows.append({**r, "median_step_s": step, "median_overlap_s": over, "ratio": over / step})
        print(f"rank {r['rank']} (stage {r['stage']}, dp {r['dp']}, {r['buckets']} buckets): reduce at the step "
              f"{step * 1e3:.1f} ms/call, overlapped {over * 1e3:.1f} ms/call, ratio {over / step:.3f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "ranks": rows}, f, indent=1)


if __name__ == "__main__":
    main()
