"""Quantized checkpoint formats: which one a config names, and each linear's tensors
decoded into one form the engine loads (`QWeight`).

Supported (anything else is refused at start, naming these):
- compressed-tensors: int weights of 4 or 8 bits, per group or per output channel,
  symmetric or not, with or without act-order (`weight_g_idx`), "pack-quantized" (W4A16,
  W8A16) or "int-quantized"/"naive-quantized" (W8A8 with activations quantized per token
  at run time);
- GPTQ: 4 or 8 bits (`qweight` packed along the input dimension), any group size or per
  channel, symmetric or not, act-order (`desc_act`), checkpoint formats v1 and v2;
- AWQ: 4 bits, GEMM layout (`qweight` packed along the output dimension, AWQ's nibble
  order), with zero points.

Every tensor is checked against the layer's shape before use: a checkpoint is as
untrusted as any other input.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

SUPPORTED = (
    "compressed-tensors (int weights of 4 or 8 bits: pack-quantized W4A16/W8A16, "
    "int-quantized W8A8 with dynamic per-token activations), gptq (4 or 8 bits), "
    "awq (4 bits, GEMM layout)"
)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output column each nibble of an int32 holds


@dataclass(frozen=True)
class Scheme:
    """How a checkpoint's linears are quantized."""

    method: str  # compressed-tensors | gptq | awq
    bits: int  # 4 or 8
    group_size: int | None  # None: one scale per output channel
    symmetric: bool
    act_quant: bool = False  # W8A8: activations quantized per token at run time
    act_order: bool = False  # groups given per input column (g_idx)
    fmt: str = ""  # compressed-tensors' format, GPTQ's checkpoint format, AWQ's version


@dataclass
class QWeight:
    """One linear's quantized weight: w[n, k] = (codes[n, k] - zeros[n, g]) * scales[n, g],
    g = g_idx[k] (k // group_size without act-order). Codes are signed: -8..7 or
    -128..127."""

    codes: torch.Tensor  # int8 [out, in]
    scales: torch.Tensor  # float32 [out, groups]
    zeros: torch.Tensor | None  # int8 [out, groups]; None: symmetric
    g_idx: torch.Tensor | None  # int64 [in]; None: groups in order
    bits: int
    group_size: int | None
    act_quant: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]

    def groups(self) -> torch.Tensor:
        """The group of each input column."""
        k = self.codes.shape[1]
        if self.g_idx is not None:
            return self.g_idx
        size = self.group_size or k
        return torch.arange(k) // size

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        g = self.groups()
        codes = self.codes.float()
        if self.zeros is not None:
            codes = codes - self.zeros.float()[:, g]
        return (codes * self.scales[:, g]).to(dtype)

    def rows(self, start: int, length: int) -> QWeight:
        """Output rows [start, start+length): a column-parallel shard."""
        return replace(
            self,
            codes=self.codes.narrow(0, start, length),
            scales=self.scales.narrow(0, start, length),
            zeros=None if self.zeros is None else self.zeros.narrow(0, start, length),
        )

    def columns(self, start: int, length: int) -> QWeight:
        """Input columns [start, start+length): a row-parallel shard. Its groups must lie
        whole inside it."""
        k = self.codes.shape[1]
        if self.g_idx is not None and length != k:
            raise ValueError(
                "act-order (g_idx) weights do not split by input columns over tensor-parallel "
                "ranks; serve this checkpoint with tensor_parallel=1 or without act-order"
            )
        if self.group_size is None:  # per channel: every shard keeps the scales
            return replace(self, codes=self.codes.narrow(1, start, length))
        size = self.group_size
        if start % size or length % size:
            raise ValueError(
                f"group size {size} does not divide the tensor-parallel split of {k} input "
                f"columns ({length} a rank): use fewer ranks or a smaller group size"
            )
        g0, gn = start // size, length // size
        return replace(
            self,
            codes=self.codes.narrow(1, start, length),
            scales=self.scales.narrow(1, g0, gn),
            zeros=None if self.zeros is None else self.zeros.narrow(1, g0, gn),
        )


