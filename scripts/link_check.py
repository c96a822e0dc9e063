"""Check the simulator's link model against a pipeline running across two DeepSpeed launchers ("nodes").

    .venv/bin/python scripts/link_check.py --out docs/results/link_check.json

Two "nodes" on this machine (``deepspeed --hostfile H --no_ssh --node_rank R``, one rank each), joined by gloo
over TCP. Each rank (this file, run by the launcher with ``--rank-job``):

1. measures the link: a ping-pong of 4 KB .. 16 MB float32 messages between the two nodes (median of 15 round
   trips; one way = half), fitted to ``latency + bytes / bandwidth`` (least squares);
2. trains a 2-stage pipeline whose layers are an element-wise scale (real math, real gradients) followed by
   ``EmulatedDeviceTime(f)`` (a CPU-free wait of ``f`` forward, ``2f`` backward), with activations of a small
   and a large size, PACI and DeepSpeed's stock engine alternately; measures seconds per ``train_batch``
   (median after a warm-up) and, for PACI, the median forward and backward instruction times from the trace.

The driver then predicts seconds per ``train_batch`` with :func:`ds_paci.tools.sim.simulate.long_run_period` from
the measured forward/backward times, with the fitted link model and without it, and writes both next to the
measurement. Emulated device time; a shared, loaded machine: read the ratios, not the absolute numbers.
"""

import json
import os
import statistics
import sys
import tempfile
import time

SIZES = [4096, 65536, 1 << 20, 4 << 20, 16 << 20]


def ping_pong(rank):
    """The study's ping-pong (:func:`ds_paci.tools.studies.linked.ping_pong`) at this script's sizes and counts."""
    from ds_paci.tools.studies.linked import ping_pong as measure
    return measure(rank, reps=15, sizes=SIZES, warmup=2)


class Scale:
    """Factory of the element-wise scale layer (a real parameter, a real gradient, negligible compute)."""

    @staticmethod
    def layer(width):
        import torch

        class _Scale(torch.nn.Module):

            def __init__(self):
                super().__init__()
                self.w = torch.nn.Parameter(torch.ones(width))

            def forward(self, x):
                return x * self.w

        return _Scale()


