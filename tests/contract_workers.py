"""Per-rank bodies of the engine-contract tests (issue 7) and the non-finite guard tests (issue 10, item 1).

Each function takes the rank first, builds real DeepSpeed engines (or real gloo groups) and returns plain data.
"""

import math
import time

import torch


def loss_ages(values, last_values):
    """For each call ``k``: how many calls before ``k`` the last stage returned ``values[k]`` (None for NaN).

    Raises AssertionError if a value was never returned by the last stage up to that call.
    """
    ages = []
    for k, v in enumerate(values):
        if math.isnan(v):
            ages.append(None)
            continue
        match = [k - j for j in range(k, -1, -1) if last_values[j] == v]
        if not match:
            raise AssertionError(f"call {k}: {v} is not a value the last stage returned up to that call: {last_values}")
        ages.append(match[0])
    return ages


# -- the side channel alone --------------------------------------------------------------------
def channel_exchange(rank, world, calls, late=0.0):
    """The last rank publishes ``calls`` messages; the others poll without waiting, then wait for the last one.
    ``late``: rank 1 takes the first 36 messages, then sleeps that long (a receiver that falls behind under load)."""
    from ds_paci.core.engine.loss_channel import KEEP_SENDS, LossChannel, pipeline_groups

    class Grid:
        pipe_groups = [list(range(world))]
        global_rank = rank

    group, ranks = pipeline_groups(Grid)
    channel = LossChannel(group, ranks, rank)
    last = world - 1
    polled, seen = [], []
    for k in range(1, calls + 1):
        if rank == last:
            channel.publish(torch.tensor(k * 1.5), k, extras=[k, -k])
        else:
            msg = channel.poll()
            polled.append(None if msg is None else msg.seq)
            if msg is not None:
                seen.append((msg.seq, msg.value, msg.origin_call, msg.extras))
    out = {"polled": polled, "seen": seen, "keep": KEEP_SENDS}
    if rank != last:
        if rank == 1 and late:
            channel.wait_for(36)
            time.sleep(late)
        t0 = time.monotonic()
        final = channel.wait_for(calls)
        out["final"] = (final.seq, final.value, final.origin_call, final.extras)
        out["received"] = channel.received
        out["wait_s"] = time.monotonic() - t0
    # stop notices: rank 0 announces; everybody else sees it (rank 0 does not see its own)
    if rank == 0:
        channel.announce_stop(step=7, count=3, limit=3)
    notice = channel.stop_notice(wait_s=10.0 if rank != 0 else 0.0)
    out["notice"] = None if notice is None else (notice.stage, notice.step, notice.count, notice.limit)
    if rank == last:
        channel.flush(seconds=60.0)  # as the engine does before its group goes (startup.finish_engines)
    out["gone"] = sorted(channel.gone)  # peers dropped after an error: says where a lost message went
    # pending receives (DEPTH from the last rank, one per other peer) are still posted here
    channel.close()
    return out


# -- DeepSpeed's calling patterns on real engines ---------------------------------------------
def _aux_pipeline(stages, layers, seed=7):
    """The tests' tanh MLP as a PipelineModule that also reports an additional loss (as Megatron's MoE models do)."""
    from collections import OrderedDict

    from deepspeed.pipe import LayerSpec, PipelineModule
    from mlp import TanhLayer, mse

    class AuxPipe(PipelineModule):

        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self._aux = torch.zeros(())

        def forward(self, x):
            out = super().forward(x)
            self._aux = out.detach().abs().mean()
            return out

        def get_additional_losses(self):
            return OrderedDict(aux=self._aux)

    return AuxPipe(layers=[LayerSpec(TanhLayer, i, seed) for i in range(layers)], num_stages=stages, loss_fn=mse,
                   partition_method="uniform")


def _mlp_engine(stages, gas, paci, lr=0.05, **extra):
    import ds_paci
    from workers import ds_config
    model = _aux_pipeline(stages, 2 * stages)
    cfg = ds_config(gas, paci, optimizer=False, **extra)
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": lr}}
    engine, *_ = ds_paci.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def _call_record(engine, loss):
    extra = engine.get_additional_losses()
    norm = engine.get_global_grad_norm()
    return {
        "loss": loss.item(),  # every rank, as DeepSpeed's examples do
        "loss_dim": loss.dim(),
        "applied": engine.was_step_applied(),
        "norm": None if norm is None else float(norm),
        "aux": None if extra is None else float(extra["aux"]),
        "age": engine.paci_stats()["loss_age"],
    }


