"""GPT-2 as a sequence of single-tensor layers, for DeepSpeed's ``PipelineModule``.

Layers (each maps ONE tensor to ONE tensor)::

    Embedding   LongTensor[B, T] -> hidden[B, T, d]   token + learned position embeddings
    Block × L   hidden -> hidden                      transformers' GPT2Block, causal (sdpa)
    FinalNorm   hidden -> hidden                      LayerNorm
    LMHead      hidden -> logits[B, T, V]             bias-free Linear, NOT tied to the embedding

With ``tie_embeddings=True`` (GPT-2's own arrangement) the LM head reuses the token embedding
through DeepSpeed's ``TiedLayerSpec("embed", ...)`` and the embedding layer is split in two, so
that the tied module holds the token embedding only::

    TokenEmbedding     LongTensor[B, T] -> [B, T, d]   wte (tied, key "embed")
    PositionEmbedding  [B, T, d] -> [B, T, d]          + wpe, dropout
    Block × L, FinalNorm
    TokenEmbedding     [B, T, d] -> logits[B, T, V]    the same wte, through :func:`tied_lm_logits`

The tied and the untied model start from the same token and position embeddings (the head
of the tied model is that embedding).

Weights are random (nothing is downloaded) and initialised GPT-2 style from an
explicit per-layer seed (:func:`layer_seeds`), with a private ``torch.Generator``:
a layer's weights depend only on ``(seed, its role)``, not on global random state,
on the pipeline partition, or on extra layers such as :class:`EmulatedDeviceTime`.
So :func:`gpt2_pipeline` and :func:`gpt2_reference_model` built with the same seed
hold identical weights.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .emulate import EmulatedDeviceTime

__all__ = [
    "SIZES",
    "gpt2_config",
    "layer_seeds",
    "Embedding",
    "Block",
    "FinalNorm",
    "LMHead",
    "TokenEmbedding",
    "PositionEmbedding",
    "TiedLMHead",
    "tied_lm_logits",
    "TIED_KEY",
    "lm_loss",
    "gpt2_layer_specs",
    "gpt2_pipeline",
    "gpt2_reference_model",
]

#: Named sizes: (n_layer, n_embd, n_head).
SIZES: dict[str, tuple[int, int, int]] = {
    "tiny": (4, 128, 4),      # CPU default
    "mini": (6, 256, 8),
    "small": (12, 768, 12),   # gpt2 (124M with the GPT-2 vocabulary)
    "medium": (24, 1024, 16), # gpt2-medium
}

_INIT_STD = 0.02
TIED_KEY = "embed"  #: the TiedLayerSpec key of the tied token embedding / LM head


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def gpt2_config(size: str = "tiny", *, vocab_size: int, n_positions: int, n_embd: int | None = None,
                n_layer: int | None = None, n_head: int | None = None, dropout: float = 0.0,
                eos_token_id: int | None = None):
    """A ``transformers.GPT2Config`` for a named size, with explicit dims overriding the preset.

    Sizes (n_layer, n_embd, n_head): ``tiny`` (4, 128, 4), ``mini`` (6, 256, 8),
    ``small`` (12, 768, 12), ``medium`` (24, 1024, 16). ``dropout`` sets the
    embedding, attention and residual dropout. ``bos/eos_token_id`` default to
    ``vocab_size - 1`` (the end-of-text id of the byte and GPT-2 tokenizers).

    Attention is forced to ``"sdpa"``: a standalone ``GPT2Block`` with the default
    (eager) attention applies no causal mask, while sdpa with no mask is causal.
    """
    from transformers import GPT2Config

    if size not in SIZES:
        raise ValueError(f"unknown GPT-2 size {size!r}; valid sizes: {', '.join(SIZES)}")
    preset_layer, preset_embd, preset_head = SIZES[size]
    n_layer = _positive_int("n_layer", preset_layer if n_layer is None else n_layer)
    n_embd = _positive_int("n_embd", preset_embd if n_embd is None else n_embd)
    n_head = _positive_int("n_head", preset_head if n_head is None else n_head)
    vocab_size = _positive_int("vocab_size", vocab_size)
    n_positions = _positive_int("n_positions", n_positions)
    if n_embd % n_head:
        raise ValueError(f"n_embd ({n_embd}) must be divisible by n_head ({n_head})")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
    eos = vocab_size - 1 if eos_token_id is None else eos_token_id
    if not 0 <= eos < vocab_size:
        raise ValueError(f"eos_token_id {eos} is outside the vocabulary 0..{vocab_size - 1}")
    config = GPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_embd=n_embd, n_layer=n_layer,
                        n_head=n_head, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                        initializer_range=_INIT_STD, bos_token_id=eos, eos_token_id=eos, use_cache=False)
    config._attn_implementation = "sdpa"
    return config


def layer_seeds(config, seed: int) -> dict[str, Any]:
    """Init seeds per layer: embedding ``seed``, block ``i`` ``seed + 1 + i``, head ``seed + n_layer + 1``.

    These equal ``seed`` plus the layer's index in the plain layer list.
    """
    return {"embedding": seed, "blocks": [seed + 1 + i for i in range(config.n_layer)],
            "head": seed + config.n_layer + 1}


def _normal_(param: torch.Tensor, std: float, gen: torch.Generator) -> None:
    with torch.no_grad():
        param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32).mul_(std).to(param.dtype))


class Embedding(nn.Module):
    """Token + learned position embeddings, then dropout: ``LongTensor[B, T] -> [B, T, d]``."""

    def __init__(self, config, init_seed: int = 0):
        super().__init__()
        self.n_positions = config.n_positions
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.drop = nn.Dropout(config.embd_pdrop)
        gen = torch.Generator().manual_seed(int(init_seed))
        _normal_(self.wte.weight, _INIT_STD, gen)
        _normal_(self.wpe.weight, _INIT_STD, gen)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = _positions(input_ids.shape[-1], self.n_positions, input_ids.device)
        return self.drop(self.wte(input_ids) + self.wpe(positions))


class TokenEmbedding(nn.Module):
    """Token embedding only (``wte``), the module GPT-2 ties to its LM head: ``LongTensor[B, T] -> [B, T, d]``.

    Initialised exactly like :class:`Embedding`'s ``wte`` for the same seed.
    """

    def __init__(self, config, init_seed: int = 0):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        _normal_(self.wte.weight, _INIT_STD, torch.Generator().manual_seed(int(init_seed)))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.wte(input_ids)


class PositionEmbedding(nn.Module):
    """Adds learned position embeddings, then dropout: ``[B, T, d] -> [B, T, d]``.

    ``wpe`` is initialised exactly like :class:`Embedding`'s for the same seed (drawn after ``wte``).
    """

    def __init__(self, config, init_seed: int = 0):
        super().__init__()
        self.n_positions = config.n_positions
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.drop = nn.Dropout(config.embd_pdrop)
        gen = torch.Generator().manual_seed(int(init_seed))
        torch.randn((config.vocab_size, config.n_embd), generator=gen)  # wte's draw, as in Embedding
        _normal_(self.wpe.weight, _INIT_STD, gen)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.drop(hidden + self.wpe(_positions(hidden.shape[-2], self.n_positions, hidden.device)))


def _positions(seq_len: int, n_positions: int, device) -> torch.Tensor:
    """``arange(seq_len)``; a sequence longer than the model's positions is refused with the fix."""
    if seq_len > n_positions:
        raise ValueError(f"sequence length {seq_len} exceeds the model's n_positions {n_positions}; "
                         f"use seq_len <= {n_positions} or build the model with n_positions >= {seq_len}")
    return torch.arange(seq_len, device=device)


