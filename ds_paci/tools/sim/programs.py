"""Reference programs and tables for the simulator: stock DeepSpeed and PACI programs, long-run periods,
published bubble formulas and the comparison rows :mod:`ds_paci.tools.sim.simulate` prints."""

from deepspeed.runtime.pipe.schedule import TrainSchedule

from ds_paci.core.program.passes import lower_call
from ds_paci.core.program.stream import PACIStream, step_phase

from .cost import CostModel
from .tied import add_tied_exchange
from .simulator import simulate

__all__ = [
    "stock_programs", "paci_programs", "simulate_stock", "simulate_paci", "simulate_schedule", "long_run_period",
    "ZB_SOURCE", "reference_rows", "comparison_rows", "markdown_table"
]


def stock_programs(stages, micro_batches, batches=1):
    """DeepSpeed's own ``TrainSchedule`` per stage, repeated ``batches`` times (a flush after each)."""
    programs = [[] for _ in range(stages)]
    for _ in range(batches):
        for s in range(stages):
            programs[s].extend(list(TrainSchedule(micro_batches=micro_batches, stages=stages, stage_id=s)))
    return programs


def paci_programs(stages, micro_batches, window, calls, drain=True, tied=None, phase="aligned", nonblocking=False,
                  slack=()):
    """PACI streams per stage: ``calls`` times ``advance(2*M)`` (one ``train_batch`` each), then ``drain()``.

    ``phase``: the engine's ``paci.step_phase`` (``"aligned"`` or ``"diagonal"``, :mod:`ds_paci.core.program.stream`).
    ``nonblocking``: each call (and the drain) lowered as the engine lowers it for non-blocking transfers,
    ``lower_call(..., nonblocking=True)`` (:mod:`ds_paci.core.program.passes`: sends hoisted); time it with
    ``simulate(..., transfers="nonblocking")``.

    The drain (if any) starts at tick ``2 * micro_batches * calls`` on every stage. ``tied`` (a
    :class:`~ds_paci.tools.sim.tied.TiedExchange`): the program in actions with the tied exchange placed on it
    (:func:`~ds_paci.tools.sim.tied.add_tied_exchange`); without, the streams' ticks as they are.
    """
    streams = [PACIStream(stages, s, window, micro_batches, step_phase(phase, s, window), slack) for s in range(stages)]
    programs = [[] for _ in range(stages)]
    lower = (lambda ticks: lower_call(ticks, nonblocking=True)) if nonblocking else list
    for _ in range(calls):
        for s, stream in enumerate(streams):
            programs[s].extend(lower(stream.advance(2 * micro_batches)))
    if drain:
        for s, stream in enumerate(streams):
            programs[s].extend(lower(stream.drain()))
    if tied is not None:
        return add_tied_exchange(programs, tied)
    return programs


def simulate_stock(stages, micro_batches, batches=1, cost=None):
    """:func:`simulate` of :func:`stock_programs`."""
    return simulate(stock_programs(stages, micro_batches, batches), cost)


def simulate_schedule(schedule, stages, micro_batches, window=None, calls=1, cost=None, phase="aligned",
                      transfers="blocking"):
    """``(result, title)`` of simulating ``schedule`` ("paci" or "stock"), for timelines and reports."""
    if schedule == "paci":
        result = simulate_paci(stages, micro_batches, window, calls, cost, phase, transfers)
        label = (f"PACI a={window or micro_batches}" + ("" if phase == "aligned" else f" {phase}") +
                 ("" if transfers == "blocking" else f" {transfers}"))
    else:
        result, label = simulate_stock(stages, micro_batches, calls, cost), "stock 1F1B-flush"
    return result, f"simulated {label}, P={stages}, M={micro_batches}, {calls} calls"


def simulate_paci(stages, micro_batches, window=None, calls=1, cost=None, phase="aligned", transfers="blocking",
                  slack=()):
    """:func:`simulate` of :func:`paci_programs` (``window`` defaults to ``micro_batches``), steady state measured.

    ``transfers="nonblocking"``: the program the engine runs with non-blocking transfers (sends hoisted), timed
    with them (:mod:`ds_paci.tools.sim.nonblocking`)."""
    window = window or micro_batches
    nonblocking = transfers == "nonblocking"
    programs = paci_programs(stages, micro_batches, window, calls, phase=phase, nonblocking=nonblocking, slack=slack)
    # the hoisting pass keeps every tick in place, so the drain still starts at this tick
    return simulate(programs, cost, drain_tick=2 * micro_batches * calls, transfers=transfers)


