"""What one engine step runs, planned from a token budget (vLLM v1's scheduler, at this size).

Each step the planner decides, without touching the model: every running sequence that has its
whole prompt in the KV cache decodes one token; the budget left goes to prompts, continuing the
ones already started and then admitting waiting requests, each in chunks of at most what is left,
so a long prompt is prefilled over several steps beside the running streams instead of stalling
them. With ``long_prefill_token_threshold`` (vLLM's name) a prompt's chunk is at most that many
tokens a step, so that a long prompt leaves budget for the prompts that arrive after it instead of
taking every step until it is in. Waiting requests are admitted one per model queue in turn (a busy
variant cannot starve a quiet one) and never past the first that does not fit (no head-of-line
skipping within a queue).

KV blocks come from a :class:`~deltafleet.serve.kv.BlockPool`. A running sequence that needs a new
block when none is free preempts the most recently admitted running sequence (its blocks are
freed and it goes back to the front of its queue, to be prefilled again, prompt and generated
tokens, when there is room, before any other waiting request: vLLM's recompute preemption); a step
that preempts admits nothing, and admission waits until the blocks of the request's whole prompt are
free, beyond those the prompts already started still need, rather than preempting (admitting a prompt
whose first chunk only fits would have it preempted again and again as the running sequences grow).
Should decode rows take the blocks a started prompt was counted on, so that no running sequence can
go on, the last admitted is preempted. The pool never runs out mid-step, and no step is refused for
memory.

Admission can be paced (vLLM's ``scheduler_delay_factor``): with a factor ``f > 0``, while sequences
are running, waiting requests are admitted only once the longest-waiting one has waited ``f`` times
the last step that admitted prompts. Under a steady stream of arrivals prompts then join in groups
rather than one per step, so fewer steps carry prefill chunks (an engine step with chunks is not
replayed from a CUDA graph); a request waits at most that long more for its first token.

A leaf module but for the block pool: the runner executes a :class:`StepPlan` and reports back with
:meth:`Planner.advance`, at once (the sampled tokens :data:`PENDING` while the step runs, with
asynchronous scheduling: serve/scheduler.py).
"""
from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable

from deltafleet.serve.kv import BlockPool

PENDING = -1  # a sampled token still on the device (its step in flight): a placeholder in Sequence.tokens


@dataclass(eq=False)
class Sequence:
    """A request as the planner sees it.

    Attributes:
        model_id: its queue (the base or a variant).
        tokens: its prompt, then every token generated so far (what a recompute must prefill).
        prompt_len: how many of ``tokens`` are the prompt.
        computed: how many of ``tokens`` have their keys and values in the cache.
    """

    model_id: str
    tokens: list[int]
    prompt_len: int
    computed: int = 0
    admitted: int = field(default=-1)  # the order it entered the running set (preemption picks the last)
    preempted: bool = False  # waiting after a preemption: admitted before the others
    arrival: float = 0.0  # when it was queued (the planner's clock)
    final: bool = False  # its last token is being sampled (a step in flight): it decodes no more

    @property
    def prefilling(self) -> bool:
        """Whether two or more of its tokens lack keys and values (a prompt, or a recompute); else it
        decodes: its last token is fed at position ``computed`` and the next one sampled."""
        return self.computed < len(self.tokens) - 1


