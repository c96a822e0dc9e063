"""Checkpoint files across disks: which ranks share one, what each disk must hold, and copying what it lacks.

Every function taking no ``plan`` is a collective over the default group (a save is collective anyway). Public
contract:

* :func:`probe_disks`: which ranks see the same ``save_dir``. Every rank tries to create the same file with
  ``O_CREAT | O_EXCL``, which is atomic on local file systems and on NFS v3 and later; on each disk exactly one
  rank succeeds and writes its rank into it. After a barrier every rank reads the file's owner (close-to-open:
  the owner has closed it). Ranks with the same owner share a disk: a :class:`DiskLayout` group, whose committer
  is its lowest rank. Nothing is taken on trust from DeepSpeed's ``checkpoint.use_node_local_storage``, which
  still decides, as in DeepSpeed, which rank writes which file.
* :func:`gather_reports`: every rank's written files ``{path relative to the checkpoint folder: size}`` (what
  :class:`ds_paci.core.checkpoint.atomic` saw it write, sizes taken by the writer after its fsync), its replica key
  (the model-parallel rank: ranks with the same key hold the same part of the model and load the same files)
  and the model-states file it will load; :func:`unwritten` names the ranks whose file nobody wrote (DeepSpeed's
  ``use_node_local_storage`` writes it from local rank 0 of each node only, which may hold no replica of a
  stage).
* :func:`replication_plan` (pure): for each disk group, the files its ranks will load that no rank of the group
  wrote, each with a source rank on another disk and the group's lowest rank that needs it as receiver: every file
  written by a rank with the same replica key (a stage's layer files, which DeepSpeed writes from data-parallel
  rank 0 only, so on one node), and every stage's model-states file (DeepSpeed's loader lists them all and checks
  their number on every rank; without ZeRO they hold each stage's optimizer state, so each disk then holds all of
  it).
* :func:`replicate`: runs a plan over a gloo group (point-to-point, in 64 MiB pieces, in the plan's order on
  every rank, so the pairs always match); each received file is fsynced.
"""

import errno
import os
from typing import List, NamedTuple

PROBE_PREFIX = ".ds_paci-probe."
CHUNK = 64 << 20

_transfer_group = {}


class DiskLayout(NamedTuple):
    """``groups[i]``: the ranks sharing disk ``i`` (sorted); ``group_of[rank]``: the index of its disk."""

    groups: List[List[int]]
    group_of: List[int]

    def committer(self, rank):
        return self.groups[self.group_of[rank]][0]

    def peers(self, rank):
        return self.groups[self.group_of[rank]]


