"""The peer watch: in a run that spans nodes, a rank that disappears ends every other rank, with one line naming it.

Within a node DeepSpeed's launcher ends its other ranks when one exits non-zero; nothing watches the other
nodes, whose ranks then fail in their next transfer with the lost ranks (a traceback) or wait in it (until the
process group's timeout, 30 minutes by default). Public contract:

* :func:`watch_peers` (a collective; :func:`ds_paci.initialize` runs it once per process and starts the watch
  when the ranks span more than one node, as :func:`ds_paci.core.health.nodes.gather_node_map` says;
  ``DS_PACI_WATCH_PEERS=0`` on every rank turns it off): rank 0 listens on a TCP port (broadcast to the others),
  every other rank holds one connection to it, and both sides send a heartbeat every second. Rank 0 declares a
  rank lost when its connection closes without a farewell (the operating system closes it when the process
  dies, however it dies) or when nothing has come from it for ``timeout`` seconds (a node gone without closing
  its connections). It waits half a second for more losses (a node's ranks die together), sends the verdict to
  every other rank, prints one line naming the lost ranks by node, and exits with :data:`EXIT_CODE`; every
  surviving rank exits with the same code on the verdict. A rank whose connection to rank 0 closes without a
  farewell, or stays silent ``timeout`` seconds, counts rank 0 as lost; then each surviving node's local rank 0
  prints the line (rank 0's node is named), and every surviving rank exits the same way.
* :func:`farewell`: a rank that ends on purpose (at the end of training, after an agreed stop) says so first, so
  it is not counted as lost. Registered with ``atexit`` and with :func:`ds_paci.core.health.lifecycle.on_exit`; a job
  that leaves with ``os._exit`` calls it first (the main job does).
* :func:`failure_verdict`: the lost ranks, if a verdict arrives within ``wait`` seconds; :func:`exit_if_lost`: a
  job whose transfer raised calls it so that the verdict's line, not a traceback, ends the rank (the main job and
  ``ds_paci.run`` do).

Bound (stated in ``docs/multinode.md``, "Node failures", and checked by ``tests/test_multinode.py`` with a wide
margin): once every process of a node is killed, every other rank has printed or received the verdict within about
a second plus the time to exit; a node that vanishes silently is declared after ``timeout`` (15 s) plus at most a
second.
"""

import atexit
import json
import os
import selectors
import socket
import sys
import threading
import time

EXIT_CODE = 87
HEARTBEAT = 1.0
GRACE = 0.5

_watch = None
_started = False
_lock = threading.Lock()


def _say(line):
    try:
        sys.stdout.flush()
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except Exception:
        pass


class _Watch:
    """State shared by the watch thread and the main thread (verdict, farewell)."""

    def __init__(self, rank, nodes, timeout):
        self.rank, self.nodes, self.timeout = rank, nodes, float(timeout)
        self.verdict = None
        self.verdict_event = threading.Event()
        self.closing = False
        self.send_lock = threading.Lock()

    def conclude(self, lost, how):
        """Name ``lost`` (rank 0 prints; elsewhere each surviving node's local rank 0) and end this rank."""
        self.verdict = sorted(lost)
        self.verdict_event.set()
        speaker = self.rank == 0 if 0 not in lost else os.environ.get("LOCAL_RANK", "0") == "0"
        if speaker:
            what = self.nodes.describe(self.verdict)
            verb = "is" if len(self.verdict) == 1 else "are"
            _say(f"[ds_paci] {what} {verb} gone ({how}); stopping every other rank now (exit code {EXIT_CODE}); "
                 "the last complete checkpoint stays the latest")
        os._exit(EXIT_CODE)


class _Coordinator(_Watch):
    """Rank 0: accepts every other rank's connection, watches them, sends the verdict."""

    def __init__(self, nodes, timeout):
        super().__init__(0, nodes, timeout)
        self.server = socket.create_server(("", 0))
        self.port = self.server.getsockname()[1]
        self.peers = {}  # rank -> [socket, last heard, said farewell]
        self.pending = {}  # socket -> bytes received before its hello line
        self.expected = set(range(1, len(nodes.labels)))
        self.since = time.monotonic()

    def run(self):
        sel = selectors.DefaultSelector()
        sel.register(self.server, selectors.EVENT_READ)
        lost, first_loss, how, last_beat = set(), None, "", 0.0
        while not self.closing:
            for key, _ in sel.select(timeout=0.2):
                if key.fileobj is self.server:
                    conn, _ = self.server.accept()
                    conn.setblocking(False)
                    self.pending[conn] = b""
                    sel.register(conn, selectors.EVENT_READ)
                else:
                    gone = self._read(key.fileobj, sel)
                    if gone is not None:
                        lost.add(gone)
                        how = "its connection to rank 0 closed without a clean exit"
                        first_loss = first_loss or time.monotonic()
            now = time.monotonic()
            never = self.expected - set(self.peers) - lost
            if never and now - self.since > 60 + self.timeout:
                lost |= never
                how = "it never connected to rank 0"
                first_loss = first_loss or now
            for rank, (_, heard, bye) in list(self.peers.items()):
                if not bye and rank not in lost and now - heard > self.timeout:
                    lost.add(rank)
                    how = f"nothing heard from it for {self.timeout:g}s"
                    first_loss = first_loss or now
            if lost and now - first_loss >= GRACE:
                self._broadcast(("lost " + json.dumps(sorted(lost)) + "\n").encode(), skip=lost)
                self.conclude(lost, how)
            if now - last_beat >= HEARTBEAT:
                self._broadcast(b"\n", skip=lost)
                last_beat = now

    def _read(self, conn, sel):
        """Handle data on ``conn``; returns a rank that is lost (closed without farewell), else None."""
        try:
            data = conn.recv(4096)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            data = b""
        rank = next((r for r, p in self.peers.items() if p[0] is conn), None)
        if not data:
            sel.unregister(conn)
            conn.close()
            self.pending.pop(conn, None)
            if rank is not None and not self.peers[rank][2]:
                return rank
            return None
        if rank is None:
            buf = self.pending[conn] + data
            if b"\n" not in buf:
                self.pending[conn] = buf
                return None
            hello, rest = buf.split(b"\n", 1)
            rank = int(hello.split()[1])
            self.pending.pop(conn)
            self.peers[rank] = [conn, time.monotonic(), False]
            data = rest
        self.peers[rank][1] = time.monotonic()
        if b"bye" in data:
            self.peers[rank][2] = True
        return None

    def _broadcast(self, message, skip=()):
        with self.send_lock:
            for rank, (conn, _, bye) in self.peers.items():
                if rank in skip or bye:
                    continue
                try:
                    conn.sendall(message)
                except OSError:
                    pass

    def close(self):
        self.closing = True
        self._broadcast(b"bye\n")


