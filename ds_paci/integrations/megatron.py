"""Megatron-DeepSpeed's ``pretrain_gpt.py`` on ds_paci: data, launch command and log parsing.

Nothing here is needed to *run* Megatron on PACI: a user adds ``"paci": {"enabled": true}`` to the DeepSpeed
config Megatron already takes and starts ``pretrain_gpt.py`` through the script runner
(:mod:`ds_paci.integrations.runner`)::

    deepspeed --num_gpus 2 --module ds_paci.run <Megatron-DeepSpeed>/pretrain_gpt.py <Megatron arguments> \\
        --deepspeed --deepspeed_config ds_paci.json

This module holds what the README's Megatron commands (``python -m ds_paci.integrations.megatron prepare``,
``make megatron``), the integration test (``tests/megatron``) and the side-by-side measurement
(``scripts/megatron_bench.py``) share, so all run the real program the same way:

* :func:`find_snapshot` / :func:`extract`: the Megatron-DeepSpeed snapshot (not on any package registry) at
  ``../shared/thirdparty/megatron-deepspeed/`` from the repository root, extracted unmodified.
* :func:`prepare_data`: the Shakespeare corpus of :mod:`ds_paci.workload.data` (same document split, same local
  byte-level BPE as the main job's ``bpe-<N>``) written as JSONL, then turned into Megatron's indexed dataset by
  Megatron's own ``tools/preprocess_data.py`` (``--append-eod``). The result is checked: the ``.idx`` document
  sizes must add up to the tokens in the ``.bin`` (the snapshot's tool gets this wrong with ``--append-eod``,
  upstream NVIDIA/Megatron-LM#431; the caller's environment must fix it: :data:`CPU_SHIMS` does).
* :func:`prepare`: all of the above for a user: build tools checked, snapshot extracted, the stable link
  ``<out>/Megatron-DeepSpeed`` to it, the dataset in ``<out>/data`` (``python -m ds_paci.integrations.megatron
  prepare``).
* :data:`CPU_SHIMS`: ``launch/megatron_cpu``, the CPU-only environment shim (a ``sitecustomize.py`` to put on
  ``PYTHONPATH``; its README says what each hook stands in for and why). Not part of ds_paci and not needed on a
  GPU node with Megatron's usual packages.
* :func:`gpt_args`: the ``pretrain_gpt.py`` arguments of a small GPT (the issue's configuration).
* :func:`launch_command` / :func:`run`: one ``deepspeed`` launch through ``ds_paci.run``.
* :func:`parse_log`: Megatron's iteration and validation lines as numbers.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SNAPSHOT_DIR = "thirdparty/megatron-deepspeed"
SNAPSHOT_GLOB = "Megatron-DeepSpeed-*.tar.gz"
CPU_SHIMS = REPO_ROOT / "launch" / "megatron_cpu"  # the CPU-only environment shim (sitecustomize.py)
DEFAULT_OUT = REPO_ROOT / ".cache" / "megatron"
TREE_LINK = "Megatron-DeepSpeed"  # <out>/Megatron-DeepSpeed -> the extracted tree of the current snapshot
BUILD_TOOLS = ("g++", "make", "python3-config")  # Megatron compiles megatron/data/helpers.cpp at start-up
MEGATRON_PACKAGES = ("einops", "nltk", "pybind11", "regex", "six")  # setup.py's megatron-test extra


class MegatronSetupError(RuntimeError):
    """The Megatron snapshot, its data or its launch is not usable; the message says what to do."""


# ------------------------------------------------------------------------------------------- snapshot
def find_snapshot(shared=None):
    """Path of the Megatron-DeepSpeed tarball under ``<shared>/thirdparty/megatron-deepspeed/``.

    ``<shared>`` is ``shared`` if given, else ``$DS_PACI_SHARED``, else the first ``shared/`` folder holding the
    snapshot in the repository itself or in one of its parent folders (the project's layout puts it next to the
    checkout: ``<repo>/../shared``), then the same for the local repository this one was cloned from (a fresh
    clone elsewhere still finds it). Raises :class:`MegatronSetupError` with the paths it looked at when there is none.
    """
    explicit = shared or os.environ.get("DS_PACI_SHARED")
    if explicit:
        candidates = [Path(explicit)]
    else:
        roots = [REPO_ROOT, *_local_origin()]
        candidates = list(dict.fromkeys(folder / "shared" for root in roots for folder in (root, *root.parents)))
    for candidate in candidates:
        found = sorted(glob.glob(str(candidate / SNAPSHOT_DIR / SNAPSHOT_GLOB)))
        if found:
            return Path(found[-1])
    looked = ", ".join(str(c / SNAPSHOT_DIR) for c in candidates[:3]) + (", ..." if len(candidates) > 3 else "")
    raise MegatronSetupError(
        f"no Megatron-DeepSpeed snapshot ({SNAPSHOT_GLOB}) in {looked}. The project expects the shared folder next "
        f"to the repository ({REPO_ROOT.parent / 'shared'}); set DS_PACI_SHARED=<shared folder> if it lives elsewhere")


def _local_origin():
    """``[path]`` of the repository ``origin`` names when it is a folder on this machine, else ``[]``."""
    try:
        url = subprocess.run(["git", "-C", str(REPO_ROOT), "remote", "get-url", "origin"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return []
    path = Path(url[len("file://"):] if url.startswith("file://") else url)
    return [path.resolve()] if url and path.is_dir() else []


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def extract(tarball, dest):
    """Extract the snapshot unmodified into ``dest`` (once per tarball content); returns the Megatron tree.

    The tree is published with an atomic rename and stamped with the tarball's sha256, so a stale or
    half-extracted tree is never used.
    """
    dest = Path(dest)
    digest = _sha256(tarball)
    tree = dest / f"Megatron-DeepSpeed-{digest[:12]}"
    if (tree / "pretrain_gpt.py").is_file() and (tree / ".ds_paci-sha256").is_file():
        return tree
    dest.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".extract-", dir=dest))
    try:
        with tarfile.open(tarball) as tar:
            tar.extractall(tmp, filter="data")
        tops = [p for p in tmp.iterdir() if p.is_dir()]
        if len(tops) != 1 or not (tops[0] / "pretrain_gpt.py").is_file():
            raise MegatronSetupError(f"{tarball}: expected one top folder holding pretrain_gpt.py")
        (tops[0] / ".ds_paci-sha256").write_text(digest + "\n")
        try:
            tops[0].rename(tree)
        except OSError:
            if not (tree / "pretrain_gpt.py").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tree


# ----------------------------------------------------------------------------------------------- data
@dataclass
class MegatronData:
    """Paths of a prepared dataset (``*_prefix`` are what ``--train-data-path`` / ``--valid-data-path`` take)."""

    vocab_file: Path
    merge_file: Path
    train_prefix: Path
    valid_prefix: Path
    vocab_size: int
    documents: dict = field(default_factory=dict)  # split -> number of documents
    tokens: dict = field(default_factory=dict)  # split -> tokens in the .bin (EOD included)


def _read_index(prefix):
    """(document sizes, tokens in the .bin) of a Megatron mmap indexed dataset, read from the files' layout."""
    import numpy as np
    idx = Path(f"{prefix}.idx").read_bytes()
    if idx[:9] != b"MMIDIDX\x00\x00":
        raise MegatronSetupError(f"{prefix}.idx is not a Megatron mmap index")
    dtype_code = idx[17]
    itemsize = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}[dtype_code]  # Megatron's dtype codes
    count = int.from_bytes(idx[18:26], "little")
    sizes = np.frombuffer(idx, dtype=np.int32, count=count, offset=34)
    tokens = os.path.getsize(f"{prefix}.bin") // itemsize
    return sizes, tokens


