"""Continuous batching (serve/scheduler.py): requests for the base and different variants decode
in the same steps and give exactly what each gives alone; a slow variant load holds up no one;
a cancelled request frees its row and its variant at once; more requests than rows wait their turn."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from deltafleet.serve.batch import DeltaSlots
from deltafleet.serve.engine import Engine, SamplingParams
from tests.conftest import complete_together, wait_released

PROMPTS = {"tiny": "def main(", "tiny-coder": "import os\nimport", "tiny-writer": "The quick brown"}


def _engine(fam, **kw) -> Engine:
    return Engine(fam.base_dir, fam.artifacts_dir, family="tiny", **kw)


@pytest.fixture(scope="module")
def alone(tiny_family) -> dict:
    """Each request run with a batch of one: the reference."""
    e = _engine(tiny_family, max_batch=1)
    out = {}
    for m, p in PROMPTS.items():
        out[(m, "greedy")] = e.complete(m, p, SamplingParams(max_tokens=10, temperature=0)).token_ids
        out[(m, "seeded")] = e.complete(m, p, SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9,
                                                             seed=5)).token_ids
    return out


def test_mixed_variants_decode_together_and_match_running_alone(tiny_family, alone):
    engine = _engine(tiny_family, max_batch=8)
    jobs = [(m, SamplingParams(max_tokens=10, temperature=0)) for m in PROMPTS] + \
        [(m, SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=5)) for m in PROMPTS]
    got = complete_together(engine, [(m, PROMPTS[m], p) for m, p in jobs])
    for (m, p), ids in zip(jobs, got):
        assert ids == alone[(m, "greedy" if p.temperature == 0 else "seeded")], m
    assert engine.scheduler.max_rows_seen == 6  # all six decoded in the same steps
    assert engine.scheduler.steps <= 10  # 10 tokens each: about one step per token, not per request
    assert len({tuple(alone[(m, "greedy")]) for m in PROMPTS}) == 3  # the variants really differ


def test_more_requests_than_rows_wait_for_a_free_row(tiny_family, alone):
    engine = _engine(tiny_family, max_batch=2)
    jobs = [(m, SamplingParams(max_tokens=10, temperature=0)) for m in PROMPTS] * 2
    got = complete_together(engine, [(m, PROMPTS[m], p) for m, p in jobs])
    for (m, _), ids in zip(jobs, got):
        assert ids == alone[(m, "greedy")]
    assert engine.scheduler.max_rows_seen == 2


def test_a_slow_variant_load_does_not_hold_up_other_requests(tiny_family, monkeypatch):
    engine = _engine(tiny_family)
    gate, started = threading.Event(), threading.Event()
    real = engine.cache._read

    def slow(model_id):
        if model_id == "tiny-coder":
            started.set()
            assert gate.wait(30)
        return real(model_id)

    monkeypatch.setattr(engine.cache, "_read", slow)
    done = []
    t = threading.Thread(target=lambda: done.append(engine.complete("tiny-coder", "x", SamplingParams(max_tokens=3))))
    t.start()
    assert started.wait(30), "tiny-coder's load never started"  # it has started and is blocked
    t0 = time.perf_counter()
    base = engine.complete("tiny", "def main(", SamplingParams(max_tokens=5, temperature=0))
    writer = engine.complete("tiny-writer", "The", SamplingParams(max_tokens=5, temperature=0))
    assert base.completion_tokens == 5 and writer.completion_tokens == 5
    assert time.perf_counter() - t0 < 20 and not done  # while tiny-coder is still loading
    gate.set()
    t.join(30)
    assert done and done[0].completion_tokens >= 1


def test_a_cancelled_request_frees_its_row_and_its_variant(tiny_family):
    engine = _engine(tiny_family, max_batch=1)
    req = engine.prepare("tiny-coder", engine.encode_prompt("def "), SamplingParams(max_tokens=100))
    gen = engine.run(req)
    first = next(gen)
    assert first.finish_reason is None
    gen.close()  # the client went away
    wait_released(engine, "tiny-coder")
    # the one row is free again: the next request runs to its end
    r = engine.complete("tiny-writer", "The", SamplingParams(max_tokens=4, temperature=0))
    assert r.completion_tokens == 4 and r.finish_reason == "length"


def test_bad_batch_size_is_named(tiny_family):
    with pytest.raises(ValueError, match="max_batch must be ≥ 1, got 0"):
        _engine(tiny_family, max_batch=0)
    for bad in (-0.5, float("inf"), "0.5"):
        with pytest.raises(ValueError, match=f"scheduler_delay_factor must be a finite number ≥ 0, got {bad!r}"):
            _engine(tiny_family, scheduler_delay_factor=bad)


def test_paced_admission_answers_as_alone(tiny_family, alone):
    """With admission paced (``scheduler_delay_factor``), requests arriving while others decode still
    get exactly what they get alone."""
    engine = _engine(tiny_family, max_batch=4, scheduler_delay_factor=1.0)
    jobs = [(m, SamplingParams(max_tokens=10, temperature=0)) for m in PROMPTS] * 2
    got = complete_together(engine, [(m, PROMPTS[m], p) for m, p in jobs])
    for (m, _), ids in zip(jobs, got):
        assert ids == alone[(m, "greedy")]


def test_variant_slots_are_overwritten_in_place(tiny_family):
    """A captured graph reads the slots' stacked tensors at fixed addresses: put and free must never
    reallocate them (serve/graphs.py relies on it instead of re-capturing)."""
    engine = _engine(tiny_family, max_batch=1)
    slots = DeltaSlots(engine.model, n_slots=1)
    tensors = [*slots.signs.values(), *slots.alphas.values(), *slots.full.values()]
    ptrs = [t.data_ptr() for t in tensors]
    before = [t.clone() for t in tensors]
    view = slots.put(engine.get_delta("tiny-coder"))
    assert any(not torch.equal(t, b) for t, b in zip(tensors, before))  # the variant went into these tensors
    slots.free(view)
    slots.put(engine.get_delta("tiny-writer"))
    assert [t.data_ptr() for d in (slots.signs, slots.alphas, slots.full) for t in d.values()] == ptrs


class _EagerGraph:
    """A stand-in for a captured CUDA graph on the CPU: "replay" runs the padded step eagerly into
    the output tensor, as the real graph writes into its captured output."""

    def __init__(self, graphs, bucket: int, with_deltas: bool, block_m: int | None):
        self.step = lambda: graphs.forward_padded(bucket, with_deltas, block_m)
        self.out = self.step()

    def replay(self) -> None:
        self.out.copy_(self.step())

    @classmethod
    def capture(cls, graphs, bucket: int, with_deltas: bool, block_m: int | None = None):
        graph = cls(graphs, bucket, with_deltas, block_m)
        return graph, graph.out, None


def test_the_scheduler_graph_path_matches_running_alone(tiny_family, alone, monkeypatch):
    """The scheduler's graph branch (static inputs, buckets, graph per bucket, logits of the real
    rows) with the capture replaced by an eager stand-in: every step goes through it and each
    request gives what it gives alone."""
    from deltafleet.serve.graphs import DecodeGraphs

    engine = _engine(tiny_family, max_batch=8)
    sch = engine.scheduler
    with engine._gen_lock:  # the scheduler thread is idle: give its runner graphs
        sch.runner.graphs = DecodeGraphs(sch.runner)
        monkeypatch.setattr(sch.graphs, "capturable", lambda with_deltas: True)
        monkeypatch.setattr(sch.graphs, "_capture", lambda b, d, bm: _EagerGraph.capture(sch.graphs, b, d, bm))
    jobs = [(m, SamplingParams(max_tokens=10, temperature=0)) for m in PROMPTS] + \
        [(m, SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=5)) for m in PROMPTS]
    got = complete_together(engine, [(m, PROMPTS[m], p) for m, p in jobs])
    for (m, p), ids in zip(jobs, got):
        assert ids == alone[(m, "greedy" if p.temperature == 0 else "seeded")], m
    # 6 rows ran in the bucket of 8 (no block size: rows are grouped from 9 on, and on a GPU only)
    assert sch.max_rows_seen == 6 and (8, True, None) in sch.graphs.graphs
    prefill_steps = sch.steps - sch.graphs.replays
    assert sch.graphs.replays >= 9 and 1 <= prefill_steps <= 3  # every decode-only step went through the graph path
    scratch = sch.runner.cache.scratch_block * sch.runner.block_size
    assert not sch.runner.cache.k[:, :, scratch + 1:].any()  # padding wrote position 0 of the scratch block only


def test_a_failed_capture_falls_back_to_eager_decoding(tiny_family, alone, monkeypatch):
    from deltafleet.serve.graphs import DecodeGraphs

    engine = _engine(tiny_family, max_batch=2)
    sch = engine.scheduler
    calls = []

    def fail(bucket, with_deltas, block_m):
        calls.append((bucket, with_deltas, block_m))
        raise RuntimeError("operation not permitted when stream is capturing")

    with engine._gen_lock:
        sch.runner.graphs = DecodeGraphs(sch.runner)
        monkeypatch.setattr(sch.graphs, "capturable", lambda with_deltas: True)
        monkeypatch.setattr(sch.graphs, "_capture", fail)
    got = engine.complete("tiny-coder", PROMPTS["tiny-coder"], SamplingParams(max_tokens=10, temperature=0))
    assert got.token_ids == alone[("tiny-coder", "greedy")]  # the failed step too, eagerly
    assert calls == [(1, True, None)] and sch.graphs is None  # tried once, then graphs are off


def test_text_is_made_off_the_model_thread_and_a_stop_string_ends_the_sequence(tiny_family, monkeypatch):
    """Every token is detokenized on the ``detokenizer`` thread, never the scheduler's; a stop string
    found there ends the request with the text before it, no token past it reaches the client, and
    the sequence's row and blocks are free again."""
    from deltafleet.serve import detokenize

    engine = _engine(tiny_family, max_batch=2)
    full = engine.complete("tiny-coder", PROMPTS["tiny-coder"], SamplingParams(max_tokens=24, temperature=0))
    text = full.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop and text.find(stop) > 0
    threads = set()
    real = detokenize.TextStream.push
    monkeypatch.setattr(detokenize.TextStream, "push",
                        lambda self, t: threads.add(threading.current_thread().name) or real(self, t))
    req = engine.prepare("tiny-coder", engine.encode_prompt(PROMPTS["tiny-coder"]),
                         SamplingParams(max_tokens=24, temperature=0, stop=[stop]))
    steps = list(engine.run(req))
    assert threads == {"detokenizer"}
    assert "".join(s.text for s in steps) == text[:text.find(stop)]
    assert steps[-1].finish_reason == "stop" and all(s.finish_reason is None for s in steps[:-1])
    assert [s.token_id for s in steps] == full.token_ids[:len(steps)]  # nothing sampled after the stop was sent
    deadline = time.time() + 30
    while engine.scheduler.running or engine.scheduler.pool.usage:
        assert time.time() < deadline
        time.sleep(0.01)


