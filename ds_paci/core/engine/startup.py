"""What a user sees at start-up and at the end of a script: PACI on or off in one line, advice, the open window.

Contract
--------
* **One line, rank 0, always shown.** Every engine ``ds_paci.initialize`` (and so the runner, the main job and
  Megatron through the runner) builds says on global rank 0, on stdout (DeepSpeed's logger hides INFO):

  ``ds_paci: PACI on (async|sync), P stages, M = .. micro-batches per train_batch: accumulation window per
  stage [..], drift bound per stage [..], look-ahead on|off (..); gradient clipping ..; deepspeed <version>``

  or, when the stock engine is built, ``ds_paci: PACI off: <why> (<how to turn it on>)`` (:func:`say_off`).
  The line is computed from the config alone (the same rule every stage applies), so no stage waits for another.
* **Advice.** A stage whose drift bound exceeds 1 while the look-ahead is on (the look-ahead predicts one local
  step ahead) gets one more line naming the stages and what ``"accumulation_window": "auto"`` would choose.
* **A ``"paci"`` section that reaches the stock engine.** Importing ``ds_paci`` wraps ``deepspeed.initialize``
  (:func:`watch_stock_initialize`; behaviour unchanged): a call whose config holds a ``"paci"`` section that does
  not say ``"enabled": false`` warns once, on rank 0, naming the two ways to turn PACI on.
* **The open window at the end.** :func:`watch_open_window` warns once when an engine is garbage-collected or the
  interpreter exits with micro-batches whose gradients were never applied (``engine.drain()`` was not called), with
  their number on that rank's stage and the call to make.
* **Exit.** At interpreter exit every live engine's side channel and watchdog are closed and the channel's own gloo
  group (with receives posted that no peer will match any more) is destroyed while the interpreter is whole; the
  runner, after the script returns, drains and destroys every process group (:func:`finish_engines`).
"""

import atexit
import inspect
import sys
import threading
import weakref

from ..config import PACI_SECTION, auto_window
from ..program.stream import drift_bound

_deciding = threading.local()  # set while ds_paci.initialize or the runner's router has decided the engine


def rank():
    """The global rank, or 0 before (or without) a process group."""
    try:
        import torch.distributed as dist
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    except Exception:  # noqa: BLE001 (never fail a start-up for a log line)
        return 0


