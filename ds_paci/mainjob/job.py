"""``main``: one rank of the main job, from its command line to its exit code.

Every input is checked before any process group starts (:mod:`.inputs`), so a bad argument ends every
rank at once with one line that names the problem and the fix (exit code 2); across nodes the verdicts
are agreed first (:func:`~.inputs.agree_start`). Then the engine is built (``ds_paci.initialize``: the
PACI engine when the config has ``"paci": {"enabled": true}``, DeepSpeed's own otherwise) and
:class:`~.loop.TrainingLoop` runs. The last pipeline stage (which computes the loss) prints progress,
periodic validation loss and a final summary, and writes metrics as JSON lines.
"""

import argparse
import os
import sys
from dataclasses import dataclass

from .inputs import agree_start, build_model_config, check_inputs, leave_the_line_to_rank0
from .loop import TrainingLoop
from .metrics import JobShape, Reporter
from .options import EXIT_USAGE, UsageError, parse_args


@dataclass
class Prepared:
    """What a rank builds from valid inputs before its process group starts."""
    ds_config: dict
    stages: int
    resume_plan: object  # (tag, note) for --resume, or None
    model_cfg: object
    train_tokens: object
    val_tokens: object
    val_batches: list
    micro: int
    gas: int


def _refuse(rank, error):
    if rank == 0:
        print(f"error: {error}", file=sys.stderr, flush=True)
    leave_the_line_to_rank0(rank)
    return EXIT_USAGE


def _install_stops(args):
    """During start-up a signal ends this rank at once; from the first step on it stops every rank at an agreed
    step, drains, saves (with --checkpoint-dir) and exits 128+signal (see ds_paci.core.health.lifecycle)."""
    from ds_paci.core.health import lifecycle
    stopper = lifecycle.StopController(timeout=args.stop_timeout, graceful=False).install()
    lifecycle.watch_launchers()
    return stopper


def _set_up_torch(args, world_size):
    import logging

    import torch
    local_size = int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // max(1, local_size)))
    import deepspeed
    if not args.verbose:
        deepspeed.utils.logger.setLevel(logging.WARNING)


def prepare(args, ds_config, docs, stages, resume_plan):
    """Tokenizer, model config, token streams and validation batches (``UsageError``/``DataError``/``ValueError``
    on an input that only shows here: a corpus too short, a model the flags cannot build)."""
    from ds_paci.workload.data import (MicroBatchIterator, encode_documents, eval_micro_batches, get_tokenizer,
                                       split_documents)
    train_docs, val_docs = split_documents(docs)
    tokenizer = get_tokenizer(args.tokenizer, train_docs=train_docs)
    model_cfg = build_model_config(args, tokenizer.vocab_size, tokenizer.eos_id, stages)
    train_tokens = encode_documents(train_docs, tokenizer)
    val_tokens = encode_documents(val_docs, tokenizer)
    micro, gas = ds_config["train_micro_batch_size_per_gpu"], ds_config["gradient_accumulation_steps"]
    val_batches = eval_micro_batches(val_tokens, micro, args.seq_len, count=args.eval_batches * gas)
    MicroBatchIterator(train_tokens, micro, args.seq_len)  # validates the corpus is long enough
    return Prepared(ds_config, stages, resume_plan, model_cfg, train_tokens, val_tokens, val_batches, micro, gas)


