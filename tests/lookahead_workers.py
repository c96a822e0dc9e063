"""Per-rank bodies of the look-ahead engine tests (run through ``harness.run_world``): real engines over gloo."""

import glob
import os

import torch

import ds_paci
from ds_paci.core.schedule import PACIStream
from deepspeed.runtime.pipe import schedule as ds
from mlp import TanhLayer, mlp_pipeline, regression_batches
from workers import MICRO, ds_config


def _layers(engine):
    return [m for m in engine.module.modules() if isinstance(m, TanhLayer)]


def _snapshot(engine):
    return {k: v.detach().double().clone() for k, v in engine.module.state_dict().items()}


def _max_diff(a, b):
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _reference_adamw(real, grad, state, group, n, window):
    """The look-ahead's prediction for AdamW written out independently (float64): see ds_paci.core.lookahead."""
    b1, b2 = group["betas"]
    lr, wd, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
    if state and "exp_avg" in state:
        t, m, v = float(state["step"]), state["exp_avg"].double(), state["exp_avg_sq"].double()
    else:
        t, m, v = 0.0, torch.zeros_like(real), torch.zeros_like(real)
    g = grad.double() * window / n
    m1 = b1 * m + (1 - b1) * g
    v1 = b2 * v + (1 - b2) * g * g
    m_hat, v_hat = m1 / (1 - b1**(t + 1)), v1 / (1 - b2**(t + 1))
    return real - lr * wd * real - lr * m_hat / (v_hat.sqrt() + eps)


def expected_crossings(stages, stage, window, micro_batches, calls):
    st = PACIStream(stages, stage, window)
    ticks = [t for _ in range(calls) for t in st.advance(2 * micro_batches)]
    return sum(1 for t in ticks for i in t if isinstance(i, ds.ForwardPass) and i.crosses_step)


# -- what each forward, backward, eval and checkpoint sees ---------------------------------------------
def views(rank, stages, gas, calls, restore, save_dir):
    """torch.optim AdamW, window a = M. Records the weights every forward and backward of this stage sees,
    next to the real weights (the optimizer's, refreshed after every local step) and, for crossing forwards, an
    independent reference of the predicted weights. Then eval and a checkpoint. Then an injected exception: stage 0
    raises inside its next crossing forward, the last stage inside its next backward (neither blocks the other)."""
    model = mlp_pipeline(stages, layers=stages)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-2, weight_decay=0.1)
    cfg = ds_config(gas, {"enabled": True, "lookahead_restore": restore}, optimizer=False)
    engine, *_ = ds_paci.initialize(model=model, optimizer=opt, config=cfg)
    la = engine._lookahead
    assert la is not None
    state = {"real": _snapshot(engine), "pending": None, "phase": "train", "raise": False}
    records = []
    alias_of = {id(p): alias for p, alias in engine._aliases.pairs}
    names = {id(p): n for n, p in engine.module.named_parameters()}

    original_after = la.after_step

    def after_step():
        original_after()
        state["real"] = _snapshot(engine)

    la.after_step = after_step
    original_applied = la.applied

    def applied(window_fill, window):
        state["pending"] = (window_fill, window)
        return original_applied(window_fill, window)

    la.applied = applied

    def on_forward(module, inputs):
        seen = {names[id(p)]: p.detach().double().clone() for p in module.parameters()}
        rec = {"kind": "forward", "phase": state["phase"], "training": module.training, "active": la.active,
               "seen": seen, "real": {k: state["real"][k] for k in seen}}
        if la.active:
            n, a = state["pending"]
            rec["reference"] = {
                names[id(p)]: _reference_adamw(state["real"][names[id(p)]], p.grad, opt.state.get(alias_of[id(p)]),
                                               opt.param_groups[0], n, a)
                for p in module.parameters()
            }
            rec["window_fill"] = n
            if state["raise"] and engine.stage_id == 0:
                raise RuntimeError("injected failure inside a crossing forward")
        records.append(rec)

    def on_backward(module, grad_output):
        seen = {names[id(p)]: p.detach().double().clone() for p in module.parameters()}
        records.append({"kind": "backward", "phase": state["phase"], "active": la.active, "seen": seen,
                        "real": {k: state["real"][k] for k in seen}})
        if state["raise"] and engine.is_last_stage():
            raise RuntimeError("injected failure inside a backward")

    for layer in _layers(engine):
        layer.register_forward_pre_hook(on_forward)
        layer.register_full_backward_pre_hook(on_backward)

    data = regression_batches(MICRO)
    for _ in range(calls):
        engine.train_batch(data)
    engine.drain()  # the drain's backward passes still count as training
    stats_train = engine.paci_stats()
    state["phase"] = "eval"
    eval_loss = engine.eval_batch(iter([next(data) for _ in range(gas)]))
    state["phase"] = "checkpoint"
    engine.save_checkpoint(save_dir, tag="t")
    saved = {}
    for path in glob.glob(os.path.join(save_dir, "t", "layer_*-model_states.pt")):
        layer = int(os.path.basename(path).split("_")[1].split("-")[0])
        for k, v in torch.load(path, weights_only=False).items():
            saved[f"{layer}.{k}"] = v.double()
    at_save = _snapshot(engine)
    real_at_save = state["real"]
    # keep training, then the injected failures
    state["phase"] = "train2"
    for _ in range(2):
        engine.train_batch(data)
    state["phase"] = "failure"
    state["raise"] = True
    error = None
    try:
        engine.train_batch(data)
    except ds_paci.PACIStreamError as e:
        error = str(e)
    after_failure = _snapshot(engine)
    return {
        "stage": engine.stage_id,
        "records": records,
        "stats": stats_train,
        "expected_crossings": expected_crossings(stages, engine.stage_id, engine.accumulation_window, gas, calls),
        "eval": float(eval_loss),
        "saved": saved,
        "at_save": at_save,
        "real_at_save": real_at_save,
        "error": error,
        "after_failure": after_failure,
        "real_at_failure": state["real"],
        "active_after_failure": la.active,
    }


