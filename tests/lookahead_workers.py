"""Per-rank bodies of the look-ahead engine tests (run through ``harness.run_world``): real engines over gloo."""

import glob
import logging
import os

import torch
from deepspeed.pipe import LayerSpec, PipelineModule
from deepspeed.utils import logger as ds_logger

import ds_paci
from ds_paci.core.program.actions import Kind
from ds_paci.core.program.stream import PACIStream
from deepspeed.runtime.pipe import schedule as ds
from mlp import DIM, TanhLayer, layer_weights, mlp_pipeline, mse, regression_batches
from workers import MICRO, ds_config


def _layers(engine):
    return [m for m in engine.module.modules() if isinstance(m, TanhLayer)]


def _hook_layers(engine, on_forward, on_backward):
    """``on_forward`` before every layer's forward, ``on_backward`` before its backward."""
    for layer in _layers(engine):
        layer.register_forward_pre_hook(on_forward)
        layer.register_full_backward_pre_hook(on_backward)


def _snapshot(engine):
    return {k: v.detach().double().clone() for k, v in engine.module.state_dict().items()}


def _max_diff(a, b):
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _reference_adamw(real, grad, state, group, n, window):
    """The look-ahead's prediction for AdamW written out independently (float64): see ds_paci.core.lookahead.predict."""
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
    return sum(1 for t in ticks for i in t if i.kind is Kind.FORWARD and i.crosses_step)


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

    _hook_layers(engine, on_forward, on_backward)

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
ADAMW = {"lr": 1e-2, "betas": [0.9, 0.95], "weight_decay": 0.1}
OPTIMIZER_CASES = {
    "torch.optim.Adam (L2 decay)": dict(client="adam"),
    "torch.optim.AdamW": dict(client="adamw"),
    "DeepSpeed AdamW (torch_adam)": dict(configured={**ADAMW, "torch_adam": True}),
    "DeepSpeed AdamW (FusedAdam)": dict(configured=ADAMW),
    "DeepSpeed Adam, L2 decay (FusedAdam)": dict(configured={**ADAMW, "adam_w_mode": False}, type="Adam"),
    "bf16 BF16_Optimizer": dict(configured={**ADAMW, "torch_adam": True}, bf16=True),
    "bf16 ZeRO-1": dict(configured={**ADAMW, "torch_adam": True}, bf16=True, zero=1),
    "ZeRO-1 fp32": dict(configured={**ADAMW, "torch_adam": True}, zero=1),
    # gradient clipping active at every step (the stage's norm is far above 0.05): the clipped step is predicted
    "torch.optim.AdamW, clipping": dict(client="adamw", clip=0.05),
    "bf16 BF16_Optimizer, clipping": dict(configured={**ADAMW, "torch_adam": True}, bf16=True, clip=0.05),
    "ZeRO-1 fp32, clipping": dict(configured={**ADAMW, "torch_adam": True}, zero=1, clip=0.05),
    "bf16 ZeRO-1, clipping": dict(configured={**ADAMW, "torch_adam": True}, bf16=True, zero=1, clip=0.05),
    # parameters without a gradient in the window after the first call: DeepSpeed's reduce gives them zeros
    "torch.optim.AdamW, a branch without gradient": dict(client="adamw", branch=True),
    "torch.optim.SGD, Nesterov": dict(client="sgd"),
    "DeepSpeed SGD (momentum, dampening, decay), clipping": dict(
        configured={"lr": 5e-2, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01}, type="SGD", clip=0.05),
    "bf16 SGD (momentum)": dict(configured={"lr": 5e-2, "momentum": 0.9}, type="SGD", bf16=True),
    "torch.optim.Muon (a bias-free model)": dict(client="muon"),
    "DeepSpeed Muon (MuonWithAuxAdam, FusedAdam part)": dict(
        configured={"lr": 1e-2, "momentum": 0.9, "weight_decay": 0.01, "betas": [0.9, 0.95]}, type="Muon"),
    # not predicted: a subclass with its own step (one log line)
    "torch.optim.Adam subclass with its own step": dict(client="adam_subclass", predicted=False),
}


