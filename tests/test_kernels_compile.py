"""Every autotuning configuration of every Triton kernel compiles for a Hopper GPU (sm_90a).

The CPU interpreter runs kernels as Python, so it misses what only the compiler sees (a name
defined under one constexpr branch and used under another, shared memory over the limit, a
layout the backend rejects). This compiles each configuration ahead of time with Triton's own
ptxas, for ``cuda:90``, with the argument specialisations a real launch on 16-aligned tensors gets
(``tt.divisibility = 16``). No GPU is needed. The compiles run in child processes, because this
test session imports triton in interpreter mode (tests/conftest.py).

``DELTAFLEET_COMPILE_ALL=1`` compiles every configuration (about 900 CPU-seconds on a fresh Triton
cache). Without it, the configuration lists of the kernels slowest to compile (7–12 s a configuration:
the int8 tenant kernel's ``WS_CONFIGS``, the Gluon and Triton tenant kernels' ``tenant_configs`` and
``_lut_configs``, the register-operand prefill kernel's ``CONFIGS`` and ``SMALL_CONFIGS``) keep their
first configuration (per row count), the dispatchers' default; every other list is compiled whole
(the grouped kernel's too, whose every configuration is checked for spills), and every kernel and
variant of one. The GPU tests (``-m gpu``) compile what the dispatchers pick on the device.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SMEM_LIMIT = 232448  # bytes of shared memory per block on H100/H200 (227 KB)
ROOT = Path(__file__).resolve().parents[1]
SWEEP = r'''
ALL = os.environ.get("DELTAFLEET_COMPILE_ALL") == "1"
def sweep(cfgs):  # the configurations of a slow-to-compile list that are compiled (module docstring)
    cfgs = list(cfgs)
    return cfgs if ALL else cfgs[:1]
'''
exec(SWEEP)

CHILD = r'''
import inspect, json, os, sys
import triton
''' + SWEEP + r'''

# Shard k of n (COMPILE_SHARD, COMPILE_SHARDS) compiles every n-th triton.compile call from the k-th;
# the others raise NotThisShard, which each call site records as its entry's error, and the parent
# keeps the shard that compiled each entry. Every shard makes the same calls in the same order.
SHARD, SHARDS = int(os.environ.get("COMPILE_SHARD", "0")), int(os.environ.get("COMPILE_SHARDS", "1"))
class NotThisShard(Exception):
    pass
_compile, _calls = triton.compile, [0]
def _sharded(*args, **kwargs):
    _calls[0] += 1
    if (_calls[0] - 1) % SHARDS != SHARD:
        raise NotThisShard()
    return _compile(*args, **kwargs)
triton.compile = _sharded
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from deltafleet.kernels import triton_bitdelta as tb

PTR = {"x_ptr": "*bf16", "w_ptr": "*bf16", "s_ptr": "*u8", "a_ptr": "*fp32", "slot_ptr": "*i32",
       "b_ptr": "*bf16", "y_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32",
       "z_ptr": "*fp32"}

def build(fn, constexprs, cfg):
    names = fn.arg_names
    constexprs = {**constexprs, **cfg.kwargs}
    for p in fn.params:  # constexpr parameters left at their defaults, as a launch does
        if p.is_constexpr and p.name not in constexprs and p.default is not inspect.Parameter.empty:
            constexprs[p.name] = p.default
    sig = {n: "constexpr" if n in constexprs else PTR.get(n, "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n not in constexprs and n != "M"}
    try:
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
        return {"shared": k.metadata.shared, "wgmma": "wgmma" in k.asm["ptx"]}
    except Exception as e:  # reported to the test, which names the configuration
        return {"error": f"{type(e).__name__}: {str(e)[-400:]}"}

def key(kernel, cfg, extra):
    return kernel + " " + json.dumps({**cfg.kwargs, **extra, "w": cfg.num_warps, "s": cfg.num_stages}, sort_keys=True)

out = {}
for cfg in tb._decode_configs(False):
    for bm in (1, 4):
        out[key("decode", cfg, {"BLOCK_M": bm})] = build(tb._decode_kernel, dict(
            ONE_DELTA=True, ALPHA_PER_ROW=True, HAS_BIAS=True, EVEN=True, BLOCK_M=bm), cfg)
for cfg in tb._decode_configs(True):
    out[key("tenants-fma", cfg, {})] = build(tb._decode_kernel, dict(
        ONE_DELTA=False, ALPHA_PER_ROW=True, HAS_BIAS=False, EVEN=False), cfg)
for cfg in tb._mm_configs():
    out[key("prefill", cfg, {})] = build(tb._mm_kernel, dict(
        ALPHA_PER_ROW=True, HAS_BIAS=True, EVEN_K=True, DOT_FP32=False), cfg)
for cfg in sweep(tb._lut_configs()):
    for bm in (1, 16):
        out[key("tenants-lut", cfg, {"BLOCK_M": bm})] = build(tb._tenants_kernel, dict(
            ALPHA_PER_ROW=False, HAS_BIAS=False, EVEN=True, DOT_FP32=False, BLOCK_M=bm), cfg)
for cfg in tb._decode_configs(False):  # one-row mixed-tenant batches use the decode tiles
    out[key("tenants-fma-1row", cfg, {})] = build(tb._decode_kernel, dict(
        ONE_DELTA=False, ALPHA_PER_ROW=True, HAS_BIAS=False, EVEN=True, BLOCK_M=1), cfg)
# signs in kernels.reference.tile_signs' layout: the first configuration of each Triton kernel
out[key("tiled-decode", tb._decode_configs(False)[0], {})] = build(tb._decode_kernel, dict(
    ONE_DELTA=True, ALPHA_PER_ROW=True, HAS_BIAS=True, EVEN=True, BLOCK_M=1, TILED=True), tb._decode_configs(False)[0])
out[key("tiled-prefill", tb._mm_configs()[0], {})] = build(tb._mm_kernel, dict(
    ALPHA_PER_ROW=True, HAS_BIAS=True, EVEN_K=True, DOT_FP32=False, TILED=True), tb._mm_configs()[0])
out[key("tiled-tenants-lut", tb._lut_configs()[0], {})] = build(tb._tenants_kernel, dict(
    ALPHA_PER_ROW=False, HAS_BIAS=False, EVEN=True, DOT_FP32=False, BLOCK_M=16, TILED=True), tb._lut_configs()[0])

# the lean base GEMM of grouped decode batches (triton_base), at each x tile it launches with
from deltafleet.kernels import triton_base as _tbase
_cfg = triton.Config({}, num_warps=4, num_stages=3)
for bm in (16, 32, _tbase.MAX_BLOCK_M):
    out[key("base-mm", _cfg, {"BLOCK_M": bm})] = build(_tbase._base_mm_kernel, dict(
        BLOCK_M=bm, BLOCK_N=_tbase.BLOCK_N, BLOCK_K=_tbase.BLOCK_K, STAGES=_tbase.STAGES, DOT_FP32=False), _cfg)
# and the add that joins its output to the sign products' float32 accumulator
out[key("add-and-clear", _cfg, {})] = build(_tbase._add_and_clear_kernel, dict(BLOCK=_tbase.ADD_BLOCK), _cfg)

# the decode chain (kernels/decode_chain.py): the base GEMM at its ring depth and the norm and SiLU·up,
# each with programmatic dependent launch; PTX counted for its waits and triggers
from deltafleet.kernels import decode_chain as _dc
def build_pdl(name, fn, signature, constexprs, warps):
    try:
        attrs = {(i,): [["tt.divisibility", 16]] for i, (n, t) in enumerate(signature.items())
                 if t.startswith("*") or n.startswith("stride")}
        _k = triton.compile(ASTSource(fn=fn, signature={**signature, **{c: "constexpr" for c in constexprs}},
                                      constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        out[name] = {"shared": _k.metadata.shared, "wait": _k.asm["ptx"].count("griddepcontrol.wait"),
                     "trigger": _k.asm["ptx"].count("griddepcontrol.launch_dependents")}
    except Exception as e:
        out[name] = {"error": f"{type(e).__name__}: {str(e)[-400:]}"}
_mm_sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32",
           "stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32"}
for bm in (16, 32, _tbase.MAX_BLOCK_M):
    build_pdl(f"chain-mm {bm}", _tbase._base_mm_kernel, _mm_sig, dict(
        BLOCK_M=bm, BLOCK_N=_tbase.BLOCK_N, BLOCK_K=_tbase.BLOCK_K, STAGES=_dc.STAGES, DOT_FP32=False,
        HAS_BIAS=True, PDL=True), 4)
build_pdl("chain-norm", _dc._add_rms_norm_kernel, {
    "x_ptr": "*bf16", "y_ptr": "*bf16", "w_ptr": "*bf16", "h_ptr": "*bf16", "n_ptr": "*bf16", "D": "i32",
    "eps": "fp32", "stride_x": "i32", "stride_y": "i32"}, dict(BLOCK=4096, PDL=True), 8)
build_pdl("chain-silu", _dc._silu_mul_kernel, {
    "g_ptr": "*bf16", "u_ptr": "*bf16", "o_ptr": "*bf16", "N": "i32", "stride_g": "i32", "stride_u": "i32"},
    dict(BLOCK=_dc.SILU_BLOCK, PDL=True), 4)

# the bit-plane kernel of the binary tenant path (a plain Triton kernel): a long K in 1024-weight
# chunks, and a short one whose chunk is the whole row (with programmatic dependent launch)
from deltafleet.kernels import gluon_planes as _gp
for block, chunk, pdl in ((8192, 1024, False), (512, 512, True)):
    try:
        _k = triton.compile(ASTSource(fn=_gp._bitplanes_kernel, signature={
            "x_ptr": "*bf16", "b_ptr": "*i32", "sc_ptr": "*fp32", "K": "i32", "stride_xm": "i32", "BLOCK": "constexpr",
            "CHUNK": "constexpr", "PDL": "constexpr"}, constexprs={"BLOCK": block, "CHUNK": chunk, "PDL": pdl}),
            target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        out["bitplanes " + json.dumps({"BLOCK": block, "CHUNK": chunk, "PDL": pdl})] = {
            "shared": _k.metadata.shared, "griddep": "griddepcontrol" in _k.asm["ptx"]}
    except Exception as e:
        out["bitplanes " + json.dumps({"BLOCK": block, "CHUNK": chunk, "PDL": pdl})] = {
            "error": f"{type(e).__name__}: {str(e)[-400:]}"}

from deltafleet.kernels import gluon_bitdelta as gb
if gb.HAVE_GLUON:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    fn = gb._prefill_kernel
    for (bm, bn, bk, stages, warps, w_tma) in gb.CONFIGS:
        for dt, gdt in (("bf16", gl.bfloat16), ("fp16", gl.float16)):
            xl = gl.NVMMASharedLayout.get_default_for([bm, bk], gdt)
            wl = gl.NVMMASharedLayout.get_default_for([bn, bk], gdt)
            sig = {"x_desc": f"tensordesc<{dt}[{bm}, {bk}],{xl!r}>", "w_desc": f"tensordesc<{dt}[{bn}, {bk}],{wl!r}>",
                   "w_ptr": "*" + dt, "s_ptr": "*u8", "a_ptr": "*fp32", "b_ptr": "*" + dt, "y_ptr": "*" + dt,
                   "M": "i32", "N": "i32", "K": "i32", "stride_wn": "i32", "stride_sn": "i32", "stride_ym": "i32"}
            consts = dict(ALPHA_PER_ROW=True, HAS_BIAS=True, STAGES=stages, W_TMA=w_tma, num_warps=warps,
                          TILED=(bm, bn, bk, stages, warps, w_tma) == gb.DEFAULT_CONFIG and dt == "fp16")
            sig.update({c: "constexpr" for c in consts})
            names = fn.arg_names
            attrs = {(names.index(a),): [["tt.divisibility", 16]]
                     for a in ("w_ptr", "s_ptr", "a_ptr", "b_ptr", "y_ptr", "N", "K", "stride_wn")}
            name = "gluon-prefill " + json.dumps({"config": [bm, bn, bk, stages, warps, w_tma], "dtype": dt,
                                                  "tiled": consts["TILED"]})
            try:
                k = triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                                   target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
                ptx = k.asm["ptx"]
                out[name] = {"shared": k.metadata.shared, "wgmma": "wgmma.mma_async" in ptx,
                             "overlap": "wgmma.wait_group.sync.aligned 1;" in ptx}
            except Exception as e:
                out[name] = {"error": f"{type(e).__name__}: {str(e)[-400:]}"}
    fn = gb._tenants_kernel
    for rows in (2, 4, 8, 16):
        for (bn, stages) in sweep(gb.tenant_configs(rows)):
            spt_n, tpw_r, wpc_r = gb._tenant_layout(rows, bn)
            bk = gb.TENANT_BLOCK_K
            xl = gl.NVMMASharedLayout.get_default_for([16, bk], gl.bfloat16)
            wl = gl.NVMMASharedLayout.get_default_for([bn, bk], gl.bfloat16)
            sig = {"x_desc": f"tensordesc<bf16[16, {bk}],{xl!r}>", "w_desc": f"tensordesc<bf16[{bn}, {bk}],{wl!r}>",
                   "x_ptr": "*bf16", "s_ptr": "*u8", "a_ptr": "*fp32", "slot_ptr": "*i32", "b_ptr": "*bf16",
                   "y_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32",
                   "NSLOT": "i32", "stride_xm": "i32", "stride_ss": "i32", "stride_sn": "i32", "stride_as": "i32",
                   "stride_ym": "i32"}
            consts = dict(ALPHA_PER_ROW=True, HAS_BIAS=True, ROWS=rows, STAGES=stages, SPT_N=spt_n, TPW_R=tpw_r,
                          WPC_R=wpc_r, num_warps=4)
            sig.update({c: "constexpr" for c in consts})
            names = fn.arg_names
            attrs = {(names.index(a),): [["tt.divisibility", 16]]
                     for a in ("x_ptr", "s_ptr", "a_ptr", "slot_ptr", "b_ptr", "y_ptr", "ws_ptr", "cnt_ptr", "N", "K",
                               "stride_xm", "stride_ss", "stride_sn", "stride_ym")}
            name = "gluon-tenants " + json.dumps({"rows": rows, "config": [bn, stages]})
            try:
                k = triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                                   target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
                ptx = k.asm["ptx"]
                out[name] = {"shared": k.metadata.shared, "wgmma": "wgmma.mma_async" in ptx,
                             "local": ptx.count("st.local")}
            except Exception as e:
                out[name] = {"error": f"{type(e).__name__}: {str(e)[-400:]}"}
    from deltafleet.kernels import gluon_planes as gp
    import subprocess, tempfile
    from pathlib import Path as _P
    ptxas = _P(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    def ptxas_log(ptx):  # ptxas's own -v report, which names wgmma serialisation (C7512/C7515)
        with tempfile.TemporaryDirectory() as d:
            (_P(d) / "k.ptx").write_text(ptx)
            return subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(_P(d) / "k.ptx"), "-o", str(_P(d) / "k.o")],
                                  capture_output=True, text=True).stderr
    def planes_sig(bk, tiled=False):
        xl = gl.NVMMASharedLayout.get_default_for([16, bk], gl.bfloat16)
        wl = gl.NVMMASharedLayout.get_default_for([gp.BLOCK_N, bk], gl.bfloat16)
        sl = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)
        pl = gl.NVMMASharedLayout.get_default_for([8, bk], gl.int8)
        return {"x_desc": f"tensordesc<bf16[16, {bk}],{xl!r}>",
                "w_desc": f"tensordesc<bf16[{gp.BLOCK_N}, {bk}],{wl!r}>",
                "s_desc": (f"tensordesc<u8[{gp.BLOCK_N * bk // 1024}, 128],{sl!r}>" if tiled
                           else f"tensordesc<u8[{gp.BLOCK_N}, {bk // 8}],{sl!r}>"),
                "p_desc": f"tensordesc<i8[8, {bk}],{pl!r}>",
                "slot_ptr": "*i32", "sc_ptr": "*fp32", "a_ptr": "*fp32", "b_ptr": "*bf16", "y_ptr": "*bf16",
                "ws_ptr": "*fp32", "cnt_ptr": "*i32", "bits_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32",
                "NSLOT": "i32", "stride_as": "i32", "stride_ym": "i32", "SPLIT": "i32", "PER": "i32"}
    def planes_build(fn, name, bk, consts, options, tiled=False):
        sig = planes_sig(bk, tiled)
        sig.update({c: "constexpr" for c in consts})
        names = fn.arg_names
        attrs = {(names.index(a),): [["tt.divisibility", 16]]
                 for a in ("slot_ptr", "sc_ptr", "a_ptr", "b_ptr", "y_ptr", "ws_ptr", "cnt_ptr", "bits_ptr", "N", "K",
                           "stride_as", "stride_ym")}
        try:
            k = triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                               target=GPUTarget("cuda", 90, 32), options=options)
            ptx = k.asm["ptx"]
            out[name] = {"shared": k.metadata.shared, "wgmma": "wgmma.mma_async" in ptx,
                         "igmma": ".s32.s8.s8" in ptx, "bmma": ".s32.b1.b1.s32.and.popc" in ptx, "serialized": "serialized" in ptxas_log(ptx),
                         "griddep": "griddepcontrol.wait" in ptx}
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {str(e)[-400:]}"}
    for rows in (2, 4, 8, 16):
        for i, (bk, rh, stages, regs, loaders) in enumerate(sweep(gp.WS_CONFIGS[rows])):
            for pdl in (False, True) if i == 0 else (False, ):  # programmatic dependent launch: the default only
                planes_build(gp._planes_ws_kernel, ("planes-ws-pdl " if pdl else "planes-ws ")
                             + json.dumps({"rows": rows, "config": [bk, rh, stages, regs, loaders]}),
                             bk, dict(ALPHA_PER_ROW=True, HAS_BIAS=True, ROWS=rows, STAGES=stages, INFLIGHT=4,
                                      CONS_REGS=regs, RH=min(rows, rh), PDL=pdl, LOADERS=loaders, BS=False,
                                      BITS=False, num_warps=4),
                             {"num_warps": 4, "maxnreg": regs, "launch_pdl": pdl})
    # tiled signs (kernels.reference.tile_signs): the first 16-row configuration with K steps of 128
    bk, rh, stages, regs, loaders = next(c for c in gp.WS_CONFIGS[16] if c[0] == 128)
    planes_build(gp._planes_ws_kernel, "planes-ws-tiled " + json.dumps({"rows": 16, "config": [bk, rh, stages, regs,
                                                                                                loaders]}),
                 bk, dict(ALPHA_PER_ROW=True, HAS_BIAS=True, ROWS=16, STAGES=stages, INFLIGHT=4, CONS_REGS=regs,
                          RH=rh, PDL=False, LOADERS=loaders, BS=False, BITS=False, num_warps=4), {"num_warps": 4, "maxnreg": regs},
                 True)
    # and with the base product spread over the consumers' K slices (base_spread)
    planes_build(gp._planes_ws_kernel, "planes-ws-tiled-bs " + json.dumps({"rows": 16, "config": [bk, rh, stages, regs,
                                                                                                   loaders]}),
                 bk, dict(ALPHA_PER_ROW=True, HAS_BIAS=True, ROWS=16, STAGES=stages, INFLIGHT=4, CONS_REGS=regs,
                          RH=rh, PDL=False, LOADERS=loaders, BS=True, BITS=False, num_warps=4),
                 {"num_warps": 4, "maxnreg": regs}, True)
    # the sign part on the binary tensor cores (bits), alone and with the base spread
    for bs in (False, True):
        planes_build(gp._planes_ws_kernel, ("planes-ws-tiled-bits-bs " if bs else "planes-ws-tiled-bits ")
                     + json.dumps({"rows": 16, "config": [bk, rh, stages, regs, loaders]}),
                     bk, dict(ALPHA_PER_ROW=True, HAS_BIAS=True, ROWS=16, STAGES=stages, INFLIGHT=4, CONS_REGS=regs,
                              RH=rh, PDL=False, LOADERS=loaders, BS=bs, BITS=True, num_warps=4),
                     {"num_warps": 4, "maxnreg": regs}, True)
    # every 16-row configuration of 128-weight K steps on tiled signs, bits with programmatic dependent
    # launch: what the dispatcher times at 16 rows (also persistent and stream-K: the same kernel)
    for cfg in sweep([c for c in gp.WS_CONFIGS[16] if c[0] == 128]):
        bk_, rh_, st_, regs_, ld_ = cfg
        planes_build(gp._planes_ws_kernel, "planes-ws-tiled-bits " + json.dumps({"rows": 16, "config": list(cfg),
                                                                                 "pdl": True}),
                     bk_, dict(ALPHA_PER_ROW=True, HAS_BIAS=True, ROWS=16, STAGES=st_, INFLIGHT=4, CONS_REGS=regs_,
                               RH=rh_, PDL=True, LOADERS=ld_, BS=False, BITS=True, num_warps=4),
                     {"num_warps": 4, "maxnreg": regs_, "launch_pdl": True}, True)
    # and on row signs: the default of 4 and 8 rows (8 with programmatic dependent launch), and a
    # 16-row configuration of 256-weight K steps (two binary mmas per row and step)
    for rows, cfg, pdl in ((4, gp.WS_CONFIGS[4][0], False), (8, gp.WS_CONFIGS[8][0], True),
                           (16, next(c for c in gp.WS_CONFIGS[16] if c[0] == 256), False)):
        bk_, rh_, st_, regs_, ld_ = cfg
        planes_build(gp._planes_ws_kernel, "planes-ws-bits " + json.dumps({"rows": rows, "config": list(cfg),
                                                                           "pdl": pdl}),
                     bk_, dict(ALPHA_PER_ROW=True, HAS_BIAS=True, ROWS=rows, STAGES=st_, INFLIGHT=4, CONS_REGS=regs_,
                               RH=min(rows, rh_), PDL=pdl, LOADERS=ld_, BS=False, BITS=True, num_warps=4),
                     {"num_warps": 4, "maxnreg": regs_, "launch_pdl": pdl})
    from deltafleet.kernels import gluon_prefill_rs as pr
    for config, tiled, seg in ([(c, False, False) for c in sweep(pr.CONFIGS) + sweep(pr.SMALL_CONFIGS)]
                               + [(pr.CONFIGS[0], True, False), (pr.SMALL_CONFIGS[1], True, False)]
                               + [(pr.SEGMENT_CONFIG, True, True), (pr.SEGMENT_CONFIG, False, True)]):
        name = "gluon-prefill-rs " + json.dumps({"config": list(config), "tiled": tiled, "segments": seg})
        try:
            k = pr.compile_for_sm90(config, tiled=tiled, segments=seg)
            ptx = k.asm["ptx"]
            out[name] = {"shared": k.metadata.shared, "wgmma": "wgmma.mma_async" in ptx,
                         "serialized": "serialized" in ptxas_log(ptx)}
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {str(e)[-400:]}"}
    # the grouped sign product on the int8 tensor cores (deltafleet.kernels.gluon_grouped): every
    # configuration with y in bf16 and α per feature, the first of the smallest and the largest block_m
    # also with y in fp16 and one α per matrix, and with y in fp32. Its ptxas report comes from the
    # ptxas Triton itself runs for sm_90 (from Triton 3.7 on the CUDA 13 one: bin/ptxas rejects the PTX
    # version Triton emits, and its report is then empty), and must exist.
    import re
    from deltafleet.kernels import gluon_grouped as gg
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        sm90_ptxas = get_ptxas(90).path
    except (ImportError, AttributeError):
        sm90_ptxas = ptxas
    def sm90_report(ptx):
        with tempfile.TemporaryDirectory() as d:
            (_P(d) / "k.ptx").write_text(ptx)
            return subprocess.run([str(sm90_ptxas), "-arch=sm_90a", "-v", str(_P(d) / "k.ptx"), "-o",
                                   str(_P(d) / "k.o")], capture_output=True, text=True).stderr
    for bm, cfgs in gg.CONFIGS.items():
        for i, cfg in enumerate(cfgs):
            # y in fp16 and fp32 (the epilogue's other stores) for the smallest and largest blocks only:
            # on a fresh Triton cache the fixture took 605 s on 2 cores (2026-12-04), each entry counts
            others = i == 0 and bm in (min(gg.CONFIGS), max(gg.CONFIGS))
            for dt, per_row in [("bf16", True)] + ([("fp16", False), ("fp32", True)] if others else []):
                name = "grouped-planes " + json.dumps({"config": list(cfg), "dtype": dt, "alpha_per_row": per_row})
                try:
                    k = gg.compile_for_sm90(cfg, dt, per_row)
                    ptx = k.asm["ptx"]
                    log = sm90_report(ptx)
                    spills = re.search(r"(\d+) bytes spill stores", log)
                    out[name] = {"shared": k.metadata.shared, "ring": cfg.smem(), "wgmma": "wgmma.mma_async" in ptx,
                                 "sync_mma": re.search(r"mma\.sync\.aligned\.m16n8k32\S*\.s32\.s8\.s8", ptx) is not None,
                                 "igmma": ".s32.s8.s8" in ptx, "report": "Used " in log,
                                 "serialized": "serialized" in log or "C7512" in log or "C7515" in log,
                                 "spills": int(spills.group(1)) if spills else -1}
                except Exception as e:
                    out[name] = {"error": f"{type(e).__name__}: {str(e)[-400:]}"}
    # the programmatic-dependent-launch forms (after the planes, after a sibling) of an mma.sync and a
    # wgmma consumer
    for bm, sibling in ((4, False), (16, False), (4, True), (16, True)):
        cfg = gg.CONFIGS[bm][0]
        name = "grouped-planes-pdl " + json.dumps({"config": list(cfg), "sibling": sibling})
        try:
            k = gg.compile_for_sm90(cfg, pdl=True, sibling=sibling)
            ptx = k.asm["ptx"]
            log = sm90_report(ptx)
            spills = re.search(r"(\d+) bytes spill stores", log)
            out[name] = {"shared": k.metadata.shared, "wait": ptx.count("griddepcontrol.wait"),
                         "trigger": ptx.count("griddepcontrol.launch_dependents"),
                         "report": "Used " in log, "spills": int(spills.group(1)) if spills else -1}
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {str(e)[-400:]}"}
json.dump(out, sys.stdout)
'''


@pytest.fixture(scope="module")
def compiled() -> dict:
    """Every entry's compile result, from one child process per CPU core (at most 4), each compiling
    its share of the configurations (the shards' outputs merged by entry)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    shards = max(1, min(4, len(os.sched_getaffinity(0))))
    procs = [subprocess.Popen([sys.executable, "-c", CHILD], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**env, "COMPILE_SHARD": str(k), "COMPILE_SHARDS": str(shards)})
             for k in range(shards)]
    outs = [p.communicate(timeout=1800) for p in procs]
    merged: dict = {}
    for p, (stdout, stderr) in zip(procs, outs):
        if p.returncode != 0:
            if "GPUTarget" in stderr or "ASTSource" in stderr:
                pytest.skip(f"this triton cannot compile ahead of time: {stderr[-300:]}")
            raise AssertionError(f"the compile child failed:\n{stderr[-3000:]}")
        for name, entry in json.loads(stdout).items():
            if not str(entry.get("error", "")).startswith("NotThisShard"):
                assert name not in merged, f"{name} compiled by two shards"
                merged[name] = entry
    assert set(merged) == set(json.loads(outs[0][0])), "an entry no shard compiled"
    return merged


