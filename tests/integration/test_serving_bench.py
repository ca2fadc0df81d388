"""bench/serving/'s client and Plurai stack, end to end on the tiny model: every request
of a seeded two-lane workload, replayed open-loop through the gateway's OpenAI API as the
bench sends it to every stack, completes with the tokens it asked for and its usage."""

from __future__ import annotations

import asyncio
from pathlib import Path

from bench.serving.client import replay
from bench.serving.figures import Slo, stack_figures
from bench.serving.stacks import EngineSpec, PluraiStack
from bench.serving.workload import BATCH, INTERACTIVE, Tokens, WorkloadConfig, generate
from plurai.broker_config import keys


def test_the_bench_replays_a_workload_through_a_plurai_stack(tiny_model: Path, tmp_path: Path):
    spec = EngineSpec(tiny_model, tiny_model.name, "float32", max_model_len=512)
    stack = PluraiStack("native", spec, 1, tmp_path)
    stack.start()
    try:
        cfg = WorkloadConfig(
            seed=3, duration_s=3.0, rate=4.0, batch_share=0.3, min_prompt=32,
            max_prompt=256, min_output=4, max_output=8, prefix_groups=2,
        )  # fmt: skip
        reqs = generate(cfg, Tokens(tiny_model))
        assert {r.lane for r in reqs} == {INTERACTIVE, BATCH}
        results, _, unsent = asyncio.run(replay(stack, reqs, 120))
        assert not unsent
        by_id = {r.id: r for r in results}
        assert set(by_id) == {r.id for r in reqs}
        for req in reqs:
            got = by_id[req.id]
            assert got.ok, got.error
            assert got.lane == req.lane
            assert got.output_tokens == req.max_tokens  # ignore_eos: the lengths asked for
            assert got.prompt_tokens == req.prompt_tokens  # the bench counts as the engine
            assert got.first_token_s is not None and got.sent_s <= got.first_token_s
            assert got.end_s is not None and got.first_token_s <= got.end_s
        slos = {INTERACTIVE: Slo(), BATCH: Slo()}
        figures = stack_figures(results, slos, {r.id: r.lane for r in reqs})
        assert figures["all"]["failed"] == figures["all"]["lost"] == 0
        # requests on a shared system prompt were served partly from a cache
        assert figures["interactive"]["cached_tokens"] > 0
        assert sum(stack.cpu()["engines"].values()) > 0
        assert jobs(stack)
    finally:
        stack.stop()
    # the stack restarted, as for the bench's next round: an empty queue, not the last one's
    again = PluraiStack("native", spec, 1, tmp_path)
    again.start()
    try:
        assert not jobs(again)
    finally:
        again.stop()


def jobs(stack: PluraiStack) -> list[bytes]:
    assert stack.r is not None
    return [k for k in stack.r.scan_iter(count=1000) if keys.job_of(k)]
