"""Run an unmodified DeepSpeed training script on the PACI engine.

::

    deepspeed --num_gpus 2 --module ds_paci.run train.py --deepspeed_config paci.json [script args]
    torchrun --nproc_per_node 2 -m ds_paci.run train.py --deepspeed_config paci.json [script args]
    python -m ds_paci.run train.py ...            (single process, or under any launcher)
    python -m ds_paci.run -m package.module ...   (a script that is itself run as a module)

Contract:

* The script runs as ``python train.py`` would run it: as ``__main__`` (:func:`runpy.run_path`), with
  ``sys.argv = [train.py, <arguments>]`` and the script's folder first on ``sys.path``. The deepspeed
  launcher puts ``--local_rank=N`` before the script path when it runs a module; it is moved after it,
  where ``deepspeed train.py`` puts it. Exit codes and exceptions are the script's.
* Before the script starts, ``deepspeed.initialize`` is rebound to :func:`router`: a ``PipelineModule``
  whose config has ``"paci": {"enabled": true}`` goes to :func:`ds_paci.initialize`, everything else
  (any other model, a config without the section, ``enabled: false``) to DeepSpeed's own
  ``initialize``, untouched. The config is read from ``config=``, ``config_params=``,
  ``args.deepspeed_config`` (a path or a dict) or, where none of these is set, ``args.deepspeed_config_dict``
  (Megatron-DeepSpeed builds it and passes ``config=args.deepspeed_config_dict``).
* Recursion-safe: the router carries the original as ``__wrapped__`` (``ds_paci.initialize`` calls
  ``inspect.unwrap(deepspeed.initialize)``, never the router), and a call made while the router is
  already routing goes straight to the original.
* DeepSpeed's CPU shared-memory op build is skipped as in ``ds_paci.initialize`` (for both engines).
* Across nodes (one DeepSpeed launcher per node), ``ds_paci.initialize`` starts the peer watch
  (:mod:`ds_paci.core.health.liveness`); a transfer that fails because a node was lost ends the rank with the watch's
  line instead of the traceback.
"""

import functools
import inspect
import os
import runpy
import sys
import threading

USAGE = ("usage: python -m ds_paci.run [--local_rank=N] SCRIPT.py [script arguments]\n"
         "       python -m ds_paci.run [--local_rank=N] -m MODULE [module arguments]\n"
         "       deepspeed --num_gpus N --module ds_paci.run SCRIPT.py [script arguments]")

_routing = threading.local()


def _config_of(bound):
    """The DeepSpeed config a ``deepspeed.initialize`` call carries (dict, path or None), as DeepSpeed resolves it."""
    config = bound.get("config")
    if config is None:
        config = bound.get("config_params")
    args = bound.get("args")
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None)
        if config is None:
            config = getattr(args, "deepspeed_config_dict", None)
    return config


def wants_paci(bound):
    """True when the call builds a pipeline with ``"paci": {"enabled": true}``."""
    from deepspeed.pipe import PipelineModule

    from ds_paci.core.config import PACIConfigError, load_config
    if not isinstance(bound.get("model"), PipelineModule):
        return False
    config = _config_of(bound)
    if config is None:
        return False
    try:
        section = load_config(config).get("paci")
    except PACIConfigError:
        return False  # let DeepSpeed report its own error about the config
    return isinstance(section, dict) and section.get("enabled") is True


def router(original):
    """``deepspeed.initialize`` that sends PACI pipelines to ``ds_paci.initialize`` (see the module docstring)."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def initialize(*args, **kwargs):
        if getattr(_routing, "active", False):
            return original(*args, **kwargs)
        bound = signature.bind_partial(*args, **kwargs).arguments
        if not wants_paci(bound):
            return original(*args, **kwargs)
        import ds_paci
        call = dict(bound)
        ds_args = call.get("args")
        if (call.get("config") is None and call.get("config_params") is None and ds_args is not None
                and getattr(ds_args, "deepspeed_config", None) is None):
            call["config"] = getattr(ds_args, "deepspeed_config_dict")
        _routing.active = True
        try:
            return ds_paci.initialize(**call)
        finally:
            _routing.active = False

    initialize.ds_paci_router = True
    return initialize


def install():
    """Rebind ``deepspeed.initialize`` to the router (idempotent); returns the original."""
    import deepspeed

    from ds_paci.core.runtime import skip_cpu_jit_ops
    skip_cpu_jit_ops()
    current = deepspeed.initialize
    if getattr(current, "ds_paci_router", False):
        return inspect.unwrap(current)
    deepspeed.initialize = router(current)
    return current


def split_argv(argv):
    """``[options before the script] SCRIPT [args]`` -> (leading --local_rank options, ('path'|'module', target), rest)."""
    leading, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--local_rank=") or arg.startswith("--local-rank="):
            leading.append(arg)
            i += 1
        elif arg in ("--local_rank", "--local-rank") and i + 1 < len(argv):
            leading += argv[i:i + 2]
            i += 2
        else:
            break
    rest = argv[i:]
    if not rest or rest[0] in ("-h", "--help"):
        raise SystemExit(USAGE)
    if rest[0] == "-m":
        if len(rest) < 2:
            raise SystemExit(USAGE)
        return leading, ("module", rest[1]), rest[2:]
    return leading, ("path", rest[0]), rest[1:]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    leading, (kind, target), rest = split_argv(argv)
    if kind == "path" and not os.path.isfile(target):
        raise SystemExit(f"ds_paci.run: no such script: {target!r}\n{USAGE}")
    install()
    sys.argv = [target] + leading + rest
    try:
        if kind == "module":
            runpy.run_module(target, run_name="__main__", alter_sys=True)
            return 0
        sys.path[0] = os.path.dirname(os.path.abspath(target))  # as `python script.py` has it
        runpy.run_path(target, run_name="__main__")
    except Exception as exc:
        from ds_paci.core.health.liveness import exit_if_lost
        exit_if_lost(exc)  # across nodes: a lost node's ranks are named by the peer watch, not a traceback
        raise
    return 0
