"""Engine settings."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

# A CPU worker's KV cache and host tier each take this share of the host's memory, at most
# 1 GiB: room is left for the weights, other workers and everything else on the host.
HOST_SHARE = 0.05
CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def host_memory_bytes() -> int:
    """The memory of this host, or of its container where the container's limit (cgroup
    v2 or v1) is lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in CGROUP_LIMITS:
        try:
            limit = Path(path).read_text().strip()
        except OSError:
            continue
        if limit.isdigit():  # "max" (v2) or a huge number (v1): no limit
            total = min(total, int(limit))
    return total


def host_share(cap: int = 1 << 30) -> int:
    return min(cap, int(host_memory_bytes() * HOST_SHARE))


@dataclass
class EngineConfig:
    model: str  # local Hugging Face model directory
    # auto: bf16 on CPUs with native bf16 (else fp32), the checkpoint's dtype on CUDA
    dtype: str = "auto"  # auto | fp32 | bf16 | fp16
    device: str = "auto"  # auto (cuda when available) | cpu | cuda | cuda:N
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # None: sized from kv_cache_bytes / gpu_memory_utilization
    # KV budget on CPU; default: HOST_SHARE of the host's memory, at most 1 GiB
    kv_cache_bytes: int = field(default_factory=host_share)
    gpu_memory_utilization: float = 0.85  # share of free device memory the KV cache may take
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 64  # sequences in one step
    max_num_batched_tokens: int = 512  # tokens in one step (prefill chunks + decodes)
    chunked_prefill: bool = True
    prefix_caching: bool = True
    # speculative decoding (speculator.py): ngram (prompt lookup), draft:<dir> (a smaller
    # model with the same tokenizer, drafter.py) or off; the most tokens proposed a step,
    # and the n-gram sizes looked up
    speculative: str = "off"
    num_speculative_tokens: int = 4
    ngram_min: int = 2
    ngram_max: int = 4
    priority_aging_steps: int = (
        256  # a waiting request gains one priority level per this many steps
    )
    watermark: float = 0.01  # share of blocks the capacity query keeps free
    seed: int = 0  # sampling seed for requests that give none
    # KV tiers below the device cache (kv_store): cached blocks evicted from the device go
    # to host memory, and from there to Redis, where every worker of the model finds them
    kv_host_bytes: int = field(default_factory=host_share)  # host tier budget; 0: none
    kv_redis_ttl_s: int = 3600
    kv_write_through: bool = False  # also send each full block to Redis as soon as it is computed
    threads: int | None = None  # torch CPU threads; None: torch's default (cores / ranks)
    # fused CPU kernels (gpu_workers.kernels): auto (when they build), native, or torch;
    # None: PLURAI_KERNELS, else auto
    kernels: str | None = None
    tensor_parallel: int = 1  # ranks the model's heads and MLP are split over (processes)
    pipeline_parallel: int = 1  # stages the model's layers are split over (processes)
    pipeline_layers: list[int] | None = None  # layers per stage; None: an even split
    # test hook: the model runner raises for every run whose batch holds a sequence with
    # this token id in its prompt (the engine's recovery from a failing step is tested so)
    fault_token_id: int | None = None

    @property
    def draft_model(self) -> str | None:
        """The draft model's directory, for speculative=draft:<dir>."""
        kind, _, path = self.speculative.partition(":")
        return path if kind == "draft" and path else None

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.tensor_parallel < 1 or self.pipeline_parallel < 1:
            raise ValueError("tensor_parallel and pipeline_parallel must be >= 1")
        if self.kernels not in (None, "auto", "native", "torch"):
            raise ValueError(f"kernels must be auto, native or torch, got {self.kernels!r}")
        if self.speculative not in ("off", "ngram") and not self.draft_model:
            raise ValueError(
                f"speculative must be ngram, draft:<model dir> or off, got {self.speculative!r}"
            )
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(
                f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}"
            )
        if not 1 <= self.ngram_min <= self.ngram_max <= 16:
            raise ValueError(
                "ngram_min and ngram_max must satisfy 1 <= ngram_min <= ngram_max <= 16, got "
                f"{self.ngram_min} and {self.ngram_max}"
            )
        if self.kv_redis_ttl_s < 1:  # Redis refuses it: every write would fail, unseen
            raise ValueError(f"kv_redis_ttl_s must be >= 1, got {self.kv_redis_ttl_s}")
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.fault_token_id is not None and (
            not isinstance(self.fault_token_id, int) or isinstance(self.fault_token_id, bool)
        ):
            raise ValueError(f"fault_token_id must be a token id, got {self.fault_token_id!r}")
