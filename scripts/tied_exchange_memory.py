"""Resident memory of a long async run without a drain, with and without a tied weight (issue 16, item 3).

    .venv/bin/python scripts/tied_exchange_memory.py --calls 1500 [--dim 256] [--out docs/results/tied_memory.json]

2 stages over gloo, DeepSpeed's AdamW (``torch_adam``), a pipeline of ``dim x dim`` tanh layers whose first and
last layer's weight is one ``TiedLayerSpec`` (``--untied``: the same layers untied), ``gradient_accumulation_steps``
= ``a`` = 2 (one local step per call), ``--calls`` calls of ``train_batch`` and no drain until the end. Each rank
records its resident set (``VmRSS``) after every call; the summary gives it after 10% of the calls and at the end,
and the tied exchange's ``max_pending_sends``. Both variants run in one invocation, tied first. To measure another checkout's engine, run it with
``PYTHONPATH=<that checkout>`` (it comes before the editable install).
"""

import argparse
import json
import os
import time
from pathlib import Path

import torch

def _rss_mib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


class Tanh(torch.nn.Module):

    def __init__(self, dim, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.linear = torch.nn.Linear(dim, dim)

    @property
    def weight(self):
        return self.linear.weight

    def forward(self, x):
        return torch.tanh(self.linear(x))


def rank_body(rank, dim, calls, tied):
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    import ds_paci
    layers = [LayerSpec(Tanh, dim, i) for i in range(4)]
    if tied:
        layers[0] = TiedLayerSpec("w", Tanh, dim, 0)
        layers[-1] = TiedLayerSpec("w", Tanh, dim, 0)
    model = PipelineModule(layers=layers, num_stages=2, loss_fn=lambda out, y: ((out - y)**2).mean(),
                           partition_method="uniform")
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 10**9,
           "gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
           "paci": {"enabled": True}}
    engine, *_ = ds_paci.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    g = torch.Generator().manual_seed(1)

    def batches():
        while True:
            x = torch.randn(4, dim, generator=g)
            yield x, torch.tanh(x.flip(1))

    data = batches()
    rss = []
    started = time.perf_counter()
    for _ in range(calls):
        engine.train_batch(data)
        rss.append(_rss_mib())
    seconds = time.perf_counter() - started
    tied_stats = engine.paci_stats().get("tied") or {}
    engine.drain()
    return {"rss_mib": rss, "seconds": seconds, "max_pending_sends": tied_stats.get("max_pending_sends")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=1500)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--out", help="write the summary (JSON) here")
    a = ap.parse_args()
    from ds_paci.tools.processes.world import run_world
    summary = {"calls": a.calls, "dim": a.dim, "load_avg_1min_start": os.getloadavg()[0]}
    for tied in (True, False):
        results = run_world(rank_body, 2, a.dim, a.calls, tied, timeout=3600)
        tenth = max(1, a.calls // 10) - 1
        summary["tied" if tied else "untied"] = [{
            "rank": rank, "rss_mib_at_10pct": round(r["rss_mib"][tenth], 1), "rss_mib_end": round(r["rss_mib"][-1], 1),
            "growth_pct": round(100.0 * (r["rss_mib"][-1] / r["rss_mib"][tenth] - 1.0), 2),
            "rss_mib_first_call": round(r["rss_mib"][0], 1), "seconds": round(r["seconds"], 1),
            "max_pending_sends": r["max_pending_sends"]} for rank, r in enumerate(results)]
    summary["load_avg_1min_end"] = os.getloadavg()[0]
    text = json.dumps(summary, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
