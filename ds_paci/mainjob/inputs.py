"""Everything a rank of the main job checks before any process group exists, and the verdicts agreed across nodes.

The config goes through core's own model-free checks (``ds_paci.core.config.check_config``: the ``"paci"``
section, the batch keys, ZeRO's stage, fp16, the accumulation window, what the installed DeepSpeed refuses under
PACI), the same function ``ds_paci.initialize`` runs through ``validate_run``, so a bad key gets the same line here,
only before any process starts. What only the job
knows (its flags, the batch keys it needs, the data-parallel size, the tied LM head with ZeRO's offload) is
checked here, each with one line that names the flag or key and the fix. Every check raises
:class:`~.options.UsageError`.
"""

import os
import sys

from .options import EXIT_USAGE, UsageError, check_flags


def check_checkpoint_dir(path):
    """The checkpoint folder exists or can be created, and a file can be written in it (tried, then removed)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"--checkpoint-dir {path} is a file, not a folder; pass a folder (it is created if missing)")
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".ds_paci-write-test.{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise UsageError(f"--checkpoint-dir {path} is not writable ({e.strerror or e}); pass a folder this user can "
                         "write to") from None


def _core(check, *args):
    """``check(*args)`` of ``ds_paci.core``, its ``PACIConfigError`` turned into a :class:`UsageError` (same line)."""
    from ds_paci.core.config import PACIConfigError
    try:
        return check(*args)
    except PACIConfigError as e:
        raise UsageError(str(e)) from None


def check_config(ds_config, world_size, stages, config_path, tie_embeddings=False):
    """Core's model-free checks (``ds_paci.core.config.check_config``, the same as ``ds_paci.initialize``'s), then
    the DeepSpeed config keys the job needs, named by their keys; all before any process starts."""
    from ds_paci.core.config import check_config as core_check_config
    from ds_paci.core.tied.weights import zero_offload_device
    paci = _core(core_check_config, ds_config)
    micro = ds_config.get("train_micro_batch_size_per_gpu")
    gas = ds_config.get("gradient_accumulation_steps")
    if micro is None or gas is None:
        missing = " and ".join(f'"{k}"' for k, v in (("train_micro_batch_size_per_gpu", micro),
                                                       ("gradient_accumulation_steps", gas)) if v is None)
        raise UsageError(f"{config_path} must set integer \"train_micro_batch_size_per_gpu\" and "
                         f"\"gradient_accumulation_steps\" (missing: {missing}; see configs/paci.json)")
    dp = world_size // stages
    if "train_batch_size" in ds_config and ds_config["train_batch_size"] != micro * gas * dp:
        raise UsageError(f"\"train_batch_size\" {ds_config['train_batch_size']} != micro-batch {micro} x "
                         f"accumulation {gas} x data-parallel {dp}; remove \"train_batch_size\" or make it "
                         f"{micro * gas * dp}")
    # core's tied_arrangement_problem says the same of a built model; the job knows its model is tied before
    # any process group exists (the embedding on the first stage, the LM head on the last), and names its flag
    offload = zero_offload_device(ds_config)
    if tie_embeddings and paci.enabled and not paci.drain_every_batch and stages > 1 and offload is not None:
        raise UsageError(f"--tie-embeddings with \"zero_optimization.offload_optimizer.device\" = \"{offload}\" in "
                         f"{config_path}: ZeRO's offloaded optimizer keeps the gradients where PACI's tied exchange "
                         "cannot reach them; remove the offload or drop --tie-embeddings (untie the layers)")


def _resume_plan(checkpoint_dir):
    """``(tag, note)`` for ``--resume`` as this rank's disk says (core's ``resume_tag``)."""
    from ds_paci.core.checkpoint.atomic import CheckpointError, resume_tag
    if not os.path.isdir(checkpoint_dir):
        raise UsageError(f"--checkpoint-dir {checkpoint_dir} holds no checkpoint (no such folder); point it "
                         "at a directory an earlier run saved into, or drop --resume")
    try:
        return resume_tag(checkpoint_dir)
    except CheckpointError as e:
        raise UsageError(resume_refusal(e)) from None


def resume_refusal(error):
    """The line for a :class:`~ds_paci.core.checkpoint.atomic.CheckpointError` met choosing what ``--resume`` loads."""
    return f"--checkpoint-dir {error}; point it at a folder an earlier run saved into, or drop --resume"


def check_inputs(args, world_size, one_disk=True):
    """Validate everything a rank can check on its own; returns (ds_config, corpus documents, stages, resume plan).

    On one node every rank reaches the same verdict, so a bad input ends all of them together. The
    resume plan is ``(tag, note)``: the checkpoint ``--resume`` loads (the one ``latest``
    names if it is complete, else the last complete one, with a one-line note saying so). With
    ``one_disk=False`` (a run across nodes, whose disks may differ) the plan is left to
    :func:`agree_start` (``None`` here).
    """
    from ds_paci.core.config import PACIConfigError, load_config
    from ds_paci.workload.data import DataError, load_corpus
    check_flags(args)
    try:
        ds_config = load_config(args.deepspeed_config)
    except PACIConfigError as e:
        raise UsageError(str(e)) from None
    stages = args.stages or world_size
    if world_size % stages:
        raise UsageError(f"--stages {stages} does not divide the {world_size} launched processes; launch a multiple "
                         f"of {stages} (deepspeed --num_gpus {stages} ...) or pass a --stages that divides {world_size}")
    check_config(ds_config, world_size, stages, args.deepspeed_config, args.tie_embeddings)
    if args.resume and not args.checkpoint_dir:
        raise UsageError("--resume needs --checkpoint-dir <directory written by an earlier run>")
    plan = _resume_plan(args.checkpoint_dir) if args.resume and one_disk else None
    if args.checkpoint_dir:
        check_checkpoint_dir(args.checkpoint_dir)
    try:
        docs = load_corpus(args.data)
    except DataError as e:
        raise UsageError(str(e)) from None
    return ds_config, docs, stages, plan


def build_model_config(args, vocab_size, eos_id, stages):
    """The GPT-2 config the flags ask for, refused (one line) when it has fewer blocks than stages."""
    from ds_paci.workload.gpt2 import gpt2_config
    try:
        cfg = gpt2_config(args.model, vocab_size=vocab_size, n_positions=args.n_positions, n_embd=args.n_embd,
                          n_layer=args.n_layer, n_head=args.n_head, eos_token_id=eos_id)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if cfg.n_layer < stages:
        raise UsageError(f"the model has {cfg.n_layer} transformer blocks but {stages} stages were asked for; "
                         f"use at most {cfg.n_layer} stages or a deeper model (--n-layer)")
    return cfg


def agree_start(error, args):
    """A run across nodes: every rank's verdict on its own inputs, agreed (a bad input on one node ends every node,
    where it would otherwise leave the others waiting in the process group's rendezvous), then the resume plan
    agreed over every rank's disk. A collective; returns ``(exit code or None, resume plan)``."""
    import torch.distributed as tdist

    from ds_paci.core.checkpoint import atomic as checkpoint
    from ds_paci.core.health.nodes import gather_node_map
    nodes = gather_node_map()
    errors = [None] * tdist.get_world_size()
    tdist.all_gather_object(errors, None if error is None else str(error))
    bad = [r for r, e in enumerate(errors) if e]
    line = None
    if bad:
        same = [r for r in bad if errors[r] == errors[bad[0]]]
        line = ("" if len(same) == len(errors) else f"on {nodes.describe(same)}: ") + errors[bad[0]]
    plan = None
    if line is None and args.resume:
        try:
            plan = checkpoint.agreed_resume_tag(args.checkpoint_dir)
        except checkpoint.CheckpointError as e:
            line = resume_refusal(e)
    if line is None:
        return None, plan
    rank = tdist.get_rank()
    if rank == 0:
        print(f"error: {line}", file=sys.stderr, flush=True)
    tdist.destroy_process_group()
    leave_the_line_to_rank0(rank)
    return EXIT_USAGE, None


#: How long a rank other than 0 waits before it exits with a refusal that rank 0 reports.
REFUSAL_GRACE_S = 10.0


def leave_the_line_to_rank0(rank):
    """A refusal is said by rank 0 only (one line). DeepSpeed's launcher (and torchrun) ends every rank as soon as
    one exits non-zero, and reports that rank's code: a rank other than 0 exiting first could have rank 0 killed
    before its line is written. So such a rank waits (at most :data:`REFUSAL_GRACE_S`) for rank 0 to exit, with
    SIGTERM at its default, so that the launcher's SIGTERM ends it silently."""
    if rank == 0:
        return
    import signal
    import time
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    time.sleep(REFUSAL_GRACE_S)
