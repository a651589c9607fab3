"""Continuous batching over one resident model: token-budget steps of mixed variants over a paged
KV cache (vLLM v1's engine core, at this size).

One thread runs the model. Requests wait in a queue per model id (the base and each variant). Each
step, :class:`~deltafleet.serve.plan.Planner` decides what runs: every running sequence decodes one
token, and the rest of the step's token budget prefills prompts — continuing long ones in chunks and
admitting waiting requests, the model queues in turn — so a new request never waits for other
prompts' prefills one by one and never stalls the running streams. KV blocks come from a
:class:`~deltafleet.serve.kv.BlockPool`; when they run out, admission waits and a sequence that must
grow preempts the latest admitted one (recomputed later), so the cache never overflows.
:class:`~deltafleet.serve.runner.ModelRunner` executes the step as one forward (decode rows and
prefill chunks, every variant) and the step's tokens are sampled together on the device with one
host synchronisation (serve/sampling.py). A request's variant is already on the device when it is
queued (``Engine.prepare`` loads it, single flight, in the request's own thread), so a variant being
loaded never holds up requests for the others.

Scheduling is asynchronous (vLLM's ``async_scheduling``, SGLang's overlap scheduler): step k + 1 is
planned, its inputs built and its forward and sampling queued on the device before step k's tokens
are read back, so the host's part of a step (planning, inputs, launches, emitting the tokens) runs
while the GPU computes the previous step instead of between steps. Every sequence step k samples is
assumed to go on: the planner advances at once and its sampled token is a placeholder
(:data:`~deltafleet.serve.plan.PENDING`) until read; step k + 1's decode rows take those tokens
from step k's output on the device (``StepInput.prev_rows``). A sequence whose last token step k
samples (``max_tokens``) is known on the host and planned no further (``Sequence.final``); one that
ends on a sampled token (eos, a stop token, a grammar's end) has one more row, in step k + 1, whose
token is dropped. A penalized sequence's token in flight is counted on the device. A sequence held
to a grammar needs its token on the host before its next mask (its matcher takes each token), and
the masks go through one pinned buffer: after a step sampled under masks, its tokens are read once
the next step's forward is launched, before its sampling. And before a
plan that would preempt, step k's tokens are read first, since the sequences that end in it give
blocks back (so it preempts only where the synchronous loop would). The tokens, their log-probabilities and the scored prompt rows of a step
come back in one copy to pinned memory, one buffer per step in flight. ``async_scheduling=False``
(and tensor parallelism, whose ranks are sent each step's tokens) reads each step's tokens before
planning the next. With ``late_planning`` (serve/pacing.py) the plan of step k + 1 waits, after a
decode step k, until what is left of k on the device is about the host's time to plan and launch,
so that requests arriving meanwhile join k + 1.

A sequence leaves when it ends (eos, a stop string, ``max_tokens``), its request is cancelled (the
client went away) or aborted (:meth:`Scheduler.abort`: the server shuts down); its blocks are free
for the next step and its hold on the variant ends.

Detokenizing is off the model's thread (vLLM v1's output processor, at this size): after each step
the scheduler hands the step's sampled ids, with what it decided at the token level (eos,
``max_tokens``, a row's failure, a request's end), to the ``detokenizer`` thread in one batch. That
thread turns ids into text with stop strings (serve/detokenize.py), puts each request's Steps in its
own thread-safe queue, in order, and then calls the step listeners (an :class:`Outbox` hands them to
the HTTP event loop). A stop string is found there, a step or two after its token was sampled: the
thread sends the final Step and asks the scheduler to end the sequence at its next step, and the
tokens sampled meanwhile are dropped. An error reaches every request it affects, as an exception
in its queue: a failed step ends every sequence in it; a failure of one row (its sampling or
detokenizing) ends that sequence alone. Under tensor parallelism a failed step fails the group
(serve/tp.py, ``TPContext.fail``): its sequences end with the group's error, and every other
request, waiting or running, and every later one, with :class:`EngineFailedError`.
"""
from __future__ import annotations

import logging
import queue
from collections import Counter
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from deltafleet.serve import sampling
from deltafleet.serve.detokenize import TextStream, token_bytes, token_name
from deltafleet.serve.kv import BlockPool
from deltafleet.serve.pacing import StepClock, decode_kind
from deltafleet.serve.plan import PENDING, Planner, Sequence, StepPlan
from deltafleet.serve.request import EngineFailedError, GenerationError, Step
from deltafleet.serve.runner import ModelRunner, StepInput
from deltafleet.serve.sampling import request_seed
from deltafleet.serve.transfer import upload

log = logging.getLogger(__name__)
END = object()  # the last item of a request's queue


class Group:
    """The requests of one HTTP request, its prompts and choices (:meth:`Scheduler.submit`): for
    :meth:`Scheduler.abort`, all have started once one of them has entered the batch, also after
    that one has ended."""

    __slots__ = ("started",)

    def __init__(self):
        self.started = False


