"""The fleet policy simulation: engines, routers, pulling and the calibration check.

One file, though long: the simulation is one module (bench/serving/simulation.py),
tested in one place.
"""

from __future__ import annotations

import copy
import json
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


def write_folder(
    path, runs: dict[str, list[float]], budget: int | None = None, delay: float = 0.0
) -> None:
    """A bench/serving/ folder: run -> arrival times, one round_robin and one plurai-vllm
    stack; every result sent `delay` after its arrival, with no times measured yet."""
    path.mkdir()
    figures = {}
    for j, (run, times) in enumerate(runs.items()):
        rows = [
            {
                "id": f"r{i}",
                "arrival_s": t,
                "lane": "interactive",
                "max_tokens": 8,
                "prompt_tokens": 200,
                "messages": [{"role": "user", "content": f"q{j}/{i} " * 50}],
            }
            for i, t in enumerate(times)
        ]
        (path / ps.workload_file(run)).write_text("".join(json.dumps(r) + "\n" for r in rows))
        res = [
            {
                "id": r["id"],
                "lane": "interactive",
                "sent_s": r["arrival_s"] + delay,
                "first_token_s": r["arrival_s"] + delay + 1.0,
                "end_s": r["arrival_s"] + delay + 2.0,
                "output_tokens": 8,
                "ok": True,
                "prompt_tokens": 200,
                "cached_tokens": 0,
            }
            for r in rows
        ]
        for stack in ("round_robin", "plurai-vllm"):
            (path / stack).mkdir(exist_ok=True)
            text = "".join(json.dumps(r) + "\n" for r in res)
            (path / stack / f"{run}.results.jsonl").write_text(text)
        figures[run] = {
            "offered_req_s": float(run.split("@")[1].split("#")[0]) if "@" in run else 1.0 + j,
            "interactive": {"ttft_p50_ms": 1000.0, "ttft_p99_ms": 1000.0},
        }
    out = {
        "k": 2,
        "capacity_req_s": 2.0,
        "slos": {
            "interactive": {"ttft_s": 10.0, "tpot_s": 10.0, "e2e_s": None},
            "batch": {"ttft_s": None, "tpot_s": None, "e2e_s": 30.0},
        },
        "stacks": {
            s: {"goodput_req_s": 1.0, "runs": copy.deepcopy(figures)}
            for s in ("round_robin", "plurai-vllm")
        },
    }
    if budget is not None:
        out["plurai_prefill_backlog_tokens"] = budget
    (path / "out.json").write_text("progress\n" + json.dumps(out) + "\n")


def test_load_finds_the_sweeps_the_flood_and_the_pull_budget(tmp_path) -> None:
    write_folder(tmp_path / "a", {"sweep@1.5": [0.0, 1.0], "flood": [0.0], "sweep@0.5": [0.0]})
    m = ps.load(tmp_path / "a", budget=2048)
    assert m.runs == ["sweep@0.5", "sweep@1.5", "flood"] and m.sweeps == m.runs[:2]
    assert m.budget == 2048  # out.json does not name one: the caller's
    assert len(m.requests("plurai-vllm", "flood")) == 1
    write_folder(tmp_path / "b", {"sweep@1.0": [0.0]}, budget=256)
    assert ps.load(tmp_path / "b", budget=2048).budget == 256
    # the top-lane target and its wait bound: per Plurai stack, or one number (older runs)
    for name, wait in (("d", {"plurai-vllm": 105}), ("e", 500)):
        write_folder(tmp_path / name, {"sweep@1.0": [0.0]})
        out = json.loads((tmp_path / name / "out.json").read_text().splitlines()[1])
        out["plurai_top_lane_tpot_ms"] = {"plurai-vllm": 24}
        out["plurai_top_lane_wait_ms"] = wait
        (tmp_path / name / "out.json").write_text(json.dumps(out) + "\n")
    assert ps.load(tmp_path / "d").target_s == pytest.approx(0.024)
    assert ps.load(tmp_path / "d").wait_s == pytest.approx(0.105)
    assert ps.load(tmp_path / "e").wait_s == pytest.approx(0.5)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "out.json").write_text("")
    with pytest.raises(ValueError, match="has not finished"):
        ps.load(tmp_path / "c")


def test_replay_arrives_when_the_request_was_really_sent() -> None:
    rows = [
        {
            "id": f"r{i}",
            "arrival_s": 1.0 * i,
            "lane": "interactive",
            "max_tokens": 4,
            "prompt_tokens": 100,
            "messages": [{"role": "user", "content": f"q{i} " * 30}],
        }
        for i in range(3)
    ]
    sent = {"r0": {"sent_s": 0.0}, "r1": {"sent_s": 1.4}}  # r1 went 0.4 s late; r2 has none
    reqs = ps.from_messages(rows, sent)
    assert [r.arrival_s for r in reqs] == [0.0, 1.4, 2.0]
    # r0 runs 1 s (prefill then 3 decodes); r1 sent at 1.4 s finds the engine idle
    k = replace(K, a_s=0.1, b_s=0.005, c_s=0.1, router_front_s=0.0)
    done = ps.simulate(reqs, 1, "round_robin", k)
    assert done[1].first_s - done[1].arrival_s == pytest.approx(0.1 + 0.005 * 100)
    early = ps.simulate(ps.from_messages(rows), 1, "round_robin", k)
    assert early[1].first_s - early[1].arrival_s > done[1].first_s - done[1].arrival_s


