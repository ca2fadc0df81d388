"""How entries enter a worker's engine: a few per engine step, ranked by lane first and
the job's own priority second, several read in one call and begun in one pipeline."""

from __future__ import annotations

import threading
import time

from plurai.broker_config import keys, protocol
from plurai.broker_config.connection import connect
from plurai.broker_config.protocol import MAX_PRIORITY
from plurai.broker_config.settings import Settings
from plurai.gpu_workers.backend import AddRequest, StepOutput
from plurai.producer.client import Client
from plurai.results import records
from tests.helpers import driven_worker

from .recorder import Recorder, Waiting, token


def test_entries_enter_by_lane_then_priority_a_few_per_step(redis_url):
    settings = Settings(
        redis_url=redis_url, takes_per_step=3, fair_every=0, top_lane_reserve=0, top_lane_slowdown=0
    )
    engine = Recorder()
    w = driven_worker(redis_url, engine, "w1", settings=settings)
    with Client(redis_url) as client:
        batch = [client.submit("b", lane="batch", priority=-5).id for _ in range(4)]
        top = client.submit("i", lane="interactive", priority=7).id
        w.taker.fill()
        assert [rid for rid, _ in engine.added] == [top, *batch[:2]]  # 3, highest lane first
        ranks = dict(engine.added)
        assert ranks[top] == 7  # the top lane: the job's own priority
        assert ranks[batch[0]] == 2 * (2 * MAX_PRIORITY + 1) - 5  # two lanes down
        w.taker.fill()
        assert [rid for rid, _ in engine.added] == [top, *batch]
        assert client.job(top).status() == "running"


class Prefilling(Recorder):
    """Computes no prompt: every prompt added stays in its backlog."""

    def __init__(self, step_tokens: int = 512) -> None:
        super().__init__()
        self.prompt_backlog = 0
        self.step_tokens = step_tokens

    def add(self, req: AddRequest) -> list[str]:
        self.prompt_backlog += protocol.estimate_prompt_tokens({"prompt": req.prompt})
        return super().add(req)


def test_the_backlog_bound_splits_a_burst_between_workers(redis_url):
    """With an objective set, a worker takes only the prompts its engine's next step can
    start (its step budget, 100 tokens here): the rest of a burst stays in the queue for the
    next worker, not held by the first."""
    settings = Settings(redis_url=redis_url, takes_per_step=8, fair_every=0, top_lane_tpot_ms=50)
    engines = [Prefilling(step_tokens=100) for _ in range(3)]
    workers = [
        driven_worker(redis_url, e, f"w{i}", settings=settings) for i, e in enumerate(engines)
    ]
    with Client(redis_url) as client:
        ids = [client.submit("x" * 160, lane="standard").id for _ in range(5)]  # 40 tokens
        for w in workers:
            w.taker.fill()
            assert not w.held  # nothing taken that it could not start
        got = [[rid for rid, _ in e.added] for e in engines]
        assert got == [ids[:2], ids[2:4], [ids[4]]]  # 80 each; a third would pass 100
        big = client.submit("y" * 800, lane="standard").id  # 200: over the bound alone
        fresh = Prefilling(step_tokens=100)
        w = driven_worker(redis_url, fresh, "w3", settings=settings)
        w.taker.fill()
        assert [rid for rid, _ in fresh.added] == [big]  # a prompt alone always may
        assert client.job(big).status() == "running"


