"""Pipelines across two "nodes" joined by a real, bandwidth-limited link, next to the simulator's prediction.

    python -m ds_paci.tools.studies.linked --rates 100 300 --rounds 5 --batches 8 --warmup 2 \
        --out docs/results/linked.json

Each node is a network namespace and the nodes are joined by a tbf-limited veth
(:class:`ds_paci.tools.processes.netns.LinkedNodes`; root only). Every rank is its own process started inside its
node's namespace (``ip netns exec``) with the variables a launcher gives (``RANK``, ``LOCAL_RANK``, ``CROSS_RANK``,
...), ``MASTER_ADDR`` = rank 0's node address and ``GLOO_SOCKET_IFNAME`` = the veth, so gloo's inter-node traffic
crosses the limited link and intra-node traffic stays on the node's loopback. Two shapes:

* ``pp2``: 2 stages, one per node (ranks 0 on A, 1 on B);
* ``pp2dp2``: 2 stages x 2 data-parallel replicas, each stage's replicas on different nodes and each pipeline
  crossing the link (ranks 0, 3 on A and 1, 2 on B; stage 0 = ranks 0, 1, stage 1 = ranks 2, 3): both
  pipelines' transfers and both stages' reduces share the link, one direction each way.

Each rank (this module with ``--rank-job``) first measures the link between rank 0 and rank 1 (a ping-pong of
16 KB .. 2 MB, fitted to latency + bytes / bandwidth as ``scripts/link_check.py`` does), then trains a 2-stage
pipeline whose layers are an element-wise scale (real math), a "ballast" parameter (a gradient of ``--grad-kb``
per stage for the data-parallel reduce, no effect on the values) and ``EmulatedDeviceTime(f)`` (a CPU-free
wait: ``f`` forward, ``2f`` backward per stage). The engine variants (``--variant NAME=JSON``: JSON merged into the
DeepSpeed config, ``"paci"`` absent = DeepSpeed's stock engine; default :data:`DEFAULT_VARIANTS`: stock, PACI before
issue 27, PACI with each of its items 1-3 and with all three) run in alternated rounds; the result is the median
seconds per micro-batch (``train_batch`` time / M after a warm-up). The driver predicts each with
:func:`ds_paci.tools.sim.simulate.long_run_period` from the measured forward/backward instruction times (the PACI
variants' trace) and the fitted link (links are not shared in the simulator; here the pp2dp2 pipelines share it),
modelling the variant as the engine runs it (:func:`engine_settings`: the step phase, the reduce overlapped with
the window's last backward, the non-blocking program timed with ``transfers="nonblocking"``; checked against what
every PACI engine reports it ran, :func:`ran_settings`; an optional ``"sim"`` object overrides ``overlap`` and
``window``). :func:`done_when` gives issue 27's last "done when" per rate and variant.

Emulated device time on a shared 2-core machine: read the ratios. Public contract: :func:`main` (the command
line), :data:`DEFAULT_VARIANTS`, :func:`run_shape` (one shape at one rate: the ranks' reports), :func:`fit`,
:func:`predict`, :func:`engine_settings`, :func:`ran_settings`, :func:`done_when`, :func:`ping_pong` and
:func:`weight_digests`.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

#: shape -> node of each rank (ranks are stage-major: stage s = ranks s*DP .. s*DP+DP-1)
PLACEMENTS = {"pp2": [0, 1], "pp2dp2": [0, 1, 1, 0]}
_BEFORE = {"enabled": True, "lookahead": False, "step_phase": "aligned", "overlap_reduce": False,
           "nonblocking_transfers": False}
#: the default variants (issue 27, item 4): DeepSpeed's stock engine; PACI as it was before issue 27 (aligned steps,
#: the reduce at the step, blocking transfers); PACI with each of the issue's items 1-3 alone; and with all three.
#: ``+overlap`` is PACI's default configuration today (look-ahead off throughout: the variants differ only in these).
DEFAULT_VARIANTS = {
    "stock": {},
    "paci-before": {"paci": dict(_BEFORE)},
    "+diagonal": {"paci": dict(_BEFORE, step_phase="diagonal")},
    "+overlap": {"paci": dict(_BEFORE, overlap_reduce=True)},
    "+nonblocking": {"paci": dict(_BEFORE, nonblocking_transfers=True)},
    "all": {"paci": dict(_BEFORE, step_phase="diagonal", overlap_reduce=True, nonblocking_transfers=True)},
}
SIZES = [16384, 131072, 524288, 2097152]


def ping_pong(rank, peer_of_zero=1, reps=7, sizes=SIZES, warmup=1):
    """One-way seconds per message size (bytes, of ``sizes``) between rank 0 and ``peer_of_zero``: the median of
    ``reps`` round trips / 2, after ``warmup`` round trips not counted. Every rank of the world calls it."""
    import torch
    import torch.distributed as dist
    out = {}
    for size in sizes:
        buf = torch.zeros(size // 4)
        times = []
        for i in range(reps + warmup):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, peer_of_zero)
                dist.recv(buf, peer_of_zero)
            elif rank == peer_of_zero:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        out[size] = statistics.median(times) / 2
    return out


def _layers(width, grad_elems, f):
    import torch

    from ds_paci.workload.emulate import EmulatedDeviceTime

    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(width))

        def forward(self, x):
            return x * self.w

    class Ballast(torch.nn.Module):
        """A parameter whose gradient (zeros, full size) only gives the data-parallel reduce its bytes."""

        def __init__(self):
            super().__init__()
            self.p = torch.nn.Parameter(torch.zeros(grad_elems))

        def forward(self, x):
            return x + self.p[:1] * 0.0

    return [Scale(), Ballast(), EmulatedDeviceTime(f), Scale(), Ballast(), EmulatedDeviceTime(f)]


def weight_digests(module):
    """``{parameter name: sha256 of its bytes}`` of this rank's stage: equal digests are bit-identical weights."""
    import hashlib
    return {name: hashlib.sha256(p.detach().cpu().contiguous().numpy().tobytes()).hexdigest()
            for name, p in module.named_parameters()}


