"""``python -m ds_paci.tools.replay``: one replay of a job of :data:`~ds_paci.tools.replay.replayer.JOBS` from the
command line; prints the curve, local steps and look-ahead stats as one JSON line."""

import argparse
import json
import sys

import torch

from ds_paci.core.program.stream import STEP_PHASES
from ds_paci.workload.gpt2 import gpt2_config, gpt2_reference_model

from .replayer import JOBS, MODES, load_tokens, replay


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ds_paci.tools.replay", description=__doc__.split("\n\n")[0])
    p.add_argument("--job", choices=sorted(JOBS), default="main")
    p.add_argument("--mode", choices=MODES, default="lookahead")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--betas", default=None, help="b1,b2 (default: 0.9,0.95 for main, 0.9,0.999 for the benchmark jobs)")
    p.add_argument("--weight-decay", type=float, default=None, help="default: 0.01 for main, 0 for the benchmark jobs")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--window", help="accumulation window a: an int, 'auto', or one int per stage (a,b,...); default M")
    p.add_argument("--eval-every", type=int, default=None, help="default: 100 for main, 25 for the benchmark jobs")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--data-seed", type=int, help="default: the seed for main, 7 for the benchmark jobs")
    p.add_argument("--restore", choices=["recompute", "copy"], default=None, help="default: the engine's")
    p.add_argument("--step-phase", choices=STEP_PHASES, default="aligned", help="the engine's paci.step_phase")
    args = p.parse_args(argv)
    from ds_paci.workload.data import MicroBatchIterator, eval_micro_batches
    job = JOBS[args.job]
    torch.set_num_threads(1)
    train, val, tokenizer = load_tokens(job.tokenizer, job.main_split)
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
    window = args.window
    if window is not None and window != "auto":
        window = [int(x) for x in window.split(",")] if "," in window else int(window)
    result = replay(model, job.stages, job.micro_batches, train_iter, val_batches, args.steps, mode=args.mode,
                    window=window, lr=args.lr, betas=betas, weight_decay=wd, schedule=job.schedule,
                    warmup=args.warmup, eval_every=args.eval_every or (100 if main_job else 25),
                    restore=args.restore, echo=lambda line: print(line, file=sys.stderr, flush=True),
                    step_phase=args.step_phase)
    print(json.dumps({"args": vars(args), "curve": result.curve, "final_val_loss": result.curve[-1][1],
                      "local_steps": result.local_steps, "lookahead": result.lookahead}))
    return 0

