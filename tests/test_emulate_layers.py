"""``ds_paci.integrations.emulate_layers``: emulated device time attached from outside to a program's layer class."""

import sys
import textwrap
import time

import pytest
import torch

from ds_paci.integrations import emulate_layers


def test_options_are_split_from_the_script_and_its_arguments():
    seconds, layer, rest, fbw, queue = emulate_layers.split_options(
        ["--local_rank=1", "--emulate-seconds", "0.05", "--emulate-layer", "m:C", "train.py", "--lr", "1"])
    assert (seconds, layer, rest, fbw, queue) == (0.05, "m:C", ["--local_rank=1", "train.py", "--lr", "1"], None, None)
    _, _, rest, fbw, queue = emulate_layers.split_options(
        ["--emulate-fbw", "0.1,0.2,0.3", "--emulate-weight-queue", "q:Q", "--emulate-layer", "m:C", "t.py"])
    assert (rest, fbw, queue) == (["t.py"], (0.1, 0.2, 0.3), "q:Q")
    for bad in (["train.py"], ["--emulate-fbw", "0.1,0.2", "--emulate-layer", "m:C", "t.py"],
                ["--emulate-seconds", "1", "--emulate-fbw", "1,1,1", "--emulate-layer", "m:C", "t.py"],
                ["--emulate-seconds", "1", "--emulate-weight-queue", "q:Q", "--emulate-layer", "m:C", "t.py"]):
        with pytest.raises(SystemExit):
            emulate_layers.split_options(bad)


def test_split_time_hands_w_to_the_programs_weight_queue(tmp_path, monkeypatch):
    """``--emulate-fbw`` with a queue: B in the backward, W wherever the queue runs it (a ZB-H1-like store that
    runs work at once in a full backward and keeps it for a later weight pass in a backward-only pass)."""
    (tmp_path / "fake_store.py").write_text(textwrap.dedent("""
        class Store:
            combine, kept = True, []
            @classmethod
            def put(cls, a, b, c, func):
                if cls.combine:
                    func(a, b, c)
                else:
                    cls.kept.append((a, b, c, func))
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    from fake_store import Store
    from ds_paci.workload import emulate
    sleeps = []
    monkeypatch.setattr(emulate.time, "sleep", sleeps.append)
    delay = emulate_layers._split_delay((0.01, 0.02, 0.03), "fake_store:Store")
    x = torch.randn(2, 3, requires_grad=True)
    delay(x).sum().backward()
    assert sleeps == [0.01, 0.02, 0.03]  # full backward: W right after B
    sleeps.clear()
    Store.combine = False
    delay(x).sum().backward()
    assert sleeps == [0.01, 0.02] and len(Store.kept) == 1  # backward-only pass: W kept
    a, b, c, func = Store.kept.pop()
    func(a, b, c)
    assert sleeps == [0.01, 0.02, 0.03]  # paid in the weight pass


def test_attached_layer_sleeps_and_stays_an_exact_identity(monkeypatch):
    from ds_paci.workload import emulate

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)

        def forward(self, x):
            return self.lin(x), "extra"

    layer = Layer()
    x = torch.randn(2, 3, requires_grad=True)
    plain, _ = layer(x)
    plain.sum().backward()
    reference = x.grad.clone()
    x.grad = None
    sleeps = []
    monkeypatch.setattr(emulate.time, "sleep", sleeps.append)
    emulate_layers.attach(Layer, 0.05)
    emulate_layers.attach(Layer, 0.05)  # idempotent: not wrapped twice
    out, extra = layer(x)
    assert sleeps == [0.05]  # F in the forward
    out.sum().backward()
    assert sleeps == [0.05, 0.1]  # 2F in the backward
    assert extra == "extra" and torch.equal(out, plain) and torch.equal(x.grad, reference)


def test_the_class_is_patched_on_import_after_other_import_hooks(tmp_path, monkeypatch):
    pkg = tmp_path / "emu_target_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "layers.py").write_text(textwrap.dedent("""
        import torch
        class Block(torch.nn.Module):
            def forward(self, x):
                return x * 2
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []

    class OtherHook:  # an earlier hook on the same module (the test environment's shims are one)
        def find_spec(self, name, path=None, target=None):
            if name == "emu_target_pkg.layers":
                seen.append(name)
            return None

    monkeypatch.setattr(sys, "meta_path", [OtherHook()] + sys.meta_path)
    emulate_layers.install("emu_target_pkg.layers:Block", 0.02)
    from emu_target_pkg.layers import Block
    assert seen == ["emu_target_pkg.layers"]
    t0 = time.perf_counter()
    assert torch.equal(Block()(torch.ones(2)), torch.full((2, ), 2.0))
    assert time.perf_counter() - t0 >= 0.02  # it slept (a lower bound only)
