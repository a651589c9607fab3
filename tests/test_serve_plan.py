"""The step planner (serve/plan.py) with a fake runner: chunked prefill beside running decodes, a
token budget per step, per-model fairness without head-of-line skipping, and preemption instead of
running out of KV blocks, under random traffic until every request is done."""
from __future__ import annotations

import random

import pytest

from deltafleet.serve.kv import BlockPool
from deltafleet.serve.plan import Planner, Sequence


def _run(planner: Planner, plan) -> None:
    """A fake runner: every decode, and every chunk that reaches the end of its tokens, samples 7."""
    sampled = {id(s): 7 for s in plan.decode}
    sampled |= {id(s): 7 for s, _, stop in plan.prefill if stop == len(s.tokens)}
    planner.advance(plan, sampled)


def _seq(model: str, n: int) -> Sequence:
    return Sequence(model, list(range(1, n + 1)), n)


def test_a_long_prompt_is_prefilled_in_chunks_beside_a_running_stream():
    planner = Planner(BlockPool(64, 4), max_running=4, token_budget=16)
    stream = _seq("tiny", 3)
    planner.add(stream)
    _run(planner, planner.schedule())  # its prompt in one chunk, first token sampled
    assert stream.computed == 3 and len(stream.tokens) == 4 and not stream.prefilling
    long = _seq("tiny-coder", 50)
    planner.add(long)
    chunks = []
    for _ in range(4):
        plan = planner.schedule()
        assert plan.decode == [stream] and plan.tokens <= 16  # the stream never stalls
        chunks += [(start, stop) for s, start, stop in plan.prefill if s is long]
        _run(planner, plan)
    assert chunks == [(0, 15), (15, 30), (30, 45), (45, 50)]
    assert len(long.tokens) == 51 and not long.prefilling  # sampled at the end of its last chunk


def test_a_long_prefill_threshold_leaves_budget_for_a_short_prompt_behind_a_long_one():
    """vLLM's ``long_prefill_token_threshold``: without it the long prompt's chunks take the whole
    budget and a short prompt that arrives after it waits for its last chunk; with a threshold of 8
    the long prompt goes 8 tokens a step and the short one is admitted and prefilled at once."""
    for threshold, short_admitted_at in ((0, 2), (8, 1)):
        planner = Planner(BlockPool(64, 4), max_running=4, token_budget=16,
                          long_prefill_token_threshold=threshold)
        long, short = _seq("tiny", 40), _seq("tiny-coder", 5)
        planner.add(long)
        steps = []
        for step in range(6):
            plan = planner.schedule()
            steps.append([(s is long, start, stop) for s, start, stop in plan.prefill])
            assert plan.tokens <= 16
            _run(planner, plan)
            if step == 0:
                planner.add(short)
        first = next(i for i, chunks in enumerate(steps) if any(not is_long for is_long, _, _ in chunks))
        assert first == short_admitted_at, (threshold, steps)
        if threshold:
            assert all(stop - start <= 8 for chunks in steps for _, start, stop in chunks)
            assert steps[1] == [(True, 8, 16), (False, 0, 5)]
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be ≥ 0, got -1"):
        Planner(BlockPool(8, 4), 2, 8, long_prefill_token_threshold=-1)


def test_prompts_are_admitted_together_and_queues_take_turns():
    planner = Planner(BlockPool(64, 4), max_running=3, token_budget=64)
    a = [_seq("tiny-a", 4) for _ in range(4)]
    b = _seq("tiny-b", 4)
    for s in a:
        planner.add(s)
    planner.add(b)
    plan = planner.schedule()
    assert [s for s, _, _ in plan.prefill] == [a[0], b, a[1]]  # a, then b's turn, then a again
    _run(planner, plan)
    planner.finish(b)
    plan = planner.schedule()
    assert plan.decode == [a[0], a[1]] and [s for s, _, _ in plan.prefill] == [a[2]]  # a's order kept


def test_queues_take_turns_across_steps():
    """A budget of one prompt a step: the queue that was admitted from goes to the back, so b's one
    prompt is admitted in the second step, not after all of a's."""
    planner = Planner(BlockPool(64, 4), max_running=4, token_budget=4)
    a = [_seq("tiny-a", 4) for _ in range(3)]
    b = _seq("tiny-b", 4)
    for s in (*a, b):
        planner.add(s)
    admitted = []
    for _ in range(3):
        plan = planner.schedule()
        admitted += [s for s, start, _ in plan.prefill if start == 0]
        _run(planner, plan)
    assert admitted == [a[0], b, a[1]]


