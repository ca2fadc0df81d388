"""`plurai quantize`: the compressed-tensors files it writes (config, tensor names, shapes,
dtypes, the packing bit for bit), the codes and scales compressed-tensors' own quantizer
computes, what is left float, transformers loading the result as the dequantized model,
and the CLI's refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig
from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from plurai.cli.main import main as plurai
from plurai.gpu_workers.models.quantize import SCHEMES, pack, quantize, quantize_weight, unpack

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GROUP = 32  # w4a16 on the tiny models (input sizes 64 and 128): 128 divides not all


# --- packing and rounding, by hand and against compressed-tensors -------------------------


def test_pack_known_values() -> None:
    # 4 bits: code c is stored as c + 8, the first code in the lowest nibble
    lo = torch.tensor([[-8, -7, -6, -5, -4, -3, -2, -1]], dtype=torch.int8)  # nibbles 0..7
    hi = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7]], dtype=torch.int8)  # nibbles 8..15
    assert pack(lo, 4).tolist() == [[0x76543210]]
    assert pack(hi, 4).tolist() == [[0xFEDCBA98 - 2**32]]  # int32: the top bit is the sign
    assert pack(torch.cat([lo, hi], 1), 4).tolist() == [[0x76543210, 0xFEDCBA98 - 2**32]]
    # 8 bits: c + 128, four a word
    assert pack(torch.tensor([[-128, -1, 0, 127]], dtype=torch.int8), 8).tolist() == [
        [0xFF807F00 - 2**32]
    ]
    assert pack(torch.tensor([[1, 2, 3, 4]], dtype=torch.int8), 8).tolist() == [
        [0x84838281 - 2**32]
    ]
    # a row that does not fill its last word: zero bits pad it (as pack_to_int32 pads)
    assert pack(torch.tensor([[7, -8, 0]], dtype=torch.int8), 4).tolist() == [[0x0000_080F]]
    assert pack(torch.tensor([[7, -8, 0]], dtype=torch.int8), 4).dtype == torch.int32


@pytest.mark.parametrize("bits,cols", [(4, 64), (4, 36), (8, 64), (8, 30)])
def test_pack_is_compressed_tensors_pack(bits: int, cols: int) -> None:
    g = torch.Generator().manual_seed(bits * cols)
    lo, hi = -(1 << (bits - 1)), 1 << (bits - 1)
    codes = torch.randint(lo, hi, (5, cols), generator=g, dtype=torch.int8)
    packed = pack(codes, bits)
    assert torch.equal(packed, pack_to_int32(codes, bits))
    assert torch.equal(unpack(packed, bits, cols), codes)
    assert torch.equal(unpack_from_int32(packed, bits, torch.Size((5, cols))), codes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits,group", [(4, 32), (4, 128), (8, None)])
def test_codes_and_scales_are_compressed_tensors(dtype, bits: int, group: int | None) -> None:
    """What compressed-tensors' own RTN (min-max observer, calculate_qparams, quantize)
    computes from the same weight, in the weight's dtype, bit for bit."""
    w = (torch.randn(48, 256, generator=torch.Generator().manual_seed(bits)) * 0.05).to(dtype)
    codes, scale = quantize_weight(w, bits, group)
    size = group or 256
    args = QuantizationArgs(
        num_bits=bits,
        symmetric=True,
        strategy="group" if group else "channel",
        group_size=group,
    )
    x = w.reshape(48, 256 // size, size)
    want_scale, zp = calculate_qparams(x.amin(-1), x.amax(-1), args)
    assert scale.dtype == dtype and scale.shape == (48, 256 // size)
    assert torch.equal(scale, want_scale)
    assert torch.equal(codes, ct_quantize(w, want_scale, zp, args, dtype=torch.int8))


@pytest.mark.parametrize("bits,group", [(4, 16), (4, 64), (8, None)])
def test_rounding_error_at_most_half_a_step(bits: int, group: int | None) -> None:
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(7))
    w[0] *= 1000  # rows of very different ranges
    w[1] *= 1e-6
    codes, scale = quantize_weight(w, bits, group)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    assert codes.min() >= lo and codes.max() <= hi
    step = scale.repeat_interleave(group or 128, dim=1)
    back = codes.float() * step
    assert ((back - w).abs() <= step / 2 + 1e-6 * w.abs()).all()  # float rounding
    # the range is used: each row's (group's) largest weight maps to a code at the end
    assert (codes.to(torch.int16).abs().amax(1) >= hi).all()


def test_an_all_zero_group_gives_zero_codes_and_a_finite_scale() -> None:
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    w[1, 32:] = 0  # one group
    w[2] = 0  # a whole row
    for bits, group in ((4, 32), (8, None)):
        codes, scale = quantize_weight(w, bits, group)
        assert torch.isfinite(scale).all() and (scale > 0).all()
        assert not codes[1, 32:].any() and not codes[2].any()
        back = codes.float() * scale.repeat_interleave(group or 64, dim=1)
        assert (back[w == 0] == 0).all() and torch.isfinite(back).all()


# --- the files ------------------------------------------------------------------------------


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    files = (
        sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
        if index.exists()
        else [folder / "model.safetensors"]
    )
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(f))
    return out


