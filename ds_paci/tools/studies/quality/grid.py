"""The depth x batch sweep as data: shapes, the model, window rules, and every run with its key.

A :class:`SweepRun` is one replay (:mod:`ds_paci.tools.replay.replayer`): engine ``stock`` (the replay's sync
mode, which is the stock engine's math), ``paci`` or ``lookahead``, the per-stage windows, the learning
rate, the seeds and the step count. Runs are identified by :meth:`SweepRun.key`; the window is in the
key as the resolved per-stage list, so a rule (a function of ``P``, ``M`` and the stage) is evaluated by
looking up the runs its windows name (:func:`rule_windows`).

The grid (:func:`sweep_plan`), per depth ``P`` in :data:`DEPTHS`:

* phase 1, the stock learning-rate sweep: stock at ``M = P`` over :data:`SWEEP_LRS`, first seed;
* phase 2, once phase 1 of ``P`` is done, for ``M`` in ``{P/2, P, 2P}`` and the two learning rates
  ``best`` and ``best / 3`` (``best``: the lowest final loss of phase 1): stock, plain PACI and PACI +
  look-ahead with the ``"auto"`` window on both seeds, and PACI + look-ahead with every window of
  :data:`ALL_RULES` on the first seed. :data:`COVERAGE` says how many seeds and learning rates each
  depth runs (both of each everywhere);
* the Muon cells at P = 8 (:func:`muon_runs`).

Every run of a depth trains :data:`STEPS` ``[P]`` ``train_batch`` calls (``M`` micro-batches each) of
the same model (:data:`MODEL`, one block per stage); ``lookahead`` runs with the ``"auto"`` window and
``paci`` runs (window :data:`PACI_RULE`) at ``P <= 8`` train :data:`OVERRUN` x as long (one drain at the common step count, where
their final loss is read), for the time to stock's final loss.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass

from ds_paci.core.config import auto_window

DEPTHS = (4, 8, 16, 32)
STEPS = {4: 240, 8: 240, 16: 120, 32: 60}
SWEEP_LRS = (1e-3, 3e-3, 9e-3)
SEEDS = ((1234, 7), (4321, 8))
#: How much of the grid a depth runs: (seeds, learning rates): the issue's grid, both of each at every depth.
COVERAGE = {4: (2, 2), 8: (2, 2), 16: (2, 2), 32: (2, 2)}
OVERRUN = 1.5
OVERRUN_DEPTHS = (4, 8)
EVALS_PER_RUN = 10  # validations (without draining) at every STEPS/EVALS_PER_RUN steps


@dataclass(frozen=True)
class Model:
    """The sweep's GPT-2: ``n_layer = P`` (one block per stage), byte tokens, the benchmark's data split."""

    n_embd: int = 32
    n_head: int = 4
    seq_len: int = 32
    micro_batch_size: int = 2
    val_micro_batches: int = 32
    betas: tuple = (0.9, 0.999)
    weight_decay: float = 0.0


MODEL = Model()


def micro_batch_counts(stages: int) -> tuple:
    return (stages // 2, stages, 2 * stages)


# -- window rules: (P, M, stage) -> a -------------------------------------------------------------------
def _uniform(fn):
    return lambda P, M: [fn(P, M)] * P


#: The issue's fixed windows: "best fixed a" of a cell is the best of these.
FIXED_RULES = {
    "a=M": _uniform(lambda P, M: M),
    "a=P-1": _uniform(lambda P, M: P - 1),
    "a=max(M,P-1)": _uniform(lambda P, M: max(M, P - 1)),
    "a=2max(M,P-1)": _uniform(lambda P, M: 2 * max(M, P - 1)),
}
#: Per-stage rules (a_s at stage s) run next to them: the smallest window with drift <= 1 at each stage, floored
#: at M; the same floored at min(M, P-1) only (the rule "auto" is now in every sweep cell: its guard ceil(M/3) of
#: ds_paci.core.config.auto_window binds in none); and the "auto" of the first sweep runs, floored at ceil(M/2).
CANDIDATE_RULES = {
    "a_s=max(M,P-1-s)": lambda P, M: [max(M, P - 1 - s, 1) for s in range(P)],
    "a_s=max(min(M,P-1),P-1-s)": lambda P, M: [max(min(M, P - 1), P - 1 - s, 1) for s in range(P)],
    "a_s=max(min(M,P-1),P-1-s,M/2)": lambda P, M: [max(min(M, P - 1), P - 1 - s, -(-M // 2), 1) for s in range(P)],
}
ALL_RULES = {**FIXED_RULES, **CANDIDATE_RULES}


#: Plain PACI's window in the sweep (the "auto" of the issue: fixed, so that a new "auto" does not re-plan it).
PACI_RULE = "a=max(M,P-1)"


def auto_windows(stages: int, micro_batches: int) -> list:
    """The engine's ``"accumulation_window": "auto"`` at every stage (:func:`ds_paci.core.config.auto_window`)."""
    return [auto_window(stages, micro_batches, stage) for stage in range(stages)]


