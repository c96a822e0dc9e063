"""The simulator's link model (ds_paci.tools.sim.links), its hook in the simulator, ZB-V timing and P up to 64."""

import pytest

from ds_paci.tools.studies import scale
from ds_paci.tools.sim.links import Link, LinkModel
from ds_paci.tools.sim.simulate import CostModel, long_run_period, simulate_paci

FREE = Link(0.0, 1e30)


def test_link_arithmetic_and_placement():
    lm = LinkModel(Link(1e-6, 100e9), Link(1e-5, 10e9), ranks_per_node=4, activation_bytes=8e6, grad_bytes=40e6,
                   dp=4)
    assert lm.transfer_time(2, 3) == pytest.approx(1e-6 + 8e6 / 100e9)  # same node
    assert lm.transfer_time(3, 4) == pytest.approx(1e-5 + 8e6 / 10e9)  # node boundary
    assert lm.transfer_time(5, 5) == 0.0
    ring = 2 * 3 * 1e-5 + 2 * 3 / 4 * 40e6 / 10e9  # 2(dp-1) latencies, 2(dp-1)/dp of the bytes
    assert lm.allreduce_time() == pytest.approx(ring)
    assert lm.step_delay(last_backward=1.0) == pytest.approx(ring)  # not overlapped: all of it
    over = LinkModel(lm.intra, lm.inter, 4, 8e6, 40e6, dp=4, overlap=True)
    assert over.step_delay(last_backward=ring / 4) == pytest.approx(ring * 3 / 4) and over.step_delay(1.0) == 0.0
    with pytest.raises(ValueError):
        LinkModel(FREE, FREE, 1, 0, dp_link="sideways")


@pytest.mark.parametrize("P,per_node,busiest", [(2, 1, 2), (4, 1, 4), (4, 2, 2), (4, 4, 0)])
def test_transfers_cost_their_link_in_the_executed_streams(P, per_node, busiest):
    # blocking transfers occupy both sides: the long-run time per micro-batch is F + B plus the transfers of the
    # busiest stage (a stage between two node boundaries moves its activation in, out, and both gradients)
    t = 0.25
    lm = LinkModel(FREE, Link(t, 1e30), ranks_per_node=per_node, activation_bytes=0)
    period = long_run_period("paci", P, 4, cost=CostModel(forward=1.0, links=lm))
    assert period == pytest.approx(3.0 + busiest * t)
    assert long_run_period("stock", P, 4, cost=CostModel(forward=1.0, links=lm)) > period


def test_an_unoverlapped_all_reduce_costs_paci_p_times_what_it_costs_the_flush():
    # PACI's stages step at different moments and stall each other through the blocking transfers; the flush steps
    # them together. Per micro-batch: P * r / M against r / M (what the table's dp4 rows show at scale).
    lm = LinkModel(FREE, Link(0.0, 1e9), ranks_per_node=1, activation_bytes=0, grad_bytes=0.5e9, dp=2)
    r = lm.allreduce_time()
    for P, M in ((4, 8), (3, 6)):
        base, linked = CostModel(forward=1.0), CostModel(forward=1.0, links=lm)
        paci = long_run_period("paci", P, M, cost=linked) - long_run_period("paci", P, M, cost=base)
        stock = long_run_period("stock", P, M, cost=linked) - long_run_period("stock", P, M, cost=base)
        assert paci == pytest.approx(P * r / M) and stock == pytest.approx(r / M)


def test_zbv_is_torchs_schedule_and_fills_its_bubble():
    P, M = 4, 8
    actions = scale.zbv_actions(P, M)
    seen = sorted((a.stage_index, a.computation_type.value, a.microbatch_index) for r in actions for a in actions[r])
    assert seen == sorted((k, c, m) for k in range(2 * P) for c in "FIW" for m in range(M))  # each once
    assert {a.stage_index for a in actions[0]} == {0, 2 * P - 1}  # the V: rank 0 holds the first and last chunk
    assert scale.zbv_period(P, 2 * P, (1, 1, 1)) == pytest.approx(6.0)  # M >= 2P, F = I = W: zero bubble
    assert scale.zbv_period(P, P, (1, 1, 1)) > 6.0
    # a transfer between ranks delays the dependent action; the V's turn (chunk P-1 -> P) stays on one rank
    lm = LinkModel(FREE, Link(0.5, 1e30), ranks_per_node=1, activation_bytes=0)
    assert scale.time_zbv(P, M, (1, 1, 1), lm) > scale.time_zbv(P, M, (1, 1, 1))
    assert scale.time_zbv(1, M, (1, 1, 1), lm) == scale.time_zbv(1, M, (1, 1, 1))