@dataclass(eq=False)
class _Seq(Sequence):
    req: object = None                      # serve.engine.Request
    out: queue.Queue | None = None
    cancel: threading.Event | None = None
    on_start: Callable[[], None] | None = None
    text: TextStream | None = None
    seed: int = 0                           # the sampler's 64-bit seed (serve/sampling.py)
    enders: frozenset = frozenset()         # tokens that end it (eos unless ignored, its stop token ids)
    eos: frozenset = frozenset()            # the model's eos ids among them (none with ignore_eos)
    n: int = 0                              # tokens generated
    started: bool = False                   # on_start called (once, however often it is preempted)
    done: bool = False                      # it ends at the token level (eos, max_tokens, an error): retire it
    ended: bool = False                     # retired: blocks and variant given back, END sent
    finished: bool = False                  # (detokenizer) its last Step or error is sent; later tokens dropped
    stop_hit: bool = False                  # (detokenizer) a stop string ended it: the scheduler retires it
    scored: int = 0                         # prompt positions whose next token's log-probability is taken
    prompt_lp: list | None = None           # those log-probabilities, until the first Step carries them
    matcher: object = None                  # its grammar's matcher (serve/grammar.py), None without one
    abort: BaseException | None = None      # ended by :meth:`Scheduler.abort`: its error, sent before END
    group: Group | None = None              # the choices of one HTTP request share it (submit's); else its own

    @property
    def leaving(self) -> bool:
        """Cancelled, aborted or ended by a stop string: retired at the next step."""
        return self.cancel.is_set() or self.stop_hit or self.abort is not None


@dataclass
class _Copy:
    """A step's outputs on their way to the host (:meth:`Scheduler._copy_out`): the values (a pinned
    buffer, or already a list off CUDA), the event of their arrival (None off CUDA), and ``(tokens,
    (logprob rows, k) or None, (scored rows, k) or None)``."""
    values: object
    done: object
    shapes: tuple


@dataclass
class _Launched:
    """A step queued on the device (:meth:`Scheduler._launch`) whose tokens are not read yet."""
    plan: StepPlan
    sampled: list                      # the sequences that sample, in row order
    scored: list                       # (sequence, next prompt token) of the scored rows
    at: list[int]                      # where each sampled token goes in its sequence's tokens
    tokens: torch.Tensor | None        # the sampled tokens on the device (the next step's decode rows)
    copy: _Copy | None
    t0: float                          # when it was planned to launch
    launch: float                      # seconds ModelRunner.execute took
    n_tokens: int                      # tokens it fed
    masked: bool = False               # it sampled under grammars' masks (the pinned mask buffer)
    kind: tuple | None = None          # late planning: a decode step's kind (serve/pacing.py), None with prefill
    start: object = None               # late planning: a CUDA event recorded before its launch


def _held(seqs: list[_Seq]) -> list[int]:
    """The rows of ``seqs`` that sample under their grammar's mask (not those ended meanwhile: their
    rows are dropped)."""
    return [i for i, s in enumerate(seqs) if s.matcher is not None and not s.ended]


def _slot(req) -> int:
    """The variant slot a request runs with (serve/batch.py), −1 for the base."""
    return -1 if req.delta is None else req.delta.slot


