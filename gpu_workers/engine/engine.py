"""The serving engine: add requests, step, read outputs.

    engine = Engine(EngineConfig(model="models/tiny-llama"))
    engine.add(AddRequest("r1", prompt="Hello", params=SamplingParams(max_tokens=8)))
    while engine.has_unfinished():
        for out in engine.step(): ...

One step = schedule, one forward over every scheduled token, sample, then
detokenize and check stop conditions. `generate` is the offline loop over the same.

A step whose batched forward or sampling raises is run again one sequence at a time; the
sequences that fail alone end with finish_reason "error" and the rest go on.

A request with n > 1 (SamplingParams.n) runs n sequences, its choices, that share the
prompt: the first (the lead) computes it, and the others are admitted once it has, with its
full prompt blocks (scheduler.py). Choice i samples as a request of seed seed + i would
(SamplingParams.for_choice); its outputs carry its `index`.

A request cut off elsewhere (a crash, a drain) is resumed with the output tokens each of
its choices had: `add(..., output_ids=...)` books them as if this engine had sampled them,
emitting nothing (`_replay`), and computes prompt and outputs as one prefill, as after a
preemption. With seeded draws that depend on position only (sampler.py), the request then
goes on exactly as the uninterrupted run did.

One file, though long: the engine's interface (add, step, abort, figures) and the step's
orchestration of scheduler, model runner, sampler and detokenizer, each a file of its own.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import TYPE_CHECKING, Any

from transformers import AutoTokenizer

from plurai.gpu_workers.backend import AddRequest, StepOutput
from plurai.gpu_workers.engine.block_manager import BlockManager
from plurai.gpu_workers.engine.config import EngineConfig
from plurai.gpu_workers.engine.detokenizer import Detokenizer
from plurai.gpu_workers.engine.drafter import Drafter
from plurai.gpu_workers.engine.errors import ErrorCode, RequestError
from plurai.gpu_workers.engine.grammar import GrammarError, Grammars, Steer
from plurai.gpu_workers.engine.kv_tiers import KVTiers
from plurai.gpu_workers.engine.model_runner import ModelRunner
from plurai.gpu_workers.engine.parallel import Group, encode_step, send_step
from plurai.gpu_workers.engine.sampler import Sampler
from plurai.gpu_workers.engine.sampling_params import SamplingParams
from plurai.gpu_workers.engine.scheduler import Scheduler
from plurai.gpu_workers.engine.sequence import (
    Completion,
    Sequence,
    Status,
    check_progress,
    finished_at,
)
from plurai.gpu_workers.engine.speculator import Speculator
from plurai.gpu_workers.models.loader import fingerprint
from plurai.gpu_workers.prompts import Prompts, check_options
from plurai.kv_store.redis_tier import RedisTier

if TYPE_CHECKING:
    import redis

log = logging.getLogger(__name__)


class Engine:
    """The native backend (gpu_workers/backend.py). `kv_redis`: a connection to the Redis
    that holds the shared KV tier, opened by the caller (the worker); None: no Redis tier."""

    def __init__(self, config: EngineConfig, kv_redis: redis.Redis | None = None) -> None:
        self.config = config
        # with tensor parallelism this process is rank 0; the other ranks are started here
        parallel = config.tensor_parallel * config.pipeline_parallel > 1
        self.group = Group(config) if parallel else None
        self.runner = ModelRunner(config)
        self.max_model_len = self.runner.max_model_len
        self.max_num_seqs = config.max_num_seqs
        self.step_tokens = config.max_num_batched_tokens
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
        self.blocks.tiers = self._tiers(kv_redis)
        self.eos_ids = self._eos_ids()
        self.grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_ids)
        drafter = None
        if config.draft_model:
            drafter = Drafter(config, self.runner.num_blocks, self.max_model_len)
        self.speculator = (
            Speculator(config, self.max_model_len, self.grammars, drafter)
            if config.speculative != "off"
            else None
        )
        self.scheduler = Scheduler(config, self.blocks, self.speculator)
        self.sampler = Sampler(config.seed, self.grammars, self.runner.ops, self.max_model_len)
        self.prompts = Prompts(self.tokenizer, self.vocab_size, self.max_model_len)
        self.tokenize = self.prompts.tokenize
        # a request's first choice (which holds the others), until every choice has ended
        self.seqs: dict[str, Sequence] = {}
        self.ended: list[Sequence] = []  # choices a resume found ended, reported next step
        self.num_steps = 0
        self._batches = itertools.count()

    def _tiers(self, kv_redis: redis.Redis | None) -> KVTiers | None:
        c = self.config
        # a rank-0 block holds only rank 0's heads (TP) or its stage's layers (PP): tiers
        # are for single-rank engines
        if (
            not c.prefix_caching
            or c.tensor_parallel > 1
            or c.pipeline_parallel > 1
            or (c.kv_host_bytes <= 0 and kv_redis is None)
        ):
            return None
        remote = None
        if kv_redis is not None:
            remote = RedisTier(kv_redis, self.model_fingerprint, c.kv_redis_ttl_s)
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

    def add(self, req: AddRequest) -> list[str]:
        """Queue a request. Raises RequestError for bad input; nothing else is affected.

        Requests share prefix-cache blocks (device, host and Redis tiers) only when their
        `cache_salt` is equal (None is a salt of its own). `special_tokens=True` lets the
        prompt's text name special tokens (see `tokenize`).

        `output_ids`: per choice (params.n lists), the output tokens a cut-off run of this
        request generated; each choice goes on after its own (they count toward
        max_tokens), and a choice they ended is reported ended at the next step, with no
        new token. Returns, per choice, the output text that run had reported for them in
        text deltas ("" without output_ids). Progress this engine cannot continue is
        refused with BAD_PROGRESS (see `_replay`).
        """
        request_id, params, output_ids = req.request_id, req.params, req.output_ids
        if request_id in self.seqs:
            raise RequestError(
                ErrorCode.DUPLICATE_ID, f"request id {request_id!r} is already in the engine"
            )
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            params = SamplingParams.from_dict(params)
        check_options(req.priority, req.cache_salt, req.special_tokens)
        ids = self.tokenize(req.prompt, req.token_ids, req.messages, req.special_tokens)
        if output_ids is None:
            output_ids = [[]] * params.n
        elif not isinstance(output_ids, list) or len(output_ids) != params.n:
            raise RequestError(
                ErrorCode.BAD_PROGRESS, f"output_ids must hold one list per choice ({params.n})"
            )
        seqs = []
        for i, outputs in enumerate(output_ids):
            p = params.for_choice(i)
            seq = Sequence(
                request_id=request_id,
                token_ids=list(ids),
                params=p,
                priority=req.priority,
                index=i,
                cache_salt=req.cache_salt,
            )
            seq.matcher = self.grammars.matcher(p)  # compiled (or refused) once, then copied
            seq.steer = Steer() if seq.matcher is not None else None
            seq.detok = Detokenizer(self.tokenizer, ids, p.skip_special_tokens)
            if outputs:
                self._replay(seq, outputs)
            seqs.append(seq)
        going = [s for s in seqs if s.finish_reason is None]
        if not going:  # (each choice ended by its last token: the first's is said)
            ended = output_ids[0]
            raise finished_at(seqs[0].finish_reason or "", len(ended) - 1, ended[-1])
        for seq in going[1:]:
            seq.lead = going[0]
        for seq in seqs:
            if seq.finish_reason is None:
                self.scheduler.add(seq)
            else:
                seq.status = Status.FINISHED
                self.ended.append(seq)
        seqs[0].others = seqs[1:]
        self.seqs[request_id] = seqs[0]
        return [seq.detok.text[: seq.emitted] for seq in seqs]  # type: ignore[union-attr]

    def _replay(self, seq: Sequence, output_ids: Any) -> None:
        """Book a cut-off run's output tokens on a new `seq` as `_append` booked them, without
        emitting: output counts, detokenizer, stop strings, grammar and the text already
        reported end as that run left them, and a finish reason where its last token ended
        it. Refuses (BAD_PROGRESS) tokens out of range, too many of them, a token the
        grammar refuses, and tokens after the one that ended it."""

        def bad(message: str) -> RequestError:
            return RequestError(ErrorCode.BAD_PROGRESS, message)

        p = seq.params
        check_progress(output_ids, len(seq), p.max_tokens, self.vocab_size, self.max_model_len)
        last = len(output_ids) - 1
        for i, token in enumerate(output_ids):
            try:
                reason, _ = self._record(seq, token)
            except GrammarError as e:
                raise bad(f"output token {i}: {e}") from None
            if reason is not None and i < last:
                raise finished_at(reason, i, token)
            seq.finish_reason = reason

    def abort(self, request_id: str) -> bool:
        first = self.seqs.pop(request_id, None)
        if first is None:
            return False
        self._drop(first)
        return True

    def _drop(self, first: Sequence) -> None:
        """Take every choice of a request (`first`, its first) out, its blocks freed at once."""
        for seq in first.choices:
            seq.num_scheduled = 0
            if seq.status is not Status.FINISHED:
                self.scheduler.finish(seq)
        self.ended = [s for s in self.ended if s.request_id != first.request_id]

    def _live(self) -> list[Sequence]:
        """Every sequence in the engine that has not ended."""
        return [
            s
            for first in self.seqs.values()
            for s in first.choices
            if s.status is not Status.FINISHED
        ]

    # -- capacity -----------------------------------------------------------------

    def _blocks_needed(self, seq_len: int) -> int:
        return self.blocks.blocks_for(min(seq_len, self.max_model_len))

    def can_admit(
        self, prompt_len: int, max_tokens: int, priority: int | None = None, spare: int = 0
    ) -> bool:
        """Whether a request of this size fits beside everything already in the engine,
        assuming each runs to its max_tokens, with a watermark of blocks and the blocks of
        `spare` more tokens kept free. With `priority`: beside the requests of that
        priority or better only; the scheduler preempts the others to run it (their blocks
        count as free)."""
        reserved = held = kept = 0
        for seq in self._live():
            if priority is not None and seq.priority > priority:
                held += len(seq.block_table)  # freed if it is preempted
                continue
            kept += 1
            reserved += max(0, self._blocks_needed(seq.max_len) - len(seq.block_table))
        watermark = int(self.config.watermark * self.blocks.num_blocks)
        room = self.blocks.num_free + held - reserved - watermark - self._blocks_needed(spare)
        return (
            kept < self.config.max_num_seqs and self._blocks_needed(prompt_len + max_tokens) <= room
        )

    def preempted(self) -> list[str]:
        """The requests preempted since the last call (one of their choices) and still in the
        engine."""
        out = [rid for rid in self.scheduler.preempted if rid in self.seqs]
        self.scheduler.preempted.clear()
        return out

    @property
    def prompt_backlog(self) -> int:
        """Prompt tokens not computed yet: the leads' (a choice computes little of it)."""
        return sum(
            max(0, seq.num_prompt_tokens - seq.num_computed_tokens)
            for seq in self._live()
            if seq.lead is None
        )

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self.ended)

    def wake(self) -> None:
        """A step computes, it never waits: new work is taken after it."""

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # -- stepping -----------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        start = time.perf_counter()
        ended, self.ended = [self._output(s) for s in self.ended], []
        for out in ended:
            self._forget(out.request_id)
        seqs = self.scheduler.schedule()
        if not seqs:
            return ended
        self.num_steps += 1
        if self.group is not None:
            self.group.check()
        # the speculator's cost model learns from steps of decodes only (a prefill's rows
        # cost otherwise); without one, nothing is counted
        spec = self.speculator
        decoding = spec is not None and all(s.num_scheduled == 1 + s.num_draft for s in seqs)
        rows = sum(s.num_scheduled for s in seqs) if decoding else 0
        try:
            sampled = self._run(seqs)
        except Exception as e:
            if not self.runner.in_lockstep:
                raise  # the other ranks are mid-step: the group cannot go on
            return ended + self._recover(seqs, e)
        outs = self._advance(seqs, *sampled)
        if spec is not None and decoding:
            made = sum(len(o.new_token_ids) for o in outs)
            spec.observe(rows, time.perf_counter() - start, made, len(seqs))
        return ended + outs

    def _run(self, seqs: list[Sequence]) -> tuple[list[Sequence], list[int], list[dict | None]]:
        """The batched part of a step: inputs, forward, sampling. It changes no bookkeeping,
        so it can be run again for any of `seqs` (the forward rewrites the same KV slots)."""
        if self.group is not None:
            payload = encode_step(seqs)
            self.runner.in_lockstep = False  # the runner sets it back once the ranks are done
            send_step(payload)
        logits, sampling = self.runner.run(seqs)
        if not sampling:
            return [], [], []
        # a row per position a sequence samples at: one, or one more than it has proposals
        rows: list[Sequence] = sampling
        positions: list[int] | None = None  # the sampler's default: each one's next
        if any(s.num_draft for s in sampling):
            rows, positions = [], []
            for s in sampling:
                n = 1 + s.num_draft
                rows += [s] * n
                positions += range(s.num_output_tokens, s.num_output_tokens + n)
        # the shared generator's draws of a failed sampling are given back, so a rerun draws
        # the same (a seeded row's draw depends on its seed and position only)
        gen = self.sampler.generator
        shared = any(s.params.seed is None and not s.params.greedy for s in sampling)
        state = gen.get_state() if shared else None
        try:
            tokens, logprobs = self.sampler(logits, rows, positions)
        except Exception:
            if state is not None:
                gen.set_state(state)
            raise
        return sampling, tokens, logprobs

    def _advance(
        self,
        seqs: list[Sequence],
        sampling: list[Sequence],
        tokens: list[int],
        logprobs: list[dict | None],
    ) -> list[StepOutput]:
        """Book a successful run: computed tokens, prefix-cache blocks, new tokens. `tokens`
        and `logprobs` hold a row per position each sampling sequence sampled at; a
        sequence's proposals are checked against them (speculator.py): the accepted ones'
        KV stays computed, the rest is void."""
        drawn = []
        i = 0
        for seq in sampling:
            n = 1 + seq.num_draft
            toks, lps = tokens[i : i + n], logprobs[i : i + n]
            i += n
            drawn.append((seq, toks, lps, n > 1))
            if n > 1:
                assert self.speculator is not None
                m = self.speculator.verify(seq, toks)
                seq.num_scheduled -= seq.num_draft - m
                seq.drop_draft(keep=m)  # equal to the tokens drawn: their blocks commit
                drawn[-1] = (seq, toks[: m + 1], lps[: m + 1], True)
        for seq in seqs:
            seq.num_computed_tokens += seq.num_scheduled
            seq.num_scheduled = 0
            self.blocks.commit(seq)
        outs = []
        for seq, toks, lps, proposed in drawn:
            if seq.status is Status.FINISHED:
                continue  # a choice of a request that failed in this step
            if proposed:
                seq.drop_draft()  # booked again below, as drawn tokens
                self.blocks.trim(seq, seq.num_computed_tokens + 1)
            try:
                outs.append(self._append(seq, toks, lps))
            except Exception as e:
                if seq.status is Status.FINISHED:
                    raise  # it failed while being taken out: the bookkeeping is broken
                outs.append(self._fail(seq, e))
        return outs

    def _recover(self, seqs: list[Sequence], error: Exception) -> list[StepOutput]:
        """Run a failed step's sequences one at a time: those that fail alone end with
        finish_reason "error"; the others take their step as usual."""
        log.warning(
            "a step of %d sequences failed (%s); running them one at a time",
            len(seqs),
            _describe(error),
        )
        outs: list[StepOutput] = []
        for seq in seqs:
            if seq.status is Status.FINISHED:
                continue  # a choice of a request that failed alone already
            try:
                sampled = self._run([seq])
            except Exception as e:
                if not self.runner.in_lockstep:
                    raise
                log.error("request %s failed: %s", seq.request_id, _describe(e), exc_info=e)
                outs.append(self._fail(seq, e))
                continue
            outs += self._advance([seq], *sampled)
        return outs

    def _fail(self, seq: Sequence, error: Exception) -> StepOutput:
        """End the request of a sequence that cannot be computed, every choice of it: their
        blocks are freed at once."""
        seq.finish_reason = "error"
        self._drop(self.seqs.pop(seq.request_id))
        return self._output(seq, error=_describe(error))

    def _output(
        self,
        seq: Sequence,
        new: list[int] | None = None,
        delta: str = "",
        logprobs: list[dict] | None = None,
        error: str | None = None,
    ) -> StepOutput:
        """What a step reports of `seq`: `new` tokens and text, and its counts; the cached
        tokens are its request's, its lead's (a choice forked the rest)."""
        st = seq.spec
        return StepOutput(
            request_id=seq.request_id,
            new_token_ids=new or [],
            text_delta=delta,
            finished=seq.finish_reason is not None,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=(seq.lead or seq).num_cached_tokens,
            logprobs=logprobs,
            error=error,
            num_spec_proposed=st.proposed if st is not None else 0,
            num_spec_accepted=st.accepted if st is not None else 0,
            index=seq.index,
        )

    def _forget(self, request_id: str) -> None:
        """Let go of a request once every choice of it has ended."""
        first = self.seqs.get(request_id)
        if first is not None and all(s.status is Status.FINISHED for s in first.choices):
            del self.seqs[request_id]

    def _append(self, seq: Sequence, tokens: list[int], logprobs: list[dict | None]) -> StepOutput:
        """Book a step's drawn tokens on `seq` in order, up to the one it ends with."""
        new: list[int] = []
        lps: list[dict] = []
        delta = ""
        reason = None
        for token, logprob in zip(tokens, logprobs, strict=True):
            if logprob is not None:
                # token texts for OpenAI-shaped answers: the gateway has no tokenizer
                logprob["token"] = self.tokenizer.decode([token])
                if "top" in logprob:
                    logprob["top_tokens"] = [self.tokenizer.decode([t]) for t, _ in logprob["top"]]
                seq.logprobs.append(logprob)
                lps.append(logprob)
            reason, text = self._record(seq, token)
            new.append(token)
            delta += text
            if reason:
                break
        if reason:
            seq.finish_reason = reason
            self.scheduler.finish(seq)
            self._forget(seq.request_id)
        return self._output(seq, new, delta, lps or None)

    def _record(self, seq: Sequence, token: int) -> tuple[str | None, str]:
        """Book one output token on `seq`: output counts, text, grammar, stop conditions.
        Returns why the sequence ends with it (None: it goes on) and the text to report
        now. Sampled tokens (`_append`) and replayed ones (`_replay`) both come here."""
        p = seq.params
        seq.append(token)
        detok = seq.detok
        assert detok is not None
        before = len(detok.text)
        new = detok.add(token)  # the text only grows, by `new`
        reason = None
        if seq.matcher is not None and not seq.matcher.consume_token(token):
            raise GrammarError(
                f"token {token} broke the output's grammar: {seq.matcher.get_error()}"
            )
        if (token in self.eos_ids and not p.ignore_eos) or token in seq.stop_ids:
            reason = "stop"
        elif seq.stop_matcher is not None and new:
            cut = seq.stop_matcher.feed(new, before)
            if cut >= 0:  # the output ends before the earliest stop string
                detok.text = detok.text[:cut]
                reason = "stop"
        if reason is None and seq.matcher is not None and seq.matcher.is_stopped():
            reason = "stop"  # the grammar is complete and allows nothing more
        if reason is None and (
            seq.num_output_tokens >= p.max_tokens or len(seq) >= self.max_model_len
        ):
            reason = "length"
        held = 0 if reason else seq.stop_hold
        text = detok.text
        delta = text[seq.emitted : max(seq.emitted, len(text) - held)]
        seq.emitted += len(delta)
        return reason, delta

    # -- offline ------------------------------------------------------------------

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        priorities: list[int] | None = None,
    ) -> list[Completion]:
        """Run prompts (text or token ids) to completion; results in input order, a
        prompt's n choices (params.n) one after another."""
        if not isinstance(params, list):
            params = [params or SamplingParams()] * len(prompts)
        batch = next(self._batches)
        ids = [f"generate-{batch}-{i}" for i in range(len(prompts))]
        seqs: list[Sequence] = []
        for i, (rid, prompt, p) in enumerate(zip(ids, prompts, params, strict=True)):
            prio = priorities[i] if priorities else 0
            if isinstance(prompt, str):
                self.add(AddRequest(rid, prompt=prompt, params=p, priority=prio))
            else:
                self.add(AddRequest(rid, token_ids=list(prompt), params=p, priority=prio))
            seqs += self.seqs[rid].choices
        while any(s.status is not Status.FINISHED for s in seqs):
            self.step()
        out = []
        for s in seqs:
            assert s.detok is not None and s.finish_reason is not None
            out.append(
                Completion(
                    request_id=s.request_id,
                    prompt_token_ids=s.token_ids[: s.num_prompt_tokens],
                    token_ids=s.output_token_ids,
                    text=s.detok.text,
                    finish_reason=s.finish_reason,
                    num_cached_tokens=s.num_cached_tokens,
                    logprobs=s.logprobs or None,
                    index=s.index,
                )
            )
        return out

    def stats(self) -> dict[str, Any]:
        bm = self.blocks
        used = bm.num_blocks - bm.num_free  # every block with no reference is in the free queue
        # per sequence, not per block: stats() runs every second in a serving worker
        stored = sum(
            min(s.num_computed_tokens, len(s.block_table) * bm.block_size) for s in self._live()
        )
        tiers = {f"kv_{k}": v for k, v in vars(bm.tiers.counters).items()} if bm.tiers else {}
        if bm.tiers is not None and bm.tiers.remote is not None:
            tiers["kv_bad_entries"] += bm.tiers.remote.refused  # MAC refusals, by the tier itself
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
            "spec_proposed_tokens": self.speculator.proposed if self.speculator else 0,
            "spec_accepted_tokens": self.speculator.accepted if self.speculator else 0,
            **tiers,
        }


def _describe(error: BaseException) -> str:
    """A short account of an exception for a request's result: type and message."""
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= 300 else text[:297] + "..."
