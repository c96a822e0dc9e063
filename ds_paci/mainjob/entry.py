"""The main job as a script: how a rank ends (``launch/train.py`` calls :func:`run_script`).

- the non-finite guard's stop: one line and :data:`~.options.EXIT_NONFINITE` (:func:`run`);
- a transfer that failed because a node was lost: the peer watch's line ends the rank (``exit_if_lost``);
- any other crash: its traceback and exit code 1, at once (its peers and the launcher wait on it; a crash is
  left for the peer watch to report as a lost rank);
- SIGINT before the stop handlers are installed (start-up): 130;
- an error or a stop: everything is saved and flushed, so the interpreter's slow teardown is skipped.
"""

import os
import sys

from .job import main
from .options import EXIT_NONFINITE

EXIT_INTERRUPTED = 128 + 2  # SIGINT during start-up


def run(argv=None):
    """``main`` with the non-finite guard's stop turned into one line and exit code :data:`EXIT_NONFINITE`."""
    try:
        return main(argv)
    except Exception as e:
        from ds_paci.core.step.guard import PACINonFiniteError
        if not isinstance(e, PACINonFiniteError):
            raise
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_NONFINITE


def end_process(code):
    """End this rank with ``code`` (see the module docstring); never returns."""
    if code != 1:  # ending on purpose (a crash is left for the peer watch to report as a lost rank)
        from ds_paci.core.health.liveness import farewell
        farewell()
    if code:  # an error or a stop: everything is saved and flushed; skip the interpreter's slow teardown
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def run_script(argv=None):
    """The script's body: :func:`run`, then :func:`end_process` with its code."""
    try:
        code = run(argv)
    except Exception as exc:
        from ds_paci.core.health.liveness import exit_if_lost
        exit_if_lost(exc)  # a transfer failed because a node was lost: the peer watch's line ends this rank
        import traceback
        traceback.print_exc()
        code = 1
    except KeyboardInterrupt:  # SIGINT before the stop handlers are installed (start-up)
        code = EXIT_INTERRUPTED
    end_process(code)
