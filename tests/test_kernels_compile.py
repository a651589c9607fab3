"""Every autotuning configuration of every Triton kernel compiles for a Hopper GPU (sm_90a).

The CPU interpreter runs kernels as Python, so it misses what only the compiler sees (a name
defined under one constexpr branch and used under another, shared memory over the limit, a
layout the backend rejects). This compiles each configuration ahead of time with Triton's own
ptxas, for ``cuda:90``, with the argument specialisations a real launch on 16-aligned tensors gets
(``tt.divisibility = 16``). No GPU is needed. The compiles run in one child process, because this
test session imports triton in interpreter mode (tests/conftest.py).
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

CHILD = r'''
import inspect, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import triton_bitdelta as tb

PTR = {"x_ptr": "*bf16", "w_ptr": "*bf16", "s_ptr": "*u8", "a_ptr": "*fp32", "slot_ptr": "*i32",
       "b_ptr": "*bf16", "y_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32"}

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
for cfg in tb._lut_configs():
    for bm in (1, 16):
        out[key("tenants-lut", cfg, {"BLOCK_M": bm})] = build(tb._tenants_kernel, dict(
            ALPHA_PER_ROW=False, HAS_BIAS=False, EVEN=True, DOT_FP32=False, BLOCK_M=bm), cfg)
json.dump(out, sys.stdout)
'''


@pytest.fixture(scope="module")
def compiled() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        if "GPUTarget" in r.stderr or "ASTSource" in r.stderr:
            pytest.skip(f"this triton cannot compile ahead of time: {r.stderr[-300:]}")
        raise AssertionError(f"the compile child failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout)


def test_every_configuration_compiles_for_sm90(compiled):
    from kernels import triton_bitdelta as tb

    n_decode, n_fma = len(tb._decode_configs(False)), len(tb._decode_configs(True))
    assert len(compiled) == 2 * n_decode + n_fma + len(tb._mm_configs()) + 2 * len(tb._lut_configs())
    errors = {k: v["error"] for k, v in compiled.items() if "error" in v}
    assert not errors, "configurations that do not compile:\n" + "\n".join(f"{k}: {e}" for k, e in errors.items())
    too_big = {k: v["shared"] for k, v in compiled.items() if v["shared"] > SMEM_LIMIT}
    assert not too_big, f"over {SMEM_LIMIT} bytes of shared memory: {too_big}"


def test_prefill_and_table_lookup_use_hopper_tensor_cores(compiled):
    for k, v in compiled.items():
        if k.startswith(("prefill", "tenants-lut")):
            assert v["wgmma"], f"{k} compiled without wgmma"
