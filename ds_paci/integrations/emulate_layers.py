"""Emulated device time attached from outside to a program's own layer class, then the script runner.

::

    deepspeed --num_gpus 4 --module ds_paci.integrations.emulate_layers \\
        --emulate-seconds 0.05 --emulate-layer megatron.model.transformer:ParallelTransformerLayerPipe \\
        <megatron>/pretrain_gpt.py <Megatron arguments> --deepspeed --deepspeed_config ds.json

For measurements only (the side-by-side Megatron benchmark, ``scripts/megatron_bench.py``). Contract:

* Every forward of the named class (``module:Class``) is followed by the benchmark's emulation
  (:class:`ds_paci.workload.emulate.EmulatedDeviceTime`): the first output tensor passes through an identity
  whose forward sleeps ``F`` seconds and whose backward sleeps ``2F``. ``time.sleep`` uses no CPU, so stages on a
  few cores overlap their emulated device time as stages on separate devices would. Nothing else changes: the
  model's layer list (and so DeepSpeed's stage partition), the arguments, the numbers (the identity is exact).
  An activation-checkpointed layer sleeps ``F`` again when it is recomputed in the backward pass.
* ``--emulate-fbw F,B,W`` instead splits the time: forward ``F``, backward ``B`` on the activation path and then
  ``W`` for the weight gradient (:func:`ds_paci.workload.emulate.deferred_split_wait`). With
  ``--emulate-weight-queue module:Class`` the ``W`` wait is handed to ``Class.put(None, None, None, fn)``, the
  queue a program keeps its weight-gradient work in (Megatron-DeepSpeed's ZB-H1:
  ``megatron.core.tensor_parallel.weight_grad_store:WeightGradStore``, which runs it at once in a full backward and
  keeps it for the next ``WeightPass`` in a backward-only pass); without it ``W`` follows ``B`` in the same backward.
* The class is patched when its module is first imported (an import hook), so the program is not edited.
* Then :func:`ds_paci.integrations.runner.main` runs the script exactly as ``python -m ds_paci.run`` does
  (PACI when the config has ``"paci": {"enabled": true}``, DeepSpeed's engine otherwise).
* Timings measured with ``F > 0`` are emulated, not hardware results.
"""

import importlib
import importlib.abc
import sys

from ds_paci.integrations import runner

USAGE = ("usage: python -m ds_paci.integrations.emulate_layers [--local_rank=N] (--emulate-seconds F | "
         "--emulate-fbw F,B,W [--emulate-weight-queue module:Class]) --emulate-layer module:Class SCRIPT.py "
         "[script arguments]")


def _split_delay(times, queue):
    """A tensor -> tensor function waiting ``times = (F, B, W)``, ``W`` through ``queue`` (``module:Class``) when
    given."""
    from ds_paci.workload.emulate import deferred_split_wait

    def defer(fn):
        module, _, name = queue.partition(":")
        getattr(importlib.import_module(module), name).put(None, None, None, lambda *_: fn())

    return lambda x: deferred_split_wait(x, *times, defer=defer if queue else None)


def attach(cls, seconds, fbw=None, queue=None):
    """Make every ``cls.forward`` output pass through ``EmulatedDeviceTime(seconds)`` (first tensor of a tuple),
    or, with ``fbw = (F, B, W)``, through the split wait (``W`` via ``queue`` when given)."""
    import torch

    from ds_paci.workload.emulate import EmulatedDeviceTime

    if getattr(cls.forward, "ds_paci_emulated", False):
        return
    delay = EmulatedDeviceTime(seconds) if fbw is None else _split_delay(fbw, queue)
    forward = cls.forward

    def emulated_forward(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        if torch.is_tensor(out):
            return delay(out)
        if isinstance(out, tuple) and out and torch.is_tensor(out[0]):
            return (delay(out[0]), ) + tuple(out[1:])
        raise TypeError(f"{cls.__qualname__}.forward returned {type(out).__name__}; emulate_layers needs a tensor "
                        "or a tuple starting with one")

    emulated_forward.ds_paci_emulated = True
    cls.forward = emulated_forward


class _AttachOnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``module`` as usual, then attaches the emulation to its ``cls_name``."""

    def __init__(self, module, cls_name, seconds, fbw=None, queue=None):
        self.module, self.cls_name, self.seconds = module, cls_name, seconds
        self.fbw, self.queue = fbw, queue
        self._loader = None

    def find_spec(self, name, path=None, target=None):
        if name != self.module:
            return None
        spec = None
        for finder in sys.meta_path:  # whoever would have loaded it (other import hooks keep working)
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
        if spec is None or spec.loader is None:
            return None
        self._loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        cls = getattr(module, self.cls_name, None)
        if cls is None:
            raise ImportError(f"emulate_layers: module {self.module} has no class {self.cls_name}")
        attach(cls, self.seconds, self.fbw, self.queue)


def install(layer, seconds, fbw=None, queue=None):
    """Attach the emulation to ``layer`` (``module:Class``) now if its module is loaded, else when it is imported."""
    module, _, cls_name = layer.partition(":")
    if not module or not cls_name:
        raise SystemExit(f"emulate_layers: --emulate-layer takes module:Class, got {layer!r}\n{USAGE}")
    if seconds < 0 or (fbw is not None and min(fbw) < 0):
        raise SystemExit(f"emulate_layers: emulated seconds must be >= 0, got {fbw if fbw is not None else seconds}")
    if queue is not None and ":" not in queue:
        raise SystemExit(f"emulate_layers: --emulate-weight-queue takes module:Class, got {queue!r}\n{USAGE}")
    if module in sys.modules:
        attach(getattr(importlib.import_module(module), cls_name), seconds, fbw, queue)
    else:
        sys.meta_path.insert(0, _AttachOnImport(module, cls_name, seconds, fbw, queue))


def _fbw(text):
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 3:
        raise SystemExit(f"emulate_layers: --emulate-fbw takes three seconds F,B,W, got {text!r}\n{USAGE}")
    return values


def split_options(argv):
    """``[--local_rank=N] --emulate-seconds F | --emulate-fbw F,B,W [--emulate-weight-queue Q] --emulate-layer L
    SCRIPT ...`` -> ``(seconds, layer, runner argv, fbw, queue)``."""
    leading, seconds, layer, fbw, queue, i = [], None, None, None, None, 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--local_rank") or arg.startswith("--local-rank"):
            if "=" in arg:
                leading.append(arg)
                i += 1
            else:
                leading += argv[i:i + 2]
                i += 2
        elif arg in ("--emulate-seconds", "--emulate-layer", "--emulate-fbw", "--emulate-weight-queue") \
                and i + 1 < len(argv):
            value = argv[i + 1]
            if arg == "--emulate-seconds":
                seconds = float(value)
            elif arg == "--emulate-fbw":
                fbw = _fbw(value)
            elif arg == "--emulate-weight-queue":
                queue = value
            else:
                layer = value
            i += 2
        else:
            break
    if (seconds is None) == (fbw is None) or layer is None or (queue is not None and fbw is None):
        raise SystemExit(USAGE)
    return (0.0 if seconds is None else seconds), layer, leading + argv[i:], fbw, queue


def main(argv=None):
    seconds, layer, rest, fbw, queue = split_options(sys.argv[1:] if argv is None else list(argv))
    install(layer, seconds, fbw, queue)
    return runner.main(rest)


if __name__ == "__main__":
    sys.exit(main())
