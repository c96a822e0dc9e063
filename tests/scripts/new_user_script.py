"""A user's own pipeline script, written from DeepSpeed's pipeline docs (not the main job): what a new user meets.

    torchrun --nproc_per_node 2 tests/scripts/new_user_script.py --init ours CONFIG.json [CONFIG.json ...]

``--init ours`` calls ``ds_paci.initialize``; ``--init deepspeed`` imports ds_paci but calls ``deepspeed.initialize``
(the mistake). Each config trains ``--steps`` calls on its own engine; the script never calls ``engine.drain()``.
``--drop`` deletes each engine and collects garbage after training, then prints ``dropped <i>``. Every rank prints
``engine <i> <class name>`` and finally ``script done``.
"""

import argparse
import gc

import deepspeed
import torch

import ds_paci
from ds_paci.tools.tanh_pipeline import tanh_pipeline


def batches(micro, dim):
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(micro, dim, generator=g) for _ in range(2)]
    while True:
        for x in xs:
            yield x, torch.tanh(x)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=-1)
    p.add_argument("--init", choices=("ours", "deepspeed"), default="ours")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--drop", action="store_true")
    p.add_argument("configs", nargs="+")
    args = p.parse_args()
    torch.set_num_threads(1)
    ds_paci.init_distributed()
    initialize = ds_paci.initialize if args.init == "ours" else deepspeed.initialize
    rank = torch.distributed.get_rank()
    for i, config in enumerate(args.configs):
        net = tanh_pipeline(8, 4, args.stages, torch.nn.MSELoss())
        engine, _, _, _ = initialize(model=net, model_parameters=net.parameters(), config=config)
        print(f"rank {rank}: engine {i} {type(engine).__name__}", flush=True)
        data = batches(engine.train_micro_batch_size_per_gpu(), 8)
        for _ in range(args.steps):
            engine.train_batch(data)
        if args.drop:
            del engine
            gc.collect()
            print(f"rank {rank}: dropped {i}", flush=True)
    print(f"rank {rank}: script done", flush=True)


if __name__ == "__main__":
    main()
