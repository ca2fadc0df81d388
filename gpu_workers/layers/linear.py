"""Linear layers with CPU weights packed once for oneDNN.

`F.linear` on CPU hands the plain row-major weight to the BLAS on every call, which
re-lays it out as it goes. Packing it once into oneDNN's blocked layout makes the same
matmul 1.4-2.4x faster here, most of all at the small batches of decode steps, where a
step is bound by how fast weights stream in from memory. CUDA and builds without oneDNN
keep `F.linear`.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)


class Linear(nn.Linear):
    packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def pack(self, keep_weight: bool) -> None:
        """Packs the weight; frees the plain copy unless something else reads it (a tied
        embedding)."""
        w = self.weight.detach()
        # the layout is chosen for a batch size; 32 suits decode batches of 2-512 rows
        # (fp32 decode steps of 4-32 rows run 25-30% faster than with a layout for 1)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, 32)
        if not keep_weight:
            self.weight.data = torch.empty(0, dtype=w.dtype)


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """True where the packed path exists and agrees with `F.linear` (checked once on a small
    random layer, so an unusual build falls back instead of computing something else)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        layer = Linear(64, 48, bias=True, dtype=dtype)
        nn.init.normal_(layer.weight, std=0.1, generator=gen)
        nn.init.normal_(layer.bias, std=0.1, generator=gen)
        x = torch.randn(3, 64, generator=gen).to(dtype)
        want = layer(x)
        layer.pack(keep_weight=True)
        got = layer(x)
    except (RuntimeError, AttributeError) as e:  # op missing or dtype not supported
        log.info("packed CPU linear not available (%s); using F.linear", e)
        return False
    return torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def pack_linears(model: nn.Module) -> None:
    """Packs every `Linear` of a loaded CPU model."""
    shared = {
        id(p)
        for m in model.modules()
        if not isinstance(m, Linear)
        for p in m.parameters(recurse=False)
    }
    for m in model.modules():
        if isinstance(m, Linear):
            m.pack(keep_weight=id(m.weight) in shared)
