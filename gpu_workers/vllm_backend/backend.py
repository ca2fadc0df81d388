"""The engine interface (gpu_workers/backend.py) on vLLM's LLMEngine.

    backend = VllmBackend("models/my-model", tensor_parallel=2, options={"dtype": "bfloat16"})
    backend.add(AddRequest("job-1", prompt="Hello", params={"max_tokens": 8}))
    while backend.has_unfinished():
        for out in backend.step(): ...

vLLM's engine core (scheduler and executor) runs in a process of its own, as under `vllm
serve`, and steps on its own while the worker loop takes entries, writes deltas and turns
outputs into text: step() collects the outputs it has made since the last call (waiting
for the next ones when there are none). PLURAI_VLLM_ENGINE_PROCESS=0 keeps the core in this
process, stepped by the worker loop between its Redis turns (the engine then idles while
the worker talks to Redis). The scheduler's figures come from a stat logger either way. Prompts are tokenized by the same code as the native engine's and the
sampling fields are validated by the native SamplingParams, so both backends refuse the
same input with the same code and message, and give vLLM the same token ids. A constraint
(response_format, regex, choice) is compiled by the native engine's grammar compiler too,
before vLLM sees it, for the same reason; vLLM then enforces it with the same library.

A request cut off elsewhere is resumed (add's `output_ids`) only where vLLM then gives exactly
the tokens of the uninterrupted run (params.resume_refusal): its output tokens so far join
the prompt, and its text is decoded here, by the native engine's Detokenizer, so that it
goes on across the cut as it was reported before; other requests are refused with
bad_progress, and the worker runs them again from the start.

Where vLLM's engine itself fails (its step raises), the backend cannot tell which request
caused it: the exception reaches the worker, which hands every running job back with the
attempt counted and exits; another worker (or this one, restarted) runs them.

One file, though long: the Backend interface over vLLM is one object whose methods share
its requests' bookkeeping (choices, resumes, detokenizers); parameters, the stat logger and
the KV connector are modules of their own.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from typing import Any

from transformers import AutoTokenizer
from vllm import TokensPrompt
from vllm.config import KVTransferConfig, StructuredOutputsConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.exceptions import VLLMClientError
from vllm.v1.engine.llm_engine import LLMEngine
from vllm.v1.executor import Executor

from plurai.broker_config.settings import Settings
from plurai.gpu_workers.backend import AddRequest, RequestError, StepOutput
from plurai.gpu_workers.engine.config import host_memory_bytes
from plurai.gpu_workers.engine.detokenizer import Detokenizer
from plurai.gpu_workers.engine.errors import ErrorCode
from plurai.gpu_workers.engine.grammar import Grammars
from plurai.gpu_workers.engine.sampling_params import SamplingParams
from plurai.gpu_workers.engine.sequence import check_progress, finished_at
from plurai.gpu_workers.models.loader import fingerprint
from plurai.gpu_workers.prompts import Prompts, check_options
from plurai.gpu_workers.vllm_backend import connector, cores, cpu_support, reaper
from plurai.gpu_workers.vllm_backend.params import logprob_entries, resume_refusal, to_vllm
from plurai.gpu_workers.vllm_backend.stats import Figures

log = logging.getLogger(__name__)

FINISH_REASONS = ("stop", "length", "abort")
# what sizes vLLM's KV cache if given; else, on CPU, the worker's share of the host
KV_SIZES = ("kv_cache_memory_bytes", "gpu_memory_utilization")
CPU_KV_ENV = "VLLM_CPU_KVCACHE_SPACE"
POLL_S = 0.02  # how long step() waits for the engine process's next outputs


def cpu_kv_bytes(options: dict[str, Any], share: float | None, ranks: int) -> int | None:
    """The KV cache bytes of each rank on a CPU host, or None to leave the size to vLLM
    (a GPU, or a size given in `options` or VLLM_CPU_KVCACHE_SPACE). vLLM's CPU default is
    gpu_memory_utilization (0.92) of the host's memory less what the process holds: one
    worker takes nearly all, and a second refuses to start."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or set(KV_SIZES) & set(options) or os.environ.get(CPU_KV_ENV):
        return None
    share = Settings().vllm_kv_share if share is None else share
    total = host_memory_bytes()
    each = int(total * share / max(1, ranks))
    log.info(
        "vLLM KV cache: %.2f GiB per rank, %g of the host's %.1f GiB (PLURAI_VLLM_KV_SHARE)",
        each / 2**30,
        share,
        total / 2**30,
    )
    return each


