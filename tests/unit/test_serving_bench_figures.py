"""The serving bench's foundation: its seeded workload (arrivals, sessions, shared prefixes,
lengths counted with the model's tokenizer, vLLM's replay formats) and its figures'
arithmetic on hand-computed inputs."""

from __future__ import annotations

import json
import math
import random
import statistics
import subprocess
import sys
from collections import defaultdict
from dataclasses import asdict
from itertools import pairwise
from pathlib import Path

import pytest

from bench.serving_figures import (
    Result,
    Slo,
    attainment,
    failures,
    goodput,
    latency,
    meets,
    percentile,
    prefill,
    results_from_vllm,
    saturated_rate,
    slos_from_idle,
    stack_figures,
)
from bench.serving_workload import (
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


# -- the figures -----------------------------------------------------------------------


def res(i: int, lane: str = INTERACTIVE, ttft: float = 0.1, e2e: float = 1.0, n: int = 11, **kw):
    """A request sent at 100 + i whose first token came after ttft and last after e2e."""
    sent = 100.0 + i
    fields = dict(
        id=f"r{i}",
        lane=lane,
        sent_s=sent,
        first_token_s=sent + ttft,
        end_s=sent + e2e,
        output_tokens=n,
        ok=True,
    )
    fields.update(kw)
    return Result(**fields)


def failed(i: int, lane: str = INTERACTIVE) -> Result:
    return res(i, lane, first_token_s=None, end_s=None, n=0, ok=False, error="engine died")


def test_percentile_linear_between_closest_ranks() -> None:
    assert percentile([4, 1, 3, 2], 50) == 2.5
    assert percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)  # rank 2.97
    assert percentile([1, 2, 3, 4], 0) == 1 and percentile([1, 2, 3, 4], 100) == 4
    assert percentile(range(1, 101), 99) == pytest.approx(99.01)
    assert percentile([5.0], 99) == 5.0 and math.isnan(percentile([], 50))


def test_per_request_times() -> None:
    r = res(0, ttft=0.5, e2e=2.5, n=5)
    assert (r.ttft, r.e2e, r.tpot) == (0.5, 2.5, 0.5)  # 2 s over the 4 tokens after the first
    assert res(0, n=1).tpot is None and failed(0).ttft is None


def test_latency_over_successful_requests() -> None:
    rs = [
        res(i, ttft=t, e2e=e, n=3)
        for i, (t, e) in enumerate([(0.1, 1.1), (0.2, 1.2), (0.3, 2.3), (0.4, 1.4)])
    ]
    rs.append(failed(9))
    got = latency(rs)
    assert got["ttft_p50_ms"] == 250.0 and got["ttft_p99_ms"] == pytest.approx(397.0)
    assert got["e2e_p50_ms"] == 1300.0  # 1.1 1.2 1.4 2.3
    assert got["tpot_p50_ms"] == 500.0  # (1.0 1.0 2.0 1.0) / 2 tokens
    assert latency([failed(0)])["ttft_p50_ms"] is None


def test_slo_attainment_counts_failed_and_lost_as_misses() -> None:
    slo = {INTERACTIVE: Slo(ttft_s=0.5, tpot_s=0.2), BATCH: Slo(e2e_s=10.0)}
    rs = [
        res(0, ttft=0.2, e2e=1.2, n=11),  # tpot 0.1: meets
        res(1, ttft=0.6, e2e=1.6, n=11),  # ttft over
        res(2, ttft=0.2, e2e=3.2, n=11),  # tpot 0.3 over
        res(3, ttft=0.2, e2e=0.2, n=1),  # one token: no tpot to miss
        failed(4),
        res(5, BATCH, ttft=5.0, e2e=9.0),  # batch has only an e2e target
        res(6, BATCH, ttft=1.0, e2e=11.0),
    ]
    assert [meets(r, slo[r.lane]) for r in rs] == [True, False, False, True, False, True, False]
    assert attainment(rs, slo) == pytest.approx(3 / 7)
    assert attainment(rs, slo, offered=10) == pytest.approx(3 / 10)
    assert failures(rs, [f"r{i}" for i in range(10)]) == {"failed": 1, "lost": 3}


