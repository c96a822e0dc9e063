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
  whose config has a ``"paci"`` section (or a top-level key that looks meant for one, which
  :func:`ds_paci.initialize` refuses) goes to :func:`ds_paci.initialize` (PACI unless the section says
  ``"enabled": false``); everything else (any other model, a config without the section) to DeepSpeed's own
  ``initialize``, untouched but for the one ``ds_paci: PACI off: <why> (<fix>)`` line on rank 0. The config is read from ``config=``, ``config_params=``,
  ``args.deepspeed_config`` (a path or a dict) or, where none of these is set, ``args.deepspeed_config_dict``
  (Megatron-DeepSpeed builds it and passes ``config=args.deepspeed_config_dict``).
* Recursion-safe: the router carries the original as ``__wrapped__`` (``ds_paci.initialize`` calls
  ``inspect.unwrap(deepspeed.initialize)``, never the router), and a call made while the router is
  already routing goes straight to the original.
* **The end of the script.** When the script returns (or exits with code 0), every PACI engine it built that is
  still alive and has trained is drained (``engine.drain()``: the micro-batches in flight completed, every open
  accumulation window stepped; every rank runs the same script, so every stage drains together; one line on
  rank 0), then its side channel and watchdog are closed and the default process group is destroyed, so no
  thread or pending transfer is left to the interpreter's exit (:func:`ds_paci.core.engine.startup.finish_engines`).
  A script that raised is left as it is (nothing is drained).
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


def route(bound):
    """Where a ``deepspeed.initialize`` call goes: ``"paci"`` (to :func:`ds_paci.initialize`, which runs PACI, says
    why not, or refuses a misspelt section), ``None`` (DeepSpeed's own, silently: a config it will report on itself),
    or ``(why, fix)`` (DeepSpeed's own, the PACI-off line said first)."""
    from deepspeed.pipe import PipelineModule

    from ds_paci.core.config import PACI_SECTION, PACIConfigError, load_config
    config = _config_of(bound)
    if config is None:
        return None
    try:
        ds_config = load_config(config)
    except PACIConfigError:
        return None  # let DeepSpeed report its own error about the config
    paci_like = [k for k in ds_config if isinstance(k, str) and PACI_SECTION in k.lower()]
    model = bound.get("model")
    if not isinstance(model, PipelineModule):
        return (f"the model is a {type(model).__name__}, not a deepspeed.pipe.PipelineModule: DeepSpeed's stock engine",
                "PACI runs pipelines: build the model as PipelineModule(layers=..., num_stages=...)")
    if paci_like:
        return "paci"
    return ('the DeepSpeed config has no "paci" section: DeepSpeed\'s stock engine',
            'add "paci": {} to the config to run PACI')


def router(original):
    """``deepspeed.initialize`` that sends PACI pipelines to ``ds_paci.initialize`` (see the module docstring)."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def initialize(*args, **kwargs):
        from ds_paci.core.engine.startup import deciding, say_off
        if getattr(_routing, "active", False):
            return original(*args, **kwargs)
        bound = signature.bind_partial(*args, **kwargs).arguments
        where = route(bound)
        if where != "paci":
            if where is not None:
                say_off(*where)
            with deciding():
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
    """Rebind ``deepspeed.initialize`` to the router (idempotent); returns DeepSpeed's own ``initialize``."""
    import deepspeed

    from ds_paci.core.runtime import skip_cpu_jit_ops
    skip_cpu_jit_ops()
    current = deepspeed.initialize
    original = inspect.unwrap(current)  # DeepSpeed's own, under ds_paci's stock-engine warning (import ds_paci)
    if not getattr(current, "ds_paci_router", False):
        deepspeed.initialize = router(original)  # the router says PACI on or off itself: no warning layer below it
    return original


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
            end_of_script()
            return 0
        sys.path[0] = os.path.dirname(os.path.abspath(target))  # as `python script.py` has it
        runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:
        if exc.code in (None, 0):
            end_of_script()
        raise
    except Exception as exc:
        from ds_paci.core.health.liveness import exit_if_lost
        exit_if_lost(exc)  # across nodes: a lost node's ranks are named by the peer watch, not a traceback
        raise
    end_of_script()
    return 0


def end_of_script():
    """The script returned (or exited 0): drain its PACI engines, then release the process group (see the module
    docstring)."""
    from ds_paci.core.engine.startup import finish_engines
    finish_engines(drain=True, release=True)
