"""The replay is evidence: it reproduces real PACI engines (one process per stage, gloo) bit for bit.

Per depth one world runs a few engines one after the other (``ds_paci.tools.replay.check``): with and
without the look-ahead, ``a = M`` and ``a != M`` (drift 2 where ``a < P-1``, partial windows stepped at
the drains before each validation), the ``"diagonal"`` step phase (partial first windows, forwards that predict
from them), slack links (``"slack_links"``: more micro-batches in flight upstream of a link, gradients sent
later), a synchronous warm start (``"sync_warmup_calls"``: stock's schedule, then the streams, aligned or diagonal),
and DeepSpeed's stock engine at P = 2. The replay of each spec must
give the same per-call losses (the engine's return value on the last stage), the same validation losses
and the same final weights, every bit: the sweep in ``docs/results/quality.md`` runs on the replay.
"""

import pytest

from ds_paci.tools.replay.check import CheckSpec, compare, replay_run, run_engine

pytestmark = pytest.mark.process  # every test here starts processes (tests/conftest.py)

CASES = {
    2: [CheckSpec(2, 2, "stock"), CheckSpec(2, 2, "paci"), CheckSpec(2, 2, "lookahead", window=3),
        CheckSpec(2, 2, "lookahead", window=3, step_phase="diagonal")],
    4: [CheckSpec(4, 2, "paci"), CheckSpec(4, 2, "lookahead", window="auto"),
        CheckSpec(4, 4, "lookahead", window=3, step_phase="diagonal"),
        CheckSpec(4, 4, "lookahead", window=3, step_phase="diagonal", slack_links=(1, )),
        CheckSpec(4, 2, "lookahead", window="auto", slack_links=(0, 2)),
        CheckSpec(4, 2, "lookahead", window="auto", sync_calls=3),
        CheckSpec(4, 2, "lookahead", window="auto", step_phase="diagonal", sync_calls=2),
        # the "auto" warm start: its end on the loss (ratio 1.65: after call 9 of this tiny model, the replay says)
        CheckSpec(4, 2, "lookahead", window="auto", steps=11, sync_calls="auto", warm_ratio=1.65)],
    8: [CheckSpec(8, 4, "lookahead", window=4, steps=5, eval_every=2),
        CheckSpec(8, 4, "paci", window="auto", steps=5, eval_every=2),
        CheckSpec(8, 4, "lookahead", window=4, steps=5, eval_every=2, step_phase="diagonal")],
}


@pytest.mark.parametrize("stages", sorted(CASES))
def test_the_replay_reproduces_the_engine_bit_for_bit(stages, tmp_path):
    specs = CASES[stages]
    engines = run_engine(specs, timeout=600, log_dir=str(tmp_path / "logs"))  # 9 specs at P = 4: minutes at load 10
    for spec, engine in zip(specs, engines):
        replayed = replay_run(spec)
        gap = compare(engine, replayed)
        where = (f"P={spec.stages} M={spec.micro_batches} {spec.mode} window={spec.window} {spec.step_phase} "
                 f"slack={spec.slack_links} sync_calls={spec.sync_calls}")
        assert gap["windows"]["engine"] == gap["windows"]["replay"], where
        assert len(engine["call_losses"]) == spec.steps and engine["call_losses"][-1] is not None, where
        assert gap["call_losses_identical"], f"{where}: per-call losses differ by {gap['call_loss_gap']}"
        assert gap["curve_gap"] == 0.0, f"{where}: validation losses differ by {gap['curve_gap']}"
        assert gap["weights_identical"], f"{where}: final weights differ by {gap['weight_gap']} {gap['missing_keys']}"
        if spec.sync_calls == "auto":  # it ended inside the run, so both sides switched at the same call
            assert 8 <= replayed["warm_calls"] < spec.steps, (where, replayed["warm_calls"])
    # the cases differ from each other: the check would notice a replay that ignored mode or window
    finals = [e["curve"][-1][1] for e in engines]
    assert len(set(finals)) == len(finals)
