"""Soak benchmark: a long asynchronous run, sampled, to show that memory and transfers stay flat.

    python -m ds_paci.tools.studies.soak --calls 3000 --out docs/results/soak/soak.json

Contract. One world of real DeepSpeed engines over gloo (:func:`ds_paci.tools.processes.world.run_world`, CPU): a tiny
GPT-2 (:mod:`ds_paci.workload.gpt2`, byte vocabulary) whose token embedding is tied to its LM head across the
first and last of ``--stages`` pipeline stages, times ``--dp`` data-parallel replicas; PACI async with
``"lookahead": true``, ``accumulation_window`` ``--window`` (default ``--micro-batches``), DeepSpeed's AdamW
with clipping; ``--calls`` calls of ``train_batch`` on the Shakespeare corpus, an
``eval_batch`` every ``--eval-every`` calls and a ``save_checkpoint`` every ``--save-every`` calls into
``--checkpoint-dir`` (a temporary folder by default), of which only the newest ``--keep`` checkpoints are kept
so the disk does not fill. Every ``--sample-every`` calls (and after the last) each rank records a sample:
call index, wall time, resident set (``VmRSS`` of ``/proc/self/status``), Python objects tracked by the garbage
collector, the machine's 1-minute load average, the tied exchange's sends and receives in flight
(``paci_stats()["tied"]``: ``pending_sends``, ``pending_receives``, the most per peer), and seconds per call
over the interval (all of it, and ``train_batch`` alone). After the run the engine drains, saves a last
checkpoint, and a fresh engine built with another seed loads ``latest`` and is compared with the trained weights
(``resume_matches``).

Output: ``--out`` (JSON) holds the arguments, the per-rank series and a summary per rank
(:func:`summarize_rank`): resident set at the first sample at or after 10% of the calls and at the last
sample, growth between them in %, the most tied sends / receives in flight per peer against the bound
``L + 1`` (``L`` = ``paci_stats()["tied"]["lag_windows"]``), the median seconds per call over the first and the
last 10% of the samples. One summary line per rank is printed. A figure, never a test threshold: the tool exits
0 whatever the growth; it exits 2 with one ``error:`` line on a bad argument, and 1 (with every rank's status,
from :class:`~ds_paci.tools.processes.world.WorldFailure`) if a rank fails or the world exceeds ``--timeout``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

SEQ_LEN = 32
MICRO_BATCH = 2
TAG_PREFIX = "call"


@dataclass(frozen=True)
class SoakJob:
    """What every rank runs (see the module docstring)."""

    calls: int = 3000
    stages: int = 2
    dp: int = 2
    micro_batches: int = 2
    window: int = 0  # "accumulation_window"; 0: DeepSpeed's gradient_accumulation_steps (one local step per call)
    eval_every: int = 100
    save_every: int = 500
    sample_every: int = 25
    keep: int = 2
    checkpoint_dir: str = ""
    n_layer: int = 4
    n_embd: int = 32
    seed: int = 11


def rss_kib() -> int:
    """This process's resident set in KiB (``VmRSS`` of ``/proc/self/status``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS line in /proc/self/status (the soak benchmark needs Linux)")


def ds_config(job: SoakJob) -> dict:
    """DeepSpeed config of the soak run: PACI async with the look-ahead, DeepSpeed's AdamW, fp32."""
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": job.micro_batches,
        "steps_per_print": 10**9,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True, "weight_decay": 0.01}},
        "paci": {"enabled": True, "lookahead": True, "watchdog_seconds": 300,
                 **({"accumulation_window": job.window} if job.window else {})},
    }


def build_engine(job: SoakJob, seed: int):
    """The tied tiny GPT-2 on ``job.stages`` stages (DP = world / stages), wrapped by ``ds_paci.initialize``."""
    import ds_paci
    from ds_paci.workload.gpt2 import gpt2_config, gpt2_pipeline
    cfg = gpt2_config("tiny", vocab_size=257, n_positions=SEQ_LEN, n_embd=job.n_embd, n_layer=job.n_layer, n_head=2)
    model = gpt2_pipeline(cfg, num_stages=job.stages, seed=seed, tie_embeddings=True)
    engine, *_ = ds_paci.initialize(model=model, model_parameters=model.parameters(), config=ds_config(job))
    return engine


