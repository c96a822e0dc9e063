"""The suite's two tiers, the guard that keeps them honest, and the shared root, port and launch fixtures.

**Tiers.** A test marked ``process`` (``@pytest.mark.process``, or ``pytestmark = pytest.mark.process`` for a whole
module) starts processes: real engines over gloo through ``run_world``, the ``deepspeed`` / ``torchrun`` launchers,
a script run as a subprocess. Every other test runs inside the pytest process and is the fast tier:
``make test-fast`` = ``pytest -m "not process"``; ``make test`` runs both.

**The guard.** While a test that is not marked ``process`` runs (its setup, call and teardown, fixtures of any
scope included), starting a process raises :class:`UnmarkedProcessError` before anything starts, and the test fails
with one line naming the marker to add, even when the code under test catches the error. It watches the points
every way of starting a process here goes through: ``subprocess.Popen`` (so ``subprocess.run``, ``check_output``,
the launchers and :class:`~ds_paci.tools.processes.launched.Launched`), ``multiprocessing``'s ``Process.start``
(so ``run_world``, pools and ``ProcessPoolExecutor``), ``os.fork``, ``os.system`` and ``os.posix_spawn[p]``.
So the fast tier starts no process, with two exceptions that are no test's doing, machine probes run once by
whichever test comes first: DeepSpeed's op-compatibility probe (a gcc run the first time a process uses
``deepspeed.ops``) and matplotlib's font list (``fc-list``, run while matplotlib builds its font cache on a machine
that has none).

**Fixtures.** ``repo_root`` (a :class:`~pathlib.Path`), ``free_port`` (a function returning a free TCP port:
:func:`ds_paci.tools.processes.world.free_port`, the one definition the tools use too) and ``launch_command``
(:func:`harness.launch_command`: ``deepspeed --num_gpus N --master_port <free port> ...``).
"""

import multiprocessing.process
import os
import subprocess
import sys

import pytest

import harness

MARKER = "process"


class UnmarkedProcessError(RuntimeError):
    """A test not marked ``process`` tried to start a process."""


def unmarked_message(nodeid, what):
    """The one line an unmarked test that starts a process fails with."""
    return (f"{nodeid} starts a process ({what}) but is not marked '{MARKER}': add @pytest.mark.{MARKER} to the test "
            f"(or pytestmark = pytest.mark.{MARKER} to its module); unmarked tests are the in-process tier "
            f"(make test-fast)")


_guarded = None  # the item whose phase is running, when it is not marked `process`; else None


# (module, function) of the machine probes let through: whichever test runs first pays them, so they say nothing
# about that test. DeepSpeed's op-compatibility probe compiles a tiny C program (gcc) the first time a process uses
# ``deepspeed.ops``; matplotlib lists the machine's fonts (fc-list) when it builds its font cache, once per machine
# (a fresh CI machine has no cache: which test imports pyplot first depends on the workers' order).
PROBES = {("deepspeed.ops.op_builder.builder", "has_function"),
          ("matplotlib.font_manager", "_get_fontconfig_fonts")}


def _machine_probe():
    """True inside one of :data:`PROBES`."""
    frame = sys._getframe(2)
    while frame is not None:
        if (frame.f_globals.get("__name__"), frame.f_code.co_name) in PROBES:
            return True
        frame = frame.f_back
    return False


def guard_check(what):
    """Called by every patched entry point before a process starts: refuses while an unmarked test runs."""
    item = _guarded
    if item is None or _machine_probe():
        return
    line = unmarked_message(item.nodeid, what)
    item.stash.setdefault(_VIOLATIONS, []).append(line)
    raise UnmarkedProcessError(line)


_VIOLATIONS = pytest.StashKey[list]()


def _wrap(original, what):
    def guarded(*args, **kwargs):
        guard_check(what)
        return original(*args, **kwargs)
    guarded.__wrapped__ = original
    guarded.__name__ = getattr(original, "__name__", what)
    return guarded


def _entry_points():
    """(owner, attribute, what) of every place a process starts from."""
    points = [(subprocess.Popen, "_execute_child", "subprocess.Popen"),
              (multiprocessing.process.BaseProcess, "start", "multiprocessing Process.start"),
              (os, "fork", "os.fork"), (os, "system", "os.system")]
    points += [(os, name, f"os.{name}") for name in ("posix_spawn", "posix_spawnp") if hasattr(os, name)]
    return points


_installed = []  # (owner, attribute, original) restored at unconfigure


def install_guard():
    """Wrap every entry point (idempotent per configure; an inner pytest session wraps the outer's wrappers)."""
    global _installed
    if _installed:
        return
    for owner, attr, what in _entry_points():
        original = getattr(owner, attr)
        setattr(owner, attr, _wrap(original, what))
        _installed.append((owner, attr, original))


def uninstall_guard():
    global _installed
    for owner, attr, original in reversed(_installed):
        setattr(owner, attr, original)
    _installed = []


def pytest_configure(config):
    install_guard()


def pytest_unconfigure(config):
    uninstall_guard()


def pytest_collection_modifyitems(session, config, items):
    """Tests marked ``process`` first, the in-process tier last (stable otherwise).

    ``make test`` runs ``--dist loadgroup`` on two workers: xdist hands each worker the next unit of work in this
    order (xdist groups first, largest first), keeping up to three queued per worker. A process test of up to two
    minutes near the end leaves the other worker idle that long; the in-process tests (hundreds of short ones) at
    the end fill both workers until the last second instead."""
    items.sort(key=lambda item: item.get_closest_marker(MARKER) is None)


def _guarding(item):
    return None if item.get_closest_marker(MARKER) else item


def _guard_phase(item):
    """The body of the setup, call and teardown wrappers: the guard watches an unmarked item while the phase runs."""
    global _guarded
    _guarded = _guarding(item)
    try:
        return (yield)
    finally:
        _guarded = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _guard_phase(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _guard_phase(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    return (yield from _guard_phase(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A phase in which an unmarked test tried to start a process fails with the guard's line, caught or not."""
    report = yield
    violations = item.stash.get(_VIOLATIONS, None)
    if violations:
        line = violations[0]
        del item.stash[_VIOLATIONS]
        if report.failed and report.longrepr is not None:
            report.longrepr = f"{line}\n\n{report.longrepr}"
        else:
            report.outcome = "failed"
            report.longrepr = line
    return report


@pytest.fixture(scope="session")
def repo_root():
    """The repository root (``tests/..``) as a :class:`~pathlib.Path`."""
    return harness.REPO_ROOT


@pytest.fixture(scope="session")
def free_port():
    """A function returning a free TCP port on 127.0.0.1 (each call a new one)."""
    return harness.free_port


@pytest.fixture(scope="session")
def launch_command():
    """:func:`harness.launch_command`: ``launch_command(nproc, *args, port=None, launcher="deepspeed")`` ->
    ``[<bin>/deepspeed, "--num_gpus", N, "--master_port", <free port>, *args]``."""
    return harness.launch_command
