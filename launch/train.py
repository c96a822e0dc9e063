"""The main job: GPT-2 pipeline training on a real text corpus, with PACI or DeepSpeed's stock engine.

    deepspeed --num_gpus 2 launch/train.py --deepspeed_config configs/paci.json    # PACI
    deepspeed --num_gpus 2 launch/train.py --deepspeed_config configs/flush.json   # stock 1F1B-flush

The same script runs both: ``ds_paci.initialize`` returns the PACI engine when the
config has ``"paci": {"enabled": true}`` and DeepSpeed's own engine otherwise.
The last pipeline stage (which computes the loss) prints progress, periodic
validation loss and a final summary, and writes metrics as JSON lines.
Every input is checked before any process group starts, so a bad argument ends
every rank at once with one line that names the problem and the fix (exit code 2).
"""

import argparse
import json
import math
import os
import resource
import sys
import time

EXIT_USAGE = 2
EXIT_NONFINITE = 3  # the non-finite guard stopped the run (see ds_paci.core.guard)


class UsageError(Exception):
    """A bad input: the message is one line naming the problem and the fix."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
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


# -- checks that run before any process group exists ---------------------------------------
def check_flags(args):
    """Every numeric flag in range; each message names the flag and what is allowed."""
    import math

    def need(ok, flag, value, allowed):
        if not ok:
            raise UsageError(f"{flag} {value} is not allowed; use {allowed}")

    need(args.steps >= 1, "--steps", args.steps, "an integer >= 1 (train_batch calls to run)")
    need(args.log_interval >= 1, "--log-interval", args.log_interval, "an integer >= 1 (a progress line every N steps)")
    need(args.eval_interval >= 0, "--eval-interval", args.eval_interval,
         "an integer >= 0 (validate every N steps; 0: only at start and end)")
    need(args.eval_batches >= 1, "--eval-batches", args.eval_batches,
         "an integer >= 1 (validation batches of gradient_accumulation_steps micro-batches)")
    need(args.save_interval >= 0, "--save-interval", args.save_interval,
         "an integer >= 0 (save every N steps; 0: only at the end)")
    if args.threads is not None:
        need(args.threads >= 1, "--threads", args.threads, "an integer >= 1 (torch threads per process), or omit it")
    need(math.isfinite(args.device_time) and args.device_time >= 0, "--device-time", args.device_time,
         "a finite number of seconds >= 0 (0: no emulated device time)")
    need(math.isfinite(args.stop_timeout) and args.stop_timeout > 0, "--stop-timeout", args.stop_timeout,
         "a finite number of seconds > 0")
    need(args.n_positions >= 1, "--n-positions", args.n_positions, "an integer >= 1")
    need(args.seq_len >= 1, "--seq-len", args.seq_len, f"an integer from 1 to --n-positions ({args.n_positions})")
    if args.seq_len > args.n_positions:
        raise UsageError(f"--seq-len {args.seq_len} exceeds the model's {args.n_positions} positions; lower --seq-len "
                         f"or raise --n-positions")
    for flag, value in (("--n-layer", args.n_layer), ("--n-embd", args.n_embd), ("--n-head", args.n_head)):
        if value is not None:
            need(value >= 1, flag, value, "an integer >= 1, or omit it for the --model default")
    if args.stages is not None:
        need(args.stages >= 1, "--stages", args.stages, "an integer >= 1, or omit it (one stage per process)")
    if args.save_interval and not args.checkpoint_dir:
        raise UsageError(f"--save-interval {args.save_interval} needs --checkpoint-dir <folder to save into>")


def check_checkpoint_dir(path):
    """The checkpoint folder exists or can be created, and a file can be written in it (tried, then removed)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"--checkpoint-dir {path} is a file, not a folder; pass a folder (it is created if missing)")
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".ds_paci-write-test.{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise UsageError(f"--checkpoint-dir {path} is not writable ({e.strerror or e}); pass a folder this user can "
                         "write to") from None