def calling_patterns(rank, stages, gas, calls, save_dir):
    """Async: the loss on every rank; set_train_batch_size every call; eval and save under no_grad; a real resize.

    Then the same model in sync mode: the loss on every rank is the call's own.
    """
    from mlp import regression_batches
    out = {"stage": None}
    # (1) a plain DeepSpeed-style loop: loss.item() on every rank after every call
    plain = _mlp_engine(stages, gas, {"enabled": True})
    out["stage"] = plain.stage_id
    data = regression_batches(2)
    out["plain"] = [_call_record(plain, plain.train_batch(data)) for _ in range(calls)]
    plain.destroy()
    # (2) the same run with Megatron's set_train_batch_size(<unchanged>) before every call: never drains
    meg = _mlp_engine(stages, gas, {"enabled": True})
    data = regression_batches(2)
    size = meg.train_batch_size()
    records = []
    for _ in range(calls):
        meg.set_train_batch_size(size)
        records.append(_call_record(meg, meg.train_batch(data)))
    out["megatron"] = records
    out["drains_after_unchanged"] = meg.paci_stats()["drains"]
    # (3) eval_batch and save_checkpoint inside torch.no_grad(), in the middle of async training
    val = [next(regression_batches(2, seed=99)) for _ in range(gas)]
    with torch.no_grad():
        out["eval"] = float(meg.eval_batch(iter(val)))
        meg.save_checkpoint(save_dir, tag="mid")
    out["drains_after_eval_save"] = meg.paci_stats()["drains"]
    out["after_save"] = [_call_record(meg, meg.train_batch(data)) for _ in range(2)]
    # (4) a real change of the batch size (ramp-up): drains once, then runs with the new number of micro-batches
    meg.set_train_batch_size(2 * size)
    out["drains_after_resize"] = meg.paci_stats()["drains"]
    out["micro_batches_after_resize"] = (meg.micro_batches, meg.accumulation_window)
    out["after_resize"] = [_call_record(meg, meg.train_batch(data)) for _ in range(2)]
    out["stats"] = meg.paci_stats()
    meg.destroy()
    # (5) sync mode: every rank returns the call's own loss, as the stock engine does
    sync = _mlp_engine(stages, gas, {"enabled": True, "drain_every_batch": True})
    data = regression_batches(2)
    out["sync"] = [_call_record(sync, sync.train_batch(data)) for _ in range(calls)]
    out["sync_drain"] = float(sync.drain())
    sync.destroy()
    return out


# -- sync mode is the stock engine, with DeepSpeed's default clipping ---------------------------
def sync_vs_stock_clipping(rank, stages, batches, gas, cases):
    """For each (clipping, bf16) case: the stock engine, then PACI sync mode, on the same init and data.

    ``clipping``: "absent" (the key is not in the config: DeepSpeed's default), or a number.
    """
    import ds_paci
    from spy import record_distributed_calls
    from workers import MICRO, SEQ, ds_config, shakespeare_tokens, stage_of_rank, stage_weights, tiny_gpt
    from ds_paci.workload.data import MicroBatchIterator
    tokens = shakespeare_tokens()
    out = {}
    for clipping, bf16 in cases:
        for name, paci in (("stock", None), ("sync", {"enabled": True, "drain_every_batch": True})):
            model = tiny_gpt(stages)
            cfg = ds_config(gas, paci=paci, bf16=bf16)
            if clipping == "absent":
                del cfg["gradient_clipping"]
            else:
                cfg["gradient_clipping"] = clipping
            engine, *_ = ds_paci.initialize(model=model, model_parameters=model.parameters(), config=cfg)
            data = MicroBatchIterator(tokens, MICRO, SEQ, seed=5)
            with record_distributed_calls() as calls:
                losses = [float(engine.train_batch(data)) for _ in range(batches)]
            out[(clipping, bf16, name)] = {"losses": losses, "weights": stage_weights(engine), "calls": calls,
                                           "clip": engine.gradient_clipping(), "type": type(engine).__name__,
                                           "stage_of_rank": stage_of_rank(engine),
                                           "norm": engine.get_global_grad_norm()}
            engine.destroy()
    return out


