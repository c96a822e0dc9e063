"""The peer study's cells and model: one layer list that DeepSpeed's ``PipelineModule`` and torch's pipeline stages
both build, with emulated device time split into forward, input-gradient and weight-gradient parts.

A :class:`PeerCell` is one point of the grid (``P`` ranks, ``M`` micro-batches, an ``F:B:W`` ratio). Its model is
GPT-2 with ``2P`` transformer blocks (:func:`layer_specs`): two per rank, so the schedules that put two virtual
stages on every rank (interleaved, zero-bubble V) run the same blocks as the ones with one stage per rank. In
emulated cells an :class:`~ds_paci.workload.emulate.EmulatedSplitTime` follows every block (``F``, ``B``, ``W``
seconds); with ``slow_last`` one more sits before the LM head, so whichever rank holds the head does one block's
work more (the last stage of DeepSpeed's pipeline is 1.5x slower; in a V schedule that is rank 0).

Partitions are lists of layer boundaries (DeepSpeed's ``PipelineModule.parts``): stage ``k`` of ``S`` starts at
the layer of its first block; the embedding belongs to stage 0 and the final norm and head to stage ``S-1``
(:func:`partition`). :func:`stage_module` builds the layers ``[lo, hi)`` as an ``nn.Sequential`` whose children are
named by their index in the layer list, as DeepSpeed names them, so state dicts of every engine line up.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from ds_paci.workload.emulate import EmulatedSplitTime
from ds_paci.workload.gpt2 import Block, Embedding, FinalNorm, LMHead, gpt2_config, layer_seeds

#: F:B:W ratios of the grid (per block); "real" has no emulated time.
RATIOS = {"1:1:1": (1.0, 1.0, 1.0), "1:2:1": (1.0, 2.0, 1.0), "real": (0.0, 0.0, 0.0)}


@dataclass(frozen=True)
class PeerCell:
    """One cell of the peer study: shape, emulated times, model size and run length.

    ``unit``: seconds of one block's forward; ``ratio`` names ``F:B:W`` per block (:data:`RATIOS`); ``slow_last``
    adds one block's ``F``, ``B``, ``W`` before the LM head. ``steps`` optimizer steps per run, of which the first
    ``warmup`` are not timed.
    """

    stages: int
    micro_batches: int
    ratio: str = "1:1:1"
    unit: float = 0.02
    slow_last: bool = False
    micro_batch_size: int = 4
    seq_len: int = 64
    n_embd: int = 64
    n_head: int = 4
    steps: int = 6
    warmup: int = 2
    lr: float = 1e-3
    seed: int = 1234
    data_seed: int = 7
    val_batches: int = 8

    @property
    def emulated(self) -> bool:
        return self.ratio != "real"

    @property
    def n_layer(self) -> int:
        return 2 * self.stages

    @property
    def block_times(self) -> tuple:
        """``(F, B, W)`` seconds of one block."""
        return tuple(self.unit * r for r in RATIOS[self.ratio])

    @property
    def head_times(self) -> tuple:
        """``(F, B, W)`` seconds added before the LM head (``slow_last``), else zeros."""
        return self.block_times if self.slow_last else (0.0, 0.0, 0.0)

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batches * self.micro_batch_size * self.seq_len

    @property
    def name(self) -> str:
        tag = {"1:1:1": "fbw111", "1:2:1": "fbw121", "real": "real"}[self.ratio]
        return f"P{self.stages}_M{self.micro_batches}_{tag}" + ("_slowlast" if self.slow_last else "")

    def label(self) -> str:
        if not self.emulated:
            return f"real P={self.stages} M={self.micro_batches}"
        f, b, w = (round(t * 1000, 3) for t in self.block_times)
        last = ", slow last stage" if self.slow_last else ""
        return f"emulated P={self.stages} M={self.micro_batches} F:B:W={self.ratio} ({f:g}/{b:g}/{w:g} ms/block{last})"



def check_cell(cell: PeerCell) -> PeerCell:
    """Raise ``ValueError`` naming the problem for a cell that cannot run; returns ``cell``."""
    if cell.ratio not in RATIOS:
        raise ValueError(f"ratio must be one of {', '.join(RATIOS)}, got {cell.ratio!r}")
    if cell.stages < 2 or cell.micro_batches < 1:
        raise ValueError(f"need stages >= 2 and micro_batches >= 1, got P={cell.stages}, M={cell.micro_batches}")
    if cell.emulated != (cell.unit > 0):
        raise ValueError("emulated ratios need unit > 0 seconds; the real ratio needs unit 0")
    if cell.slow_last and not cell.emulated:
        raise ValueError("slow_last needs emulated device time")
    if not 0 <= cell.warmup < cell.steps:
        raise ValueError(f"warmup ({cell.warmup}) must be below steps ({cell.steps})")
    if cell.n_embd % cell.n_head:
        raise ValueError(f"n_embd ({cell.n_embd}) must be divisible by n_head ({cell.n_head})")
    return cell


def model_config(cell: PeerCell):
    """The ``transformers.GPT2Config`` of a cell (byte vocabulary, no dropout)."""
    return gpt2_config("tiny", vocab_size=257, n_positions=cell.seq_len, n_embd=cell.n_embd, n_layer=cell.n_layer,
                       n_head=cell.n_head)


def layer_specs(cell: PeerCell, *, timed: bool = True) -> list:
    """DeepSpeed ``LayerSpec`` list: Embedding, (Block, EmulatedSplitTime) x 2P, FinalNorm, [EmulatedSplitTime], LMHead.

    Emulation layers are present in every emulated cell; ``timed=False`` gives them zero seconds (same parameters,
    same graph, no waits: for evaluating weights in one process). Real cells have none.
    """
    from deepspeed.pipe import LayerSpec
    config = model_config(cell)
    seeds = layer_seeds(config, cell.seed)
    zero = (0.0, 0.0, 0.0)
    specs = [LayerSpec(Embedding, config, init_seed=seeds["embedding"])]
    for i, block_seed in enumerate(seeds["blocks"]):
        specs.append(LayerSpec(Block, config, layer_idx=i, init_seed=block_seed))
        if cell.emulated:
            specs.append(LayerSpec(EmulatedSplitTime, *(cell.block_times if timed else zero)))
    specs.append(LayerSpec(FinalNorm, config))
    if cell.slow_last:
        specs.append(LayerSpec(EmulatedSplitTime, *(cell.head_times if timed else zero)))
    specs.append(LayerSpec(LMHead, config, init_seed=seeds["head"]))
    return specs


def partition(specs: list, num_stages: int) -> list:
    """Layer boundaries ``[0, b_1, ..., len(specs)]`` of ``num_stages`` stages with equal numbers of blocks.

    Stage ``k`` starts at its first block (stage 0 at the embedding); the last stage ends with the head.
    """
    blocks = [i for i, spec in enumerate(specs) if spec.typename is Block]
    if len(blocks) % num_stages:
        raise ValueError(f"{len(blocks)} blocks do not split evenly over {num_stages} stages")
    per_stage = len(blocks) // num_stages
    return [0] + [blocks[k * per_stage] for k in range(1, num_stages)] + [len(specs)]


def stage_module(specs: list, lo: int, hi: int):
    """Layers ``lo..hi-1`` built from their specs, as an ``nn.Sequential`` named by layer index (DeepSpeed's names)."""
    import torch
    return torch.nn.Sequential(OrderedDict((str(i), specs[i].build()) for i in range(lo, hi)))


def full_model(cell: PeerCell):
    """Every layer of the cell (zero emulated seconds) in one ``nn.Sequential`` named by layer index."""
    specs = layer_specs(cell, timed=False)
    return stage_module(specs, 0, len(specs))


def emulated_waits(module) -> dict:
    """Total waits per kind (``forward``, ``input_grad``, ``weight_grad``) of the emulation layers in ``module``."""
    total = {"forward": 0, "input_grad": 0, "weight_grad": 0}
    for layer in module.modules():
        if isinstance(layer, EmulatedSplitTime):
            for kind in total:
                total[kind] += layer.waits[kind]
    return total
