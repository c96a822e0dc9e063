"""Per-rank bodies of the tied-weight fault, clipping and transfer tests (issue 16), run through ``harness.run_world``."""

import gc
import weakref

import torch
import torch.distributed as tdist

import ds_paci
from contract_workers import poison_loss
from mlp import mlp_pipeline, regression_batches
from spy import group_token, record_distributed_calls
from workers import (MICRO, SEQ, MicroBatchIterator, ds_config, record_tied_digests, shakespeare_tokens, stage_of_rank,
                     stage_weights, tied_state, tiny_gpt)


def _optimizer_kwargs(case, model, cfg, lr):
    """The optimizer of a test case: a client torch.optim.AdamW, or DeepSpeed's configured AdamW (fp32, BF16
    wrapper or ZeRO-1 by the rest of the config)."""
    if case == "torch.optim":
        return {"optimizer": torch.optim.AdamW(model.parameters(), lr=lr)}
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": lr, "torch_adam": True}}
    return {"model_parameters": model.parameters()}


def _config(case, gas, window, clip):
    paci = {"enabled": True, "watchdog_seconds": 120}
    if window:
        paci["accumulation_window"] = window
    cfg = ds_config(gas, paci, optimizer=False, bf16=case == "bf16", gradient_clipping=clip)
    if case == "zero1":
        cfg["zero_optimization"] = {"stage": 1}
    return cfg


def _run(engine, data, calls):
    """Train ``calls`` calls recording what every call reports, then drain; returns the records and the spy's calls."""
    digests = record_tied_digests(engine)
    records = []
    with record_distributed_calls() as calls_made:
        for _ in range(calls):
            loss = engine.train_batch(data)
            records.append({"loss": float(loss), "applied": engine.was_step_applied(),
                            "skipped": engine.paci_stats()["skipped_steps"], "lr": engine.get_lr()[0]})
        before = engine.paci_stats()
        engine.drain()
    return records, digests, calls_made, before


def _summary(engine, records, digests, calls_made, before):
    tied = getattr(engine, "_tied", None)
    return {"records": records, "digests": digests, "calls": calls_made, "stats_before_drain": before,
            "stats": engine.paci_stats(), "stage": engine.stage_id, "dp": engine.grid.data_parallel_id,
            "stage_of_rank": stage_of_rank(engine), "tied": tied_state(engine),
            "loss_channel_group": group_token(engine._channel.group),
            "finite": all(bool(torch.isfinite(w).all()) for w in stage_weights(engine).values()),
            "optimizer": type(engine.optimizer).__name__, "global_steps": engine.global_steps,
            "owner": tied is not None and bool(tied.exchanges)}


def tied_mlp_nonfinite(rank, stages, gas, calls, bad, cases, clip, resume_dir=None):
    """The tied MLP (first and last layer's weight tied), one NaN micro-batch ``bad``, per optimizer case.

    ``resume_dir``: for the "zero1" case, save after the drain, load into a fresh engine and train on.
    """
    out = {}
    for case in cases:
        model = poison_loss(mlp_pipeline(stages, layers=2 * stages, tied=True), bad)
        cfg = _config(case, gas, None, clip)
        engine, *_ = ds_paci.initialize(model=model, config=cfg, **_optimizer_kwargs(case, model, cfg, 0.01))
        data = regression_batches(MICRO)
        if case == "bf16":
            data = ((x.bfloat16(), y.bfloat16()) for x, y in data)
        out[case] = _summary(engine, *_run(engine, data, calls))
        if resume_dir is not None and case == "zero1":
            engine.save_checkpoint(resume_dir, tag="after-nan")
            fresh = mlp_pipeline(stages, layers=2 * stages, tied=True)
            again, *_ = ds_paci.initialize(model=fresh, config=cfg, **_optimizer_kwargs(case, fresh, cfg, 0.01))
            again.load_checkpoint(resume_dir, tag="after-nan")  # the tied-copy check runs after the load
            losses = [float(again.train_batch(data)) for _ in range(2)]
            again.drain()
            out[case]["resumed"] = {"losses": losses, "tied": tied_state(again),
                                    "checks": again.paci_stats()["tied"]["copy_checks"]}
            again.destroy()
        engine.destroy()
    return out


def tied_gpt_nonfinite(rank, stages, gas, window, calls, bad, clip):
    """The tied tiny GPT (embedding on the first stage, LM head on the last), one NaN micro-batch, clipping on."""
    model = poison_loss(tiny_gpt(stages, tie=True), bad)
    cfg = _config("configured-AdamW", gas, window, clip)
    engine, *_ = ds_paci.initialize(model=model, config=cfg, **_optimizer_kwargs("AdamW", model, cfg, 3e-3))
    data = MicroBatchIterator(shakespeare_tokens(), MICRO, 32, seed=5)
    return _summary(engine, *_run(engine, data, calls))


