"""Where K and V sit in a vLLM KV cache page, and the block shape the connector stores.

vLLM hands KV connectors each layer's cache as [blocks, kv_heads, tokens, 2 *
head_dim], but where K and V sit inside a block is the attention backend's business:
FLASH_ATTN puts K and V side by side per token; CPU_ATTN (vLLM 0.32, its "vec" kernel)
puts per head all of K transposed, [head_dim, tokens], then all of V, and its other
kernels (AMX, NEON) may pack otherwise. So nothing is assumed: at registration the
connector has the backend's own cache write fill a scratch block with numbered values
and learns the permutation from [2, kv_heads, tokens, head_dim] to the block's layout,
which any backend whose write is a plain permutation gets right (CPU and GPU alike,
kernel blocks smaller than vLLM's block included). A backend without a separate cache
write, a write that is no permutation (quantized, fp8 caches), MLA, sliding-window and
hybrid models are refused with an error at start-up rather than stored wrongly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec

from plurai.kv_store import block_format

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig


class UnsupportedCache(ValueError):
    """A vLLM KV cache this connector refuses to store (raised at start-up, never while
    serving): a layout it cannot invert, a quantized dtype, MLA, sliding-window or hybrid."""


def probe(layer: Any, kv: torch.Tensor) -> torch.Tensor:
    """Where the attention backend puts each K and V value in a page of `kv` (a layer's
    [pages, heads, page tokens, 2 * head_dim] cache): page element i (in logical order)
    holds element perm[i] of the page's [2, heads, page tokens, head_dim] K/V. Learned by
    having the backend's own cache write fill a scratch page with numbered values (base-256
    digits, exact in every float dtype); raises unless that write is a permutation."""
    _, heads, rows, content = kv.shape
    size = 2 * heads * rows * (content // 2)
    strides = kv.stride()[1:]
    extent = 1 + sum((n - 1) * st for n, st in zip(kv.shape[1:], strides, strict=True))
    scratch = torch.empty_strided(
        (1, heads, rows, content), (extent, *strides), dtype=kv.dtype, device=kv.device
    )
    slots = torch.arange(rows, device=kv.device)
    ids = torch.arange(size, device=kv.device)
    perm = torch.zeros(size, dtype=torch.long, device=kv.device)
    scale = 1
    while scale < size:
        digits = ((ids // scale) % 256).to(kv.dtype).view(2, heads, rows, content // 2)
        key, value = (d.transpose(0, 1).contiguous() for d in digits)  # [tokens, heads, dim]
        scratch.fill_(-1)
        layer.impl.do_kv_cache_update(layer, key, value, scratch, slots)
        page = scratch[0].flatten()
        if bool((page < 0).any()):
            raise UnsupportedCache("the backend's cache write leaves part of a page unwritten")
        perm += page.long() * scale
        scale *= 256
    if not torch.equal(perm.sort().values, ids):
        raise UnsupportedCache("the backend's cache write is not a permutation of K and V")
    return perm


def to_native(blocks: torch.Tensor, perm: torch.Tensor, ratio: int) -> torch.Tensor:
    """[n, 2, heads, tokens, head_dim] blocks of one layer as the backend's pages, [n,
    ratio, heads, tokens // ratio, 2 * head_dim] (a vLLM block is `ratio` kernel pages)."""
    n, _, heads, tokens, dim = blocks.shape
    rows = tokens // ratio
    x = blocks.reshape(n, 2, heads, ratio, rows, dim).permute(0, 3, 1, 2, 4, 5)
    flat = x.reshape(n, ratio, -1)[:, :, perm.to(blocks.device)]
    return flat.view(n, ratio, heads, rows, 2 * dim)


