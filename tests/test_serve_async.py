"""Asynchronous scheduling (serve/scheduler.py): each step is planned and launched before the previous
step's tokens are read, its decode rows fed those tokens on the device; it answers exactly what the
synchronous loop answers, token for token, whatever ends a request, and a sequence that ends costs at
most one more row."""
from __future__ import annotations

import threading
import time

import pytest

from deltafleet.serve.engine import Engine, SamplingParams
from deltafleet.serve.request import Step
from deltafleet.serve.scheduler import END, Scheduler
from tests.conftest import complete_together, wait_released

BS = 4
TEXT = "The quick brown fox. "


def _engine(fam, async_scheduling: bool, **kw) -> Engine:
    return Engine(fam.base_dir, fam.artifacts_dir, family="tiny", async_scheduling=async_scheduling, **kw)


def _steps(engine: Engine, model: str, prompt: str, params: SamplingParams) -> list[tuple]:
    """Every Step of a request, as ``(token, text, finish, logprob, top logprobs, prompt logprobs)``."""
    return [(s.token_id, s.text, s.finish_reason, s.logprob, s.top_logprobs, s.prompt_logprobs)
            for s in engine.generate(model, engine.encode_prompt(prompt), params)]


def _hold_loop(sch, when) -> tuple[threading.Event, threading.Event]:
    """Hold the scheduler loop at the end of the first iteration after which ``when()`` is true (in
    ``detokenizer.submit``, which the loop calls outside the model lock, after handing over the
    step's items): returns ``(paused, resume)``; the loop goes on once ``resume`` is set."""
    paused, resume = threading.Event(), threading.Event()
    real_submit = sch.detokenizer.submit

    def submit(items):
        real_submit(items)
        if not paused.is_set() and when():
            paused.set()
            assert resume.wait(60)

    sch.detokenizer.submit = submit
    return paused, resume


def _count_fed(engine: Engine) -> list[int]:
    """A list that gets, for every step the runner executes, how many decode rows the previous
    step's tokens fed on the device."""
    runner, fed = engine.scheduler.runner, []
    real = runner.execute

    def execute(step, prev=None):
        fed.append(sum(r >= 0 for r in step.prev_rows))
        return real(step, prev)

    runner.execute = execute
    return fed


def test_async_steps_answer_what_sync_steps_answer(tiny_family):
    """Mixed variants, prompts chunked over several steps and sequences preempted (a 12-token budget and
    a cache smaller than the sequences need), and every way a request ends or reads back: greedy and
    seeded top-p, a stop token id, a stop string, min_tokens, log-probabilities of the output and the
    prompt, penalties (the token in flight counted on the device). The same Steps in both modes; only
    the asynchronous loop feeds tokens on the device."""
    kw = dict(max_batch=6, max_num_batched_tokens=12, kv_cache={"block_size": BS, "max_tokens": 24 * BS})
    sync, asyn = _engine(tiny_family, False, **kw), _engine(tiny_family, True, **kw)
    greedy = SamplingParams(max_tokens=16, temperature=0)
    probe = sync.complete("tiny-coder", TEXT, greedy)
    stop_id = probe.token_ids[5]
    stop_text = probe.text[len(probe.text) // 2:][:3]
    assert stop_text and stop_id not in probe.token_ids[:5]
    jobs = [
        ("tiny", TEXT * 2, greedy),
        ("tiny-coder", TEXT, SamplingParams(max_tokens=16, temperature=0, stop_token_ids=(stop_id,))),
        ("tiny-coder", TEXT, SamplingParams(max_tokens=16, temperature=0, stop=(stop_text,))),
        ("tiny-writer", TEXT, SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=7, logprobs=2,
                                             prompt_logprobs=1)),
        ("tiny-writer", TEXT * 2, SamplingParams(max_tokens=12, temperature=0.8, seed=3, min_tokens=6)),
        ("tiny", TEXT, SamplingParams(max_tokens=12, temperature=0, frequency_penalty=1.5, presence_penalty=0.5,
                                      repetition_penalty=1.3)),
    ]
    fed_sync, fed_async = _count_fed(sync), _count_fed(asyn)
    want, got = complete_together(sync, jobs, _steps), complete_together(asyn, jobs, _steps)
    assert [[s[:3] for s in steps] for steps in got] == [[s[:3] for s in steps] for steps in want]
    # log-probabilities to rounding: a request that ends on a sampled token keeps its row one more
    # step, so later steps' batches (and their sums' order) may differ
    for g, w in zip(got[3], want[3]):
        assert g[3] == pytest.approx(w[3], rel=1e-5)
        assert [v for _, v in g[4]] == pytest.approx([v for _, v in w[4]], rel=1e-5)
        assert [t for t, _ in g[4]] == [t for t, _ in w[4]]
    assert [(t, v) for t, v, _ in got[3][0][5]] == [(t, pytest.approx(v, rel=1e-5)) for t, v, _ in want[3][0][5]]
    finishes = [steps[-1][2] for steps in want]
    assert finishes == ["length", "stop", "stop", "length", "length", "length"]
    assert want[1][-1][0] == stop_id and len(want[1]) == 6  # ended at the stop token, as the probe said
    assert want[3][0][3] is not None and want[3][0][5] is not None  # log-probabilities were asked and given
    plain = sync.complete("tiny", TEXT, SamplingParams(max_tokens=12, temperature=0)).token_ids
    assert [s[0] for s in want[5]] != plain  # the penalty changes that completion
    for engine in (sync, asyn):
        sch = engine.scheduler
        assert sch.preemptions > 0 and sch.max_rows_seen >= 2
        assert sch.pool.free_blocks == 24 and not sch.running and sch._inflight is None  # every block back
    assert sum(fed_sync) == 0 and sum(fed_async) > len(jobs)