def test_every_configuration_compiles_for_sm90(compiled):
    from deltafleet.kernels import triton_bitdelta as tb

    n_decode, n_fma = len(tb._decode_configs(False)), len(tb._decode_configs(True))
    from deltafleet.kernels import gluon_bitdelta as gb

    from deltafleet.kernels import gluon_planes as gp

    from deltafleet.kernels import gluon_prefill_rs as pr

    n_gluon = (2 * len(gb.CONFIGS) + len(sweep(pr.CONFIGS)) + len(sweep(pr.SMALL_CONFIGS)) + 9  # + the register-operand
               # kernel on tiled signs (a prefill and a small-batch configuration), the int8 kernel on tiled signs,
               # the int8 kernel with its base product spread over the consumers, and on the binary
               # tensor cores (bits): tiled with and without the spread, and three on row signs,
               # and each 16-row 128-step configuration tiled on bits with PDL
               + 2  # the register-operand kernel over a tile table (bitdelta_linear_segments), tiled and not
               + sum(len(sweep(gb.tenant_configs(r))) + len(sweep(gp.WS_CONFIGS[r])) + 1 for r in (2, 4, 8, 16))
               + len(sweep([c for c in gp.WS_CONFIGS[16] if c[0] == 128]))
               ) if gb.HAVE_GLUON else 0
    n_tiled = 3 + 2 + 3 + 1  # the Triton kernels on tiled signs, one configuration each; the bit-plane kernel
    # twice; the base GEMM of grouped decode batches at its three x tiles, and its add
    from deltafleet.kernels import gluon_grouped as gg

    # the grouped int8 kernel: every configuration, the first of the smallest and largest block_m twice
    # more (fp16, fp32), and four with programmatic dependent launch
    n_grouped = sum(len(c) for c in gg.CONFIGS.values()) + 4 + 4 if gb.HAVE_GLUON else 0
    n_chain = 3 + 2  # the decode chain: its GEMM at three x tiles, the norm and SiLU·up
    assert len(compiled) == (3 * n_decode + n_fma + len(tb._mm_configs()) + 2 * len(sweep(tb._lut_configs())) + n_gluon
                             + n_tiled + n_grouped + n_chain)
    errors = {k: v["error"] for k, v in compiled.items() if "error" in v}
    assert not errors, "configurations that do not compile:\n" + "\n".join(f"{k}: {e}" for k, e in errors.items())
    too_big = {k: v["shared"] for k, v in compiled.items() if v["shared"] > SMEM_LIMIT}
    assert not too_big, f"over {SMEM_LIMIT} bytes of shared memory: {too_big}"


