"""Per-rank bodies of the multi-process engine tests (run through ``harness.run_world``).

Every function takes the rank first, builds real DeepSpeed engines over gloo, and
returns plain data (floats, tensors, dicts) for the test to assert on.
"""

import os
import time

import torch

import ds_paci
from ds_paci.workload.data import ByteTokenizer, MicroBatchIterator, encode_documents, eval_micro_batches, load_corpus
from ds_paci.workload.gpt2 import gpt2_config, gpt2_pipeline

SEQ = 32
MICRO = 2


def shakespeare_tokens(n_docs=3):
    docs = load_corpus()
    return encode_documents(docs[:n_docs], ByteTokenizer())


def tiny_gpt(stages, seed=11, dropout=0.0, tie=False):
    cfg = gpt2_config("tiny", vocab_size=257, n_positions=SEQ, n_embd=32, n_layer=4, n_head=2, dropout=dropout)
    return gpt2_pipeline(cfg, num_stages=stages, seed=seed, tie_embeddings=tie)


def ds_config(gas, paci=None, bf16=False, optimizer=True, **extra):
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "steps_per_print": 10**6,
        "gradient_clipping": 0.0,
        **extra
    }
    if optimizer:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True, "weight_decay": 0.0}}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if paci is not None:
        cfg["paci"] = paci
        if paci.get("enabled"):
            cfg["paci"] = {"check_tied_copies": True, **paci}  # the tied-copy check is on in every test
    return cfg


def stage_weights(engine):
    return {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}


def _as_float(x):
    return None if x is None else float(x)


def stage_of_rank(engine):
    return {r: engine.grid._topo.get_coord(r).pipe for r in range(torch.distributed.get_world_size())}


# -- sync mode vs stock ---------------------------------------------------------------
def stock_vs_sync(rank, stages, batches, gas, bf16, client_optimizer, zero_stage=0, modes=("stock", "sync")):
    """Train the stock engine, then PACI in sync mode (and async if asked), on the same model init and data."""
    from spy import record_distributed_calls
    out = {}
    tokens = shakespeare_tokens()
    paci_of = {"stock": None, "sync": {"enabled": True, "drain_every_batch": True}, "async": {"enabled": True}}
    for name in modes:
        paci = paci_of[name]
        model = tiny_gpt(stages)
        cfg = ds_config(gas, paci=paci, bf16=bf16, optimizer=not client_optimizer,
                        zero_optimization={"stage": zero_stage})
        kwargs = {}
        if client_optimizer:
            kwargs["optimizer"] = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
        else:
            kwargs["model_parameters"] = model.parameters()
        engine, *_ = ds_paci.initialize(model=model, config=cfg, **kwargs)
        data = MicroBatchIterator(tokens, MICRO, SEQ, seed=5, dp_rank=engine.grid.data_parallel_id,
                                  dp_size=engine.grid.data_parallel_size)
        predicted = _watch_zero_partition(engine) if name == "async" and zero_stage == 1 else None
        with record_distributed_calls() as calls:
            losses = [_as_float(engine.train_batch(data)) for _ in range(batches)]
        if name == "async":
            engine.drain()
        out[name] = {"type": type(engine).__name__, "losses": losses, "weights": stage_weights(engine),
                     "calls": calls, "stage_of_rank": stage_of_rank(engine), "optimizer": type(engine.optimizer).__name__,
                     "stage": engine.stage_id, "norm": _as_float(engine.get_global_grad_norm()),
                     "predicted": predicted,
                     "lookahead": engine.paci_stats()["lookahead"] if name != "stock" else None}
    return out


def _watch_zero_partition(engine):
    """During each predicted forward under ZeRO-1, which elements of the flat weights differ from the real ones.

    Returns a list, filled as training runs, of ``(any changed, all changes inside this rank's partition)``.
    """
    la, opt, seen = engine._lookahead, engine.optimizer, []
    if la is None:
        return seen
    real = {}
    original = la.applied

    def applied(window_fill, window):
        real["flat"] = [f.clone() for f in opt.bit16_groups_flat]
        return original(window_fill, window)

    def check(module, inputs):
        if la.active:
            for i, flat in enumerate(opt.bit16_groups_flat):
                changed = (flat != real["flat"][i]).nonzero().flatten()
                pid = torch.distributed.get_rank(group=opt.real_dp_process_group[i])
                part = opt.parallel_partitioned_bit16_groups[i][pid]
                start = part.storage_offset() - flat.storage_offset()
                seen.append((changed.numel() > 0, bool(((changed >= start) & (changed < start + part.numel())).all())))

    la.applied = applied
    engine.module.register_forward_pre_hook(check)
    return seen