def test_a_penalized_token_still_on_the_device_is_counted(tiny_family):
    """A stub model that favours repeating its input token (logit 3) over token 2 (logit 2): with
    frequency and presence penalties of 2 each a token already in the output loses 4 or more, so the
    greedy completion moves on rather than repeating. The same completion whether the last token is
    read on the host first (synchronous) or counted while still on the device (asynchronous)."""
    import torch

    from deltafleet.serve.transfer import feed_tokens

    got = {}
    for async_on in (False, True):
        engine = _engine(tiny_family, async_on)
        vocab = engine.model.args.vocab_size

        def execute(step, prev=None, vocab=vocab):
            tokens = torch.tensor(step.tokens)
            if step.prev_rows:  # what the runner feeds on the device
                feed_tokens(tokens, torch.tensor(step.prev_rows), prev)
            inputs = tokens[step.sample]
            logits = torch.zeros(len(step.sample), vocab)
            logits[:, 2] = 2.0
            logits[torch.arange(len(inputs)), inputs] += 3.0
            return logits

        engine.scheduler.runner.execute = execute
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, frequency_penalty=2.0,
                                presence_penalty=2.0)
        got[async_on] = engine.complete("tiny", TEXT, params).token_ids
    assert got[True] == got[False]
    assert got[False][:3] == [engine.encode_prompt(TEXT)[-1], 2, 2]  # repeats its input once, then moves on
    assert len(set(got[False])) > 3


def test_each_step_is_launched_before_the_previous_tokens_are_read(tiny_family, monkeypatch):
    """The loop's order, one request of five tokens (F: a forward launched, S: its sampling, R: a step's
    tokens read): F1 S1, F2 S2, R1, F3 S3, R2, …, also with penalties (the token in flight is counted
    on the device). With a grammar (its matcher takes each token before the next mask) a step's tokens
    are read once the next forward is launched, before its sampling: F1 S1, F2 R1 S2, F3 R2 S3, …
    With asynchronous scheduling off each step is read before the next: F1 S1 R1, F2 S2 R2, …"""
    events: list[str] = []
    real_read, real_sample = Scheduler._read, Scheduler._sample

    def read(copy):
        events.append("R")
        return real_read(copy)

    def sample(self, logits, seqs, prev=None):
        events.append("S")
        return real_sample(self, logits, seqs, prev)

    monkeypatch.setattr(Scheduler, "_read", staticmethod(read))
    monkeypatch.setattr(Scheduler, "_sample", sample)

    def traced(engine):
        real = engine.scheduler.runner.execute
        engine.scheduler.runner.execute = lambda step, prev=None: events.append("F") or real(step, prev)
        return engine

    def order(engine, **params) -> str:
        events.clear()
        engine.complete("tiny-coder", "def ", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, **params))
        return "".join(events)

    engine = traced(_engine(tiny_family, True))
    assert order(engine) == "FS" + "FSR" * 4 + "R"  # the last step samples the fifth token: no sixth
    assert order(engine, presence_penalty=0.5) == "FS" + "FSR" * 4 + "R"
    assert order(engine, constraint=("regex", "[a-z ]{60}")) == "FS" + "FRS" * 4 + "R"
    assert order(traced(_engine(tiny_family, False))) == "FSR" * 5


