"""Measure how many calls old the loss is on non-last stages (the side channel's staleness).

    .venv/bin/python tests/scripts/loss_age.py --stages 4 --gas 4 2 1 --calls 40

Runs the tests' tanh MLP (2 layers per stage) in async PACI on ``--stages`` processes over gloo, ``--calls``
train_batch calls per accumulation setting, and prints per stage the histogram {age: calls} of
``paci_stats()["loss_age"]`` (calls since the last stage computed the value returned) next to the bound
``ceil((P-s)/(2M))`` that the pipeline's data dependencies give once a message is delivered.
"""

import argparse
import math
import os
import sys
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))


def worker(rank, stages, gas_values, calls):
    import contract_workers
    from mlp import regression_batches
    out = {}
    for gas in gas_values:
        engine = contract_workers._mlp_engine(stages, gas, {"enabled": True})
        data = regression_batches(2)
        ages = []
        for _ in range(calls):
            engine.train_batch(data).item()
            ages.append(engine.paci_stats()["loss_age"])
        out[gas] = ages
        engine.destroy()
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--gas", type=int, nargs="+", default=[4, 2, 1])
    p.add_argument("--calls", type=int, default=40)
    args = p.parse_args()
    sys.path.insert(0, os.path.dirname(HERE))  # the tests folder (this is a test-side measurement script)
    from harness import run_world
    results = run_world(worker, args.stages, args.stages, args.gas, args.calls, timeout=1200)
    for gas in args.gas:
        print(f"P={args.stages} M=a={gas}, {args.calls} calls:")
        for s, r in enumerate(results[:-1]):
            hist = Counter(a for a in r[gas] if a is not None)
            bound = math.ceil((args.stages - s) / (2 * gas))
            print(f"  stage {s}: loss age histogram {dict(sorted(hist.items()))}, NaN (no value yet) in "
                  f"{sum(a is None for a in r[gas])} call(s); bound {bound}")


if __name__ == "__main__":
    main()
