"""The single-process replay: sync mode is plain training, PACI modes follow the streams (the engine comparison is
tests/test_replay_engine.py)."""

import torch

from ds_paci.core.program.actions import Kind
from ds_paci.core.program.stream import PACIStream
from ds_paci.tools.replay.replayer import replay, stage_slices
from ds_paci.workload.data import ByteTokenizer, MicroBatchIterator, encode_documents, load_corpus
from ds_paci.workload.gpt2 import gpt2_config, gpt2_reference_model, lm_loss

P, M, MICRO, SEQ, STEPS = 2, 2, 2, 16, 4


def _setup(seed=3):
    cfg = gpt2_config("tiny", vocab_size=257, n_positions=SEQ, n_embd=16, n_layer=2, n_head=2)
    tokens = encode_documents(load_corpus()[:1], ByteTokenizer())
    val = [next(MicroBatchIterator(tokens, MICRO, SEQ, seed=99)) for _ in range(2)]
    return gpt2_reference_model(cfg, seed=seed), MicroBatchIterator(tokens, MICRO, SEQ, seed=5), val, tokens


def test_sync_replay_is_plain_training_with_gradient_accumulation():
    model, data, val, tokens = _setup()
    curve = replay(model, P, M, data, val, STEPS, mode="sync", lr=1e-2, eval_every=STEPS).curve
    ref, ref_data, _, _ = _setup()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)
    for _ in range(STEPS):
        for _ in range(M):
            x, y = next(ref_data)
            (lm_loss(ref(x), y) / M).backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        expected = sum(float(lm_loss(ref(x), y)) for x, y in val) / len(val)
    assert abs(curve[-1][1] - expected) < 1e-5
    assert stage_slices(model, P) == [(0, 2), (2, len(model))]  # embedding + block 0 | block 1, norm, head


def test_paci_replays_differ_from_sync_and_the_lookahead_predicts_the_crossing_forwards():
    finals, stats = {}, {}
    for mode in ("sync", "paci", "lookahead"):
        model, data, val, _ = _setup()
        result = replay(model, P, M, data, val, STEPS, mode=mode, lr=1e-2, eval_every=STEPS)
        finals[mode], stats[mode] = result.curve[-1][1], result.lookahead
    assert finals["paci"] != finals["sync"] and finals["lookahead"] != finals["paci"]
    st = PACIStream(P, 0, M)
    ticks = [t for _ in range(STEPS) for t in st.advance(2 * M)]
    crossing = sum(1 for t in ticks for i in t if i.kind is Kind.FORWARD and i.crosses_step)
    assert stats["lookahead"][0]["predicted_forwards"] == crossing == STEPS - 1
    assert stats["lookahead"][1]["predicted_forwards"] == 0 and stats["paci"][0]["predicted_forwards"] == 0


def test_validations_without_draining_leave_the_training_unchanged_and_windows_are_per_stage():
    from ds_paci.tools.replay.replayer import Evaluation
    runs = {}
    for name, evaluation in (("none", Evaluation(every=0)), ("peek", Evaluation(every=1, drains=False)),
                             ("drain", Evaluation(every=1, drains=True))):
        model, data, val, _ = _setup()
        runs[name] = replay(model, P, M, data, val, STEPS, mode="lookahead", window=[3, 2], lr=1e-2,
                            evaluation=evaluation)
    assert runs["peek"].curve[-1] == runs["none"].curve[-1] and runs["peek"].call_losses == runs["none"].call_losses
    assert len(runs["peek"].curve) == STEPS + 1 and len(runs["none"].curve) == 2
    # a drain per validation changes the drift of the micro-batches in flight at it (nothing crosses a step
    # during the flush) but never adds a step: the partial window stays open (issue 16, as eval_batch)
    assert runs["drain"].curve[-1] != runs["none"].curve[-1]
    # 8 micro-batches per stage: stage 0 (a = 3) steps twice and closes a partial window at the end, stage 1 (a = 2)
    assert runs["none"].local_steps == [3, 4] and runs["none"].windows == [3, 2]
    assert runs["drain"].local_steps == runs["none"].local_steps
