"""Single-process replay of PACI streams on the GPT-2 workload: the engine's semantics in one process.

``python -m ds_paci.tools.replay --job main --mode lookahead --lr 1.5e-3`` runs every stage's
:class:`~ds_paci.core.program.stream.PACIStream` tick by tick in one process, with the engine's
semantics: a forward uses the stage's weights current at that moment (with ``--mode
lookahead``, the look-ahead's prediction for forwards the stream tags ``crosses_step``, through
the engine's own :class:`~ds_paci.core.lookahead.predict.LookAhead`); a backward runs through the weights
current at backward time (optimizers step on ``.data`` aliases); each stage takes its own
optimizer step after every ``a`` backward passes (``a`` may differ per stage) and steps its LR
scheduler ``lr_steps`` of the ``STEP`` action times (one per ``M`` micro-batches stepped); the last stage's
loss is scaled as the engine scales it (:func:`last_stage_backward`); streams are drained where
the engine drains (:func:`ENGINE_RULES`), leaving a partial window open as ``eval_batch`` does,
and closed at the end. ``--mode sync`` drains after every batch (the stock
engine's math).

Evidence, not only exploration: ``tests/test_replay_engine.py`` checks that it reproduces the
engine's per-call losses and final weights bit for bit (real engines over gloo at P = 2, 4 and
8, with and without the look-ahead, ``a = M`` and ``a != M``), and it reproduces the stored
engine curves of ``docs/results/lookahead`` (see ``docs/results/quality.md``). Long sweeps
(:mod:`ds_paci.tools.studies.quality`) run on it.

The engine's rules the replay mirrors, each in one place here:

* the last stage's loss scaling: :func:`last_stage_backward` (``compat.last_stage_loss_factor``,
  then DeepSpeed's ``1/M`` on the loss gradient where it divides);
* the LR schedule: :func:`advance_lr_schedule` (the stream's rule: each ``STEP`` action carries
  ``lr_steps``, one scheduler step per ``M`` micro-batches stepped, so the schedule does not
  depend on the window);
* the drain: :meth:`PACIStream.drain <ds_paci.core.program.stream.PACIStream.drain>` itself decides
  what a drain steps (``close_window=False``, as ``eval_batch`` and saves: the partial window
  stays open; ``True`` at the end of training), so the replay follows the stream module;
  where the replay drains is :class:`Evaluation` (``drains=True``: before every validation, as
  the engine's ``eval_batch``; ``False``: validations read the current weights without draining,
  the stream only drains at ``drain_at`` steps and at the end; no engine counterpart, used so
  that frequent validations do not change the training being measured).

Jobs: ``main`` (the default job: 4 blocks x 128, bpe-1024, micro-batch 8 x 128, M = 4, 2 stages,
warm-up + cosine) and the benchmark's shapes ``real_P2_M4``, ``emulated_P4_M4``,
``emulated_P8_M8`` (byte tokens, constant LR, no emulated wait). Prints one JSON line: the
arguments, the validation curve and each stage's look-ahead telemetry.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from ds_paci.core.seam import compat
from ds_paci.core.config import PACIConfig, auto_window
from ds_paci.core.step.local_step import ParamAliases
from ds_paci.core.lookahead.predict import lookahead_for_torch_optimizer
from ds_paci.core.program.actions import Kind
from ds_paci.core.program.interpreter import Handler, run_program
from ds_paci.core.program.stream import PACIStream
from ds_paci.core.program.stream import step_phase as phase_of
from ds_paci.core.program.warm_end import DEFAULT_RATIO
from ds_paci.core.engine.warm_start import label_histogram
from .warm import WarmStart
from ds_paci.workload.gpt2 import Block, lm_loss

MODES = ("sync", "paci", "lookahead")
OPTIMIZERS = ("adamw", "muon")


@dataclass(frozen=True)
class Job:
    """Model, data and pipeline shape of a replay."""

    stages: int
    micro_batches: int
    micro_batch_size: int
    seq_len: int
    n_layer: int
    n_embd: int
    n_head: int
    tokenizer: str
    eval_batches: int
    schedule: str  # "warmup_cosine" (the main job's) or "constant" (the benchmark's)
    main_split: bool  # the main job's document split (launch/train.py) or the benchmark's


JOBS = {
    "main": Job(2, 4, 8, 128, 4, 128, 4, "bpe-1024", 4, "warmup_cosine", True),
    "real_P2_M4": Job(2, 4, 8, 128, 4, 128, 4, "byte", 4, "constant", False),
    "emulated_P4_M4": Job(4, 4, 4, 64, 4, 64, 4, "byte", 4, "constant", False),
    "emulated_P8_M8": Job(8, 8, 4, 64, 8, 64, 4, "byte", 2, "constant", False),
}


@dataclass(frozen=True)
class Evaluation:
    """When the replay validates and drains: ``every`` steps (0: only at the start and the end).

    ``drains``: drain before each validation (the engine's ``eval_batch``: the partial window stays
    open); otherwise validations read the current weights and the stream drains only at ``drain_at``
    steps and at the end. A ``drain_at`` drain closes the partial window, as the engine's ``drain()``
    does (the sweep reads its common-step loss there; runs before the counters rule drained that way).
    """

    every: int = 100
    drains: bool = True
    drain_at: tuple = ()


@dataclass
class ReplayResult:
    """What a replay returns: the validation curve ``[(step, loss), ...]`` (step 0, every ``eval.every``
    steps, the end), per-stage look-ahead telemetry (``None`` where none), the loss each ``train_batch``
    call returns on the engine's last stage (mean of the micro-batches whose forward completed in it;
    ``None`` if none did), the local steps per stage, the windows, and the wall seconds."""

    curve: list
    lookahead: list
    call_losses: list = field(default_factory=list)
    local_steps: list = field(default_factory=list)
    windows: list = field(default_factory=list)
    seconds: float = 0.0
    warm_calls: int = 0


def stage_slices(model: torch.nn.Sequential, stages: int) -> list:
    """``[(start, stop), ...]`` of each stage's layers, split by transformer blocks as ``gpt2_pipeline`` does."""
    blocks = [i for i, m in enumerate(model) if isinstance(m, Block)]
    if len(blocks) % stages:
        raise ValueError(f"{len(blocks)} blocks do not split evenly over {stages} stages")
    per = len(blocks) // stages
    starts = [0] + [blocks[s * per] for s in range(1, stages)] + [len(model)]
    return [(starts[s], starts[s + 1]) for s in range(stages)]


