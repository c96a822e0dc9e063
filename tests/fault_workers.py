"""Per-rank bodies of the fault-suite tests (run through ``harness.run_world``).

Real DeepSpeed engines (a 2-stage MLP pipeline with DeepSpeed's AdamW, whose state is
saved too) over gloo; faults are injected through :func:`ds_paci.core.checkpoint.atomic.set_fault_hook`
(a rank kills itself with SIGKILL at a chosen disk step of a save, or copies the whole
checkpoint folder there: the state a kill at that moment leaves behind).
"""

import os
import shutil
import signal

import torch

import ds_paci
from ds_paci.core.checkpoint import atomic as checkpoint
from ds_paci.core.health import lifecycle
from mlp import mlp_pipeline, regression_batches
from workers import ds_config, stage_weights


def mlp_engine(paci=True, seed=7):
    model = mlp_pipeline(2, layers=2, seed=seed)
    engine, *_ = ds_paci.initialize(model=model, model_parameters=model.parameters(),
                                    config=ds_config(2, {"enabled": True} if paci else None))
    return engine


def snapshot(src, dst, cut=None):
    """Copy folder ``src`` to ``dst`` as it is now; ``cut``: a file whose copy keeps only its first half."""
    for root, dirs, files in os.walk(src):
        target = os.path.join(dst, os.path.relpath(root, src))
        os.makedirs(target, exist_ok=True)
        for name in files:
            try:
                shutil.copyfile(os.path.join(root, name), os.path.join(target, name))
            except FileNotFoundError:
                continue
            if cut is not None and os.path.samefile(os.path.join(root, name), cut):
                with open(os.path.join(target, name), "r+b") as f:
                    f.truncate(os.path.getsize(cut) // 2)


def _loaded(engine, reference):
    """Which reference weights (name -> state dict) the engine's stage holds now."""
    mine = stage_weights(engine)
    for name, ref in reference.items():
        if all(torch.equal(mine[k], ref[k]) for k in ref):
            return name
    return None


# -- the save protocol, observed at every disk step --------------------------------------------------
def save_protocol(rank, root):
    """Saves A, B (new tag), B again (same tag), copying the folder at every disk step; then loads everything."""
    torch.distributed.barrier()
    save_dir = os.path.join(root, "ckpt")
    snaps = os.path.join(root, "snaps")
    engine = mlp_engine()
    data = regression_batches(2)
    weights, events, out = {}, [], {}

    def hook(event, path):
        name = f"r{rank}-{len(events):02d}-{event}"
        events.append((event, os.path.relpath(path, save_dir)))
        snapshot(save_dir, os.path.join(snaps, name))
        if event == "written":  # the same moment, had the kill come while this file was being written
            snapshot(save_dir, os.path.join(snaps, name + "-cut"), cut=path)

    engine.train_batch(data)
    engine.save_checkpoint(save_dir, tag="A", client_state={"which": "A"})
    weights["A"] = stage_weights(engine)
    engine.train_batch(data)
    checkpoint.set_fault_hook(hook)
    engine.save_checkpoint(save_dir, tag="B", client_state={"which": "B"})
    weights["B"] = stage_weights(engine)
    engine.train_batch(data)
    engine.save_checkpoint(save_dir, tag="B", client_state={"which": "B2"})  # re-save: the swap path
    weights["B2"] = stage_weights(engine)
    checkpoint.set_fault_hook(None)
    out["events"] = events
    out["files"] = sorted(os.listdir(save_dir))
    out["manifest"] = checkpoint.verify(os.path.join(save_dir, "B"))[2]

    # every snapshot: `latest` names a complete checkpoint, and the engine loads it
    torch.distributed.barrier()
    out["snapshots"] = {}
    for name in sorted(os.listdir(snaps)):
        folder = os.path.join(snaps, name)
        latest = checkpoint.read_latest(folder)
        status = checkpoint.verify(os.path.join(folder, latest))[0] if latest else None
        path, client = engine.load_checkpoint(folder)
        out["snapshots"][name] = {"latest": latest, "status": status, "which": client["which"],
                                  "weights": _loaded(engine, weights)}

    # a broken copy: truncated file, missing file, absent tag, no manifest (legacy)
    broken = os.path.join(root, "broken")
    if rank == 0:
        shutil.copytree(save_dir, broken)
        with open(os.path.join(broken, "B", "mp_rank_01_model_states.pt"), "r+b") as f:
            f.truncate(100)
        os.remove(os.path.join(broken, "A", "layer_00-model_states.pt"))
        legacy = os.path.join(root, "legacy")
        shutil.copytree(save_dir, legacy)
        os.remove(os.path.join(legacy, "B", checkpoint.MANIFEST))
    torch.distributed.barrier()
    for case, kwargs in (("truncated", {}), ("missing", {"tag": "A"}), ("absent", {"tag": "C"})):
        try:
            engine.load_checkpoint(broken, **kwargs)
            out[case] = None
        except checkpoint.CheckpointError as e:
            out[case] = str(e)
    path, client = engine.load_checkpoint(os.path.join(root, "legacy"))
    out["legacy"] = client["which"]

    # DeepSpeed's own engine (no "paci") reads the PACI checkpoint through DeepSpeed's own API
    stock = mlp_engine(paci=False, seed=99)
    path, client = stock.load_checkpoint(save_dir)
    out["stock_latest"] = (client["which"], _loaded(stock, weights))
    path, client = stock.load_checkpoint(save_dir, tag="A")
    out["stock_tag"] = (client["which"], _loaded(stock, weights))
    # ... and ds_paci.save_checkpoint makes the stock engine's saves atomic too
    stock_dir = os.path.join(root, "stock")
    stock.train_batch(data)
    ds_paci.save_checkpoint(stock, stock_dir, client_state={"which": "stock"})
    tag = checkpoint.read_latest(stock_dir)
    out["stock_save"] = (tag, checkpoint.verify(os.path.join(stock_dir, tag))[0])
    weights["stock"] = stage_weights(stock)
    fresh = mlp_engine(paci=False, seed=5)
    path, client = ds_paci.load_checkpoint(fresh, stock_dir)
    out["stock_reload"] = (client["which"], _loaded(fresh, weights))

    # two ranks agree on a stop step though only rank 1 was asked to stop
    out["agreement"] = agreement_rounds(rank, ask_rank=1, ask_at=2)
    return out


class _Asked:
    code = None

    def local_code(self):
        return self.code or 0


def agreement_rounds(rank, ask_rank, ask_at, rounds=8):
    """Boundaries 0..rounds; ``ask_rank`` requests a stop just before boundary ``ask_at``. Returns where each stopped."""
    asked = _Asked()
    agreement = lifecycle.StopAgreement(asked)
    for boundary in range(rounds):
        if rank == ask_rank and boundary == ask_at:
            asked.code = signal.SIGTERM
        decision = agreement.poll()
        if decision is not None:
            return {"boundary": boundary, "code": decision.code, "rank": decision.rank}
    agreement.close()
    return None


# -- real kills ------------------------------------------------------------------------------------
def killed_during_save(rank, root, victim, event, nth, cut, resave):
    """Save A; then ``victim`` SIGKILLs itself at its ``nth`` disk step ``event`` of the next save (B, or A again)."""
    save_dir = os.path.join(root, "ckpt")
    engine = mlp_engine()
    data = regression_batches(2)
    engine.train_batch(data)
    engine.save_checkpoint(save_dir, tag="A", client_state={"which": "A"})
    engine.train_batch(data)
    seen = []

    def hook(ev, path):
        if ev != event:
            return
        seen.append(path)
        if len(seen) == nth:
            if cut:
                with open(path, "r+b") as f:
                    f.truncate(os.path.getsize(path) // 2)
            os.kill(os.getpid(), signal.SIGKILL)

    if rank == victim:
        checkpoint.set_fault_hook(hook)
    tag = "A" if resave else "B"
    engine.save_checkpoint(save_dir, tag=tag, client_state={"which": tag + ("2" if resave else "")})
    return "survived"


def resume_each(rank, folders):
    """Resume (the main job's rule: latest if complete, else the last complete one) from each folder, then train."""
    out = {}
    data = regression_batches(2)
    for folder in folders:
        engine = mlp_engine(seed=123)
        tag, note = checkpoint.resume_tag(folder)
        path, client = engine.load_checkpoint(folder, tag=tag)
        version = engine.weight_version
        loss = engine.train_batch(data)
        engine.drain()
        # trained on: this stage stepped; the last stage's loss is finite (the other stages return the last
        # stage's value through the side channel, NaN until the first one arrives)
        trained = engine.weight_version > version and (not engine.is_last_stage() or bool(torch.isfinite(loss)))
        out[folder] = {"tag": tag, "note": note, "which": client["which"], "trained": trained}
    return out
