"""Analysis of a peer-study cell: throughput per round, memory, losses, the agreement check, the ideal limits.

Pure functions over what :func:`.peers_worker.run_cell_rank` returns (``ranks[r]["runs"][round][engine]``), except
:func:`validation_loss`, which evaluates gathered weights in this process.
"""

from __future__ import annotations

import math
import statistics

from .model import PeerCell, full_model

#: Engines that run exactly the synchronous semantics of DeepSpeed's stock engine (same loss at every step).
SYNCHRONOUS = ("stock", "gpipe", "1f1b", "interleaved-1f1b", "zb1p", "zbv", "dualpipev")

#: Agreement of a synchronous schedule with stock at equal steps. The schedules run the same float32 operations
#: on the same data, but sum the gradient contributions in other orders (torch sums M micro-batch gradients and
#: divides once; DeepSpeed 0.19.8 scales each micro-batch's loss by 1/M; the I/W split accumulates each parameter
#: gradient in a second autograd call): float32 rounding, ~1e-7 relative per operation. Adam's update
#: m/sqrt(v) turns a gradient difference into an update difference of the same relative size, so after a few
#: steps the losses differ by ~1e-6 relative. A wrong harness (other data, weights, scaling or optimizer) changes
#: the loss by >1e-2 from the first step.
LOSS_TOLERANCE = 1e-4  # relative, per step
WEIGHT_TOLERANCE = 1e-4  # absolute, largest difference of any weight after the run (weights are ~0.02-1)


def run_span(run: dict, warmup: int) -> float:
    """Seconds of one rank's timed steps: start of step ``warmup`` to the end of the last step."""
    calls = run["calls"]
    return calls[-1][1] - calls[warmup][0]


def tokens_per_second(ranks: list, engine: str, round_index: int, cell: PeerCell) -> float:
    """Timed steps x tokens per step / the slowest rank's span (engine ``engine``, round ``round_index``)."""
    span = max(run_span(r["runs"][round_index][engine], cell.warmup) for r in ranks)
    return (cell.steps - cell.warmup) * cell.tokens_per_step / span


def step_losses(ranks: list, engine: str, round_index: int) -> list:
    """Per-step training loss reported by the rank holding the last stage (``None`` where it had none)."""
    values = [r["runs"][round_index][engine]["losses"] for r in ranks]
    return [next((v[i] for v in values if v[i] is not None), None) for i in range(len(values[0]))]


def gathered_state(ranks: list, engine: str) -> dict:
    """The whole model's weights after round 0, merged from every rank (keys: layer index names)."""
    state = {}
    for r in ranks:
        state.update(r["runs"][0][engine]["state"])
    return state


def validation_loss(cell: PeerCell, state: dict, val_batches: list) -> float:
    """Mean loss of the model holding ``state`` on ``val_batches``, in this process (same for every engine)."""
    import torch

    from ds_paci.workload.gpt2 import lm_loss
    model = full_model(cell)
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        return statistics.fmean(float(lm_loss(model(x), y)) for x, y in val_batches)


def weight_difference(state: dict, reference: dict) -> float:
    """Largest absolute difference between two weight sets with the same keys."""
    if state.keys() != reference.keys():
        raise ValueError(f"weight sets differ in names: {sorted(set(state) ^ set(reference))[:4]}")
    return max(float((state[k] - reference[k]).abs().max()) for k in state)


def loss_difference(losses: list, reference: list) -> float:
    """Largest relative difference of two per-step loss lists (``inf`` if one misses a value the other has)."""
    worst = 0.0
    for a, b in zip(losses, reference):
        if a is None or b is None:
            if a is not b:
                return math.inf
            continue
        worst = max(worst, abs(a - b) / max(abs(b), 1e-12))
    return worst


def agreement(engine_summaries: dict) -> dict:
    """Per synchronous engine: loss and weight differences from stock and whether both are within tolerance."""
    stock = engine_summaries.get("stock")
    out = {}
    if stock is None:
        return out
    for engine, summary in engine_summaries.items():
        if engine == "stock" or engine not in SYNCHRONOUS:
            continue
        loss = loss_difference(summary["losses"], stock["losses"])
        weights = summary["weight_difference_from_stock"]
        out[engine] = {"loss_relative": loss, "weights_absolute": weights,
                       "agrees": loss <= LOSS_TOLERANCE and weights <= WEIGHT_TOLERANCE}
    return out


