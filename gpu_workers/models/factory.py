"""Offline model factory: a random-weight model of a supported family plus a tokenizer
trained locally, written as an ordinary Hugging Face model directory.

Tests, the demo and the benchmarks run on these, since no model hub is reachable.
The tokenizer is byte-level BPE trained on a seeded synthetic corpus, so every machine
builds the same files for the same arguments.

With `train`, the model and its tokenizer are instead trained for a few seconds on the
public-domain text shipped beside this module (train.py), so that its answers read like
words; the result is cached in the directory. FACTORY_FILE records what a directory holds,
and describe() says it in one line.

One file, though long: the families' shapes, the sizes users run and the tokenizer's
training make one model directory together, and FACTORY_FILE records them all.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

from plurai.broker_config import locks
from plurai.gpu_workers.models.train import CORPUS_TITLE, TrainConfig, corpus_digest

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
SIZES = ("tiny", "small", "bench", "0.5b", "1b")
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
    # The shapes of models users run, for figures about speed and memory: random weights in
    # bfloat16 (as checkpoints ship), the bench tokenizer, and the model's own vocabulary
    # (`vocab_size`: logits over it are part of every step's cost; ids past the tokenizer's
    # decode to nothing). Their family unless --family says otherwise.
    # Qwen2.5-0.5B: 0.49B parameters, tied embeddings
    "0.5b": dict(
        family="qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab=8192,
        vocab_size=151936,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        initializer_range=0.02,
        dtype="bfloat16",
    ),
    # Llama-3.2-1B: 1.24B parameters, tied embeddings; a context of 16,384 (its own is 131,072)
    # so that an engine's default KV budget holds a whole sequence
    "1b": dict(
        family="llama",
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab=8192,
        vocab_size=128256,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_factor=32.0,
        rope_original=8192,
        max_position_embeddings=16384,
        initializer_range=0.02,
        dtype="bfloat16",
    ),
}
# the keys of a size that are not config fields as they stand
_OWN = (
    *("family", "vocab", "vocab_size", "tie_word_embeddings", "dtype"),
    *("rope_theta", "rope_factor", "rope_original"),
)


def size_family(size: str) -> str:
    """The family a size is shaped after (llama for the test and bench sizes)."""
    return _SIZES[size].get("family", "llama")


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


# written last into every factory model's directory: what it is, and the cache key
FACTORY_FILE = "plurai_factory.json"
# part of the cache key: bump when training changes in a way its arguments do not show
TRAIN_VERSION = 1


@functools.lru_cache(maxsize=4)
def _tokenizer_json(vocab: int, seed: int, source: str = "synthetic") -> str:
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
    if source == "synthetic":
        tok.train_from_iterator(corpus(seed), trainer)
    elif source == "text":
        from plurai.gpu_workers.models.train import corpus_text, paragraphs

        tok.train_from_iterator(paragraphs(corpus_text()), trainer)
    else:
        raise ValueError(f"unknown tokenizer source {source!r}")
    return tok.to_str()


def make_tokenizer(vocab: int, seed: int = 0, source: str = "synthetic") -> Any:
    """source: "synthetic" (the seeded syllable corpus) or "text" (the shipped text)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json(vocab, seed, source)),
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def model_config(family: str, size: str, vocab_size: int, eos_id: int) -> Any:
    """`vocab_size`: the tokenizer's; a size with a vocabulary of its own keeps that."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    s = dict(_SIZES[size])
    own = {k: s.pop(k) for k in _OWN if k in s}
    # (rope_theta: the families' own defaults but Llama's, as before the real sizes)
    theta = own.get("rope_theta", 500000.0 if family == "llama" else 10000.0)
    common = dict(
        s,
        vocab_size=max(vocab_size, own.get("vocab_size", 0)),
        max_position_embeddings=s.pop("max_position_embeddings", 4096),
        rms_norm_eps=1e-6,
        rope_theta=theta,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    tied = own.get("tie_word_embeddings")
    if family == "llama":
        # Llama 3.1-style rope scaling, untied embeddings (unless the size ties them)
        rope = {
            "rope_type": "llama3",
            "rope_theta": theta,
            "factor": own.get("rope_factor", 8.0),
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": own.get("rope_original", 1024),
        }
        return LlamaConfig(**common, rope_scaling=rope, tie_word_embeddings=bool(tied))
    if family == "mistral":
        return MistralConfig(**common, sliding_window=None, tie_word_embeddings=bool(tied))
    if family == "qwen2":
        return Qwen2Config(
            **common, tie_word_embeddings=tied is not False, use_sliding_window=False
        )
    if family == "qwen3":
        # head_dim set apart from hidden/heads, as real Qwen3 checkpoints do
        return Qwen3Config(
            **common,
            head_dim=2 * s["hidden_size"] // s["num_attention_heads"],
            tie_word_embeddings=tied is not False,
            use_sliding_window=False,
        )
    raise ValueError(f"unknown family {family!r}; choose from {FAMILIES}")


def make_model(
    path: str | Path,
    family: str | None = None,
    size: str = "tiny",
    seed: int = 0,
    max_shard_size: str | None = None,
    train: bool | TrainConfig = False,
) -> Path:
    """Write a random-weight model directory; returns its path.

    train: True (or a TrainConfig) trains the model, and a tokenizer, on the shipped text
    first (see train.py). A directory that already holds the model these same arguments
    train is returned as it is. `family`: None for the size's own (size_family)."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose from {SIZES}")
    family = family or size_family(size)
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {FAMILIES}")
    path = Path(path)
    cfg_train = TrainConfig() if train is True else train or None
    key = _key(family, size, seed, max_shard_size, cfg_train)
    # one writer per folder (two `make demo`s at once); the lock dies with its holder
    lock = path.parent / f".{path.name}.lock"
    with locks.held(lock, timeout_s=3600, what=f"the model being written to {path}"):
        if cfg_train is not None and is_cached(path, key):
            return path
        return _write_model(path, family, size, seed, max_shard_size, cfg_train, key)


