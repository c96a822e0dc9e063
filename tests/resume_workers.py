"""Per-rank bodies of the resume matrix (issue 28): a checkpoint saved with an open window, resumed into engines that
differ from the saving one in one thing at a time.

Real DeepSpeed engines over gloo on the tests' tanh MLP (``tests/mlp.py``). Every function takes the rank first and
returns plain data. A case that expects a refusal (:func:`attempt_refused`) trains the engine one call first (so
micro-batches are in flight and the weights are its own), tries the load, records the exception, what changed and how
long it took, then trains one more call: a refused load must leave the engine as it was, on every rank.
"""

import math
import os
import time

import torch

MICRO = 2
NAN_AT = (1, 4)  # micro-batches (per replica, in the order it consumes them) whose inputs hold a NaN
SAVE_AT = 2  # calls before the save: with a = 3, M = 2 the window holds 1 micro-batch (4 = 3 + 1)
CALLS = 6


def micro_batches(n, bf16=False, nan_at=NAN_AT, seed=3):
    from mlp import regression_batches
    gen = regression_batches(MICRO, seed=seed)
    out = []
    for k in range(n):
        x, y = next(gen)
        if k in nan_at:
            x = x.clone()
            x[0, 0] = float("nan")
        out.append((x.bfloat16(), y.bfloat16()) if bf16 else (x, y))
    return out


class Data:
    """Each replica's micro-batches: call ``c`` of replica ``d`` takes its ``M`` next ones (the same sequence for
    every replica, so a NaN reaches every replica's window alike)."""

    def __init__(self, bf16=False, nan_at=NAN_AT):
        self.batches = micro_batches(64, bf16=bf16, nan_at=nan_at)
        self.used = 0

    def call(self, engine):
        n = engine.micro_batches
        chunk = self.batches[self.used:self.used + n]
        self.used += n
        return iter(chunk)


def build(stages, gas, paci=None, seed=7, tied=False, path="configured", layers=4, **extra):
    """The MLP on ``stages`` stages. ``path``: ``configured`` (DeepSpeed's fp32 AdamW), ``offload`` (bf16, ZeRO-1 with
    its optimizer on the CPU, fp32 gradient accumulation: DeepSpeed keeps the window in ``param.grad_accum``),
    ``bf16_zero1`` (the same without the offload: DeepSpeed's ``BF16_Optimizer``)."""
    import ds_paci
    from mlp import mlp_pipeline
    from workers import ds_config
    model = mlp_pipeline(stages, layers=layers, seed=seed, tied=tied)
    bf16 = path in ("offload", "bf16_zero1")
    cfg = ds_config(gas, {"enabled": True, "watchdog_seconds": 60, **(paci or {})}, optimizer=False, bf16=bf16,
                    **extra)
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}}
    if path == "configured":
        cfg["optimizer"]["params"]["torch_adam"] = True
    if bf16:
        cfg["zero_optimization"] = {"stage": 1}
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    if path == "offload":
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                       "warmup_num_steps": 1000, "warmup_type": "linear"}}
    engine, *_ = ds_paci.initialize(model=model, config=cfg, model_parameters=model.parameters())
    return engine


def weights(engine):
    return {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}


def same_weights(a, b):
    return a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def record(engine, loss):
    stats = engine.paci_stats()
    return {"loss": repr(float(loss)), "global_steps": engine.global_steps, "version": engine.weight_version,
            "window_fill": stats["window_fill"], "lr_count": engine.lr_scheduler.last_batch_iteration + 1,
            "skipped_steps": stats["skipped_steps"], "consecutive_skips": stats["consecutive_skips"]}


def position(engine):
    """Everything a refused load must leave as it was (besides the weights)."""
    stats = engine.paci_stats()
    keys = ("version", "window_fill", "lr_steps", "ticks", "in_flight", "next_micro_batch", "skipped_steps",
            "consecutive_skips")
    return {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
            "lr_count": engine.lr_scheduler.last_batch_iteration + 1, **{k: stats[k] for k in keys}}


def run(engine, data, calls):
    return [record(engine, engine.train_batch(data.call(engine))) for _ in range(calls)]