def emit(line):
    """Write ``line`` and its newline to stdout in one write, flushed. Launched ranks share one pipe and run
    unbuffered (``python -u``), where ``print`` writes the text and its newline separately: another rank's line
    could land between them."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def say(line):
    """Print ``line`` on global rank 0 (stdout, flushed: shown whatever DeepSpeed's log level)."""
    if rank() == 0:
        emit(line)


def say_off(reason, fix):
    """The PACI-off line: the stock engine is built (on rank 0)."""
    say(f"ds_paci: PACI off: {reason} ({fix})")


class deciding:
    """``with deciding():`` the engine being built was chosen by ds_paci (no stock-engine warning)."""

    def __enter__(self):
        self.before = getattr(_deciding, "active", False)
        _deciding.active = True

    def __exit__(self, *exc):
        _deciding.active = self.before


def stage_windows(paci, micro_batches, stages, per_stage):
    """Every stage's accumulation window, by the rule each stage applies to itself (see the engine)."""
    return [paci.window(micro_batches, stages, s if per_stage else None) for s in range(stages)]


def startup_lines(paci, stages, micro_batches, windows, lookahead, clipping, deepspeed_text, tied=False):
    """The PACI-on line and, where it applies, the advice line (a list of one or two strings).

    ``lookahead``: ``None`` (off by the config or sync mode), True (on), or a reason string (asked for, not run).
    ``tied``: tied layers span stages (``"auto"`` then takes one window, stage 0's, on every stage).
    """
    sync = paci.drain_every_batch
    bounds = [0 if sync and w == micro_batches else drift_bound(stages, s, w, paci.slack_links)
              for s, w in enumerate(windows)]
    if sync:
        look = "off (sync mode)"
    elif lookahead is True:
        look = "on (forwards that cross a local step run on predicted weights)"
    elif lookahead:
        look = f"off ({lookahead})"
    else:
        look = "off (\"paci.lookahead\": false)"
    lines = [f"ds_paci: PACI on ({'sync' if sync else 'async'}), {stages} stages, M = {micro_batches} micro-batches "
             f"per train_batch: accumulation window per stage {windows}, drift bound per stage {bounds}, look-ahead "
             f"{look}; gradient clipping {clipping}; {deepspeed_text}"]
    over = [s for s, b in enumerate(bounds) if b > 1]
    if over and lookahead is True and not sync:
        auto = [auto_window(stages, micro_batches, None if tied else s, len(paci.slack_links), True)
                for s in range(stages)]  # "auto" comes with its warm start (config: sync_warmup_calls)
        lines.append(f"ds_paci: advice: drift bound {[bounds[s] for s in over]} > 1 on stage(s) {over}: forwards there "
                     f"cross up to that many local steps, while the look-ahead predicts one; \"accumulation_window\": "
                     f"\"auto\" would choose windows {auto} after its synchronous warm start (drift bound <= 1 on every "
                     "stage)")
    return lines


def warm_start_line(paci, stock):
    """The start-up line of a synchronous warm start (``paci.warm_start``); ``stock``: sync mode, which ignores it."""
    calls = paci.sync_warmup_calls
    if stock:
        return f"ds_paci: sync_warmup_calls = {calls!r} ignored: sync mode runs the stock schedule throughout"
    if calls == "auto":
        from ..program.warm_end import SPAN
        until = (f"until the mean loss of the last {SPAN} calls is below {paci.sync_warmup_loss_ratio:g} x the labels' "
                 "unigram entropy (the model has left the unigram plateau)")
    else:
        until = f"for calls 1-{calls}"
    return (f"ds_paci: synchronous warm start: train_batch runs on the stock schedule (a drain every call) {until}, "
            "then PACI's streams (\"sync_warmup_calls\": 0 turns it off)")


def announce(engine):
    """Rank 0's start-up lines for a built PACI engine (see the module docstring)."""
    from ..seam import compat
    from ..tied.layout import tied_owner_stages
    tied = bool(tied_owner_stages(engine.module))
    per_stage = engine.paci.accumulation_window == "auto" and not engine.paci.drain_every_batch and not tied
    windows = stage_windows(engine.paci, engine.micro_batches, engine.num_stages, per_stage)
    if engine._stock_step or not engine.paci.lookahead:
        look = None
    elif engine._lookahead is not None:
        look = True
    else:
        look = "this optimizer is not predicted: plain PACI"
    for line in startup_lines(engine.paci, engine.num_stages, engine.micro_batches, windows, look, engine._clipping,
                              compat.describe(), tied):
        say(line)
    if engine._stream.slack:
        from ..program.stream import slack_count
        extra = [slack_count(engine._stream.slack, s) for s in range(engine.num_stages)]
        say(f"ds_paci: slack links {list(engine._stream.slack)}: stage s holds P - s + k_s micro-batches in flight, "
            f"k_s = {extra} (stage 0: {engine.num_stages + extra[0]} instead of {engine.num_stages})")
    if engine.paci.warm_start:
        say(warm_start_line(engine.paci, engine._stock_step))
    if engine._step_phase == "diagonal":
        say("ds_paci: step phase diagonal (stage s steps after its c-th backward pass with c = s mod a, a partial first "
            f"window; phases {[s % a for s, a in enumerate(windows)]})")


# -- a "paci" section reaching the stock engine ---------------------------------------------------------------------
STOCK_FIX = ("call ds_paci.initialize(...) in place of deepspeed.initialize(...), or run the unmodified script "
             "with `python -m ds_paci.run SCRIPT.py ...` (`deepspeed --module ds_paci.run SCRIPT.py ...`)")
_warned = set()


def section_of(config, args):
    """The ``"paci"`` section a ``deepspeed.initialize`` call's config holds, or ``None`` (never raises)."""
    from ..config import load_config
    try:
        if config is None and args is not None and getattr(args, "deepspeed_config", None) is None:
            config = getattr(args, "deepspeed_config_dict", None)
        return load_config(config, args if config is None else None).get(PACI_SECTION)
    except Exception:  # noqa: BLE001 (DeepSpeed reports its own config errors)
        return None


def watch_stock_initialize():
    """Wrap ``deepspeed.initialize`` once (idempotent): warn when a ``"paci"`` config reaches the stock engine."""
    import functools

    import deepspeed
    current = deepspeed.initialize
    if getattr(current, "ds_paci_watch", False) or getattr(current, "ds_paci_router", False):
        return
    signature = inspect.signature(current)

    @functools.wraps(current)
    def initialize(*args, **kwargs):
        if not getattr(_deciding, "active", False):
            try:
                bound = signature.bind_partial(*args, **kwargs).arguments
                config = bound.get("config") if bound.get("config") is not None else bound.get("config_params")
                section = section_of(config, bound.get("args"))
            except TypeError:
                section = None
            if isinstance(section, dict) and section.get("enabled", True) is not False and "stock" not in _warned:
                _warned.add("stock")
                say(f"ds_paci: warning: the DeepSpeed config has a \"paci\" section but deepspeed.initialize builds "
                    f"DeepSpeed's stock engine: PACI is off; to turn it on, {STOCK_FIX}")
        return current(*args, **kwargs)

    initialize.ds_paci_watch = True
    deepspeed.initialize = initialize


# -- the open window at the end of a script -------------------------------------------------------------------------
def not_applied(stream):
    """(micro-batches in the open window, micro-batches forwarded but not backwarded) at this stage."""
    return stream.window_fill, stream.in_flight()


def _warn_open(stream, who):
    window, flying = not_applied(stream)
    if window + flying:
        sys.stderr.write(f"ds_paci: warning: {who} ended with {window + flying} micro-batches whose gradients were "
                         f"never applied ({window} in the open accumulation window, {flying} still in flight); call "
                         f"engine.drain() after the last train_batch (the runner `python -m ds_paci.run` does it when "
                         f"the script returns)\n")
        sys.stderr.flush()


_ENGINES = weakref.WeakSet()  # live PACI engines of this process


def watch_open_window(engine):
    """Warn once if ``engine`` is collected, or the interpreter exits, with micro-batches never applied; also keep
    it among the live engines (:func:`finish_engines`, and the side channel closed at exit)."""
    if not _ENGINES:
        atexit.register(finish_engines, drain=False, release=False)
    _ENGINES.add(engine)
    who = f"the PACI engine of {engine._describe_rank()}"
    return weakref.finalize(engine, _warn_open, engine._stream, who)


def finish_engines(drain, release):
    """The end of a script: ``drain`` every live PACI engine that has trained (every rank runs the same script, so
    every stage drains together; one line on rank 0); close their side channels and watchdogs (no pending transfer
    or thread is left to the interpreter's exit); with ``release`` destroy every process group (the runner, after
    the script), otherwise (at interpreter exit) only each engine's side-channel group, which nothing else uses."""
    import torch.distributed as dist
    engines = sorted(_ENGINES, key=id)
    alive = dist.is_available() and dist.is_initialized()
    for engine in engines:
        if drain and alive and engine._calls and not getattr(engine, "_finished", False):
            window, flying = not_applied(engine._stream)
            engine.drain()
            say(f"ds_paci.run: the script returned; engine.drain() applied the gradients of the micro-batches it "
                f"left open (on stage {engine.stage_id}: {window} in the accumulation window, {flying} in flight)")
        engine._finished = True
        if alive and getattr(engine, "_channel", None) is not None:
            engine._channel.flush()  # the last losses leave before the group goes
        for part in ("_watchdog", "_channel"):
            if getattr(engine, part, None) is not None:
                getattr(engine, part).close()
        group = getattr(getattr(engine, "_channel", None), "group", None)
        if group is not None and alive and not release:
            # The channel keeps receives posted that no peer will match any more: free its own gloo group while
            # the interpreter is whole, not in C++ teardown after it (nothing else uses that group).
            dist.destroy_process_group(group)
            engine._channel.group = None
    if release and alive:
        dist.destroy_process_group()
