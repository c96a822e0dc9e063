"""Tied weights across pipeline stages under PACI: the owners exchange window gradients point to point.

A ``TiedLayerSpec`` key whose layers sit on several stages (GPT-2's token embedding on the first
stage and its LM head on the last) gives every owning stage its own copy of the tied parameters.
DeepSpeed keeps them equal with a blocking all-reduce of their gradients at every step, a
collective spanning those stages, which PACI never runs (it deadlocks against the blocking
point-to-point transfers of stages that step at different ticks). The policy here:

* **Exchange.** At its local step producing window ``k`` (windows are numbered by weight version;
  a drain that closes the window applies everything, so counting restarts there in effect) every
  owner posts its window-``k`` tied gradient to the other owners with
  ``isend``/``irecv`` on a dedicated process group (one per set of owner ranks, created at
  construction on every rank in the same order; never the group the pipeline's own transfers
  use), together with one **finite flag**: whether its whole window-``k`` gradient (its own
  non-tied part and its tied contribution) was finite. It then applies the **total of window**
  ``k - L``: the sum over all owners, added in stage order, so every owner computes the same bits.
  When no window ``k - L`` is pending (the first ``L`` steps of the run, or after a drain that
  applied everything) the total is zero. ``L`` is :func:`~ds_paci.core.program.tied_timing.tied_lag`: the
  smallest lag for which the pipeline's own data dependencies guarantee that the peers'
  window-``k - L`` messages have been posted before an owner needs them, so the wait is transport
  latency only, never a wait on another stage (the watchdog names it if it ever hangs).
* **One verdict for all owners.** The total of a window is applied only if every owner's flag says
  finite and the total itself is finite; the inputs are identical on every owner, so is the verdict.
  Otherwise every owner skips that window's tied update, and applies (or skips) its own non-tied
  gradient by its own verdict, independently: :class:`~ds_paci.core.tied.optimizer.TiedOptimizer`
  keeps the two parts of the step apart on every optimizer path, so that Adam's state and step
  counters and the copies stay bit-identical through skips. A local step with either part skipped
  counts as skipped (``was_step_applied()`` False, the guard's count); ``paci_stats()["tied"]``
  counts the skipped windows. The flag is part of the window's message, so it travels wherever the
  window goes: across a drain that carries it, and into a checkpoint (:mod:`ds_paci.core.step.window_state`).
* **Clipping** (``gradient_clipping`` = ``c`` > 0). Each stage clips its own non-tied gradient by its
  own norm (:mod:`ds_paci.core.step.local_step`); the tied total of a window, a clipping unit of its own,
  is scaled by ``min(1, c / (||total|| + 1e-6))`` (DeepSpeed's formula), computed from the total, so
  every owner scales it by the same factor. DeepSpeed instead scales everything by one factor from
  the norm over all stages. Verdict and factor are functions of the window's messages only, never of
  when the window is applied, so a carried or checkpointed window gets the same treatment.
* **Staleness.** The tied parameters are updated with gradients ``L`` windows (``L`` local steps)
  older than the rest of the model, on every owner alike; ``paci_stats()["tied"]`` reports ``L``.
* **Transfers: NCCL-safe and bounded.** NCCL matches the point-to-point operations of a pair of
  ranks in the order they are issued (it ignores tags), runs each ungrouped ``isend``/``irecv`` as a
  kernel on the stream of the pair's communicator (or of the group's, in newer torch), and that
  kernel completes only once its counterpart on the peer has run. If both owners issued "receive,
  then send", each receive would wait for a send queued behind the other's receive: a deadlock.
  So every owner walks its peers in ascending rank order and, with each, the lower rank sends first
  and receives second, the higher rank the reverse (:func:`posting_order`): the two members of a
  pair issue complementary operations in the same order, and every rank issues its exchanges in one
  global order (window, then pair by ranks), so the earliest unfinished exchange always has both of
  its operations at the head of the two streams: no deadlock with one stream per pair or per group.
  ``batch_isend_irecv`` would also do, but its first call on a group must involve all of the
  group's ranks, a collective in all but name; a gloo group would copy the tied gradient to the host
  at every step. Each owner pair's communicator gets its first transfer while the engine is built
  (:mod:`ds_paci.core.engine.first_exchange`): created lazily at the first post instead, it would block the
  last stage's host until stage 0 posts, while stage 0 waits for a gradient the last stage sends later.
  Memory: a send of window ``v`` is matched by the peer's receive posted at its step
  ``v``, which the lag guarantees has happened before this owner's step ``v + L``; there every owner
  waits on its sends of windows ``<= v`` (at once on a completed transfer; gloo frees a send only once
  waited on), so at most ``L + 1`` sends per peer are ever pending.
* **Data parallel.** The exchange pairs replicas with the same data-parallel (and tensor-parallel)
  coordinate, like DeepSpeed's tied groups. The tied gradients are first reduced within each
  stage's data-parallel group, then exchanged, so every replica of every owner holds the same
  total: with torch.optim/DeepSpeed's fp32 optimizer and ``BF16_Optimizer`` (fp32 ``_hp_grad``)
  the engine's own reduce runs first and the exchange follows it. DeepSpeed's ZeRO-1 optimizer
  leaves each replica only its partition of the reduced gradient, and the two stages partition the
  tied parameter at different offsets, so there the tied gradients (and the finite flag) are
  averaged over the stage's data-parallel group here first (an extra within-stage all-reduce of the
  tied parameters only); ZeRO's own reduce then carries zeros for them.
* **Drain.** Each owner's last local step of a segment runs after the drain's last tick (the pass
  :func:`~ds_paci.core.program.passes.defer_tied_last_step` puts it there; nothing on that stage reads the weights in between): there every owner posts its last window, waits for
  the peers' (all owners have posted by then). What it applies depends on the drain:

  - A drain that **closes** the accumulation window (``drain()``: the end of training, a change of
    the batch size) applies the totals of every window not yet applied (each with its own verdict
    and factor), summed in window order, and waits on every send: nothing stays pending.
  - A drain that **carries** the window (evaluation, checkpoints; ``drain(close_window=False)``)
    applies only what a normal step applies: the last ``L`` windows stay pending into the next
    segment, so the tied weights see the same windows at the same steps however often the run is
    drained (and ``L + 1`` sends per peer stays the bound). The step is deferred there only when it
    closes the segment's last micro-batch: with backward passes after it, the streams' own
    dependencies cover its wait (the lag rule of :mod:`~ds_paci.core.program.tied_timing` holds for every
    step that has a later micro-batch in its segment, whatever the carried fill), and deferring it
    would let those backward passes join the window it steps.

  At the end of a carrying drain, or of a closing drain without a step of its own (``drain()``
  right after an evaluation), every owner waits for the pending receives (all posted by then) and
  on all its sends (:meth:`TiedWeights._settle`): nothing is in flight across a drain. A checkpoint
  then keeps the pending windows, flags included (:mod:`ds_paci.core.step.window_state`), and a resume
  applies them at the same steps with the same verdicts; DeepSpeed saves the tied module once, from
  the first owner, and broadcasts it on load; each stage's optimizer state, identical across owners,
  is saved per stage as usual. Sync mode with ``a = M`` is the stock engine and uses DeepSpeed's own
  ``ReduceTiedGrads`` (a synchronous all-reduce at a synchronization point).
* **Check.** With ``"paci": {"check_tied_copies": true}`` the owners compare digests of their
  copies (weights and optimizer state) after every drain and after loading a checkpoint, through
  the same point-to-point exchange, and raise :class:`TiedCopiesDiverged` naming the key, the
  stages and what differs.

Unsupported (refused at construction by :func:`tied_arrangement_problem`): DeepSpeed's ZeRO optimizer
with optimizer offload (its gradients live in a separate accumulation attribute).
"""

