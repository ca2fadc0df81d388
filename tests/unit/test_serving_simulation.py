"""The fleet policy simulation (bench/serving/simulation.py): engines, routers, pulling
and the engines' speed noise. Its calibration against measured runs (loading a folder,
the replay, the check, the fit): tests/unit/test_serving_calibration.py.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest

from bench.serving import simulation as ps

K = ps.Constants(
    a_s=0.01,
    b_s=0.001,
    c_s=0.002,
    d_s=0.0,
    router_front_s=0.05,
    queue_front_s=0.2,
    pool_block_s=0.001,
)


def req(
    i: int, t: float = 0.0, prompt: int = 100, out: int = 4, lane: str = "interactive", blocks=()
):
    blocks = tuple(blocks) or tuple(1000 * (i + 1) + j for j in range(prompt // ps.BLOCK))
    return ps.Req(f"r{i}", t, lane, prompt, out, out, blocks, ps.LANES.index(lane))


class Checked(ps.Sim):
    """Fails the moment an entry waits while some engine is idle with nothing assigned."""

    def check(self) -> None:
        if any(self.lanes):
            idle = [e.i for e in self.engines if not e.busy and e.outstanding == 0]
            assert not idle, f"engines {idle} idle with {sum(map(len, self.lanes))} queued"

    def arrive(self, reqs, now):
        super().arrive(reqs, now)
        self.check()

    def step_end(self, e, step, now):
        super().step_end(e, step, now)
        self.check()


def test_seeded_runs_are_reproducible() -> None:
    a = ps.generate(ps.Shape(groups=8, open_sessions=8), 20.0, 10.0, seed=3)
    b = ps.generate(ps.Shape(groups=8, open_sessions=8), 20.0, 10.0, seed=3)
    assert a == b and len(a) > 100
    assert a != ps.generate(ps.Shape(groups=8, open_sessions=8), 20.0, 10.0, seed=4)
    for policy in ps.POLICIES:
        x = [(r.engine, r.first_s, r.end_s) for r in ps.simulate(a, 4, policy, K, seed=1)]
        y = [(r.engine, r.first_s, r.end_s) for r in ps.simulate(a, 4, policy, K, seed=1)]
        assert x == y and all(e is not None for _, _, e in x)


@pytest.mark.parametrize("policy", ps.POLICIES)
def test_one_request_on_one_engine(policy: str) -> None:
    (r,) = ps.simulate([req(0, t=1.0, prompt=300, out=5)], 1, policy, K)
    front = K.queue_front_s if policy == "pull" else K.router_front_s
    assert r.first_s - r.arrival_s == pytest.approx(front + K.a_s + K.b_s * 300)
    # then 4 decode steps of one sequence
    assert r.end_s - r.first_s == pytest.approx(4 * (K.a_s + K.c_s))
    assert r.device == r.pool == 0


def test_round_robin_alternates() -> None:
    done = ps.simulate([req(i, t=i * 0.001) for i in range(6)], 2, "round_robin", K)
    assert [r.engine for r in done] == [0, 1, 0, 1, 0, 1]


def test_power_of_two_picks_the_less_loaded() -> None:
    long = req(0, prompt=100, out=500)
    done = ps.simulate([long] + [req(i, t=0.5 * i) for i in range(1, 6)], 2, "power_of_two", K)
    # the long one is still running: every later request goes to the other engine
    assert {r.engine for r in done[1:]} == {1 - done[0].engine}


def test_cache_aware_follows_the_prefix() -> None:
    a = [1, 2, 3, 4, 5]
    b = [11, 12, 13, 14, 15]
    reqs = [
        req(0, 0.0, prompt=96, blocks=a + [6]),
        req(1, 0.01, prompt=96, blocks=b + [16]),
        req(2, 1.0, prompt=96, blocks=b + [17]),
        req(3, 1.01, prompt=96, blocks=a + [7]),
        req(4, 1.02, prompt=96, blocks=a + [8]),
    ]
    done = ps.simulate(reqs, 2, "cache_aware", K)
    assert done[0].engine != done[1].engine
    assert done[2].engine == done[1].engine and done[2].device == 5 * ps.BLOCK
    assert done[3].engine == done[4].engine == done[0].engine
    # the other routers do not look: round robin sends r2 to engine 0, which lacks b
    rr = ps.simulate(reqs, 2, "round_robin", K)
    assert rr[2].engine == 0 and rr[2].device == 0


def test_pulling_leaves_no_entry_queued_beside_an_idle_engine() -> None:
    reqs = ps.generate(ps.Shape(groups=4, open_sessions=4), 40.0, 8.0, seed=1)
    for budget in (64, 512, 2048):
        sim = Checked(4, "pull", K, pull_budget=budget)
        done = sim.run([copy.copy(r) for r in reqs])
        assert all(r.end_s is not None for r in done)
        assert not any(sim.lanes)


def test_pulling_serves_the_interactive_lane_first() -> None:
    first = req(0, 0.0, prompt=400, out=20)
    late_batch = req(1, 0.001, prompt=400, out=4, lane="batch")
    late_chat = req(2, 0.002, prompt=400, out=4)
    done = ps.simulate([first, late_batch, late_chat], 1, "pull", K, pull_budget=256)
    # the batch entry waits behind the first prompt; the interactive one, later, does not
    assert done[2].first_s < done[1].first_s


def test_no_batch_prompt_joins_the_step_of_an_interactive_one() -> None:
    """An engine pulls no lower-lane entry while a top-lane prompt it holds has no token:
    the interactive first token comes as soon as with no batch work queued at all."""
    running = req(0, 0.0, prompt=64, out=200, lane="batch")  # decoding when they come
    chat, batch = req(1, 0.5, prompt=400), req(2, 0.5, prompt=800, lane="batch")
    alone = ps.simulate([copy.copy(running), copy.copy(chat)], 1, "pull", K, pull_budget=2048)
    both = ps.simulate([running, chat, batch], 1, "pull", K, pull_budget=2048)
    assert both[1].first_s == pytest.approx(alone[1].first_s)
    assert both[2].end_s is not None


def test_over_the_top_lane_target_new_work_waits_the_bound_at_most() -> None:
    """While its top-lane tokens come slower than the target, an engine takes nothing new
    (the batch entry waits for the running chat to end), except a top-lane entry that has
    waited the bound; with no target both start at once."""
    running = req(0, 0.0, prompt=64, out=200)  # steps of 12 ms: over a 5 ms target
    chat, batch = req(1, 0.5, prompt=64), req(2, 0.5, prompt=64, lane="batch")

    def run(**kw):
        reqs = [copy.copy(r) for r in (running, chat, batch)]
        return ps.simulate(reqs, 1, "pull", K, pull_budget=2048, **kw)

    free = run()
    assert free[1].first_s < 0.5 + 0.1 + K.queue_front_s
    assert free[2].first_s < 0.5 + 0.3 + K.queue_front_s  # once the chat's prompt is done
    held = run(tpot_target_s=0.005, wait_s=0.0)  # no bound: both wait for the chat's end
    assert held[1].first_s > held[0].end_s and held[2].first_s > held[0].end_s
    bound = run(tpot_target_s=0.005, wait_s=0.3)
    assert 0.5 + 0.3 + K.queue_front_s <= bound[1].first_s < 0.5 + 0.5 + K.queue_front_s
    assert bound[1].first_s < bound[0].end_s
    assert bound[2].first_s > bound[0].end_s  # a lower lane has no bound


def test_over_the_target_with_batch_running_a_chat_arrival_starts_at_once() -> None:
    """While lower-lane requests run on a slow engine, they slow the top lane too: its
    arrivals start at once (gpu_workers/take.py), a new lower-lane entry waits."""
    chat_running = req(0, 0.0, prompt=64, out=200)  # steps of 12 ms: over a 5 ms target
    batch_running = req(1, 0.0, prompt=64, out=200, lane="batch")
    chat, batch = req(2, 0.5, prompt=64), req(3, 0.5, prompt=64, lane="batch")
    reqs = [chat_running, batch_running, chat, batch]
    done = ps.simulate(reqs, 1, "pull", K, pull_budget=2048, tpot_target_s=0.005, wait_s=0.3)
    assert done[2].first_s < 0.5 + 0.1 + K.queue_front_s  # not held for the 0.3 s bound
    assert done[3].first_s > min(done[0].end_s, done[1].end_s)


def test_every_eighth_take_starts_at_the_batch_lane() -> None:
    """The worker's fair turn: with chats queued ahead of it, a batch entry is still the
    8th entry an engine takes (once the chats' prompts have their first tokens)."""
    chats = [req(i, 0.0) for i in range(10)]
    batch = req(10, 0.0, lane="batch")
    done = ps.simulate([*chats, batch], 1, "pull", K, pull_budget=0)
    firsts = sorted(r.first_s for r in done[:10])
    assert firsts[6] < done[10].first_s <= firsts[7]  # taken with the 8th-10th chats


def test_in_a_hold_the_batch_lane_keeps_its_fair_turn() -> None:
    """Over the top lane's target, chats are taken one a poll once they waited the bound;
    after 7 of them the next take is the batch entry, long before the hold would end."""
    running = req(0, 0.0, prompt=64, out=400)  # steps of 12 ms and more: over a 5 ms target
    chats = [req(i, 0.5, prompt=64, out=400) for i in range(1, 11)]
    batch = req(11, 0.5, prompt=64, lane="batch")
    done = ps.simulate(
        [running, *chats, batch], 1, "pull", K, pull_budget=2048, tpot_target_s=0.005, wait_s=0.01
    )
    firsts = sorted(r.first_s for r in done[1:11])
    assert firsts[6] < done[11].first_s < firsts[7]
    assert done[11].end_s < done[0].end_s


def test_an_objective_splits_a_burst_across_idle_engines() -> None:
    """With no objective an idle engine takes a burst it has room for, as the worker does
    (up to its takes a step); with one, the top lane keeps to the step budget (2,048 tokens
    of prompts not computed yet), so the rest of the burst goes to the other engines."""
    burst = [req(i, 0.0, prompt=1500) for i in range(4)]
    spread = ps.simulate(burst, 4, "pull", K, tpot_target_s=10.0)
    assert sorted(r.engine for r in spread) == [0, 1, 2, 3]
    lumped = ps.simulate(burst, 4, "pull", K)
    assert {r.engine for r in lumped} == {0}
    assert max(r.first_s for r in spread) < max(r.first_s for r in lumped)


def test_pull_counts_device_and_pool_hits() -> None:
    shared = list(range(1, 9))  # 8 blocks of a system prompt
    reqs = [req(i, 0.5 * i, prompt=160, blocks=shared + [100 + i, 200 + i]) for i in range(3)]
    done = ps.simulate(reqs, 2, "pull", K, pull_budget=2048)
    # r0 computes it; r1 pulled by the other engine copies it from the pool; r2 finds it
    # on the device of whichever engine pulls it
    assert (done[0].device, done[0].pool) == (0, 0)
    assert done[1].engine != done[0].engine and done[1].pool == 8 * ps.BLOCK
    assert done[2].device == 8 * ps.BLOCK and done[2].pool == 0
    assert ps.prefill(done)["computed_tokens"] == 3 * 160 - 16 * 16


def test_lookahead_takes_the_entry_held_on_device() -> None:
    a, b = list(range(1, 9)), list(range(11, 19))
    reqs = [  # with an objective, a 1,600-token prompt leaves no room for a second
        req(0, 0.0, prompt=1600, out=40, blocks=a + [100, 101]),
        req(1, 0.01, prompt=1600, out=40, blocks=b + [102, 103]),
        req(2, 0.02, prompt=1600, blocks=b + [104, 105]),  # queued while both are busy
        req(3, 0.03, prompt=1600, blocks=a + [106, 107]),
    ]
    slo = {"tpot_target_s": 10.0, "pool_blocks": 0}
    plain = ps.simulate(reqs, 2, "pull", K, **slo)
    ahead = ps.simulate(reqs, 2, "pull", K, lookahead=2, **slo)
    assert plain[3].engine != plain[0].engine and plain[3].device == 0
    assert ahead[3].engine == ahead[0].engine and ahead[3].device == 8 * ps.BLOCK
    assert ahead[2].engine == ahead[1].engine and ahead[2].device == 8 * ps.BLOCK


def test_prefix_identity_from_messages() -> None:
    sys_a = {"role": "system", "content": "You are assistant 0. " + "lorem ipsum " * 40}
    sys_b = {"role": "system", "content": "You are assistant 1. " + "lorem ipsum " * 40}

    def row(i: int, msgs: list[dict], n: int) -> dict:
        return {
            "id": f"r{i}",
            "arrival_s": i,
            "lane": "interactive",
            "messages": msgs,
            "max_tokens": 8,
            "prompt_tokens": n,
        }

    ask = {"role": "user", "content": "tell me more " * 10}
    rows = [
        row(0, [sys_a, {"role": "user", "content": "hello " * 20}], 160),
        row(1, [sys_a, ask], 170),
        row(2, [sys_b, ask], 170),
        row(3, [sys_a, ask, {"role": "assistant", "content": "sure " * 10}, ask], 230),
    ]
    r0, r1, r2, r3 = ps.from_messages(rows)
    shared = sum(x == y for x, y in zip(r0.blocks, r1.blocks, strict=False))
    assert 3 <= shared < len(r0.blocks) and r0.blocks[:shared] == r1.blocks[:shared]
    assert r2.blocks[0] != r1.blocks[0]  # another system prompt from the first block on
    assert r3.blocks[: len(r1.blocks) - 1] == r1.blocks[:-1]  # a later turn extends the first


def test_engine_speed_noise_holds_over_a_stretch_and_averages_to_one() -> None:
    reqs = [req(i, t=2.0 * i, prompt=300, out=2) for i in range(200)]  # each runs alone
    base = K.a_s + K.b_s * 300

    def prefill_s(k: ps.Constants) -> list[float]:
        return [
            r.first_s - r.arrival_s - k.router_front_s
            for r in ps.simulate(reqs, 1, "round_robin", k)
        ]

    assert prefill_s(K) == pytest.approx([base] * 200)
    held = prefill_s(replace(K, noise_sd=0.5, noise_s=1e6))  # one draw for the whole run
    assert held == pytest.approx([held[0]] * 200) and held[0] != pytest.approx(base)
    drawn = prefill_s(replace(K, noise_sd=0.5, noise_s=1e-6))  # a new factor every step
    assert len({round(x, 9) for x in drawn}) > 150
    assert sum(drawn) / len(drawn) == pytest.approx(base, rel=0.1)  # the factor's mean is 1


def test_engines_of_one_machine_share_its_speed() -> None:
    reqs = [req(i, t=2.0 * i, prompt=300, out=2) for i in range(40)]  # each runs alone
    k = replace(K, noise_sd=0.5, noise_s=1e6)  # one draw per machine for the whole run

    def prefill_s(machine: int) -> set[float]:
        done = ps.simulate(reqs, 2, "round_robin", k, machine=machine)
        return {round(r.first_s - r.arrival_s, 9) for r in done}

    assert len(prefill_s(machine=2)) == 1  # both engines on one machine: one speed
    assert len(prefill_s(machine=1)) == 2  # a machine each: two