def long_run_period(schedule, stages, micro_batches, window=None, calls=4, cost=None, phase="aligned",
                    transfers="blocking", slack=()):
    """Long-run time per micro-batch: ``(makespan(2N) - makespan(N)) / (N*M)`` with ``N = calls``.

    The difference of two run lengths cancels the one-off fill and drain, so this is
    the asymptotic period of an unbounded run. ``schedule`` is ``"paci"`` or ``"stock"``; ``phase``: PACI's step
    phase; ``transfers``: PACI's transfers (``"blocking"`` or ``"nonblocking"``, :func:`simulate_paci`).
    """

    def makespan(n):
        if schedule == "paci":
            result = simulate_paci(stages, micro_batches, window, n, cost, phase, transfers, slack)
        elif schedule == "stock":
            result = simulate_stock(stages, micro_batches, n, cost)
        else:
            raise ValueError(f"unknown schedule {schedule!r} (paci or stock)")
        result.raise_for_errors()
        return result.makespan

    return (makespan(2 * calls) - makespan(calls)) / (calls * micro_batches)


# -- published reference formulas ------------------------------------------------------

ZB_SOURCE = ("Qi et al., Zero Bubble Pipeline Parallelism, arXiv 2401.10241, Table 2 (per-stage bubble time; "
             "T_B = input-gradient part, T_W = weight-gradient part)")


def reference_rows(stages, micro_batches, f=1.0):
    """Bubble fractions of GPipe/1F1B, ZB-1p and ZB-2p from published formulas.

    Assumes forward ``T_F = f`` and a backward of ``2f`` that zero-bubble schedules
    split into ``T_B = f`` (input gradient) and ``T_W = f`` (weight gradient). Per-stage
    idle time ("bubble size", ``ZB_SOURCE``):

    * GPipe and 1F1B: ``(P-1)(T_F+T_B+T_W)``
    * ZB-1p: the paper's handcrafted ZB-H1 bound ``(P-1)(T_F+T_B-T_W)``, which ZB-1p
      (automatic, same 1F1B memory) matches or beats
    * ZB-2p: ZB-H2's ``(P-1)(T_F+T_B-2T_W)`` (2x activation memory)

    (With ``B`` denoting the full backward ``T_B+T_W``, as in DualPipe's README, these
    read ``(P-1)(F+B)``, ``(P-1)(F+B-2W)``, ``(P-1)(F+B-3W)``.) The fraction reported
    is idle over total stage time, comparable to :attr:`SimResult.bubble_fraction`:
    ``bubble / (M*(T_F+T_B+T_W) + bubble)``, i.e. ``(P-1)/(M+P-1)`` for 1F1B,
    ``(P-1)/(3M+P-1)`` for ZB-1p and ``0`` for ZB-2p. (The ZB README's "bubble rate"
    ``(p-1)/m``, ``(p-1)/3m`` divides by compute time instead.) Peak in-flight
    micro-batches (stage 0): GPipe ``M``, 1F1B and ZB-1p ``P``, ZB-2p ``2P-1``.
    """
    P, M = stages, micro_batches
    t_f, t_b, t_w = f, f, f
    work = M * (t_f + t_b + t_w)

    def row(name, bubble_time, peak, formula):
        bubble_time = max(0.0, bubble_time)
        return {
            "P": P,
            "M": M,
            "schedule": name,
            "bubble_time": bubble_time,
            "bubble_fraction": bubble_time / (work + bubble_time),
            "peak_in_flight": peak,
            "max_drift": 0,
            "formula": formula,
            "source": ZB_SOURCE,
        }

    return [
        row("GPipe/1F1B (formula)", (P - 1) * (t_f + t_b + t_w), M, "(P-1)(T_F+T_B+T_W) -> (P-1)/(M+P-1)"),
        row("ZB-1p (formula)", (P - 1) * (t_f + t_b - t_w), P, "(P-1)(T_F+T_B-T_W) -> (P-1)/(3M+P-1)"),
        row("ZB-2p (formula)", (P - 1) * (t_f + t_b - 2 * t_w), 2 * P - 1, "(P-1)(T_F+T_B-2T_W) -> 0"),
    ]


