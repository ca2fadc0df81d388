"""PluraiConnector: vLLM workers share prompt KV blocks through Redis.

Worker A (a vLLM engine in its own process) computes long prompts and saves their blocks;
a fresh worker B (another process: an empty local prefix cache) gets them from Redis on
its first requests, with the same output tokens. Blocks that were flipped or truncated in
Redis are refused and recomputed, with the same tokens; salts keep requests apart; a
Redis that goes away costs misses and dropped writes, nothing else. Run once without and
once with PLURAI_KV_SECRET (the MAC path). Real redis-server, the factory's small model.

Run as a script, this file is the worker: `python test_kv_connector.py MODEL` reads JSON
commands on stdin and answers each on a stdout line starting with MARK.
"""

from __future__ import annotations

import json
import os
import pickle
import queue
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM: make vllm-install, then make test-vllm")

import redis  # noqa: E402
import torch  # noqa: E402

from plurai.broker_config import keys  # noqa: E402
from plurai.broker_config.embedded import EmbeddedRedis  # noqa: E402
from plurai.gpu_workers.vllm_backend import connector, kv_layout  # noqa: E402
from plurai.kv_store import block_format  # noqa: E402
from plurai.kv_store.block_hash import chain_hashes, salt_root  # noqa: E402
from plurai.kv_store.redis_tier import SECRET_ENV, RedisTier  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MARK = "@@plurai "
BLOCK = 32  # vLLM's CPU attention takes multiples of 32
FINGERPRINT = "5eed" * 8
LAYERS, KV_HEADS, HEAD_DIM = 2, 1, 64  # the factory's "small" model
SHAPE = (2, LAYERS, KV_HEADS, BLOCK, HEAD_DIM)

rng = random.Random(16)
P1, P2, P3, P4 = ([rng.randrange(10, 2000) for _ in range(300)] for _ in range(4))
FULL = 300 // BLOCK  # full blocks of each prompt: 9, all claimable (300 % 32 != 0)
FLIPPED = 3  # P2's block flipped in Redis before B runs
TRUNCATED = 5  # P3's block truncated


# -- the worker process ---------------------------------------------------------------


def serve(model: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=512,
        block_size=BLOCK,
        enforce_eager=True,
        seed=0,
        kv_transfer_config=KVTransferConfig(
            kv_connector="PluraiConnector",
            kv_connector_module_path=connector.__name__,
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"fingerprint": FINGERPRINT, "ttl_s": 600},
        ),
    )
    for line in sys.stdin:
        cmd = json.loads(line)
        prompts: list[Any] = [
            {"prompt_token_ids": p} if s is None else {"prompt_token_ids": p, "cache_salt": s}
            for p, s in zip(cmd["prompts"], cmd["salts"], strict=True)
        ]
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        t = time.monotonic()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.monotonic() - t
        get_kv_transfer_group().flush()  # the writes made, COUNTERS.dropped current
        reply = {
            "outputs": [
                {"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens}
                for o in outs
            ],
            "counters": asdict(connector.COUNTERS),
            "seconds": seconds,
        }
        print(MARK + json.dumps(reply), flush=True)


class Worker:
    """A worker process (this file run as a script) and its answers."""

    def __init__(self, model: Path, env: dict[str, str], log: Path) -> None:
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, __file__, str(model)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={
                **os.environ,
                "PYTHONPATH": str(ROOT),
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in this process
                "VLLM_CPU_KVCACHE_SPACE": "1",
                **env,
            },
        )
        self.replies: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with self.log.open("a") as f:
            for line in self.proc.stdout:
                if line.startswith(MARK):
                    self.replies.put(line[len(MARK) :])
                else:
                    f.write(line)
                    f.flush()
        self.replies.put(None)

    def run(self, prompts: list[list[int]], salts: list[str | None] | None = None) -> Any:
        assert self.proc.stdin is not None
        cmd = {"prompts": prompts, "salts": salts or [None] * len(prompts)}
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        reply = self.replies.get(timeout=300)
        if reply is None:
            raise AssertionError(f"the worker died:\n{self.log.read_text()[-4000:]}")
        return json.loads(reply)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# -- fixtures ---------------------------------------------------------------------------