def engine_config(model: str, tensor_parallel: int, pipeline_parallel: int, options: dict) -> Any:
    try:
        args = EngineArgs(
            model=model,
            tensor_parallel_size=tensor_parallel,
            pipeline_parallel_size=pipeline_parallel,
            disable_log_stats=False,
            **options,
        )
    except TypeError as e:
        raise ValueError(f"unknown vLLM engine option: {e}") from e
    return args.create_engine_config()


@dataclass
class _Request:
    num_prompt: int
    max_len: int  # prompt plus max_tokens, capped at max_model_len
    top_logprobs: int | None
    names: list[str]  # vLLM's request of each choice (one unless n > 1)
    outputs: list[int]  # output tokens of each choice
    num_given: int = 0  # output tokens a resumed request came with, computed with the prompt
    detok: Detokenizer | None = None  # a resumed request's text is decoded here
    priority: int = 0
    num_cached: int | None = None  # the prompt's cached tokens, as its first output said

    @property
    def num_output(self) -> int:
        return sum(self.outputs)


class VllmBackend:
    def __init__(
        self,
        model: str,
        *,
        tensor_parallel: int = 1,
        pipeline_parallel: int = 1,
        options: dict[str, Any] | None = None,
        kv_redis_url: str | None = None,
        kv_ttl_s: int = 3600,
        watermark: float = 0.01,
        kv_share: float | None = None,
        engine_process: bool | None = None,
    ) -> None:
        """`options`: vLLM EngineArgs fields (`--vllm KEY=VALUE`). `kv_redis_url`: the Redis
        that holds the shared KV tier (None: PLURAI_KV_REDIS_URL, else no Redis tier).
        `kv_share`: on CPU, the share of the host's memory for the KV cache when `options`
        give no size (None: PLURAI_VLLM_KV_SHARE). `engine_process`: the engine core in a
        process of its own (None: PLURAI_VLLM_ENGINE_PROCESS, default yes)."""
        options = dict(options or {})
        fixed = {"model", "tokenizer", "tensor_parallel_size", "pipeline_parallel_size"}
        if fixed & set(options):
            raise ValueError(f"give {sorted(fixed & set(options))} as worker arguments, not --vllm")
        ranks = tensor_parallel * pipeline_parallel
        kv_bytes = cpu_kv_bytes(options, kv_share, ranks)
        if kv_bytes is not None:
            options["kv_cache_memory_bytes"] = kv_bytes
        options.setdefault("scheduling_policy", "priority")  # lanes and job priorities
        options.setdefault("enable_prefix_caching", True)
        # llguidance ("guidance"), as in the native engine (gpu_workers/engine/grammar.py):
        # it refuses the schema keywords it cannot enforce where xgrammar (vLLM's "auto"
        # choice) lets outputs through that do not validate; and JSON without optional
        # whitespace (the native JSON_OPTIONS), so a weak model does not fill max_tokens
        # with spaces. vLLM reads the whitespace rule from here only, not per request.
        options.setdefault(
            "structured_outputs_config",
            StructuredOutputsConfig(backend="guidance", disable_any_whitespace=True),
        )
        self.model_fingerprint = fingerprint(model)
        kv_redis_url = kv_redis_url or Settings().kv_redis_url
        if kv_redis_url:  # for the connector in vLLM's processes; not in vLLM's config: it logs it
            os.environ[connector.URL_ENV] = kv_redis_url
        if engine_process is None:
            engine_process = Settings().vllm_engine_process
        self.engine_process = engine_process
        self.tier = False  # the Redis KV tier (Plurai's connector) on
        self.kv = None  # the connector's counters, where it runs in this process
        if kv_redis_url and "kv_transfer_config" not in options:
            self.tier = True
            self.kv = None if engine_process else connector.COUNTERS
            # given to EngineArgs (not set on the config afterwards), so that vLLM adapts
            # the rest of its config to a connector
            options["kv_transfer_config"] = KVTransferConfig(
                kv_connector="PluraiConnector",
                kv_connector_module_path=connector.__name__,
                kv_role="kv_both",
                kv_load_failure_policy="recompute",  # a block that fails to load is a miss
                kv_connector_extra_config={"ttl_s": kv_ttl_s},
            )
        config = engine_config(model, tensor_parallel, pipeline_parallel, options)
        refusal = cpu_support.config_refusal(config)
        if refusal and options.get("dtype", "auto") == "auto":
            # the dtype was vLLM's choice, not the user's: take one its kernels run here
            log.info("vLLM: bfloat16 rather than %s: %s", config.model_config.dtype, refusal)
            options["dtype"] = "bfloat16"
            config = engine_config(model, tensor_parallel, pipeline_parallel, options)
            refusal = cpu_support.config_refusal(config)
        if refusal:
            raise cpu_support.Unsupported(refusal)
        cache = config.cache_config
        # blocks of another backend, dtype or block size are never mixed up with these
        self.kv_fingerprint = hashlib.blake2b(
            f"{self.model_fingerprint}|vllm|{config.model_config.dtype}|{cache.block_size}".encode(),
            digest_size=16,
        ).hexdigest()
        if self.tier:  # read by the connector when the engine starts, below
            config.kv_transfer_config.kv_connector_extra_config["fingerprint"] = self.kv_fingerprint
        self.figures = Figures()
        before = set(reaper.descendants(os.getpid())) if engine_process else set()
        self.engine = LLMEngine(
            vllm_config=config,
            executor_class=Executor.get_class(config),
            log_stats=True,
            stat_loggers=[lambda *_: self.figures],
            multiprocess_mode=engine_process,
        )
        # the engine's processes die with this one, even by SIGKILL (reaper.py)
        started = [p for p in reaper.descendants(os.getpid()) if p not in before]
        self.reaper = reaper.start(started) if engine_process else None
        if engine_process:  # where vLLM binds its ranks to cores (cores.py)
            cores.pin_to_ranks(started)
        self.block_size = cache.block_size
        self.num_blocks = cache.num_gpu_blocks or 0
        self.max_model_len = config.model_config.max_model_len
        self.max_num_seqs = config.scheduler_config.max_num_seqs
        self.step_tokens = config.scheduler_config.max_num_batched_tokens
        self.watermark = watermark
        tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
        vocab = config.model_config.get_vocab_size()
        self.prompts = Prompts(tokenizer, vocab, self.max_model_len)
        # vLLM's guidance backend ends a constrained output at the tokenizer's EOS
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        self.grammars = Grammars(tokenizer, vocab, eos)
        self.tokenizer = tokenizer
        # what vLLM stops at unless ignore_eos: the tokenizer's EOS and the generation config's
        gen_eos = config.model_config.try_get_generation_config().get("eos_token_id")
        self.eos_ids = {*eos, *([gen_eos] if isinstance(gen_eos, int) else gen_eos or [])}
        self.reqs: dict[str, _Request] = {}
        self.choices: dict[str, tuple[str, int]] = {}  # vLLM request -> (request, choice)
        self.added = 0  # requests added since the last step (not in vLLM's figures yet)
        self.steps = 0
        # the engine process's outputs, which step() waits for (None: the engine runs here)
        self._outputs = getattr(self.engine.engine_core, "outputs_queue", None)
        self._woken = False  # wake() was called: step() stops waiting

    # -- requests -----------------------------------------------------------------

    def add(self, req: AddRequest) -> list[str]:
        """See gpu_workers/backend.py. A request of n > 1 choices is n vLLM requests
        '<request id>/<choice>', choice i seeded as the native engine seeds it
        (SamplingParams.for_choice), which share the prompt's blocks through vLLM's prefix
        cache (vLLM's own `n` is the same fan-out, but refuses greedy sampling). Resumes
        (`output_ids`) only what vLLM continues exactly (params.resume_refusal) and
        refuses the rest with BAD_PROGRESS."""
        request_id, params, output_ids = req.request_id, req.params, req.output_ids
        if request_id in self.reqs:
            raise RequestError(
                ErrorCode.DUPLICATE_ID, f"request id {request_id!r} is already in the engine"
            )
        if not isinstance(params, SamplingParams):
            params = SamplingParams.from_dict(params or {})
        names = [request_id] if params.n == 1 else [f"{request_id}/{i}" for i in range(params.n)]
        if any(name in self.choices for name in names):
            raise RequestError(
                ErrorCode.DUPLICATE_ID, f"request id {request_id!r} is already in the engine"
            )
        check_options(req.priority, req.cache_salt, req.special_tokens)
        ids = self.prompts.tokenize(req.prompt, req.token_ids, req.messages, req.special_tokens)
        # a bad schema, regex or choice list is refused here with the native engine's reason
        # (vLLM's own check misses some, which then fail or stop the request inside vLLM)
        self.grammars.matcher(params)
        given = [] if output_ids is None else self._progress(ids, params, output_ids)
        detok, text = None, ""
        if given:
            detok = Detokenizer(self.tokenizer, ids, params.skip_special_tokens)
            text = "".join(detok.add(t) for t in given)
        request = TokensPrompt(prompt_token_ids=ids + given)
        if req.cache_salt is not None:
            request["cache_salt"] = req.cache_salt
        added: list[str] = []
        try:
            for i, name in enumerate(names):
                vllm_params = to_vllm(params.for_choice(i), len(given))
                self.engine.add_request(name, dict(request), vllm_params, priority=req.priority)
                added.append(name)
        except (ValueError, TypeError, VLLMClientError) as e:  # beyond the shared checks
            if added:
                self.engine.abort_request(added)
            raise RequestError(ErrorCode.INVALID_PARAMS, f"vLLM refused the request: {e}") from e
        max_len = min(len(ids) + params.max_tokens, self.max_model_len)
        self.reqs[request_id] = _Request(
            num_prompt=len(ids),
            max_len=max_len,
            top_logprobs=params.logprobs,
            names=names,
            outputs=[len(given)] + [0] * (params.n - 1),
            num_given=len(given),
            detok=detok,
            priority=req.priority,
        )
        self.choices.update((name, (request_id, i)) for i, name in enumerate(names))
        self.added += len(names)
        return [text] + [""] * (params.n - 1)

    def _progress(self, ids: list[int], params: SamplingParams, output_ids: Any) -> list[int]:
        """A resumed request's output tokens, checked as the native engine checks them."""

        def bad(message: str) -> RequestError:
            return RequestError(ErrorCode.BAD_PROGRESS, message)

        if not isinstance(output_ids, list) or len(output_ids) != params.n:
            raise bad(f"output_ids must hold one list per choice ({params.n})")
        if params.n > 1 and any(output_ids):
            raise bad("vLLM cannot resume a request of n > 1 choices exactly")
        given = check_progress(
            output_ids[0], len(ids), params.max_tokens, self.prompts.vocab_size, self.max_model_len
        )
        why = resume_refusal(params) if given else None
        if why is not None:
            raise bad(f"vLLM cannot resume a request with {why} exactly")
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)
        for i, t in enumerate(given):
            if t in stops:
                raise finished_at("stop", i, t)
        if given and (
            len(given) >= params.max_tokens or len(ids) + len(given) >= self.max_model_len
        ):
            raise finished_at("length", len(given) - 1, given[-1])
        return given

    def abort(self, request_id: str) -> bool:
        req = self.reqs.pop(request_id, None)
        if req is None:
            return False
        going = [name for name in req.names if self.choices.pop(name, None) is not None]
        self.engine.abort_request(going)
        self._settle()
        return True

    def _settle(self) -> None:
        """vLLM's figures come with a step, and none follows once nothing is in flight: then
        no request holds a block (cached ones count as free) and none runs or waits."""
        if not self.reqs and not self.engine.has_unfinished_requests():
            self.figures.running = self.figures.waiting = 0
            self.figures.kv_usage = 0.0

    def step(self) -> list[StepOutput]:
        """The outputs of the engine's next step. With the engine core in its own process:
        every step it has made since the last call, or none when it makes none within
        POLL_S or until wake(), so that the worker takes new entries (and the core gets
        them) while a long prefill step runs instead of after it."""
        ready = self._outputs
        if ready is not None:
            # the queue's own condition: woken by its put, or by wake(); no polling
            with ready.not_empty:
                ready.not_empty.wait_for(lambda: len(ready.queue) > 0 or self._woken, POLL_S)
                self._woken = False
                if not ready.queue:
                    return []
        outputs = self.engine.step()
        self.steps += 1
        self.added = 0
        while ready is not None and not ready.empty() and self.engine.has_unfinished_requests():
            outputs += self.engine.step()
            self.steps += 1
        out = []
        for o in outputs:
            choice = self.choices.get(o.request_id)
            if choice is None:  # aborted since
                continue
            request_id, index = choice
            req = self.reqs[request_id]
            if req.num_cached is None:  # the request's: its first output's
                req.num_cached = o.num_cached_tokens or 0
            out.append(self._output(request_id, index, req, o.outputs[0], o.finished))
            if o.finished:
                del self.choices[o.request_id]
                if not any(name in self.choices for name in req.names):
                    del self.reqs[request_id]
        self._settle()
        return out

    def wake(self) -> None:
        ready = self._outputs
        if ready is not None:
            with ready.not_empty:
                self._woken = True
                ready.not_empty.notify_all()

    def _output(
        self, request_id: str, index: int, req: _Request, c: Any, finished: bool
    ) -> StepOutput:
        """A step's output of one choice, vLLM's CompletionOutput `c`."""
        new = list(c.token_ids)
        req.outputs[index] += len(new)
        text = c.text
        if req.detok is not None:
            # vLLM leaves the text of the stop token (EOS, stop_token_ids) out
            stopped = finished and c.finish_reason == "stop"
            text = "".join(req.detok.add(t) for t in (new[:-1] if stopped else new))
        reason, error = None, None
        if finished:
            reason = c.finish_reason if c.finish_reason in FINISH_REASONS else "error"
            if reason == "error":
                error = f"vLLM ended the request: {c.finish_reason} ({c.stop_reason})"
        return StepOutput(
            request_id=request_id,
            new_token_ids=new,
            text_delta=text,
            finished=finished,
            finish_reason=reason,
            num_prompt_tokens=req.num_prompt,
            num_output_tokens=req.outputs[index],
            num_cached_tokens=req.num_cached or 0,
            logprobs=logprob_entries(new, c.logprobs, req.top_logprobs or 0)
            if req.top_logprobs is not None
            else None,
            error=error,
            index=index,
        )

    # -- capacity -----------------------------------------------------------------

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def can_admit(
        self, prompt_tokens: int, max_tokens: int, priority: int | None = None, spare: int = 0
    ) -> bool:
        """Whether a request of this size fits: vLLM has nothing waiting, a sequence slot is
        free, and the blocks in use now plus what every request here may still grow by (to
        its max_tokens) plus this one and the blocks of `spare` tokens leave the watermark
        free. With `priority`, the
        requests of a worse priority neither take a slot nor grow here: vLLM schedules the
        new one first and preempts the worst running request when blocks run short (it
        keeps its output and is recomputed)."""
        mine = [r for r in self.reqs.values() if priority is None or r.priority <= priority]
        seqs = sum(len(r.outputs) for r in mine)  # a sequence a choice
        if seqs >= self.max_num_seqs or (priority is None and self.figures.waiting > 0):
            return False
        used = round(self.figures.kv_usage * self.num_blocks)
        growth = 0
        for r in mine:
            for i, made in enumerate(r.outputs):
                given = r.num_given if i == 0 else 0
                held = self._blocks(r.num_prompt + made) if made > given else 0
                growth += self._blocks(r.max_len) - held
        need = self._blocks(min(prompt_tokens + max_tokens, self.max_model_len)) + self._blocks(
            spare
        )
        return used + growth + need <= self.num_blocks * (1 - self.watermark)

    def preempted(self) -> list[str]:
        """vLLM keeps the requests it preempts and resumes them itself."""
        return []

    def has_unfinished(self) -> bool:
        return bool(self.reqs) or self.engine.has_unfinished_requests()

    @property
    def prompt_backlog(self) -> int:
        return sum(
            r.num_prompt + r.num_given for r in self.reqs.values() if r.num_output == r.num_given
        )

    # vLLM's figures come with its steps: the last step of the last request may still count
    # it, and an idle worker steps no more, so with no request here nothing runs or waits
    @property
    def num_running(self) -> int:
        return self.figures.running if self.reqs else 0

    @property
    def num_waiting(self) -> int:
        return (self.figures.waiting if self.reqs else 0) + self.added

    def stats(self) -> dict[str, Any]:
        f, bs = self.figures, self.block_size
        used = round(f.kv_usage * self.num_blocks) if self.reqs else 0  # see num_running
        tier = {}
        if self.kv is not None:
            tier = {"kv_redis_hits": f.remote_hits // bs, "kv_bad_entries": self.kv.bad}
        elif self.tier:  # the connector counts refusals in the engine's process (and logs them)
            tier = {"kv_redis_hits": f.remote_hits // bs}
        return {
            "blocks_total": self.num_blocks,
            "blocks_free": self.num_blocks - used,
            "blocks_used": used,
            "tokens_stored": sum(r.num_prompt + r.num_output for r in self.reqs.values()),
            "slots_allocated": used * bs,
            "prefix_hit_blocks": f.prefix_hits // bs,
            "prefix_lookup_blocks": f.prefix_queries // bs,
            "running": self.num_running,
            "waiting": self.num_waiting,
            "preemptions": f.preemptions,
            "steps": self.steps,
            "prompt_tokens": f.prompt_tokens,
            "generated_tokens": f.generated_tokens,
            "spec_proposed_tokens": f.spec_proposed,
            "spec_accepted_tokens": f.spec_accepted,
            **tier,
        }

    def close(self) -> None:
        """Stop vLLM's executor (its rank processes) and the connector's Redis writer."""
        shutdown = getattr(self.engine.engine_core, "shutdown", None)
        if shutdown is not None:
            shutdown()
        reaper.stop(self.reaper)
