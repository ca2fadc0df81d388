"""Offline model factory: a random-weight model of a supported family plus a tokenizer
trained locally, written as an ordinary Hugging Face model directory.

Tests, the demo and the benchmarks run on these, since no model hub is reachable.
The tokenizer is byte-level BPE trained on a seeded synthetic corpus, so every machine
builds the same files for the same arguments.
"""

from __future__ import annotations

import argparse
import functools
import random
from pathlib import Path
from typing import Any

import torch

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
SIZES = ("tiny", "small", "bench")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_SIZES: dict[str, dict[str, Any]] = {
    # ~0.3M parameters: fast enough for token-exact tests of every family
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab=2048,
        initializer_range=0.2,
    ),
    # ~0.7M parameters with head_dim 64, the smallest head vLLM's CPU attention takes:
    # the vLLM backend's tests
    "small": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab=2048,
        initializer_range=0.2,
    ),
    # ~46M parameters, Llama architecture: the benchmark model
    "bench": dict(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=12,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab=8192,
        initializer_range=0.08,
    ),
}


def corpus(seed: int = 0, sentences: int = 30000) -> list[str]:
    """A seeded synthetic text: Zipf-distributed words built from syllables."""
    rng = random.Random(seed)
    onsets = [
        "",
        "b",
        "c",
        "d",
        "f",
        "g",
        "h",
        "l",
        "m",
        "n",
        "p",
        "r",
        "s",
        "t",
        "v",
        "st",
        "tr",
        "pl",
        "ch",
        "sh",
    ]
    vowels = ["a", "e", "i", "o", "u", "ai", "ou", "ea"]
    codas = ["", "", "n", "r", "s", "t", "l", "m", "nd", "st"]

    def word() -> str:
        return "".join(
            rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas)
            for _ in range(rng.choice((1, 1, 2, 2, 3, 4)))
        )

    lexicon = list(dict.fromkeys(word() for _ in range(12000)))
    weights = [1.0 / (i + 1) for i in range(len(lexicon))]
    lines = []
    for _ in range(sentences):
        words = rng.choices(lexicon, weights, k=rng.randint(4, 16))
        words[0] = words[0].capitalize()
        if rng.random() < 0.3:
            words.insert(rng.randint(1, len(words) - 1), str(rng.randint(0, 2030)))
        lines.append(" ".join(words) + rng.choice((".", ".", ".", "?", "!", ",")))
    return lines


@functools.lru_cache(maxsize=4)
def _tokenizer_json(vocab: int, seed: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIAL,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(seed), trainer)
    return tok.to_str()


def make_tokenizer(vocab: int, seed: int = 0) -> Any:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json(vocab, seed)),
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def model_config(family: str, size: str, vocab_size: int, eos_id: int) -> Any:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    s = dict(_SIZES[size])
    s.pop("vocab")
    common = dict(
        s,
        vocab_size=vocab_size,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    if family == "llama":
        # Llama 3.1-style rope scaling, untied embeddings
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        }
        return LlamaConfig(
            **common, rope_scaling=rope, rope_theta=500000.0, tie_word_embeddings=False
        )
    if family == "mistral":
        return MistralConfig(**common, sliding_window=None, tie_word_embeddings=False)
    if family == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=True, use_sliding_window=False)
    if family == "qwen3":
        # head_dim set apart from hidden/heads, as real Qwen3 checkpoints do
        return Qwen3Config(
            **common,
            head_dim=2 * s["hidden_size"] // s["num_attention_heads"],
            tie_word_embeddings=True,
            use_sliding_window=False,
        )
    raise ValueError(f"unknown family {family!r}; choose from {FAMILIES}")


def make_model(
    path: str | Path,
    family: str = "llama",
    size: str = "tiny",
    seed: int = 0,
    max_shard_size: str | None = None,
) -> Path:
    """Write a random-weight model directory; returns its path."""
    from transformers import AutoModelForCausalLM

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {FAMILIES}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose from {SIZES}")
    path = Path(path)
    tok = make_tokenizer(_SIZES[size]["vocab"], seed)
    cfg = model_config(family, size, len(tok), tok.eos_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.eos_token_id
    path.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), **kwargs)
    tok.save_pretrained(str(path))
    return path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="directory to write the model into")
    p.add_argument("--family", choices=FAMILIES, default="llama")
    p.add_argument("--size", choices=SIZES, default="tiny")
    p.add_argument("--seed", type=int, default=0)


def cli(args: argparse.Namespace) -> int:
    path = make_model(args.dir, family=args.family, size=args.size, seed=args.seed)
    print(f"wrote a random-weight {args.family} model ({args.size}) to {path}")
    return 0
