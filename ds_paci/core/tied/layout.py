"""Which stages own tied layers, and the tied arrangements PACI refuses. Reads only the model's layer specs,
its partition and the config, so every rank gives the same answer (:mod:`ds_paci.core.tied.weights` runs the exchange)."""

from ..seam import deepspeed_internals as ds

__all__ = ["tied_owner_stages", "zero_offload_device", "tied_arrangement_problem"]


def tied_owner_stages(module):
    """``{key: sorted owner stages}`` for the ``TiedLayerSpec`` keys of ``module`` used on two or more stages.

    Reads only the layer specs and the partition, so every rank computes the same answer.
    """
    from deepspeed.runtime.pipe.module import TiedLayerSpec
    parts = module.parts
    stages_of = {}
    for idx, spec in enumerate(ds.layer_specs(module)):
        if isinstance(spec, TiedLayerSpec):
            stage = next(s for s in range(module.num_stages) if parts[s] <= idx < parts[s + 1])
            stages_of.setdefault(spec.key, set()).add(stage)
    return {key: sorted(st) for key, st in sorted(stages_of.items()) if len(st) > 1}


def zero_offload_device(ds_config):
    """The device ZeRO offloads its optimizer to under ``ds_config`` (``"cpu"``, ``"nvme"``), or ``None``."""
    device = ((ds_config.get("zero_optimization") or {}).get("offload_optimizer") or {}).get("device")
    return None if device is None or str(device).lower() in ("none", "null") else str(device)


def tied_arrangement_problem(ds_config, model):
    """One line naming a tied arrangement PACI cannot keep identical, or ``None`` (same on every rank)."""
    owners = tied_owner_stages(model)
    if not owners:
        return None
    offload = zero_offload_device(ds_config)
    if offload is not None:
        return (f'"zero_optimization.offload_optimizer.device" = "{offload}" with tied layers {sorted(owners)} on '
                f"stages {sorted({s for st in owners.values() for s in st})}: ZeRO's offloaded optimizer keeps the "
                "gradients where PACI's tied exchange cannot reach them; remove the offload or untie the layers")
    return None
