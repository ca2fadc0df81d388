"""A vLLM v1 KV connector that shares prompt KV blocks between workers through Plurai's
Redis tier, with the native engine's keys and block format.

Keys are `keys.kv_block(fingerprint, block hash)`, the hash chained over the prompt's
token ids (kv_store.block_hash, rooted at the request's cache_salt); values are
kv_store.block_format blocks, [2, layers, kv_heads, block_size, head_dim], checksummed,
MAC'd with PLURAI_KV_SECRET when set, written by RedisTier's background thread.

Enabled by the backend with
    KVTransferConfig(kv_connector="PluraiConnector",
                     kv_connector_module_path="plurai.gpu_workers.vllm_backend.connector",
                     kv_role="kv_both", kv_load_failure_policy="recompute",
                     kv_connector_extra_config={"fingerprint": <32 hex>, "ttl_s": 3600})
and the Redis URL in PLURAI_KV_REDIS_URL (vLLM logs its config; the URL may hold a
password), read as Settings.kv_redis_url. Without the URL the connector finds nothing and
writes nothing.

Loading: the scheduler side reads the prompt's next blocks (past vLLM's local prefix hit,
never the last token) and decodes them fully, so it claims only the leading run of
present, valid blocks; a bad, truncated, foreign or missing block ends the run and is
recomputed. Checking there, rather than at load time, keeps num_cached_tokens true,
wastes no forward pass on a block that turns out bad, and reads each block once: the
decoded blocks ride on the step's metadata to the worker side, which copies them into
vLLM's paged cache before the forward pass. When the metadata crosses a process boundary
(a multi-process executor: tensor or pipeline parallel) the blocks stay behind and each
rank reads its own; a block that fails there is reported through
get_block_ids_with_load_errors, which vLLM's "recompute" policy turns into a recompute
from that block (its default "fail" policy would fail the request, so the connector
refuses to start without "recompute"). The step's saves are then skipped, and those
blocks are not saved later either.

Tensor/pipeline parallel: a rank holds only its heads or layers, so the rank is mixed
into the fingerprint of its keys. The scheduler checks rank 0's keys only; another rank
missing its block reports it as failed and vLLM recomputes it.

Saving: once a step has computed a prompt's full block that was neither found in vLLM's
local cache nor loaded from Redis, the worker side copies it out of the paged cache and
queues it on RedisTier's writer (dropped, never waited on, when the writer is behind or
Redis is down). So a damaged entry is written again whole by the next worker that
recomputes it. Generated-token blocks are not saved.

Layouts: where K and V sit inside a vLLM cache page is learned at registration
(gpu_workers/vllm_backend/kv_layout.py); caches it cannot store are refused at start-up.

Requests with images (mm_features), LoRA adapters or prompt embeddings are neither
looked up nor saved: their KV is not a function of the token ids alone.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from redis.backoff import NoBackoff
from redis.retry import Retry
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from plurai.broker_config.connection import connect
from plurai.broker_config.settings import Settings
from plurai.gpu_workers.vllm_backend.kv_layout import (
    block_spec,
    from_native,
    layer_pages,
    to_native,
)
from plurai.kv_store import block_format
from plurai.kv_store.block_hash import chain_hashes, salt_root
from plurai.kv_store.redis_tier import RedisTier

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

# Settings.kv_redis_url's variable. The backend writes the URL it uses there, so that the
# connector in vLLM's engine and rank processes (which inherit the environment) reads the
# same one from Settings.
URL_ENV = "PLURAI_KV_REDIS_URL"


@dataclass
class Counters:
    """Process-wide counts of the connector halves that run in this process. The worker
    runs vLLM's scheduler in its own process, so `misses` and `bad` (the lookup's) are the
    worker's; `hits`, `saved` and `dropped` are counted by the rank processes' halves
    (vLLM's CPU executor runs even rank 0 in a process of its own); the backend reports
    Redis hits from vLLM's own connector figures instead."""

    hits: int = 0  # blocks loaded from Redis into vLLM's cache
    misses: int = 0  # prompt blocks looked up and not loaded (absent, bad, or after one)
    bad: int = 0  # entries refused: failed a block_format check or the MAC
    saved: int = 0  # blocks queued for Redis
    dropped: int = 0  # of those, not written: writer behind, Redis down or full


COUNTERS = Counters()


def rank_fingerprint(fingerprint: str, rank: tuple[int, int], world: tuple[int, int]) -> str:
    """The key fingerprint of (tp rank, pp rank) of a (tp, pp) world: the fingerprint
    itself for a single rank, else a digest of it and the rank (same length)."""
    if world == (1, 1):
        return fingerprint
    h = hashlib.blake2b(digest_size=len(fingerprint) // 2, person=b"plurai-rank")
    h.update(f"{fingerprint}|tp{rank[0]}/{world[0]}|pp{rank[1]}/{world[1]}".encode())
    return h.hexdigest()


class Store:
    """The Redis tier as the connector sees it: blocks of one rank's shape and dtype."""

    def __init__(self, tier: RedisTier, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.tier = tier
        self.fingerprint = bytes.fromhex(tier.fingerprint)
        self.shape = shape
        self.dtype = dtype
        self.dropped = 0  # tier.dropped already added to COUNTERS

    def lookup(self, hashes: list[bytes]) -> tuple[list[torch.Tensor], int]:
        """The decoded blocks of the leading run of `hashes` that Redis holds intact, and
        how many entries were refused (at most one: the run ends there)."""
        refused = self.tier.refused
        found = self.tier.get_many(hashes, block_format.size(self.shape, self.dtype))
        bad = self.tier.refused - refused
        blocks: list[torch.Tensor] = []
        for h, data in zip(hashes, found, strict=True):
            if data is None:
                break
            try:
                # the tier has checked the MAC when there is a secret
                blocks.append(
                    block_format.decode(data, h, self.fingerprint, self.shape, self.dtype)
                )
            except block_format.BadBlock as e:
                bad += 1
                log.warning("KV block %s from Redis refused (%s); recomputing it", h.hex(), e)
                break
        return blocks, bad

    def put(self, h: bytes, block: torch.Tensor) -> None:
        self.tier.put(h, block)
        COUNTERS.saved += 1

    def sync(self) -> None:
        """Bring COUNTERS.dropped up to date with the writer thread's count."""
        dropped = self.tier.dropped
        COUNTERS.dropped += dropped - self.dropped
        self.dropped = dropped

    def close(self) -> None:
        self.tier.flush()
        self.sync()
        self.tier.close()


def open_store(
    fingerprint: str, ttl_s: int, shape: tuple[int, ...], dtype: torch.dtype
) -> Store | None:
    """A Store on Settings.kv_redis_url (PLURAI_KV_REDIS_URL); None when it is unset or
    unusable."""
    url = Settings().kv_redis_url
    if not url:
        return None
    try:
        # no retries: the engine waits on every read, and a miss only costs a recompute
        r = connect(
            url, socket_timeout=1.0, socket_connect_timeout=1.0, retry=Retry(NoBackoff(), 0)
        )
    except ValueError as e:  # the message can quote the URL: say only what kind of fault
        log.error("%s is not a usable Redis URL (%s); KV sharing is off", URL_ENV, type(e).__name__)
        return None
    return Store(RedisTier(r, fingerprint, ttl_s), shape, dtype)


@dataclass
class Load:
    """Blocks of a request to copy into vLLM's cache this step."""

    req_id: str
    block_ids: list[int]
    hashes: list[bytes]
    blocks: list[torch.Tensor] | None = None  # decoded by the scheduler; None: read them

    def __getstate__(self) -> dict[str, Any]:
        # another process (another rank) reads its own blocks: never ship these
        return {**self.__dict__, "blocks": None}


@dataclass
class Meta(KVConnectorMetadata):
    loads: list[Load] = field(default_factory=list)
    save_ids: list[int] = field(default_factory=list)  # cache blocks to write to Redis
    save_hashes: list[bytes] = field(default_factory=list)


@dataclass
class _Req:
    hashes: list[bytes]  # every full prompt block's
    saved: int = 0  # leading blocks already in Redis, in vLLM's cache, or queued
    start: int = -1  # the last lookup: its first block, and what it found
    found: list[torch.Tensor] = field(default_factory=list)
    bad: int = 0


class PluraiConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        kt = self._kv_transfer_config
        if kt.kv_load_failure_policy != "recompute":
            raise ValueError(
                "PluraiConnector needs kv_load_failure_policy='recompute': a block that "
                "fails to load must be recomputed, not fail the request"
            )
        fingerprint = str(kt.get_from_extra_config("fingerprint", ""))
        try:
            if len(bytes.fromhex(fingerprint)) < 16:
                raise ValueError
        except ValueError:
            raise ValueError(
                "PluraiConnector needs kv_connector_extra_config['fingerprint']: "
                "at least 16 bytes, in hex"
            ) from None
        self.fingerprint = fingerprint
        self.ttl_s = int(kt.get_from_extra_config("ttl_s", 3600))
        self.block_size = vllm_config.cache_config.block_size
        parallel = vllm_config.parallel_config
        self.world = (parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
        self.shape, self.dtype = block_spec(kv_cache_config)
        self.store: Store | None = None
        # scheduler side
        self.reqs: dict[str, _Req] = {}
        self.loads: list[Load] = []
        # worker side
        self.layers: list[tuple[torch.Tensor, int, torch.Tensor]] = []  # (pages, ratio, perm)
        self.failed: set[int] = set()
        if role == KVConnectorRole.SCHEDULER:
            fp = rank_fingerprint(fingerprint, (0, 0), self.world)
            self.store = open_store(fp, self.ttl_s, self.shape, self.dtype)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a save that does not happen is only a later miss

    # -- scheduler side -------------------------------------------------------------

    def _track(self, request: Request) -> _Req | None:
        st = self.reqs.get(request.request_id)
        if st is None:
            tokens = request.prompt_token_ids
            if (
                self.store is None
                or tokens is None
                or request.prompt_embeds is not None
                or request.mm_features
                or request.lora_request is not None
            ):
                return None
            fp = self.store.fingerprint
            st = _Req(
                hashes=chain_hashes(
                    list(tokens), self.block_size, fp, root=salt_root(request.cache_salt)
                )
            )
            self.reqs[request.request_id] = st
        return st

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        st = self._track(request)
        if st is None or self.store is None or request.skip_reading_prefix_cache:
            return 0, False
        start = num_computed_tokens // self.block_size
        # vLLM computes at least the last token itself
        limit = min(len(st.hashes), (request.num_tokens - 1) // self.block_size)
        if start >= limit:
            return 0, False
        if st.start != start:  # vLLM may ask again for a request it could not admit
            st.found, st.bad = self.store.lookup(st.hashes[start:limit])
            st.start = start
        return len(st.found) * self.block_size, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        st = self._track(request)
        if st is None or st.start < 0:
            return
        n = num_external_tokens // self.block_size
        limit = min(len(st.hashes), (request.num_tokens - 1) // self.block_size)
        COUNTERS.misses += max(limit - st.start - n, 0)
        COUNTERS.bad += st.bad
        if n > 0:
            ids = blocks.get_block_ids()[0][st.start : st.start + n]
            hashes = st.hashes[st.start : st.start + n]
            self.loads.append(
                Load(req_id=request.request_id, block_ids=ids, hashes=hashes, blocks=st.found[:n])
            )
        st.start, st.found, st.bad = -1, [], 0

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = Meta(loads=self.loads)
        self.loads = []
        cached = scheduler_output.scheduled_cached_reqs
        # (request, tokens computed before this step, admitted this step)
        steps = [
            (r.req_id, r.num_computed_tokens, True) for r in scheduler_output.scheduled_new_reqs
        ]
        steps += [
            (req_id, done, req_id in cached.resumed_req_ids)
            for req_id, done in zip(cached.req_ids, cached.num_computed_tokens, strict=True)
        ]
        for req_id, done, admitted in steps:
            st = self.reqs.get(req_id)
            if st is None:
                continue
            if admitted:  # what it starts with came from vLLM's cache or from Redis
                st.saved = max(st.saved, done // self.block_size)
            end = done + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            full = min(end // self.block_size, len(st.hashes))
            if full > st.saved and self._kv_cache_manager is not None:
                ids = self._kv_cache_manager.get_block_ids(req_id)[0]
                meta.save_ids += ids[st.saved : full]
                meta.save_hashes += st.hashes[st.saved : full]
                st.saved = full
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self.reqs.pop(request.request_id, None)
        return False, None

    # -- worker side ----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        layers = self._vllm_config.compilation_config.static_forward_context
        num_blocks = self._kv_cache_config.num_blocks
        self.layers = layer_pages(kv_caches, layers, self.shape, self.dtype, num_blocks)
        rank = (get_tp_group().rank_in_group, get_pp_group().rank_in_group)
        fp = rank_fingerprint(self.fingerprint, rank, self.world)
        self.store = open_store(fp, self.ttl_s, self.shape, self.dtype)
        if self.store is not None:
            log.info(
                "KV blocks shared through Redis: %s blocks of %d tokens, rank %s",
                self.dtype,
                self.block_size,
                rank,
            )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, Meta)
        for load in meta.loads:
            blocks = load.blocks
            if blocks is None and self.store is not None:  # read in another process
                blocks, bad = self.store.lookup(load.hashes)
                COUNTERS.bad += bad
            blocks = blocks or []
            self.failed.update(load.block_ids[len(blocks) :])
            if blocks:
                self._write(load.block_ids[: len(blocks)], torch.stack(blocks))
                COUNTERS.hits += len(blocks)

    def _write(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Copy [n, 2, layers, heads, tokens, dim] blocks into cache blocks `block_ids`."""
        for i, (pages, ratio, perm) in enumerate(self.layers):
            idx = torch.tensor(block_ids, device=pages.device)
            pages[idx] = to_native(blocks[:, :, i], perm, ratio).to(pages.device)

    def _read(self, block_ids: list[int]) -> torch.Tensor:
        """Cache blocks `block_ids` as [n, 2, layers, heads, tokens, dim], on the CPU."""
        out = []
        for pages, _, perm in self.layers:
            idx = torch.tensor(block_ids, device=pages.device)
            out.append(from_native(pages[idx].cpu(), perm))
        return torch.stack(out, dim=2)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # blocks are saved whole, in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if self.store is None or not isinstance(meta, Meta):
            return
        # after a failed load this step computed blocks from a hole: keep them out of Redis
        if meta.save_ids and not self.failed:
            blocks = self._read(meta.save_ids)
            for h, block in zip(meta.save_hashes, blocks, strict=True):
                self.store.put(h, block)
        self.store.sync()

    def flush(self) -> None:
        """Wait until every queued write is made or dropped, and count the dropped."""
        if self.store is not None:
            self.store.tier.flush()
            self.store.sync()

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self.failed = self.failed, set()
        return failed

    def shutdown(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None
