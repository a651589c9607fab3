"""Prompt chunks of several variants in one call (``kernels.bitdelta_linear_segments``) against the
float32 reference, row by row with each row's own variant.

On the CPU the tiles are multiplied one by one (the fallback); with ``DELTAFLEET_TRITON_DEVICE=cuda``
(``make test-gpu``) on a Hopper GPU by the Gluon prefill kernel in its tile mode, one launch. Tolerance
as in tests/test_kernels_triton.py: ``W + α·s`` is rounded to the activation dtype once and the sum
once more, so ``atol = c · max|y_ref|`` with c = 2⁻⁶ (bf16) / 2⁻⁹ (fp16); another variant's signs
would miss by far more than that (checked per case).
"""
from __future__ import annotations

import os

import pytest
import torch

DEVICE = os.environ.get("DELTAFLEET_TRITON_DEVICE", "cpu")
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []

from deltafleet.kernels import bitdelta_linear_segments, pack_signs, segments_supported, tile_signs  # noqa: E402
from deltafleet.kernels.reference import (SEGMENT_ROWS, ZERO_SLOT, bitdelta_linear_batched,  # noqa: E402
                                          max_segment_tiles, segment_tiles)

TOL = {torch.bfloat16: 2**-6, torch.float16: 2**-9}


def test_segment_tiles_cut_each_run_in_order():
    runs = [(0, 3, -1), (3, 300, 2), (300, 301, 0), (301, 429, 1)]
    assert segment_tiles(runs, 128) == [(0, 3, -1), (3, 131, 2), (131, 259, 2), (259, 300, 2), (300, 301, 0),
                                        (301, 429, 1)]
    assert segment_tiles([], 128) == []
    assert SEGMENT_ROWS == 128


def test_max_segment_tiles_bounds_every_cut():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        m = int(torch.randint(1, 700, (1,), generator=g))
        cuts = sorted(set(torch.randint(1, m, (int(torch.randint(0, 12, (1,), generator=g)),), generator=g).tolist()))
        edges = [0, *cuts, m]
        runs = [(a, b, i % 3 - 1) for i, (a, b) in enumerate(zip(edges, edges[1:]))]
        tiles = segment_tiles(runs, 64)
        assert len(tiles) <= max_segment_tiles(m, len(runs), 64)
        assert sum(b - a for a, b, _ in tiles) == m and all(0 < b - a <= 64 for a, b, _ in tiles)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("tiled", [True, False], ids=["tiled", "rows"])
def test_segments_match_each_rows_own_variant(dtype, tiled):
    """Rows 0–4 are left to the caller (a step's decode rows); then a base prompt of 130 rows, a prompt
    of one variant (300 rows: three tiles, the last short), one row of another, 129 of a third, and 40
    padding rows (``ZERO_SLOT``). Rows in tiles get ``x·(W + α_t·s_t)ᵀ``, padding zeros, and rows in no
    tile keep what ``y`` held."""
    g = torch.Generator().manual_seed(7)
    n, k, tenants = 192, 256, 4
    runs = [(5, 135, -1), (135, 435, 2), (435, 436, 0), (436, 565, 3), (565, 605, ZERO_SLOT)]
    m = runs[-1][1]
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (0.05 * torch.randn(n, k, generator=g)).to(dtype)
    rows = torch.stack([pack_signs(torch.randn(n, k, generator=g)) for _ in range(tenants)])
    signs = torch.stack([tile_signs(s) for s in rows]) if tiled else rows
    alphas = 0.03 + 0.05 * torch.rand(tenants, n, generator=g)
    slot = torch.full((m,), -1, dtype=torch.int32)
    for a, b, t in runs:
        slot[a:b] = t
    base = slot.clamp(min=-1)
    want = bitdelta_linear_batched(x.float(), w.float(), rows, alphas, base)
    other = bitdelta_linear_batched(x.float(), w.float(), rows, alphas, torch.where(base >= 0, (base + 1) % tenants, base))
    dev = torch.device(DEVICE)
    tiles = torch.tensor(segment_tiles(runs) + [(0, 0, 0), (7, 7, 1)], dtype=torch.int32, device=dev)  # + unused
    y = torch.full((m, n), 3.0, dtype=dtype, device=dev)
    got = bitdelta_linear_segments(x.to(dev), w.to(dev), signs.to(dev), alphas.to(dev), tiles, y).float().cpu()
    assert got is not None and got.shape == (m, n)
    if DEVICE == "cuda":
        assert segments_supported(x.to(dev), w.to(dev), signs.to(dev))
    assert torch.equal(got[:5], torch.full((5, n), 3.0))                 # no tile: untouched
    assert torch.equal(got[565:], torch.zeros(40, n))                   # padding: zeros
    live = slice(5, 565)
    atol = TOL[dtype] * want[live].abs().max().item()
    torch.testing.assert_close(got[live], want[live], rtol=0, atol=atol)
    variant = slot[live] >= 0
    assert (got[live][variant] - other[live][variant]).abs().max() > 10 * atol  # another variant's signs miss


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU fallback's own case")
def test_segments_fall_back_to_one_call_per_tile_off_hopper():
    x, w = torch.randn(4, 16), torch.randn(8, 16)
    signs = torch.stack([pack_signs(torch.randn(8, 16))])
    assert not segments_supported(x, w, signs)
    y = torch.zeros(4, 8)
    tiles = torch.tensor([[0, 4, -1], [4, 4, 0]], dtype=torch.int32)  # the second entry is unused
    torch.testing.assert_close(bitdelta_linear_segments(x, w, signs, torch.ones(1, 8), tiles, y), x @ w.t())
