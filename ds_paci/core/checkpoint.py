"""Atomic DeepSpeed checkpoints: whatever moment a rank is killed, ``latest`` names a complete checkpoint.

DeepSpeed 0.19 writes every file of a save straight to its final name (``torch.save`` on
``<dir>/<tag>/...``): layer files ``layer_NN-model_states.pt`` (data-parallel rank 0 of each
stage), ``mp_rank_SS_model_states.pt`` (one per stage), and with ZeRO-1 or bf16
``[bf16_]zero_pp_rank_D_mp_rank_SS_optim_states.pt`` (every rank); global rank 0 then
writes ``latest`` right after *its own* files, without waiting for the others. A rank
killed mid-save leaves a truncated or missing file under a tag that ``latest`` may
already name.

Public contract
---------------
:func:`atomic_save` (what :meth:`PACIPipelineEngine.save_checkpoint` runs, and what
:func:`save_checkpoint` runs for any DeepSpeed engine) keeps DeepSpeed's layout, so the
result is an ordinary DeepSpeed checkpoint (a stock engine, or Megatron's
``load_checkpoint(dir, tag=...)``, reads it) plus one file, ``<tag>/ds_paci_manifest.json``
(the relative path and size of every file of the checkpoint, written last). Every rank
calls it (a save is collective, as in DeepSpeed):

1. All ranks agree on a staging name ``.ds_paci-staging.<tag>.<nonce>`` (rank 0's nonce,
   broadcast). The committer removes stale ``.ds_paci-*`` folders of earlier, killed saves
   (never the one ``latest`` names). Barrier.
2. Every rank runs DeepSpeed's own ``save_checkpoint`` into the staging folder with
   ``save_latest=False``; each file is fsynced after it is written. DeepSpeed ends with a
   barrier: now every file of every rank is on disk.
3. The committer (global rank 0; with ``use_node_local_storage``, local rank 0 of each node)
   writes the manifest into the staging folder, then renames the staging folder to
   ``<tag>``, then replaces ``latest`` (``latest.tmp`` + ``os.replace``). If ``<tag>``
   already exists (a re-save of the same tag), ``latest`` first names the complete
   staging folder, the old ``<tag>`` is moved aside, a hard-linked copy of the staging
   folder is renamed to ``<tag>``, and only then does ``latest`` name ``<tag>`` again.
4. Barrier.

So ``latest`` only ever moves from one complete folder to another, and a folder named
``<tag>`` only ever appears complete. A kill at any point leaves at worst a hidden
``.ds_paci-*`` folder, removed by the next save.

:func:`verify` checks a checkpoint folder against its manifest (each file present with the
recorded size); :func:`resolve_tag` is what loading runs first: it reads ``latest`` (or
takes the explicit tag), verifies, and raises :class:`CheckpointError` with one line naming
the missing or truncated file and the last complete tag. Folders without a manifest
(stock DeepSpeed, older ds_paci) load with a warning. :func:`last_complete` lists the
newest complete checkpoint of a folder (used by the main job's ``--resume`` fallback).

An engine whose DeepSpeed checkpoint engine is *decoupled* (asynchronous writer) saves
the DeepSpeed way, with a warning: its files are not on disk when the save returns.

Fault injection (tests): :func:`set_fault_hook` installs ``hook(event, path)`` called at
every step that touches the disk: ``"write"`` / ``"written"`` around each checkpoint file
(on the writing rank), ``"manifest"``, ``"rename"``, ``"link"``, ``"latest"`` (committer).
"""

import errno
import functools
import json
import os
import shutil
import time

MANIFEST = "ds_paci_manifest.json"
MANIFEST_FORMAT = "ds_paci-checkpoint/1"
HIDDEN_PREFIX = ".ds_paci-"
_STAGING = HIDDEN_PREFIX + "staging."
_LINKING = HIDDEN_PREFIX + "linking."
_REPLACED = HIDDEN_PREFIX + "replaced."
LATEST = "latest"