def test_under_an_objective_a_top_lane_entry_waits_only_behind_top_lane_prompts(redis_url):
    """With a top-lane objective set, the top lane too takes only what the next step can
    start. Lower-lane prompts that fill the bound hold back more lower-lane entries, not a
    top-lane arrival (the engine runs it ahead of them); top-lane prompts do hold it."""
    settings = Settings(
        redis_url=redis_url,
        takes_per_step=8,
        fair_every=0,
        top_lane_reserve=0,
        top_lane_tpot_ms=50,
    )
    engine = Prefilling(step_tokens=100)
    w = driven_worker(redis_url, engine, "w1", settings=settings)
    with Client(redis_url) as client:
        batch = [client.submit("x" * 320, lane="batch").id for _ in range(3)]  # 80 tokens
        w.taker.fill()
        assert [rid for rid, _ in engine.added] == batch[:1]  # a second would pass 100
        top = [client.submit("y" * 240, lane="interactive").id for _ in range(3)]  # 60
        w.taker.fill()
        # the first top-lane prompt beside the batch one; a second would pass 100 with it
        assert [rid for rid, _ in engine.added] == [batch[0], top[0]]
        assert client.job(batch[1]).status() == "queued"
        assert client.job(top[1]).status() == "queued"


def test_an_entry_arriving_mid_step_is_taken_at_the_next_step(redis_url):
    """A busy worker hears of a new entry while its engine steps (the submit announces it):
    the step's wait for outputs ends and the entry, of a lane below the top one, is read at
    once; neither the step's wait nor poll_ms (a minute here) is waited out."""
    settings = Settings(redis_url=redis_url, poll_ms=60_000)
    engine = Waiting()
    w = driven_worker(redis_url, engine, "w1", settings=settings)
    stop = threading.Event()

    def turns() -> None:
        while not stop.is_set():
            w.iterate()

    thread = threading.Thread(target=turns, daemon=True)
    with Client(redis_url) as client:
        first = client.submit("a", lane="standard").id
        thread.start()
        try:
            deadline = time.monotonic() + 30
            while len(engine.added) < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert [rid for rid, _ in engine.added] == [first]  # a blocking read: idle
            time.sleep(0.3)  # the worker is in its engine's step now, waiting for outputs
            second = client.submit("b", lane="standard").id
            while len(engine.added) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert [rid for rid, _ in engine.added] == [first, second]
            assert engine.waits_ended == 0
        finally:
            stop.set()
            engine.wake()
            thread.join(10)
        w.intake.close()


def test_the_defaults_hold_no_top_lane_request_the_engine_could_start(redis_url):
    """With no objective set, a top-lane entry the engine has room for (sequence slots, KV)
    is taken at once, past the engine's step budget (its scheduler chunks the prompts), however
    slow the top lane's tokens and however much lower-lane work runs; only the lanes below
    wait. Lower-lane entries are not taken beyond what may start: the rest stay queued for
    another worker."""
    settings = Settings(redis_url=redis_url, takes_per_step=8)
    engine = Prefilling(step_tokens=512)
    w = driven_worker(redis_url, engine, "w1", settings=settings)
    now = time.monotonic()
    w.admission.pace.tokens(0.01, 10, now - 2)  # unloaded: 1 ms a token
    w.admission.pace.tokens(0.5, 10, now)  # now: 50x slower
    with Client(redis_url) as client:
        batch = client.submit("x" * 1600, lane="batch").id  # 400 prompt tokens
        w.taker.fill()
        top = [client.submit("y" * 1600, lane="interactive").id for _ in range(6)]
        lower = [client.submit("z", lane="standard").id for _ in range(3)]
        w.taker.fill()
        # 400 + 6 x 400 tokens, past the step's 512: the engine has room for them all
        assert [rid for rid, _ in engine.added] == [batch, *top]
        assert not w.held  # no lower-lane entry taken that may not start
        for job in lower:
            assert client.job(job).status() == "queued"  # a top-lane prompt is not computed
        engine.prompt_backlog = 0  # the prompts computed
        late = client.submit("y" * 1600, lane="interactive").id
        w.taker.fill()
        assert [rid for rid, _ in engine.added][7:] == [late]
        assert client.job(lower[0]).status() == "queued"  # until a top-lane token comes
        engine.can_admit = lambda *_a: False  # type: ignore[method-assign]  # the engine full
        full = client.submit("y", lane="interactive").id
        w.taker.fill()
        assert client.job(full).status() == "queued"  # left for a worker with room


