"""vLLM's offline engine on a workload file, for the benches' vLLM peer. Runs in vLLM's own
environment (`make vllm-install`: .venv-vllm), started by bench/throughput.py:

    .venv-vllm/bin/python bench/vllm_peer.py WORKLOAD.json

WORKLOAD.json: {"model", "dtype" ("fp32" | "bf16"), "requests": [[prompt ids, max_tokens]],
"options": {vLLM EngineArgs fields}}; or "phases": {name: requests} in place of "requests",
each phase run and timed in turn (bench/model_sizes.py). Prints one line, "PEER " and JSON:
seconds, tokens, vLLM's version; with phases, seconds and tokens per phase, the seconds from
the engine's construction to its first output (start_s) and the resident memory of this
process and its children at the end (rss_mib: vLLM's engine core runs in a child process).
vLLM's defaults otherwise, as a user would run it; every request is greedy with ignore_eos.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def tree_rss_mib(pid: int | None = None) -> float:
    """Resident memory of a process and all its descendants, MiB (Linux /proc)."""
    pid = pid or os.getpid()
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += next(int(x.split()[1]) for x in status.splitlines() if x.startswith("VmRSS"))
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, StopIteration):  # gone since, or a kernel thread
            continue
    return round(total / 1024, 1)


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    import vllm
    from vllm import LLM, SamplingParams, TokensPrompt

    dtype = {"fp32": "float32", "bf16": "bfloat16"}[spec["dtype"]]
    began = time.perf_counter()
    llm = LLM(model=spec["model"], dtype=dtype, **spec.get("options", {}))
    warm = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7, 8])], warm, use_tqdm=False)
    start_s = time.perf_counter() - began

    def run(requests: list) -> tuple[float, int]:
        prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in requests]
        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n in requests]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)

    if "phases" in spec:
        ran = {name: run(reqs) for name, reqs in spec["phases"].items()}
        result = {
            "seconds": {name: s for name, (s, _) in ran.items()},
            "tokens": {name: n for name, (_, n) in ran.items()},
            "start_s": start_s,
            "rss_mib": tree_rss_mib(),
            "vllm": vllm.__version__,
        }
    else:
        seconds, tokens = run(spec["requests"])
        result = {"seconds": seconds, "tokens": tokens, "vllm": vllm.__version__}
    print("PEER " + json.dumps(result), flush=True)  # vLLM logs to stdout too


if __name__ == "__main__":
    main()
