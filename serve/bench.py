"""Serving benchmark (``make bench-serve``): one run on one GPU that measures the engine's decode
steps, the real server over HTTP at several concurrencies, and Hugging Face transformers on the
same requests. Configuration: ``conf/bench_serve.yaml`` (``conf/bench_serve_70b.yaml``: a 70B-shaped
family over 2 GPUs).

Steps, in this order, driven from one process (the engine steps and the peers run in it):

1. **Engine steps** (``engine_steps: true``): ``deltafleet.serve.bench_step.engine_steps(cfg)``, no
   HTTP: decode step time ÷ the bandwidth floor at 1/16/64/256 rows, base rows and rows over the
   variants. Its whole return value goes to ``report["engine_steps"]``; it holds
   ``"step_over_floor": {"<rows>": {"base": x, "mixed": y}}``. A missing module or an exception is
   recorded as ``{"error": ...}`` and the run goes on. The device's cache is emptied afterwards.
2. **The family.** ``synthetic: true`` (the default): only a tokenizer is written (a byte-level BPE
   trained on a few standard-library modules, padded with plain tokens to the vocabulary, so every
   sampled id streams as text); the server generates the base and ``variants`` variants on its
   devices (serve/synthetic.py). ``synthetic: false``: a random family built once under
   ``family_dir`` (a base, a fine-tune = base + N(0, 10⁻⁶) exported with ``compress`` as ``v00``,
   and ``variants − 1`` artifacts with the same scales and random signs).
3. **The server**, ``serve/run.py`` in a child process on 127.0.0.1: every variant in a device slot,
   ``max_waiting=null`` (never a 429), tensor parallel over ``tp`` processes, plus every key of the
   ``server`` dict forwarded verbatim as an override (``key=value`` in Hydra's grammar, e.g.
   ``max_batch``, ``max_num_batched_tokens``, ``kv_cache``); ``max_waiting=null`` comes last.
4. **The load**, streamed completions (``temperature`` 1.0, a seed per request, ``max_tokens`` each,
   ``ignore_eos``: every completion runs to its length, as the peers' do)
   from ``client_processes`` client processes (asyncio + httpx each; the requests are handed out
   from one shared counter, so exactly ``concurrency`` are in flight until the last ones):

   * warm-up: one request per model (a non-synthetic variant's cold load from disk), then
     ``max(concurrency)`` short requests at that concurrency; not counted.
   * ``loads``: for every ``concurrency`` level c, ``requests_for(c)`` requests
     (``clip(per_concurrency·c, min, max)``) whose prompt and output lengths are lognormal
     (:func:`lognormal_lengths`: medians ``lengths.prompt_median`` / ``lengths.output_median``,
     ``lengths.sigma``, clipped to ``[lengths.min, lengths.max]``, then cut so that prompt + output
     fits ``max_position_embeddings``, :func:`fit_context`) and whose prompts are random token ids,
     all from fixed seeds. Each set runs twice: ``base`` (every request to the base) and ``mixed``
     (each request's model drawn from Zipf(``zipf_s``) over the base then ``v00``, ``v01``, …, in
     that rank order, :func:`zipf_models`); same prompts, lengths and sampling seeds.
   * ``ttft``: the fixed TTFT setting, ``ttft.requests`` requests of ``ttft.prompt_tokens`` prompt
     tokens and ``ttft.max_tokens`` new tokens at ``ttft.concurrency``, base and mixed.
   * ``burst``: ``burst.requests`` requests of ``burst.prompt_tokens`` (null: the context minus
     ``burst.max_tokens``) prompt tokens, all sent at once, mixed models.

   Per load (:func:`phase_stats`): tokens/s = completion tokens of the answered requests ÷ the
   phase's wall time (first send to last byte); TTFT = first text chunk − send; inter-token
   latency = gaps between text chunks; P50 and P99, overall, base vs variants, and per model;
   every non-200 status, in-band error event or client exception is recorded (``errors``,
   ``status_codes``); ``all_answered``; ``token_mismatches`` counts answered requests whose
   ``completion_tokens`` differ from ``max_tokens`` (none should: ``ignore_eos``).
5. **Non-synthetic only**: ``extra_for_host_tier`` variants hot-loaded past the device slots, then
   requests for the evicted ones (cold loads from the host tier); cold-load seconds by tier from
   ``/metrics``. Memory (``nvidia-smi`` per GPU, the tensors predicted per rank, the server's
   resident set), then the server is stopped (the device is free again).
6. **Peers** (``peers: true``): Hugging Face transformers on the same device and dtype, a
   ``LlamaForCausalLM`` of the same shape initialised at random directly on the device
   (``AutoModelForCausalLM.from_config`` under ``torch.device``), on the request set of
   ``summary_concurrency`` (same prompts and output lengths), sampling at temperature 1 without
   top-k/top-p and without eos, so each request gets exactly its length. A small warm-up run
   first, outside the timed region. tokens/s = requested completion tokens ÷ wall:

   * ``hf_continuous_batching`` (:func:`hf_continuous_batching`), ``hf.cb_api``:
     ``manager`` (the default): ``model.continuous_batching_context_manager(...)`` — the manager
     ``generate_batch`` itself drives — and one ``manager.add_request(ids, max_new_tokens=n)`` per
     request, so each request generates exactly its own length (``generate_batch`` takes one
     ``max_new_tokens`` for all). Timed from after the manager's start (its warm-up, e.g. CUDA
     graph capture, is outside) to the last result. ``generate_batch``: one
     ``model.generate_batch(inputs=..., max_new_tokens=<the longest>)`` call, the whole call timed,
     only each request's first n tokens counted.
     ``hf.cb_config`` is passed as ``ContinuousBatchingConfig(**cb_config)``, with the benchmark's
     ``seed`` unless it sets one, and on the CPU a ``num_blocks`` that holds every request at once
     unless it sets one (the library would size its cache from 90% of the free RAM).
   * ``hf_static`` (:func:`hf_static`): ``model.generate(..., cache_implementation="static")`` in
     batches of ``hf.static_batch`` in request order, left-padded with an attention mask, each
     batch generating its longest output, only each request's own length counted; a short last
     batch is filled up with copies of its rows (not counted) so that every call has the same
     shape, and ``max_cache_len`` is the largest any batch needs, so that the cache (and on CUDA
     the auto-compiled decode step) keeps one shape; the warm-up call compiles it.

   An exception in a peer is recorded (``{"error": ...}``), not raised.
7. **Report**: after each phase (the engine steps, each concurrency's loads, the TTFT setting, the
   burst) what is measured so far is rewritten to ``reports/<report_name>.partial.json``
   (``phases_done`` lists them), so a run stopped midway keeps it. ``resume=true`` goes on from that
   file, measuring only the phases it lacks (:func:`resumed_report`: the configuration must be the
   same, but for where files go and the pacing keys); ``stop_after_s`` stops a run after the first
   phase that ends past that many seconds (exit status 3), so that a machine lent for a few minutes at
   a time measures one run in several calls. ``phase_gpus`` names the GPU (its UUID) that measured
   each phase, the peers included: whether ours and the peers' figures came from one device. At the
   end ``reports/<report_name>.json`` (atomic) and ``.png`` replace it (tokens/s and TTFT against
   concurrency, the peers as points, step ÷ floor bars). ``summary`` (printed at the end) holds
   exactly ``step_over_floor`` (rows 16/64/256; nulls where not measured), ``tokens_per_s`` (base,
   mixed, hf_continuous_batching, hf_static at ``summary_concurrency``), ``ttft_p50_s`` (base,
   mixed, the ttft setting), each null for a load or peer some request of which was not answered (or
   cut short), ``machine`` and ``commit`` (``$DELTAFLEET_COMMIT`` where set, else
   ``git rev-parse HEAD`` of the checkout, else null). ``ratios`` and ``goals`` (bool, or null where an input
   was not measured, or measured at other settings than issue #25's: tokens/s at 64 clients, TTFT at 16
   clients of 128-token prompts) sit beside it. ``decode_floor`` (:func:`mixed_floor`, arithmetic on the shape
   and the requests) is the mixed ÷ base tokens/s that the summary load's decode steps would give
   at their bandwidth floors: the bound the signs' bytes set on ``ratios``'
   ``mixed_over_base_tokens_per_s``, which ``ratios`` quotes beside it.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import traceback
import uuid
from collections import Counter
from pathlib import Path

import hydra
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

REPO = Path(__file__).resolve().parents[1]
TOKENIZER_SOURCES = ("textwrap.py", "string.py", "fnmatch.py", "shlex.py", "argparse.py", "json/decoder.py")
BASE_ID = "bench"  # the served family's name: the base's model id; variants are bench-v00, bench-v01, ...
FIRST_PROMPT_ID = 4  # prompts are random token ids in [FIRST_PROMPT_ID, vocab_size)
SUMMARY_ROWS = ("16", "64", "256")  # the engine-step rows the summary quotes
# the settings of issue #25's goals: tokens/s at 64 clients, TTFT at 16 clients of 128-token prompts
GOAL_CONCURRENCY, GOAL_TTFT = 64, {"concurrency": 16, "prompt_tokens": 128}
# the seeds' streams (numpy SeedSequence entropy: [seed, stream, level])
_LENGTHS, _ZIPF, _TTFT, _TTFT_ZIPF, _BURST, _WARMUP = range(6)


# --------------------------------------------------------------------------------------------
# The family
# --------------------------------------------------------------------------------------------


def random_sign_artifact(src: Path, dst: Path, variant: str, seed: int) -> None:
    """Write the artifact ``dst`` = ``src`` with every ``*.sign`` replaced by random bytes (a variant
    of the same size and scales), hashes and manifest redone; atomic (staged folder + rename)."""
    from deltafleet.compress.bitdelta import _sha256_file, write_manifest
    from safetensors.torch import load_file, save_file

    from deltafleet.atomic import staged_dir

    manifest = json.loads((src / "bitdelta.json").read_text())
    g = torch.Generator().manual_seed(seed)
    with staged_dir(dst) as tmp:
        for name in manifest["files"]:
            if name.endswith(".safetensors"):
                tensors = load_file(src / name)
                for k, t in tensors.items():
                    if k.endswith(".sign"):
                        tensors[k] = torch.randint(0, 256, t.shape, generator=g, dtype=torch.uint8)
                save_file(tensors, tmp / name, metadata={"format": "pt"})
            else:
                shutil.copyfile(src / name, tmp / name)
        manifest["files"] = {f: _sha256_file(tmp / f) for f in manifest["files"]}
        manifest["variant"] = variant
        manifest["provenance"] = {**manifest["provenance"], "run_id": uuid.uuid4().hex,
                                  "note": f"random signs (seed {seed}) on the scales of {manifest['variant']}"}
        write_manifest(tmp, manifest)


def stdlib_tokenizer(out: Path, vocab_size: int, model_max_length: int):
    """A byte-level BPE (train/tokenizer.py) of ``min(1024, vocab_size)`` entries trained on a few of the
    standard library's modules (:data:`TOKENIZER_SOURCES`), padded with plain tokens ``<t{i}>`` up to
    ``vocab_size`` so that every id a model samples decodes to text; saved to ``out`` (Hugging Face
    format; into an existing folder, e.g. a checkpoint's, next to its files). Returns the tokenizer.

    Raises:
        ValueError: ``vocab_size`` below the 260 byte symbols and special tokens.
    """
    import tempfile

    from deltafleet.train.tokenizer import train_tokenizer

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    with tempfile.TemporaryDirectory() as d:
        corpus = Path(d) / "tokenizer_corpus.jsonl"
        corpus.write_text("".join(json.dumps({"text": (stdlib / f).read_text()}) + "\n" for f in TOKENIZER_SOURCES))
        tok = train_tokenizer([corpus], min(1024, vocab_size), out, model_max_length=model_max_length)
    tok.add_tokens([f"<t{i}>" for i in range(len(tok), vocab_size)])  # every id decodes to text
    tok.save_pretrained(out)
    return tok


def build_tokenizer(cfg: DictConfig) -> Path:
    """Only the tokenizer of a synthetic family, ``<family_dir>/tokenizer`` (built once)."""
    from deltafleet.atomic import staged_dir

    out = Path(cfg.family_dir) / "tokenizer"
    if not (out / "tokenizer.json").is_file():
        with staged_dir(out) as tmp:
            stdlib_tokenizer(tmp, int(cfg.shapes[cfg.shape].vocab_size), cfg.max_position_embeddings)
    return out


def build_family(cfg: DictConfig) -> Path:
    """The benchmark family under ``cfg.family_dir`` (built once; see the module docstring)."""
    from deltafleet.compress.bench import generate_pair
    from deltafleet.compress.bitdelta import compress

    from deltafleet.atomic import staged_dir

    out = Path(cfg.family_dir)
    if (out / "family.json").is_file():
        return out
    shape = dict(OmegaConf.to_container(cfg.shapes[cfg.shape]))
    dtype = getattr(torch, cfg.dtype) if cfg.dtype != "float32" else torch.float32
    t0 = time.perf_counter()
    with staged_dir(out) as tmp:
        generate_pair(tmp / "pair", shape, dtype, delta_std=1e-3, seed=cfg.seed, shard_bytes=2_000_000_000)
        base = tmp / "base"
        os.replace(tmp / "pair" / "base", base)
        tok = stdlib_tokenizer(base, shape["vocab_size"], cfg.max_position_embeddings)
        conf = json.loads((base / "config.json").read_text())
        conf.update(max_position_embeddings=cfg.max_position_embeddings, eos_token_id=tok.eos_token_id,
                    bos_token_id=None, pad_token_id=tok.eos_token_id)
        (base / "config.json").write_text(json.dumps(conf, indent=2))
        arts = tmp / "artifacts"
        compress(base, tmp / "pair" / "ft", arts / "v00", variant="v00", granularity="row")
        shutil.rmtree(tmp / "pair")
        for i in range(1, cfg.variants):
            random_sign_artifact(arts / "v00", arts / f"v{i:02d}", f"v{i:02d}", cfg.seed * 1000 + i)
        (tmp / "family.json").write_text(json.dumps({"shape": shape, "dtype": cfg.dtype, "variants": cfg.variants,
                                                     "seed": cfg.seed, "build_seconds": time.perf_counter() - t0}))
    return out


# --------------------------------------------------------------------------------------------
# The workload
# --------------------------------------------------------------------------------------------


def lognormal_lengths(rng: np.random.Generator, n: int, median: float, sigma: float, lo: int, hi: int) -> np.ndarray:
    """``n`` token counts, lognormal with median ``median`` and log-space deviation ``sigma``, rounded
    and clipped to ``[lo, hi]`` (int64)."""
    if not (1 <= lo <= hi) or median <= 0 or sigma < 0:
        raise ValueError(f"need 1 <= lo <= hi, median > 0, sigma >= 0; got {lo=} {hi=} {median=} {sigma=}")
    x = rng.lognormal(np.log(median), sigma, n) if sigma > 0 else np.full(n, float(median))
    return np.clip(np.rint(x), lo, hi).astype(np.int64)


def fit_context(prompt: np.ndarray, output: np.ndarray, context: int, lo: int) -> tuple[np.ndarray, np.ndarray]:
    """Lengths cut so that ``prompt + output <= context``: the output to at most ``context − lo`` (room for
    a prompt of ``lo``), then the prompt to what is left.

    Raises:
        ValueError: ``context < 2·lo`` (not even the shortest prompt and output fit).
    """
    if context < 2 * lo:
        raise ValueError(f"a context of {context} tokens cannot hold a prompt and an output of {lo} tokens each")
    output = np.minimum(output, context - lo)
    return np.minimum(prompt, context - output), output


def zipf_probabilities(n: int, s: float = 1.0) -> np.ndarray:
    """P(rank k) ∝ 1 / k^s for k = 1..n."""
    p = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** s
    return p / p.sum()


def zipf_models(models: list[str], n: int, s: float, seed: list[int]) -> list[str]:
    """``n`` picks from ``models`` (rank order: the first is the most popular), Zipf(``s``), seeded."""
    rng = np.random.default_rng(seed)
    return [models[i] for i in rng.choice(len(models), n, p=zipf_probabilities(len(models), s))]


def decode_floor_ratio(lengths: list[tuple[int, int]], on_variant: list[int], concurrency: int,
                       nbytes: dict) -> dict:
    """The mixed load's tokens/s ÷ the base load's if every decode step ran at its bandwidth floor:
    what the bytes allow "mixed ÷ base" to reach.

    The requests (``lengths``: prompt and output tokens) go in order, ``concurrency`` at once, the
    next one as soon as one ends, as the load generator sends them. Each step every request in flight
    decodes one token and reads the weights and its live keys and values; in the mixed load the step
    also reads the signs of each distinct variant among its requests (``on_variant``: each request's
    variant index, −1 for the base). ``nbytes``: :func:`deltafleet.serve.bench_step.decode_bytes`.
    Both loads take the same steps, so the ratio is the base load's floor time ÷ the mixed load's.
    Prefill is not counted, nor the token it samples: a request of ``n`` new tokens decodes ``n − 1``
    of them, the first reading its prompt and that token. Returns ``{"mixed_over_base", "steps",
    "mean_rows", "mean_variants"}``."""
    waiting, live = iter(range(len(lengths))), {}  # request → [context, tokens left to decode]
    base = mixed = rows = variants = steps = 0
    while True:
        while len(live) < concurrency and (i := next(waiting, None)) is not None:
            if lengths[i][1] > 1:  # one new token: the prefill's alone
                live[i] = [lengths[i][0], lengths[i][1] - 1]
        if not live:
            break
        n_var = len({on_variant[i] for i in live} - {-1})
        t = nbytes["weights"] + nbytes["kv_per_token"] * sum(ctx + 1 for ctx, _ in live.values())
        base, mixed = base + t, mixed + t + n_var * nbytes["signs"]
        rows, variants, steps = rows + len(live), variants + n_var, steps + 1
        for i, s in list(live.items()):
            s[0], s[1] = s[0] + 1, s[1] - 1
            if s[1] <= 0:
                del live[i]
    return {"mixed_over_base": base / mixed if mixed else None, "steps": steps,
            "mean_rows": rows / steps if steps else None, "mean_variants": variants / steps if steps else None}


def requests_for(cfg: DictConfig, concurrency: int) -> int:
    """Requests of the load at ``concurrency``: ``clip(per_concurrency · concurrency, min, max)``."""
    r = cfg.requests
    return int(min(max(r.min, r.per_concurrency * concurrency), r.max))


def random_prompts(rng: np.random.Generator, lengths, vocab: int) -> list[list[int]]:
    return [rng.integers(FIRST_PROMPT_ID, vocab, int(k)).tolist() for k in lengths]


def load_requests(cfg: DictConfig, concurrency: int, vocab: int) -> list[tuple[list[int], int]]:
    """The (prompt ids, max_tokens) of the load at ``concurrency``: lognormal lengths fitted to the
    context, random prompts, from the seed ``[cfg.seed, _LENGTHS, concurrency]`` (the same for the
    base and the mixed load, and for the peers)."""
    ln = cfg.lengths
    rng = np.random.default_rng([cfg.seed, _LENGTHS, concurrency])
    n = requests_for(cfg, concurrency)
    prompt = lognormal_lengths(rng, n, ln.prompt_median, ln.sigma, ln.min, ln.max)
    output = lognormal_lengths(rng, n, ln.output_median, ln.sigma, ln.min, ln.max)
    prompt, output = fit_context(prompt, output, cfg.max_position_embeddings, ln.min)
    return list(zip(random_prompts(rng, prompt, vocab), output.tolist()))


def fixed_requests(n: int, prompt_tokens: int, max_tokens: int, vocab: int,
                   seed: list[int]) -> list[tuple[list[int], int]]:
    """``n`` requests of ``prompt_tokens`` random prompt ids and ``max_tokens`` new tokens each."""
    rng = np.random.default_rng(seed)
    return [(p, int(max_tokens)) for p in random_prompts(rng, [prompt_tokens] * n, vocab)]


def burst_prompt_tokens(cfg: DictConfig) -> int:
    b = cfg.burst
    return int(b.prompt_tokens if b.prompt_tokens is not None else cfg.max_position_embeddings - b.max_tokens)


class SettingError(ValueError):
    """A setting of the run, or a partial report it cannot go on from: said in one line, no traceback."""


FLAGS = ("engine_steps", "peers", "structured.enabled", "synthetic", "kernel_autotune", "resume")
DTYPE_NAMES = ("bfloat16", "float16", "float32")


def check_settings(cfg: DictConfig) -> None:
    """Raises SettingError for a setting of the wrong kind or out of range, naming it, before any
    work: the yes/no settings (``peers=no`` is text to Hydra, not false), the counts (a load of no
    clients or no requests would meet its goals with nothing sent), the seed, the port, the shape, the dtype
    and the report's name (a file name inside ``reports/``). The server checks its own settings
    (``device``, ``sign_layout``, ``server.*``) and the benchmark shows its error line."""
    from deltafleet.cli import check_report_name, check_settings as check_names, flag, top_level_settings
    from deltafleet.values import real, whole

    try:
        check_names(cfg, "bench_serve.yaml")  # a misspelt +key at the top level (its sections hold shapes, ...)
        for key in FLAGS:
            flag(cfg, key)
        check_report_name(cfg.report_name)
    except ValueError as e:
        raise SettingError(str(e)) from None
    counts = {"variants": cfg.variants, "client_processes": cfg.client_processes,
              "max_position_embeddings": cfg.max_position_embeddings, "summary_concurrency": cfg.summary_concurrency,
              "tp": cfg.tp, "ttft.requests": cfg.ttft.requests, "ttft.concurrency": cfg.ttft.concurrency,
              "ttft.prompt_tokens": cfg.ttft.prompt_tokens, "ttft.max_tokens": cfg.ttft.max_tokens,
              "burst.requests": cfg.burst.requests, "burst.max_tokens": cfg.burst.max_tokens,
              **{f"requests.{k}": v for k, v in cfg.requests.items()},
              **{f"concurrency[{i}]": c for i, c in enumerate(cfg.concurrency)}}
    for key, v in counts.items():
        if not whole(v) or v < 1:
            raise SettingError(f"{key} must be a whole number ≥ 1, got {v!r}")
    if (v := cfg.burst.prompt_tokens) is not None and (not whole(v) or v < 1):
        raise SettingError(f"burst.prompt_tokens must be null or a whole number ≥ 1, got {v!r}")
    if not whole(cfg.seed) or cfg.seed < 0:  # the workload's generators (numpy SeedSequence) take no other
        raise SettingError(f"seed must be a whole number ≥ 0, got {cfg.seed!r}")
    if not whole(cfg.port) or not 1 <= cfg.port <= 65535:
        raise SettingError(f"port must be a port number from 1 to 65535, got {cfg.port!r}")
    if not whole(cfg.warmup.max_tokens) or cfg.warmup.max_tokens < 1:
        raise SettingError(f"warmup.max_tokens must be a whole number ≥ 1, got {cfg.warmup.max_tokens!r}")
    if not whole(cfg.extra_for_host_tier) or cfg.extra_for_host_tier < 0:
        raise SettingError(f"extra_for_host_tier must be a whole number ≥ 0, got {cfg.extra_for_host_tier!r}")
    for key in ("startup_timeout_s", "zipf_s"):  # seconds > 0; a popularity exponent ≥ 0 (0: uniform)
        if not real(v := cfg[key]) or v < 0 or (v == 0 and key == "startup_timeout_s"):
            raise SettingError(f"{key} must be a number {'> 0' if key == 'startup_timeout_s' else '≥ 0'}, got {v!r}")
    if cfg.shape not in cfg.shapes:
        raise SettingError(f"shape must be one of {sorted(cfg.shapes)} (or a new entry under shapes), got {cfg.shape!r}")
    shape = cfg.shapes[cfg.shape]
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads"):
        if not whole(shape.get(key)) or shape[key] < 1:
            raise SettingError(f"shapes.{cfg.shape}.{key} must be a whole number ≥ 1, got {shape.get(key)!r}")
    h, heads, kv = shape.hidden_size, shape.num_attention_heads, shape.num_key_value_heads
    if h % heads or (h // heads) % 2 or heads % kv:
        raise SettingError(f"shapes.{cfg.shape}: hidden_size {h} must be num_attention_heads {heads} × an even head "
                           f"size, and num_attention_heads a multiple of num_key_value_heads {kv}")
    served = top_level_settings("serve.yaml")
    unknown = sorted(set(cfg.get("server") or {}) - served)
    if unknown:
        raise SettingError(f"server.{unknown[0]} is not a setting of conf/serve.yaml (the server's); its settings: "
                           f"{', '.join(sorted(served))}")
    if cfg.dtype not in DTYPE_NAMES:
        raise SettingError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {cfg.dtype!r}")
    ln = cfg.lengths
    if not (whole(ln.min) and whole(ln.max) and 1 <= ln.min <= ln.max):
        raise SettingError(f"lengths.min and lengths.max must be whole numbers with 1 ≤ min ≤ max, got {ln.min!r}, "
                           f"{ln.max!r}")
    for key in ("prompt_median", "output_median", "sigma"):
        if not real(v := ln[key]) or v <= 0:
            raise SettingError(f"lengths.{key} must be a number > 0, got {v!r}")


def check_workload(cfg: DictConfig) -> None:
    """Raises SettingError where a fixed setting does not fit the served context, or a level is missing."""
    ctx = cfg.max_position_embeddings
    if not list(cfg.concurrency):
        raise SettingError("concurrency: at least one level")
    if ctx < 2 * cfg.lengths.min:  # fit_context keeps at least lengths.min of each
        raise SettingError(f"max_position_embeddings: a context of {ctx} cannot hold a prompt and an output of "
                           f"lengths.min ({cfg.lengths.min}) tokens each")
    for c in cfg.concurrency:  # fewer requests than clients: the load runs below its level, labelled with it
        if requests_for(cfg, c) < c:
            raise SettingError(f"requests: the load at concurrency {c} has {requests_for(cfg, c)} requests, fewer "
                               "than its clients: raise requests.max (or min)")
    if cfg.ttft.requests < cfg.ttft.concurrency:
        raise SettingError(f"ttft: {cfg.ttft.requests} requests for {cfg.ttft.concurrency} clients: the load would "
                           "run below its concurrency")
    for name, p, o in (("ttft", cfg.ttft.prompt_tokens, cfg.ttft.max_tokens),
                       ("burst", burst_prompt_tokens(cfg), cfg.burst.max_tokens),
                       ("warmup", cfg.lengths.min, cfg.warmup.max_tokens)):  # its prompts: lengths.min or more
        if p < 1 or o < 1 or p + o > ctx:
            raise SettingError(f"{name}: {p} prompt + {o} new tokens do not fit a context of {ctx}")


# --------------------------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------------------------


def hydra_value(v) -> str:
    """``v`` (a dict, list, str, int, float, bool or None) written in Hydra's override grammar, strings
    quoted: ``{"a": {"b": 1}, "c": "/x"}`` → ``{a:{b:1},c:'/x'}``. In a quoted string a backslash is
    itself, but for a run of them before a quote or the closing one: those are doubled, and a quote
    escaped.

    Raises:
        TypeError: on another type.
    """
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{hydra_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(hydra_value(x) for x in v) + "]"
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (str, Path)):
        s = re.sub(r"(\\*)'", lambda m: 2 * m.group(1) + "\\'", str(v))
        return "'" + re.sub(r"(\\+)$", lambda m: 2 * m.group(1), s) + "'"
    raise TypeError(f"no Hydra override for {type(v).__name__}")


def synthetic_shape(cfg: DictConfig) -> dict:
    """The served shape: ``shapes[shape]`` with the benchmark's context, as Hugging Face config fields."""
    return {**OmegaConf.to_container(cfg.shapes[cfg.shape]), "max_position_embeddings": cfg.max_position_embeddings}


def server_overrides(cfg: DictConfig, family: Path, tp_port: int) -> list[str]:
    """``serve/run.py``'s overrides for the benchmark's server: the family of ``family`` (a built one,
    or with ``cfg.synthetic`` its tokenizer and a generated family of ``cfg.variants``), every variant
    in a device slot, tensor parallel over ``cfg.tp`` processes; then every key of ``cfg.server``
    verbatim (``key=<hydra_value(value)>``: a dict merges into the served config's dict of that
    name); ``max_waiting=null`` last (the benchmark's loads queue, never a 429)."""
    out = [f"model.name={BASE_ID}", f"port={cfg.port}", f"device={cfg.device}", f"dtype={cfg.dtype}",
           f"delta_cache.device_slots={cfg.variants}", f"delta_cache.sign_layout={cfg.get('sign_layout', 'tiled')}",
           "log_level=warning", f"tp={cfg.tp}", f"tp_port={tp_port}"]
    if cfg.synthetic:
        syn = {"shape": synthetic_shape(cfg), "variants": cfg.variants, "seed": cfg.seed, "tokenizer_dir": family}
        out += ["delta_cache.host_budget_gb=0", f"synthetic={hydra_value(syn)}"]
    else:
        out += [f"base_dir={family / 'base'}", f"artifacts_dir={family / 'artifacts'}",
                "delta_cache.host_budget_gb=1000"]
    extra = OmegaConf.to_container(cfg.server, resolve=True) if cfg.get("server") else {}
    return out + [f"{k}={hydra_value(v)}" for k, v in extra.items()] + ["max_waiting=null"]


def http_stack(cfg: DictConfig) -> dict:
    """The event loop and HTTP parser the server runs (its process imports what this one can):
    uvicorn takes uvloop where it is installed, and ``http_parser: auto`` httptools. Without them the
    event loop costs more CPU per streamed token, and the model thread waits longer for the GIL."""
    from importlib.util import find_spec

    parser = (cfg.get("server") or {}).get("http_parser", "auto")
    if parser == "auto":
        parser = "httptools" if find_spec("httptools") else "h11"
    return {"event_loop": "uvloop" if find_spec("uvloop") else "asyncio", "http_parser": parser}


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for the server's tensor-parallel rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerStartError(RuntimeError):
    """The server could not start: its port is taken, or it exited (its error line in the message)."""


def _error_line(log: Path) -> str:
    """``: <line>`` for the last line of the server's ``log`` that names an error (serve/run.py's
    ``error: …`` for a refused setting), else nothing."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    found = [ln.strip() for ln in lines if ln.startswith("error:") or "Error:" in ln]
    return f": {found[-1]}" if found else ""


class Server:
    """``serve/run.py`` in a child process (its own session, so that every rank of it can be stopped)
    on 127.0.0.1; ``startup_s``: seconds from the start to a healthy ``/health``; ``overrides``: its own
    (:func:`server_overrides`)."""

    def __init__(self, cfg: DictConfig, family: Path, log: Path):
        """Start the server and wait until it answers ``/health``.

        Raises:
            RuntimeError: ``port`` is taken (whatever listens there would be measured instead), or the
                server exited. TimeoutError: it did not answer within ``startup_timeout_s``. Whatever
                stops the wait (Ctrl-C included) stops the server too.
        """
        import socket

        with socket.socket() as sock:  # as uvicorn binds: SO_REUSEADDR, so TIME_WAIT does not count
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("127.0.0.1", cfg.port))
            except OSError as e:
                raise ServerStartError(f"port {cfg.port} on 127.0.0.1 is in use ({e.strerror or e}): the benchmark "
                                   "would measure whatever listens there; stop it, or choose another port=N") from None
        self.url = f"http://127.0.0.1:{cfg.port}"
        self.overrides = server_overrides(cfg, family, free_port())
        args = [sys.executable, str(REPO / "serve" / "run.py"), *self.overrides, f"hydra.run.dir={log.parent}"]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))}
        if not cfg.get("kernel_autotune", True):  # kernels.triton_bitdelta.AUTOTUNE
            env["DELTAFLEET_TRITON_AUTOTUNE"] = "0"
        if cfg.synthetic and cfg.device == "cuda":  # the GPUs end up nearly full: fragmentation matters
            env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        self.log = open(log, "w")  # noqa: SIM115 - open while the server runs; closed by stop()
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(args, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        deadline = time.time() + cfg.startup_timeout_s
        import httpx

        try:
            while True:
                if self.proc.poll() is not None:
                    raise ServerStartError(f"the server exited with {self.proc.returncode}{_error_line(log)}; see {log}")
                try:
                    if httpx.get(self.url + "/health", timeout=2, trust_env=False).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.time() > deadline:
                    raise TimeoutError(f"the server did not start within {cfg.startup_timeout_s} s; see {log}")
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - t0

    def rss_bytes(self) -> int | None:
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None

    def stop(self) -> None:
        """SIGINT to the server's session (rank 0 and the other ranks), SIGKILL after 30 s."""
        if self.proc.poll() is None:
            self._signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        self._signal(signal.SIGKILL)  # ranks left behind by a rank 0 that exited
        self.proc.wait()
        self.log.close()

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)  # the session this Popen started: its id is the child's pid
        except (ProcessLookupError, PermissionError):
            pass


