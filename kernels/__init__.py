"""Fused 1-bit delta linear: the contract of ARCHITECTURE.md ("Kernel").

``bitdelta_linear`` dispatches to the fastest implementation for its inputs: the Triton custom op
``torch.ops.deltafleet.bitdelta_linear`` (kernels/ops.py) for bf16/fp16 tensors on a CUDA device
when triton is installed, the plain-torch reference (kernels/reference.py) everywhere else.
``bitdelta_linear_batched`` is the reference for now (its Triton kernel is issue 5's next step).
"""
from __future__ import annotations

import torch

from kernels.reference import (
    bitdelta_linear as bitdelta_linear_reference,
    bitdelta_linear_batched,
    pack_signs,
    packed_width,
    reconstruct,
    unpack_bits,
    unpack_signs,
)

_triton_op = None  # kernels.ops.bitdelta_linear_op once imported; False if triton is unavailable


def _op():
    """The Triton custom op, imported on first use (CPU-only callers never import triton)."""
    global _triton_op
    if _triton_op is None:
        try:
            from kernels.ops import bitdelta_linear_op
        except ImportError:
            _triton_op = False
        else:
            _triton_op = bitdelta_linear_op
    return _triton_op


def bitdelta_linear(x: torch.Tensor, weight: torch.Tensor, sign: torch.Tensor, alpha: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """``y = x · (W + α·(2·bits − 1))ᵀ (+ bias)``: the Triton custom op for bf16/fp16 CUDA tensors
    (when triton is installed), else :func:`kernels.reference.bitdelta_linear` (same arguments,
    shapes and errors)."""
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype and _op():
        return _op()(x, weight, sign, alpha, bias)
    return bitdelta_linear_reference(x, weight, sign, alpha, bias)


__all__ = [
    "bitdelta_linear",
    "bitdelta_linear_reference",
    "bitdelta_linear_batched",
    "pack_signs",
    "packed_width",
    "reconstruct",
    "unpack_bits",
    "unpack_signs",
]