# -- refusals that building the class directly cannot bypass ------------------------------------
def rebound_engine_refusals(rank):
    """Rebind deepspeed.PipelineEngine to the PACI class and call deepspeed.initialize: same refusals, same words."""
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from mlp import TanhLayer, TiedTanhLayer, mlp_pipeline, mse

    import ds_paci
    from workers import ds_config

    def tied():
        return PipelineModule(layers=[TiedLayerSpec("w", TiedTanhLayer, 0, 7),
                                      LayerSpec(TanhLayer, 1, 7),
                                      TiedLayerSpec("w", TiedTanhLayer, 0, 7)],
                              num_stages=2, loss_fn=mse, partition_method="uniform")

    cases = {
        # tied layers across stages are supported (with clipping too); ZeRO's optimizer offload with them is refused
        "tied": (tied, ds_config(2, {"enabled": True}, gradient_clipping=1.0,
                                 zero_optimization={"stage": 1, "offload_optimizer": {"device": "cpu"}})),
        "zero2": (lambda: mlp_pipeline(2), ds_config(2, {"enabled": True}, zero_optimization={"stage": 2})),
        "bad_section": (lambda: mlp_pipeline(2), ds_config(2, {"enabled": True, "accumulation_window": 0})),
    }
    out = {}
    original = deepspeed.PipelineEngine
    for name, (build, cfg) in cases.items():
        messages = []
        for route in ("ds_paci.initialize", "rebound deepspeed.initialize"):
            model = build()
            try:
                if route == "ds_paci.initialize":
                    ds_paci.initialize(model=model, model_parameters=model.parameters(), config=cfg)
                else:
                    deepspeed.PipelineEngine = ds_paci.PACIPipelineEngine
                    try:
                        deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
                    finally:
                        deepspeed.PipelineEngine = original
                messages.append(None)
            except ds_paci.PACIConfigError as e:
                messages.append(str(e))
        out[name] = messages
    return out


# -- the non-finite guard ---------------------------------------------------------------------------
def poison_loss(module, bad, every_after=False):
    """Make ``module``'s loss NaN for training micro-batch number ``bad`` (0-based; and all later ones if asked).

    Test-only: counts forwards made with gradients enabled (evaluation runs under no_grad).
    """
    loss_fn = module.loss_fn
    seen = [0]

    def poisoned(out, target):
        loss = loss_fn(out, target)
        if torch.is_grad_enabled():
            k = seen[0]
            seen[0] += 1
            if k == bad or (every_after and k > bad):
                loss = loss * float("nan")
        return loss

    module.loss_fn = poisoned
    return module


def nonfinite_guard(rank, stages, gas, calls, bad, cases):
    """Async PACI with one NaN micro-batch, per optimizer case: the poisoned window is skipped on every stage."""
    import ds_paci
    from mlp import regression_batches
    from workers import ds_config, stage_weights
    out = {}
    for case in cases:
        bf16 = case == "bf16"
        model = poison_loss(_aux_pipeline(stages, 2 * stages), bad)
        cfg = ds_config(gas, {"enabled": True}, optimizer=False, bf16=bf16)
        if case == "zero1":
            cfg["zero_optimization"] = {"stage": 1}
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                           "warmup_num_steps": 100, "warmup_type": "linear"}}
        kwargs = {"model_parameters": model.parameters()}
        if case == "torch.optim":
            kwargs = {"optimizer": torch.optim.AdamW(model.parameters(), lr=0.01)}
        else:
            cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}}
        engine, *_ = ds_paci.initialize(model=model, config=cfg, **kwargs)
        data = regression_batches(2)
        if bf16:
            data = ((x.bfloat16(), y.bfloat16()) for x, y in data)
        records = []
        for _ in range(calls):
            loss = engine.train_batch(data)
            records.append({"loss": loss.item(), "applied": engine.was_step_applied(), "lr": engine.get_lr()[0],
                            "version": engine.weight_version, "skipped": engine.paci_stats()["skipped_steps"],
                            "norm": engine.get_global_grad_norm()})
        engine.drain()
        weights = stage_weights(engine)
        out[case] = {"records": records, "stats": engine.paci_stats(), "lr": engine.get_lr()[0],
                     "finite": all(bool(torch.isfinite(w).all()) for w in weights.values()),
                     "global_steps": engine.global_steps, "skipped_steps": engine.skipped_steps,
                     "optimizer": type(engine.optimizer).__name__}
        engine.destroy()
    return out


