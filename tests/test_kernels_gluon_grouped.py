"""The grouped sign product on the int8 tensor cores (kernels/gluon_grouped.py).

The kernel (Gluon) runs on a Hopper GPU only: those tests are marked ``gpu`` and skipped elsewhere
(tests/conftest.py; ``make test-gpu`` sets ``DELTAFLEET_TRITON_DEVICE=cuda``). The sorted-planes kernel
(plain Triton), the configuration table and the wrapper's argument checks are tested on the CPU too,
under ``TRITON_INTERPRET=1``.

Tolerances. With y in float32 (zeros) the kernel's output is the sign term alone, and is held to
(1) the same product with the activations quantised as ``sorted_planes`` quantises them, computed here
in float64, to within a few float32 roundings of ``512·Σhi`` (≤ ``α·scale·K/32``, also covering a
quantised value one off where the device's division rounds ``1/scale`` differently); (2) the exact
sign term to within the quantisation bound ``α·K·0.505·scale`` (each activation within ``scale/2``, plus
the float32 rounding of ``x/scale``: tests/test_kernels_triton.py's activation-plane test), plus (1).
With y in the activation dtype holding ``torch.mm``'s base product, the result is held to the float32
reference as tests/test_kernels_grouped.py holds the Triton kernel (``c·max|y_ref|``, c = 2⁻⁶ bf16,
2⁻⁹ fp16), base rows must come back bit for bit, and each row must have used its own variant.
"""
from __future__ import annotations

import os

import pytest
import torch