import functools
import hashlib
import time
from collections import deque

import torch
import torch.distributed as tdist

from ..seam import deepspeed_internals as ds
from ..program.actions import Kind
from .layout import tied_arrangement_problem, tied_owner_stages, zero_offload_device  # noqa: F401 (public)
from .transport import Exchange, Received, post_ordered, posting_order  # noqa: F401 (public)
from .optimizer import TiedOptimizer
from ..program.tied_timing import tied_lag

__all__ = ["TiedWeights", "TiedCopiesDiverged", "tied_owner_stages", "tied_arrangement_problem", "posting_order",
           "zero_offload_device"]

_VERIFY_TAG = 1 << 30  # tags of the copy check; window exchanges use the weight version (< 2**30)


class TiedCopiesDiverged(RuntimeError):
    """The copies of a tied parameter differ between owning stages (raised by the copy check)."""


class TiedWeights:
    """Engine side of the tied-weight policy for one rank (see the module docstring).

    Built by :meth:`create` in the engine's constructor on every rank (it creates process groups).
    Hooks: :meth:`expect` takes the program's ``TPOST``/``TAPPLY`` actions before a step
    (:func:`ds_paci.core.program.passes.add_tied_exchange` places them, the owner's last step of a drain
    already moved after it by :func:`~ds_paci.core.program.passes.defer_tied_last_step`);
    :meth:`reduce_grads` replaces the engine's data-parallel reduce in a local step and runs what they
    say; :meth:`step` its optimizer part on an owner; :meth:`finish_drain` after a drain's program;
    :meth:`pending_windows` for the next call's pass; :meth:`verify` compares the copies;
    :meth:`stats` for ``paci_stats()``.
    """

    @classmethod
    def create(cls, ctx):
        """``None`` when no tied key spans two stages (the same answer on every rank)."""
        owners = tied_owner_stages(ctx.module)
        if not owners:
            return None
        return cls(ctx, owners)

    def __init__(self, ctx, owners):
        self.ctx = ctx
        self.owners = owners
        self.check = ctx.paci.check_tied_copies
        module, grid = ctx.module, ctx.grid
        rank = ctx.global_rank
        tp = grid.get_slice_parallel_world_size()
        groups = {}
        mine = {}
        for key, stages in owners.items():
            for dp in range(grid.data_parallel_size):
                for mp in range(tp):
                    ranks = tuple(
                        grid.stage_to_global(stage_id=s, data=dp, model=mp) if tp > 1 else grid.
                        stage_to_global(stage_id=s, data=dp) for s in stages)
                    if ranks not in groups:  # every rank creates every group, in this order
                        groups[ranks] = tdist.new_group(list(ranks))
                    if rank in ranks:
                        mine.setdefault(ranks, (tuple(stages), []))[1].append(key)
        self.exchanges = []
        for ranks, (stages, keys) in mine.items():
            params = [
                functools.reduce(getattr, attr.split("."), ds.tied_modules(module)[key]) for key in keys
                for attr in ds.tied_weight_attrs(module)[key]
            ]
            self.exchanges.append(Exchange(ranks, stages, groups[ranks], keys, params, rank))
        self.optimizer = TiedOptimizer(ctx, [p for ex in self.exchanges for p in ex.params])
        if not ctx.stock_step:
            # DeepSpeed marks the later owners' tied modules (all their parameters, tied or not) as replicated so
            # that its global norm counts them once. Async norms are stage-local and see zeros for the tied
            # weights (TiedOptimizer.clear): a later owner must count its own non-tied parameters too.
            for p in module.parameters():
                if ds.pipe_replicated(p):
                    ds.set_pipe_replicated(p, False)
        self.mode = self.optimizer.mode
        self._totals = None  # {id(param): total or None}, from reduce_grads for step
        self._plan = {}  # the program's TPOST/TAPPLY facts for the next step (set by expect)
        self._last_lag = None  # the lag of the previous step (set_train_batch_size may change it)
        self.windows_exchanged = 0
        self.skipped_windows = 0
        self.clipped_windows = 0
        self.max_pending_sends = 0
        self.max_pending_receives = 0
        self.wait_seconds = 0.0
        self.max_wait_seconds = 0.0
        self.drain_wait_seconds = 0.0
        self.checks = 0

    @property
    def lag(self):
        """``L`` for the current window (``set_train_batch_size`` may change a defaulted window; it drains first)."""
        return self.lag_for(self.ctx.accumulation_window)

    def lag_for(self, window):
        """``L`` for accumulation window ``window`` (a checkpoint's, on load)."""
        return max(tied_lag(self.ctx.num_stages, stages, window) for stages in self.owners.values())

    # -- the exchange ----------------------------------------------------------------------
    def _message(self, ex, stage_finite):
        """This owner's window message: its tied gradient (DP-averaged under ZeRO) and its finite flag."""
        own = self.optimizer.read(ex.params)
        ctx = self.ctx
        if self.mode == "zero":
            own = torch.cat([own, own.new_tensor([0.0 if stage_finite else 1.0])])
            if ctx.dp_world_size > 1:  # the flag rides along: any replica's non-finite gradient counts
                tdist.all_reduce(own, group=ctx.grid.get_data_parallel_group())
                own.div_(ctx.dp_world_size)
            stage_finite = bool(own[-1] == 0)
            own = own[:-1]
        finite = stage_finite and bool(torch.isfinite(own).all())
        return torch.cat([own, own.new_tensor([1.0 if finite else 0.0])])

    def _post(self, ex, version, message):
        buffers = {r: torch.empty_like(message) for r in ex.peers}
        works = post_ordered(self.ctx.global_rank, ex.peers, message, buffers, ex.group, version)
        for r, (send, recv) in works.items():
            ex.sends[r].append((version, send, message))
        self.max_pending_sends = max([self.max_pending_sends] + [len(q) for q in ex.sends.values()])
        ex.pending[version] = {"own": message, "recv": {r: (works[r][1], buffers[r]) for r in ex.peers}}
        self.max_pending_receives = max(self.max_pending_receives, self._pending_receives())

    def _wait(self, work, what, in_drain):
        watchdog = self.ctx.watchdog
        watchdog.note(what)
        start = time.perf_counter()
        work.wait()
        waited = time.perf_counter() - start
        watchdog.note(None)
        if in_drain:
            self.drain_wait_seconds += waited
        else:
            self.wait_seconds += waited
            self.max_wait_seconds = max(self.max_wait_seconds, waited)

    def _window_total(self, ex, version, in_drain):
        """The owners' total of window ``version`` (in stage order) and the agreed verdict: total, or ``None``."""
        entry = ex.pending.pop(version)
        total, finite = None, True
        for r, stage in zip(ex.ranks, ex.stages):
            if r == self.ctx.global_rank:
                message = entry["own"]
            else:
                work, message = entry["recv"][r]
                self._wait(work, f"waiting for the tied gradients of weight version {version} (keys {ex.keys}) from "
                           f"rank {r} (stage {stage}) on the tied-weight process group", in_drain)
            finite = finite and bool(message[-1] == 1.0)
            total = message[:-1].clone() if total is None else total.add_(message[:-1])
        self.windows_exchanged += 1
        if not (finite and bool(torch.isfinite(total).all())):
            self.skipped_windows += 1
            return None
        clip = self.ctx.gradient_clipping()
        if clip > 0:
            coef = float(clip) / (float(torch.linalg.vector_norm(total)) + 1e-6)
            if coef < 1.0:
                total.mul_(coef)
                self.clipped_windows += 1
        return total

    def _reap_sends(self, ex, version, final, in_drain):
        """Wait on the sends the peers have certainly received by now (window ``<= version - L``), or on all."""
        for r, queue in ex.sends.items():
            while queue and (final or queue[0][0] <= version - self.lag):
                v, work, _ = queue.popleft()
                self._wait(work, f"waiting for rank {r} to take this rank's tied gradients of weight version {v} "
                           f"(keys {ex.keys})", in_drain=in_drain)

    def _due_total(self, ex, version, final, in_drain, planned):
        """The total this step applies for ``ex`` (zeros when nothing is due yet), or ``None`` when skipped.

        ``planned``: the windows the program's ``TAPPLY`` names; this rank's own pending windows must agree."""
        lag = self.lag
        due = sorted(ex.pending) if final else [v for v in sorted(ex.pending) if v <= version - lag]
        if tuple(due) != tuple(planned):
            raise RuntimeError(f"tied exchange out of step: the program applies windows {list(planned)} at version "
                               f"{version}, this rank has {due} due (pending {sorted(ex.pending)})")
        # one window per step (all at a closing drain); after the lag shrank (set_train_batch_size, through a
        # closing drain with no step of its own) the first step catches up on the windows the old lag held back
        extra = max(0, (self._last_lag or lag) - lag)
        if len(due) > (lag + 1 if final else 1) + extra:
            raise RuntimeError(f"tied exchange out of step: windows {due} pending at version {version}")
        if not due:  # the first L steps of the run (or after a drain that applied everything)
            return torch.zeros(ex.numel, dtype=torch.float32, device=ex.device)
        applied = None
        for v in due:
            t = self._window_total(ex, v, in_drain=in_drain)
            if t is not None:
                applied = t if applied is None else applied.add_(t)
        return applied

    # -- hooks -------------------------------------------------------------------------------
    def expect(self, action):
        """Take a ``TPOST``/``TAPPLY`` action of the program: what the next local step posts and applies."""
        if action.kind is Kind.TIED_POST:
            self._plan = {"post": action.version, "apply": (), "all": False, "in_drain": action.in_drain}
        else:
            self._plan.update(apply=action.windows, all=action.apply_all)

    def reduce_grads(self, version, dp_reduce=None):
        """The data-parallel reduce of a local step producing ``version``, with the tied exchange around it.

        ``dp_reduce``: runs the data-parallel reduce (default DeepSpeed's ``ReduceGrads``; the engine's overlapped
        one waits for the buckets its last backward launched). The tied exchange always follows it."""
        if dp_reduce is None:
            dp_reduce = lambda: ds.exec_reduce_grads(self.ctx.engine)  # noqa: E731
        ctx = self.ctx
        plan, self._plan = self._plan, {}
        if self.exchanges and plan.get("post") != version:
            raise RuntimeError(f"tied exchange out of step: local step {version} without its TPOST{version} "
                               f"(the program posts {plan.get('post')})")
        deferred = plan.get("in_drain", False)  # the last step of a drain, after every owner has posted
        final = plan.get("all", False)  # the step that applies every window not yet applied
        if self.mode != "zero" or not self.exchanges:
            dp_reduce()
        if not self.exchanges:
            return
        stage_finite = self.optimizer.stage_gradient_finite()
        self._totals = {}
        for ex in self.exchanges:
            self._post(ex, version, self._message(ex, stage_finite))
            self.optimizer.clear(ex.params)
            total = self._due_total(ex, version, final, deferred, plan["apply"])
            offset = 0
            for p in ex.params:
                self._totals[id(p)] = None if total is None else total[offset:offset + p.numel()]
                offset += p.numel()
            self._reap_sends(ex, version, final, deferred)
        if self.mode == "zero":
            dp_reduce()
        self._last_lag = self.lag

    def step(self):
        """An owner's optimizer part of the local step (after :meth:`reduce_grads`); True if nothing was skipped."""
        totals, self._totals = self._totals, None
        stage_applied, tied_applied = self.optimizer.step(totals)
        applied = stage_applied and tied_applied
        ds.set_step_applied(self.ctx.engine, applied)
        return applied

    def pending_windows(self):
        """The windows posted and not yet applied (the same on every exchange): the next call's pass starts there."""
        return sorted(self.exchanges[0].pending) if self.exchanges else []

    def finish_drain(self, carry, stepped):
        """After a drain's program: settle what stays pending, or check nothing does; then compare the copies.

        ``carry``: the drain left the window open (pending windows stay for the next segment); ``stepped``: the
        owner's last step of the drain ran after it (``in_drain``) and applied every pending window.
        """
        try:
            if carry or not stepped:  # nothing to apply them with: they stay pending for the next step
                self._settle()
            else:
                leftover = [v for ex in self.exchanges for v in ex.pending]
                if leftover:
                    raise RuntimeError(f"tied gradients of versions {leftover} were not applied at the drain")
            if self.check:
                self.verify("after a drain")
        finally:
            self._plan = {}

    def _settle(self):
        """At the end of a drain that leaves windows pending: wait for their receives (every owner posted them
        before the drain's end) and on every send, so nothing is in flight across the drain."""
        watchdog = self.ctx.watchdog
        watchdog.enter("the tied exchange at the end of a drain", self.ctx.ticks_emitted())
        for ex in self.exchanges:
            for version, entry in sorted(ex.pending.items()):
                for r, (work, message) in list(entry["recv"].items()):
                    if isinstance(work, Received):
                        continue
                    self._wait(work, f"waiting for the tied gradients of weight version {version} (keys {ex.keys}) "
                               f"from rank {r} at the end of a drain", in_drain=True)
                    entry["recv"][r] = (Received(), message)  # a gloo receive must not be waited for twice
            self._reap_sends(ex, None, final=True, in_drain=True)
        watchdog.idle()

    def load_pending(self, pending, lag=None):
        """Replace every exchange's pending windows by ``pending`` (one ``{version: {"own": message, "recv":
        {rank: message}}}`` per exchange, as :mod:`ds_paci.core.step.window_state` restores them; ``None``: none),
        posted under lag ``lag``: where the current lag is smaller (a checkpoint resumed with a larger window), the
        first step catches up on the windows the old lag held back, as after ``set_train_batch_size``."""
        self._last_lag = lag if pending else None
        for n, ex in enumerate(self.exchanges):
            ex.pending = {}
            ex.sends = {r: deque() for r in ex.peers}
            for version, entry in ((pending or [{}] * len(self.exchanges))[n]).items():
                ex.pending[int(version)] = {"own": entry["own"].to(ex.device),
                                            "recv": {r: (Received(), m.to(ex.device)) for r, m in entry["recv"].items()}}

    # -- the copy check --------------------------------------------------------------------------
    def snapshot(self):
        """``{name: fp32 CPU tensor}`` of this rank's tied parameters and their optimizer state.

        Under BF16_Optimizer and ZeRO the fp32 master and state are gathered over the stage's
        data-parallel group (a within-stage collective: every replica must call this together).
        """
        out = {}
        for ex in self.exchanges:
            for n, p in enumerate(ex.params):
                name = f"{'+'.join(ex.keys)}.{n}"
                out[f"{name}.weight"] = p.detach().float().cpu().clone()
                for state_key, value in self.optimizer.state_of(p).items():
                    out[f"{name}.{state_key}"] = value
        return out

    def verify(self, when):
        """Compare digests of the copies with every peer owner (point to point); raise if any differs."""
        snap = self.snapshot()
        me = self.ctx.global_rank
        for ex in self.exchanges:
            prefix = f"{'+'.join(ex.keys)}."
            weights = _digest({k: v for k, v in snap.items() if k.startswith(prefix) and k.endswith(".weight")})
            state = _digest({k: v for k, v in snap.items() if k.startswith(prefix) and not k.endswith(".weight")})
            mine = torch.tensor(weights + state, dtype=torch.int64, device=ex.device)
            theirs = {r: torch.empty_like(mine) for r in ex.peers}
            works = post_ordered(me, ex.peers, mine, theirs, ex.group, _VERIFY_TAG)
            self.ctx.watchdog.note(f"comparing the tied copies {ex.keys} with ranks {list(ex.ranks)}")
            for send, recv in works.values():
                recv.wait()
                send.wait()
            self.ctx.watchdog.note(None)
            for r, other in theirs.items():
                what = [name for name, sl in (("weights", slice(0, 4)), ("optimizer state", slice(4, 8)))
                        if not torch.equal(mine[sl], other[sl])]
                if what:
                    stage = ex.stages[ex.ranks.index(r)]
                    raise TiedCopiesDiverged(
                        f"{self.ctx.describe_rank()}: the copies of tied layers {ex.keys} differ from rank {r} "
                        f"(stage {stage}) {when}: {' and '.join(what)} are not bit-identical")
        self.checks += 1

    def _pending_receives(self):
        """The most receives from one peer posted and not yet waited for (restored or settled ones excluded)."""
        counts = [sum(1 for entry in ex.pending.values() if not isinstance(entry["recv"][r][0], Received))
                  for ex in self.exchanges for r in ex.peers]
        return max([0] + counts)

    def stats(self):
        """Telemetry for ``paci_stats()['tied']``.

        Transfers in flight (read-only; the module docstring bounds each by ``L + 1`` per peer):
        ``pending_sends`` / ``pending_receives`` are the most sends / receives to or from one peer posted and not
        yet waited on now, ``max_pending_sends`` / ``max_pending_receives`` the most since construction
        (counted right after each post, before the step waits).
        """
        return {
            "keys": sorted(self.owners),
            "owner_stages": {k: list(v) for k, v in self.owners.items()},
            "owner": bool(self.exchanges),
            "lag_windows": self.lag,
            "gradient_path": self.mode,
            "pending_windows": sorted({v for ex in self.exchanges for v in ex.pending}),
            "pending_sends": max([0] + [len(q) for ex in self.exchanges for q in ex.sends.values()]),
            "max_pending_sends": self.max_pending_sends,
            "pending_receives": self._pending_receives(),
            "max_pending_receives": self.max_pending_receives,
            "windows_exchanged": self.windows_exchanged,
            "skipped_windows": self.skipped_windows,
            "clipped_windows": self.clipped_windows,
            "fault_steps": self.optimizer.fault_steps,
            "wait_seconds": self.wait_seconds,
            "max_wait_seconds": self.max_wait_seconds,
            "drain_wait_seconds": self.drain_wait_seconds,
            "copy_checks": self.checks,
        }


def _digest(tensors):
    """Four int64 words of a BLAKE2b digest over names, shapes and the exact bytes of ``tensors``."""
    h = hashlib.blake2b(digest_size=32)
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.numpy().tobytes())
    raw = h.digest()
    return [int.from_bytes(raw[i:i + 8], "little", signed=True) for i in range(0, 32, 8)]