def ran_settings(engine):
    """What a PACI ``engine`` runs, in :func:`engine_settings`' keys (its step phase, window, whether the reduce is
    overlapped and the transfers non-blocking: the engine's own decisions, which the config only asks for)."""
    out = {"schedule": "paci", "phase": engine.paci_stats()["step_phase"], "window": engine.accumulation_window,
           "overlap": engine._overlap is not None, "nonblocking": engine._transfers is not None}
    if engine._stream.slack:
        out["slack"] = list(engine._stream.slack)
    return out


def engine_settings(overlay, gas, dp, stages=2):
    """How the engine runs the variant ``overlay`` (the DeepSpeed-config overlay of ``--variant``) on ``stages``
    stages x ``dp`` replicas at ``M = gas``, as the simulator needs it: ``{"schedule": "stock"}``, or ``"paci"``
    with its ``phase`` (``paci.step_phase`` as :meth:`~ds_paci.core.config.PACIConfig.phase_rule` resolves it),
    ``window``, ``overlap`` (the data-parallel reduce under the window's last backward: ``overlap_reduce`` in async
    mode with replicas, fp32 without ZeRO), ``nonblocking`` (``nonblocking_transfers`` in async mode) and, where
    the config lists any, ``slack`` (``slack_links``, async mode). An
    optional ``"sim"`` object overrides ``overlap`` and ``window``. Pure; the study checks it against what each
    engine reports it ran (:func:`ran_settings`)."""
    from ds_paci.core.config import parse_paci_section
    paci = parse_paci_section(overlay.get("paci"))
    if not paci.enabled:
        return {"schedule": "stock"}
    window = paci.window(gas, stages)
    sync = paci.drain_every_batch
    stock_step = sync and window == gas
    wrapped = (overlay.get("bf16", {}).get("enabled", False) or overlay.get("fp16", {}).get("enabled", False)
               or overlay.get("zero_optimization", {}).get("stage", 0) > 0)
    out = {"schedule": "paci", "phase": paci.phase_rule(stock_step), "window": window,
           "overlap": paci.overlap_reduce and not stock_step and dp > 1 and not wrapped,
           "nonblocking": paci.nonblocking_transfers and not stock_step}
    if paci.slack_links and not sync:
        out["slack"] = list(paci.slack_links)  # "slack_links" (refused in sync mode); absent when none
    sim = overlay.get("sim", {})
    out.update({k: sim[k] for k in ("overlap", "window") if k in sim})
    return out


