"""Running the benchmark: one rank's training with evaluations, one world per engine, alternating rounds."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from ds_paci.tools.processes import world
from .analysis import summarize_run
from .config import BenchConfig, ENGINES, PACI_ENGINES
from .meters import ActivationMeter, StockInstructionTracer, peak_rss_bytes, weight_storage_report


@dataclass(frozen=True)
class RunJob:
    """Everything one world needs: configuration, engine, data file, whether to trace, where results go."""

    config: BenchConfig
    engine: str  # one of config.ENGINES
    data_path: str
    trace: bool
    gloo_timeout_s: float


def ds_config(cfg: BenchConfig, engine: str, trace: bool) -> dict:
    """The DeepSpeed config of a run: identical for every engine apart from the ``paci`` section.

    ``paci``: PACI streams without look-ahead; ``paci+lookahead``: the same with the
    window-informed look-ahead (the engine's default).
    """
    config = {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.micro_batches,
        "steps_per_print": 10**9,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": cfg.lr, "torch_adam": True, "weight_decay": 0.0}},
    }
    if engine in PACI_ENGINES:
        config["paci"] = {"enabled": True, "accumulation_window": cfg.micro_batches, "trace": trace,
                          "lookahead": engine == "paci+lookahead"}
    return config


def build_engine(cfg: BenchConfig, engine: str, trace: bool):
    """GPT-2 pipeline (with emulated device time in emulated mode) wrapped by ``ds_paci.initialize``."""
    import ds_paci
    from ds_paci.workload.gpt2 import gpt2_config, gpt2_pipeline
    model_cfg = gpt2_config("tiny", vocab_size=257, n_positions=cfg.seq_len, n_embd=cfg.n_embd, n_layer=cfg.n_layer,
                            n_head=cfg.n_head)
    model = gpt2_pipeline(model_cfg, num_stages=cfg.stages, seed=cfg.seed, device_time=cfg.device_time,
                          tie_embeddings=cfg.tie_embeddings)
    result, *_ = ds_paci.initialize(model=model, model_parameters=model.parameters(),
                                    config=ds_config(cfg, engine, trace))
    return result


def validation_loss(engine, batches: list, micro_batches: int) -> float:
    """Mean loss of ``engine.eval_batch`` over ``batches``, ``micro_batches`` at a time (drains PACI first)."""
    losses = []
    for i in range(0, len(batches), micro_batches):
        losses.append(float(engine.eval_batch(iter(batches[i:i + micro_batches]))))
    return sum(losses) / len(losses)


def train_with_evaluations(engine, cfg: BenchConfig, train_iter, val_batches, meter, tracer) -> dict:
    """Train ``cfg.steps`` batches with a validation at step 0, every ``eval_every`` steps and at the end.

    Returns per-call ``(start, end)`` times, per-call losses (``None`` where the engine
    returned none or NaN, i.e. no value yet), the segments between evaluations (``first_call``, ``calls``,
    ``start``, ``end``: training time including PACI's drain) and ``evals``
    (``[step, loss]``).
    """
    from ds_paci import PACIPipelineEngine
    is_paci = isinstance(engine, PACIPipelineEngine)
    calls, losses, segments = [], [], []
    evals = [[0, validation_loss(engine, val_batches, cfg.micro_batches)]]
    step = 0
    while step < cfg.steps:
        length = min(cfg.eval_every or cfg.steps, cfg.steps - step)
        first_call = len(calls)
        segment_start = time.time()
        if tracer is not None:
            tracer.active = True
        with meter.training():
            for _ in range(length):
                start = time.time()
                loss = engine.train_batch(train_iter)
                calls.append((start, time.time()))
                value = None if loss is None else float(loss)
                losses.append(None if value is None or value != value else value)  # NaN: no value yet
            if is_paci:
                engine.drain(close_window=False)  # as eval_batch: no extra local step
        if tracer is not None:
            tracer.active = False
        segments.append({"first_call": first_call, "calls": length, "start": segment_start, "end": time.time()})
        step += length
        evals.append([step, validation_loss(engine, val_batches, cfg.micro_batches)])
    return {"calls": calls, "losses": losses, "segments": segments, "evals": evals}


def _trace_of_first_segment(records: list, segment: dict) -> list:
    return [r for r in records if segment["start"] <= r["start"] and r["end"] <= segment["end"]]


def run_rank(rank: int, job: RunJob) -> dict:
    """Body of one rank: build the engine, train with evaluations, measure; returns plain JSON data."""
    import torch

    from ds_paci.workload.data import MicroBatchIterator, eval_micro_batches
    cfg = job.config
    engine = build_engine(cfg, job.engine, job.trace)
    stage = engine.stage_id
    tracer = None
    if job.trace and job.engine == "stock":
        tracer = StockInstructionTracer(rank, stage)
        tracer.install(engine)
    meter = ActivationMeter(engine)
    train_iter, val_batches = None, [None] * (cfg.eval_batches * cfg.micro_batches)
    if engine.is_first_stage() or engine.is_last_stage():
        tokens = torch.load(job.data_path)
        train_iter = MicroBatchIterator(tokens["train"].long(), cfg.micro_batch_size, cfg.seq_len,
                                        seed=cfg.data_seed)
        val_batches = eval_micro_batches(tokens["val"].long(), cfg.micro_batch_size, cfg.seq_len,
                                         count=cfg.eval_batches * cfg.micro_batches)
    run = train_with_evaluations(engine, cfg, train_iter, val_batches, meter, tracer)
    result = {
        "rank": rank,
        "stage": stage,
        "engine_type": type(engine).__name__,
        **run,
        "memory": {
            "peak_saved_bytes": meter.peak_saved_bytes,
            "peak_held_bytes": meter.peak_held_bytes,
            "peak_rss_bytes": peak_rss_bytes(),
            **weight_storage_report(engine),
        },
    }
    if job.engine in PACI_ENGINES:
        result["paci_stats"] = engine.paci_stats()
    if job.trace:
        records = tracer.records if tracer is not None else engine.paci_trace()
        result["trace"] = _trace_of_first_segment(records, run["segments"][0])
    return result


def run_world(job: RunJob, log_dir: str, timeout: float) -> list[dict]:
    """Run ``job`` on ``job.config.stages`` processes (see :mod:`ds_paci.tools.processes.world`); per-rank results in rank order."""
    return world.run_world(run_rank, job.config.stages, job, timeout=timeout, log_dir=log_dir,
                           gloo_timeout_s=job.gloo_timeout_s, accelerator=None)  # DeepSpeed's detected accelerator


def prepare_tokens(cfg: BenchConfig, path: str) -> dict:
    """Encode the Shakespeare train/validation split once and save it for the workers; returns its sizes."""
    import torch

    from ds_paci.workload.data import encode_documents, get_tokenizer, load_corpus, split_documents
    train_docs, val_docs = split_documents(load_corpus(), val_fraction=0.1, seed=0)
    tokenizer = get_tokenizer(cfg.tokenizer, train_docs)
    dtype = torch.int16 if tokenizer.vocab_size <= 32767 else torch.int32
    train = encode_documents(train_docs, tokenizer).to(dtype)
    val = encode_documents(val_docs, tokenizer).to(dtype)
    torch.save({"train": train, "val": val}, path)
    return {"tokenizer": tokenizer.name, "train_tokens": train.numel(), "val_tokens": val.numel(),
            "train_documents": len(train_docs), "val_documents": len(val_docs)}


def run_engine(cfg: BenchConfig, engine: str, round_index: int, *, trace: bool, data_path: str, log_root: str,
               timeout: float) -> tuple[dict, list]:
    """One world of ``engine`` for round ``round_index``; returns its :func:`summarize_run` and the raw rank results."""
    run_dir = os.path.join(log_root, cfg.name, f"{engine}_round{round_index}")
    job = RunJob(config=cfg, engine=engine, data_path=data_path, trace=trace, gloo_timeout_s=min(timeout, 600))
    began = time.monotonic()
    ranks = run_world(job, run_dir, timeout)
    return summarize_run(ranks, cfg, engine, time.monotonic() - began), ranks


def run_rounds(cfg: BenchConfig, *, repeats: int, trace: bool, data_path: str, log_root: str, timeout: float,
               echo=print, engines=ENGINES) -> tuple[list, dict]:
    """Run each of ``engines`` in turn (stock, PACI, PACI + look-ahead, stock, ...) for ``repeats`` rounds.

    Returns ``(rounds, traces)``: ``rounds[r][engine]`` is a run summary; ``traces[engine]``
    is ``(records of the first round, start of its first steady-state call on rank 0)``
    when ``trace`` is on.
    """
    rounds, traces = [], {}
    for r in range(repeats):
        runs = {}
        for engine in engines:
            traced = trace and r == 0
            runs[engine], ranks = run_engine(cfg, engine, r, trace=traced, data_path=data_path, log_root=log_root,
                                             timeout=timeout)
            if traced:
                traces[engine] = ([rec for rank in ranks for rec in rank["trace"]], ranks[0]["calls"][cfg.warmup][0])
            tp = runs[engine]["throughput"]
            echo(f"[{cfg.name}] round {r + 1}/{repeats} {engine:14s}: {tp['tokens_per_second']:8.0f} tokens/s, "
                 f"{tp['seconds_per_batch']:.3f} s/batch, final val loss {runs[engine]['final_val_loss']:.4f}, "
                 f"world {runs[engine]['world_wall_seconds']:.0f} s, load {os.getloadavg()[0]:.2f}")
        rounds.append(runs)
    return rounds, traces


def run_curves(cfg: BenchConfig, engines, *, data_path: str, log_root: str, timeout: float, done: dict,
               save, echo=print, past_steps: bool = False) -> dict:
    """One untimed run per engine of a loss-curve configuration; results go into ``done`` (and ``save(done)``).

    ``done`` maps :func:`curve_key` to a run summary; runs already in it are skipped, so an
    interrupted study resumes where it stopped. ``past_steps``: the runs train past stock's step count
    (their keys name their steps).
    """
    for engine in engines:
        key = curve_key(cfg, engine, past_steps)
        if key in done:
            continue
        began = time.monotonic()
        summary, _ = run_engine(cfg, engine, 0, trace=False, data_path=data_path,
                                log_root=os.path.join(log_root, f"lr{cfg.lr:g}_seed{cfg.seed}"), timeout=timeout)
        summary.pop("train_loss", None)  # per-call losses of a long run; the validation curve is what counts
        summary.pop("throughput", None)  # no wait: its timings mean nothing
        done[key] = summary
        save(done)
        echo(f"[{cfg.name} curves] lr {cfg.lr:g} seed {cfg.seed} {engine:14s}: final val loss "
             f"{summary['final_val_loss']:.4f}, world {time.monotonic() - began:.0f} s, load {os.getloadavg()[0]:.2f}")
    return done


def curve_key(cfg: BenchConfig, engine: str, past_steps: bool = False) -> str:
    """Key of one curve run: learning rate, seeds and engine (and its step count for runs past stock's)."""
    key = f"lr={cfg.lr:g} seed={cfg.seed} data_seed={cfg.data_seed} engine={engine}"
    return key + f" steps={cfg.steps}" if past_steps else key
