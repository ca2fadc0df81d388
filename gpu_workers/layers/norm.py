"""RMSNorm, computed in float32 like the reference implementation, optionally fused with
the residual add before it (the decoder's `residual + x`, then the norm of that sum)."""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: ModuleType | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.shape = (dim,)
        self.weight = nn.Parameter(torch.ones(dim))
        self.ops = ops  # the fused CPU kernels, or None for torch

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with `residual`: (norm(x + residual), x + residual), where the
        kernels update `residual` in place."""
        if self.ops is not None:
            out = self.ops.rms_norm(x, residual, self.weight, self.eps)
            return out if residual is None else (out, residual)
        if residual is not None:
            residual = x + residual
            x = residual
        out = self.weight * F.rms_norm(x.float(), self.shape, eps=self.eps).to(x.dtype)
        return out if residual is None else (out, residual)