class OwnStepAdam(torch.optim.Adam):
    """An Adam subclass whose step differs (it halves the gradient first): the look-ahead must not predict it."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(0.5)
        return super().step(closure)


class BranchLayer(TanhLayer):
    """A TanhLayer with a second linear map used only while ``BranchLayer.on`` (a conditional branch, an idle expert)."""

    on = True

    def __init__(self, index, seed, dim=DIM):
        super().__init__(index, seed, dim)
        self.branch = torch.nn.Linear(dim, dim)

    def forward(self, x):
        y = super().forward(x)
        return y + 0.5 * torch.tanh(self.branch(y)) if BranchLayer.on else y


class MatrixLayer(torch.nn.Module):
    """``tanh(x @ W^T)``: only 2-D parameters (torch.optim.Muon refuses others)."""

    def __init__(self, index, seed, dim=DIM):
        super().__init__()
        self.weight = torch.nn.Parameter(layer_weights(index, seed, dim)[0])

    def forward(self, x):
        return torch.tanh(x @ self.weight.T)


def _model_for(case, stages):
    layer = MatrixLayer if case.get("client") == "muon" else BranchLayer if case.get("branch") else None
    if layer is None:
        return mlp_pipeline(stages, layers=2 * stages)
    BranchLayer.on = True
    return PipelineModule(layers=[LayerSpec(layer, i, 7) for i in range(2 * stages)], num_stages=stages, loss_fn=mse,
                          partition_method="uniform")


def _client_optimizer(kind, params):
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-2, weight_decay=0.05)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=5e-2, momentum=0.9, nesterov=True, weight_decay=0.01)
    if kind == "muon":
        return torch.optim.Muon(params, lr=2e-2, momentum=0.9, weight_decay=0.01)
    return OwnStepAdam(params, lr=1e-2)


def _engine_for(case, stages, gas):
    model = _model_for(case, stages)
    extra = {"zero_optimization": {"stage": case.get("zero", 0)}, "gradient_clipping": case.get("clip", 0.0)}
    if case.get("zero") and case.get("type") == "SGD":
        extra["zero_allow_untested_optimizer"] = True
    paci = {"enabled": True}
    if "client" in case:
        opt = _client_optimizer(case["client"], list(model.parameters()))
        cfg = ds_config(gas, paci, bf16=case.get("bf16", False), optimizer=False, **extra)
        engine, *_ = ds_paci.initialize(model=model, optimizer=opt, config=cfg)
    else:
        cfg = ds_config(gas, paci, bf16=case.get("bf16", False), optimizer=False, **extra)
        cfg["optimizer"] = {"type": case.get("type", "AdamW"), "params": case["configured"]}
        # the predictor must use the learning rate the scheduler sets for the next step
        lr = case["configured"]["lr"]
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": lr / 5, "warmup_max_lr": lr,
                                                           "warmup_num_steps": 3}}
        engine, *_ = ds_paci.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


class _Lines(logging.Handler):

    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def build_logged(build, *args):
    """``build(*args)`` with DeepSpeed's logger captured: (what it returned, the messages logged while it ran)."""
    lines = _Lines()
    ds_logger.addHandler(lines)
    try:
        return build(*args), lines.lines
    finally:
        ds_logger.removeHandler(lines)


def predictor_matches_step(rank, stages, gas, calls, names):
    """For each optimizer case: before every local step predict with n = a, compare with the real step after it.

    Also checks that weights are real again after every crossing forward (bf16/ZeRO: the low-precision weights equal
    the master exactly) and that crossing forwards really ran on different weights."""
    out = {}
    for name in names:
        case = OPTIMIZER_CASES[name]
        engine, lines = build_logged(_engine_for, case, stages, gas)
        la = engine._lookahead
        row = {"wrapper": type(engine.optimizer).__name__, "inner": type(getattr(engine.optimizer, "optimizer",
                                                                                  engine.optimizer)).__name__,
               "lookahead": la is not None, "diffs": [], "moved": [], "restored": [], "changed": [], "norms": [],
               "log": [x for x in lines if "look-ahead off" in x]}
        out[name] = row
        if la is None:
            engine.destroy()
            continue
        _record_steps(engine, la, row)
        gen = regression_batches(MICRO)
        if case.get("bf16"):
            gen = ((x.bfloat16(), y.bfloat16()) for x, y in gen)
        for call in range(calls):
            engine.train_batch(gen)
            BranchLayer.on = False  # after the first call the branch gets no gradient
            row["norms"].append(engine.get_global_grad_norm())
        engine.drain()
        row["stats"] = engine.paci_stats()["lookahead"]
        engine.destroy()
    return out


def predict_before_each_step(la, window, compare):
    """Wrap the look-ahead's step hooks: just before each local step predict with the complete window (n = a) and
    copy the masters; just after it call ``compare(prediction, masters before the step)``."""
    pending = {}

    def before_step(original=la.before_step):
        pending["pred"] = la.predict_next(window, window)
        pending["before"] = [m.detach().clone() for m in la.masters()]
        original()

    def after_step(original=la.after_step):
        original()
        compare(pending["pred"], pending["before"])

    la.before_step, la.after_step = before_step, after_step


def _record_steps(engine, la, row):
    """Wrap the look-ahead's hooks: the n = a prediction before each step vs the step; weights around each forward."""
    lp = [p for p in engine.module.parameters()]

    def compare(pred, before):
        masters = la.masters()
        row["diffs"].append(max((p - m).abs().max().item() for p, m in zip(pred, masters)))
        row["moved"].append(min((b - m).abs().max().item() for b, m in zip(before, masters)))

    predict_before_each_step(la, engine.accumulation_window, compare)

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

    la.applied = Applied


