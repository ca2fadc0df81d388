"""vLLM's per-step figures, gathered by a stat logger (vLLM's own hook for them) into the
running totals the worker publishes: the same keys as the native engine's stats()."""

from __future__ import annotations

from typing import Any

from vllm.v1.metrics.loggers import StatLoggerBase


class Figures(StatLoggerBase):
    """Keeps the latest scheduler figures and totals since start. Token counts from vLLM's
    prefix-cache stats are kept as tokens; the block figures divide them by the block size."""

    def __init__(self, vllm_config: Any = None, engine_index: int = 0) -> None:
        self.running = 0
        self.waiting = 0
        self.kv_usage = 0.0
        self.prefix_queries = 0  # prompt tokens looked up in the local prefix cache
        self.prefix_hits = 0  # of them, found
        self.remote_hits = 0  # prompt tokens loaded by the KV connector
        self.preemptions = 0
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.spec_proposed = 0  # speculative decoding: draft tokens, and of those accepted
        self.spec_accepted = 0

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        if scheduler_stats is not None:
            s = scheduler_stats
            self.running = s.num_running_reqs
            self.waiting = s.num_waiting_reqs + s.num_skipped_waiting_reqs
            self.kv_usage = s.kv_cache_usage
            self.prefix_queries += s.prefix_cache_stats.queries
            self.prefix_hits += s.prefix_cache_stats.hits
            if s.connector_prefix_cache_stats is not None:
                self.remote_hits += s.connector_prefix_cache_stats.hits
            spec = getattr(s, "spec_decoding_stats", None)
            if spec is not None:
                self.spec_proposed += spec.num_draft_tokens
                self.spec_accepted += spec.num_accepted_tokens
        if iteration_stats is not None:
            self.preemptions += iteration_stats.num_preempted_reqs
            self.prompt_tokens += iteration_stats.num_prompt_tokens
            self.generated_tokens += iteration_stats.num_generation_tokens

    def log_engine_initialized(self) -> None:
        pass