def from_native(pages: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """The inverse of to_native."""
    n, ratio, heads, rows, content = pages.shape
    flat = torch.empty(n, ratio, perm.numel(), dtype=pages.dtype, device=pages.device)
    flat[:, :, perm.to(pages.device)] = pages.reshape(n, ratio, -1)
    x = flat.view(n, ratio, 2, heads, rows, content // 2).permute(0, 2, 3, 1, 4, 5)
    return x.reshape(n, 2, heads, ratio * rows, content // 2)


def block_spec(kv_cache_config: KVCacheConfig) -> tuple[tuple[int, ...], torch.dtype]:
    """The block_format shape and dtype of a rank's blocks; raises for caches this
    connector cannot store."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise UnsupportedCache(
            f"PluraiConnector supports one KV cache group, not {len(groups)} "
            "(hybrid or sliding-window models)"
        )
    spec = groups[0].kv_cache_spec
    if (
        type(spec) is not FullAttentionSpec
        or spec.head_size_v != spec.head_size
        or spec.num_head_slots is not None
        or spec.state_content_bytes is not None
        or spec.tokens_per_state != 1
        or spec.sliding_window is not None
        or spec.attention_chunk_size is not None
    ):
        raise UnsupportedCache(f"PluraiConnector cannot store {spec!r}")
    if spec.dtype not in block_format.DTYPES:
        raise UnsupportedCache(f"PluraiConnector cannot store a {spec.dtype} KV cache")
    layers = len(groups[0].layer_names)
    return (2, layers, spec.num_kv_heads, spec.block_size, spec.head_size), spec.dtype


def layer_pages(
    kv_caches: dict[str, torch.Tensor],
    layers: dict[str, Any],
    shape: tuple[int, ...],
    dtype: torch.dtype,
    num_blocks: int,
) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
    """(pages, ratio, perm) of each layer's cache, in layer order: its [num_blocks, ratio,
    heads, tokens // ratio, 2 * head_dim] pages (a vLLM block is `ratio` kernel pages) and
    the permutation `probe` learned for its attention backend. `layers` is vLLM's forward
    context (layer name: attention layer); `shape` and `dtype` are block_spec's. Raises
    UnsupportedCache for a cache this module cannot read."""
    from vllm.model_executor.models.utils import extract_layer_index

    _, num_layers, heads, tokens, dim = shape
    seen: set[tuple[int, int]] = set()
    perms: dict[tuple[Any, ...], torch.Tensor] = {}
    views: list[tuple[int, str, torch.Tensor, int, torch.Tensor]] = []
    for name, kv in kv_caches.items():
        where = (kv.untyped_storage().data_ptr(), kv.storage_offset())
        if where in seen:  # a layer that shares another's cache
            continue
        seen.add(where)
        layer = layers.get(name)
        backend = getattr(layer, "attn_backend", None)
        if backend is None or backend.forward_includes_kv_cache_update:
            raise UnsupportedCache(
                f"PluraiConnector needs an attention backend with a separate KV cache "
                f"write; {name} has {backend.get_name() if backend else 'none'}"
            )
        ratio = kv.shape[0] // num_blocks if kv.dim() == 4 else 0
        if (
            kv.dim() != 4
            or kv.dtype != dtype
            or ratio * num_blocks != kv.shape[0]
            or ratio * kv.shape[2] != tokens
            or tuple(kv.shape[1:]) != (heads, kv.shape[2], 2 * dim)
        ):
            raise UnsupportedCache(
                f"PluraiConnector cannot read {name}'s KV cache: {kv.dtype} "
                f"{tuple(kv.shape)}, expected {dtype} pages of [{heads}, "
                f"{tokens} / n, {2 * dim}] for {num_blocks} blocks"
            )
        key = (backend.get_name(), getattr(layer, "isa", None), kv.shape[1:], kv.stride()[1:])
        if key not in perms:
            perms[key] = probe(layer, kv).cpu()
        pages = kv.view(num_blocks, ratio, heads, tokens // ratio, 2 * dim)
        views.append((extract_layer_index(name), name, pages, ratio, perms[key]))
    if len(views) != num_layers:
        raise UnsupportedCache(f"PluraiConnector expected {num_layers} KV caches, got {len(views)}")
    return [(pages, ratio, perm) for _, _, pages, ratio, perm in sorted(views, key=lambda v: v[:2])]
