"""Issue 5 profiling (GPU): one BitDelta kernel call per named case on the Llama-2-70B ``o`` shape
(8192 × 8192), after a warm-up that compiles and autotunes, between cudaProfilerStart/Stop, so that
``ncu --profile-from-start off`` records exactly that call.

    ncu --profile-from-start off --clock-control none --set full python3 tests/gpu/profile_kernels.py lut-T2

Cases: ``dense-M<m>``, ``decode-M1``, ``fma-T<t>``, ``lut-T<t>``, ``prefill-M<m>`` (the dispatcher's pick),
``prefillss-M<m>`` (``gluon_bitdelta``'s default), ``prefillrs-M<m>`` (``gluon_prefill_rs``, ``RS_CFG``),
``planesws-T<t>`` (``gluon_planes``, ``PLANES_CFG``; ``PLANES_TILED=1`` for tiled signs).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from deltafleet.kernels import triton_bitdelta as tb  # noqa: E402


def main(case: str, n: int = 8192, k: int = 8192) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    kind, _, num = case.rpartition("-")[0], None, int(case.rsplit("-", 1)[1][1:])
    w = (0.02 * torch.randn(n, k, device="cuda", generator=g)).bfloat16()
    s = torch.randint(0, 256, (max(num, 1), n, k // 8), device="cuda", dtype=torch.uint8, generator=g)
    a = 0.004 + 0.002 * torch.rand(max(num, 1), n, device="cuda", generator=g)
    x = torch.randn(num, k, device="cuda", generator=g).bfloat16()
    slot = torch.arange(num, device="cuda", dtype=torch.int32)
    if kind == "dense":
        fn = lambda: x @ w.T  # noqa: E731
    elif kind in ("decode", "prefill"):
        fn = lambda: tb.bitdelta_linear_triton(x, w, s[0], a[0])  # noqa: E731
    elif kind in ("fma", "lut", "gluon"):
        fn = lambda: tb.bitdelta_linear_batched_triton(x, w, s, a, slot, impl=kind)  # noqa: E731
    elif kind == "planesws":  # PLANES_CFG="BLOCK_K,rows per warpgroup,STAGES,registers,loaders[,split]"
        import os                # PLANES_TILED=1: the signs in tile_signs' layout (the serving default)

        from deltafleet.kernels import gluon_planes as gp
        bk, rh, st, regs, ld, *sp = (int(v) for v in os.environ["PLANES_CFG"].split(","))
        tiled = os.environ.get("PLANES_TILED") == "1"
        spread = os.environ.get("PLANES_BS") == "1"  # base_spread
        bits = os.environ.get("PLANES_BITS") == "1"  # the sign part on the binary tensor cores
        persist = os.environ.get("PLANES_PERSIST") == "1"  # one program per resident slot
        st_ = gp.tile_signs(s, bk) if tiled else s
        y = torch.empty(num, n, device="cuda", dtype=torch.bfloat16)
        ws, cnt = tb._workspace(x.device, num * n, num * n)
        fn = lambda: gp.bitdelta_linear_batched_planes(x, w, st_, a, slot, None, y, ws, cnt,  # noqa: E731
                                                       (bk, rh, st, regs, ld), sp[0] if sp else None, tiled=tiled,
                                                       base_spread=spread, bits=bits, persistent=persist)
    elif kind == "prefillrs":  # the register-operand prefill kernel, RS_CFG="BLOCK_T,STAGES,U,PRE (0/1),registers"
        import os

        from deltafleet.kernels import gluon_prefill_rs as pr
        cfg = tuple(int(v) for v in os.environ["RS_CFG"].split(","))
        y = torch.empty(num, n, device="cuda", dtype=torch.bfloat16)
        fn = lambda: pr.bitdelta_linear_prefill_rs(x, w, s[0], a[0], None, y, cfg)  # noqa: E731
    elif kind == "prefillss":  # the Gluon prefill kernel at its default configuration
        from deltafleet.kernels import gluon_bitdelta as gb
        y = torch.empty(num, n, device="cuda", dtype=torch.bfloat16)
        fn = lambda: gb.bitdelta_linear_gluon(x, w, s[0], a[0], None, y)  # noqa: E731
    else:
        raise SystemExit(f"unknown case {case!r}")
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(case, "done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
