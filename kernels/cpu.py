"""Sign products on the CPU by byte tables: ``x · Sᵀ`` for ``S = 2·bits − 1`` without unpacking S.

The reference (kernels/reference.py) unpacks a matrix's signs to a float ``[N, K]`` of ±1 and
multiplies: for a decode step's few rows the unpacking, about fifteen bytes moved per weight, costs
many times the product itself. Here each packed byte stays a byte. For rows ``x`` ``[M, K]`` a table
``T[b, v] = Σ_j x[8b + j] · (2·bit_j(v) − 1)`` over the 256 values ``v`` of byte ``b`` (an ``[M, 8]``
by ``[8, 256]`` product per byte) turns the product into a sum of table entries, one per byte of
a sign row: ``(x · Sᵀ)[m, n] = Σ_b T[m, b, packed[n, b]]``, which ``F.embedding_bag`` gathers and
adds in one call. That moves about five bytes per eight weights, whatever M up to
:data:`TABLE_MAX_ROWS` (the table grows with M; past it the reference's unpacking costs less than
the gathers). Values equal the reference's up to the order of the float32 additions.

Used by kernels/linear.py for tensors that no Triton kernel takes (the CPU): the rows of one
variant each call, the signs of that variant only (a slot stack is never unpacked or untiled whole).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from deltafleet.kernels.reference import add_sign_products as reference_add_sign_products
from deltafleet.kernels.reference import linear_with, unpacked_product

TABLE_MAX_ROWS = 64  # rows of one variant up to which the byte tables run (above: unpack, multiply)
_LUTS: dict[torch.device, torch.Tensor] = {}


def _lut(device: torch.device) -> torch.Tensor:
    """float32 ``[256, 8]``: row ``v`` is ``2·bit_j(v) − 1`` for j = 0…7 (bit j LSB first, as packed)."""
    lut = _LUTS.get(device)
    if lut is None:
        with torch.inference_mode(False):  # kept for every later call: autograd may need to save it
            v = torch.arange(256, device=device)[:, None]
            lut = (((v >> torch.arange(8, device=device)) & 1) * 2 - 1).float()
        if type(lut) is torch.Tensor:  # not a fake or traced tensor (shape inference, export)
            _LUTS[device] = lut
    return lut


def sign_product(x: torch.Tensor, packed: torch.Tensor, k: int) -> torch.Tensor:
    """float32 ``x · (2·bits − 1)ᵀ`` ``[M, N]`` for float32 rows ``x`` ``[M, K]`` and packed sign rows
    ``packed`` uint8 ``[N, ceil(K/8)]``: by byte tables up to :data:`TABLE_MAX_ROWS` rows, else as the
    reference (unpack, multiply). Trusts its inputs."""
    m, (n, kp) = x.shape[0], packed.shape
    if m > TABLE_MAX_ROWS or m == 0 or n == 0:
        return unpacked_product(x, packed, k)
    xb = F.pad(x, (0, 8 * kp - k)).view(m, kp, 8)            # zeros past K add nothing
    table = (xb @ _lut(x.device).t()).reshape(m, kp * 256)   # [M, kp·256]: T[m, b, v]
    index = packed.to(torch.int32) + 256 * torch.arange(kp, dtype=torch.int32, device=packed.device)
    if m == 1:  # one row: a gather of scalars, which embedding_bag does one by one
        return table[0].index_select(0, index.reshape(-1)).view(1, n, kp).sum(-1)
    return F.embedding_bag(index, table.t().contiguous(), mode="sum").t()


def add_sign_products(x: torch.Tensor, signs: torch.Tensor, alphas: torch.Tensor, slot: torch.Tensor,
                      y: torch.Tensor, betas: torch.Tensor | None = None) -> torch.Tensor:
    """``reference.add_sign_products`` (same arguments and contract) with :func:`sign_product`."""
    return reference_add_sign_products(x, signs, alphas, slot, y, betas, product=sign_product)


def bitdelta_linear(x: torch.Tensor, weight: torch.Tensor, sign: torch.Tensor, alpha: torch.Tensor,
                    bias: torch.Tensor | None = None, beta: torch.Tensor | None = None) -> torch.Tensor:
    """``reference.bitdelta_linear`` (same arguments, checks and contract) with :func:`sign_product`."""
    return linear_with(sign_product, x, weight, sign, alpha, bias, beta)


__all__ = ["TABLE_MAX_ROWS", "add_sign_products", "bitdelta_linear", "sign_product"]