def pipeline_job(args):
    import deepspeed
    import torch
    from deepspeed.pipe import PipelineModule

    import ds_paci
    from ds_paci.workload.emulate import EmulatedDeviceTime
    rank = int(os.environ["RANK"])
    results = {"rank": rank, "runs": []}
    if rank == 0:
        results["ping_pong"] = ping_pong(rank)
    else:
        ping_pong(rank)
    for width in args.widths:
        layers = [Scale.layer(width), EmulatedDeviceTime(args.f), Scale.layer(width), EmulatedDeviceTime(args.f)]
        for round_ in range(args.rounds):
            for engine_kind in ("paci", "stock"):
                torch.manual_seed(0)
                model = PipelineModule(layers=layers, num_stages=2, loss_fn=lambda out, y: ((out - y)**2).mean(),
                                       partition_method="uniform")
                cfg = {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": args.gas,
                       "steps_per_print": 10**9, "gradient_clipping": 0.0,
                       "optimizer": {"type": "SGD", "params": {"lr": 1e-4}}}
                if engine_kind == "paci":
                    cfg["paci"] = {"enabled": True, "trace": True, "lookahead": False}
                engine, *_ = ds_paci.initialize(model=model, model_parameters=model.parameters(), config=cfg)
                x = torch.randn(args.micro, width)
                data = iter(lambda: (x, x), None)
                times = []
                for i in range(args.warmup + args.batches):
                    t0 = time.perf_counter()
                    engine.train_batch(data)
                    if i >= args.warmup:
                        times.append(time.perf_counter() - t0)
                run = {"engine": engine_kind, "width": width, "round": round_, "seconds_per_batch": times}
                if engine_kind == "paci":
                    trace = engine.paci_trace()
                    for kind, text in (("ForwardPass", "F"), ("BackwardPass", "B")):  # text forms F3, B3
                        spans = [r["end"] - r["start"] for r in trace if r["instr"].rstrip("0123456789") == text]
                        run[kind] = statistics.median(spans) if spans else None
                    run["instr_kinds"] = sorted({r["instr"].rstrip("0123456789") for r in trace})
                results["runs"].append(run)
                deepspeed.comm.barrier()
    with open(os.path.join(args.out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    return 0


def predict(runs, ping, micro, gas, width_bytes):
    from ds_paci.tools.sim.links import Link, LinkModel
    from ds_paci.tools.sim.simulate import CostModel, long_run_period
    from ds_paci.tools.studies.linked import fit
    latency, bandwidth = fit(ping)
    out = []
    for width in sorted({r["width"] for r in runs}):
        paci = [r for r in runs if r["width"] == width and r["engine"] == "paci"]
        fwd = statistics.median(r["ForwardPass"] for r in paci)
        bwd = statistics.median(r["BackwardPass"] for r in paci)
        nbytes = micro * width * width_bytes
        link = Link(latency, bandwidth)
        lm = LinkModel(link, link, ranks_per_node=1, activation_bytes=nbytes)
        row = {"width": width, "activation_bytes": nbytes, "forward_s": fwd, "backward_s": bwd}
        for kind, schedule in (("paci", "paci"), ("stock", "stock")):
            measured = statistics.median(t for r in runs if r["width"] == width and r["engine"] == kind
                                         for t in r["seconds_per_batch"])
            with_links = long_run_period(schedule, 2, gas, cost=CostModel(forward=fwd, backward=bwd, links=lm)) * gas
            without = long_run_period(schedule, 2, gas, cost=CostModel(forward=fwd, backward=bwd)) * gas
            row[kind] = {"measured_s": measured, "predicted_s": with_links, "predicted_without_links_s": without,
                         "predicted_over_measured": with_links / measured}
        out.append(row)
    return {"link": {"latency_s": latency, "bandwidth_bytes_per_s": bandwidth}, "ping_pong_one_way_s": ping,
            "rows": out}


def drive(args):
    from ds_paci.tools.processes.local_nodes import Node, node_command, stop_all, write_hostfile
    from ds_paci.tools.processes.world import free_port
    work = tempfile.mkdtemp(prefix="link_check_")
    host = write_hostfile(os.path.join(work, "hostfile"), {"nodeA": 1, "nodeB": 1})
    port = free_port()
    job = [os.path.abspath(__file__), "--rank-job", "--out-dir", work, "--f", str(args.f), "--micro", str(args.micro),
           "--gas", str(args.gas), "--batches", str(args.batches), "--warmup", str(args.warmup), "--rounds",
           str(args.rounds), "--widths"] + [str(w) for w in args.widths]
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    nodes = [Node(f"node{r}", node_command(r, host, port, job), env={"OMP_NUM_THREADS": "1"}) for r in range(2)]
    try:
        codes = [n.finish(timeout=3600) for n in nodes]
    finally:
        stop_all(nodes)
    if codes != [0, 0]:
        print(nodes[0].output[-4000:], nodes[1].output[-4000:])
        return 1
    rank0 = json.load(open(os.path.join(work, "rank0.json")))
    report = predict(rank0["runs"], {int(k): v for k, v in rank0["ping_pong"].items()}, args.micro, args.gas, 4)
    report.update(started=started, load_average=os.getloadavg(), emulated_f_s=args.f, micro_batch=args.micro,
                  gas=args.gas, command=" ".join(["scripts/link_check.py"] + sys.argv[1:]))
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


def main(argv=None):
    from ds_paci.tools.processes.rank_job import driver_parser, rank_or_drive
    p = driver_parser(__doc__.split("\n\n")[0], launcher=True)
    p.add_argument("--f", type=float, default=0.02, help="emulated forward seconds per stage (backward: 2f)")
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--gas", type=int, default=4)
    p.add_argument("--widths", type=int, nargs="+", default=[128, 131072],
                   help="activation width: bytes per transfer = micro x width x 4")
    p.add_argument("--batches", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", help="write the report (JSON) here")
    args = p.parse_args(argv)
    return rank_or_drive(args, pipeline_job, drive)


if __name__ == "__main__":
    sys.exit(main())