# -- comparison table -------------------------------------------------------------------


def comparison_rows(stages, micro_batches, window=None, calls=8, cost=None, peers=False, weight_share=0.5,
                    phases=("aligned", )):
    """Rows for one (P, M): stock (DeepSpeed TrainSchedule), PACI, and the formula rows.

    ``phases``: one PACI row per step phase. ``peers``: also one row per torch.distributed.pipelining schedule, timed from its own action list
    (:func:`ds_paci.tools.sim.peer_schedules.peer_rows`), with each stage's backward split ``1 - weight_share`` :
    ``weight_share`` into input and weight gradient.

    ``throughput_vs_stock`` is the ratio of long-run micro-batches per unit time (see
    :func:`long_run_period`); for formula rows ``(1-b)/(1-b_1F1B)`` (same compute).
    ``bubble_fraction`` of the simulated rows covers ``calls`` batches/calls, PACI's
    including its single fill and drain.
    """
    P, M = stages, micro_batches
    cost = cost or CostModel()
    window = window or M
    ideal = (M + P - 1) / M
    stock = simulate_stock(P, M, calls, cost).raise_for_errors()
    stock_period = long_run_period("stock", P, M, cost=cost)

    def sim_row(name, result, period, steady):
        return {
            "P": P,
            "M": M,
            "schedule": name,
            "bubble_fraction": result.bubble_fraction,
            "steady_state_bubble": steady,
            "throughput_vs_stock": stock_period / period,
            "peak_in_flight": max(result.peak_in_flight),
            "peak_in_flight_per_stage": result.peak_in_flight,
            "max_drift": result.max_drift,
            "ideal_ratio": ideal,
        }

    rows = [sim_row("stock 1F1B-flush (DeepSpeed)", stock, stock_period, None)]
    for phase in phases:
        paci = simulate_paci(P, M, window, calls, cost, phase).raise_for_errors()
        paci_period = long_run_period("paci", P, M, window, calls, cost, phase)
        name = f"PACI (a={window}, {calls} calls)" if phase == "aligned" else f"PACI {phase} (a={window}, {calls} calls)"
        rows.append(sim_row(name, paci, paci_period, paci.steady_state_bubble))
    f = cost.forward_time(0)
    one_f1b = (P - 1) / (M + P - 1)
    for ref in reference_rows(P, M, f):
        ref.update(steady_state_bubble=None,
                   throughput_vs_stock=(1 - ref["bubble_fraction"]) / (1 - one_f1b),
                   ideal_ratio=ideal)
        rows.append(ref)
    if peers:
        from .peer_schedules import costs_from_ranks, peer_rows
        forward = [cost.forward_time(s) for s in range(P)]
        backward = [cost.backward_time(s) for s in range(P)]
        rows.extend(peer_rows(P, M, lambda n: costs_from_ranks(forward, backward, weight_share, n), stock_period,
                              cost.latency, cost.step))
    return rows


def markdown_table(rows):
    """One markdown table of :func:`comparison_rows` rows."""

    def pct(x):
        return "n/a" if x is None else f"{100 * x:.1f}%"

    header = ("| P | M | schedule | bubble | steady-state bubble | throughput vs stock | peak in-flight (max) "
              "| max drift | ideal (M+P-1)/M |")
    lines = [header, "|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.get("unavailable"):
            lines.append(f"| {r['P']} | {r['M']} | {r['schedule']} | not run: {r['unavailable']} | | | | | "
                         f"{r['ideal_ratio']:.3f} |")
            continue
        lines.append(f"| {r['P']} | {r['M']} | {r['schedule']} | {pct(r['bubble_fraction'])} "
                     f"| {pct(r['steady_state_bubble'])} | {r['throughput_vs_stock']:.3f} | {r['peak_in_flight']} "
                     f"| {r['max_drift']} | {r['ideal_ratio']:.3f} |")
    return "\n".join(lines)
