"""The wire's sampling fields (validated by the native SamplingParams, so both backends
refuse the same input with the same code and message) as vLLM's SamplingParams."""

from __future__ import annotations

from vllm import SamplingParams as VllmParams
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

from plurai.gpu_workers.engine.sampling_params import SamplingParams


def structured(p: SamplingParams) -> StructuredOutputsParams | None:
    """The request's response_format, regex or choice as vLLM's structured outputs (compiled
    by its "guidance" backend, whose whitespace rule the engine's config sets)."""
    rf = p.response_format
    if rf is not None and rf["type"] == "json_schema":
        return StructuredOutputsParams(json=rf["json_schema"]["schema"])
    if rf is not None and rf["type"] == "json_object":
        return StructuredOutputsParams(json_object=True)
    if p.regex is not None:
        return StructuredOutputsParams(regex=p.regex)
    if p.choice is not None:
        return StructuredOutputsParams(choice=list(p.choice))
    return None


def resume_refusal(p: SamplingParams) -> str | None:
    """Why vLLM cannot continue a request with these fields exactly from output tokens it is
    given as prompt (None: it can). Only greedy decoding draws the same tokens (a seeded
    draw follows the request's own generator); presence and frequency penalties count
    output tokens only; stop strings are matched in the text vLLM decodes, which would not
    hold the given tokens' text; a grammar would start again from the first token."""
    if not (p.greedy or p.top_k == 1):
        return "sampling that is not greedy (temperature 0 or top_k 1)"
    if p.presence_penalty or p.frequency_penalty:
        return "presence or frequency penalties"
    if p.stop:
        return "stop strings"
    if p.constrained:
        return "structured output (response_format, regex, choice)"
    return None


def to_vllm(p: SamplingParams, num_output: int = 0) -> VllmParams:
    """One sequence's parameters (a choice's: the backend adds a vLLM request per choice).
    `num_output`: output tokens a resumed request already has (given as prompt); they
    count toward max_tokens."""
    return VllmParams(
        max_tokens=p.max_tokens - num_output,
        temperature=p.temperature,
        top_k=p.top_k,  # 0 disables it in both
        top_p=p.top_p,
        min_p=p.min_p,
        repetition_penalty=p.repetition_penalty,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        seed=p.seed,
        stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids),
        # a constrained output ends when its grammar does, as in the native engine: once
        # complete, the grammar allows only EOS, and vLLM, ignoring it, would go on without
        # a mask (free text after the grammar's output) to max_tokens
        ignore_eos=p.ignore_eos and not p.constrained,
        logprobs=p.logprobs,
        skip_special_tokens=p.skip_special_tokens,
        output_kind=RequestOutputKind.DELTA,  # each step's new tokens and text only
        structured_outputs=structured(p),
    )


def logprob_entries(
    token_ids: list[int], logprobs: list[dict] | None, top: int
) -> list[dict] | None:
    """vLLM's per-token {token id: Logprob} maps in the wire's form, the same as the native
    engine's: {"token_id", "logprob", "token" (its text), "top": [[id, logprob], ...] (rank
    order, N entries), "top_tokens": their texts}."""
    if logprobs is None:
        return None
    out = []
    for t, d in zip(token_ids, logprobs, strict=True):
        entry: dict = {"token_id": t, "logprob": float(d[t].logprob), "token": d[t].decoded_token}
        if top:
            ranked = sorted(
                (lp.rank, i, lp.logprob, lp.decoded_token)
                for i, lp in d.items()
                if lp.rank and lp.rank <= top
            )
            entry["top"] = [[int(i), float(v)] for _, i, v, _ in ranked]
            entry["top_tokens"] = [text for *_, text in ranked]
        out.append(entry)
    return out
