"""Two nodes on one machine: the main job and the runner across DeepSpeed launchers, node-local and shared
checkpoint disks, node failures.

Each "node" is its own ``deepspeed --hostfile H --no_ssh --node_rank R --master_addr 127.0.0.1`` launch (a session
of its own, so ``kill -- -PGID`` ends all of it); node-local disks are mount namespaces with a bind mount
(:mod:`ds_paci.tools.processes.local_nodes`). Every node is killed in ``finally``, so a failing test leaves no process.
The checkpoint protocol itself (four ranks as two nodes, real engines) runs through ``run_world``.
"""

import json
import os
import re
import signal
import time

import pytest

import multinode_workers
from harness import REPO_ROOT as ROOT, free_port, run_world
from ds_paci.core.checkpoint import atomic as checkpoint
from ds_paci.core.checkpoint import choice
from ds_paci.tools.processes.local_nodes import Node, node_command, stop_all, write_hostfile
from ds_paci.tools.studies.savekill import TINY, small_corpus, step_of

pytestmark = [pytest.mark.process,  # every test here starts processes (tests/conftest.py)
              pytest.mark.xdist_group("multinode")]  # one worker: the tests share the module fixture's world

BOUND_S = 30  # the README's bound is a few seconds; this margin is for a loaded 2-core machine


# == the checkpoint protocol, four ranks as two nodes ====================================================
@pytest.fixture(scope="module")
def protocol(tmp_path_factory):
    root = tmp_path_factory.mktemp("disks")
    return run_world(multinode_workers.disks_protocol, 4, str(root), timeout=420)


def test_node_local_disks_each_commit_and_hold_what_their_ranks_load(protocol):
    model_files = ["layer_00-model_states.pt", "layer_01-model_states.pt", "mp_rank_00_model_states.pt",
                   "mp_rank_01_model_states.pt"]
    for rank, r in enumerate(protocol):
        disk = r["saved"]
        assert disk["names"] == ["A", "B", "latest"] and disk["latest"] == "B", (rank, disk)  # nothing left hidden
        for tag in ("A", "B"):  # node 1's ranks wrote none of these: each was copied to its disk
            assert disk[tag]["status"] == "complete" and disk[tag]["files"] == model_files, (rank, disk[tag])
            assert disk[tag]["disk"] == {"disks": 2, "ranks": [rank % 2, rank % 2 + 2]}
        assert disk["B"]["save_id"] == protocol[0]["saved"]["B"]["save_id"]  # one save on both disks
        assert r["loads_latest"] == "B"


def test_latest_moves_only_once_every_disk_has_committed(protocol):
    for rank, r in enumerate(protocol):
        assert r["failed_save"] == protocol[0]["failed_save"]  # every rank, the same line
        assert "checkpoint 'C' was not saved: the commit failed on node 1 (rank 1)" in r["failed_save"]
        assert "No space left on device (injected)" in r["failed_save"] and "\n" not in r["failed_save"]
        after = r["after_failed_save"]
        assert after["latest"] == "B", after  # node 0 had renamed C, yet `latest` stayed B on both disks
        assert after["C"]["status"] == ("complete" if rank % 2 == 0 else "absent"), after
        assert r["loads_after_failed_save"] == "B"
        assert r["load_c"] == protocol[0]["load_c"] and "tag 'C': on node 1 (ranks 1, 3)" in r["load_c"]
        assert r["load_c"].endswith("/ckpt/C does not exist; the last complete checkpoint on every node is 'B' (load "
                                    "it with tag='B'; the main job's --resume falls back to it)")