# -- async training, drift and the collective spy -------------------------------------
def async_training(rank, stages, batches, gas, window=None, bf16=False):
    from spy import record_distributed_calls
    tokens = shakespeare_tokens()
    model = tiny_gpt(stages)
    paci = {"enabled": True}
    if window:
        paci["accumulation_window"] = window
    engine, *_ = ds_paci.initialize(model=model,
                                    model_parameters=model.parameters(),
                                    config=ds_config(gas, paci=paci, bf16=bf16))
    data = MicroBatchIterator(tokens, MICRO, SEQ, seed=5)
    losses = []
    with record_distributed_calls() as calls:
        for _ in range(batches):
            losses.append(_as_float(engine.train_batch(data)))
    stats_before_drain = engine.paci_stats()
    tail = engine.drain()
    return {
        "losses": losses,
        "drain_loss": _as_float(tail),
        "stats": engine.paci_stats(),
        "stats_before_drain": stats_before_drain,
        "calls": calls,
        "stage_of_rank": stage_of_rank(engine),
        "recent": list(engine.telemetry.recent),
    }


# -- eval, checkpoint, resume ----------------------------------------------------------
def _tied_checks(engine):
    tied = engine.paci_stats().get("tied")
    return tied["copy_checks"] if tied else 0


def train_eval_save(rank, stages, paci, batches_before, batches_after, save_dir, gas=2, tie=False):
    tokens = shakespeare_tokens()
    val = eval_micro_batches(shakespeare_tokens(4)[-20000:], MICRO, SEQ, count=gas)
    model = tiny_gpt(stages, tie=tie)
    engine, *_ = ds_paci.initialize(model=model, model_parameters=model.parameters(), config=ds_config(gas, paci))
    data = MicroBatchIterator(tokens, MICRO, SEQ, seed=5)
    losses = [_as_float(engine.train_batch(data)) for _ in range(batches_before)]
    result = {"losses_before": losses}
    if save_dir is not None:
        result["eval"] = _as_float(engine.eval_batch(iter(val)))
        result["drained_after_eval"] = engine.is_drained
        engine.save_checkpoint(save_dir, client_state={"data_position": data.position})
        result["version_at_save"] = engine.weight_version
        result["global_steps_at_save"] = engine.global_steps
    result["losses_after"] = [_as_float(engine.train_batch(data)) for _ in range(batches_after)]
    engine.drain()
    result["weights"] = stage_weights(engine)
    result["tied_checks"] = _tied_checks(engine)
    return result


def resume(rank, stages, paci, batches, load_dir, gas=2, tie=False):
    tokens = shakespeare_tokens()
    model = tiny_gpt(stages, seed=999, tie=tie)  # different init: the checkpoint must overwrite it
    engine, *_ = ds_paci.initialize(model=model, model_parameters=model.parameters(), config=ds_config(gas, paci))
    path, client_state = engine.load_checkpoint(load_dir)
    data = MicroBatchIterator(tokens, MICRO, SEQ, seed=5)
    data.skip(client_state["data_position"])
    losses = [_as_float(engine.train_batch(data)) for _ in range(batches)]
    engine.drain()
    return {"path": path, "losses": losses, "weights": stage_weights(engine), "version": engine.weight_version,
            "stream_state": client_state["ds_paci"]["stream"], "tied_checks": _tied_checks(engine)}


# -- micro-batch pairing across calls ---------------------------------------------------
def pairing(rank, stages, gas, batches, fresh_iterator_per_call):
    from mlp import mlp_pipeline, regression_batches
    model = mlp_pipeline(stages, layers=stages)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    engine, *_ = ds_paci.initialize(model=model, optimizer=opt, config=ds_config(gas, {"enabled": True}, optimizer=False))
    gen = regression_batches(MICRO)
    all_batches = [next(gen) for _ in range(batches * gas)]
    losses = []
    persistent = iter(all_batches)
    for c in range(batches):
        it = iter(all_batches[c * gas:(c + 1) * gas]) if fresh_iterator_per_call else persistent
        losses.append(_as_float(engine.train_batch(it)))
    losses.append(_as_float(engine.drain()))
    return {"losses": losses, "weights": stage_weights(engine)}


# -- the PACI gradient on a small model --------------------------------------------------
def mlp_training(rank, stages, layers, gas, window, calls, lr, bf16=False, client="sgd", tied=False):
    from mlp import mlp_pipeline, regression_batches
    model = mlp_pipeline(stages, layers=layers, tied=tied)
    # plain PACI (no look-ahead): the hand-written references follow the streams without predictions
    cfg = ds_config(gas, {"enabled": True, "accumulation_window": window, "lookahead": False}, bf16=bf16,
                    optimizer=client != "sgd")
    if client == "sgd":
        engine, *_ = ds_paci.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr), config=cfg)
    else:
        cfg["optimizer"] = {"type": "SGD", "params": {"lr": lr}}
        engine, *_ = ds_paci.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    gen = regression_batches(MICRO)
    if bf16:
        gen = ((x.bfloat16(), y.bfloat16()) for x, y in gen)
    losses = [_as_float(engine.train_batch(gen)) for _ in range(calls)]
    losses.append(_as_float(engine.drain()))
    return {
        "losses": losses,
        "weights": stage_weights(engine),
        "stats": engine.paci_stats(),
        "optimizer": type(engine.optimizer).__name__,
        "layers": (engine.module._local_start, engine.module._local_stop)
    }


