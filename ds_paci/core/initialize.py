"""``initialize``: ``deepspeed.initialize`` that builds the PACI engine when the config asks for it."""

import contextlib
import copy
import inspect

from .seam import compat
from .config import check_section_key, load_config, parse_paci_section, validate_run
from .engine.pipeline_engine import PACIPipelineEngine
from .engine.startup import deciding, say_off
from .health.lifecycle import watch_launchers
from .health.liveness import watch_peers
from .runtime import skip_cpu_jit_ops


@contextlib.contextmanager
def _pipeline_engine_class(cls):
    """Make ``deepspeed.initialize`` build ``cls`` for a PipelineModule, for the duration of the block.

    DeepSpeed (every supported version, see :mod:`ds_paci.core.seam.compat`) looks the class up as the module
    global ``deepspeed.PipelineEngine`` at call time, so a scoped rebind keeps every other step of initialize
    intact.
    """
    import deepspeed
    original = deepspeed.PipelineEngine
    deepspeed.PipelineEngine = cls
    try:
        yield
    finally:
        deepspeed.PipelineEngine = original


def initialize(args=None,
               model=None,
               optimizer=None,
               model_parameters=None,
               training_data=None,
               lr_scheduler=None,
               distributed_port=None,
               mpu=None,
               dist_init_required=None,
               collate_fn=None,
               config=None,
               mesh_param=None,
               config_params=None):
    """Drop-in for ``deepspeed.initialize``: same arguments, same 4-tuple.

    A ``"paci"`` section turns PACI on unless it says ``"enabled": false``; the engine built is said in one line on
    rank 0 (``ds_paci: PACI on ...`` from the engine, ``ds_paci: PACI off: <why> (<fix>)`` here).
    Raises :class:`PACIConfigError` (on every rank, before any engine is built) when
    the ``paci`` section or its combination with the run cannot be honoured, or when a top-level key looks meant for
    it but is not ``"paci"`` (``"PACI"``, ``"paci_config"``). Also starts
    :func:`ds_paci.core.health.lifecycle.watch_launchers` (for any engine): a rank whose launcher
    process dies stops instead of training on as an orphan; and, when the ranks span several
    nodes, :func:`ds_paci.core.health.liveness.watch_peers`: a lost node ends every other rank.
    """
    import deepspeed
    kwargs = dict(model=model,
                  optimizer=optimizer,
                  model_parameters=model_parameters,
                  training_data=training_data,
                  lr_scheduler=lr_scheduler,
                  mpu=mpu,
                  dist_init_required=dist_init_required,
                  collate_fn=collate_fn,
                  mesh_param=mesh_param)
    if distributed_port is not None:
        kwargs["distributed_port"] = distributed_port
    skip_cpu_jit_ops()
    # DeepSpeed's own initialize, even where a wrapper (e.g. the script runner's router) has been bound in its
    # place: wrappers made with functools.wraps carry the original as __wrapped__. No recursion either way.
    ds_initialize = inspect.unwrap(deepspeed.initialize)
    watch_launchers()
    ds_config = load_config(config if config is not None else config_params, args)
    check_section_key(ds_config)
    paci = parse_paci_section(ds_config.get("paci"))
    if not paci.enabled:
        say_off(*off_reason(ds_config))
        with deciding():
            result = ds_initialize(args=args, config=config, config_params=config_params, **kwargs)
        watch_peers()
        return result
    ds_config = validate_run(ds_config, model, paci)
    if args is not None and getattr(args, "deepspeed_config", None) is not None:
        args = copy.copy(args)
        args.deepspeed_config = None
    with _pipeline_engine_class(PACIPipelineEngine), deciding():
        result = ds_initialize(args=args, config=ds_config, **kwargs)
    if not isinstance(result[0], PACIPipelineEngine):
        low, high = compat.SUPPORTED
        raise RuntimeError(f"deepspeed {deepspeed.__version__} did not build the PACI engine (got "
                           f"{type(result[0]).__name__}); ds_paci supports deepspeed {low} to {high}")
    watch_peers()
    return result


def off_reason(ds_config):
    """(why PACI is off, how to turn it on) for a config whose ``"paci"`` section is absent or disabled."""
    if "paci" in ds_config:
        return ('the "paci" section says "enabled": false', 'remove "enabled": false to run PACI')
    return ('the DeepSpeed config has no "paci" section: DeepSpeed\'s stock engine',
            'add "paci": {} to the config to run PACI')