def prepare_data(megatron_dir, out_dir, vocab_size=1024, env=None, python=None, workers=1):
    """Shakespeare -> JSONL -> local BPE -> Megatron's ``tools/preprocess_data.py`` (``--append-eod``).

    Reuses a complete earlier result in ``out_dir``. ``env``: the environment for the preprocessing tool
    (the caller's shims go on its ``PYTHONPATH``). Raises :class:`MegatronSetupError` if the tool fails or
    writes an index whose sizes do not cover the ``.bin`` (the upstream ``--append-eod`` bug).
    """
    from ds_paci.workload.data import LocalBPETokenizer, load_corpus, split_documents

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = f"shakespeare-bpe{vocab_size}"
    data = MegatronData(vocab_file=out / f"bpe-{vocab_size}" / "vocab.json",
                        merge_file=out / f"bpe-{vocab_size}" / "merges.txt",
                        train_prefix=out / f"{name}-train_text_document",
                        valid_prefix=out / f"{name}-valid_text_document",
                        vocab_size=vocab_size)
    done = out / f"{name}.done.json"
    if done.is_file():
        info = json.loads(done.read_text())
        data.documents, data.tokens = info["documents"], info["tokens"]
        return data
    train, valid = split_documents(load_corpus(), val_fraction=0.1, seed=0)  # the main job's split
    tok = LocalBPETokenizer(vocab_size, train, cache_dir=out / "tokenizers")  # the main job's bpe-<N>
    data.vocab_file.parent.mkdir(exist_ok=True)
    shutil.copyfile(tok.cache_path / "vocab.json", data.vocab_file)
    shutil.copyfile(tok.cache_path / "merges.txt", data.merge_file)
    python = python or sys.executable
    for split, docs, prefix in (("train", train, data.train_prefix), ("valid", valid, data.valid_prefix)):
        jsonl = out / f"{split}.jsonl"
        with open(jsonl, "w", encoding="utf-8") as f:
            for d in docs:
                f.write(json.dumps({"name": d.name, "text": d.text}) + "\n")
        cmd = [python, str(Path(megatron_dir) / "tools" / "preprocess_data.py"), "--input", str(jsonl),
               "--json-keys", "text", "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(data.vocab_file),
               "--merge-file", str(data.merge_file), "--append-eod", "--workers", str(workers),
               "--output-prefix", str(out / f"{name}-{split}")]
        proc = subprocess.run(cmd, cwd=megatron_dir, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise MegatronSetupError(f"Megatron's tools/preprocess_data.py failed on {jsonl} (rc {proc.returncode}):\n"
                                     + (proc.stdout + proc.stderr)[-3000:])
        sizes, tokens = _read_index(prefix)
        if len(sizes) != len(docs) or int(sizes.sum()) != tokens:
            raise MegatronSetupError(
                f"{prefix}.idx: {len(sizes)} documents whose sizes add up to {int(sizes.sum())} tokens, but the .bin "
                f"holds {tokens} tokens of {len(docs)} documents: tools/preprocess_data.py --append-eod left the EOD "
                f"tokens out of the sizes (upstream NVIDIA/Megatron-LM#431); run it with the fix of "
                f"{CPU_SHIMS} on PYTHONPATH")
        data.documents[split], data.tokens[split] = len(docs), tokens
    done.write_text(json.dumps({"documents": data.documents, "tokens": data.tokens}) + "\n")
    return data


# ------------------------------------------------------------------------------------------- launching
def gpt_args(data, train_iters=20, layers=4, hidden=64, heads=4, seq=128, micro_batch=2, global_batch=8,
             pipeline=2, eval_interval=10, eval_iters=2, log_interval=1, cache_dir=None, seed=1234):
    """``pretrain_gpt.py`` arguments of a small GPT on the prepared data (Megatron's defaults otherwise).

    ``--no-gradient-accumulation-fusion`` is needed without Megatron's CUDA kernel; ``--num-workers 0``
    keeps DataLoader worker processes out (same losses). Tied embeddings (Megatron's default) unless the
    caller adds ``--untie-embeddings-and-output-weights``.
    """
    args = ["--num-layers", layers, "--hidden-size", hidden, "--num-attention-heads", heads,
            "--seq-length", seq, "--max-position-embeddings", seq,
            "--micro-batch-size", micro_batch, "--global-batch-size", global_batch, "--train-iters", train_iters,
            "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", 2,
            "--weight-decay", "0.01", "--clip-grad", "1.0", "--seed", seed,
            "--train-data-path", data.train_prefix, "--valid-data-path", data.valid_prefix, "--data-impl", "mmap",
            "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", data.vocab_file, "--merge-file", data.merge_file,
            "--log-interval", log_interval, "--eval-interval", eval_interval, "--eval-iters", eval_iters,
            "--pipeline-model-parallel-size", pipeline, "--tensor-model-parallel-size", 1,
            "--no-gradient-accumulation-fusion", "--num-workers", 0]
    if cache_dir is not None:
        args += ["--data-cache-path", cache_dir]
    return [str(a) for a in args]


def ds_config(paci=None, micro_batch=2, global_batch=8, clipping=1.0):
    """The DeepSpeed config Megatron takes (``--deepspeed_config``); ``paci``: the ``"paci"`` section or None."""
    config = {"train_batch_size": global_batch, "train_micro_batch_size_per_gpu": micro_batch,
              "steps_per_print": 10**6, "gradient_clipping": clipping, "zero_optimization": {"stage": 0},
              "fp16": {"enabled": False}, "bf16": {"enabled": False}, "wall_clock_breakdown": False}
    if paci is not None:
        config["paci"] = dict(paci)
    return config


def launch_command(megatron_dir, args, config_path, nproc=2, port=29500, bin_dir=None, module="ds_paci.run",
                   module_args=()):
    """``deepspeed --num_gpus N --master_port P --module ds_paci.run <megatron>/pretrain_gpt.py ARGS --deepspeed ...``.

    ``module``/``module_args``: the entry the launcher runs (``ds_paci.run``, or a wrapper of it that takes
    ``module_args`` before the script, e.g. :mod:`ds_paci.integrations.emulate_layers`).
    """
    deepspeed = os.path.join(bin_dir or os.path.dirname(sys.executable), "deepspeed")
    return ([deepspeed, "--num_gpus", str(nproc), "--master_port", str(port), "--module", module] + list(module_args)
            + [str(Path(megatron_dir) / "pretrain_gpt.py")] + list(args)
            + ["--deepspeed", "--deepspeed_config", str(config_path)])


def run_env(extra_pythonpath=(), bin_dir=None, base=None):
    """Environment of a launch: ``PYTHONPATH`` additions first, the venv's ``bin`` first on ``PATH`` (Megatron's
    ``make`` of its data helpers runs ``python3 -m pybind11``), ``PYTHONUTF8`` (Megatron opens the vocabulary
    without an encoding), one OpenMP thread per rank where unset."""
    env = dict(os.environ if base is None else base)
    bin_dir = bin_dir or os.path.dirname(sys.executable)
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    paths = [str(p) for p in extra_pythonpath] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("PYTHONUTF8", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONWARNINGS", "ignore")
    return env


@dataclass
class Launch:
    """One finished launch: command, return code, wall seconds, the combined output and its parsed lines."""

    cmd: list
    returncode: int
    wall_s: float
    output: str
    log: "MegatronLog"


def run(cmd, env, cwd=None, log_path=None, timeout=600):
    """Run one launch to the end (no retry); returns a :class:`Launch` (the caller asserts on it)."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout, start_new_session=True)
        output, rc = proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as e:
        output = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        output += f"\n[ds_paci] launch timed out after {timeout} s"
        rc = -9
    wall = time.perf_counter() - t0
    if log_path is not None:
        Path(log_path).write_text(output)
    return Launch(cmd=cmd, returncode=rc, wall_s=wall, output=output, log=parse_log(output))


# -------------------------------------------------------------------------------------------- parsing
_ITER = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|(.*)")
_FIELD = re.compile(r"\s*([a-zA-Z][a-zA-Z ()/_-]*?):\s*([-+0-9.eE]+|nan|inf)\s*$")
_VALID = re.compile(r"validation loss at iteration (\d+)( on [^|]*)? \| lm loss value: ([-+0-9.eE]+|nan|inf)")


@dataclass
class MegatronLog:
    """Megatron's printed iteration lines: ``iterations[i]`` = dict of the fields (numbers, as printed: ``lm loss``
    is kept as the printed string under ``"lm loss text"`` too), ``validation[i]`` = printed validation loss text
    (``"final"`` for the end-of-run draw)."""

    iterations: dict = field(default_factory=dict)
    validation: dict = field(default_factory=dict)
    loaded_iteration: int | None = None

    def loss(self, i):
        return self.iterations[i]["lm loss"]

    def loss_text(self, i):
        return self.iterations[i].get("lm loss text")


def parse_log(text):
    log = MegatronLog()
    for line in text.splitlines():
        m = _ITER.search(line)
        if m:
            fields = {}
            for part in m.group(3).split("|"):
                f = _FIELD.match(part)
                if f:
                    fields[f.group(1).strip()] = float(f.group(2))
                    if f.group(1).strip() == "lm loss":
                        fields["lm loss text"] = f.group(2)
            log.iterations[int(m.group(1))] = fields
            continue
        m = _VALID.search(line)
        if m:
            key = "final" if m.group(2) else int(m.group(1))
            log.validation[key] = m.group(3)
            continue
        m = re.search(r"successfully loaded checkpoint from .* at iteration (\d+)", line)
        if m:
            log.loaded_iteration = int(m.group(1))
    return log


# ---------------------------------------------------------------------------------------- for a user
def check_environment(python3=None):
    """Raise :class:`MegatronSetupError` naming what a CPU launch of ``pretrain_gpt.py`` lacks, else return None.

    Megatron's start-up runs ``make`` in ``megatron/data`` (``g++``, ``python3-config`` and ``python3 -m
    pybind11``, whichever ``python3`` is first on ``PATH``: the venv's ``bin`` must come first); its imports need
    the ``megatron-test`` extra's packages in this interpreter.
    """
    missing = [tool for tool in BUILD_TOOLS if shutil.which(tool) is None]
    if missing:
        raise MegatronSetupError(f"Megatron compiles megatron/data/helpers.cpp at start-up and needs {missing} on "
                                 "PATH: install g++, make and the python3 development files (python3-dev)")
    absent = [name for name in MEGATRON_PACKAGES if _missing(name)]
    if absent:
        raise MegatronSetupError(f"Megatron's packages {absent} are not installed in {sys.executable}: run "
                                 "`pip install -e '.[megatron-test]'` in the repository (`make megatron` does)")
    python3 = python3 or shutil.which("python3")
    probe = subprocess.run([python3 or "python3", "-c", "import pybind11"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise MegatronSetupError(
            f"the python3 first on PATH ({python3}) has no pybind11, so Megatron's helpers.cpp build fails "
            f"(pybind11/pybind11.h not found): put the venv's bin first on PATH "
            f"(`source {Path(sys.executable).parent}/activate`)")


def _missing(name):
    import importlib.util
    return importlib.util.find_spec(name) is None


def link_tree(tree, out):
    """Point ``<out>/Megatron-DeepSpeed`` at ``tree`` (a relative symbolic link, replaced atomically)."""
    link = Path(out) / TREE_LINK
    tmp = Path(out) / f".{TREE_LINK}.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    os.symlink(os.path.relpath(tree, out), tmp)
    os.replace(tmp, link)
    return link


def prepare(out=DEFAULT_OUT, vocab_size=1024, shared=None):
    """What ``pretrain_gpt.py`` needs on this machine: returns (``<out>/Megatron-DeepSpeed``, :class:`MegatronData`).

    Checks the environment (:func:`check_environment`), extracts the snapshot unmodified, links it under a stable
    name and builds the Shakespeare dataset in ``<out>/data`` with Megatron's own tool (the CPU shim on its
    ``PYTHONPATH`` for the ``--append-eod`` fix). Each part is reused when already done.
    """
    check_environment()
    out = Path(out)
    tree = extract(find_snapshot(shared), out)
    link = link_tree(tree, out)
    data = prepare_data(link, out / "data", vocab_size=vocab_size, env=run_env([CPU_SHIMS]))
    return link, data


def main(argv=None):
    """``python -m ds_paci.integrations.megatron prepare [--out DIR] [--vocab-size N] [--shared DIR]``."""
    import argparse
    parser = argparse.ArgumentParser(prog="python -m ds_paci.integrations.megatron",
                                     description="Megatron-DeepSpeed's pretrain_gpt.py on ds_paci (README, "
                                                 "'Megatron-DeepSpeed')")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="check the environment, extract the snapshot, build the dataset")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="default: .cache/megatron in the repository")
    p.add_argument("--vocab-size", type=int, default=1024, help="the local BPE's vocabulary (default 1024)")
    p.add_argument("--shared", type=Path, default=None, help="the shared folder holding thirdparty/ "
                                                             "(default: $DS_PACI_SHARED, else found next to the repository)")
    args = parser.parse_args(argv)
    try:
        link, data = prepare(args.out, args.vocab_size, args.shared)
    except MegatronSetupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"Megatron-DeepSpeed: {link} -> {link.resolve().name} (unmodified snapshot)")
    for split, prefix in (("train", data.train_prefix), ("valid", data.valid_prefix)):
        print(f"{split} data: {prefix} ({data.documents[split]} documents, {data.tokens[split]:,} tokens)")
    print(f"tokenizer: {data.vocab_file}, {data.merge_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
