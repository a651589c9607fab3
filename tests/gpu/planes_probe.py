"""Time the int8 tensor-core mixed-tenant kernel (``kernels.gluon_planes``) against dense bf16 and
the other tenant kernels on the Llama-2-70B layer set, per ring depth and K split (GPU).

    python3 tests/gpu/planes_probe.py OUT.json [T ...]
    PROBE_TILED=1 python3 tests/gpu/planes_probe.py OUT.json [T ...]   # also with tile_signs' layout
    PROBE_TILED=1 PROBE_BASE_SPREAD=1 …   # and tiled with the base product spread over the consumers
    PROBE_ONLY_TILED=1 PROBE_TILED=1 PROBE_BITS=1 …   # tiled only, also on the binary tensor cores
    … PROBE_BITS=1 PROBE_PERSIST=1 …   # and the binary path launched persistent
    … PROBE_BITS=1 PROBE_BITS_BK256=1 …   # and the binary path at 256-weight K steps
    … PROBE_COPIES=1 …   # and the binary kernel's copies and barriers alone (no products; a bound)

Prints and writes, per (layer, T): dense time, each configuration's time ÷ dense, and the summed
ratio over the layer set (the figure ``kernels/bench.py`` reports).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import triton
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from deltafleet.kernels import gluon_bitdelta as gb  # noqa: E402
from deltafleet.kernels import gluon_planes as gp  # noqa: E402
from deltafleet.kernels import triton_bitdelta as tb  # noqa: E402

LAYERS = {"qkv": (10240, 8192), "o": (8192, 8192), "gate_up": (57344, 8192), "down": (8192, 28672)}


def main(out: str, ts: list[int]) -> None:
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows, sums = [], {}
    for name, (n, k) in LAYERS.items():
        w = (0.02 * torch.randn(n, k, device="cuda")).bfloat16()
        for t in ts:
            x = torch.randn(t, k, device="cuda").bfloat16()
            signs = torch.randint(0, 256, (16, n, k // 8), device="cuda", dtype=torch.uint8)
            alphas = 0.01 * torch.rand(16, device="cuda")
            slot = torch.arange(t, device="cuda", dtype=torch.int32) % 16
            y = torch.empty(t, n, device="cuda", dtype=torch.bfloat16)
            ws, cnt = tb._workspace(x.device, t * n, t * triton.cdiv(n, 2))
            ref = tb.bitdelta_linear_batched_triton(x, w, signs, alphas, slot, impl="lut").float()
            dense = do_bench_cudagraph(lambda: x @ w.t(), rep=50)
            r = {"layer": name, "N": n, "K": k, "T": t, "dense_ms": dense}
            rows_ = max(2, min(16, triton.next_power_of_2(t)))
            configs = {}
            only_tiled = os.environ.get("PROBE_ONLY_TILED") == "1"  # no row-layout configurations
            if not only_tiled:
                for cfg in gp.WS_CONFIGS[rows_]:
                    configs["planes_bk{}_rh{}_s{}_r{}_l{}".format(*cfg)] = dict(config=cfg)
                configs["planes_pdl_bk{}_rh{}_s{}_r{}_l{}".format(*gp.WS_CONFIGS[rows_][0])] = dict(
                    config=gp.WS_CONFIGS[rows_][0], pdl=True)  # the default with programmatic dependent launch
            if os.environ.get("PROBE_TILED") == "1":  # sign tiles stored whole (gluon_planes.tile_signs)
                for cfg in [c for c in gp.WS_CONFIGS[rows_] if not only_tiled or c[0] == 128]:
                    configs["planes_tiled_bk{}_rh{}_s{}_r{}_l{}".format(*cfg)] = dict(config=cfg, tiled=True)
            if os.environ.get("PROBE_BASE_SPREAD") == "1":  # the base product spread over the consumers
                for cfg in [c for c in gp.WS_CONFIGS[rows_] if not only_tiled or c[0] == 128]:
                    if rows_ // min(rows_, cfg[1]) > 1:
                        configs["planes_tiled_bs_bk{}_rh{}_s{}_r{}_l{}".format(*cfg)] = dict(
                            config=cfg, tiled=True, base_spread=True)
            if os.environ.get("PROBE_BITS") == "1":  # the sign part on the binary tensor cores, tiled signs
                # with no int8 planes in the ring, deeper rings and eight rows per consumer fit too
                extra = {16: [(128, 8, 4, 128, 2), (128, 8, 6, 128, 2), (128, 4, 6, 96, 2)],
                         8: [(128, 8, 6, 128, 2), (128, 4, 6, 80, 2)]}.get(rows_, [])
                if os.environ.get("PROBE_BITS_BK256") == "1":  # 256-weight K steps (tile_signs(…, 256))
                    extra += {16: [(256, 4, 3, 96, 2), (256, 8, 2, 128, 1), (256, 4, 2, 96, 4)],
                              8: [(256, 4, 3, 80, 2), (256, 8, 3, 128, 1)]}.get(rows_, [])
                for cfg in [c for c in gp.WS_CONFIGS[rows_] if not only_tiled or c[0] == 128] + extra:
                    configs["planes_tiled_bits_bk{}_rh{}_s{}_r{}_l{}".format(*cfg)] = dict(
                        config=cfg, tiled=True, bits=True)
                    if rows_ // min(rows_, cfg[1]) > 1:
                        configs["planes_tiled_bits_bs_bk{}_rh{}_s{}_r{}_l{}".format(*cfg)] = dict(
                            config=cfg, tiled=True, bits=True, base_spread=True)
                    if os.environ.get("PROBE_PERSIST") == "1":  # one program per resident slot
                        configs["planes_tiled_bits_ps_bk{}_rh{}_s{}_r{}_l{}".format(*cfg)] = dict(
                            config=cfg, tiled=True, bits=True, persistent=True)
                        configs["planes_tiled_bits_ps_pdl_bk{}_rh{}_s{}_r{}_l{}".format(*cfg)] = dict(
                            config=cfg, tiled=True, bits=True, persistent=True, pdl=True)
                        configs["planes_tiled_bits_sk_bk{}_rh{}_s{}_r{}_l{}".format(*cfg)] = dict(
                            config=cfg, tiled=True, bits=True, stream_k=True)
            if os.environ.get("PROBE_COPIES") == "1":  # the binary kernel's copies and barriers alone
                for cfg in [c for c in gp.WS_CONFIGS[rows_] if c[0] == 128][:1]:
                    configs["copies_tiled_bits_bk{}_rh{}_s{}_r{}_l{}".format(*cfg)] = dict(
                        config=cfg, tiled=True, bits=True, _copies_only=True)
                    configs["copies_tiled_bits_ps_bk{}_rh{}_s{}_r{}_l{}".format(*cfg)] = dict(
                        config=cfg, tiled=True, bits=True, persistent=True, _copies_only=True)
            tiled_signs = {}
            for cname, config in configs.items():
                d = gp.ws_split(t, n, k, config["config"], sms)
                splits = sorted({d} | {s for s in (1, 2, 4, 8) if k // config["config"][0] // s >= 4})
                sg = signs
                if config.get("tiled"):
                    bk = config["config"][0]
                    sg = tiled_signs.setdefault(bk, gp.tile_signs(signs, bk))
                    # the row-layout configuration's best split only
                    untiled = {k2: v for k2, v in r.items()
                               if k2.startswith(cname.replace("_tiled", "").replace("_bits", "").replace("_bs", "")
                                               .replace("_ps", "").replace("_pdl", "").replace("_sk", "")
                                               .replace("copies_", "planes_")
                                               + "_k")
                               and not k2.endswith("err") and isinstance(v, float)}
                    if untiled:
                        splits = [int(min(untiled, key=untiled.get).rsplit("_k", 1)[1])]
                if config.get("stream_k"):  # the split does not apply
                    splits = [1]
                for split in splits:
                    fn = lambda: gp.bitdelta_linear_batched_planes(x, w, sg, alphas, slot, None, y, ws, cnt,  # noqa: E731
                                                                   split=split, **config)
                    name_ = f"{cname}_k{split}"
                    try:
                        fn()
                        torch.cuda.synchronize()
                        err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                        r[name_] = do_bench_cudagraph(fn, rep=50) / dense
                        r[name_ + "_err"] = err
                    except Exception as e:  # noqa: BLE001
                        r[name_] = repr(e)[:200]
            r["lut"] = float("nan") if only_tiled else do_bench_cudagraph(lambda: tb.bitdelta_linear_batched_triton(x, w, signs, alphas, slot,
                                                                                   impl="lut"), rep=50) / dense
            print(json.dumps(r), flush=True)
            rows.append(r)
            for key, v in r.items():
                if isinstance(v, float) and (key.startswith("planes") and not key.endswith("err") or key == "lut"):
                    sums.setdefault((t, key), [0.0, 0.0])
                    sums[(t, key)][0] += v * dense
                    sums[(t, key)][1] += dense
    summary = {f"T={t}/{key}": round(a / b, 3) for (t, key), (a, b) in sums.items()}
    for t in ts:
        best = min(((v, k) for k, v in summary.items() if k.startswith(f"T={t}/planes_")), default=None)
        best_ws = min(((v, k) for k, v in summary.items() if k.startswith(f"T={t}/planes_pdl")), default=None)
        # the best configuration per layer (what the dispatcher's timing picks)
        per = sum(min(v for k2, v in r.items() if k2.startswith("planes") and not k2.endswith("err")
                      and isinstance(v, float)) * r["dense_ms"] for r in rows if r["T"] == t)
        per /= sum(r["dense_ms"] for r in rows if r["T"] == t)
        print(f"T={t}: best planes {best} with PDL {best_ws} best-per-layer {per:.3f} lut {summary.get(f'T={t}/lut')} "
              f"target {1.1 * (1 + t / 16):.3f}")
        # each configuration at its best K split per layer (what the dispatcher's timing of splits gives it)
        by_cfg = {}
        for r in (r for r in rows if r["T"] == t):
            best_split = {}
            for k2, v in r.items():
                if k2.startswith("planes") and not k2.endswith("err") and isinstance(v, float):
                    c = k2.rsplit("_k", 1)[0]
                    best_split[c] = min(best_split.get(c, v), v)
            for c, v in best_split.items():
                by_cfg.setdefault(c, [0.0, 0.0])
                by_cfg[c][0] += v * r["dense_ms"]
                by_cfg[c][1] += r["dense_ms"]
        print(f"T={t} per configuration, best split per layer: "
              + ", ".join(f"{c} {a / b:.3f}" for c, (a, b) in sorted(by_cfg.items(), key=lambda kv: kv[1][0] / kv[1][1])))
    copies = {}
    for r in rows:
        for k2, v in r.items():
            if k2.startswith("copies") and not k2.endswith("err") and isinstance(v, float):
                c = (r["T"], k2.rsplit("_k", 1)[0])
                best = copies.setdefault(c, {}).get(r["layer"])
                copies[c][r["layer"]] = min(v, best) if best is not None else v
    for (t, c), per_layer in sorted(copies.items()):
        dense = {r["layer"]: r["dense_ms"] for r in rows if r["T"] == t}
        tot = sum(per_layer[lay] * dense[lay] for lay in per_layer) / sum(dense[lay] for lay in per_layer)
        print(f"T={t} copies only (no products, y wrong) {c}: {tot:.3f} "
              + " ".join(f"{lay} {v:.3f}" for lay, v in per_layer.items()))
    Path(out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows, "summary": summary},
                                    indent=1))


if __name__ == "__main__":
    main(sys.argv[1], [int(v) for v in sys.argv[2:]] or [2, 4, 8, 16])
