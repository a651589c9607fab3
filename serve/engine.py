"""The serving engine: one resident base, BitDelta variants loaded on first use, a decode loop.

Model ids (docs/architecture.md, "Serving"): the base is served as the family name (``tiny``), each
artifact folder ``<artifacts_dir>/<variant>/bitdelta.json`` as ``<family>-<variant>``. A variant's
artifact is read on its first request, checked against the base's fingerprint, and kept in the
tiered delta cache of serve/cache.py (device → host → disk, weighted-LRU eviction, pinning, never
evicting a variant with requests in flight). Loading is single-flight per variant: concurrent
first requests wait for one load, and loads of other variants are not blocked. A request holds
its variant from :meth:`Engine.prepare` until it ends (:meth:`Engine.release`).

Generation is continuous batching (serve/scheduler.py): each step, every running request, whatever
its variant, advances one token while new prompts are prefilled in chunks beside them, over a paged
KV cache; a request's steps come as a plain iterator of :class:`Step` (:meth:`Engine.run`), or to
any sink with ``put`` (the HTTP layer's, serve/app.py).
"""
from __future__ import annotations

import contextlib
import inspect
import itertools
import json
import logging
import math
import re
import threading
import time
import weakref
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from deltafleet.checkpoint import load_tokenizer
from deltafleet.compress.bitdelta import ArtifactError, fingerprint, load_artifact
from deltafleet.serve.attention import check_block_size, pick_backend
from deltafleet.serve.batch import DeltaSlots, check_sign_layout
from deltafleet.serve.cache import ArtifactGoneError, CacheFullError, DeltaCache
from deltafleet.serve.delta import VariantDelta, artifact_stamp
from deltafleet.serve.detokenize import token_bytes, token_name
from deltafleet.serve.grammar import Grammars
from deltafleet.serve.loading import load_model
from deltafleet.serve.request import (  # noqa: F401  (FinishReason, SamplingParams, Step: re-exported)
    VARIANT_NAME,
    Completion,
    EngineFailedError,
    FinishReason,
    GenerationError,
    InvalidRequestError,
    ModelNotFoundError,
    Request,
    SamplingParams,
    Step,
    TensorParallelError,
    VariantInUseError,
    VariantUnavailableError,
    check_unicode,
)
from deltafleet.serve.scheduler import END, Scheduler
from deltafleet.serve.synthetic import read_synthetic

MANIFEST_NAME = "bitdelta.json"
_MARK = re.compile("\ue000(\\d+)\ue001")  # encode_chat's placeholder of message i
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # the dtypes served
KV_BLOCK_SIZE = 128  # tokens a KV block unless kv_cache.block_size says otherwise


