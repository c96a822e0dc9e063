"""The simulator against the peer study's measurements.

Three predictions per emulated cell and engine, next to the measured ratio to stock:

* **simulated**: the schedule's own action list (:mod:`ds_paci.tools.sim.peer_schedules`; DeepSpeed's and PACI's
  instruction streams through :mod:`ds_paci.tools.sim.simulate`) timed with the cell's emulated ``F``, ``B``, ``W``
  and nothing else;
* **with host time**: the same plus ``h`` seconds per micro-batch and rank added to every forward, ``h`` fitted so
  that stock's simulated step equals its measured one (one parameter for the whole cell);
* **replay**: the first timed step of round 0 timed with the measured duration of each of its actions (torch's
  schedules: each ``F``/``I``/``W``/``B``; DeepSpeed's engines: each stage's mean forward and backward and its
  optimizer step), beside round 0's measured seconds per step: what remains between them is time the dependency
  model does not have (transfers, host work between actions, a recorded step slower than its round's mean).
"""

from __future__ import annotations

import statistics

from ds_paci.tools.sim.peer_schedules import PEERS, action_lists, long_run_period, stage_costs, time_actions
from .model import PeerCell

MISS = 0.05  # differences above this are flagged and explained in the study's notes


def simulated_step_seconds(cell: PeerCell, engine: str, host: float = 0.0) -> float:
    """Simulated seconds per step of ``engine`` under the cell's emulated costs, plus ``host`` seconds of host time
    per micro-batch and rank (added to the forward; split over a rank's virtual stages). No transfer time."""
    from ds_paci.tools.sim.simulate import CostModel
    from ds_paci.tools.sim.simulate import long_run_period as ds_period
    if engine in PEERS:
        v = PEERS[engine].stages_per_rank
        costs = stage_costs(cell.block_times, cell.head_times, cell.stages * v, cell.n_layer, forward_overhead=host / v)
        return long_run_period(action_lists(engine, cell.stages, cell.micro_batches), costs)
    f, b, w = cell.block_times
    forward, backward = [2 * f] * cell.stages, [2 * (b + w)] * cell.stages
    forward[-1] += cell.head_times[0]
    backward[-1] += cell.head_times[1] + cell.head_times[2]
    cost = CostModel(forward=forward, backward=backward, overhead=host)
    schedule = "stock" if engine == "stock" else "paci"
    return ds_period(schedule, cell.stages, cell.micro_batches, cell.micro_batches, 4, cost) * cell.micro_batches


def fitted_host_time(cell: PeerCell, stock_step_seconds: float) -> float:
    """The host time per micro-batch and rank that makes the simulated stock step as long as the measured one."""
    if simulated_step_seconds(cell, "stock") >= stock_step_seconds:
        return 0.0
    low, high = 0.0, 1.0
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (mid, high) if simulated_step_seconds(cell, "stock", mid) < stock_step_seconds else (low, mid)
    return (low + high) / 2


def simulated_ratios(cell: PeerCell, engines, host: float = 0.0) -> dict:
    """Throughput over stock's of each engine in the simulator (see :func:`simulated_step_seconds`)."""
    stock = simulated_step_seconds(cell, "stock", host)
    return {engine: stock / simulated_step_seconds(cell, engine, host) for engine in engines}


def replay_step_seconds(cell: PeerCell, engine: str, summary: dict) -> float | None:
    """The recorded step timed with its own measured action durations (``None`` when nothing was recorded)."""
    if engine in PEERS:
        durations = {}
        for actions, times in zip(summary.get("executed") or [], summary.get("executed_times") or []):
            for text, (start, end) in zip(actions or [], times or []):
                durations[text] = end - start
        if not durations:
            return None
        costs = stage_costs(cell.block_times, cell.head_times, cell.stages * PEERS[engine].stages_per_rank,
                            cell.n_layer)
        _, _, end = time_actions(action_lists(engine, cell.stages, cell.micro_batches), costs, durations=durations)
        return max(end.values())
    return _replay_deepspeed(cell, engine, summary)


