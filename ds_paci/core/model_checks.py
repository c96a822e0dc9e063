"""Run-level checks that need the model (a ``PipelineModule``): each returns one line naming the problem and the
fix, or ``None``, the same on every rank. :func:`ds_paci.core.config.validate_run` raises them as
:class:`~ds_paci.core.config.PACIConfigError`."""

__all__ = ["model_parallel_problem", "slack_links_problem"]


def slack_links_problem(paci, model):
    """One line if ``"slack_links"`` cannot be honoured (sync mode, tied layers on several stages, a link the
    pipeline does not have), else ``None`` (the same on every rank)."""
    if not paci.enabled or not paci.slack_links:
        return None
    links = list(paci.slack_links)
    if paci.drain_every_batch:
        return (f'"paci.slack_links" = {links} is not allowed with "drain_every_batch": true (sync mode drains every '
                'call, so nothing is in flight to give slack to); remove one of the two')
    from .tied.layout import tied_owner_stages
    owners = tied_owner_stages(model)
    if owners:
        return (f'"paci.slack_links" = {links} is not allowed with tied layers {sorted(owners)} on several stages '
                '(their exchange lag assumes 1F1B\'s in-flight counts); remove "slack_links"')
    stages = getattr(model, "num_stages", None)
    bad = [b for b in links if stages is not None and b > stages - 2]
    if bad:
        return (f'"paci.slack_links" = {links} names link(s) {bad} that a {stages}-stage pipeline does not have: link '
                f'b joins stage b to b+1, so use ids 0..{stages - 2}')
    return None


def model_parallel_problem(ds_config, model):
    """One line if the run asks for model (tensor) parallelism of size > 1, else ``None`` (the same on every rank).

    PACI's stage norms, clip coefficients, non-finite verdicts and the look-ahead's clip source are per rank, with
    no reduction over a model-parallel slice: the slices of a stage would clip and skip apart. So a topology with a
    ``model`` axis of size > 1 (``PipeModelDataParallelTopology(num_pp, num_mp > 1, num_dp)``) and DeepSpeed's
    AutoTP (``"tensor_parallel": {"autotp_size" > 1}``) are refused at ``initialize``.
    """
    topo = model.topology() if hasattr(model, "topology") else None
    mp = topo.get_dim("model") if topo is not None else 0
    if mp > 1:
        return (f"ds_paci: model (tensor) parallelism is not supported: the PipelineModule's topology has a \"model\" "
                f"axis of size {mp} ({type(topo).__name__}); PACI clips and skips each rank by its own norm, so the "
                "slices of a stage would drift apart: use a topology without a model axis (PipeDataParallelTopology, "
                "or PipelineModule(num_stages=...)), or remove the \"paci\" section to train with stock DeepSpeed")
    autotp = (ds_config.get("tensor_parallel") or {}).get("autotp_size", 0)
    if isinstance(autotp, int) and autotp > 1:
        return (f"ds_paci: model (tensor) parallelism is not supported: \"tensor_parallel.autotp_size\" = {autotp}; "
                "PACI clips and skips each rank by its own norm, so the slices of a stage would drift apart: remove "
                "\"tensor_parallel\" (or set autotp_size to 1), or remove the \"paci\" section to train with stock "
                "DeepSpeed")
    return None