def test_goodput_is_where_the_attainment_crosses_90_percent() -> None:
    slo = {INTERACTIVE: Slo(ttft_s=1.0)}

    def run(hits: int, misses: int = 0, fails: int = 0) -> list[Result]:
        rs = [res(i, ttft=0.5) for i in range(hits)]
        rs += [res(100 + i, ttft=2.0) for i in range(misses)]
        return rs + [failed(200 + i) for i in range(fails)]

    sweep = [(1.0, run(10)), (2.0, run(19, 1)), (3.0, run(9, 0, 1)), (4.0, run(8, 2))]
    assert goodput(sweep, slo) == 3.0  # 9 of 10 is exactly 90%
    sweep[2] = (3.0, run(8, 0, 2))  # two failures: 80%
    assert goodput(sweep, slo) == 2.3333  # 95% at 2/s, 80% at 3/s: 90% a third of the way
    assert goodput(sweep, slo, offered={2.0: 25}) == 1.4167  # 19 of 25 at 2/s: 76%
    assert goodput(sweep[:2], slo) == 2.0  # every rate made it: the highest
    assert goodput(list(reversed(sweep)), slo) == 2.3333  # in any order
    assert goodput([(1.0, run(1, 1))], slo) is None


def test_summary_pools_a_loads_repeats() -> None:
    from bench.serving import Run, summary

    slo = {INTERACTIVE: Slo(ttft_s=1.0)}

    def run(name: str, rate: float, hits: int, misses: int, lost: int = 0) -> Run:
        rs = [res(i, ttft=0.5) for i in range(hits)]
        rs += [res(100 + i, ttft=2.0) for i in range(misses)]
        ids = [r.id for r in rs] + [f"lost{i}" for i in range(lost)]
        return Run(name, rate, rs, dict.fromkeys(ids, INTERACTIVE), {})

    runs = [
        run("sweep@0.5", 1.0, 8, 2),  # 80% alone
        run("sweep@1.0", 2.0, 10, 0),
        run("sweep@0.5#1", 1.0, 10, 0),  # with its repeat: 18 of 20, 90%
        run("sweep@1.0#1", 2.0, 7, 2, lost=1),  # 17 of 20: 85%
    ]
    s = summary({"x": runs}, slo, slo)["x"]
    # each round's goodput (2/s met; 90% a third of the way from 1/s at 100% to 2/s at
    # 70%) and their median; each load's attainment over its rounds pooled
    assert s["goodput_req_s_rounds"] == [2.0, 1.3333]
    assert s["goodput_req_s"] == pytest.approx(1.6667, abs=1e-4)
    assert s["sweep_attainment"] == {"1.0": 0.9, "2.0": 0.85}
    assert set(s["runs"]) == {"sweep@0.5", "sweep@1.0", "sweep@0.5#1", "sweep@1.0#1"}


def test_prefill_and_stack_figures() -> None:
    slo = {INTERACTIVE: Slo(ttft_s=0.5), BATCH: Slo(e2e_s=5.0)}
    rs = [
        res(0, ttft=0.1, e2e=1.0, n=10, prompt_tokens=600, cached_tokens=512),
        res(1, ttft=0.3, e2e=2.0, n=10, prompt_tokens=700, cached_tokens=0),
        res(2, BATCH, ttft=1.0, e2e=4.0, n=20, prompt_tokens=1500, cached_tokens=32),
        failed(3, BATCH),
    ]
    assert prefill(rs[:2]) == {
        "prompt_tokens": 1300,
        "cached_tokens": 512,
        "computed_tokens": 788,
        "cached_share": round(512 / 1300, 4),
    }
    lanes = {f"r{i}": INTERACTIVE for i in range(2)} | {"r2": BATCH, "r3": BATCH, "r4": BATCH}
    figs = stack_figures(rs, slo, expected=lanes)
    assert list(figs) == [INTERACTIVE, BATCH, "all"]
    assert figs[INTERACTIVE]["slo_attainment"] == 1.0 and figs[INTERACTIVE]["lost"] == 0
    assert figs[BATCH].items() >= {"requests": 3, "failed": 1, "lost": 1}.items()
    assert figs[BATCH]["slo_attainment"] == round(1 / 3, 4)
    assert figs["all"]["requests"] == 5 and figs["all"]["slo_attainment"] == 0.6
    assert figs["all"]["computed_tokens"] == 2800 - 544
    # 3 completed, 40 tokens, from the first send (100) to the last end (102 + 4)
    assert figs["all"]["req_s"] == 0.5 and figs["all"]["output_tok_s"] == round(40 / 6, 3)