def test_prefill_and_table_lookup_use_hopper_tensor_cores(compiled):
    for k, v in compiled.items():
        if k.startswith(("prefill", "tenants-lut", "gluon-prefill", "gluon-tenants", "planes", "base-mm")):
            assert v["wgmma"], f"{k} compiled without wgmma"


def test_gluon_prefill_overlaps_the_sign_expansion_with_the_previous_wgmma(compiled):
    """The point of the Gluon kernel: in its K loop it waits only until one wgmma is outstanding
    (``wgmma.wait_group 1``), so step k's sign expansion runs while step k − 1's product does."""
    from deltafleet.kernels import gluon_bitdelta as gb

    if not gb.HAVE_GLUON:
        pytest.skip("this triton has no Gluon")
    gluon = {k: v for k, v in compiled.items() if k.startswith("gluon-prefill ")}
    assert len(gluon) == 2 * len(gb.CONFIGS)
    assert all(v["overlap"] for v in gluon.values()), gluon


def test_gluon_tenant_kernel_keeps_its_sums_in_registers(compiled):
    """Every compiled (rows, tile) of the Hopper mixed-tenant kernel (every usable one with
    ``DELTAFLEET_COMPILE_ALL=1``) compiles without spilling to local memory: a thread's per-feature
    sums (at most 8 features, ``tenant_configs``) stay in registers."""
    from deltafleet.kernels import gluon_bitdelta as gb

    if not gb.HAVE_GLUON:
        pytest.skip("this triton has no Gluon")
    tenants = {k: v for k, v in compiled.items() if k.startswith("gluon-tenants")}
    assert len(tenants) == sum(len(sweep(gb.tenant_configs(r))) for r in (2, 4, 8, 16)) > 0
    assert all(v.get("local") == 0 for v in tenants.values()), tenants