def _config(args, overlay):
    cfg = {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": args.gas,
           "steps_per_print": 10**9, "gradient_clipping": 0.0, "optimizer": {"type": "SGD", "params": {"lr": 1e-4}}}
    for key, value in overlay.items():
        if key != "sim":
            cfg[key] = value
    if "paci" in cfg:
        cfg["paci"] = dict(cfg["paci"], trace=True)
    return cfg


def rank_job(args):
    """One rank: the ping-pong, then every variant in alternated rounds; writes ``rank<R>.json`` (per run: seconds
    per call, losses, the stage's weight digests at the start and after the closing drain of a PACI engine)."""
    import deepspeed
    import torch
    from deepspeed.pipe import PipelineModule

    import ds_paci
    rank = int(os.environ["RANK"])
    variants = json.loads(args.variants)
    width = args.act_kb * 1024 // (4 * args.micro)
    grad_elems = max(1, (args.grad_kb * 1024 // 4 - 2 * width) // 2)
    results = {"rank": rank, "runs": [], "ping_pong": ping_pong(rank), "width": width,
               "grad_bytes_per_stage": 4 * 2 * (width + grad_elems), "activation_bytes": 4 * args.micro * width}
    for round_ in range(args.rounds):
        for name, overlay in variants.items():
            torch.manual_seed(0)
            model = PipelineModule(layers=_layers(width, grad_elems, args.f), num_stages=2,
                                   loss_fn=lambda out, y: ((out - y)**2).mean(), partition_method="uniform")
            engine, *_ = ds_paci.initialize(model=model, model_parameters=model.parameters(),
                                            config=_config(args, overlay))
            start_weights = weight_digests(engine.module)
            gen = torch.Generator().manual_seed(1)
            # targets half the inputs: the losses and the Scale layers' gradients are not zero
            batches = [(x, 0.5 * x) for x in (torch.randn(args.micro, width, generator=gen) for _ in range(args.gas))]
            times, losses = [], []
            for i in range(args.warmup + args.batches):
                data = iter(batches)
                t0 = time.perf_counter()
                loss = engine.train_batch(data)
                if i >= args.warmup:
                    times.append(time.perf_counter() - t0)
                losses.append(None if loss is None else float(loss))
            if isinstance(engine, ds_paci.PACIPipelineEngine):
                engine.drain()  # the end of training, after the timed calls: the partial window is stepped
            run = {"variant": name, "round": round_, "seconds_per_batch": times, "losses": losses,
                   "engine": type(engine).__name__, "last_stage": engine.is_last_stage(),
                   "weights_sha256": {"start": start_weights, "drained": weight_digests(engine.module)}}
            if isinstance(engine, ds_paci.PACIPipelineEngine):
                run["ran"] = ran_settings(engine)
            if "paci" in overlay and overlay["paci"].get("enabled", True):
                trace = engine.paci_trace()
                for kind, text in (("ForwardPass", "F"), ("BackwardPass", "B")):  # instruction texts F3, B3
                    spans = [r["end"] - r["start"] for r in trace if r["instr"].rstrip("0123456789") == text]
                    run[kind] = statistics.median(spans) if spans else None
            results["runs"].append(run)
            deepspeed.comm.barrier()
    with open(os.path.join(args.out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    return 0


def _job_argv(args, out_dir, variants):
    return [sys.executable, "-m", "ds_paci.tools.studies.linked", "--rank-job", "--out-dir", out_dir,
            "--variants", json.dumps(variants), "--f", str(args.f), "--micro", str(args.micro), "--gas",
            str(args.gas), "--act-kb", str(args.act_kb), "--grad-kb", str(args.grad_kb), "--batches",
            str(args.batches), "--warmup", str(args.warmup), "--rounds", str(args.rounds)]


def run_shape(linked, shape, argv_of_rank, timeout=1800):
    """Start one process per rank of ``shape`` (``argv_of_rank(rank)``), each in its node's namespace (or all on
    this machine's loopback when ``linked`` is None); returns their exit codes and outputs, every process ended.
    The first rank to fail, or ``timeout``, ends them all (a rank killed here reads -9)."""
    from ds_paci.tools.processes.launched import Launched
    from ds_paci.tools.processes.world import free_port
    node_of = PLACEMENTS[shape]
    port = free_port()
    procs = []
    try:
        for rank, node in enumerate(node_of):
            mates = [r for r, n in enumerate(node_of) if n == node]
            env = {"RANK": str(rank), "WORLD_SIZE": str(len(node_of)), "LOCAL_RANK": str(mates.index(rank)),
                   "LOCAL_SIZE": str(len(mates)), "CROSS_RANK": str(node), "CROSS_SIZE": str(len(set(node_of))),
                   "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
                   "MASTER_ADDR": linked.addresses[node_of[0]] if linked else "127.0.0.1"}
            if linked:
                env["GLOO_SOCKET_IFNAME"] = linked.ifname
            prefix = linked.prefix(node) if linked else []
            procs.append(Launched(prefix + argv_of_rank(rank), env=env))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:  # fail fast: the first rank to fail ends the others (finally)
            codes = [p.proc.poll() for p in procs]
            if all(c == 0 for c in codes) or any(c not in (None, 0) for c in codes):
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            p.kill_all()
            p.finish(timeout=30)
    return [p.proc.returncode for p in procs], [p.output for p in procs]


def fit(ping):
    """``(latency, bandwidth)`` of one-way times per message size: least squares on relative errors."""
    rows = [(float(s), float(t), 1.0 / float(t)**2) for s, t in ping.items()]
    sw = sum(w for _, _, w in rows)
    sx, sy = sum(w * x for x, _, w in rows), sum(w * y for _, y, w in rows)
    sxx, sxy = sum(w * x * x for x, _, w in rows), sum(w * x * y for x, y, w in rows)
    slope = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    return max(0.0, (sy - slope * sx) / sw), 1.0 / slope


def predict(report, variants, gas, dp):
    """Median measured and predicted seconds per micro-batch per variant of one shape's rank-0 ``report``."""
    from ds_paci.tools.sim.links import Link, LinkModel
    from ds_paci.tools.sim.simulate import CostModel, long_run_period
    latency, bandwidth = fit({int(k): v for k, v in report["ping_pong"].items()})
    link = Link(latency, bandwidth)
    traced = [r for r in report["runs"] if r.get("ForwardPass")]
    fwd = statistics.median(r["ForwardPass"] for r in traced)
    bwd = statistics.median(r["BackwardPass"] for r in traced)
    rows = {}
    for name, overlay in variants.items():
        how = engine_settings(overlay, gas, dp)
        links = LinkModel(link, link, ranks_per_node=1, activation_bytes=report["activation_bytes"],
                          grad_bytes=report["grad_bytes_per_stage"], dp=dp, overlap=how.get("overlap", False))
        cost = CostModel(forward=fwd, backward=bwd, links=links)
        if how["schedule"] == "stock":
            predicted = long_run_period("stock", 2, gas, cost=cost)
        else:
            predicted = long_run_period("paci", 2, gas, window=how["window"], cost=cost, phase=how["phase"],
                                        transfers="nonblocking" if how["nonblocking"] else "blocking",
                                        slack=tuple(how.get("slack", ())))
        for run in report["runs"]:
            ran = run.get("ran") if run["variant"] == name else None
            if ran and any(ran[k] != how.get(k) for k in ran if k not in overlay.get("sim", {})):
                raise RuntimeError(f"variant {name!r}: the engine ran {ran}, the prediction models {how}")
        measured = [t / gas for r in report["runs"] if r["variant"] == name for t in r["seconds_per_batch"]]
        rows[name] = {"measured_s_per_mb": statistics.median(measured), "predicted_s_per_mb": predicted,
                      "samples": len(measured), "modelled": how}
    return {"link": {"latency_s": latency, "bandwidth_bytes_per_s": bandwidth}, "forward_s": fwd,
            "backward_s": bwd, "rows": rows}


def _parse_variants(specs):
    if not specs:
        return dict(DEFAULT_VARIANTS)
    out = {}
    for spec in specs:
        name, sep, text = spec.partition("=")
        try:
            overlay = json.loads(text) if sep else None
        except ValueError as e:
            raise SystemExit(f"error: --variant {spec!r}: not JSON after '=' ({e})")
        if not name or not isinstance(overlay, dict):
            raise SystemExit(f"error: --variant {spec!r}: expected NAME=JSON object, e.g. stock={{}} or "
                             "paci='{\"paci\": {\"enabled\": true}}'")
        out[name] = overlay
    return out


def drive(args):
    from ds_paci.tools.processes import netns
    why = netns.unavailable()
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    variants = _parse_variants(args.variant)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    report = {"started": started, "command": " ".join(["python -m ds_paci.tools.studies.linked"] + sys.argv[1:]),
              "emulated_f_s": args.f, "micro_batch": args.micro, "gas": args.gas, "variants": variants, "cells": []}
    with netns.LinkedNodes(args.rates[0]) as linked:
        for rate in args.rates:
            linked.set_rate(rate)
            for shape in args.shapes:
                out_dir = tempfile.mkdtemp(prefix=f"linked_{shape}_")
                codes, outputs = run_shape(linked, shape, lambda rank: _job_argv(args, out_dir, variants))
                if any(c != 0 for c in codes):
                    print("\n".join(o[-3000:] for o in outputs), file=sys.stderr)
                    print(f"error: {shape} at {rate:g} Mbit/s failed: exit codes {codes}", file=sys.stderr)
                    return 1
                rank0 = json.load(open(os.path.join(out_dir, "rank0.json")))
                cell = {"shape": shape, "rate_mbit": rate, "activation_bytes": rank0["activation_bytes"],
                        "grad_bytes_per_stage": rank0["grad_bytes_per_stage"], "load_average": os.getloadavg()}
                cell.update(predict(rank0, variants, args.gas, dp=len(PLACEMENTS[shape]) // 2))
                report["cells"].append(cell)
                print(json.dumps(cell), flush=True)
    text = json.dumps(report, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(markdown(report))
    for row in done_when(report):
        print(f"{row['rate_mbit']:g} Mbit/s {row['variant']}: pp2dp2 / pp2 = {row['dp_over_pp']:.3f} "
              f"({'within' if row['within'] else 'not within'} 1.15); speed-up over stock {row['speedup']:.3f} = "
              f"{row['of_limit']:.1%} of the limit ({'holds' if row['holds'] else 'below 90%'})")
    return 0


def markdown(report):
    """The report's cells as a markdown table (seconds per micro-batch; speed-up over the first variant)."""
    names = list(report["variants"])
    lines = ["| shape | link | transfer / reduce | " + " | ".join(f"{n} s/mb (predicted)" for n in names) +
             " | " + " | ".join(f"{n} / {names[0]}" for n in names[1:]) + " |",
             "|---|---|---|" + "---:|" * (2 * len(names) - 1)]
    for c in report["cells"]:
        bw = c["link"]["bandwidth_bytes_per_s"]
        rows = c["rows"]
        first = rows[names[0]]["measured_s_per_mb"]
        lines.append(f"| {c['shape']} | {c['rate_mbit']:g} Mbit/s (fit {bw * 8 / 1e6:.0f} Mbit/s + "
                     f"{c['link']['latency_s'] * 1e3:.2f} ms) | {c['activation_bytes'] / bw * 1e3:.1f} / "
                     f"{c['grad_bytes_per_stage'] / bw * 1e3:.1f} ms | " +
                     " | ".join(f"{rows[n]['measured_s_per_mb']:.4f} ({rows[n]['predicted_s_per_mb']:.4f})"
                                for n in names) + " | " +
                     " | ".join(f"{first / rows[n]['measured_s_per_mb']:.3f}" for n in names[1:]) + " |")
    return "\n".join(lines)


def done_when(report, micro_batches=None, base="pp2", shape="pp2dp2"):
    """Issue 27's last "done when", per link rate and variant other than the first (stock): ``shape``'s measured
    seconds per micro-batch over ``base``'s (``within``: at most 1.15), and ``shape``'s speed-up over the first
    variant as a fraction of the bubble-free limit ``(M+P-1)/M`` at P = 2 (``of_limit``: at least 0.90)."""
    names = list(report["variants"])
    m = micro_batches or report["gas"]
    limit = (m + 1) / m
    cells = {(c["rate_mbit"], c["shape"]): c["rows"] for c in report["cells"]}
    out = []
    for rate in dict.fromkeys(c["rate_mbit"] for c in report["cells"]):
        if (rate, base) not in cells or (rate, shape) not in cells:
            continue
        rows, ref = cells[(rate, shape)], cells[(rate, base)]
        for n in names[1:]:
            ratio = rows[n]["measured_s_per_mb"] / ref[n]["measured_s_per_mb"]
            speedup = rows[names[0]]["measured_s_per_mb"] / rows[n]["measured_s_per_mb"]
            out.append({"rate_mbit": rate, "variant": n, "dp_over_pp": ratio, "within": ratio <= 1.15,
                        "speedup": speedup, "of_limit": speedup / limit, "holds": speedup / limit >= 0.90})
    return out


def main(argv=None):
    from ds_paci.tools.processes.rank_job import driver_parser, rank_or_drive
    p = driver_parser(__doc__.split("\n\n")[0])
    p.add_argument("--variants", help=argparse.SUPPRESS)
    p.add_argument("--rates", type=float, nargs="+", default=[100.0, 300.0], help="link rates, Mbit/s each way")
    p.add_argument("--shapes", nargs="+", default=list(PLACEMENTS), choices=list(PLACEMENTS))
    p.add_argument("--variant", action="append", metavar="NAME=JSON",
                   help="an engine variant: JSON merged into the DeepSpeed config (no \"paci\" key: the stock "
                        "engine), optional \"sim\": {\"overlap\": bool, \"window\": int} overriding the "
                        "prediction's; default: DEFAULT_VARIANTS (stock, paci-before, +diagonal, +overlap, "
                        "+nonblocking, all)")
    p.add_argument("--f", type=float, default=0.02, help="emulated forward seconds per stage (backward: 2f)")
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--gas", type=int, default=4, help="M, micro-batches per train_batch")
    p.add_argument("--act-kb", type=int, default=256, help="KiB per activation (and gradient) transfer")
    p.add_argument("--grad-kb", type=int, default=256, help="KiB of gradients per stage (the data-parallel reduce)")
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", help="write the report (JSON) here")
    args = p.parse_args(argv)
    if not args.rank_job and any(r <= 0 for r in args.rates):
        p.error("--rates must be > 0")
    return rank_or_drive(args, rank_job, drive, gloo_timeout_s=300)


if __name__ == "__main__":
    sys.exit(main())
