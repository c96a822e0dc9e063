"""StageContext: what the stage-local parts of the engine may use, and nothing else.

The tied-weight exchange (:mod:`ds_paci.core.tied.weights`, :mod:`ds_paci.core.tied.optimizer`) and the look-ahead
(:mod:`ds_paci.core.lookahead.predict`, :mod:`ds_paci.core.lookahead.slots`) receive one of these instead of the
engine: the stage (its id, the pipeline's size, the rank), its parameters (``module``) and optimizer, its
data-parallel group, the clip threshold and window, the watchdog (its ``note`` says what a rank waits for),
the ``.data`` aliases of a ``torch.optim`` optimizer, the run's ``"paci"`` config and mode, the tied layers
(once built). ``engine`` is DeepSpeed's engine object itself, for DeepSpeed's own operations only (the data-
parallel reduce, the optimizer step): through its public API and :mod:`ds_paci.core.seam.deepspeed_internals`,
never the PACI engine's own state. Built once by :class:`~ds_paci.core.engine.pipeline_engine.PACIPipelineEngine`.
"""

__all__ = ["StageContext"]


class StageContext:
    """The narrow view of one rank's stage (see the module docstring)."""

    def __init__(self, engine, *, paci, stock_step, watchdog, aliases, describe_rank, ticks_emitted, window):
        self.engine = engine
        self.stage_id = engine.stage_id
        self.num_stages = engine.num_stages
        self.global_rank = engine.global_rank
        self.module = engine.module
        self.grid = engine.grid
        self.dp_world_size = engine.dp_world_size
        self.paci = paci
        self.stock_step = stock_step  # sync mode with a = M: DeepSpeed's own step
        self.watchdog = watchdog
        self.aliases = aliases  # ParamAliases of a torch.optim optimizer, or None
        self.describe_rank = describe_rank  # "rank R (stage s of P, data-parallel rank d)"
        self._ticks_emitted = ticks_emitted
        self._window = window
        self.tied = None  # the TiedWeights, once built

    @property
    def optimizer(self):
        return self.engine.optimizer

    @property
    def accumulation_window(self):
        """``a`` now (``set_train_batch_size`` may change a defaulted window)."""
        return self._window()

    def gradient_clipping(self):
        return self.engine.gradient_clipping()

    def data_parallel_group(self):
        return self.grid.get_data_parallel_group()

    def ticks_emitted(self):
        """Ticks the stage's stream has emitted (where the watchdog says a rank is)."""
        return self._ticks_emitted()
