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
