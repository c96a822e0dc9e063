"""Non-blocking pipeline transfers (``"paci": {"nonblocking_transfers": true}``, async mode, issue 27 item 3).

The program is lowered with :func:`ds_paci.core.program.passes.hoist_sends`: each ``SA`` right after its forward,
each ``SG`` right after its backward (before the step). :class:`Transfers` runs the four transfer actions:

* **Sends**: ``isend`` of the tensors DeepSpeed would send (the bool mask as half, the floating inputs' gradients),
  after waiting for the previous send on the same link: at most one send in flight per link. The tensors are held
  until the send is waited for. The first activation send after a reset sends the shapes first, blocking, on the
  default group, as DeepSpeed does (``_send_tensor_meta``).
* **Receives**: the call's first receive of each direction is posted at the call's start (the first activation's
  shapes are received there first, as DeepSpeed does; a gradient receive only once this stage has sent an
  activation since the last reset, which gives its shapes), the next one when the current one is waited for, right
  before its forward or backward: one micro-batch ahead, never across the end of a call. Each receive has buffers
  of its own; the activation is cloned into DeepSpeed's pipe buffer, the gradient becomes ``grad_layer``.
* **Drains**: a call that drains (evaluation, checkpoints, closing) waits for every send in flight before it
  returns, so nothing is in flight across a checkpoint, an evaluation or a reset.

**Groups and why the order cannot deadlock on NCCL.** Every link and direction has a two-rank process group of its
own (created on every rank at start-up, each with its first exchange: :func:`first_exchange.link_key`), so each
group carries one sequence of messages, one way, between two ranks, and NCCL's issue order on its stream is that
sequence on both ends (the sends of a kind keep their order in the pass, and the pairing check holds). On such a
stream a receive posted ahead can only wait for its own send: it can never sit before a send another rank waits
for, which is what deadlocks a shared group (``tests/test_nccl_order.py`` shows one group per world, and one per
direction, deadlock). A rank only ever waits for (a) its own receive of ``m``, right before computing on ``m``, as
the blocking program does, and (b) its previous send on a link, which completes once the peer reaches that
receive; the peer reaches it without waiting on this rank's later work, since the hoisted send only moves earlier
what the blocking program sent. The whole program (tied exchange, data-parallel reduces, loss channel,
evaluation's blocking schedule, save barriers, sync mode, both lazy and eager communicators) is checked in the NCCL
model of ``tests/nccl_model.py`` over P = 2..8, M = 1..16 (``tests/nccl_program.py`` derives each rank's operations
from the very program this module runs).

Where DeepSpeed partitions activations or gradients across model-parallel ranks, or has dynamic shapes, the
transfers stay DeepSpeed's blocking ones (:func:`make_transfers` says so in one start-up line). Sync mode never uses
this module.
"""

import torch
import torch.distributed as tdist

from ..program.actions import Kind
from ..seam import deepspeed_internals as ds
from . import first_exchange

__all__ = ["Transfers", "make_transfers", "transfer_op"]

_DIRECTION = {Kind.SEND_ACT: ("act", +1), Kind.RECV_ACT: ("act", -1), Kind.SEND_GRAD: ("grad", -1),
              Kind.RECV_GRAD: ("grad", +1)}


def _tensors(x):
    return (x,) if torch.is_tensor(x) else tuple(x)


def make_transfers(engine, paci, stock_step, say):
    """:class:`Transfers` for ``engine`` when ``paci.nonblocking_transfers`` is on in async mode and DeepSpeed's
    transfers allow it, else ``None`` (DeepSpeed's blocking transfers). Every rank decides alike; run on every rank
    (it creates process groups)."""
    if not paci.nonblocking_transfers or stock_step:
        return None
    why = [n for n in ("is_pipe_partitioned", "is_grad_partitioned", "dynamic_shape") if ds.p2p_field(engine, n)]
    if why:
        say(f"ds_paci: nonblocking_transfers off: DeepSpeed's {', '.join(why)} needs its blocking transfers")
        return None
    return Transfers(engine)


