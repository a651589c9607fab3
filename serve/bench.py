"""Serving benchmark (``make bench-serve``): a family of variants under a mixed load, against the
same load on the base alone, through the real server and HTTP on loopback.

Configuration: ``conf/bench_serve.yaml``. Steps:

1. A random family under ``family_dir``, built once: a Llama-shaped base (random bf16 weights), a
   fine-tune = base + N(0, 10⁻⁶) exported with ``compress`` as variant ``v00``, and ``variants − 1``
   more artifacts with the same scales and random signs (1 bit per weight, like any variant); a
   byte-level BPE trained on the standard library's sources, padded with plain tokens to the
   model's vocabulary, so every sampled id streams as text.
2. ``serve/run.py`` started on 127.0.0.1 with ``device_slots = variants`` and a host tier.
3. A warm-up touching every model (each variant's cold load from disk), then a base-only load
   and a mixed load (each request's model drawn uniformly from the base and the variants), both
   ``requests`` streamed completions of ``prompt_tokens`` random token ids and ``max_tokens``
   tokens from ``concurrency`` clients. TTFT = first text chunk − send; inter-token latency =
   gaps between chunks; throughput = completion tokens ÷ phase wall time.
4. ``extra_for_host_tier`` variants hot-loaded past the device slots (evicting the coldest to
   the host tier), then requests for the evicted ones: cold loads from the host tier.
5. Cold-load seconds by tier from the server's ``/metrics``, memory (GPU via ``nvidia-smi``,
   per GPU, next to the bytes of tensors predicted by ``deltafleet.serve.synthetic.predict_memory``; the
   server's resident set), startup seconds, successful completions per model, JSON + PNG in
   ``reports/``.

With ``synthetic: true`` (``conf/bench_serve_70b.yaml``: 14 variants of a Llama-2-70B-shaped family,
tensor parallel over 2 GPUs) nothing of the family is written but its tokenizer: the server
generates the base and the variants on its devices (serve/synthetic.py), and the host tier is not
exercised.
"""
from __future__ import annotations

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
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import hydra
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

REPO = Path(__file__).resolve().parents[1]
TOKENIZER_SOURCES = ("textwrap.py", "string.py", "fnmatch.py", "shlex.py", "argparse.py", "json/decoder.py")


# --------------------------------------------------------------------------------------------
# The family
# --------------------------------------------------------------------------------------------


def random_sign_artifact(src: Path, dst: Path, variant: str, seed: int) -> None:
    """Write the artifact ``dst`` = ``src`` with every ``*.sign`` replaced by random bytes (a variant
    of the same size and scales), hashes and manifest redone; atomic (staged folder + rename)."""
    from safetensors.torch import load_file, save_file

    from deltafleet.atomic import staged_dir
    from deltafleet.compress.bitdelta import _sha256_file, write_manifest

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
    from deltafleet.atomic import staged_dir
    from deltafleet.compress.bench import generate_pair
    from deltafleet.compress.bitdelta import compress

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
# The server and the load
# --------------------------------------------------------------------------------------------


def hydra_value(v) -> str:
    """``v`` (a dict, list, str, int, float, bool or None) written in Hydra's override grammar, strings
    quoted: ``{"a": {"b": 1}, "c": "/x"}`` → ``{a:{b:1},c:'/x'}``.

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
        return "'" + str(v).replace("\\", "\\\\").replace("'", "\\'") + "'"
    raise TypeError(f"no Hydra override for {type(v).__name__}")


def synthetic_shape(cfg: DictConfig) -> dict:
    """The served shape: ``shapes[shape]`` with the benchmark's context, as Hugging Face config fields."""
    return {**OmegaConf.to_container(cfg.shapes[cfg.shape]), "max_position_embeddings": cfg.max_position_embeddings}