# --------------------------------------------------------------------------------------------
# The load generator: client processes, asyncio + httpx in each
# --------------------------------------------------------------------------------------------

_NEXT = None  # in a client process: the shared counter of requests handed out (multiprocessing.Value)


def _client_init(counter) -> None:
    global _NEXT
    _NEXT = counter
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the main process stops them


def _client_ready(processes: int, timeout_s: float) -> int:
    """Import what the clients need, then wait until ``processes`` processes have come this far (a
    barrier on the shared counter: a waiting process takes no other task, so each runs one)."""
    import httpx  # noqa: F401

    with _NEXT.get_lock():
        _NEXT.value += 1
    deadline = time.monotonic() + timeout_s
    while _NEXT.value < processes and time.monotonic() < deadline:
        time.sleep(0.01)
    return os.getpid()


def _next_job(n: int) -> int | None:
    with _NEXT.get_lock():
        i = _NEXT.value
        if i >= n:
            return None
        _NEXT.value = i + 1
    return i


def _client_run(url: str, jobs: list, workers: int) -> list[tuple[int, dict]]:
    """In a client process: ``workers`` concurrent clients taking ``jobs`` (model, prompt, max_tokens,
    seed) from the shared counter until none is left; (index, result) of each request it sent."""
    return asyncio.run(_clients(url, jobs, workers))