def test_a_sequence_detokenizes_from_its_prompts_last_tokens(tiny_family, monkeypatch):
    """Each sequence's text stream starts from the last ``CONTEXT_TOKENS`` of its prompt (its first
    word's space and a character the prompt leaves open: serve/detokenize.py)."""
    from deltafleet.serve import detokenize

    engine = _engine(tiny_family, max_batch=2)
    contexts = []
    real = detokenize.TextStream.__init__
    monkeypatch.setattr(detokenize.TextStream, "__init__",
                        lambda self, *a, **kw: real(self, *a, **kw) or contexts.append(self.ids[:self.given]))
    ids = engine.encode_prompt("import os\nimport sys\nimport json\n")
    assert len(ids) > detokenize.CONTEXT_TOKENS
    engine.complete("tiny-coder", ids, SamplingParams(max_tokens=2, temperature=0))
    engine.complete("tiny", ids[:2], SamplingParams(max_tokens=2, temperature=0))
    assert contexts == [ids[-detokenize.CONTEXT_TOKENS:], ids[:2]]


def test_a_drain_refuses_what_has_not_started_and_keeps_a_request_with_a_choice_running(tiny_family):
    """``Engine.drain`` (a shutdown's start) ends the requests that have not started with its error, and
    every later one (``prepare`` raises it). Found by a fresh user: a request of two choices with one
    in the batch and one waiting was refused as a whole, throwing away the running choice. Choices of
    one group have started once one has: both go on and end as they would have."""
    from deltafleet.serve.request import ServerShuttingDownError
    from deltafleet.serve.scheduler import END, Group

    engine = _engine(tiny_family, max_batch=1)
    sch = engine.scheduler
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    ids = engine.encode_prompt(PROMPTS["tiny-coder"])
    started = threading.Event()
    with engine._gen_lock:  # no step runs until all are queued
        group = Group()
        a = sch.submit(engine.prepare("tiny-coder", ids, params), on_start=started.set, group=group)[0]
        b = sch.submit(engine.prepare("tiny-coder", ids, params), group=group)[0]
        alone = sch.submit(engine.prepare("tiny-writer", ids, params))[0]
        late = engine.prepare("tiny", ids, params)  # prepared before the drain, submitted after it
    assert started.wait(30)
    error = ServerShuttingDownError("shutting down")
    engine.drain(error)
    with pytest.raises(ServerShuttingDownError, match="shutting down"):
        engine.prepare("tiny", ids, params)
    late = sch.submit(late)[0]

    def items(out):
        got = []
        while (item := out.get(timeout=60)) is not END:
            got.append(item)
        return got

    assert items(alone) == [error] and items(late) == [error]  # never started
    want = _engine(tiny_family, max_batch=1).complete("tiny-coder", PROMPTS["tiny-coder"], params).token_ids
    for out in (a, b):
        got = items(out)
        assert [s.token_id for s in got] == want and got[-1].finish_reason == "length"
    wait_released(engine, "tiny-coder")
    assert sch.idle


