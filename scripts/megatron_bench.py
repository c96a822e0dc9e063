"""Side by side: Megatron-DeepSpeed's pretrain_gpt.py on the stock engine vs PACI (async), back to back.

    .venv/bin/python scripts/megatron_bench.py --out docs/results/megatron [--rounds 2] [--cases p2 p4-emulated p2-ckact]
    .venv/bin/python scripts/megatron_bench.py --out docs/results/megatron-clip1 --clipping 1.0 --cases p2 p4-emulated

Cases (same model, data, arguments and seed for both engines; only the DeepSpeed config differs):

* ``p2``: 2 pipeline stages, real compute (8 layers, hidden 128, seq 256, global batch 8 in micro-batches of 2,
  i.e. M = 4; vocabulary: the local BPE-1024, so the LM head does not dominate the last stage).
* ``p4-emulated``: 4 stages, 8 layers (hidden 64), and the benchmark's emulated device time attached from outside
  to Megatron's ``ParallelTransformerLayerPipe`` (:mod:`ds_paci.integrations.emulate_layers`): every layer adds
  ``F`` = 50 ms to its forward and 100 ms to its backward; M = 4. Ideal ratio (M+P-1)/M = 1.75. Emulated, not
  hardware, time.
* ``p2-ckact``: ``p2`` with ``--checkpoint-activations`` (memory and loss under recomputation).

Each round runs every case's engines one after the other, alternating which goes first. Throughput: tokens per
iteration / the median of Megatron's own ``elapsed time per iteration`` over iterations 3..N (evaluation only at
the end, so no iteration carries it); also from the fastest such iteration (less sensitive to other jobs on a
shared machine). ``--summarize`` recomputes the summary from the logs of an earlier run. Memory: the peak resident set of the largest process of the launch
(``wait4``), i.e. of the busiest rank. Loss: Megatron's final validation loss (``--eval-iters 8``).
``--clipping C`` sets ``"gradient_clipping": C`` for both engines (default 0: no clipping): the stock engine clips
by the norm over the whole pipeline, async PACI each stage's own gradient by its norm and the tied embedding's
total by its own norm (README, "Tied weights across stages"); LLM recipes, Megatron's among them, clip at 1.0. This CPU machine needs the test environment's shims
(``tests/megatron/env_shims``: no torchvision/flash-attn, DeepSpeed >= 0.19.5); they change no number.
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

SHIMS = ROOT / "tests" / "megatron" / "env_shims"
CACHE = ROOT / ".cache" / "megatron"
EMULATED_LAYER = "megatron.model.transformer:ParallelTransformerLayerPipe"

CASES = {
    "p2": dict(nproc=2, layers=8, hidden=128, heads=4, seq=256, iters=24, emulate=0.0, extra=[]),
    "p4-emulated": dict(nproc=4, layers=8, hidden=64, heads=4, seq=128, iters=12, emulate=0.05, extra=[]),
    "p2-ckact": dict(nproc=2, layers=8, hidden=128, heads=4, seq=256, iters=24, emulate=0.0,
                     extra=["--checkpoint-activations"]),
}
ENGINES = {"stock": None, "paci": {"enabled": True}}


def launch(case, engine, data, tree, out, round_no, clipping=0.0):
    c = CASES[case]
    run_dir = out / "runs" / f"{case}-{engine}-r{round_no}"
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = run_dir / "ds.json"
    cfg.write_text(json.dumps(megatron.ds_config(ENGINES[engine], micro_batch=2, global_batch=8, clipping=clipping)))
    args = megatron.gpt_args(data, train_iters=c["iters"], layers=c["layers"], hidden=c["hidden"], heads=c["heads"],
                             seq=c["seq"], pipeline=c["nproc"], eval_interval=c["iters"], eval_iters=8,
                             cache_dir=run_dir / "index-cache") + c["extra"]
    module, module_args = "ds_paci.run", []
    if c["emulate"] > 0:
        module = "ds_paci.integrations.emulate_layers"
        module_args = ["--emulate-seconds", str(c["emulate"]), "--emulate-layer", EMULATED_LAYER]
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
            "median_grad_norm": statistics.median(norms) if norms else None}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="docs/results/megatron")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cases", nargs="+", default=["p2", "p4-emulated", "p2-ckact"], choices=sorted(CASES))
    ap.add_argument("--clipping", type=float, default=0.0, help='"gradient_clipping" for both engines (default 0)')
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
        results = []
        for r in range(a.rounds):
            for case in a.cases:
                order = ["stock", "paci"] if r % 2 == 0 else ["paci", "stock"]
                for engine in order:
                    res = launch(case, engine, data, tree, out, r, clipping=a.clipping)
                    results.append(res)
                    print(json.dumps(res), flush=True)
                    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    summary = {}
    for case in a.cases:
        rows = {e: [x for x in results if x["case"] == case and x["engine"] == e] for e in ENGINES}
        ratios = [p["tokens_per_s"] / s["tokens_per_s"] for p, s in zip(
            sorted(rows["paci"], key=lambda x: x["round"]), sorted(rows["stock"], key=lambda x: x["round"]))]
        best = [p["best_tokens_per_s"] / s["best_tokens_per_s"] for p, s in zip(
            sorted(rows["paci"], key=lambda x: x["round"]), sorted(rows["stock"], key=lambda x: x["round"]))]
        summary[case] = {
            "ratio_per_round": [round(x, 3) for x in ratios],
            "ratio_median": round(statistics.median(ratios), 3),
            "ratio_of_fastest_iterations_per_round": [round(x, 3) for x in best],
            **{f"{e}_tokens_per_s_median": round(statistics.median(x["tokens_per_s"] for x in rows[e]), 1)
               for e in ENGINES},
            **{f"{e}_final_validation_loss": [x["final_validation_loss"] for x in rows[e]] for e in ENGINES},
            **{f"{e}_peak_rss_mib_median": round(statistics.median(x["peak_rss_mib"] for x in rows[e]), 1)
               for e in ENGINES},
            **{f"{e}_median_grad_norm": [x.get("median_grad_norm") for x in rows[e]] for e in ENGINES},
        }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
