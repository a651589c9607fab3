"""GPU: every Gluon prefill configuration (and of the register-operand kernel, ``rs…``) ÷ dense bf16 on the Llama-2-70B layer set (CUDA-graph timing, same
tensors, same run), plus the dispatcher's choice. Usage: python tests/gpu/prefill_gluon.py OUT.json;
``PROBE_MS=2048`` limits the token counts, ``PROBE_SETS=rs`` the kernels (default ``ss,rs``)."""
import json
import os
import sys
import time
from pathlib import Path

import torch
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from deltafleet.kernels import bitdelta_linear, pack_signs, unpack_signs  # noqa: E402
from deltafleet.kernels import gluon_bitdelta as gb  # noqa: E402
from deltafleet.kernels import gluon_prefill_rs as pr  # noqa: E402

SHAPES = {"qkv": (10240, 8192), "o": (8192, 8192), "gate_up": (57344, 8192), "down": (8192, 28672)}
bench = lambda f: triton.testing.do_bench_cudagraph(f, rep=40)  # noqa: E731
out = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "torch": torch.__version__,
       "date": time.strftime("%Y-%m-%d"), "rows": []}
SETS = os.environ.get("PROBE_SETS", "ss,rs").split(",")
for m in [int(v) for v in os.environ.get("PROBE_MS", "2048,256").split(",")]:
    tot = {}
    for name, (n, k) in SHAPES.items():
        w = (0.02 * torch.randn(n, k, device="cuda")).to(torch.bfloat16)
        sign = pack_signs(torch.randn(n, k, device="cuda"))
        alpha = 0.004 + 0.002 * torch.rand(n, device="cuda")
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        ref = x.float() @ (w.float() + alpha[:, None] * unpack_signs(sign, k)).t()
        t_dense = bench(lambda: x @ w.t())
        row = {"M": m, "layer": name, "dense_ms": t_dense, "configs": {}}
        tot.setdefault("dense", 0.0)
        tot["dense"] += t_dense
        runs = {}  # label → call: each Gluon SS configuration, each register-operand one ("rs…")
        for cfg in gb.CONFIGS if "ss" in SETS else ():
            runs[str(cfg)] = lambda cfg=cfg: gb.bitdelta_linear_gluon(x, w, sign, alpha, None, y, cfg)
        for cfg in pr.CONFIGS if "rs" in SETS else ():
            runs["rs" + str(cfg)] = lambda cfg=cfg: pr.bitdelta_linear_prefill_rs(x, w, sign, alpha, None, y, cfg)
        for label, f in runs.items():
            try:
                f()
                err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                t = bench(f)
                row["configs"][label] = {"over_dense": t / t_dense, "rel_err": err}
                tot[label] = tot.get(label, 0.0) + t
            except Exception as e:  # noqa: BLE001
                row["configs"][label] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        t_disp = bench(lambda: bitdelta_linear(x, w, sign, alpha))
        row["dispatcher_over_dense"] = t_disp / t_dense
        tot["dispatcher"] = tot.get("dispatcher", 0.0) + t_disp
        out["rows"].append(row)
        print(m, name, f"dense {t_dense*1e3:.1f} us", {c: round(v.get("over_dense", float("nan")), 3)
                                                       for c, v in row["configs"].items()},
              f"dispatcher {t_disp / t_dense:.3f}", "max rel err", max(v.get("rel_err", 0.0) for v in row["configs"].values()),
              flush=True)
    summary = {c: v / tot["dense"] for c, v in tot.items() if c != "dense"}
    out["rows"].append({"M": m, "layer": "all", "over_dense": summary})
    print("=== M", m, "layer set", {c: round(v, 3) for c, v in summary.items()}, flush=True)
    Path(sys.argv[1]).write_text(json.dumps(out, indent=1))
