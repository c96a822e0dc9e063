"""A guard for DeepSpeed versions ds_paci was not tested with: no collective of a local step may span two stages.

Async PACI keeps every collective of a local step inside the stage (its data-parallel group and tensor
slice) by handing DeepSpeed's optimizer wrappers a stage-local view of the grid
(:mod:`ds_paci.core.step.local_step`): ``BF16_Optimizer.mpu``, ZeRO's ``model_parallel_*`` fields. That works
only as long as DeepSpeed reads those fields. A newer DeepSpeed whose wrapper reaches a global group
some other way (DeepSpeed 0.19.8 already reads one on a path PACI does not take) would issue a
collective spanning stages inside one stage's local step, while the other stages are busy with their
own streams: a hang.

So on a DeepSpeed newer than :data:`ds_paci.core.seam.compat.SUPPORTED`'s upper end, the engine runs its
first async local step under :class:`StageCollectiveGuard` (:func:`check_reason` says whether it is
on): every collective of ``torch.distributed`` (which ``deepspeed.comm`` calls) is checked *before it
is entered* (a collective that would hang cannot be seen once entered): the global ranks of its group
must all belong to this stage. One that spans stages raises :class:`CrossStageCollectiveError`, a
single line naming the rank, the collective, the group's ranks and stages, and the fix. The groups
seen are recorded (:meth:`StageCollectiveGuard.summary`, in ``paci_stats()["collective_check"]``).
Point-to-point calls are not collectives and pass (the tied-weight exchange uses them). The check runs
once per engine; later steps run unwrapped.

``DS_PACI_CHECK_COLLECTIVES=1`` forces the check on any version (the tests use it on the newest tested
version), ``=0`` turns it off. Sync mode (``drain_every_batch`` with ``a = M``) is DeepSpeed's own
synchronous step, whose global norm spans stages by design: never checked.
"""

import os

import torch.distributed as tdist
from packaging.version import Version

from . import compat
from . import deepspeed_internals as ds

__all__ = ["CrossStageCollectiveError", "StageCollectiveGuard", "check_reason", "COLLECTIVES", "ENV"]

ENV = "DS_PACI_CHECK_COLLECTIVES"
COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_object",
               "all_gather_coalesced", "_all_gather_base", "broadcast", "broadcast_object_list", "reduce",
               "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "all_to_all", "all_to_all_single",
               "gather", "gather_object", "scatter", "scatter_object_list", "barrier", "monitored_barrier")


class CrossStageCollectiveError(RuntimeError):
    """A collective inside a local step spans two pipeline stages (raised before it is entered)."""


def check_reason(version=None, environ=None):
    """Why the first local step is checked (a phrase for the refusal), or ``None`` when it is not.

    ``version``: the installed DeepSpeed's (default :data:`compat.DS_VERSION`); ``environ``: ``os.environ``.
    """
    environ = os.environ if environ is None else environ
    setting = environ.get(ENV, "").strip()
    if setting == "0":
        return None
    version = Version(str(version or compat.DS_VERSION))
    newest = compat.SUPPORTED[1]
    if Version(version.base_version) > newest:
        return f"checked because deepspeed {version} is newer than the newest version ds_paci was tested with ({newest})"
    if setting == "1":
        return f"checked because {ENV}=1, on deepspeed {version}"
    return None


def _group_of(args, kwargs):
    group = kwargs.get("group")
    if group is None:
        group = next((a for a in args if isinstance(a, tdist.ProcessGroup)), None)
    return group


def _ranks_of(group):
    if group is None or group is tdist.GroupMember.WORLD:
        return tuple(range(tdist.get_world_size()))
    return tuple(tdist.get_process_group_ranks(group))


class StageCollectiveGuard:
    """Context manager around one local step: refuses a collective whose group spans stages (see the module)."""

    def __init__(self, engine, reason):
        self.reason = reason
        self.stage = engine.stage_id
        topo = ds.grid_topology(engine.grid)
        self.stage_of = {r: topo.get_coord(r).pipe for r in range(topo.world_size())}
        self.describe = engine._describe_rank
        self.seen = []  # (collective, ranks) in call order
        self.done = False
        self._originals = {}

    def _check(self, name, args, kwargs):
        ranks = _ranks_of(_group_of(args, kwargs))
        self.seen.append((name, ranks))
        stages = sorted({self.stage_of.get(r, -1) for r in ranks})
        if stages != [self.stage]:
            raise CrossStageCollectiveError(
                f"{self.describe()}: {name} on a group of ranks {list(ranks)} (stages {stages}) inside its first "
                f"local step would span pipeline stages and hang PACI; refused before entering it ({self.reason}). "
                f"Fix: install a tested DeepSpeed (pip install 'deepspeed>={compat.SUPPORTED[0]},"
                f"<={compat.SUPPORTED[1]}'), or use sync mode (\"paci\": {{\"drain_every_batch\": true}})")

    def _wrap(self, name, fn):

        def checked(*args, **kwargs):
            self._check(name, args, kwargs)
            return fn(*args, **kwargs)

        return checked

    def __enter__(self):
        for name in COLLECTIVES:
            fn = getattr(tdist, name, None)
            if fn is not None:
                self._originals[name] = fn
                setattr(tdist, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc):
        for name, fn in self._originals.items():
            setattr(tdist, name, fn)
        self._originals = {}
        self.done = True
        return False

    def summary(self):
        """For ``paci_stats()``: whether the check ran, why, and the collectives it saw (name, ranks)."""
        return {"done": self.done, "reason": self.reason, "collectives": [[n, list(r)] for n, r in self.seen]}