# -- hangs ----------------------------------------------------------------------------
def one_stage_absent(rank, watchdog_seconds):
    """Stage 0 trains; stage 1 never joins the stream (it sleeps), so stage 0 blocks in a send."""
    from mlp import mlp_pipeline, regression_batches
    model = mlp_pipeline(2, layers=2)
    cfg = ds_config(2, {"enabled": True, "watchdog_seconds": watchdog_seconds}, optimizer=False)
    engine, *_ = ds_paci.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=cfg)
    if rank == 1:
        time.sleep(10)
        return "slept"
    engine.train_batch(regression_batches(MICRO))
    return "trained"


def one_stage_dies(rank):
    """Stage 1 exits after the first call; stage 0's next transfer fails and says where."""
    from mlp import mlp_pipeline, regression_batches
    model = mlp_pipeline(2, layers=2)
    cfg = ds_config(2, {"enabled": True, "watchdog_seconds": 0}, optimizer=False)
    engine, *_ = ds_paci.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=cfg)
    data = regression_batches(MICRO)
    engine.train_batch(data)
    if rank == 1:
        os._exit(3)
    for _ in range(3):
        engine.train_batch(data)
    return "unreachable"


# -- initialize() refusals ---------------------------------------------------------------
def initialize_errors(rank):
    """Every combination ds_paci.initialize must refuse, tried on every rank; returns the messages."""
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from mlp import TanhLayer, TiedTanhLayer, mlp_pipeline, mse

    def attempt(model, cfg, **kw):
        try:
            ds_paci.initialize(model=model, model_parameters=model.parameters(), config=cfg, **kw)
        except ds_paci.PACIConfigError as e:
            return str(e)
        return None

    paci = {"enabled": True}
    out = {}
    out["not_pipeline"] = attempt(torch.nn.Linear(2, 2), ds_config(2, paci))
    out["zero2"] = attempt(mlp_pipeline(2), ds_config(2, paci, zero_optimization={"stage": 2}))
    out["fp16"] = attempt(mlp_pipeline(2), ds_config(2, paci, fp16={"enabled": True}))
    out["window0"] = attempt(mlp_pipeline(2), ds_config(2, {"enabled": True, "accumulation_window": 0}))
    out["unknown"] = attempt(mlp_pipeline(2), ds_config(2, {"enabled": True, "acumulation_window": 4}))
    def tied_mlp():
        return PipelineModule(layers=[TiedLayerSpec("w", TiedTanhLayer, 0, 7), LayerSpec(TanhLayer, 1, 7),
                                      TiedLayerSpec("w", TiedTanhLayer, 0, 7)], num_stages=2, loss_fn=mse,
                              partition_method="uniform")

    # tied layers on two stages: clipping is accepted (each owner scales the tied total alike); ZeRO's optimizer
    # offload keeps gradients where the tied exchange cannot reach them, so it is refused
    out["tied_clip"] = attempt(tied_mlp(), ds_config(2, paci, gradient_clipping=1.0))
    out["tied_offload"] = attempt(tied_mlp(), ds_config(2, paci, zero_optimization={
        "stage": 1, "offload_optimizer": {"device": "cpu"}}))
    # accepted: tied layers across stages (PACI exchanges their gradients), the stock engine, ZeRO-1
    tied = tied_mlp()
    engine, *_ = ds_paci.initialize(model=tied, model_parameters=tied.parameters(), config=ds_config(2, paci))
    out["tied_type"] = type(engine).__name__
    out["tied_stats"] = engine.paci_stats()["tied"]
    tied = tied_mlp()
    engine, *_ = ds_paci.initialize(model=tied, model_parameters=tied.parameters(), config=ds_config(2))
    out["stock_type"] = type(engine).__name__
    engine, *_ = ds_paci.initialize(model=mlp_pipeline(2), config=ds_config(2, {"enabled": False}),
                                    model_parameters=mlp_pipeline(2).parameters())
    out["disabled_type"] = type(engine).__name__
    z1 = mlp_pipeline(2)
    engine, *_ = ds_paci.initialize(model=z1, model_parameters=z1.parameters(),
                                    config=ds_config(2, paci, zero_optimization={"stage": 1}))
    out["zero1_type"] = type(engine).__name__
    out["zero1_clip"] = engine.gradient_clipping()
    # bf16: what this DeepSpeed's stock engine builds, and whether PACI accepts it (ds_paci.core.seam.compat, item 3)
    bf = mlp_pipeline(2)
    engine, *_ = ds_paci.initialize(model=bf, model_parameters=bf.parameters(), config=ds_config(2, bf16=True))
    out["bf16_stock_optimizer"] = type(engine.optimizer).__name__
    out["bf16"] = attempt(mlp_pipeline(2), ds_config(2, paci, bf16=True))
    return out


