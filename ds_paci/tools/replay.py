"""Single-process replay of PACI streams on the GPT-2 workload: a fast tool for exploring, not evidence.

``python -m ds_paci.tools.replay --job main --mode lookahead --lr 1.5e-3`` runs every stage's
:class:`~ds_paci.core.schedule.PACIStream` tick by tick in one process, with the engine's
semantics: a forward uses the stage's weights current at that moment (with ``--mode
lookahead``, the look-ahead's prediction for forwards the stream tags ``crosses_step``, through
the engine's own :class:`~ds_paci.core.lookahead.LookAhead`); a backward runs through the weights
current at backward time (optimizers step on ``.data`` aliases); each stage takes its own AdamW
step after every ``a`` backward passes and steps its LR scheduler ``LocalStep.lr_steps`` times (one
per ``M`` micro-batches stepped); the last stage scales its loss by ``1/a``; streams are drained
before each validation, leaving a partial window open, as the main job does, and closed at the end.
``--mode sync`` drains after every batch (the stock engine's math).

It reproduces the engine's validation losses on the default job (lr 3e-3: sync 4.8010 and PACI
4.9640, as ``make train-flush`` and ``make train`` without look-ahead; lr 1.5e-3 with look-ahead:
4.2755, as ``make train``) in one process instead of one per stage, without DeepSpeed. Use it to
explore hyper-parameters; report numbers from the engine (``launch/train.py``, the benchmark).

Jobs: ``main`` (the default job: 4 blocks x 128, bpe-1024, micro-batch 8 x 128, M = 4, 2 stages,
warm-up + cosine) and the benchmark's shapes ``real_P2_M4``, ``emulated_P4_M4``,
``emulated_P8_M8`` (byte tokens, constant LR, no emulated wait). Prints one JSON line: the
arguments, the validation curve and each stage's look-ahead telemetry.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass

import torch
from deepspeed.runtime.pipe import schedule as ds

from ds_paci.core.local_step import ParamAliases
from ds_paci.core.lookahead import lookahead_for_torch_optimizer
from ds_paci.core.schedule import LocalStep, PACIStream
from ds_paci.workload.gpt2 import Block, gpt2_config, gpt2_reference_model, lm_loss


@dataclass(frozen=True)
class Job:
    """Model, data and pipeline shape of a replay."""

    stages: int
    micro_batches: int
    micro_batch_size: int
    seq_len: int
    n_layer: int
    n_embd: int
    n_head: int
    tokenizer: str
    eval_batches: int
    schedule: str  # "warmup_cosine" (the main job's) or "constant" (the benchmark's)
    main_split: bool  # the main job's document split (launch/train.py) or the benchmark's


JOBS = {
    "main": Job(2, 4, 8, 128, 4, 128, 4, "bpe-1024", 4, "warmup_cosine", True),
    "real_P2_M4": Job(2, 4, 8, 128, 4, 128, 4, "byte", 4, "constant", False),
    "emulated_P4_M4": Job(4, 4, 4, 64, 4, 64, 4, "byte", 4, "constant", False),
    "emulated_P8_M8": Job(8, 8, 4, 64, 8, 64, 4, "byte", 2, "constant", False),
}


def stage_slices(model: torch.nn.Sequential, stages: int) -> list:
    """``[(start, stop), ...]`` of each stage's layers, split by transformer blocks as ``gpt2_pipeline`` does."""
    blocks = [i for i, m in enumerate(model) if isinstance(m, Block)]
    if len(blocks) % stages:
        raise ValueError(f"{len(blocks)} blocks do not split evenly over {stages} stages")
    per = len(blocks) // stages
    starts = [0] + [blocks[s * per] for s in range(1, stages)] + [len(model)]
    return [(starts[s], starts[s + 1]) for s in range(stages)]


