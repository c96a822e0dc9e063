"""The checkpoint folder's vocabulary: names, the manifest, ``latest``, and verifying a folder against its manifest.

Public contract: :data:`MANIFEST` (``<tag>/ds_paci_manifest.json``: format, tag, save id and time, and every file
of the checkpoint on that disk with its size), :func:`verify` (a folder's status), :func:`read_latest`,
:class:`CheckpointError`. File system only; :mod:`ds_paci.core.checkpoint.atomic` (saving, loading) and
:mod:`ds_paci.core.checkpoint.choice` (which folder every rank loads) build on it.
"""

import json
import os

MANIFEST = "ds_paci_manifest.json"
MANIFEST_FORMAT = "ds_paci-checkpoint/1"
HIDDEN_PREFIX = ".ds_paci-"
_STAGING = HIDDEN_PREFIX + "staging."
_LINKING = HIDDEN_PREFIX + "linking."
_REPLACED = HIDDEN_PREFIX + "replaced."
_INTERRUPTED = (_STAGING, _REPLACED)  # hidden folders that may hold a complete save
LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded as asked; the message is one line naming the file and the last complete tag."""


def read_latest(save_dir):
    """The tag ``<save_dir>/latest`` names, or ``None`` when there is no such file."""
    try:
        with open(os.path.join(save_dir, LATEST)) as f:
            return f.read().strip() or None
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None


COMPLETE, LEGACY, INCOMPLETE, ABSENT = "complete", "legacy", "incomplete", "absent"


def verify(folder):
    """``(status, detail, manifest)`` of a checkpoint folder.

    ``status`` is ``"complete"`` (every file of the manifest present with its size),
    ``"legacy"`` (a folder without a manifest: written by stock DeepSpeed or an older
    ds_paci; nothing can be verified), ``"incomplete"`` (``detail`` names the missing,
    truncated or changed file, or the unreadable manifest) or ``"absent"``.
    """
    if not os.path.isdir(folder):
        return ABSENT, f"{folder} does not exist", None
    path = os.path.join(folder, MANIFEST)
    if not os.path.exists(path):
        return LEGACY, f"{folder} has no {MANIFEST}", None
    try:
        with open(path) as f:
            manifest = json.load(f)
        files = manifest["files"]
        if manifest.get("format") != MANIFEST_FORMAT or not isinstance(files, dict):
            raise ValueError("unknown format")
    except (OSError, ValueError, KeyError, TypeError) as e:
        return INCOMPLETE, f"its manifest {path} is unreadable ({type(e).__name__})", None
    for rel, size in sorted(files.items()):
        full = os.path.join(folder, *rel.split("/"))
        try:
            actual = os.path.getsize(full)
        except OSError:
            return INCOMPLETE, f"{full} is missing", manifest
        if actual != size:
            kind = "truncated" if actual < size else "changed"
            return INCOMPLETE, f"{full} is {kind} ({actual:,} of {size:,} bytes)", manifest
    return COMPLETE, "", manifest