def _data(engine, job: SoakJob):
    """Training iterator and validation micro-batches for this rank (``None`` on stages that read no data)."""
    from ds_paci.workload.data import ByteTokenizer, MicroBatchIterator, encode_documents, load_corpus
    if not (engine.is_first_stage() or engine.is_last_stage()):
        return None, [None] * job.micro_batches
    docs = load_corpus()
    train = encode_documents(docs[:6], ByteTokenizer())
    val = encode_documents(docs[-1:], ByteTokenizer())
    dp, dp_size = engine.grid.data_parallel_id, engine.grid.data_parallel_size
    train_iter = MicroBatchIterator(train, MICRO_BATCH, SEQ_LEN, seed=job.seed, dp_rank=dp, dp_size=dp_size)
    val_iter = MicroBatchIterator(val, MICRO_BATCH, SEQ_LEN, seed=job.seed + 1, dp_rank=dp, dp_size=dp_size)
    return train_iter, [next(val_iter) for _ in range(job.micro_batches)]


def _tied_transfers(engine) -> dict:
    tied = engine.paci_stats()["tied"] or {}
    return {"pending_sends": tied.get("pending_sends", 0), "pending_receives": tied.get("pending_receives", 0)}


def _prune(save_dir: str, keep: int) -> None:
    """Remove all but the newest ``keep`` soak checkpoints (tags sort by call index); never the one ``latest`` names."""
    from ds_paci.core.checkpoint.atomic import read_latest
    latest = read_latest(save_dir)
    tags = sorted(d for d in os.listdir(save_dir) if d.startswith(TAG_PREFIX))
    for tag in tags[:-keep]:
        if tag != latest:
            shutil.rmtree(os.path.join(save_dir, tag), ignore_errors=True)


def _save(engine, save_dir: str, call: int, keep: int, suffix: str = "") -> str:
    tag = f"{TAG_PREFIX}{call:07d}{suffix}"
    engine.save_checkpoint(save_dir, tag=tag, client_state={"calls": call})
    if engine.global_rank == 0:  # the save ended with a barrier: nobody reads the older folders any more
        _prune(save_dir, keep)
    return tag


def train_and_sample(engine, job: SoakJob, train_iter, val_batches) -> dict:
    """The soak loop: ``job.calls`` train calls with evaluations, saves and a sample every ``sample_every`` calls."""
    samples, evals, saves = [], [], []
    train_seconds = 0.0
    last_wall, last_call, last_train = time.time(), 0, 0.0
    for call in range(1, job.calls + 1):
        began = time.perf_counter()
        engine.train_batch(train_iter)
        train_seconds += time.perf_counter() - began
        if job.eval_every and call % job.eval_every == 0:
            evals.append([call, float(engine.eval_batch(iter(val_batches)))])
        if job.save_every and call % job.save_every == 0:
            saves.append(_save(engine, job.checkpoint_dir, call, job.keep))
        if call % job.sample_every == 0 or call == job.calls:
            now, n = time.time(), call - last_call
            samples.append({"call": call, "wall": now, "rss_kib": rss_kib(), "gc_objects": len(gc.get_objects()),
                            "load1": os.getloadavg()[0],
                            **_tied_transfers(engine), "s_per_call": (now - last_wall) / n,
                            "train_s_per_call": (train_seconds - last_train) / n})
            last_wall, last_call, last_train = now, call, train_seconds
    return {"samples": samples, "evals": evals, "saves": saves}


def _weights(engine) -> dict:
    return {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}


def check_resume(engine, job: SoakJob) -> dict:
    """Drain, save a last checkpoint, load ``latest`` into a fresh engine (other seed) and compare the weights."""
    engine.drain()
    tag = _save(engine, job.checkpoint_dir, job.calls, job.keep, suffix="-final")
    trained = _weights(engine)
    stats = engine.paci_stats()
    engine.destroy()
    fresh = build_engine(job, seed=job.seed + 1000)
    loaded, client = fresh.load_checkpoint(job.checkpoint_dir)
    again = _weights(fresh)
    matches = trained.keys() == again.keys() and all(bool((trained[k] == again[k]).all()) for k in trained)
    fresh.destroy()
    folder = os.path.dirname(loaded) if loaded and os.path.isfile(loaded) else loaded  # DeepSpeed returns a file
    return {"final_tag": tag, "loaded": os.path.basename(os.path.normpath(folder)) if folder else None,
            "loaded_calls": (client or {}).get("calls"), "resume_matches": matches, "stats": stats}


