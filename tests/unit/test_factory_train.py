"""The factory's trained models (make-model --train): the loss falls, the native engine
serves them, their text is made of the shipped text's words, and a second build is a
cache hit."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from plurai.gpu_workers.models import factory
from plurai.gpu_workers.models import train as train_module
from plurai.gpu_workers.models.factory import FACTORY_FILE, describe, make_model
from plurai.gpu_workers.models.train import TrainConfig, corpus_text

pytestmark = pytest.mark.model  # builds and trains models

# a short run keeps the suite fast; the default (TrainConfig()) trains longer. The steps end
# it: the time budget is only a cap, wide enough for a loaded machine
QUICK = TrainConfig(steps=120, seconds=60)
PROMPTS = ["Alice said", "The Queen", "Summarize: the council approved the new bridge."]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("m") / "alice", train=QUICK)


def words(text: str) -> list[str]:
    return [w for w in (re.sub(r"[^a-z]", "", t.lower()) for t in text.split()) if w]


def word_share(model_dir: Path, temperature: float = 0.0) -> tuple[float, list[str]]:
    """The share of generated words that are words of the text, and the texts."""
    from plurai.gpu_workers.engine.engine import Engine, EngineConfig
    from plurai.gpu_workers.engine.sampling_params import SamplingParams

    engine = Engine(EngineConfig(model=str(model_dir), dtype="fp32", kv_cache_bytes=16 << 20))
    params = SamplingParams(max_tokens=40, temperature=temperature, seed=1, ignore_eos=True)
    texts = [c.text for c in engine.generate(PROMPTS, params)]
    vocab = set(words(corpus_text()))
    got = [w for t in texts for w in words(t)]
    return sum(w in vocab for w in got) / max(len(got), 1), texts


def test_training_lowers_the_loss(trained):
    record = json.loads((trained / FACTORY_FILE).read_text())
    assert record["steps"] == QUICK.steps
    assert record["loss"] < record["loss_start"] - 2.0
    cfg = json.loads((trained / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]


def test_the_engine_writes_words_of_the_text(trained, tiny_model):
    share, texts = word_share(trained)
    sampled, _ = word_share(trained, temperature=0.8)
    random_share, _ = word_share(tiny_model)  # the random-weight model
    assert share > 0.8, texts
    assert sampled > 0.6
    assert random_share < 0.3


def test_chats_get_answers_and_end_at_im_end(trained):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(trained))
    gen = json.loads((trained / "generation_config.json").read_text())
    assert set(gen["eos_token_id"]) == {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")}
    assert tok.chat_template == factory.CHAT_TEMPLATE


def test_a_second_build_is_a_cache_hit(trained):
    files = {p.name: p.stat().st_mtime_ns for p in trained.iterdir()}
    assert make_model(trained, train=QUICK) == trained
    assert {p.name: p.stat().st_mtime_ns for p in trained.iterdir()} == files


def test_other_arguments_or_an_untrained_build_replace_the_model(tmp_path):
    out = tmp_path / "m"
    make_model(out, train=TrainConfig(steps=2))
    first = (out / FACTORY_FILE).read_text()
    make_model(out, train=TrainConfig(steps=3))
    assert json.loads((out / FACTORY_FILE).read_text())["steps"] == 3
    assert (out / FACTORY_FILE).read_text() != first
    make_model(out)
    assert "random weights" in describe(out)


class Clock:
    """A monotonic clock that moves 10 ms a reading, whatever the machine's load."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        self.now += 0.01
        return self.now


def test_a_short_budget_fits_fewer_steps_to_it(tmp_path, monkeypatch):
    clock = Clock()  # the training loop reads it once a step: a 2 s budget is ~200 steps
    monkeypatch.setattr(factory, "time", clock)
    monkeypatch.setattr(train_module, "time", clock)
    out = make_model(tmp_path / "m", train=TrainConfig(steps=100_000, seconds=2))
    record = json.loads((out / FACTORY_FILE).read_text())
    assert 20 < record["steps"] < 100_000
    assert record["seconds"] <= 2.0
    assert record["loss"] < record["loss_start"]


def test_same_seed_same_model(tmp_path):
    a, b = (make_model(tmp_path / n, train=TrainConfig(steps=3)) for n in "ab")
    for name in ("model.safetensors", "tokenizer.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()


def test_describe(trained, tiny_model, tmp_path):
    assert re.fullmatch(
        r"alice: 0\.3M-parameter Llama trained \d+ s on Alice's Adventures in Wonderland "
        r"\(loss \d+\.\d\), local tokenizer",
        describe(trained),
    ), describe(trained)
    assert describe(tiny_model).endswith(
        ": 0.3M-parameter Llama with random weights, local tokenizer"
    )
    assert "not a model directory" in describe(tmp_path)


def test_cli_train(tmp_path, capsys):
    p = argparse.ArgumentParser()
    factory.add_arguments(p)
    args = p.parse_args([str(tmp_path / "c"), "--train", "--train-steps", "2"])
    assert factory.cli(args) == 0
    assert capsys.readouterr().out.strip().endswith(f"written to {tmp_path / 'c'}")
    assert factory.cli(args) == 0
    assert "already in" in capsys.readouterr().out
    assert factory.cli(p.parse_args([str(tmp_path / "d"), "--train-steps", "2"])) == 2
    assert "go with --train" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def test_copy_windows_are_paragraphs_written_twice():
    """copy_share draws windows from each paragraph followed by itself: what teaches a
    model to copy from its context (bench/speculative.py's documents)."""
    from plurai.gpu_workers.models.factory import make_tokenizer
    from plurai.gpu_workers.models.train import paragraphs, token_streams

    tok = make_tokenizer(2048, 0, "text")
    plain, _, copies = token_streams(tok, 0)
    text = tok.decode(copies.tolist())
    paras = paragraphs(corpus_text())
    assert text.startswith(f"{paras[0]}\n\n{paras[0]}\n\n{paras[1]}\n\n{paras[1]}")
    assert 1.9 < len(copies) / len(plain) < 2.1
    with pytest.raises(ValueError, match="copy_share"):
        TrainConfig(copy_share=0.8)  # with the default chat_share 0.25: over the whole
    TrainConfig(copy_share=0.75)
    TrainConfig(copy_share=1.0, chat_share=0.0)


def test_copies_change_the_model_and_its_cache_key(tmp_path):
    plain = make_model(tmp_path / "a", train=TrainConfig(steps=3))
    copying = make_model(tmp_path / "b", train=TrainConfig(steps=3, copy_share=0.5))
    again = make_model(tmp_path / "c", train=TrainConfig(steps=3, copy_share=0.5))
    key = json.loads((copying / FACTORY_FILE).read_text())["key"]
    assert key != json.loads((plain / FACTORY_FILE).read_text())["key"]
    weights = "model.safetensors"
    assert (plain / weights).read_bytes() != (copying / weights).read_bytes()
    assert (copying / weights).read_bytes() == (again / weights).read_bytes()


def test_shares_that_both_round_up_still_fill_the_batch(tmp_path):
    # 5 x 0.3 and 5 x 0.7 round to 2 and 4: one window more than the batch holds
    cfg = TrainConfig(steps=2, batch=5, chat_share=0.3, copy_share=0.7)
    out = make_model(tmp_path / "m", train=cfg)
    assert json.loads((out / FACTORY_FILE).read_text())["steps"] == 2
