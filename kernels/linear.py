"""Fused 1-bit delta linear: the contract of docs/kernels.md ("Contract").

``bitdelta_linear`` dispatches to the fastest implementation for its inputs: the Triton custom op
``torch.ops.deltafleet.bitdelta_linear`` (kernels/ops.py) for bf16/fp16 tensors on a CUDA device
when triton is installed; on the CPU the reference's arithmetic with the sign products by byte
tables (kernels/cpu.py), which never unpack the signs; elsewhere the plain-torch reference
(kernels/reference.py). ``bitdelta_linear_batched`` likewise: ``torch.ops.deltafleet.bitdelta_linear_batched``
on CUDA, the byte tables on the CPU, the reference elsewhere. Outside ``torch.compile`` tracing the Triton wrappers are called directly
rather than through the custom ops: the same code, without the dispatcher's Python layers on every
call of an eager engine step (the ops exist for tracing, kernels/ops.py).
"""
from __future__ import annotations

import torch

from deltafleet.kernels import cpu
from deltafleet.kernels.reference import add_sign_products as add_sign_products_reference
from deltafleet.kernels.reference import batched_with, check_stacked
from deltafleet.kernels.reference import bitdelta_linear as bitdelta_linear_reference

_triton_ops = None  # (the two custom ops, the two Triton wrappers) once imported; False without triton


def _ops():
    """The Triton custom ops, imported on first use (CPU-only callers never import triton)."""
    global _triton_ops
    if _triton_ops is None:
        try:
            from deltafleet.kernels.ops import bitdelta_linear_batched_op, bitdelta_linear_op
            from deltafleet.kernels.triton_bitdelta import bitdelta_linear_batched_triton, bitdelta_linear_triton
        except ImportError:
            _triton_ops = False
        else:
            _triton_ops = (bitdelta_linear_op, bitdelta_linear_batched_op, bitdelta_linear_triton,
                           bitdelta_linear_batched_triton)
    return _triton_ops


def _triton(i: int):
    """Custom op ``i`` (0: one variant, 1: batched) while ``torch.compile`` traces, else its wrapper."""
    return _ops()[i] if torch.compiler.is_compiling() else _ops()[i + 2]


def _plain(x: torch.Tensor) -> bool:
    """Whether the non-Triton path is the CPU's byte tables (kernels/cpu.py) rather than the reference."""
    return isinstance(x, torch.Tensor) and x.device.type == "cpu"


def _linear_plain(x, weight, sign, alpha, bias=None, beta=None) -> torch.Tensor:
    return (cpu.bitdelta_linear if _plain(x) else bitdelta_linear_reference)(x, weight, sign, alpha, bias, beta)


def _add_plain(x):
    """The non-Triton ``add_sign_products`` for x: the CPU's byte tables, else the reference's."""
    return cpu.add_sign_products if _plain(x) else add_sign_products_reference


def _batched_plain(x, weight, signs, alphas, slot, bias=None, betas=None) -> torch.Tensor:
    return batched_with(_add_plain(x), x, weight, signs, alphas, slot, bias, betas)


def _on_triton(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor) and x.is_cuda
            and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype and _ops() is not False)


def bitdelta_linear(x: torch.Tensor, weight: torch.Tensor, sign: torch.Tensor, alpha: torch.Tensor,
                    bias: torch.Tensor | None = None, beta: torch.Tensor | None = None) -> torch.Tensor:
    """``y = x · (W + α·(2·bits − 1))ᵀ (+ bias)``: the Triton custom op for bf16/fp16 CUDA tensors
    (when triton is installed), else :func:`deltafleet.kernels.reference.bitdelta_linear` (same arguments,
    shapes and errors). With column scales ``beta`` ``[K]`` (granularity rowcol) the sign product reads
    ``x ⊙ β``: on CUDA through :func:`bitdelta_linear_grouped`, one group of every row."""
    if beta is not None:
        if not (_on_triton(x, weight) and sign.dim() in (2, 4)):
            return _linear_plain(x, weight, sign, alpha, bias, beta)
        x2 = x.reshape(-1, x.shape[-1])
        slot = torch.zeros(x2.shape[0], dtype=torch.int32, device=x.device)
        y = bitdelta_linear_grouped(x2, weight, sign[None], alpha[None] if alpha.dim() else alpha.reshape(1), slot,
                                    bias, betas=beta[None])
        return y.reshape(*x.shape[:-1], y.shape[-1])
    if _on_triton(x, weight):
        return _triton(0)(x, weight, sign, alpha, bias)
    return _linear_plain(x, weight, sign, alpha, bias)


