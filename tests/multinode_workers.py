"""Per-rank bodies of the multi-node checkpoint test (run through ``harness.run_world``).

Four ranks play two nodes: each sets the variables DeepSpeed's launcher gives a rank (``CROSS_RANK``,
``CROSS_SIZE``, ``LOCAL_RANK``, ``LOCAL_SIZE``), and for node-local disks enters a mount namespace of its own in
which its node's disk is bind-mounted at the checkpoint path (:func:`ds_paci.tools.processes.local_nodes.private_mount`),
so the two "nodes" see different files at the same path. Real DeepSpeed engines (a 2-stage MLP pipeline with
DeepSpeed's AdamW, 2 data-parallel replicas per stage) over gloo.
"""

import errno
import os

import torch

import ds_paci
from ds_paci.core.checkpoint import atomic as checkpoint
from ds_paci.tools.processes.local_nodes import private_mount
from mlp import mlp_pipeline, regression_batches
from workers import ds_config, stage_weights


def as_node(rank, node_of):
    """Set this rank's launcher variables as if ``node_of[rank]`` were its node."""
    node = node_of[rank]
    mates = [r for r, n in enumerate(node_of) if n == node]
    os.environ.update(CROSS_RANK=str(node), CROSS_SIZE=str(len(set(node_of))), LOCAL_RANK=str(mates.index(rank)),
                      LOCAL_SIZE=str(len(mates)))
    return node


def engine(seed=7, node_local=False):
    model = mlp_pipeline(2, layers=2, seed=seed)
    extra = {"checkpoint": {"use_node_local_storage": True}} if node_local else {}
    eng, *_ = ds_paci.initialize(model=model, model_parameters=model.parameters(),
                                 config=ds_config(2, {"enabled": True}, **extra))
    return eng


def _disk_facts(ckpt, tags):
    out = {"names": sorted(n for n in os.listdir(ckpt) if not n.startswith(".ds_paci-write")),
           "latest": checkpoint.read_latest(ckpt)}
    for tag in tags:
        status, detail, manifest = checkpoint.verify(os.path.join(ckpt, tag))
        out[tag] = {"status": status, "detail": detail, "files": sorted((manifest or {}).get("files", {})),
                    "disk": (manifest or {}).get("disk"), "save_id": (manifest or {}).get("save_id")}
    return out


def _error_of(fn):
    try:
        fn()
    except checkpoint.CheckpointError as e:
        return str(e)
    return None


def _loads(eng, ckpt, weights, **kwargs):
    """Which of ``weights`` (name -> this stage's state dict) the engine holds after loading from ``ckpt``."""
    eng.load_checkpoint(ckpt, **kwargs)
    mine = stage_weights(eng)
    return next((name for name, ref in weights.items() if all(torch.equal(mine[k], ref[k]) for k in ref)), None)


def disks_protocol(rank, root):
    """Node-local disks (a stage's replicas on both nodes), a failed commit, a partial disk, a shared disk."""
    node_of = [0, 1, 0, 1]  # stage 0 = ranks 0, 1 and stage 1 = ranks 2, 3: each stage has a replica on each node
    node = as_node(rank, node_of)
    ckpt = os.path.join(root, "ckpt")
    private_mount(os.path.join(root, f"disk{node}"), ckpt)
    torch.distributed.barrier()
    out, weights, data = {}, {}, regression_batches(2)
    eng = engine()
    eng.train_batch(data)
    eng.save_checkpoint(ckpt, tag="A")
    weights["A"] = stage_weights(eng)
    eng.train_batch(data)
    eng.save_checkpoint(ckpt, tag="B")
    weights["B"] = stage_weights(eng)
    out["saved"] = _disk_facts(ckpt, ["A", "B"])
    out["loads_latest"] = _loads(engine(seed=99), ckpt, weights)

    # node 1's committer fails while renaming its staging folder to C: `latest` stays B on both disks
    def failing_rename(event, path):
        if event == "rename" and os.path.basename(path) == "C":
            raise OSError(errno.ENOSPC, "No space left on device (injected)", path)

    checkpoint.set_fault_hook(failing_rename if rank == 1 else None)
    eng.train_batch(data)
    out["failed_save"] = _error_of(lambda: eng.save_checkpoint(ckpt, tag="C"))
    checkpoint.set_fault_hook(None)
    out["after_failed_save"] = _disk_facts(ckpt, ["B", "C"])
    out["loads_after_failed_save"] = _loads(engine(seed=98), ckpt, weights)
    out["load_c"] = _error_of(lambda: engine(seed=97).load_checkpoint(ckpt, tag="C"))

    # a file of B lost on node 1's disk: every rank refuses B, naming node 1's file; a resume falls back to A
    torch.distributed.barrier()
    if rank == 1:
        os.remove(os.path.join(ckpt, "B", "layer_00-model_states.pt"))
    torch.distributed.barrier()
    out["load_partial"] = _error_of(lambda: engine(seed=96).load_checkpoint(ckpt))
    out["resume_plan"] = checkpoint.agreed_resume_tag(ckpt)
    out["resumes"] = _loads(engine(seed=95), ckpt, weights, tag=out["resume_plan"][0])

    # a re-save of B replaces it on both disks
    eng.save_checkpoint(ckpt, tag="B")
    weights["B2"] = stage_weights(eng)
    out["resaved"] = _disk_facts(ckpt, ["B"])
    out["loads_resaved"] = _loads(engine(seed=94), ckpt, weights)

    # use_node_local_storage with this placement: DeepSpeed writes no rank's mp_rank_01 file: refused, not committed
    out["node_local_refused"] = _error_of(lambda: engine(node_local=True).save_checkpoint(ckpt, tag="D"))
    out["after_refusal"] = _disk_facts(ckpt, [])

    # one shared folder, use_node_local_storage on, a stage per node: one committer, the manifest from reports
    as_node(rank, [0, 0, 1, 1])
    shared = os.path.join(root, "shared")
    renames = []
    checkpoint.set_fault_hook(lambda event, path: renames.append(path) if event == "rename" else None)
    shared_engine = engine(node_local=True)
    shared_engine.train_batch(data)
    shared_engine.save_checkpoint(shared, tag="S")
    checkpoint.set_fault_hook(None)
    weights["S"] = stage_weights(shared_engine)
    out["shared"] = _disk_facts(shared, ["S"])
    out["shared_renames"] = len(renames)
    out["loads_shared"] = _loads(engine(seed=93), shared, weights)
    return out
