"""``make bench-compress``: BitDelta export of a 7B-shaped pair, streaming vs naive, side by side.

    python compress/bench.py                                   # Llama-2-7B shapes, bf16
    python compress/bench.py shape.num_hidden_layers=2 machine=cpu2

1. Generates (once; reused while ``pair_dir`` holds a complete pair of the same ``shape``, ``dtype``,
   ``delta_std`` and ``seed``, as its ``pair.json`` records them) a random base and "fine-tune" with
   Llama-2-7B's tensor names and shapes as sharded Hugging Face safetensors checkpoints
   (``model-0000i-of-0000N.safetensors`` + ``model.safetensors.index.json`` + ``config.json``):
   base weights ~ N(0, 0.02²), fine-tune = base + N(0, delta_std²), norms near 1.
2. Exports the pair in a child process with :func:`deltafleet.compress.bitdelta.compress` (streaming: blocks
   of rows read with plain file reads, output shards of ``max_shard_bytes``).
3. Exports it in another child process the naive way — ``safetensors.torch.load_file`` of every
   shard of both models (the whole pair resident), then Δ, signs and α per matrix and one
   ``save_file`` — as BitDelta's own scripts do with two loaded models. Skipped with a reason when
   the pair does not fit in free memory (``naive=auto``).
4. Checks that both produce the same signs and α, and writes
   ``reports/<report_name>.json`` and ``.png`` (resident memory over time for both paths).

Every setting is checked before any work (``error: ...``, exit status 2). The benchmark replaces or
deletes only folders it made: ``pair_dir`` must be absent, empty or a pair it generated, and
``work_dir`` absent, empty or holding only its ``streaming/`` and ``naive/`` exports; never the
current directory or a folder holding it. A run in which an export or the comparison failed (or
the two paths disagree) still writes its report, then exits with status 1.

Measured per path: wall seconds inside the child, throughput = bytes of both checkpoints ÷ wall
seconds (GB/s, 1 GB = 10⁹ bytes), peak resident set (the child's ``VmHWM``; samples of ``VmRSS``
every ``sample_every_s`` for the plot). The pair is generated in a child process too, and its
files may sit in the page cache when the exports read them (stated in the report).
"""
from __future__ import annotations

import json
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

GB = 1e9
DTYPES = ("float32", "float16", "bfloat16")  # the generated pair's dtypes
GRANULARITIES = ("matrix", "row")  # the export's α granularities the naive path computes too
SHAPE_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads")
PAIR_RECORD = "pair.json"  # written last into a generated pair (staged): its settings


# --------------------------------------------------------------------------------------------
# Settings, and the folders the benchmark may replace (shared with merge/bench.py)
# --------------------------------------------------------------------------------------------


def check_shape(shape: dict) -> None:
    """Raises ValueError unless ``shape`` has a ``name`` (text) and each of :data:`SHAPE_SIZES` is a
    whole number of at least 1, with ``hidden_size`` a multiple of ``num_attention_heads`` and that a
    multiple of ``num_key_value_heads`` (Llama's attention), and an even head dimension
    ``hidden_size / num_attention_heads`` (RoPE rotates pairs; ``LlamaConfig`` refuses an odd one)."""
    from deltafleet.values import whole

    name = shape.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"shape.name must be a text, got {name!r}")
    for key in SHAPE_SIZES:
        if not whole(shape.get(key)) or shape[key] < 1:
            raise ValueError(f"shape.{key} must be a whole number, at least 1, got {shape.get(key)!r}")
    h, heads, kv = shape["hidden_size"], shape["num_attention_heads"], shape["num_key_value_heads"]
    if h % heads:
        raise ValueError(f"shape.hidden_size {h} is not a multiple of shape.num_attention_heads {heads}")
    if h // heads % 2:
        raise ValueError(f"shape.hidden_size {h} / shape.num_attention_heads {heads} is {h // heads}: the head "
                         f"dimension must be even (RoPE)")
    if heads % kv:
        raise ValueError(f"shape.num_attention_heads {heads} is not a multiple of shape.num_key_value_heads {kv}")