def check_config(ds_config, world_size, stages, config_path, tie_embeddings=False):
    """The DeepSpeed config keys the job needs, named by their keys; PACI refusals before any process starts."""
    from ds_paci.core.config import (PACIConfigError, check_accumulation_window, check_batch_keys, check_fp16,
                                     check_zero_stage, parse_paci_section)
    from ds_paci.core.tied import zero_offload_device
    try:
        paci = parse_paci_section(ds_config.get("paci"))
        check_batch_keys(ds_config)
        check_zero_stage(ds_config)
        if paci.enabled:
            check_fp16(ds_config)
    except PACIConfigError as e:
        raise UsageError(str(e)) from None
    micro = ds_config.get("train_micro_batch_size_per_gpu")
    gas = ds_config.get("gradient_accumulation_steps")
    if micro is None or gas is None:
        missing = " and ".join(f'"{k}"' for k, v in (("train_micro_batch_size_per_gpu", micro),
                                                       ("gradient_accumulation_steps", gas)) if v is None)
        raise UsageError(f"{config_path} must set integer \"train_micro_batch_size_per_gpu\" and "
                         f"\"gradient_accumulation_steps\" (missing: {missing}; see configs/paci.json)")
    dp = world_size // stages
    if "train_batch_size" in ds_config and ds_config["train_batch_size"] != micro * gas * dp:
        raise UsageError(f"\"train_batch_size\" {ds_config['train_batch_size']} != micro-batch {micro} x "
                         f"accumulation {gas} x data-parallel {dp}; remove \"train_batch_size\" or make it "
                         f"{micro * gas * dp}")
    if paci.enabled:
        try:
            check_accumulation_window(paci.accumulation_window, gas)
        except PACIConfigError as e:
            raise UsageError(str(e)) from None
    offload = zero_offload_device(ds_config)
    if tie_embeddings and paci.enabled and not paci.drain_every_batch and stages > 1 and offload is not None:
        raise UsageError(f"--tie-embeddings with \"zero_optimization.offload_optimizer.device\" = \"{offload}\" in "
                         f"{config_path}: ZeRO's offloaded optimizer keeps the gradients where PACI's tied exchange "
                         "cannot reach them; remove the offload or drop --tie-embeddings (untie the layers)")


def check_inputs(args, world_size, one_disk=True):
    """Validate everything a rank can check on its own; returns (ds_config, corpus documents, stages, resume plan).

    On one node every rank reaches the same verdict, so a bad input ends all of them together. The
    resume plan is ``(tag, note)``: the checkpoint ``--resume`` loads (the one ``latest``
    names if it is complete, else the last complete one, with a one-line note saying so). With
    ``one_disk=False`` (a run across nodes, whose disks may differ) the plan is left to
    :func:`agree_start` (``None`` here).
    """
    from ds_paci.core.checkpoint import CheckpointError, resume_tag
    from ds_paci.core.config import PACIConfigError, load_config
    from ds_paci.workload.data import DataError, load_corpus
    check_flags(args)
    try:
        ds_config = load_config(args.deepspeed_config)
    except PACIConfigError as e:
        raise UsageError(str(e)) from None
    stages = args.stages or world_size
    if world_size % stages:
        raise UsageError(f"--stages {stages} does not divide the {world_size} launched processes; launch a multiple "
                         f"of {stages} (deepspeed --num_gpus {stages} ...) or pass a --stages that divides {world_size}")
    check_config(ds_config, world_size, stages, args.deepspeed_config, args.tie_embeddings)
    plan = None
    if args.resume:
        if not args.checkpoint_dir:
            raise UsageError("--resume needs --checkpoint-dir <directory written by an earlier run>")
    if args.resume and one_disk:
        if not os.path.isdir(args.checkpoint_dir):
            raise UsageError(f"--checkpoint-dir {args.checkpoint_dir} holds no checkpoint (no such folder); point it "
                             "at a directory an earlier run saved into, or drop --resume")
        try:
            plan = resume_tag(args.checkpoint_dir)
        except CheckpointError as e:
            raise UsageError(f"--checkpoint-dir {e}; point it at a folder an earlier run saved into, or drop "
                             "--resume") from None
    if args.checkpoint_dir:
        check_checkpoint_dir(args.checkpoint_dir)
    try:
        docs = load_corpus(args.data)
    except DataError as e:
        raise UsageError(str(e)) from None
    return ds_config, docs, stages, plan


def build_model_config(args, vocab_size, eos_id, stages):
    from ds_paci.workload.gpt2 import gpt2_config
    try:
        cfg = gpt2_config(args.model, vocab_size=vocab_size, n_positions=args.n_positions, n_embd=args.n_embd,
                          n_layer=args.n_layer, n_head=args.n_head, eos_token_id=eos_id)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if cfg.n_layer < stages:
        raise UsageError(f"the model has {cfg.n_layer} transformer blocks but {stages} stages were asked for; "
                         f"use at most {cfg.n_layer} stages or a deeper model (--n-layer)")
    return cfg