def server_overrides(cfg: DictConfig, family: Path, tp_port: int) -> list[str]:
    """``serve/run.py``'s overrides for the benchmark's server: the family of ``family`` (a built one,
    or with ``cfg.synthetic`` its tokenizer and a generated family of ``cfg.variants``), every variant
    in a device slot, tensor parallel over ``cfg.tp`` processes."""
    out = ["model.name=bench", f"port={cfg.port}", f"device={cfg.device}", f"dtype={cfg.dtype}",
           f"max_batch={cfg.max_batch}", "max_waiting=null", f"delta_cache.device_slots={cfg.variants}",
           f"delta_cache.sign_layout={cfg.get('sign_layout', 'tiled')}",
           "log_level=warning", f"tp={cfg.tp}", f"tp_port={tp_port}"]
    if cfg.synthetic:
        syn = {"shape": synthetic_shape(cfg), "variants": cfg.variants, "seed": cfg.seed, "tokenizer_dir": family}
        return out + ["delta_cache.host_budget_gb=0", f"synthetic={hydra_value(syn)}"]
    return out + [f"base_dir={family / 'base'}", f"artifacts_dir={family / 'artifacts'}",
                  "delta_cache.host_budget_gb=1000"]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for the server's tensor-parallel rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``serve/run.py`` in a child process (its own session, so that every rank of it can be stopped)
    on 127.0.0.1; ``startup_s``: seconds from the start to a healthy ``/health``."""

    def __init__(self, cfg: DictConfig, family: Path, log: Path):
        self.url = f"http://127.0.0.1:{cfg.port}"
        args = [sys.executable, str(REPO / "serve" / "run.py"), *server_overrides(cfg, family, free_port()),
                f"hydra.run.dir={log.parent}"]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))}
        if not cfg.get("kernel_autotune", True):  # kernels.triton_bitdelta.AUTOTUNE
            env["DELTAFLEET_TRITON_AUTOTUNE"] = "0"
        if cfg.synthetic and cfg.device == "cuda":  # the GPUs end up nearly full: fragmentation matters
            env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        self.log = open(log, "w")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(args, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        deadline = time.time() + cfg.startup_timeout_s
        import httpx

        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}; see {log}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                self.stop()
                raise TimeoutError(f"the server did not start within {cfg.startup_timeout_s} s; see {log}")
            time.sleep(0.5)
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


def one_request(url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed completion; the send time, the arrival time of every text chunk, usage."""
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0, "seed": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0, chunks, usage = time.perf_counter(), [], None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=3600) as r:
        if r.status_code != 200:
            return {"model": model, "error": f"{r.status_code} {r.read().decode()[:300]}"}
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if obj.get("usage"):
                usage = obj["usage"]
            elif obj["choices"] and obj["choices"][0]["text"]:
                chunks.append(time.perf_counter())
    return {"model": model, "sent": t0, "chunks": chunks, "completion_tokens": (usage or {}).get("completion_tokens", 0)}