def pair_parameters(shape: dict) -> int:
    """The parameters of one model of the generated pair (:func:`llama_tensors`)."""
    return sum(torch.Size(s).numel() for _, s in llama_tensors(shape))


def check_free_disk(folder: Path, need: int) -> None:
    """Raises SystemExit (one line) unless the file system of ``folder`` (or its nearest existing
    parent) has ``need`` bytes free, with a 5% margin: a default run writes 2 × 13.5 GB of pair, and a
    full disk stops it half way, and everything else on that disk with it."""
    import shutil

    at = folder
    while not at.exists():
        at = at.parent
    free = shutil.disk_usage(at).free
    if free < 1.05 * need:
        raise SystemExit(f"error: the pair needs {need / GB:.1f} GB in {folder}, and its disk has {free / GB:.1f} GB "
                         f"free: free some, choose pair_dir on another disk, or a smaller shape "
                         f"(shape.num_hidden_layers=2)")


def check_reports_dir(reports: Path) -> None:
    """Make ``reports`` (``paths.reports_dir``) and a file in it, before any work; raises ValueError
    naming it where either fails (a read-only folder, a file on the way, /proc)."""
    import tempfile

    try:
        reports.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=reports, prefix=".check-"):
            pass
    except OSError as e:
        raise ValueError(f"paths.reports_dir {reports} cannot be written: {e.strerror or e}") from None


def check_own_folder(folder: str | Path, key: str, foreign, inputs=(), job: str = "benchmark") -> Path:
    """Refuse, before any work, a folder the benchmark would replace or delete that is not its own: a
    file, the current directory or a folder holding it, one overlapping ``inputs``, one that cannot be
    made (:func:`deltafleet.atomic.check_replaceable`), or an existing non-empty folder for which
    ``foreign(folder)`` says why it holds more than the benchmark's own output.

    Returns:
        ``folder``, resolved.

    Raises:
        ValueError: naming ``key``, the folder and the reason (the foreign files, by name).
    """
    from deltafleet.atomic import check_replaceable

    folder = Path(folder).resolve()
    # overwrite=True: every check but the foreign files, whose refusal here has no overwrite to offer
    check_replaceable(folder, inputs, foreign, job=job, key=key, overwrite=True)
    if folder.is_dir() and any(folder.iterdir()):
        why = foreign(folder)
        if why:
            raise ValueError(f"{key} {folder} exists and holds files that are not an earlier {job}'s output "
                             f"({why}): the {job} replaces and deletes what it writes there; choose a new "
                             f"{key} or one an earlier run made")
    return folder


def not_pair(folder: Path) -> str | None:
    """Why ``folder`` is not (only) a pair :func:`generate_pair` wrote, or None if it is: its
    ``pair.json``, and ``base/`` and ``ft/`` (either may be gone) holding nothing but a sharded
    Hugging Face checkpoint's files."""
    from deltafleet.atomic import unlisted_files

    try:
        info = json.loads((folder / PAIR_RECORD).read_text())
    except (OSError, ValueError):
        held = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())
        return f"no readable {PAIR_RECORD}; it holds {', '.join(held[:4])}{', …' if len(held) > 4 else ''}"
    if not isinstance(info, dict) or not isinstance(info.get("shape"), dict):
        return f"its {PAIR_RECORD} was not written by this benchmark"
    why = unlisted_files(folder, [PAIR_RECORD, "base", "ft"], "benchmark")
    for which in ("base", "ft"):
        sub = folder / which
        if why is None and (sub.is_file() or sub.is_symlink()):
            why = f"{which} is not a folder"
        elif why is None and sub.is_dir():
            ours = [p.name for p in sub.iterdir() if p.name in ("config.json", "model.safetensors.index.json")
                    or (p.name.startswith("model-") and p.name.endswith(".safetensors"))]
            why = unlisted_files(sub, ours, "benchmark")
            why = why and f"in {which}/: {why}"
    return why


