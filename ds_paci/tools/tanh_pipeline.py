"""A pipeline of ``dim x dim`` tanh layers: the small model the timing scripts and the tests' user scripts share.

``TanhBlock(dim, seed)`` is ``tanh(Linear(dim, dim)(x))`` with its weights drawn after ``torch.manual_seed(seed)``;
``tanh_pipeline(dim, layers, stages, loss_fn)`` is a DeepSpeed ``PipelineModule`` of ``layers`` of them (layer ``i``
seeded ``i``), partitioned uniformly over ``stages``. The same arguments give the same weights in every process.
"""

import torch
from deepspeed.pipe import LayerSpec, PipelineModule


class TanhBlock(torch.nn.Module):

    def __init__(self, dim, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.linear = torch.nn.Linear(dim, dim)

    def forward(self, x):
        return torch.tanh(self.linear(x))


def tanh_pipeline(dim, layers, stages, loss_fn):
    """``layers`` ``TanhBlock``s of width ``dim`` on ``stages`` stages, ``loss_fn(output, target)`` on the last."""
    return PipelineModule(layers=[LayerSpec(TanhBlock, dim, i) for i in range(layers)], num_stages=stages,
                          loss_fn=loss_fn, partition_method="uniform")
