"""The quality checks that need one GPU (issue 19, item 7), as one prepared script of at most 8 minutes on an H200.

``python scripts/gpu_quality_check.py --out runs/gpu`` (on a machine with CUDA) runs three parts and writes
``<out>/gpu_quality.json``:

1. **Replay at GPT-2 small scale in bf16** (:mod:`ds_paci.tools.replay.replayer` on the GPU under ``torch.autocast``,
   fp32 master weights and AdamW state): 8 blocks x 768 (12 heads), sequences of 256, micro-batches of 8,
   P = 8 stages, M = 8, for stock (sync), plain PACI and PACI + look-ahead: final validation loss, look-ahead
   telemetry and seconds.
2. **Per-block times of GPT-2 Medium** (one block of 1024, 16 heads, sequence 1024, micro-batch 8, bf16):
   forward, input-gradient backward (B) and weight-gradient backward (W), median of CUDA-event timings, in
   the form the simulator's cost model takes (seconds per block).
3. **The look-ahead's predictor on the CUDA optimizers one GPU reaches**: given the complete window it must
   equal the next step (max |prediction - step| <= 1e-6 relative to the weights' scale in fp32): torch's
   fused CUDA AdamW and DeepSpeed's FusedAdam on fp32 parameters, and a one-stage PACI engine in bf16
   (DeepSpeed's BF16_Optimizer over FusedAdam, the engine's own predictor on its fp32 master partition).

``--dry-run`` runs the same code at tiny sizes on the CPU (``make test`` does, so the script cannot rot):
CPU autocast in bf16, torch AdamW with ``fused=True`` on the CPU, DeepSpeed's FusedAdam as the CPU
accelerator builds it. The exit status is non-zero when a predictor check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

SIZES = {  # (n_layer, n_embd, n_head, seq_len, micro_batch_size, steps, eval_every) of the bf16 replay
    "gpu": (8, 768, 12, 256, 8, 200, 50),
    "dry": (8, 16, 2, 16, 2, 4, 2),
}
MEDIUM = {"gpu": (1024, 16, 1024, 8, 20), "dry": (32, 2, 16, 2, 3)}  # n_embd, n_head, seq, micro-batch, repeats
TOLERANCE = 1e-6


def replay_bf16(device: str, size: str) -> dict:
    from ds_paci.tools.replay.replayer import load_tokens, replay
    from ds_paci.workload.data import MicroBatchIterator, eval_micro_batches
    from ds_paci.workload.gpt2 import gpt2_config, gpt2_reference_model
    n_layer, d, heads, seq, mbs, steps, every = SIZES[size]
    train, val, _ = load_tokens("byte", main_split=False)
    out = {}
    for mode in ("sync", "paci", "lookahead"):
        cfg = gpt2_config("tiny", vocab_size=257, n_positions=seq, n_embd=d, n_layer=n_layer, n_head=heads)
        model = gpt2_reference_model(cfg, seed=1234).to(device)
        began = time.time()
        result = replay(model, 8, 8, MicroBatchIterator(train, mbs, seq, seed=7),
                        eval_micro_batches(val, mbs, seq, count=16), steps, mode=mode, lr=1e-3, betas=(0.9, 0.999),
                        weight_decay=0.0, eval_every=every, device=device, autocast=torch.bfloat16)
        out[{"sync": "stock", "paci": "paci", "lookahead": "paci+lookahead"}[mode]] = {
            "curve": result.curve, "final": result.curve[-1][1], "seconds": time.time() - began,
            "predicted_forwards": sum((s or {}).get("predicted_forwards", 0) for s in result.lookahead),
            "prediction_error": [(s or {}).get("prediction_error") for s in result.lookahead]}
    return {"shape": dict(stages=8, micro_batches=8, n_layer=n_layer, n_embd=d, n_head=heads, seq_len=seq,
                          micro_batch_size=mbs, steps=steps, dtype="bfloat16 autocast"), "engines": out}


def _timer(device: str):
    if device.startswith("cuda"):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def measure(fn):
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1000.0
        return measure

    def measure(fn):
        began = time.perf_counter()
        fn()
        return time.perf_counter() - began
    return measure


def block_times(device: str, size: str) -> dict:
    """Forward, input-gradient (B) and weight-gradient (W) seconds of one GPT-2 Medium block (medians)."""
    from ds_paci.workload.gpt2 import Block, gpt2_config
    d, heads, seq, mbs, repeats = MEDIUM[size]
    cfg = gpt2_config("medium", vocab_size=257, n_positions=seq, n_embd=d, n_head=heads, n_layer=1)
    block = Block(cfg, layer_idx=0, init_seed=1).to(device)
    params = [p for p in block.parameters()]
    x = torch.randn(mbs, seq, d, device=device, requires_grad=True)
    grad = torch.randn(mbs, seq, d, device=device)
    measure = _timer(device)
    times = {"forward": [], "backward_input": [], "backward_weight": []}
    for i in range(repeats + 2):  # two warm-up rounds
        with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16):
            holder = {}
            t_f = measure(lambda: holder.update(out=block(x)))
        out = holder["out"]
        t_b = measure(lambda: torch.autograd.grad(out, [x], grad, retain_graph=True))
        t_w = measure(lambda: torch.autograd.grad(out, params, grad))
        if i >= 2:
            times["forward"].append(t_f)
            times["backward_input"].append(t_b)
            times["backward_weight"].append(t_w)
    return {"block": dict(n_embd=d, n_head=heads, seq_len=seq, micro_batch_size=mbs, dtype="bfloat16 autocast"),
            "seconds": {k: statistics.median(v) for k, v in times.items()}, "repeats": repeats,
            "note": "B: gradient of the block's input only; W: of its weights only (each through the whole graph, "
                    "so B + W exceeds a fused backward by the shared recomputation of the graph's traversal)"}


def _predictor_gap(optimizer_factory, device: str, window: int = 4) -> dict:
    """Steps of ``optimizer`` on random gradients, then the look-ahead's prediction with the complete window
    against the real next step (fp32 parameters stepped through ``.data`` aliases, as the engine steps them)."""
    from ds_paci.core.step.local_step import ParamAliases
    from ds_paci.core.lookahead.predict import lookahead_for_torch_optimizer
    gen = torch.Generator(device="cpu").manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen).to(device)) for n in (257, 4096, 33)]
    opt = optimizer_factory(params)
    aliases = ParamAliases(opt)
    la = lookahead_for_torch_optimizer(opt, aliases)
    if la is None:
        return {"predicted": False, "reason": f"no predictor for {type(opt).__name__}"}
    gaps = []
    for step in range(4):
        for p in params:
            p.grad = sum(torch.randn(p.shape, generator=gen).to(device) / window for _ in range(window))
        predicted = la.predict_next(window, window)
        aliases.bind_grads()
        opt.step()
        aliases.release_grads()
        scale = max(float(m.abs().max()) for m in la.masters())
        gaps.append(max(float((a - b).abs().max()) for a, b in zip(predicted, la.masters())) / scale)
    return {"predicted": True, "optimizer": type(opt).__name__, "relative_gaps": gaps, "ok": max(gaps) <= TOLERANCE}


def bf16_engine_rank(rank: int, accelerator_is_cuda: bool) -> dict:
    """A one-stage PACI engine in bf16 (BF16_Optimizer over FusedAdam): the engine's predictor before every local
    step with the complete window, against the step."""
    import ds_paci
    from ds_paci.workload.data import ByteTokenizer, MicroBatchIterator, encode_documents, load_corpus
    from ds_paci.workload.gpt2 import gpt2_config, gpt2_pipeline
    cfg = gpt2_config("tiny", vocab_size=257, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    model = gpt2_pipeline(cfg, num_stages=1, seed=3)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10**9,
              "gradient_clipping": 0.0, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
              "paci": {"enabled": True}}
    engine, *_ = ds_paci.initialize(model=model, model_parameters=model.parameters(), config=config)
    la = engine._lookahead
    row = {"wrapper": type(engine.optimizer).__name__,
           "inner": type(getattr(engine.optimizer, "optimizer", engine.optimizer)).__name__,
           "predicted": la is not None, "relative_gaps": []}
    if la is None:
        return row
    pending = {}

    def before(original=la.before_step):
        pending["pred"] = la.predict_next(engine.accumulation_window, engine.accumulation_window)
        original()

    def after(original=la.after_step):
        original()
        masters = la.masters()
        scale = max(float(m.abs().max()) for m in masters)
        row["relative_gaps"].append(max(float((p - m).abs().max()) for p, m in zip(pending["pred"], masters)) / scale)

    la.before_step, la.after_step = before, after
    data = MicroBatchIterator(encode_documents(load_corpus()[:1], ByteTokenizer()), 2, 16, seed=5)
    for _ in range(4):
        engine.train_batch(data)
    engine.drain()
    row["ok"] = bool(row["relative_gaps"]) and max(row["relative_gaps"]) <= TOLERANCE
    return row


def predictor_checks(device: str) -> dict:
    from deepspeed.ops.adam import FusedAdam

    from ds_paci.tools.processes.world import run_world
    cuda = device.startswith("cuda")
    out = {"torch AdamW fused (fp32)": _predictor_gap(
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, fused=True), device)}
    try:
        out["DeepSpeed FusedAdam (fp32)"] = _predictor_gap(
            lambda ps: FusedAdam(ps, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, adam_w_mode=True), device)
    except Exception as e:  # the CPU accelerator may not build it; on a GPU this is a failure
        out["DeepSpeed FusedAdam (fp32)"] = {"predicted": False, "ok": not cuda, "reason": f"{type(e).__name__}: {e}"}
    out["PACI engine bf16 (BF16_Optimizer)"] = run_world(bf16_engine_rank, 1, cuda, timeout=300,
                                                         accelerator=None if cuda else "cpu")[0]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="scripts/gpu_quality_check.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/gpu_quality")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU (the test suite's check)")
    args = p.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_quality_check: no CUDA device; run with --dry-run on a CPU", file=sys.stderr)
        return 2
    device, size = ("cpu", "dry") if args.dry_run else ("cuda", "gpu")
    if args.dry_run:  # tiny ops on a shared CPU: more threads only spin against each other
        torch.set_num_threads(1)
    torch.manual_seed(0)
    began = time.time()
    result = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu (dry run)", "part_seconds": {}}
    for name, part in (("replay_bf16", replay_bf16), ("block_times_gpt2_medium", block_times),
                       ("predictor", lambda d, _: predictor_checks(d))):
        started = time.time()
        result[name] = part(device, size)
        result["part_seconds"][name] = round(time.time() - started, 1)
    result["seconds"] = time.time() - began
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_quality.json"), "w") as f:
        json.dump(result, f, indent=1)
    failed = [k for k, v in result["predictor"].items() if not v.get("ok", False)]
    print(json.dumps({"finals": {k: v["final"] for k, v in result["replay_bf16"]["engines"].items()},
                      "block_seconds": result["block_times_gpt2_medium"]["seconds"], "predictor_failed": failed,
                      "seconds": round(result["seconds"], 1), "part_seconds": result["part_seconds"]}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