def test_a_partial_checkpoint_on_one_node_is_refused_everywhere_naming_its_file(protocol):
    for r in protocol:
        line = r["load_partial"]
        assert line == protocol[0]["load_partial"] and "\n" not in line
        assert re.search(r"'latest' names 'B', but on node 1 \(ranks 1, 3\) \S+/ckpt/B is incomplete: "
                         r"\S+/ckpt/B/layer_00-model_states.pt is missing; the last complete checkpoint on every "
                         r"node is 'A'", line), line
        tag, note = r["resume_plan"]
        assert tag == "A" and "resuming from the last complete checkpoint on every node 'A'" in note
        assert r["resumes"] == "A"
        assert r["resaved"]["B"]["status"] == "complete" and r["loads_resaved"] == "B2"  # a re-save mends node 1


def test_use_node_local_storage_is_honoured_or_refused(protocol):
    for rank, r in enumerate(protocol):
        # this placement leaves no replica of stage 1 at local rank 0, so DeepSpeed writes no mp_rank_01 anywhere
        assert r["node_local_refused"].startswith("checkpoint 'D' was not saved: no rank wrote "
                                                  "mp_rank_01_model_states.pt"), r["node_local_refused"]
        assert r["after_refusal"]["latest"] == "B"
        # one shared folder, use_node_local_storage on: one disk, one committer (no race on the rename)
        shared = r["shared"]
        assert shared["latest"] == "S" and shared["S"]["status"] == "complete"
        assert shared["S"]["disk"] == {"disks": 1, "ranks": [0, 1, 2, 3]} and len(shared["S"]["files"]) == 4
        assert r["shared_renames"] == (1 if rank == 0 else 0)
        assert r["loads_shared"] == "S"


# == the main job across two launchers ======================================================================
def _config(tmp_path, node_local):
    cfg = json.load(open(os.path.join(ROOT, "configs", "paci.json")))
    if node_local:
        cfg["checkpoint"] = {"use_node_local_storage": True}
    path = tmp_path / f"paci{'-node-local' if node_local else ''}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _start(tmp_path, slots, config, ckpt, metrics, extra, node_local):
    """One launcher per node of ``slots``; with ``node_local`` each node's ``disk<R>`` is mounted at ``ckpt``."""
    host = write_hostfile(str(tmp_path / "hostfile"), slots)
    port = free_port()
    data = small_corpus(str(tmp_path.parent / "corpus.txt"))
    args = ["launch/train.py", "--deepspeed_config", config] + TINY + [
        "--data", data, "--log-interval", "1", "--metrics", str(metrics), "--checkpoint-dir", ckpt] + list(extra)
    return [Node(name, node_command(r, host, port, args, disk=str(tmp_path / f"disk{r}") if node_local else None,
                                    mountpoint=ckpt)) for r, name in enumerate(slots)]


def _losses(path):
    return {r["step"]: r["loss"] for r in map(json.loads, open(path)) if r.get("event") == "train"}


def _wait_for_step(metrics, step, nodes, timeout=300):
    """Wait until the metrics file records a step past ``step`` (the line is printed before it is recorded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(metrics) and any(s > step for s in _losses(metrics)):
            return
        assert all(n.proc.poll() is None for n in nodes), nodes[0].output[-3000:] + nodes[-1].output[-3000:]
        time.sleep(0.05)
    raise AssertionError(f"no step past {step} within {timeout}s: " + nodes[-1].output[-3000:])


def _kill_node(nodes, victim):
    """SIGKILL every process of node ``victim``; returns the other nodes' exit codes and the seconds until they end."""
    t0 = time.monotonic()
    nodes[victim].kill_all(signal.SIGKILL)
    codes = [n.finish(timeout=90) for i, n in enumerate(nodes) if i != victim]
    return codes, time.monotonic() - t0


def _ckpt_on(disk_or_dir):
    tag = checkpoint.read_latest(disk_or_dir)
    status, detail, manifest = checkpoint.verify(os.path.join(disk_or_dir, tag))
    assert status == "complete", detail
    return tag, manifest


