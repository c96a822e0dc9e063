"""On paper, past one machine: PACI, DeepSpeed's 1F1B-flush and ZB-V at P = 16..64 under a link model.

    python -m ds_paci.tools.studies.scale --stages 16 32 64 --out /tmp/scale_table.md

Public contract:

* :class:`BlockShape` (GPT-2-Medium by default: d = 1024, sequence 1024, micro-batch 4 sequences, bf16) gives a
  transformer block's forward FLOPs per micro-batch (``24 t d^2 + 4 t S d`` for ``t`` tokens: the four weight
  matmuls and attention), its parameters (``12 d^2 + 13 d``) and the bytes crossing a stage boundary per
  micro-batch (``t * d`` elements, the block's output, and its gradient back).
* :func:`stage_costs`: forward ``f`` per block at a stated device speed; the backward is ``2f``, which ZB-V splits
  into ``I = f`` (input gradient) and ``W = f`` (weight gradient). Embedding and LM head are left out, so every
  stage costs the same and the comparison isolates the schedules and the links.
* :func:`zbv_actions` is torch's own ``ScheduleZBVZeroBubble`` action list (its per-rank planner, run on a
  stand-in that has only the three numbers it reads); :func:`time_zbv` times consecutive steps of it: every rank
  runs its actions in order, ``F`` of chunk ``k`` waits for ``F`` of chunk ``k-1``, ``I`` of ``k`` for ``I`` of
  ``k+1`` (the last chunk for its own ``F``), ``W`` for ``I``; a dependency on another rank arrives after its
  transfer (:class:`~ds_paci.tools.sim.links.LinkModel`); sends never block (torch's runtime posts them
  asynchronously); each step ends with the rank's optimizer step (plus its data-parallel all-reduce).
* PACI and 1F1B-flush run through :func:`ds_paci.tools.sim.simulate.long_run_period` with ``CostModel(links=...)``:
  the very streams the engines execute, transfers blocking both sides as DeepSpeed's are.
* :data:`VARIANTS`: PACI as configured today (``"PACI"``: aligned steps, blocking transfers), and with the
  ``"diagonal"`` step phase (:mod:`ds_paci.core.program.stream`), the all-reduce overlapped with the window's last
  backward (``+overlap``, only where there is data parallelism) and the engine's non-blocking program (``+nb``:
  ``paci_programs(..., nonblocking=True)`` timed with ``transfers="nonblocking"``, :mod:`ds_paci.tools.sim.nonblocking`),
  and all three with ``+slack``: ``"slack_links"`` on the links between nodes (:func:`node_links`; one more
  micro-batch in flight upstream of each, :mod:`ds_paci.core.program.stream`).
* :func:`rows` / :func:`markdown`: time per micro-batch, throughput relative to 1F1B-flush, and the share of
  time spent computing, per (P, M, link scenario); with ``--variants`` beyond ``PACI``, :func:`variants_markdown`:
  every variant's time and its ratio to ZB-V.

    python -m ds_paci.tools.studies.scale --stages 16 32 64 --micro-batch-factors 0.5 1 4 \
        --scenarios free ib200 ib100-dp4 --variants PACI diagonal diagonal+overlap diagonal+nb diagonal+overlap+nb
"""

import argparse
import sys
import types
from collections import deque
from dataclasses import dataclass, replace

from ..sim.links import Link, LinkModel
from ..sim.simulate import CostModel, long_run_period

# link scenarios: (name, intra-node link, inter-node link, data-parallel replicas, overlap)
NVLINK = Link(3e-6, 150e9)  # per-GPU NVLink-class bandwidth inside a node
IB200 = Link(10e-6, 25e9)  # 200 Gb/s per GPU between nodes
IB100 = Link(10e-6, 12.5e9)  # 100 Gb/s
SCENARIOS = {
    "free": ("no transfer cost", None, None, 1, False),
    "ib200": ("8 GPUs/node, NVLink 150 GB/s, 200 Gb/s between nodes", NVLINK, IB200, 1, False),
    "ib100-dp4": ("as ib200 at 100 Gb/s, 4 data-parallel replicas across nodes, all-reduce not overlapped",
                  NVLINK, IB100, 4, False),
    "ib100-dp4-overlap": ("as ib100-dp4, all-reduce overlapped with the last backward", NVLINK, IB100, 4, True),
}


@dataclass(frozen=True)
class BlockShape:
    """A GPT-2 block's shape (GPT-2-Medium by default); see the module docstring."""

    d: int = 1024
    seq: int = 1024
    micro_batch: int = 4
    bytes_per_value: int = 2  # bf16 activations
    grad_bytes_per_param: int = 2  # bf16 gradients all-reduced

    @property
    def tokens(self):
        return self.seq * self.micro_batch

    @property
    def forward_flops(self):
        return 24 * self.tokens * self.d**2 + 4 * self.tokens * self.seq * self.d

    @property
    def params(self):
        return 12 * self.d**2 + 13 * self.d

    @property
    def activation_bytes(self):
        return self.tokens * self.d * self.bytes_per_value


