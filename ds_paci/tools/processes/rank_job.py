"""A driver that runs itself again as every rank's job: its command line and the start of a rank.

``driver_parser(description)`` is an ``argparse.ArgumentParser`` with the hidden options every such driver has:
``--rank-job`` (this process is one rank), ``--out-dir`` (the folder the ranks write their reports to) and, with
``launcher=True``, ``--local_rank`` (what a DeepSpeed launcher appends). ``rank_or_drive(args, rank_job, drive)``
returns ``rank_job(args)`` in a rank, after DeepSpeed's CPU JIT ops are skipped and the gloo process group is up
(``gloo_timeout_s`` its timeout when given, else torch's default), and ``drive(args)`` in the driver.
"""

import argparse


def driver_parser(description, launcher=False):
    """The driver's parser with ``--rank-job``, ``--out-dir`` (and ``--local_rank`` with ``launcher``) hidden."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--rank-job", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out-dir", help=argparse.SUPPRESS)
    if launcher:
        p.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)
    return p


def rank_or_drive(args, rank_job, drive, gloo_timeout_s=None):
    """``rank_job(args)`` in a rank (process group started first), else ``drive(args)``; returns its exit code."""
    if not args.rank_job:
        return drive(args)
    import datetime

    import deepspeed

    from ds_paci.core.runtime import skip_cpu_jit_ops
    skip_cpu_jit_ops()
    timeout = {} if gloo_timeout_s is None else {"timeout": datetime.timedelta(seconds=gloo_timeout_s)}
    deepspeed.init_distributed(dist_backend="gloo", **timeout)
    return rank_job(args)
