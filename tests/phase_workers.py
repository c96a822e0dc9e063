"""Per-rank bodies of the step-phase engine tests: ``"paci": {"step_phase": "diagonal"}`` on real engines over gloo.

Built on :mod:`resume_workers` (the tests' MLP, DeepSpeed's fp32 AdamW with a warm-up scheduler, NaN micro-batches
before and after the save). Every function takes the rank first and returns plain data.
"""

import os

from resume_workers import Data, attempt_refused, build, finish, resumed_run, run, saved_run

DIAGONAL = {"accumulation_window": 3, "step_phase": "diagonal"}
ALIGNED = {"accumulation_window": 3, "step_phase": "aligned"}


def phase_facts(engine):
    stats = engine.paci_stats()
    return {"stage": engine.stage_id, "step_phase": stats["step_phase"], "phase": engine._stream.phase,
            "open_window": stats["open_window"], "version": stats["version"], "window_fill": stats["window_fill"]}


def world(rank, root, stages):
    """``stages`` stages (x DP = 4 / stages): a diagonal run saved with its windows open and resumed exactly; the same
    checkpoint loaded by an aligned engine (refused where a stage's phase differs); a checkpoint saved drained and
    closed, loaded by an aligned engine (allowed: it continues in its own phase)."""
    out = {}
    ckpt = os.path.join(root, "diag")
    # saved after 3 calls of M = 2: 6 backward passes, so stages 1 and 2 (phases 1, 2) hold open windows
    out["ref"] = saved_run(ckpt, stages, 2, DIAGONAL, 3, 3)
    used = out["ref"]["saved"]["used"]
    out["same"] = resumed_run(ckpt, stages, 2, DIAGONAL, 3, used)
    out["aligned_into"] = attempt_refused(build(stages, 2, ALIGNED, seed=99), Data(), ckpt, "open")
    # windows closed: engine.drain() before the save, then an aligned engine takes it
    closed = os.path.join(root, "closed")
    data = Data(nan_at=())
    engine = build(stages, 2, DIAGONAL)
    run(engine, data, 2)
    out["diagonal_facts"] = phase_facts(engine)
    engine.drain()
    engine.save_checkpoint(closed, tag="closed")
    finish(engine, [])
    data = Data(nan_at=())
    engine = build(stages, 2, ALIGNED, seed=99)
    engine.load_checkpoint(closed, tag="closed")
    out["closed_facts"] = phase_facts(engine)
    out["closed_trained"] = finish(engine, run(engine, data, 2))
    return out
