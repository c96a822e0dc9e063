"""The main job's command line: its flags, its exit codes, and the range of every numeric flag.

Pure (argparse only): nothing here needs torch, a config or a process group.
"""

import argparse
import math

EXIT_USAGE = 2
EXIT_NONFINITE = 3  # the non-finite guard stopped the run (see ds_paci.core.step.guard)

DESCRIPTION = "The main job: GPT-2 pipeline training on a real text corpus, with PACI or DeepSpeed's stock engine."


class UsageError(Exception):
    """A bad input: the message is one line naming the problem and the fix."""


def parse_args(argv=None):
    """The job's flags (``argv=None``: ``sys.argv[1:]``); ``--local_rank`` is the launcher's, hidden."""
    p = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--deepspeed_config", required=True, help="DeepSpeed JSON config (configs/paci.json, configs/flush.json)")
    p.add_argument("--steps", type=int, default=300, help="train_batch calls (optimizer steps) to run")
    p.add_argument("--model", default="tiny", help="GPT-2 size: tiny, mini, small, medium")
    p.add_argument("--n-layer", type=int, help="override the number of transformer blocks")
    p.add_argument("--n-embd", type=int, help="override the hidden size")
    p.add_argument("--n-head", type=int, help="override the number of attention heads")
    p.add_argument("--n-positions", type=int, default=1024, help="model context length (positions)")
    p.add_argument("--tie-embeddings", action="store_true",
                   help="tie the LM head to the token embedding, as GPT-2 does (default: untied, as in the PACI paper);\n"
                        "on several stages PACI keeps the two copies identical by exchanging their gradients")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per training sequence")
    p.add_argument("--data", help="text file or folder of .txt files (default: the Shakespeare corpus)")
    p.add_argument("--tokenizer", default="bpe-1024", help="byte, gpt2, or bpe-<vocab> (trained locally, cached)")
    p.add_argument("--stages", type=int, help="pipeline stages (default: every launched process is one stage)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--eval-interval", type=int, default=100, help="validate every N steps (0: only at start and end)")
    p.add_argument("--eval-batches", type=int, default=4, help="validation batches of gradient_accumulation_steps micro-batches")
    p.add_argument("--log-interval", type=int, default=10, help="progress line every N steps")
    p.add_argument("--checkpoint-dir", help="save checkpoints here (at --save-interval and at the end)")
    p.add_argument("--save-interval", type=int, default=0, help="save every N steps (0: only at the end)")
    p.add_argument("--resume", action="store_true", help="resume from the latest checkpoint in --checkpoint-dir")
    p.add_argument("--metrics", help="JSON-lines metrics file (default: runs/<config name>/metrics.jsonl)")
    p.add_argument("--device-time", type=float, default=0.0,
                   help="emulated accelerator: seconds each block waits in forward (2x in backward)")
    p.add_argument("--threads", type=int, help="torch threads per process (default: cores / local processes)")
    p.add_argument("--stop-timeout", type=float, default=8.0,
                   help="on SIGINT/SIGTERM: seconds a rank may take to stop (agree on a step, drain, save) before it "
                        "exits anyway")
    p.add_argument("--verbose", action="store_true", help="keep DeepSpeed's INFO logs")
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _need(ok, flag, value, allowed):
    if not ok:
        raise UsageError(f"{flag} {value} is not allowed; use {allowed}")


def check_flags(args):
    """Every numeric flag in range; each message names the flag and what is allowed (:class:`UsageError`)."""
    _need(args.steps >= 1, "--steps", args.steps, "an integer >= 1 (train_batch calls to run)")
    _need(args.log_interval >= 1, "--log-interval", args.log_interval, "an integer >= 1 (a progress line every N steps)")
    _need(args.eval_interval >= 0, "--eval-interval", args.eval_interval,
          "an integer >= 0 (validate every N steps; 0: only at start and end)")
    _need(args.eval_batches >= 1, "--eval-batches", args.eval_batches,
          "an integer >= 1 (validation batches of gradient_accumulation_steps micro-batches)")
    _need(args.save_interval >= 0, "--save-interval", args.save_interval,
          "an integer >= 0 (save every N steps; 0: only at the end)")
    if args.threads is not None:
        _need(args.threads >= 1, "--threads", args.threads, "an integer >= 1 (torch threads per process), or omit it")
    _need(math.isfinite(args.device_time) and args.device_time >= 0, "--device-time", args.device_time,
          "a finite number of seconds >= 0 (0: no emulated device time)")
    _need(math.isfinite(args.stop_timeout) and args.stop_timeout > 0, "--stop-timeout", args.stop_timeout,
          "a finite number of seconds > 0")
    _need(args.n_positions >= 1, "--n-positions", args.n_positions, "an integer >= 1")
    _need(args.seq_len >= 1, "--seq-len", args.seq_len, f"an integer from 1 to --n-positions ({args.n_positions})")
    if args.seq_len > args.n_positions:
        raise UsageError(f"--seq-len {args.seq_len} exceeds the model's {args.n_positions} positions; lower --seq-len "
                         f"or raise --n-positions")
    for flag, value in (("--n-layer", args.n_layer), ("--n-embd", args.n_embd), ("--n-head", args.n_head)):
        if value is not None:
            _need(value >= 1, flag, value, "an integer >= 1, or omit it for the --model default")
    if args.stages is not None:
        _need(args.stages >= 1, "--stages", args.stages, "an integer >= 1, or omit it (one stage per process)")
    if args.save_interval and not args.checkpoint_dir:
        raise UsageError(f"--save-interval {args.save_interval} needs --checkpoint-dir <folder to save into>")
