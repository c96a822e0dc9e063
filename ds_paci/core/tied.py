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
  use), and replaces its tied gradient by the **total of window** ``k - L``: the sum over all
  owners, added in stage order, so every owner computes the same bits. When no window ``k - L`` is
  pending (the first ``L`` steps, or after a closing drain) the total is zero. ``L`` is :func:`~ds_paci.core.tied_timing.tied_lag`: the smallest lag for which the
  pipeline's own data dependencies guarantee that the peers' window-``k - L`` gradients have been
  posted before an owner needs them, so the wait is transport latency only, never a wait on another
  stage (the watchdog names it if it ever hangs). Every owner then applies the same gradient to the
  same weights with the same optimizer state, so the copies stay bit-identical after every step.
* **Staleness.** The tied parameters are updated with gradients ``L`` windows (``L`` local steps)
  older than the rest of the model, on every owner alike; ``paci_stats()["tied"]`` reports ``L``.
* **Data parallel.** The exchange pairs replicas with the same data-parallel (and tensor-parallel)
  coordinate, like DeepSpeed's tied groups. The tied gradients are first reduced within each
  stage's data-parallel group, then exchanged, so every replica of every owner holds the same
  total: with torch.optim/DeepSpeed's fp32 optimizer and ``BF16_Optimizer`` (fp32 ``_hp_grad``)
  the engine's own reduce runs first and the exchange follows it. DeepSpeed's ZeRO-1 optimizer
  leaves each replica only its partition of the reduced gradient, and the two stages partition the
  tied parameter at different offsets, so there the tied gradients are averaged over the stage's
  data-parallel group here first (an extra within-stage all-reduce of the tied parameters only),
  exchanged, and the optimizer's reduce then averages identical values.
* **Drain.** Each owner's last local step of a segment runs after the drain's last tick (nothing
  on that stage reads the weights in between): there every owner posts its last window, waits for
  the peers' (all owners have posted by then). A drain that closes the accumulation window
  (``drain()``, a change of the batch size) then applies the totals of every window not yet
  applied, summed in window order. A drain that carries the window (evaluation, checkpoints;
  ``begin_drain(..., carry=True)``) applies only what a normal step applies: the last ``L``
  windows stay pending into the next segment, so the tied weights see the same windows at the
  same steps however often the run is drained. The step is deferred there only when it closes
  the segment's last micro-batch: with backward passes after it, the streams' own dependencies
  cover its wait (the lag rule of :mod:`~ds_paci.core.tied_timing` holds for every step that has a
  later micro-batch in its segment, whatever the carried fill), and deferring it would let those
  backward passes join the window it steps. At the end of such a drain every owner waits for the
  pending receives (all posted by then), so nothing is in flight across a drain; a checkpoint then
  keeps the pending windows (:mod:`ds_paci.core.window_state`).
  A drain that closes the window and has a step of its own has exchanged and applied everything
  (a closing drain with no step, e.g. ``drain()`` right after an evaluation, leaves the windows
  pending for the next step, and a checkpoint keeps them). Checkpoints never hold a transfer in
  flight (DeepSpeed saves the tied module once, from the first
  owner, and broadcasts it on load; each stage's optimizer state, identical across owners, is saved
  per stage as usual). In sync mode (``drain_every_batch``) a segment is one window and that
  step uses DeepSpeed's own ``ReduceTiedGrads`` (a synchronous all-reduce at a synchronization
  point), so sync mode is the stock engine exactly.
* **Check.** With ``"paci": {"check_tied_copies": true}`` the owners compare digests of their
  copies (weights and optimizer state) after every drain and after loading a checkpoint, through
  the same point-to-point exchange, and raise :class:`TiedCopiesDiverged` naming the key, the
  stages and what differs.