def run_phase(url: str, models: list[str], cfg: DictConfig, rng: np.random.Generator, vocab: int,
              balanced: bool = False) -> dict:
    """``cfg.requests`` requests over ``models`` from ``cfg.concurrency`` clients: each request's model
    drawn uniformly, or (``balanced``) every model ``requests // len(models)`` times or once more, in a
    random order. ``answered``: successful completions per model (0 for a model that got none)."""
    if balanced:
        picks = [models[i % len(models)] for i in range(cfg.requests)]
        rng.shuffle(picks)
        jobs = [(m, rng.integers(4, vocab, cfg.prompt_tokens).tolist()) for m in picks]
    else:
        jobs = [(models[int(rng.integers(len(models)))], rng.integers(4, vocab, cfg.prompt_tokens).tolist())
                for _ in range(cfg.requests)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(cfg.concurrency) as pool:
        results = list(pool.map(lambda j: one_request(url, j[0], j[1], cfg.max_tokens), jobs))
    wall = time.perf_counter() - t0
    errors = [r["error"] for r in results if "error" in r]
    ok = [r for r in results if "error" not in r and r["chunks"]]
    per_model = {}
    for m in sorted({r["model"] for r in ok}):
        rs = [r for r in ok if r["model"] == m]
        ttft = np.array([r["chunks"][0] - r["sent"] for r in rs])
        itl = np.concatenate([np.diff(r["chunks"]) for r in rs]) if any(len(r["chunks"]) > 1 for r in rs) \
            else np.array([np.nan])
        per_model[m] = {"requests": len(rs), "ttft_p50_s": float(np.percentile(ttft, 50)),
                        "ttft_p99_s": float(np.percentile(ttft, 99)), "itl_p50_s": float(np.nanpercentile(itl, 50)),
                        "itl_p99_s": float(np.nanpercentile(itl, 99))}
    tokens = sum(r["completion_tokens"] for r in ok)
    answered = {m: sum(r["model"] == m and r["completion_tokens"] > 0 for r in ok) for m in models}
    return {"wall_s": wall, "completion_tokens": tokens, "tokens_per_s": tokens / wall, "errors": errors,
            "per_model": per_model, "answered": answered}


def parse_load_seconds(metrics: str) -> dict:
    """Cold-load seconds by tier from /metrics: ``{tier: {"count", "mean_s", "per_model": {id: mean}}}``."""
    sums, counts = {}, {}
    for m in re.finditer(r'^deltafleet:delta_load_seconds_(sum|count)\{model_name="([^"]+)",tier="([^"]+)"\} (\S+)$',
                         metrics, re.M):
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
                             capture_output=True, text=True, timeout=30)
        return [int(x) for x in out.stdout.split()] if out.returncode == 0 else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def predicted_memory(cfg: DictConfig) -> list[dict]:
    """Bytes of tensors each rank of the server holds (``deltafleet.serve.synthetic.predict_memory``), per rank."""
    from deltafleet.serve.synthetic import predict_memory

    return [predict_memory(synthetic_shape(cfg), world=cfg.tp, rank=r, n_slots=cfg.variants,
                           dtype=getattr(torch, cfg.dtype), max_batch=cfg.max_batch,
                           max_seq_len=cfg.max_position_embeddings, sign_layout=cfg.get("sign_layout", "tiled"))
            for r in range(cfg.tp)]


def summarize(report: dict) -> dict:
    """Variant ÷ base TTFT and inter-token latency (P50, mixed load), throughput mixed ÷ base-only."""
    mixed, base_only = report["phases"]["mixed"], report["phases"]["base_only"]
    base = mixed["per_model"].get(report["base_id"])
    variants = [v for m, v in mixed["per_model"].items() if m != report["base_id"]]
    out = {"throughput_mixed_over_base_only": mixed["tokens_per_s"] / base_only["tokens_per_s"]}
    if base and variants:
        out["variant_over_base_ttft_p50"] = float(np.median([v["ttft_p50_s"] for v in variants])) / base["ttft_p50_s"]
        out["variant_over_base_itl_p50"] = float(np.median([v["itl_p50_s"] for v in variants])) / base["itl_p50_s"]
    b1 = base_only["per_model"].get(report["base_id"])
    if b1 and variants:
        out["variant_mixed_over_base_only_ttft_p50"] = \
            float(np.median([v["ttft_p50_s"] for v in variants])) / b1["ttft_p50_s"]
        out["variant_mixed_over_base_only_itl_p50"] = \
            float(np.median([v["itl_p50_s"] for v in variants])) / b1["itl_p50_s"]
    out["targets"] = {"variant_over_base_ttft_p50 <= 1.05": out.get("variant_over_base_ttft_p50", np.inf) <= 1.05,
                      "variant_over_base_itl_p50 <= 1.08": out.get("variant_over_base_itl_p50", np.inf) <= 1.08,
                      "throughput_mixed_over_base_only >= 0.6": out["throughput_mixed_over_base_only"] >= 0.6}
    return out


