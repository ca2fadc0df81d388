"""The serving bench's workload: seeded OpenAI chat requests with arrival times, written
to a JSON-lines file that every stack replays.

    python -m bench.serving.workload --model DIR --out FILE [--seed 0] [--rate 2]
        [--scale 1] [--burstiness 1] [--duration 60] [--flood N --flood-at S]
        [--vllm-custom FILE] [--vllm-trace FILE] [--smoke]

--smoke: 4 s of short requests with a flood of 4 on the smoke runs' tiny model, every file
written (to a temporary folder unless --out says where): a check that the script runs.

Two lanes. Interactive: one-shot chats whose system prompt is one of a few long shared
prompts (a prefix group), and multi-turn sessions on those same system prompts whose
conversation grows turn by turn. Batch: long-document extraction (long input, short
output). A turn carries the whole conversation so far, with a seeded stand-in text as each
earlier answer, so the file does not depend on what the model said.

Arrivals are a gamma renewal process as `vllm bench serve` draws it: intervals of shape
`burstiness` and mean 1 / rate (1 is Poisson, below 1 burstier). The offered rate is
`rate * scale`: a sweep over scale replays the same requests, only closer together (and
more of them within the duration). The flood scenario adds a burst of batch requests on
top of steady traffic. Prompt lengths are counted as the engine counts them (the model's
chat template and tokenizer) and kept within [min_prompt, max_prompt].

One file, though long: the workload's kinds and the files written for every stack come
from one seeded generator.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


INTERACTIVE, BATCH = "interactive", "batch"
EXTRACT_SYSTEM = (
    "You extract facts from documents. Answer with one JSON object holding the names, "
    "dates, places and amounts the document states, and nothing else."
)
EXTRACT_ASK = "Extract the facts from this document.\n\n"


@dataclass
class WorkloadConfig:
    seed: int = 0
    duration_s: float = 60.0
    rate: float = 2.0  # requests/s at scale 1: the stack's calibrated capacity
    scale: float = 1.0  # offered load as a multiple of rate
    burstiness: float = 1.0  # gamma shape of the intervals: 1 is Poisson, < 1 burstier
    batch_share: float = 0.2  # of the steady arrivals: long-document extraction
    session_share: float = 0.5  # of the interactive arrivals: a turn of a session
    prefix_groups: int = 4  # shared system prompts
    open_sessions: int = 4  # sessions in progress at once
    max_turns: int = 6
    min_prompt: int = 128
    max_prompt: int = 2048
    min_output: int = 16
    max_output: int = 128
    flood_requests: int = 0  # batch requests in a burst on top of the steady traffic
    flood_at_s: float = 0.0
    flood_span_s: float = 1.0

    @property
    def offered_rate(self) -> float:
        return self.rate * self.scale

    @property
    def system_tokens(self) -> int:
        return self.max_prompt // 4

    def check(self) -> None:
        if not (
            0 < self.min_prompt
            and 4 * self.min_prompt <= self.max_prompt
            and self.max_prompt >= 256
        ):
            raise ValueError("need 0 < 4 * min_prompt <= max_prompt and max_prompt >= 256")
        if not 0 < self.min_output <= self.max_output:
            raise ValueError("need 0 < min_output <= max_output")
        if self.offered_rate <= 0 or self.burstiness <= 0 or self.duration_s <= 0:
            raise ValueError("rate, scale, burstiness and duration_s must be positive")
        if not (0 <= self.batch_share <= 1 and 0 <= self.session_share <= 1):
            raise ValueError("batch_share and session_share are fractions")
        if self.prefix_groups < 1 or self.open_sessions < 1 or self.max_turns < 2:
            raise ValueError("need prefix_groups >= 1, open_sessions >= 1, max_turns >= 2")


def flood_scenario(**kw) -> WorkloadConfig:
    """Steady interactive traffic with a batch flood on top (defaults: 200 extraction
    requests arriving within 2 s, a third of the way in)."""
    kw.setdefault("batch_share", 0.0)
    kw.setdefault("flood_requests", 200)
    kw.setdefault("flood_span_s", 2.0)
    cfg = WorkloadConfig(**kw)
    if "flood_at_s" not in kw:
        cfg.flood_at_s = cfg.duration_s / 3
    return cfg


@dataclass
class ServingRequest:
    id: str
    arrival_s: float  # offset from the start of the run
    lane: str  # interactive | batch
    kind: str  # chat | session | extract
    messages: list[dict]
    max_tokens: int
    prompt_tokens: int  # the chat template's tokens, as the engine counts them
    group: str | None = None  # shared system prompt
    session: str | None = None
    turn: int | None = None  # 1, 2, ... within the session
    # a prompt of token ids (a trace's: bench/trace_replay.py), sent as a completion; then
    # `messages` is empty
    prompt_ids: list[int] | None = None


def arrival_times(
    rng: random.Random, rate: float, burstiness: float, duration_s: float
) -> list[float]:
    """Arrival offsets in [0, duration_s): gamma intervals of shape `burstiness` and mean
    1 / rate. Intervals are drawn at unit mean and divided by the rate, so for one seed a
    higher rate gives the same sequence compressed in time."""
    out: list[float] = []
    t = 0.0
    while True:
        t += rng.gammavariate(burstiness, 1.0 / burstiness) / rate
        if t >= duration_s:
            return out
        out.append(t)


class Tokens:
    """Prompt lengths as the engine counts them: the model's own tokenizer and template."""

    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoTokenizer

        from plurai.gpu_workers.prompts import Prompts

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        self._prompts = Prompts(self.tokenizer, len(self.tokenizer), 1 << 30)

    def ids(self, messages: list[dict]) -> list[int]:
        return self._prompts.tokenize(messages=messages)

    def count(self, messages: list[dict]) -> int:
        return len(self.ids(messages))

    def text(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False).input_ids)


