"""Model definitions for pipeline training."""

from .gpt2 import (
    SIZES,
    Block,
    Embedding,
    FinalNorm,
    LMHead,
    gpt2_config,
    gpt2_layer_specs,
    gpt2_pipeline,
    gpt2_reference_model,
    layer_seeds,
    lm_loss,
)

__all__ = [
    "SIZES",
    "Block",
    "Embedding",
    "FinalNorm",
    "LMHead",
    "gpt2_config",
    "gpt2_layer_specs",
    "gpt2_pipeline",
    "gpt2_reference_model",
    "layer_seeds",
    "lm_loss",
]