def scheme(cfg: Any) -> Scheme | None:
    """The checkpoint's quantization from its HF config; None when it has none."""
    qc = getattr(cfg, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
    method = str(qc.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "gptq":
        return _gptq(qc)
    if method == "awq":
        return _awq(qc)
    raise ValueError(f"quantization {method or '?'!r} is not supported; supported: {SUPPORTED}")


def _refuse(why: str) -> ValueError:
    return ValueError(f"quantization_config: {why}; supported: {SUPPORTED}")


def _group(size: Any) -> int | None:
    if size is None or size == -1:
        return None
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise _refuse(f"group_size {size!r} is not a positive integer or -1")
    return size


def _compressed_tensors(qc: dict[str, Any]) -> Scheme:
    fmt = qc.get("format")
    if fmt not in ("pack-quantized", "int-quantized", "naive-quantized"):
        raise _refuse(f"compressed-tensors format {fmt!r}")
    if qc.get("quantization_status", "compressed") != "compressed":
        raise _refuse(f"quantization_status {qc.get('quantization_status')!r} (want compressed)")
    if qc.get("kv_cache_scheme"):
        raise _refuse("a quantized KV cache (kv_cache_scheme)")
    if qc.get("sparsity_config"):
        raise _refuse("sparse weights (sparsity_config)")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _refuse("no config_groups")
    found = set()
    for name, g in groups.items():
        if not isinstance(g, dict):
            raise _refuse(f"config group {name!r} is not an object")
        w = g.get("weights") or {}
        a = g.get("input_activations")
        if g.get("output_activations"):
            raise _refuse("quantized output activations")
        if g.get("format") not in (None, fmt):
            raise _refuse(f"config group {name!r} has its own format {g.get('format')!r}")
        if w.get("type", "int") != "int" or w.get("num_bits") not in (4, 8):
            raise _refuse(f"weights of type {w.get('type')!r} with {w.get('num_bits')!r} bits")
        strategy = w.get("strategy")
        if strategy not in ("group", "channel"):
            raise _refuse(f"weight strategy {strategy!r} (want group or channel)")
        size = _group(w.get("group_size")) if strategy == "group" else None
        if strategy == "group" and size is None:
            raise _refuse("group strategy without a group_size")
        act = False
        if a:
            if not (
                a.get("type", "int") == "int"
                and a.get("num_bits") == 8
                and a.get("strategy") == "token"
                and a.get("dynamic") is True
                and a.get("symmetric", True) is True
            ):
                raise _refuse(f"input activations {a!r} (only int8, per token, dynamic)")
            if w.get("num_bits") != 8 or strategy != "channel" or not w.get("symmetric", True):
                raise _refuse("int8 activations need int8 symmetric per-channel weights")
            act = True
        # act-order with a g_idx per column: "group" (or its alias "dynamic", or true)
        order = w.get("actorder")
        order = order is True or (isinstance(order, str) and order.lower() in ("group", "dynamic"))
        found.add((w["num_bits"], size, bool(w.get("symmetric", True)), act, order))
    if len(found) != 1:
        raise _refuse("config groups that quantize layers differently")
    bits, size, sym, act, order = found.pop()
    if act and fmt == "pack-quantized":
        raise _refuse("int8 activations with pack-quantized weights")
    if not act and fmt != "pack-quantized":
        raise _refuse(f"weight-only quantization in format {fmt!r} (want pack-quantized)")
    return Scheme("compressed-tensors", bits, size, sym, act, order, fmt)


def _gptq(qc: dict[str, Any]) -> Scheme:
    bits = qc.get("bits")
    if bits not in (4, 8):
        raise _refuse(f"gptq with {bits!r} bits")
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse(f"gptq checkpoint_format {fmt!r}")
    if qc.get("dynamic"):  # GPTQModel's per-module overrides of bits, groups, skipped layers
        raise _refuse(
            "gptq with per-module `dynamic` overrides (every layer must share one scheme)"
        )
    return Scheme(
        "gptq",
        bits,
        _group(qc.get("group_size")),
        bool(qc.get("sym", True)),
        act_order=bool(qc.get("desc_act", False)),
        fmt=fmt,
    )


def _awq(qc: dict[str, Any]) -> Scheme:
    bits = qc.get("bits", qc.get("w_bit"))
    version = str(qc.get("version", "gemm")).lower()
    if bits != 4 or version != "gemm":
        raise _refuse(f"awq with {bits!r} bits, version {version!r} (want 4 bits, gemm)")
    size = _group(qc.get("group_size", qc.get("q_group_size")))
    if size is None or not qc.get("zero_point", True):
        raise _refuse("awq without a group_size or without zero points")
    return Scheme("awq", 4, size, symmetric=False, fmt=version)


# each quantized linear's tensors, by format: (always, zero points, act-order's groups)
PARTS = {
    "pack-quantized": (
        {"weight_packed", "weight_scale", "weight_shape"},
        "weight_zero_point",
        "weight_g_idx",
    ),
    "int-quantized": ({"weight", "weight_scale"}, "weight_zero_point", "weight_g_idx"),
    "gptq": ({"qweight", "qzeros", "scales"}, "", "g_idx"),
    "awq": ({"qweight", "qzeros", "scales"}, "", ""),
}


def decode(
    tensors: Iterable[tuple[str, torch.Tensor]], s: Scheme
) -> Iterator[tuple[str, torch.Tensor | QWeight]]:
    """The checkpoint's tensors with each quantized linear's parts replaced by one
    `<linear>.weight` QWeight; every other tensor passes through. A part the scheme does
    not use (zero points of symmetric weights, groups in order) is dropped."""
    key = s.fmt if s.method == "compressed-tensors" else s.method
    if key == "naive-quantized":
        key = "int-quantized"
    always, zero, order = PARTS[key]
    need = (
        always
        | ({zero} if zero and not s.symmetric else set())
        | ({order} if s.act_order else set())
    )
    known = always | {zero, order} - {""}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors:
        prefix, _, part = name.rpartition(".")
        if part not in known or (part == "weight" and t.dtype != torch.int8):
            yield name, t  # not a quantized linear's (a float weight: one left unquantized)
            continue
        if part not in need:
            continue
        parts = pending.setdefault(prefix, {})
        parts[part] = t
        if need <= parts.keys():
            yield f"{prefix}.weight", _one(prefix, pending.pop(prefix), s, key)
    for prefix, parts in pending.items():
        missing = sorted(need - parts.keys())
        raise ValueError(f"checkpoint: {prefix} is missing {', '.join(missing)}")


def _one(prefix: str, parts: dict[str, torch.Tensor], s: Scheme, key: str) -> QWeight:
    try:
        if key == "pack-quantized":
            return _from_packed(parts, s)
        if key == "int-quantized":
            return _from_int(parts, s)
        if key == "gptq":
            return _from_gptq(parts, s)
        return _from_awq(parts, s)
    except (ValueError, RuntimeError, IndexError) as e:
        raise ValueError(f"checkpoint: {prefix}: {e}") from None


def unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned codes from int32s holding 32/bits each, lowest bits first, along `dim`."""
    if packed.dtype != torch.int32:
        raise ValueError(f"packed weights are {packed.dtype}, want int32")
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    x = packed.unsqueeze(-1) >> shifts  # [..., per]
    x = (x & ((1 << bits) - 1)).to(torch.int16)
    x = x.flatten(-2) if dim == packed.dim() - 1 else x.movedim(-1, dim + 1).flatten(dim, dim + 1)
    assert x.shape[dim] == packed.shape[dim] * per
    return x


def _check(t: torch.Tensor, shape: tuple[int, ...], what: str) -> torch.Tensor:
    if tuple(t.shape) != shape:
        raise ValueError(f"{what} has shape {tuple(t.shape)}, want {shape}")
    return t


def _groups_of(k: int, size: int | None) -> int:
    if size is None:
        return 1
    if k % size:
        raise ValueError(f"group size {size} does not divide {k} input columns")
    return k // size


def _scales(t: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    t = _check(t, shape, "the scales").float()
    if not torch.isfinite(t).all():
        raise ValueError("the scales hold a NaN or an infinity")
    return t


def _g_idx(t: torch.Tensor | None, k: int, groups: int) -> torch.Tensor | None:
    if t is None:
        return None
    g = _check(t, (k,), "g_idx").long()
    if g.numel() and (g.min() < 0 or g.max() >= groups):
        raise ValueError(f"g_idx names a group outside 0..{groups - 1}")
    if torch.equal(g, torch.arange(k) * groups // k):
        return None  # groups in order: act-order off
    return g


def _from_packed(parts: dict[str, torch.Tensor], s: Scheme) -> QWeight:
    shape = parts["weight_shape"]
    if shape.numel() != 2 or shape.is_floating_point() or shape.dtype == torch.bool:
        raise ValueError("weight_shape must hold 2 integers")
    n, k = (int(v) for v in shape.tolist())
    per = 32 // s.bits
    packed = _check(parts["weight_packed"], (n, -(-k // per)), "weight_packed")
    offset = 1 << (s.bits - 1)
    codes = (unpack(packed, s.bits, 1)[:, :k] - offset).to(torch.int8)
    return _finish(codes, parts, s, offset)


def _from_int(parts: dict[str, torch.Tensor], s: Scheme) -> QWeight:
    w = parts["weight"]
    if w.dtype != torch.int8 or w.dim() != 2:
        raise ValueError(f"weight is {w.dtype} {tuple(w.shape)}, want int8 [out, in]")
    return _finish(w, parts, s, 0)


def _finish(codes: torch.Tensor, parts: dict[str, torch.Tensor], s: Scheme, offset: int) -> QWeight:
    """compressed-tensors' scales [out, groups], zero points (packed along the output
    dimension for pack-quantized) and g_idx."""
    n, k = codes.shape
    groups = _groups_of(k, s.group_size)
    scale = parts["weight_scale"]
    scales = _scales(scale[:, None] if scale.dim() == 1 else scale, (n, groups))
    zeros = None
    if not s.symmetric:
        zp = parts["weight_zero_point"]
        if zp.dtype == torch.int32 and offset:  # packed along the output dimension
            zp = (
                unpack(
                    _check(zp, (-(-n // (32 // s.bits)), groups), "weight_zero_point"), s.bits, 0
                )[:n]
                - offset
            )
        zp = _check(zp[:, None] if zp.dim() == 1 else zp, (n, groups), "weight_zero_point")
        lo = -(1 << (s.bits - 1))
        if zp.is_floating_point() or zp.dtype == torch.bool or zp.min() < lo or zp.max() >= -lo:
            raise ValueError(f"weight_zero_point must hold integers in {lo}..{-lo - 1}")
        zeros = zp.to(torch.int8)
    return QWeight(
        codes,
        scales,
        zeros,
        _g_idx(parts.get("weight_g_idx"), k, groups),
        s.bits,
        s.group_size,
        s.act_quant,
    )


def _from_gptq(parts: dict[str, torch.Tensor], s: Scheme) -> QWeight:
    qweight = parts["qweight"]
    if qweight.dim() != 2:
        raise ValueError("qweight must be 2-D")
    per = 32 // s.bits
    k, n = qweight.shape[0] * per, qweight.shape[1]
    groups = _groups_of(k, s.group_size)
    scales = _scales(parts["scales"], (groups, n)).t().contiguous()
    g_idx = _g_idx(parts.get("g_idx"), k, groups)
    codes = unpack(qweight, s.bits, 0).t()  # [n, k] unsigned
    zeros = unpack(_check(parts["qzeros"], (groups, -(-n // per)), "qzeros"), s.bits, 1)
    zeros = zeros[:, :n].t()
    if s.fmt == "gptq":  # v1 stores each zero point less one
        zeros = (zeros + 1) & ((1 << s.bits) - 1)
    offset = 1 << (s.bits - 1)
    codes = (codes - offset).to(torch.int8).contiguous()
    zeros = (zeros - offset).to(torch.int8)
    if s.symmetric and not zeros.any():
        zeros = None
    return QWeight(codes, scales, zeros, g_idx, s.bits, s.group_size)


def _from_awq(parts: dict[str, torch.Tensor], s: Scheme) -> QWeight:
    qweight = parts["qweight"]
    if qweight.dim() != 2:
        raise ValueError("qweight must be 2-D")
    k, n = qweight.shape[0], qweight.shape[1] * 8
    groups = _groups_of(k, s.group_size)
    order = torch.tensor(AWQ_ORDER).argsort()  # column j of each 8 sits in nibble order[j]

    def columns(t: torch.Tensor) -> torch.Tensor:
        u = unpack(t, 4, 1).view(t.shape[0], -1, 8)
        return u[:, :, order].flatten(1)

    codes = (columns(qweight).t() - 8).to(torch.int8).contiguous()
    zeros = (columns(_check(parts["qzeros"], (groups, n // 8), "qzeros")).t() - 8).to(torch.int8)
    scales = _scales(parts["scales"], (groups, n)).t().contiguous()
    return QWeight(
        codes, scales, None if s.symmetric else zeros.contiguous(), None, 4, s.group_size
    )
