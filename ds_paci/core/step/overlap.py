"""The data-parallel reduce overlapped with the window's last backward (``"paci": {"overlap_reduce": true}``).

Contract
--------
* The lowered program marks the backward pass after which a local step follows with no other backward in
  between (``B7[dp]``, :func:`ds_paci.core.program.passes.mark_reduce_backward`): the window's last backward,
  including a partial window a closing drain steps. The engine runs that backward under
  :meth:`OverlappedReduce.armed`; the local step calls :meth:`OverlappedReduce.finish` where the stock reduce
  (DeepSpeed's ``_exec_reduce_grads``) ran.
* While armed, a post-accumulate-grad hook on every parameter reports its gradient final. The parameters are
  split once, at start-up, into fixed *buckets* (:func:`plan_buckets`: reverse module order, the order a
  sequential model's backward produces them; one dtype per bucket; about ``bucket_elements`` elements each).
  A bucket is launched (its gradients copied into one flat buffer, scaled as DeepSpeed scales before its
  all-reduce, then ``all_reduce(async_op=True)`` on the stage's data-parallel group) once it and every bucket
  before it are complete: every replica issues the same collectives in the same order whatever order its
  hooks fire in.
* :meth:`OverlappedReduce.finish` launches what is left (parameters without a gradient get zeros, as
  DeepSpeed's reduce gives them; a step with no marked backward, e.g. a closing drain with nothing in flight,
  reduces everything here), waits for every handle, scales after the all-reduce as DeepSpeed does, and copies
  the result into ``param.grad``. ``param.grad`` is untouched until then, so anything that reads the window's
  gradients before the step (the look-ahead) sees what it saw without the overlap.
* **Exactness.** DeepSpeed's reduce (``allreduce_bucket``) is, per element: divide (pre-scale), sum over the
  replicas, multiply (post-scale). The same arithmetic runs here on the same values; only the bucket
  boundaries differ (DeepSpeed: one flat bucket of up to 5e8 elements in module order). With two replicas the
  sum of an element is one addition, so the result is **bit-identical**. With three or more, a ring all-reduce
  sums an element in an order that depends on its position in the buffer, so the result may differ from the
  unoverlapped reduce's in the last bits (within fp32 rounding of a ``DP``-term sum); every replica still gets
  the same bits (each element is reduced once and broadcast).
* **Supported** (:func:`support_reason` says why not, and the engine then reduces at the step and says so in
  one start-up line): async mode, more than one data-parallel replica, an unwrapped fp32 optimizer
  (``torch.optim`` or DeepSpeed's configured one without ZeRO), dense gradients, no MoE, DeepSpeed's
  pipeline reduce on (``pipeline_enable_backward_allreduce``). DeepSpeed's ``BF16_Optimizer`` reduces its fp32
  master gradients, filled only after the whole backward (``update_hp_grads``), and ZeRO-1 reduces into its
  partitions (``reduce_gradients``): both keep the reduce at the step.

Imports torch and DeepSpeed only (through the seam).
"""

import contextlib

import torch
import torch.distributed as dist

from ..seam import deepspeed_internals as ds

DEFAULT_BUCKET_ELEMENTS = 1 << 22  # 16 MiB of fp32, near torch DDP's 25 MB first bucket


def support_reason(engine, stock_step):
    """``None`` when the overlapped reduce can run on ``engine``, else why not (one phrase)."""
    from .local_step import is_wrapped
    if stock_step:
        return "sync mode runs DeepSpeed's own step and reduce"
    if engine.dp_world_size <= 1:
        return "one data-parallel replica: there is nothing to reduce"
    if not ds.zero_fills_missing_gradients(engine):
        return "DeepSpeed's pipeline reduce is off (pipeline_enable_backward_allreduce)"
    if is_wrapped(engine.optimizer):
        name = type(engine.optimizer).__name__
        return (f"{name} reduces its own gradient buffers (bf16 master gradients or ZeRO partitions), filled only "
                "after the backward: not supported yet")
    if engine.has_moe_layers:
        return "MoE layers reduce on expert groups: not supported"
    if any(getattr(m, "sparse", False) is True for m in engine.module.modules()):
        return "a module with sparse gradients (e.g. nn.Embedding(sparse=True)): not supported"
    return None


def plan_buckets(params, bucket_elements):
    """Indices of ``params`` grouped into buckets: reverse order, one dtype per bucket, a bucket closed once it
    holds at least ``bucket_elements`` elements. Pure."""
    buckets, current, numel, dtype = [], [], 0, None
    for i in reversed(range(len(params))):
        p = params[i]
        if current and (p.dtype != dtype or numel >= bucket_elements):
            buckets.append(current)
            current, numel = [], 0
        current.append(i)
        numel += p.numel()
        dtype = p.dtype
    if current:
        buckets.append(current)
    return buckets