def soak_rank(rank: int, job: SoakJob) -> dict:
    """Body of one rank: build, soak, check the resume; returns plain JSON data."""
    import torch
    torch.manual_seed(job.seed)
    engine = build_engine(job, seed=job.seed)
    train_iter, val_batches = _data(engine, job)
    coords = {"rank": rank, "stage": engine.stage_id, "dp": engine.grid.data_parallel_id,
              "rss_kib_start": rss_kib()}
    run = train_and_sample(engine, job, train_iter, val_batches)
    tied = engine.paci_stats()["tied"] or {}
    coords.update(lag_windows=tied.get("lag_windows"), tied_owner=bool(tied.get("owner")),
                  max_pending_sends=tied.get("max_pending_sends", 0),
                  max_pending_receives=tied.get("max_pending_receives", 0))
    return {**coords, **run, **check_resume(engine, job)}


def _median_of(samples: list, key: str):
    return statistics.median(s[key] for s in samples) if samples else None


def summarize_rank(result: dict, calls: int) -> dict:
    """The per-rank figures of the module docstring from one rank's result."""
    samples = result["samples"]
    at10 = next(s for s in samples if s["call"] >= calls / 10)
    end = samples[-1]
    tenth = max(1, len(samples) // 10)
    lag = result["lag_windows"]
    return {
        "rank": result["rank"], "stage": result["stage"], "dp": result["dp"], "tied_owner": result["tied_owner"],
        "rss_mib_start": round(result["rss_kib_start"] / 1024, 1),
        "call_at_10pct": at10["call"], "rss_mib_at_10pct": round(at10["rss_kib"] / 1024, 1),
        "rss_mib_end": round(end["rss_kib"] / 1024, 1),
        "rss_growth_pct": round(100.0 * (end["rss_kib"] / at10["rss_kib"] - 1.0), 2),
        "gc_objects_at_10pct": at10["gc_objects"], "gc_objects_end": end["gc_objects"],
        "lag_windows": lag, "pending_bound": None if lag is None else lag + 1,
        "max_pending_sends": max([result["max_pending_sends"]] + [s["pending_sends"] for s in samples]),
        "max_pending_receives": max([result["max_pending_receives"]] + [s["pending_receives"] for s in samples]),
        "median_s_per_call_first_10pct": _median_of(samples[:tenth], "s_per_call"),
        "median_s_per_call_last_10pct": _median_of(samples[-tenth:], "s_per_call"),
        "median_train_s_per_call_first_10pct": _median_of(samples[:tenth], "train_s_per_call"),
        "median_train_s_per_call_last_10pct": _median_of(samples[-tenth:], "train_s_per_call"),
        "median_load1_first_10pct": _median_of(samples[:tenth], "load1"),
        "median_load1_last_10pct": _median_of(samples[-tenth:], "load1"),
        "resume_matches": result["resume_matches"], "loaded": result["loaded"],
    }


def summary_line(s: dict) -> str:
    return (f"rank {s['rank']} (stage {s['stage']}, dp {s['dp']}): RSS {s['rss_mib_at_10pct']:.1f} MiB at call "
            f"{s['call_at_10pct']} -> {s['rss_mib_end']:.1f} MiB at the end ({s['rss_growth_pct']:+.2f}%), "
            f"tied in flight max {s['max_pending_sends']} sends / {s['max_pending_receives']} receives per peer "
            f"(bound {s['pending_bound']}), s/call {s['median_s_per_call_first_10pct']:.4f} first 10% -> "
            f"{s['median_s_per_call_last_10pct']:.4f} last 10%, "
            f"resume {'matches' if s['resume_matches'] else 'DIFFERS'}")


def _commit() -> str | None:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def run_soak(job: SoakJob, *, log_dir: str | None = None, timeout: float = 3600.0) -> dict:
    """Run the soak world; returns ``{"job", "commit", "started", "seconds", "load_avg", "ranks", "summary"}``."""
    from ds_paci.tools.processes.world import run_world
    started, load_start, commit = time.time(), os.getloadavg(), _commit()
    results = run_world(soak_rank, job.stages * job.dp, job, timeout=timeout, log_dir=log_dir,
                        gloo_timeout_s=min(timeout, 600))
    for r in results:
        r["stats"] = {k: r["stats"].get(k) for k in ("train_batch_calls", "drains", "skipped_steps", "tied",
                                                  "lookahead")}
    return {"job": asdict(job), "seq_len": SEQ_LEN, "micro_batch": MICRO_BATCH, "commit": commit,
            "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
            "seconds": round(time.time() - started, 1), "load_avg": {"start": load_start, "end": os.getloadavg()},
            "ranks": results, "summary": [summarize_rank(r, job.calls) for r in results]}


def _problem(a) -> str | None:
    for name in ("calls", "stages", "dp", "micro_batches", "sample_every", "keep", "n_layer", "n_embd"):
        if getattr(a, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}"
    for name in ("eval_every", "save_every", "window"):
        if getattr(a, name) < 0:
            return f"--{name.replace('_', '-')} must be >= 0 (0: never), got {getattr(a, name)}"
    if a.stages < 2:
        return f"--stages must be >= 2 (the tied embedding spans the first and last stage), got {a.stages}"
    if a.n_layer < a.stages:
        return f"--n-layer ({a.n_layer}) must be >= --stages ({a.stages}): every stage holds a block"
    if a.calls < 10 * a.sample_every:
        return f"--calls ({a.calls}) must be >= 10 x --sample-every ({a.sample_every}) to have a sample at 10%"
    if a.checkpoint_dir and os.path.exists(a.checkpoint_dir) and not os.path.isdir(a.checkpoint_dir):
        return f"--checkpoint-dir {a.checkpoint_dir} is not a directory"
    return None


def parse_args(argv=None):
    d = SoakJob()
    ap = argparse.ArgumentParser(prog="python -m ds_paci.tools.studies.soak", description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=d.calls, help="train_batch calls (default %(default)s)")
    ap.add_argument("--stages", type=int, default=d.stages, help="pipeline stages (default %(default)s)")
    ap.add_argument("--dp", type=int, default=d.dp, help="data-parallel replicas (default %(default)s; 1: none)")
    ap.add_argument("--micro-batches", type=int, default=d.micro_batches, help="micro-batches per call")
    ap.add_argument("--window", type=int, default=d.window,
                    help="PACI accumulation_window a (default: --micro-batches, one local step per call)")
    ap.add_argument("--eval-every", type=int, default=d.eval_every, help="calls between eval_batch (0: never)")
    ap.add_argument("--save-every", type=int, default=d.save_every, help="calls between saves (0: never)")
    ap.add_argument("--sample-every", type=int, default=d.sample_every, help="calls between samples")
    ap.add_argument("--keep", type=int, default=d.keep, help="checkpoints kept on disk (default %(default)s)")
    ap.add_argument("--n-layer", type=int, default=d.n_layer)
    ap.add_argument("--n-embd", type=int, default=d.n_embd)
    ap.add_argument("--checkpoint-dir", default="", help="where the saves go (default: a temporary folder)")
    ap.add_argument("--out", help="write the result (JSON) here")
    ap.add_argument("--log-dir", help="per-rank logs (default: a temporary folder)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds before the world is killed")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    problem = _problem(a)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    own_dir = not a.checkpoint_dir
    save_dir = a.checkpoint_dir or tempfile.mkdtemp(prefix="ds_paci_soak_")
    os.makedirs(save_dir, exist_ok=True)
    job = SoakJob(calls=a.calls, stages=a.stages, dp=a.dp, micro_batches=a.micro_batches, window=a.window,
                  eval_every=a.eval_every,
                  save_every=a.save_every, sample_every=a.sample_every, keep=a.keep, checkpoint_dir=save_dir,
                  n_layer=a.n_layer, n_embd=a.n_embd)
    from ds_paci.tools.processes.world import WorldFailure
    try:
        result = run_soak(job, log_dir=a.log_dir, timeout=a.timeout)
    except WorldFailure as failure:
        print(f"soak failed:\n{failure}", file=sys.stderr)
        return 1
    finally:
        if own_dir:
            shutil.rmtree(save_dir, ignore_errors=True)
    result["command"] = "python -m ds_paci.tools.studies.soak " + " ".join(argv if argv is not None else sys.argv[1:])
    for s in result["summary"]:
        print(summary_line(s), flush=True)
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1, default=str)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
