"""The grouped mixed-variant linear (kernels/triton_grouped.py) against the float32 reference.

On the CPU the kernel runs under ``TRITON_INTERPRET=1``; with ``DELTAFLEET_TRITON_DEVICE=cuda``
(``make test-gpu``) every case runs on the GPU. Tolerance as in tests/test_kernels_triton.py: the
base product is rounded to the activation dtype once and the sum once more, so ``atol = c ·
max|y_ref|`` with c = 2⁻⁶ (bf16) / 2⁻⁹ (fp16); each case also checks that every row used its own
variant (another variant's signs would miss by far more than that).
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

from deltafleet import kernels  # noqa: E402
from deltafleet.kernels import pack_signs, tile_signs  # noqa: E402
from deltafleet.kernels.reference import bitdelta_linear_batched  # noqa: E402
from deltafleet.kernels.triton_grouped import (BLOCK_M, bitdelta_linear_grouped, bitdelta_linears_grouped,  # noqa: E402
                                               group_rows, grouped_block_m, grouped_long_m, max_blocks)

TOL = {torch.bfloat16: 2**-6, torch.float16: 2**-9}


def _zipf_slots(m: int, tenants: int, g: torch.Generator) -> torch.Tensor:
    """Rows over the base (−1) and ``tenants`` variants with Zipf(1) popularity, shuffled."""
    p = 1.0 / torch.arange(1, tenants + 2, dtype=torch.float64)
    return (torch.multinomial(p, m, replacement=True, generator=g) - 1).to(torch.int32)


def _rows_over_variants(g: torch.Generator, m: int, n: int, k: int, tenants: int, dtype: torch.dtype):
    """``(x [M, K], W [N, K], signs [T, N, K/8], α [T, N], slots [M])``: random rows Zipf(1)-spread
    over the base and ``tenants`` variants."""
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (0.05 * torch.randn(n, k, generator=g)).to(dtype)
    signs = torch.stack([pack_signs(torch.randn(n, k, generator=g)) for _ in range(tenants)])
    alphas = 0.03 + 0.05 * torch.rand(tenants, n, generator=g)
    return x, w, signs, alphas, _zipf_slots(m, tenants, g)


SLOTS = {
    "zipf": lambda m, t, g: _zipf_slots(m, t, g),
    "own": lambda m, t, g: torch.arange(m, dtype=torch.int32) % t,           # every row its own variant (m ≤ t)
    "one": lambda m, t, g: torch.full((m,), t - 1, dtype=torch.int32),        # all rows one variant
    "base": lambda m, t, g: torch.full((m,), -1, dtype=torch.int32),          # no variant at all
    "gap": lambda m, t, g: torch.randint(0, 2, (m,), generator=g, dtype=torch.int32) * (t - 1),  # variants 1…t−2 absent
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m, n, k, tenants, slots, tiled, row_alpha, bias", [
    (37, 130, 260, 4, "zipf", True, True, False),    # ragged N and K, groups over one block of 16
    (14, 64, 128, 14, "own", True, False, True),     # every row its own variant, matrix α, bias
    (40, 72, 200, 3, "one", False, True, False),     # one variant over three blocks, sign rows
    (5, 40, 72, 3, "base", True, True, True),        # base rows only: the base product alone
    (33, 96, 384, 6, "gap", False, False, False),    # empty groups between the present ones
    (2, 20, 13, 2, "zipf", False, True, True),       # K < 16, two rows
])
def test_grouped_matches_reference(dtype, m, n, k, tenants, slots, tiled, row_alpha, bias):
    g = torch.Generator().manual_seed(m * 31 + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (0.05 * torch.randn(n, k, generator=g)).to(dtype)
    signs = torch.stack([pack_signs(torch.randn(n, k, generator=g)) for _ in range(tenants)])
    alphas = (0.03 + 0.05 * torch.rand(tenants, n, generator=g)) if row_alpha else 0.03 + 0.05 * torch.rand(tenants, generator=g)
    slot = SLOTS[slots](m, tenants, g)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    ref = bitdelta_linear_batched(x.float(), w.float(), signs, alphas, slot, None if b is None else b.float())
    held = tile_signs(signs) if tiled else signs
    y = bitdelta_linear_grouped(*(t.to(DEVICE) if t is not None else None for t in (x, w, held, alphas, slot, b)))
    assert y.shape == (m, n) and y.dtype == dtype
    atol = TOL[dtype] * ref.abs().max().item()
    torch.testing.assert_close(y.float().cpu(), ref, rtol=0, atol=atol)
    rows = slot >= 0
    if tenants > 1 and rows.any():  # each row used its own variant's signs
        swapped = bitdelta_linear_batched(x.float(), w.float(), signs.flip(0), alphas.flip(0), slot,
                                          None if b is None else b.float())
        assert (swapped[rows] - y.float().cpu()[rows]).abs().max() > 4 * atol


@pytest.mark.parametrize("block_m, long_m", [(4, None), (8, None), (32, None), (64, None), (16, 32), (16, 64)])
def test_groups_of_other_blocks_multiply_every_row(block_m, long_m):
    """Rows grouped in blocks of ``block_m`` (32 or 64: a step of a long prompt; 4 or 8: a Hopper decode
    step, which the Triton kernel multiplies as blocks of 16 with most of their rows dead), or with the
    run's whole ``long_m`` blocks first (two launches): one variant's run of 150 rows beside Zipf
    rows; none is dropped or counted twice, and each row has its own variant."""
    g = torch.Generator().manual_seed(block_m + (long_m or 0))
    m, n, k, tenants, dtype = 190, 96, 256, 4, torch.bfloat16
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (0.05 * torch.randn(n, k, generator=g)).to(dtype)
    signs = torch.stack([pack_signs(torch.randn(n, k, generator=g)) for _ in range(tenants)])
    alphas = 0.03 + 0.05 * torch.rand(tenants, n, generator=g)
    slot = torch.cat([torch.full((150,), 2, dtype=torch.int32), _zipf_slots(m - 150, tenants, g)])
    slot = slot[torch.randperm(m, generator=g)]  # the run's rows spread over the batch
    groups = group_rows(slot.to(DEVICE), tenants, block_m, long_m)
    if long_m is None:
        assert groups.block_m == block_m and groups.max_blocks == max_blocks(m, tenants, block_m)
    else:
        assert int((groups.long.first < m).sum()) == int((torch.bincount(slot[slot >= 0]) // long_m).sum())
    ref = bitdelta_linear_batched(x.float(), w.float(), signs, alphas, slot)
    y = bitdelta_linear_grouped(*(t.to(DEVICE) for t in (x, w, tile_signs(signs), alphas, slot)), groups=groups)
    atol = TOL[dtype] * ref.abs().max().item()
    torch.testing.assert_close(y.float().cpu(), ref, rtol=0, atol=atol)
    swapped = bitdelta_linear_batched(x.float(), w.float(), signs.flip(0), alphas.flip(0), slot)
    rows = slot >= 0
    assert (swapped[rows] - y.float().cpu()[rows]).abs().max() > 4 * atol


def test_group_rows_sorts_stably_and_cuts_blocks_of_block_m():
    slot = torch.tensor([2, -1, 0, 2, 2, 0, 7, 2, 2])
    gr = group_rows(slot, 3, block_m=2)
    # variant 0: rows 2, 5; variant 2: rows 0, 3, 4, 7, 8; the base (−1) and the out-of-range 7 last
    assert gr.order.tolist() == [2, 5, 0, 3, 4, 7, 8, 1, 6]
    assert gr.key.tolist() == [0, 0, 2, 2, 2, 2, 2, 3, 3]
    assert gr.first.tolist() == [0, 2, 4, 6, 9, 9, 9, 9]  # blocks {2,5} {0,3} {4,7} {8}, then unused
    assert gr.max_blocks == max_blocks(9, 3, 2) == 8  # ceil(9 / 2) + 3


def test_group_rows_cuts_whole_long_blocks_first():
    """With ``long_m`` each run's leading whole blocks of ``long_m`` rows are groups of their own and
    only its rest is cut into blocks of ``block_m``."""
    slot = torch.tensor([1] * 37 + [-1] * 2 + [0] * 20 + [1] * 2)
    gr = group_rows(slot, 2, block_m=8, long_m=16)
    # sorted: variant 0 rows 0–19 (20 rows), variant 1 rows 20–58 (39), the base 59–60
    assert gr.long.first.tolist() == [0, 20, 36]  # M // 16 entries: 0–15; 20–35 and 36–51
    assert gr.long.block_m == 16 and gr.long.order is gr.order and gr.long.key is gr.key
    assert gr.first.tolist() == [16, 52, 61, 61]  # the rests 16–19 and 52–58
    assert gr.max_blocks == max_blocks(61, 2, 8, 16) == 4  # a rest of < 16 rows: 2 blocks per variant
    assert [p.block_m for p in gr.parts()] == [16, 8]
    assert group_rows(slot, 2, block_m=8).long is None
    short = group_rows(slot[:10], 2, block_m=8, long_m=16)  # fewer rows than one long block
    assert short.long is None and short.max_blocks == max_blocks(10, 2, 8, 16)
    for bad in (4, 12):  # under the Triton kernel's 16-row tile; not whole blocks of 8
        with pytest.raises(ValueError, match=f"long_m must be a multiple of block_m \\(8\\) and at least 16, got {bad}"):
            group_rows(slot, 2, block_m=8, long_m=bad)


def test_grouped_block_m_is_16_off_hopper():
    """Blocks of 8 are for the Hopper kernel's mma.sync path only; the CPU (and the interpreter) group by 16."""
    assert [grouped_block_m(m, "cpu", prefill) for m in (1, 64, 65, 256) for prefill in (False, True)] == [BLOCK_M] * 8
    assert [grouped_long_m(m, "cpu") for m in (64, 128, 2048)] == [None] * 3  # long blocks: the Hopper kernel's


