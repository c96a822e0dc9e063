"""The peer study (issue 17): split emulated time, torch's schedules as data, and a smoke run of the study.

The smoke test runs real DeepSpeed engines and real torch.distributed.pipelining schedules in one world of 2
processes over gloo and checks that the harness compares like with like.
"""

import json

import pytest
import torch
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from ds_paci.tools.sim import peer_schedules as ps
from ds_paci.tools.studies.peers import study as peers
from ds_paci.tools.studies.peers.model import PeerCell, check_cell, layer_specs, partition
from ds_paci.workload import emulate
from ds_paci.workload.emulate import EmulatedSplitTime, deferred_split_wait


def _model(em):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), em, torch.nn.Linear(4, 4))


def test_split_wait_is_paid_by_the_pass_that_reaches_it(monkeypatch):
    """torch's input-gradient pass pays B only, its weight-gradient pass W only, a full backward B + W."""
    sleeps = []
    monkeypatch.setattr(emulate.time, "sleep", sleeps.append)
    em = EmulatedSplitTime(0.01, 0.02, 0.03)
    model = _model(em)
    x = torch.randn(3, 4, requires_grad=True)
    out = model(x)
    assert sleeps == [0.01]
    _, groups = stage_backward_input([out], [torch.ones_like(out)], [x], model.parameters())
    assert sleeps == [0.01, 0.02] and x.grad is not None and all(p.grad is None for p in model.parameters())
    stage_backward_weight(model.parameters(), groups)
    assert sleeps == [0.01, 0.02, 0.03] and all(p.grad is not None for p in model.parameters())
    assert dict(em.waits) == {"forward": 1, "input_grad": 1, "weight_grad": 1}
    split_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    sleeps.clear()
    x.grad = None
    model(x).sum().backward()  # one full backward, as DeepSpeed's engines run it
    assert sorted(sleeps[1:]) == [0.02, 0.03]
    assert all(torch.equal(a, p.grad) for a, p in zip(split_grads, model.parameters()))
    assert torch.equal(em.anchor.grad, torch.zeros(1))  # the anchor never moves
    plain = torch.nn.Sequential(model[0], model[2])
    assert torch.equal(plain(x), model(x))  # values unchanged


def test_deferred_split_wait_hands_w_to_the_caller():
    handed, sleeps = [], []
    x = torch.randn(2, requires_grad=True)
    y = deferred_split_wait(x, 0, 0, 0.5, defer=handed.append)
    y.sum().backward()
    assert len(handed) == 1 and torch.equal(x.grad, torch.ones(2))
    with pytest.raises(ValueError):
        EmulatedSplitTime(0.1, -1, 0)
    del sleeps


@pytest.mark.parametrize("ranks,micro", [(2, 4), (4, 2), (4, 8), (8, 16)])
def test_action_lists_hold_every_pass_once_in_a_valid_order(ranks, micro):
    for name, peer in ps.PEERS.items():
        try:
            actions = ps.action_lists(name, ranks, micro)
        except ps.ScheduleUnavailable as e:
            assert (name == "1f1b" and micro < ranks) or (name == "dualpipev" and micro < 2 * ranks), (name, e)
            continue
        stages = ranks * peer.stages_per_rank
        done = set()
        for rank, acts in actions.items():
            for stage, kind, mb in (op for a in acts for op in ps._compute_ops(a)):
                assert stage in ps.rank_stages(name, ranks, rank)
                if kind in ("I", "B", "W"):
                    assert (stage, "F", mb) in done, (name, rank, stage, kind, mb)
                if kind == "W":
                    assert (stage, "I", mb) in done
                done.add((stage, kind, mb))
        for stage in range(stages):
            for mb in range(micro):
                assert (stage, "F", mb) in done and ((stage, "B", mb) in done or {(stage, "I", mb), (stage, "W", mb)}
                                                     <= done), (name, stage, mb)
        costs = ps.stage_costs((1, 1, 1), (0, 0, 0), stages, 2 * ranks)
        assert ps.long_run_period(actions, costs) > 0  # and no deadlock


def test_timing_of_action_lists_matches_the_known_bubbles():
    P, M = 4, 8
    one_f1b = ps.action_lists("1f1b", P, M)
    costs = ps.stage_costs((1, 1, 1), (0, 0, 0), P, 2 * P)  # per rank: F 2, B + W 4
    _, _, end = ps.time_actions(one_f1b, costs)
    assert max(end.values()) == pytest.approx((M + P - 1) * 6)  # 1F1B: (M + P - 1)(F + B + W)
    zbv = ps.action_lists("zbv", P, 2 * P)
    v_costs = ps.stage_costs((1, 1, 1), (0, 0, 0), 2 * P, 2 * P, torch_first_stage=False)
    assert ps.long_run_period(zbv, v_costs) == pytest.approx(2 * P * 6)  # ZB-V at M = 2P, F = B = W: no bubble
    stuck = {0: list(reversed(ps.action_lists("gpipe", 2, 1)[0])), 1: ps.action_lists("gpipe", 2, 1)[1]}
    with pytest.raises(RuntimeError, match="deadlock"):
        ps.time_actions(stuck, ps.stage_costs((1, 1, 1), (0, 0, 0), 2, 4))


