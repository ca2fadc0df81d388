"""Rotary position embeddings (default, linear and llama3 scaling), as a lookup table."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def rope_params(config: Any) -> dict[str, Any]:
    """The rope settings of an HF config, whichever transformers version wrote it."""
    params = dict(
        getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    )
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def inv_frequencies(params: dict[str, Any], head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale for one rope configuration."""
    base = float(params["rope_theta"])
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = params["rope_type"]
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / float(params["factor"]), 1.0
    if kind == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    raise ValueError(f"rope_type {kind!r} is not supported (supported: default, linear, llama3)")


class Rotary(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, params: dict[str, Any]) -> None:
        super().__init__()
        inv, scale = inv_frequencies(params, head_dim)
        if inv.numel() * 2 != head_dim:
            raise ValueError("partial rotary embeddings are not supported")
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scale, persistent=False)
        sin = emb.sin() * scale
        sin[:, : inv.numel()] *= -1
        self.register_buffer("signed_sin", sin, persistent=False)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for `positions`, shaped [T, 1, D] to broadcast over heads; the first
        half of sin negated, for `apply_rotary`."""
        cos = torch.index_select(self.cos, 0, positions).unsqueeze(1).to(dtype)
        sin = torch.index_select(self.signed_sin, 0, positions).unsqueeze(1).to(dtype)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half(x) = [-x2, x1] computed as the
    swapped halves [x2, x1] times the sign folded into sin: the same values, fewer ops."""
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
    return x * cos + swapped * signed_sin
