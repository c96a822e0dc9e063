"""The look-ahead on tied owners (issue 28 item 3): real engines over gloo, the tied MLP on P = 2 (both stages own
the tied weight), a = M = 2, one replica.

A tied owner's step applies to the tied weight the owners' total of window ``k - L`` (the lagged exchange), which a
crossing forward cannot know yet: the look-ahead leaves the tied weights at their current value (reported in
``paci_stats()["lookahead"]["tied_unpredicted"]``, one line from rank 0 at start-up) and predicts every other
parameter of the owner with the norm the step clips by (the tied gradients left out, as the step zeroes them before
its norm). Before every local step, the prediction given the complete window (``n = a``) equals the step on every
predicted element: relative error ``||pred - next|| / ||next - current|| <= 1e-6`` over them, with and without
clipping (clipping active at every step), on the torch.optim, BF16_Optimizer and ZeRO-1 paths."""

import pytest

from harness import run_world

pytestmark = pytest.mark.process  # every test here starts processes (tests/conftest.py)


def test_tied_owner_predicts_every_untied_parameter_exactly_and_leaves_tied_weights_unpredicted():
    import lookahead_tied_workers as lw
    names = list(lw.CASES)
    calls = 4
    results = run_world(lw.tied_owner_predictions, 2, 2, 2, calls, names, timeout=300)
    for stage, r in enumerate(results):
        for name in names:
            row, case = r[name], lw.CASES[name]
            assert row["lookahead"] and row["owner"], (name, row["optimizer"])
            assert len(row["relative"]) == calls, (name, row["relative"])  # a = M: one step per call
            # every predicted element: the optimizer's step (relative error over them)
            assert max(row["relative"]) <= 1e-6, (name, stage, row["relative"], row["max_abs"])
            assert max(row["max_abs"]) <= 1e-6, (name, stage, row["max_abs"])
            # the tied weight: reported unpredicted, left where it is, while the real step moves it (after the lag)
            assert max(row["tied_predicted_move"]) == 0.0, (name, row["tied_predicted_move"])
            assert row["stats"]["tied_unpredicted"] == ["w"], (name, row["stats"])
            assert row["stats"]["unpredicted_elements"] == row["tied_elements"] > 0, name
            assert max(row["tied_real_move"]) > 1e-4, (name, row["tied_real_move"])
            assert row["tied"]["lag_windows"] >= 1
            if case.get("clip"):  # clipping was active: the stage's norm far above the threshold
                assert min(n for n in row["norms"] if n is not None) > 2 * case["clip"], (name, row["norms"])
                assert stage != 0 or row["stats"]["clipped_forwards"] == row["stats"]["predicted_forwards"] > 0
            # one line at start-up, from rank 0 only
            assert len(row["log"]) == (1 if stage == 0 else 0), (name, row["log"])
            if stage == 0:
                assert "w (stages [0, 1])" in row["log"][0], row["log"]