async def _clients(url: str, jobs: list, workers: int) -> list[tuple[int, dict]]:
    import httpx

    out: list[tuple[int, dict]] = []
    limits = httpx.Limits(max_connections=workers, max_keepalive_connections=workers)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(3600.0, connect=120.0),
                                 trust_env=False) as client:  # loopback: never through a proxy
        async def worker():
            while (i := _next_job(len(jobs))) is not None:
                out.append((i, await stream_completion(client, *jobs[i])))

        await asyncio.gather(*(worker() for _ in range(workers)))
    return out


async def stream_completion(client, model: str, prompt: list[int], max_tokens: int, seed: int,
                            extra: dict | None = None) -> dict:
    """One streamed completion: ``status`` (None: no response), send time, arrival time of every chunk
    with text, ``end`` (the last byte), ``completion_tokens`` of the usage chunk, ``done`` (``[DONE]``
    seen), ``error`` (a non-200 body, an in-band error event or a client exception; None if none);
    ``extra``: more body fields (a structured-output constraint)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0, "seed": seed,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
    out = {"model": model, "prompt_tokens": len(prompt), "max_tokens": max_tokens, "status": None, "chunks": [],
           "completion_tokens": 0, "done": False, "error": None}
    chunks = out["chunks"]
    out["sent"] = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            out["status"] = r.status_code
            if r.status_code != 200:
                out["error"] = (await r.aread()).decode(errors="replace")[:300]
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        out["done"] = True
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        out["error"] = json.dumps(obj["error"])[:300]
                    elif obj.get("usage"):
                        out["completion_tokens"] = obj["usage"]["completion_tokens"]
                    elif obj.get("choices") and obj["choices"][0].get("text"):
                        chunks.append(time.perf_counter())
    except Exception as e:  # noqa: BLE001 - connection refused or reset, timeouts, a malformed event: recorded
        out["error"] = f"{type(e).__name__}: {e}"[:300]
    out["end"] = time.perf_counter()
    return out


class LoadGenerator:
    """Streamed completions from ``processes`` client processes (spawned once; time.perf_counter is
    the system's monotonic clock, the same in every process). :meth:`run` keeps ``concurrency``
    requests in flight, split over the processes, each request handed to whichever client is free."""

    def __init__(self, processes: int):
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        ctx = mp.get_context("spawn")  # not fork: this process may hold CUDA and threads
        self.processes = max(1, int(processes))
        self.counter = ctx.Value("q", 0)
        self.pool = ProcessPoolExecutor(self.processes, mp_context=ctx, initializer=_client_init,
                                        initargs=(self.counter,))
        futures = [self.pool.submit(_client_ready, self.processes, 300.0) for _ in range(self.processes)]
        self.pids = sorted({f.result() for f in futures})  # one per process, unless the barrier timed out

    def run(self, url: str, jobs: list[tuple[str, list[int], int, int]], concurrency: int) -> list[dict]:
        """``jobs`` (model, prompt ids, max_tokens, seed) at ``concurrency``; their results in order."""
        with self.counter.get_lock():
            self.counter.value = 0
        c = max(1, min(concurrency, len(jobs)))
        workers = [c // self.processes + (i < c % self.processes) for i in range(self.processes)]
        futures = [self.pool.submit(_client_run, url, jobs, w) for w in workers if w > 0]
        out: list = [None] * len(jobs)
        for f in futures:
            for i, r in f.result():
                out[i] = r
        missing = [i for i, r in enumerate(out) if r is None]
        if missing:
            raise RuntimeError(f"{len(missing)} requests were never sent")
        return out

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def _pct(x: list[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(x, dtype=np.float64), q)) if len(x) else None


def latency_stats(results: list[dict]) -> dict:
    """TTFT (first text chunk − send) and inter-token latency (gaps between text chunks) P50/P99 of
    ``results``, pooled; None where there is no sample."""
    ttft = [r["chunks"][0] - r["sent"] for r in results if r["chunks"]]
    itl = [g for r in results for g in np.diff(r["chunks"]).tolist()]
    return {"requests": len(results), "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
            "ttft_mean_s": float(np.mean(ttft)) if ttft else None,
            "itl_p50_s": _pct(itl, 50), "itl_p99_s": _pct(itl, 99)}


def answered(r: dict) -> bool:
    """A 200 whose stream ended with ``[DONE]`` and no error event."""
    return r["status"] == 200 and r["done"] and r["error"] is None


def phase_stats(results: list[dict], base_id: str = BASE_ID) -> dict:
    """One load's figures (see the module docstring); ``results`` from :meth:`LoadGenerator.run`."""
    ok = [r for r in results if answered(r)]
    wall = max(r["end"] for r in results) - min(r["sent"] for r in results) if results else 0.0
    tokens = sum(r["completion_tokens"] for r in ok)
    codes = Counter("none" if r["status"] is None else str(r["status"]) for r in results)
    errors = [{"model": r["model"], "status": r["status"], "error": r["error"] or "the stream ended without [DONE]"}
              for r in results if not answered(r)]
    out = {**latency_stats(ok), "requests": len(results), "answered": len(ok), "all_answered": len(ok) == len(results),
           "status_codes": dict(sorted(codes.items())),
           "no_5xx": not any(r["status"] is not None and r["status"] >= 500 for r in results),
           "errors": errors, "wall_s": wall, "completion_tokens": tokens,
           "requested_tokens": sum(r["max_tokens"] for r in results),
           "prompt_tokens": sum(r["prompt_tokens"] for r in results),
           "tokens_per_s": tokens / wall if wall > 0 else None,
           "token_mismatches": sum(r["completion_tokens"] != r["max_tokens"] for r in ok)}
    out["base"] = latency_stats([r for r in ok if r["model"] == base_id])
    out["variants"] = latency_stats([r for r in ok if r["model"] != base_id])
    out["per_model"] = {m: latency_stats([r for r in ok if r["model"] == m]) for m in sorted({r["model"] for r in ok})}
    return out


def run_load(gen: LoadGenerator, url: str, name: str, requests: list[tuple[list[int], int]], models: list[str],
             concurrency: int, extra: dict | None = None) -> dict:
    """``requests`` (prompt, max_tokens) sent to ``models`` (one per request) at ``concurrency``, each
    body with ``extra``'s fields: :func:`phase_stats`, ``concurrency`` and the server's
    ``engine_steps`` meanwhile (:func:`step_stats`)."""
    jobs = [(m, p, n, i, extra) for i, (m, (p, n)) in enumerate(zip(models, requests))]
    before = _scrape(url)
    stats = phase_stats(gen.run(url, jobs, concurrency))
    stats["concurrency"] = concurrency
    after = _scrape(url)
    stats["engine_steps"] = step_stats(before, after)
    stats["server_ttft"] = server_ttft(before, after)
    tps = stats["tokens_per_s"]
    ttft = stats["ttft_p50_s"]
    print(f"{name:>16} c={concurrency:<4} {stats['answered']}/{stats['requests']} answered, "
          f"{tps or 0:.1f} tokens/s, TTFT P50 {(ttft or 0) * 1e3:.1f} ms, codes {stats['status_codes']}, "
          f"{stats['token_mismatches']} length mismatches", flush=True)
    return stats


# --------------------------------------------------------------------------------------------
# Engine steps (serve/bench_step.py) and the peers (Hugging Face transformers)
# --------------------------------------------------------------------------------------------


def _error(e: BaseException) -> dict:
    return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}


