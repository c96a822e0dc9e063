"""Which checkpoint folder every rank loads: each rank's view of its own disk, combined into one choice.

With node-local disks a rank sees only its own node's copy of a checkpoint, so no rank can decide alone that a
checkpoint is complete: it is complete only if it is complete on every rank's disk, and it must be the same save
everywhere (the manifest's ``save_id``). Public contract:

* :func:`local_view` (file system only): this rank's ``latest``; every checkpoint folder of the directory with its
  status (:func:`ds_paci.core.checkpoint.atomic.verify`), save id and time; the complete folders of interrupted saves
  (hidden names, since another node may hold the same save under its final name); the folder asked for.
* :func:`choose` (pure): from every rank's view, the folder each rank loads (one save on every rank, possibly
  under a different folder name on different disks), or :class:`~ds_paci.core.checkpoint.atomic.CheckpointError`
  with one line naming the node, its file and the last checkpoint complete on every node. Modes: ``"tag"``
  (the folder asked for), ``"latest"`` (the newest save some rank's ``latest`` names that is complete on every
  rank), ``"resume"`` (as ``"latest"``, else the last checkpoint complete on every node, with a note saying why).
  On one node the messages are those of a single disk.
* :func:`agree` (a collective on the default group): gathers the views and chooses; every rank gets the same
  answer or the same error.
"""

import os

from .files import ABSENT, COMPLETE, INCOMPLETE, LEGACY
from ..health.nodes import NodeMap


def _entry(status, detail, manifest, hidden):
    entry = {"status": status, "detail": detail, "hidden": hidden, "id": None, "at": 0.0, "tag": None}
    if status == COMPLETE:
        entry["at"] = float(manifest.get("saved_at", 0.0))
        entry["tag"] = manifest.get("tag")
        entry["id"] = manifest.get("save_id") or f"{entry['tag']}@{entry['at']!r}"
    return entry


def local_view(load_dir, asked=None):
    """This rank's view of ``load_dir`` (see the module docstring); reads the file system only."""
    from .files import _INTERRUPTED, read_latest, verify
    from ..health.nodes import node_label
    folders = {}
    try:
        names = sorted(os.listdir(load_dir))
    except OSError:
        names = []
    for name in names:
        hidden = name.startswith(".")
        if hidden and not name.startswith(_INTERRUPTED):
            continue
        full = os.path.join(load_dir, name)
        if not os.path.isdir(full):
            continue
        status, detail, manifest = verify(full)
        if hidden and status != COMPLETE:
            continue
        folders[name] = _entry(status, detail, manifest, hidden)
    latest = read_latest(load_dir)
    for name in (latest, asked):
        if name is not None and name not in folders:
            status, detail, manifest = verify(os.path.join(load_dir, name))
            folders[name] = _entry(status, detail, manifest, name.startswith("."))
    return {"node": node_label(), "latest": latest, "asked": asked, "folders": folders}


class _Views:
    """Every rank's view, with the questions :func:`choose` asks of them."""

    def __init__(self, views, load_dir):
        self.views, self.dir = views, load_dir
        self.nodes = NodeMap([v["node"] for v in views])
        self.multi = len(self.nodes.nodes) > 1

    def where(self, ranks):
        return f" on {self.nodes.describe(ranks)}" if self.multi else ""

    def holder(self, view, sid):
        """The folder of ``view`` holding save ``sid`` complete (its ``latest`` first, then visible names), or None."""
        folders = view["folders"]
        order = ([view["latest"]] if view["latest"] in folders else []) + sorted(
            folders, key=lambda n: (folders[n]["hidden"], n))
        for name in order:
            e = folders[name]
            if e["status"] == COMPLETE and e["id"] == sid:
                return name
        return None

    def everywhere(self, sid):
        names = [self.holder(v, sid) for v in self.views]
        return names if all(n is not None for n in names) else None

    def last_everywhere(self):
        """``(name, save id)`` of the newest visible folder complete with the same save on every rank, or None."""
        best = None
        for name, e in self.views[0]["folders"].items():
            if e["hidden"] or e["status"] != COMPLETE:
                continue
            if all(v["folders"].get(name, {}).get("id") == e["id"] and v["folders"][name]["status"] == COMPLETE
                   for v in self.views):
                key = (e["at"], name)
                if best is None or key > best[0]:
                    best = (key, name, e["id"])
        return (best[1], best[2]) if best else None

    def hint(self):
        last = self.last_everywhere()
        where = " on every node" if self.multi else ""
        if last is None:
            return "no checkpoint is complete on every node" if self.multi else "no complete checkpoint is in this folder"
        return (f"the last complete checkpoint{where} is '{last[0]}' (load it with tag='{last[0]}'; the main job's "
                "--resume falls back to it)")

    def problem(self, name_of):
        """``(ranks, folder, status, detail)`` for the first rank whose folder ``name_of(rank)`` is not complete."""
        for r, v in enumerate(self.views):
            name = name_of(r)
            e = v["folders"].get(name) or {"status": ABSENT, "detail": None}
            if e["status"] in (INCOMPLETE, ABSENT):
                same = [q for q, w in enumerate(self.views) if name_of(q) == name and
                        (w["folders"].get(name) or {"detail": None})["detail"] == e["detail"]]
                return same, os.path.join(self.dir, name), e["status"], e["detail"]
        return None


def _what(status, detail, resume):
    if status == ABSENT:
        return "does not exist"
    if status == INCOMPLETE:
        return f"is incomplete ({detail})" if resume else f"is incomplete: {detail}"
    return detail