def test_lower_lanes_are_bounded_only_while_the_top_lane_runs(redis_url):
    """With the defaults lower-lane requests are taken as the engine has room for them, past
    its step budget (512 tokens here); while top-lane jobs ran on the worker within the last
    10 s, their prompts not computed yet are bounded by prefill_backlog_tokens (512), so
    that the steps the top lane waits for stay short, and the rest stays queued."""
    settings = Settings(redis_url=redis_url, takes_per_step=8, fair_every=0)
    for top_ran, taken in ((False, 3), (True, 1)):
        engine = Prefilling(step_tokens=512)
        w = driven_worker(redis_url, engine, f"w{top_ran}", settings=settings)
        if top_ran:
            w.admission.pace.seen(time.monotonic())
        with Client(redis_url) as client:
            batch = [client.submit("x" * 1200, lane="batch").id for _ in range(3)]  # 300 each
            w.taker.fill()
            w.taker.fill()
            assert [rid for rid, _ in engine.added] == batch[:taken]
            for job in batch[taken:]:  # left for another worker
                assert client.job(job).status() == "queued"
        w.intake.close()
        w.r.delete(*w.intake.streams())


class Filling(Recorder):
    """An engine with room for `free` tokens of prompt and output (KV)."""

    def __init__(self, free: int) -> None:
        super().__init__()
        self.free = free

    def can_admit(self, prompt: int, output: int, *_a: object) -> bool:
        return prompt + output <= self.free

    def add(self, req: AddRequest) -> list[str]:
        self.free -= protocol.estimate_prompt_tokens({"prompt": req.prompt}) + 16
        return super().add(req)


def test_with_no_bound_a_worker_reads_no_more_than_its_engine_can_start(redis_url):
    """With the defaults (no bound on the backlog), a busy worker asks the queue for only as
    many entries as its engine has room for, by the recent mean size: an entry it read and
    could not start would wait in this worker while another one might start it."""
    settings = Settings(redis_url=redis_url, takes_per_step=8, fair_every=0)
    engine = Filling(free=10_000)
    w = driven_worker(redis_url, engine, "w1", settings=settings)
    with Client(redis_url) as client:
        first = client.submit("x" * 400, lane="standard", max_tokens=16).id  # 100 + 16
        w.taker.fill()
        assert [rid for rid, _ in engine.added] == [first]
        engine.free = 2 * 116 + 50  # room for two more of that size
        rest = [client.submit("x" * 400, lane="standard", max_tokens=16).id for _ in range(5)]
        w.taker.fill()
        assert [rid for rid, _ in engine.added] == [first, *rest[:2]]
        assert not w.held  # nothing read that could not start
        for job in rest[2:]:
            assert client.job(job).status() == "queued"  # left for a worker with room


def test_default_takes_scale_with_the_engine(redis_url):
    engine = Recorder()
    engine.max_num_seqs = 128
    w = driven_worker(redis_url, engine, "w1")
    with Client(redis_url) as client:
        client.submit_many([{"prompt": "x", "lane": "interactive"} for _ in range(10)])
        w.taker.fill()
        assert len(engine.added) == 8  # 128 slots / 16


def test_several_entries_a_take_keep_the_fair_turns(redis_url):
    """Entries read several at once still give every fair_every-th one to a lower lane (the
    lower lanes' yielding to the top lane, off here, is tested on its own)."""
    settings = Settings(
        redis_url=redis_url, takes_per_step=8, fair_every=4, top_lane_reserve=0, top_lane_slowdown=0
    )
    engine = Recorder()
    engine.added.append(("busy", 0))  # a running engine: no blocking read
    w = driven_worker(redis_url, engine, "w1", settings=settings)
    with Client(redis_url) as client:
        top = [client.submit("i", lane="interactive").id for _ in range(10)]
        low = [client.submit("b", lane="batch").id for _ in range(10)]
        w.taker.fill()
    got = [rid for rid, _ in engine.added[1:]]
    assert got == [*top[:3], low[0], *top[3:6], low[1]]
    assert set(w.running) == set(got)