def _write_model(
    path: Path,
    family: str,
    size: str,
    seed: int,
    max_shard_size: str | None,
    cfg_train: TrainConfig | None,
    key: str,
) -> Path:
    from transformers import AutoModelForCausalLM

    deadline = time.monotonic() + (cfg_train.seconds if cfg_train else 0)
    source = "text" if cfg_train else "synthetic"
    tok = make_tokenizer(_SIZES[size]["vocab"], seed, source)
    cfg = model_config(family, size, len(tok), tok.eos_token_id)
    if cfg_train:
        cfg.initializer_range = cfg_train.init_std
    torch.manual_seed(seed)
    dtype = getattr(torch, _SIZES[size].get("dtype", "float32"))
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.eos_token_id
    record: dict[str, Any] = {"key": key, "family": family, "size": size, "seed": seed}
    if cfg_train:
        from plurai.gpu_workers.models.train import train as run_training

        result = run_training(model, tok, cfg_train, seed, deadline)
        # chats end at <|im_end|>, as the model learned from the chat-shaped text
        im_end = tok.convert_tokens_to_ids("<|im_end|>")
        model.generation_config.eos_token_id = [tok.eos_token_id, im_end]
        record["trained_on"] = CORPUS_TITLE
        record.update(dataclasses.asdict(result))
        record["train"] = dataclasses.asdict(cfg_train)
    path.mkdir(parents=True, exist_ok=True)
    # gone while the files change, so that a build cut short is not taken as cached
    (path / FACTORY_FILE).unlink(missing_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), **kwargs)
    tok.save_pretrained(str(path))
    tmp = path / (FACTORY_FILE + ".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path / FACTORY_FILE)
    return path


def _key(
    family: str, size: str, seed: int, max_shard_size: str | None, train: TrainConfig | None
) -> str:
    args = {
        "family": family,
        "size": size,
        "seed": seed,
        "max_shard_size": max_shard_size,
        "train": dataclasses.asdict(train) if train else None,
    }
    if train:
        args["corpus"] = corpus_digest()
        args["version"] = TRAIN_VERSION
    return hashlib.sha256(json.dumps(args, sort_keys=True).encode()).hexdigest()[:32]


def factory_record(model_dir: str | Path) -> dict[str, Any] | None:
    """What FACTORY_FILE says of a directory, or None (not made by the factory)."""
    try:
        record = json.loads((Path(model_dir) / FACTORY_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def is_cached(path: str | Path, key: str) -> bool:
    """Whether the directory holds a whole factory model built with this key."""
    from plurai.gpu_workers.models.loader import weight_files

    record = factory_record(path)
    if record is None or record.get("key") != key:
        return False
    try:
        return bool(weight_files(path)) and (Path(path) / "tokenizer.json").is_file()
    except (OSError, ValueError):
        return False


def describe(model_dir: str | Path) -> str:
    """One line on what a model directory holds, e.g. "tiny-llama: 0.3M-parameter Llama
    trained 20 s on Alice's Adventures in Wonderland (loss 3.9), local tokenizer"."""
    path = Path(model_dir)
    name = path.resolve().name
    try:
        cfg = json.loads((path / "config.json").read_text())
        kind = _ARCH_NAMES.get(cfg.get("model_type"), cfg.get("model_type") or "model")
    except (OSError, ValueError):
        return f"{name}: not a model directory (no readable config.json)"
    what = f"{_count(_parameters(path))}-parameter {kind}"
    record = factory_record(path)
    if record is None:
        return f"{name}: {what}"
    if not record.get("trained_on"):
        return f"{name}: {what} with random weights, local tokenizer"
    return (
        f"{name}: {what} trained {record['seconds']:.0f} s on {record['trained_on']} "
        f"(loss {record['loss']:.1f}), local tokenizer"
    )


_ARCH_NAMES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}


def _parameters(path: Path) -> int:
    """Parameter count from the safetensors headers (no tensor is read)."""
    from safetensors import safe_open

    from plurai.gpu_workers.models.loader import weight_files

    n = 0
    try:
        for f in weight_files(path):
            with safe_open(str(f), framework="pt") as st:
                for k in st.keys():  # noqa: SIM118 - safe_open is not a dict
                    n += math.prod(st.get_slice(k).get_shape())
    except (OSError, ValueError):
        return 0
    return n


def _count(n: int) -> str:
    """0.3M, 46M, 1.2B."""
    if n >= 1e9:
        return f"{n / 1e9:.1f}B"
    return f"{n / 1e6:.0f}M" if n >= 1e7 else f"{n / 1e6:.1f}M"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="directory to write the model into")
    p.add_argument(
        "--family",
        choices=FAMILIES,
        default=None,
        help="default: the size's own (0.5b: qwen2, the Qwen2.5-0.5B shapes; else llama)",
    )
    p.add_argument(
        "--size",
        choices=SIZES,
        default="tiny",
        help="tiny and small: for tests; bench: 46M, the benches' default; 0.5b and 1b: the "
        "shapes of Qwen2.5-0.5B and Llama-3.2-1B in bfloat16 (random weights decide nothing "
        "about text: fix output lengths, e.g. ignore_eos)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--train",
        action="store_true",
        help=f"train it, and its tokenizer, for a few seconds on {CORPUS_TITLE} "
        "(shipped with the package) so that it writes words; cached in DIR",
    )
    p.add_argument(
        "--train-seconds",
        type=float,
        help="time budget of --train, tokenizer included: on a slow machine training stops "
        f"early (default {TrainConfig.seconds:g})",
    )
    p.add_argument(
        "--train-steps", type=int, help=f"steps of --train (default {TrainConfig.steps})"
    )


def cli(args: argparse.Namespace) -> int:
    given = {"steps": args.train_steps, "seconds": args.train_seconds}
    given = {k: v for k, v in given.items() if v is not None}
    if not args.train:
        if given:
            print("--train-seconds and --train-steps go with --train", file=sys.stderr)
            return 2
        path = make_model(args.dir, family=args.family, size=args.size, seed=args.seed)
        family = args.family or size_family(args.size)
        print(f"wrote a random-weight {family} model ({args.size}) to {path}")
        return 0
    if "dtype" in _SIZES[args.size]:
        print(f"make-model: --train is for the test sizes; {args.size} is random", file=sys.stderr)
        return 2
    try:
        train = TrainConfig(**given)
    except ValueError as e:
        print(f"make-model: {e}", file=sys.stderr)
        return 2
    key = _key(args.family or size_family(args.size), args.size, args.seed, None, train)
    cached = is_cached(args.dir, key)
    path = make_model(args.dir, family=args.family, size=args.size, seed=args.seed, train=train)
    print(f"{describe(path)}; {'already in' if cached else 'written to'} {path}")
    return 0
