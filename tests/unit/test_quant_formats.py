"""Quantized checkpoints (GPTQ, AWQ, compressed-tensors) load into the native engine: the
layouts unpack to the values they hold, the engine computes what the dequantized weights
compute (greedy tokens equal transformers' on them), shards respect groups, and a bad
checkpoint is refused at start with a message.

One file, though long: the three formats share the checkpoint writers and the reference
they are checked against.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from plurai.gpu_workers.engine.sampling_params import SamplingParams
from plurai.gpu_workers.layers.quant_linear import QuantLinear
from plurai.gpu_workers.models import quant_formats as qf
from tests.quant_checkpoints import AWQ_ORDER, pack, write

MAX_TOKENS = 16
CPU = torch.device("cpu")


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(16, 2048) for _ in range(n)] for n in (1, 7, 30, 70)]


def test_unpack_gives_the_values_packed_lowest_bits_first():
    # 4-bit: nibble i of 0x76543210 holds i
    assert qf.unpack(torch.tensor([[0x76543210]], dtype=torch.int32), 4, 1).tolist() == [
        list(range(8))
    ]
    # 0xFEDCBA98 as an int32: nibbles 8..15, the top one setting the sign bit
    top = torch.tensor([[0xFEDCBA98 - (1 << 32)]], dtype=torch.int32)
    assert qf.unpack(top, 4, 1).tolist() == [list(range(8, 16))]
    # 8-bit, along dim 0: each int32 of a column holds 4 rows
    col = torch.tensor([[0x04030201], [0x807F0605 - (1 << 32)]], dtype=torch.int32)
    assert qf.unpack(col, 8, 0)[:, 0].tolist() == [1, 2, 3, 4, 5, 6, 0x7F, 0x80]
    # the tests' own packer is its inverse
    u = torch.randint(0, 16, (6, 32))
    assert torch.equal(qf.unpack(pack(u, 4), 4, 1).long(), u)


def _layer(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    method: str,
    g_idx: torch.Tensor | None = None,
) -> qf.QWeight:
    """One layer in a format's tensors, decoded."""
    n, k = codes.shape
    group = k // scales.shape[1]
    if method == "awq":
        idx = torch.tensor([c * 8 + AWQ_ORDER[i] for c in range(n // 8) for i in range(8)])
        parts = {
            "qweight": pack(codes.t()[:, idx], 4),
            "qzeros": pack(zeros.t()[:, idx], 4),
            "scales": scales.t().half(),
        }
        s = qf.Scheme("awq", 4, group, False, fmt="gemm")
    else:
        parts = {
            "qweight": pack(codes, 4).t(),
            "qzeros": pack((zeros - 1).t() & 15, 4),
            "scales": scales.t().half(),
        }
        if g_idx is not None:
            parts["g_idx"] = g_idx.int()
        s = qf.Scheme("gptq", 4, group, False, act_order=g_idx is not None, fmt="gptq")
    [(name, w)] = list(qf.decode(((f"l.{p}", t) for p, t in parts.items()), s))
    assert name == "l.weight"
    return w


def test_awq_and_gptq_layouts_unpack_to_known_values():
    # 16 output rows, 64 input columns, groups of 32: code of row n, column k = (n + k) % 16
    n, k = 16, 64
    codes = (torch.arange(n)[:, None] + torch.arange(k)[None, :]) % 16
    zeros = torch.tensor([[3, 12]] * n)
    scales = torch.tensor([[0.5, 0.25]] * n)
    want = (codes - zeros[:, torch.arange(k) // 32]).float() * scales[:, torch.arange(k) // 32]
    for method in ("awq", "gptq"):
        w = _layer(codes, scales, zeros, method)
        assert w.codes.tolist() == (codes - 8).tolist()  # stored signed
        assert torch.equal(w.dequantize(), want), method


def test_gptq_act_order_groups_follow_g_idx():
    n, k = 16, 64
    g_idx = torch.arange(k) % 2  # columns alternate between the two groups
    codes = torch.randint(0, 16, (n, k))
    zeros = torch.randint(0, 16, (n, 2))
    scales = torch.rand(n, 2) + 0.5
    w = _layer(codes, scales, zeros, "gptq", g_idx)
    assert w.g_idx is not None
    want = (codes - zeros[:, g_idx]).float() * scales.half().float()[:, g_idx]
    assert torch.equal(w.dequantize(), want)
    # on the kernel: the layer permutes its inputs so that each group is contiguous
    layer = QuantLinear(k, n, False, qf.Scheme("gptq", 4, 32, False, act_order=True))
    layer.put(0, w)
    layer.finish(torch.float32, CPU)
    assert layer.kind == "int4" and layer.perm is not None
    x = torch.randn(5, k)
    torch.testing.assert_close(layer(x), x @ want.t(), rtol=1e-4, atol=1e-4)


CASES = [
    ("compressed-tensors", dict(bits=4, group=32)),
    ("compressed-tensors", dict(bits=4, group=None)),  # per channel
    ("compressed-tensors", dict(bits=4, group=32, sym=False, act_order=True)),
    ("compressed-tensors", dict(bits=8, group=None)),
    ("gptq", dict(bits=4, group=32, sym=False)),
    ("gptq", dict(bits=4, group=32, act_order=True)),
    ("gptq", dict(bits=8, group=None)),
    ("awq", dict(bits=4, group=32, sym=False)),
]


@pytest.mark.parametrize(("method", "kw"), CASES, ids=[f"{m}-{k}" for m, k in CASES])
def test_greedy_equals_transformers_on_the_dequantized_weights(
    method, kw, model_factory, engine_factory, reference, tmp_path
):
    src = model_factory("qwen2")  # q/k/v bias, GQA: biases stay float beside the codes
    dst = tmp_path / "q"
    ref = write(src, dst, method, **kw)
    engine = engine_factory(dst)
    layers = [m for m in engine.runner.model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 2 * 4  # qkv, o, gate_up, down in each of the 2 layers
    # every layer runs on an integer kernel, none on a dequantized fallback
    assert {m.kind for m in layers} == {"int4" if kw["bits"] == 4 else "int8"}
    got = [
        c.token_ids
        for c in engine.generate(prompts(), SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    ]
    assert got == reference(ref, prompts(), MAX_TOKENS)


def test_bf16_logits_stay_close_to_the_dequantized_model(model_factory, engine_factory, tmp_path):
    src = model_factory("llama")
    dst = tmp_path / "q"
    ref = write(src, dst, "compressed-tensors", bits=4, group=32)
    ps = prompts(1)
    outs = {}
    for name, path in (("q", dst), ("ref", ref)):
        engine = engine_factory(path, dtype="bf16")
        outs[name] = engine.generate(ps, SamplingParams(max_tokens=1, logprobs=5))
    for a, b in zip(outs["q"], outs["ref"], strict=True):
        # the same first token, and its log-probability within bf16's rounding
        assert a.token_ids == b.token_ids
        assert abs(a.logprobs[0]["logprob"] - b.logprobs[0]["logprob"]) < 0.05


def test_row_parallel_shards_keep_whole_groups():
    codes = torch.randint(-8, 8, (16, 128), dtype=torch.int8)
    w = qf.QWeight(codes, torch.rand(16, 4), None, None, 4, 32)
    half = w.columns(64, 64)
    assert half.scales.shape == (16, 2)
    assert torch.equal(half.dequantize(), w.dequantize()[:, 64:])
    with pytest.raises(ValueError, match="group size 32 does not divide"):
        w.columns(48, 48)
    order = qf.QWeight(codes, torch.rand(16, 4), None, torch.randperm(128) // 32, 4, 32)
    with pytest.raises(ValueError, match="act-order"):
        order.columns(0, 64)
    assert torch.equal(w.rows(8, 8).dequantize(), w.dequantize()[8:])


def test_tensor_parallel_ranks_hold_their_slices(model_factory, tmp_path):
    """Each of two ranks' quantized layers dequantizes to its slice of the whole weight."""
    from transformers import AutoConfig

    from plurai.gpu_workers.engine.placement import TP, Stage
    from plurai.gpu_workers.layers.quant_linear import finish_quantized
    from plurai.gpu_workers.models.llama import LlamaForCausalLM
    from plurai.gpu_workers.models.loader import iter_tensors

    src = model_factory("llama")
    dst = tmp_path / "q"
    write(src, dst, "gptq", bits=4, group=32, sym=False)
    cfg = AutoConfig.from_pretrained(str(dst))
    ref = dst.with_name("q-dequantized")
    full = load_file(str(ref / "model.safetensors"))
    whole = {}
    for rank in (0, 1):
        model = LlamaForCausalLM(cfg, 64, TP(rank, 2), Stage(layers=(0, 2)))
        model.load_weights(qf.decode(iter_tensors([dst / "model.safetensors"]), model.quant))
        for m in model.modules():
            if isinstance(m, QuantLinear):  # keep the pieces to compare
                m.keep = {s: p.dequantize() for s, p in m.pieces.items()}
        finish_quantized(model, torch.float32, CPU)
        whole[rank] = model
    down = "model.layers.1.mlp.down_proj.weight"
    halves = [whole[r].layers[1].mlp.down_proj.keep[0] for r in (0, 1)]
    assert torch.equal(torch.cat(halves, dim=1), full[down])  # row parallel: input halves
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(
        torch.cat([whole[r].layers[0].self_attn.qkv_proj.keep[0] for r in (0, 1)]), full[q]
    )


def _broken(tmp_path: Path, src: Path, edit) -> Path:
    dst = tmp_path / "q"
    write(src, dst, "gptq", bits=4, group=32)
    tensors = load_file(str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    edit(tensors, cfg)
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _drop_scales(t: dict, cfg: dict) -> None:
    del t["model.layers.1.mlp.up_proj.scales"]


def _short_scales(t: dict, cfg: dict) -> None:
    name = "model.layers.0.self_attn.o_proj.scales"
    t[name] = t[name][:1].contiguous()


def _nan_scales(t: dict, cfg: dict) -> None:
    t["model.layers.0.mlp.down_proj.scales"][0, 0] = float("nan")


def _bad_g_idx(t: dict, cfg: dict) -> None:
    cfg["quantization_config"]["desc_act"] = True
    t["model.layers.0.mlp.down_proj.g_idx"][3] = 99


def _unknown_method(t: dict, cfg: dict) -> None:
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}


def _fp8(t: dict, cfg: dict) -> None:
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {},
    }


def _three_bits(t: dict, cfg: dict) -> None:
    cfg["quantization_config"]["bits"] = 3


def _dynamic(t: dict, cfg: dict) -> None:  # GPTQModel: layer 1's MLP in 8 bits
    cfg["quantization_config"]["dynamic"] = {r"+:.*\.1\.mlp\..*": {"bits": 8}}


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_drop_scales, r"model\.layers\.1\.mlp\.up_proj is missing scales"),
        (_short_scales, r"o_proj: the scales has shape \(1, 64\), want \(2, 64\)"),
        (_nan_scales, "NaN"),
        (_bad_g_idx, "g_idx names a group outside"),
        (_unknown_method, "quantization 'bitsandbytes' is not supported; supported: compressed"),
        (_fp8, "format 'float-quantized'"),
        (_three_bits, "gptq with 3 bits"),
        (_dynamic, "per-module `dynamic` overrides"),
    ],
)
def test_a_bad_checkpoint_is_refused_at_start(
    edit, message, model_factory, engine_factory, tmp_path
):
    dst = _broken(tmp_path, model_factory("llama"), edit)
    with pytest.raises(ValueError, match=message):
        engine_factory(dst)


def test_w8a8_quantizes_each_row_of_activations():
    """int-quantized W8A8: int8 weights per channel, activations to int8 per token."""
    gen = torch.Generator().manual_seed(0)
    # 48 rows: a pair of blocks of 16 and one alone, as the kernel splits them
    codes = torch.randint(-128, 128, (48, 64), dtype=torch.int8, generator=gen)
    scale = torch.rand(48, 1, generator=gen) / 100
    s = qf.Scheme("compressed-tensors", 8, None, True, act_quant=True, fmt="int-quantized")
    parts = [("l.weight", codes), ("l.weight_scale", scale), ("l.bias", torch.ones(48))]
    decoded = dict(qf.decode(parts, s))
    assert torch.equal(decoded["l.bias"], torch.ones(48))
    from plurai.gpu_workers.kernels import load

    ops = load("auto")
    x = torch.randn(21, 64, generator=gen) * torch.rand(21, 1, generator=gen) * 10
    x[4] = 0.0
    xs = x.abs().amax(1, keepdim=True).clamp(min=1e-8) / 127
    want = ((x / xs).round() * xs) @ (codes.float() * scale).t()
    kinds = {"w8a8"} | ({"native_w8a8"} if getattr(ops, "qlinear_i8", None) else set())
    for kind in kinds:  # torch's _int_mm, and the project's kernel where this CPU has it
        layer = QuantLinear(64, 48, False, s, ops if kind == "native_w8a8" else None)
        layer.put(0, decoded["l.weight"])
        layer.finish(torch.float32, CPU)
        assert layer.kind == kind
        # a rounding of x / scale may land on the other integer: one step of one product
        torch.testing.assert_close(layer(x), want, rtol=0, atol=float(xs.max() * scale.max()))
        got = layer(x.bfloat16()).float()
        assert ((got - want).abs().max() / want.abs().max()).item() < 2e-2


@pytest.mark.parametrize(
    ("bits", "group", "zeros"), [(8, None, False), (8, 32, True), (4, 32, True), (4, None, False)]
)
def test_the_native_kernel_computes_the_dequantized_matmul(bits, group, zeros):
    from plurai.gpu_workers.kernels import load

    ops = load("auto")
    if getattr(ops, "qlinear", None) is None:
        pytest.skip("the native kernels have no qlinear on this CPU (it needs AVX512-BF16)")
    gen = torch.Generator().manual_seed(bits + (group or 0))
    n, k = 48, 128
    lo = -(1 << (bits - 1))
    codes = torch.randint(lo, -lo, (n, k), dtype=torch.int8, generator=gen)
    groups = k // (group or k)
    w = qf.QWeight(
        codes,
        torch.rand(n, groups, generator=gen) / 20 + 0.01,
        torch.randint(lo // 4, -lo // 4, (n, groups), dtype=torch.int8, generator=gen)
        if zeros
        else None,
        None,
        bits,
        group,
    )
    layer = QuantLinear(k, n, True, qf.Scheme("x", bits, group, not zeros), ops)
    layer.bias.data = torch.randn(n, generator=gen)
    layer.put(0, w)
    layer.finish(torch.bfloat16, CPU)
    assert layer.kind == "native"
    ref_w = w.dequantize()
    for m in (1, 3, 4, 5, 16, 17, 40):  # a few rows in registers; tiles of 16 and the rest
        x = torch.randn(m, k, generator=gen).bfloat16()
        want = x.float() @ ref_w.t() + layer.bias.float()
        got = layer(x).float()
        assert got.shape == (m, n)
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-2, m


@pytest.mark.parametrize(("scheme", "group"), [("w8a16", None), ("w4a16", 32)])
def test_plurai_quantize_checkpoints_match_transformers_loading_them(
    scheme, group, model_factory, engine_factory, reference, tmp_path
):
    """`plurai quantize`'s files, read by the engine and by transformers (which decompresses
    them with the compressed-tensors package): the same greedy tokens."""
    from plurai.gpu_workers.models.quantize import quantize

    dst = tmp_path / scheme
    quantize(model_factory("qwen3"), dst, scheme, group)
    engine = engine_factory(dst)
    assert {m.kind for m in engine.runner.model.modules() if isinstance(m, QuantLinear)} == {
        "int8" if scheme == "w8a16" else "int4"
    }
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    got = [c.token_ids for c in engine.generate(prompts(2), params)]
    assert got == reference(dst, prompts(2), MAX_TOKENS)


def test_an_act_order_layer_on_its_dequantized_weight_keeps_the_input_order():
    """Groups of 16 fit no integer kernel: the layer runs on its dequantized weight, whose
    columns are in the checkpoint's order, so the inputs must not be permuted."""
    gen = torch.Generator().manual_seed(3)
    n, k = 16, 64
    g_idx = torch.randperm(k, generator=gen) // 16
    w = qf.QWeight(
        torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=gen),
        torch.rand(n, 4, generator=gen),
        None,
        g_idx,
        4,
        16,
    )
    layer = QuantLinear(k, n, False, qf.Scheme("gptq", 4, 16, True, act_order=True))
    layer.put(0, w)
    layer.finish(torch.float32, CPU)
    assert layer.kind == "float" and layer.perm is None
    x = torch.randn(3, k, generator=gen)
    torch.testing.assert_close(layer(x), x @ w.dequantize().t())


@pytest.mark.parametrize("actorder", ["group", "GROUP", "dynamic", True])
def test_compressed_tensors_act_order_spellings(actorder):
    cfg = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "g": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": 32,
                    "actorder": actorder,
                },
            }
        },
    }
    assert qf.scheme(type("C", (), {"quantization_config": cfg})()).act_order


