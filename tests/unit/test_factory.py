"""The offline model factory and its CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from plurai.gpu_workers.models.factory import make_tokenizer, model_config


@pytest.mark.model
def test_make_model_cli_writes_a_loadable_model(tmp_path):
    out = tmp_path / "q3"
    subprocess.run(
        [sys.executable, "-m", "plurai.cli", "make-model", str(out), "--family", "qwen3"],
        check=True,
        capture_output=True,
    )
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg["head_dim"] * cfg["num_attention_heads"] != cfg["hidden_size"]
    from plurai.gpu_workers.engine.engine import Engine, EngineConfig
    from plurai.gpu_workers.engine.sampling_params import SamplingParams

    engine = Engine(EngineConfig(model=str(out), dtype="fp32", num_kv_blocks=32))
    got = engine.generate(["Plai stou"], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(got.token_ids) == 4


@pytest.mark.model
def test_tokenizer_is_the_same_on_every_build():
    a, b = make_tokenizer(2048, seed=0), make_tokenizer(2048, seed=0)
    text = "Stou plai tren 1999, chea!"
    assert a(text).input_ids == b(text).input_ids
    assert a.decode(a(text).input_ids) == text
    assert len(a) == 2048


def test_bench_size_is_about_50m_parameters():
    from transformers import AutoModelForCausalLM

    cfg = model_config("llama", "bench", vocab_size=8192, eos_id=0)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    n = sum(p.numel() for p in model.parameters())
    assert 40e6 < n < 60e6
    assert cfg.rope_parameters["rope_type"] == "llama3"


@pytest.mark.parametrize(
    ("size", "family", "params", "vocab"),
    [("0.5b", "qwen2", 494_032_768, 151_936), ("1b", "llama", 1_235_814_400, 128_256)],
)
def test_real_sizes_have_the_shapes_of_the_models_users_run(size, family, params, vocab):
    """Qwen2.5-0.5B's and Llama-3.2-1B's parameter counts, exactly, with the factory's own
    tokenizer (8,192 tokens) padded to their vocabularies."""
    from transformers import AutoModelForCausalLM

    from plurai.gpu_workers.models.factory import size_family

    assert size_family(size) == family
    cfg = model_config(family, size, vocab_size=8192, eos_id=0)
    assert cfg.vocab_size == vocab and cfg.tie_word_embeddings
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    assert sum(p.numel() for p in model.parameters()) == params
    assert type(model).__name__.lower().startswith(family)


def test_real_sizes_refuse_training(capsys):
    import argparse

    from plurai.gpu_workers.models.factory import add_arguments, cli

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert cli(p.parse_args(["unused", "--size", "1b", "--train"])) == 2
    assert "--train is for the test sizes" in capsys.readouterr().err