def test_max_blocks_bounds_every_grouping():
    g = torch.Generator().manual_seed(0)
    for m in (1, 15, 16, 17, 64, 255):
        for tenants in (1, 4, 14):
            slot = _zipf_slots(m, tenants, g)
            counts = torch.bincount(slot[slot >= 0].long(), minlength=tenants)
            needed = int(((counts + BLOCK_M - 1) // BLOCK_M).sum())
            gr = group_rows(slot, tenants)
            assert int((gr.first < m).sum()) == needed <= gr.max_blocks
            # with long blocks of 32: the runs' whole 32s, then their rests in 16s
            gr = group_rows(slot, tenants, BLOCK_M, 32) if m >= 32 else None
            if gr is not None:
                assert int((gr.long.first < m).sum()) == int((counts // 32).sum()) <= gr.long.max_blocks
                rest = counts % 32
                assert int((gr.first < m).sum()) == int(((rest + BLOCK_M - 1) // BLOCK_M).sum()) <= gr.max_blocks


def test_grouped_contract_errors():
    x = torch.randn(2, 16).bfloat16()
    w = torch.randn(8, 16).bfloat16()
    signs = torch.zeros(2, 8, 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"slot indices must lie in \[-1, 2\), got \[-1, 2\]"):
        bitdelta_linear_grouped(x, w, signs, torch.ones(2), torch.tensor([-1, 2]))
    with pytest.raises(ValueError, match=r"alphas must be \[2\] or \[2, 8\]"):
        bitdelta_linear_grouped(x, w, signs, torch.ones(3), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="signs must be uint8"):
        bitdelta_linear_grouped(x, w, signs.int(), torch.ones(2), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="x and weight must share a floating dtype"):
        bitdelta_linear_grouped(x, w.half(), signs, torch.ones(2), torch.tensor([0, 1]))
    # signs of another dtype are refused by every implementation even where no row reads them (the
    # plain-torch reference, which the public entries take on the CPU, once computed the base)
    base_rows = torch.tensor([-1, -1])
    for fn in (bitdelta_linear_grouped, kernels.bitdelta_linear_grouped, kernels.bitdelta_linear_batched,
               bitdelta_linear_batched):
        with pytest.raises(ValueError, match="^signs must be uint8, got torch.float32$"):
            fn(x, w, signs.float(), torch.ones(2), base_rows)


@pytest.mark.parametrize("tiled", [True, False])
def test_column_scales_multiply_each_rows_own_input(tiled):
    """Granularity rowcol: the sign product of a row reads ``x ⊙ β`` of the row's own variant, in the
    grouped kernel as in the float32 reference; both equal ``x · (W + diag(α)·S·diag(β))ᵀ``."""
    from deltafleet.kernels import reconstruct

    g = torch.Generator().manual_seed(7)
    m, n, k, tenants, dtype = 29, 72, 200, 3, torch.bfloat16
    x, w, signs, alphas, slot = _rows_over_variants(g, m, n, k, tenants, dtype)
    betas = 0.2 + 2 * torch.rand(tenants, k, generator=g)
    ref = bitdelta_linear_batched(x.float(), w.float(), signs, alphas, slot, betas=betas)
    dense = torch.stack([x[i].float() @ (w.float() if t < 0 else reconstruct(w, signs[t], alphas[t], betas[t])).t()
                         for i, t in enumerate(slot.tolist())])
    torch.testing.assert_close(ref, dense, rtol=1e-5, atol=1e-5)
    held = tile_signs(signs) if tiled else signs
    y = bitdelta_linear_grouped(*(t.to(DEVICE) for t in (x, w, held, alphas, slot)), betas=betas.to(DEVICE))
    atol = TOL[dtype] * ref.abs().max().item()
    torch.testing.assert_close(y.float().cpu(), ref, rtol=0, atol=atol)
    rows = slot >= 0  # β of another variant (or none) misses by far more than the rounding
    for wrong in (betas.flip(0), torch.ones_like(betas)):
        off = bitdelta_linear_batched(x.float(), w.float(), signs, alphas, slot, betas=wrong)
        assert (off[rows] - y.float().cpu()[rows]).abs().max() > 4 * atol


@pytest.mark.parametrize("tiled", [True, False])
def test_column_scales_whose_product_with_x_passes_float16_stay_finite(tiled):
    """In float16 an activation of 100 and a column scale of 2,000, both in range, multiply past
    float16's largest value: the grouped path must not round ``x ⊙ β`` to inf (every output of the row
    NaN or inf) where the float32 reference is finite."""
    g = torch.Generator().manual_seed(0)
    n, k, s = 16, 128, 2
    w = (0.05 * torch.randn(n, k, generator=g)).half()
    signs = torch.stack([pack_signs(torch.randn(n, k, generator=g)) for _ in range(s)])
    alphas = torch.full((s, n), 1e-3)
    betas = torch.ones(s, k)
    betas[:, 3] = 2000.0
    x = torch.randn(4, k, generator=g).half()
    x[:, 3] = 100.0
    slot = torch.tensor([0, 1, 0, -1], dtype=torch.int32)
    ref = bitdelta_linear_batched(x.float(), w.float(), signs, alphas, slot, betas=betas)
    assert torch.isfinite(ref).all() and ref.abs().max() < 1e3
    held = tile_signs(signs) if tiled else signs
    y = bitdelta_linear_grouped(*(t.to(DEVICE) for t in (x, w, held, alphas, slot)), betas=betas.to(DEVICE))
    torch.testing.assert_close(y.float().cpu(), ref, rtol=0, atol=TOL[torch.float16] * ref.abs().max().item())


def test_column_scales_of_the_wrong_shape_are_named():
    x, w = torch.randn(3, 16), torch.randn(8, 16)
    signs, alphas, slot = torch.zeros(2, 8, 2, dtype=torch.uint8), torch.ones(2, 8), torch.tensor([0, 1, -1])
    with pytest.raises(ValueError, match=r"betas must have shape \[2, 16\], got \(2, 15\)"):
        bitdelta_linear_grouped(x, w, signs, alphas, slot, betas=torch.ones(2, 15))
    with pytest.raises(ValueError, match=r"betas must have shape \[2, 16\], got \(16,\)"):
        bitdelta_linear_batched(x, w, signs, alphas, slot, betas=torch.ones(16))


@pytest.mark.parametrize("tiled", [True, False])
def test_one_variant_with_column_scales_takes_the_grouped_path(monkeypatch, tiled):
    """``kernels.bitdelta_linear(…, beta)`` on a GPU: every row one group of the grouped kernel (here the
    dispatch is told it is on a GPU, and the kernel runs where the other cases do), ``[B, T, K]`` in,
    ``[B, T, N]`` out, against the reconstructed weight."""
    import deltafleet.kernels as kernels

    monkeypatch.setattr(kernels.linear, "_on_triton", lambda x, w: True)
    g = torch.Generator().manual_seed(11)
    n, k, dtype = 80, 136, torch.bfloat16
    x = torch.randn(2, 9, k, generator=g).to(dtype)
    w = (0.05 * torch.randn(n, k, generator=g)).to(dtype)
    sign = pack_signs(torch.randn(n, k, generator=g))
    alpha, beta = 0.03 + 0.05 * torch.rand(n, generator=g), 0.2 + 2 * torch.rand(k, generator=g)
    bias = torch.randn(n, generator=g).to(dtype)
    ref = x.float() @ kernels.reconstruct(w, sign, alpha, beta).t() + bias.float()
    held = tile_signs(sign) if tiled else sign
    y = kernels.bitdelta_linear(*(t.to(DEVICE) for t in (x, w, held, alpha, bias, beta)))
    assert y.shape == (2, 9, n) and y.dtype == dtype
    torch.testing.assert_close(y.float().cpu(), ref, rtol=0, atol=TOL[dtype] * ref.abs().max().item())


@pytest.mark.parametrize("tiled", [True, False])
def test_stacked_matrices_equal_each_matrix_alone(tiled):
    """q, k and v (GQA widths, one ragged) over one GEMM of their stacked base weights and one set of
    rows' groups: each column block is that matrix's grouped linear, against the float32 reference,
    and each row read its own variant's signs of its own matrix."""
    g = torch.Generator().manual_seed(5)
    m, k, sizes, tenants, dtype = 30, 256, [128, 64, 72], 5, torch.bfloat16
    x = torch.randn(m, k, generator=g).to(dtype)
    ws = [(0.05 * torch.randn(n, k, generator=g)).to(dtype) for n in sizes]
    signs = [torch.stack([pack_signs(torch.randn(n, k, generator=g)) for _ in range(tenants)]) for n in sizes]
    alphas = [0.03 + 0.05 * torch.rand(tenants, n, generator=g) for n in sizes]
    alphas[1] = alphas[1][:, 0].contiguous()  # one α per matrix
    slot = _zipf_slots(m, tenants, g)
    held = [tile_signs(s) if tiled else s for s in signs]
    y = bitdelta_linears_grouped(x.to(DEVICE), torch.cat(ws).to(DEVICE), sizes, [s.to(DEVICE) for s in held],
                                 [a.to(DEVICE) for a in alphas], slot.to(DEVICE))
    assert y.shape == (m, sum(sizes)) and y.dtype == dtype
    rows = slot >= 0
    for yi, w, s, a in zip(y.float().cpu().split(sizes, 1), ws, signs, alphas):
        ref = bitdelta_linear_batched(x.float(), w.float(), s, a, slot)
        atol = TOL[dtype] * ref.abs().max().item()
        torch.testing.assert_close(yi, ref, rtol=0, atol=atol)
        swapped = bitdelta_linear_batched(x.float(), w.float(), s.flip(0), a.flip(0), slot)
        assert (swapped[rows] - yi[rows]).abs().max() > 4 * atol


def test_stacked_matrices_contract_errors():
    x, slot = torch.randn(2, 16).bfloat16(), torch.tensor([0, 1])
    w = torch.randn(12, 16).bfloat16()
    signs = [torch.zeros(2, 8, 2, dtype=torch.uint8), torch.zeros(2, 4, 2, dtype=torch.uint8)]
    alphas = [torch.ones(2), torch.ones(2)]
    with pytest.raises(ValueError, match=r"sizes \[8, 5\] must add up to the weight's 12 rows"):
        bitdelta_linears_grouped(x, w, [8, 5], signs, alphas, slot)
    with pytest.raises(ValueError, match=r"one per signs \(1\) and alphas \(2\)"):
        bitdelta_linears_grouped(x, w, [8, 4], signs[:1], alphas, slot)
    with pytest.raises(ValueError, match=r"signs must be \[S, 8, 2\], got \(2, 4, 2\)"):
        bitdelta_linears_grouped(x, w, [8, 4], signs[::-1], alphas, slot)
    with pytest.raises(ValueError, match="x and weight must share a floating dtype"):
        bitdelta_linears_grouped(x, w.half(), [8, 4], signs, alphas, slot)


def test_a_decode_batch_takes_the_cheapest_block_for_its_runs(monkeypatch):
    """``decode_block_m``: on Hopper the block size of ``BLOCK_COST`` whose blocks cost least over the
    variants' runs (base rows and slots past S not counted; above 64 rows only a run's rest past its
    whole blocks of 64); a batch without variant rows, or off Hopper, takes ``grouped_block_m`` of its
    row count. ``DecodeGraphs.block_sizes`` lists what a bucket's batches can take (what a server
    captures before it serves)."""
    from types import SimpleNamespace

    from deltafleet.kernels import triton_grouped
    from deltafleet.kernels.triton_grouped import decode_block_m
    from deltafleet.serve.graphs import DecodeGraphs

    spread = lambda rows, each: [v % (rows // each) for v in range(rows)]  # noqa: E731  (each variant `each` rows)
    assert decode_block_m(spread(16, 1), 14, "cpu") == BLOCK_M  # off Hopper: the row count's default
    monkeypatch.setattr(triton_grouped, "_hopper", lambda device: True)
    # runs of 1 or 4: blocks of 4; 5 or 8: 8; 9 or 16: 16; 17 (past 64 rows: no whole long block): 32;
    # 18 in 252 rows (14 variants evenly, as the engine-step benchmark): 32
    cases = {(16, 1): 4, (16, 4): 4, (60, 5): 8, (64, 8): 8, (63, 9): 16, (64, 16): 16, (68, 17): 32, (252, 18): 32}
    for (rows, each), bm in cases.items():
        assert decode_block_m(spread(rows, each), 14, "cuda") == bm, (rows, each)
    # runs 10, 1, 1 (base rows and slots 14, 99 not counted): 5 blocks of 4 (5.0) > 4 of 8 (4.84) < 3 of 16
    assert decode_block_m([-1] * 30 + [0] * 10 + [1, 2] + [14, 99], 14, "cuda") == 8
    # above 64 rows, runs of 128 and 64 rows are whole long blocks: nothing left to cut, the smallest block
    assert decode_block_m([0] * 128 + [1] * 64 + [-1] * 64, 14, "cuda") == 4
    # the padded row count decides whether long blocks come first: 64 rows alone, two blocks of 32;
    # padded to 128, one long block
    assert decode_block_m([1] * 64, 14, "cuda") == 32 and decode_block_m([1] * 64, 14, "cuda", rows=128) == 4
    assert decode_block_m([-1] * 20, 14, "cuda") == grouped_block_m(20, "cuda") == 4
    graphs = object.__new__(DecodeGraphs)
    graphs.runner = SimpleNamespace(device=torch.device("cuda"), slots=SimpleNamespace(n_slots=14, small_blocks=True))
    assert [graphs.block_sizes(b) for b in (8, 16, 32, 256)] == [[None], [4, 8, 16], [4, 8, 16, 32], [4, 8, 16, 32]]
    graphs.runner.slots.small_blocks = False  # signs the Triton kernel reads: its 16-row tiles, one graph
    assert [graphs.block_sizes(b) for b in (16, 256)] == [[None], [None]]


@pytest.mark.parametrize("tiled", [False, True])
def test_sign_products_added_to_a_base_product_equal_the_batched_linear(tiled):
    """``kernels.add_sign_products``: each variant row's sign product added in place to a given base
    product equals the batched linear; base rows keep their values exactly, and another variant's
    signs would miss."""
    from deltafleet.kernels import add_sign_products

    g = torch.Generator().manual_seed(5)
    m, n, k, tenants, dtype = 21, 72, 256, 5, torch.bfloat16
    x, w, signs, alphas, slot = _rows_over_variants(g, m, n, k, tenants, dtype)
    ref = bitdelta_linear_batched(x.float(), w.float(), signs, alphas, slot)
    base = (x.float() @ w.float().t()).to(dtype)
    y = base.clone().to(DEVICE)
    held = tile_signs(signs) if tiled else signs
    out = add_sign_products(x.to(DEVICE), held.to(DEVICE), alphas.to(DEVICE), slot.to(DEVICE), y)
    assert out is y and y.dtype == dtype
    atol = TOL[dtype] * ref.abs().max().item()
    torch.testing.assert_close(y.float().cpu(), ref, rtol=0, atol=atol)
    rows = slot >= 0
    assert rows.any() and (~rows).any()
    assert torch.equal(y.cpu()[~rows], base[~rows])
    swapped = bitdelta_linear_batched(x.float(), w.float(), signs.flip(0), alphas.flip(0), slot)
    assert (swapped[rows] - y.float().cpu()[rows]).abs().max() > 4 * atol


def test_sign_products_into_the_leading_rows_of_a_wider_output():
    """The grouped sign products (``triton_grouped._add_signs``: Triton here, Gluon on Hopper) added
    into ``y[:d]``, the leading rows of a larger output, as a step by tiles adds its decode rows':
    those rows equal the batched linear, the rows after them are left as they were."""
    from deltafleet.kernels.triton_grouped import _add_signs

    g = torch.Generator().manual_seed(11)
    m, d, n, k, tenants, dtype = 40, 24, 64, 256, 4, torch.bfloat16
    x, w, signs, alphas, slot = _rows_over_variants(g, m, n, k, tenants, dtype)
    ref = bitdelta_linear_batched(x[:d].float(), w.float(), signs, alphas, slot[:d])
    base = (x.float() @ w.float().t()).to(dtype)
    y = base.clone().to(DEVICE)
    lead = slot[:d].to(DEVICE)
    _add_signs(x[:d].to(DEVICE), tile_signs(signs).to(DEVICE), alphas.to(DEVICE), group_rows(lead, tenants),
               y[:d], {})
    atol = TOL[dtype] * ref.abs().max().item()
    torch.testing.assert_close(y[:d].float().cpu(), ref, rtol=0, atol=atol)
    assert torch.equal(y[d:].cpu(), base[d:]) and (slot[:d] >= 0).any()


def test_the_overlap_switch_takes_a_row_count():
    """``DELTAFLEET_GROUPED_OVERLAP`` is the largest batch whose base product runs beside the sign
    products: a count of rows up to 256 (each row of it keeps a float32 accumulator row per width), 0
    for never; anything else is refused with the variable's name."""
    from deltafleet.kernels.triton_grouped import _overlap_rows

    assert [_overlap_rows(v) for v in ("0", "64", " 128 ", "256")] == [0, 64, 128, 256]
    for bad in ("off", "", "-1", "1.5", "true", "257", "2048"):
        with pytest.raises(ValueError, match="DELTAFLEET_GROUPED_OVERLAP"):
            _overlap_rows(bad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_column_scales_with_no_slot_give_the_base_product(dtype):
    """Found by a reviewer: with column scales and an empty slot stack (every row the base, slot −1)
    the β of ``slot.clamp(0, S − 1)`` was an IndexError; the contract's answer is x·Wᵀ, as without β."""
    g = torch.Generator().manual_seed(0)
    m, n, k = 3, 5, 16
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    w = torch.randn(n, k, generator=g).to(dtype).to(DEVICE)
    slot = torch.full((m,), -1, dtype=torch.int32, device=DEVICE)
    y = bitdelta_linear_grouped(x, w, torch.zeros(0, n, 2, dtype=torch.uint8, device=DEVICE), torch.zeros(0),
                                slot, betas=torch.ones(0, k))
    torch.testing.assert_close(y.double().cpu(), (x.double() @ w.double().t()).cpu(), rtol=2**-6, atol=1e-6)