def test_slos_from_idle() -> None:
    idle = [res(i, ttft=t, e2e=t + 1.0, n=11) for i, t in enumerate([0.1, 0.2, 0.3])]
    idle.append(res(5, BATCH, ttft=0.4, e2e=2.4, n=11))
    slo = slos_from_idle(idle, ttft_factor=5, tpot_factor=2)
    assert slo[INTERACTIVE].ttft_s == pytest.approx(1.0) and slo[
        INTERACTIVE
    ].tpot_s == pytest.approx(0.2)
    assert slo[BATCH].ttft_s == pytest.approx(2.0) and slo[BATCH].tpot_s == pytest.approx(0.4)


def test_results_from_vllm_saved_json() -> None:
    saved = {
        "start_times": [10.0, 11.0],
        "ttfts": [0.2, 0.0],
        "latencies": [1.2, 0.0],
        "output_lens": [6, 0],
        "input_lens": [600, 700],
        "errors": ["", "HTTP 500"],
    }
    a, b = results_from_vllm(saved, ["r0", "r1"], [INTERACTIVE, BATCH])
    assert (a.ok, a.prompt_tokens, a.output_tokens) == (True, 600, 6)
    assert (a.ttft, a.e2e, a.tpot) == pytest.approx((0.2, 1.2, 0.2))
    assert (b.ok, b.lane, b.error, b.end_s) == (False, BATCH, "HTTP 500", None)


# -- bench/serving.py's own arithmetic --------------------------------------------------


def _done(i: int, end: float) -> Result:
    return Result(f"r{i}", INTERACTIVE, end - 1.0, end - 0.5, end, 8, True)


def test_recovery_after_a_kill() -> None:
    from bench.serving import recovery_s

    # 2 completions/s for 10 s, nothing for 4 s after the kill at 10 s, then 2/s again
    ends = [0.25 + 0.5 * i for i in range(20)] + [14.25 + 0.5 * i for i in range(20)]
    results = [_done(i, e) for i, e in enumerate(ends)]
    got = recovery_s(results, at=10.0)
    assert got == 4.25  # the first completion after the gap
    # a stack that never serves again does not recover
    assert recovery_s(results[:20], at=10.0) is None
    # one that never slowed down: recovered at once
    steady = [_done(i, 0.25 + 0.5 * i) for i in range(60)]
    assert recovery_s(steady, at=10.0) == 0.25


def test_ratios_against_the_best_router_on_each_figure() -> None:
    from bench.serving import ratios

    stacks = {
        "plurai-vllm": {
            "goodput_req_s": 1.3,
            "flood_interactive_ttft_p99_s": 0.5,
            "prefill_computed_tokens": 900,
            "kill_failed": 0,
            "kill_lost": 0,
            "add_ready_to_load_s": 0.4,
        },
        "round_robin": {
            "goodput_req_s": 0.65,
            "flood_interactive_ttft_p99_s": 2.0,
            "prefill_computed_tokens": 1500,
            "kill_failed": 3,
            "kill_lost": 0,
            "add_ready_to_load_s": 1.0,
        },
        "cache_aware": {
            "goodput_req_s": 1.0,
            "flood_interactive_ttft_p99_s": 1.0,
            "prefill_computed_tokens": 1000,
            "kill_failed": 2,
            "kill_lost": 1,
            "add_ready_to_load_s": 1.2,
        },
    }
    # a Plurai stack of another variant is no router, and has its own ratios
    stacks["plurai-vllm-notier"] = {"goodput_req_s": 2.0, "prefill_computed_tokens": 500}
    r = ratios(stacks)
    assert r["goodput_req_s"] == {"ratio": 1.3, "best_router": "cache_aware", "target": ">= 1.3"}
    assert ratios(stacks, "plurai-vllm-notier")["goodput_req_s"]["ratio"] == 2.0
    assert r["flood_interactive_ttft_p99_s"]["ratio"] == 0.5
    assert r["flood_interactive_ttft_p99_s"]["best_router"] == "cache_aware"
    assert r["prefill_computed_tokens"]["ratio"] == 0.9
    assert r["kill_failed_or_lost"]["plurai"] == 0
    assert r["kill_failed_or_lost"]["cache_aware"] == 3
    assert r["add_ready_to_load_s"]["round_robin"] == 1.0
    # a router with no goodput at all (no rate met the SLOs) is no best
    stacks["cache_aware"]["goodput_req_s"] = None
    assert ratios(stacks)["goodput_req_s"]["best_router"] == "round_robin"
    # with rounds: each round against that round's best router, the median and spread
    stacks["plurai-vllm"]["trace_goodput_req_s"] = 3.0
    stacks["plurai-vllm"]["trace_goodput_req_s_rounds"] = [3.0, 2.0, None]
    stacks["round_robin"]["trace_goodput_req_s"] = 2.0
    stacks["round_robin"]["trace_goodput_req_s_rounds"] = [2.0, 1.0, 1.0]
    stacks["cache_aware"]["trace_goodput_req_s_rounds"] = [1.0, 2.0, None]
    t = ratios(stacks)["trace_goodput_req_s"]
    assert t["rounds"] == [1.5, 1.0, 0.0] and t["spread"] == [0.0, 1.5]
    assert t["ratio"] == 1.0