def test_int8_tenant_kernels_keep_their_wgmmas_asynchronous(compiled):
    """Every configuration of the int8 tensor-core tenant kernels (``deltafleet.kernels.gluon_planes``) issues
    int8 wgmmas and compiles without ptxas serialising them (its C7512/C7515 "wgmma.mma_async
    instructions are serialized" diagnostic: too few registers, or an accumulator touched mid-pipeline),
    which in the non-specialised kernel had cost a factor of about two."""
    from deltafleet.kernels import gluon_planes as gp

    if not gp.HAVE_GLUON:
        pytest.skip("this triton has no Gluon")
    planes = {k: v for k, v in compiled.items() if k.startswith("planes")}
    # + tiled, tiled spread, tiled bits, tiled bits spread, each 16-row 128-step configuration tiled
    # bits with PDL, three bits on row signs
    tiled16 = len(sweep([c for c in gp.WS_CONFIGS[16] if c[0] == 128]))
    assert len(planes) == sum(len(sweep(gp.WS_CONFIGS[r])) + 1 for r in (2, 4, 8, 16)) + 7 + tiled16
    pdl = {k: v for k, v in planes.items() if k.startswith("planes-ws-pdl")}
    assert len(pdl) == 4 and all(v.get("griddep") for v in pdl.values()), pdl
    bits = {k: v for k, v in planes.items() if "-bits" in k}
    assert len(bits) == 5 + tiled16 and all(v.get("bmma") and not v.get("igmma") for v in bits.values()), bits
    assert all(v.get("griddep") for k, v in bits.items() if '"pdl": true' in k), bits
    bitplanes = {k: v for k, v in compiled.items() if k.startswith("bitplanes ")}
    assert len(bitplanes) == 2, bitplanes  # the merged shards' order is not the compile order: by name
    assert all(v.get("griddep") == ('"PDL": true' in k) for k, v in bitplanes.items()), bitplanes
    assert all(v.get("igmma") for k, v in planes.items() if k not in bits), planes
    serialized = sorted(k for k, v in planes.items() if v.get("serialized"))
    assert not serialized, f"ptxas serialised the wgmmas of {serialized}"