def _mean_duration(records, prefix) -> float:
    values = [end - start for text, start, end in records if text.rstrip("0123456789") == prefix]
    return statistics.fmean(values) if values else 0.0


def _replay_deepspeed(cell: PeerCell, engine: str, summary: dict) -> float | None:
    from ds_paci.tools.sim.simulate import CostModel, simulate_paci, simulate_stock
    per_rank = summary.get("instructions") or []
    if not per_rank or not all(per_rank):
        return None
    forward = [_mean_duration(r, "F") + _mean_duration(r, "L") for r in per_rank]
    backward = [_mean_duration(r, "B") for r in per_rank]
    step = statistics.fmean(_mean_duration(r, "STEP") for r in per_rank)
    cost = CostModel(forward=forward, backward=backward, step=step)
    if engine == "stock":
        return simulate_stock(cell.stages, cell.micro_batches, 1, cost).makespan
    # PACI: one call of the long run (the fill and drain cancel out)
    runs = [simulate_paci(cell.stages, cell.micro_batches, cell.micro_batches, n, cost).makespan for n in (4, 8)]
    return (runs[1] - runs[0]) / 4


def simulator_rows(entries) -> list:
    """Per emulated cell and engine: the three predictions beside the measurement (see the module docstring)."""
    rows = []
    for e in entries:
        cell = PeerCell(**e["cell"])
        if not cell.emulated:
            continue
        host = fitted_host_time(cell, e["engines"]["stock"]["seconds_per_step_median"])
        sim, sim_host = simulated_ratios(cell, e["engines"]), simulated_ratios(cell, e["engines"], host)
        for engine, summary in e["engines"].items():
            measured = e["ratios"]["vs_stock"][engine]
            replay = replay_step_seconds(cell, engine, summary)
            round_0 = cell.tokens_per_step / summary["tokens_per_second"]["per_round"][0]  # the replayed step's round
            rows.append({"cell": e["name"], "engine": engine, "measured": measured, "simulated": sim[engine],
                         "difference": measured / sim[engine] - 1.0, "host_seconds": host,
                         "simulated_with_host": sim_host[engine],
                         "difference_with_host": measured / sim_host[engine] - 1.0,
                         "measured_step": summary["seconds_per_step_median"],
                         "simulated_step": simulated_step_seconds(cell, engine),
                         "replay_step": replay,
                         "round_0_step": round_0,
                         "replay_difference": None if not replay else round_0 / replay - 1.0})
    return rows


def _flag(x) -> str:
    return " **(> 5%)**" if x is not None and abs(x) > MISS else ""


def simulator_table(entries, titles: dict) -> str:
    lines = ["| cell | engine | measured vs stock | simulated | measured / simulated - 1 | with host time h: "
             "simulated, measured / it - 1 | s/step: measured (median) / simulated | round 0: s/step measured / "
             "replay, - 1 |",
             "|---|---|---|---|---|---|---|---|"]
    for r in simulator_rows(entries):
        replay = "-" if r["replay_difference"] is None else (
            f"{r['round_0_step']:.3f} / {r['replay_step']:.3f}, {r['replay_difference']:+.1%}")
        steps = f"{r['measured_step']:.3f} / {r['simulated_step']:.3f}"
        if r["engine"] == "stock":
            lines.append(f"| {r['cell']} | {titles['stock']} | 1 | 1 | | h = {r['host_seconds'] * 1000:.1f} ms per "
                         f"micro-batch and rank | {steps} | {replay} |")
            continue
        lines.append(f"| {r['cell']} | {titles[r['engine']]} | {r['measured']:.3f} | {r['simulated']:.3f} | "
                     f"{r['difference']:+.1%}{_flag(r['difference'])} | {r['simulated_with_host']:.3f}, "
                     f"{r['difference_with_host']:+.1%}{_flag(r['difference_with_host'])} | {steps} | {replay} |")
    return "\n".join(lines)