def stage_costs(shape, flops_per_s):
    """Forward seconds of one block for one micro-batch at ``flops_per_s`` (backward: twice that)."""
    return shape.forward_flops / flops_per_s


def link_model(scenario, shape, blocks_per_stage, ranks_per_node=8):
    _, intra, inter, dp, overlap = SCENARIOS[scenario]
    if intra is None:
        return None
    return LinkModel(intra=intra, inter=inter, ranks_per_node=ranks_per_node, activation_bytes=shape.activation_bytes,
                     grad_bytes=blocks_per_stage * shape.params * shape.grad_bytes_per_param, dp=dp,
                     dp_link="inter", overlap=overlap)


# -- ZB-V ------------------------------------------------------------------------------------------
def zbv_actions(ranks, micro_batches):
    """``{rank: [torch _Action, ...]}`` of torch's ``ScheduleZBVZeroBubble`` (``None`` placeholders dropped)."""
    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble
    planner = types.SimpleNamespace(pp_group_size=ranks, _n_microbatches=micro_batches, num_stages=2 * ranks)
    return {r: [a for a in ScheduleZBVZeroBubble._calculate_single_rank_operations(planner, r) if a is not None]
            for r in range(ranks)}


def time_zbv(ranks, micro_batches, chunk, links=None, steps=1, step=0.0):
    """Makespan of ``steps`` consecutive ZB-V steps; ``chunk = (F, I, W)`` seconds of one chunk (see the module
    docstring). Raises RuntimeError on a deadlock (the action lists never deadlock)."""
    chunks = 2 * ranks
    rank_of = [k if k < ranks else chunks - 1 - k for k in range(chunks)]
    duration = dict(zip("FIW", chunk))
    actions = zbv_actions(ranks, micro_batches)
    seqs = []
    for r in range(ranks):
        seq = []
        for s in range(steps):
            seq += [(s, a.computation_type.value, a.stage_index, a.microbatch_index) for a in actions[r]]
            seq.append((s, "STEP", r, None))
        seqs.append(seq)
    move = links.transfer_time if links is not None else (lambda a, b: 0.0)
    done, clock, pos, blocked = {}, [0.0] * ranks, [0] * ranks, {}
    ready = deque(range(ranks))
    while ready:
        r = ready.popleft()
        while pos[r] < len(seqs[r]):
            s, kind, k, m = seqs[r][pos[r]]
            if kind == "STEP":
                start, dur = clock[r], step + (links.step_delay(duration["W"]) if links is not None else 0.0)
            else:
                if kind == "F":
                    dep = ((s, "F", k - 1, m), rank_of[k - 1]) if k > 0 else None
                elif kind == "I":
                    dep = ((s, "I", k + 1, m), rank_of[k + 1]) if k < chunks - 1 else ((s, "F", k, m), r)
                else:
                    dep = ((s, "I", k, m), r)
                if dep is not None and dep[0] not in done:
                    blocked.setdefault(dep[0], []).append(r)
                    break
                start = clock[r] if dep is None else max(clock[r], done[dep[0]] + move(dep[1], r))
                dur = duration[kind]
            key = (s, kind, k, m)
            done[key] = clock[r] = start + dur
            pos[r] += 1
            ready.extend(blocked.pop(key, ()))
    if any(pos[r] < len(seqs[r]) for r in range(ranks)):
        raise RuntimeError(f"ZB-V deadlock at ranks' positions {pos}")
    return max(clock)


def zbv_period(ranks, micro_batches, chunk, links=None, steps=2, step=0.0):
    """Long-run seconds per micro-batch: ``(makespan(2n) - makespan(n)) / (n M)``, fill and drain cancelled."""
    one = time_zbv(ranks, micro_batches, chunk, links, steps, step)
    two = time_zbv(ranks, micro_batches, chunk, links, 2 * steps, step)
    return (two - one) / (steps * micro_batches)


# -- the table ------------------------------------------------------------------------------------------
# PACI variants: label -> (paci.step_phase, all-reduce overlapped with the window's last backward, transfers,
# slack on the links between nodes: "paci.slack_links" = node_links(...))
VARIANTS = {
    "PACI": ("aligned", False, "blocking", False),
    "diagonal": ("diagonal", False, "blocking", False),
    "diagonal+overlap": ("diagonal", True, "blocking", False),
    "diagonal+nb": ("diagonal", False, "nonblocking", False),
    "diagonal+overlap+nb": ("diagonal", True, "nonblocking", False),
    "diagonal+nb+slack": ("diagonal", False, "nonblocking", True),
    "diagonal+overlap+nb+slack": ("diagonal", True, "nonblocking", True),
}


def node_links(stages, links):
    """The links ``b`` (stage ``b`` to ``b+1``) that join two nodes under ``links`` (none without a link model):
    what a user lists in ``"paci": {"slack_links": [...]}``."""
    if links is None:
        return ()
    return tuple(b for b in range(stages - 1) if links.node_of(b) != links.node_of(b + 1))