def test_cpu_used_counts_the_processes_alive_at_the_end() -> None:
    from bench.serving import cpu_used

    before = {"engines": {1: 10.0, 2: 20.0}, "front": {3: 1.0}}
    after = {"engines": {2: 26.5, 4: 3.0}, "front": {3: 1.5}, "redis": {}}
    # engine 1 was killed (its time went with it), engine 4 started in between
    assert cpu_used(before, after) == {"engines": 9.5, "front": 0.5, "redis": 0}


def test_the_saturated_rate_leaves_out_the_drain_tail() -> None:
    # eight completions a second for 1.5 s, then the last few alone, slowly
    ends = [0.125 * i for i in range(1, 13)] + [3.0, 5.0, 8.0, 12.0]
    assert saturated_rate(ends) == pytest.approx(12 / 1.5)
    assert saturated_rate([2.0]) == pytest.approx(0.5)
    assert saturated_rate([]) == 0.0


def test_the_slowest_interactive_first_tokens_split_into_queue_and_engine() -> None:
    from bench.serving import slowest_share

    def res(i: int, ttft: float, lane: str = "interactive") -> Result:
        return Result(f"r{i}", lane, 0.0, ttft, ttft + 1.0, 8, True)

    # 40 interactive requests: the two slowest (5%) waited 3 of 4 s and 1 of 5 s queued,
    # then 0.5 s and 3 s to the worker's first token; the second's intake is not known
    results = [res(i, 0.1) for i in range(38)] + [res(38, 4.0), res(39, 5.0), res(40, 9.0, "batch")]
    times = {f"r{i}": {"intake_ms": 1, "queue_ms": 10, "engine_ms": 50} for i in range(38)}
    times["r38"] = {"intake_ms": 200, "queue_ms": 3000, "engine_ms": 500}
    times["r39"] = {"intake_ms": None, "queue_ms": 1000, "engine_ms": 3000}
    times["r40"] = {"intake_ms": 0, "queue_ms": 9000, "engine_ms": None}
    got = slowest_share(results, times)
    assert got == {
        "n": 2,
        "ttft_ms": 4500.0,
        "intake_share": 0.05,
        "queue_share": pytest.approx(0.475),
        "engine_share": pytest.approx((0.125 + 0.6) / 2, abs=1e-3),
    }
    assert slowest_share([res(0, 0.2, "batch")], {"r0": {"queue_ms": 5}}) == {"n": 0}


def test_bound_peers_run_wholly_on_their_engines_core(tmp_path: Path) -> None:
    import shutil

    from bench.serving import EngineSpec, RouterStack

    if shutil.which("taskset") is None:
        pytest.skip("taskset is not installed")
    spec = EngineSpec(model=tmp_path, name="m", dtype="bfloat16", max_model_len=768)
    cmd, env = RouterStack("round_robin", spec, 2, tmp_path).engine_cmd(1, 8000)
    assert "taskset" not in cmd and env["VLLM_CPU_OMP_THREADS_BIND"] == str(spec.core(1))
    bound = EngineSpec(
        model=tmp_path, name="m", dtype="bfloat16", max_model_len=768, bind_peers=True
    )
    cmd, _ = RouterStack("round_robin", bound, 2, tmp_path).engine_cmd(1, 8000)
    assert cmd[:3] == ["taskset", "-c", str(bound.core(1))] and "serve" in cmd


def test_a_plurai_stack_gives_its_workers_the_operators_targets(tmp_path: Path) -> None:
    from bench.serving import EngineSpec, PluraiStack

    spec = EngineSpec(model=tmp_path, name="m", dtype="bfloat16", max_model_len=768)
    stack = PluraiStack("vllm", spec, 2, tmp_path)
    _, env = stack.engine_cmd(0)
    assert "PLURAI_TOP_LANE_TPOT_MS" not in env and "PLURAI_TOP_LANE_WAIT_MS" not in env
    stack.tpot_ms, stack.wait_ms = 24.4, 105.2
    _, env = stack.engine_cmd(0)
    assert env["PLURAI_TOP_LANE_TPOT_MS"] == "24" and env["PLURAI_TOP_LANE_WAIT_MS"] == "105"


