"""The supported DeepSpeed range is declared once per place that needs it, and agrees everywhere.

The behaviour of each version difference is tested on real engines (test_engine, test_nonfinite, test_config),
on the newest version by `make test` and on the oldest by `make test-oldest`.
"""

import re

import pytest
from packaging.version import Version

from ds_paci.core.seam import compat
from harness import REPO_ROOT as ROOT


def test_setup_makefile_and_compat_declare_the_same_range():
    low, high = compat.SUPPORTED
    setup = (ROOT / "setup.py").read_text()
    assert f'"deepspeed>={low},<={high}"' in setup
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(rf"^DS_OLDEST \?= {re.escape(str(low))}$", makefile, re.M)
    assert re.search(rf"^DS_NEWEST \?= {re.escape(str(high))}$", makefile, re.M)
    readme = (ROOT / "README.md").read_text()
    assert f"deepspeed>={low},<={high}" in readme


def test_the_installed_deepspeed_is_in_range_and_an_older_one_is_refused(monkeypatch):
    low, high = compat.SUPPORTED
    assert low <= Version(compat.DS_VERSION.base_version) <= high
    compat.check_version()  # the installed one passes
    monkeypatch.setattr(compat, "DS_VERSION", Version("0.15.4"))
    expected = rf"ds_paci supports deepspeed {re.escape(str(low))} to {re.escape(str(high))}, but .* is installed; "
    with pytest.raises(RuntimeError, match=expected + "install one in that range"):
        compat.check_version()
    monkeypatch.setattr(compat, "DS_VERSION", Version("0.20.1"))
    compat.check_version()  # newer than tested: a warning, not a refusal