def stage_windows(window, stages: int, micro_batches: int, extra: int = 0, per_stage: bool = False) -> list:
    """Each stage's window: ``None`` (M), an int, ``"auto"`` (:func:`~ds_paci.core.config.auto_window`; ``extra``:
    the slack links it widens for; ``per_stage``: a run with a synchronous warm start) or a sequence of ``stages``
    ints."""
    if window is None:
        return [micro_batches] * stages
    if window == "auto":  # one window on every stage since issue 30, as the engine (per stage after a warm start)
        return [auto_window(stages, micro_batches, s, extra, per_stage) for s in range(stages)]
    if isinstance(window, int):
        return [window] * stages
    windows = [int(a) for a in window]
    if len(windows) != stages or min(windows) < 1:
        raise ValueError(f"per-stage windows {window!r}: need {stages} integers >= 1")
    return windows


# -- the engine's rules, each in one place ------------------------------------------------------------
def last_stage_backward(loss: torch.Tensor, micro_batches: int, window: int) -> None:
    """Backward of the last stage's loss as the engine runs it: ``loss * compat.last_stage_loss_factor`` (only
    when the factor is not 1, as ``_exec_paci_backward``), then DeepSpeed's division of the loss gradient by
    ``M`` (``_backward_prologue_per_tensor``) on the versions that divide (``compat.DS_SCALES_BY_GAS``)."""
    factor = compat.last_stage_loss_factor(micro_batches, window)
    if factor != 1.0:
        loss = loss * factor
    grad = torch.ones_like(loss)
    if compat.DS_SCALES_BY_GAS:
        grad = grad / micro_batches
    loss.backward(grad)