def probe_disks(save_dir, nonce):
    """The :class:`DiskLayout` of ``save_dir`` for this save (see the module docstring). Every rank calls it."""
    import torch.distributed as tdist
    rank = tdist.get_rank()
    path = os.path.join(save_dir, PROBE_PREFIX + nonce)
    os.makedirs(save_dir, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        pass
    else:
        try:
            os.write(fd, str(rank).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
    tdist.barrier()
    owner = _read_owner(path)
    owners = [None] * tdist.get_world_size()
    tdist.all_gather_object(owners, owner)
    return layout_from_owners(owners)


def _read_owner(path):
    """The rank written into the probe file (re-read briefly: an exclusive create is visible before its data)."""
    import time
    for _ in range(50):
        try:
            with open(path) as f:
                text = f.read().strip()
            if text.isdigit():
                return int(text)
        except OSError as e:
            if e.errno != errno.ENOENT:
                raise
        time.sleep(0.02)
    raise OSError(f"the disk probe {path} could not be read; is the checkpoint folder on a file system that "
                  "supports exclusive create (NFS v3 or later)?")


def layout_from_owners(owners):
    """:class:`DiskLayout` from each rank's probe owner (pure)."""
    by_owner = {}
    for rank, owner in enumerate(owners):
        by_owner.setdefault(owner, []).append(rank)
    groups = sorted(by_owner.values())
    group_of = [0] * len(owners)
    for i, ranks in enumerate(groups):
        for r in ranks:
            group_of[r] = i
    return DiskLayout(groups, group_of)


def replica_key(engine):
    """Ranks with the same key load the same model files: DeepSpeed's checkpoint model-parallel rank."""
    from ..seam import deepspeed_internals  # imports DeepSpeed: only where an engine is at hand
    mpu = deepspeed_internals.engine_mpu(engine)
    if mpu is not None and hasattr(mpu, "get_model_parallel_rank"):
        return int(mpu.get_model_parallel_rank())
    return 0


def expected_model_file(engine, folder_name):
    """The model-states file this rank will load, relative to the checkpoint folder (DeepSpeed's own name), or None."""
    from ..seam import deepspeed_internals
    name_of = deepspeed_internals.model_states_file_namer(engine)
    if name_of is None:
        return None
    try:
        return os.path.basename(name_of("", folder_name))
    except Exception:  # an engine layout this check does not know (it is a safety net, not a requirement)
        return None


def gather_reports(files, key, expected=None):
    """``(reports, keys, expected)`` of every rank: ``reports[r] = {relative path: size}``, ``keys[r]`` its replica
    key, ``expected[r]`` the model-states file it loads (or None)."""
    import torch.distributed as tdist
    out = [None] * tdist.get_world_size()
    tdist.all_gather_object(out, (dict(files), key, expected))
    return [r for r, _, _ in out], [k for _, k, _ in out], [e for _, _, e in out]


def unwritten(reports, keys, expected):
    """Ranks whose model-states file no rank with the same replica key wrote (pure)."""
    missing = []
    for r, name in enumerate(expected):
        if name and not any(name in reports[w] for w in range(len(reports)) if keys[w] == keys[r]):
            missing.append(r)
    return missing


class Transfer(NamedTuple):
    rel: str
    size: int
    src: int
    dst: int


def replication_plan(layout, reports, keys, expected=()):
    """The files each disk lacks, as :class:`Transfer` s in one order every rank computes alike (pure).

    A disk needs every file written by a rank with the same replica key as one of its ranks, and every
    model-states file (``expected``: DeepSpeed's loader lists them all, checks their number against the saved
    model-parallel size and reads the first, on every rank).
    """
    every_model_file = {name for name in expected if name}
    plan = []
    for group in layout.groups:
        members = set(group)
        have = set()
        for r in group:
            have.update(reports[r])
        need = {}
        for w in range(len(reports)):
            if w in members:
                continue
            wanted = [r for r in group if keys[r] == keys[w]]
            for rel, size in sorted(reports[w].items()):
                if rel in have or rel in need or not (wanted or rel in every_model_file):
                    continue
                need[rel] = Transfer(rel, int(size), w, (wanted or group)[0])
        plan.extend(need[rel] for rel in sorted(need))
    return plan


def group_files(layout, reports, plan, group_index):
    """``{relative path: size}`` a disk group holds once the plan has run: its own writes and its received files."""
    files = {}
    for r in layout.groups[group_index]:
        for rel, size in reports[r].items():
            if rel in files and files[rel] != size:
                raise OSError(f"ranks of one disk wrote {rel} with different sizes ({files[rel]:,} and {size:,} "
                              "bytes)")
            files[rel] = int(size)
    for t in plan:
        if layout.group_of[t.dst] == group_index:
            files[t.rel] = t.size
    return files


def _group():
    import torch.distributed as tdist
    if tdist.get_backend() == "gloo":
        return None
    key = id(tdist.group.WORLD)
    if key not in _transfer_group:
        _transfer_group[key] = tdist.new_group(backend="gloo")
    return _transfer_group[key]


def replicate(plan, folder, fire=None):
    """Run ``plan``: the source of each transfer sends its file below ``folder``, the receiver writes it there."""
    if not plan:
        return
    import torch
    import torch.distributed as tdist
    group = _group()
    me = tdist.get_rank()
    for t in plan:
        if me not in (t.src, t.dst):
            continue
        path = os.path.join(folder, *t.rel.split("/"))
        if me == t.src:
            with open(path, "rb") as f:
                for start in range(0, t.size, CHUNK):
                    piece = bytearray(f.read(min(CHUNK, t.size - start)))
                    tdist.send(torch.frombuffer(piece, dtype=torch.uint8), t.dst, group=group)
            continue
        if fire is not None:
            fire("receive", path)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            for start in range(0, t.size, CHUNK):
                piece = torch.empty(min(CHUNK, t.size - start), dtype=torch.uint8)
                tdist.recv(piece, t.src, group=group)
                f.write(piece.numpy().tobytes())
            f.flush()
            os.fsync(f.fileno())
