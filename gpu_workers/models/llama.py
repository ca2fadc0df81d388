"""Llama-family decoder for paged attention: Llama 2/3, Mistral, Qwen2, Qwen3.

The families differ only in switches read from the HF config: q/k/v bias (Qwen2),
per-head q/k RMSNorm (Qwen3), rope scaling (Llama 3), tied embeddings, GQA. Tokens are
flattened over the whole batch ([T, hidden]); attention reads the paged cache.
q/k/v and gate/up are packed into one matmul each; `load_weights` packs the
checkpoint's separate tensors.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plurai.gpu_workers.engine.placement import TP, Stage
from plurai.gpu_workers.layers.attention import AttnContext, PagedAttention
from plurai.gpu_workers.layers.linear import Linear
from plurai.gpu_workers.layers.norm import RMSNorm
from plurai.gpu_workers.layers.quant_linear import QuantLinear, make_linear
from plurai.gpu_workers.layers.rotary import Rotary, apply_rotary, rope_params
from plurai.gpu_workers.models.files import NATIVE
from plurai.gpu_workers.models.quant_formats import QWeight, Scheme, scheme

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin for the step's positions


class Attention(nn.Module):
    """Heads are split across tensor-parallel ranks; KV heads too, or replicated when there
    are fewer KV heads than ranks. o_proj is row-parallel: one all-reduce."""

    def __init__(self, cfg: Any, tp: TP, ops: ModuleType | None, quant: Scheme | None) -> None:
        super().__init__()
        self.tp = tp
        self.ops = ops
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        if (
            heads % tp.size
            or (kv_heads >= tp.size and kv_heads % tp.size)
            or (kv_heads < tp.size and tp.size % kv_heads)
        ):
            raise ValueError(
                f"{heads} heads / {kv_heads} KV heads do not split over {tp.size} ranks"
            )
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        self.num_heads = heads // tp.size
        self.num_kv_heads = max(1, kv_heads // tp.size)
        self.q_start = tp.rank * self.num_heads  # first global head of each kind held here
        self.kv_start = tp.rank * kv_heads // tp.size
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = bool(getattr(cfg, "attention_bias", False))
        qkv_bias = bias or cfg.model_type == "qwen2"
        self.qkv_proj = make_linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, qkv_bias, quant, ops
        )
        self.o_proj = make_linear(
            self.q_size, cfg.hidden_size, bias and cfg.model_type != "qwen2", quant, ops
        )
        self.qk_norm = cfg.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, ops)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, ops)
        self.attn = PagedAttention(
            self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5, ops
        )

    def forward(self, x: torch.Tensor, rope: Rope, ctx: AttnContext) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        d = self.head_dim
        if self.ops is not None:  # views into qkv: rotated in place, k and v cached
            q, k, v = (
                t.view(-1, n, d)
                for t, n in zip(
                    qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1),
                    (self.num_heads, self.num_kv_heads, self.num_kv_heads),
                    strict=True,
                )
            )
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            self.ops.rotary_cache(
                q, k, v, *rope, self.attn.k_cache, self.attn.v_cache, ctx.slot_mapping
            )
            o = self.attn(q, k, v, ctx, cached=True)
            return self.tp.all_reduce(self.o_proj(o.flatten(1)))
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        v = v.view(-1, self.num_kv_heads, d)
        if self.qk_norm:
            q, k = qk.split([self.q_size, self.kv_size], dim=-1)
            q = self.q_norm(q.view(-1, self.num_heads, d))
            k = self.k_norm(k.view(-1, self.num_kv_heads, d))
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        else:  # q and k heads rotated in one go: half the small ops
            qk = apply_rotary(qk.view(-1, self.num_heads + self.num_kv_heads, d), *rope)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        o = self.attn(q, k, v, ctx)
        return self.tp.all_reduce(self.o_proj(o.flatten(1)))


class MLP(nn.Module):
    """gate/up column-parallel, down row-parallel: one all-reduce."""

    def __init__(self, cfg: Any, tp: TP, ops: ModuleType | None, quant: Scheme | None) -> None:
        super().__init__()
        self.tp = tp
        self.ops = ops
        bias = bool(getattr(cfg, "mlp_bias", False))
        if cfg.intermediate_size % tp.size:
            raise ValueError(
                f"intermediate_size {cfg.intermediate_size} does not split over {tp.size} ranks"
            )
        self.inter = cfg.intermediate_size // tp.size
        self.gate_up_proj = make_linear(cfg.hidden_size, 2 * self.inter, bias, quant, ops)
        self.down_proj = make_linear(self.inter, cfg.hidden_size, bias, quant, ops)
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (only silu)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.ops is not None:
            return self.tp.all_reduce(self.down_proj(self.ops.silu_mul(gate_up)))
        gate, up = gate_up.split(self.inter, dim=-1)
        return self.tp.all_reduce(self.down_proj(F.silu(gate) * up))


class DecoderLayer(nn.Module):
    """Takes and returns (x, residual): each residual add is done by the norm after it
    (one fused op with the kernels); the first layer's residual is None."""

    def __init__(self, cfg: Any, tp: TP, ops: ModuleType | None, quant: Scheme | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.self_attn = Attention(cfg, tp, ops, quant)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.mlp = MLP(cfg, tp, ops, quant)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope, ctx: AttnContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    # checkpoint name piece -> (packed parameter piece, index of the shard inside it)
    packed = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(
        self,
        cfg: Any,
        max_positions: int,
        tp: TP | None = None,
        stage: Stage | None = None,
        ops: ModuleType | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp = tp or TP()
        self.stage = stage = stage or Stage(layers=(0, cfg.num_hidden_layers))
        # vocab-parallel embedding and lm_head: each rank holds one slice of the rows
        self.vocab = cfg.vocab_size
        self.vocab_local = -(-cfg.vocab_size // tp.size)
        self.vocab_start = tp.rank * self.vocab_local
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        first, end = stage.layers
        # ops: the fused CPU kernels (gpu_workers.kernels), or None for the torch path
        # the decoder's linears are quantized when the checkpoint is (never lm_head)
        self.quant = quant = scheme(cfg)
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp, ops, quant) for _ in range(first, end))
        attn = self.layers[0].self_attn
        self.rotary = Rotary(attn.head_dim, max_positions, rope_params(cfg))
        if stage.first:
            self.embed_tokens = nn.Embedding(self.vocab_local, cfg.hidden_size)
        if stage.last:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
            self.lm_head = Linear(cfg.hidden_size, self.vocab_local, bias=False)
            if self.tied and stage.first:
                self.lm_head.weight = self.embed_tokens.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.embed_tokens(input_ids)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.vocab_local)
        x = self.embed_tokens(local.clamp(0, self.vocab_local - 1)) * mine.unsqueeze(1).to(
            self.embed_tokens.weight.dtype
        )
        return self.tp.all_reduce(x)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: AttnContext,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """This stage's layers: from the tokens on the first stage, else from `hidden`, the
        previous stage's output. The last stage returns normed hidden states."""
        x = self.embed(input_ids) if self.stage.first else hidden
        rope = self.rotary(positions, x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, rope, ctx)
        if self.stage.last:
            return self.norm(x, residual)[0]
        return x + residual

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_last(self.lm_head(hidden).float())[:, : self.vocab]

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.layers]

    @torch.no_grad()
    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor | QWeight]]) -> None:
        """Loads the checkpoint's tensors (a quantized linear's weight as one QWeight)."""
        params = dict(self.named_parameters())
        quantized = {
            f"{n}.weight": m for n, m in self.named_modules() if isinstance(m, QuantLinear)
        }
        loaded: set[str] = set()
        for name, w in tensors:
            name = self._local_name(name.removeprefix("model."))
            if name is None:
                continue
            if isinstance(w, QWeight) and name in ("embed_tokens.weight", "lm_head.weight"):
                raise ValueError(
                    f"checkpoint: {name} is quantized; the native engine takes quantized "
                    "linears in the decoder layers only (lm_head and embeddings float)"
                )
            w = self._shard(name, w)
            for piece, (packed, idx) in self.packed.items():
                if f".{piece}." in name:
                    target = name.replace(piece, packed)
                    offsets = self._packed_offsets(packed)
                    if target in quantized:
                        quantized[target].put(offsets[idx], w, name)
                    elif isinstance(w, QWeight) or target not in params:
                        raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
                    else:
                        params[target].data[offsets[idx] : offsets[idx + 1]].copy_(w)
                    loaded.add(f"{target}#{idx}")
                    break
            else:
                if name in quantized:
                    quantized[name].put(0, w, name)
                    loaded.add(name)
                    continue
                if name.endswith(".bias") and name not in params and not w.any():
                    continue  # a zero bias some GPTQ exports add to layers that have none
                if name not in params or isinstance(w, QWeight):
                    raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
                if params[name].shape != w.shape:  # the last rank's vocab slice is padded
                    params[name].data.zero_()
                    params[name].data[: w.shape[0]].copy_(w)
                else:
                    params[name].data.copy_(w)
                loaded.add(name)
        missing = [n for n in self._expected([*params, *quantized]) if n not in loaded]
        if missing:
            raise ValueError(
                f"checkpoint is missing tensors: {missing[:8]}{' ...' if len(missing) > 8 else ''}"
            )

    def _local_name(self, name: str) -> str | None:
        """The parameter a checkpoint tensor loads into on this stage; None: not held here."""
        if "rotary_emb" in name:
            return None
        if name.startswith("layers."):
            i = int(name.split(".")[1])
            first, end = self.stage.layers
            return f"layers.{i - first}.{name.split('.', 2)[2]}" if first <= i < end else None
        if name == "embed_tokens.weight":
            if self.stage.first:
                return name
            return "lm_head.weight" if self.tied and self.stage.last else None
        if name == "lm_head.weight":
            return name if self.stage.last and not self.tied else None
        if name.startswith("norm."):
            return name if self.stage.last else None
        return name

    def _shard(self, name: str, w: torch.Tensor | QWeight) -> torch.Tensor | QWeight:
        """This rank's part of a checkpoint tensor."""
        tp = self.tp
        if tp.size == 1:
            return w
        a = self.layers[0].self_attn
        d = a.head_dim
        if ".q_proj." in name:
            return _rows(w, a.q_start * d, a.q_size)
        if ".k_proj." in name or ".v_proj." in name:
            return _rows(w, a.kv_start * d, a.kv_size)
        inter = self.layers[0].mlp.inter
        if ".gate_proj." in name or ".up_proj." in name:
            return _rows(w, tp.rank * inter, inter)
        row_parallel = {
            ".o_proj.": (a.q_start * d, a.q_size),
            ".down_proj.": (tp.rank * inter, inter),
        }
        for piece, (start, length) in row_parallel.items():
            if piece in name:
                if name.endswith(".bias"):  # added once: by rank 0, before the all-reduce
                    return w if tp.rank == 0 else torch.zeros_like(w)
                return (
                    w.columns(start, length)
                    if isinstance(w, QWeight)
                    else w.narrow(1, start, length)
                )
        if name in ("embed_tokens.weight", "lm_head.weight"):
            return w[self.vocab_start : self.vocab_start + self.vocab_local]
        return w

    def _packed_offsets(self, packed: str) -> list[int]:
        a = self.layers[0].self_attn
        if packed == "qkv_proj":
            return [0, a.q_size, a.q_size + a.kv_size, a.q_size + 2 * a.kv_size]
        inter = self.layers[0].mlp.inter
        return [0, inter, 2 * inter]

    def _expected(self, params: list[str]) -> list[str]:
        out = []
        for name in params:
            if self.tied and self.stage.first and name == "lm_head.weight":
                continue
            if ".qkv_proj." in name:
                out += [f"{name}#{i}" for i in range(3)]
            elif ".gate_up_proj." in name:
                out += [f"{name}#{i}" for i in range(2)]
            else:
                out.append(name)
        return out


def _rows(w: torch.Tensor | QWeight, start: int, length: int) -> torch.Tensor | QWeight:
    return w.rows(start, length) if isinstance(w, QWeight) else w.narrow(0, start, length)


# HF `architectures` entries this file serves
ARCHITECTURES = dict.fromkeys(NATIVE, LlamaForCausalLM)