DEVICE = os.environ.get("DELTAFLEET_TRITON_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from deltafleet.kernels import pack_signs, tile_signs, unpack_signs  # noqa: E402
from deltafleet.kernels import gluon_grouped as gg  # noqa: E402
from deltafleet.kernels.reference import bitdelta_linear_batched  # noqa: E402
from deltafleet.kernels.triton_grouped import group_rows  # noqa: E402

TOL = {torch.bfloat16: 2**-6, torch.float16: 2**-9}


def _zipf(m: int, tenants: int, g: torch.Generator) -> torch.Tensor:
    """Rows over the base (−1) and ``tenants`` variants with Zipf(1) popularity: odd group sizes."""
    p = 1.0 / torch.arange(1, tenants + 2, dtype=torch.float64)
    return (torch.multinomial(p, m, replacement=True, generator=g) - 1).to(torch.int32)


SLOTS = {
    "zipf": _zipf,
    "own": lambda m, t, g: torch.randperm(t, generator=g)[:m].to(torch.int32),   # every row its own variant
    "one": lambda m, t, g: torch.full((m,), t - 1, dtype=torch.int32),           # all rows one variant
    # variants 1 … t − 2 absent (empty groups), base rows mixed in
    "gap": lambda m, t, g: torch.randint(-1, 2, (m,), generator=g, dtype=torch.int32) * (t - 1),
    # base rows as −1 and as slots past S, among odd groups
    "oob": lambda m, t, g: torch.where(torch.rand(m, generator=g) < 0.2, t + 3, _zipf(m, t, g)).to(torch.int32),
}

CASES = [  # (M, slots, variants, N, K, α per feature)
    (1, "one", 3, 200, 384, True),      # one row; N ragged (a part tile); K three 128-tiles (odd)
    (5, "own", 5, 520, 384, False),     # every row its own variant; feature tiles past N in the last column
    (16, "zipf", 4, 200, 1024, True),   # odd group sizes with base rows
    (16, "own", 16, 136, 256, False),   # sixteen rows, sixteen variants
    (37, "oob", 4, 200, 384, True),     # out-of-range slots and −1 among odd groups
    (64, "gap", 6, 520, 384, False),    # empty groups between the present ones
    (64, "one", 3, 200, 1024, True),    # one variant over one to four blocks
    (256, "zipf", 14, 520, 384, True),  # a serving step's mix
    (256, "one", 2, 136, 256, False),   # one variant, 4 to 16 blocks
]


def _case(m, pattern, tenants, n, k, row_alpha, dtype):
    g = torch.Generator().manual_seed(m * 131 + n + k + tenants)
    x = torch.randn(m, k, generator=g).to(dtype)
    x[0, 3] = 9.0  # an outlier sets row 0's scale
    w = (0.05 * torch.randn(n, k, generator=g)).to(dtype)
    signs = torch.stack([pack_signs(torch.randn(n, k, generator=g)) for _ in range(tenants)])
    alphas = (0.03 + 0.05 * torch.rand((tenants, n) if row_alpha else (tenants,), generator=g))
    slot = SLOTS[pattern](m, tenants, g)
    return x, w, signs, alphas, slot


def _sign_terms(x, signs, alphas, slot, k):
    """float64 ``[M, N]``: ``α_t ⊙ (x·S_tᵀ)`` exactly and with x quantised as ``sorted_planes`` does
    it; the per-row scale. Rows without a variant: zeros."""
    n_slots, n = signs.shape[0], signs.shape[1]
    xf = x.float()
    a = xf.abs().amax(dim=1)
    a = torch.where(a >= 1e-30, a, torch.zeros_like(a))
    inv = torch.where(a > 0, torch.tensor(32639.0) / a, torch.zeros_like(a))       # float32, as the kernel
    v = xf * inv[:, None]
    q = torch.where(v >= 0, v + 0.5, v - 0.5).trunc().double()                       # round half away
    scale = (a / 32639.0).double()
    exact = torch.zeros(x.shape[0], n, dtype=torch.float64)
    quant = torch.zeros_like(exact)
    for t in range(n_slots):
        rows = (slot == t).nonzero(as_tuple=True)[0]
        if len(rows) == 0:
            continue
        s = unpack_signs(signs[t], k, torch.float64)                                 # [N, K] of ±1
        al = alphas[t].double()
        exact[rows] = (xf[rows].double() @ s.t()) * al
        quant[rows] = (q[rows] @ s.t()) * scale[rows, None] * al
    return exact, quant, scale


def test_sorted_planes_are_the_planes_of_the_rows_in_sorted_order():
    """``sorted_planes`` writes, for every sorted row of a variant, the planes and (scale, Σq) that
    ``gluon_planes.activation_planes`` computes for that row of ``x[order]``; base rows are skipped."""
    from deltafleet.kernels.gluon_planes import activation_planes

    g = torch.Generator().manual_seed(0)
    m, k, tenants = 19, 96, 3
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    slot = _zipf(m, tenants, g)
    slot[4] = tenants + 2  # out of range: a base row
    groups = group_rows(slot.to(DEVICE), tenants, 16)
    planes, sc = gg.sorted_planes(x.to(DEVICE), groups.order, groups.key, tenants)
    ref_planes, ref_sc = activation_planes(x.to(DEVICE)[groups.order.long()])
    live = (groups.key < tenants).cpu()
    assert live.sum() == ((slot >= 0) & (slot < tenants)).sum() > 0
    rows2 = torch.stack([2 * torch.arange(m), 2 * torch.arange(m) + 1], 1)[live].flatten()
    assert torch.equal(planes.cpu()[rows2], ref_planes.cpu()[rows2])
    assert torch.equal(sc.cpu()[live], ref_sc.cpu()[live])


@pytest.mark.skipif(not gg.HAVE_GLUON, reason="needs Gluon's layouts")
@pytest.mark.parametrize("k", [256, 384, 768])
def test_bit_accumulator_planes_pair_each_sign_bit_with_its_activation(k):
    """``bitacc``: chunk c of a K step multiplies bit c of the ``[64, 32]`` view of the step's two sign
    tiles (``_STEP_BYTES``, read here through its offset bases) by planes columns ``32c …`` that
    ``sorted_planes(bits=True)`` wrote. Emulated in integers: the eight sums of each feature equal
    ``s'·q`` of the quantised row, exactly, including a last step whose second tile lies past K (its
    bits are the next feature tile's, here random, against zero planes)."""
    g = torch.Generator().manual_seed(k)
    m, tenants = 3, 2
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    slot = torch.tensor([1, 0, 1], dtype=torch.int32)
    signs = torch.stack([pack_signs(torch.randn(64, k, generator=g)) for _ in range(tenants)])
    groups = group_rows(slot.to(DEVICE), tenants, 8)
    planes, sc = gg.sorted_planes(x.to(DEVICE), groups.order, groups.key, tenants, bits=True)
    planes, sc, order = planes.cpu().long(), sc.cpu(), groups.order.cpu().long()
    kp = -(-k // 256) * 256
    assert planes.shape == (2 * m, kp)
    # the view: offset o of the step's 2048 bytes holds element (row, col) = XOR of the bases of o's bits
    bases = gg._STEP_BYTES.value.offset_bases if hasattr(gg._STEP_BYTES, "value") else gg._STEP_BYTES.offset_bases
    where = torch.zeros(64, 32, dtype=torch.long)
    for o in range(2048):
        r = c = 0
        for i, (br, bc) in enumerate(bases):
            if o >> i & 1:
                r, c = r ^ br, c ^ bc
        where[r, c] = o
    assert where.unique().numel() == 2048
    _, quant, scale = _sign_terms(x, signs, torch.ones(tenants), slot, k)
    for i in range(m):  # sorted row i is x row order[i]
        t = int(slot[order[i]])
        tiles = tile_signs(signs[t:t + 1])[0, 0]                           # [K/128, 64, 16]
        tiles = torch.cat([tiles, torch.randint(0, 256, (1, 64, 16), generator=g, dtype=torch.uint8)])
        hi, lo = planes[2 * i], planes[2 * i + 1]
        total = torch.zeros(64, dtype=torch.long)
        for st in range(kp // 256):
            step = tiles[2 * st:2 * st + 2].reshape(-1).long()               # the stage's 2048 bytes
            view = step[where]                                              # [64, 32]
            for c in range(8):
                bit = (view >> c) & 1
                cols = slice(256 * st + 32 * c, 256 * st + 32 * c + 32)
                total += bit @ (256 * hi[cols] + lo[cols])
        sdot = scale[order[i]] * (2 * total.double() - sc[i, 1].double())   # s·q = 2·(s'·q) − Σq
        assert torch.equal(sdot, quant[order[i]]), f"sorted row {i}"


def test_configurations_are_ones_the_kernel_takes():
    """Every entry of the table is launchable (``_check_config``), filed under its own block_m, within
    one block's shared memory; the chooser takes the first with two programs per multiprocessor, else
    the most programs."""
    for bm, cfgs in gg.CONFIGS.items():
        assert cfgs[0] == gg.default_config(bm)
        for cfg in cfgs:
            gg._check_config(cfg)
            assert cfg.block_m == bm and cfg.smem() + 1024 <= gg.SMEM_PER_BLOCK
    assert gg.choose_config(57344, 30, 16) == gg.CONFIGS[16][0]       # 224 columns × 30 blocks
    assert gg.choose_config(4096, 2, 16).block_n == 64                # 7B o at 16 rows of one variant
    assert gg.choose_config(4096, 2, 64).block_n == 64
    with pytest.raises(ValueError, match="block_m must be one of"):
        gg.default_config(48)


def test_wrapper_refuses_what_the_kernel_cannot_launch():
    x = torch.zeros(4, 128, dtype=torch.bfloat16)
    signs = tile_signs(torch.zeros(2, 64, 16, dtype=torch.uint8))
    groups = group_rows(torch.zeros(4, dtype=torch.int32), 2, 16)
    y = torch.zeros(4, 64, dtype=torch.bfloat16)
    assert not gg.supported(x, signs, y)  # not on a Hopper GPU
    for bad, match in ((dict(block_m=48), "block_m must be one of"), (dict(block_k=512), "block_k must be 128 or 256"),
                       (dict(consumers=3), "must split into 3 consumer"), (dict(stages=1), "stages must be 2"),
                       (dict(blockn=64), "unexpected field"), (dict(prefetch=True), "prefetch needs sync_mma"),
                       (dict(block_m=8, sync_mma=True, bitacc=True, prefetch=True), "prefetch needs sync_mma")):
        with pytest.raises(ValueError, match=match):
            gg.add_sign_products_planes(x, signs, torch.ones(2), groups, y, **bad)
    # blocks of 8 prefetch by default; an override that rules it out (bitacc) drops it, unless stated
    # (no rows: the configuration is checked, nothing is launched)
    assert gg.default_config(8).prefetch and gg.default_config(4).prefetch
    x0, y0, g0 = torch.zeros(0, 128, dtype=torch.bfloat16), torch.zeros(0, 64), group_rows(torch.zeros(0).int(), 2, 8)
    assert gg.add_sign_products_planes(x0, signs, torch.ones(2), g0, y0, block_m=8, bitacc=True) is y0
    with pytest.raises(ValueError, match="prefetch needs sync_mma"):
        gg.add_sign_products_planes(x0, signs, torch.ones(2), g0, y0, block_m=8, bitacc=True, prefetch=True)


def _hopper():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9 or not gg.HAVE_GLUON:
        pytest.skip("not a Hopper GPU with Gluon")


@pytest.mark.gpu
@pytest.mark.parametrize("block_m", gg.BLOCK_MS)
@pytest.mark.parametrize("m, pattern, tenants, n, k, row_alpha", CASES,
                         ids=[f"m{c[0]}-{c[1]}-t{c[2]}-n{c[3]}-k{c[4]}-{'feat' if c[5] else 'mat'}" for c in CASES])
def test_grouped_planes_match_reference(block_m, m, pattern, tenants, n, k, row_alpha):
    """Every configuration of ``block_m`` and the chooser's (bf16; the default also fp16), against the float32
    reference, the quantised and exact sign terms (float32 y), base rows untouched, each row its own
    variant's signs."""
    _hopper()
    for dtype in (torch.bfloat16, torch.float16):
        x, w, signs, alphas, slot = _case(m, pattern, tenants, n, k, row_alpha, dtype)
        variant = (slot >= 0) & (slot < tenants)
        ref_slot = torch.where(variant, slot, -1)
        ref = bitdelta_linear_batched(x.float(), w.float(), signs, alphas, ref_slot)
        exact, quant, scale = _sign_terms(x, signs, alphas, slot, k)
        xd, wd, sd, ad, slotd = (t.cuda() for t in (x, w, tile_signs(signs), alphas, slot))
        assert gg.supported(xd, sd, torch.empty(m, n, device="cuda", dtype=dtype))
        groups = group_rows(slotd, tenants, block_m)
        base = torch.mm(xd, wd.t())
        a_max = alphas.double().reshape(tenants, -1).amax(dim=1)[slot.clamp(0, tenants - 1).long()]  # [M]
        bound_q = (a_max * scale * k / 32)[:, None] + 2**-20 * quant.abs()
        bound_x = (a_max * scale * k * 0.505)[:, None] + bound_q
        atol = TOL[dtype] * ref.abs().max().item()
        # every configuration in bf16, and choose_config's pick (no configuration given); the default in fp16
        # and each mma.sync configuration with its epilogue's loads on the other side of the K loop
        # (prefetch toggled)
        toggled = [c._replace(prefetch=not c.prefetch) for c in gg.CONFIGS[block_m] if c.sync_mma and not c.bitacc]
        configs = [*gg.CONFIGS[block_m], *toggled, None] if dtype == torch.bfloat16 else gg.CONFIGS[block_m][:1]
        for cfg in configs:
            what = f"{cfg or 'chosen'} {dtype}"
            kw = cfg._asdict() if cfg else {"block_m": block_m}
            y = base.clone()
            gg.add_sign_products_planes(xd, sd, ad, groups, y, **kw)
            term = torch.zeros(m, n, device="cuda", dtype=torch.float32)
            gg.add_sign_products_planes(xd, sd, ad, groups, term, **kw)
            torch.cuda.synchronize()
            y, term = y.cpu(), term.cpu().double()
            assert torch.equal(y[~variant], base.cpu()[~variant]), f"{what}: a base row changed"
            assert not term[~variant].any(), f"{what}: a base row got a sign term"
            err_q = (term - quant).abs()
            assert (err_q <= bound_q).all(), f"{what}: off the quantised product by {(err_q / bound_q).max():.3g}×"
            err_x = (term - exact).abs()
            assert (err_x <= bound_x).all(), f"{what}: over the quantisation bound by {(err_x / bound_x).max():.3g}×"
            torch.testing.assert_close(y.float(), ref, rtol=0, atol=atol, msg=lambda s, what=what: f"{what}: {s}")
        if tenants > 1 and variant.any():  # another variant's signs would miss by far more
            swapped = bitdelta_linear_batched(x.float(), w.float(), signs.flip(0), alphas.flip(0), ref_slot)
            assert (swapped[variant] - y.float()[variant]).abs().max() > 4 * atol


@pytest.mark.gpu
def test_hopper_groups_short_runs_by_4_or_8_and_long_ones_by_64():
    """A decode step groups blocks of 4 for the mma.sync configurations (``CONFIGS[4]``) up to 32 rows,
    of 8 (``CONFIGS[8]``) up to 128, of 16 beyond, and above 64 rows each run's whole blocks of 64
    first (wgmma, ``CONFIGS[64]``); a step with prompt chunks, blocks of 8 at any size."""
    _hopper()
    from deltafleet.kernels.triton_grouped import (BLOCK4_MAX_ROWS, BLOCK8_MAX_ROWS, SHORT_MAX_ROWS, grouped_block_m,
                                                   grouped_long_m)

    rows = (1, BLOCK4_MAX_ROWS, BLOCK4_MAX_ROWS + 1, SHORT_MAX_ROWS, SHORT_MAX_ROWS + 1, BLOCK8_MAX_ROWS,
            BLOCK8_MAX_ROWS + 1)
    assert [grouped_block_m(m, "cuda") for m in rows] == [4, 4, 8, 8, 8, 8, 16]
    assert [grouped_long_m(m, "cuda") for m in rows] == [None, None, None, None, 64, 64, 64]
    assert [grouped_block_m(m, "cuda", prefill=True) for m in rows] == [8] * 7  # a step with prompt chunks
    assert all(cfg.sync_mma for b in (4, 8) for cfg in gg.CONFIGS[b])
    assert not any(cfg.sync_mma for cfg in gg.CONFIGS[64])
    slot = torch.cat([torch.full((150,), 1), torch.arange(40) % 3 - 1]).int().cuda()
    g = group_rows(slot, 2)  # the engine's default grouping for 190 rows
    assert g.block_m == 16 and g.long.block_m == 64 and int((g.long.first < 190).sum()) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("cut, block_m", [(16, 64), (8, 16)])
def test_groups_cut_smaller_than_the_kernel_block_are_still_right(cut, block_m):
    """Groups of ``group_rows(…, cut)`` under the ``block_m``-row kernel: each program's box holds the
    next blocks' rows too, which it must leave to their own programs (live rows end at ``first[b + 1]``)."""
    _hopper()
    x, w, signs, alphas, slot = _case(256, "zipf", 4, 200, 384, True, torch.bfloat16)
    ref = bitdelta_linear_batched(x.float(), w.float(), signs, alphas, slot)
    xd, wd, sd, ad, slotd = (t.cuda() for t in (x, w, tile_signs(signs), alphas, slot))
    y = torch.mm(xd, wd.t())
    gg.add_sign_products_planes(xd, sd, ad, group_rows(slotd, 4, cut), y, block_m=block_m)
    torch.testing.assert_close(y.float().cpu(), ref, rtol=0, atol=TOL[torch.bfloat16] * ref.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("k", [384, 1536])
def test_programmatic_dependent_launch_waits_for_what_the_kernel_before_wrote(k):
    """With ``pdl`` the sign products start while the kernel before runs and must wait for it before
    reading the planes, the scales and y. Captured in a CUDA graph whose every replay writes new
    activations, makes their planes (``sorted_planes(pdl=True)``: the next launch may start at once)
    and then multiplies two matrices over them (the second launched on the first as a sibling, as k
    is on q: it does not wait, and relies on the first having let it start only once all of its
    programs had waited for the planes), each configuration's output must equal the launch without
    it, replay after replay: a read before the planes are written would see the last replay's. K of
    384 leaves the ring more stages than K steps."""
    _hopper()
    x, w, signs, alphas, slot = _case(64, "zipf", 6, 520, k, True, torch.bfloat16)
    xd, wd, sd, ad, slotd = (t.cuda() for t in (x, w, tile_signs(signs), alphas, slot))
    sd2, ad2 = sd.flip(0).contiguous(), ad.flip(0).contiguous()
    configs = [cfg for b in gg.BLOCK_MS for cfg in gg.CONFIGS[b]]
    groups = {b: group_rows(slotd, 6, b) for b in gg.BLOCK_MS}
    src = torch.empty_like(xd)

    def run(pdl: bool) -> list[torch.Tensor]:
        xd.copy_(src)
        out = []
        for cfg in configs:  # as the engine: the base products, the planes, then one matrix after the other
            g = groups[cfg.block_m]
            ys = [torch.mm(xd, wd.t()) for _ in range(2)]
            planes = None if cfg.bitacc else gg.sorted_planes(xd, g.order, g.key, 6, pdl=pdl)
            for j, (y, (s_, a_)) in enumerate(zip(ys, ((sd, ad), (sd2, ad2)))):
                out.append(gg.add_sign_products_planes(xd, s_, a_, g, y, planes=planes, pdl=pdl, sibling=j > 0,
                                                       **cfg._asdict()))
        return out

    src.copy_(xd)
    run(True)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = run(True)
    for seed in range(3):
        src.copy_(torch.randn(xd.shape, generator=torch.Generator().manual_seed(seed)).to(xd))
        graph.replay()
        want = run(False)
        torch.cuda.synchronize()
        for cfg, a, b in zip([c for c in configs for _ in (0, 1)], got, want):
            assert torch.equal(a, b), f"replay {seed}, {cfg}: the launch with pdl differs from the one without"


@pytest.mark.gpu
@pytest.mark.parametrize("runs", [(40, 30, 26), (64, 64)], ids=["no-long-block", "no-short-block"])
def test_chained_launches_stay_ordered_through_a_part_without_blocks(runs):
    """``bitdelta_linears_grouped`` as the engine calls it on Hopper: the planes, then per matrix a launch
    per part of ``groups.parts()``, each launched on the one before (programmatic dependent launch). Over
    64 rows each variant's run first goes in whole blocks of 64 (the long part), its rest in short
    blocks, so runs under 64 rows leave the long part without a block and runs of 64 the short part.
    A wait covers only the launch just before, so a launch without a block must still end after its
    predecessor; else the next one may pass its wait while the planes are still being written.
    Replayed in a CUDA graph with new activations each time, every replay must match the float32
    reference. Whether a missing wait shows here is a matter of timing (the planes' kernel may well
    end first), so this pins the outputs of such a chain, and catches the race only when it happens."""
    _hopper()
    from deltafleet.kernels import bitdelta_linears_grouped

    g = torch.Generator().manual_seed(len(runs))
    m, k, tenants, sizes = sum(runs), 8192, len(runs), [520, 264]  # long rows: planes that take a while
    slot = torch.cat([torch.full((r,), t, dtype=torch.int32) for t, r in enumerate(runs)])
    slot = slot[torch.randperm(m, generator=g)]
    w = (0.05 * torch.randn(sum(sizes), k, generator=g)).to(torch.bfloat16)
    signs = [torch.stack([pack_signs(torch.randn(n, k, generator=g)) for _ in range(tenants)]) for n in sizes]
    alphas = [0.03 + 0.05 * torch.rand(tenants, n, generator=g) for n in sizes]
    wd, slotd = w.cuda(), slot.cuda()
    sd, ad = [tile_signs(s).cuda() for s in signs], [a.cuda() for a in alphas]
    groups = group_rows(slotd, tenants)
    live = [int((part.first < m).sum()) for part in groups.parts()]
    assert len(live) == 2 and 0 in live and max(live) > 0, live  # one part without a block: the case at issue
    xd = torch.randn(m, k, generator=g).to(torch.bfloat16).cuda()
    bitdelta_linears_grouped(xd, wd, sizes, sd, ad, slotd, groups=groups)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = bitdelta_linears_grouped(xd, wd, sizes, sd, ad, slotd, groups=groups)
    for seed in range(3):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
        xd.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        for i, (wi, yi) in enumerate(zip(w.split(sizes), y.cpu().split(sizes, 1))):
            ref = bitdelta_linear_batched(x.float(), wi.float(), signs[i], alphas[i], slot)
            torch.testing.assert_close(yi.float(), ref, rtol=0, atol=TOL[torch.bfloat16] * ref.abs().max().item(),
                                       msg=lambda s, i=i, seed=seed: f"replay {seed}, matrix {i}: {s}")


@pytest.mark.gpu
@pytest.mark.parametrize("m, pattern", [(16, "zipf"), (37, "oob"), (64, "gap")])
def test_base_product_beside_the_sign_products_on_two_streams(m, pattern):
    """On Hopper a decode batch of up to ``OVERLAP_MAX_ROWS`` rows computes its base product
    (``triton_base.base_mm``) on the current stream while the sign products go into a float32 buffer
    on a side stream, added after the join. Through ``bitdelta_linears_grouped`` (two stacked
    matrices, as gate and up) and ``bitdelta_linear_grouped`` (also with column scales, whose sign
    products read x ⊙ β while the base product reads x), eagerly and replayed in a CUDA graph
    with new rows each replay, every output must match the float32 reference, and the base rows
    must equal the base GEMM's alone bit for bit: a branch left unjoined, a buffer reused while the
    other stream still reads it, or a float32 accumulator left uncleared (the same one serves each call
    of a width) would show as stale, missing or doubled sign products."""
    _hopper()
    from deltafleet.kernels import triton_base
    from deltafleet.kernels.triton_grouped import _overlaps, bitdelta_linear_grouped, bitdelta_linears_grouped

    x, w, signs, alphas, slot = _case(m, pattern, 6, 520, 1024, True, torch.bfloat16)
    _, w2, signs2, alphas2, _ = _case(m, pattern, 6, 264, 1024, False, torch.bfloat16)
    sizes = [520, 264]
    wd, slotd = torch.cat([w, w2]).cuda(), slot.cuda()
    sd, ad = [tile_signs(s).cuda() for s in (signs, signs2)], [a.cuda() for a in (alphas, alphas2)]
    groups = group_rows(slotd, 6)
    xd = x.cuda()
    assert _overlaps(xd, wd, sd), "the case must take the two-stream path"
    base = (slot < 0) | (slot >= 6)  # base rows: any slot outside [0, S)
    ref_slot = torch.where(base, -1, slot)  # as the reference takes them

    def check(x_cpu, ys, what):
        for i, (wi, yi) in enumerate(zip(torch.cat([w, w2]).split(sizes), ys)):
            ref = bitdelta_linear_batched(x_cpu.float(), wi.float(), [signs, signs2][i], [alphas, alphas2][i],
                                          ref_slot)
            got = yi.float().cpu()
            torch.testing.assert_close(got, ref, rtol=0, atol=TOL[torch.bfloat16] * ref.abs().max().item(),
                                       msg=lambda s, i=i: f"{what}, matrix {i}: {s}")
            alone = triton_base.base_mm(x_cpu.cuda(), wi.cuda().contiguous()).cpu()
            assert torch.equal(yi.cpu()[base], alone[base]), f"{what}, matrix {i}: base rows"

    betas = 0.5 + torch.rand(6, 1024, generator=torch.Generator().manual_seed(m))  # column scales
    bd = betas.cuda()

    def run():
        y = bitdelta_linears_grouped(xd, wd, sizes, sd, ad, slotd, groups=groups)
        y1 = bitdelta_linear_grouped(xd, wd[:520], sd[0], ad[0], slotd, groups=groups)
        yb = bitdelta_linear_grouped(xd, wd[:520], sd[0], ad[0], slotd, groups=groups, betas=bd)
        return y, y1, yb

    def check_betas(x_cpu, yb, what):  # the sign products read x ⊙ β, the base product x
        ref = bitdelta_linear_batched(x_cpu.float(), w.float(), signs, alphas, ref_slot, betas=betas)
        torch.testing.assert_close(yb.float().cpu(), ref, rtol=0, atol=TOL[torch.bfloat16] * ref.abs().max().item(),
                                   msg=lambda s: f"{what}, column scales: {s}")

    y, y1, yb = run()
    torch.cuda.synchronize()
    check(x, y.split(sizes, 1), "eager")
    check(x, [y1], "eager, one matrix")
    check_betas(x, yb, "eager")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, y1, yb = run()
    for seed in range(3):
        xn = torch.randn(m, 1024, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
        xd.copy_(xn)
        graph.replay()
        torch.cuda.synchronize()
        check(xn, y.split(sizes, 1), f"replay {seed}")
        check(xn, [y1], f"replay {seed}, one matrix")
        check_betas(xn, yb, f"replay {seed}")
    import threading

    from deltafleet.kernels.triton_grouped import _ACCUMULATORS, GRAPHS  # each use leaves its accumulator zeroed

    kept = [b for (dev, n, owner), b in _ACCUMULATORS.items()
            if dev == xd.device.index and n in (520, 784) and owner in (threading.get_ident(), GRAPHS)]
    assert len(kept) == 4 and all(torch.count_nonzero(b).item() == 0 for b in kept)  # eager and graphs
    from deltafleet.kernels.triton_grouped import _SIDE_STREAMS  # the longer chain's blocks go first

    side = _SIDE_STREAMS[(xd.device.index, threading.get_ident())]
    assert side.priority < torch.cuda.current_stream().priority


@pytest.mark.gpu
def test_a_failed_two_stream_call_leaves_no_sign_products_behind(monkeypatch):
    """The two-stream path keeps its float32 accumulator between calls. A call that raises after its
    sign products were launched (here the base GEMM fails) must clear it before the error reaches the
    caller, also when the accumulator was made under inference mode and the failing call runs outside
    it, so that the next call of that width, on another stream too, gets its own sign products only."""
    import threading

    _hopper()
    from deltafleet.kernels import triton_base
    from deltafleet.kernels.triton_grouped import _ACCUMULATORS, _overlaps, bitdelta_linear_grouped

    x, w, signs, alphas, slot = _case(32, "zipf", 6, 384, 1024, True, torch.bfloat16)
    xd, wd, sd, ad, slotd = x.cuda(), w.cuda(), tile_signs(signs).cuda(), alphas.cuda(), slot.cuda()
    assert _overlaps(xd, wd, [sd])
    base = (slot < 0) | (slot >= 6)
    ref = bitdelta_linear_batched(x.float(), w.float(), signs, alphas, torch.where(base, -1, slot))
    with torch.inference_mode():  # as the engine first runs it
        bitdelta_linear_grouped(xd, wd, sd, ad, slotd)
    real = triton_base.base_mm

    def failing(*args, **kwargs):
        raise RuntimeError("the base GEMM failed")

    monkeypatch.setattr(triton_base, "base_mm", failing)
    with pytest.raises(RuntimeError, match="the base GEMM failed"):
        bitdelta_linear_grouped(xd, wd, sd, ad, slotd)
    torch.cuda.synchronize()
    mine = _ACCUMULATORS[(xd.device.index, 384, threading.get_ident())]
    assert torch.count_nonzero(mine).item() == 0, "the failed call's sign products were left behind"
    monkeypatch.setattr(triton_base, "base_mm", real)
    other = torch.cuda.Stream()
    with torch.cuda.stream(other):
        y = bitdelta_linear_grouped(xd, wd, sd, ad, slotd)
    torch.cuda.synchronize()
    torch.testing.assert_close(y.float().cpu(), ref, rtol=0, atol=TOL[torch.bfloat16] * ref.abs().max().item())
