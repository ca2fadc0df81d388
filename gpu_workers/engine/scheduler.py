"""Iteration-level scheduling: which sequences run in the next step, and how many
tokens of each.

Every step spends a token budget. Running sequences go first, best priority first: a
decode takes one token, an unfinished prefill takes the next chunk. Waiting sequences
are then admitted in (effective priority, arrival) order while budget, sequence slots
and KV blocks last; a prompt longer than the remaining budget is prefilled in chunks.
When a running sequence needs a block and none is free, the worst running sequence
(highest priority value, newest) is preempted: its blocks are released (its full blocks
stay in the prefix cache) and it is recomputed when readmitted. A waiting sequence that
does not fit may likewise preempt running sequences of a strictly lower priority.

A waiting sequence of strictly better priority than every running one gets a step of its
own: its (first chunk of) prefill runs without the running decodes, so its first token is
not slowed by the batch it overtakes; the decodes continue at the next step.

With a speculator (speculator.py), a decode may carry proposed tokens: they take budget
and blocks like a prefill chunk, and are the first thing given up when blocks run short.

The choices of a request with n > 1 wait behind their lead (its first choice) until it has
computed the prompt; each is then admitted with the lead's full prompt blocks (the
block manager's fork: `match_prefix`), and computes only the prompt's last partial block
before sampling on its own. The prompt is computed once.
"""

from __future__ import annotations

from plurai.gpu_workers.engine.block_manager import BlockManager
from plurai.gpu_workers.engine.config import EngineConfig
from plurai.gpu_workers.engine.sequence import Sequence, Status
from plurai.gpu_workers.engine.speculator import Speculator


class Scheduler:
    def __init__(
        self, config: EngineConfig, blocks: BlockManager, speculator: Speculator | None = None
    ) -> None:
        self.config = config
        self.blocks = blocks
        self.speculator = speculator
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.preempted: dict[str, None] = {}  # request ids preempted, until Engine.preempted

    def rank(self, seq: Sequence) -> tuple[int, int]:
        """Sort key, lower runs first: priority improved by time spent waiting."""
        return seq.priority - seq.waited_steps // self.config.priority_aging_steps, seq.arrival

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Sequence]:
        budget = self.config.max_num_batched_tokens
        bm = self.blocks
        scheduled: list[Sequence] = []
        self.running.sort(key=self.rank)
        self.waiting.sort(key=self.rank)
        if self.waiting and self.running:
            best_running = self.rank(self.running[0])[0]
            if self.rank(self.waiting[0])[0] < best_running:
                self._admit(budget, scheduled, better_than=best_running)
                if scheduled:
                    self._aging()
                    return scheduled
        preempted = False
        spec = self.speculator
        if spec is not None:
            spec.prepare(self.running)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(len(seq) - seq.num_computed_tokens, budget)
            if spec is not None and n == 1 and len(seq) - seq.num_computed_tokens == 1:
                # proposals only from budget that leaves every later running one a token
                spec.draft(seq, budget - (len(self.running) - i))
                n += seq.num_draft
            while not bm.can_grow(seq, seq.num_computed_tokens + n):
                if seq.num_draft:  # proposals go first
                    seq.drop_draft()
                    n = 1
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                bm.grow(seq, seq.num_computed_tokens + n)
                seq.num_scheduled = n
                scheduled.append(seq)
                budget -= n
                i += 1

        if not preempted:
            budget = self._admit(budget, scheduled)
        self._aging()
        return scheduled

    def _aging(self) -> None:
        for seq in self.waiting:
            seq.waited_steps += 1

    def _admit(self, budget: int, scheduled: list[Sequence], better_than: int | None = None) -> int:
        """Admit waiting sequences in rank order (only those ranked strictly better than
        `better_than` when given) while budget, slots and blocks last."""
        bm = self.blocks
        chunked = self.config.chunked_prefill
        admitted: set[int] = set()
        for seq in list(self.waiting):
            if budget <= 0 or (better_than is not None and self.rank(seq)[0] >= better_than):
                break
            if _behind_lead(seq):
                continue
            hit = bm.match_prefix(seq)
            loaded = bm.match_tiers(seq, len(hit))
            cached = (len(hit) + len(loaded)) * bm.block_size
            remaining = len(seq) - cached
            if remaining > budget and not chunked:
                break
            n = min(remaining, budget)
            while not self._fits(seq, hit, cached + n):
                victim = self._victim_for(seq)
                if victim is None:
                    break
                budget += self._evict(victim, scheduled)
                n = min(remaining, budget)
            if not self._fits(seq, hit, cached + n):
                break
            bm.allocate(seq, hit, loaded)
            bm.grow(seq, seq.num_computed_tokens + n)
            seq.status = Status.RUNNING
            seq.num_scheduled = n
            self.running.append(seq)
            scheduled.append(seq)
            budget -= n
            admitted.add(id(seq))
        self.waiting = [s for s in self.waiting if id(s) not in admitted]
        return budget

    def _fits(self, seq: Sequence, hit: list[int], num_tokens: int) -> bool:
        return len(self.running) < self.config.max_num_seqs and self.blocks.can_allocate(
            seq, hit, num_tokens
        )

    def _victim_for(self, seq: Sequence) -> Sequence | None:
        """The running sequence a waiting `seq` may preempt to get in: the worst one whose
        effective priority is strictly lower (a higher value), newest first."""
        mine = self.rank(seq)[0]
        worse = [s for s in self.running if self.rank(s)[0] > mine]
        return max(worse, key=self.rank, default=None)

    def _evict(self, victim: Sequence, scheduled: list[Sequence]) -> int:
        """Preempt a running sequence, taking it out of this step; returns its tokens."""
        refund = 0
        if victim in scheduled:
            scheduled.remove(victim)
            refund = victim.num_scheduled
        self.running.remove(victim)
        self._preempt(victim)
        return refund

    def _preempt(self, seq: Sequence) -> None:
        seq.drop_draft()
        self.blocks.release(seq)
        seq.status = Status.WAITING
        seq.num_scheduled = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.preempted[seq.request_id] = None
        self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Take a sequence out (finished or aborted) and free its blocks now."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self.blocks.release(seq)
        if self.speculator is not None:
            self.speculator.forget(seq)
        seq.status = Status.FINISHED


def _behind_lead(seq: Sequence) -> bool:
    """Whether a choice waits for its lead to compute the prompt it will share: while the
    lead has not ended and its prompt is not computed (not yet, or again after it was
    preempted)."""
    lead = seq.lead
    return (
        lead is not None
        and lead.status is not Status.FINISHED
        and lead.num_computed_tokens < seq.num_prompt_tokens
    )