def test_one_batch_of_begins_answers_each_job(redis_url):
    """A turn's jobs are begun together; each gets its own answer: run, cancelled while
    queued, past its deadline, refused by the engine (which no longer holds the ones that
    do not run)."""
    r = connect(redis_url)
    settings = Settings(redis_url=redis_url, takes_per_step=8, fair_every=0)
    engine = Recorder()
    w = driven_worker(redis_url, engine, "w1", settings=settings)
    with Client(redis_url) as client:
        runs = client.submit("fine", lane="interactive")
        cancelled = client.submit("cancel me", lane="interactive")
        assert cancelled.cancel() == "cancelled"
        late = client.submit("late", lane="interactive", deadline=time.time() - 1)
        refused = client.submit("refuse me", lane="interactive")
        w.taker.fill()
        w.writer.settle()
        assert list(w.running) == [runs.id] and runs.status() == "running"
        assert [rid for rid, _ in engine.added] == [runs.id, cancelled.id, late.id]
        assert engine.aborted == [cancelled.id, late.id]
        states = {j.id: j.record() for j in (cancelled, late, refused)}
        assert states[cancelled.id].state == records.CANCELLED
        assert (states[late.id].state, states[late.id].error_code) == (
            records.FAILED,
            "deadline_exceeded",
        )
        assert (states[refused.id].state, states[refused.id].error_code) == (
            records.FAILED,
            "invalid_params",
        )
    # every entry but the running job's is acknowledged and deleted
    assert r.xlen(keys.request_stream("interactive")) == 1


def test_the_pace_counts_one_interval_for_a_jobs_outputs_of_one_step(redis_url):
    """A backend may give several outputs of one job in one step (the vLLM backend collects
    every engine step since its last call): they are one interval for the top lane's pace,
    not several of no length, which would take its unloaded time to zero."""
    settings = Settings(redis_url=redis_url, top_lane_reserve=0)
    engine = Recorder()
    w = driven_worker(redis_url, engine, "w1", settings=settings)
    with Client(redis_url) as client:
        job = client.submit("i", lane="interactive").id
        w.taker.fill()
        start = time.monotonic()
        w.publisher.step([token(job, 1)])
        time.sleep(0.06)
        w.publisher.step([token(job, 2), token(job, 3), token(job, 4)])
        took = time.monotonic() - start  # 60 ms, or more on a loaded machine
        assert 0.06 / 3 <= w.admission.pace.tpot_s <= took / 3  # that interval over three tokens
        assert w.admission.pace.unloaded_s == 0.0  # three tokens are too few to learn it by


def test_no_lower_lane_prompt_joins_a_top_lane_prompt_not_computed_yet(redis_url):
    """The engine would compute both in one step and the interactive job's first token
    would wait for the batch prompt too: lower lanes wait until the top-lane prompts have
    their first token."""
    settings = Settings(redis_url=redis_url, takes_per_step=8, fair_every=0, top_lane_reserve=0)
    engine = Recorder()
    w = driven_worker(redis_url, engine, "w1", settings=settings)
    with Client(redis_url) as client:
        top = client.submit("i", lane="interactive").id
        low = [client.submit("b", lane="batch").id for _ in range(3)]
        w.taker.fill()
        assert [rid for rid, _ in engine.added] == [top]
        w.taker.fill()
        assert [rid for rid, _ in engine.added] == [top]  # still no first token
        w.publisher.step([StepOutput(job, [5], "a", False, None, 1, 5, 0) for job in [top]])
        w.taker.fill()
        assert [rid for rid, _ in engine.added] == [top, *low]


