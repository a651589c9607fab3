"""Continuous batching over one resident model, rows of different variants in each step.

One thread runs the model. Requests wait in a queue per model id (the base and each variant); at
every step the scheduler admits waiting requests into free rows of a static KV cache, taking the
variant queues in turn (round robin, so a busy variant cannot starve a quiet one), prefills each
admitted prompt on its own with its own variant, then advances every running sequence by one
token in a single batched forward (``Transformer.forward_rows``: one
``bitdelta_linear_batched`` per linear for all rows and their variants). A request's variant is
already on the device when it is queued (``Engine.prepare`` loads it, single flight, in the
request's own thread), so a variant being loaded never holds up requests for the others.

A sequence leaves the batch when it ends (eos, a stop string, ``max_tokens``) or its request is
cancelled (the client went away); its cache row is free for the next request at once, and its
hold on the variant ends (it may then be evicted). Steps reach each request through its own
thread-safe queue, so the HTTP layer streams them as they come. An error reaches every request
it affects, as an exception in its queue: a failed batched forward ends every sequence of that
step; a failure of one row (its sampling or detokenizing) ends that sequence alone.

On a CUDA device the batched step is replayed as a CUDA graph, the batch padded to a bucket size
(serve/graphs.py); on the CPU, or for a step that cannot be captured, it runs eagerly.
"""
from __future__ import annotations

import logging
import queue
import secrets
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from deltafleet.serve import sampling
from deltafleet.serve.batch import BatchDeltas, RowCache
from deltafleet.serve.detokenize import TextStream
from deltafleet.serve.graphs import DecodeGraphs
from deltafleet.serve.request import GenerationError, Step
from deltafleet.serve.sampling import request_seed

log = logging.getLogger(__name__)
END = object()  # the last item of a request's queue


@dataclass
class _Seq:
    req: object                    # serve.engine.Request
    out: queue.Queue
    cancel: threading.Event
    on_start: Callable[[], None] | None
    text: TextStream | None = None
    seed: int = 0                  # the sampler's 64-bit seed (serve/sampling.py)
    row: int = -1
    pos: int = 0                   # position of the token fed next
    token: int = 0                 # the token fed next
    n: int = 0                     # tokens generated
    done: bool = field(default=False)


def _slot(req) -> int:
    """The variant slot a request runs with (serve/batch.py), −1 for the base."""
    return -1 if req.delta is None else req.delta.slot


