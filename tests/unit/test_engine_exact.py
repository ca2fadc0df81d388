"""Greedy output of the engine equals transformers `generate`, token for token."""

from __future__ import annotations

import json
import random

import pytest
import torch

from plurai.gpu_workers.backend import AddRequest
from plurai.gpu_workers.engine.sampling_params import SamplingParams
from plurai.gpu_workers.kernels import cpu_isa
from plurai.gpu_workers.layers.linear import Linear, can_pack
from tests.conftest import FAMILIES

MAX_TOKENS = 24


def prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(16, vocab) for _ in range(n)] for n in lengths]


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_batch_matches_transformers(family, model_factory, engine_factory, reference):
    path = model_factory(family)
    engine = engine_factory(path)
    # where oneDNN can (CPU), every projection runs on packed weights, the tied lm_head too
    packed = can_pack(engine.runner.device, engine.runner.dtype)
    linears = [m for m in engine.runner.model.modules() if isinstance(m, Linear)]
    assert linears and all((m.packed is not None) == packed for m in linears)
    ps = prompts(engine.vocab_size, [1, 3, 17, 40, 95, 150])
    got = [c.token_ids for c in engine.generate(ps, greedy())]
    assert got == reference(path, ps, MAX_TOKENS)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_chunked_prefill_matches(family, model_factory, engine_factory, reference):
    path = model_factory(family)
    # a 16-token budget splits every prompt below into several chunks, mixed with decodes
    engine = engine_factory(path, max_num_batched_tokens=16)
    ps = prompts(engine.vocab_size, [45, 70, 9, 33], seed=1)
    got = [c.token_ids for c in engine.generate(ps, greedy())]
    assert got == reference(path, ps, MAX_TOKENS)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_prefix_cache_hits_match(family, model_factory, engine_factory, reference):
    path = model_factory(family)
    engine = engine_factory(path)
    shared = prompts(engine.vocab_size, [50], seed=2)[0]
    tails = prompts(engine.vocab_size, [5, 12, 1], seed=3)
    ps = [shared + t for t in tails] + [shared[:48]]  # the last is exactly 3 full blocks
    first = engine.generate([ps[0]], greedy())[0]
    assert first.num_cached_tokens == 0
    rest = engine.generate(ps, greedy())
    # 3 full blocks of the shared prefix come from the cache (the last prompt keeps its
    # final block to compute, since the step needs its logits)
    assert [c.num_cached_tokens for c in rest] == [48, 48, 48, 32]
    assert engine.blocks.hits > 0
    assert [c.token_ids for c in rest] == reference(path, ps, MAX_TOKENS)


def test_generated_blocks_are_reused_by_a_follow_up(model_factory, engine_factory, reference):
    """A multi-turn follow-up reuses the blocks that the first answer filled."""
    path = model_factory("llama")
    engine = engine_factory(path)
    p = prompts(engine.vocab_size, [20], seed=4)[0]
    first = engine.generate([p], greedy(40))[0]
    follow = p + first.token_ids + prompts(engine.vocab_size, [7], seed=5)[0]
    second = engine.generate([follow], greedy())[0]
    assert second.num_cached_tokens == (len(p) + 40 - 1) // 16 * 16
    assert second.token_ids == reference(path, [follow], MAX_TOKENS)[0]


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_preempted_and_resumed_match(family, model_factory, engine_factory, reference):
    path = model_factory(family)
    # 14 blocks of 16 = 224 token slots for four sequences that grow to 90-ish tokens each
    engine = engine_factory(path, num_kv_blocks=14, max_num_batched_tokens=64)
    ps = prompts(engine.vocab_size, [40, 35, 50, 28], seed=6)
    got = [c.token_ids for c in engine.generate(ps, greedy(48))]
    assert engine.scheduler.num_preemptions > 0
    assert got == reference(path, ps, 48)
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_stops_at_eos_like_transformers(model_factory, engine_factory, reference, tmp_path):
    """Random weights rarely pick the real EOS, so declare as EOS a token that greedy
    decoding reaches, in a copy of the model, and check both stop at it the same way."""
    import shutil

    src = model_factory("qwen2")
    ps = prompts(2048, [8, 30, 3], seed=7)
    free_run = reference(src, ps, MAX_TOKENS)
    eos = free_run[0][5]
    path = tmp_path / "eos-model"
    shutil.copytree(src, path)
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((path / name).read_text())
        cfg["eos_token_id"] = eos
        (path / name).write_text(json.dumps(cfg))
    ref = reference(path, ps, MAX_TOKENS, stop_at_eos=True)
    got = engine_factory(path).generate(ps, SamplingParams(max_tokens=MAX_TOKENS))
    assert [c.token_ids for c in got] == ref
    assert got[0].token_ids[-1] == eos and got[0].finish_reason == "stop"
    for c in got:
        assert c.finish_reason == ("stop" if eos in c.token_ids else "length")


