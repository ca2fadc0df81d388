"""Paged attention: K/V go into one preallocated cache through slot mappings and are
read back through block tables.

A step's tokens are laid out decode-first: rows [0, num_decode) are one token each of
running sequences, then each prefill chunk's rows follow. Decodes are attended in one
batched call over their gathered (padded, masked) blocks, or, with the fused CPU kernels
(gpu_workers.kernels), read in place from the cache through the block tables; each
prefill chunk is one causal call over its context. The torch path runs on CPU and CUDA; on
CUDA with flash-attn installed and a block size that it can page (a multiple of 256),
prefills and decodes go through flash-attn's paged varlen kernel instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

try:  # optional CUDA kernel
    from flash_attn import flash_attn_varlen_func  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - depends on the machine
    flash_attn_varlen_func = None


@dataclass
class Prefill:
    start: int  # first row of this chunk in the step's token rows
    length: int  # tokens in the chunk
    context: int  # tokens attended (cached prefix + the chunk)
    blocks: torch.Tensor | None  # block ids covering the context; None: no cached prefix


@dataclass
class AttnContext:
    slot_mapping: torch.Tensor  # [T] cache slot each token's K/V is written to
    num_decode: int = 0
    decode_blocks: torch.Tensor | None = None  # [B, max_blocks] block tables, padded
    decode_bias: torch.Tensor | None = None  # [1, B, 1, max_blocks*block_size]: 0 or -inf (padding)
    decode_rows: torch.Tensor | None = None  # cache rows of decode_blocks (first layer sets it)
    decode_tokens: torch.Tensor | None = None  # [Hkv*B*G, L] their token rows (likewise)
    decode_lens: torch.Tensor | None = None  # [B] tokens each decode attends (kernel path)
    prefills: list[Prefill] = field(default_factory=list)
    # flash-attn varlen inputs (built only when that kernel is used)
    cu_q: torch.Tensor | None = None
    cu_k: torch.Tensor | None = None
    max_q: int = 0
    max_k: int = 0
    block_table: torch.Tensor | None = None
    # reusable buffers for gathered K and V (one layer at a time); fresh multi-MB
    # allocations per layer would cost page faults on every call
    scratch: tuple[torch.Tensor, torch.Tensor] | None = None


def use_flash(device: torch.device, block_size: int) -> bool:
    return flash_attn_varlen_func is not None and device.type == "cuda" and block_size % 256 == 0


class PagedAttention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        ops: ModuleType | None = None,
    ) -> None:
        super().__init__()
        self.ops = ops
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        # [num_kv_heads, num_blocks, block_size, head_dim] views into the engine's cache.
        # Heads lead so that gathered blocks are [Hkv, B, L, D] with contiguous [L, D]
        # rows: the decode matmuls then read them in place.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ctx: AttnContext,
        cached: bool = False,
    ) -> torch.Tensor:
        # q: [T, H, D]; k, v: [T, Hkv, D] -> out [T, H, D]; cached: k, v are in the cache
        if not cached:
            for cache, new in ((self.k_cache, k), (self.v_cache, v)):
                cache.view(self.num_kv_heads, -1, self.head_dim).index_copy_(
                    1, ctx.slot_mapping, new.transpose(0, 1)
                )
        if ctx.block_table is not None:
            return flash_attn_varlen_func(  # type: ignore[misc]
                q,
                self.k_cache.permute(1, 2, 0, 3),
                self.v_cache.permute(1, 2, 0, 3),
                ctx.cu_q,
                ctx.cu_k,
                ctx.max_q,
                ctx.max_k,
                softmax_scale=self.scale,
                causal=True,
                block_table=ctx.block_table,
            )
        n = ctx.num_decode
        if not ctx.prefills:  # decodes only: no output buffer to fill
            return self._decode(q, ctx)
        out = torch.empty_like(q)
        if n:
            out[:n] = self._decode(q[:n], ctx)
        for p in ctx.prefills:
            out[p.start : p.start + p.length] = self._prefill(q, k, v, p, ctx)
        return out

    def _rows(self, blocks: torch.Tensor) -> torch.Tensor:
        """The cache rows holding `blocks` [B, nb], head by head, when the cache is seen as
        [Hkv * num_blocks, bs * D]: selecting whole rows of a 2-D tensor is about twice as
        fast on CPU as selecting along dim 1 of the 4-D cache (and far faster than
        cache[:, idx]). The same for every layer."""
        hkv, num_blocks = self.k_cache.shape[:2]
        heads = torch.arange(0, hkv * num_blocks, num_blocks, device=blocks.device)
        return (heads[:, None] + blocks.flatten()[None, :]).flatten()

    def _gather(self, ctx: AttnContext, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `blocks` [B, nb] as [Hkv, B, nb * block_size, D] each."""
        rows = self._rows(blocks)
        k, v = (self._select(c, i, rows, ctx) for i, c in enumerate((self.k_cache, self.v_cache)))
        return (
            k.view(self.num_kv_heads, blocks.shape[0], -1, self.head_dim),
            v.view(self.num_kv_heads, blocks.shape[0], -1, self.head_dim),
        )

    def _select(
        self, cache: torch.Tensor, i: int, rows: torch.Tensor, ctx: AttnContext
    ) -> torch.Tensor:
        """Cache rows [len(rows), bs * D], into scratch buffer i when the step has one."""
        hkv, num_blocks, bs, d = cache.shape
        flat = cache.view(hkv * num_blocks, bs * d)
        if ctx.scratch is None:
            return torch.index_select(flat, 0, rows)
        buf = ctx.scratch[i][: rows.numel() * bs * d].view(rows.numel(), bs * d)
        return torch.index_select(flat, 0, rows, out=buf)

    def _decode(self, q: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        # One query per sequence. Scores: a batched matmul over (kv head, sequence) against
        # the gathered K blocks, with the query heads that share a kv head stacked as rows.
        # Output: each query head's probability-weighted sum of V rows, read straight from
        # the cache by embedding_bag, so V is never copied (2-8x faster than gather + matmul
        # on CPU). Padding reads block 0 with weight 0.
        if ctx.decode_lens is not None:
            return self.ops.paged_decode(  # type: ignore[union-attr]
                q, self.k_cache, self.v_cache, ctx.decode_blocks, ctx.decode_lens, self.scale
            )
        b, hkv, d = q.shape[0], self.num_kv_heads, self.head_dim
        if ctx.decode_rows is None:
            ctx.decode_rows = self._rows(ctx.decode_blocks)
            ctx.decode_tokens = self._token_rows(ctx.decode_rows, b)
        k = self._select(self.k_cache, 0, ctx.decode_rows, ctx).view(hkv, b, -1, d)
        qg = q.view(b, hkv, -1, d).transpose(0, 1)  # [Hkv, B, G, D]
        scores = torch.matmul(qg, k.transpose(-1, -2))
        # bias + scale * scores, in fp32: the fp32 bias promotes it
        scores = torch.add(ctx.decode_bias, scores, alpha=self.scale)
        probs = scores.softmax(dim=-1).to(q.dtype)  # [Hkv, B, G, L]
        o = F.embedding_bag(
            ctx.decode_tokens,
            self.v_cache.view(-1, d),
            mode="sum",
            per_sample_weights=probs.view(ctx.decode_tokens.shape),
        )
        return o.view(hkv, b, -1, d).transpose(0, 1).reshape(b, self.num_heads, d)

    def _token_rows(self, rows: torch.Tensor, b: int) -> torch.Tensor:
        """Per (kv head, sequence, query head of the group): the rows of the cache seen as
        [Hkv * num_blocks * bs, D] that hold the tokens of the blocks at `rows`."""
        bs = self.k_cache.shape[2]
        group = self.num_heads // self.num_kv_heads
        offsets = torch.arange(bs, device=rows.device)
        tokens = (rows.view(self.num_kv_heads, b, -1, 1) * bs + offsets).view(
            self.num_kv_heads, b, 1, -1
        )
        return tokens.expand(-1, -1, group, -1).reshape(-1, tokens.shape[-1])

    def _prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: Prefill, ctx: AttnContext
    ) -> torch.Tensor:
        rows = slice(p.start, p.start + p.length)
        qp = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        gqa = self.num_heads != self.num_kv_heads
        if p.blocks is None:
            kp = k[rows].transpose(0, 1).unsqueeze(0)
            vp = v[rows].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                qp, kp, vp, is_causal=True, scale=self.scale, enable_gqa=gqa
            )
        else:
            kp, vp = self._gather(ctx, p.blocks.unsqueeze(0))  # [Hkv, 1, L, D]
            kp = kp[:, 0, : p.context].unsqueeze(0)
            vp = vp[:, 0, : p.context].unsqueeze(0)
            # query i sits at position context - length + i and sees keys up to it
            qpos = torch.arange(p.context - p.length, p.context, device=q.device)
            mask = torch.arange(p.context, device=q.device)[None, :] <= qpos[:, None]
            o = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=mask, scale=self.scale, enable_gqa=gqa
            )
        return o.squeeze(0).transpose(0, 1)
