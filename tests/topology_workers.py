"""Per-rank body of the model-parallel refusal test (issue 28 item 8), run through ``harness.run_world``."""

import time

import ds_paci
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from mlp import mlp_pipeline
from workers import ds_config


def model_parallel_refused(rank):
    """On 4 ranks: ``ds_paci.initialize`` with a 2-way model-parallel topology (PP 2 x MP 2) and with
    ``tensor_parallel.autotp_size`` 2 (each refused: the message and how long it took), then PP 2 x DP 2 through the
    same topology class with a model axis of size 1 (accepted: the engine's type)."""

    def attempt(model, cfg):
        start = time.monotonic()
        try:
            engine, *_ = ds_paci.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        except ds_paci.PACIConfigError as e:
            return {"error": str(e), "seconds": time.monotonic() - start}
        return {"error": None, "type": type(engine).__name__}

    paci = {"enabled": True}
    out = {}
    out["mp2"] = attempt(mlp_pipeline(None, topology=PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1)),
                         ds_config(2, paci))
    out["autotp2"] = attempt(mlp_pipeline(2), ds_config(2, paci, tensor_parallel={"autotp_size": 2}))
    out["mp1"] = attempt(mlp_pipeline(None, topology=PipeModelDataParallelTopology(num_pp=2, num_mp=1, num_dp=2)),
                         ds_config(2, paci))
    return out
