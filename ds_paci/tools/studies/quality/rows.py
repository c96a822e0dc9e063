"""The studies' result files: one JSON line per finished run, appended as each run ends, so a study resumes.

``load_rows(path, key)`` reads ``{row[key]: row}`` (a missing file is empty); ``append_row`` writes one line and
syncs it to disk before returning, so a killed study loses at most the run in progress.
"""

from __future__ import annotations

import json
import os


def load_rows(path: str, key: str = "key") -> dict:
    out = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    out[row[key]] = row
    return out


def append_row(path: str, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())