def measure(m: ps.Measured, stack: str, run: str, factor: float = 1.0) -> None:
    """The stack's results of the run as the simulation gives them, TTFTs times `factor`."""
    sim = {r.id: r for r in ps._replay(m, stack, run, K, ps.STACK_POLICY[stack])}
    for row in m.results[stack][run]:
        r = sim[row["id"]]
        row["first_token_s"] = row["sent_s"] + factor * (r.first_s - r.arrival_s)
        row["end_s"] = row["first_token_s"] + (r.end_s - r.first_s)


def test_check_flags_errors_over_20_percent(tmp_path) -> None:
    assert ps.within(1.19, 1.0)["ok"] and ps.within(0.81, 1.0)["ok"]
    assert not ps.within(1.21, 1.0)["ok"] and not ps.within(0.79, 1.0)["ok"]
    assert ps.within(None, None)["ok"] and not ps.within(1.0, None)["ok"]

    runs = {"sweep@0.4": [0.3 * i for i in range(10)], "sweep@1.0": [0.1 * i for i in range(10)]}
    runs["sweep@1.0#1"] = [0.1 * i + 0.05 for i in range(10)]  # a repeat: pooled with its load
    runs["flood"] = [0.0] * 6
    write_folder(tmp_path / "f", runs)
    m = ps.load(tmp_path / "f")
    for run in m.runs:
        measure(m, "round_robin", run)
    figures = m.out["stacks"]["round_robin"]
    figures["goodput_req_s"] = 1.0  # both loads meet the SLOs: the highest rate
    good = ps.check(m, K)["round_robin"]
    assert good["ok"] and good["errors"] == [] and good["checked"] == 4
    assert set(good) >= {"interactive_ttft_p99_s@sweep@1.0", "interactive_ttft_p99_s@flood"}
    measure(m, "round_robin", "flood", 1 / 1.3)
    figures["goodput_req_s"] = 0.4
    bad = ps.check(m, K)
    assert not bad["round_robin"]["ok"]
    assert bad["round_robin"]["interactive_ttft_p99_s@flood"]["ratio"] == pytest.approx(1.3, 0.01)
    assert len(bad["round_robin"]["errors"]) == 2
    summary = ps.check_summary(bad)
    assert summary["per_stack"]["round_robin"] == "2/4" and not summary["ok"]
    # one repeat of a load off by 1.5x moves the load's pooled p99, not a figure of its own
    measure(m, "round_robin", "sweep@1.0#1", 1.5)
    again = ps.check(m, K)
    pooled = again["round_robin"]["interactive_ttft_p99_s@sweep@1.0"]
    assert pooled["measured"] > good["interactive_ttft_p99_s@sweep@1.0"]["measured"]
    # beside it, each repeat's own p99: the measurement's reproducibility, counted apart
    first, second = pooled["repeats"]
    assert second / first == pytest.approx(1.5, 0.01)
    assert good["interactive_ttft_p99_s@sweep@1.0"]["repeats"][0] == first
    assert ps.repeats_agree({"round_robin": good}) == (1, 1)
    assert ps.repeats_agree({"round_robin": again["round_robin"]}) == (0, 1)
    # plurai-vllm's repeats were left as written: the same figures, which agree
    assert ps.check_summary(again)["repeats_within"] == "1/2"


def test_calibrates_on_one_folder_and_checks_on_others(tmp_path, monkeypatch, capsys) -> None:
    write_folder(tmp_path / "a", {"sweep@0.5": [0.5 * i for i in range(8)]})
    write_folder(tmp_path / "b", {"sweep@1.0": [0.2 * i for i in range(8)]}, budget=256)
    argv = ["simulation.py", "--calibrate-from", str(tmp_path / "a")]
    argv += ["--check-against", f"{tmp_path / 'a'},{tmp_path / 'b'}", "--check-budget", "2048"]
    argv += ["--sizes", "2", "--scales", "0.5,1.5", "--duration", "5"]
    monkeypatch.setattr("sys.argv", argv)
    ps.main()
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["constants_source"] == "fitted"
    a, b = (out["checks"][str(tmp_path / x)] for x in "ab")
    assert (a["runs"], b["runs"]) == (["sweep@0.5"], ["sweep@1.0"])
    assert (a["pull_budget"], b["pull_budget"]) == (2048, 256)
    assert set(b["stacks"]) == {"round_robin", "plurai-vllm"}
    fleet = out["sizes"]["2"]
    per = fleet["capacity_per_engine_req_s"]
    assert per > 0 and out["capacity_per_engine_req_s"]["measured"] == 1.0
    assert fleet["pull"]["runs"]["@1.5"]["offered_req_s"] == pytest.approx(1.5 * 2 * per, 1e-3)


