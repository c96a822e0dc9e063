"""Per-rank bodies of the non-blocking transfer tests (issue 27 item 3), run through ``harness.run_world``."""

import tempfile

import ds_paci
from mlp import mlp_pipeline, regression_batches
from workers import MICRO, ds_config, stage_weights


def blocking_vs_nonblocking(rank, stages, tied, gas, window, slack=()):
    """The same run with DeepSpeed's blocking transfers and with ``"nonblocking_transfers"``: two calls, an
    evaluation (a drain keeping the window open), a call, a checkpoint save (the same drain), a call, a closing
    drain. ``slack``: ``"paci.slack_links"``. Returns each run's losses, evaluation loss, weights, what the transfers
    did and the stage's stream facts (buffers, slack)."""
    out = {}
    for nonblocking in (False, True):
        model = mlp_pipeline(stages, layers=2 * stages, tied=tied)
        paci = {"enabled": True, "accumulation_window": window, "nonblocking_transfers": nonblocking,
                "watchdog_seconds": 120, "slack_links": list(slack)}
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
            "nbuf": engine._stream.nbuf, "slack": engine._stream.slack,
        }
        engine.destroy()
    return out


def slack_refusals(rank, stages):
    """``ds_paci.initialize`` with ``"slack_links"`` where it cannot be honoured: tied layers on several stages, a
    link the pipeline does not have, sync mode. Returns each refusal's message (``None`` if the engine was built)."""
    from ds_paci.core.config import PACIConfigError
    cases = {"tied": (True, {"slack_links": [0]}), "range": (False, {"slack_links": [stages - 1]}),
             "sync": (False, {"slack_links": [0], "drain_every_batch": True})}
    out = {}
    for name, (tied, extra) in cases.items():
        model = mlp_pipeline(stages, layers=2 * stages, tied=tied)
        try:
            engine = ds_paci.initialize(model=model, model_parameters=model.parameters(),
                                        config=ds_config(2, {"enabled": True, **extra}))[0]
            engine.destroy()
            out[name] = None
        except PACIConfigError as e:
            out[name] = str(e)
    return out
