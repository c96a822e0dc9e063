"""GPT-2 pipeline layers (ds_paci.workload.gpt2) and emulated device time (ds_paci.workload.emulate)."""

import math
import time

import pytest
import torch
from harness import run_world

from ds_paci.workload.emulate import EmulatedDeviceTime
from ds_paci.workload.gpt2 import (SIZES, TIED_KEY, Block, Embedding, FinalNorm, LMHead, PositionEmbedding,
                                   TiedLMHead, TokenEmbedding, gpt2_config, gpt2_layer_specs, gpt2_pipeline,
                                   gpt2_reference_model, lm_loss, tied_lm_logits)


def _small_config(**overrides):
    kwargs = dict(vocab_size=97, n_positions=32, n_embd=32, n_layer=3, n_head=4)
    kwargs.update(overrides)
    return gpt2_config("tiny", **kwargs)


def _future_leak(model, seq_len, vocab, t, seed=0):
    """Max change of outputs at positions < t, and at positions >= t, when token t changes."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (2, seq_len), generator=gen)
    x2 = x.clone()
    x2[:, t] = (x[:, t] + 1 + torch.randint(0, vocab - 1, (2,), generator=gen)) % vocab
    with torch.no_grad():
        a, b = model(x), model(x2)
    return (a[:, :t] - b[:, :t]).abs().max().item(), (a[:, t:] - b[:, t:]).abs().max().item()


# ------------------------------------------------------------------- causality


@pytest.mark.parametrize("config", [
    gpt2_config("tiny", vocab_size=257, n_positions=64),
    gpt2_config("tiny", vocab_size=97, n_positions=32, n_embd=48, n_layer=2, n_head=3, dropout=0.1),
], ids=["tiny", "custom-dropout"])
def test_logits_do_not_depend_on_later_tokens(config):
    model = gpt2_reference_model(config, seed=5).eval()
    seq_len = min(config.n_positions, 24)
    for t in (1, seq_len // 2, seq_len - 1):
        past, future = _future_leak(model, seq_len, config.vocab_size, t)
        assert past == 0.0, f"position < {t} saw token {t}"
        assert future > 0.0, "changing a token must change its own logits (test sanity)"


def test_plain_eager_gpt2_block_would_leak_but_ours_does_not():
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    plain_cfg = GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=1, n_head=4, bos_token_id=0,
                           eos_token_id=0)
    plain_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    plain = GPT2Block(plain_cfg, layer_idx=0).eval()
    ours = Block(plain_cfg, layer_idx=0, init_seed=0).eval()  # same eager config, forced to sdpa inside
    assert plain_cfg._attn_implementation == "eager", "Block must not modify the caller's config"
    assert gpt2_config(vocab_size=97, n_positions=32)._attn_implementation == "sdpa"
    x = torch.randn(1, 12, 32, generator=torch.Generator().manual_seed(1))
    x2 = x.clone()
    x2[0, 7] = torch.randn(32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (plain(x)[0, :7] - plain(x2)[0, :7]).abs().max() > 1e-4, "eager GPT2Block is expected to leak"
        assert torch.equal(ours(x)[0, :7], ours(x2)[0, :7])


def test_sequence_longer_than_n_positions_is_a_clear_error():
    model = gpt2_reference_model(_small_config(n_positions=16), seed=0)
    model(torch.zeros(1, 16, dtype=torch.long))
    with pytest.raises(ValueError) as exc:
        model(torch.zeros(1, 17, dtype=torch.long))
    assert "17" in str(exc.value) and "16" in str(exc.value) and "n_positions" in str(exc.value)


# ------------------------------------------------------------------ config


def test_size_presets_and_overrides():
    expected = {"tiny": (4, 128, 4), "small": (12, 768, 12), "medium": (24, 1024, 16)}
    for size, dims in expected.items():
        cfg = gpt2_config(size, vocab_size=50257, n_positions=1024)
        assert (cfg.n_layer, cfg.n_embd, cfg.n_head) == dims == SIZES[size]
        assert cfg.bos_token_id == cfg.eos_token_id == 50256
    cfg = gpt2_config("small", vocab_size=257, n_positions=128, n_layer=2, n_embd=64, n_head=2, dropout=0.2)
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_positions, cfg.vocab_size) == (2, 64, 2, 128, 257)
    assert cfg.resid_pdrop == cfg.embd_pdrop == cfg.attn_pdrop == 0.2
    assert cfg.eos_token_id == 256


def test_config_validation():
    with pytest.raises(ValueError, match="divisible"):
        gpt2_config(vocab_size=257, n_positions=64, n_embd=100, n_head=3)
    with pytest.raises(ValueError, match="unknown GPT-2 size 'huge'.*tiny"):
        gpt2_config("huge", vocab_size=257, n_positions=64)
    with pytest.raises(ValueError, match="n_layer"):
        gpt2_config(vocab_size=257, n_positions=64, n_layer=0)
    with pytest.raises(ValueError, match="vocab_size"):
        gpt2_config(vocab_size=0, n_positions=64)
    with pytest.raises(ValueError, match="dropout"):
        gpt2_config(vocab_size=257, n_positions=64, dropout=1.0)
    with pytest.raises(ValueError, match="eos_token_id"):
        gpt2_config(vocab_size=257, n_positions=64, eos_token_id=257)


# ------------------------------------------------------------------ weights, loss


def test_lm_head_is_untied_from_the_embedding():
    cfg = _small_config()
    model = gpt2_reference_model(cfg, seed=3)
    emb, head = model[0], model[-1]
    assert isinstance(emb, Embedding) and isinstance(head, LMHead) and isinstance(model[-2], FinalNorm)
    assert head.proj.bias is None
    assert head.proj.weight is not emb.wte.weight
    assert head.proj.weight.data_ptr() != emb.wte.weight.data_ptr()
    assert not torch.equal(head.proj.weight, emb.wte.weight)
    with torch.no_grad():
        emb.wte.weight.zero_()
    assert head.proj.weight.abs().sum() > 0


def test_tied_model_shares_the_token_embedding_and_starts_from_the_untied_embeddings():
    cfg = _small_config()
    untied = gpt2_reference_model(cfg, seed=3)
    tied = gpt2_reference_model(cfg, seed=3, tie_embeddings=True)
    token, position, head = tied[0], tied[1], tied[-1]
    assert isinstance(token, TokenEmbedding) and isinstance(position, PositionEmbedding)
    assert isinstance(head, TiedLMHead) and head.embedding is token
    assert torch.equal(token.wte.weight, untied[0].wte.weight) and torch.equal(position.wpe.weight, untied[0].wpe.weight)
    assert all(torch.equal(p, q) for p, q in zip(tied[2].parameters(), untied[1].parameters()))  # first block
    # one parameter fewer (the head), and the head's gradient lands on the embedding
    assert sum(p.numel() for p in tied.parameters()) == sum(p.numel() for p in untied.parameters()) - 97 * 32
    x = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    lm_loss(tied(x), x).backward()
    only_head = token.wte.weight.grad.clone()
    token.wte.weight.grad = None
    with torch.no_grad():
        hidden = tied[:-1](x)
    lm_loss(tied_lm_logits(token, hidden), x).backward()
    assert (only_head - token.wte.weight.grad).abs().max() > 0  # the embedding use adds to the head's gradient
    specs = gpt2_layer_specs(cfg, seed=3, tie_embeddings=True)
    from deepspeed.pipe import TiedLayerSpec
    assert [s.key for s in specs if isinstance(s, TiedLayerSpec)] == [TIED_KEY, TIED_KEY]
    assert specs[-1].forward_fn is tied_lm_logits and specs[0].forward_fn is None


def test_init_is_deterministic_gpt2_style_and_independent_of_global_rng():
    cfg = gpt2_config("tiny", vocab_size=257, n_positions=64)
    torch.manual_seed(0)
    a = gpt2_reference_model(cfg, seed=11)
    torch.manual_seed(99)
    b = gpt2_reference_model(cfg, seed=11)
    c = gpt2_reference_model(cfg, seed=12)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a[1].block.attn.c_attn.weight, c[1].block.attn.c_attn.weight)
    blk = a[1].block
    assert abs(blk.attn.c_attn.weight.std().item() - 0.02) < 0.002
    assert abs(blk.mlp.c_proj.weight.std().item() - 0.02 / math.sqrt(2 * cfg.n_layer)) < 0.001
    assert torch.equal(blk.ln_1.weight, torch.ones(128)) and not blk.attn.c_attn.bias.any()
    assert not torch.equal(a[1].block.attn.c_attn.weight, a[2].block.attn.c_attn.weight)
    # the emulation layers do not shift any weights
    d = gpt2_reference_model(cfg, seed=11, device_time=0.001)
    assert [torch.equal(p, q) for p, q in zip(a.parameters(), d.parameters())] == [True] * len(list(a.parameters()))


def test_lm_loss_is_float32_mean_cross_entropy():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=gen)
    labels = torch.randint(0, 11, (2, 5), generator=gen)
    manual = -torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).mean()
    assert torch.allclose(lm_loss(logits, labels), manual, atol=1e-6)
    low = lm_loss(logits.bfloat16(), labels)
    assert low.dtype == torch.float32
    model = gpt2_reference_model(_small_config(), seed=0)
    x = torch.randint(0, 97, (4, 32), generator=gen)
    assert abs(lm_loss(model(x), x).item() - math.log(97)) < 0.1  # near-uniform at init


# ------------------------------------------------------------------ emulated time


def test_emulated_device_time_sleeps_and_passes_values_and_gradients():
    layer = EmulatedDeviceTime(0.05)
    x = torch.randn(3, 4, requires_grad=True)
    start = time.perf_counter()
    y = layer(x)
    assert time.perf_counter() - start >= 0.05
    assert torch.equal(y, x)
    grad = torch.randn(3, 4)
    start = time.perf_counter()
    y.backward(grad)
    assert time.perf_counter() - start >= 0.1
    assert torch.equal(x.grad, grad)
    assert "emulated" in (EmulatedDeviceTime.__doc__ or "").lower()

    ident = EmulatedDeviceTime(0)
    assert ident(x) is x
    with pytest.raises(ValueError):
        EmulatedDeviceTime(-1)


# ------------------------------------------------------------------ pipeline module


def _one_stage_world(rank):
    torch.manual_seed(0)
    cfg = _small_config()
    x = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(3))
    out = {}
    ref = gpt2_reference_model(cfg, seed=7)
    ref_logits = ref(x)
    lm_loss(ref_logits, x).backward()
    out["ref_logits"] = ref_logits.detach()
    out["ref_grads"] = [p.grad.clone() for p in ref.parameters()]
    for device_time in (0.0, 0.002):
        pipe = gpt2_pipeline(cfg, num_stages=1, seed=7, device_time=device_time)
        logits = pipe(x)
        pipe.loss_fn(logits, x).backward()
        out[device_time] = {
            "types": [type(f).__name__ for f in pipe.forward_funcs],
            "logits": logits.detach(),
            "params": [p.detach().clone() for p in pipe.parameters()],
            "grads": [p.grad.clone() for p in pipe.parameters()],
        }
    out["ref_params"] = [p.detach().clone() for p in ref.parameters()]
    return out


def _one_stage_tied_world(rank):
    cfg = _small_config()
    x = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(3))
    ref = gpt2_reference_model(cfg, seed=7, tie_embeddings=True)
    ref_logits = ref(x)
    lm_loss(ref_logits, x).backward()
    pipe = gpt2_pipeline(cfg, num_stages=1, seed=7, tie_embeddings=True)
    logits = pipe(x)
    pipe.loss_fn(logits, x).backward()
    grads = dict((n, p.grad.clone()) for n, p in pipe.named_parameters())
    return {"ref_logits": ref_logits.detach(), "logits": logits.detach(),
            "ref_wte_grad": ref[0].wte.weight.grad.clone(), "wte_grad": grads["tied_modules.embed.wte.weight"],
            "n_params": (sum(p.numel() for p in pipe.parameters()), sum(p.numel() for p in ref.parameters()))}


@pytest.mark.process
def test_one_stage_tied_pipeline_equals_tied_reference_model():
    (out,) = run_world(_one_stage_tied_world, 1, timeout=120)
    assert out["n_params"][0] == out["n_params"][1]
    assert torch.allclose(out["logits"], out["ref_logits"], atol=1e-6, rtol=0)
    assert torch.allclose(out["wte_grad"], out["ref_wte_grad"], atol=1e-6, rtol=1e-5)


@pytest.mark.process
def test_one_stage_pipeline_equals_reference_model():
    (out,) = run_world(_one_stage_world, 1, timeout=120)
    plain = ["Embedding", "Block", "Block", "Block", "FinalNorm", "LMHead"]
    assert out[0.0]["types"] == plain
    assert out[0.002]["types"] == ["Embedding"] + ["Block", "EmulatedDeviceTime"] * 3 + ["FinalNorm", "LMHead"]
    for device_time in (0.0, 0.002):
        res = out[device_time]
        assert len(res["params"]) == len(out["ref_params"])
        assert all(torch.equal(p, q) for p, q in zip(res["params"], out["ref_params"]))
        assert torch.allclose(res["logits"], out["ref_logits"], atol=1e-6, rtol=0)
        assert all(torch.allclose(g, h, atol=1e-6, rtol=1e-5) for g, h in zip(res["grads"], out["ref_grads"]))


def _two_stage_world(rank):
    result = {}
    for n_layer in (3, 4):
        cfg = _small_config(n_layer=n_layer)
        pipe = gpt2_pipeline(cfg, num_stages=2, seed=7, device_time=0.001)
        ref = gpt2_reference_model(cfg, seed=7)
        ref_blocks = {m.layer_idx: m for m in ref if isinstance(m, Block)}
        local = list(pipe.forward_funcs)
        same_weights = all(
            all(torch.equal(p, q) for p, q in zip(f.parameters(), ref_blocks[f.layer_idx].parameters()))
            for f in local if isinstance(f, Block))
        result[n_layer] = {"types": [type(f).__name__ for f in local], "same_weights": same_weights}
    try:
        gpt2_pipeline(_small_config(n_layer=4), num_stages=2, device_time=0.001, partition_method="uniform")
        result["uniform"] = None
    except RuntimeError as exc:
        result["uniform"] = str(exc)
    return result


@pytest.mark.process
def test_two_stage_partition_keeps_emulated_time_with_its_block():
    stages = run_world(_two_stage_world, 2, timeout=120)
    for n_layer in (3, 4):
        types = [stage[n_layer]["types"] for stage in stages]
        assert all(stage[n_layer]["same_weights"] for stage in stages)
        assert types[0][0] == "Embedding" and types[1][-2:] == ["FinalNorm", "LMHead"]
        blocks = [t.count("Block") for t in types]
        assert sum(blocks) == n_layer and abs(blocks[0] - blocks[1]) <= 1
        for t in types:
            for i, name in enumerate(t):
                if name == "Block":
                    assert t[i + 1] == "EmulatedDeviceTime", t
                if name == "EmulatedDeviceTime":
                    assert t[i - 1] == "Block", t
    assert stages[0]["uniform"] and "type:Block" in stages[0]["uniform"]