class _Client(_Watch):
    """Every other rank: one connection to rank 0; a heartbeat each second; acts on a verdict or rank 0's loss."""

    def __init__(self, rank, nodes, timeout, address, port):
        super().__init__(rank, nodes, timeout)
        deadline = time.monotonic() + 60
        while True:
            try:
                self.conn = socket.create_connection((address, port), timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        self.conn.settimeout(HEARTBEAT / 2)
        self.conn.sendall(f"hello {rank}\n".encode())

    def run(self):
        heard, last_beat, buf = time.monotonic(), 0.0, b""
        while not self.closing:
            now = time.monotonic()
            if now - last_beat >= HEARTBEAT:
                self._send(b"\n")
                last_beat = now
            try:
                data = self.conn.recv(4096)
            except socket.timeout:
                data = None
            except OSError:
                data = b""
            if self.closing:
                return
            if data == b"":
                self.conclude([0], "this rank's connection to it closed without a clean exit")
            if data:
                heard = time.monotonic()
                buf += data
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if line.startswith(b"lost "):
                        self.verdict = json.loads(line[5:])
                        self.verdict_event.set()
                        os._exit(EXIT_CODE)
                    if line == b"bye":
                        self.closing = True
                        return
            elif time.monotonic() - heard > self.timeout:
                self.conclude([0], f"nothing heard from it for {self.timeout:g}s")

    def _send(self, message):
        with self.send_lock:
            try:
                self.conn.sendall(message)
            except OSError:
                pass

    def close(self):
        self.closing = True
        self._send(b"bye\n")


def watch_peers(nodes=None, timeout=15.0, force=False):
    """Start the watch (see the module docstring). Every rank calls it, in the same order as other collectives; only
    the first call does anything (it gathers the node map when ``nodes`` is None: a collective).

    The watch starts when the ranks span more than one node (or with ``force``). Returns whether it runs.
    """
    global _watch, _started
    import torch.distributed as tdist
    with _lock:
        if _started:
            return _watch is not None
        _started = True
    if nodes is None:
        from .nodes import gather_node_map
        nodes = gather_node_map()
    if not force and (len(nodes.nodes) < 2 or os.environ.get("DS_PACI_WATCH_PEERS", "1") == "0"):
        return False
    rank = tdist.get_rank()
    timeout = float(os.environ.get("DS_PACI_PEER_TIMEOUT", timeout))
    watch = _Coordinator(nodes, timeout) if rank == 0 else None
    port = [watch.port if watch else None]
    tdist.broadcast_object_list(port, src=0)
    if watch is None:
        watch = _Client(rank, nodes, timeout, os.environ.get("MASTER_ADDR", "127.0.0.1"), port[0])
    _watch = watch
    threading.Thread(target=watch.run, name="ds_paci-peer-watch", daemon=True).start()
    atexit.register(farewell)
    from .lifecycle import on_exit
    on_exit(farewell)
    return True


def farewell():
    """This rank ends on purpose: tell the watch, so it is not counted as lost (idempotent)."""
    watch = _watch
    if watch is not None and not watch.closing:
        watch.close()


def failure_verdict(wait):
    """The ranks the watch found lost, waiting up to ``wait`` seconds for a verdict; None without one."""
    watch = _watch
    if watch is None or watch.closing:
        return None
    watch.verdict_event.wait(wait)
    return watch.verdict


def exit_if_lost(exc):
    """If ``exc`` is a failed transfer and the watch finds ranks lost, end this rank as the verdict does (its line,
    not a traceback, tells what happened); otherwise return. Jobs call it on an exception before reporting it."""
    text = str(exc)
    if not watching() or not isinstance(exc, RuntimeError) or not any(
            word in text for word in ("Connection", "connection", "gloo", "closed", "peer")):
        return
    if failure_verdict(wait=GRACE + 3 * HEARTBEAT) is not None:
        os._exit(EXIT_CODE)  # the watch thread ends the process too; whichever comes first


def watching():
    """Whether the peer watch runs in this process."""
    return _watch is not None and not _watch.closing
