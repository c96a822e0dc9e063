"""A small MLP pipeline for engine tests whose expected gradients can be written out by hand.

Layer ``i`` computes ``tanh(x @ W_i^T + b_i)``; the loss is the mean squared error.
Weights are a deterministic function of ``seed`` and the layer index, so a pipeline
of any depth and the hand-written reference start from the same weights.
"""

import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

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


def cross_entropy(out, labels):
    """Classification loss for :func:`classification_batches` (the tanh output scaled to logits)."""
    return torch.nn.functional.cross_entropy(4 * out, labels)


def mlp_pipeline(stages, layers=4, seed=7, dim=DIM, tied=False, loss_fn=mse, **kwargs):
    """``layers`` tanh layers; with ``tied`` the first and last are one ``TiedLayerSpec("w")`` (layer 0's weights).

    Tied: only ``linear.weight`` is tied (:class:`TiedTanhLayer`, DeepSpeed's default ``tied_weight_attr``);
    each owning stage keeps its own copy of the bias.
    """
    specs = [LayerSpec(TanhLayer, i, seed, dim) for i in range(layers)]
    if tied:
        specs[0] = TiedLayerSpec("w", TiedTanhLayer, 0, seed, dim)
        specs[-1] = TiedLayerSpec("w", TiedTanhLayer, 0, seed, dim)
    return PipelineModule(layers=specs, num_stages=stages, loss_fn=loss_fn, partition_method="uniform", **kwargs)


def regression_batches(micro_batch_size, seed=3, dim=DIM):
    """Infinite deterministic (x, y) micro-batches of a fixed random linear target."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(dim, dim, generator=g) * 0.5
    while True:
        x = torch.randn(micro_batch_size, dim, generator=g)
        yield x, torch.tanh(x @ target.T)


def classification_batches(micro_batch_size, seed=3, dim=DIM):
    """Infinite deterministic (x, class id) micro-batches: the class is the largest output of a fixed random target
    (integer labels, as a language model's token ids)."""
    for x, y in regression_batches(micro_batch_size, seed, dim):
        yield x, y.argmax(dim=1)


def run_streams_by_hand(P, layers, gas, window, calls, W, gW, micro_batch_size, on_step, stale=False):
    """Execute the PACI streams of the tanh MLP by hand (no autograd; :func:`ds_paci.core.program.interpreter.run_program`
    orders the actions); returns the last stage's losses.

    ``W``/``gW``: per layer ``[weight, bias]`` (float64) and their gradient accumulators, changed in
    place. A forward uses the weights current at that moment and saves each layer's input and
    output. A backward adds the weight gradients from those saved activations into ``gW`` and
    passes the input gradient through the weights current *at backward time* (``stale=True``: the
    weights of the forward, as a weight-stashing scheme would). The last stage's loss is scaled by
    ``1/window``. Each ``STEP`` calls ``on_step(stage, instruction, layers_of_stage)``.
    """
    from deepspeed.runtime.pipe import schedule as ds

    from ds_paci.core.program.actions import Kind
    from ds_paci.core.program.interpreter import Handler, run_program
    from ds_paci.core.program.stream import PACIStream
    per_stage = layers // P
    gen = regression_batches(micro_batch_size)
    batches, saved, acts, grads, losses = {}, {}, {}, {}, []
    streams = [PACIStream(P, s, window) for s in range(P)]
    schedule = [[] for _ in range(P)]
    for _ in range(calls):
        for s in range(P):
            schedule[s] += streams[s].advance(2 * gas)
    for s in range(P):
        schedule[s] += streams[s].drain()

    class ByHand(Handler):
        """Each action's arithmetic, run by the one program interpreter (rendezvous order, as the engines run)."""

        def run(self, s, ins, now):
            m = ins.micro_batch
            mine = range(s * per_stage, (s + 1) * per_stage)
            if ins.kind is Kind.LOAD and s == 0:
                x, y = next(gen)
                batches[m] = (x.double(), y.double())
            elif ins.kind is Kind.FORWARD:
                h = batches[m][0] if s == 0 else acts[(s - 1, m)]
                layer_io = []
                for i in mine:
                    w, b = W[i]
                    out = torch.tanh(h @ w.T + b)
                    layer_io.append((h, out, w.clone() if stale else None))
                    h = out
                saved[(s, m)] = layer_io
                acts[(s, m)] = h
                if s == P - 1:
                    losses.append(((h - batches[m][1])**2).mean().item())
            elif ins.kind is Kind.BACKWARD:
                if s == P - 1:
                    out, target = acts[(s, m)], batches[m][1]
                    g = 2 * (out - target) / out.numel() / window
                else:
                    g = grads.pop((s + 1, m))
                for i, (h_in, out, w_fwd) in zip(reversed(mine), reversed(saved.pop((s, m)))):
                    gz = g * (1 - out * out)
                    gW[i][0] += gz.T @ h_in
                    gW[i][1] += gz.sum(0)
                    g = gz @ (w_fwd if stale else W[i][0])
                grads[(s, m)] = g
            elif ins.kind is Kind.STEP:
                on_step(s, ins, mine)

    run = run_program(schedule, ByHand())
    assert run.ok, run.stuck
    return losses
