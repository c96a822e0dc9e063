"""The prepared GPU script (scripts/gpu_quality_check.py) runs end to end at tiny sizes on the CPU (--dry-run).

On a GPU the same code runs at GPT-2 small/medium sizes; here it must produce every part: the bf16 replay of
stock, PACI and PACI + look-ahead at P = 8 (the look-ahead predicted), positive per-block F/B/W times, and
the predictor equal to the next step of fused AdamW, FusedAdam and a bf16 PACI engine.
"""

import json
import math
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.process  # every test here starts processes (tests/conftest.py)


def test_gpu_quality_script_dry_run_produces_every_part(tmp_path, repo_root):
    script = repo_root / "scripts" / "gpu_quality_check.py"
    done = subprocess.run([sys.executable, str(script), "--dry-run", "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_quality.json").read_text())
    engines = result["replay_bf16"]["engines"]
    assert set(engines) == {"stock", "paci", "paci+lookahead"}
    assert all(math.isfinite(e["final"]) and e["final"] < e["curve"][0][1] for e in engines.values())
    assert engines["paci+lookahead"]["predicted_forwards"] > 0 and engines["paci"]["predicted_forwards"] == 0
    assert engines["paci"]["final"] != engines["stock"]["final"]
    seconds = result["block_times_gpt2_medium"]["seconds"]
    assert set(seconds) == {"forward", "backward_input", "backward_weight"} and min(seconds.values()) > 0
    checks = result["predictor"]
    assert set(checks) == {"torch AdamW fused (fp32)", "DeepSpeed FusedAdam (fp32)", "PACI engine bf16 (BF16_Optimizer)"}
    for name, check in checks.items():
        assert check["predicted"] and check["ok"] and max(check["relative_gaps"]) <= 1e-6, (name, check)
    assert checks["PACI engine bf16 (BF16_Optimizer)"]["wrapper"] == "BF16_Optimizer"
