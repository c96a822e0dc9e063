"""Two "nodes" on one machine joined by a real, bandwidth-limited link: network namespaces and a veth pair.

Each node is a network namespace of its own (``ip netns add``); a veth pair joins them, one end in each, with the
addresses ``10.X.Y.1/24`` and ``10.X.Y.2/24`` that exist only inside those namespaces, and both ends' egress limited
by a token-bucket filter (``tc qdisc add dev V root tbf rate R burst B latency L``; ``netem`` is not needed). A
process started in a node's namespace reaches the other node only through that link; ranks of one node talk over
the node's own loopback, so an intra-node transfer is free and an inter-node one costs what the link allows, in
each direction separately (a veth is full duplex).

Public contract:

* :func:`unavailable` is ``None`` where namespaces can be made here, else one line saying why (not root, no
  ``ip``/``tc``, the kernel refusing ``ip netns add`` or ``tbf``).
* :class:`LinkedNodes` (a context manager) makes the two namespaces on entry and deletes them on exit, also when
  the body raises; names are unique per run (``dspaci-<pid>-<random>-<node>``), so parallel runs never collide.
  Namespaces of a run whose process died without its exit (SIGKILL) are removed by the next :class:`LinkedNodes`
  (:func:`sweep_stale`: only names of our prefix whose pid is gone). An ``atexit`` hook covers an interpreter
  that exits while a :class:`LinkedNodes` is still open.
* :meth:`LinkedNodes.prefix` is the argv prefix running a command in node ``i`` (``ip netns exec NAME``),
  :attr:`LinkedNodes.addresses` the nodes' addresses, :attr:`LinkedNodes.ifname` the veth's name in each
  namespace (the same in both; ``GLOO_SOCKET_IFNAME``), :meth:`LinkedNodes.set_rate` changes the limit in
  place; :func:`burst_bytes` is the bucket's size (at most that many bytes pass above the rate).

Rates are in Mbit/s (``tc``'s ``mbit``: 10^6 bits per second).
"""

import atexit
import os
import random
import shutil
import subprocess

PREFIX = "dspaci-"
IFNAME = "dspaci0"
_open = set()


def _run(argv, what):
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().splitlines()
        raise RuntimeError(f"{what} failed: `{' '.join(argv)}`: {detail[-1] if detail else 'exit ' + str(proc.returncode)}")
    return proc.stdout


def unavailable():
    """``None`` if network namespaces with a tbf-limited veth can be made here, else one line saying why."""
    if os.geteuid() != 0:
        return "emulated links need root (ip netns add); run as root or in a container that grants CAP_NET_ADMIN"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"emulated links need iproute2's `{tool}` (apt-get install iproute2)"
    try:
        with LinkedNodes(rate_mbit=100):
            pass
    except RuntimeError as e:
        return f"emulated links are not available here: {e}"
    return None


def _names():
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def sweep_stale():
    """Delete namespaces this module made for processes that no longer exist; returns their names."""
    gone = []
    for name in _names():
        if not name.startswith(PREFIX):
            continue
        try:
            pid = int(name[len(PREFIX):].split("-")[0])
        except ValueError:
            continue
        if not os.path.exists(f"/proc/{pid}"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            gone.append(name)
    return gone


def burst_bytes(rate_mbit):
    """The token bucket's size in bytes for a link of ``rate_mbit`` (what may pass at once, above the rate)."""
    # small, so that a ping-pong sees the rate and not the bucket (measured here: 16 KiB passes 300 Mbit/s in full)
    return max(16 * 1024, int(rate_mbit * 1e6 / 8 * 0.001))


class LinkedNodes:
    """Two network namespaces joined by a veth pair limited to ``rate_mbit`` each way (see the module docstring)."""

    def __init__(self, rate_mbit, latency_ms=200):
        if not rate_mbit > 0:
            raise ValueError(f"rate_mbit must be > 0, got {rate_mbit!r}")
        self.rate_mbit = float(rate_mbit)
        self.latency_ms = latency_ms
        tag = f"{os.getpid()}-{random.randrange(16**6):06x}"
        self.names = [f"{PREFIX}{tag}-a", f"{PREFIX}{tag}-b"]
        octets = random.randrange(1, 255), random.randrange(0, 256)
        self.addresses = [f"10.{octets[0]}.{octets[1]}.{i}" for i in (1, 2)]
        self.ifname = IFNAME
        self._made = []

    def prefix(self, node):
        """argv prefix running a command inside node ``node``'s namespace."""
        return ["ip", "netns", "exec", self.names[node]]

    def _tbf(self, verb, node):
        rate = self.rate_mbit
        _run(["ip", "netns", "exec", self.names[node], "tc", "qdisc", verb, "dev", self.ifname, "root", "tbf",
              "rate", f"{rate:g}mbit", "burst", str(burst_bytes(rate)), "latency", f"{self.latency_ms}ms"],
             f"limiting the link to {rate:g} Mbit/s")

    def set_rate(self, rate_mbit):
        """Change both directions' limit to ``rate_mbit`` Mbit/s, in place."""
        self.rate_mbit = float(rate_mbit)
        for node in (0, 1):
            self._tbf("change", node)

    def __enter__(self):
        sweep_stale()
        _open.add(self)
        try:
            for name in self.names:
                _run(["ip", "netns", "add", name], "creating a network namespace")
                self._made.append(name)
            a, b = self.names
            _run(["ip", "link", "add", IFNAME, "netns", a, "type", "veth", "peer", "name", IFNAME, "netns", b],
                 "creating the veth pair")
            for node, name in enumerate(self.names):
                _run(["ip", "-n", name, "addr", "add", self.addresses[node] + "/24", "dev", IFNAME], "addressing")
                _run(["ip", "-n", name, "link", "set", IFNAME, "up"], "bringing the veth up")
                _run(["ip", "-n", name, "link", "set", "lo", "up"], "bringing loopback up")
                self._tbf("add", node)
        except BaseException:
            self.close()
            raise
        return self

    def close(self):
        """Delete the namespaces (the veth goes with them); idempotent."""
        while self._made:
            subprocess.run(["ip", "netns", "del", self._made.pop()], capture_output=True)
        _open.discard(self)

    def __exit__(self, *exc):
        self.close()
        return False


@atexit.register
def _close_open():
    for nodes in list(_open):
        nodes.close()
