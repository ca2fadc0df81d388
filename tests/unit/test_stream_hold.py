"""A running job's tokens are held back and written to its stream together (job.Running):
its first tokens at once (time to first token unchanged), then every `tokens` tokens or
when the oldest held one is `seconds` old, the rest with its result; the stream always
spells the same text as the result."""

from __future__ import annotations

from plurai.broker_config import protocol
from plurai.gpu_workers.backend import StepOutput
from plurai.gpu_workers.intake import Entry
from plurai.gpu_workers.job import Running, Stream
from plurai.results import jobs, progress

EVERY = Stream(tokens=4, seconds=0.1)


def running(stream: bool = True, n: int = 1) -> Running:
    env = protocol.Envelope(job_id="job-12345678", max_tokens=64, prompt_tokens=3)
    params = {"max_tokens": 64, "n": n} if n > 1 else {"max_tokens": 64}
    return Running(
        Entry(
            lane="standard",
            stream="plurai:{default}:req:standard",
            entry_id=b"1-0",
            fields={},
            req=protocol.Request(envelope=env, prompt="x", stream=stream, params=params),
        )
    )


def out(tok: int, text: str, finished: bool = False, index: int = 0) -> StepOutput:
    return StepOutput(
        request_id="job-12345678",
        new_token_ids=[tok],
        text_delta=text,
        finished=finished,
        finish_reason="length" if finished else None,
        num_prompt_tokens=3,
        num_output_tokens=0,
        num_cached_tokens=0,
        index=index,
    )


def one(deltas: list) -> jobs.Delta | None:
    """The one write of a job of one choice, or None."""
    assert len(deltas) <= 1 and all(d.index is None for d in deltas)
    return deltas[0] if deltas else None


def test_first_tokens_at_once_then_held_until_enough() -> None:
    run = running()
    first = one(run.absorb(out(1, "a"), 0.0, EVERY))
    assert first is not None and (first.text, first.token_ids, first.reset) == ("a", [1], False)
    assert [run.absorb(out(t, str(t)), 0.01, EVERY) for t in (2, 3, 4)] == [[], [], []]
    sent = one(run.absorb(out(5, "5"), 0.02, EVERY))  # four held: written together
    assert sent is not None and (sent.text, sent.token_ids) == ("2345", [2, 3, 4, 5])
    assert run.held_since is None and not run.has_unsent


def test_held_tokens_go_when_the_oldest_is_old_enough_or_the_job_ends() -> None:
    run = running()
    run.absorb(out(1, "a"), 0.0, EVERY)
    assert one(run.absorb(out(2, "b"), 1.0, EVERY)) is None
    late = one(run.absorb(out(3, "c"), 1.1, EVERY))  # the oldest held waited 0.1 s
    assert late is not None and late.token_ids == [2, 3]
    assert one(run.absorb(out(4, "d"), 1.2, EVERY)) is None
    last = one(run.absorb(out(5, "e", finished=True), 1.21, EVERY))
    assert last is not None and (last.text, last.token_ids) == ("de", [4, 5])


def test_the_stream_spells_the_result_whatever_the_holding() -> None:
    for every in (
        Stream(tokens=1, seconds=0.0),
        Stream(tokens=3, seconds=10.0),
        Stream(tokens=1000, seconds=1000.0),
    ):
        run, written = running(), []
        for t in range(20):
            written += run.absorb(out(t, f"<{t}>", finished=t == 19), t * 0.03, every)
        (c,) = run.choices
        assert "".join(d.text for d in written) == "".join(c.text)
        assert [i for d in written for i in d.token_ids] == c.token_ids == list(range(20))
        if every.tokens == 1:
            assert len(written) == 20  # one write a token, as before holding


def test_a_resync_rewrites_everything_and_unsent_flushes_the_rest() -> None:
    run = running()
    run.absorb(out(1, "a"), 0.0, EVERY)
    run.absorb(out(2, "b"), 0.01, EVERY)
    run.resync = True  # Redis failed: the stream may lack writes
    again = one(run.absorb(out(3, "c"), 0.02, EVERY))
    assert again is not None and again.reset and (again.text, again.token_ids) == ("abc", [1, 2, 3])
    assert again.whole  # the progress is written again from its header
    run.absorb(out(4, "d"), 0.03, EVERY)
    held = one(run.unsent())  # a job ended outside a step (cancel, deadline) writes what it holds
    assert held is not None and (held.text, held.token_ids) == ("d", [4]) and not held.whole
    assert run.unsent() == []


def test_a_job_that_does_not_stream_writes_its_progress_only() -> None:
    run = running(stream=False)
    assert run.absorb(out(1, "a"), 0.0, EVERY) == []  # no rush for a first token
    saved = one(run.absorb(out(2, "b"), 0.2, EVERY))  # held for longer than EVERY.seconds
    assert saved is not None and not saved.stream and saved.whole
    head = progress.header("f" * 64)
    got = progress.parse(head + saved.progress, head, max_tokens=8, logprobs=False)
    assert got is not None and got[0].token_ids == [1, 2] and got[0].logprobs is None
    run.absorb(out(3, "c"), 0.25, EVERY)
    more = one(run.unsent())  # from where the last write stopped: appended
    assert more is not None and not more.whole and more.token_ids == [3]
    assert run.absorb(out(4, "d", finished=True), 0.3, EVERY) == []  # its result has all
    assert run.choices[0].text == ["a", "b", "c", "d"]


def test_tokens_go_at_once_until_the_first_text_is_out() -> None:
    run = running()  # e.g. text held back while it may start a stop string
    assert one(run.absorb(out(1, ""), 0.0, EVERY)) is not None
    assert one(run.absorb(out(2, ""), 0.01, EVERY)) is not None
    shown = one(run.absorb(out(3, "abc"), 0.02, EVERY))
    assert shown is not None and shown.text == "abc"
    assert one(run.absorb(out(4, "d"), 0.03, EVERY)) is None


def test_a_job_of_several_choices_writes_a_delta_per_choice() -> None:
    run = running(n=2)
    first = run.absorb(out(1, "a", index=1), 0.0, EVERY)  # its first text: at once
    assert [(d.index, d.text, d.whole) for d in first] == [(1, "a", True)]
    assert run.absorb(out(2, "b"), 0.01, EVERY) == []
    assert run.absorb(out(3, "c", finished=True, index=1), 0.02, EVERY) == []  # one ended
    assert not run.done
    run.resync = True
    again = run.absorb(out(4, "d"), 0.03, EVERY)  # the whole text of each, one reset
    assert [(d.index, d.text, d.token_ids, d.reset, d.whole) for d in again] == [
        (0, "bd", [2, 4], True, True),
        (1, "ac", [1, 3], False, False),
    ]
    head = progress.header("f" * 64)
    blob = head + b"".join(d.progress for d in again)
    got = progress.parse(blob, head, max_tokens=8, logprobs=False, n=2)
    assert got is not None and [c.token_ids for c in got] == [[2, 4], [1, 3]]
    assert progress.parse(blob, head, max_tokens=8, logprobs=False) is None  # indexed chunks
    last = run.absorb(out(5, "e", finished=True), 0.04, EVERY)
    assert run.done and [(d.index, d.text) for d in last] == [(0, "e")]
    fields = dict(zip(*[iter(run.result_fields("w", 1, "length", "", ""))] * 2, strict=True))
    assert (fields["text"], fields["output_tokens"]) == ("bde", 5)
    assert '"finish_reason":"length"' in fields["choices"]