def _items(out) -> list:
    """Every item of a submitted request's queue, up to its END."""
    from deltafleet.serve.scheduler import END

    got = []
    while (item := out.get(timeout=60)) is not END:
        got.append(item)
    return got


def test_a_drain_keeps_a_waiting_choice_whose_sibling_has_ended(tiny_family):
    """A choice of a request is started once another has entered the batch, also once that one has
    ended: a drain lets it run. Found by a review: the started groups were read off the waiting and
    running sequences only, so a choice still waiting behind a full batch (``max_batch=1``) got the
    shutdown's error once its sibling had finished."""
    from deltafleet.serve.request import ServerShuttingDownError
    from deltafleet.serve.scheduler import Group

    engine = _engine(tiny_family, max_batch=1)
    sch = engine.scheduler
    ids = engine.encode_prompt(PROMPTS["tiny-coder"])
    group, started = Group(), threading.Event()
    with engine._gen_lock:
        a = sch.submit(engine.prepare("tiny-coder", ids, SamplingParams(max_tokens=1, temperature=0,
                                                                        ignore_eos=True)), group=group)[0]
        other = sch.submit(engine.prepare("tiny-writer", ids, SamplingParams(max_tokens=40, temperature=0,
                                                                             ignore_eos=True)))[0]
        b = sch.submit(engine.prepare("tiny-coder", ids, SamplingParams(max_tokens=3, temperature=0,
                                                                        ignore_eos=True)),
                       on_start=started.set, group=group)[0]
    first = _items(a)
    assert [s.finish_reason for s in first] == ["length"]
    error = ServerShuttingDownError("shutting down")
    with engine._gen_lock:  # no step between the check and the drain
        assert not started.is_set()  # b still waits behind the other request's 40 tokens
        engine.drain(error)
    got = _items(b)
    assert [type(s).__name__ for s in got] == ["Step"] * 3 and got[-1].finish_reason == "length"
    assert len(_items(other)) == 40  # in the batch at the drain: it goes on


