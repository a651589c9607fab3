"""Offline look at the Hopper mixed-tenant kernel (no GPU needed): compile
``kernels.gluon_bitdelta._tenants_kernel`` for sm_90 with the installed Triton and report, per
(rows, tile), the registers and shared memory per thread block (cuobjdump) and the SASS
instructions of the K loop per row and weight, by opcode.

    python tests/gpu/sass_tenants.py            # every usable (rows, tile)
    python tests/gpu/sass_tenants.py 16 64,6    # one
    python tests/gpu/sass_tenants.py planes     # the warp-specialised int8 kernel, every WS_CONFIGS entry

Used to compare kernel variants before spending GPU time on them (the device's Triton is 3.6: run
this with that version for numbers that match the GPU). On 2026-11-30, Triton 3.6: 168 / 255 / 168 /
168 registers for 2 / 4 / 8 / 16 rows at their default tiles (so at most 3 programs of 4 warps per
multiprocessor), 3.1–3.7 instructions per row and weight at 8 features per thread. The loop is taken
as the shortest backward branch around the wgmma, which for some small tiles is only part of the K
loop: read the SASS when a count looks low.
"""
from __future__ import annotations

import collections
import re
import subprocess
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from deltafleet.kernels import gluon_bitdelta as gb  # noqa: E402

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def compile_one(rows: int, bn: int, stages: int):
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    spt_n, tpw_r, wpc_r = gb._tenant_layout(rows, bn)
    bk = gb.TENANT_BLOCK_K
    xl = gl.NVMMASharedLayout.get_default_for([16, bk], gl.bfloat16)
    wl = gl.NVMMASharedLayout.get_default_for([bn, bk], gl.bfloat16)
    sig = {"x_desc": f"tensordesc<bf16[16, {bk}],{xl!r}>", "w_desc": f"tensordesc<bf16[{bn}, {bk}],{wl!r}>",
           "x_ptr": "*bf16", "s_ptr": "*u8", "a_ptr": "*fp32", "slot_ptr": "*i32", "b_ptr": "*bf16", "y_ptr": "*bf16",
           "ws_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "NSLOT": "i32",
           "stride_xm": "i32", "stride_ss": "i32", "stride_sn": "i32", "stride_as": "i32", "stride_ym": "i32"}
    consts = dict(ALPHA_PER_ROW=True, HAS_BIAS=False, ROWS=rows, STAGES=stages, SPT_N=spt_n, TPW_R=tpw_r,
                  WPC_R=wpc_r, num_warps=4)
    sig.update({c: "constexpr" for c in consts})
    names = gb._tenants_kernel.arg_names
    attrs = {(names.index(a),): [["tt.divisibility", 16]]
             for a in ("x_ptr", "s_ptr", "a_ptr", "slot_ptr", "b_ptr", "y_ptr", "ws_ptr", "cnt_ptr", "N", "K",
                       "stride_xm", "stride_ss", "stride_sn", "stride_ym")}
    k = triton.compile(GluonASTSource(fn=gb._tenants_kernel, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    return k, spt_n


def analyse(rows: int, bn: int, stages: int) -> dict:
    k, spt_n = compile_one(rows, bn, stages)
    regs, loop, _ = _inspect(k, "HGMMA")
    weights = spt_n * gb.TENANT_BLOCK_K
    return {"rows": rows, "tile": [bn, stages], "features_per_thread": spt_n, "registers": regs,
            "loop_instructions": len(loop), "per_row_weight": round(len(loop) / weights, 2),
            "opcodes": dict(collections.Counter(loop).most_common(8))}


def _inspect(kernel, mma: str) -> tuple[int, list[str], str]:
    """Registers per thread (cuobjdump), the K loop's opcodes (nvdisasm: the shortest backward branch
    whose body holds an ``mma`` instruction) and ptxas's ``-v`` log of a compiled kernel."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        Path(d, "k.cubin").write_bytes(kernel.asm["cubin"])
        Path(d, "k.ptx").write_text(kernel.asm["ptx"])
        usage = subprocess.run([str(BIN / "cuobjdump"), "--dump-resource-usage", f"{d}/k.cubin"],
                               capture_output=True, text=True).stdout
        sass = subprocess.run([str(BIN / "nvdisasm"), "-c", f"{d}/k.cubin"], capture_output=True, text=True).stdout
        log = subprocess.run([str(BIN / "ptxas"), "-arch=sm_90a", "-v", f"{d}/k.ptx", "-o", f"{d}/k.o"],
                             capture_output=True, text=True).stderr
    labels, ins = {}, []
    for line in sass.splitlines():
        m = re.match(r"\s*\.(L_x_\d+):", line)
        if m:
            labels[m.group(1)] = len(ins)
        elif re.search(r"/\*[0-9a-f]{4,}\*/", line):
            ins.append(re.search(r"\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)", line).group(2).split(".")[0])
    bodies = [ins[a:b + 1] for a, b in _backward_branches(sass, labels) if mma in ins[a:b + 1]]
    return int(re.search(r"REG:(\d+)", usage).group(1)), min(bodies, key=len, default=[]), log


def _backward_branches(sass: str, labels: dict) -> list[tuple[int, int]]:
    out, n = [], 0
    for line in sass.splitlines():
        if re.match(r"\s*\.(L_x_\d+):", line) or not re.search(r"/\*[0-9a-f]{4,}\*/", line):
            continue
        m = re.search(r"BRA\s+(?:`\()?\.?(L_x_\d+)", line)
        if m and m.group(1) in labels and labels[m.group(1)] < n:
            out.append((labels[m.group(1)], n))
        n += 1
    return out


def analyse_planes(rows: int, config: tuple, tiled: bool = False, base_spread: bool = False,
                   bits: bool = False) -> dict:
    """The warp-specialised int8 tenant kernel (``kernels.gluon_planes._planes_ws_kernel``) at
    ``config = (BLOCK_K, rows per warpgroup, STAGES, registers, loader warps)``: registers, spills, whether ptxas
    serialises its wgmmas, and the consumers' K-loop instructions per row and weight. ``tiled``: the
    sign tiles stored whole (``gluon_planes.tile_signs``)."""

    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from deltafleet.kernels import gluon_planes as gp

    bk, rh, stages, regs, loaders = config
    bn = gp.BLOCK_N
    xl = gl.NVMMASharedLayout.get_default_for([16, bk], gl.bfloat16)
    wl = gl.NVMMASharedLayout.get_default_for([bn, bk], gl.bfloat16)
    sl = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)
    pl = gl.NVMMASharedLayout.get_default_for([8, bk], gl.int8)
    sig = {"x_desc": f"tensordesc<bf16[16, {bk}],{xl!r}>", "w_desc": f"tensordesc<bf16[{bn}, {bk}],{wl!r}>",
           "s_desc": (f"tensordesc<u8[{bn * bk // 1024}, 128],{sl!r}>" if tiled
                      else f"tensordesc<u8[{bn}, {bk // 8}],{sl!r}>"), "p_desc": f"tensordesc<i8[8, {bk}],{pl!r}>",
           "slot_ptr": "*i32", "sc_ptr": "*fp32", "a_ptr": "*fp32", "b_ptr": "*bf16", "y_ptr": "*bf16",
           "ws_ptr": "*fp32", "cnt_ptr": "*i32", "bits_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "NSLOT": "i32",
           "stride_as": "i32", "stride_ym": "i32", "SPLIT": "i32", "PER": "i32"}
    consts = dict(ALPHA_PER_ROW=True, HAS_BIAS=False, ROWS=rows, STAGES=stages, INFLIGHT=4, CONS_REGS=regs,
                  RH=min(rows, rh), PDL=False, LOADERS=loaders, BS=base_spread and rows // min(rows, rh) > 1, BITS=bits,
                  num_warps=4)
    sig.update({c: "constexpr" for c in consts})
    names = gp._planes_ws_kernel.arg_names
    attrs = {(names.index(a),): [["tt.divisibility", 16]]
             for a in ("slot_ptr", "sc_ptr", "a_ptr", "b_ptr", "y_ptr", "ws_ptr", "cnt_ptr", "bits_ptr", "N", "K", "stride_as",
                       "stride_ym")}
    k = triton.compile(GluonASTSource(fn=gp._planes_ws_kernel, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": regs})
    regs, loop, log = _inspect(k, "BMMA" if bits else "IGMMA")
    weights = min(rows, rh) * bn * bk / 128  # row-weights per consumer thread per K step
    return {"rows": rows, "config": list(config), "tiled": tiled, "base_spread": base_spread, "bits": bits,
            "registers": regs,
            "spill_bytes": int((re.search(r"(\d+) bytes spill stores", log) or [0, 0])[1]),
            "serialized": "serialized" in log, "loop_instructions": len(loop),
            "per_row_weight": round(len(loop) / weights, 3), "opcodes": dict(collections.Counter(loop).most_common(8))}


def analyse_prefill_rs(config: tuple, dtype: str = "bf16") -> dict:
    """The register-operand prefill kernel (``kernels.gluon_prefill_rs``) at ``config`` (one of its
    ``CONFIGS``: BLOCK_T, STAGES, U, PRE, registers): registers, spills, whether ptxas serialises its wgmmas, and the consumers'
    K-loop instructions per weight (each consumer thread forms 64·64/128 = 32 weights per K step, U
    steps per loop body)."""
    from deltafleet.kernels import gluon_prefill_rs as pr

    u = config[2]
    k = pr.compile_for_sm90(config, dtype)
    regs, loop, log = _inspect(k, "HGMMA")
    return {"config": list(config), "dtype": dtype, "setmaxnreg": re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+\d+",
                                                                             k.asm["ptx"]),
            "registers": regs, "shared": k.metadata.shared,
            "spill_bytes": int((re.search(r"(\d+) bytes spill stores", log) or [0, 0])[1]),
            "serialized": "serialized" in log, "loop_instructions": len(loop),
            "per_weight": round(len(loop) / (32 * u), 3), "opcodes": dict(collections.Counter(loop).most_common(12))}


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "prefill-rs":  # python tests/gpu/sass_tenants.py prefill-rs [BT,STAGES,U,PRE,REGS]
        from deltafleet.kernels import gluon_prefill_rs as pr
        for config in ([tuple(int(v) for v in sys.argv[2].split(","))] if len(sys.argv) > 2 else pr.CONFIGS):
            print(analyse_prefill_rs(config), flush=True)
        sys.exit(0)
    if len(sys.argv) > 1 and sys.argv[1] == "planes":  # … planes [ROWS BK,RH,STAGES,REGS,LOADERS] [tiled] [spread]
        from deltafleet.kernels import gluon_planes as gp
        flags = {a for a in sys.argv[2:] if a in ("tiled", "spread", "bits")}
        args = [a for a in sys.argv[2:] if a not in flags]
        cases = ([(int(args[0]), tuple(int(v) for v in args[1].split(",")))] if len(args) > 1 else
                 [(r, c) for r in (2, 4, 8, 16) for c in gp.WS_CONFIGS[r]])
        for rows, config in cases:
            print(analyse_planes(rows, config, "tiled" in flags, "spread" in flags, "bits" in flags), flush=True)
        sys.exit(0)
    if len(sys.argv) > 2:
        cases = [(int(sys.argv[1]), tuple(int(v) for v in sys.argv[2].split(",")))]
    else:
        cases = [(r, c) for r in (2, 4, 8, 16) for c in gb.tenant_configs(r)]
    for rows, (bn, stages) in cases:
        print(analyse(rows, bn, stages), flush=True)
