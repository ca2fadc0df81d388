"""Train a factory model for a few seconds on the public-domain text shipped with the
package (corpus.txt: Alice's Adventures in Wonderland), so that its answers read like
words rather than random bytes.

Next-token cross-entropy with AdamW on random windows of the text, on the CPU. A share of
the windows come from the text laid out as chats (consecutive paragraphs as user and
assistant turns, in the factory's chat template), so that chat prompts get answers.
Another share (`copy_share`, none by default) are paragraphs written twice, so that the
model learns to copy from its context, as extraction and quoting ask of a real one.
The run is deterministic for a seed (one CPU thread) on any machine fast enough for its
steps in its time budget; a slower one trains fewer steps, fitted to the time left.
"""

from __future__ import annotations

import functools
import hashlib
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

CORPUS = Path(__file__).with_name("corpus.txt")
CORPUS_TITLE = "Alice's Adventures in Wonderland"


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 600
    # budget for the whole build, tokenizer included: a slow machine stops training early
    seconds: float = 30.0
    batch: int = 16
    context: int = 64
    lr: float = 1e-2
    warmup: int = 20
    weight_decay: float = 0.01
    chat_share: float = 0.25  # share of each batch taken from the text laid out as chats
    copy_share: float = 0.0  # share taken from paragraphs each written twice
    # the random models' wide init (initializer_range 0.2 for "tiny") trains slowly
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch < 1 or self.context < 1 or self.warmup < 1:
            raise ValueError("steps, batch, context and warmup must be positive")
        if not self.seconds > 0:
            raise ValueError(f"seconds must be positive, got {self.seconds}")
        if not 0 <= self.chat_share <= 1:
            raise ValueError(f"chat_share must be in [0, 1], got {self.chat_share}")
        if not 0 <= self.copy_share <= 1 - self.chat_share:
            raise ValueError(f"copy_share must be in [0, 1 - chat_share], got {self.copy_share}")


# the step after which the pace is measured, and the steps fitted to the time left
_PACE_STEP = 20


@dataclass
class TrainResult:
    steps: int
    seconds: float
    loss_start: float  # mean loss on fixed windows of the text, before and after
    loss: float


@functools.cache
def corpus_text() -> str:
    """The shipped text without its leading note (the lines starting with "#")."""
    lines = CORPUS.read_text(encoding="utf-8").splitlines()
    while lines and (lines[0].startswith("#") or not lines[0].strip()):
        lines.pop(0)
    return "\n".join(lines) + "\n"


def corpus_digest() -> str:
    return hashlib.sha256(corpus_text().encode()).hexdigest()[:16]


def paragraphs(text: str) -> list[str]:
    """The text's paragraphs, each unwrapped to one line (the file is wrapped at ~70
    columns; generated text should not be)."""
    paras = (" ".join(line.strip() for line in p.splitlines()) for p in text.split("\n\n"))
    return [p for p in paras if p]


def token_streams(tok: Any, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The text as three token sequences: plain (paragraphs apart by blank lines), as
    short chats (consecutive paragraphs as user and assistant turns, in the chat template),
    and copies (each paragraph, a blank line, the same paragraph again). Kept apart, so
    that a text prompt is not continued with chat markup."""
    paras = paragraphs(corpus_text())
    rng = random.Random(seed)
    chats, i = [], 0
    while i + 1 < len(paras):
        n = 2 * rng.randint(1, 3)
        turns = [
            {"role": ("user", "assistant")[k % 2], "content": p}
            for k, p in enumerate(paras[i : i + n])
        ]
        chats.append(tok.apply_chat_template(turns, tokenize=False))
        i += n

    def ids(text: str) -> torch.Tensor:
        return torch.tensor(tok(text).input_ids, dtype=torch.long)

    plain = ids("".join(p + "\n\n" for p in paras))
    return plain, ids("".join(chats)), ids("".join(f"{p}\n\n{p}\n\n" for p in paras))


def _windows(
    stream: torch.Tensor, n: int, context: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, len(stream) - context - 1, (n,), generator=gen)
    idx = starts[:, None] + torch.arange(context + 1)
    w = stream[idx]
    return w[:, :-1], w[:, 1:]


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def train(
    model: torch.nn.Module, tok: Any, cfg: TrainConfig, seed: int, deadline: float
) -> TrainResult:
    """Train in place until cfg.steps or the monotonic-clock deadline, whichever is first."""
    threads = torch.get_num_threads()
    # one thread: as fast for matrices this small, unharmed by a busy machine (two threads
    # with another process on the cores run ~10x slower), and the same sums everywhere
    torch.set_num_threads(1)
    try:
        return _train(model, tok, cfg, seed, deadline)
    finally:
        torch.set_num_threads(threads)


def _train(
    model: torch.nn.Module, tok: Any, cfg: TrainConfig, seed: int, deadline: float
) -> TrainResult:
    plain, chats, copies = token_streams(tok, seed)
    gen = torch.Generator().manual_seed(seed)
    n_chat = round(cfg.batch * cfg.chat_share)
    # where both shares round up (an odd batch) the copies give one back: plain never < 0
    n_copy = min(round(cfg.batch * cfg.copy_share), cfg.batch - n_chat)
    parts = [(plain, cfg.batch - n_chat - n_copy), (chats, n_chat)]
    if n_copy:  # drawn after the others: a model without copies trains as it always did
        parts.append((copies, n_copy))
    held = _windows(plain, 32, cfg.context, torch.Generator().manual_seed(seed + 1))
    decay = [p for p in model.parameters() if p.dim() > 1]
    other = [p for p in model.parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": other, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    model.eval()
    with torch.no_grad():
        loss_start = _loss(model, *held).item()
    model.train()
    start = time.monotonic()
    total, step = cfg.steps, 0
    while step < total and time.monotonic() < deadline:
        if step == _PACE_STEP:
            # a machine too slow for the steps in the time left gets fewer, on a schedule
            # of its own; the others keep theirs, so that a seed always trains one model
            now = time.monotonic()
            pace = (now - start) / step
            total = min(total, step + 1 + int(0.9 * (deadline - now) / pace))
        progress = step / total
        warm = min(1.0, (step + 1) / cfg.warmup)
        lr = cfg.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = map(
            torch.cat, zip(*(_windows(s, n, cfg.context, gen) for s, n in parts), strict=True)
        )
        loss = _loss(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
    seconds = time.monotonic() - start
    model.eval()
    with torch.no_grad():
        loss_end = _loss(model, *held).item()
    return TrainResult(step, round(seconds, 2), round(loss_start, 3), round(loss_end, 3))
