"""The base rows' kernels of a decode step on a Hopper GPU, chained by programmatic dependent launch.

A decode step of a few base rows is a chain of short kernels: per layer the add + RMSNorm, the q/k/v
GEMM, RoPE and the cache write, the attention, the output GEMM, the add + RMSNorm, the gate/up GEMM,
SiLU·up and the down GEMM. Each GEMM streams its weight (33–180 MB for a 7B layer), but between two
kernels the GPU drains the first and ramps up the second, and at 16–64 rows that costs a few
microseconds a GEMM, hundreds of them a step. Programmatic dependent launch (PDL, sm_90) lets a
kernel's programs start while the kernel before still runs, and wait (``griddepcontrol.wait``)
only before they read its output:

* :func:`add_rms_norm` and :func:`silu_mul` let the next kernel start at once
  (``griddepcontrol.launch_dependents`` first thing), then wait for the kernel before;
* :func:`linear` (``triton_base.base_mm`` with ``pdl``, a ring of :data:`STAGES` weight tiles) waits
  before its first load and lets the next kernel start once its products are done, before its stores.

So the GEMM after a norm is resident, its setup done, when the norm ends, and the norm after a GEMM
is launched during the GEMM's last tiles. Every kernel of the chain waits for the one before before
it ends, so a wait also covers every kernel further back; a kernel launched without PDL (cuBLAS,
FlexAttention, RoPE) waits for the one before to end, as always.

The chain runs only in steps run for CUDA graphs (:func:`in_graphs`: their warm-up and capture,
serve/graphs.py), since launching these Triton kernels from Python costs more host time than cuBLAS
and the compiled functions, which a graph pays once; on a Hopper GPU (:func:`takes`: CUDA capability
9, half precision, up to :data:`MAX_ROWS` rows); with ``DELTAFLEET_DECODE_CHAIN`` not ``0`` (read at
import; to compare, or to debug). Elsewhere the model runs ``F.linear`` (cuBLAS) and its compiled
norm and SiLU·up (serve/model.py). Above :data:`MAX_ROWS` rows the GEMMs are bound by the tensor
cores, where cuBLAS is faster than this Triton GEMM. The norm and SiLU·up round as the model's
compiled functions do: the residual sum once to the activation dtype, the normalised row once before
the weight, ``silu(g)·u`` in float32 once.
"""
from __future__ import annotations

import contextlib
import os
import threading

import torch
import triton
import triton.language as tl

from deltafleet.kernels import triton_base
from deltafleet.kernels.triton_bitdelta import _interpret

CHAIN = os.environ.get("DELTAFLEET_DECODE_CHAIN", "1") != "0"
MAX_ROWS = 64  # rows of a step that the chain takes (its GEMM's x tile)
STAGES = 6     # the GEMM's ring of weight tiles (16 KiB each, and their x tiles)
SILU_BLOCK = 2048  # features per program of silu_mul
_graphs = threading.local()  # .on: this thread runs steps for CUDA graphs (in_graphs)


@contextlib.contextmanager
def in_graphs():
    """The steps run inside (on this thread) take the chain where :func:`takes` allows: a CUDA graph's
    warm-up (which compiles the kernels) and its capture."""
    before = getattr(_graphs, "on", False)
    _graphs.on = True
    try:
        yield
    finally:
        _graphs.on = before


def takes(x: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether the chain runs for activations ``x [..., K]`` (and ``others`` read beside them, of x's
    shape): inside :func:`in_graphs`, on a Hopper GPU (not the interpreter), bf16/fp16, 1 to
    :data:`MAX_ROWS` rows, unit stride along K, with :data:`CHAIN` on."""
    if not (CHAIN and getattr(_graphs, "on", False) and x.is_cuda) or _interpret():
        return False
    if x.dtype not in (torch.bfloat16, torch.float16):
        return False
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not 0 < rows <= MAX_ROWS or any(t.shape != x.shape or t.dtype != x.dtype for t in others):
        return False
    return all(t.stride(-1) == 1 for t in (x, *others)) and torch.cuda.get_device_capability(x.device)[0] == 9


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, pdl: bool = True) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x [..., K]`` by ``triton_base.base_mm`` in the chain, where it
    takes these (``triton_base.supported``, x contiguous); else ``F.linear``."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k) if x.is_contiguous() else None
    if x2 is None or not triton_base.supported(x2, weight) or (bias is not None and bias.stride(0) != 1):
        return torch.nn.functional.linear(x, weight, bias)
    y = triton_base.base_mm(x2, weight, bias=bias, stages=STAGES, pdl=pdl)
    return y.view(*x.shape[:-1], weight.shape[0])


@triton.jit
def _add_rms_norm_kernel(x_ptr, y_ptr, w_ptr, h_ptr, n_ptr, D, eps, stride_x, stride_y,
                         BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    y = tl.load(y_ptr + row * stride_y + offs, mask=mask, other=0.0)
    h = (x.to(tl.float32) + y.to(tl.float32)).to(h_ptr.dtype.element_ty)
    tl.store(h_ptr + row * D + offs, h, mask=mask)
    hf = h.to(tl.float32)
    normed = (hf * tl.rsqrt(tl.sum(hf * hf, 0) / D + eps)).to(h_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(n_ptr + row * D + offs, (w * normed.to(tl.float32)).to(n_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float,
                 pdl: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, weight · h / rms(h))`` for ``h = x + y`` (``[..., D]`` each, one dtype, unit stride along D;
    ``weight [D]``), as serve/model.py's ``add_rms_norm``: one program per row. Trusts its inputs."""
    d = x.shape[-1]
    x2, y2 = x.reshape(-1, d), y.reshape(-1, d)
    h, n = torch.empty_like(x2), torch.empty_like(x2)
    if x2.shape[0]:
        _add_rms_norm_kernel[(x2.shape[0],)](x2, y2, weight, h, n, d, eps, x2.stride(0), y2.stride(0),
                                             BLOCK=triton.next_power_of_2(d), PDL=pdl, num_warps=8,
                                             launch_pdl=pdl)
    return h.view(x.shape), n.view(x.shape)


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, o_ptr, N, stride_g, stride_u, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    mask = offs < N
    g = tl.load(g_ptr + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_ptr + row * N + offs, (g * tl.sigmoid(g) * u).to(o_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, pdl: bool = True) -> torch.Tensor:
    """``silu(gate) · up`` (``[..., F]`` each, one dtype, unit stride along F: the two halves of a fused
    gate/up output may be column views of one tensor), as serve/model.py's ``silu_mul``. Trusts its
    inputs."""
    f = gate.shape[-1]
    g2, u2 = gate.reshape(-1, f), up.reshape(-1, f)
    out = torch.empty(g2.shape, dtype=gate.dtype, device=gate.device)
    if g2.shape[0] and f:
        _silu_mul_kernel[(g2.shape[0], triton.cdiv(f, SILU_BLOCK))](
            g2, u2, out, f, g2.stride(0), u2.stride(0), BLOCK=SILU_BLOCK, PDL=pdl, num_warps=4, launch_pdl=pdl)
    return out.view(*gate.shape[:-1], f)
