"""`plurai worker` picks its backend: clear errors for options of the other backend, and
for --backend vllm where vLLM is not installed (the core environment)."""

from __future__ import annotations

import argparse
import importlib.util

import pytest

from plurai.broker_config.settings import Settings
from plurai.gpu_workers import serve
from plurai.gpu_workers.startup import StartError


def args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    return p.parse_args(["--model", "unused", *argv])


def test_vllm_options_need_the_vllm_backend() -> None:
    with pytest.raises(StartError, match="--vllm options need --backend vllm"):
        serve.make_backend(args("--vllm", "max_num_seqs=8"), Settings(model_dir="unused"))


def test_native_options_are_refused_with_the_vllm_backend() -> None:
    with pytest.raises(StartError, match="give vLLM's as --vllm"):
        serve.make_backend(
            args("--backend", "vllm", "--engine", "block_size=32"), Settings(model_dir="unused")
        )


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_vllm_backend_without_vllm_says_how_to_get_it() -> None:
    with pytest.raises(StartError, match="make vllm-install"):
        serve.make_backend(args("--backend", "vllm"), Settings(model_dir="unused"))


def test_vllm_option_values_are_json_or_text() -> None:
    a = args("--backend", "vllm", "--vllm", "enforce_eager=true", "--vllm", "dtype=bfloat16")
    assert dict(a.vllm) == {"enforce_eager": True, "dtype": "bfloat16"}


def test_speculative_decoding_is_vllms_ngram_method() -> None:
    opts = {"speculative": "ngram", "num_speculative_tokens": 3, "ngram_max": 5}
    assert serve._vllm_speculative(opts) == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 5,
    }
    assert opts == {}  # taken out: the rest must be vLLM's own
    assert serve._vllm_speculative({"speculative": "off", "ngram_min": 1}) is None
    with pytest.raises(StartError, match="speculative must be"):
        serve._vllm_speculative({"speculative": "eagle"})
    with pytest.raises(StartError, match="speculative must be"):
        serve._vllm_speculative({"speculative": "draft:"})


def test_a_draft_model_is_vllms_draft_model_method() -> None:
    opts = {"speculative": "draft:/models/small", "num_speculative_tokens": 3}
    assert serve._vllm_speculative(opts) == {
        "method": "draft_model",
        "model": "/models/small",
        "num_speculative_tokens": 3,
    }