def test_admission_waits_for_blocks_and_decodes_preempt_the_latest():
    pool = BlockPool(5, block_size=2)
    planner = Planner(pool, max_running=4, token_budget=32)
    first, second, third = _seq("m1", 4), _seq("m2", 4), _seq("m1", 4)
    for s in (first, second, third):
        planner.add(s)
    plan = planner.schedule()
    assert [s for s, _, _ in plan.prefill] == [first, second]  # third needs 2 blocks, 1 is free: it waits
    assert pool.free_blocks == 1 and list(planner.waiting["m1"]) == [third]
    _run(planner, plan)
    plan = planner.schedule()  # first takes the last block; second needs one: it is the latest admitted
    assert plan.decode == [first] and plan.preempted == [second] and not plan.prefill  # nobody admitted
    assert second.computed == 0 and len(second.tokens) == 5 and planner.waiting["m2"][0] is second
    _run(planner, plan)
    planner.finish(first)
    plan = planner.schedule()  # the preempted one first, prompt and generated token again; then third
    assert plan.prefill == [(second, 0, 5), (third, 0, 4)]


def test_a_long_prompt_that_does_not_fit_is_not_passed_by_other_queues():
    """Found by a fresh user: a quiet variant's long prompt that did not fit the free blocks was skipped,
    and a busy variant's short prompts took each block as it came free, so it waited as long as that
    traffic went on (8–14 s against 0.07 s alone). The blocks that come free are now the waiting one's."""
    pool = BlockPool(8, block_size=8)
    planner = Planner(pool, max_running=8, token_budget=64)
    busy = [_seq("tiny-busy", 12) for _ in range(3)]
    for s in busy:
        planner.add(s)
    _run(planner, planner.schedule())  # three prompts hold 6 of the 8 blocks (room to decode in them)
    long = _seq("tiny-quiet", 30)  # needs 4 blocks
    more = [_seq("tiny-busy", 4) for _ in range(3)]  # one block each
    for s in (long, *more):
        planner.add(s)
    plan = planner.schedule()  # the busy queue's turn came first; then the long one finds no room: held
    assert plan.prefill == [(more[0], 0, 4)] and list(planner.waiting["tiny-busy"]) == more[1:]
    _run(planner, plan)
    plan = planner.schedule()  # one block is free, and more[1] needs one: it is the long one's
    assert not plan.prefill and not plan.preempted and pool.free_blocks == 1
    _run(planner, plan)
    for s in busy:  # the busy variant's first prompts end: the long one goes first
        planner.finish(s)
    assert planner.schedule().prefill[0] == (long, 0, 30)


def test_a_preempted_sequence_goes_back_ahead_of_its_queue():
    pool = BlockPool(5, block_size=2)
    planner = Planner(pool, max_running=4, token_budget=32)
    first, second, third = _seq("m1", 4), _seq("m2", 4), _seq("m2", 4)
    for s in (first, second, third):
        planner.add(s)
    _run(planner, planner.schedule())  # first and second admitted; third waits in m2 for 2 blocks
    plan = planner.schedule()
    assert plan.preempted == [second] and list(planner.waiting["m2"]) == [second, third]
    _run(planner, plan)
    planner.finish(first)
    assert planner.schedule().prefill == [(second, 0, 5), (third, 0, 4)]


def test_a_started_prompt_takes_the_blocks_left_when_its_whole_chunk_does_not_fit():
    """Blocks of one token: the decodes of two streams take two of the four free blocks, so the long
    prompt's next chunk is the two tokens that fit, not the three of its threshold, nor none."""
    pool = BlockPool(9, block_size=1)
    planner = Planner(pool, max_running=4, token_budget=16, long_prefill_token_threshold=3)
    s1, s2, long = _seq("a", 1), _seq("b", 1), _seq("c", 6)
    for s in (s1, s2, long):
        planner.add(s)
    plan = planner.schedule()
    assert plan.prefill == [(s1, 0, 1), (s2, 0, 1), (long, 0, 3)] and pool.free_blocks == 4
    _run(planner, plan)
    plan = planner.schedule()
    assert plan.decode == [s1, s2] and plan.prefill == [(long, 3, 5)] and pool.free_blocks == 0


