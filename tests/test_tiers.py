"""The two tiers (tests/conftest.py): an unmarked test that starts a process fails with the line naming the marker
and starts nothing, caught or not; a test marked ``process`` may; the guard covers every entry point."""

import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest

import conftest

pytest_plugins = ["pytester"]

CONFTEST = Path(conftest.__file__).read_text()
INI = "[pytest]\naddopts = --strict-markers\nmarkers =\n    process: starts processes\n"

# Each inner test would leave a file behind if its process started; the guard must stop all of them first.
SPAWNING = '''
import multiprocessing, os, subprocess, sys
import pytest
import harness

OUT = {out!r}

def _touch(name):
    open(os.path.join(OUT, name), "w").close()

def _rank_touch(rank, name):
    _touch(name)

def test_popen():
    subprocess.run([sys.executable, "-c", f"open({{OUT + '/popen'!r}}, 'w')"])

def test_popen_caught():
    try:
        subprocess.check_output([sys.executable, "-c", f"open({{OUT + '/caught'!r}}, 'w')"])
    except Exception:
        pass

def test_multiprocessing():
    p = multiprocessing.get_context("spawn").Process(target=_touch, args=("mp",))
    p.start()
    p.join()

def test_run_world():
    harness.run_world(_rank_touch, 1, "world", timeout=60)

@pytest.fixture(scope="module")
def launched_once():
    subprocess.run([sys.executable, "-c", f"open({{OUT + '/fixture'!r}}, 'w')"])

def test_module_fixture(launched_once):
    pass

def test_in_process():
    assert sum(range(4)) == 6
'''


def _inner(pytester, tmp_path, body, *args):
    out = tmp_path / "started"
    out.mkdir()
    pytester.makeini(INI)
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_inner=body.format(out=str(out)))
    return pytester.runpytest_inprocess("-p", "no:cacheprovider", *args), out


def test_an_unmarked_test_that_starts_a_process_fails_naming_the_marker_and_starts_nothing(pytester, tmp_path):
    result, out = _inner(pytester, tmp_path, SPAWNING)
    result.assert_outcomes(passed=1, failed=4, errors=1)  # the module fixture's launch: an error in setup
    text = result.stdout.str()
    for name, what in (("test_popen", "subprocess.Popen"), ("test_popen_caught", "subprocess.Popen"),
                       ("test_multiprocessing", "multiprocessing Process.start"),
                       ("test_run_world", "multiprocessing Process.start"),
                       ("test_module_fixture", "subprocess.Popen")):
        line = conftest.unmarked_message(f"test_inner.py::{name}", what)
        assert line in text, (line, text[-4000:])
    assert "add @pytest.mark.process to the test" in text
    assert sorted(os.listdir(out)) == [], "the guard let a process start"


def test_the_fast_tier_deselects_marked_tests_and_the_rest_starts_nothing(pytester, tmp_path):
    marked = SPAWNING.replace("\ndef test_popen():", "\n@pytest.mark.process\ndef test_popen():")
    result, out = _inner(pytester, tmp_path, marked, "-m", "not process")
    result.assert_outcomes(passed=1, failed=3, errors=1, deselected=1)
    assert sorted(os.listdir(out)) == []


@pytest.mark.process
def test_a_marked_test_may_start_processes(pytester, tmp_path):
    body = "import pytest\npytestmark = pytest.mark.process\n" + SPAWNING
    result, out = _inner(pytester, tmp_path, body)
    result.assert_outcomes(passed=6)
    assert sorted(os.listdir(out)) == ["caught", "fixture", "mp", "popen", "world"]


def test_every_entry_point_is_guarded_in_this_session(request):
    """Subprocess-free: in this unmarked test each way of starting a process raises before anything starts."""
    attempts = [lambda: subprocess.Popen([sys.executable, "-c", "pass"]),
                lambda: multiprocessing.get_context("spawn").Process(target=print).start(),
                lambda: multiprocessing.get_context("fork").Process(target=print).start(),
                os.fork, lambda: os.system("true")]
    if hasattr(os, "posix_spawn"):
        attempts.append(lambda: os.posix_spawn(sys.executable, [sys.executable, "-c", "pass"], dict(os.environ)))
    for attempt in attempts:
        with pytest.raises(conftest.UnmarkedProcessError, match="is not marked 'process': add @pytest.mark.process"):
            attempt()
    assert multiprocessing.active_children() == []
    # the attempts were deliberate: clear them so that this test's report stays green
    violations = request.node.stash[conftest._VIOLATIONS]
    assert len(violations) == len(attempts) and all(request.node.nodeid in v for v in violations)
    del request.node.stash[conftest._VIOLATIONS]


def test_matplotlibs_font_list_is_let_through_and_nothing_else_from_matplotlib(pytester, tmp_path):
    """A fresh machine has no matplotlib font cache: whichever test imports pyplot first runs ``fc-list`` inside
    ``matplotlib.font_manager._get_fontconfig_fonts``. That probe is the machine's, not the test's, so the guard
    lets it through; a process started from elsewhere in the same test still fails it."""
    body = '''
import subprocess, sys
from matplotlib import font_manager

def test_font_list():
    font_manager._get_fontconfig_fonts.cache_clear()
    assert isinstance(font_manager._get_fontconfig_fonts(), list)

def test_font_list_then_popen():
    font_manager._get_fontconfig_fonts.cache_clear()
    font_manager._get_fontconfig_fonts()
    subprocess.run([sys.executable, "-c", "pass"])
'''
    result, _ = _inner(pytester, tmp_path, body)
    result.assert_outcomes(passed=1, failed=1)
    assert conftest.unmarked_message("test_inner.py::test_font_list_then_popen", "subprocess.Popen") in \
        result.stdout.str()