def group_size(scheme: str) -> int | None:
    return GROUP if scheme == "w4a16" else None


@pytest.fixture(scope="module")
def made(model_factory, tmp_path_factory):
    """made(family, scheme) -> (float folder, quantized folder), cached for the module."""
    root = tmp_path_factory.mktemp("quantized")
    cache: dict[tuple[str, str], tuple[Path, Path]] = {}

    def make(family: str, scheme: str) -> tuple[Path, Path]:
        if (family, scheme) not in cache:
            src = model_factory(family)
            dst = root / f"{family}-{scheme}"
            quantize(src, dst, scheme, group_size(scheme))
            cache[family, scheme] = (src, dst)
        return cache[family, scheme]

    return make


WANT_WEIGHTS = {
    "w8a16": {"num_bits": 8, "strategy": "channel", "group_size": None},
    "w8a8": {"num_bits": 8, "strategy": "channel", "group_size": None},
    "w4a16": {"num_bits": 4, "strategy": "group", "group_size": GROUP},
}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_config_and_tensors(made, family: str, scheme: str) -> None:
    src, dst = made(family, scheme)
    cfg = json.loads((dst / "config.json").read_text())
    src_cfg = json.loads((src / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    assert cfg == src_cfg  # nothing else changed (tie_word_embeddings, dtype, ...)
    assert qc["quant_method"] == "compressed-tensors"
    assert qc["quantization_status"] == "compressed"
    assert qc["format"] == ("int-quantized" if scheme == "w8a8" else "pack-quantized")
    assert qc["ignore"] == ["lm_head"]
    assert list(qc["config_groups"]) == ["group_0"]
    group = qc["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"] and group["output_activations"] is None
    w = group["weights"]
    assert {k: w[k] for k in ("num_bits", "strategy", "group_size")} == WANT_WEIGHTS[scheme]
    assert (w["type"], w["symmetric"], w["dynamic"], w["actorder"]) == ("int", True, False, None)
    if scheme == "w8a8":
        a = group["input_activations"]
        assert (a["num_bits"], a["type"], a["symmetric"], a["strategy"], a["dynamic"]) == (
            8,
            "int",
            True,
            "token",
            True,
        )
    else:
        assert group["input_activations"] is None
    QuantizationConfig.model_validate(qc)  # compressed-tensors' own schema takes it

    before, after = tensors(src), tensors(dst)
    dtype = next(iter(before.values())).dtype
    quantized = {k for k in before if k.rsplit(".", 2)[-2] in PROJ and k.endswith(".weight")}
    assert len(quantized) == 7 * 2  # seven Linears in each of the two layers
    for name, t in before.items():
        if name in quantized:
            continue
        assert torch.equal(after[name], t) and after[name].dtype == t.dtype, name
    if family == "qwen2":  # q/k/v biases stay float; embeddings stay tied (no lm_head)
        assert {"model.layers.0.self_attn.q_proj.bias"} <= before.keys()
        assert "lm_head.weight" not in after and cfg["tie_word_embeddings"] is True
    else:
        assert torch.equal(after["lm_head.weight"], before["lm_head.weight"])
    expected = set(before) - quantized
    for name in quantized:
        prefix = name.removesuffix(".weight")
        out, k = before[name].shape
        scale = after[f"{prefix}.weight_scale"]
        assert scale.dtype == dtype
        if scheme == "w8a8":
            expected |= {f"{prefix}.weight", f"{prefix}.weight_scale"}
            assert after[f"{prefix}.weight"].dtype == torch.int8
            assert after[f"{prefix}.weight"].shape == (out, k)
            assert scale.shape == (out, 1)
        else:
            bits = WANT_WEIGHTS[scheme]["num_bits"]
            expected |= {f"{prefix}.weight_packed", f"{prefix}.weight_scale"}
            expected |= {f"{prefix}.weight_shape"}
            packed = after[f"{prefix}.weight_packed"]
            assert packed.dtype == torch.int32 and packed.shape == (out, k * bits // 32)
            assert after[f"{prefix}.weight_shape"].tolist() == [out, k]
            assert scale.shape == (out, k // GROUP if scheme == "w4a16" else 1)
    assert set(after) == expected


@pytest.mark.parametrize("scheme", SCHEMES)
def test_dequantized_weights_within_half_a_step(made, scheme: str) -> None:
    """Decoded with compressed-tensors' unpacking, every weight is within scale/2 of the
    float one."""
    src, dst = made("llama", scheme)
    before, after = tensors(src), tensors(dst)
    bits = WANT_WEIGHTS[scheme]["num_bits"]
    for layer in range(2):
        for proj in PROJ:
            part = "self_attn" if proj in PROJ[:4] else "mlp"
            prefix = f"model.layers.{layer}.{part}.{proj}"
            w = before[f"{prefix}.weight"]
            if scheme == "w8a8":
                codes = after[f"{prefix}.weight"]
            else:
                codes = unpack_from_int32(after[f"{prefix}.weight_packed"], bits, w.shape)
            step = after[f"{prefix}.weight_scale"].repeat_interleave(
                group_size(scheme) or w.shape[1], dim=1
            )
            assert ((codes * step - w).abs() <= step / 2 + 1e-6 * w.abs()).all(), prefix
            assert not torch.equal(codes * step, w)  # it did quantize


def test_loader_files_copied_and_nothing_else(made) -> None:
    src, dst = made("llama", "w4a16")
    names = {p.name for p in dst.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= names
    assert "chat_template.jinja" in names
    for name in names - {"config.json", "model.safetensors"}:
        assert (dst / name).read_bytes() == (src / name).read_bytes(), name
    assert "plurai_factory.json" not in names  # it describes the float model
    assert not [p for p in dst.parent.iterdir() if p.name.startswith(".")]  # no temp folder


def test_a_sharded_source_keeps_its_shards_and_index(model_factory, tmp_path: Path) -> None:
    src = model_factory("llama", max_shard_size="300KB")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    quantize(src, tmp_path / "q", "w8a8")
    out = json.loads((tmp_path / "q" / "model.safetensors.index.json").read_text())
    assert set(out["weight_map"].values()) == set(index["weight_map"].values())
    size = 0
    for name, file in out["weight_map"].items():
        with safe_open(str(tmp_path / "q" / file), framework="pt") as st:
            assert name in st.keys()  # noqa: SIM118
            t = st.get_tensor(name)
            size += t.numel() * t.element_size()
    assert out["metadata"]["total_size"] == size
    assert len(out["weight_map"]) == len(index["weight_map"]) + 14  # a scale per Linear


def test_a_bf16_source_keeps_bf16(model_factory, tmp_path: Path) -> None:
    src = tmp_path / "bf16"
    shutil.copytree(model_factory("llama"), src)
    t = load_file(src / "model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in t.items()}, src / "model.safetensors")
    quantize(src, tmp_path / "q", "w4a16", 64)
    after = tensors(tmp_path / "q")
    assert after["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert after["model.layers.0.self_attn.q_proj.weight_scale"].dtype == torch.bfloat16
    assert after["model.layers.0.self_attn.q_proj.weight_scale"].shape == (64, 1)
    assert after["model.layers.0.mlp.down_proj.weight_scale"].shape == (64, 2)


# --- transformers loads it as the dequantized model -----------------------------------------


def reference(src: Path, dst: Path, scheme: str):
    """The float model with every decoder Linear's weight replaced by the dequantized one
    (decoded with compressed-tensors' unpacking); for w8a8 each Linear's input also goes
    through compressed-tensors' dynamic per-token int8 fake quantization (scale = absmax /
    127.5, codes clamped to [-128, 127])."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    after = tensors(dst)
    bits = WANT_WEIGHTS[scheme]["num_bits"]
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear) or name == "lm_head":
            continue
        if scheme == "w8a8":
            codes = after[f"{name}.weight"]
        else:
            codes = unpack_from_int32(after[f"{name}.weight_packed"], bits, mod.weight.shape)
        step = after[f"{name}.weight_scale"].repeat_interleave(
            group_size(scheme) or mod.in_features, dim=1
        )
        mod.weight.data = codes * step
        if scheme == "w8a8":
            mod.register_forward_pre_hook(lambda _, args: (fake_quant_tokens(args[0]),))
    return model


def fake_quant_tokens(x: torch.Tensor) -> torch.Tensor:
    scale = x.abs().amax(-1, keepdim=True) / 127.5
    scale = torch.where(scale == 0, torch.finfo(x.dtype).eps, scale)
    return torch.clamp(x / scale, -128, 127).round() * scale


@pytest.mark.parametrize(
    "family,scheme", [("llama", s) for s in SCHEMES] + [("qwen2", "w4a16"), ("qwen2", "w8a8")]
)
def test_transformers_loads_it_as_the_dequantized_model(made, family: str, scheme: str) -> None:
    from transformers import AutoModelForCausalLM

    src, dst = made(family, scheme)
    loaded, info = AutoModelForCausalLM.from_pretrained(str(dst), output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"])
    ids = torch.tensor([[5, 17, 300, 42, 1000, 7, 7, 2000, 64, 99]])
    with torch.inference_mode():
        got = loaded.eval()(ids).logits
        want = reference(src, dst, scheme)(ids).logits
        float_logits = AutoModelForCausalLM.from_pretrained(str(src)).eval()(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got - float_logits).abs().max() > 1e-3  # quantization shows: not the float model


# --- the CLI ----------------------------------------------------------------------------------


def run(args: list[str], capsys) -> tuple[int, str]:
    rc = plurai(["quantize", *args])
    return rc, capsys.readouterr().err


def test_cli_writes_the_model(model_factory, tmp_path: Path, capsys) -> None:
    src = model_factory("llama")
    rc = plurai(
        ["quantize", str(src), str(tmp_path / "q"), "--scheme", "w4a16", "--group-size", "64"]
    )
    assert rc == 0 and str(tmp_path / "q") in capsys.readouterr().out
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["weights"]["group_size"] == 64
    empty = tmp_path / "empty"
    empty.mkdir()  # an empty DST folder is fine
    assert plurai(["quantize", str(src), str(empty), "--scheme", "w8a16"]) == 0
    assert (empty / "model.safetensors").is_file()


@pytest.mark.parametrize(
    "case,args,message",
    [
        ("missing src", ["{missing}", "{dst}", "--scheme", "w8a8"], "not a model folder"),
        ("src not a model", ["{tmp}", "{dst}", "--scheme", "w8a8"], "not a model folder"),
        ("dst not empty", ["{src}", "{tmp}", "--scheme", "w8a8"], "not an empty folder"),
        ("dst a file", ["{src}", "{file}", "--scheme", "w8a8"], "not an empty folder"),
        ("group size not dividing", ["{src}", "{dst}", "--scheme", "w4a16"], "does not divide"),
        (
            "group size 48",
            ["{src}", "{dst}", "--scheme", "w4a16", "--group-size", "48"],
            "group size 48 does not divide the 128 input columns of model.layers.0.mlp."
            "down_proj.weight: choose a divisor of 64",
        ),
        (
            "group size zero",
            ["{src}", "{dst}", "--scheme", "w4a16", "--group-size", "0"],
            "positive integer",
        ),
        (
            "group size for w8a16",
            ["{src}", "{dst}", "--scheme", "w8a16", "--group-size", "32"],
            "takes no group size",
        ),
        (
            "group size for w8a8",
            ["{src}", "{dst}", "--scheme", "w8a8", "--group-size", "32"],
            "takes no group size",
        ),
    ],
)
def test_cli_refusals(model_factory, tmp_path, capsys, case: str, args: list[str], message: str):
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "keep").mkdir()
    paths = {
        "src": model_factory("llama"),
        "dst": tmp_path / "out",
        "missing": tmp_path / "nope",
        "tmp": tmp_path,
        "file": tmp_path / "a-file",
    }
    before = sorted(p.name for p in tmp_path.iterdir())
    rc, err = run([a.format(**paths) for a in args], capsys)
    assert rc == 2 and message in err and "Traceback" not in err, (case, err)
    assert err.startswith("plurai quantize: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


def test_cli_refuses_an_unknown_scheme(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as e:  # argparse's own usage error
        plurai(["quantize", str(tmp_path), str(tmp_path / "q"), "--scheme", "w3a16"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'w3a16'" in err and "w8a16" in err and "w4a16" in err


def test_cli_refuses_a_quantized_or_foreign_source(made, tmp_path: Path, capsys) -> None:
    _, quantized = made("llama", "w8a8")
    rc, err = run([str(quantized), str(tmp_path / "q"), "--scheme", "w4a16"], capsys)
    assert rc == 2 and "already quantized (compressed-tensors)" in err
    gpt2 = tmp_path / "gpt2"
    shutil.copytree(made("llama", "w8a8")[0], gpt2)
    cfg = json.loads((gpt2 / "config.json").read_text())
    (gpt2 / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    rc, err = run([str(gpt2), str(tmp_path / "q"), "--scheme", "w8a8"], capsys)
    assert rc == 2 and "GPT2LMHeadModel is not supported" in err
    assert "LlamaForCausalLM" in err and "Qwen3ForCausalLM" in err
    # quantized tensors under a config that does not say so
    sneaky = tmp_path / "sneaky"
    shutil.copytree(quantized, sneaky)
    cfg = json.loads((sneaky / "config.json").read_text())
    del cfg["quantization_config"]
    (sneaky / "config.json").write_text(json.dumps(cfg))
    rc, err = run([str(sneaky), str(tmp_path / "q"), "--scheme", "w8a8"], capsys)
    assert rc == 2 and "weight_scale is already quantized" in err
    assert not (tmp_path / "q").exists()


def test_cli_refuses_a_damaged_source(model_factory, tmp_path: Path, capsys) -> None:
    cut = tmp_path / "cut"
    shutil.copytree(model_factory("llama"), cut)
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) // 2])
    rc, err = run([str(cut), str(tmp_path / "q"), "--scheme", "w8a8"], capsys)
    assert rc == 2 and "truncated" in err
    (cut / "config.json").write_text("{not json")
    rc, err = run([str(cut), str(tmp_path / "q"), "--scheme", "w8a8"], capsys)
    assert rc == 2 and "config.json: not JSON" in err
    (cut / "config.json").unlink()
    rc, err = run([str(cut), str(tmp_path / "q"), "--scheme", "w8a8"], capsys)
    assert rc == 2 and "not a model folder: no config.json" in err
    assert not (tmp_path / "q").exists()