@dataclass
class StepPlan:
    """One step: ``decode`` sequences feed their last token (at position ``computed``) and sample the
    next; ``prefill`` feeds ``(seq, start, stop)`` chunks of ``seq.tokens``, and a chunk that ends at
    ``len(seq.tokens)`` samples the next token too; ``preempted`` lost their blocks this step."""

    decode: list[Sequence] = field(default_factory=list)
    prefill: list[tuple[Sequence, int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return len(self.decode) + sum(stop - start for _, start, stop in self.prefill)


class Planner:
    """Plans steps over ``pool`` with at most ``max_running`` sequences and ``token_budget`` tokens
    a step, admission paced by ``delay_factor`` (0: admit at once), time read from ``clock`` (see the
    module docstring).

    Raises:
        ValueError: ``max_running`` < 1, ``token_budget`` < ``max_running`` (every running sequence
            must be able to decode in every step), ``delay_factor`` < 0, or
            ``long_prefill_token_threshold`` < 0 (0: a chunk takes all the budget left).
    """

    def __init__(self, pool: BlockPool, max_running: int, token_budget: int, delay_factor: float = 0.0,
                 clock: Callable[[], float] = time.monotonic, long_prefill_token_threshold: int = 0):
        if max_running < 1 or token_budget < max_running:
            raise ValueError(f"need 1 ≤ max_running ≤ token_budget, got {max_running} and {token_budget}")
        if not 0 <= delay_factor < math.inf:  # inf would admit nothing while anything runs
            raise ValueError(f"scheduler_delay_factor must be finite and ≥ 0, got {delay_factor}")
        if long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be ≥ 0, got {long_prefill_token_threshold}")
        self.pool, self.max_running, self.token_budget = pool, max_running, token_budget
        self.delay_factor, self.clock = float(delay_factor), clock
        self.chunk_cap = long_prefill_token_threshold or token_budget  # a prompt's tokens a step at most
        self.waiting: OrderedDict[str, deque[Sequence]] = OrderedDict()
        self.running: list[Sequence] = []
        self._admissions = 0
        self._admitted_at: float | None = None  # when the last step that admitted was planned
        self._admit_step_s = 0.0  # how long that step took (until the next plan)

    def add(self, seq: Sequence) -> None:
        """Queue a new request at the back of its model's queue."""
        seq.arrival = self.clock()
        self.waiting.setdefault(seq.model_id, deque()).append(seq)

    def _may_admit(self, now: float) -> bool:
        """Pacing (the module docstring): nothing running, no factor, or the oldest waited long enough."""
        if self.delay_factor == 0 or not self.running:
            return True
        oldest = min((q[0].arrival for q in self.waiting.values() if q), default=now)
        return now - oldest >= self.delay_factor * self._admit_step_s

    def finish(self, seq: Sequence) -> None:
        """``seq`` ended (or was cancelled): its blocks go back, it leaves the running set or its queue."""
        if seq in self.running:
            self.running.remove(seq)
        else:
            queue = self.waiting.get(seq.model_id)
            if queue is not None and seq in queue:
                queue.remove(seq)
        self.pool.release(seq)

    def advance(self, plan: StepPlan, new_tokens: dict[int, int]) -> None:
        """The runner ran (or launched) ``plan``: the chunks' and decodes' keys and values are cached;
        ``new_tokens`` maps ``id(seq)`` to the token each sampled (every decode, and each chunk that
        reached the end of its sequence's tokens), or :data:`PENDING` until it is read."""
        for seq, _, stop in plan.prefill:
            seq.computed = stop
        for seq in plan.decode:
            seq.computed += 1
        for seq in plan.decode + [s for s, _, _ in plan.prefill]:
            if id(seq) in new_tokens:
                seq.tokens.append(new_tokens[id(seq)])

    def must_preempt(self) -> bool:
        """Whether :meth:`schedule` would preempt now: the running sequences that decode need more
        new blocks for their next token than are free. (The scheduler reads a step in flight first
        then, since the sequences that end in it give blocks back: serve/scheduler.py.)"""
        free = self.pool.free_blocks
        if free >= len(self.running):  # a token takes at most one new block
            return False
        return sum(self.pool.extra_blocks(s, s.computed + 1) for s in self.running
                   if not s.prefilling and not s.final) > free

    # ---------------------------------------------------------------- planning

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.token_budget
        now = self.clock()
        if self._admitted_at is not None:
            self._admit_step_s, self._admitted_at = now - self._admitted_at, None
        for seq in sorted(self.running, key=lambda s: s.admitted):
            if seq.preempted or seq.prefilling or seq.final:  # (preempted: by an earlier one, this step)
                continue
            while not self.pool.can_grow(seq, seq.computed + 1):  # the token it decodes needs a block
                # not one that is ending: its blocks come back when its last token is read
                victim = max((s for s in self.running if not s.final), key=lambda s: s.admitted)
                self._preempt(victim, plan)
                if victim is seq:
                    break
            if not seq.preempted:
                self.pool.grow(seq, seq.computed + 1)
                plan.decode.append(seq)
                budget -= 1
        for seq in sorted(self.running, key=lambda s: s.admitted):  # prompts already started
            if budget == 0:
                break
            if seq.prefilling:  # (the decode rows are not)
                budget -= self._chunk(seq, min(budget, self.chunk_cap), plan)
        if self.running and all(s.prefilling for s in self.running) and not plan.prefill:
            # every running sequence is a prompt that found no block (decode rows grew into the room its
            # admission saw): the last admitted goes back, so that the others can go on
            self._preempt(max(self.running, key=lambda s: s.admitted), plan)
        if plan.preempted:  # no room this step: admitting now would take the blocks just freed
            return plan
        if not self._may_admit(now):
            return plan
        admissions = self._admissions
        # the blocks the prompts already started still need: an admission leaves them free
        owed = sum(self.pool.extra_blocks(s, len(s.tokens)) for s in self.running if s.prefilling)
        held = False  # a queue's first request found no room: the blocks that come free are its
        while budget > 0 and len(self.running) < self.max_running and any(self.waiting.values()) and not held:
            admitted = False
            first = [m for m, q in self.waiting.items() if q and q[0].preempted]  # then the queues in turn
            for model_id in first + [m for m in self.waiting if m not in first]:
                queue = self.waiting[model_id]
                if not queue or budget == 0 or len(self.running) >= self.max_running:
                    continue
                seq = queue[0]
                if self.pool.extra_blocks(seq, len(seq.tokens)) + owed > self.pool.free_blocks:
                    # no room for its whole prompt yet: it keeps its place, and nothing after it in the
                    # turn takes the blocks it waits for (as vLLM stops at the first request it cannot
                    # place), else other queues' shorter prompts could keep a long one waiting for ever
                    held = True
                    break
                queue.popleft()
                self.waiting.move_to_end(model_id)  # the next admission starts with another queue
                seq.admitted, self._admissions, seq.preempted = self._admissions, self._admissions + 1, False
                self.running.append(seq)
                budget -= self._chunk(seq, min(budget, self.chunk_cap), plan)
                if seq.prefilling:
                    owed += self.pool.extra_blocks(seq, len(seq.tokens))
                admitted = True
            if not admitted:
                break
        if self._admissions != admissions:
            self._admitted_at = now
        return plan

    def _chunk(self, seq: Sequence, budget: int, plan: StepPlan) -> int:
        """Plan the next prefill chunk of ``seq`` within ``budget``; returns its size (0: no blocks)."""
        stop = min(len(seq.tokens), seq.computed + budget)
        while stop > seq.computed and not self.pool.can_grow(seq, stop):
            stop -= 1
        if stop <= seq.computed:
            return 0
        self.pool.grow(seq, stop)
        plan.prefill.append((seq, seq.computed, stop))
        return stop - seq.computed

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        self.running.remove(seq)
        self.pool.release(seq)
        seq.computed, seq.admitted, seq.preempted = 0, -1, True
        self.waiting.setdefault(seq.model_id, deque()).appendleft(seq)
        if seq in plan.decode:
            plan.decode.remove(seq)
        plan.prefill = [c for c in plan.prefill if c[0] is not seq]
        plan.preempted.append(seq)
