"""Per-rank bodies of the engine-contract tests (issue 7) and the non-finite guard tests (issue 10, item 1).

Each function takes the rank first, builds real DeepSpeed engines (or real gloo groups) and returns plain data.
"""

import math
import time

import torch
import torch.distributed as tdist


def loss_ages(values, last_values):
    """For each call ``k``: how many calls before ``k`` the last stage returned ``values[k]`` (None for NaN).

    Raises AssertionError if a value was never returned by the last stage up to that call.
    """
    ages = []
    for k, v in enumerate(values):
        if math.isnan(v):
            ages.append(None)
            continue
        match = [k - j for j in range(k, -1, -1) if last_values[j] == v]
        if not match:
            raise AssertionError(f"call {k}: {v} is not a value the last stage returned up to that call: {last_values}")
        ages.append(match[0])
    return ages


# -- the side channel alone --------------------------------------------------------------------
def channel_exchange(rank, world, calls):
    """The last rank publishes ``calls`` messages; the others poll without waiting, then wait for the last one."""
    from ds_paci.core.loss_channel import KEEP_SENDS, LossChannel, pipeline_groups

    class Grid:
        pipe_groups = [list(range(world))]
        global_rank = rank

    group, ranks = pipeline_groups(Grid)
    channel = LossChannel(group, ranks, rank)
    last = world - 1
    polled, seen = [], []
    for k in range(1, calls + 1):
        if rank == last:
            channel.publish(torch.tensor(k * 1.5), k, extras=[k, -k])
        else:
            msg = channel.poll()
            polled.append(None if msg is None else msg.seq)
            if msg is not None:
                seen.append((msg.seq, msg.value, msg.origin_call, msg.extras))
    out = {"polled": polled, "seen": seen, "keep": KEEP_SENDS}
    if rank != last:
        t0 = time.monotonic()
        final = channel.wait_for(calls)
        out["final"] = (final.seq, final.value, final.origin_call, final.extras)
        out["received"] = channel.received
        out["wait_s"] = time.monotonic() - t0
    # stop notices: rank 0 announces; everybody else sees it (rank 0 does not see its own)
    if rank == 0:
        channel.announce_stop(step=7, count=3, limit=3)
    notice = channel.stop_notice(wait_s=10.0 if rank != 0 else 0.0)
    out["notice"] = None if notice is None else (notice.stage, notice.step, notice.count, notice.limit)
    # pending receives (DEPTH from the last rank, one per other peer) and sends are still posted here
    channel.close()
    return out