def test_one_stage_per_node_tied_node_local_disks_node_killed_and_resumed_exactly(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    config = _config(tmp_path, node_local=True)
    common = ["--tie-embeddings", "--save-interval", "3", "--steps", "100000"]
    nodes = _start(tmp_path, {"nodeA": 1, "nodeB": 1}, config, ckpt, tmp_path / "m1.jsonl", common, True)
    try:  # 1. every process of node 1 (stage 1) killed after step 7: node 0 ends, naming the lost rank
        _wait_for_step(tmp_path / "m1.jsonl", 6, nodes)
        codes, took = _kill_node(nodes, 1)
    finally:
        stop_all(nodes)
    out = nodes[0].output
    assert codes == [87] and took < BOUND_S, (codes, took, out[-3000:])
    lost = [line for line in out.splitlines() if "is gone" in line]
    assert lost == ["[ds_paci] node 1 (rank 1) is gone (its connection to rank 0 closed without a clean exit); "
                    "stopping every other rank now (exit code 87); the last complete checkpoint stays the latest"], out
    assert "Traceback" not in out and not nodes[0].processes()
    disks = [str(tmp_path / f"disk{r}") for r in range(2)]
    for disk in disks:  # `latest` names a complete checkpoint on each disk, holding both stages' model-states files
        _, manifest = _ckpt_on(disk)  # (DeepSpeed's loader counts them on every rank)
        assert {"mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"} <= set(manifest["files"])
        assert manifest["disk"]["disks"] == 2
    names, _ = choice.choose([choice.local_view(d) for d in disks], ckpt, "resume")  # what the resume will load
    saved = step_of(disks[0], names[0])
    first = _losses(tmp_path / "m1.jsonl")
    assert saved == 6 and max(first) > saved, (saved, sorted(first))

    # 2. resume from the node-local disks: the same losses; then node 1's launcher killed: a clean stop everywhere
    nodes = _start(tmp_path, {"nodeA": 1, "nodeB": 1}, config, ckpt, tmp_path / "m2.jsonl", common + ["--resume"],
                   True)
    try:
        line = nodes[1].wait_for(r"resumed from|error:", timeout=300)
        assert line and f"at step {saved}" in line, nodes[1].output[-3000:]
        assert nodes[1].wait_for(rf"step +{max(first) + 1}/", timeout=120), nodes[1].output[-3000:]
        orphan = list(nodes[1].ranks().values())
        t0 = time.monotonic()
        nodes[1].launcher().kill()
        code0 = nodes[0].finish(timeout=90)
        while any(p.is_running() and p.status() != "zombie" for p in orphan) and time.monotonic() - t0 < 90:
            time.sleep(0.1)
        took = time.monotonic() - t0
        nodes[1].finish(timeout=30)
    finally:
        stop_all(nodes)
    assert code0 == 128 + signal.SIGTERM and took < BOUND_S, (code0, took, nodes[0].output[-3000:])
    stop = nodes[1].wait_for(r"stopping: launcher exit on rank 1; every rank stops after step \d+", timeout=1)
    assert stop, nodes[1].output[-3000:]
    stopped = int(stop.rsplit(" ", 1)[1])
    for disk in disks:  # the final save of the clean stop, committed on both disks
        tag, _ = _ckpt_on(disk)
        assert step_of(disk, tag) == stopped
    second = _losses(tmp_path / "m2.jsonl")
    common_steps = sorted(set(first) & set(second))
    assert common_steps and common_steps[0] == saved + 1
    assert [first[s] for s in common_steps] == [second[s] for s in common_steps]  # bit for bit


def test_replicas_across_nodes_shared_folder_node_killed_and_resumed_exactly(tmp_path):
    # nodeA: ranks 0-2, nodeB: rank 3; stage 0 = ranks 0, 1 and stage 1 = ranks 2 (nodeA), 3 (nodeB)
    ckpt = str(tmp_path / "ckpt")
    config = os.path.join("configs", "paci.json")
    slots = {"nodeA": 3, "nodeB": 1}
    nodes = _start(tmp_path, slots, config, ckpt, tmp_path / "m1.jsonl",
                   ["--stages", "2", "--save-interval", "3", "--steps", "100000"], False)
    try:
        _wait_for_step(tmp_path / "m1.jsonl", 3, nodes)
        codes, took = _kill_node(nodes, 1)
    finally:
        stop_all(nodes)
    out = nodes[0].output
    assert "2 stages x 2 data-parallel" in out
    assert codes == [87] and took < BOUND_S, (codes, took, out[-3000:])
    assert [line for line in out.splitlines() if "is gone" in line] == [
        "[ds_paci] node 1 (rank 3) is gone (its connection to rank 0 closed without a clean exit); stopping every "
        "other rank now (exit code 87); the last complete checkpoint stays the latest"], out[-3000:]
    tag, manifest = _ckpt_on(ckpt)
    assert manifest["disk"] == {"disks": 1, "ranks": [0, 1, 2, 3]}  # one committer for the shared folder
    assert len([f for f in manifest["files"] if f.startswith("layer_")]) == 5  # the manifest from every rank's report
    saved = step_of(ckpt, tag)
    first = _losses(tmp_path / "m1.jsonl")
    assert max(first) > saved

    nodes = _start(tmp_path, slots, config, ckpt, tmp_path / "m2.jsonl",
                   ["--stages", "2", "--save-interval", "3", "--steps", str(max(first) + 1), "--resume"], False)
    try:
        codes = [n.finish(timeout=300) for n in nodes]
    finally:
        stop_all(nodes)
    assert codes == [0, 0], nodes[0].output[-3000:] + nodes[1].output[-3000:]
    assert f"at step {saved}" in nodes[0].wait_for(r"resumed from", timeout=1)
    assert "==== summary" in nodes[0].output
    second = _losses(tmp_path / "m2.jsonl")
    steps = [s for s in sorted(second) if s in first]
    assert steps == list(range(saved + 1, max(first) + 1)), (steps, saved, sorted(first))
    assert [first[s] for s in steps] == [second[s] for s in steps]  # bit for bit


def test_the_runner_and_a_bad_input_across_nodes(tmp_path):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10**6,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}}, "paci": {"enabled": True}}
    (tmp_path / "paci.json").write_text(json.dumps(cfg))
    host = write_hostfile(str(tmp_path / "hostfile"), {"nodeA": 1, "nodeB": 1})
    script = os.path.join("tests", "scripts", "ds_pipeline_script.py")
    port = free_port()
    args = [script, "--deepspeed_config", str(tmp_path / "paci.json"), "--out", str(tmp_path / "out"), "--steps", "6"]
    nodes = [Node(f"node{r}", node_command(r, host, port, ["ds_paci.run"] + args, module=True)) for r in range(2)]
    try:
        codes = [n.finish(timeout=300) for n in nodes]
    finally:
        stop_all(nodes)
    assert codes == [0, 0], nodes[0].output[-3000:] + nodes[1].output[-3000:]
    ranks = [json.load(open(tmp_path / "out" / f"rank{r}.json")) for r in range(2)]
    assert [r["runs"][0]["engine"] for r in ranks] == ["PACIPipelineEngine"] * 2
    losses = ranks[1]["runs"][0]["losses"]
    assert losses[-1] < losses[0]

    # the main job with a data file only node 0 has: every node ends with one line naming node 1 (no rendezvous hang)
    data = small_corpus(str(tmp_path.parent / "corpus.txt"))
    port = free_port()
    nodes = []
    for r in range(2):
        job = ["launch/train.py", "--deepspeed_config", "configs/paci.json"] + TINY + [
            "--data", data if r == 0 else str(tmp_path / "no-such.txt"), "--steps", "2"]
        nodes.append(Node(f"node{r}", node_command(r, host, port, job)))
    try:
        codes = [n.finish(timeout=300) for n in nodes]
    finally:
        stop_all(nodes)
    assert codes == [2, 2], nodes[0].output[-3000:]
    errors = [line for n in nodes for line in n.lines if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: on node 1 (rank 1): ") and "no-such.txt" in errors[0]
