"""What the tests share: the repository root, free ports, the launcher command and the multi-process harness.

The multi-process harness is :mod:`ds_paci.tools.processes.world` (real processes over gloo, fail fast, per-rank
logs); ``free_port`` is its single definition, shared by the tests and the tools. ``tests/conftest.py`` hands these
to tests as the fixtures ``repo_root``, ``free_port`` and ``launch_command``; modules that need them at import time
(a path constant, a helper called by several tests) import them from here.
"""

import os
import sys
from pathlib import Path

from ds_paci.tools.processes.world import WorldFailure, free_port, run_world  # noqa: F401

#: The repository root (``tests/..``).
REPO_ROOT = Path(__file__).resolve().parent.parent

#: The folder of this interpreter's console scripts (``deepspeed``, ``torchrun``).
BIN = os.path.dirname(sys.executable)


def launch_command(nproc, *args, port=None, launcher="deepspeed"):
    """argv of a local launch of ``nproc`` processes on its own free port: ``deepspeed --num_gpus N
    --master_port P <args>`` (``launcher="torchrun"``: ``torchrun --nproc_per_node N --master_port P <args>``).
    Every launch gets its own port (``port`` or a free one), so concurrent tests and workers never share one."""
    flag = {"deepspeed": "--num_gpus", "torchrun": "--nproc_per_node"}.get(launcher)
    if flag is None:
        raise ValueError(f"launcher {launcher!r} is not known: pass 'deepspeed' or 'torchrun'")
    port = free_port() if port is None else port
    return [os.path.join(BIN, launcher), flag, str(nproc), "--master_port", str(port)] + [str(a) for a in args]
