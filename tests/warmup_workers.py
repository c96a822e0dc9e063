"""Per-rank bodies of ``test_sync_warmup.py``: a synchronous warm start on real engines over gloo (the tests' MLP,
``resume_workers.build``), saved inside the warm start and resumed, against the uninterrupted run."""

import os

import resume_workers as rw

WARM = 3  # the warm start's calls
PACI = {"accumulation_window": 3, "sync_warmup_calls": WARM}  # a = 3 != M = 2: PACI's windows straddle calls


def window_of_each_call(engine, data, calls):
    """Per call: the record of ``resume_workers`` plus the stream's window after it."""
    out = []
    for _ in range(calls):
        loss = engine.train_batch(data.call(engine))
        out.append({**rw.record(engine, loss), "window": engine.accumulation_window,
                    "in_flight": engine.paci_stats()["in_flight"]})
    return out


def two_ranks(rank, root):
    """P = 2: the uninterrupted run (a save after call 2, inside the warm start), the same run resumed from that save
    by a fresh engine, and the run without the warm start (which must differ)."""
    out = {}
    ckpt = os.path.join(root, "warm")
    data = rw.Data(nan_at=())
    engine = rw.build(2, 2, PACI)
    out["first"] = window_of_each_call(engine, data, 2)
    engine.save_checkpoint(ckpt, tag="warm", client_state={"used": data.used})
    used = data.used
    out["ref"] = rw.finish(engine, window_of_each_call(engine, data, 4))
    data = rw.Data(nan_at=())
    data.used = used
    engine = rw.build(2, 2, PACI, seed=99)
    engine.load_checkpoint(ckpt, tag="warm")
    out["resumed"] = rw.finish(engine, window_of_each_call(engine, data, 4))
    data = rw.Data(nan_at=())
    engine = rw.build(2, 2, {"accumulation_window": 3})
    out["cold"] = rw.finish(engine, window_of_each_call(engine, data, 6))
    return out


RATIO = float(os.environ.get("WARM_RATIO", "1.2"))  # the "auto" warm start's end on the classifier (see AUTO_CALLS)
AUTO_PACI = {"accumulation_window": 3, "sync_warmup_calls": "auto", "sync_warmup_loss_ratio": RATIO}
AUTO_SAVE, AUTO_CALLS = 5, 16  # a save after call 5 (inside the warm start, 5 losses seen), 16 calls in all


class ClassData(rw.Data):
    """``rw.Data`` with integer labels (``mlp.classification_batches``): what the ``"auto"`` warm start judges."""

    def __init__(self):
        from mlp import classification_batches
        gen = classification_batches(rw.MICRO)
        self.batches = [next(gen) for _ in range(2 * AUTO_CALLS)]
        self.used = 0


def build_classifier(paci, seed=7):
    """The tests' MLP on 2 stages (M = 2) with a cross-entropy loss on class ids."""
    import ds_paci
    from mlp import cross_entropy, mlp_pipeline
    from workers import ds_config
    model = mlp_pipeline(2, layers=4, seed=seed, loss_fn=cross_entropy)
    cfg = ds_config(2, {"enabled": True, "watchdog_seconds": 60, **paci}, optimizer=False)
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0, "torch_adam": True}}
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                       "warmup_num_steps": 10, "warmup_type": "linear"}}
    engine, *_ = ds_paci.initialize(model=model, config=cfg, model_parameters=model.parameters())
    return engine


def auto_two_ranks(rank, root):
    """P = 2, ``"auto"`` warm start: the uninterrupted run (a save inside the warm start), the same run resumed from
    it, and a run on float labels (regression), which cannot be judged and ends the warm start after one call."""
    out = {}
    ckpt = os.path.join(root, "auto")
    data = ClassData()
    engine = build_classifier(AUTO_PACI)
    out["first"] = window_of_each_call(engine, data, AUTO_SAVE)
    engine.save_checkpoint(ckpt, tag="warm", client_state={"used": data.used})
    used = data.used
    out["ref"] = rw.finish(engine, window_of_each_call(engine, data, AUTO_CALLS - AUTO_SAVE))
    data = ClassData()
    data.used = used
    engine = build_classifier(AUTO_PACI, seed=99)
    engine.load_checkpoint(ckpt, tag="warm")
    out["resumed"] = rw.finish(engine, window_of_each_call(engine, data, AUTO_CALLS - AUTO_SAVE))
    engine = rw.build(2, 2, {"accumulation_window": 3, "sync_warmup_calls": "auto"})
    out["unjudged"] = rw.finish(engine, window_of_each_call(engine, rw.Data(nan_at=()), 3))
    return out


def auto_two_replicas(rank, root):
    """P = 2 with two data-parallel replicas fed different micro-batches, ``"auto"``: per call, the window after it
    (every rank must switch after the same call, whatever its own replica's labels say)."""
    from mlp import classification_batches
    engine = build_classifier(AUTO_PACI)
    data = ClassData()
    gen = classification_batches(rw.MICRO, seed=3 + 10 * engine.grid.data_parallel_id)
    data.batches = [next(gen) for _ in range(2 * AUTO_CALLS)]
    out = {"calls": window_of_each_call(engine, data, AUTO_CALLS), "dp": engine.grid.data_parallel_id}
    engine.destroy()
    return out
