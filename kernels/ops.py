"""``torch.ops.deltafleet.bitdelta_linear``: the Triton kernel as a torch custom op.

Registered with a fake (meta) implementation so ``torch.compile`` traces through it without
running it and CUDA graphs capture its launch (ARCHITECTURE.md, "Kernel": "Register them as
torch custom ops"). Importing this module needs triton.
"""
from __future__ import annotations

import torch

from kernels.triton_bitdelta import bitdelta_linear_triton


@torch.library.custom_op("deltafleet::bitdelta_linear", mutates_args=())
def bitdelta_linear_op(x: torch.Tensor, weight: torch.Tensor, sign: torch.Tensor, alpha: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """``y = x · (W + α·(2·bits − 1))ᵀ (+ bias)`` by :func:`kernels.triton_bitdelta.bitdelta_linear_triton`.

    Shapes and dtypes as there: x ``[..., K]`` bf16/fp16, weight ``[N, K]``, sign uint8
    ``[N, ceil(K/8)]``, alpha float32 ``[]`` or ``[N]``, bias ``[N]`` → ``[..., N]`` in x's dtype.
    """
    return bitdelta_linear_triton(x, weight, sign, alpha, bias)


@bitdelta_linear_op.register_fake
def _(x, weight, sign, alpha, bias=None):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