def tied_dp_nonfinite(rank, gas, calls, bad, clip):
    """PP = 2 x DP = 2, ZeRO-1, tied MLP: the NaN micro-batch reaches data-parallel replica 0 only."""
    model = mlp_pipeline(2, layers=4, tied=True)
    cfg = _config("zero1", gas, None, clip)
    engine, *_ = ds_paci.initialize(model=model, config=cfg, **_optimizer_kwargs("zero1", model, cfg, 0.01))
    if engine.grid.data_parallel_id == 0:
        poison_loss(engine.module, bad)
    data = regression_batches(MICRO, seed=3 + engine.grid.data_parallel_id)
    return _summary(engine, *_run(engine, data, calls))


def tied_mlp_clipping(rank, stages, layers, gas, window, calls, lr, clip):
    """SGD on the tied MLP with ``gradient_clipping`` = ``clip`` (async): the weights, to compare by hand."""
    model = mlp_pipeline(stages, layers=layers, tied=True)
    cfg = ds_config(gas, {"enabled": True, "accumulation_window": window}, gradient_clipping=clip, optimizer=False)
    engine, *_ = ds_paci.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr), config=cfg)
    data = regression_batches(MICRO)
    for _ in range(calls):
        engine.train_batch(data)
    engine.drain()
    return {"weights": stage_weights(engine), "stats": engine.paci_stats(),
            "layers": (engine.module._local_start, engine.module._local_stop)}


def tied_sends_without_drain(rank, stages, gas, window, calls):
    """A long stretch without a drain: after every call, how many tied-gradient messages this rank's sends still
    hold alive (counted through weak references to the sent tensors, whatever holds them), and the order of the
    tied group's transfers (for the NCCL model)."""
    model = mlp_pipeline(stages, layers=2 * stages, tied=True)
    cfg = ds_config(gas, {"enabled": True, "accumulation_window": window}, optimizer=False)
    engine, *_ = ds_paci.initialize(model=model, config=cfg, **_optimizer_kwargs("AdamW", model, cfg, 1e-3))
    tied_groups = {id(ex.group) for ex in engine._tied.exchanges}
    sent = weakref.WeakSet()
    original = tdist.isend

    def isend(tensor, *args, **kwargs):
        if id(kwargs.get("group")) in tied_groups:
            sent.add(tensor)
        return original(tensor, *args, **kwargs)

    data = regression_batches(MICRO)
    alive = []
    tdist.isend = isend
    try:
        with record_distributed_calls() as calls_made:
            for _ in range(calls):
                engine.train_batch(data)
                gc.collect()
                alive.append(len(sent))
            engine.drain()
    finally:
        tdist.isend = original
    gc.collect()
    tokens = {group_token(ex.group) for ex in engine._tied.exchanges}
    order = [(c.op, c.peer) for c in calls_made if c.op in ("isend", "irecv") and c.group in tokens]
    return {"alive": alive, "alive_after_drain": len(sent), "order": order, "rank": engine.global_rank,
            "lag": engine.paci_stats()["tied"]["lag_windows"], "version": engine.weight_version}


def first_exchange_training(rank, stages, gas, window, batches):
    """The tied tiny GPT trained twice from the same init and data: with the start-up exchange and with it left out
    (``first_exchange.run`` replaced by a no-op: the engine before issue 27); what each engine's exchange did, the
    transfers its construction issued on every group, the losses and the tied state after the drain."""
    from ds_paci.core.engine import pipeline_engine
    real = pipeline_engine.first_exchange.run
    out = {}
    for name in ("with", "without"):
        if name == "without":
            pipeline_engine.first_exchange.run = lambda items, me, device: {"pairs": 0, "collectives": 0, "groups": 0}
        try:
            model = tiny_gpt(stages, tie=True)
            paci = {"enabled": True, "watchdog_seconds": 120}
            if window:
                paci["accumulation_window"] = window
            cfg = ds_config(gas, paci)
            with record_distributed_calls() as built:
                engine, *_ = ds_paci.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        finally:
            pipeline_engine.first_exchange.run = real
        data = MicroBatchIterator(shakespeare_tokens(), MICRO, SEQ, seed=5, dp_rank=engine.grid.data_parallel_id,
                                  dp_size=engine.grid.data_parallel_size)
        losses = [float(engine.train_batch(data)) for _ in range(batches)]
        losses.append(float(engine.drain()))
        out[name] = {"exchange": engine.paci_stats()["first_exchange"], "built": built, "losses": losses,
                     "tied": tied_state(engine), "stage": engine.stage_id, "dp": engine.grid.data_parallel_id,
                     "owner": bool(engine._tied is not None and engine._tied.exchanges)}
    return out