def free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def run_engine_steps(cfg: DictConfig) -> dict | None:
    """``deltafleet.serve.bench_step.engine_steps(cfg)`` (None with ``engine_steps: false``); a missing
    module or an exception is returned as ``{"error": ...}``."""
    if not cfg.get("engine_steps", True):
        return None
    try:
        from deltafleet.serve.bench_step import engine_steps
    except ImportError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    try:
        return engine_steps(cfg)
    except Exception as e:  # noqa: BLE001 - recorded in the report; the HTTP loads still run
        return _error(e)
    finally:
        free_device_memory()


def torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def hf_model(cfg: DictConfig):
    """A transformers ``LlamaForCausalLM`` of the served shape and context, random weights (the library's
    own init, std ``initializer_range`` = 0.02), made directly on ``cfg.device`` in ``cfg.dtype``; no eos."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    conf = LlamaConfig(**synthetic_shape(cfg), bos_token_id=None, eos_token_id=None, pad_token_id=0,
                       tie_word_embeddings=False)
    torch.manual_seed(cfg.seed)
    with torch.device(cfg.device):
        model = AutoModelForCausalLM.from_config(conf, dtype=torch_dtype(cfg.dtype),
                                                 attn_implementation=cfg.hf.attn_implementation)
    return model.eval()


def _sampling(**kw):
    """Temperature-1 sampling over the whole vocabulary (as the server's requests: no top-k, no top-p), no eos."""
    from transformers import GenerationConfig

    return GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=None, pad_token_id=0,
                            **kw)


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def _peer_result(requests: list[tuple[list[int], int]], generated: list[int | None], wall: float, **extra) -> dict:
    """tokens/s = tokens of the requested lengths that were generated ÷ ``wall``; ``generated[i]``: tokens
    request i got (None: it failed)."""
    counted = sum(min(g, n) for (_, n), g in zip(requests, generated) if g is not None)
    return {"requests": len(requests), "failed": sum(g is None for g in generated),
            "short": sum(g is not None and g < n for (_, n), g in zip(requests, generated)),
            "requested_tokens": sum(n for _, n in requests), "counted_tokens": counted,
            "generated_tokens": sum(g or 0 for g in generated), "wall_s": wall,
            "tokens_per_s": counted / wall if wall > 0 else None, **extra}


