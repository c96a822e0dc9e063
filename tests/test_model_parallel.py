"""Model (tensor) parallelism is refused at ``initialize`` (issue 28 item 8): PACI's stage norms, clip coefficients,
non-finite verdicts and the look-ahead's clip source are per rank, with no reduction over a model-parallel slice, so
the slices of a stage would clip and skip apart. Real ranks over gloo, DeepSpeed's own topology."""

import pytest

from harness import run_world

pytestmark = pytest.mark.process  # every test here starts processes (tests/conftest.py)


def test_a_model_parallel_topology_is_refused_on_every_rank_with_one_line():
    import topology_workers as tw
    results = run_world(tw.model_parallel_refused, 4, timeout=240)
    for out in results:  # every rank refuses, with the same line, at once (nothing collective ran: no hang)
        for case in ("mp2", "autotp2"):
            assert out[case]["error"] == results[0][case]["error"], case
            assert out[case]["seconds"] < 30, out[case]
        assert out["mp1"] == {"error": None, "type": "PACIPipelineEngine"}, out["mp1"]
    mp2, autotp2 = results[0]["mp2"]["error"], results[0]["autotp2"]["error"]
    for line in (mp2, autotp2):
        assert line and "\n" not in line and "model (tensor) parallelism is not supported" in line, line
        assert 'remove the "paci" section' in line, line
    assert '"model" axis of size 2 (PipeModelDataParallelTopology)' in mp2 and "PipeDataParallelTopology" in mp2
    assert '"tensor_parallel.autotp_size" = 2' in autotp2