def finish(engine, records):
    engine.drain()
    out = {"records": records, "weights": weights(engine), "stage": engine.stage_id, "last": engine.is_last_stage(),
           "end": record(engine, 0.0)}
    engine.destroy()
    return out


def attempt_refused(engine, data, load_dir, tag, **kwargs):
    """Train one call, try the load, train one more call (see the module docstring)."""
    engine.train_batch(data.call(engine))
    before, where = weights(engine), position(engine)
    start = time.monotonic()
    try:
        engine.load_checkpoint(load_dir, tag=tag, **kwargs)
        error = None
    except Exception as e:  # noqa: BLE001 (the test asserts which)
        error = f"{type(e).__name__}: {e}"
    seconds = time.monotonic() - start
    out = {"error": error, "seconds": seconds, "weights_kept": same_weights(before, weights(engine)),
           "position_before": where, "position_after": position(engine), "stage": engine.stage_id}
    if error is not None:
        engine.train_batch(data.call(engine))  # the engine goes on as if nothing had been tried
        out["trained_after"] = True
    engine.destroy()
    return out


def saved_run(directory, stages, gas, paci, calls_before, calls_after, **build_kw):
    """The uninterrupted run: ``calls_before`` calls, a save with the window open (tag ``open``), ``calls_after`` more
    calls and a closing drain. Returns its records, weights at the save and at the end."""
    data = Data(bf16=build_kw.get("path") in ("offload", "bf16_zero1"))
    engine = build(stages, gas, paci, **build_kw)
    run(engine, data, calls_before)
    engine.save_checkpoint(directory, tag="open", client_state={"used": data.used})
    saved = {"fill": engine.paci_stats()["window_fill"], "weights": weights(engine), "used": data.used,
             "tied": (engine.paci_stats()["tied"] or {}).get("pending_windows")}
    out = finish(engine, run(engine, data, calls_after))
    return {**out, "saved": saved}


def resumed_run(directory, stages, gas, paci, calls_after, used, load_module_only=False, **build_kw):
    """A fresh engine (another initialisation) loads ``directory``/open and trains ``calls_after`` calls."""
    data = Data(bf16=build_kw.get("path") in ("offload", "bf16_zero1"))
    data.used = used
    engine = build(stages, gas, paci, seed=99, **build_kw)
    engine.load_checkpoint(directory, tag="open", load_module_only=load_module_only)
    return finish(engine, run(engine, data, calls_after))


def fresh_from_weights(stages, gas, paci, calls_after, used, saved_weights, **build_kw):
    """What ``load_module_only`` means: a fresh engine whose weights are the checkpoint's, nothing else."""
    data = Data(bf16=build_kw.get("path") in ("offload", "bf16_zero1"))
    data.used = used
    engine = build(stages, gas, paci, seed=99, **build_kw)
    with torch.no_grad():
        for name, p in engine.module.state_dict().items():
            p.copy_(saved_weights[name])
    return finish(engine, run(engine, data, calls_after))


