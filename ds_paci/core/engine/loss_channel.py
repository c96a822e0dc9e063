"""The loss side channel: the last stage's loss reaches every stage of its pipeline, never waited for.

Contract
--------
* **Its own process group.** :func:`pipeline_groups` creates one gloo group per pipeline (the ranks that
  share every coordinate but the pipe axis, ordered by stage), on every rank and in the same order
  (``new_group`` is collective over WORLD; call it once, at engine start-up). The pipeline's own
  activations and gradients travel on the default group, so a message of this channel can never be
  matched by a pipeline receive, nor the other way round. The group is gloo even when the pipeline runs
  on NCCL: messages are a few CPU scalars, and gloo needs no extra accelerator communicator per pair.
* **Point-to-point only.** ``isend``/``irecv`` between the stages of one pipeline; nothing here is a
  collective, so no call of the channel makes one stage wait for another.
* **Losses.** After each engine call (``train_batch`` or ``drain``) the last stage
  :meth:`~LossChannel.publish`\\ es one message to every other stage of its pipeline: the loss it returns
  for that call (already averaged over its data-parallel group), the call it was computed in, and the
  additional losses (``module.get_additional_losses()``, up to :data:`EXTRA` of them). Every other stage
  keeps :data:`DEPTH` receives posted from the last stage and, at the end of its own call,
  :meth:`~LossChannel.poll` takes every message that has arrived (the newest wins) and re-posts, without
  waiting. :meth:`~LossChannel.wait_for` is the blocking variant (sync mode only).
* **Stop notices.** Any stage may :meth:`~LossChannel.announce_stop` (the non-finite guard's limit): a
  notice to every other stage of the pipeline. Every stage keeps one receive posted from each other
  stage for it; :meth:`~LossChannel.stop_notice` returns one that has arrived.
* **Arrival without ``is_completed()``.** Gloo's point-to-point work objects report completion only once
  ``wait()`` has been called, so a message carries its sequence number in its first and its last slot;
  a receive whose buffer shows the expected number at both ends has landed, and ``wait()`` on it returns
  at once. Receives from one peer are matched in the order they were posted, so the ``k``-th receive
  from a peer holds that peer's ``k``-th message.
* **Bounded memory.** A sender keeps its pending sends and ``wait()``\\ s on one only when it is
  :data:`KEEP_SENDS` messages old: the receiver consumes up to :data:`DEPTH` messages per call and is at
  most a few calls behind (the pipeline's own transfers couple the stages), so such a send has long
  completed and the ``wait()`` returns at once.
* **Shutdown.** :meth:`~LossChannel.flush` gives the pending sends a bounded time to leave (used before a
  process destroys the channel's group or exits), :meth:`~LossChannel.close` drops the pending works: nothing waits on a receive that will
  never be matched, and a process can exit or destroy its process groups at any time (the tests check it).
* **Best effort.** The channel carries information, never a result a rank depends on: a transfer to or
  from a peer that has finished and exited (gloo: "Connection closed by peer") is dropped, that peer is
  left out from then on (:attr:`~LossChannel.gone`), and no call of the channel raises for it. So a
  stage that drains and exits at once never makes the last stage's final :meth:`~LossChannel.publish`
  fail the run after all the work is done.
"""

import math
from collections import deque

import torch
import torch.distributed as tdist

DEPTH = 4  # receives kept posted from the last stage
KEEP_SENDS = 64  # pending sends kept per peer before the oldest is waited on
EXTRA = 16  # additional losses carried per message

LOSS, STOP = 1.0, 2.0
_SEQ, _KIND, _A, _B, _C, _D, _X = 0, 1, 2, 3, 4, 5, 6
SIZE = _X + EXTRA + 1  # ... + trailing sequence number


def pipeline_groups(grid):
    """Create a gloo group per pipeline of ``grid`` (collective over WORLD); returns (own group, own ranks by stage).

    Every rank must call this at the same point, once: ``new_group`` is collective over WORLD.
    Returns ``(None, ranks)`` for a single-stage pipeline (nothing to send).
    """
    mine, own = None, None
    from ..seam import deepspeed_internals  # imports DeepSpeed: not at module level (this module needs torch only)
    for ranks in deepspeed_internals.pipe_groups(grid):
        ranks = list(ranks)
        if len(ranks) < 2:
            continue
        group = tdist.new_group(ranks, backend="gloo")
        if grid.global_rank in ranks:
            mine, own = group, ranks
    return mine, own or [grid.global_rank]


