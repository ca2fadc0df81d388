"""The serving bench's trace replay (bench/trace_replay.py): Mooncake-format entries to
requests whose shared blocks are equal token for token, scaled down, timed to a rate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.trace_replay import TraceEntry, block_tokens, read_trace, replay

VOCAB = 2048


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def entry(t: float, n_in: int, n_out: int, ids: list[int]) -> TraceEntry:
    return TraceEntry(t, n_in, n_out, ids)


def test_equal_hash_ids_give_equal_token_blocks() -> None:
    a, b, c = replay(
        [entry(0, 1536, 10, [0, 1, 2]), entry(5, 1536, 10, [0, 1, 7]), entry(9, 600, 10, [4, 1])],
        VOCAB,
        scale=1 / 16,
        rate=1.0,
    )
    block = 32
    blocks = [
        [r.prompt_ids[i : i + block] for i in range(0, len(r.prompt_ids), block)] for r in (a, b, c)
    ]
    assert blocks[0][:2] == blocks[1][:2]  # the shared prefix
    assert blocks[0][2] != blocks[1][2]
    # block 1 is the same tokens at another place, after another first block
    assert blocks[2][1] == blocks[0][1][: len(blocks[2][1])] and blocks[2][0] != blocks[0][0]
    assert all(3 <= t < VOCAB for r in (a, b, c) for t in r.prompt_ids)  # no special token
    # another seed, other tokens; the same seed, the same
    assert block_tokens(1, block, VOCAB, seed=1) != block_tokens(1, block, VOCAB, seed=0)
    assert block_tokens(1, block, VOCAB, seed=0) == blocks[0][1]


def test_lengths_scale_down_within_the_blocks() -> None:
    (r, short, capped) = replay(
        [entry(0, 6758, 500, list(range(14))), entry(1, 20, 3, [99]), entry(2, 5000, 0, [5, 6])],
        VOCAB,
        scale=1 / 16,
        rate=1.0,
    )
    assert len(r.prompt_ids) == round(6758 / 16) and r.max_tokens == round(500 / 16)
    assert len(short.prompt_ids) == 1 and short.max_tokens == 1  # never empty
    assert len(capped.prompt_ids) == 2 * 32  # no more than its blocks hold
    assert capped.max_tokens == 1
    (whole,) = replay([entry(0, 700, 40, [1, 2])], VOCAB, scale=1.0, rate=1.0)
    assert len(whole.prompt_ids) == 700 and whole.prompt_ids[:512] == block_tokens(1, 512, VOCAB, 0)


def test_arrivals_keep_the_pattern_at_the_offered_rate() -> None:
    stamps = [0, 0, 100, 3000, 3100, 9000]  # a burst, a lull, another burst
    reqs = replay([entry(t, 10, 1, [0]) for t in stamps], VOCAB, scale=1 / 16, rate=2.0)
    times = [r.arrival_s for r in reqs]
    assert times[-1] == pytest.approx((len(stamps) - 1) / 2.0)  # 2 requests/s over the run
    ratio = times[-1] / 9.0
    assert times == pytest.approx([t / 1000 * ratio for t in stamps])
    same = replay([entry(7, 10, 1, [0])] * 3, VOCAB, scale=1 / 16, rate=2.0)
    assert [r.arrival_s for r in same] == [0.0, 0.0, 0.0]


def test_read_trace_sorts_and_names_a_bad_line(tmp_path: Path) -> None:
    good = write(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 30, "input_length": 9, "output_length": 2, "hash_ids": [1]},
            {"timestamp": 10, "input_length": 700, "output_length": 5, "hash_ids": [0, 1]},
        ],
    )
    got = read_trace(good)
    assert [e.timestamp_ms for e in got] == [10, 30] and got[0].hash_ids == [0, 1]
    assert len(read_trace(good, limit=1)) == 1
    # a window past the first entries, in the file's order
    assert [e.timestamp_ms for e in read_trace(good, limit=1, skip=1)] == [10]
    bad = write(tmp_path / "b.jsonl", [{"timestamp": 0, "input_length": 9, "hash_ids": [1]}])
    with pytest.raises(ValueError, match="b.jsonl:1: not a trace entry"):
        read_trace(bad)
    empty = write(
        tmp_path / "e.jsonl",
        [{"timestamp": 0, "input_length": 9, "output_length": 1, "hash_ids": []}],
    )
    with pytest.raises(ValueError, match="e.jsonl:1: empty prompt"):
        read_trace(empty)
