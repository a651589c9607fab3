"""``torch.ops.deltafleet.bitdelta_linear`` and ``torch.ops.deltafleet.bitdelta_linear_batched``:
the Triton kernels as torch custom ops.

Registered with fake (meta) implementations so ``torch.compile`` traces through them without
running them and CUDA graphs capture their launches (docs/kernels.md, "Contract"). The fakes check
devices as the kernels do: a meta argument dispatches to them. Importing this module needs triton.
"""
from __future__ import annotations

import torch

from deltafleet.kernels.reference import check_tensors
from deltafleet.kernels.triton_bitdelta import bitdelta_linear_batched_triton, bitdelta_linear_triton


@torch.library.custom_op("deltafleet::bitdelta_linear", mutates_args=())
def bitdelta_linear_op(x: torch.Tensor, weight: torch.Tensor, sign: torch.Tensor, alpha: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """``y = x · (W + α·(2·bits − 1))ᵀ (+ bias)`` by :func:`deltafleet.kernels.triton_bitdelta.bitdelta_linear_triton`.

    Shapes and dtypes as there: x ``[..., K]`` bf16/fp16, weight ``[N, K]``, sign uint8
    ``[N, ceil(K/8)]``, alpha float32 ``[]`` or ``[N]``, bias ``[N]`` → ``[..., N]`` in x's dtype.
    """
    return bitdelta_linear_triton(x, weight, sign, alpha, bias)


@bitdelta_linear_op.register_fake
def _(x, weight, sign, alpha, bias=None):
    check_tensors(x=x, weight=weight, sign=sign, alpha=alpha, bias=bias)  # a meta argument dispatches here
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("deltafleet::bitdelta_linear_batched", mutates_args=())
def bitdelta_linear_batched_op(x: torch.Tensor, weight: torch.Tensor, signs: torch.Tensor, alphas: torch.Tensor,
                               slot: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Mixed tenants by :func:`deltafleet.kernels.triton_bitdelta.bitdelta_linear_batched_triton`: x ``[M, K]``,
    weight ``[N, K]``, signs uint8 ``[S, N, ceil(K/8)]``, alphas float32 ``[S]``/``[S, N]``, slot
    ``[M]`` int (−1: base only), bias ``[N]`` → ``[M, N]`` in x's dtype."""
    return bitdelta_linear_batched_triton(x, weight, signs, alphas, slot, bias)


@bitdelta_linear_batched_op.register_fake
def _(x, weight, signs, alphas, slot, bias=None):
    check_tensors(x=x, weight=weight, signs=signs, alphas=alphas, slot=slot, bias=bias)
    return x.new_empty((x.shape[0], weight.shape[0]))