def _words(n: int = 512) -> list[str]:
    rng = random.Random(20240601)
    onsets = "b c d f g h j k l m n p r s t v w br cl dr fl gr pl st tr".split()
    vowels = "a e i o u ai ea ou".split()
    codas = ["", "", "n", "r", "s", "t", "nd", "st", "l"]

    def syllable() -> str:
        return rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas)

    return sorted({"".join(syllable() for _ in range(rng.randint(1, 3))) for _ in range(n)})


class _Texts:
    """Seeded word text of about n tokens (each word's cost measured once)."""

    def __init__(self, tokens: Tokens) -> None:
        self.words = _words()
        self.cost = {w: max(1, tokens.text(" " + w)) for w in self.words}

    def make(self, rng: random.Random, n: int) -> str:
        out: list[str] = []
        used = 0
        while used < n:
            w = rng.choice(self.words)
            out.append(w)
            used += self.cost[w]
        return " ".join(out)


@dataclass
class _Session:
    id: str
    group: int
    turns: int
    messages: list[dict]
    turn: int = 0
    answer: str = ""  # the stand-in for the last turn's answer


class _Builder:
    def __init__(self, cfg: WorkloadConfig, tokens: Tokens) -> None:
        self.cfg, self.tokens, self.texts = cfg, tokens, _Texts(tokens)
        rng = random.Random(f"{cfg.seed}/system")
        self.systems = [
            f"You are assistant {g}. " + self.texts.make(rng, cfg.system_tokens - 8)
            for g in range(cfg.prefix_groups)
        ]
        self.sessions: list[_Session] = []
        self.made_sessions = 0

    def _output(self, rng: random.Random) -> int:
        return rng.randint(self.cfg.min_output, self.cfg.max_output)

    def _pad(self, rng: random.Random, messages: list[dict]) -> int:
        """Lengthen the last message until the prompt reaches min_prompt; the count."""
        n = self.tokens.count(messages)
        while n < self.cfg.min_prompt:
            extra = self.texts.make(rng, self.cfg.min_prompt - n)
            messages[-1] = {**messages[-1], "content": messages[-1]["content"] + " " + extra}
            n = self.tokens.count(messages)
        return n

    def chat(self, rng: random.Random) -> dict:
        g = rng.randrange(self.cfg.prefix_groups)
        ask = self.texts.make(rng, rng.randint(self.cfg.min_prompt // 4, self.cfg.min_prompt))
        messages = [
            {"role": "system", "content": self.systems[g]},
            {"role": "user", "content": ask},
        ]
        n = self._pad(rng, messages)
        return dict(
            kind="chat",
            lane=INTERACTIVE,
            messages=messages,
            prompt_tokens=n,
            max_tokens=self._output(rng),
            group=f"sys{g}",
        )

    def _new_session(self, rng: random.Random) -> _Session:
        g = rng.randrange(self.cfg.prefix_groups)
        s = _Session(
            id=f"s{self.made_sessions:04d}",
            group=g,
            turns=rng.randint(2, self.cfg.max_turns),
            messages=[{"role": "system", "content": self.systems[g]}],
        )
        self.made_sessions += 1
        self.sessions.append(s)
        return s

    def session_turn(self, rng: random.Random) -> dict:
        if len(self.sessions) < self.cfg.open_sessions:
            s = self._new_session(rng)
        else:
            s = rng.choice(self.sessions)
        lo, hi = self.cfg.min_prompt // 8, self.cfg.min_prompt // 2
        while True:
            history = s.messages + ([{"role": "assistant", "content": s.answer}] if s.turn else [])
            messages = history + [
                {"role": "user", "content": self.texts.make(rng, rng.randint(lo, hi))}
            ]
            n = self.tokens.count(messages)
            if n <= self.cfg.max_prompt or s.turn == 0:
                break
            # the conversation has outgrown the prompt budget: a new one takes its place
            self.sessions.remove(s)
            s = self._new_session(rng)
        n = self._pad(rng, messages)
        s.messages, s.turn = messages, s.turn + 1
        max_tokens = self._output(rng)
        s.answer = self.texts.make(rng, max_tokens)
        if s.turn >= s.turns:
            self.sessions.remove(s)
        return dict(
            kind="session",
            lane=INTERACTIVE,
            messages=[dict(m) for m in messages],
            prompt_tokens=n,
            max_tokens=max_tokens,
            group=f"sys{s.group}",
            session=s.id,
            turn=s.turn,
        )

    def extract(self, rng: random.Random) -> dict:
        cfg = self.cfg
        target = rng.randint(cfg.max_prompt // 2, cfg.max_prompt)
        head = [
            {"role": "system", "content": EXTRACT_SYSTEM},
            {"role": "user", "content": EXTRACT_ASK},
        ]
        doc = self.texts.make(rng, target - self.tokens.count(head)).split(" ")
        while True:
            messages = [head[0], {"role": "user", "content": EXTRACT_ASK + " ".join(doc)}]
            n = self.tokens.count(messages)
            if n <= cfg.max_prompt:
                break
            if not doc:
                raise ValueError(f"max_prompt {cfg.max_prompt} cannot hold the extraction prompt")
            del doc[-max(1, (n - cfg.max_prompt) // 2) :]
        n = self._pad(rng, messages)
        out = rng.randint(cfg.min_output, min(cfg.max_output, 2 * cfg.min_output))
        return dict(
            kind="extract",
            lane=BATCH,
            messages=messages,
            prompt_tokens=n,
            max_tokens=out,
            group="extract",
        )


def generate(cfg: WorkloadConfig, tokens: Tokens) -> list[ServingRequest]:
    """The requests in arrival order, ids r00000, r00001, ... The steady stream and the
    flood draw from their own seeded generators, so changing one leaves the other alone."""
    cfg.check()
    b = _Builder(cfg, tokens)
    rng = random.Random(f"{cfg.seed}/content")
    times = arrival_times(
        random.Random(f"{cfg.seed}/arrivals"), cfg.offered_rate, cfg.burstiness, cfg.duration_s
    )
    made: list[tuple[float, dict]] = []
    for t in times:
        if rng.random() < cfg.batch_share:
            made.append((t, b.extract(rng)))
        elif rng.random() < cfg.session_share:
            made.append((t, b.session_turn(rng)))
        else:
            made.append((t, b.chat(rng)))
    frng = random.Random(f"{cfg.seed}/flood")
    for _ in range(cfg.flood_requests):
        made.append((cfg.flood_at_s + frng.random() * cfg.flood_span_s, b.extract(frng)))
    made.sort(key=lambda x: x[0])
    return [
        ServingRequest(id=f"r{i:05d}", arrival_s=round(t, 6), **r) for i, (t, r) in enumerate(made)
    ]


def write_jsonl(path: str | Path, requests: Iterable[ServingRequest]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            f.write(json.dumps(asdict(r)) + "\n")


def read_jsonl(path: str | Path) -> list[ServingRequest]:
    with open(path, encoding="utf-8") as f:
        return [ServingRequest(**json.loads(line)) for line in f if line.strip()]


# -- the same requests for `vllm bench serve` -------------------------------------------


def flatten(messages: list[dict]) -> str:
    """A conversation as one text; a longer conversation's text starts with a shorter one's."""
    return "".join(f"{m['role']}: {m['content']}\n\n" for m in messages)


def write_vllm_custom(path: str | Path, requests: list[ServingRequest]) -> list[str]:
    """The requests as `vllm bench serve --dataset-name custom` reads them (JSON lines of
    prompt and output_tokens), and the arguments that replay them in this order. What it
    cannot carry: the arrival times (vLLM draws its own with --request-rate and
    --burstiness), the lanes, and the chat roles (each conversation goes as one user
    message, whose text still grows turn by turn and shares the system prompts)."""
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            f.write(
                json.dumps({"prompt": flatten(r.messages), "output_tokens": r.max_tokens}) + "\n"
            )
    return [
        "--dataset-name",
        "custom",
        "--dataset-path",
        str(path),
        "--num-prompts",
        str(len(requests)),
        "--disable-shuffle",
        "--skip-chat-template",
        "--custom-output-len",
        "-1",
        "--backend",
        "openai-chat",
        "--endpoint",
        "/v1/chat/completions",
    ]


def block_hash_ids(prompts: list[list[int]], block: int = 16) -> list[list[int]]:
    """Each prompt's blocks as small integers, equal exactly when the prompts agree on
    every token up to the end of that block (a chained prefix hash); the last, partial
    block gets its own id."""
    table: dict[tuple, int] = {}
    out = []
    for ids in prompts:
        chain, parent = [], -1
        for i in range(0, len(ids), block):
            parent = table.setdefault((parent, tuple(ids[i : i + block])), len(table))
            chain.append(parent)
        out.append(chain)
    return out


def write_vllm_trace(
    path: str | Path, requests: list[ServingRequest], tokens: Tokens, block: int = 16
) -> list[str]:
    """The requests as `vllm bench serve --dataset-name timed_trace` reads them, and the
    arguments that replay them: the arrival times, the lengths and which blocks of the
    prompts are shared are kept exactly (the flood included), the text is not (vLLM fills
    each block id with its own random tokens and sends token ids to /v1/completions;
    run it with PYTHONHASHSEED fixed for the same tokens in every run), nor are the lanes."""
    hashes = block_hash_ids([tokens.ids(r.messages) for r in requests], block)
    with open(path, "w", encoding="utf-8") as f:
        for r, h in zip(requests, hashes, strict=True):
            rec = {
                "timestamp": r.arrival_s,
                "input_length": r.prompt_tokens,
                "output_length": r.max_tokens,
                "hash_ids": h,
            }
            f.write(json.dumps(rec) + "\n")
    return [
        "--dataset-name",
        "timed_trace",
        "--dataset-path",
        str(path),
        "--num-prompts",
        str(len(requests)),
        "--timed-trace-chunk-hash-size",
        str(block),
        "--backend",
        "openai",
        "--endpoint",
        "/v1/completions",
    ]


def vllm_rate_args(cfg: WorkloadConfig) -> list[str]:
    """The arrival process of cfg for `vllm bench serve` (with the custom dataset)."""
    return [
        "--request-rate",
        str(cfg.offered_rate),
        "--burstiness",
        str(cfg.burstiness),
        "--seed",
        str(cfg.seed),
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/bench-llama", help="its tokenizer counts the lengths")
    p.add_argument("--out", help="required, but with --smoke")
    d = WorkloadConfig()
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--duration", type=float, default=d.duration_s)
    p.add_argument("--rate", type=float, default=d.rate)
    p.add_argument("--scale", type=float, default=d.scale)
    p.add_argument("--burstiness", type=float, default=d.burstiness)
    p.add_argument("--batch-share", type=float, default=d.batch_share)
    p.add_argument("--prompt", default=f"{d.min_prompt}-{d.max_prompt}", help="tokens, lo-hi")
    p.add_argument("--output", default=f"{d.min_output}-{d.max_output}", help="tokens, lo-hi")
    p.add_argument("--flood", type=int, default=0, help="batch requests in a burst")
    p.add_argument("--flood-at", type=float, default=None, help="seconds; default a third in")
    p.add_argument("--vllm-custom", help="also write vLLM's custom dataset here")
    p.add_argument("--vllm-trace", help="also write vLLM's timed_trace dataset here")
    from bench.workload import add_smoke_arg, cpu_isa, json_line, smoke_model

    add_smoke_arg(p)
    a = p.parse_args()
    if a.smoke:
        a.model, a.duration, a.prompt, a.output, a.flood = (
            str(smoke_model()),
            4.0,
            "32-256",
            "4-8",
            4,
        )
        tmp = Path(tempfile.mkdtemp(prefix="plurai-workload-"))
        a.out = a.out or str(tmp / "workload.jsonl")
        a.vllm_custom = a.vllm_custom or str(tmp / "vllm-custom.jsonl")
        a.vllm_trace = a.vllm_trace or str(tmp / "vllm-trace.jsonl")
    elif not a.out:
        p.error("the following arguments are required: --out")

    lo_in, hi_in = map(int, a.prompt.split("-"))
    lo_out, hi_out = map(int, a.output.split("-"))
    kw = dict(
        seed=a.seed,
        duration_s=a.duration,
        rate=a.rate,
        scale=a.scale,
        burstiness=a.burstiness,
        batch_share=a.batch_share,
        min_prompt=lo_in,
        max_prompt=hi_in,
        min_output=lo_out,
        max_output=hi_out,
    )
    if a.flood:
        kw.update(flood_requests=a.flood)
        if a.flood_at is not None:
            kw.update(flood_at_s=a.flood_at)
        cfg = flood_scenario(**kw)
    else:
        cfg = WorkloadConfig(**kw)
    from bench.workload import bench_model

    model = bench_model(a.model)
    tokens = Tokens(model)
    reqs = generate(cfg, tokens)
    write_jsonl(a.out, reqs)
    summary: dict = {"requests": len(reqs), "file": a.out, "config": asdict(cfg), "isa": cpu_isa()}
    if a.vllm_custom:
        summary["vllm_custom_args"] = write_vllm_custom(a.vllm_custom, reqs) + vllm_rate_args(cfg)
    if a.vllm_trace:
        summary["vllm_trace_args"] = write_vllm_trace(a.vllm_trace, reqs, tokens)
    json_line(summary, a.smoke)


if __name__ == "__main__":
    main()