# -- data-parallel replicas stay bit-identical --------------------------------------------------------------
def replicas(rank, stages, gas, calls, restore):
    """P stages x DP replicas, torch.optim AdamW, look-ahead on: every rank's weights and optimizer state after
    ``calls`` calls (and after a drain), for the test to compare replicas of one stage bit for bit."""
    model = mlp_pipeline(stages, layers=2 * stages, dim=16)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-2, weight_decay=0.1)
    cfg = ds_config(gas, {"enabled": True, "lookahead_restore": restore}, optimizer=False)
    engine, *_ = ds_paci.initialize(model=model, optimizer=opt, config=cfg)
    data = regression_batches(MICRO, seed=3 + engine.grid.data_parallel_id, dim=16)  # each replica its own data
    snapshots = []
    for _ in range(calls):
        engine.train_batch(data)
        snapshots.append(_snapshot(engine))
    engine.drain()
    state = [t.detach().clone() for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    return {"stage": engine.stage_id, "dp": engine.grid.data_parallel_id, "snapshots": snapshots,
            "final": _snapshot(engine), "state": state, "stats": engine.paci_stats()["lookahead"]}


# -- failures at every point of a predicted forward ---------------------------------------------------------
class _RaiseOnce:
    """Replace ``torch.<name>`` by a version that raises on its ``nth`` call while installed."""

    def __init__(self, name, nth):
        self.name, self.nth, self.calls, self.fired = name, nth, 0, False
        self.original = getattr(torch, name)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.nth and not self.fired:
            self.fired = True
            raise RuntimeError(f"injected failure in torch.{self.name} (call {self.nth})")
        return self.original(*args, **kwargs)

    def __enter__(self):
        setattr(torch, self.name, self)

    def __exit__(self, *exc):
        setattr(torch, self.name, self.original)


INJECTION_POINTS = ("prediction of param group 0", "prediction of param group 1", "forward", "restore")


def failures(rank, stages, gas, points):
    """:func:`failure_at` for each point, each on a fresh engine; returns ``{point: result}``."""
    return {point: failure_at(stages, gas, point) for point in points}


def failure_at(stages, gas, point):
    """Stage 0 (torch.optim AdamW, two param groups, default restore) fails at ``point`` of its next crossing
    forward, the last stage inside its next backward in the same call (neither then waits for the other).

    The prediction fails as an out-of-memory in the foreach temporaries would: the k-th ``torch._foreach_sqrt_``
    (Adam's denominators: one call per batch, one batch per param group here) raises; the restore's first copy
    raises. Returns the weights just before that forward and after the exception, and the engine's error."""
    model = mlp_pipeline(stages, layers=2 * stages)
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    opt = torch.optim.AdamW([{"params": weights}, {"params": biases, "weight_decay": 0.0}], lr=2e-2,
                            weight_decay=0.1)
    engine, *_ = ds_paci.initialize(model=model, optimizer=opt, config=ds_config(gas, {"enabled": True},
                                                                                 optimizer=False))
    la = engine._lookahead
    state = {"armed": False}
    seen = {}
    original_applied = la.applied

    class Armed:

        def __init__(self, n, a):
            self.inner = original_applied(n, a)

        def __enter__(self):
            if not state["armed"]:
                return self.inner.__enter__()
            seen["before"] = _snapshot(engine)
            if point.startswith("prediction"):
                with _RaiseOnce("_foreach_sqrt_", int(point[-1]) + 1):
                    return self.inner.__enter__()
            return self.inner.__enter__()

        def __exit__(self, *exc):
            if state["armed"] and point == "restore":
                with _RaiseOnce("_foreach_copy_", 1):
                    return self.inner.__exit__(*exc)
            return self.inner.__exit__(*exc)

    la.applied = Armed

    def on_forward(module, inputs):
        if state["armed"] and point == "forward" and la.active:
            raise RuntimeError("injected failure inside a crossing forward")

    def on_backward(module, grad_output):
        if state["armed"] and engine.is_last_stage():
            raise RuntimeError("injected failure inside a backward")

    _hook_layers(engine, on_forward, on_backward)
    data = regression_batches(MICRO)
    for _ in range(2):
        engine.train_batch(data)
    state["armed"] = True
    error = None
    try:
        engine.train_batch(data)
    except ds_paci.PACIStreamError as e:
        error = str(e)
    out = {"stage": engine.stage_id, "error": error, "before": seen.get("before"), "after": _snapshot(engine),
           "active": la.active, "restore": la.stats()["restore"]}
    engine.destroy()
    return out