def test_a_drain_between_a_plan_and_its_launch_keeps_the_request_the_plan_admitted(tiny_family):
    """A request the planner has put in the batch has started, though its step (and ``on_start``) is
    still to be launched: a drain in that moment lets it run. Found by a review: ``started`` was set
    at the launch, outside the lock the drain takes, so the request was refused after its prefill
    ran and its ``on_start`` had counted it as started."""
    from deltafleet.serve.request import ServerShuttingDownError

    engine = _engine(tiny_family, max_batch=1)
    sch = engine.scheduler
    error = ServerShuttingDownError("shutting down")
    real, drained = sch.planner.schedule, []

    def schedule():  # (called under the scheduler's lock, as Engine.drain's abort is)
        plan = real()
        if plan.prefill and not drained:  # the request is in the batch now, not yet launched
            drained.append(True)
            sch.abort(error)
        return plan

    sch.planner.schedule = schedule
    started = threading.Event()
    ids = engine.encode_prompt(PROMPTS["tiny"])
    got = _items(sch.submit(engine.prepare("tiny", ids, SamplingParams(max_tokens=4, temperature=0,
                                                                         ignore_eos=True)),
                            on_start=started.set)[0])
    assert drained and started.is_set()
    assert [type(s).__name__ for s in got] == ["Step"] * 4 and got[-1].finish_reason == "length"


