"""The tiled sign layout (``deltafleet.kernels.reference.tile_signs``): the layout itself, the reference ops on
it, and the Triton kernels that read it (under ``TRITON_INTERPRET=1`` on the CPU; on the GPU with
``DELTAFLEET_TRITON_DEVICE=cuda``, ``make test-gpu``, as ``tests/test_kernels_triton.py``), each
against the row layout's float32 reference."""
from __future__ import annotations

import os

import pytest
import torch

DEVICE = os.environ.get("DELTAFLEET_TRITON_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from deltafleet.kernels import pack_signs  # noqa: E402
from deltafleet.kernels.reference import (bitdelta_linear, bitdelta_linear_batched, tile_signs, tiled_shape,  # noqa: E402
                               untile_signs)

pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []  # every case below then runs on the GPU
TOL = {torch.bfloat16: 2**-6, torch.float16: 2**-9}


def test_tile_layout_places_each_tile_whole_and_round_trips():
    """Tile ``(f, j)`` of slot s is rows ``64f … 64f + 63`` and bytes ``16j … 16j + 15`` of that
    slot's ``[N, KB]`` (zero past N and KB); ``untile_signs`` gives the rows back exactly."""
    g = torch.Generator().manual_seed(5)
    signs = torch.randint(0, 256, (2, 130, 37), generator=g, dtype=torch.uint8)  # N = 130, K = 296
    t = tile_signs(signs)
    assert t.shape == (2, 3, 3, 64, 16) and t.is_contiguous() and tuple(t.shape[1:]) == tiled_shape(130, 296)
    for s in range(2):
        for f in range(3):
            for j in range(3):
                want = torch.zeros(64, 16, dtype=torch.uint8)
                part = signs[s, 64 * f:64 * f + 64, 16 * j:16 * j + 16]
                want[:part.shape[0], :part.shape[1]] = part
                assert torch.equal(t[s, f, j], want), (s, f, j)
    assert torch.equal(untile_signs(t, 130, 296), signs)
    assert torch.equal(untile_signs(tile_signs(signs[1]), 130, 296), signs[1])  # one matrix, 4-D
    with pytest.raises(ValueError, match=r"^tiled signs must end in \[3, 3, 64, 16\] for \[130, 296\], "
                                         r"got \(2, 3, 2, 64, 16\)$"):
        untile_signs(t[:, :, :2], 130, 296)
    with pytest.raises(ValueError, match=r"^signs must be uint8 \[\.\.\., N, KB\], got torch.int32 \(4,\)$"):
        tile_signs(torch.zeros(4, dtype=torch.int32))


def test_reference_reads_tiled_signs_like_rows():
    g = torch.Generator().manual_seed(6)
    x, w = torch.randn(3, 200, generator=g), torch.randn(70, 200, generator=g)
    sign, alpha = pack_signs(torch.randn(70, 200, generator=g)), torch.rand(70, generator=g)
    assert torch.equal(bitdelta_linear(x, w, tile_signs(sign), alpha), bitdelta_linear(x, w, sign, alpha))
    signs = torch.stack([sign, pack_signs(torch.randn(70, 200, generator=g))])
    slot = torch.tensor([1, -1, 0], dtype=torch.int32)
    alphas = torch.rand(2, generator=g)
    assert torch.equal(bitdelta_linear_batched(x, w, tile_signs(signs), alphas, slot),
                       bitdelta_linear_batched(x, w, signs, alphas, slot))
    with pytest.raises(ValueError, match=r"^tiled signs must be \[S, 2, 2, 64, 16\], got \(2, 2, 1, 64, 16\)$"):
        bitdelta_linear_batched(x, w, tile_signs(signs)[:, :, :1], alphas, slot)


triton = pytest.importorskip("triton")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m, n, k, row_alpha", [
    (1, 70, 200, True),     # decode: N past one 64-row block, K past one 128-weight tile, ragged
    (3, 130, 1000, False),  # three row blocks of N, K split across programs
    (40, 65, 300, True),    # the prefill (tensor-core) kernel
])
def test_triton_single_variant_reads_tiled_signs(dtype, m, n, k, row_alpha):
    from deltafleet.kernels.triton_bitdelta import bitdelta_linear_triton

    g = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (0.05 * torch.randn(n, k, generator=g)).to(dtype)
    sign = pack_signs(torch.randn(n, k, generator=g))
    alpha = (0.03 + 0.05 * torch.rand(n, generator=g)) if row_alpha else torch.tensor(0.05)
    ref = bitdelta_linear(x.float(), w.float(), sign, alpha)
    y = bitdelta_linear_triton(*(t.to(DEVICE) for t in (x, w, tile_signs(sign), alpha)))
    atol = TOL[dtype] * ref.abs().max().item()
    torch.testing.assert_close(y.float().cpu(), ref, rtol=0, atol=atol)
    # the delta term is far above the tolerance: reading the tiles as rows would fail
    assert (ref - x.float() @ w.float().t()).abs().max().item() > 5 * atol
    with pytest.raises(ValueError, match=r"sign must be uint8 \[.*, 64, 16\]"):
        bitdelta_linear_triton(x, w, tile_signs(sign)[:, :1].contiguous(), alpha)


