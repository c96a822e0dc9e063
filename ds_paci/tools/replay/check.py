"""The replay against the engine: the same run on real engines (one process per stage) and in the replay.

:class:`CheckSpec` is one run (shape, window, engine, model size, steps, evaluations).
:func:`engine_rank` is a rank's body for :func:`ds_paci.tools.processes.world.run_world`: it builds the GPT-2
pipeline with ``ds_paci.initialize`` (the benchmark's DeepSpeed config: torch AdamW, no clipping;
no ``paci`` section for ``stock``), trains, validates with ``eval_batch`` and returns the per-call
losses, the validation curve and its stage's final weights. :func:`replay_run` runs the same spec in
:func:`ds_paci.tools.replay.replayer.replay`; :func:`compare` says how far apart the two are.

``python -m ds_paci.tools.replay.check --stages 8 --micro-batches 4 --window auto --mode lookahead
--steps 40`` runs one spec both ways and prints the comparison as one JSON line (engine
confirmations of sweep cells).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass

ENGINE_MODES = ("stock", "paci", "lookahead")


@dataclass(frozen=True)
class CheckSpec:
    """One run: ``mode`` ``stock`` (DeepSpeed's engine; the replay's ``sync``), ``paci`` or ``lookahead``.

    ``window``: an int, ``"auto"`` or ``None`` (M); ``step_phase``: ``paci.step_phase`` of the PACI modes;
    ``sync_calls``: ``paci.sync_warmup_calls``. Validation at step 0, every ``eval_every`` steps
    (0: only at the end) and at the end, each after a drain (the engine's ``eval_batch``).
    """

    stages: int
    micro_batches: int
    mode: str
    window: object = None
    steps: int = 6
    eval_every: int = 3
    n_embd: int = 16
    n_head: int = 2
    seq_len: int = 16
    micro_batch_size: int = 2
    blocks_per_stage: int = 1
    eval_batches: int = 1  # validations use eval_batches x M micro-batches
    lr: float = 3e-3
    seed: int = 1234
    data_seed: int = 7
    step_phase: str = "aligned"
    slack_links: tuple = ()
    sync_calls: object = 0  # paci.sync_warmup_calls (the replay's sync_calls): an int or "auto"
    warm_ratio: float = 0.9  # paci.sync_warmup_loss_ratio of sync_calls "auto"

    def config(self):
        """The DeepSpeed config of the engine run (the benchmark's, :func:`ds_paci.tools.bench.runner.ds_config`)."""
        config = {"train_micro_batch_size_per_gpu": self.micro_batch_size,
                  "gradient_accumulation_steps": self.micro_batches, "steps_per_print": 10**9,
                  "gradient_clipping": 0.0,
                  "optimizer": {"type": "AdamW", "params": {"lr": self.lr, "torch_adam": True, "weight_decay": 0.0}}}
        if self.mode != "stock":
            config["paci"] = {"enabled": True, "lookahead": self.mode == "lookahead", "watchdog_seconds": 120}
            if self.window is not None:
                config["paci"]["accumulation_window"] = self.window
            config["paci"]["step_phase"] = self.step_phase
            if self.slack_links:
                config["paci"]["slack_links"] = list(self.slack_links)
            config["paci"]["sync_warmup_calls"] = self.sync_calls  # always: "auto" windows default to "auto"
            if self.sync_calls == "auto":
                config["paci"]["sync_warmup_loss_ratio"] = self.warm_ratio
        return config

    def model_config(self):
        from ds_paci.workload.gpt2 import gpt2_config
        return gpt2_config("tiny", vocab_size=257, n_positions=self.seq_len, n_embd=self.n_embd,
                           n_layer=self.stages * self.blocks_per_stage, n_head=self.n_head)


def _tokens():
    from ds_paci.tools.replay.replayer import load_tokens
    train, val, _ = load_tokens("byte", main_split=False)  # the benchmark's split
    return train, val


def _data(spec: CheckSpec, train, val):
    from ds_paci.workload.data import MicroBatchIterator, eval_micro_batches
    return (MicroBatchIterator(train, spec.micro_batch_size, spec.seq_len, seed=spec.data_seed),
            eval_micro_batches(val, spec.micro_batch_size, spec.seq_len,
                               count=spec.eval_batches * spec.micro_batches))


def _eval_steps(spec: CheckSpec) -> list:
    every = spec.eval_every or spec.steps
    return sorted({s for s in range(every, spec.steps + 1, every)} | {spec.steps})


def _engine_run(spec: CheckSpec, rank: int, tokens) -> dict:
    import torch

    import ds_paci
    from ds_paci.workload.gpt2 import gpt2_pipeline
    model = gpt2_pipeline(spec.model_config(), num_stages=spec.stages, seed=spec.seed)
    engine, *_ = ds_paci.initialize(model=model, model_parameters=model.parameters(), config=spec.config())
    train_iter, val = None, [None] * (spec.eval_batches * spec.micro_batches)
    if engine.is_first_stage() or engine.is_last_stage():
        train_iter, val = _data(spec, *tokens())
    paci = isinstance(engine, ds_paci.PACIPipelineEngine)

    def validate():
        M = spec.micro_batches
        losses = [float(engine.eval_batch(iter(val[i:i + M]))) for i in range(0, len(val), M)]
        return sum(losses) / len(losses)

    curve, call_losses, step = [(0, validate())], [], 0
    for target in _eval_steps(spec):
        while step < target:
            loss = float(engine.train_batch(train_iter))
            call_losses.append(None if math.isnan(loss) else loss)
            step += 1
        if paci:  # as the replay: evaluation leaves a partial window open, the end of training closes it
            engine.drain(close_window=step == spec.steps)
        curve.append((step, validate()))
    weights = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    out = {"rank": rank, "stage": engine.stage_id, "call_losses": call_losses, "curve": curve, "weights": weights,
           "window": engine.accumulation_window if paci else spec.micro_batches}
    engine.destroy()
    del engine
    torch.set_num_threads(1)
    return out


def engine_rank(rank: int, specs) -> list:
    """One rank's body: each spec of ``specs`` (same ``stages``) in turn on a fresh engine; plain data per spec."""
    import torch
    torch.set_num_threads(1)
    cache = {}

    def tokens():
        if not cache:
            cache["t"] = _tokens()
        return cache["t"]

    return [_engine_run(spec, rank, tokens) for spec in specs]


def run_engine(specs, timeout: float = 600, log_dir=None) -> list:
    """The engine runs of ``specs`` (one world of ``stages`` processes, one engine after the other): per spec, the
    last stage's per-call losses and curve and every stage's weights."""
    from ds_paci.tools.processes.world import run_world
    specs = [specs] if isinstance(specs, CheckSpec) else list(specs)
    if len({s.stages for s in specs}) != 1:
        raise ValueError("run_engine: every spec of one world needs the same number of stages")
    ranks = run_world(engine_rank, specs[0].stages, specs, timeout=timeout, log_dir=log_dir,
                      gloo_timeout_s=min(timeout, 300))
    out = []
    for i in range(len(specs)):
        per = sorted((r[i] for r in ranks), key=lambda r: r["stage"])
        weights = {}
        for r in per:
            weights.update(r["weights"])
        out.append({"call_losses": per[-1]["call_losses"], "curve": per[-1]["curve"], "weights": weights,
                    "windows": [r["window"] for r in per]})
    return out


def replay_run(spec: CheckSpec) -> dict:
    """The same run in the replay: per-call losses, curve and final weights (keys as the engine's state dicts)."""
    import torch

    from ds_paci.tools.replay.replayer import Evaluation, replay
    from ds_paci.workload.gpt2 import gpt2_reference_model
    torch.set_num_threads(1)
    model = gpt2_reference_model(spec.model_config(), seed=spec.seed)
    train_iter, val = _data(spec, *_tokens())
    mode = "sync" if spec.mode == "stock" else spec.mode
    result = replay(model, spec.stages, spec.micro_batches, train_iter, val, spec.steps, mode=mode,
                    window=spec.window, lr=spec.lr, betas=(0.9, 0.999), weight_decay=0.0,
                    evaluation=Evaluation(every=spec.eval_every), step_phase=spec.step_phase,
                    slack_links=spec.slack_links, sync_calls=spec.sync_calls,
                    warm_ratio=spec.warm_ratio)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"call_losses": result.call_losses, "curve": result.curve, "weights": weights, "windows": result.windows,
            "warm_calls": result.warm_calls}


def compare(engine: dict, replayed: dict) -> dict:
    """How far apart an engine run and a replay are: largest absolute differences of the per-call losses, the
    validation losses and the weights, and whether the losses and weights are bit-identical."""
    def loss_gap(a, b):
        if len(a) != len(b) or any((x is None) != (y is None) for x, y in zip(a, b)):
            return math.inf
        return max([abs(x - y) for x, y in zip(a, b) if x is not None] or [0.0])

    keys = sorted(engine["weights"])
    missing = sorted(set(keys) ^ set(replayed["weights"]))
    weight_gap = math.inf if missing else max(
        float((engine["weights"][k].double() - replayed["weights"][k].double()).abs().max()) for k in keys)
    same_weights = not missing and all(bool(engine["weights"][k].eq(replayed["weights"][k]).all()) for k in keys)
    return {"call_loss_gap": loss_gap(engine["call_losses"], replayed["call_losses"]),
            "call_losses_identical": engine["call_losses"] == replayed["call_losses"],
            "curve_gap": loss_gap([v for _, v in engine["curve"]], [v for _, v in replayed["curve"]]),
            "weight_gap": weight_gap, "weights_identical": same_weights, "missing_keys": missing,
            "windows": {"engine": engine["windows"], "replay": replayed["windows"]},
            "engine_final": engine["curve"][-1][1], "replay_final": replayed["curve"][-1][1]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ds_paci.tools.replay.check", description=__doc__.split("\n\n")[0])
    for name in ("stages", "micro-batches", "steps", "eval-every", "n-embd", "n-head", "seq-len", "micro-batch-size",
                 "blocks-per-stage", "eval-batches", "seed", "data-seed"):
        field_ = name.replace("-", "_")
        default = CheckSpec.__dataclass_fields__[field_].default
        p.add_argument(f"--{name}", type=int, required=default is dataclasses.MISSING,
                       default=None if default is dataclasses.MISSING else default)
    p.add_argument("--mode", choices=ENGINE_MODES, required=True)
    p.add_argument("--window", help="an int or 'auto' (default M)")
    p.add_argument("--lr", type=float, default=CheckSpec.lr)
    p.add_argument("--step-phase", choices=("aligned", "diagonal"), default=CheckSpec.step_phase)
    p.add_argument("--timeout", type=float, default=1800)
    args = p.parse_args(argv)
    window = None if args.window is None else (args.window if args.window == "auto" else int(args.window))
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(CheckSpec) if f.name != "window"}
    spec = CheckSpec(window=window, **fields)
    began = time.time()
    engine, = run_engine([spec], timeout=args.timeout, log_dir=tempfile.mkdtemp(prefix="ds_paci_replay_check_"))
    engine_s = time.time() - began
    replayed = replay_run(spec)
    out = {"spec": dataclasses.asdict(spec), **compare(engine, replayed), "engine_curve": engine["curve"],
           "replay_curve": replayed["curve"], "engine_seconds": round(engine_s, 1),
           "loadavg": [round(x, 2) for x in os.getloadavg()]}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