_fault_hook = None
_warned = set()


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded as asked; the message is one line naming the file and the last complete tag."""


def set_fault_hook(hook):
    """Install ``hook(event, path)`` (or ``None``): called at every disk step of a save. For fault-injection tests."""
    global _fault_hook
    _fault_hook = hook


def _fire(event, path):
    if _fault_hook is not None:
        _fault_hook(event, path)


def _warn_once(key, message):
    if key not in _warned:
        _warned.add(key)
        from deepspeed.utils import logger
        logger.warning(message)


# -- files ------------------------------------------------------------------------------------
def _fsync_path(path, directory=False):
    try:
        fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on directories; the data is still written
    finally:
        os.close(fd)


def _list_files(folder):
    """``{relative posix path: size}`` of every file below ``folder`` (the manifest excluded)."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            full = os.path.join(root, name)
            rel = os.path.relpath(full, folder).replace(os.sep, "/")
            if rel != MANIFEST:
                out[rel] = os.path.getsize(full)
    return out


def read_latest(save_dir):
    """The tag ``<save_dir>/latest`` names, or ``None`` when there is no such file."""
    try:
        with open(os.path.join(save_dir, LATEST)) as f:
            return f.read().strip() or None
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None


def _write_latest(save_dir, tag):
    path = os.path.join(save_dir, LATEST)
    tmp = path + ".tmp"
    _fire("latest", path)
    with open(tmp, "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_path(save_dir, directory=True)


def _rename(src, dst):
    _fire("rename", dst)
    os.rename(src, dst)


def _link_tree(src, dst):
    """A copy of folder ``src`` at ``dst`` made of hard links (a real copy where links are not possible)."""
    for root, dirs, files in os.walk(src):
        target = os.path.join(dst, os.path.relpath(root, src))
        os.makedirs(target, exist_ok=True)
        for name in files:
            _fire("link", os.path.join(target, name))
            try:
                os.link(os.path.join(root, name), os.path.join(target, name))
            except OSError as e:
                if e.errno not in (errno.EPERM, errno.EXDEV, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
                    raise
                shutil.copy2(os.path.join(root, name), os.path.join(target, name))
                _fsync_path(os.path.join(target, name))
        _fsync_path(target, directory=True)


# -- verification -------------------------------------------------------------------------------
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


def complete_checkpoints(save_dir):
    """Complete (manifest-verified) checkpoints in ``save_dir``, newest first, as ``[(tag, manifest)]``."""
    found = []
    try:
        names = os.listdir(save_dir)
    except OSError:
        return []
    for name in names:
        if name.startswith("."):
            continue
        status, _, manifest = verify(os.path.join(save_dir, name))
        if status == COMPLETE:
            found.append((manifest.get("saved_at", 0.0), name, manifest))
    found.sort(key=lambda t: (t[0], t[1]), reverse=True)
    return [(name, manifest) for _, name, manifest in found]


def last_complete(save_dir):
    """The tag of the newest complete checkpoint in ``save_dir``, or ``None``."""
    found = complete_checkpoints(save_dir)
    return found[0][0] if found else None


def resume_tag(save_dir):
    """``(tag, note)``: what a resume should load from ``save_dir``. Reads the file system only.

    The tag ``latest`` names when that checkpoint is complete (``note`` is ``None``) or has no
    manifest (``note`` says it is loaded unverified); otherwise the newest complete
    checkpoint, with a one-line ``note`` saying why. Raises :class:`CheckpointError` when
    there is none.
    """
    latest = read_latest(save_dir)
    last = last_complete(save_dir)
    if latest is not None:
        status, detail, _ = verify(os.path.join(save_dir, latest))
        if status == COMPLETE:
            return latest, None
        if status == LEGACY:
            return latest, (f"checkpoint '{latest}' has no {MANIFEST} (saved by stock DeepSpeed or an older ds_paci); "
                            "loading it unverified")
        why = "does not exist" if status == ABSENT else f"is incomplete ({detail})"
        if last is not None:
            return last, (f"'latest' names '{latest}', which {why}; resuming from the last complete checkpoint "
                          f"'{last}'")
        raise CheckpointError(f"{save_dir} holds no complete checkpoint: 'latest' names '{latest}', which {why}, and "
                              "no other complete checkpoint folder is there")
    if last is not None:
        return last, f"{save_dir} has no 'latest' file; resuming from the last complete checkpoint '{last}'"
    raise CheckpointError(f"{save_dir} holds no checkpoint (no 'latest' file and no complete checkpoint folder)")


def resolve_tag(load_dir, tag=None):
    """The tag to load: ``tag``, or what ``latest`` names (``None`` when there is no ``latest``).

    Raises :class:`CheckpointError` (one line) when that checkpoint is absent or incomplete;
    warns once when it has no manifest. Reads the file system only.
    """
    if tag is None:
        tag = read_latest(load_dir)
        if tag is None:
            return None
        named = f"'latest' names '{tag}', but"
    else:
        tag = str(tag)
        named = f"tag '{tag}':"
    folder = os.path.join(load_dir, tag)
    status, detail, _ = verify(folder)
    if status == COMPLETE:
        return tag
    if status == LEGACY:
        _warn_once(folder, f"ds_paci: checkpoint {folder} has no {MANIFEST} (written by stock DeepSpeed or an older "
                   "ds_paci), so its completeness cannot be checked; loading it as is")
        return tag
    last = last_complete(load_dir)
    hint = (f"the last complete checkpoint is '{last}' (load it with tag='{last}'; the main job's --resume falls back "
            "to it)" if last else "no complete checkpoint is in this folder")
    what = "does not exist" if status == ABSENT else f"is incomplete: {detail}"
    raise CheckpointError(f"cannot load checkpoint from {load_dir}: {named} {folder} {what}; {hint}")


# -- saving -------------------------------------------------------------------------------------
class _SyncedWrites:
    """Wraps a DeepSpeed checkpoint engine: every file it saves is fsynced and reported to the fault hook."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def save(self, state_dict, path):
        _fire("write", path)
        self._inner.save(state_dict, path)
        _fsync_path(path)
        _fire("written", path)


def _is_committer(engine):
    if getattr(engine, "use_node_local_storage", lambda: False)():
        return int(getattr(engine, "local_rank", 0) or 0) == 0
    from deepspeed import comm as dist
    return dist.get_rank() == 0


def _agree_nonce(engine):
    import torch
    from deepspeed import comm as dist
    nonce = torch.tensor([time.time_ns() ^ os.getpid()], dtype=torch.int64, device=engine.device)
    dist.broadcast(nonce, src=0)
    return f"{int(nonce.item()) & 0xFFFFFFFFFFFF:012x}"


def _remove_stale(save_dir, keep):
    try:
        names = os.listdir(save_dir)
    except OSError:
        return
    for name in names:
        if name.startswith(HIDDEN_PREFIX) and name != keep:
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
    try:
        os.remove(os.path.join(save_dir, LATEST + ".tmp"))
    except OSError:
        pass


def _commit(engine, save_dir, tag, staging_name, save_latest):
    staging = os.path.join(save_dir, staging_name)
    final = os.path.join(save_dir, tag)
    files = _list_files(staging)
    for root, _, _ in os.walk(staging):
        _fsync_path(root, directory=True)
    manifest = {
        "format": MANIFEST_FORMAT,
        "tag": tag,
        "saved_at": time.time(),
        "global_steps": int(getattr(engine, "global_steps", 0)),
        "world_size": _world_size(),
        "files": files,
    }
    path = os.path.join(staging, MANIFEST)
    _fire("manifest", path)
    with open(path, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    _fsync_path(staging, directory=True)
    latest_is_tag = read_latest(save_dir) == tag
    move_latest = save_latest or latest_is_tag
    if os.path.lexists(final):
        # Re-save of an existing tag: `latest` names the complete staging folder while <tag> is swapped.
        nonce = staging_name.rsplit(".", 1)[-1]
        linking = os.path.join(save_dir, f"{_LINKING}{_flat(tag)}.{nonce}")
        replaced = os.path.join(save_dir, f"{_REPLACED}{_flat(tag)}.{nonce}")
        if move_latest:
            _write_latest(save_dir, staging_name)
        _link_tree(staging, linking)
        _rename(final, replaced)
        _rename(linking, final)
        _fsync_path(save_dir, directory=True)
        if move_latest:
            _write_latest(save_dir, tag)
        shutil.rmtree(replaced, ignore_errors=True)
        shutil.rmtree(staging, ignore_errors=True)
    else:
        os.makedirs(os.path.dirname(final), exist_ok=True)  # a tag may contain a folder
        _rename(staging, final)
        _fsync_path(os.path.dirname(final), directory=True)
        if move_latest:
            _write_latest(save_dir, tag)


def _world_size():
    from deepspeed import comm as dist
    return dist.get_world_size()


def _flat(tag):
    return tag.replace("/", "%2F").replace(os.sep, "%2F")


def atomic_save(engine, save_dir, tag, save_latest, write):
    """Save with the protocol of the module docstring. ``write(staging_tag)`` runs DeepSpeed's own save.

    ``write`` must call DeepSpeed's ``save_checkpoint(save_dir, tag=staging_tag, save_latest=False, ...)``.
    Every rank calls this; returns ``True`` like DeepSpeed.
    """
    from deepspeed import comm as dist
    if not save_dir:
        raise ValueError(f"save_dir must be a non-empty string, got {save_dir!r}")
    save_dir = os.fspath(save_dir)
    tag = str(tag if tag is not None else f"global_step{engine.global_steps}")
    ckpt_engine = getattr(engine, "checkpoint_engine", None)
    if ckpt_engine is not None and ckpt_engine.is_decoupled():
        _warn_once("decoupled", "ds_paci: the decoupled DeepSpeed checkpoint writer is asynchronous; checkpoints are "
                   "saved the DeepSpeed way, without the ds_paci completeness manifest")
        return write(tag, save_latest=save_latest)
    staging_name = f"{_STAGING}{_flat(tag)}.{_agree_nonce(engine)}"
    committer = _is_committer(engine)
    if committer:
        os.makedirs(save_dir, exist_ok=True)
        latest = read_latest(save_dir)
        _remove_stale(save_dir, keep=latest)
    dist.barrier()
    engine.checkpoint_engine = _SyncedWrites(ckpt_engine)
    try:
        write(staging_name, save_latest=False)  # ends with DeepSpeed's barrier: every rank's files are written
    finally:
        engine.checkpoint_engine = ckpt_engine
    if committer:
        _commit(engine, save_dir, tag, staging_name, save_latest)
    dist.barrier()
    return True


def _agree_ok(engine, ok):
    """Every rank's verdict, combined (a load is collective): True only if all ranks passed."""
    import torch
    from deepspeed import comm as dist
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64, device=engine.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def verified_tag(engine, load_dir, tag=None):
    """:func:`resolve_tag` on every rank, agreed: raises :class:`CheckpointError` on all ranks if any rank failed.

    Universal checkpoints (``latest_universal``, DeepSpeed's own conversion format) are passed through unverified.
    """
    if getattr(engine, "load_universal_checkpoint", lambda: False)():
        return tag
    error = None
    try:
        resolved = resolve_tag(load_dir, tag)
    except CheckpointError as e:
        error, resolved = e, None
    if not _agree_ok(engine, error is None):
        raise error or CheckpointError(f"cannot load checkpoint from {load_dir}: another rank found it incomplete "
                                       "(see that rank's message)")
    return resolved


# -- for any DeepSpeed engine -------------------------------------------------------------------------
def save_checkpoint(engine, save_dir, tag=None, client_state=None, save_latest=True, exclude_frozen_parameters=False):
    """``engine.save_checkpoint`` made atomic, for any DeepSpeed engine (the PACI engine already is)."""
    if getattr(engine, "saves_atomically", False):
        return engine.save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=save_latest,
                                      exclude_frozen_parameters=exclude_frozen_parameters)
    write = functools.partial(_deepspeed_save, engine.save_checkpoint, save_dir, dict(client_state or {}),
                              exclude_frozen_parameters)
    return atomic_save(engine, save_dir, tag, save_latest, write)


def _deepspeed_save(save, save_dir, client_state, exclude_frozen_parameters, tag, save_latest):
    return save(save_dir, tag=tag, client_state=client_state, save_latest=save_latest,
                exclude_frozen_parameters=exclude_frozen_parameters)


def load_checkpoint(engine, load_dir, tag=None, **kwargs):
    """``engine.load_checkpoint`` after verifying completeness, for any DeepSpeed engine (the PACI engine already does)."""
    if getattr(engine, "saves_atomically", False):
        return engine.load_checkpoint(load_dir, tag=tag, **kwargs)
    resolved = verified_tag(engine, load_dir, tag)
    if resolved is None:
        return engine.load_checkpoint(load_dir, tag=tag, **kwargs)  # no `latest`: DeepSpeed warns, returns (None, None)
    return engine.load_checkpoint(load_dir, tag=resolved, **kwargs)
