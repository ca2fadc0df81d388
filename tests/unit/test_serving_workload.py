"""The serving bench's seeded workload (bench/serving/workload.py): arrivals, sessions,
shared prefixes, lengths counted with the model's tokenizer, vLLM's replay formats."""

from __future__ import annotations

import json
import math
import random
import statistics
from collections import defaultdict
from itertools import pairwise
from pathlib import Path

import pytest

from bench.serving.workload import (
    BATCH,
    INTERACTIVE,
    ServingRequest,
    Tokens,
    WorkloadConfig,
    arrival_times,
    block_hash_ids,
    flatten,
    flood_scenario,
    generate,
    read_jsonl,
    write_jsonl,
    write_vllm_custom,
    write_vllm_trace,
)

# -- the workload --------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokens(tiny_model: Path) -> Tokens:
    return Tokens(tiny_model)


@pytest.fixture(scope="module")
def mixed(tokens: Tokens) -> list[ServingRequest]:
    return generate(WorkloadConfig(seed=3, rate=4.0, duration_s=40.0), tokens)


def test_same_seed_same_file_other_seed_differs(tokens: Tokens, tmp_path: Path) -> None:
    cfg = dict(rate=3.0, duration_s=10.0, flood_requests=5, flood_at_s=4.0)
    paths = []
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        paths.append(tmp_path / f"{name}.jsonl")
        write_jsonl(paths[-1], generate(WorkloadConfig(seed=seed, **cfg), tokens))
    a, b, c = (p.read_bytes() for p in paths)
    assert a == b and a != c
    assert read_jsonl(paths[0]) == generate(WorkloadConfig(seed=7, **cfg), tokens)


def test_arrivals_mean_rate_and_burstiness() -> None:
    cvs = {}
    for b in (0.3, 1.0, 4.0):
        times = arrival_times(random.Random(11), rate=20.0, burstiness=b, duration_s=1000.0)
        gaps = [t1 - t0 for t0, t1 in zip([0.0, *times[:-1]], times, strict=True)]
        assert statistics.fmean(gaps) == pytest.approx(1 / 20, rel=0.04)
        assert len(times) / 1000.0 == pytest.approx(20.0, rel=0.04)
        cvs[b] = statistics.pstdev(gaps) / statistics.fmean(gaps)
        # gamma of shape b: squared coefficient of variation 1 / b
        assert cvs[b] ** 2 == pytest.approx(1 / b, rel=0.12)
    assert cvs[0.3] > cvs[1.0] > cvs[4.0]
    assert all(0 <= t < 1000.0 for t in times) and times == sorted(times)


def test_scale_compresses_the_same_requests(tokens: Tokens) -> None:
    slow = generate(WorkloadConfig(seed=5, rate=2.0, duration_s=20.0), tokens)
    fast = generate(WorkloadConfig(seed=5, rate=2.0, scale=2.0, duration_s=20.0), tokens)
    assert len(fast) > len(slow) * 1.5
    for s, f in zip(slow, fast[: len(slow)], strict=True):
        assert f.messages == s.messages and f.max_tokens == s.max_tokens
        assert f.arrival_s == pytest.approx(s.arrival_s / 2, abs=2e-6)


def test_mix_of_kinds_and_lanes(mixed: list[ServingRequest]) -> None:
    kinds = {r.kind for r in mixed}
    assert kinds == {"chat", "session", "extract"}
    assert all((r.lane == BATCH) == (r.kind == "extract") for r in mixed)
    assert [r.id for r in mixed] == [f"r{i:05d}" for i in range(len(mixed))]
    assert [r.arrival_s for r in mixed] == sorted(r.arrival_s for r in mixed)


def test_sessions_grow_turn_by_turn_and_share_bytes(
    mixed: list[ServingRequest], tokens: Tokens
) -> None:
    by_session: dict[str, list[ServingRequest]] = defaultdict(list)
    for r in mixed:
        assert (r.session is None) == (r.turn is None) == (r.kind != "session")
        if r.session:
            by_session[r.session].append(r)
    multi = [turns for turns in by_session.values() if len(turns) >= 3]
    assert len(multi) >= 2
    for turns in by_session.values():
        assert [t.turn for t in turns] == list(range(1, len(turns) + 1))
        assert len({t.group for t in turns}) == 1
        for prev, nxt in pairwise(turns):
            assert nxt.arrival_s >= prev.arrival_s
            # the whole conversation so far, then a stand-in answer and a new question
            assert nxt.messages[: len(prev.messages)] == prev.messages
            assert [m["role"] for m in nxt.messages[len(prev.messages) :]] == ["assistant", "user"]
            assert flatten(nxt.messages).startswith(flatten(prev.messages))
            assert nxt.prompt_tokens > prev.prompt_tokens
            # and the engine's tokens of the longer prompt start with the shorter one's
            ids = tokens.ids(nxt.messages)
            assert ids[: prev.prompt_tokens] == tokens.ids(prev.messages)