def rows(stages, micro_batch_factors=(1, 4), scenarios=tuple(SCENARIOS), shape=BlockShape(), flops_per_s=100e12,
         blocks_per_stage=2, calls=2, variants=("PACI", )):
    """One row per (P, M, scenario): seconds per micro-batch of 1F1B-flush, each PACI variant (:data:`VARIANTS`;
    an overlap variant only where there is a data-parallel reduce) and ZB-V, and derived ratios."""
    f = stage_costs(shape, flops_per_s)
    out = []
    for P in stages:
        for factor in micro_batch_factors:
            M = max(1, int(round(factor * P)))
            for name in scenarios:
                links = link_model(name, shape, blocks_per_stage)
                cost = CostModel(forward=blocks_per_stage * f, backward=2 * blocks_per_stage * f, links=links)
                per = blocks_per_stage / 2  # ZB-V: two chunks per rank, each half a stage
                periods = {"1F1B-flush": long_run_period("stock", P, M, cost=cost, calls=calls)}
                for label in variants:
                    phase, overlap, transfers, slack = VARIANTS[label]
                    if overlap and (links is None or links.dp == 1 or links.overlap):
                        continue
                    c = replace(cost, links=replace(links, overlap=True)) if overlap else cost
                    periods[label] = long_run_period("paci", P, M, M, calls=calls, cost=c, phase=phase,
                                                     transfers=transfers,
                                                     slack=node_links(P, links) if slack else ())
                periods["ZB-V"] = zbv_period(P, M, (per * f, per * f, per * f), links)
                compute = 3 * blocks_per_stage * f
                out.append({"P": P, "M": M, "scenario": name, "period_s": periods,
                            "vs_1f1b": {k: periods["1F1B-flush"] / v for k, v in periods.items()},
                            "compute_share": {k: compute / v for k, v in periods.items()}})
    return out


def markdown(table):
    lines = ["| P | M | links | 1F1B-flush ms/mb | PACI ms/mb | ZB-V ms/mb | PACI / 1F1B | ZB-V / 1F1B | PACI / ZB-V "
             "| compute share 1F1B / PACI / ZB-V |", "|---:|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in table:
        p, v, c = r["period_s"], r["vs_1f1b"], r["compute_share"]
        lines.append(f"| {r['P']} | {r['M']} | {r['scenario']} | {1e3 * p['1F1B-flush']:.2f} | {1e3 * p['PACI']:.2f} "
                     f"| {1e3 * p['ZB-V']:.2f} | {v['PACI']:.3f} | {v['ZB-V']:.3f} | {p['ZB-V'] / p['PACI']:.3f} "
                     f"| {c['1F1B-flush']:.1%} / {c['PACI']:.1%} / {c['ZB-V']:.1%} |")
    return "\n".join(lines)


def variants_markdown(table, variants):
    """1F1B-flush, ZB-V and every PACI variant: ms per micro-batch, each PACI cell with its ratio to ZB-V (ZB-V's
    time over PACI's, above 1: PACI faster); ``-`` where a variant does not apply."""
    head = " | ".join(variants)
    lines = [f"| P | M | links | 1F1B-flush | ZB-V | {head} |", "|---:|---:|---|---:|---:|" + "---:|" * len(variants)]
    for r in table:
        p = r["period_s"]
        cells = " | ".join(f"{1e3 * p[n]:.2f} ({p['ZB-V'] / p[n]:.3f}x)" if n in p else "-" for n in variants)
        lines.append(f"| {r['P']} | {r['M']} | {r['scenario']} | {1e3 * p['1F1B-flush']:.2f} | {1e3 * p['ZB-V']:.2f} "
                     f"| {cells} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m ds_paci.tools.studies.scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--micro-batch-factors", type=float, nargs="+", default=[1, 4], help="M = factor x P")
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    p.add_argument("--tflops", type=float, default=100.0, help="device speed (effective TFLOP/s)")
    p.add_argument("--blocks-per-stage", type=int, default=2)
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=["PACI"],
                   help="PACI variants to time (more than PACI: the variants table instead)")
    p.add_argument("--step-phases", nargs="+", choices=["aligned", "diagonal"],
                   help="the older spelling: --variants PACI (aligned) and diagonal")
    p.add_argument("--out", help="also write the table (markdown) here")
    args = p.parse_args(argv)
    if args.step_phases:
        args.variants = [{"aligned": "PACI", "diagonal": "diagonal"}[x] for x in args.step_phases]
    data = []
    for P in args.stages:
        for factor in args.micro_batch_factors:
            data += rows([P], [factor], args.scenarios, flops_per_s=args.tflops * 1e12,
                         blocks_per_stage=args.blocks_per_stage, variants=tuple(args.variants))
            table = markdown(data) if args.variants == ["PACI"] else variants_markdown(data, args.variants)
            if args.out:  # written after every (P, M), so a long run leaves what it has
                with open(args.out, "w") as f:
                    f.write(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
