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


# -- the variants and their prediction (pure) ---------------------------------------------------------------------
ISSUE27 = {  # variant -> (step phase, overlapped reduce with replicas, non-blocking transfers)
    "paci-before": ("aligned", False, False),
    "+diagonal": ("diagonal", False, False),
    "+overlap": ("aligned", True, False),
    "+nonblocking": ("aligned", False, True),
    "all": ("diagonal", True, True),
}


def test_the_default_variants_are_stock_paci_before_each_item_and_all():
    assert list(linked.DEFAULT_VARIANTS) == ["stock"] + list(ISSUE27)
    assert linked.engine_settings(linked.DEFAULT_VARIANTS["stock"], 4, dp=2) == {"schedule": "stock"}
    for name, (phase, overlap, nonblocking) in ISSUE27.items():
        overlay = linked.DEFAULT_VARIANTS[name]
        assert overlay["paci"]["lookahead"] is False, name  # the variants differ only in items 1-3
        for dp in (1, 2):
            assert linked.engine_settings(overlay, 4, dp=dp) == {
                "schedule": "paci", "phase": phase, "window": 4, "overlap": overlap and dp > 1,
                "nonblocking": nonblocking}, (name, dp)


def test_engine_settings_follow_the_engine_rules():
    paci = {"paci": {"enabled": True}}
    # today's defaults: aligned, overlapped with replicas, blocking; the window is M unless configured
    assert linked.engine_settings(paci, 8, dp=2) == {"schedule": "paci", "phase": "aligned", "window": 8,
                                                      "overlap": True, "nonblocking": False}
    assert linked.engine_settings({"paci": {"enabled": False}}, 4, dp=2) == {"schedule": "stock"}
    assert linked.engine_settings({"paci": {"accumulation_window": 2}}, 4, dp=1)["window"] == 2
    # bf16 and ZeRO keep the reduce at the step
    assert not linked.engine_settings(dict(paci, bf16={"enabled": True}), 4, dp=2)["overlap"]
    assert not linked.engine_settings(dict(paci, zero_optimization={"stage": 1}), 4, dp=2)["overlap"]
    # sync mode (a = M) is DeepSpeed's step: aligned, reduce at the step, blocking transfers
    sync = {"paci": {"drain_every_batch": True, "overlap_reduce": True, "nonblocking_transfers": True}}
    assert linked.engine_settings(sync, 4, dp=2) == {"schedule": "paci", "phase": "aligned", "window": 4,
                                                      "overlap": False, "nonblocking": False}
    # "sim" overrides the prediction's overlap and window
    assert linked.engine_settings(dict(paci, sim={"overlap": False, "window": 2}), 4, dp=2)["overlap"] is False
    assert linked.engine_settings(dict(paci, sim={"overlap": False, "window": 2}), 4, dp=2)["window"] == 2


def _report(variants, ran=None):
    bandwidth, latency = 100e6 / 8, 0.7e-3
    runs = []
    for name, overlay in variants.items():
        run = {"variant": name, "seconds_per_batch": [0.40, 0.44, 0.42]}
        if "paci" in overlay:
            run.update(ForwardPass=0.021, BackwardPass=0.041, ran=(ran or {}).get(name, linked.engine_settings(
                {k: v for k, v in overlay.items() if k != "sim"}, 4, dp=2)))
        runs.append(run)
    return {"ping_pong": {s: latency + s / bandwidth for s in linked.SIZES}, "activation_bytes": 262144,
            "grad_bytes_per_stage": 262144, "runs": runs}


def test_predict_models_each_variant_as_the_engine_runs_it():
    from ds_paci.tools.sim.links import Link, LinkModel
    from ds_paci.tools.sim.simulate import CostModel, long_run_period
    out = linked.predict(_report(linked.DEFAULT_VARIANTS), linked.DEFAULT_VARIANTS, 4, dp=2)
    assert out["link"]["bandwidth_bytes_per_s"] == pytest.approx(100e6 / 8)
    assert out["link"]["latency_s"] == pytest.approx(0.7e-3)
    link = Link(out["link"]["latency_s"], out["link"]["bandwidth_bytes_per_s"])

    def cost(overlap):
        return CostModel(forward=0.021, backward=0.041, links=LinkModel(link, link, 1, 262144, 262144, dp=2,
                                                                        overlap=overlap))

    rows = out["rows"]
    assert rows["stock"]["predicted_s_per_mb"] == long_run_period("stock", 2, 4, cost=cost(False))
    for name, (phase, overlap, nonblocking) in ISSUE27.items():
        assert rows[name]["measured_s_per_mb"] == pytest.approx(0.42 / 4) and rows[name]["samples"] == 3
        expected = long_run_period("paci", 2, 4, window=4, cost=cost(overlap), phase=phase,
                                   transfers="nonblocking" if nonblocking else "blocking")
        assert rows[name]["predicted_s_per_mb"] == expected, name
    predicted = {n: r["predicted_s_per_mb"] for n, r in rows.items()}
    # each item alone lowers the prediction below PACI before the issue, all three lower it most
    for name in ("+diagonal", "+overlap", "+nonblocking"):
        assert predicted["all"] < predicted[name] < predicted["paci-before"] < predicted["stock"], predicted


def test_predict_refuses_a_variant_the_engine_ran_otherwise():
    variants = {"stock": {}, "+overlap": linked.DEFAULT_VARIANTS["+overlap"]}
    ran = {"+overlap": {"schedule": "paci", "phase": "aligned", "window": 4, "overlap": False,
                        "nonblocking": False}}
    with pytest.raises(RuntimeError, match="variant '\\+overlap': the engine ran"):
        linked.predict(_report(variants, ran), variants, 4, dp=2)


def test_done_when_per_rate_and_variant():
    def cell(rate, shape, stock, paci):
        return {"rate_mbit": rate, "shape": shape, "rows": {"stock": {"measured_s_per_mb": stock},
                                                            "paci": {"measured_s_per_mb": paci}}}

    report = {"variants": {"stock": {}, "paci": {"paci": {}}}, "gas": 4,
              "cells": [cell(100, "pp2", 0.12, 0.10), cell(100, "pp2dp2", 0.13, 0.104),
                        cell(300, "pp2", 0.09, 0.07), cell(300, "pp2dp2", 0.10, 0.09)]}
    rows = linked.done_when(report)
    assert [(r["rate_mbit"], r["variant"]) for r in rows] == [(100, "paci"), (300, "paci")]
    assert rows[0]["dp_over_pp"] == pytest.approx(1.04) and rows[0]["within"]
    assert rows[0]["speedup"] == pytest.approx(1.25) and rows[0]["of_limit"] == pytest.approx(1.0)
    assert rows[0]["holds"]
    assert rows[1]["dp_over_pp"] == pytest.approx(9 / 7) and not rows[1]["within"]
    assert rows[1]["of_limit"] == pytest.approx(0.10 / 0.09 / 1.25) and not rows[1]["holds"]


def test_engine_settings_carry_slack_links_in_async_mode_only():
    slack = {"paci": {"enabled": True, "nonblocking_transfers": True, "slack_links": [0]}}
    assert linked.engine_settings(slack, 4, dp=1)["slack"] == [0]
    assert "slack" not in linked.engine_settings({"paci": {"enabled": True}}, 4, dp=1)