def plot(report: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mixed, base_only = report["phases"]["mixed"]["per_model"], report["phases"]["base_only"]["per_model"]
    models = list(mixed)
    used = report["memory"].get("gpu_memory_used_mib")
    fig, axes = plt.subplots(1, 3 if used else 2, figsize=(max(10, 0.7 * len(models) + 4) + (4 if used else 0), 4.5),
                             gridspec_kw={"width_ratios": [3, 3, 1] if used else [1, 1]})
    for ax, key, title in ((axes[0], "ttft", "time to first token"), (axes[1], "itl", "inter-token latency")):
        x = np.arange(len(models))
        ax.bar(x - 0.2, [mixed[m][f"{key}_p50_s"] * 1e3 for m in models], 0.4, label="P50, mixed load")
        ax.bar(x + 0.2, [mixed[m][f"{key}_p99_s"] * 1e3 for m in models], 0.4, label="P99, mixed load")
        b = base_only.get(report["base_id"])
        if b:
            ax.axhline(b[f"{key}_p50_s"] * 1e3, color="k", ls=":", label="base P50, base-only load")
        ax.set_xticks(x, models, rotation=60, fontsize=7)
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.legend(fontsize=7)
    if used:  # per GPU: nvidia-smi after the load, the tensors predicted for its rank, the capacity
        ax, x = axes[2], np.arange(len(used))
        pred = [p["total_bytes"] / 2**30 for p in report["memory"]["predicted_bytes_per_rank"]]
        ax.bar(x - 0.2, [u / 1024 for u in used], 0.4, label="used (nvidia-smi)")
        ax.bar(x[:len(pred)] + 0.2, pred, 0.4, label="tensors, predicted")
        for i, t in enumerate(report["memory"].get("gpu_memory_total_mib") or []):
            ax.hlines(t / 1024, i - 0.4, i + 0.4, color="k", ls=":")
        ax.set_xticks(x, [f"GPU {i}" for i in x], fontsize=7)
        ax.set_ylabel("GiB (dotted: capacity)")
        ax.set_title("memory per GPU")
        ax.legend(fontsize=7, loc="lower center")
    s, c = report["summary"], report["config"]
    tp = f", TP={c['tp']}" if c.get("tp", 1) > 1 else ""
    fig.suptitle(f"{c['shape']} family{' (synthetic)' if c.get('synthetic') else ''}, {c['variants']} variants{tp} — "
                 f"mixed {report['phases']['mixed']['tokens_per_s']:.0f} tokens/s, "
                 f"÷ base-only {s['throughput_mixed_over_base_only']:.2f} — "
                 f"{report['machine']['device']} — {report['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(cfg: DictConfig) -> dict:
    from deltafleet.atomic import write_text

    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    family = build_tokenizer(cfg) if cfg.synthetic else build_family(cfg)
    vocab = cfg.shapes[cfg.shape].vocab_size
    from hydra.core.hydra_config import HydraConfig

    # the run's own folder (Hydra does not change the working directory)
    out_dir = Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else Path(cfg.family_dir).parent
    out_dir.mkdir(parents=True, exist_ok=True)
    server = Server(cfg, family, out_dir / "server.log")
    print(f"server healthy after {server.startup_s:.1f} s", flush=True)
    rng = np.random.default_rng(cfg.seed)
    import httpx

    try:
        url = server.url
        mem_started = gpu_memory_used_mib()
        listed = [{"id": m["id"], "parent": m["parent"]} for m in httpx.get(url + "/v1/models").json()["data"]]
        models = [m["id"] for m in listed]
        base_id, variants = "bench", [m for m in models if m != "bench"]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(min(cfg.concurrency, len(models))) as pool:  # every cold load from disk
            warm = list(pool.map(lambda m: one_request(url, m, [5, 6, 7], 2), models))
        warm_s = time.perf_counter() - t0
        phases = {"base_only": run_phase(url, [base_id], cfg, rng, vocab)}
        print(f"base-only: {phases['base_only']['tokens_per_s']:.1f} tokens/s", flush=True)
        phases["mixed"] = run_phase(url, [base_id] + variants, cfg, rng, vocab, balanced=cfg.balanced_mix)
        print(f"mixed:     {phases['mixed']['tokens_per_s']:.1f} tokens/s", flush=True)
        mem = {"gpu_memory_used_mib": gpu_memory_used_mib(), "gpu_memory_total_mib": gpu_memory_used_mib("memory.total"),
               "gpu_memory_used_mib_after_startup": mem_started, "predicted_bytes_per_rank": predicted_memory(cfg),
               "server_rss_bytes": server.rss_bytes()}
        print(f"GPU memory used (MiB): {mem['gpu_memory_used_mib']}; tensors predicted per rank (GiB): "
              f"{[round(p['total_bytes'] / 2**30, 2) for p in mem['predicted_bytes_per_rank']]}", flush=True)
        for i in range(cfg.extra_for_host_tier):  # past the slots: the coldest go to the host tier
            r = httpx.post(url + "/v1/load_variant", json={"variant": f"extra{i}", "path": "v00"}, timeout=600)
            r.raise_for_status()
        cache = httpx.get(url + "/v1/delta_cache").json()
        on_host = [m for m, v in cache["variants"].items() if v["tier"] == "host"]
        for m in on_host:
            one_request(url, m, [5, 6, 7], 2)
        loads = parse_load_seconds(httpx.get(url + "/metrics").text)
        answered = phases["mixed"]["answered"]
        report = {
            "date": time.strftime("%Y-%m-%d"),
            "machine": {"tag": cfg.machine, "device": torch.cuda.get_device_name() if cfg.device == "cuda"
                        else platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                        "gpus": torch.cuda.device_count() if cfg.device == "cuda" else 0,
                        "torch": torch.__version__, "python": platform.python_version()},
            "config": OmegaConf.to_container(cfg, resolve=True),
            "synthetic": _synthetic_spec(cfg),
            "startup_s": server.startup_s,
            "base_id": base_id, "variant_ids": variants, "models": listed,
            "warmup": {"seconds": warm_s, "errors": [w["error"] for w in warm if "error" in w]},
            "phases": phases, "answered_mixed": answered,
            "all_variants_answered": len(variants) == cfg.variants and all(answered[v] > 0 for v in variants),
            "cold_load_seconds_by_tier": loads, "evicted_to_host": on_host,
            "memory": mem, "delta_cache": cache,
        }
        report["summary"] = summarize(report)
    finally:
        server.stop()
    reports = Path(cfg.paths.reports_dir)
    reports.mkdir(parents=True, exist_ok=True)
    write_text(reports / f"{cfg.report_name}.json", json.dumps(report, indent=1, default=str) + "\n")
    plot(report, reports / f"{cfg.report_name}.png")
    s = report["summary"]
    print(json.dumps(s, indent=1), flush=True)
    print(f"every variant answered: {report['all_variants_answered']} {report['answered_mixed']}", flush=True)
    print(f"wrote {reports / cfg.report_name}.json and .png", flush=True)
    return report


def _synthetic_spec(cfg: DictConfig) -> dict | None:
    """How the server generates a synthetic family (its defaults for what the benchmark does not set)."""
    if not cfg.synthetic:
        return None
    from deltafleet.serve.synthetic import DEFAULTS

    return {"shape": synthetic_shape(cfg), "variants": cfg.variants, "seed": cfg.seed, "std": DEFAULTS["std"],
            "alpha": DEFAULTS["alpha"]}


@hydra.main(version_base="1.3", config_path="../conf", config_name="bench_serve")
def _entry(cfg: DictConfig) -> None:
    main(cfg)


if __name__ == "__main__":
    _entry()