def advance_lr_schedule(scheduler, lr_steps: int) -> None:
    """The LR-schedule rule at a stage's local step: the scheduler steps ``lr_steps`` of the ``STEP`` action times (the
    stream's count of whole ``M`` micro-batches stepped since the last scheduler step), as the engine's
    ``_local_step`` does. Change it here when the engine's counters change."""
    if scheduler is not None:
        for _ in range(lr_steps):
            scheduler.step()


# -- one stage ------------------------------------------------------------------------------------------
def _muon_groups(part):
    """Muon's split: the 2-D weights of transformer blocks, and everything else (AdamW's part)."""
    matrices, rest = [], []
    for module in part:
        for p in module.parameters():
            (matrices if isinstance(module, Block) and p.dim() == 2 else rest).append(p)
    return matrices, rest


def make_optimizers(part, kind, lr, betas, weight_decay) -> list:
    """The torch.optim optimizers of one stage: AdamW, or Muon on block matrices with AdamW on the rest."""
    if kind == "adamw":
        return [torch.optim.AdamW(part.parameters(), lr=lr, betas=betas, eps=1e-8, weight_decay=weight_decay)]
    if kind == "muon":
        matrices, rest = _muon_groups(part)
        out = [torch.optim.Muon(matrices, lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw")] \
            if matrices else []
        if rest:
            out.append(torch.optim.AdamW(rest, lr=lr, betas=betas, eps=1e-8, weight_decay=weight_decay))
        return out
    raise ValueError(f"unknown optimizer {kind!r}; use one of {', '.join(OPTIMIZERS)}")


class _Stage:
    """One stage's layers, optimizers (on ``.data`` aliases), look-aheads, schedulers and stream."""

    def __init__(self, part, stages, stage_id, window, micro_batches, optimizer, lr, betas, weight_decay, restore,
                 scheduler, phase=0, candidate=None, slack=()):
        self.part = part
        self.window = window
        self.stream = PACIStream(stages, stage_id, window, micro_batches, phase, slack)
        self.optimizers = make_optimizers(part, optimizer, lr, betas, weight_decay)
        self.aliases = [ParamAliases(opt) for opt in self.optimizers]
        if candidate is not None and candidate.custom_prediction:
            from .candidates import CandidateLookAhead
            self.lookaheads = [CandidateLookAhead(opt, alias, candidate)
                               for opt, alias in zip(self.optimizers, self.aliases)]
        else:
            self.lookaheads = [lookahead_for_torch_optimizer(opt, alias, restore)
                               for opt, alias in zip(self.optimizers, self.aliases)]
        self.predicts = any(la is not None for la in self.lookaheads)
        self.schedulers = [scheduler(opt) for opt in self.optimizers] if scheduler else [None] * len(self.optimizers)
        self.local_steps = 0

    @contextlib.contextmanager
    def predicted(self, window_fill, open_window=None):
        with contextlib.ExitStack() as stack:
            for la in self.lookaheads:
                if la is not None:
                    stack.enter_context(la.applied(window_fill, open_window or self.window))
            yield

    def local_step(self, lr_steps):
        """The engine's ``_local_step`` for torch.optim optimizers on one process (no reduce, no clipping)."""
        for la, alias, opt in zip(self.lookaheads, self.aliases, self.optimizers):
            if la is not None:
                la.before_step()
            alias.bind_grads()
            opt.step()
            alias.release_grads()
        for p in self.part.parameters():
            p.grad = None
        for sched in self.schedulers:
            advance_lr_schedule(sched, lr_steps)
        for la in self.lookaheads:
            if la is not None:
                la.after_step()
        self.local_steps += 1

    def stats(self):
        found = [la.stats() for la in self.lookaheads if la is not None]
        return found[0] if len(found) == 1 else (found or None)


def _scheduler_factory(schedule, steps, warmup, cos_min_ratio):
    if schedule == "constant":
        return None
    if schedule != "warmup_cosine":
        raise ValueError(f"unknown schedule {schedule!r}; use 'constant' or 'warmup_cosine'")
    from deepspeed.runtime.lr_schedules import WarmupCosineLR
    warm = warmup if warmup < steps else max(1, steps // 10)  # as launch/train.py does
    return lambda opt: WarmupCosineLR(opt, total_num_steps=steps, warmup_num_steps=warm, cos_min_ratio=cos_min_ratio)


class _Math(Handler):
    """The replay's handler of :func:`~ds_paci.core.program.interpreter.run_program`: every local action does its math."""

    def __init__(self, pipeline):
        self.pipeline = pipeline

    def run(self, stage, action, now):
        self.pipeline.run_action(stage, action)


class _Pipeline:
    """Every stage in one process; :meth:`execute` runs ticks in the order the engine's processes would."""

    def __init__(self, stages_, micro_batches, mode, train_iter, device=None, autocast=None):
        self.stages = stages_
        self.micro_batches = micro_batches
        self.mode = mode
        self.train_iter = train_iter
        self.device = device
        self.autocast = autocast
        self.batches, self.outputs, self.inputs, self.grads = {}, {}, {}, {}
        self.total_loss, self.completed = None, 0
        self.label_counts = None  # a list while an "auto" warm start counts the last stage's labels

    def _forward(self, s, m):
        P = len(self.stages)
        x = self.batches[m][0] if s == 0 else self.outputs[(s - 1, m)].detach().requires_grad_(True)
        if s > 0:
            self.inputs[(s, m)] = x
        with _autocast(self.device, self.autocast):
            out = self.stages[s].part(x)
        if s < P - 1:
            return out
        loss = lm_loss(out, self.batches[m][1])
        if self.label_counts is not None:
            self.label_counts.append(label_histogram(self.batches[m][1]))
        self.total_loss = torch.zeros_like(loss) if self.total_loss is None else self.total_loss
        self.total_loss += loss.detach()  # as DeepSpeed's forward adds to total_loss
        self.completed += 1
        return loss

    def _backward(self, s, m):
        P = len(self.stages)
        out = self.outputs.pop((s, m))
        if s == P - 1:
            last_stage_backward(out, self.micro_batches, self.stages[s].window)
            self.batches.pop(m)
        else:
            out.backward(self.grads.pop((s + 1, m)))
        if s > 0:
            self.grads[(s, m)] = self.inputs.pop((s, m)).grad

    def run_action(self, s, action):
        """The math of one action of stage ``s`` (transfers carry nothing here: outputs and gradients are shared)."""
        stage, kind, m = self.stages[s], action.kind, action.micro_batch
        if kind is Kind.LOAD and s == 0:
            x, y = next(self.train_iter)
            self.batches[m] = (x, y) if self.device is None else (x.to(self.device), y.to(self.device))
        elif kind is Kind.FORWARD:
            if self.mode == "lookahead" and action.crosses_step and stage.predicts:
                with stage.predicted(action.window_fill, action.open_window):
                    self.outputs[(s, m)] = self._forward(s, m)
            else:
                self.outputs[(s, m)] = self._forward(s, m)
        elif kind is Kind.BACKWARD:
            self._backward(s, m)
        elif kind is Kind.STEP:
            stage.local_step(action.lr_steps)

    def execute(self, ticks):
        """Run every stage's ``ticks`` on :func:`~ds_paci.core.program.interpreter.run_program`, the engine's semantics:
        a stage's forward runs after its activation arrived, a backward after its gradient did."""
        run = run_program(ticks, _Math(self))
        if not run.ok:
            raise RuntimeError("the replayed streams do not run: " +
                               "; ".join([str(x) for x in run.stuck] + run.mismatches))

    def call_loss(self):
        """The loss the engine's last stage returns for the call just run (``None``: no forward completed)."""
        if self.total_loss is None:
            return None
        value = float(self.total_loss / self.completed)
        self.total_loss, self.completed = None, 0
        return value

    def advance(self):
        self.execute([st.stream.advance(2 * self.micro_batches) for st in self.stages])

    def drain(self, close_window):
        self.execute([st.stream.drain(close_window=close_window) for st in self.stages])


def _autocast(device, dtype):
    """``torch.autocast`` on ``device`` in ``dtype`` (e.g. bf16 on a GPU), or nothing when ``dtype`` is None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device or "cpu").type, dtype=dtype)


def validation_loss(model, val_batches, micro_batches, device=None, autocast=None) -> float:
    """Validation loss as the benchmark measures it on the engine: ``eval_batch`` over ``micro_batches`` at a time
    (DeepSpeed sums the micro-batches' losses and divides by their count), then the mean over the calls."""
    n = micro_batches if len(val_batches) % micro_batches == 0 else len(val_batches)
    move = (lambda t: t) if device is None else (lambda t: t.to(device))
    calls = []
    with torch.no_grad(), _autocast(device, autocast):
        for i in range(0, len(val_batches), n):
            calls.append(float(sum(lm_loss(model(move(x)), move(y)) for x, y in val_batches[i:i + n]) / n))
    return sum(calls) / len(calls)


def _adapt_windows(pipe, adaptive, low, high) -> list:
    """The adaptive candidate's move at a drain: each stage between ``low`` and ``high`` from its prediction error."""
    pipe.drain(close_window=True)  # a window can change only when closed (PACIStream.set_micro_batches)
    pipe.call_loss()
    errors = [st.lookaheads[0].recent_error() if st.lookaheads[0] is not None else None for st in pipe.stages]
    windows = adaptive.windows(low, high, errors)
    for st, a in zip(pipe.stages, windows):
        st.stream.set_micro_batches(pipe.micro_batches, window=a)
        st.window = a
    return windows


def replay(model, stages, micro_batches, train_iter, val_batches, steps, mode="lookahead", window=None, lr=1e-3,
           betas=(0.9, 0.95), weight_decay=0.0, schedule="constant", warmup=20, cos_min_ratio=0.1, eval_every=100,
           restore=None, echo=None, optimizer="adamw", evaluation=None, lr_scales=None, device=None,
           autocast=None, step_phase="aligned", candidate=None, slack_links=(), sync_calls=0,
           warm_ratio=DEFAULT_RATIO) -> ReplayResult:
    """Train ``model`` (an ``nn.Sequential`` of GPT-2 layers) on PACI streams; returns a :class:`ReplayResult`.

    ``mode``: ``sync``, ``paci`` or ``lookahead``. ``window``: see :func:`stage_windows`. ``step_phase``: the
    engine's ``paci.step_phase`` (``"aligned"`` or ``"diagonal"``; sync mode is always aligned); ``slack_links``:
    the engine's ``paci.slack_links`` (sync mode has none). ``sync_calls``: the first ``sync_calls`` calls run
    as sync mode does (stock's schedule, a flush every call, no prediction, every stage at ``lr``), then
    ``mode`` takes over from an empty pipeline (a synchronous warm start; 0: none); ``"auto"``: until
    :class:`~ds_paci.core.program.warm_end.WarmEnd` with ``warm_ratio`` ends it, as the engine's ``"auto"``
    (``ReplayResult.warm_calls``: how many calls were synchronous).
    ``evaluation``: an :class:`Evaluation` (default: every ``eval_every`` steps, draining first, as the
    engine). ``lr_scales``: per-stage factors on ``lr`` (default 1). ``optimizer``: ``adamw`` or ``muon``.
    ``restore``: the look-ahead's restore mode (default: the engine's, ``PACIConfig.lookahead_restore``).
    ``device``: where ``model`` lives (batches are moved there); ``autocast``: a dtype to run forwards in
    (``torch.autocast``, e.g. ``torch.bfloat16`` on a GPU; fp32 master weights and optimizer state).
    ``candidate``: a :class:`~ds_paci.tools.replay.candidates.Candidate` (issue 30's variants: its prediction,
    learning-rate compensation and adaptive windows; its ``window`` is ignored, pass ``window``); ``None``: the
    engine's look-ahead.
    Validation loss: :func:`validation_loss` over ``val_batches``.
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; use one of {', '.join(MODES)}")
    restore = restore or PACIConfig().lookahead_restore  # the engine's default
    evaluation = evaluation or Evaluation(every=eval_every)
    slack = () if mode == "sync" else tuple(slack_links)
    windows = stage_windows(window, stages, micro_batches, len(set(slack)), per_stage=bool(sync_calls))
    scales = list(lr_scales) if lr_scales is not None else [1.0] * stages
    adaptive = candidate.adaptive if candidate is not None and mode == "lookahead" else None
    if adaptive is not None:
        low, high = windows, [max(windows)] * stages
        windows = list(low if adaptive.start == "low" else high)
    if candidate is not None and mode != "sync":
        from .candidates import candidate_lr_factors
        scales = [x * f for x, f in zip(scales, candidate_lr_factors(candidate, windows, micro_batches))]
    scheduler = _scheduler_factory(schedule, steps, warmup, cos_min_ratio)
    parts = [torch.nn.Sequential(*list(model)[lo:hi]) for lo, hi in stage_slices(model, stages)]
    rule = "aligned" if mode == "sync" else step_phase
    pipe = _Pipeline([_Stage(part, stages, s, windows[s], micro_batches, optimizer, lr * scales[s], betas, weight_decay, restore,
                             scheduler, phase_of(rule, s, windows[s]), candidate, slack)
                      for s, part in enumerate(parts)],
                     micro_batches, mode, train_iter, device, autocast)

    def evaluate():
        return validation_loss(model, val_batches, micro_batches, device, autocast)

    warm = WarmStart(pipe, sync_calls if mode != "sync" else 0, warm_ratio, lr, scheduler)
    curve, call_losses = [(0, evaluate())], []
    began = time.time()
    for step in range(1, steps + 1):
        warm.before(step, (mode, windows, rule), scales)
        pipe.advance()
        if pipe.mode == "sync":  # drain_every_batch: inside the call
            pipe.drain(close_window=True)  # a = M: nothing is left open anyway
        call_losses.append(pipe.call_loss())
        warm.after(call_losses[-1])
        if adaptive is not None and step % adaptive.every == 0 and step < steps:
            windows = _adapt_windows(pipe, adaptive, low, high)
        validate = (evaluation.every and step % evaluation.every == 0) or step == steps
        if pipe.mode != "sync" and (step == steps or step in evaluation.drain_at or (validate and evaluation.drains)):
            # the engine's drain(): a call of its own, whose loss is not a train_batch's; as eval_batch it
            # leaves a partial window open, the end of training and drain_at close it (Evaluation)
            pipe.drain(close_window=step == steps or step in evaluation.drain_at)
            pipe.call_loss()
        if validate:
            curve.append((step, evaluate()))
            if echo:
                echo(f"step {step}: validation loss {curve[-1][1]:.4f} ({time.time() - began:.0f} s)")
    return ReplayResult(curve=curve, lookahead=[st.stats() for st in pipe.stages], call_losses=call_losses,
                        local_steps=[st.local_steps for st in pipe.stages], windows=windows,
                        seconds=time.time() - began, warm_calls=warm.calls)


def load_tokens(tokenizer_name: str, main_split: bool):
    """``(train tokens, validation tokens, tokenizer)`` of the corpus, split as the job or the benchmark does."""
    from ds_paci.workload.data import encode_documents, get_tokenizer, load_corpus, split_documents
    docs = load_corpus()
    train_docs, val_docs = split_documents(docs) if main_split else split_documents(docs, val_fraction=0.1, seed=0)
    tokenizer = get_tokenizer(tokenizer_name, train_docs=train_docs)
    return encode_documents(train_docs, tokenizer).long(), encode_documents(val_docs, tokenizer).long(), tokenizer
