"""Per-rank bodies of the counter, carried-window and collective-guard tests (issue 16, items 6 and 8).

Real DeepSpeed engines over gloo on the tests' tanh MLP; each function takes the rank first and returns plain data.
"""

import os

import torch

MICRO = 2


def batches(n, bf16=False, seed=3):
    from mlp import regression_batches
    gen = regression_batches(MICRO, seed=seed)
    out = [next(gen) for _ in range(n)]
    return [(x.bfloat16(), y.bfloat16()) for x, y in out] if bf16 else out


def mlp_engine(stages, gas, paci, path="configured", seed=7, tied=False, layers=None, **extra):
    """The tanh MLP on ``stages`` stages with one optimizer path and a linear warm-up LR schedule (its count is
    ``lr_scheduler.last_batch_iteration + 1``)."""
    import ds_paci
    from mlp import mlp_pipeline
    from workers import ds_config
    model = mlp_pipeline(stages, layers=layers or 2 * stages, seed=seed, tied=tied)
    cfg = ds_config(gas, {"enabled": True, **paci}, optimizer=False, bf16=path == "bf16", **extra)
    if path == "zero1":
        cfg["zero_optimization"] = {"stage": 1}
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                       "warmup_num_steps": 1000, "warmup_type": "linear"}}
    if path == "torch.optim":
        kwargs = {"optimizer": torch.optim.AdamW(model.parameters(), lr=0.01)}
    else:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}}
        kwargs = {"model_parameters": model.parameters()}
    engine, *_ = ds_paci.initialize(model=model, config=cfg, **kwargs)
    return engine


def lr_count(engine):
    return engine.lr_scheduler.last_batch_iteration + 1


def weights(engine):
    return {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}


def _record(engine, loss):
    return {"loss": float(loss), "global_steps": engine.global_steps, "global_samples": engine.global_samples,
            "lr_count": lr_count(engine), "version": engine.weight_version,
            "window_fill": engine.paci_stats().get("window_fill"), "age": engine.paci_stats()["loss_age"],
            "micro_batches": engine.paci_stats()["micro_batches"]}


def drains_do_not_change_training(rank, save_dir, csv_dir, calls=12, save_at=5):
    """P = 4, M = 1, ``"auto"`` (a = 3), a weight tied between stage 0 and 3, DeepSpeed's AdamW with the look-ahead.

    ``reference``: ``calls`` calls, then a drain. ``evaluated``: the same with ``eval_batch`` after every call and
    a checkpoint (default tag) after call ``save_at``, with a window open. ``resumed``: a fresh engine (other init)
    loads that checkpoint and goes on as ``evaluated`` did.
    """
    data = batches(calls)
    val = batches(1, seed=11)
    monitor = {"csv_monitor": {"enabled": True, "output_path": csv_dir, "job_name": "reference"}}
    out = {}
    engine = mlp_engine(4, 1, {"accumulation_window": "auto", "sync_warmup_calls": 0}, tied=True, layers=4, **monitor)
    out["window"] = engine.accumulation_window
    out["reference"] = [_record(engine, engine.train_batch(iter([data[k]]))) for k in range(calls)]
    engine.drain(close_window=False)  # as eval_batch drains; a = 3 divides the 12 micro-batches: nothing left open
    out["reference_end"] = _record(engine, float("nan"))
    out["tbs"] = engine.train_batch_size()
    engine.destroy()

    def evaluated(engine, first):
        records = []
        for k in range(first, calls):
            records.append(_record(engine, engine.train_batch(iter([data[k]]))))
            records[-1]["eval"] = float(engine.eval_batch(iter(val)))
            records[-1]["after_eval"] = _record(engine, float("nan"))
            if k + 1 == save_at and first == 0:
                engine.save_checkpoint(save_dir, client_state={"calls": k + 1})
                out["saved_fill"] = engine.paci_stats().get("window_fill")
        end = {"weights": weights(engine), "drains": engine.paci_stats()["drains"],
               "copy_checks": engine.paci_stats()["tied"]["copy_checks"], **_record(engine, float("nan"))}
        return records, end

    engine = mlp_engine(4, 1, {"accumulation_window": "auto", "sync_warmup_calls": 0}, tied=True, layers=4)
    out["evaluated"], out["evaluated_end"] = evaluated(engine, 0)
    engine.destroy()

    engine = mlp_engine(4, 1, {"accumulation_window": "auto", "sync_warmup_calls": 0}, tied=True, layers=4, seed=99)
    _, client = engine.load_checkpoint(save_dir)
    out["resumed_from"] = (client["calls"], engine.global_steps, engine.paci_stats().get("window_fill"))
    out["resumed"], out["resumed_end"] = evaluated(engine, client["calls"])
    out["stage"] = engine.stage_id
    engine.destroy()
    return out