def block_keys(prompt: list[int], salt: str | None = None) -> list[tuple[bytes, str]]:
    hashes = chain_hashes(prompt, BLOCK, bytes.fromhex(FINGERPRINT), root=salt_root(salt))
    return [(h, keys.kv_block(FINGERPRINT, h.hex())) for h in hashes]


@pytest.fixture(scope="module")
def shared(small_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A computes P1-P3 (and P1 salted "x"); P2's and P3's blocks are damaged in Redis;
    a fresh B runs P1-P3, then P1 salted "x" and "y"; then Redis stops and B runs P4.
    Both hold a secret, so every block carries a MAC (the path without one is the native
    tier's: tests/integration/test_kv_redis_tier.py)."""
    secret = "kv-test-secret"
    tmp = tmp_path_factory.mktemp("kv")
    server = EmbeddedRedis(tmp / "redis")
    url = server.start()
    r = redis.Redis.from_url(url)
    env = {connector.URL_ENV: url, SECRET_ENV: secret or ""}
    out: dict[str, Any] = {"url": url, "secret": secret, "log": tmp / "workers.log"}
    try:
        a = Worker(small_model, env, out["log"])
        try:
            out["a"] = a.run([P1, P2, P3])
            out["a_salted"] = a.run([P1], ["x"])
        finally:
            a.close()
        out["stored"] = {k: r.get(k) for p in (P1, P2, P3) for _, k in block_keys(p)}
        out["stored_salted"] = [r.get(k) for _, k in block_keys(P1, "x")]
        data = out["stored"][block_keys(P2)[FLIPPED][1]]
        r.set(block_keys(P2)[FLIPPED][1], data[:-1] + bytes([data[-1] ^ 1]))
        data = out["stored"][block_keys(P3)[TRUNCATED][1]]
        r.set(block_keys(P3)[TRUNCATED][1], data[: len(data) // 2])
        b = Worker(small_model, env, out["log"])
        try:
            out["b"] = b.run([P1, P2, P3])
            out["b_salted"] = b.run([P1, P1], ["x", "y"])
            server.stop()
            out["b_down"] = b.run([P4])
        finally:
            b.close()
        yield out
    finally:
        r.close()
        server.stop()


# -- the acceptance test ----------------------------------------------------------------


def test_a_fresh_redis_has_nothing_and_a_saves_every_full_prompt_block(
    shared: dict[str, Any],
) -> None:
    a = shared["a"]
    assert [o["cached"] for o in a["outputs"]] == [0, 0, 0]
    assert all(len(o["tokens"]) == 8 for o in a["outputs"])
    assert all(v is not None for v in shared["stored"].values()), "a block was not saved"
    assert len(shared["stored"]) == 3 * FULL
    assert a["counters"]["saved"] == 3 * FULL
    assert a["counters"]["hits"] == 0 and a["counters"]["bad"] == 0
    # P1 with a salt: vLLM's own cache and Redis both keep it apart from unsalted P1
    salted = shared["a_salted"]
    assert salted["outputs"][0]["cached"] == 0
    assert salted["outputs"][0]["tokens"] == a["outputs"][0]["tokens"]
    assert all(v is not None for v in shared["stored_salted"])


def test_b_loads_the_prefix_from_redis_with_identical_output(shared: dict[str, Any]) -> None:
    a, b = shared["a"]["outputs"], shared["b"]["outputs"]
    assert b[0]["cached"] == FULL * BLOCK  # every full block; vLLM computes the last token
    assert b[0]["tokens"] == a[0]["tokens"]


def test_flipped_and_truncated_blocks_are_recomputed(shared: dict[str, Any]) -> None:
    a, b = shared["a"]["outputs"], shared["b"]["outputs"]
    assert b[1]["cached"] == FLIPPED * BLOCK  # the blocks before the flipped one
    assert b[2]["cached"] == TRUNCATED * BLOCK
    assert b[1]["tokens"] == a[1]["tokens"]
    assert b[2]["tokens"] == a[2]["tokens"]
    c = shared["b"]["counters"]
    assert c["bad"] == 2
    assert c["hits"] == FULL + FLIPPED + TRUNCATED
    assert c["misses"] == (FULL - FLIPPED) + (FULL - TRUNCATED)
    # B saved what it recomputed: the damaged entries are whole again
    assert c["saved"] == (FULL - FLIPPED) + (FULL - TRUNCATED)


def test_salts_share_only_with_the_same_salt(shared: dict[str, Any]) -> None:
    p1 = shared["a"]["outputs"][0]["tokens"]
    x, y = shared["b_salted"]["outputs"]
    assert x["cached"] == FULL * BLOCK  # A's blocks salted "x"
    assert y["cached"] == 0  # neither unsalted nor "x" blocks
    assert x["tokens"] == p1 and y["tokens"] == p1


def test_redis_down_means_misses_and_dropped_writes(shared: dict[str, Any]) -> None:
    down = shared["b_down"]
    before = shared["b_salted"]["counters"]
    assert down["outputs"][0]["cached"] == 0
    assert len(down["outputs"][0]["tokens"]) == 8
    assert down["seconds"] < 30
    c = down["counters"]
    assert c["hits"] == before["hits"]
    assert c["misses"] == before["misses"] + FULL
    assert c["dropped"] - before["dropped"] == FULL


def test_saved_blocks_hold_the_models_keys_and_values(
    shared: dict[str, Any], small_model: Path
) -> None:
    """The stored block is the native format's [2, layers, kv_heads, tokens, head_dim]:
    Hugging Face's keys (after RoPE) and values for the same tokens."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(small_model, dtype=torch.float32)
    with torch.no_grad():
        cache = hf(torch.tensor([P1]), use_cache=True).past_key_values
    secret = shared["secret"].encode()
    fp = bytes.fromhex(FINGERPRINT)
    for i in (0, FULL - 1):
        h, key = block_keys(P1)[i]
        block = block_format.decode(shared["stored"][key], h, fp, SHAPE, torch.float32, secret)
        for layer in range(LAYERS):
            span = slice(i * BLOCK, (i + 1) * BLOCK)
            k = cache.layers[layer].keys[0, :, span]
            v = cache.layers[layer].values[0, :, span]
            torch.testing.assert_close(block[0, layer], k, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(block[1, layer], v, atol=1e-4, rtol=1e-4)


def test_blocks_carry_the_mac_of_the_secret(shared: dict[str, Any]) -> None:
    data = next(iter(shared["stored"].values()))
    block_format.verify(data, shared["secret"].encode())
    with pytest.raises(block_format.BadBlock):
        block_format.verify(data, b"another secret")


def test_the_url_and_secret_stay_out_of_the_logs(shared: dict[str, Any]) -> None:
    text = shared["log"].read_text()
    password = redis.connection.parse_url(shared["url"])["password"]
    assert password and password not in text
    assert shared["url"] not in text
    assert shared["secret"] not in text


# -- the parts, without an engine ---------------------------------------------------------


def test_layout_permutation_round_trips() -> None:
    g = torch.Generator().manual_seed(0)
    blocks = torch.randn(3, 2, 4, 64, 8, generator=g)
    perm = torch.randperm(2 * 4 * 16 * 8, generator=g)
    pages = kv_layout.to_native(blocks, perm, ratio=4)
    assert pages.shape == (3, 4, 4, 16, 16)
    # page j of a block holds tokens 16j..16j+15, placed by perm
    sem = blocks[1, :, :, 32:48].reshape(-1)
    assert torch.equal(pages[1, 2].reshape(-1), sem[perm])
    assert torch.equal(kv_layout.from_native(pages, perm), blocks)


def test_rank_fingerprints() -> None:
    assert connector.rank_fingerprint(FINGERPRINT, (0, 0), (1, 1)) == FINGERPRINT
    ranks = {
        connector.rank_fingerprint(FINGERPRINT, (t, p), (2, 2)) for t in (0, 1) for p in (0, 1)
    }
    assert len(ranks) == 4 and FINGERPRINT not in ranks
    assert all(len(f) == len(FINGERPRINT) for f in ranks)


def test_lookup_takes_the_leading_run_of_good_blocks(redis_url: str) -> None:
    tier = RedisTier(redis.Redis.from_url(redis_url), FINGERPRINT, secret=None)
    store = connector.Store(tier, SHAPE, torch.float32)
    fp = bytes.fromhex(FINGERPRINT)
    hashes = chain_hashes(list(range(5 * BLOCK)), BLOCK, fp)
    blocks = [torch.full(SHAPE, float(i)) for i in range(5)]
    for h, block in zip(hashes[:4], blocks, strict=False):
        tier.put(h, block)
    tier.flush()
    found, bad = store.lookup(hashes)
    assert bad == 0 and [int(b[0, 0, 0, 0, 0]) for b in found] == [0, 1, 2, 3]
    nan = blocks[2].clone()
    nan[1, 1, 0, 3, 7] = float("nan")
    tier.r.set(tier.key(hashes[2]), block_format.encode(nan, hashes[2], fp))
    found, bad = store.lookup(hashes)
    assert bad == 1 and len(found) == 2
    tier.close()


def test_the_worker_half_reads_what_did_not_come_along_and_reports_what_failed(
    redis_url: str,
) -> None:
    """A load whose blocks stayed behind in the scheduler's process (vLLM pickles the
    metadata for other ranks) is read from Redis; the blocks from a bad one on are
    reported for recompute, and the step's saves are skipped, as they were computed
    from a hole."""
    tier = RedisTier(redis.Redis.from_url(redis_url), FINGERPRINT, secret=None)
    fp = bytes.fromhex(FINGERPRINT)
    hashes = chain_hashes(list(range(4 * BLOCK)), BLOCK, fp)
    blocks = [torch.randn(SHAPE) for _ in range(4)]
    for h, block in zip(hashes[:3], blocks, strict=False):
        tier.put(h, block)
    tier.flush()
    data = tier.r.get(tier.key(hashes[2]))
    tier.r.set(tier.key(hashes[2]), data[:-4])
    # the worker half alone: its cache (8 blocks a layer, in a made-up layout) and store
    w = object.__new__(connector.PluraiConnector)
    perm = torch.randperm(2 * KV_HEADS * BLOCK * HEAD_DIM)
    caches = [torch.zeros(8, KV_HEADS, BLOCK, 2 * HEAD_DIM) for _ in range(LAYERS)]
    w.layers = [(kv.view(8, 1, KV_HEADS, BLOCK, 2 * HEAD_DIM), 1, perm) for kv in caches]
    w.store, w.failed = connector.Store(tier, SHAPE, torch.float32), set()
    load = connector.Load(req_id="r", block_ids=[5, 3, 7, 1], hashes=hashes, blocks=blocks)
    meta = pickle.loads(
        pickle.dumps(connector.Meta(loads=[load], save_ids=[6], save_hashes=[b"h" * 16]))
    )
    assert meta.loads[0].blocks is None and load.blocks is blocks
    before = asdict(connector.COUNTERS)
    w.bind_connector_metadata(meta)
    w.start_load_kv(None)
    w.wait_for_save()
    assert w.get_block_ids_with_load_errors() == {7, 1}
    assert w.get_block_ids_with_load_errors() == set()
    torch.testing.assert_close(w._read([5, 3]), torch.stack(blocks[:2]), rtol=0, atol=0)
    w.wait_for_save()  # no failure this time: block 6 goes to Redis
    w.flush()
    after = asdict(connector.COUNTERS)
    assert after["hits"] - before["hits"] == 2
    assert after["bad"] - before["bad"] == 1
    assert after["saved"] - before["saved"] == 1
    saved = tier.r.get(tier.key(b"h" * 16))
    assert saved is not None
    assert torch.equal(
        block_format.decode(saved, b"h" * 16, fp, SHAPE, torch.float32), w._read([6])[0]
    )
    tier.close()


def test_without_redis_lookups_miss_at_once_and_writes_drop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(connector.URL_ENV, "redis://127.0.0.1:1/0")  # nothing listens
    store = connector.open_store(FINGERPRINT, 60, SHAPE, torch.float32)
    assert store is not None
    hashes = chain_hashes(list(range(2 * BLOCK)), BLOCK, bytes.fromhex(FINGERPRINT))
    dropped = connector.COUNTERS.dropped
    t = time.monotonic()
    assert store.lookup(hashes) == ([], 0)
    for h in hashes:
        store.put(h, torch.zeros(SHAPE))
    store.close()
    assert time.monotonic() - t < 2
    assert connector.COUNTERS.dropped - dropped == 2


def test_no_url_no_store(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(connector.URL_ENV, raising=False)
    assert connector.open_store(FINGERPRINT, 60, SHAPE, torch.float32) is None


if __name__ == "__main__":
    serve(sys.argv[1])
