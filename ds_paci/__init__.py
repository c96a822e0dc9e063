"""ds_paci: bubble-free PACI pipeline training for DeepSpeed.

``ds_paci.initialize`` takes the arguments of ``deepspeed.initialize`` and returns
the same 4-tuple ``(engine, optimizer, training_dataloader, lr_scheduler)``. With
``"paci": {"enabled": true, ...}`` in the DeepSpeed config the engine is a
:class:`PACIPipelineEngine` (still a ``deepspeed.PipelineEngine``); otherwise it is
exactly what ``deepspeed.initialize`` returns; either way one line on rank 0 says which (PACI on or off).

Importing ``ds_paci`` also wraps ``deepspeed.initialize`` (unchanged behaviour): a config with a ``"paci"`` section
passed to it warns once that PACI is off and how to turn it on (:mod:`ds_paci.core.engine.startup`).
"""

from .core.checkpoint.atomic import CheckpointError, load_checkpoint, save_checkpoint
from .core.config import PACIConfig, PACIConfigError, load_config, parse_paci_section, validate_run
from .core.engine.pipeline_engine import PACIPipelineEngine, PACIStreamError
from .core.step.guard import PACINonFiniteError
from .core.initialize import initialize
from .core.runtime import init_distributed, skip_cpu_jit_ops
from .core.engine.startup import watch_stock_initialize

watch_stock_initialize()

__version__ = "0.1.0"

__all__ = [
    "initialize", "PACIPipelineEngine", "PACIConfig", "PACIConfigError", "PACIStreamError", "PACINonFiniteError",
    "init_distributed", "skip_cpu_jit_ops", "save_checkpoint", "load_checkpoint", "CheckpointError", "__version__"
]
