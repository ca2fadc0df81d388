"""vLLM's offline engine on a workload file, for the benches' vLLM peer. Runs in vLLM's own
environment (`make vllm-install`: .venv-vllm), started by bench/throughput.py:

    .venv-vllm/bin/python bench/vllm_peer.py WORKLOAD.json

WORKLOAD.json: {"model", "dtype" ("fp32" | "bf16"), "requests": [[prompt ids, max_tokens]],
"options": {vLLM EngineArgs fields}}. Prints one line, "PEER " and JSON: seconds, tokens, vLLM's version.
vLLM's defaults otherwise, as a user would run it; every request is greedy with ignore_eos.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    import vllm
    from vllm import LLM, SamplingParams, TokensPrompt

    dtype = {"fp32": "float32", "bf16": "bfloat16"}[spec["dtype"]]
    llm = LLM(model=spec["model"], dtype=dtype, **spec.get("options", {}))
    warm = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7, 8])], warm, use_tqdm=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in spec["requests"]]
    params = [
        SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n in spec["requests"]
    ]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {"seconds": seconds, "tokens": tokens, "vllm": vllm.__version__}
    print("PEER " + json.dumps(result), flush=True)  # vLLM logs to stdout too


if __name__ == "__main__":
    main()