def kv_cache_blocks(block_size: int, max_batch: int, context: int, max_tokens: int | None) -> int:
    """Blocks of the paged KV cache before the device's free memory is counted: ``max_batch`` full
    contexts (each in whole blocks), within ``max_tokens`` where it is set (whole blocks, as vLLM
    rounds)."""
    most = max_batch * -(-context // block_size)
    return most if max_tokens is None else min(most, max_tokens // block_size)
log = logging.getLogger(__name__)
# event ("hit", "miss", "load", "load_failed", "evict", "unload"), model id, seconds (load time for "load"
# and "load_failed", else 0), tier (where a load came from: "host"/"disk"; what an eviction or an unload
# left: "device"/"host")
DeltaListener = Callable[[str, str, float, "str | None"], None]


def _chat_template_options(tokenizer) -> frozenset[str]:
    """The named parameters of ``tokenizer.apply_chat_template`` (``conversation``, ``chat_template``,
    ``tools``, ``tokenize``, ...): its options, which ``chat_template_kwargs`` may not set (only the
    rest of its keyword arguments reach the template as variables)."""
    params = inspect.signature(type(tokenizer).apply_chat_template).parameters.values()
    return frozenset(p.name for p in params if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))


@dataclass(frozen=True)
class ModelCard:
    id: str
    parent: str | None  # the base id for a variant, None for the base
    artifact_dir: Path | None = None


def _dtype(name: str | torch.dtype) -> torch.dtype:
    dt = name if isinstance(name, torch.dtype) else DTYPES.get(str(name))
    if dt not in DTYPES.values():
        raise ValueError(f"dtype {name!r} cannot be served; valid dtypes: {', '.join(DTYPES)}")
    return dt


def _manifest_field(manifest: Path, *keys: str):
    """``manifest[keys[0]][keys[1]]...`` of an artifact manifest, or None where it cannot be read (the
    artifact's load says why). Only a regular file is read: a named pipe would block for ever."""
    if not manifest.is_file():
        return None
    try:
        value = json.loads(manifest.read_text())
    except (OSError, ValueError, RecursionError):  # (JSON nested past the parser's depth)
        return None
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _granularity(manifest: Path) -> str | None:
    return _manifest_field(manifest, "granularity")


def _without_paths(text: str, *dirs: Path) -> str:
    """``text`` without the server's filesystem paths: ``dirs`` and any other absolute path's folders
    are cut (``/srv/artifacts/coder/bitdelta.json`` → ``bitdelta.json``), so clients never see them."""
    for d in dirs:
        text = text.replace(f"{d}/", "")
    return re.sub(r"(?<![\w.~])/(?:[^\s/'\":]+/)+", "", text)



def _unbounded(tokenizer):
    """``tokenizer`` without its own length limit: the engine refuses a prompt over the served context
    by itself (``context_length_exceeded``), and transformers' warning of a sequence over
    ``model_max_length`` ("will result in indexing errors") would read as a fault of the model."""
    from transformers.tokenization_utils_base import VERY_LARGE_INTEGER  # transformers' "no limit"

    tokenizer.model_max_length = VERY_LARGE_INTEGER
    return tokenizer


def _steps(out, cancel: threading.Event) -> Iterator[Step]:
    """A submitted request's Steps from ``out`` to its END (:meth:`Engine.run`), raising its error."""
    ended = False
    try:
        while (item := out.get()) is not END:
            if isinstance(item, BaseException):
                raise item
            yield item
        ended = True
    finally:
        if not ended:  # closed early: the scheduler drops the sequence after its current step
            cancel.set()


def _changed_while_loading(model_id: str) -> VariantUnavailableError:
    """Tensor parallel: a variant's artifact changed or went on disk between rank 0's read and another
    rank's, so the ranks would hold two versions; no rank takes it and the next request reads it again."""
    reason = "its artifact changed on disk while it was being loaded: retry"
    return VariantUnavailableError(f"variant `{model_id}` is unavailable: {reason}", transient=True, reason=reason)


def _copy_read(src: VariantDelta, dst: VariantDelta) -> None:
    """Tensor parallel: carry a delta's read (``source`` folder, rank 0's read ``key``, ``model_id``;
    serve/follower.py) over to its slot's views or its host copy."""
    for name in ("source", "key", "model_id"):
        setattr(dst, name, getattr(src, name, None))


class Engine:
    """Serve a base checkpoint and every BitDelta artifact found for it.

    Args:
        base_dir: Hugging Face checkpoint of the base (config, safetensors, tokenizer), or the folder
            of a synthetic family (config, tokenizer, ``synthetic.json``: weights and variants generated
            on the device, serve/synthetic.py).
        artifacts_dir: folder of artifact folders ``<variant>/bitdelta.json``; None: base only.
        family: model id of the base; variants are ``<family>-<variant>``.
        device, dtype: where and in which dtype the base (and the deltas' full tensors) live.
        force: load artifacts even if their base fingerprint differs (not recommended).
        delta_cache: ``device_slots`` (variants on the device at once; default: the device budget
            over one slot's bytes, else the number of artifacts served, at least 1) and keyword
            arguments of :class:`deltafleet.serve.cache.DeltaCache` (``device_budget_bytes``,
            ``host_budget_bytes``, ``pinned`` (variant names or model ids), ``pin_top_n``,
            ``half_life_s``, ``wait_timeout_s``).
        max_batch: sequences running at once at most (continuous batching, serve/scheduler.py).
        max_num_batched_tokens: tokens one step feeds at most (decode rows + prefill chunks; vLLM's
            name); raised to ``max_batch`` if below it.
        kv_cache: the paged KV cache (serve/kv.py, serve/attention.py): ``block_size`` (tokens a
            block, default 128; a power of two ≥ 16 with FlexAttention on CUDA), ``max_tokens`` (tokens in all; default: on CUDA what
            ``gpu_memory_utilization`` (default 0.9) of the device leaves after the base and the
            delta slots, elsewhere ``max_batch`` full contexts; never more than ``max_batch`` full
            contexts). The served context is capped at the cache's size.
        attention: the decode attention kernel: ``auto`` (FlexAttention on CUDA, else SDPA), ``flex``, ``sdpa``.
        scheduler_delay_factor: admission pacing (vLLM's name; serve/plan.py): while sequences run, a
            waiting request is admitted once it has waited this many times the last admitting step;
            0 (default): at once.
        long_prefill_token_threshold: a prompt's tokens one step prefills at most (vLLM's name;
            serve/plan.py), so a long prompt leaves room for the prompts behind it; 0 (default): all
            the budget left.
        async_scheduling: plan and launch each step while the previous one runs on the device, its
            sampled tokens fed to the next step there (serve/scheduler.py); off with ``tp``.
        late_planning: with ``async_scheduling`` on CUDA, plan the step after a decode step as late as
            that step's device time allows, so that requests arriving while it runs join the next step
            (serve/pacing.py).
        cuda_graphs: on a CUDA device, replay decode-only steps as CUDA graphs, one per batch-size
            bucket (serve/graphs.py); ignored on the CPU and with ``tp``.
        prefill_graphs: with ``cuda_graphs``, also run steps with prefill chunks as
            piecewise CUDA graphs (serve/graphs.py, ``PiecewiseGraphs``).
        capture_at_start: with ``cuda_graphs``, capture every graph bucket before serving (else each
            on its first use, in the step that needs it).
        tp: rank 0's :class:`deltafleet.serve.tp.TPContext` when serving tensor parallel (the other ranks run
            :func:`deltafleet.serve.follower.run_follower`); None: one process. Once its group fails (a
            rank died or stopped answering) the engine generates no more: :meth:`failure`.

    Raises:
        FileNotFoundError: if ``base_dir`` holds no checkpoint (run ``make base`` or ``make demo``).
        ValueError: if ``dtype`` is not one of :data:`DTYPES`.
    """

    def __init__(self, base_dir: str | Path, artifacts_dir: str | Path | None = None, family: str = "tiny",
                 device: str = "cpu", dtype: str | torch.dtype = "float32", force: bool = False,
                 delta_cache: dict | None = None, max_batch: int = 8, tp=None, cuda_graphs: bool = True,
                 prefill_graphs: bool = False, capture_at_start: bool = False, max_num_batched_tokens: int = 2048,
                 kv_cache: dict | None = None,
                 attention: str = "auto",
                 scheduler_delay_factor: float = 0.0, async_scheduling: bool = True, late_planning: bool = False,
                 long_prefill_token_threshold: int = 0):
        self.base_dir = Path(base_dir)
        self.dtype = _dtype(dtype)
        if not (self.base_dir / "config.json").is_file():
            raise FileNotFoundError(
                f"no base checkpoint at {self.base_dir} (config.json missing): build it with `make base` "
                "(or the whole demo family with `make demo`; an installed package without this checkout: "
                "`deltafleet train variant=base`), or set base_dir=/path/to/hf/checkpoint"
            )
        self.artifacts_dir = Path(artifacts_dir) if artifacts_dir else None
        if self.artifacts_dir is not None and not self.artifacts_dir.is_dir():
            log.warning("artifacts_dir %s is not a folder: serving the base alone until it exists "
                        "(variants are found at their first request or by /v1/load_variant)", self.artifacts_dir)
        self.family, self.device, self.force = family, torch.device(device), force
        self.tokenizer = _unbounded(load_tokenizer(self.base_dir))
        # Special tokens (eos, role markers, ...) by text: only a chat template may emit them, see encode_chat.
        self._special_ids = {t.content: i for i, t in self.tokenizer.added_tokens_decoder.items() if t.special}
        longest_first = sorted(self._special_ids, key=len, reverse=True)
        self._special_re = re.compile("(" + "|".join(map(re.escape, longest_first)) + ")")
        self.max_token_chars = self._longest_token_chars()
        self.tp = tp
        self.synthetic = read_synthetic(self.base_dir)  # None: a real checkpoint
        if self.synthetic is None:
            self.model = load_model(self.base_dir, self.device, self.dtype, tp=None if tp is None else tp.shard)
        else:
            self.model = self.synthetic.build_base(self.device, self.dtype, tp=None if tp is None else tp.shard)
        self.max_model_len = self.model.args.max_seq_len
        self.base_fingerprint = fingerprint(self.base_dir) if self.synthetic is None else self.synthetic.fingerprint
        self.eos_token_ids = self._eos_ids()
        self._variants: dict[str, ModelCard] = {}
        self._removed: set[str] = set()  # ids unloaded by remove_variant: not rediscovered until add_variant
        # ids of artifacts on disk this server cannot serve → why: (their 404's reason, the log line's), _not_servable
        self._unserved: dict[str, tuple[str, str]] = {}
        self._misnamed: set[str] = set()  # folders in the artifact root named no variant name: warned of once
        self._registry_lock = threading.Lock()  # guards _variants and _removed
        self._closing: BaseException | None = None  # set by drain(): the server is shutting down
        self._tok_lock = threading.Lock()  # HF fast tokenizers are not safe to share across threads
        # The scheduler's detokenizer has its own copy: encoding a huge prompt in a request thread must
        # not stall every running sequence's next token.
        self.detokenizer = _unbounded(load_tokenizer(self.base_dir))
        self._detok_lock = threading.Lock()
        self.grammars = Grammars(self.tokenizer, self.model.args.vocab_size)  # structured output
        self._gen_lock = threading.Lock()  # one generation at a time
        self._release_lock = threading.Lock()
        self._loading: Counter[str] = Counter()  # per model id, requests waiting in prepare for their deltas
        self._reads = itertools.count()  # names each read of an artifact (tensor parallel: _put_slot)
        opts = dict(delta_cache or {})
        opts["pinned"] = [p if p.startswith(f"{family}-") else f"{family}-{p}" for p in opts.get("pinned") or ()]
        n_slots = opts.pop("device_slots", None)
        budget = opts.pop("device_budget_bytes", None)
        sign_layout = opts.pop("sign_layout", "tiled")  # serve.batch.DeltaSlots: "tiled" or "rows"
        check_sign_layout(sign_layout, "delta_cache.sign_layout")
        # The slots are sized for the artifacts served, as discover() lists them: not the hidden folders a
        # killed export leaves (deltafleet/atomic.py), another base's artifacts, nor links out of the root.
        served = self.discover()
        artifacts = [c.artifact_dir for c in served if c.artifact_dir is not None]
        if n_slots is None:
            n_slots = max(1, len(artifacts) + (self.synthetic.variants if self.synthetic else 0))
        # variants of granularity rowcol at start: the slots hold column scales (DeltaSlots, col_scales)
        col_scales = any(_granularity(d / MANIFEST_NAME) == "rowcol" for d in artifacts)
        per_slot = DeltaSlots.bytes_per_slot(self.model, sign_layout, col_scales)
        if budget is not None:
            if budget < per_slot:
                raise ValueError(f"device_budget_bytes={budget} is less than one variant slot ({per_slot} bytes)")
            n_slots = budget // per_slot
        self.slots = DeltaSlots(self.model, int(n_slots), sign_layout, col_scales)
        self.cache = DeltaCache(self._read_delta, self._put_slot, self._artifact_stamp, to_host=self._to_host,
                                free_device=self._free_slot, free_host=self._free_host,
                                size=lambda d: self.slots.slot_bytes,
                                device_budget_bytes=self.slots.n_slots * self.slots.slot_bytes, **opts)
        served_ids = {c.id for c in served}
        for mid in opts["pinned"]:
            if mid == f"{family}-{family}":
                log.warning("delta_cache.pinned names %s, the base, which is always on the device", family)
            elif mid not in served_ids:  # not an error: its artifact may be exported later (discover)
                log.warning("delta_cache.pinned names %s, which is not served (no artifact for it yet)", mid)
        # (a pin not served now holds no slot, and has its warning above)
        held = len(set(opts["pinned"]) & served_ids) + opts.get("pin_top_n", 0)
        if held >= self.slots.n_slots:  # no slot left to evict for: the others' loads wait, then 503
            log.warning("delta_cache: %d pinned variants and pin_top_n %d can hold all %d device slots; once "
                        "they do, any other variant waits wait_timeout_s and gets 503 on every request: pin "
                        "fewer or raise delta_cache.device_slots", held - opts.get("pin_top_n", 0),
                        opts.get("pin_top_n", 0), self.slots.n_slots)
        if max_batch < 1:
            raise ValueError(f"max_batch must be ≥ 1, got {max_batch}")
        pick_backend(attention, self.device)  # a bad name is refused here, before any rank is told
        if not isinstance(async_scheduling, bool):
            raise ValueError(f"async_scheduling must be true or false, got {async_scheduling!r}")
        if not isinstance(late_planning, bool):
            raise ValueError(f"late_planning must be true or false, got {late_planning!r}")
        if isinstance(scheduler_delay_factor, bool) or not isinstance(scheduler_delay_factor, (int, float)) \
                or not 0 <= scheduler_delay_factor < math.inf:
            raise ValueError(f"scheduler_delay_factor must be a finite number ≥ 0, got {scheduler_delay_factor!r}")
        if isinstance(long_prefill_token_threshold, bool) or not isinstance(long_prefill_token_threshold, int) \
                or long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be an integer ≥ 0, got {long_prefill_token_threshold!r}")
        block_size, n_blocks = self._kv_blocks(dict(kv_cache or {}), max_batch)
        check_block_size(block_size, pick_backend(attention, self.device), self.device)
        if n_blocks * block_size < self.max_model_len:
            log.warning("the KV cache holds %d tokens: the served context is cut from %d to that",
                        n_blocks * block_size, self.max_model_len)
            self.max_model_len = n_blocks * block_size
        self.kv_tokens = n_blocks * block_size
        budget = int(max_num_batched_tokens)
        if budget < max_batch:  # every running sequence must be able to decode in every step
            log.warning("max_num_batched_tokens=%d is below max_batch=%d: raised to %d", budget, max_batch, max_batch)
            budget = max_batch
        self._check_artifacts()  # once the settings are known good: no warnings before a setting's error
        with self.collective(("init", self.slots.n_slots, max_batch, self.max_model_len, sign_layout, n_blocks,
                              block_size, attention, col_scales)):
            self.scheduler = Scheduler(self, max_batch, self.max_model_len, n_blocks, block_size, budget,
                                       cuda_graphs=cuda_graphs, prefill_graphs=prefill_graphs, attention=attention,
                                       delay_factor=float(scheduler_delay_factor), capture_at_start=capture_at_start,
                                       async_scheduling=async_scheduling, late_planning=late_planning,
                                       long_prefill_token_threshold=long_prefill_token_threshold)

    def _kv_blocks(self, opts: dict, max_batch: int) -> tuple[int, int]:
        """``(block_size, n_blocks)`` of the paged KV cache (see the class docstring's ``kv_cache``).

        Raises:
            ValueError: an unknown option, a block size < 1, a utilization outside (0, 1], or no
                room for one block."""
        from deltafleet.serve.attention import PagedKVCache
        from deltafleet.serve.kv import BlockPool

        def number(key: str, default, kind, ok, what: str):
            value = opts.pop(key, None)
            if value is None:
                return default
            # not coerced: true is no block size of 1, nor 64.9 one of 64
            numeric = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not numeric or (kind is int and value != int(value)) or not ok(kind(value)):
                raise ValueError(f"kv_cache.{key} must be {what}, got {value!r}")
            return kind(value)

        block_size = number("block_size", KV_BLOCK_SIZE, int, lambda v: v >= 1, "an integer ≥ 1")
        max_tokens = number("max_tokens", None, int, lambda v: v >= block_size,
                            f"null or an integer ≥ kv_cache.block_size ({block_size})")
        utilization = number("gpu_memory_utilization", 0.9, float, lambda v: 0 < v <= 1, "a number in (0, 1]")
        if opts:
            raise ValueError(f"unknown kv_cache option(s): {', '.join(sorted(opts))} "
                             "(known: block_size, max_tokens, gpu_memory_utilization)")
        attn = self.model.layers[0].self_attn
        per_block = PagedKVCache.bytes_per_block(len(self.model.layers), attn.n_kv, attn.head_dim, block_size,
                                                 self.dtype)
        n_blocks = kv_cache_blocks(block_size, max_batch, self.max_model_len, max_tokens)
        if max_tokens is None and self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            left = free - (1 - utilization) * total  # vLLM's gpu_memory_utilization: of the whole device
            # Tensor-parallel ranks hold equal slices: rank 0's figure is every rank's (sent with "init").
            n_blocks = min(n_blocks, BlockPool.blocks_for_memory(max(0, int(left)), per_block, 1.0))
        if n_blocks < 1:
            raise ValueError(f"no room for one KV block of {block_size} tokens ({per_block} bytes): lower "
                             "delta_cache.device_slots or raise kv_cache.gpu_memory_utilization")
        return block_size, n_blocks

    def collective(self, cmd: tuple):
        """Context for work every tensor-parallel rank must do together: announces ``cmd`` to the other
        ranks (serve/tp.py) and keeps other announcements out until the block ends. A no-op in
        one process."""
        if self.tp is None:
            return contextlib.nullcontext()
        lock = self.tp.lock

        @contextlib.contextmanager
        def ctx():
            with lock:
                self.tp.send(cmd)
                yield

        return ctx()

    def _put_slot(self, delta: VariantDelta) -> VariantDelta:
        if self.tp is None:
            return self.slots.put(delta)
        if getattr(delta, "stamp", None) is not None and not getattr(delta, "host_copy", False):
            self._wait_for_reads(delta.key)  # a read from disk: the other ranks' (prefetch) is done first
        with self.tp.lock:  # the slot is chosen, announced and filled under one hold of the lock
            slot = self.slots.next_free()
            # a host copy goes back from each rank's own host copy (serve/follower.py), not from disk, where
            # the artifact may have changed or gone since it was read; a read from disk must find the
            # version rank 0 read (its stamp), or no rank takes it
            self.tp.send(("load", delta.key, delta.source, slot, getattr(delta, "host_copy", False),
                          getattr(delta, "stamp", None)))
            failed = self.tp.gather(None)
            if any(failed):
                log.warning("variant %s: %s", delta.source, next(f for f in failed if f))
                if not all(failed):  # the ranks that took it give the slot back, as free as rank 0's
                    self.tp.send(("free", slot, False))
                raise _changed_while_loading(delta.model_id)
            view = self.slots.put(delta, slot)
            _copy_read(delta, view)  # kept by its host copy, for a reload from the host tier
            return view

    def _wait_for_reads(self, key) -> None:
        """Until every other rank has its slice of read ``key`` (announced by :meth:`_read_delta`) in
        host memory, or ``tp_timeout_s`` has passed: asks them between steps, so that the load that
        follows holds the steps of every model only for the copy into the slot, not for what is left of
        a read from disk (serve/follower.py)."""
        deadline = time.monotonic() + (self.tp.timeout_s or 600.0)
        pause = 0.002
        while time.monotonic() < deadline:
            with self.tp.lock:
                self.tp.send(("reading", key))
                if not any(self.tp.gather(False)):
                    return
            time.sleep(pause)
            pause = min(2 * pause, 0.05)

    def _free_slot(self, view: VariantDelta, kept: bool) -> None:
        with self.collective(("free", view.slot, kept)):  # kept: rank 0's host tier has a copy
            self.slots.free(view)

    def _free_host(self, delta: VariantDelta) -> None:
        if self.tp is not None:  # the other ranks drop their copies too (serve/follower.py)
            with self.tp.lock:
                self.tp.send(("drop", delta.key))

    def failure(self) -> EngineFailedError | None:
        """Why this engine cannot generate any more (its tensor-parallel group failed: a rank died or
        stopped answering; serve/tp.py), as the error that refuses requests; None while it can."""
        reason = None if self.tp is None else self.tp.failed
        return None if reason is None else EngineFailedError(reason)

    @property
    def draining(self) -> bool:
        """Whether :meth:`drain` was called (the server is shutting down)."""
        return self._closing is not None

    def drain(self, error: BaseException) -> None:
        """Begin a shutdown: :meth:`prepare` raises ``error`` from now on, and so do the loads waiting
        for room on the device and the requests that have not started (``Scheduler.abort``); the
        running ones go on."""
        self._closing = error
        self.cache.close(error)
        self.scheduler.abort(error)

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (no-op in one process, and once the group failed:
        nothing can be sent on it, and the launcher stops the ranks left, serve/run.py). A step still
        running holds it up to ``tp_timeout_s``."""
        if self.tp is not None:
            with self.tp.lock:
                try:
                    self.tp.send(("stop",))
                except TensorParallelError:  # logged as the group failed
                    pass

    # ---------------------------------------------------------------- models and variants

    def discover(self) -> list[ModelCard]:
        """(Re)scan ``artifacts_dir`` for ``*/bitdelta.json`` and make the list of variants what is on
        disk now (``GET /v1/models`` calls it): new artifacts become servable (not those removed with
        :meth:`remove_variant`), and a variant whose manifest is gone (its folder removed) or names what
        this server cannot serve (re-exported against another base) leaves the list and every cache
        tier, as its next request would find it (a 404; docs/serving.md, "Changed on disk").
        Requests running on it finish on what they hold. As cheap as listing the folder: each
        manifest is read for its base fingerprint and each listed variant's manifest looked up, no
        artifact is loaded."""
        found: dict[str, ModelCard] = {}
        if self.artifacts_dir is not None and self.artifacts_dir.is_dir():
            root = self.artifacts_dir.resolve()
            for manifest in sorted(self.artifacts_dir.glob(f"*/{MANIFEST_NAME}")):
                if manifest.parent.name.startswith("."):  # temp or old folders of an atomic write
                    continue
                if not manifest.is_file():  # no manifest (a named pipe, a link to a device: reading one blocks)
                    continue
                if not re.fullmatch(VARIANT_NAME, manifest.parent.name):  # no load route could name it again
                    if manifest.parent.name not in self._misnamed:
                        self._misnamed.add(manifest.parent.name)
                        log.warning("not serving the artifact folder %s: its name is no variant name (1–64 letters, "
                                    "digits, '.', '_' or '-', starting with a letter or digit)",
                                    ascii(manifest.parent.name))
                    continue
                if not manifest.parent.resolve().is_relative_to(root):  # a symbolic link out of the root
                    log.warning("not serving %s: it resolves outside the artifact root", manifest.parent.name)
                    continue
                mid = f"{self.family}-{manifest.parent.name}"
                why = self._not_servable(manifest)
                if why is not None:  # never served here: not listed, and a request says why (404)
                    if self._unserved.get(mid) != why:
                        log.warning("not serving %s: %s", mid, why[1])
                    self._unserved[mid] = why
                    continue
                self._unserved.pop(mid, None)
                found[mid] = ModelCard(mid, self.family, manifest.parent)
        for name in self.synthetic.names if self.synthetic else ():
            found[f"{self.family}-{name}"] = ModelCard(f"{self.family}-{name}", self.family)
        with self._registry_lock:
            listed = list(self._variants.values())
        # a listed variant whose manifest is gone, or names what this server cannot serve now (re-exported
        # against another base, or with column scales its slots lack), leaves the list as at start
        unservable = {c.id: why for c in listed if not self._gone(c) and c.artifact_dir is not None
                      and (why := self._not_servable(c.artifact_dir / MANIFEST_NAME)) is not None}
        stale = [c for c in listed if self._gone(c) or c.id in unservable]
        with self._registry_lock:
            gone = [c.id for c in stale if self._variants.get(c.id) is c]  # not replaced meanwhile
            for mid in gone:
                del self._variants[mid]
                if mid in unservable:  # its requests answer 404 saying why
                    self._unserved[mid] = unservable[mid]
            for mid, card in found.items():
                if mid not in self._removed:
                    self._variants.setdefault(mid, card)
        for mid in gone:  # requests in flight keep what they hold; it leaves with the last of them
            self.cache.discard(mid)
        return self.models()

    @staticmethod
    def _gone(card: ModelCard) -> bool:
        """Whether a variant's artifact manifest is no longer on disk (a generated variant's never is)."""
        return card.artifact_dir is not None and not (card.artifact_dir / MANIFEST_NAME).is_file()

    def _not_servable(self, manifest: Path) -> tuple[str, str] | None:
        """Why this server can never serve the artifact of ``manifest``, or None where it may: made for
        another base, or with column scales (granularity rowcol) where the slots, sized at start, hold
        none. As (its requests' 404 after "The model `<id>` ", without paths; the log line's reason)."""
        other = self._other_base(manifest)
        if other is not None:
            return (f"does not exist for this server's base: its artifact was exported against another base "
                    f"(fingerprint {other}, this server's base {self.base_fingerprint}); export it again against "
                    "this base",
                    f"its artifact {manifest.parent} was exported against another base (fingerprint {other}, this "
                    f"server's base {self.base_fingerprint}); export it again against this base, or start the "
                    "server with force=true")
        slots = getattr(self, "slots", None)  # None while the start's discover() sizes them
        if slots is not None and not slots.betas and _granularity(manifest) == "rowcol":
            why = ("its artifact has column scales (granularity rowcol), which this server's slots do not hold: "
                   "it started without a rowcol variant; restart it with this one in place")
            return f"is not served by this server: {why}", f"{why} ({manifest.parent})"
        return None

    def _other_base(self, manifest: Path) -> str | None:
        """The base fingerprint an artifact manifest names when it is not this server's base (None when
        it is, when ``force`` is set, or when the manifest cannot be read: its load says why)."""
        other = None if self.force else _manifest_field(manifest, "base", "fingerprint")
        return other if isinstance(other, str) and other != self.base_fingerprint else None

    def models(self) -> list[ModelCard]:
        with self._registry_lock:
            return [ModelCard(self.family, None)] + list(self._variants.values())

    def card(self, model_id: str) -> ModelCard:
        """The card of the base or a found variant; a variant's bare name (``coder`` for ``<family>-coder``,
        as vLLM serves an adapter under its ``lora_name``) finds it too. The card's ``id`` is the
        canonical model id.

        An id not listed, or listed with its manifest gone from disk, is looked for again
        (:meth:`discover`), so that a new artifact is found and a removed one is not: one stat of the
        manifest for a listed variant.

        Raises ModelNotFoundError for an id that is neither (an artifact exported against another base
        is not served, and one removed from disk no longer is: the message says so)."""
        if model_id == self.family:
            return ModelCard(self.family, None)
        ids = (model_id, f"{self.family}-{model_id}")

        def listed() -> ModelCard | None:
            return next((card for mid in ids if (card := self._variants.get(mid)) is not None), None)

        card = was = listed()
        if card is None or self._gone(card):
            self.discover()
            card = listed()
        if card is not None:
            return card
        why = next((self._unserved[mid] for mid in ids if mid in self._unserved), None)
        if why is not None:
            raise ModelNotFoundError(f"The model `{model_id}` {why[0]}")
        removed = " (its artifact was removed)" if was is not None else ""
        raise ModelNotFoundError(f"The model `{model_id}` does not exist{removed}")

    def add_listener(self, fn: DeltaListener) -> None:
        """Call ``fn(event, model_id, seconds, tier)`` on delta-cache hits, misses, loads, failed loads,
        evictions and unloads (see :data:`DeltaListener`)."""
        self.cache.add_listener(fn)

    def acquire_delta(self, model_id: str, held: VariantDelta | None = None,
                      request: bool = True) -> VariantDelta | None:
        """The variant's deltas on the serving device (None for the base), loaded if needed, held
        (never evicted) until :meth:`release_delta` of the same id. ``held``: the deltas the caller
        holds already, taken again as they are (``DeltaCache.acquire``'s ``join``). ``request``:
        False for a load ahead of traffic (a hot load, the synthetic family's preload), which counts
        in neither the variant's request count that eviction ranks by nor the cache's hits and misses.

        Raises:
            ModelNotFoundError: unknown id, or its artifact was removed.
            VariantUnavailableError: the artifact is missing, corrupt, made for another base
                (fingerprint mismatch), does not fit the base's shapes, or there is no room for it
                on the device. Not cached: the next request tries again, so a fixed artifact is
                picked up without a restart.
            EngineFailedError: the tensor-parallel group failed, now or before (:meth:`failure`).
        """
        card = self.card(model_id)
        if card.parent is None:
            return None
        model_id = card.id
        try:
            return self.cache.acquire(model_id, join=held, request=request)
        except ArtifactGoneError:
            with self._registry_lock:
                if self._variants.get(model_id) is card:  # not one added again under the name meanwhile
                    del self._variants[model_id]
            raise ModelNotFoundError(f"The model `{model_id}` does not exist (its artifact was removed)") from None
        except CacheFullError as e:
            raise VariantUnavailableError(f"variant `{model_id}` is unavailable: {e}", transient=True) from None
        except TensorParallelError as e:  # announcing a load or an eviction to the other ranks failed
            raise EngineFailedError(e.reason) from None

    def load(self) -> tuple[dict[str, int], dict[str, int]]:
        """Per model id with any: the requests running (in the batch) and those waiting, as vLLM's
        ``num_requests_running`` and ``_waiting`` count: for the batch (:meth:`Scheduler.load`), and
        for their variant's deltas, being loaded or waiting for room on the device (a variant past
        ``max_loras`` waits in vLLM's queue too)."""
        running, waiting = self.scheduler.load()
        with self._release_lock:
            for model_id, n in (+self._loading).items():  # (+: those above 0)
                waiting[model_id] = waiting.get(model_id, 0) + n
        return running, waiting

    def release_delta(self, model_id: str, delta: VariantDelta | None = None) -> None:
        """End one hold of :meth:`acquire_delta` (no-op for the base); ``delta``: what it returned
        (an artifact changed on disk since is still held as its old version: serve/cache.py)."""
        if model_id != self.family:
            self.cache.release(model_id, delta)

    def get_delta(self, model_id: str, request: bool = True) -> VariantDelta | None:
        """The variant's deltas, loaded if needed, without holding them (they may be evicted later);
        ``request``: as :meth:`acquire_delta`'s (False: a load ahead of traffic, no request)."""
        model_id = self.card(model_id).id
        delta = self.acquire_delta(model_id, request=request)
        self.release_delta(model_id, delta)
        return delta

    def release(self, request: Request) -> None:
        """End ``request``'s hold on its variant (idempotent; :meth:`run` does it when it ends)."""
        with self._release_lock:  # the scheduler's thread and the request's may both end it
            if request.released:
                return
            request.released = True
        self.release_delta(request.model_id, request.delta)

    def _artifact_stamp(self, model_id: str):
        """The variant's artifact stamp (serve/delta.py, ``artifact_stamp``), or None once its manifest
        is gone: a re-export (a new folder renamed in) and a file changed in place both read the artifact
        again."""
        card = self._variants.get(model_id)
        if card is not None and card.artifact_dir is None and self.synthetic is not None:
            return self.synthetic.fingerprint  # generated: never changes, never gone
        if card is None or card.artifact_dir is None:
            return None
        return artifact_stamp(card.artifact_dir)

    def _read_delta(self, model_id: str) -> VariantDelta:
        """Read and check a variant's artifact into host memory (pinned when serving on a GPU)."""
        card = self._variants.get(model_id)
        if card is None:  # removed (remove_variant) after its request found it
            raise ModelNotFoundError(f"The model `{model_id}` does not exist")
        if card.artifact_dir is None and self.synthetic is not None:  # generated into its slot by put
            delta = self.synthetic.variant(card.id.removeprefix(f"{self.family}-"), self.device,
                                           None if self.tp is None else self.tp.shard)
            delta.model_id, delta.stamp, delta.key = card.id, None, next(self._reads)
            return delta
        why = self._not_servable(card.artifact_dir / MANIFEST_NAME)
        if why is not None:  # re-exported so since it was listed: as discover() finds it
            with self._registry_lock:
                self._variants.pop(card.id, None)
                self._unserved[card.id] = why
            raise ModelNotFoundError(f"The model `{card.id}` {why[0]}")
        fp = None if self.force else self.base_fingerprint
        stamp = None if self.tp is None else artifact_stamp(card.artifact_dir)  # what the other ranks must read
        key = next(self._reads)
        if self.tp is not None:  # the other ranks read their slices meanwhile, beside their steps (follower.py)
            with self.tp.lock:
                self.tp.send(("prefetch", key, str(card.artifact_dir), stamp))
        try:
            delta = self._read_checked(card, fp, stamp)
        except BaseException:
            if self.tp is not None:  # no load follows: the others let their read go
                with contextlib.suppress(Exception), self.tp.lock:
                    self.tp.send(("drop", key))
            raise
        # tensor parallel: where the other ranks read it, the version they must find there, and the name
        # of this read, by which they keep their host copies of it as rank 0's host tier keeps its own
        delta.source, delta.stamp, delta.key = str(card.artifact_dir), stamp, key
        delta.model_id = card.id
        return delta

    def _read_checked(self, card: ModelCard, fp: str | None, stamp) -> VariantDelta:
        """:meth:`_read_delta` of an artifact folder: this rank's slice, checked, in host memory."""
        try:
            artifact = load_artifact(card.artifact_dir, base_fingerprint=fp, force=self.force, device="cpu")
            delta = VariantDelta(artifact, "cpu", self.dtype)
            self._check_fits(delta)  # refused here, before any rank is told to load it
            delta.check_scales(self.dtype)  # values: not in _check_fits, which start runs on headers alone
            if self.tp is not None:
                from deltafleet.serve.tp import shard_delta

                delta = shard_delta(delta, self.tp.rank, self.tp.world)
        except (ArtifactError, OSError, ValueError) as e:
            log.warning("variant %s (%s) is unavailable: %s", card.id, card.artifact_dir, e)
            reason = _without_paths(str(e), card.artifact_dir.parent, self.base_dir)
            raise VariantUnavailableError(f"variant `{card.id}` is unavailable: {reason}", reason=reason) from e
        if self.tp is not None and artifact_stamp(card.artifact_dir) != stamp:
            raise _changed_while_loading(card.id)
        return delta.to("cpu", pin=True) if self.device.type == "cuda" else delta

    def _check_fits(self, delta: VariantDelta) -> None:
        """Raise ValueError where a variant's deltas cannot be served here: not the base's shapes, a
        matrix stored in full (a batch of mixed variants cannot share it), or column scales the slots
        do not hold. Dtypes and shapes only, so deltas of meta tensors are checked as well
        (:meth:`_check_artifacts`)."""
        delta.check(self.model.full_param_shapes)
        full_matrix = next((k for k, v in delta.full.items() if v.dim() != 1), None)
        if full_matrix is not None:
            raise ValueError(f"it stores {full_matrix!r} in full (shape {tuple(delta.full[full_matrix].shape)}), "
                             "which a batch of mixed variants cannot share (a resized vocabulary?)")
        if delta.betas and not self.slots.betas:
            raise ValueError("it has column scales (granularity rowcol) and the server started without a rowcol "
                             "variant, so its slots do not hold them: restart it with the variant in place")

    def _check_artifacts(self) -> None:
        """Log one warning for each listed artifact that cannot be served as it is (a bad manifest, a
        file missing, a shard's header unreadable, tensors that do not fit the base), naming its folder
        and the problem, so that it shows at start rather than at the first request for it. Nothing
        else changes: it stays listed, and each request for it is read and refused again (503), so a
        repaired artifact is picked up without a restart. Cheap: the manifests and the safetensors
        headers only (``load_artifact(values=False)``), no tensor read and no hash, so a file corrupt
        in its data is found at its first load, as before."""
        fp = None if self.force else self.base_fingerprint
        for card in self.models()[1:]:
            if card.artifact_dir is None:  # synthetic: generated, nothing on disk
                continue
            try:
                artifact = load_artifact(card.artifact_dir, base_fingerprint=fp, force=self.force, values=False)
                self._check_fits(VariantDelta(artifact, "meta", self.dtype))
            except (ArtifactError, OSError, ValueError) as e:
                log.warning("variant %s (%s) is unavailable: %s", card.id, card.artifact_dir, e)

    def _to_host(self, delta: VariantDelta) -> VariantDelta:
        """A host copy of a slot's views (the slot is given back right after)."""
        out = delta.to("cpu", pin=self.device.type == "cuda")
        _copy_read(delta, out)  # tensor parallel: what the other ranks load again, ...
        out.host_copy = True  # ... from their own host copies of it
        return out

    def add_variant(self, name: str, path: str | Path | None = None) -> ModelCard:
        """Serve the artifact folder ``path`` (default ``<artifacts_dir>/<name>``; in a synthetic
        family, the generated variant ``name``) as ``<family>-<name>`` and load it onto the device now
        (a hot load: no request, so neither a hit or miss nor a use that eviction ranks by; its load is
        counted as any); a variant removed with :meth:`remove_variant` is served again.

        Raises:
            InvalidRequestError: a bad name, no artifact root, a path outside the artifact root
                (symbolic links resolved) or without ``bitdelta.json``, an artifact of another base
                (``base_mismatch``) or one that cannot be used (``artifact_unusable``: unreadable,
                corrupt, not this base's shapes).
            VariantUnavailableError: no room on the device for it in time (``transient``).
            EngineFailedError: the engine cannot generate any more (:meth:`failure`).
        """
        if (failure := self.failure()) is not None:  # no rank can load it, nor run it
            raise failure
        if not re.fullmatch(VARIANT_NAME, name or ""):
            raise InvalidRequestError("`variant` must be 1–64 letters, digits, '.', '_' or '-', starting with a "
                                      "letter or digit", "variant", "invalid_value")
        mid = f"{self.family}-{name}"
        if path is None and self.synthetic is not None and name in self.synthetic.names:
            with self._registry_lock:
                self._removed.discard(mid)
                self._variants.setdefault(mid, ModelCard(mid, self.family))
            self.get_delta(mid, request=False)
            return self._variants[mid]
        if self.artifacts_dir is None:
            raise InvalidRequestError("this server has no artifact root (artifacts_dir)", "path", "invalid_value")
        root = self.artifacts_dir.resolve()
        raw = Path(path) if path else Path(name)
        try:
            folder = (raw if raw.is_absolute() else root / raw).resolve()
        except (ValueError, OSError, RuntimeError):  # an embedded NUL, a loop of links (RuntimeError before 3.13), ...
            raise InvalidRequestError("`path` is not a usable path", "path", "path_not_allowed") from None
        if not folder.is_relative_to(root):
            if not path:  # the default folder, <artifacts_dir>/<variant>, is a link out of the root
                raise InvalidRequestError(f"the folder `{name}` of the artifact root leads outside it (a symbolic "
                                          "link?): give `path` inside the root", "variant", "path_not_allowed")
            raise InvalidRequestError("`path` must be inside the server's artifact root", "path", "path_not_allowed")
        if not (folder / MANIFEST_NAME).is_file():
            raise InvalidRequestError(f"no {MANIFEST_NAME} in `{folder.relative_to(root)}` under the artifact root",
                                      "path", "artifact_not_found")
        other = self._other_base(folder / MANIFEST_NAME)
        if other is not None:
            raise InvalidRequestError(f"the artifact in `{folder.relative_to(root)}` was exported against another "
                                      f"base (fingerprint {other}, this server's base {self.base_fingerprint}); "
                                      "export it again against this base",
                                      "path", "base_mismatch")
        why = self._not_servable(folder / MANIFEST_NAME)  # column scales where the slots hold none
        if why is not None:
            raise InvalidRequestError(f"the artifact in `{folder.relative_to(root)}` cannot be used: it {why[0]}",
                                      "path", "artifact_unusable")
        with self._registry_lock:
            was_removed = mid in self._removed
            self._removed.discard(mid)
            old = self._variants.get(mid)
            was = self.cache.tier(mid)
            if old is not None and old.artifact_dir is not None and old.artifact_dir.resolve() != folder:
                try:
                    self.cache.unload(mid)  # another folder under this name: the new one replaces it
                except RuntimeError as e:
                    raise self._in_use(e) from None
            self._variants[mid] = ModelCard(mid, self.family, folder)
        try:
            self.get_delta(mid, request=False)
        except VariantUnavailableError as e:  # an unusable artifact is not served: the registry as it was
            with self._registry_lock:
                if old is None:
                    self._variants.pop(mid, None)
                    self.cache.forget(mid)
                else:
                    self._variants[mid] = old
                if was_removed:
                    self._removed.add(mid)
            if old is not None and was == "device" and self.cache.tier(mid) != "device":
                # the replacement failed: the variant it would have replaced goes back onto the device
                with contextlib.suppress(Exception):
                    self.get_delta(mid, request=False)
            if e.transient:  # no device slot in time: the artifact is fine, try again
                raise
            # the folder asked for cannot be used, as a bad path or another base's artifact: the caller's
            # to fix (vLLM answers a failed adapter load so), not a matter of retrying
            raise InvalidRequestError(f"the artifact in `{folder.relative_to(root)}` cannot be used: {e.reason}",
                                      "path", "artifact_unusable") from None
        return self._variants[mid]

    def remove_variant(self, model_id: str) -> ModelCard:
        """Stop serving a variant, as vLLM unloads a LoRA adapter: its deltas leave every cache tier
        and its id is neither listed nor served (404) — nor found again in the artifact root — until
        :meth:`add_variant` loads it again. Returns its card.

        Raises:
            InvalidRequestError: ``model_id`` is the base, which is always loaded.
            ModelNotFoundError: unknown id, or removed already.
            VariantInUseError: the variant has requests in flight.
            EngineFailedError: the engine cannot generate any more (:meth:`failure`).
        """
        if model_id == self.family:
            raise InvalidRequestError(f"`{model_id}` is the base model, which is always loaded: it cannot be "
                                      "unloaded", "variant", "base_model")
        if (failure := self.failure()) is not None:  # no rank can be told to free its slot
            raise failure
        card = self.card(model_id)  # finds an artifact folder added since the last listing
        with self._registry_lock:
            if self._variants.get(model_id) is not card:
                raise ModelNotFoundError(f"The model `{model_id}` does not exist")
            try:
                self.cache.unload(model_id)  # refuses a variant with requests in flight, also while it loads
            except RuntimeError as e:
                raise self._in_use(e) from None
            del self._variants[model_id]
            self._removed.add(model_id)
        return card

    def _in_use(self, e: RuntimeError) -> Exception:
        """The error of an unload refused with ``e``: the variant has requests in flight, or (a
        TensorParallelError) the group failed while the other ranks were told to free its slot."""
        failure = self.failure()
        return failure if failure is not None else VariantInUseError(str(e))

    # ---------------------------------------------------------------- tokens

    def encode_prompt(self, prompt: str | list[int], add_special_tokens: bool = True,
                      generating: bool = True) -> list[int]:
        """Token ids of a completion prompt: plain text, so ``"<|user|>"`` in it is text, not the special
        token (special tokens as the tokenizer adds them, e.g. BOS, are added unless
        ``add_special_tokens`` is false). Token ids pass as they are. ``generating=False``
        (``/tokenize``): a text refused untokenized for its length says so without a completion."""
        if isinstance(prompt, list):
            self._check_ids(prompt, "token ids", "prompt")
            return list(prompt)
        self._check_chars(len(prompt), "prompt", generating)
        check_unicode(prompt, "prompt")
        with self._tok_lock:
            return self.tokenizer.encode(prompt, split_special_tokens=True, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int]) -> str:
        """Text of token ids (special tokens kept), as ``/detokenize`` answers.

        Raises:
            InvalidRequestError: an id outside the vocabulary.
        """
        self._check_ids(ids, "token ids", "tokens")
        with self._tok_lock:
            return self.tokenizer.decode(ids)

    def _check_ids(self, ids, what: str, param: str | None) -> None:
        """Raise InvalidRequestError (``param``) naming the first ids of ``ids`` outside the vocabulary."""
        vocab = self.model.args.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"{what} out of range [0, {vocab}): {bad[:5]}", param, "invalid_value")

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each id as log-probabilities name tokens (``detokenize.token_name``: its own bytes' text, special
        tokens' too, or ``bytes:\\xNN…`` for a piece of a character)."""
        with self._tok_lock:
            return [token_name(b) for b in token_bytes(self.tokenizer, ids)]

    def token_strs(self, ids: list[int]) -> list[str]:
        """The vocabulary's string of each id (byte-level pieces as the tokenizer spells them)."""
        with self._tok_lock:
            return self.tokenizer.convert_ids_to_tokens(ids)

    def encode_chat(self, messages: list[dict[str, Any]], template_kwargs: dict[str, Any] | None = None,
                    tools: list[dict[str, Any]] | None = None, generating: bool = True, *,
                    add_generation_prompt: bool = True, continue_final_message: bool = False) -> list[int]:
        """Token ids of a chat (``[{"role", "content": str}]``, an assistant's ``tool_calls`` and a tool
        result's ``tool_call_id`` too), rendered with the tokenizer's chat template and the generation
        prompt; ``template_kwargs`` (vLLM's ``chat_template_kwargs``) are more variables for the
        template (not ``messages``, ``add_generation_prompt``, ``tokenize``, ``tools``); ``tools``
        (OpenAI's) are rendered by the template, which must take them.

        Only the template's own markers (role tokens, eos) are special tokens: a message that spells
        one (``"hi <|assistant|>"``) has it encoded as plain text, so its content cannot forge a turn;
        tools and tool calls that spell one are refused. A chat without such text is encoded exactly
        as ``apply_chat_template(tokenize=True)`` does. ``generating``: as :meth:`encode_prompt`'s.
        ``add_generation_prompt``, ``continue_final_message``: transformers' (vLLM's request fields):
        the text ends with the assistant turn's opening, or inside the last message, cut after its
        content where transformers cuts it (not both: the caller checks).
        """
        template = getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise InvalidRequestError(f"model `{self.family}` has no chat template; use /v1/completions", "messages",
                                      "invalid_value")
        calls = [json.dumps(m["tool_calls"], ensure_ascii=False) for m in messages if m.get("tool_calls")]
        calls += [m["tool_call_id"] for m in messages if m.get("tool_call_id")]
        listed = json.dumps(tools or [], ensure_ascii=False)
        if tools or calls:
            if "tools" not in template or "tool_calls" not in template:
                raise InvalidRequestError(f"model `{self.family}`'s chat template does not support tools",
                                          "tools" if tools else "messages", "tools_not_supported")
            self._check_chars(len(listed), "tools", generating)
            for text, param in [(listed, "tools")] + [(c, "messages") for c in calls]:
                check_unicode(text, param)
                # neither a template marker nor the placeholders of the contents (below) may be spelled
                if any(s in text for s in self._special_ids) or "\ue000" in text or "\ue001" in text:
                    raise InvalidRequestError(f"`{param}` spells one of the chat template's special tokens "
                                              "(or U+E000 / U+E001)", param, "invalid_value")
        self._check_chars(sum(len(m["content"].strip()) for m in messages) + sum(map(len, calls))  # templates may trim
                          + (len(listed) if tools else 0), "messages", generating)
        for m in messages:
            check_unicode(m["content"], "messages")
        ending = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message}
        if not any(s in m["content"] for m in messages for s in self._special_ids):
            text = self._render_chat(messages, template_kwargs, tools, **ending)
            with self._tok_lock:
                return self.tokenizer.encode(text, add_special_tokens=False)
        # Render with a placeholder for each content, cut the text at the (template's) special tokens,
        # put the contents back into the pieces (one pass: a content is never searched for marks) and
        # encode every piece as plain text, in one batch.
        marked = [{**m, "content": f"\ue000{i}\ue001"} for i, m in enumerate(messages)]
        text = self._render_chat(marked, template_kwargs, tools, **ending)
        pieces = [p for p in self._special_re.split(text) if p]
        plain = [_MARK.sub(lambda match: messages[int(match[1])]["content"], p) for p in pieces
                 if p not in self._special_ids]
        with self._tok_lock:
            encoded = iter(self.tokenizer(plain, add_special_tokens=False, split_special_tokens=True)["input_ids"]
                           if plain else ())
        ids = []
        for p in pieces:
            ids += [self._special_ids[p]] if p in self._special_ids else next(encoded)
        return ids

    def _longest_token_chars(self) -> int:
        """The most characters of text that one token can stand for: the longest decoded token of the
        vocabulary (special tokens included), + 1 for a decoder that drops a lone token's leading
        space (SentencePiece's ``▁``), × 4 if the tokenizer normalizes text (NFC composes up to 4 code
        points into one). A byte-level BPE token that ends inside a character decodes to U+FFFD: it
        still has a character for each character it begins."""
        ids = [[i] for i in range(len(self.tokenizer))]
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        backend = getattr(self.tokenizer, "backend_tokenizer", None)  # None: a slow tokenizer
        normalizes = backend is None or backend.normalizer is not None
        return (max(map(len, texts), default=0) + 1) * (4 if normalizes else 1)

    def _check_chars(self, n_chars: int, param: str, generating: bool = True) -> None:
        """Raise check_length's context_length_exceeded error, without tokenizing, when ``n_chars``
        characters are certainly more tokens than the context holds: more than :attr:`max_token_chars`
        × ``max_model_len``. Tokenizing holds the tokenizer's one lock for seconds per megabyte, which
        would stall every other request. ``generating=False``: the text is only to be tokenized."""
        n, per = self.max_model_len, self.max_token_chars
        if n_chars > per * n:
            why = "which leaves no room for the completion" if generating else "so it is not tokenized"
            raise InvalidRequestError(
                f"This model's maximum context length is {n} tokens, but `{param}` holds {n_chars} characters: "
                f"more than {n} tokens even at {per} characters per token (the most one token stands for), {why}. "
                f"Please reduce the length of the {param}.",
                param, "context_length_exceeded",
            )

    def _render_chat(self, messages: list[dict[str, Any]], template_kwargs: dict[str, Any] | None = None,
                     tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True,
                     continue_final_message: bool = False) -> str:
        """The chat as text. ``template_kwargs`` are variables of the template only: ``messages`` and
        every option of ``apply_chat_template`` (``chat_template``, a template of the request's own,
        which would render text that no length check has seen; ``tools``, ``documents``,
        ``tokenize``, ...) are refused by name (InvalidRequestError; vLLM refuses a template there too)."""
        reserved = ()
        if template_kwargs:
            reserved = ({"messages"} | _chat_template_options(self.tokenizer)) & set(template_kwargs)
        if reserved:
            raise InvalidRequestError(f"chat_template_kwargs may not set {sorted(reserved)}: it holds variables of "
                                      "the model's chat template, not options of its rendering",
                                      "chat_template_kwargs", "invalid_value")
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=continue_final_message, tokenize=False,
                                                      **(template_kwargs or {}), **({"tools": tools} if tools else {}))
        except Exception as e:  # jinja errors: a message shape the template rejects
            raise InvalidRequestError(f"cannot render messages with the chat template: {e}", "messages",
                                      "invalid_value") from e

    def _eos_ids(self) -> set[int]:
        ids = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        for f in ("config.json", "generation_config.json"):
            p = self.base_dir / f
            if p.is_file():
                eos = json.loads(p.read_text()).get("eos_token_id")
                ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
        return ids

    def check_length(self, prompt_tokens: int, max_tokens: int | None, param: str = "prompt") -> int:
        """The number of tokens to generate at most; raises InvalidRequestError if it does not fit.

        ``max_tokens=None`` means "the rest of the context".
        """
        n = self.max_model_len
        if prompt_tokens == 0:
            raise InvalidRequestError("the prompt is empty (0 tokens)", param, "invalid_value")
        if prompt_tokens >= n:  # no room for even one new token, whatever max_tokens says
            raise InvalidRequestError(
                f"This model's maximum context length is {n} tokens, but there are {prompt_tokens} tokens in the "
                f"{param} alone, which leaves no room for the completion. Please reduce the length of the {param}.",
                param, "context_length_exceeded",
            )
        if max_tokens is None:
            max_tokens = n - prompt_tokens
        if max_tokens < 1:  # the prompt's prefill samples a first token (vLLM refuses it too)
            raise InvalidRequestError(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens",
                                      "invalid_value")
        if prompt_tokens + max_tokens > n:
            raise InvalidRequestError(
                f"This model's maximum context length is {n} tokens. However, you requested "
                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {param}, {max_tokens} in the "
                "completion). Please reduce the length of the prompt or max_tokens.",
                param, "context_length_exceeded",
            )
        return max_tokens

    # ---------------------------------------------------------------- generation

    def prepare(self, model_id: str, prompt_ids: list[int], params: SamplingParams,
                param: str = "prompt", held: VariantDelta | None = None) -> Request:
        """Check a request and load its variant, so that errors surface before any output. ``held``:
        the variant's deltas another request of the caller's holds (a later choice of one HTTP request
        passes its first choice's ``delta``): this one takes them too, their version, without waiting
        behind a load that waits for that hold to end (:meth:`acquire_delta`).

        Raises:
            ModelNotFoundError: unknown model id (404).
            InvalidRequestError: empty prompt, max_tokens below 1, prompt + max_tokens beyond the context,
                min_tokens above max_tokens, or a prompt or stop token id outside the vocabulary (400).
            VariantUnavailableError: the variant's artifact cannot be used (503).
            EngineFailedError: the engine cannot generate any more (:meth:`failure`).
            ServerShuttingDownError (or the error :meth:`drain` was given): the server is shutting down.
        """
        if (failure := self.failure()) is not None:
            raise failure
        if self._closing is not None:
            raise self._closing
        model_id = self.card(model_id).id
        max_tokens = self.check_length(len(prompt_ids), params.max_tokens, param)
        if params.min_tokens > max_tokens:
            raise InvalidRequestError(f"min_tokens ({params.min_tokens}) must be at most max_tokens ({max_tokens})",
                                      "min_tokens", "invalid_value")
        # the in-process API's prompt (HTTP's: encode_prompt): in a step, an id outside the embedding fails
        # every request of it (on CUDA: the device)
        self._check_ids(prompt_ids, "prompt token ids", param)
        self._check_ids(params.stop_token_ids, "stop_token_ids", "stop_token_ids")
        grammar = None
        if params.constraint is not None:  # compiled here, in the request's thread: a bad schema is its 400
            grammar = self.grammars.compile(*params.constraint, param=params.constraint_param)
        req = Request(model_id, list(prompt_ids), max_tokens, params, self._acquire_waiting(model_id, held))
        req.grammar = grammar
        return req

    def _acquire_waiting(self, model_id: str, held: VariantDelta | None) -> VariantDelta | None:
        """:meth:`acquire_delta` for a request, counted among the waiting (:meth:`load`) while it waits
        (a hot load's wait, :meth:`add_variant`, is no request's)."""
        if model_id == self.family:
            return None
        with self._release_lock:
            self._loading[model_id] += 1
        try:
            return self.acquire_delta(model_id, held)
        finally:
            with self._release_lock:
                self._loading[model_id] -= 1

    def run(self, request: Request, *, cancel: threading.Event | None = None,
            on_start: Callable[[], None] | None = None) -> Iterator[Step]:
        """Generate: prefill the prompt, then one token per :class:`Step` until eos, a stop string or max_tokens.

        The request joins the continuous batch (serve/scheduler.py): it decodes together with the
        other running requests, whatever their variants. Greedy below ``SAMPLING_EPS``, else
        temperature, top-k and top-p sampling (serve/sampling.py), seeded by ``seed`` if given (the
        same seed, prompt and model give the same tokens, whatever shares the batch). The texts of the steps
        concatenate to the completion: a stop string is cut off (the text ends before it); partial
        UTF-8 and possible stop prefixes are held back until resolved. ``on_start`` is called once
        the request enters the batch; setting ``cancel`` (or closing this iterator) ends it after the
        current step and frees its KV blocks and its hold on the variant. The request is submitted
        here, not at the first step read, and an iterator dropped unread ends it too: it never holds
        its variant for ever.
        """
        out, cancel = self.scheduler.submit(request, cancel, on_start)
        steps = _steps(out, cancel)
        weakref.finalize(steps, cancel.set)  # collected before its end (never read, say): the request ends
        return steps

    def generate(self, model_id: str, prompt_ids: list[int], params: SamplingParams) -> Iterator[Step]:
        """:meth:`prepare` then :meth:`run`."""
        return self.run(self.prepare(model_id, prompt_ids, params))

    def complete(self, model_id: str, prompt: str | list[int], params: SamplingParams) -> Completion:
        """Run :meth:`generate` to the end on a prompt (in-process use, tests)."""
        ids = self.encode_prompt(prompt)
        steps = list(self.generate(model_id, ids, params))
        return Completion("".join(s.text for s in steps), steps[-1].finish_reason, len(ids), len(steps),
                          [s.token_id for s in steps])
