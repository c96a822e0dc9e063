"""Stage-local optimizer steps: everything a local step needs besides the engine's loop.

Two problems are solved here:

1. **No cross-stage collective.** DeepSpeed computes gradient norms and overflow
   flags over its "model parallel" group, which in a pipeline grid spans every
   stage of a replica. :class:`StageLocalMPU` is a view of the grid in which the
   model-parallel group is the stage's own tensor-parallel slice (a single rank
   when TP = 1) and the pipeline has one stage, so norms, clipping and overflow
   checks stay on the stage. It is handed to the optimizer wrappers only; the
   engine keeps the real grid (checkpoint file names depend on it).

2. **Backward through the current weights on stock PyTorch.** A micro-batch whose
   backward runs after a local step must use the updated weights (PACI's
   semantics), but a ``torch.optim`` step updates parameters in place and bumps
   autograd's version counter, so the pending backward would raise "modified by an
   inplace operation". :class:`ParamAliases` lets the optimizer step on aliases
   made with ``param.data``: they share storage with the parameters (so the update
   is visible to everyone) but not the version counter. DeepSpeed's BF16 and ZeRO-1
   wrappers already write parameters through ``.data`` and need no alias.
"""

import torch
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer


class StageLocalMPU:
    """A pipeline grid whose model-parallel and pipeline groups are confined to one stage.

    Every other query (data-parallel group and rank, slice group, ...) goes to the grid.
    """

    def __init__(self, grid):
        self._grid = grid

    def __getattr__(self, name):
        return getattr(self._grid, name)

    def get_model_parallel_group(self):
        return self._grid.get_slice_parallel_group()

    def get_model_parallel_rank(self):
        return self._grid.get_slice_parallel_rank()

    def get_model_parallel_world_size(self):
        return self._grid.get_slice_parallel_world_size()

    def get_pipe_parallel_world_size(self):
        return 1

    def get_pipe_parallel_rank(self):
        return 0


class ParamAliases:
    """Point a ``torch.optim`` optimizer at ``.data`` aliases of its parameters.

    Call :meth:`bind_grads` right before ``optimizer.step()`` and :meth:`release_grads`
    right after. Optimizer state stays keyed by position, so ``state_dict()`` and
    ``load_state_dict()`` are unchanged.
    """

    def __init__(self, optimizer):
        self.pairs = []
        for group in optimizer.param_groups:
            aliases = []
            for p in group["params"]:
                alias = p.data
                self.pairs.append((p, alias))
                aliases.append(alias)
            group["params"] = aliases
        # Optimizer state created before aliasing (e.g. a resumed client optimizer) follows its parameter.
        for p, alias in self.pairs:
            if p in optimizer.state:
                optimizer.state[alias] = optimizer.state.pop(p)

    def bind_grads(self):
        for p, alias in self.pairs:
            alias.grad = p.grad

    def release_grads(self):
        for _, alias in self.pairs:
            alias.grad = None


def make_stage_local(engine):
    """Confine the engine's optimizer to its stage; returns a :class:`ParamAliases` or ``None``.

    Raises ``TypeError`` for an optimizer wrapper whose step we cannot confine.
    """
    mpu = StageLocalMPU(engine.grid)
    opt = engine.optimizer
    if opt is None:
        raise TypeError("PACI needs an optimizer: pass optimizer= to initialize or add an \"optimizer\" section")
    if isinstance(opt, BF16_Optimizer):
        opt.mpu = mpu
        return None
    if isinstance(opt, DeepSpeedZeroOptimizer):
        opt.model_parallel_group = mpu.get_model_parallel_group()
        opt.model_parallel_world_size = mpu.get_model_parallel_world_size()
        opt.model_parallel_rank = mpu.get_model_parallel_rank()
        return None
    if isinstance(opt, torch.optim.Optimizer):
        return ParamAliases(opt)
    raise TypeError(f"optimizer wrapper {type(opt).__name__} is not supported by PACI; use fp32 or bf16 with "
                    "ZeRO stage 0 or 1 and a torch.optim optimizer or DeepSpeed's configured one")


def clip_stage_gradients(engine, max_norm):
    """Clip this stage's gradients by their own norm (over the stage and its DP replicas); returns the norm."""
    from deepspeed.runtime.utils import clip_grad_norm_
    return clip_grad_norm_(parameters=engine.module.parameters(), max_norm=max_norm, mpu=StageLocalMPU(engine.grid))
