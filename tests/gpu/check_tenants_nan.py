"""GPU check: mixed-tenant kernels on the 70B down / gate_up shapes at T = 16, with the autotuner's
choice, NaN count and whether the split-K workspace is left zero after each call."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from deltafleet.kernels import bitdelta_linear_batched_reference as ref_fn  # noqa: E402
from deltafleet.kernels import triton_bitdelta as tb  # noqa: E402


def case(n, k, t, impl, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = (0.02 * torch.randn(n, k, device="cuda", generator=g)).bfloat16()
    s = torch.randint(0, 256, (t, n, (k + 7) // 8), device="cuda", dtype=torch.uint8, generator=g)
    a = 0.004 + 0.002 * torch.rand(t, n, device="cuda", generator=g)
    sl = torch.arange(t, device="cuda", dtype=torch.int32)
    x = torch.randn(t, k, device="cuda", generator=g).bfloat16()
    for rep in range(2):
        y = tb.bitdelta_linear_batched_triton(x, w, s, a, sl, impl=impl)
        torch.cuda.synchronize()
        ref = ref_fn(x.float(), w.float(), s, a, sl)
        err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
        ws, cnt = tb._WORKSPACE[x.device]
        print(n, k, t, impl, rep, "err", err, "nan", y.isnan().sum().item(), "nan rows",
              y.isnan().any(1).nonzero().flatten().tolist(), "ws nonzero", (ws != 0).sum().item(),
              "cnt nonzero", (cnt != 0).sum().item(), flush=True)
    tuner = tb._lut_tuned if impl == "lut" else tb._batched_tuned
    print("   chosen", {str(k_): str(v) for k_, v in tuner.cache.items()}, flush=True)


for n, k in [(8192, 28672), (57344, 8192)]:
    for impl in ["fma", "lut"]:
        case(n, k, 16, impl)
case(8192, 28672, 16, "fma", seed=1)
case(8192, 28672, 8, "fma", seed=1)
