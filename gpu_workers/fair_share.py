"""Fair share among the tenants of one lane: which tenant's entry is taken next.

The Virtual Token Counter (Sheng et al., "Fairness in Serving Large Language Models", OSDI
2024). Each tenant has a counter of the service it has had: PROMPT_COST per prompt token
and OUTPUT_COST per output token (a decoded token costs an engine about twice a prefilled
one), divided by the tenant's weight. The next entry taken is the head of the backlogged
tenant (one with entries waiting) whose counter is lowest. A tenant that becomes backlogged
again is lifted to the lowest counter among the backlogged ones (with none backlogged, to
the counter of the tenant served last), never left below it: idle time banks no credit, so
a tenant back from idle shares from then on rather than taking everything until its
counter catches up. With every lane's takes in this order, the service two backlogged
tenants of equal weight have had differs by at most about twice the largest request's
cost (the paper's bound for one engine), and no engine idles while any tenant waits.

A plain object fed by events, no Redis and no clock: the reference for the counters that
the queue keeps in Redis, and the policy the fleet simulation runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PROMPT_COST = 1.0
OUTPUT_COST = 2.0


@dataclass
class FairShare:
    weights: dict[str, float] = field(default_factory=dict)  # a tenant not named: 1
    counters: dict[str, float] = field(default_factory=dict)
    waiting: dict[str, int] = field(default_factory=dict)  # the backlogged: entries waiting
    last: str | None = None  # the tenant served last

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def arrive(self, tenant: str) -> None:
        """An entry of `tenant` joins the lane."""
        if not self.waiting.get(tenant):
            if self.waiting:
                floor = min(self.counters.get(t, 0.0) for t in self.waiting)
            else:
                floor = self.counters.get(self.last, 0.0) if self.last is not None else 0.0
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)
        self.waiting[tenant] = self.waiting.get(tenant, 0) + 1

    def next(self) -> str | None:
        """The tenant whose head entry goes next (ties: the name first), or None."""
        if not self.waiting:
            return None
        return min(self.waiting, key=lambda t: (self.counters.get(t, 0.0), t))

    def take(self, tenant: str, prompt_tokens: int) -> None:
        """`tenant`'s head entry was taken: its prompt is charged now, its output tokens as
        they are made (charge)."""
        left = self.waiting.get(tenant, 0) - 1
        if left < 0:
            raise ValueError(f"tenant {tenant!r} has no entry waiting")
        if left:
            self.waiting[tenant] = left
        else:
            del self.waiting[tenant]
        self.last = tenant
        self.charge(tenant, prompt_tokens, 0)

    def charge(self, tenant: str, prompt_tokens: int, output_tokens: int) -> None:
        cost = PROMPT_COST * prompt_tokens + OUTPUT_COST * output_tokens
        self.counters[tenant] = self.counters.get(tenant, 0.0) + cost / self.weight(tenant)
