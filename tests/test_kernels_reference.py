"""The plain-torch reference kernels (kernels/reference.py) against independent dense math.

The reference defines the semantics every fast kernel must match, so it is checked here against
hand-built bit layouts and a dense ``x @ (W + α·sign(Δ)).T`` written without the packed format.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deltafleet.kernels import (
    bitdelta_linear,
    bitdelta_linear_batched,
    pack_signs,
    packed_width,
    reconstruct,
    unpack_bits,
    unpack_signs,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _delta(n: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random Δ with exact zeros mixed in (Δ == 0 must pack to bit 0, i.e. −α)."""
    g = torch.Generator().manual_seed(seed)
    d = torch.randn(n, k, generator=g)
    d[torch.rand(n, k, generator=g) < 0.2] = 0.0
    return d.to(dtype)


def _dense_sign(delta: torch.Tensor) -> torch.Tensor:
    """+1 where Δ > 0, −1 elsewhere (Δ == 0 included), in float32 — the contract, spelled out."""
    return torch.where(delta.float() > 0, 1.0, -1.0)


# --------------------------------------------------------------------------------------------
# pack / unpack
# --------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 12),
    k=st.integers(1, 70),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31 - 1),
)
def test_pack_unpack_round_trip(n, k, dtype, seed):
    delta = _delta(n, k, dtype, seed)
    packed = pack_signs(delta)
    assert packed.dtype == torch.uint8
    assert packed.shape == (n, packed_width(k)) == (n, (k + 7) // 8)
    assert torch.equal(unpack_bits(packed, k), (delta > 0).to(torch.uint8))
    assert torch.equal(unpack_signs(packed, k), _dense_sign(delta))
    assert unpack_signs(packed, k, dtype).dtype == dtype
    # pad bits past K are 0
    pad = packed_width(k) * 8 - k
    if pad:
        last = packed[:, -1].to(torch.int32)
        assert torch.all(last >> (8 - pad) == 0)


def test_pack_exact_bit_layout():
    # Row 0: signs + − 0 + + − − + | + (K = 9: one full byte, one byte with 7 pad bits)
    # Row 1: all ≤ 0 except the last column.
    delta = torch.tensor(
        [
            [0.5, -1.0, 0.0, 2.0, 1e-3, -0.0, -3.0, 7.0, 4.0],
            [-1.0, -1.0, 0.0, -2.0, -1e-3, 0.0, -3.0, -7.0, 0.25],
        ]
    )
    # bit j of byte b (LSB first) = Δ[r, 8b + j] > 0
    row0_byte0 = 0b1001_1001  # bits 0, 3, 4, 7 → 1 + 8 + 16 + 128 = 153
    expected = torch.tensor([[row0_byte0, 0b1], [0, 0b1]], dtype=torch.uint8)
    assert torch.equal(pack_signs(delta), expected)
    assert pack_signs(delta)[0, 0].item() == 153
    row0_bits = torch.tensor([1, 0, 0, 1, 1, 0, 0, 1, 1], dtype=torch.uint8)
    assert torch.equal(unpack_bits(expected, 9)[0], row0_bits)
    # K a multiple of 8: no pad byte
    assert pack_signs(torch.ones(1, 16)).tolist() == [[255, 255]]
    assert pack_signs(-torch.ones(3, 8)).tolist() == [[0], [0], [0]]


def test_reconstruct_matches_dense():
    w = torch.randn(5, 19)
    delta = _delta(5, 19, torch.float32, 1)
    sign = pack_signs(delta)
    for alpha in (torch.tensor(0.03), torch.rand(5)):
        a = alpha.reshape(-1, 1) if alpha.dim() else alpha
        torch.testing.assert_close(reconstruct(w, sign, alpha), w + a * _dense_sign(delta), rtol=0, atol=0)


def test_pack_unpack_errors():
    with pytest.raises(ValueError, match="2-D"):
        pack_signs(torch.randn(8))
    with pytest.raises(ValueError, match="floating"):
        pack_signs(torch.ones(2, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="uint8"):
        unpack_bits(torch.zeros(2, 1, dtype=torch.int32), 8)
    with pytest.raises(ValueError, match=r"ceil\(9/8\) = 2"):
        unpack_bits(torch.zeros(2, 1, dtype=torch.uint8), 9)
    with pytest.raises(ValueError, match="≥ 1"):
        packed_width(0)


# --------------------------------------------------------------------------------------------
# bitdelta_linear
# --------------------------------------------------------------------------------------------

N, K = 6, 19  # K not a multiple of 8


def _problem(seed: int = 0, row_alpha: bool = False):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g)
    delta = _delta(N, K, torch.float32, seed + 100)
    alpha = torch.rand(N, generator=g) * 0.1 if row_alpha else torch.tensor(0.05)
    bias = torch.randn(N, generator=g)
    return w, delta, alpha, bias


def _dense(x, w, delta, alpha, bias=None):
    a = alpha.reshape(-1, 1) if alpha.dim() else alpha
    y = x.float() @ (w.float() + a * _dense_sign(delta)).T
    return y if bias is None else y + bias.float()


@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("row_alpha", [False, True], ids=["matrix", "row"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_bitdelta_linear_matches_dense(m, row_alpha, with_bias):
    w, delta, alpha, bias = _problem(m, row_alpha)
    x = torch.randn(m, K)
    b = bias if with_bias else None
    y = bitdelta_linear(x, w, pack_signs(delta), alpha, b)
    assert y.shape == (m, N) and y.dtype == torch.float32
    torch.testing.assert_close(y, _dense(x, w, delta, alpha, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_bitdelta_linear_half_inputs(dtype):
    w, delta, alpha, bias = _problem(7, row_alpha=True)
    x = torch.randn(3, K).to(dtype)
    y = bitdelta_linear(x, w.to(dtype), pack_signs(delta), alpha, bias.to(dtype))
    assert y.dtype == dtype
    ref = _dense(x, w.to(dtype), delta, alpha, bias.to(dtype))
    tol = 1e-2 if dtype == torch.float16 else 5e-2  # one rounding of the float32 result
    torch.testing.assert_close(y.float(), ref, rtol=tol, atol=tol)


def test_bitdelta_linear_errors():
    w, delta, alpha, _ = _problem()
    sign = pack_signs(delta)
    with pytest.raises(ValueError, match=f"x has {K + 1} features"):
        bitdelta_linear(torch.randn(2, K + 1), w, sign, alpha)
    with pytest.raises(ValueError, match=r"sign must have shape \[6, 3\]"):
        bitdelta_linear(torch.randn(2, K), w, sign[:, :2], alpha)
    with pytest.raises(ValueError, match=r"sign must have shape"):
        bitdelta_linear(torch.randn(2, K), w, sign[:5], alpha)
    with pytest.raises(ValueError, match=r"alpha must have shape \[\] or \[6\]"):
        bitdelta_linear(torch.randn(2, K), w, sign, torch.rand(5))
    with pytest.raises(ValueError, match="alpha must be a torch.Tensor, got float"):
        bitdelta_linear(torch.randn(2, K), w, sign, 0.5)
    with pytest.raises(ValueError, match="x must be a floating-point tensor, got torch.int64"):
        bitdelta_linear(torch.ones(2, K, dtype=torch.long), w, sign, alpha)
    with pytest.raises(ValueError, match="weight has 0 input features; K must be ≥ 1"):
        bitdelta_linear(torch.randn(2, 0), torch.randn(6, 0), sign[:, :0], alpha)
    with pytest.raises(ValueError, match=r"x must have a feature dimension \(\[..., K\]\), got a 0-D tensor"):
        bitdelta_linear(torch.tensor(1.0), w, sign, alpha)
    from deltafleet import kernels  # the public dispatcher reads x before the reference checks it

    with pytest.raises(ValueError, match="x must be a torch.Tensor, got list"):
        kernels.bitdelta_linear([[1.0] * K], w, sign, alpha)
    with pytest.raises(ValueError, match="weight is on meta but x is on cpu"):
        kernels.bitdelta_linear(torch.randn(2, K), w.to("meta"), sign, alpha)
    with pytest.raises(ValueError, match=r"alpha is on the meta device \(no data\) but x is on cpu"):
        kernels.bitdelta_linear(torch.randn(2, K), w, sign, alpha.to("meta"))
    with pytest.raises(ValueError, match="x must be a torch.Tensor, got NoneType"):
        kernels.bitdelta_linear(None, w, sign, alpha)


# --------------------------------------------------------------------------------------------
# bitdelta_linear_batched
# --------------------------------------------------------------------------------------------

S = 3


def _batched_problem(row_alpha: bool):
    g = torch.Generator().manual_seed(11)
    w = torch.randn(N, K, generator=g)
    deltas = [_delta(N, K, torch.float32, 200 + s) for s in range(S)]
    signs = torch.stack([pack_signs(d) for d in deltas])
    alphas = torch.rand(S, N, generator=g) * 0.1 if row_alpha else torch.rand(S, generator=g) * 0.1
    return w, deltas, signs, alphas


@pytest.mark.parametrize("row_alpha", [False, True], ids=["matrix", "row"])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_batched_matches_per_row_loop(row_alpha, slot_dtype):
    w, deltas, signs, alphas = _batched_problem(row_alpha)
    bias = torch.randn(N)
    slot = torch.tensor([0, -1, 2, 0, 1, -1, 2, 2], dtype=slot_dtype)
    x = torch.randn(len(slot), K)
    y = bitdelta_linear_batched(x, w, signs, alphas, slot, bias)
    assert y.shape == (len(slot), N)
    for m, s in enumerate(slot.tolist()):
        if s < 0:
            ref = x[m : m + 1] @ w.T + bias  # base only
        else:
            ref = bitdelta_linear(x[m : m + 1], w, signs[s], alphas[s], bias)
            dense = _dense(x[m : m + 1], w, deltas[s], alphas[s], bias)
            torch.testing.assert_close(ref, dense, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(y[m : m + 1], ref, rtol=1e-5, atol=1e-5)


def test_batched_all_base_and_empty():
    w, _, signs, alphas = _batched_problem(False)
    x = torch.randn(4, K)
    y = bitdelta_linear_batched(x, w, signs, alphas, torch.full((4,), -1, dtype=torch.int32))
    torch.testing.assert_close(y, x @ w.T)
    empty = bitdelta_linear_batched(torch.randn(0, K), w, signs, alphas, torch.zeros(0, dtype=torch.int32))
    assert empty.shape == (0, N)


def test_batched_errors():
    w, _, signs, alphas = _batched_problem(False)
    x = torch.randn(3, K)
    ok = torch.tensor([0, 1, -1], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"slot indices must lie in \[-1, 3\)"):
        bitdelta_linear_batched(x, w, signs, alphas, torch.tensor([0, 3, -1], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"slot indices must lie in \[-1, 3\)"):
        bitdelta_linear_batched(x, w, signs, alphas, torch.tensor([0, -2, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"slot must be \[3\]"):
        bitdelta_linear_batched(x, w, signs, alphas, ok[:2])
    with pytest.raises(ValueError, match=r"x must be \[M, 19\]"):
        bitdelta_linear_batched(torch.randn(3, K - 1), w, signs, alphas, ok)
    with pytest.raises(ValueError, match=r"signs must be \[S, 6, 3\]"):
        bitdelta_linear_batched(x, w, signs[:, :, :2], alphas, ok)
    with pytest.raises(ValueError, match=r"alphas must be \[3\] or \[3, 6\]"):
        bitdelta_linear_batched(x, w, signs, torch.rand(S, N + 1), ok)
    with pytest.raises(ValueError, match=r"signs must be \[S, 6, 3\] or tiled \(5-D\), got \(\)"):
        bitdelta_linear_batched(x, w, signs[0, 0, 0], alphas, ok)
    with pytest.raises(ValueError, match="slot must be a torch.Tensor, got list"):
        bitdelta_linear_batched(x, w, signs, alphas, [0, 1, -1])
    with pytest.raises(ValueError, match="bias must be a torch.Tensor, got float"):
        bitdelta_linear_batched(x, w, signs, alphas, ok, bias=0.5)
    # a CPU product with a meta tensor returns uninitialised memory instead of raising: refused first
    with pytest.raises(ValueError, match="signs is on meta but x is on cpu: x, weight and the signs must be on one"):
        bitdelta_linear_batched(x, w, signs.to("meta"), alphas, ok)
    with pytest.raises(ValueError, match=r"slot is on the meta device \(no data\) but x is on cpu"):
        bitdelta_linear_batched(x, w, signs, alphas, ok.to("meta"))
    with pytest.raises(ValueError, match="weight must be a torch.Tensor, got NoneType"):
        bitdelta_linear_batched(x, None, signs, alphas, ok)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 12),
    k=st.integers(1, 70),
    dtype=st.sampled_from(DTYPES),
    row_alpha=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_reconstruct_over_shapes_and_dtypes(n, k, dtype, row_alpha, seed):
    """reconstruct(W, pack(Δ), α) = W + α·(±1) elementwise, computed in float32, for any shape."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).to(dtype)
    delta = _delta(n, k, dtype, seed)
    alpha = torch.rand(n, generator=g) if row_alpha else torch.rand((), generator=g)
    got = reconstruct(w, pack_signs(delta), alpha)
    sign = torch.where(delta.float() > 0, 1.0, -1.0)
    a = alpha[:, None] if row_alpha else alpha
    assert got.shape == (n, k)
    torch.testing.assert_close(got.float(), w.float() + a * sign, rtol=0, atol=0)


def test_column_scales_equal_the_reconstructed_weight():
    """``bitdelta_linear(…, beta)`` (granularity rowcol) is ``x · (W + diag(α)·S·diag(β))ᵀ``, for one
    variant and through the dispatching entry point; a β of the wrong length is named."""
    from deltafleet.kernels import bitdelta_linear as dispatched

    g = torch.Generator().manual_seed(3)
    n, k = 24, 37
    w, d = torch.randn(n, k, generator=g), torch.randn(n, k, generator=g)
    sign, alpha, beta = pack_signs(d), torch.rand(n, generator=g), 0.5 + torch.rand(k, generator=g)
    x, bias = torch.randn(2, 5, k, generator=g), torch.randn(n, generator=g)
    want_w = w + alpha[:, None] * beta[None, :] * torch.where(d > 0, 1.0, -1.0)
    torch.testing.assert_close(reconstruct(w, sign, alpha, beta), want_w)
    for fn in (bitdelta_linear, dispatched):
        torch.testing.assert_close(fn(x, w, sign, alpha, bias, beta), x @ want_w.t() + bias, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"beta must have shape \[37\], got \(36,\)"):
        bitdelta_linear(x, w, sign, alpha, None, beta[:-1])