def test_simulated_capacity_is_a_saturating_burst() -> None:
    one = ps.capacity(1, K)
    # a burst: the engine never idles, so a slower step gives proportionally fewer req/s
    slow = ps.capacity(1, replace(K, a_s=2 * K.a_s, b_s=2 * K.b_s, c_s=2 * K.c_s))
    assert 0 < slow < one
    slos = {"interactive": ps.sf.Slo(ttft_s=1.0), "batch": ps.sf.Slo(e2e_s=10.0)}
    fleet = ps.fleet(4, [0.5, 2.0], K, slos, 5.0)
    assert fleet["capacity_per_engine_req_s"] == ps.capacity(4, K)
    under, over = (fleet["round_robin"]["runs"][s]["slo_attainment"] for s in ("@0.5", "@2.0"))
    assert under > over


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


def write_idle(path, figures: dict[str, tuple[float, float, float]], chats, docs) -> None:
    """The idle run of a folder: its workload (chat and document prompt sizes) and, per
    stack, (interactive TTFT, interactive TPOT, batch TTFT) medians in ms."""
    rows = [{"id": f"i{i}", "lane": "interactive", "prompt_tokens": n} for i, n in enumerate(chats)]
    rows += [{"id": f"d{i}", "lane": "batch", "prompt_tokens": n} for i, n in enumerate(docs)]
    (path / "idle.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = (path / "out.json").read_text().splitlines()
    out = json.loads(lines[-1])
    out["idle"] = {
        s: {
            "interactive": {"ttft_p50_ms": ttft, "tpot_p50_ms": tpot},
            "batch": {"ttft_p50_ms": doc},
        }
        for s, (ttft, tpot, doc) in figures.items()
    }
    (path / "out.json").write_text(json.dumps(out) + "\n")


def test_first_guess_reads_the_idle_figures(tmp_path) -> None:
    write_folder(tmp_path / "a", {"sweep@1.0": [0.0, 1.0]})
    m = ps.load(tmp_path / "a")
    assert ps.first_guess(m) == replace(ps.DEFAULTS, noise_sd=0.0)  # no idle run: defaults
    # chats of 116 tokens find their first 16-token block cached: 100 computed; documents 500
    figures = {"round_robin": (100.0, 20.0, 300.0), "plurai-vllm": (150.0, 25.0, 400.0)}
    write_idle(tmp_path / "a", figures, chats=[110, 116, 130], docs=[500, 500])
    m = ps.load(tmp_path / "a")
    assert len(m.idle) == 5 and m.block == 16
    g = ps.first_guess(m, share=0.25)
    assert g.b_s == pytest.approx(0.2 / 400)  # 200 ms more for 400 tokens more
    assert (g.a_s, g.c_s) == (pytest.approx(0.015), pytest.approx(0.005))  # TPOT 20 ms
    assert g.router_front_s == pytest.approx(0.1 - 0.02 - 0.05)
    assert g.queue_front_s == pytest.approx(0.15 - 0.02 - 0.05)  # plurai-vllm's TTFT
    assert g.noise_sd == 0.0


def test_fit_finds_constants_that_reproduce_the_figures(tmp_path) -> None:
    """Results made by the simulation with known constants: the fit, from the idle run's
    guess, reproduces their figures (p99s and goodput within the tolerance), closer than
    the guess did."""
    times = {"sweep@0.5": [0.4 * i for i in range(30)], "sweep@1.0": [0.2 * i for i in range(30)]}
    write_folder(tmp_path / "a", times)
    write_idle(tmp_path / "a", {"round_robin": (300.0, 14.0, 300.0)}, chats=[216], docs=[200])
    m = ps.load(tmp_path / "a")
    slos = ps.slos_of(m)
    for stack in m.results:
        sweep = []
        for run in m.runs:
            measure(m, stack, run)
            rate = m.out["stacks"][stack]["runs"][run]["offered_req_s"]
            sweep.append((rate, [ps.sf.Result.from_row(r) for r in m.results[stack][run]]))
        m.out["stacks"][stack]["goodput_req_s"] = ps.sf.goodput(sweep, slos)
    guess = ps.first_guess(m)
    k, info = ps.fit(m)
    assert info["figures_error"]["fitted"] <= info["figures_error"]["grid"]
    assert ps.figures_error(m, k) < ps.figures_error(m, guess)
    assert ps.check_summary(ps.check(m, k))["ok"]
