"""``make bench-kernels``: the Triton BitDelta kernels against dense bf16 ``torch.matmul``, side by side.

    python kernels/bench.py machine=h200
    python kernels/bench.py shapes=[llama2-70b] ms=[1,2048] tenants=[1,16]

For each layer shape (Llama-2-7B and -70B linears, ``conf/bench_kernels.yaml``) it times, on the
same random tensors in one run:

* ``dense``: ``x @ W.T`` in bf16 (cuBLAS) — the denominator of every ratio;
* ``naive``: unpack the signs to bf16, ``W + α·S``, then the matmul (the path the kernel replaces);
* ``triton``: :func:`deltafleet.kernels.bitdelta_linear` (the custom op; decode kernel for M ≤ 4, tensor-core
  kernel above), for M in ``ms``;
* mixed tenants, T variants with one token each (M = T): ``dense`` at M = T,
  ``triton_batched`` (:func:`deltafleet.kernels.bitdelta_linear_batched`, the dispatcher's pick), each
  mixed-tenant kernel on its own (``batched_fma``, ``batched_lut``, ``batched_gluon``,
  ``batched_planes``: ``batched_impls``; the Hopper ones from two rows up) and, as a reference row,
  ``bitdelta_style``: BitDelta's approach of unpacking each tenant's signs and a batched matmul
  (``x·Wᵀ`` shared, ``α_t ⊙ bmm(x_t, S_tᵀ)``; our torch code, not theirs);
* grouped decode batches (``grouped``): M rows over the base and T variants with Zipf(s)
  popularity, as a serving engine's decode step holds them: ``dense`` at M, ``triton_batched``
  (the dispatcher's pick) and ``grouped`` (:func:`deltafleet.kernels.bitdelta_linear_grouped`, the rows
  grouped by variant once beforehand, as the engine does per step), against the floor ``1 + D/16``
  for the D variants present and the bound ``1.1·(1 + T/16)`` (issue #26).

Times are medians taken in ``rounds`` rounds of dense and the kernels timed in turn (the median over
rounds is reported), replayed from a CUDA graph (``triton.testing.do_bench_cudagraph``) when
``timing=cuda_graph`` (as a serving engine replays decode steps; no Python launch overhead in either
side of a ratio) or launched eagerly (``triton.testing.do_bench``, L2 flushed before each call).
A graph replays its calls back to back with no flush, so with ``cold_l2`` (the default) every timed
callable, dense included, cycles through copies of its operands (:mod:`deltafleet.kernels.timing`): between two
calls on one copy the others' bytes pass through the L2 at least twice, and each call reads its
weights from memory, as a decode step does (its other layers' weights evict them). Without it a
matrix that fits in the L2 (Llama-2-7B's o, 32 MiB) is read from it by both sides of the ratio.
Achieved bandwidth = bytes the kernel must read and write (W, signs, α, x, y) ÷ time, against the
bandwidth of a device-to-device copy timed in the same run. A "layer set" figure is Σ time over
the four linears of one model ÷ Σ dense.

Writes ``reports/<report_name>.json`` and ``.png``; prints the targets: issue 5's (decode M = 1 and
prefill M = 2048 ≤ 1.10 × dense over the 70B layer set; T tenants ≤ 1.1·(1 + T/16) × dense) and
issue 26's (one variant ≤ 1.15 × dense for 2 ≤ M ≤ 64 and ≤ 1.10 × at M = 256 on every shape;
grouped batches ≤ 1.1·(1 + T/16) × dense at M = 64 and 256 for T = 4 and 14).
"""
from __future__ import annotations

import json
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from deltafleet.atomic import write_figure, write_text
from deltafleet.kernels.timing import cold_copies, l2_size, rotating

TARGET_SINGLE = 1.10   # one variant at M = 1, 256 and 2048 rows
TARGET_BATCH = 1.15    # one variant at 2 ≤ M ≤ 64 rows (issue 26)


def target_tenants(t: int) -> float:
    """Issue 5's bound for T tenants at M = T: 1.1 · (1 + T/16) × dense (1 + T/16: W once + T sign sets)."""
    return 1.1 * (1 + t / 16)


