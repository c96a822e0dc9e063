"""Meters that run inside a rank: saved-for-backward activation bytes, weight storage, peak RSS, stock-engine tracer."""

from __future__ import annotations

import time
from collections import Counter

from ds_paci.core.program.actions import Kind


def _storage_of(tensor):
    """``(data_ptr, nbytes)`` of the storage behind ``tensor``, or ``None`` when it has none."""
    try:
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):
        return None


def _tensors_in(obj):
    """Every tensor in a tensor / (nested) tuple or list / ``None``."""
    import torch
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _tensors_in(item)


class _SavedForBackward:
    """What autograd keeps instead of a saved tensor while the meter is on; its death releases the bytes.

    It holds the tensor *detached* (same storage, no ``grad_fn``): a saved output holding its own ``grad_fn``
    would make a reference cycle through autograd's C++ graph that Python's collector cannot see, which keeps the
    node alive whenever autograd does not release it itself (nodes only an input-gradient pass ran, with
    ``retain_graph=True``, as torch's zero-bubble schedules do; a graph no backward ever ran).
    """

    __slots__ = ("tensor", "key", "meter")

    def __init__(self, tensor, key, meter):
        self.tensor, self.key, self.meter = tensor.detach(), key, meter

    def __del__(self):
        try:
            self.meter._release(self.key)
        except Exception:  # interpreter shutdown
            pass


class SavedTensorMeter:
    """Peak bytes of the tensors autograd saves for backward, for any engine's parameters.

    ``peak_saved_bytes``: most bytes ever held at once by tensors saved for backward while :meth:`training`
    is on, counted once per storage, the storages of ``params`` excluded. Tracked at every save; a saved
    tensor counts until autograd drops it (after the backward that used it, or with its graph).
    """

    def __init__(self, params):
        self._param_storages = {_storage_of(p)[0] for p in params}
        self._saved = {}  # storage data_ptr -> [references, nbytes]
        self.saved_bytes = 0
        self.peak_saved_bytes = 0
        self._active = False

    def training(self):
        """Context manager: count saved tensors inside it."""
        import contextlib

        import torch

        @contextlib.contextmanager
        def scope():
            self._active = True
            try:
                with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                    yield
            finally:
                self._active = False

        return scope()

    def _pack(self, tensor):
        storage = _storage_of(tensor)
        if storage is None or storage[0] in self._param_storages:
            return tensor
        key, nbytes = storage
        entry = self._saved.get(key)
        if entry is None:
            self._saved[key] = [1, nbytes]
            self.saved_bytes += nbytes
            self.peak_saved_bytes = max(self.peak_saved_bytes, self.saved_bytes)
        else:
            entry[0] += 1
        return _SavedForBackward(tensor, key, self)

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _SavedForBackward) else packed

    def reset_peak(self):
        """Start the peak afresh from what is saved now (e.g. after warm-up steps)."""
        self.peak_saved_bytes = self.saved_bytes

    def _release(self, key):
        entry = self._saved[key]
        entry[0] -= 1
        if entry[0] == 0:
            del self._saved[key]
            self.saved_bytes -= entry[1]


class ActivationMeter(SavedTensorMeter):
    """Peak activation bytes of one pipeline stage, measured identically for every engine.

    * ``peak_saved_bytes``: most bytes ever held at once by tensors autograd saved for
      backward, counted once per storage, parameters excluded. Tracked at every save.
    * ``peak_held_bytes``: most bytes of the union of those saved storages, the
      engine's pipe buffers (inputs, labels, outputs) and the stage output, sampled
      right after each training forward of the stage (when a 1F1B stage holds most).

    Use :meth:`training` around training calls only; evaluation is not counted.
    """

    def __init__(self, engine):
        super().__init__(engine.module.parameters())
        self._engine = engine
        self.peak_held_bytes = 0
        engine.module.register_forward_hook(self._after_stage_forward)

    def _after_stage_forward(self, module, inputs, output):
        import torch
        if not (self._active and module.training and torch.is_grad_enabled()):
            return
        held = {key: entry[1] for key, entry in self._saved.items()}
        from ds_paci.core.seam import deepspeed_internals
        buffers = deepspeed_internals.pipe_buffers(self._engine)
        for tensor in _tensors_in([list(slots) for slots in buffers.values()] + [output]):
            storage = _storage_of(tensor)
            if storage is not None and storage[0] not in self._param_storages:
                held[storage[0]] = storage[1]
        self.peak_held_bytes = max(self.peak_held_bytes, sum(held.values()))