def test_the_mask_buffer_is_not_refilled_while_a_step_that_read_it_runs(tiny_family, monkeypatch):
    """Grammars' masks go to the device through one pinned buffer, copied behind the step's forward: it
    is refilled only once the step that used it is read. The case that needs it: a structured request
    cancelled between two steps while a plain one runs on, and a new structured request admitted
    (the step in flight used a mask, though no request of it needs its token any more)."""
    engine = _engine(tiny_family, True)
    sch, real = engine.scheduler, engine.grammars.bitmask
    fills = []

    def bitmask(rows, pinned=False):
        fills.append(sch._inflight is not None and sch._inflight.masked)  # True: a hazard on CUDA
        return real(rows, pinned)

    monkeypatch.setattr(engine.grammars, "bitmask", bitmask)
    # The scheduler pauses (between two steps, holding nothing) the first time A and C both decode (C has
    # two tokens) and a step that sampled A under its mask is in flight: A is cancelled then, for sure
    # before it ends.
    seqs = {}

    def when():
        running = {id(s.out): s for s in sch.planner.running}
        sa, sc = running.get(id(seqs.get("a"))), running.get(id(seqs.get("c")))
        inflight = sch._inflight
        return (sa is not None and sc is not None and not sa.done and not sc.done
                and len(sc.tokens) - sc.prompt_len >= 2 and inflight is not None and inflight.masked
                and any(s is sa for s in inflight.sampled))

    paused, resume = _hold_loop(sch, when)
    regex = ("regex", "[a-z ]{40,80}")
    a = engine.prepare("tiny", engine.encode_prompt("The quick brown"),
                       SamplingParams(max_tokens=60, temperature=0.8, seed=1, constraint=regex))
    out_a, cancel_a = sch.submit(a)
    seqs["a"] = out_a
    out_a.get(timeout=60)
    c = engine.prepare("tiny", engine.encode_prompt("Once upon"), SamplingParams(max_tokens=30, temperature=0,
                                                                                ignore_eos=True))
    out_c, _ = sch.submit(c)
    seqs["c"] = out_c
    assert paused.wait(60), "never were A and C both decoding with a step under A's mask in flight"
    try:
        with engine._gen_lock:  # between two steps
            cancel_a.set()
            b = engine.prepare("tiny", engine.encode_prompt("Hello"), SamplingParams(max_tokens=4, temperature=0,
                                                                                    constraint=regex))
            out_b, _ = sch.submit(b)
    finally:
        resume.set()
    while out_b.get(timeout=60) is not END:
        pass
    while out_c.get(timeout=60) is not END:
        pass
    assert len(fills) > 3 and not any(fills)


def test_an_ended_sequence_costs_at_most_one_more_row(tiny_family):
    """A request that reaches max_tokens takes as many steps as synchronously (its last token is known
    to be last when it is launched); one that ends on a sampled token (a stop token id) one more, whose
    row is dropped."""
    sync, asyn = _engine(tiny_family, False), _engine(tiny_family, True)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    ids = sync.complete("tiny", TEXT, greedy).token_ids
    stop = SamplingParams(max_tokens=8, temperature=0, stop_token_ids=(ids[3],))
    assert ids[3] not in ids[:3]
    counts = {}
    for name, engine in (("sync", sync), ("async", asyn)):
        for params in (greedy, stop):
            before = engine.scheduler.steps
            r = engine.complete("tiny", TEXT, params)
            counts[name, params.stop_token_ids != ()] = (engine.scheduler.steps - before, r.token_ids)
    assert counts["sync", False] == counts["async", False] == (8, ids)
    assert counts["sync", True] == (4, ids[:4])
    assert counts["async", True] == (5, ids[:4])


