"""Smoke test of the soak benchmark (issue 16, item 9): a short real run of ``ds_paci.tools.studies.soak``.

The benchmark's figures (memory growth, seconds per call) are never thresholds here; this asserts what would break
if the tool or the engine were wrong: every rank samples, the tied exchange's transfers in flight stay within the
documented ``L + 1`` per peer (and are really counted), the saves rotate and ``latest`` names a complete
checkpoint that a fresh engine loads with the trained weights.
"""

import math
import os

import pytest

import reliability_cases
from ds_paci.core.checkpoint.atomic import COMPLETE, read_latest, verify
from ds_paci.tools.studies import soak

CALLS, EVERY, SAMPLE = 120, 40, 10


@pytest.mark.process
def test_a_short_soak_samples_every_rank_bounds_tied_transfers_and_resumes(tmp_path):
    """2 stages (tied embedding), a = 1 with M = 2 (two local steps per call, L = 2), 120 calls, an evaluation
    and a save every 40: the series, the bound on transfers in flight, the rotated checkpoints, the resume."""
    save_dir = str(tmp_path / "ckpt")
    os.makedirs(save_dir)
    job = soak.SoakJob(calls=CALLS, stages=2, dp=1, micro_batches=2, window=1, eval_every=EVERY, save_every=EVERY,
                       sample_every=SAMPLE, keep=2, checkpoint_dir=save_dir)
    result = soak.run_soak(job, log_dir=str(tmp_path / "logs"), timeout=300)
    ranks = result["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and {r["stage"] for r in ranks} == {0, 1}
    for r in ranks:
        calls = [s["call"] for s in r["samples"]]
        assert calls == list(range(SAMPLE, CALLS + 1, SAMPLE)), calls
        assert all(s["rss_kib"] > 0 and s["s_per_call"] > 0 for s in r["samples"])
        assert r["stats"]["train_batch_calls"] == CALLS and r["stats"]["skipped_steps"] == 0
        assert [c for c, _ in r["evals"]] == [40, 80, 120]
        if r["stage"] == 1:
            assert all(math.isfinite(loss) for _, loss in r["evals"])
        lag = r["lag_windows"]
        assert r["tied_owner"] and lag == 2, (r["tied_owner"], lag)
        sends = [s["pending_sends"] for s in r["samples"]]
        receives = [s["pending_receives"] for s in r["samples"]]
        assert max(sends + [r["max_pending_sends"]]) <= lag + 1
        assert max(receives + [r["max_pending_receives"]]) <= lag + 1
        # between calls the last L windows are in flight (read through paci_stats), none after an evaluation's drain
        assert max(sends) == lag and max(receives) == lag and r["max_pending_sends"] == lag + 1, (sends, receives)
        assert sends[EVERY // SAMPLE - 1] == receives[EVERY // SAMPLE - 1] == 0
        assert r["saves"] == ["call0000040", "call0000080", "call0000120"]
        assert r["final_tag"] == r["loaded"] == "call0000120-final" and r["loaded_calls"] == CALLS
        assert r["resume_matches"], "a fresh engine loading latest does not hold the trained weights"
    assert read_latest(save_dir) == "call0000120-final"
    assert verify(os.path.join(save_dir, "call0000120-final"))[0] == COMPLETE
    assert sorted(d for d in os.listdir(save_dir) if d.startswith("call")) == ["call0000120", "call0000120-final"]
    summary = result["summary"]
    assert [s["rank"] for s in summary] == [0, 1]
    for s in summary:
        assert s["call_at_10pct"] == 20 and s["pending_bound"] == 3 and math.isfinite(s["rss_growth_pct"])
    assert "| 1 | 1 | 0 | 20 |" in reliability_cases.soak_markdown(result)


def test_bad_arguments_end_with_one_line_before_any_world(capsys):
    for argv, word in ((["--calls", "0"], "--calls"), (["--stages", "1"], "--stages"),
                       (["--calls", "50", "--sample-every", "25"], "--sample-every"),
                       (["--eval-every", "-1"], "--eval-every"), (["--n-layer", "1"], "--n-layer")):
        assert soak.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and word in err[0], err