def weight_storage_report(engine) -> dict:
    """Parameter and optimizer-state bytes of this stage, and whether the optimizer holds any weight copy.

    ``extra_weight_bytes`` counts optimizer parameter tensors whose storage is not a
    module parameter's (0 = the optimizer updates the module's own weights).
    ``aliases_share_storage`` (PACI's ``engine._aliases`` only): every alias has its
    parameter's ``data_ptr``; ``None`` when the engine has no aliases.
    """
    import torch
    params = list(engine.module.parameters())
    module_storages = {_storage_of(p)[0] for p in params}
    extra = 0
    for group in engine.optimizer.param_groups:
        for p in group["params"]:
            storage = _storage_of(p)
            if storage[0] not in module_storages:
                extra += storage[1]
    state_bytes = 0
    for state in engine.optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                state_bytes += value.numel() * value.element_size()
    aliases = getattr(engine, "_aliases", None)
    shared = None
    if aliases is not None:
        shared = all(alias.data_ptr() == p.data_ptr() for p, alias in aliases.pairs)
    return {
        "param_bytes": sum(p.numel() * p.element_size() for p in params),
        "param_count": sum(p.numel() for p in params),
        "optimizer_state_bytes": state_bytes,
        "extra_weight_bytes": extra,
        "aliases_share_storage": shared,
    }


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports ``ru_maxrss`` in KiB)."""
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class StockInstructionTracer:
    """Per-instruction records of the stock engine, in :mod:`ds_paci.tools.sim.records` format.

    :meth:`install` gives one engine its own instruction table, DeepSpeed's stock functions wrapped; DeepSpeed's
    class table (``PipelineEngine._INSTRUCTION_MAP``), and so every other engine, is left unchanged (the table
    lives in :mod:`ds_paci.core.seam.deepspeed_internals`). Records are taken while :attr:`active`.
    Micro-batch ids are counted per instruction type, which 1F1B executes in
    micro-batch order; the optimizer step prints as ``STEP<n>`` (n = steps so far).
    """

    _CODES = {  # DeepSpeed's instruction type -> the program vocabulary's text code
        "LoadMicroBatch": Kind.LOAD.value,
        "ForwardPass": Kind.FORWARD.value,
        "BackwardPass": Kind.BACKWARD.value,
        "SendActivation": Kind.SEND_ACT.value,
        "RecvActivation": Kind.RECV_ACT.value,
        "SendGrad": Kind.SEND_GRAD.value,
        "RecvGrad": Kind.RECV_GRAD.value,
    }
    _NAMES = {"ReduceGrads": Kind.REDUCE_GRADS.value, "ReduceTiedGrads": Kind.REDUCE_TIED.value}

    def __init__(self, rank: int, stage: int):
        self.rank, self.stage = rank, stage
        self.records = []
        self.active = False
        self._counts = Counter()

    def install(self, engine):
        """Time ``engine``'s stock instructions from now on (one tracer may serve several engines in turn)."""
        from ds_paci.core.seam import deepspeed_internals
        table = {cls: self._timed(cls.__name__, fn) for cls, fn in deepspeed_internals.stock_instruction_map().items()}
        deepspeed_internals.set_engine_instruction_map(engine, table)

    def _timed(self, type_name, fn):
        tracer = self

        def run(engine, **kwargs):
            if not tracer.active:
                return fn(engine, **kwargs)
            start = time.time()
            result = fn(engine, **kwargs)
            tracer.records.append({"rank": tracer.rank, "stage": tracer.stage, "instr": tracer._text(type_name),
                                   "start": start, "end": time.time()})
            return result

        return run

    def _text(self, type_name):
        n = self._counts[type_name]
        self._counts[type_name] += 1
        if type_name in self._CODES:
            return f"{self._CODES[type_name]}{n}"
        if type_name == "OptimizerStep":
            return f"{Kind.STEP.value}{n + 1}"
        return self._NAMES.get(type_name, type_name.upper())