Unsupported (refused at construction by :func:`tied_arrangement_problem`): stage-local gradient
clipping (``gradient_clipping > 0``), which would scale the copies' gradients by different
coefficients; DeepSpeed's ZeRO optimizer with a separate gradient-accumulation attribute (CPU
offload).
"""

import functools
import hashlib
import time

import torch
import torch.distributed as tdist

from deepspeed.runtime.pipe.schedule import BackwardPass

from .schedule import LocalStep
from .tied_timing import tied_lag

__all__ = ["TiedWeights", "TiedCopiesDiverged", "tied_owner_stages", "tied_arrangement_problem"]

_VERIFY_TAG = 1 << 30  # tags of the copy check; window exchanges use the weight version (< 2**30)


class TiedCopiesDiverged(RuntimeError):
    """The copies of a tied parameter differ between owning stages (raised by the copy check)."""


class Received:
    """A receive that has completed (waited for at a drain, or a pending window restored from a checkpoint)."""

    def wait(self):
        return True

    def is_completed(self):
        return True


def tied_owner_stages(module):
    """``{key: sorted owner stages}`` for the ``TiedLayerSpec`` keys of ``module`` used on two or more stages.

    Reads only the layer specs and the partition, so every rank computes the same answer.
    """
    from deepspeed.runtime.pipe.module import TiedLayerSpec
    parts = module.parts
    stages_of = {}
    for idx, spec in enumerate(module._layer_specs):
        if isinstance(spec, TiedLayerSpec):
            stage = next(s for s in range(module.num_stages) if parts[s] <= idx < parts[s + 1])
            stages_of.setdefault(spec.key, set()).add(stage)
    return {key: sorted(st) for key, st in sorted(stages_of.items()) if len(st) > 1}


def tied_arrangement_problem(ds_config, model):
    """One line naming a tied arrangement PACI cannot keep identical, or ``None`` (same on every rank)."""
    owners = tied_owner_stages(model)
    if not owners:
        return None
    clip = ds_config.get("gradient_clipping", 0.0) or 0.0
    if clip > 0:
        return (f'"gradient_clipping" = {clip} with tied layers {sorted(owners)} on stages '
                f'{sorted({s for st in owners.values() for s in st})}: PACI clips stage-locally, which would scale '
                f"the copies' gradients by different factors and let them drift apart; set \"gradient_clipping\": 0 "
                "or untie the layers")
    return None


class _Exchange:
    """The tied parameters this rank shares with one set of owner ranks, and the windows in flight."""

    def __init__(self, ranks, stages, group, keys, params):
        self.ranks = ranks  # global ranks of the owners, in stage order
        self.stages = stages
        self.group = group
        self.keys = keys
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.device = params[0].device
        self.pending = {}  # version -> {"own": tensor, "recv": {rank: (work, buffer)}}


class TiedWeights:
    """Engine side of the tied-weight policy for one rank (see the module docstring).

    Built by :meth:`create` in the engine's constructor on every rank (it creates process groups).
    Hooks: :meth:`reduce_grads` replaces the engine's data-parallel reduce in a local step;
    :meth:`begin_drain` / :meth:`defer` / :meth:`end_drain` move an owner's last step of a segment
    after the drain; :meth:`verify` compares the copies; :meth:`stats` for ``paci_stats()``.
    """

    @classmethod
    def create(cls, engine):
        """``None`` when no tied key spans two stages (the same answer on every rank)."""
        owners = tied_owner_stages(engine.module)
        if not owners:
            return None
        return cls(engine, owners)

    def __init__(self, engine, owners):
        from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

        self.engine = engine
        self.owners = owners
        module, grid = engine.module, engine.grid
        opt = engine.optimizer
        if isinstance(opt, BF16_Optimizer):
            self.mode = "bf16"
        elif isinstance(opt, DeepSpeedZeroOptimizer):
            if getattr(opt, "use_grad_accum_attribute", False):
                raise TypeError("tied layers across stages are not supported with DeepSpeed's ZeRO optimizer keeping "
                                "gradients in a separate accumulation attribute (e.g. CPU offload); use ZeRO stage 0/1 "
                                "without offload, or untie the layers")
            self.mode = "zero"
        else:
            self.mode = "fp32"
        self.sync = engine.paci.drain_every_batch
        self.check = engine.paci.check_tied_copies
        rank = engine.global_rank
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
                functools.reduce(getattr, attr.split("."), module.tied_modules[key]) for key in keys
                for attr in module.tied_weight_attrs[key]
            ]
            self.exchanges.append(_Exchange(ranks, stages, groups[ranks], keys, params))
        self._grad_slot = {}
        if self.mode == "bf16":
            for i, group in enumerate(opt.bf16_groups):
                for j, p in enumerate(group):
                    self._grad_slot[id(p)] = (i, j)
        self._final = None  # version of the segment's last step, when deferred (set by begin_drain)
        self._carry = False  # the current drain carries pending windows into the next segment
        self._last_lag = None  # the lag of the previous step
        self._deferred = None
        self._sends = []
        self.windows_exchanged = 0
        self.wait_seconds = 0.0
        self.max_wait_seconds = 0.0
        self.drain_wait_seconds = 0.0
        self.checks = 0

    @property
    def lag(self):
        """``L`` for the current window (``set_train_batch_size`` may change a defaulted window; it drains first)."""
        window = self.engine.accumulation_window
        return max(tied_lag(self.engine.num_stages, stages, window) for stages in self.owners.values())

    # -- gradients -----------------------------------------------------------------------
    def _grad_tensor(self, p, create=False):
        """The gradient the optimizer steps on: fp32 ``_hp_grad`` under BF16_Optimizer, else ``p.grad``."""
        if self.mode == "bf16":
            i, j = self._grad_slot[id(p)]
            return self.engine.optimizer.fp32_groups_gradients[i][j]
        if p.grad is None and create:
            p.grad = torch.zeros_like(p)
        return p.grad

    def _read(self, ex):
        parts = []
        for p in ex.params:
            g = self._grad_tensor(p)
            parts.append(torch.zeros(p.numel(), dtype=torch.float32, device=ex.device)
                         if g is None else g.detach().reshape(-1).float())
        return torch.cat(parts).clone()

    def _write(self, ex, flat):
        offset = 0
        for p in ex.params:
            g = self._grad_tensor(p, create=True)
            g.data.copy_(flat[offset:offset + p.numel()].view_as(g))
            offset += p.numel()
        if self.mode == "bf16":
            for p in ex.params:
                i, j = self._grad_slot[id(p)]
                self.engine.optimizer.fp32_groups_has_gradients[i][j] = True

    def _dp_mean(self, flat):
        engine = self.engine
        if engine.dp_world_size > 1:
            tdist.all_reduce(flat, group=engine.grid.get_data_parallel_group())
            flat.div_(engine.dp_world_size)
        return flat

    # -- the exchange ----------------------------------------------------------------------
    def _post(self, ex, version):
        own = self._read(ex)
        if self.mode == "zero":
            own = self._dp_mean(own)
        recv = {}
        me = self.engine.global_rank
        for r in ex.ranks:
            if r == me:
                continue
            buf = torch.empty(ex.numel, dtype=torch.float32, device=ex.device)
            recv[r] = (tdist.irecv(buf, src=r, group=ex.group, tag=version), buf)
            self._sends.append((tdist.isend(own, dst=r, group=ex.group, tag=version), own))
        ex.pending[version] = {"own": own, "recv": recv}

    def _total(self, ex, version, in_drain):
        """Sum over owners (in stage order) of window ``version``; waits for the peers' transfers."""
        entry = ex.pending.pop(version)
        watchdog = self.engine._watchdog
        total = None
        for r, stage in zip(ex.ranks, ex.stages):
            if r == self.engine.global_rank:
                part = entry["own"]
            else:
                work, part = entry["recv"][r]
                watchdog.note(f"waiting for the tied gradients of weight version {version} (keys {ex.keys}) from "
                              f"rank {r} (stage {stage}) on the tied-weight process group")
                start = time.perf_counter()
                work.wait()
                waited = time.perf_counter() - start
                watchdog.note(None)
                if in_drain:
                    self.drain_wait_seconds += waited
                else:
                    self.wait_seconds += waited
                    self.max_wait_seconds = max(self.max_wait_seconds, waited)
            total = part.clone() if total is None else total.add_(part)
        self.windows_exchanged += 1
        return total

    def _reap_sends(self, wait=False):
        keep = []
        for work, buf in self._sends:
            if wait:
                work.wait()
            elif not work.is_completed():
                keep.append((work, buf))
        self._sends = keep

    # -- hooks -------------------------------------------------------------------------------
    def reduce_grads(self, version):
        """The data-parallel reduce of a local step producing ``version``, with the tied exchange around it."""
        engine = self.engine
        deferred = version == self._final
        final = deferred and not self._carry  # the step that applies every window not yet applied
        lag = self.lag
        if final and self.sync and not any(ex.pending for ex in self.exchanges):
            # sync mode: the segment is this one window; DeepSpeed's own tied all-reduce, then its DP reduce
            engine._exec_reduce_tied_grads()
            engine._exec_reduce_grads()
            return
        if self.mode != "zero":
            engine._exec_reduce_grads()
        for ex in self.exchanges:
            self._post(ex, version)
            due = sorted(ex.pending) if final else [v for v in sorted(ex.pending) if v <= version - lag]
            # one window per step; after the lag shrank (a new window, set_train_batch_size) the first step catches up
            if len(due) > (lag + 1 if final else 1 + max(0, (self._last_lag or lag) - lag)):
                raise RuntimeError(f"tied exchange out of step: windows {due} pending at version {version}")
            total = None
            for v in due:
                t = self._total(ex, v, in_drain=deferred)
                total = t if total is None else total.add_(t)
            if total is None:  # the first L steps of a segment: nothing due yet
                total = torch.zeros(ex.numel, dtype=torch.float32, device=ex.device)
            self._write(ex, total)
        if self.mode == "zero":
            engine._exec_reduce_grads()
        self._last_lag = lag
        self._reap_sends(wait=final)

    def begin_drain(self, ticks, carry=False):
        """Called with the drain's ticks before they run: the segment's last step will be deferred.

        ``carry``: the drain leaves the accumulation window open and the exchange keeps its last ``L`` windows
        pending; the last step is then deferred only if no backward pass follows it (see the module docstring).
        """
        self._carry = carry
        self._final = None
        if not self.exchanges:
            return
        last, after = None, False
        for tick in ticks:
            for i in tick:
                if isinstance(i, LocalStep):
                    last, after = i.version, False
                elif isinstance(i, BackwardPass):
                    after = True
        if last is not None and not (carry and after):
            self._final = last

    def defer(self, cmd):
        """True when ``cmd`` is this owner's last step of the segment: it runs in :meth:`end_drain` instead."""
        if self._final is not None and cmd.version == self._final:
            self._deferred = cmd
            return True
        return False

    def end_drain(self, run_step, tick):
        """After the drain's last tick: run the deferred step (every owner posts, then waits), then check."""
        cmd, self._deferred = self._deferred, None
        watchdog = self.engine._watchdog
        try:
            if cmd is not None:
                watchdog.enter(cmd, tick)
                run_step(cmd)
            if self._carry or cmd is None:  # nothing to apply them with: they stay pending for the next step
                self._settle()
            else:
                leftover = [v for ex in self.exchanges for v in ex.pending]
                if leftover:
                    raise RuntimeError(f"tied gradients of versions {leftover} were not applied at the drain")
            if self.check:
                self.verify("after a drain")
        finally:
            watchdog.idle()
            self._final = None
            self._carry = False

    def _settle(self):
        """After a drain that carries windows: wait for the pending receives (all posted by now) and the sends."""
        watchdog = self.engine._watchdog
        for ex in self.exchanges:
            for version, entry in sorted(ex.pending.items()):
                for r, (work, buf) in list(entry["recv"].items()):
                    if isinstance(work, Received):
                        continue
                    watchdog.enter("the tied exchange at the end of a drain", self.engine._stream.ticks_emitted)
                    watchdog.note(f"waiting for the tied gradients of weight version {version} (keys {ex.keys}) "
                                  f"from rank {r}")
                    start = time.perf_counter()
                    work.wait()
                    self.drain_wait_seconds += time.perf_counter() - start
                    watchdog.idle()
                    entry["recv"][r] = (Received(), buf)  # a gloo receive must not be waited for twice
        self._reap_sends(wait=True)

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
                for state_key, value in self._optimizer_state(p).items():
                    out[f"{name}.{state_key}"] = value
        return out

    def _optimizer_state(self, p):
        engine, opt = self.engine, self.engine.optimizer
        if self.mode == "fp32":
            aliases = engine._aliases
            key = p
            if aliases is not None:
                key = next((alias for q, alias in aliases.pairs if q is p), p)
            state = opt.state.get(key, {})
            return {k: v.detach().float().cpu().clone() for k, v in sorted(state.items()) if torch.is_tensor(v)}
        # flat fp32 master partitions: every replica gathers the same keys, in the same order
        inner = opt.optimizer
        keys = sorted({k for st in inner.state.values() for k, v in st.items() if torch.is_tensor(v) and v.dim() > 0})
        out = {"master": self._full_hp(p, None)}
        for k in keys:
            out[k] = self._full_hp(p, k)
        return out

    def _full_hp(self, p, key):
        buf = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
        mapping = getattr(p, "_hp_mapping", None)
        if mapping is not None:
            frag = mapping.hp_fragment if key is None else getattr(mapping, "optim_fragment", {}).get(key)
            if frag is not None:
                address = mapping.lp_fragment_address
                buf.narrow(0, address.start, address.numel).copy_(frag.detach().reshape(-1).float())
        if self.engine.dp_world_size > 1:
            tdist.all_reduce(buf, group=self.engine.grid.get_data_parallel_group())
        return buf.view_as(p).cpu()

    def verify(self, when):
        """Compare digests of the copies with every peer owner (point to point); raise if any differs."""
        snap = self.snapshot()
        me = self.engine.global_rank
        for ex in self.exchanges:
            prefix = f"{'+'.join(ex.keys)}."
            weights = _digest({k: v for k, v in snap.items() if k.startswith(prefix) and k.endswith(".weight")})
            state = _digest({k: v for k, v in snap.items() if k.startswith(prefix) and not k.endswith(".weight")})
            mine = torch.tensor(weights + state, dtype=torch.int64, device=ex.device)
            works, theirs = [], {}
            for r in ex.ranks:
                if r != me:
                    theirs[r] = torch.empty_like(mine)
                    works.append(tdist.irecv(theirs[r], src=r, group=ex.group, tag=_VERIFY_TAG))
                    works.append(tdist.isend(mine, dst=r, group=ex.group, tag=_VERIFY_TAG))
            self.engine._watchdog.note(f"comparing the tied copies {ex.keys} with ranks {list(ex.ranks)}")
            for w in works:
                w.wait()
            self.engine._watchdog.note(None)
            for r, other in theirs.items():
                what = [name for name, sl in (("weights", slice(0, 4)), ("optimizer state", slice(4, 8)))
                        if not torch.equal(mine[sl], other[sl])]
                if what:
                    stage = ex.stages[ex.ranks.index(r)]
                    raise TiedCopiesDiverged(
                        f"{self.engine._describe_rank()}: the copies of tied layers {ex.keys} differ from rank {r} "
                        f"(stage {stage}) {when}: {' and '.join(what)} are not bit-identical")
        self.checks += 1

    def stats(self):
        """Telemetry for ``paci_stats()['tied']``."""
        return {
            "keys": sorted(self.owners),
            "owner_stages": {k: list(v) for k, v in self.owners.items()},
            "owner": bool(self.exchanges),
            "lag_windows": self.lag,
            "gradient_path": self.mode,
            "pending_windows": sorted({v for ex in self.exchanges for v in ex.pending}),
            "windows_exchanged": self.windows_exchanged,
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
