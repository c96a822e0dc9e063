"""Process set-up for DeepSpeed pipelines on machines without accelerators.

DeepSpeed's CPU accelerator JIT-compiles a shared-memory collective op with g++ the
first time the process group starts (about 30 s on 2 cores). Pipelines move their
data with point-to-point gloo transfers, which that op does not accelerate, so
ds_paci switches the build off on CPU unless ``DS_PACI_SHM_COMM=1`` is set.
"""

import os


def skip_cpu_jit_ops():
    """Turn off DeepSpeed's JIT-built shared-memory comm op on the CPU accelerator (idempotent)."""
    if os.environ.get("DS_PACI_SHM_COMM") == "1":
        return
    from deepspeed.accelerator import get_accelerator
    if get_accelerator().device_name() != "cpu":
        return
    import deepspeed.ops
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def init_distributed(timeout_minutes=None, **kwargs):
    """``deepspeed.init_distributed`` with the CPU JIT op skipped; ``timeout_minutes`` bounds every gloo wait."""
    import datetime

    import deepspeed
    skip_cpu_jit_ops()
    if timeout_minutes is not None:
        kwargs["timeout"] = datetime.timedelta(minutes=timeout_minutes)
    deepspeed.init_distributed(**kwargs)
