"""Timelines: Chrome trace, PNG, text grid and record loading, from simulations and engine-style files."""

import json

import pytest

from ds_paci.tools.sim.simulate import simulate_paci, simulate_stock
from ds_paci.tools.sim.records import kind_of, load_records, micro_batch_in, records_from_sim
from ds_paci.tools.sim.render import to_chrome_trace, to_png, to_text_grid
from ds_paci.tools.sim.timeline import main


@pytest.fixture(scope="module")
def paci_records():
    return records_from_sim(simulate_paci(4, 4, calls=2))


def test_records_from_sim_one_per_instruction():
    result = simulate_paci(3, 2, calls=2)
    records = records_from_sim(result)
    executed = sum(1 for stage in result.events for e in stage if e.kind != "wait")
    assert len(records) == executed
    assert {r["stage"] for r in records} == {0, 1, 2}
    assert all(set(r) == {"rank", "stage", "instr", "start", "end"} for r in records)
    # a blocked receive is one record spanning its wait
    first_recv = next(r for r in records if r["stage"] == 2 and r["instr"].startswith("RA"))
    assert first_recv["start"] == 0.0 and first_recv["end"] == 2.0


def test_kind_and_micro_batch_of_text():
    assert [kind_of(t) for t in ("F3", "B3", "SA3", "RG3", "L3", "ACC3", "STEP1", "REDUCE_TIED", "?")] == [
        "forward", "backward", "send", "recv", "load", "step", "step", "step", "other"
    ]
    assert micro_batch_in("SG12") == 12 and micro_batch_in("STEP3") is None


def test_chrome_trace(paci_records, tmp_path):
    path = tmp_path / "trace.json"
    to_chrome_trace(paci_records, path, label="simulated PACI")
    trace = json.loads(path.read_text())
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(paci_records)
    assert {e["tid"] for e in complete} == {0, 1, 2, 3}
    for e in complete:
        assert e["ts"] >= 0 and e["dur"] >= 0 and e["cat"] == kind_of(e["name"])
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {s: f"stage {s}" for s in range(4)}
    forward0 = next(e for e in complete if e["name"] == "F1" and e["tid"] == 0)
    assert forward0["ts"] == pytest.approx(1e6) and forward0["dur"] == pytest.approx(1e6)


def test_png(paci_records, tmp_path):
    path = tmp_path / "timeline.png"
    to_png(paci_records, path, "simulated PACI (emulated title)")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_text_grid(paci_records):
    grid = to_text_grid(paci_records, width=60).splitlines()
    assert len(grid) == 4 + 1 and grid[-1].startswith("legend")
    for s, line in enumerate(grid[:4]):
        assert line.strip().startswith(f"stage {s} |")
        cells = line.split("|")[1]
        assert len(cells) == 60 and "F" in cells and "B" in cells and "S" in cells
    # the last stage is idle during the fill: its first columns are '.'
    assert grid[3].split("|")[1].startswith("...")


def test_text_grid_shows_stock_bubble_and_paci_none():
    def idle_share(records):
        cells = "".join(line.split("|")[1] for line in to_text_grid(records, width=200).splitlines()[:-1])
        return cells.count(".") / len(cells)

    stock = idle_share(records_from_sim(simulate_stock(4, 4)))
    paci = idle_share(records_from_sim(simulate_paci(4, 4, calls=8)))
    assert stock == pytest.approx(3 / 7, abs=0.03)
    assert paci < stock / 3


def test_records_round_trip_through_files(paci_records, tmp_path):
    base = 1.7e9  # wall-clock seconds, as the engine writes them
    shifted = [dict(r, start=r["start"] + base, end=r["end"] + base) for r in paci_records]
    for rank in range(4):
        with open(tmp_path / f"trace_rank{rank}.jsonl", "w") as f:
            for r in shifted:
                if r["rank"] == rank:
                    f.write(json.dumps(r) + "\n")
    loaded = load_records(tmp_path)
    key = lambda r: (r["stage"], r["rank"], r["start"], r["instr"])
    assert sorted(loaded, key=key) == sorted(shifted, key=key)
    assert load_records([tmp_path / "trace_rank1.jsonl"]) == [r for r in loaded if r["rank"] == 1]
    # relative timestamps in the Chrome trace even for wall-clock records
    to_chrome_trace(loaded, tmp_path / "t.json")
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert min(e["ts"] for e in events if e["ph"] == "X") == 0.0


def test_several_ranks_per_stage_get_their_own_rows():
    records = [
        {"rank": 0, "stage": 0, "instr": "F0", "start": 0.0, "end": 1.0},
        {"rank": 2, "stage": 0, "instr": "F0", "start": 0.0, "end": 1.0},
        {"rank": 1, "stage": 1, "instr": "B0", "start": 1.0, "end": 2.0},
    ]
    grid = to_text_grid(records, width=10).splitlines()
    assert [l.split("|")[0].strip() for l in grid[:-1]] == ["stage 0 rank 0", "stage 0 rank 2", "stage 1"]


def test_load_records_rejects_incomplete(tmp_path):
    (tmp_path / "bad.jsonl").write_text(json.dumps({"rank": 0, "instr": "F0"}) + "\n")
    with pytest.raises(ValueError, match="lacks"):
        load_records(tmp_path)


def test_cli_from_records_and_from_simulation(paci_records, tmp_path, capsys):
    with open(tmp_path / "trace_rank0.jsonl", "w") as f:
        for r in paci_records:
            f.write(json.dumps(r) + "\n")
    chrome, png = tmp_path / "out.json", tmp_path / "out.png"
    assert main([str(tmp_path), "--chrome", str(chrome), "--png", str(png), "--text"]) == 0
    assert chrome.stat().st_size > 0 and png.read_bytes()[:4] == b"\x89PNG"
    assert "stage 3 |" in capsys.readouterr().out
    assert main(["--simulate", "--stages", "4", "--micro-batches", "4", "--schedule", "stock", "--width", "40"]) == 0
    out = capsys.readouterr().out
    assert "simulated stock" in out and out.count(" |") >= 4
