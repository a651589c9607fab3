"""The lean base GEMM of grouped decode batches (kernels/triton_base.py) against float64 products.

On the CPU the kernel runs under ``TRITON_INTERPRET=1``; with ``DELTAFLEET_TRITON_DEVICE=cuda``
(``make test-gpu``) on the GPU. The kernel sums in float32 and rounds once to the activation dtype,
so each element must lie within ``c·max|y_ref|`` of the float64 product, c = 2⁻⁶ (bf16) / 2⁻⁹ (fp16)
as tests/test_kernels_grouped.py holds the grouped linear (the interpreter's casts may truncate).
"""
from __future__ import annotations

import os

import pytest
import torch

DEVICE = os.environ.get("DELTAFLEET_TRITON_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []

from deltafleet.kernels.triton_base import BLOCK_K, base_mm, supported  # noqa: E402

TOL = {torch.bfloat16: 2**-6, torch.float16: 2**-9}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("m, n, k", [
    (1, 64, 128),     # one row, one W tile
    (5, 100, 256),    # N ragged: the last tile's rows past N are read modulo N and not stored
    (16, 200, 384),   # three K steps
    (40, 72, 128),    # a 64-row x tile holding 40 rows
    (97, 130, 256),   # two M tiles, the second ragged
])
def test_base_mm_matches_the_float64_product(m, n, k, dtype):
    g = torch.Generator().manual_seed(m * 7 + n + k)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    w = torch.randn(n, k, generator=g).to(dtype).to(DEVICE)
    assert supported(x, w)
    y = base_mm(x, w)
    ref = x.double().cpu() @ w.double().cpu().t()
    assert y.shape == (m, n) and y.dtype == dtype
    torch.testing.assert_close(y.double().cpu(), ref, rtol=0, atol=TOL[dtype] * ref.abs().max().item())


def test_base_mm_writes_into_a_column_block_and_nothing_else():
    """``out`` a column block of a wider output (stride ΣN), as the grouped path passes it: the block
    gets the product, the columns beside it stay as they were."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 256, generator=g).to(torch.bfloat16).to(DEVICE)
    w = torch.randn(72, 256, generator=g).to(torch.bfloat16).to(DEVICE)
    wide = torch.full((9, 200), 7.0, dtype=torch.bfloat16, device=DEVICE)
    base_mm(x, w, out=wide[:, 64:136])
    ref = x.double().cpu() @ w.double().cpu().t()
    torch.testing.assert_close(wide[:, 64:136].double().cpu(), ref, rtol=0,
                               atol=TOL[torch.bfloat16] * ref.abs().max().item())
    assert (wide[:, :64] == 7).all() and (wide[:, 136:] == 7).all()


def test_supported_names_what_the_kernel_takes():
    x = torch.randn(4, 2 * BLOCK_K).to(torch.bfloat16)
    w = torch.randn(8, 2 * BLOCK_K).to(torch.bfloat16)
    assert supported(x, w)
    assert not supported(x.float(), w.float())                          # float32
    assert not supported(x, w.half())                                   # dtypes differ
    assert not supported(x[:, :BLOCK_K + 32], w[:, :BLOCK_K + 32])       # K not a multiple of BLOCK_K
    assert not supported(x[:, :0], w[:, :0])                            # K = 0
    assert not supported(x.t().contiguous().t(), w)                     # x strided along K
    assert not supported(x, w[:, :BLOCK_K])                             # K differs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", [(1, 1), (3, 700), (16, 4100), (64, 12288)],
                         ids=["one", "under-a-block", "ragged-blocks", "qkv-64-rows"])
def test_add_and_clear_adds_as_add_and_leaves_zeros(shape, dtype):
    """``add_and_clear(y, z)`` is ``y.add_(z)`` (float32 sum, rounded once to y's dtype) and leaves
    ``z`` all zeros, also past a ragged last block; nothing outside ``y`` and ``z`` is written. Bit for
    bit on the GPU; the interpreter's cast to bfloat16 truncates, so there a unit in the last place.
    Hundreds of programs (64 rows of a 7B qkv output): without a barrier between the loads and the
    stores, a warp zeroed elements of z that another warp had yet to load (a GPU run lost about one
    element in 6,000)."""
    from deltafleet.kernels.triton_base import add_and_clear

    g = torch.Generator().manual_seed(shape[1])
    n = shape[0] * shape[1]
    y_buf = (torch.randn(n + 8, generator=g) * 4).to(dtype).to(DEVICE)
    z_buf = torch.randn(n + 8, generator=g).to(DEVICE)
    y, z = y_buf[:n].view(shape), z_buf[:n].view(shape)
    want = y.clone().add_(z)
    tail_y, tail_z = y_buf[n:].clone(), z_buf[n:].clone()
    assert add_and_clear(y, z) is y
    exact = DEVICE == "cuda" or dtype == torch.float16
    torch.testing.assert_close(y, want, rtol=0 if exact else 2**-7, atol=0)
    assert torch.count_nonzero(z).item() == 0
    assert torch.equal(y_buf[n:], tail_y) and torch.equal(z_buf[n:], tail_z)
