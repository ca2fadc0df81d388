"""The fleet policy simulation's calibration (bench/serving/simulation.py): loading a
bench/serving/ folder, replaying its requests as they were sent, the calibration check, the
simulated capacity, and fitting the constants from the idle run's first guess. The engines,
routers and pulling: tests/unit/test_serving_simulation.py.
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest

from bench.serving import simulation as ps
from tests.unit.test_serving_simulation import K


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