def fmt_time(seconds):
    seconds = int(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


# -- the job ------------------------------------------------------------------------------
class Reporter:
    """Progress lines, validation lines, metrics JSONL and the summary, on the last stage's first replica."""

    def __init__(self, active, path):
        self.active = active
        self.path = path
        self.file = None
        if active:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.file = open(path, "a")

    def record(self, **fields):
        if self.active:
            self.file.write(json.dumps(fields) + "\n")
            self.file.flush()

    def say(self, line):
        if self.active:
            print(line, flush=True)

    def close(self):
        if self.file:
            self.file.close()


def agree_start(error, args):
    """A run across nodes: every rank's verdict on its own inputs, agreed (a bad input on one node ends every node,
    where it would otherwise leave the others waiting in the process group's rendezvous), then the resume plan
    agreed over every rank's disk. A collective; returns ``(exit code or None, resume plan)``."""
    import torch.distributed as tdist

    from ds_paci.core import checkpoint
    from ds_paci.core.nodes import gather_node_map
    nodes = gather_node_map()
    errors = [None] * tdist.get_world_size()
    tdist.all_gather_object(errors, None if error is None else str(error))
    bad = [r for r, e in enumerate(errors) if e]
    line = None
    if bad:
        same = [r for r in bad if errors[r] == errors[bad[0]]]
        line = ("" if len(same) == len(errors) else f"on {nodes.describe(same)}: ") + errors[bad[0]]
    plan = None
    if line is None and args.resume:
        try:
            plan = checkpoint.agreed_resume_tag(args.checkpoint_dir)
        except checkpoint.CheckpointError as e:
            line = f"--checkpoint-dir {e}; point it at a folder an earlier run saved into, or drop --resume"
    if line is None:
        return None, plan
    if tdist.get_rank() == 0:
        print(f"error: {line}", file=sys.stderr, flush=True)
    tdist.destroy_process_group()
    return EXIT_USAGE, None


def main(argv=None):
    args = parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    from ds_paci.core.nodes import launched_nodes
    across_nodes = launched_nodes() > 1  # disks and data paths may differ by node: verdicts are agreed (agree_start)
    error = None
    try:
        ds_config, docs, stages, resume_plan = check_inputs(args, world_size, one_disk=not across_nodes)
    except UsageError as e:
        if not across_nodes:
            if rank == 0:
                print(f"error: {e}", file=sys.stderr, flush=True)
            return EXIT_USAGE
        error = e

    # Stops: during start-up a signal ends this rank at once; from the first step on it stops every rank
    # at an agreed step, drains, saves (with --checkpoint-dir) and exits 128+signal (see ds_paci.core.lifecycle).
    from ds_paci.core import checkpoint, lifecycle
    stopper = lifecycle.StopController(timeout=args.stop_timeout, graceful=False).install()
    lifecycle.watch_launchers()

    import logging

    import torch
    local_size = int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // max(1, local_size)))
    import deepspeed
    if not args.verbose:
        deepspeed.utils.logger.setLevel(logging.WARNING)

    import ds_paci
    from ds_paci.workload.data import (DataError, MicroBatchIterator, encode_documents, eval_micro_batches, get_tokenizer,
                              split_documents)
    from ds_paci.workload.gpt2 import gpt2_pipeline

    try:
        if error is not None:
            raise error
        train_docs, val_docs = split_documents(docs)
        tokenizer = get_tokenizer(args.tokenizer, train_docs=train_docs)
        model_cfg = build_model_config(args, tokenizer.vocab_size, tokenizer.eos_id, stages)
        train_tokens = encode_documents(train_docs, tokenizer)
        val_tokens = encode_documents(val_docs, tokenizer)
        micro, gas = ds_config["train_micro_batch_size_per_gpu"], ds_config["gradient_accumulation_steps"]
        val_batches = eval_micro_batches(val_tokens, micro, args.seq_len, count=args.eval_batches * gas)
        MicroBatchIterator(train_tokens, micro, args.seq_len)  # validates the corpus is long enough
    except (UsageError, DataError, ValueError) as e:
        if not across_nodes:
            if rank == 0:
                print(f"error: {e}", file=sys.stderr, flush=True)
            return EXIT_USAGE
        error = e

    ds_paci.init_distributed(dist_backend="gloo" if deepspeed.get_accelerator().device_name() == "cpu" else None)
    if across_nodes:
        code, resume_plan = agree_start(error, args)
        if code is not None:
            return code
    sched = ds_config.get("scheduler", {}).get("params", {})
    if "total_num_steps" in sched:
        sched["total_num_steps"] = args.steps  # the schedule spans this run
        if sched.get("warmup_num_steps", 0) >= args.steps:
            sched["warmup_num_steps"] = max(1, args.steps // 10)
    model = gpt2_pipeline(model_cfg, num_stages=stages, seed=args.seed, device_time=args.device_time,
                          tie_embeddings=args.tie_embeddings)
    args_for_ds = argparse.Namespace(local_rank=args.local_rank, deepspeed_config=None)
    engine, _, _, _ = ds_paci.initialize(args=args_for_ds, model=model, model_parameters=model.parameters(),
                                         config=ds_config)
    is_paci = isinstance(engine, ds_paci.PACIPipelineEngine)
    dp_rank, dp = engine.grid.data_parallel_id, engine.grid.data_parallel_size
    data = MicroBatchIterator(train_tokens, micro, args.seq_len, seed=args.seed, dp_rank=dp_rank, dp_size=dp)
    config_name = os.path.splitext(os.path.basename(args.deepspeed_config))[0]
    reporter = Reporter(engine.is_last_stage() and dp_rank == 0,
                        args.metrics or os.path.join("runs", config_name, "metrics.jsonl"))
    engine_name = "stock 1F1B-flush"
    if is_paci:
        engine_name = f"PACI (a={engine.accumulation_window})"
        if engine.paci_stats()["lookahead"]["enabled"]:
            engine_name += " + look-ahead"
    reporter.say(f"ds_paci {ds_paci.__version__} | {engine_name} | {stages} stages x {dp} data-parallel | GPT-2 "
                 f"{args.model} ({model_cfg.n_layer} blocks x {model_cfg.n_embd}, vocab {model_cfg.vocab_size}, "
                 f"{'tied' if args.tie_embeddings else 'untied'} LM head) | "
                 f"{args.tokenizer} | seq {args.seq_len} | micro-batch {micro} x {gas} | "
                 f"{len(train_tokens):,} train tokens, {len(val_tokens):,} val tokens"
                 + (f" | emulated device time {args.device_time}s/block" if args.device_time else ""))

    start_step = 0
    if args.resume:
        tag, note = resume_plan
        path, client = checkpoint.load_checkpoint(engine, args.checkpoint_dir, tag=tag)
        if path is None:
            reporter.say(f"error: could not load a checkpoint from {args.checkpoint_dir}")
            return EXIT_USAGE
        start_step = client["step"]
        data.load_state_dict(client["data"])
        reporter.say(f"resumed from {path} at step {start_step}" + (f" ({note})" if note else ""))

    def gather_stats():
        local = {"stage": engine.stage_id, "dp": dp_rank, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
        if is_paci:
            local.update(engine.paci_stats())
        out = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(out, local)  # legal here: the pipeline is drained
        return out

    eval_seconds = 0.0

    def evaluate(step):
        nonlocal eval_seconds
        t0 = time.perf_counter()
        if is_paci:
            engine.drain(close_window=False)  # evaluation never adds a local step
        losses = []
        for i in range(args.eval_batches):
            group = val_batches[i * gas:(i + 1) * gas]
            losses.append(float(engine.eval_batch(iter(group))))
        val = sum(losses) / len(losses)
        eval_seconds += time.perf_counter() - t0
        reporter.say(f"step {step:>6}/{args.steps} | validation loss {val:.4f}")
        reporter.record(event="eval", step=step, val_loss=val)
        return val

    saved_step = None

    def save(step):
        nonlocal saved_step
        checkpoint.save_checkpoint(engine, args.checkpoint_dir, client_state={"step": step, "data": data.state_dict()})
        saved_step = step
        reporter.say(f"step {step:>6}/{args.steps} | checkpoint saved to {args.checkpoint_dir}")

    def stop_run(step, decision):
        """Every rank agreed to stop after ``step``: drain, save, exit 128+signal (bounded by --stop-timeout)."""
        if stopper.code is None:  # learned from another rank: this rank's stop is bounded by the deadline too
            stopper.request_stop(decision.code, f"stop agreed by all ranks ({decision.describe()})", announce=False)
        reporter.say(f"step {step:>6}/{args.steps} | stopping: {decision.describe()}; every rank stops after step "
                     f"{step}")
        if is_paci:
            engine.drain(close_window=False)  # a resume continues exactly where this stops
        if args.checkpoint_dir and saved_step != step:
            save(step)
        reporter.record(event="stop", step=step, reason=decision.describe(), exit_code=decision.exit_code)
        after = (f"resume with --resume --checkpoint-dir {args.checkpoint_dir}" if args.checkpoint_dir else
                 "nothing saved (no --checkpoint-dir)")
        reporter.say(f"stopped at step {step} of {args.steps} ({decision.describe()}); {after}")
        reporter.close()
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        return decision.exit_code

    first_val = evaluate(start_step)
    stats, stats_step = gather_stats(), start_step
    tokens_per_step = micro * gas * dp * args.seq_len
    recent_losses, window_start, window_steps = [], time.perf_counter(), 0
    train_seconds = 0.0
    last_loss = None
    nonfinite_steps, window_nonfinite = [], []
    agreement = lifecycle.StopAgreement(stopper)
    stopper.graceful = True
    agreement.poll()  # from here a stop requested on any rank is agreed on by all within two steps
    for step in range(start_step + 1, args.steps + 1):
        t0 = time.perf_counter()
        loss = engine.train_batch(data)
        train_seconds += time.perf_counter() - t0
        window_steps += 1
        if loss is not None:
            last_loss = float(loss)
            if math.isfinite(last_loss):
                recent_losses = (recent_losses + [last_loss])[-10:]
            elif engine.is_last_stage():  # the loss computed this step is NaN/inf (never a stale value here)
                nonfinite_steps.append(step)
                window_nonfinite.append(step)
        if step % args.log_interval == 0 or step == args.steps:
            elapsed = time.perf_counter() - window_start
            tps = tokens_per_step * window_steps / max(elapsed, 1e-9)
            eta = (args.steps - step) * elapsed / max(window_steps, 1)
            drift = ""
            if is_paci:
                seen = max(s.get("max_drift", 0) for s in stats)
                bound = max(s.get("drift_bound", 0) for s in stats)
                drift = f" | drift {seen} (bound {bound}, all stages as of step {stats_step})"
            loss_txt = f"{last_loss:.4f}" if last_loss is not None else "   n/a"
            guard = ""
            if window_nonfinite:
                guard = f" | non-finite loss at step {', '.join(map(str, window_nonfinite))}"
            if engine.skipped_steps:
                guard += f" | skipped steps {engine.skipped_steps} (non-finite gradients; this stage)"
            window_nonfinite = []
            reporter.say(f"step {step:>6}/{args.steps} | loss {loss_txt} | {tps:,.0f} tokens/s | "
                         f"lr {engine.get_lr()[0]:.2e}{drift}{guard} | eta {fmt_time(eta)}")
            reporter.record(event="train", step=step, loss=last_loss, tokens_per_s=tps, lr=engine.get_lr()[0],
                            time=time.time())
            window_start, window_steps = time.perf_counter(), 0
        if args.eval_interval and step % args.eval_interval == 0 and step != args.steps:
            evaluate(step)
            stats, stats_step = gather_stats(), step
        if args.checkpoint_dir and args.save_interval and step % args.save_interval == 0 and step != args.steps:
            save(step)
        decision = agreement.poll()
        if decision is not None:
            return stop_run(step, decision)
    agreement.close()

    tail = engine.drain() if is_paci else None
    if tail is not None and engine.paci_stats()["loss_age"] == 0 and math.isfinite(float(tail)):
        recent_losses = (recent_losses + [float(tail)])[-10:]
    final_val = evaluate(args.steps)
    if args.checkpoint_dir:
        save(args.steps)
    stats = gather_stats()
    steps_run = args.steps - start_step
    tokens = steps_run * tokens_per_step
    train_loss = sum(recent_losses) / len(recent_losses) if recent_losses else float("nan")
    summary = {
        "engine": engine_name, "stages": stages, "data_parallel": dp, "steps": steps_run, "tokens": tokens,
        "train_seconds": train_seconds, "eval_seconds": eval_seconds, "tokens_per_s": tokens / max(train_seconds, 1e-9),
        "final_train_loss": train_loss, "first_val_loss": first_val, "final_val_loss": final_val,
        "peak_rss_mb_per_stage": {s["stage"]: round(s["rss_mb"], 1) for s in stats if s["dp"] == 0},
        "drift_per_stage": {s["stage"]: s.get("drift_histogram") for s in stats if s["dp"] == 0} if is_paci else None,
        "nonfinite_loss_steps": nonfinite_steps,
        "skipped_steps_per_stage": {s["stage"]: s.get("skipped_steps") for s in stats if s["dp"] == 0} if is_paci else None,
        "tie_embeddings": args.tie_embeddings,
        "tied": [s["tied"] for s in stats if s.get("tied") and s["tied"]["owner"]] if is_paci else None,
        "lookahead_per_stage": {s["stage"]: s.get("lookahead") for s in stats if s["dp"] == 0} if is_paci else None,
    }
    reporter.record(event="summary", **summary)
    rss = " | ".join(f"stage {k}: {v:.0f} MB" for k, v in summary["peak_rss_mb_per_stage"].items())
    lines = [
        f"==== summary: {engine_name}, {stages} stages x {dp} data-parallel ====",
        f"steps            {steps_run} ({tokens:,} tokens)",
        f"wall time        {train_seconds + eval_seconds:.1f} s (training {train_seconds:.1f} s, evaluation {eval_seconds:.1f} s)",
        f"throughput       {summary['tokens_per_s']:,.0f} tokens/s (training time)",
        f"train loss       {train_loss:.4f} (mean of the last {len(recent_losses)} batches)",
        f"validation loss  {first_val:.4f} at step {start_step} -> {final_val:.4f} at step {args.steps}",
        f"peak memory      {rss} (RSS)",
    ]
    if is_paci:
        lines.append("weight drift     " + " | ".join(
            f"stage {s['stage']}: {s['drift_histogram']} (bound {s['drift_bound']})" for s in stats if s["dp"] == 0))

        def lookahead_text(la):
            if not la.get("enabled"):
                return "off"
            error = "n/a" if la["prediction_error"] is None else f"{la['prediction_error']:.2f}"
            return f"{la['predicted_forwards']} predicted forwards, error {error}, {la['seconds']:.2f} s"

        lines.append("look-ahead       " + " | ".join(
            f"stage {s['stage']}: {lookahead_text(s['lookahead'])}" for s in stats if s["dp"] == 0))
    if nonfinite_steps or any((summary["skipped_steps_per_stage"] or {}).values()):
        lines.append(f"non-finite       loss at step(s) {nonfinite_steps or 'none'}; skipped local steps per stage "
                     f"{summary['skipped_steps_per_stage']}")
    tied = [t for t in summary["tied"] or [] if t]
    if tied:
        t = tied[0]
        lines.append(f"tied embedding   stages {t['owner_stages']['embed']}: gradients applied {t['lag_windows']} window(s) "
                     f"late, {t['windows_exchanged']} windows exchanged, longest wait in a step "
                     f"{max(x['max_wait_seconds'] for x in tied) * 1e3:.2f} ms")
    lines.append(f"metrics          {reporter.path}")
    reporter.say("\n".join(lines))
    reporter.close()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


def run(argv=None):
    """``main`` with the non-finite guard's stop turned into one line and exit code :data:`EXIT_NONFINITE`."""
    try:
        return main(argv)
    except Exception as e:
        from ds_paci.core.guard import PACINonFiniteError
        if not isinstance(e, PACINonFiniteError):
            raise
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_NONFINITE


if __name__ == "__main__":
    try:
        code = run()
    except Exception as exc:
        from ds_paci.core.liveness import exit_if_lost
        exit_if_lost(exc)  # a transfer failed because a node was lost: the peer watch's line ends this rank
        # A failing rank ends at once (its peers and the launcher wait on it): no slow interpreter teardown.
        import traceback
        traceback.print_exc()
        code = 1
    except KeyboardInterrupt:  # SIGINT before the stop handlers are installed (start-up)
        code = 128 + 2
    if code != 1:  # ending on purpose (a crash is left for the peer watch to report as a lost rank)
        from ds_paci.core.liveness import farewell
        farewell()
    if code:  # an error or a stop: everything is saved and flushed; skip the interpreter's slow teardown
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