def activation_bytes(run: dict, engine: str, warmup: int) -> int:
    """Peak bytes saved for backward by the schedule in the timed steps of one rank's run.

    A synchronous schedule frees every activation by the end of its step, so bytes still saved when a step starts
    are not its activations and are subtracted per step (a guard: the study measured none, see
    ``held_at_step_start_per_rank``). PACI's engines keep micro-batches in flight across calls: for them the raw
    peak counts.
    """
    held, peaks = run["saved_bytes"]["held_at_step_start"], run["saved_bytes"]["step_peak"]
    if engine not in SYNCHRONOUS:
        return max(peaks[warmup:])
    return max(p - h for p, h in zip(peaks[warmup:], held[warmup:]))


def bubble_free_tokens_per_second(cell: PeerCell) -> float | None:
    """Emulated limit: every rank busy all the time on its share, the busiest rank (two blocks, plus the head's
    extra time where ``slow_last``) setting the pace; ``None`` for real compute."""
    if not cell.emulated:
        return None
    per_micro_batch = 2 * sum(cell.block_times) + sum(cell.head_times)
    return cell.tokens_per_step / (cell.micro_batches * per_micro_batch)


def summarize_engine(ranks: list, engine: str, cell: PeerCell, val_batches: list, stock_state: dict | None) -> dict:
    """Throughput per round (and median), memory per rank, losses, validation loss and waits of one engine."""
    rounds = sorted(ranks[0]["runs"])
    tps = [tokens_per_second(ranks, engine, r, cell) for r in rounds]
    losses = [step_losses(ranks, engine, r) for r in rounds]
    state = gathered_state(ranks, engine)
    first = [r["runs"][0][engine] for r in ranks]
    return {
        "tokens_per_second": {"per_round": tps, "median": statistics.median(tps)},
        "seconds_per_step_median": cell.tokens_per_step / statistics.median(tps),
        "losses": losses[0],
        "losses_same_every_round": all(loss_difference(x, losses[0]) == 0.0 for x in losses[1:]),
        "validation_loss": validation_loss(cell, state, val_batches),
        "weight_difference_from_stock": None if stock_state is None else weight_difference(state, stock_state),
        "activation_bytes_per_rank": [activation_bytes(run, engine, cell.warmup) for run in first],
        "raw_peak_saved_bytes_per_rank": [max(run["saved_bytes"]["step_peak"][cell.warmup:]) for run in first],
        "held_at_step_start_per_rank": [run["saved_bytes"]["held_at_step_start"] for run in first],
        "stages_per_rank": [run["stages"] for run in first],
        "waits_per_rank": [run["waits"] for run in first],
        "executed": [run.get("executed") for run in first],
        "executed_times": [run.get("executed_times") for run in first],
        "recorded_step": [run.get("recorded_step") for run in first],
        "instructions": [run.get("instructions") for run in first],
        "pipeline_order": [run.get("pipeline_order") for run in first],
        "setup_seconds_per_round": [max(r["runs"][i][engine]["setup_seconds"] for r in ranks) for i in rounds],
        "run_seconds_per_round": [max(r["runs"][i][engine]["run_seconds"] for r in ranks) for i in rounds],
        "loadavg_per_round": [ranks[0]["runs"][i][engine]["loadavg_1min"] for i in rounds],
        "run_order_per_round": [ranks[0]["runs"][r][engine]["order"] for r in rounds],
    }


def summarize_cell(cell: PeerCell, ranks: list, engines: list, val_batches: list) -> dict:
    """Every engine's summary, the agreement check and the ratios to stock and to the best synchronous peer."""
    summaries = {}
    stock_state = gathered_state(ranks, "stock") if "stock" in engines else None
    for engine in engines:
        summaries[engine] = summarize_engine(ranks, engine, cell, val_batches, stock_state)
    return {"engines": summaries, "agreement": agreement(summaries), "ratios": ratios(summaries),
            "bubble_free_tokens_per_second": bubble_free_tokens_per_second(cell)}


def ratios(summaries: dict) -> dict:
    """Median tokens/s of each engine over stock's, and PACI's engines over the best synchronous peer per round."""
    out = {}
    stock = summaries.get("stock")
    if stock is not None:
        out["vs_stock"] = {e: s["tokens_per_second"]["median"] / stock["tokens_per_second"]["median"]
                           for e, s in summaries.items()}
    peers = [e for e in summaries if e in SYNCHRONOUS]
    if peers:
        best = max(peers, key=lambda e: summaries[e]["tokens_per_second"]["median"])
        out["best_synchronous"] = best
        for engine in ("paci", "paci+lookahead"):
            if engine in summaries:
                per_round = [a / max(summaries[p]["tokens_per_second"]["per_round"][i] for p in peers)
                             for i, a in enumerate(summaries[engine]["tokens_per_second"]["per_round"])]
                out[f"{engine}_vs_best_synchronous"] = {
                    "median": summaries[engine]["tokens_per_second"]["median"]
                    / summaries[best]["tokens_per_second"]["median"],
                    "per_round": per_round}
    return out