def replay(model, stages, micro_batches, train_iter, val_batches, steps, mode="lookahead", window=None, lr=1e-3,
           betas=(0.9, 0.95), weight_decay=0.0, schedule="constant", warmup=20, cos_min_ratio=0.1, eval_every=100,
           restore="recompute", echo=None):
    """Train ``model`` (an ``nn.Sequential`` of GPT-2 layers) with PACI streams; returns ``(curve, lookahead stats)``.

    ``curve``: ``[(step, validation loss), ...]`` at step 0, every ``eval_every`` steps and at
    the end (mean of :func:`lm_loss` over ``val_batches``). ``mode``: ``sync``, ``paci`` or
    ``lookahead``. ``window``: ``a`` (default ``micro_batches``).
    """
    window = window or micro_batches
    parts = [torch.nn.Sequential(*list(model)[lo:hi]) for lo, hi in stage_slices(model, stages)]
    optimizers, aliases, lookaheads, schedulers = [], [], [], []
    for part in parts:
        opt = torch.optim.AdamW(part.parameters(), lr=lr, betas=betas, eps=1e-8, weight_decay=weight_decay)
        alias = ParamAliases(opt)
        optimizers.append(opt)
        aliases.append(alias)
        lookaheads.append(lookahead_for_torch_optimizer(opt, alias, restore))
        if schedule == "warmup_cosine":
            from deepspeed.runtime.lr_schedules import WarmupCosineLR
            warm = warmup if warmup < steps else max(1, steps // 10)  # as launch/train.py does
            schedulers.append(WarmupCosineLR(opt, total_num_steps=steps, warmup_num_steps=warm,
                                             cos_min_ratio=cos_min_ratio))
        else:
            schedulers.append(None)
    streams = [PACIStream(stages, s, window, micro_batches) for s in range(stages)]
    batches, outputs, inputs, grads = {}, {}, {}, {}

    def forward(s, m):
        x = batches[m][0] if s == 0 else outputs[(s - 1, m)].detach().requires_grad_(True)
        if s > 0:
            inputs[(s, m)] = x
        out = parts[s](x)
        return lm_loss(out, batches[m][1]) / window if s == stages - 1 else out

    def execute(ticks):
        for t in range(max(len(x) for x in ticks)):
            for s in range(stages):
                for cmd in ticks[s][t] if t < len(ticks[s]) else []:
                    m = getattr(cmd, "micro_batch_id", None)
                    if isinstance(cmd, ds.LoadMicroBatch) and s == 0:
                        batches[m] = next(train_iter)
                    elif isinstance(cmd, ds.ForwardPass):
                        if mode == "lookahead" and cmd.crosses_step and lookaheads[s] is not None:
                            with lookaheads[s].applied(cmd.window_fill, window):
                                outputs[(s, m)] = forward(s, m)
                        else:
                            outputs[(s, m)] = forward(s, m)
                    elif isinstance(cmd, ds.BackwardPass):
                        out = outputs.pop((s, m))
                        out.backward() if s == stages - 1 else out.backward(grads.pop((s + 1, m)))
                        if s > 0:
                            grads[(s, m)] = inputs.pop((s, m)).grad
                        if s == stages - 1:
                            batches.pop(m)
                    elif isinstance(cmd, LocalStep):
                        if lookaheads[s] is not None:
                            lookaheads[s].before_step()
                        aliases[s].bind_grads()
                        optimizers[s].step()
                        aliases[s].release_grads()
                        for p in parts[s].parameters():
                            p.grad = None
                        if schedulers[s] is not None:  # the engine's rule: one step per M micro-batches stepped
                            for _ in range(cmd.lr_steps):
                                schedulers[s].step()
                        if lookaheads[s] is not None:
                            lookaheads[s].after_step()

    def evaluate():
        with torch.no_grad():
            return sum(float(lm_loss(model(x), y)) for x, y in val_batches) / len(val_batches)

    curve = [(0, evaluate())]
    began = time.time()
    for step in range(1, steps + 1):
        execute([st.advance(2 * micro_batches) for st in streams])
        if mode == "sync" or step % eval_every == 0 or step == steps:
            # as the engine: evaluation leaves a partial window open; sync mode (a = M) and the end close it
            close = mode == "sync" or step == steps
            execute([st.drain(close_window=close) for st in streams])
        if step % eval_every == 0 or step == steps:
            curve.append((step, evaluate()))
            if echo:
                echo(f"step {step}: validation loss {curve[-1][1]:.4f} ({time.time() - began:.0f} s)")
    return curve, [la.stats() if la is not None else None for la in lookaheads]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ds_paci.tools.replay", description=__doc__.split("\n\n")[0])
    p.add_argument("--job", choices=sorted(JOBS), default="main")
    p.add_argument("--mode", choices=["sync", "paci", "lookahead"], default="lookahead")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--betas", default=None, help="b1,b2 (default: 0.9,0.95 for main, 0.9,0.999 for the benchmark jobs)")
    p.add_argument("--weight-decay", type=float, default=None, help="default: 0.01 for main, 0 for the benchmark jobs")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--window", type=int, help="accumulation window a (default M)")
    p.add_argument("--eval-every", type=int, default=None, help="default: 100 for main, 25 for the benchmark jobs")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--data-seed", type=int, help="default: the seed for main, 7 for the benchmark jobs")
    p.add_argument("--restore", choices=["recompute", "copy"], default="recompute")
    args = p.parse_args(argv)
    from ds_paci.workload.data import (MicroBatchIterator, encode_documents, eval_micro_batches, get_tokenizer,
                                       load_corpus, split_documents)
    job = JOBS[args.job]
    torch.set_num_threads(1)
    docs = load_corpus()
    train_docs, val_docs = split_documents(docs) if job.main_split else split_documents(docs, val_fraction=0.1,
                                                                                         seed=0)
    tokenizer = get_tokenizer(job.tokenizer, train_docs=train_docs)
    train = encode_documents(train_docs, tokenizer).long()
    val = encode_documents(val_docs, tokenizer).long()
    main_job = args.job == "main"
    cfg = gpt2_config("tiny", vocab_size=tokenizer.vocab_size, n_positions=1024 if main_job else job.seq_len,
                      n_embd=job.n_embd, n_layer=job.n_layer, n_head=job.n_head,
                      **({"eos_token_id": tokenizer.eos_id} if main_job else {}))
    model = gpt2_reference_model(cfg, seed=args.seed)
    data_seed = args.data_seed if args.data_seed is not None else (args.seed if main_job else 7)
    train_iter = MicroBatchIterator(train, job.micro_batch_size, job.seq_len, seed=data_seed)
    val_batches = eval_micro_batches(val, job.micro_batch_size, job.seq_len, count=job.eval_batches * job.micro_batches)
    betas = tuple(float(x) for x in args.betas.split(",")) if args.betas else ((0.9, 0.95) if main_job else (0.9, 0.999))
    wd = args.weight_decay if args.weight_decay is not None else (0.01 if main_job else 0.0)
    curve, stats = replay(model, job.stages, job.micro_batches, train_iter, val_batches, args.steps, mode=args.mode,
                          window=args.window, lr=args.lr, betas=betas, weight_decay=wd, schedule=job.schedule,
                          warmup=args.warmup, eval_every=args.eval_every or (100 if main_job else 25),
                          restore=args.restore, echo=lambda line: print(line, file=sys.stderr, flush=True))
    print(json.dumps({"args": vars(args), "curve": curve, "final_val_loss": curve[-1][1], "lookahead": stats}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