# -- the worlds ------------------------------------------------------------------------------------------------------
def two_ranks(rank, root):
    """P = 2, DP = 1: DeepSpeed's window in ``param.grad_accum`` (offload), tied weights whose lag changes with the
    window, ``load_module_only`` with tied windows pending, tied <-> untied; and a P = 2 x DP = 1 checkpoint with an
    open window for the four-rank world (a change of the data-parallel size)."""
    out = {}
    base = {"accumulation_window": 3}
    # DeepSpeed's window in param.grad_accum: the same engine resumes exactly; without the offload it is refused
    offload = os.path.join(root, "offload")
    out["offload_ref"] = saved_run(offload, 2, 2, base, SAVE_AT, 3, path="offload")
    used = out["offload_ref"]["saved"]["used"]
    out["offload_same"] = resumed_run(offload, 2, 2, base, 3, used, path="offload")
    out["offload_removed"] = attempt_refused(build(2, 2, base, seed=99, path="bf16_zero1"), Data(bf16=True),
                                             offload, "open")
    # an untied P = 2 x DP = 1 checkpoint with an open window (fp32), loaded by the four-rank world with DP = 2
    plain = os.path.join(root, "p2dp1")
    out["plain_ref"] = saved_run(plain, 2, 2, base, SAVE_AT, 1)
    # tied weights, a = M = 1: the lag L = ceil(P / a) = 2, windows pending at the save
    tied = os.path.join(root, "tied")
    data = Data(nan_at=())
    engine = build(2, 1, {}, tied=True)
    run(engine, data, 5)
    engine.save_checkpoint(tied, tag="open", client_state={"used": data.used})
    out["tied_pending"] = engine.paci_stats()["tied"]["pending_windows"]
    saved_weights, used = weights(engine), data.used
    engine.set_train_batch_size(2 * MICRO)  # M = 2, so a = 2 and L = 1: the uninterrupted run's catch-up
    out["tied_ref"] = finish(engine, run(engine, data, 4))
    data = Data(nan_at=())
    data.used = used
    engine = build(2, 2, {}, tied=True, seed=99)
    start = time.monotonic()
    try:
        engine.load_checkpoint(tied, tag="open")
        out["tied_m2"] = finish(engine, run(engine, data, 4))
    except Exception as e:  # noqa: BLE001 (a refusal is allowed: on every rank, quickly)
        out["tied_m2"] = {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - start}
        engine.destroy()
    # load_module_only: no pending tied window, open window or counter of the old run
    out["tied_module_only"] = resumed_run(tied, 2, 1, {}, 3, used, load_module_only=True, tied=True)
    out["tied_fresh"] = fresh_from_weights(2, 1, {}, 3, used, saved_weights, tied=True)
    # tied <-> untied
    out["tied_into_untied"] = attempt_refused(build(2, 1, {}, seed=99), Data(nan_at=()), tied, "open")
    out["untied_into_tied"] = attempt_refused(build(2, 2, base, seed=99, tied=True), Data(), plain, "open")
    return out


def four_ranks(rank, root, p2dp1):
    """P = 2 x DP = 2 (a = 3, M = 2, NaN micro-batches before and after the save), resumed unchanged, with another
    window, load_module_only, on 4 stages, on DP = 2 from a DP = 1 checkpoint; P = 4 with "auto", M 10 -> 1."""
    out = {}
    base = {"accumulation_window": 3}
    ckpt = os.path.join(root, "p2dp2")
    out["ref"] = saved_run(ckpt, 2, 2, base, SAVE_AT, CALLS - SAVE_AT)
    used = out["ref"]["saved"]["used"]
    out["same"] = resumed_run(ckpt, 2, 2, base, CALLS - SAVE_AT, used)
    out["window"] = attempt_refused(build(2, 2, {"accumulation_window": 2}, seed=99), Data(), ckpt, "open")
    out["module_only"] = resumed_run(ckpt, 2, 2, base, CALLS - SAVE_AT, used, load_module_only=True)
    out["fresh"] = fresh_from_weights(2, 2, base, CALLS - SAVE_AT, used, out["ref"]["saved"]["weights"])
    out["stages"] = attempt_refused(build(4, 2, base, seed=99), Data(), ckpt, "open")
    out["dp"] = attempt_refused(build(2, 2, base, seed=99), Data(), p2dp1, "open")
    # "auto" on P = 4: M = 10 gives a = ceil(10/3) = 4 on every stage (2 micro-batches open after one call);
    # M = 1 gives a = 3 on every stage
    auto = os.path.join(root, "auto")
    engine = build(4, 10, {"accumulation_window": "auto", "sync_warmup_calls": 0})
    data = Data(nan_at=())
    run(engine, data, 1)
    engine.save_checkpoint(auto, tag="open")
    out["auto_saved"] = (engine.accumulation_window, engine.paci_stats()["window_fill"])
    engine.destroy()
    engine = build(4, 1, {"accumulation_window": "auto", "sync_warmup_calls": 0}, seed=99)
    out["auto_window"] = engine.accumulation_window
    out["auto"] = attempt_refused(engine, Data(nan_at=()), auto, "open")
    return out


def isnan_repr(text):
    return math.isnan(float(text))
