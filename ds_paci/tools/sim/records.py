"""Trace records: the common currency of engine traces, the simulator and the timeline renderers.

A *record* is one executed instruction of one rank::

    {"rank": 0, "stage": 0, "instr": "F3", "start": 1700000000.10, "end": 1700000000.12}

``instr`` is an action's text form (:mod:`ds_paci.core.program.actions`, the one vocabulary: ``F3``, ``B3``,
``SA3``, ``RG3``, ``L3``, ``ACC3``, ``STEP1``, ``REDUCE_GRADS``/``REDUCE_TIED`` for stock DeepSpeed) without
its bracketed facts (:func:`instr_text`), ``start``/``end`` are seconds (wall clock for engine traces, comparable
across the processes of one machine). The engine writes one JSON-lines file per rank
(:meth:`ds_paci.PACIPipelineEngine.write_trace`); :func:`records_from_sim` turns a
simulation into the same records. This module sits below both the simulator and the
renderers and imports neither.
"""

import glob
import json
import os
import re

from ds_paci.core.program.actions import Kind, format_action

__all__ = ["COMPUTE_KINDS", "instr_text", "kind_of", "micro_batch_in", "load_records", "records_from_sim"]

_RECORD_KIND = {Kind.LOAD: "load", Kind.FORWARD: "forward", Kind.BACKWARD: "backward", Kind.SEND_ACT: "send",
                Kind.SEND_GRAD: "send", Kind.RECV_ACT: "recv", Kind.RECV_GRAD: "recv", Kind.ACCUMULATE: "step",
                Kind.STEP: "step", Kind.REDUCE_GRADS: "step", Kind.REDUCE_TIED: "step"}
# the text codes of :class:`Kind`, longest first so that no code shadows a longer one
_CODE = re.compile("^(" + "|".join(sorted((re.escape(k.value) for k in Kind), key=len, reverse=True)) + ")")
_NUMBER = re.compile(r"(\d+)$")
COMPUTE_KINDS = ("forward", "backward", "step", "load")


def instr_text(action):
    """The record text of an :class:`~ds_paci.core.program.actions.Action`: its text form without the bracketed facts
    (``F3[0,x]`` -> ``F3``, ``STEP2[lr2]`` -> ``STEP2``), as engines write it."""
    return format_action(action, facts=False)


def _kind_code(instr):
    match = _CODE.match(instr)
    return Kind(match.group(1)) if match else None


def kind_of(instr):
    """Kind of an instruction text: forward, backward, step, load, send, recv, or other."""
    return _RECORD_KIND.get(_kind_code(instr), "other")


def micro_batch_in(instr):
    """Micro-batch id in an instruction text (``F3`` -> 3), ``None`` for steps and reductions."""
    if kind_of(instr) == "step":
        return None
    match = _NUMBER.search(instr)
    return int(match.group(1)) if match else None


# -- sources ----------------------------------------------------------------------------


def load_records(paths_or_dir):
    """Records from JSON-lines files (one per rank) or a directory of ``*.jsonl`` files.

    Accepts a path or a list of paths; a ``.json`` file may also hold a JSON list of
    records. Returns the records sorted by (stage, rank, start).
    """
    if isinstance(paths_or_dir, (str, os.PathLike)):
        paths_or_dir = [paths_or_dir]
    files = []
    for path in map(str, paths_or_dir):
        if os.path.isdir(path):
            found = sorted(glob.glob(os.path.join(path, "*.jsonl")))
            if not found:
                raise FileNotFoundError(f"no *.jsonl trace files in {path}")
            files.extend(found)
        else:
            files.append(path)
    records = []
    for path in files:
        with open(path) as f:
            if path.endswith(".json"):
                records.extend(json.load(f))
            else:
                records.extend(json.loads(line) for line in f if line.strip())
    for rec in records:
        missing = {"rank", "stage", "instr", "start", "end"} - rec.keys()
        if missing:
            raise ValueError(f"trace record {rec} lacks {sorted(missing)}")
    records.sort(key=lambda r: (r["stage"], r["rank"], r["start"]))
    return records


def records_from_sim(result, seconds_per_unit=1.0):
    """The records an engine would have written for a :class:`ds_paci.tools.sim.simulate.SimResult`.

    One record per executed instruction; rank = stage. A simulated wait and the
    transfer that follows it become one send/recv record, as an engine timing the
    blocking call would see it.
    """
    records = []
    for stage, events in enumerate(result.events):
        wait_start = None
        for e in events:
            if e.kind == "wait":
                wait_start = e.start
                continue
            start = e.start if wait_start is None else wait_start
            wait_start = None
            records.append({
                "rank": stage,
                "stage": stage,
                "instr": e.text,
                "start": start * seconds_per_unit,
                "end": e.end * seconds_per_unit
            })
    return records

