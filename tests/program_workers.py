"""Per-rank body of the program text-form test (issue 18): the same run with its programs built directly, and
with every program printed, parsed back and the parsed one executed."""

import types

import torch

import ds_paci
from ds_paci.core.program.actions import format_stage, parse_stage
from ds_paci.workload.data import MicroBatchIterator
from workers import MICRO, SEQ, _as_float, ds_config, shakespeare_tokens, stage_weights, tiny_gpt


def _through_text(engine, texts):
    """Make ``engine`` run, for every call, the program parsed from the text of the one it lowered."""
    lower = engine.lower

    def lower_via_text(self, ticks, drain_ticks=None, carry=False):
        text = format_stage(lower(ticks, drain_ticks, carry))
        texts.append(text)
        return parse_stage(text, self.stage_id)

    engine.lower = types.MethodType(lower_via_text, engine)


def direct_and_parsed(rank, stages, gas, paci, calls, eval_at):
    """Train the tied tiny GPT twice from the same init and data: programs built directly, then parsed from text.

    ``eval_at``: the calls after which ``eval_batch`` drains with the window left open. Ends with ``drain()``.
    """
    tokens = shakespeare_tokens()
    out = {}
    for variant in ("direct", "text"):
        model = tiny_gpt(stages, tie=True)
        engine, *_ = ds_paci.initialize(model=model, config=ds_config(gas, paci=paci),
                                        model_parameters=model.parameters())
        texts = []
        if variant == "text":
            _through_text(engine, texts)
        data = MicroBatchIterator(tokens, MICRO, SEQ, seed=5)
        val = MicroBatchIterator(tokens, MICRO, SEQ, seed=9)
        losses, evals = [], []
        for call in range(calls):
            losses.append(_as_float(engine.train_batch(data)))
            if call in eval_at:
                with torch.no_grad():
                    evals.append(_as_float(engine.eval_batch(val)))
        losses.append(_as_float(engine.drain()))
        out[variant] = {"losses": losses, "evals": evals, "weights": stage_weights(engine), "texts": texts,
                        "version": engine.weight_version, "stage": engine.stage_id}
    return out
