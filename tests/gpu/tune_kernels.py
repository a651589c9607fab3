"""Issue 5 tuning sweep (GPU): every tile configuration of each Triton kernel on the Llama-2-70B
layer shapes, each time next to dense bf16 ``x @ W.T`` measured in the same run (eager launches;
the autotuned call's time includes Python dispatch, see ``make bench-kernels`` for CUDA-graph
timings). Both mixed-tenant kernels (FMA and table lookup) are swept.

    python tests/gpu/tune_kernels.py OUT.json
    TUNE_DRY=1 TRITON_INTERPRET=1 python tests/gpu/tune_kernels.py /tmp/dry.json   # CPU check of this script
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from deltafleet.kernels import pack_signs, unpack_signs  # noqa: E402
from deltafleet.kernels import gluon_bitdelta as gb  # noqa: E402
from deltafleet.kernels import triton_bitdelta as tb  # noqa: E402

SHAPES = {"qkv": (10240, 8192), "o": (8192, 8192), "gate_up": (57344, 8192), "down": (8192, 28672)}
bench = lambda f: triton.testing.do_bench_cudagraph(f, rep=40)  # noqa: E731  (what serving replays)
if os.environ.get("TUNE_DRY"):  # CPU dry run of this script's logic under TRITON_INTERPRET=1
    SHAPES = {"a": (24, 1024), "b": (16, 2048)}
    bench = lambda f: (f(), 1.0)[1]  # noqa: E731
    torch.cuda.get_device_name = lambda: "cpu"
    torch.cuda.synchronize = lambda: None
    _randn, _randint = torch.randn, torch.randint
    torch.randn = lambda *a, **k: _randn(*a, **{**k, "device": "cpu"})
    torch.randint = lambda *a, **k: _randint(*a, **{**k, "device": "cpu"})
    torch.full = (lambda f: lambda *a, **k: f(*a, **{**k, "device": "cpu"}))(torch.full)
    torch.empty = (lambda f: lambda *a, **k: f(*a, **{**k, "device": "cpu"}))(torch.empty)
    torch.arange = (lambda f: lambda *a, **k: f(*a, **{**k, "device": "cpu"}))(torch.arange)
out = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "torch": torch.__version__, "rows": []}
t0 = time.time()


def launch_cfg(kern, grid, args, kw, cfg):
    kern[grid](*args, **kw, **cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def sweep(label, configs, make, check=None):
    """make(cfg) -> zero-arg launcher or None. Returns [(ms, cfg_str)] sorted."""
    res = []
    for cfg in configs:
        try:
            f = make(cfg)
            f()
            torch.cuda.synchronize()
            err = f" err {check():.1e}" if check else ""
            res.append((bench(f), str(cfg.kwargs) + f" w{cfg.num_warps} s{cfg.num_stages}" + err))
        except Exception as e:  # noqa: BLE001 (out of resources etc.)
            res.append((float("inf"), f"{cfg.kwargs} w{cfg.num_warps}: {type(e).__name__} {str(e)[:80]}"))
    return sorted(res)


data = {}
for name, (n, k) in SHAPES.items():
    w = (0.02 * torch.randn(n, k, device="cuda")).to(torch.bfloat16)
    sign = pack_signs(torch.randn(n, k, device="cuda"))
    alpha = torch.full((n,), 0.01, device="cuda")
    data[name] = (w, sign, alpha)

tot = {}
MS = (1, 4, 40) if os.environ.get('TUNE_DRY') else (1, 4, 2048)
if os.environ.get("TUNE_MS") is not None:  # e.g. TUNE_MS=256,2048 TUNE_TENANTS= (prefill only)
    MS = tuple(int(v) for v in os.environ["TUNE_MS"].split(",") if v)
for m in MS:
    for name, (n, k) in SHAPES.items():
        w, sign, alpha = data[name]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        t_dense = bench(lambda: x @ w.t())
        kb = (k + 7) // 8
        ref = x.float() @ (w.float() + alpha[:, None] * unpack_signs(sign, k)).t()
        chk = lambda: ((y.float() - ref).abs().max() / ref.abs().max()).item()  # noqa: E731
        if m <= tb.GEMV_MAX_M:
            ws, cnt = tb._workspace(x.device, m * n, n)
            args = (x, w, sign, alpha, alpha, alpha, y, ws, cnt, m, n, k, kb, 1, x.stride(0), w.stride(0), 0,
                    sign.stride(0), 0, y.stride(0))
            kw = dict(ONE_DELTA=True, ALPHA_PER_ROW=True, HAS_BIAS=False, EVEN=True, BLOCK_M=triton.next_power_of_2(m))
            res = sweep("gemv", tb._decode_configs(False), lambda c: (lambda: launch_cfg(
                tb._decode_kernel, tb._decode_grid(n, kb, m, kw["BLOCK_M"])(c.kwargs), args, kw, c)), chk)
        else:
            args = (x, w, sign, alpha, alpha, y, m, n, k, x.stride(0), w.stride(0), sign.stride(0), y.stride(0))
            kw = dict(ALPHA_PER_ROW=True, HAS_BIAS=False, EVEN_K=True, DOT_FP32=False)
            res = sweep("mm", tb._mm_configs(), lambda c: (lambda: launch_cfg(
                tb._mm_kernel, (triton.cdiv(m, c.kwargs["BLOCK_M"]) * triton.cdiv(n, c.kwargs["BLOCK_N"]),),
                args, kw, c)), chk)
            if gb.supported(x, w):  # the Gluon (Hopper) prefill kernel, each configuration
                for cfg in gb.CONFIGS:
                    try:
                        f = lambda cfg=cfg: gb.bitdelta_linear_gluon(x, w, sign, alpha, None, y, cfg)  # noqa: E731
                        f()
                        torch.cuda.synchronize()
                        res.append((bench(f), f"gluon {cfg} err {chk():.1e}"))
                    except Exception as e:  # noqa: BLE001
                        res.append((float("inf"), f"gluon {cfg}: {type(e).__name__} {str(e)[:200]}"))
                res.sort()
        t_auto = bench(lambda: tb.bitdelta_linear_triton(x, w, sign, alpha))
        err = (tb.bitdelta_linear_triton(x, w, sign, alpha).float() - ref).abs().max().item() / ref.abs().max().item()
        best = res[0]
        tot.setdefault(m, [0.0, 0.0, 0.0])
        tot[m][0] += t_dense; tot[m][1] += best[0]; tot[m][2] += t_auto
        row = {"kind": "single", "M": m, "layer": name, "dense_ms": t_dense, "best_ms": best[0], "auto_ms": t_auto,
               "best_over_dense": best[0] / t_dense, "rel_err": err, "auto_over_dense": t_auto / t_dense,
               "top": [(r[0] / t_dense, r[1]) for r in res[:5]], "all": [(r[0] / t_dense, r[1]) for r in res]}
        out["rows"].append(row)
        print(f"[{time.time()-t0:5.0f}s] M={m:5d} {name:8s} dense {t_dense*1e3:8.1f} us  best {best[0]/t_dense:5.3f}x "
              f"auto {t_auto/t_dense:5.3f}x err {err:.1e} {best[1]}", flush=True)
        for r in res[1:4]:
            print(f"{'':40s}{r[0]/t_dense:5.3f}x  {r[1]}", flush=True)
    d, b, a = tot[m]
    print(f"=== M={m} 70B set: best {b/d:.3f}x  autotuned {a/d:.3f}x dense", flush=True)
    out["rows"].append({"kind": "single", "M": m, "layer": "all", "best_over_dense": b / d, "auto_over_dense": a / d})

# mixed tenants, one token each
TENANTS = (1, 4, 16) if os.environ.get("TUNE_TENANTS") is None else \
    tuple(int(v) for v in os.environ["TUNE_TENANTS"].split(",") if v)
for t in TENANTS:
    tot_b = [0.0, 0.0, 0.0]
    for name, (n, k) in SHAPES.items():
        w, _, _ = data[name]
        signs = torch.randint(0, 256, (t, n, (k + 7) // 8), device="cuda", dtype=torch.uint8)
        alphas = torch.full((t, n), 0.01, device="cuda")
        slot = torch.arange(t, device="cuda", dtype=torch.int32)
        x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(t, n, device="cuda", dtype=torch.bfloat16)
        t_dense = bench(lambda: x @ w.t())
        ws, cnt = tb._workspace(x.device, t * n, t * n)
        args = (x, w, signs, alphas, slot, alphas, y, ws, cnt, t, n, k, (k + 7) // 8, t, x.stride(0), w.stride(0),
                signs.stride(0), signs.stride(1), alphas.stride(0), y.stride(0))
        kw = dict(ONE_DELTA=False, ALPHA_PER_ROW=True, HAS_BIAS=False, EVEN=True)
        res = sweep("batched", tb._decode_configs(True), lambda c: (lambda: launch_cfg(
            tb._decode_kernel, tb._decode_grid(n, (k + 7) // 8, t)(c.kwargs), args, kw, c)))
        kw_lut = dict(ALPHA_PER_ROW=True, HAS_BIAS=False, EVEN=True, DOT_FP32=False, BLOCK_M=min(16, triton.next_power_of_2(t)))
        res_lut = sweep("lut", tb._lut_configs(), lambda c: (lambda: launch_cfg(
            tb._tenants_kernel, (triton.cdiv(n, c.kwargs["BLOCK_N"]),
                                 triton.cdiv((k + 7) // 8, c.kwargs["BLOCK_K"] // 8 * c.kwargs["CHUNK_ITERS"]),
                                 triton.cdiv(t, kw_lut["BLOCK_M"])), args, kw_lut, c)))
        print(f"{'':40s}table-lookup kernel: best {res_lut[0][0]/t_dense:5.3f}x  {res_lut[0][1]}", flush=True)
        from deltafleet.kernels.reference import bitdelta_linear_batched as ref_b
        yb = tb.bitdelta_linear_batched_triton(x, w, signs, alphas, slot).float()
        rb = ref_b(x.float(), w.float(), signs, alphas, slot)
        errb = ((yb - rb).abs().max() / rb.abs().max()).item()
        t_auto = bench(lambda: tb.bitdelta_linear_batched_triton(x, w, signs, alphas, slot))
        tot_b[0] += t_dense; tot_b[1] += res[0][0]; tot_b[2] += t_auto
        out["rows"].append({"kind": "batched", "T": t, "layer": name, "dense_ms": t_dense,
                            "best_over_dense": res[0][0] / t_dense, "auto_over_dense": t_auto / t_dense,
                            "all": [(r[0] / t_dense, r[1]) for r in res],
                            "lut_all": [(r[0] / t_dense, r[1]) for r in res_lut]})
        print(f"[{time.time()-t0:5.0f}s] T={t:2d} {name:8s} dense {t_dense*1e3:8.1f} us  best {res[0][0]/t_dense:5.3f}x "
              f"auto {t_auto/t_dense:5.3f}x err {errb:.1e} {res[0][1]}  | target {1.1*(1+t/16):.3f}", flush=True)
        for r in res[1:3]:
            print(f"{'':40s}{r[0]/t_dense:5.3f}x  {r[1]}", flush=True)
    print(f"=== T={t} 70B set: best {tot_b[1]/tot_b[0]:.3f}x  autotuned {tot_b[2]/tot_b[0]:.3f}x  "
          f"(target {1.1*(1+t/16):.3f}x)", flush=True)
    out["rows"].append({"kind": "batched", "T": t, "layer": "all", "best_over_dense": tot_b[1] / tot_b[0],
                        "auto_over_dense": tot_b[2] / tot_b[0]})
    Path(sys.argv[1]).write_text(json.dumps(out, indent=1))
Path(sys.argv[1]).write_text(json.dumps(out, indent=1))