@pytest.mark.parametrize("impl", ["fma", "lut"])
# the second: two row blocks of 16, K past one 512-weight chunk of the interpreter's tiles, ragged
@pytest.mark.parametrize("m, n, k", [(5, 70, 200), (18, 24, 520)])
def test_triton_mixed_tenants_read_tiled_signs(impl, m, n, k):
    from deltafleet.kernels.triton_bitdelta import bitdelta_linear_batched_triton

    g = torch.Generator().manual_seed(m * 7 + k)
    dtype = torch.bfloat16
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (0.05 * torch.randn(n, k, generator=g)).to(dtype)
    signs = torch.stack([pack_signs(torch.randn(n, k, generator=g)) for _ in range(3)])
    alphas = 0.03 + 0.05 * torch.rand(3, n, generator=g)
    slot = torch.randint(-1, 3, (m,), generator=g, dtype=torch.int32)
    slot[0] = 2
    ref = bitdelta_linear_batched(x.float(), w.float(), signs, alphas, slot)
    y = bitdelta_linear_batched_triton(*(t.to(DEVICE) for t in (x, w, tile_signs(signs), alphas, slot)), impl=impl)
    atol = TOL[dtype] * ref.abs().max().item()
    torch.testing.assert_close(y.float().cpu(), ref, rtol=0, atol=atol)
    swapped = bitdelta_linear_batched(x.float(), w.float(), signs.flip(0), alphas, slot)
    assert (swapped[slot >= 0] - y.float().cpu()[slot >= 0]).abs().max() > 4 * atol
    with pytest.raises(ValueError, match=r"^impl='gluon' reads sign rows; tiled signs run with impl=None, 'fma', "
                                         r"'lut' or 'planes'$"):
        bitdelta_linear_batched_triton(x, w, tile_signs(signs), alphas, slot, impl="gluon")


@pytest.mark.gpu  # a Hopper GPU only: Gluon has no interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m, n, k", [(300, 200, 512), (1100, 384, 4096)])
def test_gluon_prefill_kernels_read_tiled_signs(dtype, m, n, k):
    """Both Hopper prefill kernels on tiled signs: the register-operand kernel at each of its usable
    configurations and the shared-memory one at its default, against the row layout's reference."""
    from deltafleet.kernels import gluon_bitdelta as gb
    from deltafleet.kernels import gluon_prefill_rs as pr

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("not a Hopper GPU")
    g = torch.Generator().manual_seed(m + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (0.05 * torch.randn(n, k, generator=g)).to(dtype)
    sign = pack_signs(torch.randn(n, k, generator=g))
    alpha = 0.03 + 0.05 * torch.rand(n, generator=g)
    ref = bitdelta_linear(x.float(), w.float(), sign, alpha)
    atol = TOL[dtype] * ref.abs().max().item()
    xd, wd, td, ad = x.cuda(), w.cuda(), tile_signs(sign).cuda(), alpha.cuda()
    configs = pr.usable_configs(xd, wd, td)
    assert configs, "the register-operand kernel should run on these tiled signs"
    for cfg in configs:
        y = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
        pr.bitdelta_linear_prefill_rs(xd, wd, td, ad, None, y, cfg)
        torch.testing.assert_close(y.float().cpu(), ref, rtol=0, atol=atol, msg=lambda s: f"rs {cfg}: {s}")
    y = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
    gb.bitdelta_linear_gluon(xd, wd, td, ad, None, y)
    torch.testing.assert_close(y.float().cpu(), ref, rtol=0, atol=atol, msg=lambda s: f"ss: {s}")


@pytest.mark.gpu  # a Hopper GPU only: Gluon has no interpreter
@pytest.mark.parametrize("m", [2, 16])
def test_dispatcher_runs_tiled_mixed_tenants_on_the_int8_kernel(m):
    """``bitdelta_linear_batched_triton`` with tiled signs and no ``impl`` on a Hopper GPU: the int8
    kernel at its first configuration of 128-weight K steps, equal to the reference."""
    from deltafleet.kernels.triton_bitdelta import bitdelta_linear_batched_triton

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("not a Hopper GPU")
    g = torch.Generator().manual_seed(m)
    n, k = 320, 1024
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = (0.05 * torch.randn(n, k, generator=g)).to(torch.bfloat16)
    signs = torch.stack([pack_signs(torch.randn(n, k, generator=g)) for _ in range(3)])
    alphas = 0.03 + 0.05 * torch.rand(3, n, generator=g)
    slot = torch.randint(-1, 3, (m,), generator=g, dtype=torch.int32)
    ref = bitdelta_linear_batched(x.float(), w.float(), signs, alphas, slot)
    y = bitdelta_linear_batched_triton(*(t.cuda() for t in (x, w, tile_signs(signs), alphas, slot)))
    torch.testing.assert_close(y.float().cpu(), ref, rtol=0, atol=TOL[torch.bfloat16] * ref.abs().max().item())