def _named_saves(vs):
    """Save ids some rank's ``latest`` names (complete there), newest first."""
    found = {}
    for v in vs.views:
        e = v["folders"].get(v["latest"]) if v["latest"] is not None else None
        if e is not None and e["status"] == COMPLETE:
            found[e["id"]] = max(found.get(e["id"], 0.0), e["at"])
    return sorted(found, key=lambda sid: found[sid], reverse=True)


def _choose_tag(vs):
    from .files import CheckpointError
    problem = vs.problem(lambda r: vs.views[r]["asked"])
    if problem is not None:
        ranks, folder, status, detail = problem
        raise CheckpointError(f"cannot load checkpoint from {vs.dir}: tag '{vs.views[ranks[0]]['asked']}':"
                              f"{vs.where(ranks)} {folder} {_what(status, detail, False)}; {vs.hint()}")
    entries = [v["folders"][v["asked"]] for v in vs.views]
    ids = {}
    for r, e in enumerate(entries):
        if e["status"] == COMPLETE:
            ids.setdefault(e["id"], []).append(r)
    if len(ids) > 1:
        groups = sorted(ids.values())
        raise CheckpointError(f"cannot load checkpoint from {vs.dir}: tag '{vs.views[0]['asked']}' holds different "
                              f"saves on {vs.nodes.describe(groups[0])} and {vs.nodes.describe(groups[1])} (a save "
                              f"interrupted between the commits of its nodes); {vs.hint()}")
    return [v["asked"] for v in vs.views], [r for r, e in enumerate(entries) if e["status"] == LEGACY]


def _choose_named(vs):
    """``(folders, legacy ranks)`` for the newest save ``latest`` names that every rank holds; None when none."""
    for sid in _named_saves(vs):
        names = vs.everywhere(sid)
        if names is not None:
            return names, []
    latests = [v["latest"] for v in vs.views]
    if latests[0] is not None and len(set(latests)) == 1:
        statuses = {v["folders"][latests[0]]["status"] for v in vs.views}
        if statuses <= {COMPLETE, LEGACY} and LEGACY in statuses:
            return latests, [r for r, v in enumerate(vs.views) if v["folders"][latests[0]]["status"] == LEGACY]
    return None


def _latest_problem(vs):
    """``(latest, ranks, folder, status, detail)``: why no save ``latest`` names is complete on every rank."""
    first = next(v["latest"] for v in vs.views if v["latest"] is not None)
    problem = vs.problem(lambda r: vs.views[r]["latest"] or first)
    if problem is not None:
        ranks, folder, status, detail = problem
        return vs.views[ranks[0]]["latest"] or first, ranks, folder, status, detail
    sid = _named_saves(vs)[0]
    ranks = [r for r, v in enumerate(vs.views) if vs.holder(v, sid) is None]
    latest = next(v["latest"] for v in vs.views if vs.holder(v, sid) == v["latest"])
    return latest, ranks, os.path.join(vs.dir, latest), "other", "holds a different save"


def choose(views, load_dir, mode):
    """The folder each rank loads (a list by rank; ``None`` entries: no ``latest`` anywhere) and a note or None.

    See the module docstring; raises :class:`~ds_paci.core.checkpoint.atomic.CheckpointError` where no save is
    complete on every rank.
    """
    from .files import CheckpointError
    vs = _Views(views, load_dir)
    everywhere = " on every node" if vs.multi else ""
    if mode == "tag":
        names, legacy = _choose_tag(vs)
        return names, _legacy_note(vs, names, legacy)
    if all(v["latest"] is None for v in vs.views):
        if mode == "latest":
            return [None] * len(views), None
        last = vs.last_everywhere()
        if last is None:
            raise CheckpointError(f"{load_dir} holds no checkpoint (no 'latest' file and no complete checkpoint "
                                  f"folder{everywhere})")
        return vs.everywhere(last[1]), (f"{load_dir} has no 'latest' file; resuming from the last complete "
                                        f"checkpoint{everywhere} '{last[0]}'")
    chosen = _choose_named(vs)
    if chosen is not None:
        return chosen[0], _legacy_note(vs, *chosen)
    latest, ranks, folder, status, detail = _latest_problem(vs)
    if mode == "latest":
        raise CheckpointError(f"cannot load checkpoint from {load_dir}: 'latest' names '{latest}', but"
                              f"{vs.where(ranks)} {folder} {_what(status, detail, False)}; {vs.hint()}")
    why = f"{vs.where(ranks)} {_what(status, detail, True)}".lstrip()
    last = vs.last_everywhere()
    if last is not None:
        return vs.everywhere(last[1]), (f"'latest' names '{latest}', which {why}; resuming from the last complete "
                                        f"checkpoint{everywhere} '{last[0]}'")
    raise CheckpointError(f"{load_dir} holds no complete checkpoint{everywhere}: 'latest' names '{latest}', which "
                          f"{why}, and no other complete checkpoint folder is there")


def _legacy_note(vs, names, legacy):
    from .files import MANIFEST
    if not legacy:
        return None
    return (f"checkpoint '{names[legacy[0]]}'{vs.where(legacy)} has no {MANIFEST} (saved by stock DeepSpeed or an "
            "older ds_paci); loading it unverified")


def agree(load_dir, mode, asked=None):
    """:func:`choose` over every rank's :func:`local_view`: ``(this rank's folder, note)``, the same on all ranks."""
    import torch.distributed as tdist
    view = local_view(load_dir, asked)
    views = [None] * tdist.get_world_size()
    tdist.all_gather_object(views, view)
    error, result = None, None
    from .files import CheckpointError
    try:
        names, note = choose(views, load_dir, mode)
        result = (names[tdist.get_rank()], note)
    except CheckpointError as e:
        error = e
    if error is not None:
        raise error
    return result