def test_prefix_groups_share_their_system_prompt(
    mixed: list[ServingRequest], tokens: Tokens
) -> None:
    systems: dict[str, set[str]] = defaultdict(set)
    for r in mixed:
        assert r.messages[0]["role"] == "system"
        systems[r.group].add(r.messages[0]["content"])
    interactive = {g for g in systems if g.startswith("sys")}
    assert len(interactive) == 4 and "extract" in systems
    assert all(len(texts) == 1 for texts in systems.values())
    prompts = [next(iter(systems[g])) for g in sorted(interactive)]
    assert len(set(prompts)) == 4
    cfg = WorkloadConfig()
    for text in prompts:  # long: a quarter of the prompt budget
        assert abs(tokens.text(text) - cfg.system_tokens) <= 16
    counts = defaultdict(int)
    for r in mixed:
        counts[r.group] += 1
    assert min(counts[g] for g in interactive) >= 3


@pytest.mark.parametrize(
    "bounds", [dict(), dict(min_prompt=64, max_prompt=512, min_output=4, max_output=24)]
)
def test_lengths_within_bounds_by_the_tokenizer(tokens: Tokens, bounds: dict) -> None:
    cfg = WorkloadConfig(seed=2, rate=4.0, duration_s=25.0, batch_share=0.3, **bounds)
    reqs = generate(cfg, tokens)
    assert len(reqs) > 60
    tok = tokens.tokenizer
    for r in reqs:
        text = tok.apply_chat_template(r.messages, tokenize=False, add_generation_prompt=True)
        assert r.prompt_tokens == len(tok(text, add_special_tokens=False).input_ids)
        assert cfg.min_prompt <= r.prompt_tokens <= cfg.max_prompt
        assert cfg.min_output <= r.max_tokens <= cfg.max_output
        if r.lane == BATCH:  # long input, short output
            assert r.prompt_tokens >= cfg.max_prompt // 2 - 8
            assert r.max_tokens <= 2 * cfg.min_output
    extract = [r.prompt_tokens for r in reqs if r.kind == "extract"]
    assert max(extract) > 0.8 * cfg.max_prompt


def test_flood_on_top_of_steady_interactive_traffic(tokens: Tokens) -> None:
    cfg = flood_scenario(seed=4, rate=2.0, duration_s=30.0, flood_requests=40)
    reqs = generate(cfg, tokens)
    batch = [r for r in reqs if r.lane == BATCH]
    assert len(batch) == 40 and cfg.flood_at_s == 10.0
    assert all(10.0 <= r.arrival_s <= 12.0 for r in batch)
    steady = [r for r in reqs if r.lane == INTERACTIVE]
    alone = generate(WorkloadConfig(seed=4, rate=2.0, duration_s=30.0, batch_share=0.0), tokens)
    assert [(r.arrival_s, r.messages) for r in steady] == [(r.arrival_s, r.messages) for r in alone]


def test_vllm_custom_dataset(mixed: list[ServingRequest], tmp_path: Path) -> None:
    args = write_vllm_custom(tmp_path / "custom.jsonl", mixed)
    rows = [json.loads(line) for line in (tmp_path / "custom.jsonl").read_text().splitlines()]
    assert rows == [{"prompt": flatten(r.messages), "output_tokens": r.max_tokens} for r in mixed]
    assert args[args.index("--num-prompts") + 1] == str(len(mixed))
    assert {"--disable-shuffle", "--skip-chat-template"} <= set(args)


def test_block_hash_ids() -> None:
    a = list(range(40))
    b = list(range(32)) + [99] * 8
    c = [7] + list(range(1, 40))
    ha, hb, hc = block_hash_ids([a, b, c], block=16)
    assert len(ha) == 3 and ha[:2] == hb[:2] and ha[2] != hb[2]
    assert not set(hc) & set(ha)  # the first block differs, so every block does


def test_vllm_timed_trace(mixed: list[ServingRequest], tokens: Tokens, tmp_path: Path) -> None:
    args = write_vllm_trace(tmp_path / "trace.jsonl", mixed, tokens)
    rows = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    assert [(x["timestamp"], x["input_length"], x["output_length"]) for x in rows] == [
        (r.arrival_s, r.prompt_tokens, r.max_tokens) for r in mixed
    ]
    assert all(len(x["hash_ids"]) == math.ceil(x["input_length"] / 16) for x in rows)
    first = defaultdict(set)
    for r, x in zip(mixed, rows, strict=True):
        if r.kind != "extract":
            first[r.group].add(tuple(x["hash_ids"][:8]))  # 128 tokens of the system prompt
    assert len(first) == 4 and all(len(v) == 1 for v in first.values())
    assert len({h for v in first.values() for h in v}) == 4
    assert "timed_trace" in args and "--timed-trace-chunk-hash-size" in args


def test_config_refuses_impossible_bounds(tokens: Tokens) -> None:
    with pytest.raises(ValueError):
        generate(WorkloadConfig(min_prompt=600, max_prompt=1000), tokens)
    with pytest.raises(ValueError):
        generate(WorkloadConfig(burstiness=0.0), tokens)
    with pytest.raises(ValueError):
        generate(WorkloadConfig(min_prompt=32, max_prompt=200), tokens)
