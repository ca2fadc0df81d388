"""`python -m bench`: every bench, the question it answers, the peers it runs beside
Plurai on the same work, the environment it runs in, how long its default run takes and
where its figures are written up.

Run times: a default run (no option but the model's default) on a 2-core AMD EPYC (AVX2
only), measured December 8 2026 and printed by each bench as `wall_s`; "est." where a run
was not timed, from what the run does. Machines with AVX-512 or AMX run the engine
benches faster.

Each bench is a script (`python bench/<name>.py --help`), or a module of a package
(`python -m bench.serving --help`); `--smoke` runs it briefly as a check, and its last line
is one JSON object of measured figures (the ISA among them).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Bench:
    name: str
    question: str
    peers: str
    docs: str  # where its figures are written up
    runtime: str  # a default run's length (module docstring)
    vllm_env: bool = False  # runs in vLLM's environment (.venv-vllm/bin/python)
    module: str = ""  # run as `python -m <module>`; else bench/<name>.py

    @property
    def command(self) -> str:
        return f"-m {self.module}" if self.module else f"bench/{self.name}.py"

    @property
    def file(self) -> str:
        """Its source under bench/, without .py (a package's: its __main__)."""
        return source(self.module) if self.module else self.name


def source(module: str) -> str:
    """bench.serving -> serving/__main__, bench.serving.workload -> serving/workload."""
    rel = module.removeprefix("bench.").replace(".", "/")
    return f"{rel}/__main__" if (BENCH / rel).is_dir() else rel


INDEX = [
    # serving: the queue against router stacks
    Bench("serving", "Floods, kills, load sweeps and added engines: Plurai against routers",
          "vllm-router (round_robin, power_of_two, cache_aware) over `vllm serve`",
          "docs/benchmarks.md",
          "~1.5 h (est.: 5 stacks x 8 runs of 40 s arrivals, each drained and restarted)",
          module="bench.serving"),
    Bench("router_latency", "Everyday latency with the defaults, under `vllm bench serve`",
          "vllm-router over `vllm serve`", "docs/benchmarks.md",
          "~2 h (est.: 4 stacks x 2 datasets x 3 loads of 600 requests)", vllm_env=True),
    Bench("priority", "Interactive TTFT while the batch lane saturates the workers",
          "the same requests on idle workers", "docs/benchmarks.md",
          "3.0 min"),
    Bench("simulation", "Routers against pulling at 64-1,000 engines (a simulation)",
          "simulated routers", "docs/benchmarks.md",
          "~20 min (est.; 19 min with --check-against)", module="bench.serving.simulation"),
    Bench("fleet_sim", "The real queue layer at fleet scale, engines simulated",
          "the smallest fleet (scaling to 256 workers)", "docs/benchmarks.md",
          "2.3 min"),
    # the queue's own costs
    Bench("queue_overhead", "What Redis costs a job: end to end against offline",
          "Engine.generate offline; a bare XADD", "docs/benchmarks.md",
          "3.0 min"),
    Bench("gateway", "The HTTP gateway against the SDK straight to Redis",
          "producer.aio's AsyncClient", "docs/benchmarks.md",
          "1.0 min"),
    Bench("tracing", "What tracing every job costs", "the same jobs, tracing off",
          "docs/benchmarks.md",
          "1.1 min"),
    Bench("dashboard", "The dashboard's weight and its Redis cost as the backlog grows",
          "(none)", "docs/benchmarks.md",
          "12 s"),
    Bench("bulk", "Documents/s of the batch pipeline (Celery) against offline",
          "the same map-reduce plan offline", "docs/benchmarks.md",
          "49 s"),
    Bench("backends", "The native and vLLM backends on the same queue work",
          "vLLM's LLM.generate", "docs/benchmarks.md",
          "2.9 min", vllm_env=True),
    # the engine
    Bench("throughput", "Tokens/s of the engine on a mixed workload",
          "vLLM's CPU build, transformers", "docs/benchmarks.md",
          "4.4 min"),
    Bench("model_sizes", "Decode, prefill, start and memory at 0.5B and 1B",
          "vLLM's CPU build", "docs/benchmarks.md",
          "~30 min (est.: 1B in two dtypes, 3 runs, and vLLM's)"),
    Bench("quantized", "int8/int4 weights against bf16, speed and perplexity",
          "vLLM's CPU build on the same checkpoints", "docs/benchmarks.md",
          "~30 min (est.: 4 checkpoints, 3 runs each, the book model's training)"),
    Bench("speculative", "Prompt-lookup and draft-model speculation, with and without",
          "vLLM's CPU build with n-gram speculation", "docs/benchmarks.md",
          "~1 h the first time (est.: ~40 min train its two models, kept after)"),
    Bench("structured", "JSON-schema constrained decoding against unconstrained",
          "the same batch unconstrained", "docs/benchmarks.md",
          "1.3 min"),
    Bench("prefix_reuse", "TTFT and throughput with prefixes on the device, host and Redis",
          "a cold engine", "docs/benchmarks.md",
          "1.1 min"),
    Bench("overhead", "A decode step against the bare forward inside it",
          "the forward alone", "docs/benchmarks.md",
          "14 s"),
    Bench("step_profile", "Where a step's time goes, and the matmul-only floor",
          "the model's linear layers alone", "docs/benchmarks.md",
          "39 s"),
    Bench("cpu_kernels", "What each fused CPU kernel gains, alone and in place",
          "the torch ops it replaces", "docs/benchmarks.md",
          "4.4 min"),
    Bench("parallel", "Tensor- and pipeline-parallel groups against one rank",
          "one rank", "docs/benchmarks.md",
          "34 s"),
]  # fmt: skip

# Parts of the benches above, not benches (files under bench/, without .py): the serving
# bench's workload, stacks, client, scenarios and figures, the fleet bench's simulated
# engines, the engine peers run in processes of their own, vLLM's CLI.
PARTS = ["serving/workload", "serving/figures", "serving/stacks", "serving/client",
         "serving/scenarios", "serving/report", "serving/__init__", "sim_backend",
         "fleet_procs", "trace_replay", "workload", "plurai_peer", "vllm_peer",
         "vllm_cli"]  # fmt: skip


def main() -> None:
    width = max(len(b.name) for b in INDEX)
    print(__doc__.split("\n\n")[0].replace("\n", " "))
    print()
    for b in INDEX:
        python = ".venv-vllm/bin/python" if b.vllm_env else "python"
        print(f"{b.name:<{width}}  {b.question}")
        print(f"{'':<{width}}  peers: {b.peers}; figures: {b.docs}")
        print(f"{'':<{width}}  default run: {b.runtime}")
        print(f"{'':<{width}}  {python} {b.command} [--smoke]")


if __name__ == "__main__":
    main()
