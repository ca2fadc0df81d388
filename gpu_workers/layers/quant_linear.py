"""A linear layer with quantized weights, run on integer CPU kernels.

Its weight arrives as `QWeight` pieces (a fused layer such as qkv_proj gets one per
checkpoint tensor, stacked along the output dimension); `finish` turns them into the
form of the kernel that serves the scheme:
- bf16 activations on a CPU with AVX512-BF16, weights of 4 or 8 bits (any group size,
  zero points or not): the project's `qlinear` (gpu_workers/kernels/cpu.cpp), which
  dequantizes each weight once a step and multiplies all the step's rows with it (torch's
  kernels below redo that per row: 2-3x slower than bf16 at 32 rows);
- 4-bit: `_weight_int4pack_mm_for_cpu` (groups of 32-256 input columns; act-order
  checkpoints have their input columns permuted so that groups are contiguous);
- 8-bit, weight only (symmetric, per channel): `_weight_int8pack_mm`;
- 8-bit weights and activations (W8A8): activations quantized per token, then the
  project's `qlinear_i8` (AVX512-VNNI: 64 products an instruction) or `torch._int_mm`.
Anything these do not take (groups under 32, other devices, a layer the checkpoint left
partly unquantized) runs on the dequantized weight, with a log line saying why.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from plurai.gpu_workers.kernels import cpu_flags
from plurai.gpu_workers.layers.linear import Linear
from plurai.gpu_workers.models.quant_formats import QWeight, Scheme

log = logging.getLogger(__name__)

INT4_GROUPS = (256, 128, 64, 32)  # the group sizes the int4 kernel takes
# qlinear_i8's vpdpbusd: every CPU with AVX512-BF16 known has it, but a VM may mask it
VNNI = "avx512_vnni" in cpu_flags()


class QuantLinear(nn.Module):
    def __init__(
        self, in_features: int, out_features: int, bias: bool, scheme: Scheme, ops=None
    ) -> None:
        super().__init__()
        self.ops = ops  # the fused CPU kernels, or None
        self.in_features = in_features
        self.out_features = out_features
        self.scheme = scheme
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        self.pieces: dict[int, QWeight | torch.Tensor] = {}  # first output row -> piece
        self.kind = ""  # native | native_w8a8 | int4 | int8 | w8a8 | float, once finished
        self.perm: torch.Tensor | None = None  # act-order: the input columns' order
        # (dtype, device, name) to finish with as soon as every row has arrived, so that a
        # model's load holds the unpacked codes of about one layer at a time
        self.target: tuple[torch.dtype, torch.device, str] | None = None

    def put(self, start: int, w: QWeight | torch.Tensor, name: str = "") -> None:
        """Rows [start, start + len(w)) of the weight (`name`: the checkpoint's, for errors)."""
        rows, cols = w.shape
        if cols != self.in_features or start + rows > self.out_features:
            raise ValueError(
                f"checkpoint: {name or 'a weight'} of shape {tuple(w.shape)} at row {start} "
                f"does not fit its {self.out_features}x{self.in_features} layer"
            )
        self.pieces[start] = w
        if self.target and sum(p.shape[0] for p in self.pieces.values()) >= self.out_features:
            self.finish(*self.target)

    def finish(self, dtype: torch.dtype, device: torch.device, name: str = "") -> None:
        """Builds the kernel's tensors from the pieces (all present: the loader checks), on
        the model's device."""
        starts = sorted(self.pieces)
        parts = [self.pieces[s] for s in starts]
        ends = [s + p.shape[0] for s, p in zip(starts, parts, strict=True)]
        if not starts or starts[0] != 0 or starts[1:] != ends[:-1] or ends[-1] != self.out_features:
            raise ValueError(
                f"{name}: checkpoint pieces of rows {list(zip(starts, ends, strict=True))} do "
                f"not make its {self.out_features} rows"
            )
        self.pieces = {}
        if all(isinstance(p, QWeight) for p in parts):
            q = _stack(parts)  # type: ignore[arg-type]
            why = q if isinstance(q, str) else self._use_kernel(q, dtype, device)
            if not why:
                return
            self.perm = None  # the dequantized weight below keeps the checkpoint's order
        else:
            why = "the checkpoint left part of it unquantized"
        log.info("%s runs on its dequantized weight: %s", name or "a quantized linear", why)
        w = torch.cat([p.dequantize() if isinstance(p, QWeight) else p.float() for p in parts])
        self.weight = w.to(device=device, dtype=dtype)
        self.kind = "float"

    def _use_kernel(self, q: QWeight, dtype: torch.dtype, device: torch.device) -> str:
        """Sets up the kernel for q; returns why none serves it ('' when one does)."""
        if device.type != "cpu":
            return f"no integer kernel on {device.type} here"
        n, k = q.shape
        if (
            q.act_quant
            and getattr(self.ops, "qlinear_i8", None) is not None
            and VNNI
            and n % 16 == 0
            and k % 16 == 0
        ):
            self.q_codes = (
                q.codes.view(n // 16, 16, k // 4, 4).permute(0, 2, 1, 3).reshape(n // 16, -1, 64)
            ).contiguous()
            self.q_sum = q.codes.sum(dim=1, dtype=torch.int32)
            self.w_scale = q.scales[:, 0].contiguous()
            self.kind = "native_w8a8"
            return ""
        if q.act_quant:
            self.w8 = q.codes.t().contiguous()  # [in, out], as _int_mm takes it
            self.w_scale = q.scales[:, 0].contiguous()
            self.kind = "w8a8"
            return ""
        if q.g_idx is not None:
            size = q.group_size or k
            if not bool((torch.bincount(q.groups(), minlength=q.scales.shape[1]) == size).all()):
                return "act-order groups of unequal sizes"
            self.perm = torch.argsort(q.groups(), stable=True)
            q = QWeight(q.codes[:, self.perm], q.scales, q.zeros, None, q.bits, q.group_size)
        if self._use_native(q, dtype):
            return ""
        if q.bits == 8:
            if q.zeros is not None or q.group_size is not None:
                return "8-bit weights run on the kernel only when symmetric and per channel"
            self.w8 = q.codes.contiguous()
            self.w_scale = q.scales[:, 0].to(dtype)
            self.kind = "int8"
            return ""
        size = q.group_size or k
        group = next((g for g in INT4_GROUPS if size % g == 0), 0)
        if not group or n % 16:
            return f"the int4 kernel takes groups of 32-256 and rows in 16s ({size}, {n})"
        g = q.groups()
        codes, scales = q.codes, q.scales
        zeros = q.zeros if q.zeros is not None else torch.zeros_like(scales, dtype=torch.int8)
        # the kernel's form: w = (u - 8) * s + offset, u = code + 8, offset = -zero * s
        per = g[::group]  # the checkpoint group of each kernel group
        s = scales[:, per]
        z = -zeros[:, per].float() * s
        self.w4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            (codes.to(torch.int32) + 8).contiguous(), 1
        )
        self.w4_group = group
        self.w4_sz = torch.stack([s, z], dim=-1).transpose(0, 1).contiguous().to(dtype)
        self.kind = "int4"
        return ""

    def _use_native(self, q: QWeight, dtype: torch.dtype) -> bool:
        """The project's kernel, where it serves q: codes of 16 rows at a time, input
        columns in pairs (as vdpbf16ps reads them), each group's scale and offset spread
        over a pair row of 32 values."""
        n, k = q.shape
        group = q.group_size or k
        if getattr(self.ops, "qlinear", None) is None or dtype != torch.bfloat16:
            return False
        if n % 16 or k % 2 or group % 2:
            return False
        codes = q.codes.view(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).reshape(n // 16, -1, 32)
        zeros = q.zeros.float() if q.zeros is not None else torch.zeros_like(q.scales)
        if q.bits == 4:  # stored as u = code + 8, two to a byte
            u = (codes.to(torch.int16) + 8).to(torch.uint8)
            codes = u[..., 0::2] | (u[..., 1::2] << 4)
            zeros = zeros + 8
        groups = q.scales.shape[1]

        def spread(t: torch.Tensor) -> torch.Tensor:  # [n, groups] -> [n/16, groups, 32]
            return t.view(n // 16, 16, groups).permute(0, 2, 1).repeat_interleave(2, dim=-1)

        self.q_codes = codes.contiguous()
        self.q_affine = torch.stack(
            [spread(q.scales), spread(-zeros * q.scales)], dim=2
        ).contiguous()
        self.q_bits, self.q_group = q.bits, group
        self.kind = "native"
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if self.perm is not None:
            x = x.index_select(1, self.perm)
        if self.kind == "native":
            y = self.ops.qlinear(
                x.contiguous(), self.q_codes, self.q_affine, self.q_bits, self.q_group
            )
        elif self.kind == "native_w8a8":
            y = self.ops.qlinear_i8(x.contiguous(), self.q_codes, self.q_sum, self.w_scale)
        elif self.kind == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.w4, self.w4_group, self.w4_sz)
        elif self.kind == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x, self.w8, self.w_scale)
        elif self.kind == "w8a8":
            y = _int8_matmul(x, self.w8, self.w_scale)
        else:
            y = F.linear(x, self.weight)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)