def test_a_sequence_whose_last_token_is_in_flight_neither_decodes_nor_is_preempted():
    """``final`` (asynchronous scheduling: its last token is being sampled): it keeps its blocks until it
    is finished, and a sequence that needs a block preempts the latest admitted of the others;
    ``must_preempt`` tells beforehand whether the next plan preempts."""
    pool = BlockPool(5, block_size=2)
    planner = Planner(pool, max_running=4, token_budget=32)
    first, second = _seq("m1", 4), _seq("m2", 4)
    for s in (first, second):
        planner.add(s)
    _run(planner, planner.schedule())
    second.final = True  # admitted last, but ending
    plans = []
    while not planner.must_preempt():  # first grows: one block free, then none
        plan = planner.schedule()
        assert plan.decode == [first] and not plan.prefill and not plan.preempted
        plans.append(pool.free_blocks)
        _run(planner, plan)
    assert plans == [0, 0]
    plan = planner.schedule()  # as must_preempt said
    # first needs a fourth block: the only sequence it may preempt is itself
    assert plan.preempted == [first] and not plan.decode and planner.running == [second]
    planner.finish(second)
    assert pool.free_blocks == 5


def test_random_traffic_finishes_every_request_within_budget_and_blocks():
    rng = random.Random(3)
    pool = BlockPool(40, block_size=8)
    planner = Planner(pool, max_running=8, token_budget=48)
    want: dict[int, int] = {}
    pending = []
    for i in range(60):
        s = _seq(f"m{rng.randrange(4)}", rng.randrange(1, 90))
        want[id(s)] = rng.randrange(1, 40)
        pending.append(s)
    done, steps, preemptions, chunked = [], 0, 0, 0
    while (pending or planner.running or any(planner.waiting.values())) and steps < 5000:
        steps += 1
        if pending and rng.random() < 0.3:
            planner.add(pending.pop(0))
        plan = planner.schedule()
        preemptions += len(plan.preempted)
        chunked += sum(stop < len(s.tokens) for s, _, stop in plan.prefill)
        fed = plan.decode + [s for s, _, _ in plan.prefill]
        assert plan.tokens <= 48 and len(fed) == len(set(map(id, fed)))
        for s, start, stop in plan.prefill:
            assert start == s.computed < stop <= len(s.tokens) and pool.capacity(s) >= stop
        for s in plan.decode:
            assert s.computed == len(s.tokens) - 1 and pool.capacity(s) >= s.computed + 1
        _run(planner, plan)
        for s in list(planner.running):
            if len(s.tokens) - s.prompt_len >= want[id(s)] and not s.prefilling:
                planner.finish(s)
                done.append(s)
        held = [b for s in planner.running for b in pool.table(s)]
        assert len(held) == len(set(held)) == pool.n_blocks - pool.free_blocks
    assert len(done) == 60, f"{len(done)} of 60 done after {steps} steps"
    assert preemptions > 0 and chunked > 0  # the traffic did run out of blocks and did chunk prompts
    assert all(len(s.tokens) - s.prompt_len == want[id(s)] for s in done)
    assert pool.free_blocks == pool.n_blocks


def test_a_prompt_is_admitted_only_beside_the_blocks_started_prompts_still_need():
    """Found by a fresh user (a server hung: two prompts of about 250 tokens, 20 blocks of 16, chunks of
    8): the second prompt was admitted while the first was still in chunks, each fitting alone, and
    both then held half the pool with none left for either's rest. Admission now leaves free what the
    started prompts still need, so the second waits; both end with the whole prompt in chunks."""
    pool = BlockPool(20, block_size=16)
    planner = Planner(pool, max_running=8, token_budget=16, long_prefill_token_threshold=8)
    a, b = _seq("tiny", 250), _seq("tiny", 240)
    planner.add(a)
    planner.add(b)
    admitted_b = None
    for step in range(200):
        plan = planner.schedule()
        assert plan.prefill or plan.decode, f"step {step}: nothing to run"
        if admitted_b is None and any(s is b for s, _, _ in plan.prefill):
            admitted_b = step
        _run(planner, plan)
        for s in list(planner.running):
            if len(s.tokens) > s.prompt_len + 3:
                planner.finish(s)
        if not planner.running and not any(planner.waiting.values()):
            break
    assert len(a.tokens) == 254 and len(b.tokens) == 244
    assert admitted_b is not None and admitted_b >= 250 // 8  # after a's last chunk
    assert pool.free_blocks == pool.n_blocks


def test_started_prompts_that_decode_rows_leave_without_blocks_give_way():
    """Decode rows may take blocks a started prompt's admission counted on: when every running
    sequence is then a prompt with no block for its next chunk, the last admitted is preempted and
    the others go on (no step stalls while sequences run)."""
    pool = BlockPool(6, block_size=4)
    planner = Planner(pool, max_running=4, token_budget=8, long_prefill_token_threshold=4)
    a, b = _seq("tiny", 12), _seq("tiny-coder", 8)
    planner.add(a)
    planner.add(b)
    _run(planner, planner.schedule())  # a 4 of 12 (3 blocks owed in all), b 4 of 8 (2)
    assert a.computed == 4 and b.computed == 4 and pool.free_blocks == 4
    pool.grow(_seq("other", 1), 16)  # another sequence's decode rows take every free block
    plan = planner.schedule()
    assert plan.preempted == [b] and not plan.prefill and not plan.decode and planner.running == [a]
    plan = planner.schedule()
    assert [(s, start, stop) for s, start, stop in plan.prefill] == [(a, 4, 8)]