def tied_lm_logits(embedding: TokenEmbedding, hidden: torch.Tensor) -> torch.Tensor:
    """The tied LM head: ``hidden @ wte^T`` (the ``forward_fn`` of the last ``TiedLayerSpec``)."""
    return F.linear(hidden, embedding.wte.weight)


class TiedLMHead(nn.Module):
    """:func:`tied_lm_logits` as a module sharing ``embedding`` (for :func:`gpt2_reference_model`)."""

    def __init__(self, embedding: TokenEmbedding):
        super().__init__()
        self.embedding = embedding

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return tied_lm_logits(self.embedding, hidden)


class Block(nn.Module):
    """One causal transformer block: transformers' ``GPT2Block`` with sdpa attention.

    The block always uses sdpa (a copy of ``config`` is switched to it if needed),
    because eager attention without an explicit mask would see future tokens.
    Linear weights ~ N(0, 0.02), the two residual projections ~ N(0, 0.02/sqrt(2L)),
    biases 0, LayerNorms (1, 0).
    """

    def __init__(self, config, layer_idx: int, init_seed: int = 0):
        super().__init__()
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        if config._attn_implementation != "sdpa":
            config = copy.deepcopy(config)
            config._attn_implementation = "sdpa"
        self.layer_idx = layer_idx
        self.block = GPT2Block(config, layer_idx=layer_idx)
        residual_std = _INIT_STD / math.sqrt(2 * config.n_layer)
        gen = torch.Generator().manual_seed(int(init_seed))
        for name, param in self.block.named_parameters():
            if name.startswith("ln_"):  # LayerNorms (ln_1, ln_2, ln_cross_attn)
                with torch.no_grad():
                    param.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                with torch.no_grad():
                    param.zero_()
            else:
                _normal_(param, residual_std if name.endswith("c_proj.weight") else _INIT_STD, gen)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.block(hidden)
        # transformers 5.x returns a tensor; 4.x returned a tuple.
        return out[0] if isinstance(out, tuple) else out