def pair_differences(info: dict, want: dict) -> list[str]:
    """The settings in which the generated pair recorded as ``info`` (its ``pair.json``) differs from
    ``want`` (``shape`` as a dict, ``dtype`` as ``"torch.<name>"``, ``delta_std``, ``seed``), as
    ``"<key> <recorded>, not <wanted>"``; empty for a pair of these settings."""
    out = []
    for key, value in want.items():
        have = info.get(key)
        if isinstance(value, dict):
            have = have if isinstance(have, dict) else {}
            out += [f"{key}.{k} {have.get(k)!r}, not {value.get(k)!r}" for k in sorted(set(value) | set(have))
                    if have.get(k) != value.get(k)]
        elif have != value:
            out.append(f"{key} {have!r}, not {value!r}")
    return out


def cached_pair(pair_dir: Path, want: dict) -> tuple[dict | None, list[str]]:
    """The record of the pair generated in ``pair_dir`` with ``want``'s settings
    (:func:`pair_differences`), or None and how the one there differs (empty: none there); a pair
    of other settings is generated again, not reused under this run's name."""
    try:
        info = json.loads((pair_dir / PAIR_RECORD).read_text())
    except (OSError, ValueError):
        return None, []
    diff = pair_differences(info, want)
    return (None, diff) if diff else (info, [])


def not_work_dir(folder: Path) -> str | None:
    """Why ``folder`` (``work_dir``) holds more than this benchmark's exports, or None: ``streaming/``
    (a BitDelta artifact of variant ``bench``) and ``naive/`` (``delta.safetensors``) only."""
    from deltafleet.atomic import unlisted_files
    from deltafleet.compress.bitdelta import not_artifact

    why = unlisted_files(folder, ["streaming", "naive"], "benchmark")
    for sub, check in (("streaming", lambda f: not_artifact(f, "bench", job="benchmark")),
                       ("naive", lambda f: unlisted_files(f, ["delta.safetensors"], "benchmark"))):
        path = folder / sub
        if why is None and (path.is_file() or path.is_symlink()):
            why = f"{sub} is not a folder"
        elif why is None and path.is_dir() and any(path.iterdir()):
            why = check(path)
            why = why and f"in {sub}/: {why}"
    return why


def check_config(cfg) -> dict:
    """Check every setting of ``conf/bench.yaml`` before any work.

    Returns:
        ``{"shape", "naive" (True, False or "auto"), "keep_pair", "report_name", "pair_dir",
        "work_dir"}``, the folders resolved.

    Raises:
        ValueError: naming the setting (an unknown one, a bad value, a folder that is not the
            benchmark's own: :func:`check_own_folder`).
    """
    from omegaconf import OmegaConf

    from deltafleet.cli import check_report_name, check_settings, flag
    from deltafleet.values import real, whole

    check_settings(cfg, "bench.yaml", ("shape",))
    shape = OmegaConf.to_container(cfg.shape, resolve=True)
    check_shape(shape)
    if cfg.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {cfg.dtype!r}")
    if not real(cfg.delta_std) or cfg.delta_std <= 0:
        raise ValueError(f"delta_std must be a positive number, got {cfg.delta_std!r}")
    if not whole(cfg.seed) or cfg.seed < 0:
        raise ValueError(f"seed must be a whole number, at least 0, got {cfg.seed!r}")
    if not whole(cfg.checkpoint_shard_bytes) or cfg.checkpoint_shard_bytes < 1:
        raise ValueError(f"checkpoint_shard_bytes must be a whole number of bytes, at least 1, "
                         f"got {cfg.checkpoint_shard_bytes!r}")
    if cfg.granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {', '.join(GRANULARITIES)} (the naive path's), "
                         f"got {cfg.granularity!r}")
    if cfg.max_shard_bytes is not None and (not whole(cfg.max_shard_bytes) or cfg.max_shard_bytes < 1):
        raise ValueError(f"max_shard_bytes must be a whole number of bytes, at least 1 (or null: one shard), "
                         f"got {cfg.max_shard_bytes!r}")
    for key in ("sample_every_s", "rss_limit_gb"):
        if not real(cfg[key]) or cfg[key] <= 0:
            raise ValueError(f"{key} must be a positive number, got {cfg[key]!r}")
    try:
        naive = "auto" if cfg.naive == "auto" else flag(cfg, "naive")
    except ValueError:
        raise ValueError(f"naive must be true, false or auto, got {cfg.naive!r}") from None
    keep_pair = flag(cfg, "keep_pair")
    report_name = check_report_name(cfg.report_name)
    for key in ("pair_dir", "work_dir"):
        if not isinstance(cfg[key], str) or not cfg[key].strip():
            raise ValueError(f"{key} must be a folder path, got {cfg[key]!r}")
    reports = Path(cfg.paths.reports_dir).resolve()  # not inside a folder the benchmark deletes
    pair_dir = check_own_folder(cfg.pair_dir, "pair_dir", not_pair, inputs=[reports])
    work_dir = check_own_folder(cfg.work_dir, "work_dir", not_work_dir, inputs=[pair_dir, reports])
    check_reports_dir(reports)
    return {"shape": shape, "naive": naive, "keep_pair": keep_pair, "report_name": report_name,
            "pair_dir": pair_dir, "work_dir": work_dir, "pair_existed": pair_dir.exists()}