# -- tied weights across stages ----------------------------------------------------------
def tied_state(engine):
    """This rank's tied parameters and their optimizer state (fp32 masters gathered over DP), or ``{}``."""
    from deepspeed.runtime.pipe.engine import PipelineEngine
    if getattr(engine, "_tied", None) is not None:
        return engine._tied.snapshot()
    assert isinstance(engine, PipelineEngine)
    out = {}
    for key, comm in engine.module.tied_comms.items():
        for attr in comm["weight_attr"]:
            out[f"{key}.{attr}"] = engine.module._recursive_getattr(comm["module"], attr).detach().float().clone()
    return out


def record_tied_digests(engine):
    """Digest of this rank's tied copies (weights and optimizer state) after every local step: {version: hex}."""
    import hashlib
    digests = {}
    if getattr(engine, "_tied", None) is None or not engine._tied.exchanges:
        return digests
    step = engine._local_step

    def step_and_record(cmd):
        step(cmd)
        h = hashlib.sha256()
        for name, t in sorted(engine._tied.snapshot().items()):
            h.update(name.encode() + t.contiguous().numpy().tobytes())
        digests[cmd.version] = h.hexdigest()

    engine._local_step = step_and_record
    return digests


def tied_training(rank, stages, batches, gas, window=None, bf16=False, zero_stage=0, client_optimizer=False,
                  modes=("async",), lr=3e-3):
    """Train the tied tiny GPT in each of ``modes`` (stock / sync / async) from the same init and data."""
    from spy import group_token, record_distributed_calls
    tokens = shakespeare_tokens()
    paci_of = {"stock": None, "sync": {"enabled": True, "drain_every_batch": True}, "async": {"enabled": True}}
    out = {}
    for name in modes:
        paci = paci_of[name]
        if paci is not None and window:
            paci = {**paci, "accumulation_window": window}
        model = tiny_gpt(stages, tie=True)
        cfg = ds_config(gas, paci=paci, bf16=bf16, optimizer=not client_optimizer,
                        zero_optimization={"stage": zero_stage})
        if not client_optimizer:
            cfg["optimizer"]["params"]["lr"] = lr
        kwargs = {}
        if client_optimizer:
            kwargs["optimizer"] = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        else:
            kwargs["model_parameters"] = model.parameters()
        engine, *_ = ds_paci.initialize(model=model, config=cfg, **kwargs)
        data = MicroBatchIterator(tokens, MICRO, SEQ, seed=5, dp_rank=engine.grid.data_parallel_id,
                                  dp_size=engine.grid.data_parallel_size)
        digests = record_tied_digests(engine)
        with record_distributed_calls() as calls:
            losses = [_as_float(engine.train_batch(data)) for _ in range(batches)]
        stats_before = engine.paci_stats() if name != "stock" else None
        if name != "stock":
            engine.drain()
        out[name] = {"losses": losses, "weights": stage_weights(engine), "tied": tied_state(engine),
                     "digests": digests, "calls": calls, "stage_of_rank": stage_of_rank(engine),
                     "stage": engine.stage_id, "dp": engine.grid.data_parallel_id,
                     "optimizer": type(engine.optimizer).__name__, "type": type(engine).__name__,
                     "stats_before_drain": stats_before,
                     "loss_channel_group": group_token(engine._channel.group) if name != "stock" else None,
                     "stats": engine.paci_stats() if name != "stock" else None}
    return out


def tied_peer_never_posts(rank, watchdog_seconds):
    """Stage 0 drops its tied-gradient sends: stage 1 waits in the tied exchange until its watchdog names it."""
    import torch.distributed as tdist

    class Sent:  # a send that "completed" without sending anything

        def wait(self):
            return True

        def is_completed(self):
            return True

    model = tiny_gpt(2, tie=True)
    cfg = ds_config(2, {"enabled": True, "watchdog_seconds": watchdog_seconds})
    engine, *_ = ds_paci.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    if rank == 0:
        tdist.isend = lambda *args, **kwargs: Sent()  # only the tied exchange uses isend
    data = MicroBatchIterator(shakespeare_tokens(), MICRO, SEQ, seed=5)
    for _ in range(4):
        engine.train_batch(data)
    return "trained"
