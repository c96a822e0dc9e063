"""Side by side: Megatron-DeepSpeed's pretrain_gpt.py on the stock engine, its ZB-H1 schedule and PACI (async).

    .venv/bin/python scripts/megatron_bench.py --out docs/results/megatron [--rounds 2] [--cases p2 p4-emulated p2-ckact]
        [--engines stock paci zbh1]
    .venv/bin/python scripts/megatron_bench.py --out docs/results/megatron-clip1 --clipping 1.0 --cases p2 p4-emulated \
        --engines stock paci

Engines: ``stock`` (DeepSpeed's 1F1B-flush), ``paci`` (``"paci": {"enabled": true}``) and ``zbh1``: the stock
engine with Megatron's ``--enable-zbh1-pipeline`` (Megatron swaps DeepSpeed's ``TrainSchedule`` for its
``ZeroBubbleH1Pipeline`` and defers the linear layers' weight gradients to ``WeightPass`` instructions).

Cases (same model, data, arguments and seed for every engine; only the DeepSpeed config and the ZB-H1 flag differ):

* ``p2``: 2 pipeline stages, real compute (8 layers, hidden 128, seq 256, global batch 8 in micro-batches of 2,
  i.e. M = 4; vocabulary: the local BPE-1024, so the LM head does not dominate the last stage).
* ``p4-emulated``: 4 stages, 8 layers (hidden 64), and the benchmark's emulated device time attached from outside
  to Megatron's ``ParallelTransformerLayerPipe`` (:mod:`ds_paci.integrations.emulate_layers`): every layer adds
  ``F`` = 50 ms to its forward and 100 ms to its backward, split into ``B`` = 50 ms on the activation path and
  ``W`` = 50 ms handed to Megatron's ``WeightGradStore`` (paid at once in a full backward, in the next
  ``WeightPass`` under ZB-H1's backward-only passes); M = 4. Ideal ratio (M+P-1)/M = 1.75. Emulated, not
  hardware, time.
* ``p2-ckact``: ``p2`` with ``--checkpoint-activations`` (memory and loss under recomputation).

Each round runs every case's engines one after the other, alternating which goes first. Throughput: tokens per
iteration / the median of Megatron's own ``elapsed time per iteration`` over iterations 3..N (evaluation only at
the end, so no iteration carries it); also from the fastest such iteration (less sensitive to other jobs on a
shared machine). ``--add`` keeps the stored results and replaces only what it runs (one case at a time).
``--summarize`` recomputes the summary from the logs of an earlier run. Memory: the peak resident set of the largest process of the launch
(``wait4``), i.e. of the busiest rank. Loss: Megatron's final validation loss (``--eval-iters 8``).
``--clipping C`` sets ``"gradient_clipping": C`` for both engines (default 0: no clipping): the stock engine clips
by the norm over the whole pipeline, async PACI each stage's own gradient by its norm and the tied embedding's
total by its own norm (README, "Tied weights across stages"); LLM recipes, Megatron's among them, clip at 1.0. This CPU machine needs the CPU-only environment shim
(``launch/megatron_cpu``: no torchvision/flash-attn, DeepSpeed >= 0.19.5); they change no number.
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ds_paci.integrations import megatron  # noqa: E402

SHIMS = ROOT / "launch" / "megatron_cpu"
CACHE = ROOT / ".cache" / "megatron"
EMULATED_LAYER = "megatron.model.transformer:ParallelTransformerLayerPipe"

WEIGHT_QUEUE = "megatron.core.tensor_parallel.weight_grad_store:WeightGradStore"

CASES = {
    "p2": dict(nproc=2, layers=8, hidden=128, heads=4, seq=256, iters=24, emulate=None, extra=[]),
    "p4-emulated": dict(nproc=4, layers=8, hidden=64, heads=4, seq=128, iters=12, emulate=(0.05, 0.05, 0.05),
                        extra=[]),
    "p2-ckact": dict(nproc=2, layers=8, hidden=128, heads=4, seq=256, iters=24, emulate=None,
                     extra=["--checkpoint-activations"]),
}
#: engine -> (the DeepSpeed config's "paci" section, extra Megatron arguments)
ENGINES = {"stock": (None, []), "paci": ({"enabled": True}, []), "zbh1": (None, ["--enable-zbh1-pipeline"])}


def wait_for_quiet(max_load, max_wait):
    """Sleep until the 1-minute load average is below ``max_load`` (0: never wait) or ``max_wait`` s passed."""
    began = time.monotonic()
    while max_load > 0 and os.getloadavg()[0] >= max_load and time.monotonic() - began < max_wait:
        time.sleep(10)
    return round(time.monotonic() - began, 1)


def launch(case, engine, data, tree, out, round_no, clipping=0.0):
    c = CASES[case]
    run_dir = out / "runs" / f"{case}-{engine}-r{round_no}"
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = run_dir / "ds.json"
    paci, engine_args = ENGINES[engine]
    cfg.write_text(json.dumps(megatron.ds_config(paci, micro_batch=2, global_batch=8, clipping=clipping)))
    args = megatron.gpt_args(data, train_iters=c["iters"], layers=c["layers"], hidden=c["hidden"], heads=c["heads"],
                             seq=c["seq"], pipeline=c["nproc"], eval_interval=c["iters"], eval_iters=8,
                             cache_dir=run_dir / "index-cache") + c["extra"] + engine_args
    module, module_args = "ds_paci.run", []
    if c["emulate"]:
        module = "ds_paci.integrations.emulate_layers"
        module_args = ["--emulate-fbw", ",".join(str(t) for t in c["emulate"]), "--emulate-weight-queue",
                       WEIGHT_QUEUE, "--emulate-layer", EMULATED_LAYER]
    cmd = megatron.launch_command(tree, args, cfg, nproc=c["nproc"], port=random.randint(20000, 40000),
                                  module=module, module_args=module_args)
    env = megatron.run_env([SHIMS])
    env["DS_ACCELERATOR"] = "cpu"
    t0 = time.perf_counter()
    with open(run_dir / "log.txt", "w") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    rc = os.waitstatus_to_exitcode(status)
    if rc != 0:
        raise SystemExit(f"{case}/{engine} round {round_no} failed (rc {rc}); see {run_dir / 'log.txt'}")
    return {"case": case, "engine": engine, "round": round_no, "wall_s": round(wall, 1), **measure(run_dir, case),
            "peak_rss_mib": usage.ru_maxrss / 1024.0, "load_avg_1min": os.getloadavg()[0], "clipping": clipping}


def measure(run_dir, case):
    """Throughput and losses from a launch's log (Megatron's own printed lines)."""
    parsed = megatron.parse_log((run_dir / "log.txt").read_text())
    if not parsed.iterations:
        raise SystemExit(f"no iteration lines in {run_dir / 'log.txt'}")
    ms = [parsed.iterations[i]["elapsed time per iteration (ms)"] for i in sorted(parsed.iterations) if i >= 3]
    tokens_per_iteration = 8 * CASES[case]["seq"]
    # Megatron's printed grad norm: the stock engine's over the whole pipeline, PACI's the last stage's own
    norms = [f["grad norm"] for f in parsed.iterations.values() if f.get("grad norm")]
    return {"median_ms_per_iteration": statistics.median(ms), "min_ms_per_iteration": min(ms),
            "tokens_per_s": tokens_per_iteration / (statistics.median(ms) / 1000.0),
            "best_tokens_per_s": tokens_per_iteration / (min(ms) / 1000.0),
            "final_validation_loss": float(parsed.validation.get("final", "nan")),
            "last_train_loss": parsed.loss(max(parsed.iterations)),
            "median_grad_norm": statistics.median(norms) if norms else None,
            "train_losses": [parsed.loss(i) for i in sorted(parsed.iterations)]}


def _per_round(rows, engine, other, key):
    by_round = {x["round"]: x for x in rows[other]}
    return [round(x[key] / by_round[x["round"]][key], 3) for x in sorted(rows[engine], key=lambda x: x["round"])
            if x["round"] in by_round]


def summarize(results, case):
    """Per engine: median tokens/s, validation losses, peak RSS; every engine's ratio to stock and PACI's to ZB-H1
    (per round); the largest difference of any printed training loss from stock's (same iteration)."""
    rows = {e: [x for x in results if x["case"] == case and x["engine"] == e] for e in ENGINES}
    rows = {e: v for e, v in rows.items() if v}
    out = {}
    for engine, runs in rows.items():
        out[engine] = {"tokens_per_s_median": round(statistics.median(x["tokens_per_s"] for x in runs), 1),
                       "final_validation_loss": [x["final_validation_loss"] for x in runs],
                       "peak_rss_mib_median": round(statistics.median(x["peak_rss_mib"] for x in runs), 1),
                       "median_grad_norm": [x.get("median_grad_norm") for x in runs]}
        for other in ("stock", "zbh1"):
            if other in rows and other != engine:
                ratios = _per_round(rows, engine, other, "tokens_per_s")
                out[engine][f"vs_{other}_per_round"] = ratios
                out[engine][f"vs_{other}_median"] = round(statistics.median(ratios), 3)
                out[engine][f"vs_{other}_fastest_iterations_per_round"] = _per_round(rows, engine, other,
                                                                                   "best_tokens_per_s")
        if "stock" in rows and engine != "stock" and all("train_losses" in x for x in runs + rows["stock"]):
            ref = rows["stock"][0]["train_losses"]
            out[engine]["max_train_loss_difference_from_stock"] = max(
                abs(a - b) for x in runs for a, b in zip(x["train_losses"], ref))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="docs/results/megatron")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cases", nargs="+", default=["p2", "p4-emulated", "p2-ckact"], choices=sorted(CASES))
    ap.add_argument("--clipping", type=float, default=0.0, help='"gradient_clipping" for both engines (default 0)')
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    ap.add_argument("--max-load", type=float, default=0.0,
                    help="before each launch wait until the 1-minute load average is below this (0: never wait)")
    ap.add_argument("--max-wait", type=float, default=900.0, help="seconds a launch waits for --max-load at most")
    ap.add_argument("--add", action="store_true",
                    help="keep the stored results.json of --out; a launch replaces the entry of its case, engine, round")
    ap.add_argument("--summarize", action="store_true",
                    help="no launches: re-read the logs of an earlier run in --out and rewrite the summary")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.summarize:
        results = json.loads((out / "results.json").read_text())
        for res in results:
            res.update(measure(out / "runs" / f"{res['case']}-{res['engine']}-r{res['round']}", res["case"]))
        (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
        a.cases = [c for c in a.cases if any(x["case"] == c for x in results)]
    else:
        tree = megatron.extract(megatron.find_snapshot(), CACHE)
        env = megatron.run_env([SHIMS])
        data = megatron.prepare_data(tree, CACHE / "data", vocab_size=1024, env=env)
        stored = out / "results.json"
        results = json.loads(stored.read_text()) if a.add and stored.exists() else []
        for r in range(a.rounds):
            for case in a.cases:
                k = r % len(a.engines)
                order = a.engines[k:] + a.engines[:k]  # each round another engine goes first
                for engine in order:
                    waited = wait_for_quiet(a.max_load, a.max_wait)
                    before = os.getloadavg()[0]
                    res = {**launch(case, engine, data, tree, out, r, clipping=a.clipping), "waited_for_quiet_s": waited,
                           "load_avg_1min_before": before}
                    results = [x for x in results if (x["case"], x["engine"], x["round"]) != (case, engine, r)]
                    results.append(res)
                    print(json.dumps(res), flush=True)
                    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    cases = sorted({x["case"] for x in results}) if a.add else a.cases
    summary = {case: summarize(results, case) for case in cases}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