PATHS = ("torch.optim", "configured", "bf16", "zero1")


def every_path_checked_and_resumed(rank, save_dir, paths=PATHS):
    """PP = 2 x DP = 2, a = 3, M = 2, with DS_PACI_CHECK_COLLECTIVES=1: per optimizer path, the first local step's
    collectives (checked, recorded), and a checkpoint taken with an open window resumed by a fresh engine."""
    out = {}
    for path in paths:
        bf16 = path == "bf16"
        data = batches(8 * 2 * 2, bf16=bf16)

        def feed(engine, call):
            dp, n = engine.grid.data_parallel_id, engine.micro_batches
            return iter(data[(call * 2 + dp) * n:(call * 2 + dp + 1) * n])

        engine = mlp_engine(2, 2, {"accumulation_window": 3}, path=path)
        first = [float(engine.train_batch(feed(engine, c))) for c in range(2)]
        engine.save_checkpoint(os.path.join(save_dir, path), tag="open", client_state={"calls": 2})
        fill = engine.paci_stats().get("window_fill")
        after = [_record(engine, engine.train_batch(feed(engine, c))) for c in range(2, 5)]
        engine.drain()
        result = {"optimizer": type(engine.optimizer).__name__, "fill": fill, "first": first, "after": after,
                  "weights": weights(engine), "check": engine.paci_stats().get("collective_check"),
                  "stage": engine.stage_id, "dp": engine.grid.data_parallel_id,
                  "stage_ranks": engine.grid._topo.filter_match(pipe=engine.stage_id)}
        engine.destroy()
        if path == "bf16":
            # DeepSpeed 0.19.8's own engine cannot load a BF16_Optimizer (ZeRO stage 0) checkpoint (KeyError in
            # _load_legacy_checkpoint; the stock engine too): take the open window out and put it back instead
            from ds_paci.core.step import window_state
            engine = mlp_engine(2, 2, {"accumulation_window": 3}, path=path)
            for c in range(2):
                engine.train_batch(feed(engine, c))
            engine.drain(close_window=False)
            state = window_state.capture(engine)
            window_state.discard(engine)
            window_state.restore(engine, state, "the test's capture")
        else:
            engine = mlp_engine(2, 2, {"accumulation_window": 3}, path=path, seed=99)
            engine.load_checkpoint(os.path.join(save_dir, path), tag="open")
        result["resumed"] = [_record(engine, engine.train_batch(feed(engine, c))) for c in range(2, 5)]
        engine.drain()
        result["resumed_weights"] = weights(engine)
        engine.destroy()
        out[path] = result
    return out


def unconfined_bf16_wrapper(rank):
    """BF16_Optimizer handed the pipeline's own grid again (as a DeepSpeed that ignores ``mpu`` would): its norm
    all-reduce spans both stages. With the check forced on, the first local step refuses it."""
    engine = mlp_engine(2, 2, {"watchdog_seconds": 60}, path="bf16")
    engine.optimizer.mpu = engine.grid  # undo PACI's stage-local view: the global model-parallel group
    data = batches(16, bf16=True)
    for c in range(4):
        engine.train_batch(iter(data[2 * c:2 * c + 2]))
    return "trained"
