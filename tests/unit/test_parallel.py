"""Tensor and pipeline parallelism over processes (gloo on CPU): same tokens as one rank
and as transformers; a dead rank stops the engine."""

from __future__ import annotations

import random
import time

import pytest

from plurai.gpu_workers.backend import AddRequest
from plurai.gpu_workers.engine.parallel import decode_step, encode_step
from plurai.gpu_workers.engine.placement import split_layers
from plurai.gpu_workers.engine.sampling_params import SamplingParams
from plurai.gpu_workers.engine.sequence import Sequence


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(16, 2000) for _ in range(n)] for n in (3, 40, 100, 17)]


def test_step_encoding_round_trip():
    a = Sequence("a", list(range(10, 40)), SamplingParams())
    a.num_computed_tokens, a.num_scheduled, a.block_table = 16, 14, [3, 7]
    b = Sequence("b", [5, 6, 7], SamplingParams())
    b.num_computed_tokens, b.num_scheduled, b.block_table = 2, 1, [9]
    got = decode_step(encode_step([a, b]).tolist())
    for want, have in zip([a, b], got, strict=True):
        assert len(have) == len(want)
        assert have.num_computed_tokens == want.num_computed_tokens
        assert have.num_scheduled == want.num_scheduled
        assert have.block_table == want.block_table
        s, e = want.num_computed_tokens, want.num_computed_tokens + want.num_scheduled
        assert have.token_ids[s:e] == want.token_ids[s:e]


def test_layer_split():
    assert split_layers(5, 2) == [(0, 3), (3, 5)]
    assert split_layers(12, 3, [2, 4, 6]) == [(0, 2), (2, 6), (6, 12)]
    with pytest.raises(ValueError):
        split_layers(4, 2, [4, 0])


# the tiny models have 4 heads, 2 KV heads and 2 layers: TP4 replicates each KV head on two
# ranks; qwen2 ties its embeddings, so with PP its last stage loads lm_head from them
@pytest.mark.parametrize(
    ("family", "tp", "pp"),
    [("llama", 2, 1), ("qwen2", 2, 1), ("qwen3", 4, 1), ("mistral", 1, 2), ("qwen2", 2, 2)],
)
def test_parallel_groups_match_transformers(
    family, tp, pp, model_factory, engine_factory, reference
):
    path = model_factory(family)
    assert group_greedy(engine_factory, path, tp, pp) == reference(path, prompts(), 16)


def group_greedy(engine_factory, path, tp: int, pp: int) -> list[list[int]]:
    """16 greedy tokens for each of prompts() from a tp x pp group, closed after."""
    engine = engine_factory(
        path, tensor_parallel=tp, pipeline_parallel=pp, max_num_batched_tokens=32
    )
    try:
        params = SamplingParams(max_tokens=16, ignore_eos=True)
        return [c.token_ids for c in engine.generate(prompts(), params)]
    finally:
        engine.close()


def test_a_dead_rank_stops_the_engine(model_factory, engine_factory):
    engine = engine_factory(model_factory("llama"), tensor_parallel=2)
    try:
        engine.add(
            AddRequest(
                "r", token_ids=[20, 21, 22], params=SamplingParams(max_tokens=50, ignore_eos=True)
            )
        )
        engine.step()
        rank1 = engine.group.procs[0]
        rank1.kill()
        rank1.wait()
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="rank 1"):
            for _ in range(50):
                engine.step()
        assert time.monotonic() - start < 30
    finally:
        engine.close()


def test_a_pipeline_group_never_takes_blocks_from_the_kv_tiers(model_factory, engine_factory):
    """A prompt evicted from a small device cache (to the host tier of a single-rank
    engine) and run again: in a PP2 group, rank 0's block holds only stage 0's layers, so
    the group must recompute it, and give the same tokens both times."""
    rng = random.Random(1)
    a, b = ([rng.randrange(16, 2000) for _ in range(n)] for n in (100, 140))
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    engine = engine_factory(
        model_factory("llama"),
        pipeline_parallel=2,
        num_kv_blocks=10,
        kv_host_bytes=1 << 30,
        max_num_batched_tokens=256,
    )
    try:
        first = engine.generate([a], params)[0].token_ids
        engine.generate([b], params)  # evicts a's blocks
        again = engine.generate([a], params)[0].token_ids
    finally:
        engine.close()
    assert again == first


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (2, 2)])
def test_a_quantized_checkpoint_splits_over_ranks(
    tp, pp, model_factory, engine_factory, reference, tmp_path
):
    """GPTQ int4 with zero points, groups of 32: row-parallel layers split on whole groups;
    every rank's share computes what the dequantized weights compute."""
    from tests.quant_checkpoints import write

    quantized = tmp_path / "gptq"
    dequantized = write(model_factory("qwen2"), quantized, "gptq", bits=4, group=32, sym=False)
    got = group_greedy(engine_factory, quantized, tp, pp)
    assert got == reference(dequantized, prompts(), 16)