class Full(Recorder):
    """Has room for top-priority requests only: lower ones do not fit now."""

    def can_admit(
        self, _prompt: int, _max_tokens: int, priority: int | None = None, spare: int = 0
    ) -> bool:
        return priority is not None


def test_a_top_lane_arrival_passes_lower_lane_entries_that_do_not_fit(redis_url):
    """A worker holding a lower-lane entry that does not fit (its KV cache is full) still
    reads the top lane at each turn: the arrival starts at once, the held entry waits."""
    settings = Settings(redis_url=redis_url, takes_per_step=4, fair_every=0, preempt=True)
    engine = Full()
    engine.added.append(("busy", 0))  # the engine runs something
    w = driven_worker(redis_url, engine, "w1", settings=settings)
    with Client(redis_url) as client:
        held = client.submit("b", lane="batch").id
        w.taker.fill()
        assert [e.job_id for e in w.held] == [held]
        top = client.submit("i", lane="interactive").id
        w.taker.fill()
        assert [rid for rid, _ in engine.added] == ["busy", top]
        assert [e.job_id for e in w.held] == [held]


class Sizes(Recorder):
    """Has room for anything, and records the room each admission asked to keep."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[tuple[int | None, int]] = []

    def can_admit(
        self, _prompt: int, _max_tokens: int, priority: int | None = None, spare: int = 0
    ) -> bool:
        self.asked.append((priority, spare))
        return True


def test_lower_lanes_leave_kv_for_the_top_lanes_reserve(redis_url):
    """Lower-lane entries are admitted only with the KV of top_lane_reserve top-lane
    requests (their recent prompt plus max_tokens) left free, once the top lane runs here:
    vLLM never preempts to admit a waiting request, so a cache full of batch work would
    keep an interactive arrival waiting for it."""
    settings = Settings(
        redis_url=redis_url, takes_per_step=1, fair_every=0, top_lane_reserve=3, preempt=False
    )
    engine = Sizes()
    engine.added.append(("busy", 0))  # the engine runs something: admissions are checked
    w = driven_worker(redis_url, engine, "w1", settings=settings)
    with Client(redis_url) as client:
        client.submit("b", lane="batch", max_tokens=10)
        w.taker.fill()
        assert engine.asked[-1] == (None, 0)  # no top-lane job seen: nothing kept back
        top = client.submit(token_ids=[5] * 30, lane="interactive", max_tokens=70).id
        w.taker.fill()
        assert engine.asked[-1] == (None, 0)  # the top lane's own entry keeps nothing
        w.publisher.step([token(top, 1)])  # its prompt is computed: lower lanes may go on
        client.submit("b", lane="batch", max_tokens=10)
        w.taker.fill()
        assert engine.asked[-1] == (None, 3 * 100)


def test_a_prompt_backlog_over_the_lower_lanes_bound_still_takes_the_top_lane(redis_url):
    """While the top lane runs on a worker, its engine's prompts not computed yet may exceed
    the lower lanes' bound (prefill_backlog_tokens, 512): a top-lane entry is taken all the
    same (no bound with the defaults), and the lower lanes' wait."""
    settings = Settings(redis_url=redis_url, fair_every=0)
    engine = Prefilling(step_tokens=512)
    w = driven_worker(redis_url, engine, "w1", settings=settings)
    w.admission.pace.seen(time.monotonic())  # the top lane ran here just now
    with Client(redis_url) as client:
        first = [client.submit("y" * 2400, lane="interactive").id for _ in range(2)]
        w.taker.fill()
        assert [rid for rid, _ in engine.added] == first
        assert engine.prompt_backlog > 512  # over the lower lanes' bound
        lower = client.submit("z", lane="standard").id
        top = client.submit("y", lane="interactive").id
        w.taker.fill()
        assert [rid for rid, _ in engine.added][2:] == [top]
        assert client.job(lower).status() == "queued"
    w.intake.close()
