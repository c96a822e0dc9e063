"""The ``"diagonal"`` step phase on real engines over gloo: resumed exactly, refused under another phase with one line
on every rank, a closed checkpoint taken by either phase (issue 27, item 1). The replay's equality with the engine
under the diagonal phase is in ``tests/test_replay_engine.py``.

One world of four ranks per shape: P = 2 x DP = 2 and P = 4.
"""

import pytest

import phase_workers
from harness import run_world
from test_resume_matrix import assert_continues, assert_refused

pytestmark = pytest.mark.process


@pytest.mark.parametrize("stages", [2, 4])
def test_diagonal_resumes_exactly_and_refuses_another_phase(stages, tmp_path):
    results = run_world(phase_workers.world, 4, str(tmp_path), stages, timeout=600)
    for r in results:
        facts = r["diagonal_facts"]
        # the diagonal really ran: stage s's phase is s mod a (a = 3), its first window partial
        assert facts["step_phase"] == "diagonal" and facts["phase"] == facts["stage"] % 3, facts
        assert_continues(r["same"], r["ref"], f"P={stages} diagonal resumed")
        # a closed checkpoint is taken by an aligned engine: it goes on in its own phase, from a full window
        closed = r["closed_facts"]
        assert closed["step_phase"] == "aligned" and closed["phase"] == 0 and closed["open_window"] == 3, closed
        assert closed["window_fill"] == 0
        assert "error" not in r["closed_trained"]
    # stages whose phase differs from 0 saved an open window: every rank refuses with one line
    assert_refused(results, "aligned_into", "WindowStateError", "step phase", "step_phase")