def hf_continuous_batching(model, cfg: DictConfig, requests: list[tuple[list[int], int]]) -> dict:
    """transformers' continuous batching on ``requests`` (prompt ids, new tokens); see the module
    docstring for ``hf.cb_api`` (``manager``: per-request lengths; ``generate_batch``: one call at the
    longest length, each request's first n tokens counted)."""
    import dataclasses
    import logging

    from transformers.generation import ContinuousBatchingConfig

    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.WARNING)  # INFO lines per manager otherwise
    api = cfg.hf.cb_api
    cb_opts = OmegaConf.to_container(cfg.hf.cb_config, resolve=True) if cfg.hf.get("cb_config") else {}
    if dataclasses.is_dataclass(ContinuousBatchingConfig) and "seed" in {
            f.name for f in dataclasses.fields(ContinuousBatchingConfig)}:
        cb_opts.setdefault("seed", cfg.seed)  # its sampling seed (else a random one)
    if cfg.device == "cpu" and cb_opts.get("num_blocks") is None:  # else sized from free RAM: 90% of it
        probe = ContinuousBatchingConfig(**cb_opts)
        page = getattr(probe, "page_size", None) or getattr(probe, "block_size", None) or 256
        cb_opts["num_blocks"] = sum(-(-(len(p) + n) // page) for p, n in requests) + 1  # every request at once
    longest = max(n for _, n in requests)
    original_attn = model.config._attn_implementation

    def run(reqs) -> tuple[list[int | None], float]:
        gen = _sampling(max_new_tokens=max(n for _, n in reqs))
        cb = ContinuousBatchingConfig(**cb_opts)  # a new one each time: the manager resolves it in place
        if api == "generate_batch":
            t0 = time.perf_counter()
            out = model.generate_batch(inputs=[p for p, _ in reqs], generation_config=gen,
                                       continuous_batching_config=cb, max_new_tokens=max(n for _, n in reqs),
                                       progress_bar=False)
            _sync(cfg.device)
            wall = time.perf_counter() - t0
            res = list(out.values())
            if len(res) != len(reqs):
                raise RuntimeError(f"generate_batch returned {len(res)} of {len(reqs)} requests")
            return [None if r.error is not None else len(r.generated_tokens) for r in res], wall
        if api != "manager":
            raise ValueError(f"hf.cb_api: manager or generate_batch, got {api!r}")
        hints = _workload_hints(reqs)
        with model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cb,
                                                       block=True, timeout=60, **hints) as manager:
            t0 = time.perf_counter()  # the manager is started: its warm-up (graph capture) is behind us
            ids = [manager.add_request(p, max_new_tokens=n, eos_token_id=-1) for p, n in reqs]
            done: dict = {}
            while len(done) < len(ids):
                r = manager.get_result(timeout=1)
                if r is None:
                    if not manager.is_running():
                        break
                elif r.is_finished():
                    done[r.request_id] = r
            _sync(cfg.device)
            wall = time.perf_counter() - t0
        return [len(done[i].generated_tokens) if i in done and done[i].error is None else None for i in ids], wall

    try:
        run([(p[:16], min(n, 4)) for p, n in requests[:8]])  # warm-up: a small run, not timed
        free_device_memory()
        generated, wall = run(requests)
    finally:
        if model.config._attn_implementation != original_attn:
            model.set_attn_implementation(original_attn)
    return _peer_result(requests, generated, wall, api=api, cb_config=cb_opts, longest=longest)


def _workload_hints(reqs) -> dict:
    """``workload_hints=`` as ``generate_batch`` passes it (where this transformers has it)."""
    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints
    except ImportError:
        return {}
    return {"workload_hints": WorkloadHints(max_prompt_length=max(len(p) for p, _ in reqs),
                                            max_generated_length=max(n for _, n in reqs), num_requests=len(reqs))}


def hf_static(model, cfg: DictConfig, requests: list[tuple[list[int], int]]) -> dict:
    """``model.generate(..., cache_implementation="static")`` in batches of ``hf.static_batch`` (see the
    module docstring)."""
    bs = int(cfg.hf.static_batch)
    batches = [requests[i:i + bs] for i in range(0, len(requests), bs)]
    max_cache_len = max(max(len(p) for p, _ in b) + max(n for _, n in b) for b in batches)
    dev = torch.device(cfg.device)

    def generate(batch, new_tokens: int) -> int:
        rows = [batch[i % len(batch)][0] for i in range(bs)]  # a short batch: its rows again (not counted)
        width = max(map(len, rows))
        ids = torch.zeros(bs, width, dtype=torch.long)
        mask = torch.zeros(bs, width, dtype=torch.long)
        for j, p in enumerate(rows):  # left padding
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        gen = _sampling(max_new_tokens=new_tokens, min_new_tokens=new_tokens, cache_implementation="static",
                        max_cache_len=max_cache_len)
        out = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), generation_config=gen)
        return out.shape[1] - width  # every row: no eos, so all run to the batch's length

    generate(batches[0], min(8, max(n for _, n in batches[0])))  # warm-up (on CUDA: compiles the decode step)
    _sync(cfg.device)
    generated: list[int | None] = []
    t0 = time.perf_counter()
    for b in batches:
        g = generate(b, max(n for _, n in b))
        generated += [g] * len(b)
    _sync(cfg.device)
    return _peer_result(requests, generated, time.perf_counter() - t0, batch=bs, batches=len(batches),
                        max_cache_len=max_cache_len)


def run_peers(cfg: DictConfig, requests: list[tuple[list[int], int]], concurrency: int) -> dict:
    """Both peers on ``requests`` (the load at ``concurrency``); each one's exception recorded, not raised."""
    import transformers

    out: dict = {"transformers": transformers.__version__, "concurrency": concurrency, "requests": len(requests),
                 "prompt_tokens": sum(len(p) for p, _ in requests), "requested_tokens": sum(n for _, n in requests),
                 "device": cfg.device, "dtype": cfg.dtype}
    try:
        model = hf_model(cfg)
    except Exception as e:  # noqa: BLE001
        err = _error(e)
        return {**out, "hf_continuous_batching": err, "hf_static": err}
    out["attn_implementation"] = model.config._attn_implementation
    for name, fn in (("hf_continuous_batching", hf_continuous_batching), ("hf_static", hf_static)):
        free_device_memory()
        t0 = time.perf_counter()
        try:
            out[name] = fn(model, cfg, requests)
        except Exception as e:  # noqa: BLE001 - recorded in the report, as a peer that did not run
            out[name] = _error(e)
        out[name]["seconds_with_warmup"] = time.perf_counter() - t0
        tps = out[name].get("tokens_per_s")
        print(f"{name:>24}: " + (f"{tps:.1f} tokens/s" if tps else f"failed: {out[name].get('error')}"), flush=True)
    del model
    free_device_memory()
    return out


# --------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------


def _scrape(url: str) -> str:
    import httpx

    try:
        return httpx.get(url + "/metrics", timeout=10, trust_env=False).text
    except httpx.HTTPError:
        return ""


def parse_step_metrics(metrics: str) -> dict:
    """The engine-step series of /metrics (serve/app.py): ``{name: value}`` for the ``_sum`` and
    ``_count`` of ``iteration_tokens_total`` and, by kind, ``engine_step_seconds`` and
    ``engine_step_launch_seconds``."""
    out = {}
    for m in re.finditer(r'^deltafleet:(iteration_tokens_total|engine_step_seconds|engine_step_launch_seconds)_'
                         r'(sum|count)(?:\{kind="([^"]+)"\})? (\S+)$', metrics, re.MULTILINE):
        out[(m.group(1), m.group(2), m.group(3))] = float(m.group(4))
    return out


_WAITED = re.compile(r"^deltafleet:late_planning_wait_seconds_total (\S+)$", re.MULTILINE)