@pytest.fixture(scope="module")
def four_rows(tiny_family) -> Engine:
    return _engine(tiny_family, max_batch=4)


def test_a_prompt_id_outside_the_vocabulary_is_refused_before_the_batch(four_rows):
    """The in-process API checks prompt ids as HTTP does (``encode_prompt``): an id past the vocabulary
    is the request's own 400, and a request decoding beside it is not touched (in a step the id would
    fail every request of it, and on CUDA the device)."""
    from deltafleet.serve.request import InvalidRequestError

    eng = four_rows
    good = eng.generate("tiny", eng.encode_prompt("def main("), SamplingParams(max_tokens=20, temperature=0,
                                                                              ignore_eos=True))
    next(good)
    vocab = eng.model.args.vocab_size
    for ids in ([5, vocab + 7], [-1, 5]):
        with pytest.raises(InvalidRequestError, match=rf"prompt token ids out of range \[0, {vocab}\): "
                                                      rf"\[{ids[0] if ids[0] < 0 else ids[1]}\]"):
            eng.prepare("tiny", ids, SamplingParams(max_tokens=3))
    assert len(list(good)) == 19


@pytest.mark.parametrize("max_tokens", [0, -2])
def test_max_tokens_below_one_is_refused(four_rows, max_tokens):
    """The prompt's prefill samples a token: ``max_tokens`` 0 would get one anyway (vLLM's
    SamplingParams refuses it too); HTTP's ``echo`` with 0 asks the engine for one and drops it."""
    from deltafleet.serve.request import InvalidRequestError

    with pytest.raises(InvalidRequestError, match=rf"max_tokens must be at least 1, got {max_tokens}") as e:
        four_rows.prepare("tiny", four_rows.encode_prompt("def main("), SamplingParams(max_tokens=max_tokens))
    assert e.value.param == "max_tokens"


def test_an_on_start_callback_that_raises_ends_its_own_request_alone(four_rows):
    """``Engine.run``'s ``on_start`` runs in the scheduler's thread as the request enters the batch: its
    exception is that request's error, and a request decoding in the same steps runs on to its end."""
    eng = four_rows
    good = eng.generate("tiny-coder", eng.encode_prompt("import os\nimport"),
                        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    next(good)

    def boom():
        raise RuntimeError("on_start callback failed")

    req = eng.prepare("tiny", eng.encode_prompt("The quick"), SamplingParams(max_tokens=3, temperature=0))
    with pytest.raises(RuntimeError, match="on_start callback failed"):
        list(eng.run(req, on_start=boom))
    assert len(list(good)) == 29
    wait_released(eng, "tiny-coder")
    assert eng.complete("tiny", "The quick", SamplingParams(max_tokens=3, temperature=0)).token_ids