def consecutive_skips_stop(rank, stages, gas, bad, limit):
    """NaN from micro-batch ``bad`` on: after ``limit`` skips in a row every rank stops with the guard's line."""
    from mlp import regression_batches
    engine = _mlp_engine(stages, gas, {"enabled": True, "max_consecutive_skips": limit, "watchdog_seconds": 30})
    poison_loss(engine.module, bad, every_after=True)
    data = regression_batches(2)
    for call in range(50):
        engine.train_batch(data)
    return "never stopped"


def save_refuses_nonfinite_weights(rank, save_dir):
    """Sync mode in fp32 applies a NaN step as DeepSpeed's engine does; the save then refuses on every rank."""
    import ds_paci
    from mlp import regression_batches
    engine = _mlp_engine(2, 2, {"enabled": True, "drain_every_batch": True})
    poison_loss(engine.module, 0)
    data = regression_batches(2)
    engine.train_batch(data)
    try:
        engine.save_checkpoint(save_dir, tag="bad")
    except ds_paci.PACINonFiniteError as e:
        return {"error": str(e), "applied": engine.was_step_applied()}
    return {"error": None}


# -- watchdog wording ---------------------------------------------------------------------------------
def stuck_in_forward(rank):
    """Stage 0's third forward takes far longer than the watchdog allows: it is stuck in its own computation."""
    from deepspeed.pipe import LayerSpec, PipelineModule
    from mlp import TanhLayer, mse, regression_batches

    import ds_paci
    from workers import ds_config

    class Slow(TanhLayer):
        calls = 0

        def forward(self, x):
            Slow.calls += 1
            if Slow.calls == 3:
                time.sleep(30)
            return super().forward(x)

    model = PipelineModule(layers=[LayerSpec(Slow, 0, 7), LayerSpec(TanhLayer, 1, 7)], num_stages=2, loss_fn=mse,
                           partition_method="uniform")
    cfg = ds_config(2, {"enabled": True, "watchdog_seconds": 3}, optimizer=False)
    engine, *_ = ds_paci.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=cfg)
    data = regression_batches(2)
    for _ in range(4):
        engine.train_batch(data)
    return "unreachable"


def stage_exits_after_drain(rank, stages, calls):
    """Every stage trains and drains; stage 1 then exits at once (its process is gone), while the last stage
    still publishes (two more drains) and stage 0 still polls: neither may fail (the channel is best effort)."""
    import os
    import sys
    from mlp import regression_batches
    engine = _mlp_engine(stages, 2, {"enabled": True, "watchdog_seconds": 60})
    data = regression_batches(2)
    for _ in range(calls):
        engine.train_batch(data)
    engine.drain()
    if rank == 1:
        sys.stdout.flush()
        os._exit(0)  # as a launcher's rank that finished: no barrier, no clean-up
    time.sleep(3.0)  # stage 1's sockets are closed by now
    losses = [float(engine.drain()) for _ in range(2)]  # nothing in flight: only the loss side channel talks
    out = {"losses": losses, "gone": sorted(engine._channel.gone), "sent": engine._channel.sent}
    # The last stage stays until stage 0 has read its channel: an exiting process closes its side of the channel
    # (at interpreter exit its group is destroyed), and stage 0 would then rightly count it gone too.
    import torch.distributed as dist
    done = torch.zeros(1)
    if rank == 0:
        dist.send(done, dst=stages - 1)
    elif rank == stages - 1:
        dist.recv(done, src=0)
    return out
