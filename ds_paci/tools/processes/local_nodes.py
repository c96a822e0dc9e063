"""Several DeepSpeed "nodes" on one machine: one launcher per node, each with its own checkpoint disk if asked.

DeepSpeed's launcher runs one node per command without ssh::

    deepspeed --hostfile H --no_ssh --node_rank R --master_addr 127.0.0.1 --master_port X script.py ...

with a hostfile naming the nodes and their slots (``nodeA slots=2``); on that path the names are never resolved.
Public contract:

* :func:`write_hostfile` writes such a hostfile.
* :func:`node_command` is the argv of one node's launcher; with ``disk`` it runs in a mount namespace of its own
  (``unshare --mount``; unprivileged: ``--user --map-root-user`` as well) where ``disk`` is bind-mounted at
  ``mountpoint``: every process of that node sees its own disk at the same path, as node-local disks do.
* :class:`Node` starts a command in a session of its own (so :meth:`Node.kill_all` reaches every process of the
  node, ``kill -- -PGID``) and collects its output line by line (:class:`ds_paci.tools.processes.launched.Launched`).
  :func:`stop_all` ends every node's session; tests call it in ``finally`` so no process outlives a test.
* :func:`private_mount` does the same as ``disk`` for the calling process itself (``unshare(CLONE_NEWNS)`` and a
  bind mount, through libc): for test workers that are already running.
"""

import ctypes
import os
import shutil
import signal
import sys

from .launched import Launched

_CLONE_NEWNS, _MS_BIND, _MS_REC, _MS_PRIVATE = 0x00020000, 4096, 16384, 1 << 18


def write_hostfile(path, slots):
    """A DeepSpeed hostfile with one line per node: ``slots`` maps node name -> processes."""
    with open(path, "w") as f:
        for name, n in slots.items():
            f.write(f"{name} slots={int(n)}\n")
    return path


def _namespace_prefix():
    if shutil.which("unshare") is None:
        raise RuntimeError("node-local disks need util-linux's `unshare` (apt-get install util-linux)")
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    return ["unshare"] + user + ["--mount", "--propagation", "private"]


def node_command(node_rank, hostfile, port, script_args, disk=None, mountpoint=None, module=False):
    """argv for node ``node_rank``'s DeepSpeed launcher (see the module docstring)."""
    deepspeed = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    cmd = [deepspeed, "--hostfile", hostfile, "--no_ssh", "--node_rank", str(node_rank), "--master_addr",
           "127.0.0.1", "--master_port", str(port)] + (["--module"] if module else []) + list(script_args)
    if disk is None:
        return cmd
    os.makedirs(disk, exist_ok=True)
    os.makedirs(mountpoint, exist_ok=True)
    script = 'mount --bind "$1" "$2" || exit 97; shift 2; exec "$@"'
    return _namespace_prefix() + ["sh", "-c", script, "sh", disk, mountpoint] + cmd


class Node(Launched):
    """One node's launcher in its own session; ``name`` is used in messages."""

    def __init__(self, name, cmd, env=None, cwd=None):
        super().__init__(cmd, env=env, cwd=cwd)
        self.name = name

    def processes(self):
        """Every live process of this node's session (psutil), the session leader first."""
        import psutil
        try:
            leader = psutil.Process(self.proc.pid)
            return [leader] + leader.children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def launcher(self):
        """The node's ``deepspeed.launcher.launch`` process (psutil), or None."""
        for p in self.processes():
            try:
                if "deepspeed.launcher.launch" in p.cmdline():
                    return p
            except Exception:
                continue
        return None

    def ranks(self):
        """``{global rank: psutil process}`` of this node's training processes."""
        out = {}
        for p in self.processes():
            try:
                env = p.environ()
                if any(a.startswith("--local_rank=") for a in p.cmdline()) and "RANK" in env:
                    out[int(env["RANK"])] = p
            except Exception:
                continue
        return out


def stop_all(nodes, sig=signal.SIGKILL):
    """End every process of every node (their sessions); waits for the launch commands to exit."""
    for node in nodes:
        node.kill_all(sig)
    for node in nodes:
        node.finish(timeout=30)


def private_mount(disk, mountpoint):
    """Give the calling process a mount namespace of its own with ``disk`` bind-mounted at ``mountpoint``."""
    os.makedirs(disk, exist_ok=True)
    os.makedirs(mountpoint, exist_ok=True)
    libc = ctypes.CDLL(None, use_errno=True)

    def check(result, what):
        if result != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what} failed ({os.strerror(err)}); node-local disks on one machine need root or "
                          "unprivileged user namespaces")

    check(libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    check(libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None), "making / private")
    check(libc.mount(os.fsencode(disk), os.fsencode(mountpoint), None, _MS_BIND, None), f"bind-mounting {disk}")
