"""``python -m ds_paci.integrations.megatron prepare``: what it refuses, in one line naming the fix (in-process).

The successful path (snapshot extracted and linked, dataset built, then ``pretrain_gpt.py`` on PACI) runs in
``test_readme_megatron.py`` through the README's own commands.
"""

import os
import sys
from pathlib import Path

import pytest

from ds_paci.integrations import megatron

VENV_BIN = os.path.dirname(sys.executable)


def _fake_tool(folder, name, body="exit 0"):
    path = Path(folder) / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


def test_missing_build_tools_are_named_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on PATH
    with pytest.raises(megatron.MegatronSetupError, match=r"needs \['g\+\+', 'make', 'python3-config'\] on PATH: "
                                                          r"install g\+\+, make and the python3 development files"):
        megatron.check_environment()


@pytest.mark.process
def test_a_python3_without_pybind11_first_on_path_is_named_with_the_fix(tmp_path, monkeypatch):
    for tool in megatron.BUILD_TOOLS:
        _fake_tool(tmp_path, tool)
    python3 = _fake_tool(tmp_path, "python3", "exit 1")  # a python3 that cannot import pybind11
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(megatron.MegatronSetupError) as e:
        megatron.check_environment()
    message = str(e.value)
    assert f"the python3 first on PATH ({python3}) has no pybind11" in message
    assert "pybind11/pybind11.h not found" in message and f"source {VENV_BIN}/activate" in message


@pytest.mark.process
def test_the_venvs_python3_passes(monkeypatch):
    monkeypatch.setenv("PATH", VENV_BIN + os.pathsep + os.environ.get("PATH", ""))
    megatron.check_environment()  # g++, make, python3-config and the megatron-test extra: `make test` installs them


@pytest.mark.process
def test_prepare_without_a_snapshot_prints_one_error_line_and_exits_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", VENV_BIN + os.pathsep + os.environ.get("PATH", ""))
    rc = megatron.main(["prepare", "--out", str(tmp_path / "out"), "--shared", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("error: no Megatron-DeepSpeed snapshot (Megatron-DeepSpeed-*.tar.gz) in ")
    assert not (tmp_path / "out").exists()


def test_the_tree_link_is_replaced_atomically(tmp_path):
    old, new = tmp_path / "Megatron-DeepSpeed-aaa", tmp_path / "Megatron-DeepSpeed-bbb"
    old.mkdir()
    new.mkdir()
    megatron.link_tree(old, tmp_path)
    link = megatron.link_tree(new, tmp_path)
    assert link == tmp_path / megatron.TREE_LINK and link.resolve() == new.resolve()
    assert os.readlink(link) == new.name  # relative: the cache folder can move
