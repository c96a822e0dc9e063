"""Per-rank bodies of the non-blocking transfer tests (issue 27 item 3), run through ``harness.run_world``."""

import tempfile

import ds_paci
from mlp import mlp_pipeline, regression_batches
from workers import MICRO, ds_config, stage_weights


def blocking_vs_nonblocking(rank, stages, tied, gas, window):
    """The same run with DeepSpeed's blocking transfers and with ``"nonblocking_transfers"``: two calls, an
    evaluation (a drain keeping the window open), a call, a checkpoint save (the same drain), a call, a closing
    drain. Returns each run's losses, evaluation loss, weights and what the transfers did."""
    out = {}
    for nonblocking in (False, True):
        model = mlp_pipeline(stages, layers=2 * stages, tied=tied)
        paci = {"enabled": True, "accumulation_window": window, "nonblocking_transfers": nonblocking,
                "watchdog_seconds": 120}
        engine = ds_paci.initialize(model=model, model_parameters=model.parameters(), config=ds_config(gas, paci))[0]
        data = regression_batches(MICRO, seed=3 + 101 * engine.grid.data_parallel_id)
        val = regression_batches(MICRO, seed=999)
        losses = [float(engine.train_batch(data)) for _ in range(2)]
        evaluated = float(engine.eval_batch(val))
        losses.append(float(engine.train_batch(data)))
        with tempfile.TemporaryDirectory() as folder:
            engine.save_checkpoint(folder, tag="mid")
        losses.append(float(engine.train_batch(data)))
        losses.append(float(engine.drain()))
        transfers = engine._transfers
        out["nonblocking" if nonblocking else "blocking"] = {
            "losses": losses, "eval": evaluated, "weights": stage_weights(engine), "stage": engine.stage_id,
            "stats": None if transfers is None else dict(transfers.stats),
            "in_flight": None if transfers is None else len(transfers.in_flight),
        }
        engine.destroy()
    return out
