"""The CPU's sign products by byte tables (kernels/cpu.py) against the plain reference, which unpacks
the signs (kernels/reference.py): odd K (padding bits), both sign layouts, every row count around
the table's limit, column scales, base rows; and the dispatcher (kernels/linear.py) picking them on
the CPU with the reference's checks."""
from __future__ import annotations

import pytest
import torch

from deltafleet.kernels import (add_sign_products, bitdelta_linear, bitdelta_linear_batched, bitdelta_linear_grouped,
                                bitdelta_linears_grouped, tile_signs)
from deltafleet.kernels import cpu, reference


def _signs(s: int, n: int, k: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, (s, n, reference.packed_width(k)), dtype=torch.uint8, generator=g)


@pytest.mark.parametrize("n,k", [(1, 1), (3, 7), (64, 8), (65, 9), (40, 129), (17, 576)])
@pytest.mark.parametrize("m", [1, 3, cpu.TABLE_MAX_ROWS, cpu.TABLE_MAX_ROWS + 1])
def test_the_byte_tables_give_the_unpacked_product(m, n, k):
    """``x · (2·bits − 1)ᵀ`` written plainly: every bit unpacked (LSB first), the bits past K ignored
    whatever they hold (random bytes set them)."""
    g = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    packed = _signs(1, n, k, g)[0]
    x = torch.randn(m, k, generator=g)
    bits = [[(int(packed[r, j // 8]) >> (j % 8)) & 1 for j in range(k)] for r in range(n)]
    want = x.double() @ (2 * torch.tensor(bits, dtype=torch.float64) - 1).t()
    got = cpu.sign_product(x, packed, k)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * k ** 0.5)


@pytest.mark.parametrize("layout", ["rows", "tiled"])
@pytest.mark.parametrize("betas", [False, True])
def test_mixed_rows_match_the_reference(layout, betas):
    """Rows of three variants and of the base in one batch, α per matrix and per row: the dispatcher's
    CPU path equals the reference's (up to float32 summation order), base rows exactly the base product."""
    g = torch.Generator().manual_seed(7)
    s, n, k, m = 3, 70, 200, 12
    x = torch.randn(m, k, generator=g)
    weight = torch.randn(n, k, generator=g)
    signs = _signs(s, n, k, g)
    held = tile_signs(signs) if layout == "tiled" else signs
    slot = torch.tensor([0, -1, 2, 2, 1, -1, 0, 0, 2, 1, -1, 2])
    b = torch.rand(s, k, generator=g) + 0.5 if betas else None
    for alphas in (torch.rand(s, generator=g), torch.rand(s, n, generator=g)):
        want = reference.bitdelta_linear_batched(x, weight, signs, alphas, slot, betas=b)
        got = (bitdelta_linear_grouped(x, weight, held, alphas, slot, betas=b) if betas
               else bitdelta_linear_batched(x, weight, held, alphas, slot))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        base = slot < 0
        assert torch.equal(got[base], (x @ weight.t())[base])
    y = x @ weight.t()
    add_sign_products(x, held, alphas, slot, y)
    torch.testing.assert_close(y, reference.bitdelta_linear_batched(x, weight, signs, alphas, slot), rtol=1e-5,
                               atol=1e-5)
    stacked = torch.cat([weight, weight[:30]])
    got = bitdelta_linears_grouped(x, stacked, [n, 30], [held, held[:, :1] if layout == "tiled" else signs[:, :30]],
                                   [alphas, alphas[:, :30]], slot)
    torch.testing.assert_close(got[:, :n], reference.bitdelta_linear_batched(x, weight, signs, alphas, slot),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[:, n:], reference.bitdelta_linear_batched(x, weight[:30], signs[:, :30],
                                                                            alphas[:, :30], slot), rtol=1e-5, atol=1e-5)


def test_one_variant_matches_the_reference_with_its_checks():
    g = torch.Generator().manual_seed(3)
    n, k = 33, 100
    x, weight = torch.randn(2, 5, k, generator=g), torch.randn(n, k, generator=g)
    sign, alpha, bias, beta = _signs(1, n, k, g)[0], torch.rand(n, generator=g), torch.randn(n, generator=g), None
    want = reference.bitdelta_linear(x, weight, sign, alpha, bias)
    for s in (sign, tile_signs(sign)):
        got = bitdelta_linear(x, weight, s, alpha, bias)
        assert got.shape == (2, 5, n)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    beta = torch.rand(k, generator=g)
    torch.testing.assert_close(bitdelta_linear(x.bfloat16(), weight.bfloat16(), sign, alpha, None, beta).float(),
                               reference.bitdelta_linear(x.bfloat16(), weight.bfloat16(), sign, alpha, None,
                                                         beta).float(), rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match=r"sign must have shape \[33, 13\], got \(33, 12\)"):
        bitdelta_linear(x, weight, sign[:, :12], alpha)
    with pytest.raises(ValueError, match="slot"):
        bitdelta_linear_batched(x[0], weight, sign[None], alpha[None], torch.tensor([0, 1, 0, 0, 0]))


def test_signs_of_another_dtype_are_refused_at_any_row_count():
    """Found by a reviewer: the byte tables never unpack, so the reference's uint8 check (in its
    unpacking) no longer ran for 1–64 rows: int32 signs were read as bytes, silently wrong."""
    g = torch.Generator().manual_seed(5)
    n, k = 8, 16
    weight, sign, alpha = torch.randn(n, k, generator=g), _signs(1, n, k, g)[0], torch.rand(n, generator=g)
    for m in (1, 2, cpu.TABLE_MAX_ROWS + 1):
        for dtype in (torch.int32, torch.int8, torch.float32):
            with pytest.raises(ValueError, match=f"packed signs must be uint8, got {dtype}"):
                bitdelta_linear(torch.randn(m, k, generator=g), weight, sign.to(dtype), alpha)


def test_the_byte_table_is_not_kept_from_a_fake_tensor_run():
    """Found by a reviewer: a first call under FakeTensorMode (shape inference) cached a fake table,
    and every later eager call returned fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cpu._LUTS.clear()
    x, packed = torch.randn(2, 16), torch.randint(0, 256, (4, 2), dtype=torch.uint8)
    with FakeTensorMode(allow_non_fake_inputs=True):
        cpu.sign_product(x, packed, 16)
    assert type(cpu.sign_product(x, packed, 16)) is torch.Tensor


@pytest.mark.parametrize("m", [1, 3])
def test_sign_rows_that_are_not_contiguous_match_the_reference(m):
    """Packed sign rows with column-major strides (a transposed copy, as a slice or a permuted layout
    gives) are read as the reference reads them, for one row (a gather through the byte table) and for
    a variant holding one row of a batch."""
    g = torch.Generator().manual_seed(m)
    s, n, k = 3, 24, 40
    w = torch.randn(n, k, generator=g)
    signs = _signs(s, n, k, g)
    strided = signs.transpose(1, 2).contiguous().transpose(1, 2)
    alphas = torch.rand(s, n, generator=g)
    x = torch.randn(m, k, generator=g)
    torch.testing.assert_close(bitdelta_linear(x, w, strided[0], alphas[0]),
                               reference.bitdelta_linear(x, w, signs[0], alphas[0]))
    slot = torch.tensor([0, -1, 2, 2], dtype=torch.int32)  # variant 0 holds one row
    x4 = torch.randn(4, k, generator=g)
    torch.testing.assert_close(bitdelta_linear_batched(x4, w, strided, alphas, slot),
                               reference.bitdelta_linear_batched(x4, w, signs, alphas, slot))


def test_a_byte_table_built_in_inference_mode_still_serves_autograd():
    """Found by a reviewer: the cached ±1 byte table was built under the server's
    ``torch.inference_mode()`` on its first use, and every later call whose x requires grad failed
    ("Inference tensors cannot be saved for backward"). The table is a normal tensor whatever
    mode first builds it."""
    g = torch.Generator().manual_seed(0)
    n, k = 5, 16
    w, s = torch.randn(n, k, generator=g), torch.randn(n, k, generator=g)
    sign, alpha = reference.pack_signs(s), torch.tensor(0.1)
    saved = dict(cpu._LUTS)
    cpu._LUTS.clear()
    try:
        with torch.inference_mode():
            bitdelta_linear(torch.randn(2, k, generator=g), w, sign, alpha)
        x = torch.randn(2, k, generator=g, requires_grad=True)
        y = bitdelta_linear(x, w, sign, alpha)
        y.sum().backward()
    finally:
        cpu._LUTS.clear()
        cpu._LUTS.update(saved)
    w_eff = w.double() + 0.1 * torch.where(s > 0, 1.0, -1.0).double()  # Δ > 0: bit 1
    torch.testing.assert_close(y.double(), x.detach().double() @ w_eff.t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), w_eff.sum(0).expand(2, k), rtol=1e-5, atol=1e-5)


def test_column_scales_on_meta_are_refused_by_name():
    """Found by a reviewer: ``beta`` / ``betas`` were not among the checked arguments, so one on the
    meta device reached the arithmetic and torch's RuntimeError named nothing. A ValueError names it,
    as for every other argument."""
    n, k = 5, 16
    x, w = torch.randn(3, k), torch.randn(n, k)
    sign = reference.pack_signs(torch.randn(n, k))
    with pytest.raises(ValueError, match="^beta is on the meta device"):
        bitdelta_linear(x, w, sign, torch.tensor(0.1), beta=torch.ones(k, device="meta"))
    with pytest.raises(ValueError, match="^betas is on the meta device"):
        bitdelta_linear_batched(x, w, sign[None], torch.ones(1), torch.tensor([0, -1, 0]),
                                betas=torch.ones(1, k, device="meta"))
