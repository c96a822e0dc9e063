"""Throughput of an unmodified DeepSpeed script through the runner: stock vs PACI, back to back, alternating.

    .venv/bin/python tests/scripts/runner_throughput.py --rounds 3 --steps 30

Each round launches ``deepspeed --num_gpus 2 --module ds_paci.run tests/scripts/ds_pipeline_script.py`` once
with a stock config and once with the same config plus ``"paci": {"enabled": true}`` (the order alternates
between rounds), and reads the last stage's seconds per ``train_batch`` after ``--warmup`` calls. Prints the
samples/s of every run, the medians and their ratio. The model: ``--layers`` tanh layers of ``--dim`` units,
micro-batches of ``--micro`` samples, ``--gas`` micro-batches per call (real compute, one thread per rank).
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def launch(config, args, out):
    cmd = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", "2", "--master_port",
           str(random.randint(20000, 40000)), "--module", "ds_paci.run", "tests/scripts/ds_pipeline_script.py",
           "--deepspeed_config", config, "--out", out, "--steps", str(args.steps), "--dim", str(args.dim),
           "--layers", str(args.layers)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if run.returncode:
        raise SystemExit((run.stdout + run.stderr)[-3000:])
    last = json.load(open(os.path.join(out, "rank1.json")))["runs"][0]
    seconds = sum(last["seconds"][args.warmup:])
    return last["engine"], last["samples_per_call"] * (args.steps - args.warmup) / seconds


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--micro", type=int, default=32)
    p.add_argument("--gas", type=int, default=4)
    p.add_argument("--no-lookahead", action="store_true", help='PACI with "lookahead": false (default: on, as PACI\'s default)')
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="ds_paci_runner_bench_")
    base = {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": args.gas,
            "steps_per_print": 10**6, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    paci = {"enabled": True, "lookahead": False} if args.no_lookahead else {"enabled": True}
    configs = {"stock": dict(base), "paci": dict(base, paci=paci)}
    for name, cfg in configs.items():
        with open(os.path.join(tmp, f"{name}.json"), "w") as f:
            json.dump(cfg, f)
    rates = {"stock": [], "paci": []}
    for r in range(args.rounds):
        order = ["stock", "paci"] if r % 2 == 0 else ["paci", "stock"]
        for name in order:
            engine, rate = launch(os.path.join(tmp, f"{name}.json"), args, os.path.join(tmp, f"out_{r}_{name}"))
            assert engine == {"stock": "PipelineEngine", "paci": "PACIPipelineEngine"}[name], engine
            rates[name].append(rate)
            print(f"round {r + 1} {name:5s} ({engine}): {rate:,.1f} samples/s", flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    ideal = (args.gas + 1) / args.gas
    print(f"median samples/s: stock {med['stock']:,.1f}, PACI {med['paci']:,.1f}; PACI/stock {med['paci'] / med['stock']:.3f} "
          f"(ideal (M+P-1)/M = {ideal:.3f}); per-round ratios "
          + ", ".join(f"{p / s:.3f}" for s, p in zip(rates['stock'], rates['paci'])))


if __name__ == "__main__":
    main()