def bitdelta_linear_grouped(x: torch.Tensor, weight: torch.Tensor, signs: torch.Tensor, alphas: torch.Tensor,
                            slot: torch.Tensor, bias: torch.Tensor | None = None, groups=None,
                            betas: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`bitdelta_linear_batched`'s contract with the rows grouped by variant first: the base
    product once (``torch.addmm``), then each variant's sign product over its own rows
    (``deltafleet.kernels.triton_grouped``) for bf16/fp16 CUDA tensors when triton is installed; else the
    reference. ``groups``: ``triton_grouped.group_rows(slot, S)``, computed once by a caller that
    multiplies the same rows by many matrices (an engine step's layers). ``betas``: as in
    :func:`bitdelta_linear_batched`."""
    if _on_triton(x, weight):
        from deltafleet.kernels.triton_grouped import bitdelta_linear_grouped as grouped

        return grouped(x, weight, signs, alphas, slot, bias, groups, betas)
    return _batched_plain(x, weight, signs, alphas, slot, bias, betas)


def bitdelta_linears_grouped(x: torch.Tensor, weight: torch.Tensor, sizes: list[int], signs: list[torch.Tensor],
                             alphas: list[torch.Tensor], slot: torch.Tensor, groups=None) -> torch.Tensor:
    """Matrices that read the same rows (q, k, v; gate, up), their base weights stacked in ``weight``
    ``[ΣN, K]`` (``sizes``: each one's N): ``[M, ΣN]``, column block i being
    :func:`bitdelta_linear_grouped` of matrix i with ``signs[i]``, ``alphas[i]`` (no bias). On CUDA
    (``deltafleet.kernels.triton_grouped``) the base product is one GEMM and the rows' activation
    planes are shared; else the reference, matrix by matrix."""
    if _on_triton(x, weight):
        from deltafleet.kernels.triton_grouped import bitdelta_linears_grouped as grouped

        return grouped(x, weight, sizes, signs, alphas, slot, groups)
    check_stacked(weight, sizes, signs, alphas)
    return torch.cat([_batched_plain(x, w, s, a, slot)
                      for w, s, a in zip(weight.split(list(sizes)), signs, alphas)], 1)


def segments_supported(x: torch.Tensor, weight: torch.Tensor, signs: torch.Tensor) -> bool:
    """Whether :func:`bitdelta_linear_segments` runs as one Hopper kernel for these tensors (Gluon, a
    compute capability 9.x device, bf16/fp16, K a multiple of 128, aligned contiguous rows; signs
    ``[S, N, K/8]`` or tiled ``[S, N/64, K/128, 64, 16]``); elsewhere it loops over the tiles on the host."""
    if not _on_triton(x, weight):
        return False
    from deltafleet.kernels import gluon_prefill_rs

    return gluon_prefill_rs.segments_supported(x, weight, signs)


def bitdelta_linear_segments(x: torch.Tensor, weight: torch.Tensor, signs: torch.Tensor, alphas: torch.Tensor,
                             tiles: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Stretches of rows of one variant each (a step's prompt chunks, sorted by variant), in one
    call: ``y[a:b] = x[a:b] · (W + α_t·(2·bits_t − 1))ᵀ`` for every row ``(a, b, t)`` of ``tiles``
    (int32 ``[T, 3]``: :func:`~deltafleet.kernels.reference.segment_tiles`, at most ``SEGMENT_ROWS``
    rows each; ``t`` −1: the base weight alone, −2 ``ZERO_SLOT``: zeros; ``a ≥ b``: unused), from the
    stacked slots ``signs`` ``[S, N, K/8]`` (or tiled) and ``alphas`` float32 ``[S, N]``; the rows of
    ``y`` (``[M, N]``, ``x.dtype``) in no tile are left as they are. Returns ``y``.

    Where :func:`segments_supported`, the Hopper register-operand kernel, whose tiles share each pass
    over W through L2 (``gluon_prefill_rs.bitdelta_linear_segments_rs``): the FLOPs of one GEMM over
    the rows and W read about once, where one :func:`bitdelta_linear`
    per stretch reads W once per stretch. Else :func:`bitdelta_linear` per tile (the tiles read on
    the host). Trusts its inputs."""
    if segments_supported(x, weight, signs):
        from deltafleet.kernels import gluon_prefill_rs

        return gluon_prefill_rs.bitdelta_linear_segments_rs(x, weight, signs, alphas, tiles, y)
    for a, b, t in tiles.tolist():
        if a < b:
            y[a:b] = (0 if t < -1 else torch.nn.functional.linear(x[a:b], weight) if t < 0
                      else bitdelta_linear(x[a:b], weight, signs[t], alphas[t]))
    return y


def add_sign_products(x: torch.Tensor, signs: torch.Tensor, alphas: torch.Tensor, slot: torch.Tensor,
                      y: torch.Tensor, groups=None, planes: dict | None = None) -> torch.Tensor:
    """The variants' part of :func:`bitdelta_linear_batched`, added in place: ``y[m] += α_t ⊙ (x[m] ·
    S_tᵀ)`` for every row ``m`` of a variant ``t = slot[m]`` (base rows, −1, unchanged), for a ``y``
    ``[M, N]`` that already holds the base product (unit stride along N). Returns ``y``.

    On CUDA (bf16/fp16, triton installed) the grouped sign products of
    ``deltafleet.kernels.triton_grouped`` (``groups``: ``group_rows(slot, S)``, made here if None;
    ``planes``: a dict kept by a caller that adds several matrices' products over the same ``x``
    and ``groups``, so that the rows' activation planes are made once, into it); else the
    reference's sign term, in float32, rounded once into ``y``. Trusts its inputs (the shapes of
    :func:`bitdelta_linear_batched`)."""
    if _on_triton(x, y):
        from deltafleet.kernels.triton_grouped import _add_signs, group_rows

        planes = planes if planes is not None else {}
        # groups made here come just before the launch, which reads them before it waits, unless the
        # planes are made in between: no programmatic dependent launch then
        _add_signs(x if x.stride(-1) == 1 else x.contiguous(), signs,
                   alphas, groups if groups is not None else group_rows(slot, signs.shape[0]), y,
                   planes, pdl=groups is not None or not planes)
        return y
    return _add_plain(x)(x, signs, alphas, slot, y)


def bitdelta_linear_batched(x: torch.Tensor, weight: torch.Tensor, signs: torch.Tensor, alphas: torch.Tensor,
                            slot: torch.Tensor, bias: torch.Tensor | None = None,
                            betas: torch.Tensor | None = None) -> torch.Tensor:
    """Mixed tenants, each row of ``x`` with its own slot's delta (−1: base only): the Triton custom
    op for bf16/fp16 CUDA tensors (when triton is installed), else
    :func:`deltafleet.kernels.reference.bitdelta_linear_batched` (same arguments, shapes and errors; on CUDA
    the slot values are not range-checked, see :func:`deltafleet.kernels.reference.check_batched_args`).
    With column scales ``betas`` ``[S, K]`` (granularity rowcol; ones for a slot without) the sign
    products read ``x ⊙ β_slot``: on CUDA through :func:`bitdelta_linear_grouped`."""
    if betas is not None:
        return bitdelta_linear_grouped(x, weight, signs, alphas, slot, bias, betas=betas)
    if _on_triton(x, weight):
        return _triton(1)(x, weight, signs, alphas, slot, bias)
    return _batched_plain(x, weight, signs, alphas, slot, bias)


__all__ = ["add_sign_products", "bitdelta_linear", "bitdelta_linear_batched", "bitdelta_linear_grouped",
           "bitdelta_linears_grouped", "bitdelta_linear_segments", "segments_supported"]
