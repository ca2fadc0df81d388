"""The serving engine: add requests, step, read outputs.

    engine = Engine(EngineConfig(model="models/tiny-llama"))
    engine.add("r1", prompt="Hello", params=SamplingParams(max_tokens=8))
    while engine.has_unfinished():
        for out in engine.step(): ...

One step = schedule, one forward over every scheduled token, sample, then
detokenize and check stop conditions. `generate` is the offline loop over the same.
"""

from __future__ import annotations

import itertools
from typing import Any

from transformers import AutoTokenizer

from gpu_workers.engine.block_manager import BlockManager
from gpu_workers.engine.config import EngineConfig
from gpu_workers.engine.detokenizer import Detokenizer
from gpu_workers.engine.errors import ErrorCode, RequestError, valid_messages
from gpu_workers.engine.kv_tiers import KVTiers
from gpu_workers.engine.model_runner import ModelRunner
from gpu_workers.engine.parallel import Group, encode_step, send_step
from gpu_workers.engine.sampler import Sampler
from gpu_workers.engine.sampling_params import SamplingParams
from gpu_workers.engine.scheduler import Scheduler
from gpu_workers.engine.sequence import Completion, Sequence, Status, StepOutput
from gpu_workers.models.loader import fingerprint
from kv_store.redis_tier import RedisTier


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # with tensor parallelism this process is rank 0; the other ranks are started here
        parallel = config.tensor_parallel * config.pipeline_parallel > 1
        self.group = Group(config) if parallel else None
        self.runner = ModelRunner(config)
        self.max_model_len = self.runner.max_model_len
        if not config.chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "without chunked prefill, max_num_batched_tokens must be >= max_model_len "
                f"({config.max_num_batched_tokens} < {self.max_model_len})"
            )
        self.tokenizer = AutoTokenizer.from_pretrained(config.model, local_files_only=True)
        self.vocab_size = self.runner.vocab_size
        self.model_fingerprint = fingerprint(config.model)
        self.blocks = BlockManager(
            self.runner.num_blocks,
            config.block_size,
            bytes.fromhex(self.model_fingerprint),
            config.prefix_caching,
        )
        self.blocks.tiers = self._tiers()
        self.scheduler = Scheduler(config, self.blocks)
        self.sampler = Sampler(config.seed)
        self.eos_ids = self._eos_ids()
        self.seqs: dict[str, Sequence] = {}
        self.num_steps = 0
        self._batches = itertools.count()

    def _tiers(self) -> KVTiers | None:
        c = self.config
        # a rank-0 block holds only rank 0's heads: tiers are for single-rank engines
        if (
            not c.prefix_caching
            or c.tensor_parallel > 1
            or (c.kv_host_bytes <= 0 and not c.kv_redis_url)
        ):
            return None
        remote = None
        if c.kv_redis_url:
            import redis

            conn = redis.Redis.from_url(
                c.kv_redis_url, socket_timeout=2.0, socket_connect_timeout=2.0
            )
            remote = RedisTier(conn, self.model_fingerprint, c.kv_redis_ttl_s)
        return KVTiers(
            self.runner.kv_cache,
            bytes.fromhex(self.model_fingerprint),
            c.kv_host_bytes,
            remote,
            c.kv_write_through,
        )

    def close(self) -> None:
        """Finish queued writes to the Redis tier, stop its writer and the other ranks."""
        if self.blocks.tiers is not None:
            self.blocks.tiers.close()
        if self.group is not None:
            self.group.close()
            self.group = None

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for src in (self.runner.hf_config, self.tokenizer):
            v = getattr(src, "eos_token_id", None)
            ids.update(v if isinstance(v, list) else [v] if v is not None else [])
        try:
            from transformers import GenerationConfig

            v = GenerationConfig.from_pretrained(
                self.config.model, local_files_only=True
            ).eos_token_id
            ids.update(v if isinstance(v, list) else [v] if v is not None else [])
        except OSError:
            pass
        return ids

    # -- requests -----------------------------------------------------------------

    def tokenize(
        self,
        prompt: str | None = None,
        token_ids: list[int] | None = None,
        messages: list[dict] | None = None,
    ) -> list[int]:
        """Token ids for exactly one of prompt / token_ids / messages, validated."""
        given = [x is not None for x in (prompt, token_ids, messages)]
        if sum(given) != 1:
            raise RequestError(
                ErrorCode.INVALID_PROMPT, "give exactly one of prompt, token_ids or messages"
            )
        if prompt is not None:
            if not isinstance(prompt, str) or not prompt:
                raise RequestError(ErrorCode.INVALID_PROMPT, "prompt must be a non-empty string")
            ids = self.tokenizer(prompt).input_ids
        elif messages is not None:
            if not valid_messages(messages):
                raise RequestError(
                    ErrorCode.INVALID_PROMPT,
                    "messages must be a non-empty list of {role: str, content: str} objects",
                )
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
            ids = self.tokenizer(text, add_special_tokens=False).input_ids
        else:
            if not isinstance(token_ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in token_ids
            ):
                raise RequestError(ErrorCode.INVALID_PROMPT, "token_ids must be a list of integers")
            bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestError(
                    ErrorCode.TOKEN_OUT_OF_VOCAB,
                    f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})",
                )
            ids = list(token_ids)
        if not ids:
            raise RequestError(ErrorCode.INVALID_PROMPT, "the prompt is empty")
        return ids

    def add(
        self,
        request_id: str,
        prompt: str | None = None,
        token_ids: list[int] | None = None,
        messages: list[dict] | None = None,
        params: SamplingParams | dict | None = None,
        priority: int = 0,
    ) -> None:
        """Queue a request. Raises RequestError for bad input; nothing else is affected."""
        if request_id in self.seqs:
            raise RequestError(
                ErrorCode.DUPLICATE_ID, f"request id {request_id!r} is already in the engine"
            )
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            params = SamplingParams.from_dict(params)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise RequestError(
                ErrorCode.INVALID_PARAMS, f"priority must be an integer, got {priority!r}"
            )
        ids = self.tokenize(prompt, token_ids, messages)
        if len(ids) >= self.max_model_len:
            raise RequestError(
                ErrorCode.PROMPT_TOO_LONG,
                f"the prompt has {len(ids)} tokens; this model serves at most "
                f"{self.max_model_len} tokens including at least one generated token, "
                f"so shorten the prompt to {self.max_model_len - 1} tokens or fewer",
            )
        seq = Sequence(request_id, ids, params, priority)
        seq.detok = Detokenizer(self.tokenizer, ids, params.skip_special_tokens)
        self.seqs[request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq)
        return True

    # -- capacity -----------------------------------------------------------------

    def _blocks_needed(self, seq_len: int) -> int:
        return self.blocks.blocks_for(min(seq_len, self.max_model_len))

    def can_admit(self, prompt_len: int, max_tokens: int) -> bool:
        """Whether a request of this size fits beside everything already in the engine,
        assuming each runs to its max_tokens, with a watermark of blocks kept free."""
        reserved = 0
        for seq in self.seqs.values():
            reserved += max(0, self._blocks_needed(seq.max_len) - len(seq.block_table))
        watermark = int(self.config.watermark * self.blocks.num_blocks)
        room = self.blocks.num_free - reserved - watermark
        return (
            len(self.seqs) < self.config.max_num_seqs
            and self._blocks_needed(prompt_len + max_tokens) <= room
        )

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # -- stepping -----------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        seqs = self.scheduler.schedule()
        if not seqs:
            return []
        self.num_steps += 1
        if self.group is not None:
            self.group.check()
            send_step(encode_step(seqs))
        logits, sampling = self.runner.run(seqs)
        for seq in seqs:
            seq.num_computed_tokens += seq.num_scheduled
            seq.num_scheduled = 0
            self.blocks.commit(seq)
        if not sampling:
            return []
        tokens, logprobs = self.sampler(logits, sampling)
        return [
            self._append(seq, tok, lp)
            for seq, tok, lp in zip(sampling, tokens, logprobs, strict=True)
        ]

    def _append(self, seq: Sequence, token: int, logprob: dict | None) -> StepOutput:
        p = seq.params
        seq.append(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
        assert seq.detok is not None
        before = len(seq.detok.text)
        seq.detok.add(token)
        reason = None
        if (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
            reason = "stop"
        elif p.stop and self._cut_at_stop(seq, before):
            reason = "stop"
        elif seq.num_output_tokens >= p.max_tokens or len(seq) >= self.max_model_len:
            reason = "length"
        held = 0 if reason else max((len(s) for s in p.stop), default=1) - 1
        text = seq.detok.text
        delta = text[seq.emitted : max(seq.emitted, len(text) - held)]
        seq.emitted += len(delta)
        if reason:
            seq.finish_reason = reason
            self.scheduler.finish(seq)
            del self.seqs[seq.request_id]
        return StepOutput(
            seq.request_id,
            [token],
            delta,
            reason is not None,
            reason,
            seq.num_prompt_tokens,
            seq.num_output_tokens,
            seq.num_cached_tokens,
            [logprob] if logprob is not None else None,
        )

    @staticmethod
    def _cut_at_stop(seq: Sequence, before: int) -> bool:
        """Truncate the output text at the first stop string; True when one appeared."""
        detok = seq.detok
        assert detok is not None
        longest = max(len(s) for s in seq.params.stop)
        start = max(0, before - longest + 1)
        hits = [i for i in (detok.text.find(s, start) for s in seq.params.stop) if i >= 0]
        if not hits:
            return False
        detok.text = detok.text[: min(hits)]
        return True

    # -- offline ------------------------------------------------------------------

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        priorities: list[int] | None = None,
    ) -> list[Completion]:
        """Run prompts (text or token ids) to completion; results in input order."""
        if not isinstance(params, list):
            params = [params or SamplingParams()] * len(prompts)
        batch = next(self._batches)
        ids = [f"generate-{batch}-{i}" for i in range(len(prompts))]
        seqs: dict[str, Sequence] = {}
        for i, (rid, prompt, p) in enumerate(zip(ids, prompts, params, strict=True)):
            prio = priorities[i] if priorities else 0
            if isinstance(prompt, str):
                self.add(rid, prompt=prompt, params=p, priority=prio)
            else:
                self.add(rid, token_ids=list(prompt), params=p, priority=prio)
            seqs[rid] = self.seqs[rid]
        while any(s.status is not Status.FINISHED for s in seqs.values()):
            self.step()
        out = []
        for rid in ids:
            s = seqs[rid]
            assert s.detok is not None and s.finish_reason is not None
            out.append(
                Completion(
                    rid,
                    s.token_ids[: s.num_prompt_tokens],
                    s.output_token_ids,
                    s.detok.text,
                    s.finish_reason,
                    s.num_cached_tokens,
                    s.logprobs or None,
                )
            )
        return out

    def stats(self) -> dict[str, Any]:
        bm = self.blocks
        used = bm.num_blocks - bm.num_free  # every block with no reference is in the free queue
        # per sequence, not per block: stats() runs every second in a serving worker
        stored = sum(
            min(s.num_computed_tokens, len(s.block_table) * bm.block_size)
            for s in self.seqs.values()
        )
        return {
            "blocks_total": bm.num_blocks,
            "blocks_free": bm.num_free,
            "blocks_used": used,
            "blocks_cached": len(bm.cached),
            "tokens_stored": stored,
            "slots_allocated": used * bm.block_size,
            "prefix_hit_blocks": bm.hits,
            "prefix_lookup_blocks": bm.lookups,
            "running": self.num_running,
            "waiting": self.num_waiting,
            "preemptions": self.scheduler.num_preemptions,
            "steps": self.num_steps,
            **({f"kv_{k}": v for k, v in vars(bm.tiers.counters).items()} if bm.tiers else {}),
        }
