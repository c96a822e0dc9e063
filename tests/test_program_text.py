"""The program's text form is the program: a parsed lowered stream runs on the engine exactly as the built one."""

import pytest
import torch

import program_workers
from harness import run_world

pytestmark = pytest.mark.process  # every test here starts processes (tests/conftest.py)


@pytest.mark.parametrize("stages,gas,paci", [
    (2, 4, {"enabled": True, "accumulation_window": 2}),  # async: look-ahead facts, the tied exchange, drains
    (2, 2, {"enabled": True, "drain_every_batch": True}),  # sync mode: the deferred step at the end of the call
], ids=["async-tied", "sync-tied"])
def test_a_parsed_program_runs_on_the_engine_with_the_same_losses(stages, gas, paci):
    results = run_world(program_workers.direct_and_parsed, stages, stages, gas, paci, 5, (1, 3), timeout=420)
    for r in results:
        direct, text = r["direct"], r["text"]
        stage = direct["stage"]
        if stage == stages - 1:  # (earlier stages return the side channel's latest value: timing, not math)
            assert text["losses"] == direct["losses"] and text["evals"] == direct["evals"], stage
        assert all(torch.equal(text["weights"][k], direct["weights"][k]) for k in direct["weights"]), stage
        assert text["version"] == direct["version"] > 0
        joined = " | ".join(text["texts"])
        if paci.get("drain_every_batch"):  # (sync mode's tied weights: DeepSpeed's all-reduce, no exchange)
            # every call's only step ends its last tick (DeepSpeed's OptimizerStep position)
            assert all(t.rsplit(" | ", 1)[-1].split(",")[-1].startswith("STEP") for t in text["texts"] if "STEP" in t)
        else:
            assert "TPOST" in joined and "TAPPLY" in joined  # the tied exchange runs from its actions
            assert "[drain]" in joined  # the owner's last step of the closing drain, moved after it
            assert (",x]" in joined) == (stage < stages - 1)  # forwards the look-ahead predicts for