def _quantized_lm_head(t: dict, cfg: dict) -> None:
    w = t.pop("lm_head.weight") if "lm_head.weight" in t else t["model.embed_tokens.weight"]
    n, k = w.shape
    t["lm_head.qweight"] = torch.zeros(k // 8, n, dtype=torch.int32)
    t["lm_head.qzeros"] = torch.zeros(k // 32, n // 8, dtype=torch.int32)
    t["lm_head.scales"] = torch.ones(k // 32, n, dtype=torch.float16)
    t["lm_head.g_idx"] = (torch.arange(k) // 32).int()


def test_a_quantized_lm_head_is_refused_with_why(model_factory, engine_factory, tmp_path):
    dst = _broken(tmp_path, model_factory("llama"), _quantized_lm_head)
    with pytest.raises(ValueError, match="lm_head.weight is quantized; the native engine"):
        engine_factory(dst)


def test_zero_points_out_of_range_are_refused():
    s = qf.Scheme("compressed-tensors", 8, None, False, act_quant=True, fmt="int-quantized")
    parts = [
        ("l.weight", torch.zeros(16, 32, dtype=torch.int8)),
        ("l.weight_scale", torch.ones(16, 1)),
        ("l.weight_zero_point", torch.full((16, 1), 300, dtype=torch.int32)),
    ]
    with pytest.raises(ValueError, match=r"l: weight_zero_point must hold integers in -128..127"):
        list(qf.decode(parts, s))


def test_each_layer_is_packed_as_its_last_piece_arrives(model_factory, tmp_path, monkeypatch):
    """A load holds the unpacked codes (a byte a weight) of about one layer at a time, not of
    the whole model until the end (twice an int4 model's served size)."""
    from transformers import AutoConfig

    from plurai.gpu_workers.models.loader import build_model

    src = model_factory("llama")
    dst = tmp_path / "q"
    write(src, dst, "gptq", bits=4, group=32)
    holding: set[int] = set()
    most = [0]
    put, finish = QuantLinear.put, QuantLinear.finish

    def tracked_put(self, *args, **kw):
        put(self, *args, **kw)
        if self.pieces:
            holding.add(id(self))
        most[0] = max(most[0], len(holding))

    def tracked_finish(self, *args, **kw):
        holding.discard(id(self))
        finish(self, *args, **kw)

    monkeypatch.setattr(QuantLinear, "put", tracked_put)
    monkeypatch.setattr(QuantLinear, "finish", tracked_finish)
    model = build_model(dst, AutoConfig.from_pretrained(str(dst)), torch.float32, CPU, 64)
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 8 and all(m.kind == "int4" and not m.pieces for m in layers)
    assert most[0] <= 2, most  # q/k/v or gate/up waiting for their last piece