def test_a_budget_below_the_running_set_is_refused():
    with pytest.raises(ValueError, match="max_running ≤ token_budget"):
        Planner(BlockPool(4, 4), max_running=8, token_budget=4)


def test_paced_admission_groups_arrivals_while_streams_run():
    """``delay_factor`` 2: with a stream running, waiting requests join only once the oldest has waited
    twice the last admitting step (10 s on the fake clock), then together; with nothing running they
    join at once; a factor of 0 admits at every step."""
    now = [0.0]
    planner = Planner(BlockPool(64, 4), max_running=8, token_budget=64, delay_factor=2.0, clock=lambda: now[0])
    stream = _seq("tiny", 3)
    planner.add(stream)
    plan = planner.schedule()  # nothing runs: admitted at once
    assert [s for s, _, _ in plan.prefill] == [stream]
    now[0] += 10.0  # that admitting step took 10 s
    _run(planner, plan)
    a, b = _seq("tiny-coder", 4), _seq("tiny-writer", 4)
    planner.add(a)
    assert planner.schedule().prefill == []  # a waited 0 s < 2 × 10 s
    now[0] += 15.0
    _run(planner, planner.schedule())  # 15 s: still waits; b arrives meanwhile
    planner.add(b)
    now[0] += 6.0  # a has now waited 21 s ≥ 20 s: a and b join in one step
    plan = planner.schedule()
    assert {s.model_id for s, _, _ in plan.prefill} == {"tiny-coder", "tiny-writer"} and plan.decode == [stream]
    _run(planner, plan)
    now[0] += 12.0  # that admitting step took 12 s
    _run(planner, planner.schedule())
    for s in (stream, a, b):
        planner.finish(s)
    late = _seq("tiny", 3)
    planner.add(late)  # nothing runs: admitted at once, though it waited 0 s < 2 × 12 s
    assert [s for s, _, _ in planner.schedule().prefill] == [late]
    unpaced = Planner(BlockPool(64, 4), max_running=8, token_budget=64, clock=lambda: now[0])
    for s in (_seq("tiny", 3), _seq("tiny-coder", 4)):
        unpaced.add(s)
        plan = unpaced.schedule()
        assert [x for x, _, _ in plan.prefill] == [s]  # admitted in the step after it came
        _run(unpaced, plan)
    for bad in (-1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match=f"scheduler_delay_factor must be finite and ≥ 0, got {bad}"):
            Planner(BlockPool(8, 4), 2, 8, delay_factor=bad)


def test_the_load_gauges_count_the_batch_and_the_preempted_as_waiting():
    """Found by a fresh user: ``num_requests_running`` went above ``max_batch`` (9 with 8) and a preempted
    request was never counted as waiting again: the gauges were kept by the HTTP side, a request
    running from its first start to its end. They now read the scheduler's own sets at the scrape."""
    import threading
    import types

    from prometheus_client import generate_latest

    from deltafleet.serve.app import Metrics
    from deltafleet.serve.scheduler import Scheduler

    pool = BlockPool(5, block_size=2)
    planner = Planner(pool, max_running=4, token_budget=32)
    first, second, third = _seq("tiny-a", 4), _seq("tiny-b", 4), _seq("tiny-a", 4)
    for s in (first, second, third):
        planner.add(s)
    _run(planner, planner.schedule())
    plan = planner.schedule()
    assert plan.preempted == [second]  # (as in the test above)
    sched = types.SimpleNamespace(planner=planner, _cv=threading.Condition())
    assert Scheduler.load(sched) == ({"tiny-a": 1}, {"tiny-a": 1, "tiny-b": 1})
    metrics = Metrics(["tiny", "tiny-a", "tiny-b"], "tiny", lambda: Scheduler.load(sched))
    text = generate_latest(metrics.registry).decode()
    for line in ('num_requests_running{model_name="tiny-a"} 1.0', 'num_requests_running{model_name="tiny-b"} 0.0',
                 'num_requests_waiting{model_name="tiny-a"} 1.0', 'num_requests_waiting{model_name="tiny-b"} 1.0',
                 'num_requests_running{model_name="tiny"} 0.0'):
        assert f"deltafleet:{line}" in text, line