# --------------------------------------------------------------------------------------------
# The random 7B-shaped pair
# --------------------------------------------------------------------------------------------


def llama_tensors(shape: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of a Llama checkpoint's tensors, in Hugging Face order.

    Args:
        shape: ``vocab_size, hidden_size, intermediate_size, num_hidden_layers,
            num_attention_heads, num_key_value_heads``.

    Returns:
        ``[(name, shape), ...]``; ``lm_head.weight`` included (untied).
    """
    v, h, i = shape["vocab_size"], shape["hidden_size"], shape["intermediate_size"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    out = [("model.embed_tokens.weight", (v, h))]
    for layer in range(shape["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (h, h)),
                (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.v_proj.weight", (kv, h)),
                (p + "self_attn.o_proj.weight", (h, h)), (p + "post_attention_layernorm.weight", (h,)),
                (p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
                (p + "mlp.down_proj.weight", (h, i))]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    return out


def generate_pair(pair_dir: Path, shape: dict, dtype: torch.dtype, delta_std: float, seed: int,
                  shard_bytes: int) -> dict:
    """Write the random base / fine-tune pair under ``pair_dir/{base,ft}`` (atomically).

    Tensor ``k`` of the base is drawn from a generator seeded with ``seed · 100003 + k``, so the
    pair is the same on every machine. Memory: two checkpoint shards (and their serialisation).

    Returns:
        ``{"parameters", "checkpoint_bytes"}`` (bytes of one checkpoint's tensors).
    """
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from deltafleet.atomic import staged_dir

    tensors = llama_tensors(shape)
    n_params = sum(torch.Size(s).numel() for _, s in tensors)
    with staged_dir(pair_dir) as tmp:
        parts: dict[str, list[dict[str, str]]] = {"base": [], "ft": []}
        pending: dict[str, dict[str, torch.Tensor]] = {"base": {}, "ft": {}}
        size = 0

        def flush() -> None:
            nonlocal size
            for which in ("base", "ft"):
                k = len(parts[which])
                (tmp / which).mkdir(exist_ok=True)
                save_file(pending[which], tmp / which / f"part-{k}.safetensors", metadata={"format": "pt"})
                parts[which].append({name: f"part-{k}.safetensors" for name in pending[which]})
                pending[which] = {}
            size = 0

        for k, (name, s) in enumerate(tensors):
            g = torch.Generator().manual_seed(seed * 100003 + k)
            nbytes = torch.Size(s).numel() * dtype.itemsize
            if pending["base"] and size + nbytes > shard_bytes:
                flush()
            if len(s) == 1:  # norms: near 1, nudged by the fine-tune
                base = 1.0 + 0.1 * torch.randn(s, generator=g)
            else:
                base = 0.02 * torch.randn(s, generator=g)
            ft = base + delta_std * torch.randn(s, generator=g)
            pending["base"][name], pending["ft"][name] = base.to(dtype), ft.to(dtype)
            del base, ft
            size += nbytes
        flush()
        n_shards = len(parts["base"])
        config = LlamaConfig(vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
                             intermediate_size=shape["intermediate_size"],
                             num_hidden_layers=shape["num_hidden_layers"],
                             num_attention_heads=shape["num_attention_heads"],
                             num_key_value_heads=shape["num_key_value_heads"], tie_word_embeddings=False,
                             dtype=str(dtype).removeprefix("torch."))
        for which in ("base", "ft"):
            weight_map = {}
            for k, part in enumerate(parts[which]):
                final = f"model-{k + 1:05d}-of-{n_shards:05d}.safetensors"
                os.replace(tmp / which / f"part-{k}.safetensors", tmp / which / final)
                weight_map.update({name: final for name in part})
            total = sum((tmp / which / f).stat().st_size for f in set(weight_map.values()))
            (tmp / which / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
            config.save_pretrained(tmp / which)
        info = {"parameters": n_params, "checkpoint_bytes": n_params * dtype.itemsize,
                "shape": shape, "dtype": str(dtype), "delta_std": delta_std, "seed": seed}
        (tmp / "pair.json").write_text(json.dumps(info, indent=2))
    return info


# --------------------------------------------------------------------------------------------
# The two export paths (each run in its own process by the driver)
# --------------------------------------------------------------------------------------------


def export_streaming(pair_dir: Path, out_dir: Path, granularity: str, max_shard_bytes: int) -> dict:
    """The product path: :func:`deltafleet.compress.bitdelta.compress`."""
    from deltafleet.compress.bitdelta import compress

    manifest = compress(pair_dir / "base", pair_dir / "ft", out_dir, variant="bench",
                        granularity=granularity, max_shard_bytes=max_shard_bytes)
    return {"artifact_bytes": manifest["stats"]["bytes"],
            "bits_per_parameter": manifest["stats"]["bits_per_parameter"]}


def export_naive(pair_dir: Path, out_dir: Path, granularity: str) -> dict:
    """Both checkpoints loaded whole, then one Δ per matrix: the path users of BitDelta's repo take."""
    from safetensors.torch import load_file, save_file

    from deltafleet.kernels import pack_signs

    def load(d: Path) -> dict[str, torch.Tensor]:
        state: dict[str, torch.Tensor] = {}
        for f in sorted(d.glob("model-*.safetensors")):
            state.update(load_file(f))
        return state

    base, ft = load(pair_dir / "base"), load(pair_dir / "ft")
    out: dict[str, torch.Tensor] = {}
    for name, w in ft.items():
        if w.dim() == 2:
            delta = w.float() - base[name].float()
            per_row = granularity == "row" or name.endswith(("embed_tokens.weight", "lm_head.weight"))
            alpha = delta.abs().mean(dim=1) if per_row else delta.abs().mean()
            out[name + ".sign"], out[name + ".alpha"] = pack_signs(delta), alpha.float()
            del delta
        elif not torch.equal(w, base[name]):
            out[name] = w
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(out, out_dir / "delta.safetensors", metadata={"format": "pt"})
    nbytes = (out_dir / "delta.safetensors").stat().st_size
    return {"artifact_bytes": nbytes,
            "bits_per_parameter": 8 * nbytes / sum(t.numel() for t in ft.values())}


def compare_artifacts(streaming_dir: Path, naive_dir: Path) -> dict:
    """Signs equal bit for bit, α equal to float32 summation error, the same full tensors."""
    from deltafleet.compress.bitdelta import load_artifact
    from safetensors.torch import load_file

    art = load_artifact(streaming_dir)
    naive = load_file(naive_dir / "delta.safetensors")
    sign_mismatch, alpha_rel = [], 0.0
    for p, s in art.signs.items():
        if not torch.equal(s, naive[p + ".sign"]):
            sign_mismatch.append(p)
        a, b = art.alphas[p].double(), naive[p + ".alpha"].double()
        alpha_rel = max(alpha_rel, float(((a - b).abs() / b.abs().clamp_min(1e-30)).max()))
    full_equal = sorted(art.full) == sorted(k for k in naive if not k.endswith((".sign", ".alpha"))) and all(
        torch.equal(t, naive[k]) for k, t in art.full.items())
    return {"matrices": len(art.signs), "sign_mismatches": sign_mismatch,
            "alpha_max_relative_difference": alpha_rel, "full_tensors_equal": full_equal}


def _worker(argv: list[str]) -> None:
    """``bench.py --worker <path> <json args>``: run one path, print one JSON line."""
    path, args = argv[0], json.loads(argv[1])
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    t0 = time.perf_counter()
    if path == "streaming":
        res = export_streaming(Path(args["pair_dir"]), Path(args["out_dir"]), args["granularity"],
                               args["max_shard_bytes"])
    elif path == "naive":
        res = export_naive(Path(args["pair_dir"]), Path(args["out_dir"]), args["granularity"])
    elif path == "generate":
        res = generate_pair(Path(args["pair_dir"]), args["shape"], getattr(torch, args["dtype"]),
                            args["delta_std"], args["seed"], args["shard_bytes"])
    elif path == "compare":
        res = compare_artifacts(Path(args["streaming_dir"]), Path(args["naive_dir"]))
    else:
        raise SystemExit(f"unknown worker path {path!r}")
    res["wall_s"] = time.perf_counter() - t0
    res["peak_rss_bytes"] = _status_bytes("self", "VmHWM")
    print("RESULT " + json.dumps(res), flush=True)


def _status_bytes(pid: int | str, key: str = "VmRSS") -> int | None:
    """``key`` (VmRSS: resident now, VmHWM: peak resident) of ``/proc/<pid>/status``, in bytes."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def run_measured(path: str, args: dict, sample_every_s: float) -> dict:
    """Run one worker in a child process; its result plus peak RSS and RSS samples.

    The peak is the child's own ``VmHWM`` (high-water mark of its resident set since ``exec``),
    read by the child at the end. Not ``ru_maxrss`` from ``wait4``: Linux carries the parent's
    resident set at ``fork`` into the child's ``ru_maxrss``, which would charge the driver's memory
    (e.g. after generating the pair) to the export. A child that dies gets the sampled maximum.

    Returns:
        the worker's JSON result with ``peak_rss_bytes``, ``rss`` (list of ``[seconds, bytes]``)
        and ``returncode``; ``error`` (stderr tail) if the child failed.
    """
    import subprocess

    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", path, json.dumps(args)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    samples = []
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        rss = _status_bytes(proc.pid)
        if rss is not None:
            samples.append([round(time.perf_counter() - t0, 3), rss])
        time.sleep(sample_every_s)
    proc.returncode = os.waitstatus_to_exitcode(status)
    out, err = proc.communicate()
    res: dict = {}
    for line in out.splitlines():
        if line.startswith("RESULT "):
            res = json.loads(line[len("RESULT "):])
    res.setdefault("peak_rss_bytes", max((b for _, b in samples), default=0))
    res.update(returncode=proc.returncode, rss=samples, process_wall_s=time.perf_counter() - t0,
               ru_maxrss_bytes=usage.ru_maxrss * 1024)
    if proc.returncode != 0:
        res["error"] = err[-2000:]
    return res


def _machine() -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    mem = next((int(ln.split()[1]) * 1024 for ln in open("/proc/meminfo") if ln.startswith("MemTotal")), 0)
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_bytes": mem, "python": platform.python_version(),
            "torch": torch.__version__, "platform": platform.platform()}


def _mem_available() -> int:
    return next(int(ln.split()[1]) * 1024 for ln in open("/proc/meminfo") if ln.startswith("MemAvailable"))


def plot(report: dict, png: Path) -> None:
    """Resident memory over time of both paths, with the RSS target."""
    import matplotlib

    from deltafleet.atomic import write_figure

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for path, color in (("streaming", "tab:blue"), ("naive", "tab:red")):
        r = report["paths"].get(path)
        if not r or not r.get("rss"):
            continue
        t = [s[0] for s in r["rss"]]
        rss = [s[1] / GB for s in r["rss"]]
        label = (f"{path}: peak {r['peak_rss_bytes'] / GB:.2f} GB, {r['gb_per_s']:.2f} GB/s"
                 if r.get("returncode") == 0 else f"{path}: failed (rc {r.get('returncode')})")
        ax.plot(t, rss, color=color, label=label)
    ax.axhline(report["rss_limit_gb"], color="gray", ls="--", label=f"target {report['rss_limit_gb']:g} GB")
    pair = report["pair"]
    ax.set_title(f"BitDelta export, {pair['shape']['name']} pair ({pair['parameters'] / 1e9:.2f}B params, "
                 f"{pair['dtype'].removeprefix('torch.')}), {report['machine']['cores']} cores", fontsize=10)
    ax.set_xlabel("seconds since the process started")
    ax.set_ylabel("resident memory (GB)")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    write_figure(fig, png, dpi=120)
    plt.close(fig)


def main(cfg) -> dict:
    """One run of the benchmark (the module's docstring): :func:`run` after :func:`check_config`.

    Raises:
        ValueError: a setting :func:`check_config` refuses, before any work.
    """
    return run(cfg, check_config(cfg))


def run(cfg, checked: dict) -> dict:
    """The benchmark with ``cfg``'s settings, as :func:`check_config` returned them in ``checked``;
    its report, whose ``failed`` lists what did not run through (empty for a complete run)."""
    from deltafleet.atomic import remove_dir, write_text

    shape, pair_dir, work = checked["shape"], checked["pair_dir"], checked["work_dir"]
    want = {"shape": shape, "dtype": str(getattr(torch, cfg.dtype)), "delta_std": cfg.delta_std, "seed": cfg.seed}
    pair, differs = cached_pair(pair_dir, want)
    if pair is not None:
        print(f"[bench] reusing {pair_dir}")
    else:
        if differs:
            print(f"[bench] {pair_dir} holds a pair of other settings ({'; '.join(differs)}): generating it again")
        check_free_disk(pair_dir, 2 * pair_parameters(shape) * getattr(torch, cfg.dtype).itemsize)
        print(f"[bench] generating the {shape['name']} pair ({cfg.shape.num_hidden_layers} layers) in {pair_dir} …")
        gen = run_measured("generate", {"pair_dir": str(pair_dir), "shape": shape, "dtype": cfg.dtype,
                                        "delta_std": cfg.delta_std, "seed": cfg.seed,
                                        "shard_bytes": cfg.checkpoint_shard_bytes}, 1.0)
        if gen["returncode"] != 0:
            raise SystemExit(f"generating the pair failed:\n{gen.get('error', '')}")
        pair = json.loads((pair_dir / PAIR_RECORD).read_text())
        print(f"[bench] generated 2 × {pair['checkpoint_bytes'] / GB:.2f} GB in {gen['wall_s']:.0f} s")
    pair_bytes = 2 * pair["checkpoint_bytes"]
    report: dict = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": _machine(),
                    "pair": pair, "granularity": cfg.granularity, "max_shard_bytes": cfg.max_shard_bytes,
                    "rss_limit_gb": cfg.rss_limit_gb, "paths": {},
                    # whether both checkpoints can sit in the page cache: then the exports read
                    # from memory, else from disk
                    "pair_fits_in_page_cache": _machine()["memory_bytes"] > 1.1 * 2 * pair["checkpoint_bytes"]}
    work.mkdir(parents=True, exist_ok=True)
    args = {"pair_dir": str(pair_dir), "granularity": cfg.granularity}

    print("[bench] streaming export …")
    r = run_measured("streaming", {**args, "out_dir": str(work / "streaming"),
                                   "max_shard_bytes": cfg.max_shard_bytes}, cfg.sample_every_s)
    report["paths"]["streaming"] = r

    need = int(pair_bytes * 1.15)
    avail = _mem_available()
    run_naive = checked["naive"] is True or (checked["naive"] == "auto" and need < avail)
    if run_naive:
        print("[bench] naive export (both checkpoints loaded) …")
        if (work / "naive").is_dir():  # the previous run's (check_config: nothing else is there)
            remove_dir(work / "naive")
        report["paths"]["naive"] = run_measured("naive", {**args, "out_dir": str(work / "naive")}, cfg.sample_every_s)
    else:
        report["paths"]["naive"] = {"skipped": f"needs ~{need / GB:.1f} GB resident (both checkpoints), "
                                               f"{avail / GB:.1f} GB available"}
    for r in report["paths"].values():
        if r.get("returncode") == 0:
            r["gb_per_s"] = pair_bytes / GB / r["wall_s"]
    s, n = report["paths"]["streaming"], report["paths"]["naive"]
    if s.get("returncode") == 0 and n.get("returncode") == 0:
        report["agreement"] = run_measured("compare", {"streaming_dir": str(work / "streaming"),
                                                       "naive_dir": str(work / "naive")}, 1.0)
        report["agreement"].pop("rss", None)
        a = report["agreement"]
        if a["returncode"] == 0 and (a["sign_mismatches"] or not a["full_tensors_equal"]):
            a["error"] = (f"the paths disagree: {len(a['sign_mismatches'])} matrices' signs differ, "
                          f"full tensors equal {a['full_tensors_equal']}")
        report["peak_rss_ratio_naive_over_streaming"] = n["peak_rss_bytes"] / s["peak_rss_bytes"]
        report["speed_ratio_streaming_over_naive"] = s["gb_per_s"] / n["gb_per_s"]
    report["streaming_within_rss_limit"] = s.get("returncode") == 0 and s["peak_rss_bytes"] <= cfg.rss_limit_gb * GB
    report["failed"] = [f"{path} export" for path, r in report["paths"].items() if r.get("returncode", 0) != 0]
    if "error" in report.get("agreement", {}):
        report["failed"].append("comparison")

    reports = Path(cfg.paths.reports_dir)
    reports.mkdir(parents=True, exist_ok=True)
    js, png = reports / f"{checked['report_name']}.json", reports / f"{checked['report_name']}.png"
    write_text(js, json.dumps(report, indent=1) + "\n")
    plot(report, png)
    for path, r in report["paths"].items():
        if "skipped" in r:
            print(f"[bench] {path:9s} skipped: {r['skipped']}")
        elif r["returncode"] != 0:
            print(f"[bench] {path:9s} FAILED rc={r['returncode']}: {r.get('error', '')[-500:]}")
        else:
            print(f"[bench] {path:9s} {r['wall_s']:7.1f} s  {r['gb_per_s']:.3f} GB/s  "
                  f"peak RSS {r['peak_rss_bytes'] / GB:.2f} GB  artifact {r['artifact_bytes'] / GB:.3f} GB "
                  f"({r['bits_per_parameter']:.4f} bits/param)")
    if "error" in report.get("agreement", {}):
        print(f"[bench] comparison FAILED: {report['agreement']['error'][-500:]}")
    elif "agreement" in report:
        a = report["agreement"]
        print(f"[bench] agreement: {a['matrices']} matrices, sign mismatches {len(a['sign_mismatches'])}, "
              f"max α relative difference {a['alpha_max_relative_difference']:.2e}, "
              f"full tensors equal {a['full_tensors_equal']}")
        print(f"[bench] naive ÷ streaming peak RSS = {report['peak_rss_ratio_naive_over_streaming']:.2f}×, "
              f"streaming ÷ naive throughput = {report['speed_ratio_streaming_over_naive']:.2f}×")
    print(f"[bench] → {js}, {png}")
    if not checked["keep_pair"]:  # generated or checked as a pair (check_config); a folder it found stays
        if checked["pair_existed"]:
            for made in (PAIR_RECORD, "base", "ft"):
                if (pair_dir / made).is_dir():
                    remove_dir(pair_dir / made)
                else:
                    (pair_dir / made).unlink(missing_ok=True)
        else:
            remove_dir(pair_dir)
    if report["failed"]:
        print(f"[bench] FAILED: {', '.join(report['failed'])}")
    return report


def _entry(cfg) -> None:
    """``python compress/bench.py``: a refused setting is ``error: <why>`` on stderr and exit status 2,
    before any work (its Hydra run folder removed); a run in which something failed exits with 1,
    after its report is written."""
    from deltafleet.cli import checked_run

    checked_run("bench-compress", cfg, check_config, run)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(sys.argv[2:])
    else:
        import hydra

        from deltafleet.cli import run_script

        run_script(hydra.main(config_path="../conf", config_name="bench", version_base="1.3")(_entry))