def test_64_stages_and_gpt2_medium_shapes():
    result = simulate_paci(64, 16, 16, 4)
    assert result.ok and 1 <= result.max_drift <= 4  # ceil(63 / 16)
    assert len(scale.zbv_actions(64, 8)[63]) == 2 * 3 * 8
    shape = scale.BlockShape()
    assert shape.activation_bytes == 4 * 1024 * 1024 * 2  # 4 sequences x 1024 tokens x d = 1024, bf16
    assert shape.params == 12 * 1024**2 + 13 * 1024
    assert scale.stage_costs(shape, 100e12) == pytest.approx((24 * 4096 * 1024**2 + 4 * 4096 * 1024 * 1024) / 100e12)
    rows = scale.rows([4], (1,), ("free", "ib200"))
    free, linked = rows
    assert free["compute_share"]["PACI"] == pytest.approx(1.0)
    assert free["vs_1f1b"]["PACI"] == pytest.approx((4 + 4 - 1) / 4)  # the ideal (M+P-1)/M
    assert linked["period_s"]["PACI"] > free["period_s"]["PACI"]


def test_scale_variants_rows_and_table(tmp_path):
    linked, dp = scale.rows([4], (0.5, ), ("ib200", "ib100-dp4"), variants=tuple(scale.VARIANTS))
    assert linked["M"] == dp["M"] == 2
    assert "diagonal+overlap" not in linked["period_s"] and "diagonal+nb" in linked["period_s"]
    p = dp["period_s"]
    # each change removes a cost the previous one paid: reduces in sequence, the reduce at the step, blocking sends
    assert p["PACI"] > p["diagonal"] > p["diagonal+overlap"] > p["diagonal+overlap+nb"]
    assert p["diagonal"] > p["diagonal+nb"] > p["diagonal+overlap+nb"]
    table = scale.variants_markdown([linked, dp], list(scale.VARIANTS))
    assert table.count("\n") == 3 and "| - |" in table and "x)" in table
    out = tmp_path / "t.md"
    assert scale.main(["--stages", "2", "--micro-batch-factors", "1", "--scenarios", "ib200", "--variants", "PACI",
                       "diagonal+nb", "--out", str(out)]) == 0
    assert out.read_text().count("| 2 | 2 | ib200 |") == 1


def test_slack_on_the_links_between_nodes_takes_the_transfer_off_the_dependence_chain():
    """``"slack_links"`` on the node boundary (P = 16, eight ranks a node: link 7): with non-blocking transfers the
    100 Gb/s transfer (0.68 ms) no longer adds to every micro-batch, which it does without slack (a bubble-free
    stream has no slack); the stream program is the engine's, the link the study's."""
    links = scale.link_model("ib100-dp4", scale.BlockShape(), 2)
    assert scale.node_links(16, links) == (7, ) and scale.node_links(32, links) == (7, 15, 23)
    assert scale.node_links(16, None) == ()
    (row, ) = scale.rows([16], (4, ), ("ib100-dp4", ), variants=("diagonal+overlap+nb", "diagonal+overlap+nb+slack"))
    p = row["period_s"]
    transfer = links.transfer_time(7, 8)
    assert p["diagonal+overlap+nb"] - p["diagonal+overlap+nb+slack"] > 0.5 * transfer
    compute = 3 * 2 * scale.stage_costs(scale.BlockShape(), 100e12)
    assert p["diagonal+overlap+nb+slack"] < compute + 0.5 * transfer < p["diagonal+overlap+nb"]