class OverlappedReduce:
    """Bucketed asynchronous data-parallel reduce of one stage's gradients (see the module docstring).

    ``params``: the parameters DeepSpeed's reduce covers, in module order. ``group``/``world``: the stage's
    data-parallel group and size. ``scaling``: ``(average, postscale, predivide, comm_dtype)`` as DeepSpeed's
    ``allreduce_bucket`` reads them (:func:`ds_paci.core.seam.deepspeed_internals.reduce_scaling`)."""

    def __init__(self, params, group, world, scaling, bucket_elements=DEFAULT_BUCKET_ELEMENTS):
        self.params = list(params)
        self.group, self.world = group, world
        self.average, self.postscale, self.predivide, self.comm_dtype = scaling
        self.buckets = plan_buckets(self.params, bucket_elements)
        self._bucket_of = {}
        for b, idx in enumerate(self.buckets):
            for i in idx:
                self._bucket_of[i] = b
        self._armed = False
        self._reset()
        self.launched_in_backward = 0  # buckets launched inside a marked backward (telemetry, tests)
        self.reduces = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook_for(i)) for i, p in enumerate(self.params)]

    def _reset(self):
        self._ready = [set() for _ in self.buckets]
        self._next = 0  # the next bucket to launch
        self._flight = []  # (bucket index, flat buffer, handle)

    def _hook_for(self, i):
        def hook(param):
            if self._armed:
                self._ready[self._bucket_of[i]].add(i)
                self._launch_ready()
        return hook

    def close(self):
        for h in self._hooks:
            h.remove()
        self._hooks = []

    @property
    def in_flight(self):
        return len(self._flight)

    @contextlib.contextmanager
    def armed(self):
        """Run the window's last backward inside: buckets are launched as their gradients become final."""
        if self._flight or self._next:
            raise RuntimeError("overlapped reduce: a marked backward began while the previous window's reduce "
                               "was still open (the program steps once after each marked backward)")
        self._armed = True
        try:
            yield
        finally:
            self._armed = False

    def _launch_ready(self):
        while self._next < len(self.buckets) and len(self._ready[self._next]) == len(self.buckets[self._next]):
            self._launch(self._next)
            if self._armed:
                self.launched_in_backward += 1
            self._next += 1

    def _launch(self, b):
        grads = []
        for i in self.buckets[b]:
            p = self.params[i]
            if p.grad is None:
                p.grad = torch.zeros(p.size(), dtype=p.dtype, device=p.device)
            if p.grad.is_sparse:
                raise RuntimeError("overlap_reduce: a sparse gradient; set \"paci\": {\"overlap_reduce\": false}")
            grads.append(p.grad.detach().reshape(-1))
        flat = torch.cat(grads)
        if flat.dtype != self.comm_dtype:
            flat = flat.to(self.comm_dtype)
        if self.average and self.postscale:
            if self.predivide != 1.0:
                flat.mul_(1.0 / self.predivide)
        elif self.average:
            flat.mul_(1. / self.world)
        handle = dist.all_reduce(flat, group=self.group, async_op=True)
        self._flight.append((b, flat, handle))

    def finish(self):
        """The step's reduce: launch the rest, wait for every bucket, write the averages into ``param.grad``."""
        try:
            for b in range(self._next, len(self.buckets)):
                self._launch(b)
            with torch.no_grad():
                for b, flat, handle in self._flight:
                    handle.wait()
                    if self.average and self.postscale and self.predivide != self.world:
                        flat.mul_(self.predivide / self.world)
                    offset = 0
                    for i in self.buckets[b]:
                        g = self.params[i].grad
                        n = g.numel()
                        g.copy_(flat[offset:offset + n].view_as(g))
                        offset += n
            self.reduces += 1
        finally:
            self._reset()


def make_overlap(engine, paci, stock_step, say):
    """The engine's :class:`OverlappedReduce`, or ``None`` (the reduce at the step).

    ``paci``: the parsed ``"paci"`` section (``overlap_reduce``, ``overlap_bucket_elements``). ``say``: prints one
    start-up line (on rank 0): that the reduce is overlapped, or, when it was asked for (the default) and cannot
    be, why not; nothing when it is off by config or moot (sync mode, one replica)."""
    if not paci.overlap_reduce:
        return None
    reason = support_reason(engine, stock_step)
    if reason is not None:
        if not (stock_step or engine.dp_world_size <= 1):
            say(f"ds_paci: overlap_reduce: the data-parallel reduce runs at each local step, not under the window's "
                f"last backward: {reason}")
        return None
    params = [p for p in engine.module.parameters() if p.requires_grad and p.numel() > 0]
    group = engine.grid.get_data_parallel_group()
    reducer = OverlappedReduce(params, group, dist.get_world_size(group), ds.reduce_scaling(engine),
                               paci.overlap_bucket_elements)
    say(f"ds_paci: overlap_reduce: the data-parallel reduce runs under each window's last backward "
        f"({len(reducer.buckets)} bucket(s) on stage {engine.stage_id}, async all-reduce on "
        f"{engine.dp_world_size} replicas)")
    return reducer


def armed_for(reducer, action):
    """The context a backward ``action`` runs in: :meth:`OverlappedReduce.armed` for a marked one (``B7[dp]``)."""
    if reducer is not None and action.reduce_overlap:
        return reducer.armed()
    return contextlib.nullcontext()


def dp_reduce(engine, reducer):
    """The local step's data-parallel reduce: the overlapped reduce's :meth:`~OverlappedReduce.finish`, or
    DeepSpeed's ``ReduceGrads`` of this stage's replicas when ``reducer`` is ``None``."""
    if reducer is not None:
        reducer.finish()
    else:
        ds.exec_reduce_grads(engine)