class Scheduler:
    """Continuous batching for ``engine`` (see the module docstring).

    Args:
        engine: the :class:`~deltafleet.serve.engine.Engine` (its model, tokenizer, delta slots, release).
        max_batch: sequences running at once at most (decode rows of a step).
        max_seq_len: tokens per sequence (the model's context at most).
        n_blocks, block_size: the paged KV cache (``n_blocks · block_size`` tokens in all).
        token_budget: tokens a step feeds at most (decode rows + prefill chunks; ≥ ``max_batch``).
        cuda_graphs: on a CUDA device in one process, replay decode-only steps as CUDA graphs
            (serve/graphs.py).
        prefill_graphs: with ``cuda_graphs``, also steps with prefill chunks, as piecewise
            CUDA graphs of up to ``token_budget`` tokens.
        attention: the decode attention backend (serve/attention.py): ``auto``, ``flex``, ``sdpa``.
        delay_factor: admission pacing (serve/plan.py; 0: admit at once).
        long_prefill_token_threshold: a prompt's tokens a step at most (serve/plan.py; 0: the budget left).
        capture_at_start: capture every CUDA graph bucket here, before the scheduler thread starts.
        async_scheduling: plan and launch each step before the previous step's tokens are read (see
            the module docstring); off with tensor parallelism.
        late_planning: with ``async_scheduling`` on CUDA, plan each step after a decode step as late
            as that step's device time allows (serve/pacing.py), so that requests arriving while it
            runs join the next step rather than the one after.
    """

    def __init__(self, engine, max_batch: int, max_seq_len: int, n_blocks: int, block_size: int,
                 token_budget: int, cuda_graphs: bool = False, attention: str = "auto", delay_factor: float = 0.0,
                 prefill_graphs: bool = False, capture_at_start: bool = False, async_scheduling: bool = True,
                 late_planning: bool = False, long_prefill_token_threshold: int = 0):
        if max_batch < 1:
            raise ValueError(f"max_batch must be ≥ 1, got {max_batch}")
        self.engine, self.model = engine, engine.model
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        # Not with tensor parallelism: the other ranks run each step eagerly (serve/tp.py).
        graphs = cuda_graphs and engine.device.type == "cuda" and engine.tp is None
        self.runner = ModelRunner(self.model, engine.slots, n_blocks, block_size, max_batch, max_seq_len,
                                  cuda_graphs=graphs, attention=attention,
                                  prefill_graphs=token_budget if prefill_graphs else 0)
        self.pool = BlockPool(n_blocks, block_size)
        self.planner = Planner(self.pool, max_batch, token_budget, delay_factor,
                               long_prefill_token_threshold=long_prefill_token_threshold)
        self._cv = threading.Condition()  # guards the planner's queues (submit runs in request threads)
        self._refuse: BaseException | None = None  # set by abort(): every request submitted later gets it
        self.steps = 0  # steps run (tests, metrics)
        self.preemptions = 0
        self.max_rows_seen = 0  # most decode rows in one step
        # Not with tensor parallelism either: the other ranks are sent each step's tokens as lists.
        self.async_scheduling = async_scheduling and engine.tp is None
        self._inflight: _Launched | None = None  # the step launched last, its tokens not yet read
        # late planning (serve/pacing.py): the device times are CUDA events' (none elsewhere: no wait)
        self._clock = StepClock() if late_planning and self.async_scheduling else None
        self._running_since = 0.0  # when the step in flight started on the device, about
        self._finished_at = 0.0  # when the last step's tokens were read (step_observers' seconds)
        self._pinned: list[torch.Tensor] = []  # CUDA: where sampled tokens land on the host, one per step in flight
        self._launches = 0
        self._items: list[tuple] = []  # this step's work for the detokenizer (see _Detokenizer)
        self.detokenizer = _Detokenizer()
        # called after every step on this thread: (kind "decode" or "prefill", the step's seconds, the
        # seconds ModelRunner.execute took to prepare and launch it, the tokens it fed)
        self.step_observers: list[Callable[[str, float, float, int], None]] = []
        if capture_at_start and graphs:
            t0 = time.perf_counter()
            with torch.cuda.device(engine.device):  # cuda:N: capture on that device's streams
                n = self.runner.capture_graphs()
            log.info("captured %d CUDA graphs in %.1f s", n, time.perf_counter() - t0)
        threading.Thread(target=self._loop, name="scheduler", daemon=True).start()

    @property
    def graphs(self):
        return self.runner.graphs

    @property
    def running(self) -> list[_Seq]:
        return self.planner.running

    # ------------------------------------------------------------------ requests

    def submit(self, req, cancel: threading.Event | None = None, on_start: Callable[[], None] | None = None,
               out=None, group: Group | None = None) -> tuple[queue.Queue, threading.Event]:
        """Queue a prepared request; returns (where its items go: ``out``, an object with ``put(item)``,
        or a new ``queue.Queue``; its cancel event — set it to end the request after the current step).
        The items are its Steps, an exception if it fails, and :data:`END` last. Requests submitted
        with one ``group`` (the choices of one HTTP request) have started once one has (:meth:`abort`)."""
        seq = _Seq(req.model_id, list(req.prompt_ids), len(req.prompt_ids), req=req,
                   out=queue.Queue() if out is None else out, cancel=cancel or threading.Event(),
                   on_start=on_start, group=Group() if group is None else group)
        with self._cv:
            seq.abort = self._refuse
            self.planner.add(seq)
            self._cv.notify()
        return seq.out, seq.cancel

    def abort(self, error: BaseException, running: bool = False) -> None:
        """End the requests that have not started (and with ``running``, those that have) with
        ``error`` at the next step, and every request submitted from now on. A request has started
        once it, or another of its ``group``, has entered the batch. Their Steps so far stay
        delivered; ``error`` comes before END."""
        with self._cv:
            self._refuse = error
            for seq in self.planner.running:  # in the batch, though its launch (and on_start) may be to come
                seq.group.started = True
            # a preempted sequence waits again, but has started; so has a choice whose sibling has, even
            # one that has ended since
            for seq in [s for q in self.planner.waiting.values() for s in q] + self.planner.running:
                if running or not seq.group.started:
                    seq.abort = error
            self._cv.notify()

    def waiting(self) -> dict[str, int]:
        """Per model id with any: the sequences waiting for the batch, preempted ones included."""
        return self.load()[1]

    def load(self) -> tuple[dict[str, int], dict[str, int]]:
        """Per model id with any: the sequences in the batch (at most ``max_batch``) and those waiting
        for it, preempted ones included, as vLLM's ``num_requests_running`` and ``_waiting`` count."""
        with self._cv:
            running = Counter(seq.model_id for seq in self.planner.running)
            return dict(running), {m: len(q) for m, q in self.planner.waiting.items() if q}

    def add_step_listener(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` (in the detokenizer's thread) after every step's items are put: an
        :class:`Outbox` hands them to an event loop at once, not one wake-up per token."""
        self.detokenizer.listeners.append(fn)

    @property
    def late_planning_wait_s(self) -> float:
        """Seconds the loop has waited to plan late (``late_planning``; 0 without it)."""
        return 0.0 if self._clock is None else self._clock.waited_s

    @property
    def idle(self) -> bool:
        """No request waits or runs, and no step is in flight."""
        with self._cv:
            return self._inflight is None and not self.planner.running and not any(self.planner.waiting.values())

    def kv_usage(self) -> float:
        """The fraction of KV blocks in use."""
        return self.pool.usage

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        dev = self.engine.device
        if dev.type == "cuda" and dev.index is not None:
            # a new thread's current device is 0: the events this thread records and waits on (the
            # outputs' copies, the graphs' staging) are on the current device's stream
            torch.cuda.set_device(dev)
        while True:
            with self._cv:
                while self._inflight is None and not self.planner.running and not any(self.planner.waiting.values()):
                    self._cv.wait()
            if self._clock is not None:
                self._plan_late()
            t_plan = time.perf_counter()
            plan, launched, read = None, None, False
            try:
                with self.engine._gen_lock:  # the model is used by this thread only (tests can hold it)
                    self._drop_cancelled()
                    waited = False  # for the step in flight, before the launch: not the host's time
                    if self._inflight is not None and self.planner.must_preempt():
                        # the sequences that end in flight give their blocks back first: preempt as the
                        # synchronous loop would, not for blocks about to come free
                        self._finish_inflight()
                        self._drop_cancelled()
                        waited = True
                    with self._cv:
                        plan = self.planner.schedule()
                    self.preemptions += len(plan.preempted)
                    if plan.tokens:
                        waited |= self._inflight is not None and self._inflight.masked  # _launch reads it first
                        launched = self._launch(plan, self._inflight)
                        if self._clock is not None and not waited:
                            self._clock.observe_host(time.perf_counter() - t_plan, bool(plan.prefill))
                        if not self.async_scheduling:
                            self._finish(launched)
                            launched = None
                    if self._inflight is not None:  # its tokens, read while the GPU runs the step just launched
                        self._finish_inflight()
                        read = True
                    self._inflight = launched
                    if not read:  # launched on an idle device (else _finish stamped when the step before ended)
                        self._running_since = time.perf_counter()
                    # nothing fits (a prompt waits for blocks held by none), and no step ended to free any
                    if not plan.tokens and not plan.preempted and not read:
                        with self._cv:
                            self._cv.wait(0.01)
            except BaseException as e:  # noqa: BLE001 - reported to the requests of the failed steps
                tp = self.engine.tp
                if tp is None:
                    log.exception("scheduler step failed")
                else:  # a rank is gone, or the ranks are out of step: this server cannot generate any more
                    e = tp.fail(e)  # logged there, as one line
                inflight = self._inflight
                failed, self._inflight = [], None
                for p in (plan, launched and launched.plan, inflight and inflight.plan):
                    failed += [] if p is None else p.decode + [s for s, _, _ in p.prefill]
                failed = list(dict.fromkeys(failed))
                for seq in failed:
                    if not seq.done:
                        self._items.append(("error", seq, e))
                        seq.done = True
                self._retire(failed)
                if tp is not None:  # every other request, now and later, is refused
                    self.abort(EngineFailedError(tp.failed), running=True)
            items, self._items = self._items, []
            self.detokenizer.submit(items)

    def _plan_late(self) -> None:
        """Late planning (serve/pacing.py): while a decode step runs on the device, wait until what
        is left of it is the host's time to plan and launch the next step (and the margins), or
        until its tokens are in. While no request waits the next step is a decode step; once one
        waits it may be one with prefill chunks, whose launch takes longer, so the wait ends earlier
        (also when the request cannot be admitted yet: a shorter wait, never a late launch).
        Requests submitted meanwhile join that next step."""
        job = self._inflight
        if job is None or job.kind is None or job.masked:
            return
        t0 = time.perf_counter()
        running = t0 - self._running_since
        wait = self._clock.slack(job.kind, running)
        if wait <= 0.0:
            return
        done = job.copy.done if job.copy is not None else None
        decode_end, prefill_end = t0 + wait, t0 + self._clock.slack(job.kind, running, prefill=True)
        with self._cv:  # submit() notifies: a request that arrives moves the end to prefill_end
            while True:
                end = prefill_end if any(self.planner.waiting.values()) else decode_end
                if (left := end - time.perf_counter()) <= 0.0 or (done is not None and done.query()):
                    break
                self._cv.wait(left if done is None else min(left, 0.001))
        self._clock.waited_s += time.perf_counter() - t0

    def _finish_inflight(self) -> None:
        """:meth:`_finish` the step in flight (which stays in flight if that fails: its requests get
        the error)."""
        self._finish(self._inflight)
        self._inflight = None

    def _drop_cancelled(self) -> None:
        """End the requests cancelled or aborted since the last step, waiting or running, and those a
        stop string ended (found by the detokenizer)."""
        with self._cv:
            gone = [s for q in self.planner.waiting.values() for s in q if s.leaving]
            gone += [s for s in self.planner.running if s.leaving]
        for seq in gone:
            if seq.abort is not None and not seq.done and not seq.ended:
                self._items.append(("error", seq, seq.abort))
                seq.done = True
        self._retire(gone)

    def _launch(self, plan: StepPlan, prev: _Launched | None) -> _Launched:
        """Queue ``plan``'s step on the device: its forward, its sampling and the copy of its tokens to
        the host, without waiting for any of them. Decode rows whose last token ``prev`` sampled
        (still on the device) are fed it there. The planner advances at once: every sampled sequence
        gets a :data:`PENDING` token, which :meth:`_finish` replaces."""
        t0 = time.perf_counter()
        for seq, start, _ in plan.prefill:
            if not seq.started:
                self._start(seq)
        step, sampled, scored = self._inputs(plan, prev)
        copy = kind = start = None
        if self._clock is not None and not plan.prefill:  # late planning: time the decode steps
            kind = decode_kind(len(plan.decode), any(_slot(s.req) >= 0 for s in plan.decode))
            if self.engine.device.type == "cuda":
                start = torch.cuda.Event(enable_timing=True)
                start.record()
        with self.engine.collective(("step", step)), torch.inference_mode():
            t1 = time.perf_counter()
            logits = self.runner.execute(step, None if prev is None else prev.tokens)
            launch = time.perf_counter() - t1
            if prev is not None and prev is self._inflight and prev.masked:
                # prev sampled under grammars' masks: their matchers need its tokens before the next masks,
                # and its copy of the one pinned mask buffer must have run before the buffer is refilled.
                # Read them now, while the forward runs.
                self._finish_inflight()
            tokens = None
            masked = bool(_held(sampled))
            if sampled or scored:
                n = len(sampled)
                score = self._score(logits[n:], scored) if scored else None  # before sampling edits the logits
                tokens, lp = self._sample(logits[:n], sampled, prev) if sampled else (logits.new_zeros(0).long(), None)
                copy = self._copy_out(tokens, lp, score)
        self.steps += 1
        self.max_rows_seen = max(self.max_rows_seen, len(plan.decode))
        at = [len(s.tokens) for s in sampled]
        self.planner.advance(plan, dict.fromkeys(map(id, sampled), PENDING))
        for seq in sampled:
            seq.final = len(seq.tokens) - seq.prompt_len >= seq.req.max_tokens
        return _Launched(plan, sampled, scored, at, tokens, copy, t0, launch, len(step.tokens), masked, kind, start)

    def _finish(self, job: _Launched) -> None:
        """Read ``job``'s tokens (waiting for its step), put each in its sequence in place of its
        :data:`PENDING` token and emit it; retire the sequences that ended. Rows of sequences retired
        since it was launched are dropped."""
        tokens, lps, scores = self._read(job.copy) if job.copy is not None else ([], {}, [])
        if self._clock is not None:
            self._running_since = time.perf_counter()  # the step after it (if launched) runs from here
            if job.start is not None and not job.masked and job.copy is not None and job.copy.done is not None:
                # both events have run; a masked step's window holds the host's mask work
                self._clock.observe_device(job.kind, job.start.elapsed_time(job.copy.done) / 1e3)
        for (seq, target), (value, top) in zip(job.scored, scores):
            if seq.prompt_lp is None:
                seq.prompt_lp = []
            seq.prompt_lp.append((target, value, top[:seq.req.params.prompt_logprobs]))
        live = []
        for i, (seq, token, at) in enumerate(zip(job.sampled, tokens, job.at)):
            if seq.ended:  # cancelled, or a stop string, while its step ran
                continue
            seq.tokens[at] = token
            self._emit(seq, token, lps.get(i))
            live.append(seq)
        self._retire([s for s in live if s.done])
        now = time.perf_counter()
        seconds, self._finished_at = now - max(job.t0, self._finished_at), now  # pipelined: the steps' period
        if self.step_observers:
            kind = "prefill" if job.plan.prefill else "decode"
            for fn in self.step_observers:
                try:
                    fn(kind, seconds, job.launch, job.n_tokens)
                except Exception:  # noqa: BLE001 - an observer never stops the model thread
                    log.exception("a step observer failed")

    def _start(self, seq: _Seq) -> None:
        p, eng = seq.req.params, self.engine
        seq.started = seq.group.started = True
        seq.text = TextStream(eng.detokenizer, p.stop, eng._detok_lock, p.min_tokens, p.skip_special_tokens,
                              seq.req.prompt_ids)
        seq.eos = frozenset() if p.ignore_eos else frozenset(eng.eos_token_ids)
        seq.enders = frozenset(p.stop_token_ids) | seq.eos
        seq.seed = request_seed(p.seed if p.seed is not None else secrets.randbits(64))
        if seq.req.grammar is not None and seq.matcher is None:  # kept through a preemption: its tokens stay
            seq.matcher = eng.grammars.matcher(seq.req.grammar)
        if seq.on_start is not None:
            try:
                seq.on_start()
            except Exception as e:  # noqa: BLE001 - the caller's callback: its failure ends its own request
                log.error("on_start failed for a request on %s", seq.req.model_id, exc_info=e)
                self._items.append(("error", seq, e))
                seq.abort = e  # leaving: retired before the next step, its tokens of this one dropped

    def _inputs(self, plan: StepPlan, prev: _Launched | None = None) -> tuple[StepInput, list[_Seq], list]:
        """The step's flat batch (decode rows, then the chunks), the sequences that sample, in order, and
        the scored prompt positions. A decode row whose token ``prev`` sampled (:data:`PENDING` here)
        takes it from ``prev``'s tokens on the device (``StepInput.prev_rows``)."""
        pool, st = self.pool, StepInput()
        pending = {} if prev is None else {id(s): i for i, s in enumerate(prev.sampled)}
        for seq in plan.decode:
            pos = seq.computed
            token = seq.tokens[pos]
            if token == PENDING:
                st.prev_rows.append(pending[id(seq)])
                token = 0
            elif pending:
                st.prev_rows.append(-1)
            st.tokens.append(token)
            st.positions.append(pos)
            st.kv_slots += pool.slots(seq, pos, pos + 1)
            st.variants.append(_slot(seq.req))
            st.tables.append(pool.table(seq))  # read before the table next grows
        st.n_decode = len(plan.decode)
        st.sample = list(range(st.n_decode))
        sampled, scored = list(plan.decode), []
        # chunks of one variant side by side: their linears run as one call (StepInput.runs)
        for seq, start, stop in sorted(plan.prefill, key=lambda c: _slot(c[0].req)):
            first = len(st.tokens)
            st.tokens += seq.tokens[start:stop]
            st.positions += range(start, stop)
            st.kv_slots += pool.slots(seq, start, stop)
            st.variants += [_slot(seq.req)] * (stop - start)
            st.chunks.append((first, stop - start, start, pool.table(seq)))
            if stop == len(seq.tokens):
                st.sample.append(len(st.tokens) - 1)
                sampled.append(seq)
            if seq.req.params.prompt_logprobs is not None:  # each prompt position once (not again on a recompute)
                for p in range(max(start, seq.scored), min(stop, seq.prompt_len - 1)):
                    st.score.append(first + p - start)
                    scored.append((seq, seq.tokens[p + 1]))
                seq.scored = max(seq.scored, min(stop, seq.prompt_len - 1))
        return st, sampled, scored

    def _score(self, logits: torch.Tensor, scored: list) -> tuple:
        """The log-probability of each scored row's next prompt token, and its rows' likeliest tokens'
        (as many as the most any of them asks for), on the device."""
        logp = logits.log_softmax(-1)
        targets = upload([t for _, t in scored], torch.int64, logits.device)
        k = max(s.req.params.prompt_logprobs for s, _ in scored)
        chosen = logp.gather(1, targets[:, None])[:, 0]
        if k:
            top = logp.topk(k, -1)
            return chosen, top.values, top.indices
        empty = logp.new_zeros(len(scored), 0)
        return chosen, empty, empty.long()

    def _copy_out(self, tokens: torch.Tensor, lp: tuple | None = None, score: tuple | None = None) -> _Copy:
        """Start copying a step's sampled ``tokens``, the log-probabilities of the rows that asked for
        them and the scored rows' to the host; :meth:`_read` waits for them. On CUDA they go as one
        float64 tensor into pinned memory behind the step (one buffer per step in flight: the next
        step's copy cannot overwrite what is being read), and an event marks their arrival, which
        lets the HTTP thread run while the GPU works (a plain ``tolist`` would wait holding the
        interpreter)."""
        parts = [tokens.double()]
        if lp is not None:
            rows, chosen, top_lp, top_id = lp
            parts += [chosen.double(), top_lp.double().flatten(), top_id.double().flatten()]
        if score is not None:
            parts += [t.double().flatten() for t in score]
        flat = torch.cat(parts) if len(parts) > 1 else parts[0]
        shapes = (tokens.numel(), None if lp is None else (lp[0], lp[2].shape[1]),
                  None if score is None else (score[0].numel(), score[1].shape[1]))
        if flat.device.type != "cuda":
            return _Copy(flat.tolist(), None, shapes)
        n, i = flat.numel(), self._launches % 2
        self._launches += 1
        if len(self._pinned) <= i:
            self._pinned.append(torch.empty(0, dtype=torch.float64))
        if self._pinned[i].numel() < n:
            self._pinned[i] = torch.empty(max(n, 2 * self.max_batch), dtype=torch.float64, pin_memory=True)
        host = self._pinned[i][:n]
        host.copy_(flat, non_blocking=True)
        done = torch.cuda.Event(enable_timing=self._clock is not None)  # late planning times the steps
        done.record()
        return _Copy(host, done, shapes)

    @staticmethod
    def _read(copy: _Copy) -> tuple[list[int], dict, list]:
        """The sampled tokens of a :meth:`_copy_out`, the log-probabilities of the rows that asked for
        them (row → ``(logprob, [(id, logprob), …])``) and the scored rows' (``(logprob, [(id, logprob),
        …])`` in order), once they are on the host."""
        if copy.done is not None:
            copy.done.synchronize()
        values = copy.values if isinstance(copy.values, list) else copy.values.tolist()
        b, lp, score = copy.shapes
        out = [int(v) for v in values[:b]]
        at = b

        def unpack(r: int, k: int) -> list[tuple]:
            nonlocal at
            chosen, tl, ti = values[at:at + r], values[at + r:at + r + r * k], values[at + r + r * k:at + r + 2 * r * k]
            at += r + 2 * r * k
            return [(chosen[j], [(int(ti[j * k + c]), tl[j * k + c]) for c in range(k)]) for j in range(r)]

        lps = dict(zip(lp[0], unpack(len(lp[0]), lp[1]))) if lp is not None else {}
        scores = unpack(*score) if score is not None else []
        return out, lps, scores

    def _sample(self, logits: torch.Tensor, seqs: list[_Seq], prev: _Launched | None = None
                ) -> tuple[torch.Tensor, tuple | None]:
        """The next token of each of ``seqs`` from ``logits`` ``[B, V]`` (serve/sampling.py), −1 for a
        row whose logits are not finite; a token is drawn at position ``len(seq.tokens)``. Also, for
        the rows that ask for log-probabilities, ``(rows, sampled token's, top values, top ids)`` of
        the model's own log-softmax (None if no row asks), all on the device. A penalized row's last
        output token, if ``prev`` sampled it (still :data:`PENDING` here), is counted from ``prev``'s
        tokens on the device."""
        # before min_tokens, the tokens that would end a row cannot be drawn (a grammar's end decides for its rows)
        # (len(tokens) − prompt_len: the tokens sampled so far, those of a step in flight included)
        banned = [(i, t) for i, s in enumerate(seqs)
                  if len(s.tokens) - s.prompt_len < s.req.params.min_tokens and s.matcher is None for t in s.enders]
        penalties, fed, rows_of = [], [], None
        for i, s in enumerate(seqs):
            p = s.req.params
            if p.penalized:  # the output's counts, and the prompt's tokens (count 0) for the repetition penalty
                out = s.tokens[s.prompt_len:]
                if out and out[-1] == PENDING:  # sampled by the step in flight: counted on the device
                    rows_of = rows_of or {id(q): j for j, q in enumerate(prev.sampled)}
                    fed.append((i, rows_of[id(s)], p.repetition_penalty, p.frequency_penalty, p.presence_penalty))
                    out = out[:-1]
                seen = Counter(out)
                if p.repetition_penalty != 1.0:
                    seen.update(dict.fromkeys(set(s.tokens[:s.prompt_len]) - seen.keys(), 0))
                penalties += [(i, t, c, p.repetition_penalty, p.frequency_penalty, p.presence_penalty)
                              for t, c in seen.items()]
        min_p = [s.req.params.min_p for s in seqs] if any(s.req.params.min_p > 0 for s in seqs) else None
        held = _held(seqs)
        if held:  # the grammars' allowed tokens, written while the GPU runs the forward (before any copy waits)
            bitmask = self.engine.grammars.bitmask(len(seqs), pinned=logits.is_cuda)  # free rows: every token
            self.engine.grammars.fill([seqs[i].matcher for i in held], bitmask, held)
        batch = sampling.SamplingBatch.build(
            [(s.req.params.temperature, s.req.params.top_p, s.req.params.top_k, s.seed, len(s.tokens))
             for s in seqs], logits.device, banned, penalties, min_p, (fed, prev.tokens) if fed else None)
        if held:
            # pinned on CUDA: the copy queues behind the forward without holding the host (the buffer is
            # reused next step, after this step's tokens are read: _launch reads them before sampling)
            batch.allowed = bitmask.to(logits.device, non_blocking=True)
        want = [i for i, s in enumerate(seqs) if s.req.params.logprobs is not None]
        lp = None
        if want:  # the model's own distribution, before penalties, bans and truncation change the logits
            rows = upload(want, torch.int64, logits.device)
            k = max(seqs[i].req.params.logprobs for i in want)
            logp = logits[rows].log_softmax(-1)
            top = logp.topk(k, -1) if k else None
        tokens = sampling.sample(logits, batch)
        if want:
            chosen = logp.gather(1, tokens[rows].clamp(min=0)[:, None])[:, 0]
            empty = logp.new_zeros(len(want), 0)
            lp = (want, chosen, top.values if k else empty, top.indices if k else empty.long())
        return tokens, lp

    def _emit(self, seq: _Seq, token: int, lp: tuple | None = None) -> None:
        """Queue ``seq``'s sampled ``token`` for the detokenizer, with its end at the token level: eos
        (unless the request ignores it) or one of its stop token ids, ``max_tokens`` (or a cancelled
        request), or −1 (its logits were not finite: an error for ``seq`` alone)."""
        if token < 0:
            err = GenerationError("the model's next-token logits for this request are not finite (NaN or inf)")
            self._items.append(("error", seq, err))
            seq.done = True
            return
        seq.n += 1
        if seq.matcher is not None and not seq.matcher.accept_token(token):  # the sampler kept it to the grammar
            err = GenerationError(f"token {token} is outside the request's grammar")
            self._items.append(("error", seq, err))
            seq.done = True
            return
        if token in seq.enders or (seq.matcher is not None and seq.matcher.is_terminated()):
            end = "eos"  # finish "stop", the token left out of the text
        elif seq.n >= seq.req.max_tokens or seq.cancel.is_set():
            end = "length"
        else:
            end = None
        self._items.append(("token", seq, token, end, lp, seq.prompt_lp))
        seq.prompt_lp = None
        seq.done = end is not None

    def _retire(self, seqs: list[_Seq]) -> None:
        """End ``seqs``: their blocks go back, their hold on the variant ends, their queue ends."""
        with self._cv:
            seqs = [s for s in seqs if not s.ended]
            for seq in seqs:
                seq.ended = True
                self.planner.finish(seq)
        for seq in seqs:
            self.engine.release(seq.req)
            self._items.append(("end", seq))


class _Detokenizer:
    """The thread that turns each step's sampled ids into Steps and delivers every item of every
    request, in order (see the module docstring). Work comes as one list per step of

    - ``("token", seq, token, end, logprobs, prompt logprobs)``: ``end`` None (the sequence goes
      on), ``"eos"`` or ``"length"``; ``logprobs`` ``(logprob, [(id, logprob), …])`` or None; the
      prompt's ``[(next prompt token, logprob, [(id, logprob), …]), …]`` (first Step only) or None;
    - ``("error", seq, exception)``: the sequence failed (sent unless its last Step went already);
    - ``("end", seq)``: the sequence is retired: :data:`END`.

    After each list it calls :attr:`listeners`."""

    def __init__(self):
        self.listeners: list[Callable[[], None]] = []
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="detokenizer", daemon=True).start()

    def submit(self, items: list[tuple]) -> None:
        if items:
            self._work.put(items)

    def _loop(self) -> None:
        while True:
            for item in self._work.get():
                try:
                    self._handle(item)
                except Exception:  # noqa: BLE001 - never let one item stop every request's output
                    log.exception("delivering an item failed")
            for fn in self.listeners:
                try:
                    fn()
                except Exception:  # noqa: BLE001
                    log.exception("a step listener failed")

    def _handle(self, item: tuple) -> None:
        kind, seq = item[0], item[1]
        if kind == "end":
            seq.out.put(END)
            return
        if seq.finished:  # a stop string ended it: tokens sampled since are dropped
            return
        if kind == "error":
            seq.finished = True
            seq.out.put(item[2])
            return
        token, end, lp, prompt_lp = item[2], item[3], item[4], item[5]
        try:
            if end == "eos":  # vLLM's stop_reason: a stop token id, not the model's eos (checked first, as
                # vLLM does: also where it is a stop token id too) or a grammar's end
                stop = token if token in seq.req.params.stop_token_ids and token not in seq.eos else None
                step = Step(token, seq.text.flush()[0], "stop", stop_reason=stop)
            else:
                piece, stopped = seq.text.push(token)
                if not stopped and end == "length":
                    rest, stopped = seq.text.flush()
                    piece += rest
                step = Step(token, piece, "stop" if stopped else end, stop_reason=seq.text.matched)  # None unstopped
        except Exception as e:  # noqa: BLE001 — this row's own failure ends this request only
            log.error("detokenizing failed for a request on %s", seq.req.model_id, exc_info=e)
            seq.finished = seq.stop_hit = True
            seq.out.put(e)
            return
        if lp is not None:  # the token and the likeliest ones decoded alone, here, off the model thread
            top = lp[1][:seq.req.params.logprobs]
            ids = [token] + [i for i, _ in top]
            with seq.text.lock:
                step.token_bytes = token_bytes(seq.text.tokenizer, ids)
            strs = [token_name(b) for b in step.token_bytes]
            step.logprob, step.token_str = lp[0], strs[0]
            step.top_logprobs = [(s, v) for s, (_, v) in zip(strs[1:], top)]
        if prompt_lp is not None:
            with seq.text.lock:
                own = [token_bytes(seq.text.tokenizer, [t] + [i for i, _ in top]) for t, _, top in prompt_lp]
            step.prompt_logprobs = [(token_name(b[0]), v, [(token_name(c), w) for c, (_, w) in zip(b[1:], top)])
                                    for b, (_, v, top) in zip(own, prompt_lp)]
        seq.out.put(step)
        if step.finish_reason is not None:
            seq.finished = True
            seq.stop_hit = end is None  # ended by a stop string: the scheduler retires it next step


class Outbox:
    """Items for the requests of one asyncio event loop, handed to it once per step.

    A request's items go to ``outbox.sink(queue, on_end)`` (its ``out`` in :meth:`Scheduler.submit`);
    :meth:`flush` (a step listener) passes everything put since the last flush to the loop in one
    ``call_soon_threadsafe``, which puts each item in its ``asyncio.Queue`` (:data:`END` last, after
    calling the sink's ``on_end`` there). One wake-up of the loop per step, and no
    thread per request.
    """

    def __init__(self, loop):
        self.loop = loop
        self._pending: list = []
        self._lock = threading.Lock()

    def sink(self, queue, on_end: Callable[[], None] | None = None) -> _Sink:
        return _Sink(self, queue, on_end)

    def flush(self) -> None:
        with self._lock:
            items, self._pending = self._pending, []
        if items:
            try:
                self.loop.call_soon_threadsafe(self._deliver, items)
            except RuntimeError:  # the loop is closed: the server is shutting down
                pass

    def _deliver(self, items: list) -> None:
        for sink, item in items:
            if item is END and sink.on_end is not None:
                sink.on_end()
            sink.queue.put_nowait(item)


class _Sink:
    def __init__(self, outbox: Outbox, queue, on_end):
        self.outbox, self.queue, self.on_end = outbox, queue, on_end

    def put(self, item) -> None:
        with self.outbox._lock:
            self.outbox._pending.append((self, item))
