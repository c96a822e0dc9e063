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
(the relative path and size of every file of the checkpoint on that disk, the save's id and
time, written last). Every rank calls it (a save is collective, as in DeepSpeed):

1. All ranks agree on a save id and time (rank 0's, broadcast) and the staging name
   ``.ds_paci-staging.<tag>.<id>``, and find out which ranks share a disk
   (:func:`ds_paci.core.checkpoint.disks.probe_disks`: one exclusive create per rank; not
   taken from DeepSpeed's ``use_node_local_storage``). Each disk's committer (its lowest rank)
   removes stale ``.ds_paci-*`` folders of earlier, killed saves (never the one ``latest``
   names). Barrier.
2. Every rank runs DeepSpeed's own ``save_checkpoint`` into the staging folder with
   ``save_latest=False`` (DeepSpeed decides who writes what, ``use_node_local_storage``
   included); each file is fsynced after it is written and recorded with its size. DeepSpeed
   ends with a barrier. Every rank's record is gathered (the manifest is built from these
   reports, never from a directory walk, which on NFS may miss other clients' files). A disk
   lacking a file one of its ranks will load (a stage's layer files, written by data-parallel
   rank 0 on another node) receives a copy (:func:`~ds_paci.core.checkpoint.disks.replicate`).
3. One disk for all ranks: its committer writes the manifest into the staging folder, renames
   the staging folder to ``<tag>``, then replaces ``latest`` (``latest.tmp`` + ``os.replace``).
   If ``<tag>`` already exists (a re-save of the same tag), ``latest`` first names the complete
   staging folder, the old ``<tag>`` is moved aside, a hard-linked copy of the staging folder
   is renamed to ``<tag>``, and only then does ``latest`` name ``<tag>`` again.
   Several disks (node-local disks): in three steps with a collective between them, every
   committer writes its disk's manifest; every committer renames its staging folder to
   ``<tag>`` (an old ``<tag>`` moved aside first); only then does each committer replace its
   ``latest``. A committer's error stops the save on every rank with one line naming its node.
4. Barrier.

So on every disk ``latest`` only ever moves from one complete folder to another, a folder named
``<tag>`` only ever appears complete, and with several disks ``latest`` moves only once every
disk holds the new save. A kill at any point leaves at worst a hidden ``.ds_paci-*`` folder,
removed by the next save.

:func:`verify` checks a checkpoint folder against its manifest (each file present with the
recorded size). Loading (:func:`verified_tag`, run by every ``load_checkpoint`` here) is agreed
by all ranks (:mod:`ds_paci.core.checkpoint.choice`): each rank describes its own disk, and the
save loaded is one that is complete on every rank's disk; otherwise every rank raises
:class:`CheckpointError` with one line naming the node, its missing or truncated file and the
last checkpoint complete on every node. Folders without a manifest (stock DeepSpeed, older
ds_paci) load with a warning. :func:`resume_tag` (one disk, file system only) and
:func:`agreed_resume_tag` (all ranks) give what a resume loads: ``latest``, else the newest
complete checkpoint (the main job's ``--resume`` fallback). :func:`last_complete` lists the
newest complete checkpoint of a folder.

An engine whose DeepSpeed checkpoint engine is *decoupled* (asynchronous writer) saves
the DeepSpeed way, with a warning: its files are not on disk when the save returns.

Fault injection (tests): :func:`set_fault_hook` installs ``hook(event, path)`` called at
every step that touches the disk: ``"write"`` / ``"written"`` around each checkpoint file
(on the writing rank), ``"receive"`` (a copy for another disk, on its receiver), ``"manifest"``,
``"rename"``, ``"link"``, ``"latest"`` (committer).
"""

import errno
import functools
import json
import os
import shutil
import time

from . import choice
from . import disks
from .files import (_INTERRUPTED, _LINKING, _REPLACED, _STAGING, ABSENT, COMPLETE, HIDDEN_PREFIX,  # noqa: F401
                               INCOMPLETE, LATEST, LEGACY, MANIFEST, MANIFEST_FORMAT, CheckpointError, read_latest,
                               verify)

_fault_hook = None
_warned = set()


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
    """``(tag, note)``: what a resume should load from ``save_dir``, as this rank's disk alone says.

    The tag ``latest`` names when that checkpoint is complete (``note`` is ``None``) or has no
    manifest (``note`` says it is loaded unverified); otherwise the newest complete
    checkpoint, with a one-line ``note`` saying why. Raises :class:`CheckpointError` when
    there is none. Reads the file system only; :func:`agreed_resume_tag` is the same choice
    made by all ranks together (for disks that differ between nodes).
    """
    names, note = choice.choose([choice.local_view(save_dir)], save_dir, "resume")
    return names[0], note


def resolve_tag(load_dir, tag=None):
    """The tag to load: ``tag``, or what ``latest`` names (``None`` when there is no ``latest``).

    Raises :class:`CheckpointError` (one line) when that checkpoint is absent or incomplete;
    warns once when it has no manifest. Reads the file system only.
    """
    tag = None if tag is None else str(tag)
    names, note = choice.choose([choice.local_view(load_dir, tag)], load_dir, "latest" if tag is None else "tag")
    if note:
        _warn_once(note, f"ds_paci: {note}")
    return names[0]


# -- saving -------------------------------------------------------------------------------------
class _SyncedWrites:
    """Wraps a DeepSpeed checkpoint engine: every file it saves is fsynced, reported to the fault hook, and recorded
    (``files``: path relative to ``folder`` -> size, as the writer sees it after the fsync)."""

    def __init__(self, inner, folder):
        self._inner = inner
        self._folder = folder
        self.files = {}

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def save(self, state_dict, path):
        _fire("write", path)
        self._inner.save(state_dict, path)
        _fsync_path(path)
        rel = os.path.relpath(os.fspath(path), self._folder).replace(os.sep, "/")
        if not rel.startswith("../"):
            self.files[rel] = os.path.getsize(path)
        _fire("written", path)


def _agree_nonce(engine):
    """Rank 0's ``(nonce, time)`` for this save, broadcast: the staging name, the save id, the manifests' time."""
    import torch
    from deepspeed import comm as dist
    now = time.time_ns()
    value = torch.tensor([now ^ os.getpid(), now], dtype=torch.int64, device=engine.device)
    dist.broadcast(value, src=0)
    return f"{int(value[0].item()) & 0xFFFFFFFFFFFF:012x}", int(value[1].item()) / 1e9


def _remove_stale(save_dir, keep):
    try:
        names = os.listdir(save_dir)
    except OSError:
        return
    for name in names:
        if name.startswith(HIDDEN_PREFIX) and name != keep:
            path = os.path.join(save_dir, name)
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    os.remove(path)
                except OSError:
                    pass
    try:
        os.remove(os.path.join(save_dir, LATEST + ".tmp"))
    except OSError:
        pass


def _write_manifest(staging, manifest):
    for root, _, _ in os.walk(staging):  # fsync only: the file list comes from what every rank reported
        _fsync_path(root, directory=True)
    path = os.path.join(staging, MANIFEST)
    _fire("manifest", path)
    with open(path, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    _fsync_path(staging, directory=True)


def _commit(save_dir, tag, staging_name, save_latest, manifest):
    """One disk for every rank: manifest, rename, ``latest`` (a same-tag re-save swaps with ``latest`` on staging)."""
    staging = os.path.join(save_dir, staging_name)
    final = os.path.join(save_dir, tag)
    _write_manifest(staging, manifest)
    move_latest = save_latest or read_latest(save_dir) == tag
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


def _agree_step(committer, step, tag):
    """Run ``step`` on the committers; every rank learns every committer's error and raises the first, one line."""
    import torch.distributed as tdist

    from ..health.nodes import NodeMap, node_label
    error = None
    if committer:
        try:
            step()
        except OSError as e:
            error = f"{type(e).__name__}: {e}"
    out = [None] * tdist.get_world_size()
    tdist.all_gather_object(out, (error, node_label()))
    failed = [r for r, (e, _) in enumerate(out) if e is not None]
    if failed:
        where = NodeMap([label for _, label in out]).describe([failed[0]])
        raise CheckpointError(f"checkpoint '{tag}' was not saved: the commit failed on {where} ({out[failed[0]][0]}); "
                              "'latest' still names the previous checkpoint on every disk")


def _commit_disks(layout, save_dir, tag, staging_name, save_latest, manifest):
    """Several disks: every disk commits its files, and only then does ``latest`` move on any of them."""
    from deepspeed import comm as dist
    committer = layout.committer(dist.get_rank()) == dist.get_rank()
    staging = os.path.join(save_dir, staging_name)
    final = os.path.join(save_dir, tag)
    replaced = os.path.join(save_dir, f"{_REPLACED}{_flat(tag)}.{staging_name.rsplit('.', 1)[-1]}")
    move_latest = committer and (save_latest or read_latest(save_dir) == tag)

    def swap_in():
        if os.path.lexists(final):  # a re-save: the old save stays whole, under a hidden name, until `latest` moves
            _rename(final, replaced)
        os.makedirs(os.path.dirname(final), exist_ok=True)
        _rename(staging, final)
        _fsync_path(os.path.dirname(final), directory=True)

    _agree_step(committer, lambda: _write_manifest(staging, manifest), tag)  # 1: each disk holds its complete files
    _agree_step(committer, swap_in, tag)  # 2: each disk names them <tag>
    if move_latest:  # 3: `latest` moves only once every disk has committed
        _write_latest(save_dir, tag)
    if committer:
        shutil.rmtree(replaced, ignore_errors=True)
    dist.barrier()


def _refuse_unwritten(engine, tag, reports, keys, expected):
    """A save some rank could not load from (its stage's model-states file written by nobody) is not committed."""
    missing = disks.unwritten(reports, keys, expected)
    if not missing:
        return
    node_local = getattr(engine, "use_node_local_storage", lambda: False)()
    who = ("local rank 0 of each node (checkpoint.use_node_local_storage), and no node has a replica of this stage at "
           "local rank 0; turn use_node_local_storage off (ds_paci copies each disk the files it lacks) or place the "
           "ranks so that one does" if node_local else "data-parallel rank 0 of each stage")
    raise CheckpointError(f"checkpoint '{tag}' was not saved: no rank wrote {expected[missing[0]]}, which rank "
                          f"{missing[0]} loads (DeepSpeed writes it from {who}); 'latest' still names the previous "
                          "checkpoint")


def _flat(tag):
    return tag.replace("/", "%2F").replace(os.sep, "%2F")


def atomic_save(engine, save_dir, tag, save_latest, write):
    """Save with the protocol of the module docstring. ``write(staging_tag)`` runs DeepSpeed's own save.

    ``write`` must call DeepSpeed's ``save_checkpoint(save_dir, tag=staging_tag, save_latest=False, ...)``.
    Every rank calls this; returns ``True`` like DeepSpeed.
    """
    from deepspeed import comm as dist

    from ..seam import deepspeed_internals as ds
    if not save_dir:
        raise ValueError(f"save_dir must be a non-empty string, got {save_dir!r}")
    save_dir = os.fspath(save_dir)
    tag = str(tag if tag is not None else f"global_step{engine.global_steps}")
    ckpt_engine = ds.checkpoint_engine(engine)
    if ckpt_engine is not None and ckpt_engine.is_decoupled():
        _warn_once("decoupled", "ds_paci: the decoupled DeepSpeed checkpoint writer is asynchronous; checkpoints are "
                   "saved the DeepSpeed way, without the ds_paci completeness manifest")
        return write(tag, save_latest=save_latest)
    nonce, saved_at = _agree_nonce(engine)
    staging_name = f"{_STAGING}{_flat(tag)}.{nonce}"
    staging = os.path.join(save_dir, staging_name)
    layout = disks.probe_disks(save_dir, nonce)
    me = dist.get_rank()
    committer = layout.committer(me) == me
    if committer:
        _remove_stale(save_dir, keep=read_latest(save_dir))
    dist.barrier()
    synced = _SyncedWrites(ckpt_engine, staging)
    ds.set_checkpoint_engine(engine, synced)
    try:
        write(staging_name, save_latest=False)  # ends with DeepSpeed's barrier: every rank's files are written
    finally:
        ds.set_checkpoint_engine(engine, ckpt_engine)
    reports, keys, expected = disks.gather_reports(synced.files, disks.replica_key(engine),
                                                   disks.expected_model_file(engine, staging_name))
    _refuse_unwritten(engine, tag, reports, keys, expected)
    plan = disks.replication_plan(layout, reports, keys, expected)
    disks.replicate(plan, staging, fire=_fire)
    manifest = {
        "format": MANIFEST_FORMAT, "tag": tag, "save_id": nonce, "saved_at": saved_at,
        "global_steps": int(getattr(engine, "global_steps", 0)), "world_size": dist.get_world_size(),
        "disk": {"ranks": layout.peers(me), "disks": len(layout.groups)},
        "files": disks.group_files(layout, reports, plan, layout.group_of[me]),
    }
    if len(layout.groups) == 1:
        if committer:
            _commit(save_dir, tag, staging_name, save_latest, manifest)
        dist.barrier()
    else:
        _commit_disks(layout, save_dir, tag, staging_name, save_latest, manifest)
    return True


def verified_tag(engine, load_dir, tag=None):
    """The folder this rank loads, agreed by all ranks (:mod:`ds_paci.core.checkpoint.choice`): ``tag``, or the save
    ``latest`` names that is complete on every rank's disk (``None`` when no rank has a ``latest``). Raises
    :class:`CheckpointError` on every rank, with the same line, when there is none.

    Universal checkpoints (``latest_universal``, DeepSpeed's own conversion format) are passed through unverified.
    """
    if getattr(engine, "load_universal_checkpoint", lambda: False)():
        return tag
    name, note = choice.agree(load_dir, "latest" if tag is None else "tag", None if tag is None else str(tag))
    if note:
        _warn_once(note, f"ds_paci: {note}")
    return name


def agreed_resume_tag(load_dir):
    """:func:`resume_tag` decided by all ranks together (a collective): ``(this rank's folder, note)``.

    Use it when the ranks' disks may differ (node-local disks): the save loaded is complete on every rank's disk.
    """
    return choice.agree(load_dir, "resume")


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