def test_sharded_checkpoint_loads_the_same(model_factory, engine_factory, reference, tmp_path):
    single = model_factory("mistral")
    sharded = model_factory("mistral", max_shard_size="300KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    ps = prompts(2048, [12, 30], seed=8)
    a = [c.token_ids for c in engine_factory(single).generate(ps, greedy())]
    b = [c.token_ids for c in engine_factory(sharded).generate(ps, greedy())]
    assert a == b == reference(single, ps, MAX_TOKENS)


def test_text_prompt_and_chat_messages(model_factory, engine_factory, reference):
    path = model_factory("qwen3")
    engine = engine_factory(path)
    tok = engine.tokenizer
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Plai stou ten?"},
    ]
    ids = tok(
        tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    ).input_ids
    assert engine.tokenize(messages=msgs) == ids
    assert engine.tokenize(prompt="Hello there") == tok("Hello there").input_ids
    engine.add(AddRequest("chat", messages=msgs, params=greedy()))
    text_parts, tokens = [], []
    while engine.has_unfinished():
        for out in engine.step():
            text_parts.append(out.text_delta)
            tokens += out.new_token_ids
    assert tokens == reference(path, [ids], MAX_TOKENS)[0]
    # the streamed deltas add up to the decoded answer
    assert "".join(text_parts) == tok.decode(tokens, skip_special_tokens=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_matches_plain(dtype):
    torch.manual_seed(0)
    layer = Linear(96, 40, bias=True, dtype=dtype)
    x = torch.randn(5, 96, dtype=dtype)
    want = layer(x)
    packs = can_pack(torch.device("cpu"), dtype)
    # oneDNN packs fp32 on every x86 CPU, and bf16 where AVX-512 or AMX runs it; an AVX2
    # CPU may have no packed bf16 linear: the engine keeps F.linear there (nothing to pack)
    if dtype == torch.float32 or cpu_isa() in ("avx512", "avx512_bf16", "amx"):
        assert packs, f"no packed {dtype} linear on {cpu_isa()}"
    if packs:
        layer.pack(keep_weight=False)
        assert layer.weight.numel() == 0  # the plain copy is freed
    torch.testing.assert_close(layer(x), want, rtol=1e-2, atol=1e-2)


def test_kernel_path_follows_the_setting(model_factory, engine_factory):
    """`make test` runs this file twice: with the fused CPU kernels (the default where they
    build) and with PLURAI_KERNELS=torch; each run must really take its path."""
    import os
    import shutil

    engine = engine_factory(model_factory("llama"))
    model = engine.runner.model
    torch_path = (
        os.environ.get("PLURAI_KERNELS") == "torch"
        or shutil.which("c++") is None
        or engine.runner.device.type != "cpu"
    )
    if torch_path:
        assert engine.runner.ops is None
    else:
        assert engine.runner.ops is not None
    assert all(layer.mlp.ops is engine.runner.ops for layer in model.layers)
