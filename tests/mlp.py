"""A small MLP pipeline for engine tests whose expected gradients can be written out by hand.

Layer ``i`` computes ``tanh(x @ W_i^T + b_i)``; the loss is the mean squared error.
Weights are a deterministic function of ``seed`` and the layer index, so a pipeline
of any depth and the hand-written reference start from the same weights.
"""

import torch
from deepspeed.pipe import LayerSpec, PipelineModule

DIM = 6


def layer_weights(index, seed, dim=DIM):
    g = torch.Generator().manual_seed(seed * 1000 + index)
    w = torch.randn(dim, dim, generator=g) * (0.8 / dim**0.5)
    b = torch.randn(dim, generator=g) * 0.1
    return w, b


class TanhLayer(torch.nn.Module):

    def __init__(self, index, seed, dim=DIM):
        super().__init__()
        w, b = layer_weights(index, seed, dim)
        self.linear = torch.nn.Linear(dim, dim)
        with torch.no_grad():
            self.linear.weight.copy_(w)
            self.linear.bias.copy_(b)

    def forward(self, x):
        return torch.tanh(self.linear(x))


class TiedTanhLayer(TanhLayer):
    """A ``TanhLayer`` whose tied weight DeepSpeed finds under its default name ``weight`` (every supported version;
    dotted names such as ``linear.weight`` only from DeepSpeed 0.16.x releases after 0.16.0)."""

    @property
    def weight(self):
        return self.linear.weight


def mse(out, target):
    return ((out - target)**2).mean()


def mlp_pipeline(stages, layers=4, seed=7, dim=DIM, **kwargs):
    specs = [LayerSpec(TanhLayer, i, seed, dim) for i in range(layers)]
    return PipelineModule(layers=specs, num_stages=stages, loss_fn=mse, partition_method="uniform", **kwargs)


def regression_batches(micro_batch_size, seed=3, dim=DIM):
    """Infinite deterministic (x, y) micro-batches of a fixed random linear target."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(dim, dim, generator=g) * 0.5
    while True:
        x = torch.randn(micro_batch_size, dim, generator=g)
        yield x, torch.tanh(x @ target.T)