def test_a_results_file_line_with_the_stacks_record_reads_back() -> None:
    # bench/serving.py writes each result with what the job's record says beside it
    row = {
        **asdict(Result("r1", "batch", 1.0, 1.5, 3.0, 8, True, None, 200, 128)),
        "job": "abc",
        "created_ms": 5,
        "queue_ms": 10,
        "engine_ms": None,
        "intake_ms": 2,
    }
    got = Result.from_row(json.loads(json.dumps(row)))
    assert got == Result("r1", "batch", 1.0, 1.5, 3.0, 8, True, None, 200, 128)
    assert got.ttft == pytest.approx(0.5)


def test_the_trace_is_judged_by_its_own_slos() -> None:
    """The trace's prompts are of other lengths than the mixed workload's: its runs are
    scored by the SLOs of its own idle requests, the sweep's by the mixed ones'."""
    from bench.serving import Run, summary

    mixed, trace = {INTERACTIVE: Slo(ttft_s=1.0)}, {INTERACTIVE: Slo(ttft_s=3.0)}
    rs = [res(i, ttft=2.0) for i in range(10)]
    runs = [
        Run(n, 1.0, rs, dict.fromkeys([r.id for r in rs], INTERACTIVE), {})
        for n in ("sweep@1.0", "trace@1.0")
    ]
    s = summary({"x": runs}, mixed, trace)["x"]
    assert s["sweep_attainment"] == {"1.0": 0.0} and s["goodput_req_s"] is None
    assert s["trace_attainment"] == {"1.0": 1.0} and s["trace_goodput_req_s"] == 1.0
    assert s["runs"]["trace@1.0"]["all"]["slo_attainment"] == 1.0
    assert s["runs"]["sweep@1.0"]["all"]["slo_attainment"] == 0.0


def test_a_bench_scripts_folder_shadows_nothing_transformers_imports() -> None:
    # `python bench/serving.py` puts bench/ first on sys.path: a file there named like a
    # package transformers probes for (bench/kernels.py against `kernels`) broke making the
    # bench model on a fresh clone
    bench = Path(__file__).resolve().parents[2] / "bench"
    code = "import transformers; from transformers import LlamaConfig, Qwen3Config"
    run = subprocess.run([sys.executable, "-c", code], cwd=bench, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]


def test_a_later_run_takes_an_earlier_runs_slos(tmp_path: Path) -> None:
    from bench.serving import slos_from

    slos = {
        "interactive": {"ttft_s": 0.5, "tpot_s": 0.08, "e2e_s": None},
        "batch": {"ttft_s": None, "tpot_s": None, "e2e_s": 6.2},
    }
    out = tmp_path / "out.json"
    out.write_text("progress\n" + json.dumps({"slos": slos, "stacks": {}}) + "\n")
    got, trace = slos_from(str(out))
    assert got["interactive"] == Slo(ttft_s=0.5, tpot_s=0.08)
    assert got["batch"] == Slo(e2e_s=6.2)
    assert trace is None
    # and the trace's own, where that run replayed it
    trace_slos = {"interactive": {"ttft_s": 1.5, "tpot_s": 0.06, "e2e_s": None}}
    out.write_text(json.dumps({"slos": slos, "trace_slos": trace_slos}) + "\n")
    assert slos_from(str(out))[1] == {"interactive": Slo(ttft_s=1.5, tpot_s=0.06)}
    out.write_text('{"stacks": {}}\n')  # a run that did not finish
    with pytest.raises(SystemExit, match="no SLOs of a finished run"):
        slos_from(str(out))


def test_each_round_of_the_sweep_runs_every_stack_in_turn() -> None:
    from bench.serving import rounds

    stacks = ["round_robin", "cache_aware", "plurai-vllm"]
    # a slow stretch of the machine lands on every stack's rounds, not on the last stack's
    assert rounds(stacks, ["idle", "sweep"], 2) == [
        (0, "round_robin"),
        (0, "cache_aware"),
        (0, "plurai-vllm"),
        (1, "round_robin"),
        (1, "cache_aware"),
        (1, "plurai-vllm"),
    ]
    # without a sweep there is nothing to go round again
    assert rounds(stacks, ["idle", "flood", "kill"], 3) == [(0, s) for s in stacks]
    assert rounds(stacks[:1], ["sweep"], 0) == [(0, "round_robin")]
