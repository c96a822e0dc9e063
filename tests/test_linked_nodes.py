"""Two "nodes" joined by a real, bandwidth-limited link (``ds_paci.tools.processes.netns``), running real engines.

Each node is a network namespace; a veth pair limited by ``tc ... tbf`` joins them. A PACI pipeline (2 stages one
per node, and 2 stages x 2 replicas with each stage's replicas on different nodes) trains across that link over
gloo and its last stage must produce exactly the losses of the same run on loopback, and every rank exactly its
weights after the closing drain; the link must really be limited (a 2 MiB message takes at least what the token
bucket lets through); the namespaces must be gone afterwards, also when the body fails. Needs root (``ip netns add``); fails with the one-line reason elsewhere, as
``tests/test_multinode.py`` does without mount namespaces.
"""

import json
import os
import subprocess
import sys

import pytest

from ds_paci.tools.processes import netns
from ds_paci.tools.studies import linked

RATE_MBIT = 100
PACI = {"paci": {"enabled": True, "lookahead": False}}


def _netns_names():
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _argv(out_dir):
    return [sys.executable, "-m", "ds_paci.tools.studies.linked", "--rank-job", "--out-dir", out_dir, "--variants",
            json.dumps({"paci": PACI}), "--f", "0", "--micro", "2", "--gas", "4", "--act-kb", "64", "--grad-kb",
            "64", "--batches", "3", "--warmup", "0", "--rounds", "1"]


def _run(linked_nodes, shape, out_dir):
    os.makedirs(out_dir)
    codes, outputs = linked.run_shape(linked_nodes, shape, lambda rank: _argv(out_dir), timeout=600)
    assert codes == [0] * len(codes), "\n".join(f"--- rank {r}: exit {c}\n{o[-2000:]}"
                                                for r, (c, o) in enumerate(zip(codes, outputs)))
    return [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(len(codes))]


@pytest.mark.process
@pytest.mark.parametrize("shape", ["pp2", "pp2dp2"])
def test_a_paci_pipeline_across_a_limited_link_equals_loopback(tmp_path, shape):
    why = netns.unavailable()
    assert why is None, why
    with netns.LinkedNodes(RATE_MBIT) as nodes:
        names = set(nodes.names)
        assert names <= _netns_names()
        across = _run(nodes, shape, str(tmp_path / "linked"))
    assert not names & _netns_names()  # deleted on exit
    local = _run(None, shape, str(tmp_path / "loopback"))
    for rank, (a, b) in enumerate(zip(across, local)):
        assert a["runs"][0]["engine"] == "PACIPipelineEngine", a["runs"][0]
        assert len(a["runs"][0]["losses"]) == 3 and None not in a["runs"][0]["losses"]
        # the last stage's own losses, bit for bit (a first stage returns the newest loss that has reached it over
        # the side channel: which one depends on the link's timing, so it is not compared)
        if a["runs"][0]["last_stage"]:
            assert a["runs"][0]["losses"] == b["runs"][0]["losses"], (rank, a["runs"], b["runs"])
            assert min(a["runs"][0]["losses"]) > 0, a["runs"][0]["losses"]
        # every rank's weights after the closing drain, bit for bit: the same arithmetic whatever the link's timing
        weights, loopback = a["runs"][0]["weights_sha256"], b["runs"][0]["weights_sha256"]
        assert weights["start"] == loopback["start"], rank
        assert weights["drained"] == loopback["drained"], (rank, weights, loopback)
        assert weights["drained"] != weights["start"], rank  # training changed them (the comparison means something)
    assert sum(a["runs"][0]["last_stage"] for a in across) == {"pp2": 1, "pp2dp2": 2}[shape]
    # the link is limited: a token bucket passes at most burst + rate * t bytes in t seconds
    size = max(int(k) for k in across[0]["ping_pong"])
    one_way = across[0]["ping_pong"][str(size)]
    floor = (size - netns.burst_bytes(RATE_MBIT)) / (RATE_MBIT * 1e6 / 8)
    assert one_way >= floor, (one_way, floor)
    assert local[0]["ping_pong"][str(size)] < one_way  # and the loopback run was not limited the same way


@pytest.mark.process
def test_namespaces_are_removed_when_the_body_fails_and_after_a_killed_run():
    with pytest.raises(RuntimeError, match="boom"):
        with netns.LinkedNodes(RATE_MBIT) as nodes:
            names = set(nodes.names)
            raise RuntimeError("boom")
    assert not names & _netns_names()
    # a run that was SIGKILLed leaves its namespaces; the next LinkedNodes removes them (their pid is gone)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = f"{netns.PREFIX}{dead.pid}-abcdef-a"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        with netns.LinkedNodes(RATE_MBIT) as nodes:
            assert stale not in _netns_names()
            assert nodes.names[0] in _netns_names()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)


@pytest.mark.parametrize("spec", ["paci", "paci={", "=[]", "x=[1]"])
def test_a_bad_variant_is_one_line(spec):
    with pytest.raises(SystemExit) as e:
        linked._parse_variants([spec])
    assert str(e.value).startswith("error: --variant") and "\n" not in str(e.value)


def test_rates_must_be_positive():
    with pytest.raises(ValueError, match="rate_mbit must be > 0"):
        netns.LinkedNodes(0)


def test_without_root_the_harness_and_the_study_refuse_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    why = netns.unavailable()
    assert why.startswith("emulated links need root") and "\n" not in why
    assert linked.main(["--rates", "100"]) == 2
    assert capsys.readouterr().err == f"error: {why}\n"


@pytest.mark.process
def test_a_failing_rank_ends_the_others_at_once(tmp_path):
    """Rank 1 exits 3 before joining; rank 0, waiting for it in the rendezvous (a 300 s timeout), is killed by the
    harness (-9) rather than left to time out and exit with its own error."""
    out_dir = str(tmp_path)

    def argv(rank):
        return _argv(out_dir) if rank == 0 else [sys.executable, "-c", "import sys; sys.exit(3)"]

    codes, outputs = linked.run_shape(None, "pp2", argv, timeout=600)
    assert codes == [-9, 3], (codes, outputs[0][-2000:])
