"""Plurai's engine on a workload file of phases, in a process of its own so that its start
time and memory are its own: the Plurai peer of bench/model_sizes.py, as bench/vllm_peer.py
is vLLM's.

    python bench/plurai_peer.py WORKLOAD.json

WORKLOAD.json: {"model", "dtype" ("fp32" | "bf16"), "phases": {name: [[prompt ids,
max_tokens]]}, "options": {EngineConfig fields}}. Each phase's requests are added at once
and stepped to their end, greedy with ignore_eos. Prints one line, "PEER " and JSON: seconds
and tokens per phase, start_s (from the engine's construction to its first output), rss_mib
(this process's resident memory at the end) and kernels (the fused kernels' ISA, or "torch").
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from plurai.gpu_workers.backend import AddRequest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.vllm_peer import tree_rss_mib  # noqa: E402
from plurai.gpu_workers.engine.engine import Engine, EngineConfig  # noqa: E402
from plurai.gpu_workers.engine.sampling_params import SamplingParams  # noqa: E402


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    began = time.perf_counter()
    engine = Engine(EngineConfig(model=spec["model"], dtype=spec["dtype"], **spec["options"]))
    engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, ignore_eos=True))
    start_s = time.perf_counter() - began
    seconds, tokens = {}, {}
    for name, requests in spec["phases"].items():
        start = time.perf_counter()
        for i, (prompt, n) in enumerate(requests):
            engine.add(
                AddRequest(
                    f"{name}-{i}",
                    token_ids=prompt,
                    params=SamplingParams(max_tokens=n, ignore_eos=True),
                ),
            )
        made = 0
        while engine.has_unfinished():
            made += sum(len(o.new_token_ids) for o in engine.step())
        seconds[name], tokens[name] = time.perf_counter() - start, made
    ops = engine.runner.ops
    result = {
        "seconds": seconds,
        "tokens": tokens,
        "start_s": start_s,
        "rss_mib": tree_rss_mib(),
        "kernels": "torch" if ops is None else "native",
    }
    print("PEER " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
