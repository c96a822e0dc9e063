"""Per-rank body of the seam test's benchmark-meter check (run through ``harness.run_world``)."""

import ds_paci
from ds_paci.tools.bench.meters import StockInstructionTracer
from ds_paci.workload.data import MicroBatchIterator
from workers import MICRO, SEQ, ds_config, shakespeare_tokens, tiny_gpt


def traced_stock_engine(rank, calls):
    """Train the stock engine under the benchmark's instruction tracer; returns what DeepSpeed's class table held
    before and after (as ``{instruction name: function qualname and id}``), and the tracer's records."""
    from deepspeed.runtime.pipe.engine import PipelineEngine

    def table():
        return {cls.__name__: (fn.__qualname__, id(fn)) for cls, fn in PipelineEngine._INSTRUCTION_MAP.items()}

    before = table()
    model = tiny_gpt(2)
    engine, *_ = ds_paci.initialize(model=model, model_parameters=model.parameters(), config=ds_config(2))
    tracer = StockInstructionTracer(rank, engine.stage_id)
    tracer.install(engine)
    tracer.active = True
    data = MicroBatchIterator(shakespeare_tokens(), MICRO, SEQ, seed=5)
    losses = [float(engine.train_batch(data)) for _ in range(calls)]
    tracer.active = False
    after = table()
    # a second engine in the same process runs DeepSpeed's own table: nothing recorded for it
    model = tiny_gpt(2)
    other, *_ = ds_paci.initialize(model=model, model_parameters=model.parameters(), config=ds_config(2))
    recorded = len(tracer.records)
    tracer.active = True
    other.train_batch(data)
    return {"before": before, "after": after, "records": [r["instr"] for r in tracer.records[:recorded]],
            "records_of_other_engine": len(tracer.records) - recorded, "losses": losses,
            "type": type(engine).__name__}