class LossMessage:
    """A loss published by the last stage: ``seq`` (its call count), ``value``, ``origin_call``, ``extras``."""

    __slots__ = ("seq", "value", "origin_call", "extras")

    def __init__(self, seq, value, origin_call, extras):
        self.seq, self.value, self.origin_call, self.extras = seq, value, origin_call, extras


class StopNotice:
    """A stage's announcement that it stops the run (see :mod:`ds_paci.core.step.guard`)."""

    __slots__ = ("stage", "step", "count", "limit")

    def __init__(self, stage, step, count, limit):
        self.stage, self.step, self.count, self.limit = stage, step, count, limit


class _Receive:
    __slots__ = ("work", "buf", "seq")

    def __init__(self, work, buf, seq):
        self.work, self.buf, self.seq = work, buf, seq

    def arrived(self):
        return self.buf[_SEQ].item() == self.seq and self.buf[-1].item() == self.seq


class LossChannel:
    """One rank's end of its pipeline's side channel (see the module docstring).

    ``ranks``: the pipeline's global ranks ordered by stage; ``stage``: this rank's stage.
    """

    def __init__(self, group, ranks, stage):
        self.group = group
        self.ranks = list(ranks)
        self.stage = stage
        self.last = len(self.ranks) - 1
        self.sent = 0  # messages this rank has published (its sequence counter)
        self.received = 0  # loss messages taken from the last stage
        self.latest = None  # the newest LossMessage taken
        self._sends = {s: deque() for s in range(len(self.ranks)) if s != stage}
        self._recvs = {s: deque() for s in range(len(self.ranks)) if s != stage}
        self._next_seq = {s: 1 for s in self._recvs}
        self._stop = None
        self.gone = set()  # stages whose end of the channel has closed (their process exited)
        self._closed = group is None
        if not self._closed:
            for peer in self._recvs:
                for _ in range(DEPTH if peer == self.last else 1):
                    self._post(peer)

    @property
    def active(self):
        return not self._closed

    # -- sending ------------------------------------------------------------------------------
    def publish(self, value, origin_call, extras=()):
        """Last stage: send this call's loss to every other stage of the pipeline (never waits)."""
        assert self.stage == self.last, "only the last stage publishes losses"
        extras = list(extras)[:EXTRA]
        fields = {_A: _as_float(value), _B: float(origin_call), _C: float(len(extras))}
        self._broadcast(LOSS, fields, extras)

    def announce_stop(self, step, count, limit, wait_s=10.0):
        """Tell every other stage of the pipeline that this stage stops the run; waits up to ``wait_s`` for delivery."""
        if self._closed:
            return
        works = self._broadcast(STOP, {_A: float(self.stage), _B: float(step), _C: float(count), _D: float(limit)})
        import datetime
        for work in works:
            try:
                work.wait(timeout=datetime.timedelta(seconds=wait_s))
            except RuntimeError:
                pass  # the peer is gone; the others still get their notice

    def _broadcast(self, kind, fields, extras=()):
        if self._closed:
            return []
        self.sent += 1
        buf = torch.zeros(SIZE, dtype=torch.float64)
        buf[_SEQ] = buf[-1] = float(self.sent)
        buf[_KIND] = kind
        for slot, v in fields.items():
            buf[slot] = v
        for i, v in enumerate(extras):
            buf[_X + i] = _as_float(v)
        works = []
        for peer, pending in list(self._sends.items()):
            try:
                work = tdist.isend(buf, dst=self.ranks[peer], group=self.group)
                pending.append((work, buf))
                works.append(work)
                while len(pending) > KEEP_SENDS:
                    pending.popleft()[0].wait()  # KEEP_SENDS messages old: completed long ago
            except RuntimeError:
                self._drop(peer)
        return works

    def _drop(self, peer):
        """``peer`` has exited (its end of the channel is closed): forget its transfers, never talk to it again."""
        self.gone.add(peer)
        self._sends.pop(peer, None)
        self._recvs.pop(peer, None)

    # -- receiving ----------------------------------------------------------------------------
    def _post(self, peer):
        if peer in self.gone:
            return
        buf = torch.zeros(SIZE, dtype=torch.float64)
        seq = self._next_seq[peer]
        self._next_seq[peer] += 1
        try:
            work = tdist.irecv(buf, src=self.ranks[peer], group=self.group)
        except RuntimeError:
            self._drop(peer)
            return
        self._recvs[peer].append(_Receive(work, buf, seq))

    def _take(self, peer, block=False):
        """Messages from ``peer`` that have arrived (in order), re-posting a receive for each."""
        out = []
        pending = self._recvs.get(peer, ())
        while pending and (pending[0].arrived() or block):
            rec = pending.popleft()
            try:
                rec.work.wait()
            except RuntimeError:
                self._drop(peer)
                break
            out.append(rec.buf)
            self._post(peer)
            if peer in self.gone:
                break
            block = False
        return out

    def _decode(self, buf):
        if buf[_KIND].item() == STOP:
            return StopNotice(int(buf[_A].item()), int(buf[_B].item()), int(buf[_C].item()), int(buf[_D].item()))
        n = int(buf[_C].item())
        return LossMessage(int(buf[_SEQ].item()), buf[_A].item(), int(buf[_B].item()),
                           [buf[_X + i].item() for i in range(n)])

    def poll(self):
        """Non-last stages: the newest loss message that has arrived since the last poll, or ``None``. Never waits."""
        if self._closed:
            return None
        newest = self._absorb(self._take(self.last))
        self._poll_stops()
        return newest

    def wait_for(self, seq):
        """Non-last stages: block until the last stage's loss message ``seq`` has arrived; returns the newest one.

        Sync mode only: it drains every call, so waiting for the call's own loss costs (almost) nothing there.
        """
        newest = None
        while (not self._closed and self._stop is None and self.last not in self.gone
               and (self.latest is None or self.latest.seq < seq)):
            newest = self._absorb(self._take(self.last, block=True)) or newest
        return self.poll() or newest

    def _absorb(self, bufs):
        newest = None
        for buf in bufs:
            msg = self._decode(buf)
            if isinstance(msg, StopNotice):
                self._stop = self._stop or msg
            else:
                newest = self.latest = msg
                self.received += 1
        return newest

    def _poll_stops(self):
        for peer in list(self._recvs):
            if peer != self.last:
                for buf in self._take(peer):
                    self._stop = self._stop or self._decode(buf)

    def stop_notice(self, wait_s=0.0):
        """A :class:`StopNotice` another stage of this pipeline sent, or ``None``; polls for up to ``wait_s`` seconds."""
        import time
        deadline = time.monotonic() + wait_s
        while True:
            if self._stop is None and not self._closed:
                try:
                    if self.stage != self.last:
                        self.poll()
                    else:
                        self._poll_stops()
                except RuntimeError:
                    pass  # a broken pair: that peer is gone; what arrived before is already recorded
            if self._stop is not None or time.monotonic() >= deadline:
                return self._stop
            time.sleep(0.05)

    def sniff_stop(self):
        """A stop notice that has landed, found by reading buffers only (no wait, no post): safe from another thread."""
        if self._stop is not None:
            return self._stop
        for pending in list(self._recvs.values()):
            for rec in list(pending):
                if rec.arrived() and rec.buf[_KIND].item() == STOP:
                    return self._decode(rec.buf)
        return None

    def flush(self, seconds=2.0):
        """Give the pending sends up to ``seconds`` in all to leave this process (a peer that has exited is left out),
        so that a process about to destroy the channel's group or exit does not cut off its last messages."""
        import datetime
        import time
        deadline = time.monotonic() + seconds
        for peer, pending in list(self._sends.items()):
            while pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                work, _ = pending.popleft()
                try:
                    work.wait(timeout=datetime.timedelta(seconds=left))
                except RuntimeError:
                    self._drop(peer)  # gone (or not delivered in time): nothing more to wait for there
                    break

    def close(self):
        """Drop every pending send and receive (see the module docstring); the channel is unusable afterwards."""
        self._closed = True
        for pending in list(self._sends.values()) + list(self._recvs.values()):
            pending.clear()


def _as_float(value):
    if value is None:
        return math.nan
    if torch.is_tensor(value):
        return float(value.detach().float().mean().item())
    return float(value)
