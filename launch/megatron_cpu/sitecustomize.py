"""CPU-only environment shim for Megatron-DeepSpeed (4efb479d) with DeepSpeed 0.19.8: what a CPU machine without
torchvision and flash-attn lacks to run the unmodified ``pretrain_gpt.py`` (README, "Megatron-DeepSpeed").

NOT part of ds_paci and not about PACI: the stock engine needs it just the same on such a machine, and a Megatron
user on a GPU node with Megatron's usual packages (and DeepSpeed <= 0.19.4) needs none of it. Put this folder on
``PYTHONPATH`` and Python imports this file at start-up in every process of a run (launcher and ranks); nothing is
imported here eagerly: each shim is an import hook that acts only when Megatron (or DeepSpeed) imports the module
concerned. No Megatron or DeepSpeed file is edited. What each shim stands in for (``README.md`` here, one line each):

1. ``megatron.model.vision.knn_monitor`` -> a stub. ``megatron/training.py`` imports it at top level; the real one
   imports torchvision and PIL (not installed here). GPT pre-training never calls it.
2. ``deepspeed.compression.compress`` -> a stub, only where DeepSpeed lacks the module (it ships up to 0.19.4,
   not in 0.19.5+). ``training.py`` imports it at top level; only ``--compression-training`` uses it.
3. ``megatron.model.transformer.CoreAttention.forward`` gets contiguous query/key/value. Without flash-attn the
   non-flash path calls ``.view()`` on strided slices of the fused QKV output and fails (fixed upstream later).
4. ``megatron.data.indexed_dataset.MMapIndexedDatasetBuilder.add_doc`` counts tokens the sizes leave out into the
   document's last sentence: ``tools/preprocess_data.py --append-eod`` appends the EOD to the ids but not to the
   sentence lengths (upstream NVIDIA/Megatron-LM#431), which shifts every later document in the ``.idx``.
5. ``deepspeed.runtime.pipe.engine.PipelineEngine.mem_status`` -> a no-op, only where DeepSpeed lacks it. Megatron's
   ZB-H1 (``--enable-zbh1-pipeline``, ``deepspeed_zbh1_engine.py``) calls it; older DeepSpeed releases had it as a
   method whose first statement was ``return``, newer ones dropped it (0.19.8 has none).
6. ``megatron.core.pipeline_parallel.deepspeed_zbh1_engine._exec_backward_only_pass`` runs with the engine's
   ``_running_engine_backward`` flag set, only where DeepSpeed has that flag. DeepSpeed 0.19.x hooks every
   forward output and refuses a backward through it that the engine did not start (``Direct calls to
   tensor.backward() are not supported ... ZeRO stage 0``); its own ``PipelineEngine._exec_backward_pass`` sets
   the flag around the same ``backward`` call of a non-last stage, which Megatron's ZB-H1 copy of that function
   (written against older DeepSpeed) does not. Same computation, same flag as the stock engine's backward.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import sys

_STUBBED = "stubbed out by the CPU-only environment shim (launch/megatron_cpu/sitecustomize.py)"


def _raise(what):
    def fail(*args, **kwargs):
        raise RuntimeError(f"{what} is {_STUBBED}")
    return fail


def _knn_monitor(module):
    module.compute_feature_bank = _raise("knn_monitor.compute_feature_bank (needs torchvision)")
    module.get_feature_bank = _raise("knn_monitor.get_feature_bank (needs torchvision)")
    module.knn_predict = _raise("knn_monitor.knn_predict (needs torchvision)")


def _compress(module):
    module.init_compression = _raise("deepspeed.compression.compress.init_compression (DeepSpeed >= 0.19.5)")
    module.redundancy_clean = _raise("deepspeed.compression.compress.redundancy_clean (DeepSpeed >= 0.19.5)")


def _contiguous_attention(module):
    forward = module.CoreAttention.forward

    def contiguous_forward(self, query_layer, key_layer, value_layer, *args, **kwargs):
        return forward(self, query_layer.contiguous(), key_layer.contiguous(), value_layer.contiguous(), *args,
                       **kwargs)

    module.CoreAttention.forward = contiguous_forward


def _eod_sizes(module):
    add_doc = module.MMapIndexedDatasetBuilder.add_doc

    def add_doc_with_eod(self, tensor, sizes, *args, **kwargs):
        sizes = list(sizes)
        missing = len(tensor) - sum(sizes)
        if missing > 0 and sizes:
            sizes[-1] += missing
        return add_doc(self, tensor, sizes, *args, **kwargs)

    module.MMapIndexedDatasetBuilder.add_doc = add_doc_with_eod


def _mem_status(module):
    if not hasattr(module.PipelineEngine, "mem_status"):
        module.PipelineEngine.mem_status = lambda self, msg, print_rank=-1, reset_max=False: None


def _zbh1_engine_backward(module):
    backward_only = module._exec_backward_only_pass

    def backward_only_as_the_engine(self, buffer_id):
        if not hasattr(self, "_running_engine_backward") or self.is_last_stage():  # the last stage: engine.backward
            return backward_only(self, buffer_id)
        self._running_engine_backward = True
        try:
            return backward_only(self, buffer_id)
        finally:
            self._running_engine_backward = False

    module._exec_backward_only_pass = backward_only_as_the_engine


class _StubLoader(importlib.abc.Loader):
    def __init__(self, fill):
        self.fill = fill

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        self.fill(module)


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real module, then patches it."""

    def __init__(self, loader, patch):
        self.loader, self.patch = loader, patch

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        self.patch(module)


class _ReplaceFinder(importlib.abc.MetaPathFinder):
    """First on sys.meta_path: modules replaced outright, or loaded as usual and then patched."""

    REPLACE = {"megatron.model.vision.knn_monitor": _knn_monitor}
    PATCH = {"megatron.model.transformer": _contiguous_attention, "megatron.data.indexed_dataset": _eod_sizes,
             "deepspeed.runtime.pipe.engine": _mem_status,
             "megatron.core.pipeline_parallel.deepspeed_zbh1_engine": _zbh1_engine_backward}

    def find_spec(self, name, path=None, target=None):
        if name in self.REPLACE:
            return importlib.util.spec_from_loader(name, _StubLoader(self.REPLACE[name]))
        if name in self.PATCH:
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, self.PATCH[name])
            return spec
        return None


class _FallbackFinder(importlib.abc.MetaPathFinder):
    """Last on sys.meta_path: a stub only when no real module was found."""

    FALLBACK = {"deepspeed.compression.compress": _compress}

    def find_spec(self, name, path=None, target=None):
        if name in self.FALLBACK:
            return importlib.util.spec_from_loader(name, _StubLoader(self.FALLBACK[name]))
        return None


sys.meta_path.insert(0, _ReplaceFinder())
sys.meta_path.append(_FallbackFinder())