def test_simulate_cli_adds_rows_from_the_action_lists(capsys):
    from ds_paci.tools.sim.simulate import main
    assert main(["--stages", "4", "--micro-batches", "2", "8", "--peers"]) == 0
    out = capsys.readouterr().out
    assert out.count("(torch action list)") == 2 * len(ps.PEERS)
    assert "not run: Number of microbatches (2) must be greater than or equal to the number of stages (4)" in out
    zbv = [line for line in out.splitlines() if "| 8 | ZB-V" in line][0]
    assert "| 1.375 |" in zbv  # zero bubble at M = 2P: the ideal (M+P-1)/M


def test_the_partition_is_deepspeeds_type_block_partition():
    from deepspeed.runtime.utils import partition_balanced
    for cell in (PeerCell(4, 4), PeerCell(8, 16, ratio="1:2:1", slow_last=True),
                 PeerCell(2, 2, ratio="real", unit=0.0)):
        specs = layer_specs(cell)
        weights = [1 if s.typename.__name__ == "Block" else 0 for s in specs]
        assert partition(specs, cell.stages) == [int(b) for b in partition_balanced(weights, cell.stages)]
        assert len(partition(specs, 2 * cell.stages)) == 2 * cell.stages + 1
    with pytest.raises(ValueError, match="ratio"):
        check_cell(PeerCell(4, 4, ratio="1:3:1"))


@pytest.mark.process
def test_smoke_study_synchronous_engines_agree_with_stock(tmp_path):
    """Two synchronous schedules beside stock and PACI + look-ahead, one cell, three steps, real processes."""
    out = tmp_path / "peers"
    assert peers.main(["--study", "peers", "--smoke", "--engines", "stock,paci+lookahead,1f1b,zbv", "--rounds", "1",
                       "--out", str(out), "--log-dir", str(tmp_path / "logs")]) == 0
    entry = json.loads((out / "cells" / "P2_M2_fbw111.json").read_text())
    cell = peers.smoke_cell()
    eng = entry["engines"]
    assert set(entry["agreement"]) == {"1f1b", "zbv"}
    for name, check in entry["agreement"].items():
        assert check["agrees"], (name, check)
        assert eng[name]["losses"] == pytest.approx(eng["stock"]["losses"], rel=1e-4)
    assert eng["stock"]["losses"][-1] < eng["stock"]["losses"][0]  # it trains
    assert eng["paci+lookahead"]["validation_loss"] != eng["stock"]["validation_loss"]  # async: another run
    micro_batch_blocks = cell.steps * cell.micro_batches * 2  # two blocks per rank
    for name, summary in eng.items():
        for waits in summary["waits_per_rank"]:
            assert waits["weight_grad"] == micro_batch_blocks, (name, waits)  # every engine pays every W once
            # torch's first step adds shape-inference passes (at most one per block)
            assert micro_batch_blocks <= waits["forward"] <= micro_batch_blocks + 2, (name, waits)
            assert micro_batch_blocks <= waits["input_grad"] <= micro_batch_blocks + 2, (name, waits)
    for name in ("1f1b", "zbv"):
        expected = ps.action_strings(ps.action_lists(name, 2, 2))
        assert eng[name]["executed"] == [expected[0], expected[1]], name  # torch ran the lists we time
    # the same order holds the same activations (torch's last stage saves its labels as a view of the whole
    # batch's labels: one storage of M micro-batches' labels instead of one)
    torch_1f1b, stock = eng["1f1b"]["activation_bytes_per_rank"], eng["stock"]["activation_bytes_per_rank"]
    assert torch_1f1b[0] == stock[0]
    assert 0 <= torch_1f1b[1] - stock[1] <= cell.micro_batches * cell.micro_batch_size * cell.seq_len * 8
    markdown = (tmp_path / "peers.md").read_text()
    assert "PACI + look-ahead against the best synchronous peer" in markdown and "(agrees)" in markdown


def test_meter_releases_what_torchs_split_backward_leaves_to_the_collector():
    """A node only the input-gradient pass runs (retain_graph=True there) is never released by autograd; the meter
    must not keep it alive through its saved output (it did before it held saved tensors detached)."""
    import gc

    from ds_paci.tools.bench.meters import SavedTensorMeter
    lin = torch.nn.Linear(8, 8)
    meter = SavedTensorMeter(lin.parameters())
    with meter.training():
        x = torch.randn(4, 8, requires_grad=True)
        out = lin(torch.sigmoid(x))  # sigmoid saves its output; only the input gradient needs it
        saved = meter.saved_bytes
        _, groups = stage_backward_input([out], [torch.ones_like(out)], [x], lin.parameters())
        stage_backward_weight(lin.parameters(), groups)
        del out, groups, x
    gc.collect()
    assert saved > 0 and meter.saved_bytes == 0 and meter.peak_saved_bytes == saved