# -- the predictor, given the complete window, equals the optimizer's step: every optimizer and precision -------
OPTIMIZER_CASES = {
    "torch.optim.Adam (L2 decay)": dict(client="adam"),
    "torch.optim.AdamW": dict(client="adamw"),
    "DeepSpeed AdamW (torch_adam)": dict(configured={"torch_adam": True}),
    "DeepSpeed AdamW (FusedAdam)": dict(configured={}),
    "DeepSpeed Adam, L2 decay (FusedAdam)": dict(configured={"adam_w_mode": False}, type="Adam"),
    "bf16 BF16_Optimizer": dict(configured={"torch_adam": True}, bf16=True),
    "bf16 ZeRO-1": dict(configured={"torch_adam": True}, bf16=True, zero=1),
    "ZeRO-1 fp32": dict(configured={"torch_adam": True}, zero=1),
}


def _engine_for(case, stages, gas):
    model = mlp_pipeline(stages, layers=2 * stages)
    extra = {"zero_optimization": {"stage": case.get("zero", 0)}}
    paci = {"enabled": True}
    if "client" in case:
        params = model.parameters()
        opt = (torch.optim.Adam(params, lr=1e-2, weight_decay=0.05) if case["client"] == "adam" else
               torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1))
        cfg = ds_config(gas, paci, bf16=case.get("bf16", False), optimizer=False, **extra)
        engine, *_ = ds_paci.initialize(model=model, optimizer=opt, config=cfg)
    else:
        cfg = ds_config(gas, paci, bf16=case.get("bf16", False), **extra)
        cfg["optimizer"] = {"type": case.get("type", "AdamW"),
                            "params": {"lr": 1e-2, "betas": [0.9, 0.95], "weight_decay": 0.1, **case["configured"]}}
        # the predictor must use the learning rate the scheduler sets for the next step
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 2e-3, "warmup_max_lr": 1e-2,
                                                           "warmup_num_steps": 3}}
        engine, *_ = ds_paci.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def predictor_matches_step(rank, stages, gas, calls, names):
    """For each optimizer case: before every local step predict with n = a, compare with the real step after it.

    Also checks that weights are real again after every crossing forward (bf16/ZeRO: the low-precision weights equal
    the master exactly) and that crossing forwards really ran on different weights."""
    out = {}
    for name in names:
        case = OPTIMIZER_CASES[name]
        engine = _engine_for(case, stages, gas)
        la = engine._lookahead
        row = {"wrapper": type(engine.optimizer).__name__, "inner": type(getattr(engine.optimizer, "optimizer",
                                                                                  engine.optimizer)).__name__,
               "lookahead": la is not None, "diffs": [], "moved": [], "restored": [], "changed": []}
        out[name] = row
        if la is None:
            continue
        lp = [p for p in engine.module.parameters()]
        window = engine.accumulation_window
        pending = {}

        def before_step(original=la.before_step):
            pending["pred"] = la.predict_next(window, window)
            pending["before"] = [m.detach().clone() for m in la.masters()]
            original()

        def after_step(original=la.after_step):
            original()
            masters = la.masters()
            row["diffs"].append(max((p - m).abs().max().item() for p, m in zip(pending["pred"], masters)))
            row["moved"].append(max((b - m).abs().max().item() for b, m in zip(pending["before"], masters)))

        original_applied = la.applied

        class Applied:

            def __init__(self, n, a):
                self.inner = original_applied(n, a)

            def __enter__(self):
                self.real = [p.detach().clone() for p in lp]
                self.inner.__enter__()
                row["changed"].append(max((p.detach() - r).abs().max().item() for p, r in zip(lp, self.real)))

            def __exit__(self, *exc):
                result = self.inner.__exit__(*exc)
                row["restored"].append(max((p.detach() - r).abs().max().item() for p, r in zip(lp, self.real)))
                return result

        la.before_step, la.after_step, la.applied = before_step, after_step, Applied
        gen = regression_batches(MICRO)
        if case.get("bf16"):
            gen = ((x.bfloat16(), y.bfloat16()) for x, y in gen)
        for _ in range(calls):
            engine.train_batch(gen)
        engine.drain()
        row["stats"] = engine.paci_stats()["lookahead"]
        engine.destroy()
    return out
