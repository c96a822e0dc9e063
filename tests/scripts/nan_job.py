"""The main job (launch/train.py) with one poisoned micro-batch: a test-only fault injector, not a product flag.

    deepspeed --num_gpus 2 tests/scripts/nan_job.py --nan-at K [launch/train.py arguments]

Micro-batch ``K`` (0-based, counting training forwards on the last stage; validation runs under no_grad and
is not counted) gets a NaN loss, so its gradient is NaN on every stage. ``--nan-at -1`` poisons nothing
(the clean run of the same job, for comparisons).
"""

import os
import runpy
import sys

import torch


def main():
    argv = sys.argv[1:]
    bad = -1
    if "--nan-at" in argv:
        i = argv.index("--nan-at")
        bad = int(argv[i + 1])
        del argv[i:i + 2]
    import ds_paci.workload.gpt2 as gpt2
    build = gpt2.gpt2_pipeline

    def poisoned_pipeline(*args, **kwargs):
        module = build(*args, **kwargs)
        loss_fn, seen = module.loss_fn, [0]

        def loss(logits, labels):
            value = loss_fn(logits, labels)
            if torch.is_grad_enabled():
                if seen[0] == bad:
                    value = value * float("nan")
                seen[0] += 1
            return value

        module.loss_fn = loss
        return module

    gpt2.gpt2_pipeline = poisoned_pipeline
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = os.path.join(root, "launch", "train.py")
    sys.argv = [script] + argv
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