def _timer(timing: str, rep_ms: int):
    import triton.testing

    if timing == "cuda_graph":
        def run(fn):
            fn()  # allocations (split-K workspace, autotuning) happen before capture
            torch.cuda.synchronize()
            return triton.testing.do_bench_cudagraph(fn, rep=rep_ms)
    elif timing == "eager":
        def run(fn):
            return triton.testing.do_bench(fn, warmup=max(10, rep_ms // 4), rep=rep_ms)
    else:
        raise ValueError(f"timing must be cuda_graph or eager, got {timing!r}")
    return run


def time_interleaved(bench, fns: dict, rounds: int) -> dict:
    """Median time of each callable in ``fns`` (name -> fn) over ``rounds`` rounds, the callables
    timed one after another within a round, so that a drift of the GPU's speed during a run weighs on
    dense and the kernels alike (dense alone varies by several per cent from run to run).

    Args:
        bench: ``fn -> milliseconds`` (``_timer``'s).
        fns: name -> zero-argument callable, timed in this order in each round.
        rounds: ≥ 1.

    Returns:
        name -> median milliseconds (for an even ``rounds``, the mean of the two middle times).

    Raises:
        ValueError: if ``rounds`` < 1.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    times: dict = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(bench(fn))
    out = {}
    for name, ts in times.items():
        ts = sorted(ts)
        mid = len(ts) // 2
        out[name] = ts[mid] if len(ts) % 2 else (ts[mid - 1] + ts[mid]) / 2
    return out


def l2_bytes(cfg) -> int:
    """The L2 bytes the timed calls must pass through (the device's L2; 0 without ``cold_l2`` and for
    eager timing, whose ``do_bench`` flushes the L2 before each call)."""
    if not cfg.get("cold_l2", True) or cfg.timing == "eager":
        return 0
    return l2_size(torch.cuda.current_device())


def copy_bandwidth(nbytes: int, bench) -> float:
    """Device-to-device copy bandwidth in GB/s (10⁹ bytes), counting bytes read + written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    del src, dst
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _naive(x, w, sign, alpha, k, dtype):
    from deltafleet.kernels import unpack_signs

    a = alpha.to(dtype)[:, None] if alpha.dim() == 1 else alpha.to(dtype)
    return x @ (w + a * unpack_signs(sign, k, dtype)).t()


def _bitdelta_style(x, w, signs, alphas, k, dtype):
    """Unpack each tenant's signs to the activation dtype, then one bmm for the deltas."""
    from deltafleet.kernels import unpack_signs

    base = x @ w.t()
    s = unpack_signs(signs, k, dtype)                                    # [T, N, K]
    d = torch.bmm(x[:, None, :], s.transpose(1, 2))[:, 0, :]            # [T, N]
    return base + alphas.to(dtype) * d


def run(cfg) -> dict:
    """Run the benchmark described by ``cfg`` (``conf/bench_kernels.yaml``); returns the report.

    Raises:
        RuntimeError: without a CUDA device.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("make bench-kernels needs a CUDA GPU (the kernels' CPU tests are `make test`)")
    import triton

    from deltafleet.kernels import (bitdelta_linear, bitdelta_linear_batched, bitdelta_linear_batched_reference,
                                    bitdelta_linear_grouped, pack_signs, tile_signs)
    from deltafleet.kernels.triton_grouped import decode_block_m, group_rows
    from deltafleet.kernels import triton_bitdelta
    from deltafleet.kernels.triton_bitdelta import bitdelta_linear_batched_triton

    if cfg.get("sign_layout", "tiled") not in ("rows", "tiled"):
        raise ValueError(f"sign_layout must be rows or tiled, got {cfg.sign_layout!r}")
    tiled = cfg.get("sign_layout", "tiled") == "tiled"  # the kernels read kernels.tile_signs' layout

    dtype = getattr(torch, cfg.dtype)
    bench = _timer(cfg.timing, cfg.rep_ms)
    rounds = int(cfg.get("rounds", 1))  # dense and the kernels timed in turn, medians over the rounds
    g = torch.Generator(device="cuda").manual_seed(cfg.seed)
    copy_gbs = copy_bandwidth(int(cfg.copy_bytes), bench)
    l2 = l2_bytes(cfg)
    print(f"copy bandwidth {copy_gbs:.0f} GB/s; operands cycled past {l2 / 2**20:.0f} MiB of L2", flush=True)
    rows, t0 = [], time.time()
    for model in cfg.shapes:
        layers = {name: tuple(nk) for name, nk in cfg.layer_shapes[model].items()}
        tensors = {}
        for name, (n, k) in layers.items():
            w = (0.02 * torch.randn(n, k, device="cuda", generator=g)).to(dtype)
            sign = pack_signs(torch.randn(n, k, device="cuda", generator=g))
            alpha = (0.004 + 0.002 * torch.rand(n, device="cuda", generator=g)) if cfg.alpha_granularity == "row" \
                else torch.tensor(0.005, device="cuda")
            tensors[name] = (w, sign, alpha)
        for m in cfg.ms:
            for name, (n, k) in layers.items():
                w, sign, alpha = tensors[name]
                ks = tile_signs(sign) if tiled else sign  # what the kernels read
                x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
                before = set(triton_bitdelta._PREFILL_CHOICE)
                y = bitdelta_linear(x, w, ks, alpha)  # the dispatcher's choice for this shape, timed once
                new = [v for key, v in triton_bitdelta._PREFILL_CHOICE.items() if key not in before]
                pick = str(new[0]) if new else ("decode" if m <= triton_bitdelta.GEMV_MAX_M else "as before")
                ref = _naive(x.float(), w.float(), sign, alpha.float(), k, torch.float32)
                err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                c = cold_copies((x, w, sign, ks, alpha), l2)
                t = time_interleaved(bench, {
                    "dense": rotating(lambda x, w, sign, ks, alpha: x @ w.t(), c),
                    "naive": rotating(lambda x, w, sign, ks, alpha: _naive(x, w, sign, alpha, k, dtype), c),
                    "triton": rotating(lambda x, w, sign, ks, alpha: bitdelta_linear(x, w, ks, alpha), c)}, rounds)
                del c
                nbytes = 2 * n * k + n * ((k + 7) // 8) + 4 * alpha.numel() + 2 * m * (k + n)
                rows.append({"kind": "single", "model": model, "layer": name, "N": n, "K": k, "M": m,
                             **{f"{key}_ms": v for key, v in t.items()},
                             "triton_over_dense": t["triton"] / t["dense"], "naive_over_dense": t["naive"] / t["dense"],
                             "triton_GBps": nbytes / (t["triton"] * 1e-3) / 1e9,
                             "dense_GBps": (2 * n * k + 2 * m * (k + n)) / (t["dense"] * 1e-3) / 1e9,
                             "max_rel_err": err, "pick": pick})
                print(f"[{time.time() - t0:5.0f}s] {model} {name:8s} M={m:5d} dense {t['dense'] * 1e3:9.1f} us  "
                      f"triton {t['triton'] / t['dense']:6.3f}x  naive {t['naive'] / t['dense']:6.2f}x  "
                      f"{rows[-1]['triton_GBps']:6.0f} GB/s  err {err:.1e}  {pick}", flush=True)
        for t_count in cfg.tenants:
            for name, (n, k) in layers.items():
                w = tensors[name][0]
                signs = torch.randint(0, 256, (t_count, n, (k + 7) // 8), device="cuda", dtype=torch.uint8,
                                      generator=g)
                alphas = 0.004 + 0.002 * torch.rand(t_count, n, device="cuda", generator=g)
                slot = torch.arange(t_count, device="cuda", dtype=torch.int32)
                x = torch.randn(t_count, k, device="cuda", generator=g).to(dtype)
                kss = tile_signs(signs) if tiled else signs  # what the kernels read
                y = bitdelta_linear_batched(x, w, kss, alphas, slot)
                ref = bitdelta_linear_batched_reference(x.float(), w.float(), signs, alphas, slot)
                err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                c = cold_copies((x, w, kss, alphas), l2)
                t = time_interleaved(bench, {
                    "dense": rotating(lambda x, w, kss, alphas: x @ w.t(), c),
                    "triton_batched": rotating(
                        lambda x, w, kss, alphas: bitdelta_linear_batched(x, w, kss, alphas, slot), c)}, rounds)
                for impl in cfg.batched_impls:  # each mixed-tenant kernel on its own, besides the dispatcher's pick
                    if impl in ("gluon", "planes") and t_count < 2:  # the Hopper tenant kernel takes two rows or more
                        t[f"batched_{impl}"] = float("nan")
                        continue
                    if impl == "gluon" and tiled:  # that kernel reads sign rows only
                        t[f"batched_{impl}"] = float("nan")
                        continue
                    t[f"batched_{impl}"] = bench(rotating(lambda x, w, kss, alphas, impl=impl:
                                                          bitdelta_linear_batched_triton(x, w, kss, alphas, slot,
                                                                                         impl=impl), c))
                del c
                if cfg.bitdelta_style:
                    t["bitdelta_style"] = bench(rotating(lambda x, w, signs, alphas: _bitdelta_style(
                        x, w, signs, alphas, k, dtype), cold_copies((x, w, signs, alphas), l2)))
                nbytes = 2 * n * k + t_count * (n * ((k + 7) // 8) + 4 * n) + 2 * t_count * (k + n)
                # the dispatcher's pick for this shape (kernels.triton_bitdelta._TENANTS_CHOICE), for the record
                choice = [repr(v) for key, v in triton_bitdelta._TENANTS_CHOICE.items()
                          if key[:3] == (n, k, triton.next_power_of_2(t_count))]
                rows.append({"kind": "tenants", "model": model, "layer": name, "N": n, "K": k, "T": t_count,
                             "M": t_count, "dispatcher_choice": choice, **{f"{key}_ms": v for key, v in t.items()},
                             **{f"{key}_over_dense": v / t["dense"] for key, v in t.items() if key != "dense"},
                             "triton_batched_GBps": nbytes / (t["triton_batched"] * 1e-3) / 1e9, "max_rel_err": err})
                print(f"[{time.time() - t0:5.0f}s] {model} {name:8s} T={t_count:3d} dense {t['dense'] * 1e3:9.1f} us  "
                      f"batched {t['triton_batched'] / t['dense']:6.3f}x  "
                      f"bitdelta-style {t.get('bitdelta_style', float('nan')) / t['dense']:6.2f}x  err {err:.1e}  "
                      f"pick {' '.join(choice)}", flush=True)
            del signs, kss
            _write_partial(cfg, copy_gbs, rows)
        grouped = cfg.get("grouped") or {}
        for m in grouped.get("ms", []):
            for t_count in grouped.get("tenants", []):
                slot = zipf_slots(m, t_count, float(grouped.get("zipf_s", 1.0)), cfg.seed + 31 * m + t_count).cuda()
                distinct = len({v for v in slot.tolist() if v >= 0})
                # blocks as the engine's graphed decode step cuts them (serve/graphs.py: decode_block_m of
                # the rows' variants), long blocks by grouped_long_m
                block_m = decode_block_m(slot.tolist(), t_count, "cuda")
                groups = group_rows(slot, t_count, block_m)
                for name, (n, k) in layers.items():
                    w = tensors[name][0]
                    signs = torch.randint(0, 256, (t_count, n, (k + 7) // 8), device="cuda", dtype=torch.uint8,
                                          generator=g)
                    alphas = 0.004 + 0.002 * torch.rand(t_count, n, device="cuda", generator=g)
                    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
                    kss = tile_signs(signs) if tiled else signs
                    ref = bitdelta_linear_batched_reference(x.float(), w.float(), signs, alphas, slot)
                    errs = {key: ((y.float() - ref).abs().max() / ref.abs().max()).item() for key, y in
                            (("triton_batched", bitdelta_linear_batched(x, w, kss, alphas, slot)),
                             ("grouped", bitdelta_linear_grouped(x, w, kss, alphas, slot, groups=groups)))}
                    c = cold_copies((x, w, kss, alphas), l2)
                    t = time_interleaved(bench, {
                        "dense": rotating(lambda x, w, kss, alphas: x @ w.t(), c),
                        "triton_batched": rotating(
                            lambda x, w, kss, alphas: bitdelta_linear_batched(x, w, kss, alphas, slot), c),
                        "grouped": rotating(lambda x, w, kss, alphas: bitdelta_linear_grouped(
                            x, w, kss, alphas, slot, groups=groups), c)}, rounds)
                    del c
                    rows.append({"kind": "grouped", "model": model, "layer": name, "N": n, "K": k, "M": m,
                                 "T": t_count, "distinct": distinct, "block_m": block_m, "floor": 1 + distinct / 16,
                                 **{f"{key}_ms": v for key, v in t.items()},
                                 **{f"{key}_over_dense": v / t["dense"] for key, v in t.items() if key != "dense"},
                                 "max_rel_err": max(errs.values())})
                    print(f"[{time.time() - t0:5.0f}s] {model} {name:8s} M={m:4d} T={t_count:2d} ({distinct} present) "
                          f"batched {t['triton_batched'] / t['dense']:6.3f}x  grouped {t['grouped'] / t['dense']:6.3f}x  "
                          f"floor {1 + distinct / 16:.3f}x  block {block_m}  err {max(errs.values()):.1e}", flush=True)
                    del signs, kss
                _write_partial(cfg, copy_gbs, rows)
        del tensors
        torch.cuda.empty_cache()
        _write_partial(cfg, copy_gbs, rows)
    summary = _summary(rows, cfg)
    for line in summary["lines"]:
        print(line, flush=True)
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": {"gpu": torch.cuda.get_device_name(), "host": platform.node(), "torch": torch.__version__,
                        "triton": triton.__version__, "cuda": torch.version.cuda},
            "config": _plain(cfg),
            "copy_GBps": copy_gbs, "summary": summary, "rows": rows}


def zipf_slots(m: int, tenants: int, s: float, seed: int) -> torch.Tensor:
    """int32 ``[m]`` slots over the base (−1) and ``tenants`` variants, model ``r`` of rank ``r + 1``
    (the base first) drawn with probability ∝ ``1 / (r + 1)^s``, seeded, on the CPU."""
    p = 1.0 / torch.arange(1, tenants + 2, dtype=torch.float64) ** s
    g = torch.Generator().manual_seed(seed)
    return (torch.multinomial(p, m, replacement=True, generator=g) - 1).to(torch.int32)


def _write_partial(cfg, copy_gbs: float, rows: list[dict]) -> None:
    """The rows so far, in ``<report_name>.partial.json`` (survives an interrupted run; removed at the end)."""
    write_text(Path(cfg.paths.reports_dir) / f"{cfg.report_name}.partial.json",
               json.dumps({"copy_GBps": copy_gbs, "rows": rows}))


def _plain(cfg) -> dict:
    """The benchmark settings as plain JSON values (without the paths group)."""
    from omegaconf import OmegaConf

    keys = ("shapes", "layer_shapes", "ms", "tenants", "dtype", "alpha_granularity", "timing", "rep_ms",
            "bitdelta_style", "batched_impls", "sign_layout", "copy_bytes", "seed", "machine", "rounds", "grouped",
            "cold_l2")
    out = {k: OmegaConf.to_container(cfg[k], resolve=True) if OmegaConf.is_config(cfg[k]) else cfg[k]
           for k in keys if k in cfg}
    out.setdefault("sign_layout", "rows")  # configurations from before the setting
    return out


def _summary(rows: list[dict], cfg) -> dict:
    """Layer-set ratios (Σ time ÷ Σ dense over each model's linears), the issue-5 targets, and the
    grouped batches' against the issue-26 bound (at M = 64 and 256 for T = 4 and 14, every shape)."""
    out: dict = {"single": {}, "tenants": {}, "grouped": {}, "targets": {}, "lines": []}
    for model in cfg.shapes:
        for m in cfg.ms:
            rs = [r for r in rows if r["kind"] == "single" and r["model"] == model and r["M"] == m]
            d = sum(r["dense_ms"] for r in rs)
            out["single"][f"{model}/M={m}"] = {key: sum(r[f"{key}_ms"] for r in rs) / d for key in ("triton", "naive")}
        for t in cfg.tenants:
            rs = [r for r in rows if r["kind"] == "tenants" and r["model"] == model and r["T"] == t]
            d = sum(r["dense_ms"] for r in rs)
            keys = ["triton_batched"] + [f"batched_{i}" for i in cfg.get("batched_impls", [])] \
                + (["bitdelta_style"] if cfg.bitdelta_style else [])
            out["tenants"][f"{model}/T={t}"] = {key: sum(r[f"{key}_ms"] for r in rs) / d for key in keys}
    grouped = cfg.get("grouped") or {}
    for model in cfg.shapes:
        for m in grouped.get("ms", []):
            for t in grouped.get("tenants", []):
                rs = [r for r in rows if r["kind"] == "grouped" and r["model"] == model and r["M"] == m and r["T"] == t]
                d = sum(r["dense_ms"] for r in rs)
                v = {key: sum(r[f"{key}_ms"] for r in rs) / d for key in ("triton_batched", "grouped")}
                v.update(floor=rs[0]["floor"], bound=target_tenants(t))
                out["grouped"][f"{model}/M={m}/T={t}"] = v
                if m in (64, 256) and t in (4, 14):
                    best = min(v["triton_batched"], v["grouped"])
                    out["targets"][f"{model} M={m} T={t}"] = {"ratio": best, "bound": v["bound"],
                                                             "met": best <= v["bound"]}
    for model in cfg.shapes:  # issue 26: one variant in decode batches and short prefill chunks
        for m in cfg.ms:
            if 2 <= m <= 64 or m == 256:
                bound = TARGET_BATCH if m <= 64 else TARGET_SINGLE
                v = out["single"][f"{model}/M={m}"]["triton"]
                out["targets"][f"{model} M={m}"] = {"ratio": v, "bound": bound, "met": v <= bound}
    if "llama2-70b" in cfg.shapes:
        for m in (1, 2048):
            if m in cfg.ms:
                v = out["single"][f"llama2-70b/M={m}"]["triton"]
                out["targets"][f"M={m}"] = {"ratio": v, "bound": TARGET_SINGLE, "met": v <= TARGET_SINGLE}
        for t in cfg.tenants:
            v = out["tenants"][f"llama2-70b/T={t}"]["triton_batched"]
            out["targets"][f"T={t}"] = {"ratio": v, "bound": target_tenants(t), "met": v <= target_tenants(t)}
    for key, v in out["single"].items():
        out["lines"].append(f"{key:22s} triton {v['triton']:6.3f}x  naive {v['naive']:6.2f}x dense (layer set)")
    for key, v in out["tenants"].items():
        out["lines"].append(f"{key:22s} " + "  ".join(f"{k2} {v2:6.3f}x" for k2, v2 in v.items()) + " dense (layer set)")
    for key, v in out["grouped"].items():
        out["lines"].append(f"{key:26s} batched {v['triton_batched']:6.3f}x  grouped {v['grouped']:6.3f}x  "
                            f"floor {v['floor']:.3f}x  bound {v['bound']:.3f}x dense (layer set)")
    for key, v in out["targets"].items():
        label = key if " " in key else f"70B {key:7s}"  # grouped targets name their shape
        out["lines"].append(f"target {label} {v['ratio']:6.3f}x ≤ {v['bound']:.3f}x: {'met' if v['met'] else 'NOT met'}")
    return out


def plot(report: dict, path: Path) -> None:
    """One panel per part the run measured: one variant's ratio vs M, mixed tenants' ratio vs T, and
    decode batches of mixed variants vs M (log scales), each with its targets."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg, summary = report["config"], report["summary"]
    grouped = summary.get("grouped") or {}
    parts = [p for p, on in (("single", cfg["ms"]), ("tenants", cfg["tenants"]), ("grouped", grouped)) if on]
    if not parts:
        return
    fig, axes = plt.subplots(1, len(parts), figsize=(6.5 * len(parts), 5), squeeze=False)
    axes = dict(zip(parts, axes[0]))
    styles = list(zip(cfg["shapes"], ("-", "--")))
    if "single" in axes:
        a1, ms, s = axes["single"], cfg["ms"], summary["single"]
        for model, style in styles:
            a1.plot(ms, [s[f"{model}/M={m}"]["triton"] for m in ms], "o" + style, color="C0", label=f"triton ({model})")
            a1.plot(ms, [s[f"{model}/M={m}"]["naive"] for m in ms], "s" + style, color="C3",
                    label=f"naive unpack ({model})")
        a1.axhline(TARGET_SINGLE, color="k", lw=0.8, ls=":", label="target 1.10×")
        a1.axhline(1.0625, color="grey", lw=0.8, ls="-.", label="limit 1.0625× (W + signs)")
        a1.set(xscale="log", yscale="log", xlabel="tokens M (one variant)", title="one variant, layer set")
    if "tenants" in axes:
        a2, ts, s = axes["tenants"], cfg["tenants"], summary["tenants"]
        for model, style in styles:
            a2.plot(ts, [s[f"{model}/T={t}"]["triton_batched"] for t in ts], "o" + style, color="C0",
                    label=f"triton batched ({model})")
            for i, impl in enumerate(cfg.get("batched_impls", [])):
                a2.plot(ts, [s[f"{model}/T={t}"][f"batched_{impl}"] for t in ts], "^v"[i % 2] + style,
                        color=f"C{2 + i}", label=f"triton batched, {impl} kernel ({model})")
            if cfg["bitdelta_style"]:
                a2.plot(ts, [s[f"{model}/T={t}"]["bitdelta_style"] for t in ts], "s" + style, color="C1",
                        label=f"BitDelta-style unpack + bmm ({model})")
        # marked too, so that a run of one T still shows its target and limit
        a2.plot(ts, [target_tenants(t) for t in ts], "k:_", lw=0.8, ms=16, label="target 1.1·(1 + T/16)")
        a2.plot(ts, [1 + t / 16 for t in ts], color="grey", ls="-.", marker="_", lw=0.8, ms=16, label="limit 1 + T/16")
        a2.set(xscale="log", yscale="log", xlabel="tenants T (one token each, M = T)",
               title="mixed variants in one call, layer set")
    if "grouped" in axes:
        a3, g = axes["grouped"], cfg["grouped"]
        for j, (model, style) in enumerate(styles):
            for i, t in enumerate(g["tenants"]):
                v = [grouped[f"{model}/M={m}/T={t}"] for m in g["ms"]]
                a3.plot(g["ms"], [x["triton_batched"] for x in v], "o" + style, color=f"C{i}",
                        label=f"T={t} batched ({model})")
                a3.plot(g["ms"], [x["grouped"] for x in v], "s" + style, color=f"C{i}", alpha=0.6,
                        label=f"T={t} grouped ({model})")
                if j == 0:
                    a3.plot(g["ms"], [x["bound"] for x in v], ":_", color=f"C{i}", lw=0.8, ms=16,
                            label=f"T={t} bound 1.1·(1 + T/16)")
        a3.set(xscale="log", yscale="log", xlabel="rows M (Zipf over the base and T variants)",
               title="decode batches of mixed variants, layer set")
    for a in axes.values():
        a.set_ylabel("time ÷ dense bf16 matmul")
        a.grid(True, which="both", alpha=0.3)
        a.legend(fontsize=7)
    m = report["machine"]
    sep = "\n" if len(parts) == 1 else ", "  # one panel is too narrow for one line
    fig.suptitle(f"BitDelta kernels vs dense bf16 — {m['gpu']}{sep}torch {m['torch']}, triton {m['triton']}, "
                 f"{cfg['timing']} timing, {report['date'][:10]}", fontsize=10)
    fig.tight_layout()
    write_figure(fig, path, dpi=110)
    plt.close(fig)


def main(cfg) -> dict:
    from deltafleet.cli import check_report_name, drop_refused_run_dir, refuse_unknown_settings, user_errors

    refuse_unknown_settings(cfg, "bench_kernels.yaml")  # a misspelt +key: `error: ...`, status 2 (its own shapes taken)
    with user_errors("bench-kernels"):
        check_report_name(cfg.report_name)
    if not torch.cuda.is_available():
        drop_refused_run_dir()
        raise SystemExit("bench-kernels: needs a CUDA GPU (the kernels' CPU tests are `make test`)")
    with user_errors("bench-kernels"):
        report = run(cfg)
    reports = Path(cfg.paths.reports_dir)
    js, png = reports / f"{cfg.report_name}.json", reports / f"{cfg.report_name}.png"
    write_text(js, json.dumps(report, indent=1))
    plot(report, png)
    (reports / f"{cfg.report_name}.partial.json").unlink(missing_ok=True)
    print(f"wrote {js} and {png}", flush=True)
    return report


if __name__ == "__main__":
    import hydra

    from deltafleet.cli import run_script

    run_script(hydra.main(config_path="../conf", config_name="bench_kernels", version_base="1.3")(main))
