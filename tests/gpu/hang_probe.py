"""Find which int8 tenant-kernel configuration and K split does not finish at a given layer shape
and row count (GPU): each run is announced before it starts and synchronised after, so the last
line printed names the one that hung.

    python3 tests/gpu/hang_probe.py N K T
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kernels import gluon_planes as gp  # noqa: E402
from kernels import triton_bitdelta as tb  # noqa: E402

n, k, t = (int(v) for v in sys.argv[1:4])
torch.manual_seed(0)
w = (0.02 * torch.randn(n, k, device="cuda")).bfloat16()
x = torch.randn(t, k, device="cuda").bfloat16()
signs = torch.randint(0, 256, (16, n, k // 8), device="cuda", dtype=torch.uint8)
alphas = 0.01 * torch.rand(16, device="cuda")
slot = torch.arange(t, device="cuda", dtype=torch.int32) % 16
y = torch.empty(t, n, device="cuda", dtype=torch.bfloat16)
ws, cnt = tb._workspace(x.device, t * n, t * triton.cdiv(n, 2))
rows = max(2, min(16, triton.next_power_of_2(t)))
for cfg in gp.WS_CONFIGS[rows]:
    if not gp.config_fits(k, cfg):
        continue
    for split in range(1, 9):
        print("start", cfg, split, flush=True)
        gp.bitdelta_linear_batched_planes(x, w, signs, alphas, slot, None, y, ws, cnt, cfg, split)
        torch.cuda.synchronize()
        print("done", cfg, split, flush=True)
print("all done", flush=True)
