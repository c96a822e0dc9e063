"""A DeepSpeed pipeline training script written the way DeepSpeed's examples are: it knows nothing of ds_paci.

    deepspeed --num_gpus 2 tests/scripts/ds_pipeline_script.py --deepspeed_config cfg.json --out DIR
    deepspeed --num_gpus 2 --module ds_paci.run tests/scripts/ds_pipeline_script.py --deepspeed_config cfg.json ...

Every rank calls ``loss.item()`` after every ``train_batch`` (as DeepSpeed's pipeline examples do) and
writes ``DIR/rank<R>.json``: the engine's class, the losses, and the seconds per call.
``--megatron-style`` hands the config over as Megatron-DeepSpeed does (``args.deepspeed_config_dict``,
passed as ``config=``); ``--then-config PATH`` trains a second engine with another config in the same run.
"""

import argparse
import json
import os
import sys
import time

import deepspeed
import torch
from deepspeed.pipe import LayerSpec, PipelineModule


class Block(torch.nn.Module):

    def __init__(self, dim, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.linear = torch.nn.Linear(dim, dim)

    def forward(self, x):
        return torch.tanh(self.linear(x))


def batches(micro, dim, seed=0, distinct=2):
    """A fixed set of ``distinct`` micro-batches of a random tanh regression, repeated forever."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(dim, dim, generator=g) / dim**0.5
    xs = [torch.randn(micro, dim, generator=g) for _ in range(distinct)]
    while True:
        for x in xs:
            yield x, torch.tanh(x @ target)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--out", required=True)
    p.add_argument("--megatron-style", action="store_true")
    p.add_argument("--then-config")
    p = deepspeed.add_config_arguments(p)
    args = p.parse_args()
    torch.set_num_threads(1)
    deepspeed.init_distributed()
    runs = []
    for config_path in [args.deepspeed_config] + ([args.then_config] if args.then_config else []):
        args.deepspeed_config = config_path
        kwargs = {}
        if args.megatron_style:
            with open(config_path) as f:
                args.deepspeed_config_dict = json.load(f)
            args.deepspeed_config = None
            kwargs["config"] = args.deepspeed_config_dict
        net = PipelineModule(layers=[LayerSpec(Block, args.dim, i) for i in range(args.layers)],
                             num_stages=args.stages, loss_fn=torch.nn.MSELoss(), partition_method="uniform")
        engine, _, _, _ = deepspeed.initialize(args=args, model=net, model_parameters=net.parameters(), **kwargs)
        data = batches(engine.train_micro_batch_size_per_gpu(), args.dim)
        losses, seconds = [], []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            loss = engine.train_batch(data)
            losses.append(loss.item())
            seconds.append(time.perf_counter() - t0)
        runs.append({"config": config_path, "engine": type(engine).__name__, "stage": engine.stage_id,
                     "losses": losses, "seconds": seconds, "samples_per_call": engine.train_batch_size()})
    rank = torch.distributed.get_rank()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"runs": runs, "argv": sys.argv, "main": __name__, "path0": sys.path[0]}, f)


if __name__ == "__main__":
    main()