class FinalNorm(nn.Module):
    """The final LayerNorm."""

    def __init__(self, config):
        super().__init__()
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.ln_f(hidden)


class LMHead(nn.Module):
    """Bias-free projection to the vocabulary, untied from the embedding: ``[B, T, d] -> [B, T, V]``."""

    def __init__(self, config, init_seed: int = 0):
        super().__init__()
        self.proj = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        _normal_(self.proj.weight, _INIT_STD, torch.Generator().manual_seed(int(init_seed)))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj(hidden)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over all tokens, computed in float32."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def gpt2_layer_specs(config, *, seed: int = 1234, device_time: float = 0.0, tie_embeddings: bool = False) -> list:
    """The ``LayerSpec`` list of :func:`gpt2_pipeline`.

    With ``device_time > 0`` an :class:`EmulatedDeviceTime` follows each ``Block``. With
    ``tie_embeddings`` the first and last layers are ``TiedLayerSpec(TIED_KEY, TokenEmbedding)``
    (the last through :func:`tied_lm_logits`), with a :class:`PositionEmbedding` after the first.
    """
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    seeds = layer_seeds(config, seed)
    if tie_embeddings:
        specs = [TiedLayerSpec(TIED_KEY, TokenEmbedding, config, init_seed=seeds["embedding"],
                               tied_weight_attr=["wte.weight"]),
                 LayerSpec(PositionEmbedding, config, init_seed=seeds["embedding"])]
    else:
        specs = [LayerSpec(Embedding, config, init_seed=seeds["embedding"])]
    for i, block_seed in enumerate(seeds["blocks"]):
        specs.append(LayerSpec(Block, config, layer_idx=i, init_seed=block_seed))
        if device_time > 0:
            specs.append(LayerSpec(EmulatedDeviceTime, device_time))
    specs.append(LayerSpec(FinalNorm, config))
    if tie_embeddings:
        specs.append(TiedLayerSpec(TIED_KEY, TokenEmbedding, config, init_seed=seeds["embedding"],
                                   forward_fn=tied_lm_logits, tied_weight_attr=["wte.weight"]))
    else:
        specs.append(LayerSpec(LMHead, config, init_seed=seeds["head"]))
    return specs