class Scheduler:
    """Continuous batching for ``engine`` (see the module docstring).

    Args:
        engine: the :class:`~deltafleet.serve.engine.Engine` (its model, tokenizer, delta slots, release).
        max_batch: sequences decoded together at most (rows of the KV cache).
        max_seq_len: tokens per sequence the cache holds (the model's context at most).
        cuda_graphs: on a CUDA device in one process, replay decode steps as CUDA graphs
            (serve/graphs.py); the cache then has one more row, the padding rows' scratch row.
    """

    def __init__(self, engine, max_batch: int, max_seq_len: int, cuda_graphs: bool = False):
        if max_batch < 1:
            raise ValueError(f"max_batch must be ≥ 1, got {max_batch}")
        self.engine, self.model = engine, engine.model
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        # Not with tensor parallelism: the other ranks run each step eagerly (serve/tp.py).
        graphs = cuda_graphs and engine.device.type == "cuda" and engine.tp is None
        self.cache = self.model.new_cache(max_batch + 1 if graphs else max_batch, max_seq_len)
        self.graphs = DecodeGraphs(self.model, engine.slots, self.cache) if graphs else None
        self._free_rows = list(range(max_batch - 1, -1, -1))
        self._waiting: OrderedDict[str, deque[_Seq]] = OrderedDict()  # model id → its queue
        self.running: list[_Seq] = []
        self._cv = threading.Condition()
        self.steps = 0  # batched decode steps run (tests, metrics)
        self.fatal: BaseException | None = None  # set when a tensor-parallel rank failed
        self.max_rows_seen = 0
        threading.Thread(target=self._loop, name="scheduler", daemon=True).start()

    # ------------------------------------------------------------------ requests

    def submit(self, req, cancel: threading.Event | None = None,
               on_start: Callable[[], None] | None = None) -> tuple[queue.Queue, threading.Event]:
        """Queue a prepared request; returns (its queue of Steps, an exception or :data:`END`; its
        cancel event — set it to end the request after the current step)."""
        seq = _Seq(req, queue.Queue(), cancel or threading.Event(), on_start)
        with self._cv:
            self._waiting.setdefault(req.model_id, deque()).append(seq)
            self._cv.notify()
        return seq.out, seq.cancel

    def waiting(self) -> dict[str, int]:
        with self._cv:
            return {m: len(q) for m, q in self._waiting.items() if q}

    # ------------------------------------------------------------------ the loop

    def _admit(self) -> list[_Seq]:
        """Take waiting requests into free rows, one per variant queue in turn (lock held)."""
        admitted = []
        while self._free_rows and any(self._waiting.values()):
            for mid in list(self._waiting):
                q = self._waiting[mid]
                if not q or not self._free_rows:
                    continue
                seq = q.popleft()
                self._waiting.move_to_end(mid)  # the next round starts with another variant
                if seq.cancel.is_set():  # abandoned while it waited
                    self._finish(seq)
                    continue
                seq.row = self._free_rows.pop()
                admitted.append(seq)
        return admitted

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self.running and not any(self._waiting.values()):
                    self._cv.wait()
            admitted: list[_Seq] = []
            try:
                with self.engine._gen_lock:  # the model is used by this thread only (tests can hold it)
                    with self._cv:
                        admitted = self._admit()
                    for seq in admitted:
                        self._prefill(seq)
                    self._retire()
                    if self.running:
                        self._decode()
                    self._retire()
            except BaseException as e:  # noqa: BLE001 - reported to the requests of the failed step
                log.exception("scheduler step failed")
                if self.engine.tp is not None:  # a rank is gone: this server cannot serve any more
                    self.fatal = e
                for seq in self.running + [a for a in admitted if a not in self.running]:
                    if not seq.done:
                        seq.out.put(e)
                        seq.done = True
                    if seq not in self.running:
                        self.running.append(seq)
                self._retire()

    def _prefill(self, seq: _Seq) -> None:
        eng, req = self.engine, seq.req
        if seq.on_start is not None:
            seq.on_start()
        if seq.cancel.is_set():
            seq.done = True
            self.running.append(seq)
            return
        p = req.params
        seq.text = TextStream(eng.detokenizer, p.stop, eng._detok_lock)
        seq.seed = request_seed(p.seed if p.seed is not None else secrets.randbits(64))
        n = len(req.prompt_ids)
        rows = torch.tensor([seq.row], device=eng.device)
        view = [RowCache(c, rows, per_row_positions=False) for c in self.cache]
        slot = _slot(req)
        with eng.collective(("prefill", seq.row, list(req.prompt_ids), slot)), torch.inference_mode():
            logits = self.model(torch.tensor([req.prompt_ids], device=eng.device),
                                torch.arange(n, device=eng.device), view, req.delta)[0, -1].float()
        seq.pos = n
        self.running.append(seq)
        self._emit(seq, int(self._sample(logits[None], [seq], [n])[0]))

    def _decode(self) -> None:
        live = [s for s in self.running if not s.done]
        if not live:
            return
        dev = self.engine.device
        tokens, pos, rows = [s.token for s in live], [s.pos for s in live], [s.row for s in live]
        slots = [_slot(s.req) for s in live]
        with_deltas = any(x >= 0 for x in slots)
        logits = None
        with self.engine.collective(("decode", tokens, pos, rows, slots)), torch.inference_mode():
            if self.graphs is not None and self.graphs.capturable(with_deltas):
                try:
                    logits = self.graphs.run(tokens, pos, rows, slots).float()
                except Exception:  # a capture that fails once fails again: serve eagerly (the step rewrites its KV)
                    log.exception("decoding by CUDA graph failed; decoding eagerly from now on")
                    self.graphs = None
            if logits is None:
                delta = BatchDeltas(self.engine.slots, torch.tensor(slots, device=dev)) if with_deltas else None
                logits = self.model.forward_rows(torch.tensor(tokens, device=dev), torch.tensor(pos, device=dev),
                                                 self.cache, torch.tensor(rows, device=dev), delta).float()
        self.steps += 1
        self.max_rows_seen = max(self.max_rows_seen, len(live))
        for s, token in zip(live, self._sample(logits, live, [s.pos + 1 for s in live]).tolist()):  # one sync
            s.pos += 1
            self._emit(s, token)

    def _sample(self, logits: torch.Tensor, seqs: list[_Seq], positions: list[int]) -> torch.Tensor:
        """The next token of each of ``seqs`` from ``logits`` ``[B, V]`` (serve/sampling.py), −1 for a
        row whose logits are not finite; ``positions``: those of the tokens sampled."""
        batch = sampling.SamplingBatch.build(
            [(s.req.params.temperature, s.req.params.top_p, s.req.params.top_k, s.seed, p)
             for s, p in zip(seqs, positions)], logits.device)
        return sampling.sample(logits, batch)

    def _emit(self, seq: _Seq, token: int) -> None:
        """Send the Step of ``seq``'s sampled ``token``; a failure here (−1: its logits were not finite,
        or its detokenizing failed) is sent to ``seq`` alone and ends it."""
        eng = self.engine
        try:
            if token < 0:
                raise GenerationError("the model's next-token logits for this request are not finite (NaN or inf)")
            seq.n += 1
            if token in eng.eos_token_ids:
                step = Step(token, seq.text.flush()[0], "stop")
            else:
                piece, stopped = seq.text.push(token)
                if stopped:
                    step = Step(token, piece, "stop")
                elif seq.n >= seq.req.max_tokens or seq.cancel.is_set():
                    rest, stopped = seq.text.flush()
                    step = Step(token, piece + rest, "stop" if stopped else "length")
                else:
                    step = Step(token, piece)
        except Exception as e:  # noqa: BLE001 — this row's own failure ends this request only
            log.error("generation failed for a request on %s", seq.req.model_id, exc_info=e)
            seq.out.put(e)
            seq.done = True
            return
        seq.out.put(step)
        seq.token = token
        if step.finish_reason is not None:
            seq.done = True

    def _retire(self) -> None:
        for seq in [s for s in self.running if s.done or s.cancel.is_set()]:
            self.running.remove(seq)
            self._finish(seq)

    def _finish(self, seq: _Seq) -> None:
        if seq.row >= 0:
            with self._cv:
                self._free_rows.append(seq.row)
            seq.row = -1
        self.engine.release(seq.req)
        seq.out.put(END)