def test_blocks_about_to_come_free_are_waited_for_not_preempted_for(tiny_family, monkeypatch):
    """A pool of 8 blocks of 4 tokens and two requests of 3-token prompts, 18 and 14 tokens long: the
    synchronous loop never preempts (the shorter one's blocks come back when it ends). Neither does
    the asynchronous one: when the next step would preempt, it reads the step in flight first, where
    the shorter one ends. Every preemption planned is counted, launched or not."""
    from deltafleet.serve.plan import Planner

    planned = []
    real = Planner._preempt

    def preempt(self, seq, plan):
        planned.append(seq)
        return real(self, seq, plan)

    monkeypatch.setattr(Planner, "_preempt", preempt)
    got = {}
    for async_on in (False, True):
        engine = _engine(tiny_family, async_on, max_batch=2, max_num_batched_tokens=32,
                         kv_cache={"block_size": BS, "max_tokens": 8 * BS})
        fed = []
        real_exec = engine.scheduler.runner.execute
        engine.scheduler.runner.execute = lambda step, prev=None: fed.append(len(step.tokens)) or real_exec(step, prev)
        ids = engine.encode_prompt(TEXT)[:3]
        jobs = [("tiny", ids, SamplingParams(max_tokens=m, temperature=0, ignore_eos=True)) for m in (18, 14)]
        planned.clear()
        got[async_on] = complete_together(engine, jobs), sum(fed), len(planned), engine.scheduler.preemptions
    assert got[True] == got[False]
    assert got[True][1:] == (36, 0, 0)  # every token fed once: 2 prompts of 3, 17 + 13 decode rows
    # under more pressure (6 blocks): preemptions happen, and each one planned is counted
    engine = _engine(tiny_family, True, max_batch=2, max_num_batched_tokens=32,
                     kv_cache={"block_size": BS, "max_tokens": 6 * BS})
    planned.clear()
    complete_together(engine, jobs)
    assert engine.scheduler.preemptions == len(planned) > 0


def test_a_request_cancelled_while_its_step_runs_gets_nothing_after_its_end(tiny_family):
    """Cancelled between two steps (the loop is held at the end of the first iteration that leaves the
    request with a token emitted and a step in flight), the request gets exactly the tokens emitted
    before: the token its launched step samples is dropped, no Step follows its end, and its row and
    variant are free for the next one."""
    engine = _engine(tiny_family, True, max_batch=1)
    sch = engine.scheduler
    paused, resume = _hold_loop(sch, lambda: sch._inflight is not None and any(s.n >= 1 for s in sch.planner.running))
    req = engine.prepare("tiny-coder", engine.encode_prompt("def "), SamplingParams(max_tokens=100, ignore_eos=True))
    out, cancel = sch.submit(req)
    assert paused.wait(60), "the request never had a token out and a step in flight"
    try:
        with engine._gen_lock:
            (seq,) = [s for s in sch.planner.running if s.out is out]
            emitted, inflight = seq.n, sch._inflight
            cancel.set()
    finally:
        resume.set()
    assert inflight is not None and seq in inflight.sampled  # the dropped token is real
    items = []
    while (item := out.get(timeout=30)) is not END:
        items.append(item)
    time.sleep(0.2)  # the steps in flight end meanwhile
    assert out.empty() and all(isinstance(i, Step) for i in items)
    assert len(items) == emitted and 1 <= emitted < 100
    assert items[-1].finish_reason is None  # the end came by the cancel, not a token
    wait_released(engine, "tiny-coder")
    r = engine.complete("tiny-writer", "The", SamplingParams(max_tokens=4, temperature=0))
    assert r.completion_tokens == 4 and r.finish_reason == "length"


def test_a_step_that_fails_ends_the_requests_in_flight_and_the_next_ones_run(tiny_family, monkeypatch):
    """The third step fails while the second is in flight: both requests in the batch get the error (as
    their exception), every block comes back, and the next request is answered."""
    engine = _engine(tiny_family, True, max_batch=4)
    runner, calls = engine.scheduler.runner, []
    real = runner.execute

    def execute(step, prev=None):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("device fault")
        return real(step, prev)

    runner.execute = execute
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    errors = []

    def go(model):
        try:
            engine.complete(model, "def ", params)
        except RuntimeError as e:
            errors.append(str(e))

    with engine._gen_lock:
        threads = [threading.Thread(target=go, args=(m,)) for m in ("tiny", "tiny-coder")]
        for t in threads:
            t.start()
        while sum(engine.scheduler.waiting().values()) < 2:
            time.sleep(0.01)
    for t in threads:
        t.join(60)
    assert errors == ["device fault"] * 2
    assert engine.scheduler.pool.free_blocks == engine.scheduler.pool.n_blocks and engine.scheduler._inflight is None
    assert engine.complete("tiny-writer", "The", params).completion_tokens == 6


def test_the_switch_is_checked(tiny_family):
    with pytest.raises(ValueError, match="async_scheduling must be true or false, got 'yes'"):
        _engine(tiny_family, "yes")