def _set_seed(seed) -> None:
    from deepspeed.runtime.utils import set_random_seed

    # PipelineModule passes numpy ints; random.seed rejects those on Python 3.11+.
    set_random_seed(int(seed))


def gpt2_pipeline(config, num_stages: int | None = None, *, topology=None, seed: int = 1234,
                  device_time: float = 0.0, activation_checkpoint_interval: int = 0,
                  partition_method: str = "type:Block", tie_embeddings: bool = False):
    """GPT-2 as a ``deepspeed.pipe.PipelineModule`` with loss :func:`lm_loss`.

    Layers: Embedding, ``n_layer`` x Block, FinalNorm, LMHead, partitioned by
    transformer blocks (``partition_method="type:Block"``). ``seed`` fixes the
    weights (see :func:`layer_seeds`) and is DeepSpeed's ``base_seed`` for its
    per-layer reseeding of dropout. With ``device_time > 0`` an
    :class:`EmulatedDeviceTime` layer follows each Block, so a stage's emulated
    device time is proportional to its number of blocks (with activation
    checkpointing the recomputed forward waits again, as real recompute would).
    ``tie_embeddings`` ties the LM head to the token embedding (see the module docstring):
    DeepSpeed keeps one copy per owning stage (first and last) and broadcasts it at start.

    torch.distributed (and DeepSpeed's comm layer, ``deepspeed.init_distributed``)
    must be initialised and ``LOCAL_RANK`` set before calling this; each rank
    builds only the layers of its own stage. Raises ``RuntimeError`` if the
    partition would separate an emulation layer from its block.
    """
    from deepspeed.pipe import PipelineModule

    if device_time < 0:
        raise ValueError(f"device_time must be >= 0 seconds, got {device_time!r}")
    specs = gpt2_layer_specs(config, seed=seed, device_time=device_time, tie_embeddings=tie_embeddings)
    module = PipelineModule(layers=specs, num_stages=num_stages, topology=topology, loss_fn=lm_loss,
                            seed_layers=True, base_seed=seed, seed_fn=_set_seed,
                            partition_method=partition_method,
                            activation_checkpoint_interval=activation_checkpoint_interval)
    for boundary in module.parts[1:-1]:
        if boundary < len(specs) and specs[boundary].typename is EmulatedDeviceTime:
            raise RuntimeError(f"partition {list(map(int, module.parts))} ({partition_method!r}) puts the emulated "
                               f"device time of a block on the next stage; use partition_method='type:Block'")
    return module


def gpt2_reference_model(config, seed: int = 1234, device_time: float = 0.0,
                         tie_embeddings: bool = False) -> nn.Sequential:
    """The same layers as :func:`gpt2_pipeline` in one ``nn.Sequential``, with identical weights.

    For single-process checks; no torch.distributed needed. Loss: :func:`lm_loss`. With
    ``tie_embeddings`` the last layer is a :class:`TiedLMHead` sharing the first layer's module.
    """
    seeds = layer_seeds(config, seed)
    if tie_embeddings:
        token = TokenEmbedding(config, init_seed=seeds["embedding"])
        layers: list[nn.Module] = [token, PositionEmbedding(config, init_seed=seeds["embedding"])]
    else:
        layers = [Embedding(config, init_seed=seeds["embedding"])]
    for i, block_seed in enumerate(seeds["blocks"]):
        layers.append(Block(config, layer_idx=i, init_seed=block_seed))
        if device_time > 0:
            layers.append(EmulatedDeviceTime(device_time))
    layers.append(FinalNorm(config))
    layers.append(TiedLMHead(token) if tie_embeddings else LMHead(config, init_seed=seeds["head"]))
    return nn.Sequential(*layers)