def build_engine(args, prepared):
    """The pipelined GPT-2 and its engine; the LR schedule spans this run's ``--steps``."""
    import ds_paci
    from ds_paci.workload.gpt2 import gpt2_pipeline
    sched = prepared.ds_config.get("scheduler", {}).get("params", {})
    if "total_num_steps" in sched:
        sched["total_num_steps"] = args.steps  # the schedule spans this run
        if sched.get("warmup_num_steps", 0) >= args.steps:
            sched["warmup_num_steps"] = max(1, args.steps // 10)
    model = gpt2_pipeline(prepared.model_cfg, num_stages=prepared.stages, seed=args.seed,
                          device_time=args.device_time, tie_embeddings=args.tie_embeddings)
    args_for_ds = argparse.Namespace(local_rank=args.local_rank, deepspeed_config=None)
    engine, _, _, _ = ds_paci.initialize(args=args_for_ds, model=model, model_parameters=model.parameters(),
                                         config=prepared.ds_config)
    return engine


def engine_name(engine):
    import ds_paci
    if not isinstance(engine, ds_paci.PACIPipelineEngine):
        return "stock 1F1B-flush"
    name = f"PACI (a={engine.accumulation_window})"
    if engine.paci_stats()["lookahead"]["enabled"]:
        name += " + look-ahead"
    return name


def banner(args, shape, prepared):
    """The job's first line: version, engine, layout, model, data."""
    import ds_paci
    cfg = prepared.model_cfg
    return (f"ds_paci {ds_paci.__version__} | {shape.engine_name} | {shape.stages} stages x {shape.data_parallel} "
            f"data-parallel | GPT-2 {args.model} ({cfg.n_layer} blocks x {cfg.n_embd}, vocab {cfg.vocab_size}, "
            f"{'tied' if args.tie_embeddings else 'untied'} LM head) | "
            f"{args.tokenizer} | seq {args.seq_len} | micro-batch {prepared.micro} x {prepared.gas} | "
            f"{len(prepared.train_tokens):,} train tokens, {len(prepared.val_tokens):,} val tokens"
            + (f" | emulated device time {args.device_time}s/block" if args.device_time else ""))


def train(args, prepared, stopper):
    """Build the engine and run the loop (resumed with ``--resume``); the rank's exit code."""
    import ds_paci
    from ds_paci.workload.data import MicroBatchIterator
    engine = build_engine(args, prepared)
    dp_rank, dp = engine.grid.data_parallel_id, engine.grid.data_parallel_size
    data = MicroBatchIterator(prepared.train_tokens, prepared.micro, args.seq_len, seed=args.seed, dp_rank=dp_rank,
                              dp_size=dp)
    config_name = os.path.splitext(os.path.basename(args.deepspeed_config))[0]
    reporter = Reporter(engine.is_last_stage() and dp_rank == 0,
                        args.metrics or os.path.join("runs", config_name, "metrics.jsonl"))
    shape = JobShape(engine_name(engine), isinstance(engine, ds_paci.PACIPipelineEngine), prepared.stages, dp,
                     start_step=0, steps=args.steps, tokens_per_step=prepared.micro * prepared.gas * dp * args.seq_len,
                     tie_embeddings=args.tie_embeddings)
    reporter.say(banner(args, shape, prepared))
    loop = TrainingLoop(engine, data, prepared.val_batches, reporter, stopper, shape, args, prepared.gas)
    if args.resume and not loop.resume(*prepared.resume_plan):
        return EXIT_USAGE
    return loop.run()


def main(argv=None):
    """One rank of the main job (``argv=None``: ``sys.argv[1:]``); returns its exit code."""
    args = parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    from ds_paci.core.health.nodes import launched_nodes
    across_nodes = launched_nodes() > 1  # disks and data paths may differ by node: verdicts are agreed (agree_start)
    error = checked = prepared = None
    try:
        checked = check_inputs(args, world_size, one_disk=not across_nodes)
    except UsageError as e:
        if not across_nodes:
            return _refuse(rank, e)
        error = e
    stopper = _install_stops(args)
    _set_up_torch(args, world_size)
    from ds_paci.workload.data import DataError
    try:
        if error is not None:
            raise error
        prepared = prepare(args, *checked)
    except (UsageError, DataError, ValueError) as e:
        if not across_nodes:
            return _refuse(rank, e)
        error = e

    import deepspeed

    import ds_paci
    ds_paci.init_distributed(dist_backend="gloo" if deepspeed.get_accelerator().device_name() == "cpu" else None)
    if across_nodes:
        code, plan = agree_start(error, args)
        if code is not None:
            return code
        prepared.resume_plan = plan
    return train(args, prepared, stopper)
