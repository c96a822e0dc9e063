"""Per-rank bodies of the tied-owner look-ahead test (issue 28 item 3), run through ``harness.run_world``: real
engines over gloo, the tied MLP (first and last layer's weight one ``TiedLayerSpec``: every stage of P = 2 owns it)."""

import torch

import ds_paci
from mlp import mlp_pipeline, regression_batches
from lookahead_workers import build_logged, predict_before_each_step
from workers import MICRO, ds_config

ADAMW = {"lr": 3e-2, "betas": [0.9, 0.95], "weight_decay": 0.1, "torch_adam": True}
CASES = {
    "torch.optim.AdamW": dict(client=True),
    "torch.optim.AdamW, clipping": dict(client=True, clip=0.05),
    "bf16 BF16_Optimizer, clipping": dict(bf16=True, clip=0.05),
    "ZeRO-1 fp32, clipping": dict(zero=1, clip=0.05),
}


def _engine(case, stages, gas):
    model = mlp_pipeline(stages, layers=2 * stages, tied=True)
    extra = {"zero_optimization": {"stage": case.get("zero", 0)}, "gradient_clipping": case.get("clip", 0.0)}
    cfg = ds_config(gas, {"enabled": True}, bf16=case.get("bf16", False), optimizer=False, **extra)
    if case.get("client"):
        opt = torch.optim.AdamW(model.parameters(), lr=3e-2, betas=(0.9, 0.95), weight_decay=0.1)
        return ds_paci.initialize(model=model, optimizer=opt, config=cfg)[0]
    cfg["optimizer"] = {"type": "AdamW", "params": ADAMW}
    return ds_paci.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]


def _tied_masks(engine):
    """``{id(tensor the optimizer steps): bool mask of its tied elements}``, from where the tied optimizer writes the
    lagged totals (independent of the look-ahead's own bookkeeping)."""
    masks = {}
    for s in engine._tied.optimizer.slots:
        mask = masks.setdefault(id(s.target), torch.zeros(s.target.numel(), dtype=torch.bool))
        mask[s.start:s.start + s.numel] = True
    return masks


def _compare(la, pred, before, row, masks):
    """One step: the n = a prediction ``pred`` against the real next masters, split into tied and the rest."""
    err_sq = move_sq = tied_pred = tied_moved = 0.0
    worst = 0.0
    for slot, p, b in zip(la.slots, pred, before):
        nxt = slot.master.detach().double().reshape(-1)
        p, b = p.double().reshape(-1), b.double().reshape(-1)
        fixed = masks.get(id(slot.master), torch.zeros(nxt.numel(), dtype=torch.bool))
        free = ~fixed
        err_sq += float((p[free] - nxt[free]).pow(2).sum())
        move_sq += float((nxt[free] - b[free]).pow(2).sum())
        if free.any():
            worst = max(worst, float((p[free] - nxt[free]).abs().max()))
        if fixed.any():
            tied_pred = max(tied_pred, float((p[fixed] - b[fixed]).abs().max()))
            tied_moved = max(tied_moved, float((nxt[fixed] - b[fixed]).abs().max()))
    row["relative"].append((err_sq / move_sq) ** 0.5 if move_sq > 0 else 0.0)
    row["max_abs"].append(worst)
    row["tied_predicted_move"].append(tied_pred)
    row["tied_real_move"].append(tied_moved)


def tied_owner_predictions(rank, stages, gas, calls, names):
    """For each case: before every local step of every owner, predict with the complete window (n = a) and compare
    with the step (relative error over the predicted elements; the tied elements separately)."""
    out = {}
    for name in names:
        case = CASES[name]
        engine, lines = build_logged(_engine, case, stages, gas)
        la = engine._lookahead
        window = engine.accumulation_window
        row = {"relative": [], "max_abs": [], "tied_predicted_move": [], "tied_real_move": [], "norms": [],
               "lookahead": la is not None, "optimizer": type(engine.optimizer).__name__,
               "log": [x for x in lines if "tied weights are not predicted" in x],
               "owner": bool(engine._tied.exchanges)}
        out[name] = row
        masks = _tied_masks(engine)
        predict_before_each_step(la, window, lambda pred, before: _compare(la, pred, before, row, masks))
        data = regression_batches(MICRO)
        if case.get("bf16"):
            data = ((x.bfloat16(), y.bfloat16()) for x, y in data)
        for _ in range(calls):
            engine.train_batch(data)
            row["norms"].append(engine.get_global_grad_norm())
        engine.drain()
        row["stats"] = engine.paci_stats()["lookahead"]
        row["tied_elements"] = sum(int(m.sum()) for m in masks.values())
        row["tied"] = engine.paci_stats()["tied"]
        engine.destroy()
    return out
