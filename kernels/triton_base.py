"""The base product ``y = x·Wᵀ`` of a grouped decode batch, by a lean Triton GEMM that runs beside
the sign products.

A grouped mixed batch costs the base GEMM (bound by the bytes of W) plus the sign products (bound by
the instructions that expand the sign bits, :mod:`deltafleet.kernels.gluon_grouped`). In sequence the
two times add up. Launched on two streams they can overlap, but only if the GEMM's blocks find room on
multiprocessors the sign kernel's programs already occupy: this kernel keeps its footprint small for
that (4 warps, a ring of ``STAGES`` weight tiles of ``BLOCK_N × BLOCK_K``, 16 KiB each, and their x
tiles), while still streaming W at the GEMM's bandwidth for the few rows of a decode batch.
``triton_grouped._base_beside_signs`` pairs it with the sign products.

Program ``(m tile, n tile)`` multiplies ``BLOCK_N`` rows of W by ``BLOCK_M`` rows of x over all of K,
with float32 accumulation, and rounds once to ``y``'s dtype; the M tiles of one W tile are adjacent
in the grid, so a W tile read by several of them comes from L2 the second time. Rows of W past N and
of x past M are read modulo N and M (no masked loads) and never stored. K must be a multiple of
``BLOCK_K`` (:func:`supported`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltafleet.kernels.triton_bitdelta import _interpret

BLOCK_N = 64     # weight rows per program: many programs for small N, each a 16 KiB tile per K step
BLOCK_K = 128
STAGES = 4
MAX_BLOCK_M = 64  # x rows per program: a decode batch's rows in one tile up to 64, then tiles of 64
ADD_BLOCK = 2048  # elements per program of add_and_clear


@triton.jit
def _base_mm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                    DOT_FP32: tl.constexpr, HAS_BIAS: tl.constexpr = False, PDL: tl.constexpr = False):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + (offs_n % N).to(tl.int64)[:, None] * stride_wn + offs_k[None, :]    # W tile [BN, BK]
    x_ptrs = x_ptr + (offs_m % M).to(tl.int64)[None, :] * stride_xm + offs_k[:, None]    # xᵀ tile [BK, BM]
    if PDL:  # x comes from the kernel before
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for _ in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        w = tl.load(w_ptrs)
        xt = tl.load(x_ptrs)
        if DOT_FP32:  # the interpreter's half-precision products are not exact
            acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc)
        else:
            acc = tl.dot(w, xt, acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if PDL:  # the next kernel may start on what this one's last tiles leave free
        tl.extra.cuda.gdc_launch_dependents()
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[None, :] * stride_ym + offs_n[:, None]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(offs_m < M)[None, :] & (offs_n < N)[:, None])


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`base_mm` takes these: 2-D, one half-precision dtype, K a non-zero multiple of
    :data:`BLOCK_K`, unit stride along K, on one device."""
    return (x.dim() == 2 and weight.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and x.shape[1] == weight.shape[1] and x.shape[1] > 0
            and x.shape[1] % BLOCK_K == 0 and x.stride(1) == 1 and weight.stride(1) == 1
            and x.device == weight.device)


def base_mm(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None, bias: torch.Tensor | None = None,
            stages: int = STAGES, pdl: bool = False) -> torch.Tensor:
    """``x [M, K] · weight [N, K]ᵀ (+ bias [N])`` into ``out`` (``[M, N]``, x's dtype, unit stride along
    N; a new tensor if None), returned. ``stages``: the ring's depth. ``pdl``: launch with programmatic
    dependent launch (a Hopper GPU): the programs start while the kernel before still runs and wait
    for it before reading x, and let the next kernel start once their products are done
    (``deltafleet.kernels.decode_chain``). Trusts its inputs (:func:`supported`)."""
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    if m == 0 or n == 0:
        return y
    bm = min(MAX_BLOCK_M, max(16, triton.next_power_of_2(m)))
    _base_mm_kernel[(triton.cdiv(m, bm), triton.cdiv(n, BLOCK_N))](
        x, weight, weight if bias is None else bias, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=bm, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, STAGES=stages, DOT_FP32=_interpret(),
        HAS_BIAS=bias is not None, PDL=pdl, num_warps=4, launch_pdl=pdl)
    return y


@triton.jit
def _add_and_clear_kernel(y_ptr, z_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    z = tl.load(z_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    # every warp's loads before any warp's stores: the compiler may give the loads and the stores
    # different layouts (16-byte vectors of bf16 and of float32), so a warp may store elements that
    # another warp has yet to load
    tl.debug_barrier()
    tl.store(y_ptr + offs, (y.to(tl.float32) + z).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(z_ptr + offs, tl.zeros_like(z), mask=mask)


def add_and_clear(y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """``y += z``, the sum in float32 rounded once to y's dtype (as ``y.add_(z)``), and ``z`` left all
    zeros, in one pass: ``z`` is a float32 accumulator kept zeroed between uses, so nothing clears it
    before the next one. ``y`` (half precision) and ``z`` (float32) contiguous, of one shape; returns
    ``y``. Trusts its inputs."""
    n = y.numel()
    if n:
        _add_and_clear_kernel[(triton.cdiv(n, ADD_BLOCK),)](y, z, n, BLOCK=ADD_BLOCK, num_warps=4)
    return y
