"""A real ``kill -9`` at every disk step of a save, then a resume from each result (too slow for CI).

    .venv/bin/python tests/kill_every_step.py        # ~40 worlds; about 15 minutes on 2 busy cores

Both ranks, a new-tag save and a same-tag re-save; every disk step the fault hook reports
(each file before and after it is written, the written file also cut to half before the
kill, the manifest, every rename, hard link and ``latest`` replacement). For each step one
2-rank world saves ``A``, then the victim SIGKILLs itself at that step of the next save;
the survivor must fail, not hang. One more world then resumes from every result the way
the main job does and trains a step; each must hold ``A`` or the new content, never a mix.
CI runs three of these kills plus a copy of the folder at every step
(``tests/test_reliability.py``).
"""

import collections
import os
import signal
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fault_workers  # noqa: E402
from harness import run_world  # noqa: E402


def record_events(rank, root, resave):
    """The disk steps each rank goes through in the save after ``A`` (no kill)."""
    from ds_paci.core.checkpoint import atomic as checkpoint
    save_dir = os.path.join(root, "ckpt")
    engine = fault_workers.mlp_engine()
    data = fault_workers.regression_batches(2)
    engine.train_batch(data)
    engine.save_checkpoint(save_dir, tag="A")
    engine.train_batch(data)
    events = []
    checkpoint.set_fault_hook(lambda event, path: events.append(event))
    engine.save_checkpoint(save_dir, tag="A" if resave else "B")
    checkpoint.set_fault_hook(None)
    return events


def main():
    started = time.monotonic()
    scenarios = []
    for resave in (False, True):
        events = run_world(record_events, 2, tempfile.mkdtemp(prefix="events_"), resave, timeout=180)
        for victim, seq in enumerate(events):
            count = collections.Counter()
            for event in seq:
                count[event] += 1
                scenarios.append((victim, event, count[event], False, resave))
                if event == "written":
                    scenarios.append((victim, event, count[event], True, resave))
    print(f"{len(scenarios)} kill points", flush=True)
    folders, failures = [], []
    for i, sc in enumerate(scenarios):
        root = tempfile.mkdtemp(prefix=f"kill{i:02d}_")
        t = time.monotonic()
        status, _, _ = run_world(fault_workers.killed_during_save, 2, root, *sc, timeout=150, expect_failure=True)
        victim = sc[0]
        ok = status[victim] == f"exit {-signal.SIGKILL}" and status[1 - victim] in ("error", "killed")
        print(f"kill {i:2d} {sc}: {status} ({time.monotonic() - t:.0f} s){'' if ok else '  <-- UNEXPECTED'}",
              flush=True)
        if not ok:
            failures.append((sc, status))
        folders.append((os.path.join(root, "ckpt"), sc))
    resumed = run_world(fault_workers.resume_each, 2, [f for f, _ in folders], timeout=900)
    for folder, sc in folders:
        new = "A2" if sc[4] else "B"
        for rank, r in enumerate(resumed):
            got = r[folder]
            if got["which"] not in ("A", new) or not got["trained"]:
                failures.append((sc, f"rank {rank} resumed {got}"))
        print(f"resume after {sc}: {resumed[0][folder]['which']} (tag {resumed[0][folder]['tag']})", flush=True)
    print(f"{len(scenarios)} kills, {len(scenarios) - len(failures)} resumed correctly, "
          f"{time.monotonic() - started:.0f} s", flush=True)
    for f in failures:
        print("FAILED:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