def test_register_operand_prefill_keeps_its_wgmmas_asynchronous(compiled):
    """The register-operand prefill kernel (``deltafleet.kernels.gluon_prefill_rs``): every configuration issues
    wgmmas and ptxas keeps them asynchronous (no wgmma with a register operand stays in flight across
    the K loop's back edge, which would make ptxas serialise all of them)."""
    from deltafleet.kernels import gluon_prefill_rs as pr

    if not pr.HAVE_GLUON:
        pytest.skip("this triton has no Gluon")
    rs = {k: v for k, v in compiled.items() if k.startswith("gluon-prefill-rs")}
    # + two on tiled signs, two over a tile table (tiled signs and sign rows)
    assert len(rs) == len(sweep(pr.CONFIGS)) + len(sweep(pr.SMALL_CONFIGS)) + 4
    assert all(v["wgmma"] and not v["serialized"] for v in rs.values()), rs


def test_grouped_int8_kernel_compiles_without_serialised_wgmmas_or_spills(compiled):
    """Every configuration of the grouped sign-product kernel (``deltafleet.kernels.gluon_grouped``)
    compiles for sm_90a with int8 wgmmas (``mma.sync`` for ``sync_mma``), within the shared memory of
    one block (its ring and under 1 KiB of barriers and scratch: the epilogue stays in the
    accumulator's registers), and ptxas,
    the one Triton runs for sm_90, reports no wgmma serialisation (C7512/C7515) and at most 128 bytes
    of spills (none with Triton 3.9; Triton 3.6 spills about 100 bytes in the epilogue of the 64-row
    two-consumer configurations, after the K loop)."""
    from deltafleet.kernels import gluon_grouped as gg

    if not gg.HAVE_GLUON:
        pytest.skip("this triton has no Gluon")
    grouped = {k: v for k, v in compiled.items() if k.startswith("grouped-planes ")}
    assert len(grouped) == sum(len(c) for c in gg.CONFIGS.values()) + 4  # + fp16, fp32 of two block sizes
    assert all(v["report"] for v in grouped.values()), "ptxas gave no -v report"
    # int8 products by the warpgroup's wgmma, or (sync_mma) by each warp's mma.sync only
    for k, v in grouped.items():
        sync = gg.GroupedConfig(*json.loads(k.split(" ", 1)[1])["config"]).sync_mma
        assert v["igmma"] and (v["sync_mma"] and not v["wgmma"] if sync else v["wgmma"]), (k, v)
    assert all(v["ring"] <= v["shared"] <= v["ring"] + 1024 <= gg.SMEM_PER_BLOCK for v in grouped.values()), grouped
    serialized = sorted(k for k, v in grouped.items() if v["serialized"])
    assert not serialized, f"ptxas serialised the wgmmas of {serialized}"
    spilled = {k: v["spills"] for k, v in grouped.items() if not 0 <= v["spills"] <= 128}
    assert not spilled, f"ptxas spilled (bytes): {spilled}"