class Transfers:
    """One stage's non-blocking transfers (see the module docstring)."""

    def __init__(self, engine):
        self.engine = engine
        self.groups = {}  # (direction, low rank, high rank) -> group; every rank creates every link's groups
        for ranks in ds.pipe_groups(engine.grid):
            for a, b in zip(ranks, ranks[1:]):
                for direction in ("act", "grad"):
                    self.groups[(direction, min(a, b), max(a, b))] = tdist.new_group([a, b])
        self.in_flight = {}  # direction -> (works, tensors held until they complete)
        self.posted = {}  # receive kind -> (works, buffers)
        self.pending = {}  # receive kind -> buffer ids still to post in this call
        self.stats = {"sends": 0, "receives": 0}
        self._grad_shapes = None  # the floating outputs' (size, dtype): a gradient receive's buffers

    def _peer(self, kind):
        direction, step = _DIRECTION[kind]
        peer = self.engine.grid.stage_to_global(stage_id=self.engine.stage_id + step)
        me = self.engine.global_rank
        return direction, peer, self.groups[(direction, min(me, peer), max(me, peer))]

    def items(self):
        """The start-up exchanges of this rank's link groups (:func:`first_exchange.plan` items)."""
        out = []
        for (direction, low, high), group in self.groups.items():
            if self.engine.global_rank in (low, high):
                out.append(first_exchange.Item(first_exchange.link_key(direction, low, high), (low, high), "pairs",
                                               group))
        return out

    # -- a call --------------------------------------------------------------------------------------------------
    def begin(self, program):
        """The call's receives, in order; the first of each direction posted now (see the module docstring)."""
        nbuf = self.engine._stream.nbuf
        actions = [a for tick in program for a in tick]
        self.pending = {kind: [a.micro_batch % nbuf for a in actions if a.kind is kind]
                        for kind in (Kind.RECV_ACT, Kind.RECV_GRAD)}
        self._post(Kind.RECV_ACT)
        if self._grad_shapes is not None and not ds.p2p_field(self.engine, "first_output_send"):
            self._post(Kind.RECV_GRAD)

    def drain(self):
        """Wait for every send in flight (a call that drains ends here)."""
        for works, _ in self.in_flight.values():
            for work in works:
                work.wait()
        self.in_flight.clear()

    def _post(self, kind):
        if kind in self.posted or not self.pending.get(kind):
            return
        engine = self.engine
        _, peer, group = self._peer(kind)
        if kind is Kind.RECV_ACT:
            if ds.p2p_field(engine, "pipe_recv_buf") is None:
                ds.set_p2p_field(engine, "pipe_recv_buf", ds.recv_tensor_meta(engine, engine.prev_stage))
            shapes = [(b.size(), b.dtype) for b in _tensors(ds.p2p_field(engine, "pipe_recv_buf"))]
        else:
            shapes = self._grad_shapes
        buffers = [torch.empty(size, dtype=dtype, device=engine.device) for size, dtype in shapes]
        self.posted[kind] = ([tdist.irecv(b, peer, group=group) for b in buffers], buffers)

    def _take(self, kind):
        self._post(kind)  # not posted ahead: the first gradient receive of a run
        works, buffers = self.posted.pop(kind)
        for work in works:
            work.wait()
        self.pending[kind].pop(0)
        self._post(kind)
        self.stats["receives"] += 1
        return buffers

    def _send(self, kind, tensors):
        direction, peer, group = self._peer(kind)
        previous = self.in_flight.pop(direction, None)
        if previous is not None:
            for work in previous[0]:
                work.wait()
        tensors = [t.contiguous() for t in tensors]
        self.in_flight[direction] = ([tdist.isend(t, peer, group=group) for t in tensors], tensors)
        self.stats["sends"] += 1

    # -- the four actions ------------------------------------------------------------------------------------------
    def send_activations(self, buffer_id):
        engine = self.engine
        outputs = ds.pipe_buffers(engine)["outputs"][buffer_id]
        self._grad_shapes = [(t.size(), t.dtype) for t in _tensors(outputs) if t.is_floating_point()]
        if not torch.is_tensor(outputs) and (ds.p2p_field(engine, "has_attention_mask")
                                             or ds.p2p_field(engine, "has_bool_tensors")):
            outputs = tuple(outputs[:-1]) + (outputs[-1].half(),)
        if ds.p2p_field(engine, "first_output_send"):
            ds.set_p2p_field(engine, "first_output_send", False)
            ds.send_tensor_meta(engine, outputs, engine.next_stage)
        self._send(Kind.SEND_ACT, _tensors(outputs))

    def recv_activations(self, buffer_id):
        engine = self.engine
        template = ds.p2p_field(engine, "pipe_recv_buf")
        received = [b.clone().detach() for b in self._take(Kind.RECV_ACT)]
        if torch.is_tensor(template):
            got = received[0]
            got.requires_grad = got.is_floating_point()
        else:
            if ds.p2p_field(engine, "has_attention_mask") or ds.p2p_field(engine, "has_bool_tensors"):
                received[-1] = received[-1].bool()
            got = tuple(received)
            for t in got:
                t.requires_grad = t.is_floating_point()
        ds.pipe_buffers(engine)["inputs"][buffer_id] = got

    def send_grads(self, buffer_id):
        engine = self.engine
        inputs = ds.pipe_buffers(engine)["inputs"][buffer_id]
        if torch.is_tensor(inputs):
            grads = [inputs.grad]
        else:
            if ds.p2p_field(engine, "has_attention_mask") or ds.p2p_field(engine, "has_bool_tensors"):
                inputs = inputs[:-1]
            grads = [t.grad for t in inputs if t.is_floating_point()]
        assert all(g is not None for g in grads), "an input of the stage has no gradient to send"
        self._send(Kind.SEND_GRAD, grads)
        ds.pipe_buffers(engine)["inputs"][buffer_id] = None  # as DeepSpeed: the gradients are held by the send

    def recv_grads(self, buffer_id):
        buffers = self._take(Kind.RECV_GRAD)
        outputs = ds.pipe_buffers(self.engine)["outputs"][buffer_id]
        ds.set_p2p_field(self.engine, "grad_layer", buffers[0] if torch.is_tensor(outputs) else buffers)


_RUN = {Kind.SEND_ACT: Transfers.send_activations, Kind.RECV_ACT: Transfers.recv_activations,
        Kind.SEND_GRAD: Transfers.send_grads, Kind.RECV_GRAD: Transfers.recv_grads}


def transfer_op(blocking):
    """A transfer action: :class:`Transfers` where the engine has them (``engine._transfers``), else DeepSpeed's
    blocking instruction ``blocking`` (:mod:`ds_paci.core.seam.deepspeed_internals`)."""

    def run(engine, action):
        buffer_id = action.micro_batch % engine._stream.nbuf
        if engine._transfers is None:
            return blocking(engine, buffer_id)
        return _RUN[action.kind](engine._transfers, buffer_id)

    run.__name__ = blocking.__name__
    return run