def step_stats(before: str, after: str) -> dict:
    """The engine steps between two scrapes of /metrics: per kind (``decode``, ``prefill``) the steps,
    their mean seconds and mean launch seconds and the launch's share of the step; the mean tokens a
    step fed; and the seconds the scheduler waited to plan late (``late_planning_wait_s``, where it
    did). Empty where the server has no such series."""
    b, a = parse_step_metrics(before), parse_step_metrics(after)
    d = {k: v - b.get(k, 0.0) for k, v in a.items()}
    out: dict = {}
    for kind in ("decode", "prefill"):
        n = d.get(("engine_step_seconds", "count", kind), 0.0)
        if n > 0:
            step = d[("engine_step_seconds", "sum", kind)] / n
            launch = d.get(("engine_step_launch_seconds", "sum", kind), 0.0) / n
            out[kind] = {"steps": int(n), "mean_s": step, "mean_launch_s": launch,
                         "launch_share": launch / step if step > 0 else None}
    n = d.get(("iteration_tokens_total", "count", None), 0.0)
    if n > 0:
        out["mean_tokens"] = d[("iteration_tokens_total", "sum", None)] / n
    was, now = (_WAITED.search(t) for t in (before, after))
    if now is not None and float(now.group(1)) > (float(was.group(1)) if was else 0.0):
        out["late_planning_wait_s"] = float(now.group(1)) - (float(was.group(1)) if was else 0.0)
    return out


_LATENCY = re.compile(r'^deltafleet:(time_to_first_token_seconds|request_queue_time_seconds)_(sum|count)'
                      r'\{model_name="[^"]+"\} (\S+)$', re.MULTILINE)


def server_ttft(before: str, after: str) -> dict:
    """The server's side of the TTFT between two scrapes of /metrics, every model together: the
    requests that got a first token, and the means of ``time_to_first_token_seconds`` (from the
    request's arrival in its handler to its first token handed to the response) and of
    ``request_queue_time_seconds`` (from arrival to its first prefill chunk's launch). With the
    client's mean TTFT (``ttft_mean_s``) they split it: client − server TTFT is the HTTP path outside
    the handler, queue the wait for a step, server TTFT − queue the prefill steps and the hand-over.
    Empty where the server has no such series."""
    def totals(text: str) -> dict:
        out: dict = {}
        for m in _LATENCY.finditer(text):
            out[m.group(1), m.group(2)] = out.get((m.group(1), m.group(2)), 0.0) + float(m.group(3))
        return out

    b, a = totals(before), totals(after)
    d = {k: v - b.get(k, 0.0) for k, v in a.items()}
    n, q = d.get(("time_to_first_token_seconds", "count"), 0.0), d.get(("request_queue_time_seconds", "count"), 0.0)
    if n <= 0:
        return {}
    return {"requests": int(n), "ttft_mean_s": d[("time_to_first_token_seconds", "sum")] / n,
            "queue_mean_s": d[("request_queue_time_seconds", "sum")] / q if q > 0 else None}


def parse_load_seconds(metrics: str) -> dict:
    """Cold-load seconds by tier from /metrics: ``{tier: {"count", "mean_s", "per_model": {id: mean}}}``."""
    sums, counts = {}, {}
    for m in re.finditer(r'^deltafleet:delta_load_seconds_(sum|count)\{model_name="([^"]+)",tier="([^"]+)"\} (\S+)$',
                         metrics, re.MULTILINE):
        (sums if m.group(1) == "sum" else counts)[(m.group(2), m.group(3))] = float(m.group(4))
    out: dict = {}
    for (model, tier), n in counts.items():
        if n > 0:
            t = out.setdefault(tier, {"count": 0, "total_s": 0.0, "per_model": {}})
            t["count"] += int(n)
            t["total_s"] += sums[(model, tier)]
            t["per_model"][model] = sums[(model, tier)] / n
    for t in out.values():
        t["mean_s"] = t["total_s"] / t["count"]
    return out


def gpu_memory_used_mib(field: str = "memory.used") -> list[int] | None:
    """``nvidia-smi``'s ``field`` (MiB) of every GPU, in index order; None without GPUs."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits"],
                             check=False, capture_output=True, text=True, timeout=30)
        return [int(x) for x in out.stdout.split()] if out.returncode == 0 else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def mixed_floor(cfg: DictConfig, requests: list[tuple[list[int], int]], concurrency: int) -> dict:
    """:func:`decode_floor_ratio` of the mixed load at ``concurrency`` (the same requests and Zipf
    draws as :func:`serve_and_load` sends) over the served shape's bytes."""
    from deltafleet.serve.bench_step import decode_bytes

    ranks = zipf_models(list(range(cfg.variants + 1)), len(requests), cfg.zipf_s, [cfg.seed, _ZIPF, concurrency])
    nbytes = decode_bytes(synthetic_shape(cfg), torch_dtype(cfg.dtype).itemsize, cfg.get("sign_layout", "tiled"))
    lengths = [(len(p), n) for p, n in requests]
    return {"concurrency": concurrency, **decode_floor_ratio(lengths, [r - 1 for r in ranks], concurrency, nbytes)}


def predicted_memory(cfg: DictConfig) -> list[dict] | dict:
    """Bytes of tensors each rank of the server holds, per rank: the base's slice and the variant slots
    (``deltafleet.serve.synthetic.predict_memory``), and the paged KV cache of ``kv_cache_tokens``
    tokens in whole blocks of ``server.kv_cache.block_size``, as the server allocates them: at most
    ``max_batch`` full contexts (each in whole blocks), and within ``server.kv_cache.max_tokens``
    where it is set; where it is not, all of them on the CPU, else (on CUDA the server sizes it from
    the free memory) None, and the KV cache out of ``total_bytes``. ``{"error": ...}`` where that
    cannot be computed."""
    try:
        from deltafleet.serve.engine import KV_BLOCK_SIZE, kv_cache_blocks
        from deltafleet.serve.synthetic import predict_memory

        server = OmegaConf.to_container(cfg.server, resolve=True) if cfg.get("server") else {}
        ctx = cfg.max_position_embeddings
        kv_opts = server.get("kv_cache") or {}
        block = kv_opts.get("block_size") or KV_BLOCK_SIZE
        tokens = kv_opts.get("max_tokens")
        if tokens is not None or cfg.device == "cpu":  # else the server sizes it from the free memory
            tokens = kv_cache_blocks(block, server.get("max_batch", 8), ctx, tokens) * block
        out = []
        for r in range(cfg.tp):
            one = predict_memory(synthetic_shape(cfg), world=cfg.tp, rank=r, n_slots=cfg.variants,
                                 dtype=torch_dtype(cfg.dtype), max_batch=1, max_seq_len=ctx,
                                 sign_layout=cfg.get("sign_layout", "tiled"))  # KV: one full context
            kv = None if tokens is None else one["kv_cache_bytes"] // ctx * tokens
            out.append({**one, "kv_cache_tokens": tokens, "kv_cache_bytes": kv,
                        "total_bytes": one["base_bytes"] + one["slots_bytes"] + (kv or 0)})
        return out
    except Exception as e:  # noqa: BLE001 - a figure of the report, not a reason to lose the run
        return {"error": f"{type(e).__name__}: {e}"}


def git_commit() -> str | None:
    """``$DELTAFLEET_COMMIT`` where it is set (a copy of the code whose git metadata is not the code's:
    the one running it says which commit it is); else ``git rev-parse HEAD`` of this checkout; else
    None."""
    if os.environ.get("DELTAFLEET_COMMIT"):
        return os.environ["DELTAFLEET_COMMIT"]
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], check=False, cwd=REPO, capture_output=True, text=True,
                           timeout=30)
        if r.returncode == 0 and re.fullmatch(r"[0-9a-f]{40}", r.stdout.strip()):
            return r.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return None


def machine_info(cfg: DictConfig) -> dict:
    cuda = cfg.device == "cuda" and torch.cuda.is_available()
    device = torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine()
    gpus = torch.cuda.device_count() if cuda else 0
    name = f"{cfg.machine}: {f'{gpus}x ' if gpus > 1 else ''}{device}" + ("" if cuda else f", {os.cpu_count()} CPUs")
    uuid_ = str(getattr(torch.cuda.get_device_properties(0), "uuid", "")) or None if cuda else None
    return {"name": name, "tag": cfg.machine, "device": device, "cpus": os.cpu_count(), "gpus": gpus,
            "gpu_uuid": uuid_, "torch": torch.__version__, "python": platform.python_version()}


# Configuration keys a resumed run may change: where things go and how the run is paced, not what is measured.
RESUME_FREE = ("paths", "resume", "stop_after_s", "port", "startup_timeout_s", "family_dir")
STOPPED_EXIT = 3  # the exit status of a run stopped by ``stop_after_s`` (``resume=true`` goes on)


class StoppedForResume(Exception):
    """A run stopped after a phase, past ``stop_after_s``, with phases left."""

    def __init__(self, partial: Path, phase: str, left: list[str]):
        super().__init__(f"stopped after {phase!r} (stop_after_s); left: {left}. Run the same command with "
                         f"resume=true to measure them into {partial}")
        self.partial, self.phase, self.left = partial, phase, left


def resumed_report(partial: Path, fresh: dict) -> dict:
    """The report of ``partial`` (``<report_name>.partial.json``) to go on with, checked against this run's
    ``fresh`` start: the same configuration but for :data:`RESUME_FREE`, the same commit where both know
    theirs, and the same kind and number of devices. Its date and machine stay the first run's;
    ``resumed`` lists each later start's. A phase that failed (its error recorded) stays done.

    Raises:
        SettingError: the partial report was measured otherwise (naming the keys that differ), or is not one.
    """
    try:
        old = json.loads(partial.read_text())
    except (OSError, ValueError) as e:
        raise SettingError(f"cannot resume from {partial}: {e}") from e
    if not (isinstance(old, dict) and isinstance(old.get("phases_done"), list) and isinstance(old.get("config"), dict)):
        raise SettingError(f"cannot resume from {partial}: not a partial report of serve/bench.py")
    a, b = ({k: v for k, v in r["config"].items() if k not in RESUME_FREE} for r in (old, fresh))
    differ = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    if differ:
        raise SettingError(f"cannot resume from {partial}: it was measured with other values of {differ}")
    if old.get("commit") and fresh.get("commit") and old["commit"] != fresh["commit"]:
        raise SettingError(f"cannot resume from {partial}: it was measured at commit {old['commit']}, "
                           f"this checkout is {fresh['commit']}")
    was, now = ({k: r["machine"].get(k) for k in ("device", "gpus")} for r in (old, fresh))
    if was != now:  # the ratios between phases (ours ÷ the peers') would compare two machines
        raise SettingError(f"cannot resume from {partial}: it was measured on {was}, this machine is {now}")
    old["resumed"] = [*old.get("resumed", []), {"date": fresh["date"], "machine": fresh["machine"],
                                                "after": list(old["phases_done"])}]
    return old


