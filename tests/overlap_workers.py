"""Per-rank bodies of the overlapped data-parallel reduce tests (issue 27 item 2), run through ``harness.run_world``."""

import torch

import ds_paci
from ds_paci.core.program.actions import Kind
from mlp import mlp_pipeline, regression_batches
from workers import MICRO, ds_config, stage_weights


def _engine(stages, layers, tied, gas, window, overlap, client, clip, bucket_elements):
    model = mlp_pipeline(stages, layers=layers, tied=tied)
    paci = {"enabled": True, "accumulation_window": window, "overlap_reduce": overlap,
            "overlap_bucket_elements": bucket_elements, "watchdog_seconds": 120}
    cfg = ds_config(gas, paci, optimizer=client != "torch.optim", gradient_clipping=clip)
    if client == "torch.optim":
        return ds_paci.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.01), config=cfg)[0]
    return ds_paci.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]


def _data(engine):
    # each data-parallel replica reads its own micro-batches, so the reduce really averages different gradients
    return regression_batches(MICRO, seed=3 + 101 * engine.grid.data_parallel_id)


def overlap_vs_step(rank, stages, layers, tied, gas, window, client, clip, bucket_elements, calls_before, calls_after,
                    bad=None):
    """Train the same run twice, the reduce at the step and overlapped: ``calls_before`` calls, a drain that leaves
    the window open (as evaluation and checkpoints do), ``calls_after`` calls, a closing drain (a partial window).
    ``bad``: training micro-batch ``bad`` of data-parallel replica 0 has a NaN loss (the reduce carries it to the
    other replica: every replica must skip that window). Returns each run's losses, weights and what the overlap
    did."""
    from contract_workers import poison_loss
    out = {}
    for overlap in (False, True):
        engine = _engine(stages, layers, tied, gas, window, overlap, client, clip, bucket_elements)
        if bad is not None and engine.grid.data_parallel_id == 0 and engine.is_last_stage():
            poison_loss(engine.module, bad)
        data = _data(engine)
        losses = [float(engine.train_batch(data)) for _ in range(calls_before)]
        losses.append(float(engine.drain(close_window=False)))
        fill_at_drain = engine.paci_stats()["window_fill"]
        losses += [float(engine.train_batch(data)) for _ in range(calls_after)]
        losses.append(float(engine.drain()))
        fill_at_close = engine.paci_stats()["window_fill"]  # 0: the closing drain stepped its partial window
        reducer = engine._overlap
        out["overlap" if overlap else "step"] = {
            "losses": losses, "weights": stage_weights(engine), "stage": engine.stage_id,
            "dp": engine.grid.data_parallel_id, "fill_at_drain": fill_at_drain, "fill_at_close": fill_at_close,
            "version": engine.weight_version,
            "skipped": engine.paci_stats()["skipped_steps"],
            "buckets": None if reducer is None else len(reducer.buckets),
            "launched_in_backward": None if reducer is None else reducer.launched_in_backward,
            "reduces": None if reducer is None else reducer.reduces,
            "optimizer": type(engine.optimizer).__name__,
        }
        engine.destroy()
    return out


def marked_program(rank, stages, gas, window, overlap):
    """The program text one call of a real engine runs: whether its backward passes carry ``[dp]``."""
    from ds_paci.core.program.actions import format_stage
    engine = _engine(stages, 2 * stages, False, gas, window, overlap, "deepspeed", 0.0, 1 << 22)
    ticks = engine.lower(engine._stream.advance(2 * gas), engine._stream.drain(True))
    text = format_stage(ticks)
    marked = [a.micro_batch for t in ticks for a in t if a.kind is Kind.BACKWARD and a.reduce_overlap]
    steps = sum(1 for t in ticks for a in t if a.kind is Kind.STEP)
    reducer = engine._overlap is not None
    engine.destroy()
    return {"text": text, "marked": marked, "steps": steps, "reducer": reducer}


def fallback_lines(rank):
    """bf16 (``BF16_Optimizer``) and ZeRO-1 on P = 2 x DP = 2: no overlapped reducer, and rank 0's start-up line
    says the reduce stays at the step; each trains two calls and drains."""
    import contextlib
    import io
    out = {}
    for case in ("bf16", "zero1"):
        model = mlp_pipeline(2, layers=4)
        cfg = ds_config(2, {"enabled": True, "watchdog_seconds": 120}, bf16=case == "bf16")
        if case == "zero1":
            cfg["zero_optimization"] = {"stage": 1}
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            engine = ds_paci.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]
        data = _data(engine)
        if case == "bf16":
            data = ((x.bfloat16(), y.bfloat16()) for x, y in data)
        losses = [float(engine.train_batch(data)) for _ in range(2)] + [float(engine.drain())]
        out[case] = {"reducer": engine._overlap is not None, "optimizer": type(engine.optimizer).__name__,
                     "lines": [l for l in text.getvalue().splitlines() if "overlap_reduce" in l],
                     "weights": stage_weights(engine), "stage": engine.stage_id, "losses": losses}
        engine.destroy()
    return out