def test_grouped_kernel_with_programmatic_dependent_launch_compiles_with_its_wait(compiled):
    """The ``pdl`` forms of the grouped kernel (an ``mma.sync`` and a wgmma configuration, each after
    the planes and after a sibling launch) compile for sm_90a without spills, and their PTX holds the
    trigger for the next launch and the waits for the one before: after the planes the loader's (before
    its first planes copy), the consumer's and that of a program without a block; a sibling only in
    program (0, 0), after its products or without a block (ptxas may merge those two into one)."""
    from deltafleet.kernels import gluon_grouped as gg

    if not gg.HAVE_GLUON:
        pytest.skip("this triton has no Gluon")
    pdl = {k: v for k, v in compiled.items() if k.startswith("grouped-planes-pdl ")}
    assert len(pdl) == 4 and all("error" not in v for v in pdl.values()), pdl
    assert all(v["report"] and v["spills"] == 0 and v["trigger"] >= 1 for v in pdl.values()), pdl
    for cfg in (gg.CONFIGS[4][0], gg.CONFIGS[16][0]):
        first, sibling = (pdl["grouped-planes-pdl " + json.dumps({"config": list(cfg), "sibling": s})] for s in (False, True))
        assert first["wait"] >= 3 and 1 <= sibling["wait"] <= 2, pdl


def test_decode_chain_kernels_compile_with_their_waits_and_triggers(compiled):
    """kernels/decode_chain.py's kernels compile for sm_90a with programmatic dependent launch at the
    GEMM's ring depth (in shared memory at every x tile), each with one wait for the kernel before and
    one trigger for the next."""
    chain = {k: v for k, v in compiled.items() if k.startswith("chain-")}
    assert len(chain) == 5 and all("error" not in v for v in chain.values()), chain
    assert all(v["wait"] == 1 and v["trigger"] == 1 for v in chain.values()), chain
    assert all(v["shared"] <= SMEM_LIMIT for v in chain.values()), chain