def _num(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and np.isfinite(x) else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(report: dict) -> dict:
    """The ``summary`` block (see the module docstring) of a report."""
    es = report.get("engine_steps")
    sof = es.get("step_over_floor") if isinstance(es, dict) else None
    sof = sof if isinstance(sof, dict) else {}

    def rows(k: str) -> dict:
        v = sof.get(k, sof.get(int(k)))
        v = v if isinstance(v, dict) else {}
        return {"base": _num(v.get("base")), "mixed": _num(v.get("mixed"))}

    load = report["loads"].get(str(report["summary_concurrency"])) or {}
    peers = report.get("peers") or {}

    def whole(phase: dict | None, key: str):
        """``phase[key]`` where every request of the phase was answered (a peer: none failed or cut
        short), else None: a figure of fewer requests is not the workload's."""
        phase = phase or {}
        done = phase.get("all_answered") if "all_answered" in phase else \
            not (phase.get("failed") or phase.get("short")) and "tokens_per_s" in phase
        return _num(phase.get(key)) if done else None

    return {"step_over_floor": {k: rows(k) for k in SUMMARY_ROWS},
            "tokens_per_s": {"base": whole(load.get("base"), "tokens_per_s"),
                             "mixed": whole(load.get("mixed"), "tokens_per_s"),
                             **{k: whole(peers.get(k), "tokens_per_s")
                                for k in ("hf_continuous_batching", "hf_static")}},
            "ttft_p50_s": {k: whole(report["ttft"][k], "ttft_p50_s") for k in ("base", "mixed")},
            "machine": report["machine"]["name"], "commit": report["commit"]}


def ratios_and_goals(report: dict) -> tuple[dict, dict]:
    """Ratios of the summary's figures, and the issue's goals: True/False, None where an input is missing."""
    s = report["summary"]
    tps, ttft = s["tokens_per_s"], s["ttft_p50_s"]
    every_step = [v for r in s["step_over_floor"].values() for v in r.values()]
    steps = [v for v in every_step if v is not None]
    ttft_mixed = report["ttft"]["mixed"]
    ratios = {"mixed_over_base_tokens_per_s": _ratio(tps["mixed"], tps["base"]),
              "mixed_over_base_at_decode_floor": (report.get("decode_floor") or {}).get("mixed_over_base"),
              "base_over_hf_continuous_batching": _ratio(tps["base"], tps["hf_continuous_batching"]),
              "base_over_hf_static": _ratio(tps["base"], tps["hf_static"]),
              "mixed_over_hf_continuous_batching": _ratio(tps["mixed"], tps["hf_continuous_batching"]),
              "mixed_over_hf_static": _ratio(tps["mixed"], tps["hf_static"]),
              "ttft_variant_over_base_p50": _ratio(ttft_mixed["variants"]["ttft_p50_s"],
                                                   ttft_mixed["base"]["ttft_p50_s"]),
              "ttft_mixed_over_base_p50": _ratio(ttft["mixed"], ttft["base"]),
              "step_over_floor_max": max(steps) if steps else None,
              "structured_over_base_decode_step": _structured_step_ratio(report)}

    def at_least(x, bound):
        return None if x is None else bool(x >= bound)

    phases = [p for c in report["loads"].values() for p in c.values()]
    phases += [*report["ttft"].values(), report["burst"]]
    ttfts = [ttft["base"], ttft["mixed"]]
    # a goal of other settings than the is not evaluated (null), whatever the figures
    at_64 = report["summary_concurrency"] == GOAL_CONCURRENCY
    ttft_cfg = (report.get("config") or {}).get("ttft") or GOAL_TTFT
    ttft_set = all(ttft_cfg.get(k) == v for k, v in GOAL_TTFT.items())
    variant_ttft = ratios["ttft_variant_over_base_p50"] if None not in ttfts else None  # both loads answered
    goals = {"step_over_floor <= 1.3": bool(max(steps) <= 1.3) if every_step and None not in every_step else None,
             "base >= 4x hf_continuous_batching": at_least(ratios["base_over_hf_continuous_batching"], 4.0)
             if at_64 else None,
             "base >= 2x hf_static": at_least(ratios["base_over_hf_static"], 2.0) if at_64 else None,
             "mixed/base >= 0.85": at_least(ratios["mixed_over_base_tokens_per_s"], 0.85) if at_64 else None,
             "ttft_p50 <= 0.1 s": None if None in ttfts or not ttft_set else bool(max(ttfts) <= 0.1),
             "variant/base ttft <= 1.05": None if variant_ttft is None or not ttft_set else bool(variant_ttft <= 1.05),
             "burst answered, no 5xx": bool(report["burst"]["all_answered"] and report["burst"]["no_5xx"]),
             "every request answered": all(p["all_answered"] for p in phases),
             "every completion max_tokens long": sum(p["token_mismatches"] for p in phases) == 0,
             "structured decode step <= 1.05x": None if ratios["structured_over_base_decode_step"] is None
             else bool(ratios["structured_over_base_decode_step"] <= 1.05)}
    return ratios, goals


def _structured_step_ratio(report: dict) -> float | None:
    """The structured load's mean decode step ÷ the base load's (same requests, summary concurrency)."""
    load = report["loads"].get(str(report["summary_concurrency"])) or {}
    means = [((load.get(k) or {}).get("engine_steps") or {}).get("decode", {}).get("mean_s")
             for k in ("structured", "base")]
    return _ratio(*means)


def plot(report: dict, png: Path) -> None:
    """tokens/s and TTFT P50/P99 against concurrency (base, mixed; the peers as points), step ÷ floor bars."""
    import matplotlib

    from deltafleet.atomic import write_figure

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted(report["loads"], key=int)
    x = [int(c) for c in levels]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    ax = axes[0]
    for load, style in (("base", "o-"), ("mixed", "s-")):
        ax.plot(x, [report["loads"][c][load]["tokens_per_s"] or np.nan for c in levels], style, label=load)
    peers = report.get("peers") or {}
    for name, marker in (("hf_continuous_batching", "^"), ("hf_static", "v")):
        tps = (peers.get(name) or {}).get("tokens_per_s")
        if tps:
            ax.plot([peers["concurrency"]], [tps], marker, ms=10, ls="none", label=f"{name} (transformers)")
    ax.set(xscale="log", yscale="log", xlabel="concurrency (clients)", ylabel="completion tokens/s",
           title="throughput")
    ax.set_xticks(x, [str(c) for c in x], minor=False)
    ax.set_xticks([], minor=True)
    ax.legend(fontsize=7)
    ax = axes[1]
    for load, color in (("base", "C0"), ("mixed", "C1")):
        for q, ls in (("p50", "-"), ("p99", ":")):
            ys = [(report["loads"][c][load][f"ttft_{q}_s"] or np.nan) * 1e3 for c in levels]
            ax.plot(x, ys, ls, color=color, marker="o", label=f"{load} {q.upper()}")
    t = report["ttft"]
    for load, color in (("base", "C0"), ("mixed", "C1")):
        if t[load]["ttft_p50_s"] is not None:
            ax.plot([t[load]["concurrency"]], [t[load]["ttft_p50_s"] * 1e3], "*", color=color, ms=12,
                    label=f"{load} P50, {report['config']['ttft']['prompt_tokens']}-token prompts")
    ax.set(xscale="log", yscale="log", xlabel="concurrency (clients)", ylabel="ms", title="time to first token")
    ax.set_xticks(x, [str(c) for c in x], minor=False)
    ax.set_xticks([], minor=True)
    ax.legend(fontsize=7)
    ax = axes[2]
    es = report.get("engine_steps")
    sof = es.get("step_over_floor") if isinstance(es, dict) else None
    if isinstance(sof, dict) and sof:
        rows = sorted(sof, key=lambda k: int(k))
        xs = np.arange(len(rows))
        for i, load in enumerate(("base", "mixed")):
            ax.bar(xs + (i - 0.5) * 0.4, [_num((sof[r] or {}).get(load)) or np.nan for r in rows], 0.4, label=load)
        ax.axhline(1.3, color="k", ls=":", label="goal 1.3")
        ax.set_xticks(xs, [str(r) for r in rows])
        ax.set(xlabel="rows in the decode step", ylabel="step time ÷ bandwidth floor", title="engine decode steps")
        ax.legend(fontsize=7)
    else:
        why = es.get("error", "not measured") if isinstance(es, dict) else "not run (engine_steps: false)"
        ax.text(0.5, 0.5, f"engine steps:\n{why[:120]}", ha="center", va="center", wrap=True, fontsize=8)
        ax.set_axis_off()
    c, s = report["config"], report["summary"]
    tp = f", TP={c['tp']}" if c.get("tp", 1) > 1 else ""
    fig.suptitle(f"{c['shape']} family{' (synthetic)' if c.get('synthetic') else ''}, {c['variants']} variants{tp} — "
                 f"{s['machine']} — {report['date']}", fontsize=9)
    fig.tight_layout()
    write_figure(fig, png, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


def _synthetic_spec(cfg: DictConfig) -> dict | None:
    """How the server generates a synthetic family (its defaults for what the benchmark does not set)."""
    if not cfg.synthetic:
        return None
    from deltafleet.serve.synthetic import DEFAULTS

    return {"shape": synthetic_shape(cfg), "variants": cfg.variants, "seed": cfg.seed, "std": DEFAULTS["std"],
            "alpha": DEFAULTS["alpha"]}


def serve_and_load(cfg: DictConfig, report: dict, family: Path, out_dir: Path, vocab: int,
                   loads: dict[int, list], checkpoint=lambda phase: None, done: frozenset = frozenset()) -> None:
    """Steps 3-5 of the module docstring: the server, its loads, memory and cold loads, into ``report``;
    ``checkpoint(phase)`` after each load; the server stopped at the end, whatever happens. Phases in
    ``done`` (a resumed run's) are not measured again; with all of them done no server starts."""
    import httpx

    levels = sorted(loads)
    if {f"loads at {c}" for c in levels} | {"ttft", "burst"} <= done:
        return
    gen = LoadGenerator(cfg.client_processes)
    try:
        server = Server(cfg, family, out_dir / "server.log")
    except BaseException:
        gen.close()
        raise
    print(f"server healthy after {server.startup_s:.1f} s; {len(gen.pids)} client processes", flush=True)
    try:
        url = server.url
        mem_started = gpu_memory_used_mib()
        models = httpx.get(url + "/v1/models", trust_env=False).json()["data"]
        listed = [{"id": m["id"], "parent": m["parent"]} for m in models]
        variants = sorted(m["id"] for m in listed if m["id"] != BASE_ID)
        ranked = [BASE_ID] + variants  # Zipf rank order: the base, then v00, v01, ...
        report["server"] = {"startup_s": server.startup_s, "overrides": server.overrides, "models": listed,
                            "base_id": BASE_ID, "variant_ids": variants, "client_processes": len(gen.pids),
                            **http_stack(cfg)}

        t0 = time.perf_counter()  # warm-up: every model once (a variant's cold load), then the widest batch
        every = phase_stats(gen.run(url, [(m, [5, 6, 7], 2, 0) for m in ranked], min(len(ranked), max(levels))))
        n = max(levels)
        rng = np.random.default_rng([cfg.seed, _WARMUP, 0])
        ln = cfg.lengths
        prompt = lognormal_lengths(rng, n, ln.prompt_median, ln.sigma, ln.min, ln.max)
        prompt, _ = fit_context(prompt, np.full(n, cfg.warmup.max_tokens), cfg.max_position_embeddings, ln.min)
        reqs = [(p, int(cfg.warmup.max_tokens)) for p in random_prompts(rng, prompt, vocab)]
        wide = run_load(gen, url, "warm-up", reqs, zipf_models(ranked, n, cfg.zipf_s, [cfg.seed, _WARMUP, 1]), n)
        report["warmup"] = {"seconds": time.perf_counter() - t0, "every_model": every, "widest": wide,
                            "models_answered": sorted(every["per_model"]),
                            "all_variants_answered": len(variants) == cfg.variants and every["all_answered"]}

        report.setdefault("loads", {})
        for c in levels:
            if f"loads at {c}" in done:
                continue
            reqs = loads[c]
            report["loads"][str(c)] = {
                "base": run_load(gen, url, "base", reqs, [BASE_ID] * len(reqs), c),
                "mixed": run_load(gen, url, "mixed", reqs, zipf_models(ranked, len(reqs), cfg.zipf_s,
                                                                       [cfg.seed, _ZIPF, c]), c)}
            st = cfg.get("structured")
            if st is not None and st.enabled and c == int(cfg.summary_concurrency):  # the base load, every
                # request held to a grammar that outlasts it: the mask's cost beside the same steps free
                report["loads"][str(c)]["structured"] = run_load(gen, url, "structured", reqs, [BASE_ID] * len(reqs),
                                                                 c, {"guided_regex": st.regex})
            checkpoint(f"loads at {c}")
        if "ttft" not in done:
            t = cfg.ttft
            reqs = fixed_requests(t.requests, t.prompt_tokens, t.max_tokens, vocab, [cfg.seed, _TTFT, 0])
            report["ttft"] = {
                "base": run_load(gen, url, "ttft base", reqs, [BASE_ID] * len(reqs), t.concurrency),
                "mixed": run_load(gen, url, "ttft mixed", reqs, zipf_models(ranked, len(reqs), cfg.zipf_s,
                                                                            [cfg.seed, _TTFT_ZIPF, 0]), t.concurrency)}
            checkpoint("ttft")
        if "burst" in done:
            return
        b = cfg.burst
        reqs = fixed_requests(b.requests, burst_prompt_tokens(cfg), b.max_tokens, vocab, [cfg.seed, _BURST, 0])
        report["burst"] = run_load(gen, url, "burst", reqs, zipf_models(ranked, len(reqs), cfg.zipf_s,
                                                                        [cfg.seed, _BURST, 1]), len(reqs))
        report["burst"]["prompt_tokens_each"] = burst_prompt_tokens(cfg)

        report["memory"] = {"gpu_memory_used_mib": gpu_memory_used_mib(),
                            "gpu_memory_total_mib": gpu_memory_used_mib("memory.total"),
                            "gpu_memory_used_mib_after_startup": mem_started,
                            "predicted_bytes_per_rank": predicted_memory(cfg), "server_rss_bytes": server.rss_bytes()}
        print(f"GPU memory used (MiB): {report['memory']['gpu_memory_used_mib']}", flush=True)
        on_host, host = [], None
        if not cfg.synthetic:  # past the device slots: the coldest variants go to the host tier
            for i in range(cfg.extra_for_host_tier):
                r = httpx.post(url + "/v1/load_variant", json={"variant": f"extra{i}", "path": "v00"}, timeout=600,
                               trust_env=False)
                r.raise_for_status()
            cache = httpx.get(url + "/v1/delta_cache", trust_env=False).json()
            on_host = sorted(m for m, v in cache["variants"].items() if v["tier"] == "host")
            if on_host:
                host = phase_stats(gen.run(url, [(m, [5, 6, 7], 2, 0) for m in on_host], 1))
        report["host_tier"] = {"evicted_to_host": on_host, "requests": host}
        report["cold_load_seconds_by_tier"] = parse_load_seconds(_scrape(url))
        report["delta_cache"] = httpx.get(url + "/v1/delta_cache", trust_env=False).json()
        checkpoint("burst")  # with the server's state after it: memory, host tier, cold loads
    finally:
        server.stop()
        gen.close()


def main(cfg: DictConfig) -> dict:
    import logging

    from deltafleet.atomic import write_text

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    check_settings(cfg)
    check_workload(cfg)
    levels = sorted({int(c) for c in cfg.concurrency})
    summary_c = int(cfg.summary_concurrency)
    if summary_c not in levels:
        raise SettingError(f"summary_concurrency={summary_c} is not one of the concurrency levels {levels}")
    stop = cfg.get("stop_after_s")
    if stop is not None and (isinstance(stop, bool) or not isinstance(stop, (int, float)) or not stop >= 0):
        raise SettingError(f"stop_after_s must be null or a number of seconds ≥ 0, got {stop!r}")
    report: dict = {"date": time.strftime("%Y-%m-%d"), "machine": machine_info(cfg), "commit": git_commit(),
                    "config": OmegaConf.to_container(cfg, resolve=True), "synthetic": _synthetic_spec(cfg),
                    "summary_concurrency": summary_c}

    reports = Path(cfg.paths.reports_dir)
    reports.mkdir(parents=True, exist_ok=True)
    partial = reports / f"{cfg.report_name}.partial.json"
    phases = ["engine steps", *(f"loads at {c}" for c in levels), "ttft", "burst"]
    gpu = report["machine"]["gpu_uuid"]  # this start's, for phase_gpus
    if cfg.get("resume") and partial.exists():
        report = resumed_report(partial, report)
        print(f"resuming {partial}: done {report['phases_done']}", flush=True)
    elif cfg.get("resume"):
        print(f"nothing to resume at {partial}: a whole run", flush=True)
    elif partial.exists():  # an earlier run's phases: kept aside, not overwritten
        partial.replace(partial.with_suffix(".json.prev"))
        print(f"a whole run: the partial report of an earlier one moved to {partial.with_suffix('.json.prev')} "
              "(resume=true goes on from a partial report)", flush=True)
    done = frozenset(report.get("phases_done", ()))
    report["phase_gpus"] = {**report.get("phase_gpus", {})}
    started, stop_after = time.perf_counter(), cfg.get("stop_after_s")

    def checkpoint(phase: str) -> None:
        """What is measured so far, in ``<report_name>.partial.json`` (a run stopped midway keeps it);
        then, past ``stop_after_s`` with phases left, stop for a resumed run to go on."""
        report["phases_done"] = [*report.get("phases_done", []), phase]
        report["phase_gpus"][phase] = gpu
        write_text(partial, json.dumps(report, indent=1, default=str) + "\n")
        left = [p for p in phases if p not in report["phases_done"]] + (["peers"] if cfg.peers else [])
        if stop_after is not None and left and time.perf_counter() - started > float(stop_after):
            raise StoppedForResume(partial, phase, left)

    if "engine steps" not in done:
        t0 = time.perf_counter()
        report["engine_steps"] = run_engine_steps(cfg)
        es = report["engine_steps"]
        print(f"engine steps: {'off' if es is None else es.get('error') or 'done'} ({time.perf_counter() - t0:.1f} s)",
              flush=True)
        checkpoint("engine steps")

    family = build_tokenizer(cfg) if cfg.synthetic else build_family(cfg)
    vocab = int(cfg.shapes[cfg.shape].vocab_size)
    loads = {c: load_requests(cfg, c, vocab) for c in levels}
    report["decode_floor"] = mixed_floor(cfg, loads[summary_c], summary_c)
    from hydra.core.hydra_config import HydraConfig

    # the run's own folder (Hydra does not change the working directory)
    out_dir = Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else Path(cfg.family_dir).parent
    out_dir.mkdir(parents=True, exist_ok=True)
    serve_and_load(cfg, report, family, out_dir, vocab, loads, checkpoint, done)

    report["peers"] = run_peers(cfg, loads[summary_c], summary_c) if cfg.peers else None
    if cfg.peers:
        report["phase_gpus"]["peers"] = gpu
    report.pop("phases_done", None)
    report["summary"] = summarize(report)
    report["ratios"], report["goals"] = ratios_and_goals(report)
    write_text(reports / f"{cfg.report_name}.json", json.dumps(report, indent=1, default=str) + "\n")
    plot(report, reports / f"{cfg.report_name}.png")
    partial.unlink(missing_ok=True)
    print(json.dumps(report["summary"], indent=1), flush=True)
    print("goals: " + json.dumps(report["goals"]), flush=True)
    print("ratios: " + json.dumps(report["ratios"]), flush=True)
    print(f"wrote {reports / cfg.report_name}.json and .png", flush=True)
    return report


def _terminated(signum, frame) -> None:
    """SIGTERM (a time limit's): exit through the ``finally`` blocks, which stop the server's session
    and the clients, instead of leaving them running."""
    raise SystemExit(128 + signum)


@hydra.main(version_base="1.3", config_path="../conf", config_name="bench_serve")
def _entry(cfg: DictConfig) -> None:
    from deltafleet.cli import drop_refused_run_dir, interruptible

    signal.signal(signal.SIGTERM, _terminated)
    try:
        with interruptible("bench-serve"):  # the partial report keeps the phases done (resume=true)
            main(cfg)
    except StoppedForResume as e:
        print(e, flush=True)
        sys.exit(STOPPED_EXIT)
    except SettingError as e:  # a setting, or a partial report that cannot be resumed: named, no traceback
        drop_refused_run_dir()
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    except ServerStartError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    from deltafleet.cli import run_script

    run_script(_entry)
