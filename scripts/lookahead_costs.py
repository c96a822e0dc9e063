"""What the look-ahead's prediction costs and how far it is off, per optimizer, on one GPT-2 stage (one process).

    .venv/bin/python scripts/lookahead_costs.py [--out docs/results/lookahead/optimizers.json] [--smoke]

For each optimizer (AdamW; SGD with Nesterov momentum; torch.optim.Muon on the blocks' matrices with AdamW on
the rest, as the replay builds it; DeepSpeed's MuonWithAuxAdam with its inline Adam) the script trains a GPT-2
model (default 4 blocks x 256, byte tokens, micro-batch 8 x 128, window a = 4) on the Shakespeare corpus for
``--warmup`` steps, then for ``--steps`` steps, each with the complete window (n = a):

* **prediction error**: ``||predicted - next|| / ||next - current||`` over all weights (0: exact, 1: the old
  weights), without clipping, and with gradient clipping active (``--clip``, below the gradient's norm) both
  predicted (the look-ahead now) and ignored (what it did before);
* **cost** per crossing forward: predict + write + restore (``LookAhead.applied`` with an empty body; restore by
  copy and by recompute), next to one training forward of a micro-batch and the optimizer step, medians of
  ``--repeat`` timings, alternated;
* **memory**: the copy restore holds one fp32 copy of the weights it predicts while the forward runs.

Timings on a loaded machine: medians and ratios to the forward, with the load average printed. DeepSpeed's Muon
compiles its ``muon_update`` with torch.compile on first use (``--no-compile`` runs it eagerly).
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from ds_paci.core.step.local_step import ParamAliases, clip_by_norm, stage_grad_norm  # noqa: E402
from ds_paci.core.lookahead.predict import lookahead_for_torch_optimizer  # noqa: E402
from ds_paci.workload.data import ByteTokenizer, MicroBatchIterator, encode_documents, load_corpus  # noqa: E402
from ds_paci.workload.gpt2 import Block, gpt2_config, gpt2_reference_model, lm_loss  # noqa: E402

OPTIMIZERS = ("adamw", "sgd_nesterov", "muon_adamw", "deepspeed_muon")


def _optimizers(kind, model, lr):
    params = list(model.parameters())
    matrices = [p for m in model if isinstance(m, Block) for p in m.parameters() if p.ndim == 2]
    rest = [p for p in params if all(p is not q for q in matrices)]
    if kind == "adamw":
        return [torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.01)]
    if kind == "sgd_nesterov":
        return [torch.optim.SGD(params, lr=lr * 30, momentum=0.9, nesterov=True, weight_decay=0.01)]
    if kind == "muon_adamw":
        return [torch.optim.Muon(matrices, lr=lr, weight_decay=0.01, adjust_lr_fn="match_rms_adamw"),
                torch.optim.AdamW(rest, lr=lr, betas=(0.9, 0.95), weight_decay=0.01)]
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
    return [MuonWithAuxAdam([dict(params=matrices, use_muon=True, lr=lr * 10, momentum=0.95, weight_decay=0.01),
                             dict(params=rest, use_muon=False, lr=lr, betas=(0.9, 0.95), eps=1e-8,
                                  weight_decay=0.01)])]


def _median_seconds(fn, repeat):
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


_TOKENS = []


def _tokens():
    if not _TOKENS:
        _TOKENS.append(encode_documents(load_corpus()[:20], ByteTokenizer()))
    return _TOKENS[0]


class Stage:
    """One model, its optimizers, aliases and look-aheads (told ``predicted_clip``), and its data."""

    def __init__(self, args, kind, predicted_clip):
        cfg = gpt2_config("tiny", vocab_size=257, n_positions=args.seq, n_embd=args.embd, n_layer=args.layers,
                          n_head=args.heads)
        self.model = gpt2_reference_model(cfg, seed=1)
        self.optimizers = _optimizers(kind, self.model, args.lr)
        self.aliases = [ParamAliases(o) for o in self.optimizers]
        params = list(self.model.parameters())
        self.lookaheads = [lookahead_for_torch_optimizer(o, a, "copy", predicted_clip, clip_params=params)
                           for o, a in zip(self.optimizers, self.aliases)]
        assert all(la is not None for la in self.lookaheads), kind
        self.data = MicroBatchIterator(_tokens(), args.micro, args.seq, seed=3)
        self.window = args.window

    def accumulate(self):
        for p in self.model.parameters():
            p.grad = None
        for _ in range(self.window):
            x, y = next(self.data)
            (lm_loss(self.model(x), y) / self.window).backward()

    def step(self, clip):
        norm = float(stage_grad_norm(self.model.parameters()))
        if clip > 0:
            clip_by_norm(self.model.parameters(), clip, norm)
        for opt, alias in zip(self.optimizers, self.aliases):
            alias.bind_grads()
            opt.step()
            alias.release_grads()
        return norm

    def weights(self):
        return [p.detach().clone() for p in self.model.parameters()]

    def predicted(self):
        """The predicted next weights (each optimizer predicts its own parameters), in model order."""
        by_id = {}
        for la in self.lookaheads:
            for master, pred in zip(la.masters(), la.predict_next(self.window, self.window)):
                by_id[master.data_ptr()] = pred
        return [by_id.get(p.data_ptr(), p.detach().clone()) for p in self.model.parameters()]


def relative_error(predicted, before, after):
    miss = sum(float((p - a).pow(2).sum()) for p, a in zip(predicted, after))
    move = sum(float((a - b).pow(2).sum()) for a, b in zip(after, before))
    return (miss / move)**0.5


def errors(args, kind):
    """Prediction errors (median and max over the measured steps) without clipping, and with it (predicted, ignored)."""
    out = {}
    for label, clip, told in (("no clipping", 0.0, 0.0), ("clipping, predicted", args.clip, args.clip),
                              ("clipping, ignored", args.clip, 0.0)):
        stage = Stage(args, kind, told)
        errs, coefs = [], []
        for k in range(args.warmup + args.steps):
            stage.accumulate()
            predicted = stage.predicted() if k >= args.warmup else None
            before = stage.weights()
            norm = stage.step(clip)
            if predicted is not None:
                errs.append(relative_error(predicted, before, stage.weights()))
                coefs.append(min(1.0, clip / (norm + 1e-6)) if clip else 1.0)
        out[label] = {"median": statistics.median(errs), "max": max(errs), "clip_coef_max": max(coefs)}
    return out


def costs(args, kind):
    """Seconds per crossing forward (predict + write + restore, copy and recompute), forward, step; copy bytes."""
    stage = Stage(args, kind, 0.0)
    for _ in range(args.warmup):
        stage.accumulate()
        stage.step(0.0)
    stage.accumulate()
    x, y = next(stage.data)

    def crossing(restore):
        for la in stage.lookaheads:
            la.restore = restore
        for la in stage.lookaheads:
            with la.applied(stage.window, stage.window):
                pass

    def forward():
        lm_loss(stage.model(x), y)

    timings = {"copy": [], "recompute": [], "forward": []}
    for _ in range(args.repeat):  # alternated, so that load changes hit all three alike
        timings["copy"].append(_median_seconds(lambda: crossing("copy"), 1))
        timings["recompute"].append(_median_seconds(lambda: crossing("recompute"), 1))
        timings["forward"].append(_median_seconds(forward, 1))
    grads = [p.grad.clone() for p in stage.model.parameters()]

    def step():
        for p, g in zip(stage.model.parameters(), grads):
            p.grad = g.clone()
        stage.step(0.0)

    step_s = _median_seconds(step, max(1, args.repeat // 2))
    out = {k: statistics.median(v) for k, v in timings.items()}
    out["step"] = step_s
    out["copy_bytes"] = sum(4 * m.numel() for la in stage.lookaheads for m in la.masters())
    out["parameters"] = sum(p.numel() for p in stage.model.parameters())
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--optimizers", nargs="+", choices=OPTIMIZERS, default=list(OPTIMIZERS))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--embd", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--window", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip", type=float, default=0.25, help="below the gradient norm, so clipping is active")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--repeat", type=int, default=9)
    p.add_argument("--no-compile", action="store_true", help="run DeepSpeed's muon_update eagerly")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, for the test suite")
    args = p.parse_args(argv)
    if args.smoke:
        args.layers, args.embd, args.heads, args.seq, args.micro = 1, 16, 2, 8, 2
        args.warmup, args.steps, args.repeat, args.no_compile = 1, 1, 1, True
    torch.set_num_threads(1)
    results = {"args": vars(args), "load_average": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
               "optimizers": {}}
    for kind in args.optimizers:
        with torch._dynamo.config.patch(disable=args.no_compile):
            row = {"errors": errors(args, kind), "costs": costs(args, kind)}
        results["optimizers"][kind] = row
        c, e = row["costs"], row["errors"]
        print(f"{kind}: error {e['no clipping']['median']:.2e} (clipped: predicted {e['clipping, predicted']['median']:.2e}"
              f", ignored {e['clipping, ignored']['median']:.2f}); crossing {c['copy'] * 1e3:.2f} ms copy, "
              f"{c['recompute'] * 1e3:.2f} ms recompute; forward {c['forward'] * 1e3:.2f} ms; step "
              f"{c['step'] * 1e3:.2f} ms; copy {c['copy_bytes'] / 2**20:.1f} MiB", flush=True)
    results["load_average_end"] = os.getloadavg()
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
