"""Fleet scale by simulation: routers against Plurai's KV-aware pulling, on the same seeded
requests, as a discrete-event simulation (one heap of events; no Redis, engines or threads).
One file, though long: the simulated engines and policies, their calibration on a measured
run and the fleets share one set of constants and are read together.

    python -m bench.serving.simulation [--calibrate-from DIR] [--check-against DIR[,DIR]]
        [--check-budget 512] [--sizes 64,256,1000] [--scales 0.3,0.6,1.0,1.2,1.4,1.6]
        [--duration 60] [--pull-budget 512] [--tpot-share 0.8] [--wait-share 0.5]
        [--lookahead 0] [--seed 0] [--smoke]

--smoke: one fleet of 4 engines at two loads of 5 s each, on the default constants (no
calibration): a check that the bench runs, not a measurement.

Policies. Routers assign a request when it arrives: round_robin; power_of_two (two engines
at random, the one with fewer outstanding requests); cache_aware (vllm-router's and the
SGLang router's idea: the router keeps, per engine, a tree of the prompts it sent there; if
the outstanding counts are imbalanced, max - min > 32 and max > 1.0001 * min, the least
loaded engine; else the engine whose tree matches the longest share of the prompt, if that
share is over 0.5; else the engine with the smallest tree). Pulling (Plurai): one FIFO queue
per lane; each engine's worker decides what it takes with the worker's own admission
policy (gpu_workers/admission.py, the same object, fed the simulated engine's figures): an
idle engine takes the head of the highest non-empty lane; a busy one while it has a free
slot and KV room for prompt + max_tokens, within the prompt backlog bound where one
applies (the lower lanes' --pull-budget, PLURAI_PREFILL_BACKLOG_TOKENS, while the top lane
runs there; every lane's step budget with an objective), no lower-lane entry beside a
top-lane prompt with no token yet, nor while the top lane's tokens come over
PLURAI_TOP_LANE_SLOWDOWN times slower than unloaded, nor into the top lane's reserved
slots and KV; at most its takes a step; every 8th take starts at the lower lanes
(PLURAI_FAIR_EVERY, the queue's read order). With a top-lane TPOT target
(PLURAI_TOP_LANE_TPOT_MS; --tpot-share of the SLO, or the measured run's), an engine over
it while top-lane sequences decode there takes nothing of the lower lanes; of the top
lane, it takes arrivals while lower-lane requests run on it, else only the head once that
has waited --wait-share of the TTFT SLO (PLURAI_TOP_LANE_WAIT_MS), one a poll
(PLURAI_POLL_MS); after 7 such takes, the next is the lower lanes' head (their fair turn
in the hold). Engines that found the queue empty wait in line and the longest-waiting
pulls first (a blocking stream read); the others pull again at the end of each step.
--lookahead N lets a puller take, among the first N entries of the lane, the one with the
most leading blocks on its device (an entry skipped N times is taken first). Prefix blocks
on the engine's device are free; blocks in the fleet's shared pool (every pulling engine
writes what it computed; LRU of --pool-blocks) cost `pool_block_s` each, paid before the
request joins the engine's waiting list; the rest is computed. Routers have no pool.

Engines batch like vLLM: a step runs every decoding sequence (one token each), then
prefill chunks of partly prefilled and then waiting sequences (waiting ordered by lane,
then arrival: vLLM's priority scheduling) up to 2048 tokens, with at most 256 sequences
running. A step takes a + b * prompt tokens computed + c * decoding sequences + d * context
tokens attended (a decode attends its context, a chunk the prompt up to its end). A request's
first token comes at the end of the step that computes its last prompt token (at least one
is always computed, as in vLLM); it finishes after its output tokens. Each engine has a
device prefix cache of 16-token blocks (the measured engines' block when replaying), LRU,
holding what its KV budget (1 GiB of the bench model's fp32 KV) leaves beside the running
sequences. A machine's speed wanders (the noisy shared machine): the steps of its engines
take a factor, lognormal of mean 1 (noise_sd), drawn anew after exponential stretches
(noise_s mean); a replayed run's K engines share one machine, a fleet's come
--machine-engines to a machine.
TTFT and end times get the front's fixed overhead, one constant per stack kind (router;
gateway + queue).

Prefix identity. The replayed workloads carry messages, not tokens; the results carry each
prompt's token count. A prompt's conversation text (bench/serving/workload.py's flatten) is
cut into blocks at the workload's mean characters per token: block i stands for the text up
to (i + 1) * block tokens, chained on the block before (as a chained block hash), so two
prompts share exactly the leading blocks whose text they share: a system prompt, a
session's earlier turns, the extraction instructions. The block is the measured engines'
(the gcd of the results' cached tokens: 128 on vLLM's CPU backend); replayed this way the
simulated routers' cached tokens come within a few blocks of the measured ones. Generated
fleets use the same structure in token counts (bench/serving/workload.py's chats, sessions
and extractions, with 2 prefix groups and 2 open sessions per engine) and 16-token blocks.
Requests of the same instant are queued together before an engine pulls (a burst).

Calibration (--calibrate-from a bench/serving/ folder, K = 2): its sweep and flood runs
are whatever out.json holds; a measured request arrives at its sent_s (when the load
generator really sent it); plurai-vllm pulls with out.json's plurai_prefill_backlog_tokens,
else --check-budget (2048 for runs before the bound). The constants are fitted on the
figures the check compares, not on single requests: per stack and load, the interactive
TTFT p99, SLO attainment and the interactive TTFT and TPOT medians (figures_error). A
first guess comes from the idle run (one request at a time: its TPOT is a + c, the batch
lane's longer TTFT per extra token computed is b, the rest of the TTFT the front, the
router's and the queue's); the share of c in a + c, which the idle run cannot tell, and
the speed noise go on a grid, then every constant by coordinate descent together (one set
for all stacks; no constant is tuned per stack). The check (--check-against, default the
calibration folder: another is out of sample) replays every run of each folder at its K
through every stack's policy and compares interactive TTFT p99 (sweeps and flood) and
goodput with the measured ones: within 20% or not, reported as it comes out. Beside each
p99 are the measured repeats' own, and the summary counts the loads whose repeats agree
within 20%: on a noisy 2-core machine a 40 s run's p99 moves by more than that from one
run of the same load to the next, which bounds how close any model can come.
Then fleets of --sizes engines at --scales of the simulated capacity per engine * engines:
the capacity is measured in the simulation as bench/serving/ measures the real one (a
saturating burst of about 12 requests per engine, its third quarter of completions / its
end, pulling); the measured run's is reported beside the simulated one at K = 2 (the median
of 5 bursts: one of 24 requests moves by 2x from one seed to the next). Figures (p50/p99,
SLO attainment, goodput) are bench/serving/figures.py's own. The last line is one JSON
object.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
import time
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.serving import figures as sf
from bench.serving.workload import arrival_times, flatten
from plurai.broker_config.settings import Settings
from plurai.gpu_workers.admission import Admission

ROOT = Path(__file__).resolve().parents[2]

BLOCK = 16  # vLLM's block on a GPU
STEP_TOKENS = 2048  # vLLM's max_num_batched_tokens
MAX_SEQS = 256
# PLURAI_FAIR_EVERY's default: every fair_every-th take of a worker starts at the lower lanes
FAIR_EVERY: int = Settings.model_fields["fair_every"].default
KV_TOKEN_BYTES = 2 * 12 * 4 * 64 * 4  # bench-llama: K and V, 12 layers, 4 heads of 64, fp32
KV_TOKENS = (1 << 30) // KV_TOKEN_BYTES  # 1 GiB per engine, as the serving bench runs it
LANES = ("interactive", "batch")
ROUTERS = ("round_robin", "power_of_two", "cache_aware")
POLICIES = (*ROUTERS, "pull")
STACK_POLICY = {"plurai-vllm": "pull", **{r: r for r in ROUTERS}}
TOLERANCE = 0.2
SEEDS = 3  # the check replays each measured run with this many seeds of the speed noise
CAPACITY_SEEDS = 5  # the simulated K = 2 capacity: the median of this many bursts
# vllm-router's cache-aware defaults
BALANCE_ABS, BALANCE_REL, CACHE_THRESHOLD = 32, 1.0001, 0.5


@dataclass
class Constants:
    a_s: float  # per step
    b_s: float  # per prompt token computed
    c_s: float  # per decoding sequence
    d_s: float  # per context token attended
    router_front_s: float  # client -> vllm-router -> vllm serve and back
    queue_front_s: float  # client -> gateway -> Redis queue -> worker and back
    pool_block_s: float  # one 16-token block copied from the Redis KV pool
    # a machine's speed wanders: its engines' steps take a factor, lognormal of mean 1 and
    # this sd of its log, drawn anew after exponential stretches of noise_s mean
    noise_sd: float = 0.0
    noise_s: float = 2.0


# Fitted by `--calibrate-from` a bench/serving/ sweep folder (0.6-1.2x, two rounds a
# load), K = 2, bench-llama bf16, vLLM CPU engines bound to a core each on a 2-core AVX-512
# machine (out.json capacity 9.473 req/s), pull budget 512, top-lane target 52 ms, wait
# bound 239 ms. pool_block_s is not fitted (the run does not split device hits from pool
# hits): a block over a local Redis, about 1 ms.
DEFAULTS = Constants(
    a_s=0.0138,
    b_s=0.00035,
    c_s=0.00299,
    d_s=1e-07,
    router_front_s=0.0962,
    queue_front_s=0.0775,
    pool_block_s=0.001,
    noise_sd=0.46,
    noise_s=0.5,
)
# the same run's SLOs (5x the idle interactive TTFT and TPOT medians, 10x the batch e2e)
DEFAULT_SLOS = {
    "interactive": sf.Slo(ttft_s=0.4778, tpot_s=0.0646),
    "batch": sf.Slo(e2e_s=5.3988),
}
DEFAULT_CAPACITY_PER_ENGINE = 9.473 / 2  # the measured one, for reference


@dataclass(slots=True)
class Req:
    id: str
    arrival_s: float
    lane: str
    prompt: int
    output: int  # tokens it generates
    max_tokens: int
    blocks: tuple[int, ...]  # its full prompt blocks, equal ids for equal prefixes
    prio: int = 0
    # filled by the run
    left: int = 0  # prompt tokens still to compute
    device: int = 0  # prompt tokens found on the engine's device
    pool: int = 0  # prompt tokens copied from the pool
    reserved: int = 0  # KV blocks held
    skips: int = 0
    engine: int = -1
    first_s: float | None = None
    end_s: float | None = None


# -- workloads --------------------------------------------------------------------------


class Prefixes:
    """Block ids from prefix structure: a prompt is a list of (prefix key, tokens at its
    end); a block's id is (the first key whose end covers the block, the block's index)."""

    def __init__(self) -> None:
        self.keys: dict[Any, int] = {}
        self.ends: dict[int, int] = {}
        self.ids: dict[tuple[int, int], int] = {}

    def key(self, k: Any, end: int) -> tuple[int, int]:
        i = self.keys.setdefault(k, len(self.keys))
        return i, self.ends.setdefault(i, end)

    def blocks(self, bounds: list[tuple[int, int]], prompt: int) -> tuple[int, ...]:
        out, j = [], 0
        for i in range(prompt // BLOCK):
            end = (i + 1) * BLOCK
            while j < len(bounds) - 1 and bounds[j][1] < end:
                j += 1
            out.append(self.ids.setdefault((bounds[j][0], i), len(self.ids)))
        return tuple(out)


def from_messages(
    rows: list[dict], results: dict[str, dict] | None = None, block: int = BLOCK
) -> list[Req]:
    """Requests of a serving workload file (its JSON rows); token counts, output lengths
    and arrival times from `results` (id -> result row) where there is one: a measured
    request arrives when the load generator really sent it (its sent_s, on the workload's
    clock; on a busy machine up to hundreds of ms after its arrival_s). Block i of a prompt stands for
    the characters of its conversation text up to (i + 1) * block tokens at the workload's
    mean characters per token, chained on the block before, so prompts share exactly the
    blocks whose text they share from the start."""
    texts = [flatten(row["messages"]) for row in rows]
    res = [(results or {}).get(row["id"], {}) for row in rows]
    prompts = [
        int(x.get("prompt_tokens") or row["prompt_tokens"])
        for x, row in zip(res, rows, strict=True)
    ]
    per_token = sum(map(len, texts)) / max(1, sum(prompts))
    ids: dict[tuple[int, str], int] = {}
    out = []
    for row, x, text, prompt in zip(rows, res, texts, prompts, strict=True):
        chain, parent, start = [], -1, 0
        for i in range(prompt // block):
            end = min(len(text), round((i + 1) * block * per_token))
            parent = ids.setdefault((parent, text[start:end]), len(ids))
            chain.append(parent)
            start = end
        lane = row["lane"]
        sent = x.get("sent_s")
        out.append(
            Req(
                row["id"],
                float(row["arrival_s"] if sent is None else sent),
                lane,
                prompt,
                max(1, int(x.get("output_tokens") or row["max_tokens"])),
                int(row["max_tokens"]),
                tuple(chain),
                LANES.index(lane) if lane in LANES else len(LANES),
            )
        )
    return out


@dataclass
class Shape:
    """Generated requests in token counts, as bench/serving/workload.py builds them with
    --prompt 64-512 --output 16-64 (the calibration run's)."""

    groups: int = 4
    open_sessions: int = 4
    batch_share: float = 0.2
    session_share: float = 0.5
    burstiness: float = 0.3
    system_tokens: int = 140  # the svF prompts' system prefix, template included
    min_prompt: int = 64
    max_prompt: int = 512
    min_output: int = 16
    max_output: int = 64
    max_turns: int = 6
    turn_overhead: int = 5  # template tokens around one message


def generate(shape: Shape, rate: float, duration_s: float, seed: int) -> list[Req]:
    rng = random.Random(f"{seed}/content")
    times = arrival_times(random.Random(f"{seed}/arrivals"), rate, shape.burstiness, duration_s)
    px = Prefixes()
    sessions: list[list] = []  # [id, bounds, prompt, answer, turn, turns]
    made = 0
    out = []
    o = shape.turn_overhead
    for n, t in enumerate(times):
        rid = f"r{n:06d}"
        if rng.random() < shape.batch_share:
            prompt = rng.randint(shape.max_prompt // 2, shape.max_prompt)
            output = rng.randint(shape.min_output, min(shape.max_output, 2 * shape.min_output))
            bounds = [px.key(("doc", rid), prompt)]
            lane = "batch"
        elif rng.random() < shape.session_share:
            if len(sessions) < shape.open_sessions:
                g = rng.randrange(shape.groups)
                sessions.append([f"s{made}", [px.key(("sys", g), shape.system_tokens)], 0, 0, 0, 0])
                sessions[-1][5] = rng.randint(2, shape.max_turns)
                made += 1
            s = rng.choice(sessions)
            ask = rng.randint(shape.min_prompt // 8, shape.min_prompt // 2) + o
            bounds = list(s[1])
            if s[4]:
                bounds.append(px.key((s[0], s[4], "answer"), s[2] + s[3] + o))
            end = bounds[-1][1] + ask
            prompt = max(shape.min_prompt, end)
            bounds.append(px.key((s[0], s[4], "ask"), prompt))
            output = rng.randint(shape.min_output, shape.max_output)
            s[1], s[2], s[3], s[4] = bounds, prompt, output, s[4] + 1
            if s[4] >= s[5] or prompt + output + 2 * o + shape.min_prompt // 2 > shape.max_prompt:
                sessions.remove(s)
            lane = "interactive"
        else:
            g = rng.randrange(shape.groups)
            ask = rng.randint(shape.min_prompt // 4, shape.min_prompt) + o
            prompt = max(shape.min_prompt, shape.system_tokens + ask)
            bounds = [px.key(("sys", g), shape.system_tokens), px.key(("chat", rid), prompt)]
            output = rng.randint(shape.min_output, shape.max_output)
            lane = "interactive"
        out.append(
            Req(rid, t, lane, prompt, output, output, px.blocks(bounds, prompt), LANES.index(lane))
        )
    return out


# -- the simulation ---------------------------------------------------------------------


class Lru:
    """Block ids, least recently used first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.d: OrderedDict[int, None] = OrderedDict()

    def leading(self, blocks: tuple[int, ...], start: int = 0, limit: int | None = None) -> int:
        """How many of blocks[start:limit] from start on are held; touches them."""
        n, d = 0, self.d
        for b in blocks[start:limit]:
            if b not in d:
                break
            d.move_to_end(b)
            n += 1
        return n

    def peek(self, blocks: tuple[int, ...], limit: int) -> int:
        n, d = 0, self.d
        for b in blocks[:limit]:
            if b not in d:
                break
            n += 1
        return n

    def add(self, blocks: tuple[int, ...], room: int) -> None:
        d = self.d
        for b in blocks:
            d[b] = None
            d.move_to_end(b)
        while len(d) > max(0, room):
            d.popitem(last=False)


@dataclass(slots=True)
class Engine:
    """A simulated engine; the worker's admission policy (gpu_workers/admission.py) reads
    it as its engine and its running jobs."""

    i: int
    cache: Lru
    kv_blocks: int
    block: int
    used: int = 0  # KV blocks reserved by its requests
    outstanding: int = 0  # assigned and not finished
    pending: int = 0  # prompt tokens of the requests assigned with no token yet
    pending_top: int = 0  # the same, of the top lane's requests
    lower: int = 0  # assigned and not finished, of the lanes below the top one
    waiting: list = field(default_factory=list)  # heap (prio, arrival, n, req)
    prefilling: list = field(default_factory=list)
    decoding: int = 0
    context: int = 0  # tokens attended by the decoding sequences
    finishes: list = field(default_factory=list)  # heap (step, n, req)
    steps: int = 0
    busy: bool = False
    in_line: bool = False  # waits for work (pulling)
    tree: set = field(default_factory=set)  # the cache-aware router's view of its blocks
    speed: float = 1.0  # its machine's steps' time factor (Constants.noise_sd)
    speed_until: float = 0.0
    decoding_top: int = 0  # top-lane sequences among the decoding ones
    takes: int = 0  # entries taken (a fair turn is every FAIR_EVERY-th)
    adm: Any = None  # its worker's Admission, pulling
    max_num_seqs: int = MAX_SEQS
    step_tokens: int = STEP_TOKENS
    num_waiting: int = 0  # counted in num_running

    @property
    def prompt_backlog(self) -> int:
        return self.pending

    @property
    def num_running(self) -> int:
        return self.outstanding

    def has_unfinished(self) -> bool:
        return self.outstanding > 0

    def can_admit(
        self, prompt_tokens: int, max_tokens: int, priority: int | None = None, spare: int = 0
    ) -> bool:
        """A slot and KV for the request and `spare` tokens more; no preemption here."""
        blocks = -(-(prompt_tokens + max_tokens + spare) // self.block)
        return self.outstanding < MAX_SEQS and self.used + blocks <= self.kv_blocks

    def top_backlog(self) -> int:
        return self.pending_top

    def lower_running(self) -> bool:
        return self.lower > 0

    def top_making(self) -> bool:
        return self.decoding_top > 0


class Sim:
    def __init__(
        self,
        engines: int,
        policy: str,
        k: Constants,
        pull_budget: int = 512,
        tpot_target_s: float = 0.0,
        wait_s: float = 0.5,
        lookahead: int = 0,
        pool_blocks: int = 1 << 20,
        kv_tokens: int = KV_TOKENS,
        block: int = BLOCK,
        machine: int = 1,
        seed: int = 0,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r}: choose one of {', '.join(POLICIES)}")
        self.policy, self.k, self.lookahead = policy, k, lookahead
        self.machine = max(1, machine)  # engines per machine, sharing its speed
        self.block, self.kv_blocks = block, kv_tokens // block
        self.engines = [
            Engine(i, Lru(self.kv_blocks), self.kv_blocks, block) for i in range(engines)
        ]
        settings = Settings.model_construct(  # the defaults, but for the knobs the run sets
            lanes=list(LANES),
            prefill_backlog_tokens=pull_budget,
            top_lane_tpot_ms=1000 * tpot_target_s,
            top_lane_wait_ms=1000 * wait_s,
        )
        for e in self.engines:
            e.adm = Admission.of(settings, e, e)
        self.pool = Lru(pool_blocks) if policy == "pull" else None
        self.rng = random.Random(f"{seed}/policy")
        self.noise = random.Random(f"{seed}/noise")
        self.events: list = []
        self.n = 0  # tie-breaker, so equal times run in the order they were made
        self.rr = 0
        self.lanes: list[deque] = [deque() for _ in LANES]
        self.line: deque[Engine] = deque(self.engines)  # pullers waiting for work
        for e in self.engines:
            e.in_line = True
        self.front = k.queue_front_s if policy == "pull" else k.router_front_s
        # the cache-aware router: engines by outstanding count, block -> engines whose tree
        # holds it, (tree size, engine) with stale entries skipped
        self.by_load: dict[int, set[int]] = {0: set(range(engines))}
        self.load_min = self.load_max = 0
        self.index: dict[int, set[int]] = {}
        self.sizes = [(0, i) for i in range(engines)]

    def push(self, t: float, kind: int, a: Any, b: Any = None) -> None:
        self.n += 1
        heapq.heappush(self.events, (t, self.n, kind, a, b))

    # event kinds
    STEP, READY = 0, 1

    def run(self, reqs: list[Req]) -> list[Req]:
        """Every request to its end; returns them with their times filled in."""
        for r in reqs:
            if -(-(r.prompt + r.max_tokens) // self.block) > self.kv_blocks:
                raise ValueError(f"request {r.id} needs more KV than an engine has")
        arrivals = sorted(reqs, key=lambda r: r.arrival_s)
        i, ev = 0, self.events
        while i < len(arrivals) or ev:
            if i < len(arrivals) and (not ev or arrivals[i].arrival_s <= ev[0][0]):
                # requests of the same instant (a burst) are all queued before anyone pulls
                now, j = arrivals[i].arrival_s, i
                while i < len(arrivals) and arrivals[i].arrival_s == now:
                    i += 1
                self.arrive(arrivals[j:i], now)
                continue
            t, _, kind, a, b = heapq.heappop(ev)
            if kind == self.STEP:
                self.step_end(a, b, t)
            else:
                self.ready(a, b, t)
        for r in reqs:
            r.first_s = None if r.first_s is None else r.first_s + self.front
            r.end_s = None if r.end_s is None else r.end_s + self.front
        return reqs

    # routers and the queue

    def arrive(self, reqs: list[Req], now: float) -> None:
        if self.policy == "pull":
            for r in reqs:
                self.lanes[min(r.prio, len(LANES) - 1)].append(r)
            line = self.line
            while line and any(self.lanes):
                e = line.popleft()
                e.in_line = False
                self.pull(e, now)
            return
        for r in reqs:
            self.assign(self.route(r), r, now)

    def route(self, r: Req) -> Engine:
        es = self.engines
        if self.policy == "round_robin":
            self.rr = (self.rr + 1) % len(es)
            return es[self.rr - 1]
        if self.policy == "power_of_two":
            if len(es) == 1:
                return es[0]
            x, y = self.rng.sample(es, 2)
            return y if y.outstanding < x.outstanding else x
        hi, lo = self.load_max, self.load_min
        if hi - lo > BALANCE_ABS and hi > BALANCE_REL * lo:
            e = es[min(self.by_load[lo])]
        else:
            cands, depth = set(), 0
            for b in r.blocks:
                held = self.index.get(b)
                nxt = held if not depth else cands & held if held else None
                if not nxt:
                    break
                cands, depth = nxt, depth + 1
            if depth and depth * self.block / r.prompt > CACHE_THRESHOLD:
                e = es[min(cands, key=lambda i: (es[i].outstanding, i))]
            else:
                sizes = self.sizes
                while sizes[0][0] != len(es[sizes[0][1]].tree):  # stale entries
                    heapq.heapreplace(sizes, (len(es[sizes[0][1]].tree), sizes[0][1]))
                e = es[sizes[0][1]]
        new = [b for b in r.blocks if b not in e.tree]
        if new:
            e.tree.update(new)
            for b in new:
                self.index.setdefault(b, set()).add(e.i)
            heapq.heappush(self.sizes, (len(e.tree), e.i))
        return e

    def load(self, e: Engine, delta: int) -> None:
        """Outstanding counts, kept by value for the cache-aware router's balance check."""
        before = e.outstanding
        e.outstanding += delta
        if self.policy != "cache_aware":
            return
        by = self.by_load
        by[before].discard(e.i)
        by.setdefault(e.outstanding, set()).add(e.i)
        self.load_max = max(self.load_max, e.outstanding)
        while not by.get(self.load_max):
            self.load_max -= 1
        self.load_min = min(self.load_min, e.outstanding)
        while not by.get(self.load_min):
            self.load_min += 1

    def fits(self, e: Engine, r: Req, now: float) -> bool:
        """Whether e's worker would start r now: an idle engine always; else as the
        worker's admission says (room, the prompt backlog bound)."""
        top = r.lane == LANES[0]
        return not e.outstanding or e.adm.fits(r.prompt, r.max_tokens, top, now)

    def pick(self, e: Engine, lane: deque) -> int:
        """The index in lane that e takes: the head, or with lookahead the entry of the
        first N with the most leading blocks on e's device (one skipped N times first)."""
        n = min(self.lookahead, len(lane))
        if n <= 1:
            return 0
        best, most = 0, 0
        for j in range(n):
            r = lane[j]
            if r.skips >= self.lookahead:
                return j
            held = e.cache.peek(r.blocks, (r.prompt - 1) // self.block)
            if held > most:
                best, most = j, held
        for j in range(best):
            lane[j].skips += 1
        return best

    def pull(self, e: Engine, now: float) -> None:
        """e takes entries while its worker's admission lets them in, at most its takes a
        step; it waits in line if the lanes are empty. While the top lane is over its
        target, it takes nothing of the lower lanes, and of the top lane only while
        lower-lane requests run on it, else only the top lane's head once that has waited
        top_lane_wait_ms (one a poll), with the lower lanes' fair turn among those takes
        (the worker's Taker, gpu_workers/take.py)."""
        adm, top = e.adm, self.lanes[0]
        slow = adm.slow()
        if slow and not e.lower:
            if adm.look_for_waited(now):
                lower = next((q for q in self.lanes[1:] if q), None)
                if adm.fair_turn() and lower and self.startable(e, lower[0], now):
                    adm.took_waited(1, fair=True)
                    self.assign(e, lower.popleft(), now)
                elif (
                    top
                    and now - top[0].arrival_s >= adm.wait_ms / 1000
                    and self.fits(e, top[0], now)
                ):
                    adm.took_waited(1, fair=False)
                    self.assign(e, top.popleft(), now)
            return
        for _ in range(adm.takes()):
            lanes = self.lanes
            if slow:
                lanes = lanes[:1]
            elif (e.takes + 1) % FAIR_EVERY == 0:
                lanes = lanes[1:] + lanes[:1]  # the lower lanes' fair turn (the read order)
            lane = next((q for q in lanes if q), None)
            if lane is None:
                if slow:
                    return  # it pulls again after its next step, when it may be fast again
                if not e.in_line:
                    e.in_line = True
                    self.line.append(e)
                return
            if lane is not top and not adm.room_below_top(now):
                return  # held: the top lane's reserve and pace
            j = self.pick(e, lane)
            r = lane[j]
            if not self.fits(e, r, now):
                return
            del lane[j]
            self.assign(e, r, now)

    def startable(self, e: Engine, r: Req, now: float) -> bool:
        """Whether lower-lane r may start on e now."""
        return bool(e.adm.room_below_top(now)) and self.fits(e, r, now)

    def assign(self, e: Engine, r: Req, now: float) -> None:
        limit = (r.prompt - 1) // self.block  # at least one token is computed
        dev = e.cache.leading(r.blocks, 0, limit)
        pool = self.pool.leading(r.blocks, dev, limit) if self.pool is not None else 0
        r.engine, r.device, r.pool = e.i, dev * self.block, pool * self.block
        e.takes += 1
        if self.policy == "pull":
            e.adm.taken(r.prompt, r.max_tokens, 1, r.lane == LANES[0])
            if r.lane == LANES[0]:
                e.adm.pace.seen(now)
        r.left = r.prompt - r.device - r.pool
        r.reserved = -(-(r.prompt + r.max_tokens) // self.block)
        e.used += r.reserved
        self.load(e, 1)
        e.pending += r.prompt
        e.pending_top += r.prompt if r.lane == LANES[0] else 0
        e.lower += r.lane != LANES[0]
        if pool:
            self.push(now + pool * self.k.pool_block_s, self.READY, e, r)
        else:
            self.ready(e, r, now)

    # the engine

    def ready(self, e: Engine, r: Req, now: float) -> None:
        self.n += 1
        heapq.heappush(e.waiting, (r.prio, r.arrival_s, self.n, r))
        if not e.busy:
            self.step_start(e, now)

    def step_start(self, e: Engine, now: float) -> None:
        k = self.k
        budget = STEP_TOKENS - e.decoding
        computed, attended = 0, e.context
        chunks = []
        for r in e.prefilling:
            if budget <= 0:
                break
            take = min(r.left, budget)
            budget -= take
            computed += take
            attended += r.prompt - r.left + take
            chunks.append((r, take))
        while budget > 0 and e.waiting and e.decoding + len(e.prefilling) < MAX_SEQS:
            r = heapq.heappop(e.waiting)[3]
            e.prefilling.append(r)
            take = min(r.left, budget)
            budget -= take
            computed += take
            attended += r.prompt - r.left + take
            chunks.append((r, take))
        if not chunks and not e.decoding:
            e.busy = False
            return
        e.busy = True
        dt = k.a_s + k.b_s * computed + k.c_s * e.decoding + k.d_s * attended
        if k.noise_sd:
            box = self.engines[e.i - e.i % self.machine]  # the engines of a machine share it
            if now >= box.speed_until:
                sd = k.noise_sd
                box.speed = math.exp(self.noise.gauss(-sd * sd / 2, sd))
                box.speed_until = now + self.noise.expovariate(1 / k.noise_s)
            dt *= box.speed
        self.push(now + dt, self.STEP, e, (chunks, e.decoding, e.decoding_top, dt))

    def step_end(self, e: Engine, step: tuple, now: float) -> None:
        chunks, decoded, top, dt = step
        e.steps += 1
        e.context += decoded
        if top and self.policy == "pull":  # each decoding top-lane sequence made a token
            e.adm.pace.tokens(dt * top, top, now)
        fin = e.finishes
        while fin and fin[0][0] <= e.steps:
            r = heapq.heappop(fin)[2]
            self.finish(e, r, now)
            e.decoding -= 1
            e.decoding_top -= r.lane == LANES[0]
        for r, take in chunks:
            r.left -= take
            if r.left:
                continue
            e.prefilling.remove(r)
            e.pending -= r.prompt
            e.pending_top -= r.prompt if r.lane == LANES[0] else 0
            r.first_s = now
            room = self.kv_blocks - e.used
            e.cache.add(r.blocks, room)
            if self.pool is not None:
                self.pool.add(r.blocks, self.pool.capacity)
            if r.output <= 1:
                self.finish(e, r, now)
            else:
                e.decoding += 1
                e.decoding_top += r.lane == LANES[0]
                e.context += r.prompt + 1
                self.n += 1
                heapq.heappush(fin, (e.steps + r.output - 1, self.n, r))
        if self.pool is not None:
            self.pull(e, now)
        self.step_start(e, now)

    def finish(self, e: Engine, r: Req, now: float) -> None:
        r.end_s = now
        e.lower -= r.lane != LANES[0]
        e.used -= r.reserved
        self.load(e, -1)
        if r.output > 1:
            e.context -= r.prompt + r.output


def simulate(reqs: list[Req], engines: int, policy: str, k: Constants, **kw: Any) -> list[Req]:
    fresh = [replace(r) for r in reqs]
    return Sim(engines, policy, k, **kw).run(fresh)


def results(reqs: list[Req]) -> list[sf.Result]:
    return [
        sf.Result(
            id=r.id,
            lane=r.lane,
            sent_s=r.arrival_s,
            first_token_s=r.first_s,
            end_s=r.end_s,
            output_tokens=r.output,
            ok=r.end_s is not None,
            prompt_tokens=r.prompt,
            cached_tokens=r.device + r.pool,
        )
        for r in reqs
    ]


def prefill(reqs: list[Req]) -> dict[str, int]:
    return {
        "computed_tokens": sum(r.prompt - r.device - r.pool for r in reqs),
        "device_tokens": sum(r.device for r in reqs),
        "pool_tokens": sum(r.pool for r in reqs),
    }


def p_ttft_s(
    res: list[sf.Result], p: float, lane: str = "interactive", name: str = "ttft"
) -> float | None:
    """The p-th percentile of the lane's TTFT (or `name`: "tpot") in seconds; None with no
    values."""
    xs = [x for r in res if r.lane == lane and (x := getattr(r, name)) is not None]
    v = sf.percentile(xs, p)
    return None if math.isnan(v) else round(v, 4)


def p99_ttft_s(res: list[sf.Result], lane: str = "interactive") -> float | None:
    return p_ttft_s(res, 99, lane)


# -- calibration ------------------------------------------------------------------------


def _read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@dataclass
class Measured:
    folder: str
    out: dict  # out.json's last line
    workloads: dict[str, list[dict]]  # run -> workload rows
    results: dict[str, dict[str, list[dict]]]  # stack -> run -> result rows
    budget: int = 512  # the plurai stack's pull budget (PLURAI_PREFILL_BACKLOG_TOKENS)
    block: int = BLOCK  # the measured engines' cache block
    target_s: float = 0.0  # its top-lane TPOT target (PLURAI_TOP_LANE_TPOT_MS); 0: none
    wait_s: float = 0.0  # its bound on a top-lane entry's wait (PLURAI_TOP_LANE_WAIT_MS)
    idle: list[dict] = field(default_factory=list)  # the idle run's requests (workload rows)
    reqs: dict[tuple[str, str], list[Req]] = field(default_factory=dict)

    @property
    def sweeps(self) -> list[str]:
        """The sweep runs, by scale (a scale's repeats, sweep@0.5#1, after it)."""
        runs = [r for r in self.workloads if r.startswith("sweep@")]
        return sorted(runs, key=lambda r: (float(r.split("@")[1].split("#")[0]), r))

    @property
    def runs(self) -> list[str]:
        """The sweeps, then the flood where there is one."""
        return self.sweeps + [r for r in self.workloads if r == "flood"]

    def requests(self, stack: str, run: str) -> list[Req]:
        if (stack, run) not in self.reqs:
            res = {r["id"]: r for r in self.results[stack][run]}
            self.reqs[stack, run] = from_messages(self.workloads[run], res, self.block)
        return self.reqs[stack, run]


IDLE_REQUESTS = 10  # bench/serving/'s idle run sends its workload's first 10, one at a time


def workload_file(run: str) -> str:
    """bench/serving/'s name for a run's workload: sweep@0.7 -> sweep-0.7.jsonl."""
    return run.replace("@", "-") + ".jsonl"


def load(folder: str | Path, budget: int = 512) -> Measured:
    """A bench/serving/ folder's figures, and the workloads and per-request results of
    its sweep runs and flood. The pull budget is out.json's plurai_prefill_backlog_tokens,
    else `budget` (runs before the bound pulled with 2048). The engines' cache block is the
    gcd of the cached token counts (vLLM's CPU backend caches 128-token blocks, its GPU
    build 16)."""
    folder = Path(folder)
    lines = (folder / "out.json").read_text().strip().splitlines()
    if not lines:
        raise ValueError(f"{folder / 'out.json'} is empty: the bench run has not finished")
    out = json.loads(lines[-1])
    named = {run for s in out["stacks"].values() for run in s.get("runs", {})}
    runs = [r for r in named if r.startswith("sweep@") or r == "flood"]
    work = {
        r: _read_jsonl(folder / workload_file(r))
        for r in runs
        if (folder / workload_file(r)).exists()
    }
    res = {
        stack: {
            run: _read_jsonl(folder / stack / f"{run}.results.jsonl")
            for run in work
            if (folder / stack / f"{run}.results.jsonl").exists()
        }
        for stack in STACK_POLICY
        if stack in out["stacks"] and (folder / stack).is_dir()
    }
    cached = [r["cached_tokens"] for rs in res.values() for rows in rs.values() for r in rows]
    block = math.gcd(*cached) if any(cached) else BLOCK
    budget = int(out.get("plurai_prefill_backlog_tokens") or budget)
    # the top-lane target and its wait bound, where the run gave them (runs before the
    # bound: none)
    target = (out.get("plurai_top_lane_tpot_ms") or {}).get("plurai-vllm", 0) / 1000
    waits = out.get("plurai_top_lane_wait_ms") or {}
    if not isinstance(waits, dict):  # one number, before it was given per stack
        waits = {"plurai-vllm": waits}
    wait = waits.get("plurai-vllm", 0) / 1000
    idle = folder / "idle.jsonl"
    rows = _read_jsonl(idle)[:IDLE_REQUESTS] if idle.exists() else []
    return Measured(str(folder), out, work, res, budget, block, target, wait, rows)


def slos_of(m: Measured) -> dict[str, sf.Slo]:
    return {lane: sf.Slo(**v) for lane, v in m.out["slos"].items()}


def first_guess(m: Measured, share: float = 0.5) -> Constants:
    """Constants from the run's idle figures (one request at a time, nothing waiting): the
    routers' median TPOT is a + c (c `share` of it: the idle run cannot tell them apart, a
    step there decodes one sequence), the batch lane's TTFT over the interactive
    lane's per extra prompt token computed is b, and what is left of the interactive TTFT is
    the router's front (plurai-vllm's: the queue's). Interactive prompts are taken to find
    their system prompt's first block cached, documents nothing. DEFAULTS where the run has
    no idle figures."""
    idle = m.out.get("idle") or {}
    routers = [idle[s] for s in ROUTERS if s in idle]
    lanes = {lane: [r["prompt_tokens"] for r in m.idle if r["lane"] == lane] for lane in LANES}
    if not routers or not all(lanes.values()):
        return replace(DEFAULTS, noise_sd=0.0)

    def ms(figs: list[dict], lane: str, name: str) -> float:
        return sf.percentile([f[lane][name] for f in figs], 50) / 1000

    chat = max(1.0, sf.percentile(lanes["interactive"], 50) - m.block)
    doc = sf.percentile(lanes["batch"], 50)
    ttft = ms(routers, "interactive", "ttft_p50_ms")
    extra = ms(routers, "batch", "ttft_p50_ms") - ttft
    b = extra / (doc - chat) if doc > chat and extra > 0 else DEFAULTS.b_s
    tpot = ms(routers, "interactive", "tpot_p50_ms")
    a, c = (1 - share) * tpot, share * tpot
    front = max(1e-3, ttft - tpot - b * chat)
    queue = DEFAULTS.queue_front_s
    if "plurai-vllm" in idle:
        queue = ms([idle["plurai-vllm"]], "interactive", "ttft_p50_ms")
        queue = max(1e-3, queue - tpot - b * chat)
    return replace(
        DEFAULTS,
        a_s=a,
        b_s=b,
        c_s=c,
        d_s=1e-7,
        router_front_s=front,
        queue_front_s=queue,
        noise_sd=0.0,
    )


def _descend(k: Constants, names: list[str], error: Any) -> Constants:
    """Coordinate descent on `names` in multiplicative steps, each kept positive."""
    best = error(k)
    for step in (2.0, 1.4, 1.15, 1.05):
        improved = True
        while improved:
            improved = False
            for name in names:
                for f in (step, 1 / step):
                    trial = replace(k, **{name: max(1e-7, getattr(k, name) * f)})
                    e = error(trial)
                    if e < best - 1e-9:
                        k, best, improved = trial, e, True
                        break
    return k


FITTED = ("a_s", "b_s", "c_s", "d_s", "router_front_s", "queue_front_s", "noise_sd", "noise_s")
FIT_SEEDS = 2  # seeds of the speed noise per replay while fitting (the check uses SEEDS)
# 5 points of SLO attainment weigh as much as a p99 off by 22% (log 1.22 = 0.2)
ATTAINMENT_SCALE = 0.25


def figures_error(m: Measured, k: Constants, seeds: int = FIT_SEEDS) -> float:
    """How far the simulated figures of every stack's loads are from the measured ones:
    per load, the squared log error of the interactive TTFT p99, half that of the
    interactive TTFT and TPOT medians, and the SLO attainment's error over
    ATTAINMENT_SCALE, squared."""
    slos, err = slos_of(m), 0.0
    for stack in m.results:
        for one in loads(m, stack, k, seeds).values():
            sim, measured = one.sim, one.measured
            pairs = [
                (p_ttft_s(sim, 99), p_ttft_s(measured, 99), 1.0),
                (p_ttft_s(sim, 50), p_ttft_s(measured, 50), 0.5),
                (p_ttft_s(sim, 50, name="tpot"), p_ttft_s(measured, 50, name="tpot"), 0.5),
            ]
            err += sum(w * math.log(x / y) ** 2 for x, y, w in pairs if x and y)
            miss = sf.attainment(sim, slos) - sf.attainment(measured, slos)
            err += (miss / ATTAINMENT_SCALE) ** 2
    return err


def fit(m: Measured) -> tuple[Constants, dict]:
    """The constants that bring the simulated figures closest to the measured ones
    (figures_error): the idle run's first guess with the per-sequence share of a step on a
    grid (0.1-0.5) and the speed noise on another (none, or sd 0.1-0.8 over stretches of
    0.5, 2 or 8 s), then coordinate descent of every constant together from the best."""
    best, least = None, math.inf
    for share in (0.1, 0.2, 0.3, 0.5):
        start = first_guess(m, share)
        for period in (0.5, 2.0, 8.0):
            for sd in (0.0, 0.1, 0.2, 0.3, 0.4, 0.6, 0.8):
                trial = replace(start, noise_sd=sd, noise_s=period)
                e = figures_error(m, trial)
                if e < least:
                    best, least = trial, e
    assert best is not None
    k = _descend(best, list(FITTED), lambda k: figures_error(m, k))
    rounded = Constants(**{f: float(f"{v:.3g}") for f, v in asdict(k).items()})
    guess = {f: float(f"{v:.3g}") for f, v in asdict(best).items()}
    errors = {"grid": round(least, 3), "fitted": round(figures_error(m, rounded), 3)}
    return rounded, {"block_tokens": m.block, "start": guess, "figures_error": errors}


def _replay(m: Measured, stack: str, run: str, k: Constants, policy: str, **kw: Any) -> list[Req]:
    """A run's requests through `policy` on the run's K engines, one machine; pulling as
    plurai-vllm ran (its budget, target and wait bound)."""
    engines = int(m.out.get("k", 2))
    kw = {"block": m.block, "machine": engines, **kw}
    if policy == "pull":
        kw = {"pull_budget": m.budget, "tpot_target_s": m.target_s, "wait_s": m.wait_s, **kw}
    return simulate(m.requests(stack, run), engines, policy, k, **kw)


@dataclass
class Load:
    """One load of a measured run (a sweep scale, its repeats pooled; the flood)."""

    sim: list[sf.Result]  # replayed with each seed of the speed noise, pooled
    measured: list[sf.Result]
    repeats: list[list[sf.Result]]  # the measured runs apart
    rate: float | None  # offered req/s of a sweep load; None for the flood


def loads(m: Measured, stack: str, k: Constants, seeds: int) -> dict[str, Load]:
    """The stack's loads, each run replayed through the stack's policy with `seeds` seeds."""
    runs = m.out["stacks"][stack]["runs"]
    out: dict[str, Load] = {}
    for run in m.runs:
        if run not in m.results[stack] or run not in runs:
            continue
        rate = runs[run]["offered_req_s"] if run.startswith("sweep@") else None
        one = out.setdefault(run.split("#")[0], Load([], [], [], rate))
        for seed in range(seeds):
            one.sim += results(_replay(m, stack, run, k, STACK_POLICY[stack], seed=seed))
        one.repeats.append([sf.Result.from_row(r) for r in m.results[stack][run]])
        one.measured += one.repeats[-1]
    return out


def within(sim: float | None, measured: float | None) -> dict:
    """sim / measured and whether it is within TOLERANCE; two Nones agree."""
    if sim is None or measured is None:
        return {
            "sim": sim,
            "measured": measured,
            "ratio": None,
            "ok": sim is None and measured is None,
        }
    ratio = sim / measured if measured else math.inf
    return {
        "sim": sim,
        "measured": measured,
        "ratio": round(ratio, 3),
        "ok": abs(ratio - 1) <= TOLERANCE,
    }


def check(m: Measured, k: Constants, seeds: int = SEEDS) -> dict:
    """Each measured stack against its policy replayed on the same runs at the same K:
    interactive TTFT p99 of every sweep load and of the flood, and goodput over the sweeps,
    each within TOLERANCE or not (the medians beside them, for reading only). A load's
    repeats (sweep@1.4, sweep@1.4#1, ...) are pooled on both sides, as its goodput pools
    them, and each run is replayed with `seeds` seeds of the engines' speed noise, pooled.
    Beside each p99, the repeats' own p99s: how far the measurement moves from one run of
    the same load to the next (check_summary counts the loads whose repeats agree within
    TOLERANCE)."""
    slos = slos_of(m)
    out: dict[str, Any] = {}
    for stack, policy in STACK_POLICY.items():
        if stack not in m.results:
            continue
        figures, errors, sweep, offered = {}, [], [], {}
        for name, one in loads(m, stack, k, seeds).items():
            figures[f"interactive_ttft_p50_s@{name}"] = {
                "sim": p_ttft_s(one.sim, 50),
                "measured": p_ttft_s(one.measured, 50),
            }
            f = within(p_ttft_s(one.sim, 99), p_ttft_s(one.measured, 99))
            f["repeats"] = [p_ttft_s(rs, 99) for rs in one.repeats]
            figures[f"interactive_ttft_p99_s@{name}"] = f
            if not f["ok"]:
                errors.append(f"{name} interactive TTFT p99 ratio {f['ratio']}")
            if one.rate is not None:
                sweep.append((one.rate, one.sim))
                offered[one.rate] = len(one.sim)
        if sweep:
            measured = m.out["stacks"][stack]["goodput_req_s"]
            g = within(sf.goodput(sweep, slos, offered=offered), measured)
            figures["goodput_req_s"] = g
            if not g["ok"]:
                errors.append(f"goodput {g['sim']} req/s against {g['measured']} measured")
        checked = sum("ratio" in f and "ok" in f for f in figures.values())
        out[stack] = {
            "policy": policy,
            **figures,
            "ok": not errors,
            "checked": checked,
            "errors": errors,
        }
    return out


def repeats_agree(stacks: dict[str, Any]) -> tuple[int, int]:
    """(loads whose measured repeats' p99s agree within TOLERANCE, loads with repeats): the
    measurement's own reproducibility, against which the check's tolerance is read."""
    agree = total = 0
    for v in stacks.values():
        for f in v.values():
            ps = [p for p in f.get("repeats", []) if p] if isinstance(f, dict) else []
            if len(ps) >= 2:
                total += 1
                agree += within(max(ps), min(ps))["ok"]
    return agree, total


def check_summary(stacks: dict[str, Any]) -> dict[str, Any]:
    """How many of the checked figures came within TOLERANCE, per stack and in all."""
    per = {s: v["checked"] - len(v["errors"]) for s, v in stacks.items()}
    total = sum(v["checked"] for v in stacks.values())
    agree, loads_repeated = repeats_agree(stacks)
    return {
        "within": sum(per.values()),
        "checked": total,
        "per_stack": {s: f"{n}/{stacks[s]['checked']}" for s, n in per.items()},
        "ok": all(v["ok"] for v in stacks.values()),
        "repeats_within": f"{agree}/{loads_repeated}",
    }


# -- fleets -----------------------------------------------------------------------------


def capacity(size: int, k: Constants, seed: int = 0, **kw: Any) -> float:
    """Completed requests per second per engine of a saturating burst on `size` engines, as
    bench/serving/ measures the real capacity on its first stack: about 12 requests per
    engine of the mixed workload within 0.24 s, the third quarter of completions / its end."""
    shape = Shape(groups=2 * size, open_sessions=2 * size)
    n = max(16, 12 * size)
    reqs = generate(shape, n / 0.24, 0.24, seed)
    done = simulate(reqs, size, "pull", k, seed=seed, **kw)
    ends = [r.end_s for r in done if r.end_s is not None]
    return round(sf.saturated_rate(ends) / size, 4)


def fleet(
    size: int,
    scales: list[float],
    k: Constants,
    slos: dict[str, sf.Slo],
    duration_s: float,
    seed: int = 0,
    per_engine: float | None = None,
    **kw: Any,
) -> dict:
    """Every policy at every scale of the capacity per engine (default: the simulated one
    at this size) times the engines, on the same generated requests per scale."""
    if per_engine is None:
        per_engine = capacity(size, k, seed, **kw)
    shape = Shape(groups=2 * size, open_sessions=2 * size)
    out: dict[str, Any] = {"capacity_per_engine_req_s": per_engine}
    out.update({p: {"runs": {}} for p in POLICIES})
    for i, scale in enumerate(scales):
        rate = per_engine * size * scale
        reqs = generate(shape, rate, duration_s, seed + 1 + i)
        for p in POLICIES:
            t = time.monotonic()
            done = simulate(reqs, size, p, k, seed=seed, **kw)
            res = results(done)
            good = sf.goodput([(rate, res)], slos)
            if good is not None:
                out[p]["goodput_req_s"] = max(good, out[p].get("goodput_req_s") or 0.0)
            out[p]["runs"][f"@{scale}"] = {
                "offered_req_s": round(rate, 3),
                "requests": len(res),
                "interactive_ttft_p99_s": p99_ttft_s(res),
                "slo_attainment": round(sf.attainment(res, slos), 4),
                **prefill(done),
                "sim_wall_s": round(time.monotonic() - t, 2),
            }
            print(f"  {size} engines {p} @ {scale}: {len(res)} requests", file=sys.stderr)
    for p in POLICIES:
        runs = out[p]["runs"]
        good = out[p].setdefault("goodput_req_s", None)
        if good is not None:
            out[p]["goodput_req_s"] = good = round(good, 3)
        out[p]["goodput_per_engine"] = None if good is None else round(good / size, 4)
        out[p]["prefill_computed_tokens"] = sum(v["computed_tokens"] for v in runs.values())
    out["ratios"] = ratios(out, scales)
    return out


def ratios(stacks: dict[str, Any], scales: list[float], ours: str = "pull") -> dict[str, Any]:
    """Pulling against the best router on each figure, as bench/serving/ prints them."""
    out: dict[str, Any] = {}
    me = stacks[ours]

    def best(get: Any, high: bool) -> tuple[str, float] | None:
        vals = [(r, v) for r in ROUTERS if (v := get(stacks[r])) is not None]
        if not vals:
            return None
        return max(vals, key=lambda x: x[1]) if high else min(vals, key=lambda x: x[1])

    figures = [
        ("goodput_req_s", True, lambda s: s["goodput_req_s"]),
        ("prefill_computed_tokens", False, lambda s: s["prefill_computed_tokens"]),
    ]
    for scale in scales:
        figures.append(
            (
                f"interactive_ttft_p99_s@{scale}",
                False,
                lambda s, sc=scale: s["runs"][f"@{sc}"]["interactive_ttft_p99_s"],
            )
        )
    for name, high, get in figures:
        b, mine = best(get, high), get(me)
        if b is None or mine is None or not b[1]:
            continue
        out[name] = {"ratio": round(mine / b[1], 3), "best_router": b[0]}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calibrate-from", default=None, help="a bench/serving/ folder to fit on")
    p.add_argument(
        "--check-against",
        default=None,
        help="bench/serving/ folders, comma-separated, to check the constants on "
        "(default: the calibration folder)",
    )
    p.add_argument(
        "--check-budget",
        type=int,
        default=512,
        help="the plurai stack's pull budget where out.json does not name it (2048 for "
        "runs from before the backlog bound)",
    )
    p.add_argument("--sizes", default="64,256,1000")
    p.add_argument("--scales", default="0.3,0.6,1.0,1.2,1.4,1.6")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per run")
    p.add_argument("--pull-budget", type=int, default=512, help="admission budget B, tokens")
    p.add_argument(
        "--tpot-share",
        type=float,
        default=0.8,
        help="pulling's top-lane TPOT target as a share of the interactive TPOT SLO, as "
        "bench/serving/ sets PLURAI_TOP_LANE_TPOT_MS; 0: none",
    )
    p.add_argument(
        "--wait-share",
        type=float,
        default=0.5,
        help="PLURAI_TOP_LANE_WAIT_MS, the longest a top-lane entry waits for the target, as "
        "a share of the interactive TTFT SLO, as bench/serving/ sets it",
    )
    p.add_argument("--lookahead", type=int, default=0)
    p.add_argument(
        "--machine-engines",
        type=int,
        default=2,
        help="engines per machine in the fleets, sharing its speed noise (the calibration "
        "run's K = 2 shared one)",
    )
    p.add_argument("--pool-blocks", type=int, default=1 << 20, help="the shared pool's LRU size")
    p.add_argument("--seed", type=int, default=0)
    from bench.workload import add_smoke_arg, cpu_isa, json_line

    add_smoke_arg(p)
    a = p.parse_args()
    if a.smoke:
        a.sizes, a.scales, a.duration = "4", "0.6,1.2", 5.0
    sizes = [int(x) for x in a.sizes.split(",") if x]
    scales = [float(x) for x in a.scales.split(",") if x]
    k, slos, measured = DEFAULTS, DEFAULT_SLOS, DEFAULT_CAPACITY_PER_ENGINE
    out: dict[str, Any] = {"bench": "simulation"}
    out["isa"] = cpu_isa()
    folders: dict[Path, Measured] = {}
    if a.calibrate_from:
        m = folders[Path(a.calibrate_from).resolve()] = load(a.calibrate_from, a.check_budget)
        k, info = fit(m)
        slos, measured = slos_of(m), m.out["capacity_req_s"] / m.out.get("k", 2)
        out["calibration"] = {"from": a.calibrate_from, "pull_budget": m.budget, **info}
    out["constants"] = asdict(k)
    out["constants_source"] = "fitted" if a.calibrate_from else "defaults"
    against = a.check_against or a.calibrate_from
    if against:
        out["checks"] = {}
        for f in against.split(","):
            path = Path(f).resolve()
            m = folders.get(path) or load(path, a.check_budget)
            stacks = check(m, k)
            out["checks"][f] = {
                "pull_budget": m.budget,
                "top_lane_tpot_target_s": m.target_s,
                "top_lane_wait_s": m.wait_s,
                "runs": m.runs,
                **check_summary(stacks),
                "stacks": stacks,
            }
            print(f"  checked against {f}: {out['checks'][f]['per_stack']}", file=sys.stderr)
        out["check_ok"] = all(c["ok"] for c in out["checks"].values())
    out["slos"] = {lane: asdict(s) for lane, s in slos.items()}
    target = a.tpot_share * (slos["interactive"].tpot_s or 0.0)
    wait = a.wait_share * (slos["interactive"].ttft_s or 0.0)
    kw = dict(
        pull_budget=a.pull_budget,
        tpot_target_s=target,
        wait_s=wait,
        lookahead=a.lookahead,
        pool_blocks=a.pool_blocks,
        machine=a.machine_engines,
    )
    # a burst of 24 requests on 2 engines: its rate moves by 2x from one seed to the next
    k2 = [capacity(2, k, a.seed + i, **kw) for i in range(CAPACITY_SEEDS)]
    out["capacity_per_engine_req_s"] = {
        "measured": round(measured, 4),
        "simulated_k2": round(sf.percentile(k2, 50), 4),
        "simulated_k2_seeds": k2,
    }
    out["pull_budget"], out["lookahead"] = a.pull_budget, a.lookahead
    out["machine_engines"] = a.machine_engines
    out["top_lane_tpot_target_s"], out["top_lane_wait_s"] = round(target, 4), round(wait, 4)
    out["sizes"] = {str(n): fleet(n, scales, k, slos, a.duration, a.seed, **kw) for n in sizes}
    json_line(out, a.smoke)


if __name__ == "__main__":
    main()
