"""gpu_workers/fair_share.py, the lane's fair share among tenants, on known inputs: the
counter's arithmetic, the rule for a tenant back from idle, the take order with weights,
and the bound on the service gap between two backlogged tenants."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from plurai.gpu_workers.fair_share import OUTPUT_COST, PROMPT_COST, FairShare


def test_a_tenant_is_charged_its_tokens_over_its_weight() -> None:
    f = FairShare(weights={"b": 2.0})
    f.charge("a", 100, 10)
    f.charge("b", 100, 10)
    assert f.counters["a"] == 100 * PROMPT_COST + 10 * OUTPUT_COST == 120
    assert f.counters["b"] == 60


def test_a_take_charges_the_prompt_and_counts_the_entry_off() -> None:
    f = FairShare()
    f.arrive("a")
    f.arrive("a")
    f.take("a", 30)
    assert f.counters["a"] == 30 and f.waiting == {"a": 1} and f.last == "a"
    f.take("a", 5)
    assert f.waiting == {} and f.next() is None
    with pytest.raises(ValueError, match="no entry waiting"):
        f.take("a", 1)


def test_a_tenant_back_from_idle_starts_at_the_lowest_backlogged_counter() -> None:
    f = FairShare(counters={"a": 500.0, "b": 800.0, "c": 0.0, "old": 9000.0})
    f.arrive("a")
    f.arrive("b")
    f.arrive("c")  # idle since 0: lifted to the lowest waiting, a's 500
    assert f.counters["c"] == 500
    f.arrive("old")  # ahead already: kept where it is, not lowered
    assert f.counters["old"] == 9000
    f.arrive("c")  # backlogged now: a second entry lifts nothing
    f.charge("a", 1000, 0)
    f.arrive("c")
    assert f.counters["c"] == 500


def test_with_no_one_waiting_a_returning_tenant_starts_at_the_last_served() -> None:
    f = FairShare()
    f.arrive("a")
    f.take("a", 400)
    f.arrive("b")  # no one waits: b starts at a's 400, the last served, not at 0
    assert f.counters["b"] == 400
    g = FairShare()
    g.arrive("new")  # nothing served yet: 0
    assert g.counters["new"] == 0


def test_takes_follow_the_weights_among_three_tenants() -> None:
    f = FairShare(weights={"a": 2.0})
    for _ in range(100):
        for t in "abc":
            f.arrive(t)
    order = []
    for _ in range(40):
        t = f.next()
        assert t is not None
        order.append(t)
        f.take(t, 10)
    assert order[:8] == ["a", "b", "c", "a", "a", "b", "c", "a"]  # ties: the name first
    assert (order.count("a"), order.count("b"), order.count("c")) == (20, 10, 10)


@given(
    st.lists(st.tuples(st.integers(1, 2000), st.integers(0, 500)), min_size=1, max_size=200),
    st.floats(0.25, 4.0),
)
def test_two_backlogged_tenants_differ_by_at_most_one_request(
    sizes: list[tuple[int, int]], weight_b: float
) -> None:
    """Both always have work waiting: at every take, their counters (service over weight)
    differ by no more than the largest request's weighted cost."""
    f = FairShare(weights={"b": weight_b})
    largest = max(PROMPT_COST * p + OUTPUT_COST * o for p, o in sizes) / min(1.0, weight_b)
    f.arrive("a")
    f.arrive("b")
    for prompt, output in sizes:
        t = f.next()
        assert t is not None
        f.take(t, prompt)
        f.charge(t, 0, output)
        f.arrive(t)  # still backlogged
        assert abs(f.counters["a"] - f.counters["b"]) <= largest + 1e-9
