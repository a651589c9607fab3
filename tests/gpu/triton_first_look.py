"""First look at the Triton bitdelta_linear on a GPU (issue 5, not the final benchmark).

    DELTAFLEET_TRITON_DEVICE=cuda python -m pytest tests/test_kernels_triton.py -q
    python tests/gpu/triton_first_look.py

Times, on Llama-2-70B layer shapes, dense bf16 ``x @ W.T``, the naive path (unpack the signs to
bf16, add, matmul) and the fused kernel, each as a ratio to dense measured in the same run.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kernels import pack_signs, unpack_signs  # noqa: E402
from kernels.triton_bitdelta import bitdelta_linear_triton  # noqa: E402

SHAPES = {"qkv": (10240, 8192), "o": (8192, 8192), "gate_up": (57344, 8192), "down": (8192, 28672)}
rows = []
for m in (1, 4, 16, 2048):
    tot = {"dense": 0.0, "naive": 0.0, "triton": 0.0}
    for name, (n, k) in SHAPES.items():
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = (0.02 * torch.randn(n, k, device="cuda")).to(torch.bfloat16)
        sign = pack_signs(torch.randn(n, k, device="cuda"))
        alpha = torch.tensor(0.01, device="cuda")
        t_dense = triton.testing.do_bench(lambda: x @ w.t(), warmup=25, rep=100)
        t_naive = triton.testing.do_bench(
            lambda: x @ (w + alpha.to(torch.bfloat16) * unpack_signs(sign, k, torch.bfloat16)).t(), warmup=25, rep=100)
        t_tri = triton.testing.do_bench(lambda: bitdelta_linear_triton(x, w, sign, alpha), warmup=25, rep=100)
        for key, t in (("dense", t_dense), ("naive", t_naive), ("triton", t_tri)):
            tot[key] += t
        rows.append({"M": m, "layer": name, "dense_ms": t_dense, "naive_ms": t_naive, "triton_ms": t_tri,
                     "triton_over_dense": t_tri / t_dense, "naive_over_dense": t_naive / t_dense})
        print(f"M={m:5d} {name:8s} dense {t_dense:.4f} ms  naive {t_naive / t_dense:5.2f}x  triton {t_tri / t_dense:5.2f}x",
              flush=True)
    print(f"M={m:5d} 70B layer set: naive {tot['naive'] / tot['dense']:.2f}x  triton {tot['triton'] / tot['dense']:.2f}x dense",
          flush=True)
    rows.append({"M": m, "layer": "all", **{f"{k}_ms": v for k, v in tot.items()},
                 "triton_over_dense": tot["triton"] / tot["dense"], "naive_over_dense": tot["naive"] / tot["dense"]})
out = Path(sys.argv[1]) if len(sys.argv) > 1 else None
if out:
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