def rule_windows(rule: str, stages: int, micro_batches: int) -> list:
    """Per-stage windows of a named rule: ``"auto"`` or a key of :data:`ALL_RULES`."""
    if rule == "auto":
        return auto_windows(stages, micro_batches)
    return ALL_RULES[rule](stages, micro_batches)


def window_label(windows) -> str:
    """``"7"`` for a uniform window, ``"7,6,5,4,4,4,4,4"`` per stage otherwise."""
    return str(windows[0]) if len(set(windows)) == 1 else ",".join(str(a) for a in windows)


@dataclass(frozen=True)
class SweepRun:
    """One replay of the sweep (see the module docstring)."""

    stages: int
    micro_batches: int
    engine: str  # "stock", "paci" or "lookahead"
    windows: tuple
    lr: float
    seed: int
    data_seed: int
    steps: int  # train_batch calls
    common_steps: int  # the depth's step count: the final loss compared between engines is read here
    optimizer: str = "adamw"
    step_phase: str = "aligned"  # the engine's paci.step_phase (in the key only when not "aligned")

    def key(self) -> str:
        phase = "" if self.step_phase == "aligned" else f" phase={self.step_phase}"
        return (f"P={self.stages} M={self.micro_batches} engine={self.engine} a={window_label(self.windows)} "
                f"lr={self.lr:g} seed={self.seed} steps={self.steps} opt={self.optimizer}{phase}")

    @property
    def eval_every(self) -> int:
        return max(1, self.common_steps // EVALS_PER_RUN)

    def as_dict(self) -> dict:
        return {**asdict(self), "windows": list(self.windows), "key": self.key()}


def make_run(stages, micro_batches, engine, windows, lr, seed_pair, overrun=False, optimizer="adamw") -> SweepRun:
    common = STEPS[stages]
    steps = int(math.ceil(OVERRUN * common)) if overrun else common
    if engine == "stock":
        windows = [micro_batches] * stages
    return SweepRun(stages, micro_batches, engine, tuple(windows), float(lr), seed_pair[0], seed_pair[1], steps,
                    common, optimizer)


def lr_sweep_runs(stages: int) -> list:
    """Phase 1 of a depth: stock at ``M = P`` over :data:`SWEEP_LRS`, first seed."""
    return [make_run(stages, stages, "stock", None, lr, SEEDS[0]) for lr in SWEEP_LRS]


def best_lr(results: dict, stages: int):
    """The phase-1 learning rate with the lowest final loss, or ``None`` while phase 1 of ``stages`` is incomplete."""
    finals = {}
    for run in lr_sweep_runs(stages):
        done = results.get(run.key())
        if done is None:
            return None
        finals[run.lr] = done["final"]
    return min(finals, key=finals.get)


def cell_lrs(results: dict, stages: int):
    """The two learning rates of a depth (``best``, ``best / 3``) or ``None`` before phase 1 is done."""
    best = best_lr(results, stages)
    return None if best is None else (best, best / 3)


def cell_runs(stages: int, micro_batches: int, lr: float, optimizer: str = "adamw", seeds=SEEDS) -> list:
    """Phase-2 runs of one cell (depth, micro-batches, learning rate), in run order."""
    overrun = stages in OVERRUN_DEPTHS
    auto = auto_windows(stages, micro_batches)
    runs = []
    paci = rule_windows(PACI_RULE, stages, micro_batches)
    for pair in seeds:
        runs.append(make_run(stages, micro_batches, "stock", None, lr, pair, optimizer=optimizer))
        runs.append(make_run(stages, micro_batches, "paci", paci, lr, pair, overrun=overrun, optimizer=optimizer))
        runs.append(make_run(stages, micro_batches, "lookahead", auto, lr, pair, overrun=overrun, optimizer=optimizer))
    seen = {tuple(auto)}
    for rule in ALL_RULES:
        windows = tuple(rule_windows(rule, stages, micro_batches))
        if windows not in seen:
            seen.add(windows)
            runs.append(make_run(stages, micro_batches, "lookahead", windows, lr, SEEDS[0], optimizer=optimizer))
    return runs


#: Run order of phase 2, by (learning rate index, second seed): the first seed at the best learning rate (every
#: window), the Muon cells (tier 2), the second seed at the best learning rate (stock, PACI, "auto"), the first
#: seed at the other learning rate (every window), its second seed.
_TIERS = {(0, False): 1, (0, True): 3, (1, False): 4, (1, True): 5}


def sweep_plan(results: dict, depths=DEPTHS, coverage=None) -> list:
    """Every run that can start now (phase 1 always; phase 2 of a depth once its phase 1 is in ``results``),
    in priority order: phase 1, then the tiers of :data:`_TIERS`, shallow depths first within a tier."""
    coverage = coverage or COVERAGE
    plan = []
    for stages in depths:
        plan += [(0, stages, run) for run in lr_sweep_runs(stages)]
        lrs = cell_lrs(results, stages)
        if lrs is None:
            continue
        n_seeds, n_lrs = coverage[stages]
        for i, lr in enumerate(lrs[:n_lrs]):
            for micro_batches in micro_batch_counts(stages):
                for run in cell_runs(stages, micro_batches, lr, seeds=SEEDS[:n_seeds]):
                    second_seed = run.seed != SEEDS[0][0]
                    plan.append((_TIERS[(i, second_seed)], stages, run))
        if stages in MUON_DEPTHS:
            plan += [(2, stages, run) for run in muon_runs(stages, lrs[0])]
    unique = {}
    for tier, stages, run in sorted(plan, key=lambda x: (x[0], x[1])):
        if _trained_longer(run).key() not in results:  # the same run trained past the common steps counts too
            unique.setdefault(run.key(), run)
    return list(unique.values())


def _trained_longer(run: SweepRun) -> SweepRun:
    steps = int(math.ceil(OVERRUN * run.common_steps)) if run.steps == run.common_steps else run.common_steps
    return dataclasses.replace(run, steps=steps)


MUON_DEPTHS = (8, )


def muon_runs(stages: int, lr: float) -> list:
    """The Muon cells (torch.optim.Muon on the blocks' matrices, AdamW on the rest; ``adjust_lr_fn =
    "match_rms_adamw"``, so the AdamW learning rates carry over): stock, plain PACI and PACI + look-ahead with
    the ``"auto"`` window, first seed, at the best AdamW learning rate."""
    runs = []
    for M in micro_batch_counts(stages):
        runs.append(make_run(stages, M, "stock", None, lr, SEEDS[0], optimizer="muon"))
        runs.append(make_run(stages, M, "paci", rule_windows(PACI_RULE, stages, M), lr, SEEDS[0], optimizer="muon"))
        runs.append(make_run(stages, M, "lookahead", auto_windows(stages, M), lr, SEEDS[0], optimizer="muon"))
    return runs


#: The spot cells of the step-phase comparison (issue 27): P = 8, M in {4, 8, 16}, both learning rates, first seed.
PHASE_SPOT = {"stages": 8, "lrs": (3e-3, 1e-3)}


def phase_spot_runs() -> list:
    """PACI + look-ahead with the ``"auto"`` window in the spot cells, ``"aligned"`` and ``"diagonal"`` each, the
    common step count (a closing drain at the end, as the sweep's runs read their final loss)."""
    P = PHASE_SPOT["stages"]
    runs = []
    for lr in PHASE_SPOT["lrs"]:
        for M in micro_batch_counts(P):
            for phase in ("aligned", "diagonal"):
                run = make_run(P, M, "lookahead", auto_windows(P, M), lr, SEEDS[0])
                runs.append(dataclasses.replace(run, step_phase=phase))
    return runs


def run_cost(run: SweepRun) -> float:
    """Relative cost of a run (micro-batch x layer passes), for ordering and estimates."""
    return run.steps * run.micro_batches * (run.stages + 1.5)