def _int8_matmul(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """x @ w with x quantized to int8 per row (symmetric, its absolute max to 127)."""
    xf = x.float()
    x_scale = xf.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127
    xq = (xf / x_scale).round_().clamp_(-128, 127).to(torch.int8)
    return (torch._int_mm(xq, w8) * (x_scale * w_scale)).to(x.dtype)


def _stack(parts: list[QWeight]) -> QWeight | str:
    """Pieces of one layer stacked along the output dimension; why they cannot be, if not."""
    first = parts[0]
    for p in parts[1:]:
        if (p.bits, p.group_size, p.act_quant) != (first.bits, first.group_size, first.act_quant):
            return "the pieces of this fused layer are quantized differently"
        if (p.g_idx is None) != (first.g_idx is None) or (
            p.g_idx is not None and not torch.equal(p.g_idx, first.g_idx)
        ):
            return "the pieces of this fused layer have different act-order groups"
    if len(parts) == 1:
        return first
    zeros = None
    if any(p.zeros is not None for p in parts):
        zeros = torch.cat(
            [
                p.zeros if p.zeros is not None else torch.zeros_like(p.scales, dtype=torch.int8)
                for p in parts
            ]
        )
    return QWeight(
        torch.cat([p.codes for p in parts]),
        torch.cat([p.scales for p in parts]),
        zeros,
        first.g_idx,
        first.bits,
        first.group_size,
        first.act_quant,
    )


def make_linear(
    in_features: int, out_features: int, bias: bool, scheme: Scheme | None, ops=None
) -> nn.Module:
    if scheme is None:
        return Linear(in_features, out_features, bias=bias)
    return QuantLinear(in_features, out_features, bias, scheme, ops)


def start_quantized(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Before loading: each quantized layer finishes as its last piece arrives."""
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear):
            m.target = (dtype, device, name)


def finish_quantized(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """After loading: the layers not finished yet (all of them without start_quantized;
    with it, those missing pieces, which finish refuses)."""
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear) and (m.pieces or not m.kind):
            m.finish(dtype, device, name)
