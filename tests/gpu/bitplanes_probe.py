"""Time ``activation_bitplanes`` (the binary path's input kernel) per chunk size and warp count on a GPU.

At 16 rows and K = 8192 the default (1024-weight chunks, 4 warps) took 5.2 µs under ncu on an H200
(tests/gpu/session30.sh, 198 registers a thread, 6 % achieved occupancy), about 7 % of the 16-variant
call on ``o``; with programmatic dependent launch the tenant kernel's consumers wait for it. Each
variant is checked equal to the default, then timed by CUDA-graph replay.

    python3 tests/gpu/bitplanes_probe.py OUT.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from deltafleet.kernels.gluon_planes import activation_bitplanes  # noqa: E402


def main(out: str) -> None:
    torch.manual_seed(0)
    rows = []
    for m in (4, 8, 16):
        for k in (8192, 28672):
            x = torch.randn(m, k, device="cuda").bfloat16()
            ref = activation_bitplanes(x)
            for chunk in (256, 512, 1024, 2048, 4096):
                for warps in (4, 8):
                    bits, sc = activation_bitplanes(x, chunk=chunk, num_warps=warps)
                    same = torch.equal(bits, ref[0]) and torch.equal(sc, ref[1])
                    us = 1e3 * do_bench_cudagraph(lambda: activation_bitplanes(x, chunk=chunk, num_warps=warps),
                                                  rep=30)
                    rows.append({"M": m, "K": k, "chunk": chunk, "warps": warps, "us": us, "same": same})
                    print(json.dumps(rows[-1]), flush=True)
                    # after every row, so that a run cut short keeps what it measured
                    Path(out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
