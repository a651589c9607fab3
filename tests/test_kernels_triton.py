"""The Triton bitdelta_linear against the float32 torch reference.

On the CPU the kernel runs under ``TRITON_INTERPRET=1`` (set here before triton is imported). With
``DELTAFLEET_TRITON_DEVICE=cuda`` (``make test-gpu``) every case runs on the GPU and the module is a
``gpu`` test; the Gluon (Hopper) kernels' tests are ``gpu`` tests always, skipped off a Hopper GPU.

Tolerance: the kernel rounds each reconstructed weight ``W + α·s`` once to the activation dtype
before the float32-accumulating product, so against the float32 reference it may differ by about
one rounding (2⁻⁸ bf16, 2⁻¹¹ fp16) per weight, which averages over K: we allow
``atol = c · max|y_ref|`` with c = 2⁻⁶ (bf16) / 2⁻⁹ (fp16), and check that it is not vacuous by
requiring the delta term itself to be much larger than that.
"""
from __future__ import annotations

import os
import re

import pytest
import torch

DEVICE = os.environ.get("DELTAFLEET_TRITON_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []  # every case below then runs on the GPU

from deltafleet.kernels import pack_signs  # noqa: E402
from deltafleet.kernels.reference import bitdelta_linear  # noqa: E402
from deltafleet.kernels.triton_bitdelta import bitdelta_linear_triton  # noqa: E402

TOL = {torch.bfloat16: 2**-6, torch.float16: 2**-9}


def _case(m, n, k, dtype, row_alpha, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (0.05 * torch.randn(n, k, generator=g)).to(dtype)
    delta = torch.randn(n, k, generator=g)
    sign = pack_signs(delta)
    alpha = (0.03 + 0.05 * torch.rand(n, generator=g)) if row_alpha else torch.tensor(0.05)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, sign, alpha, b


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "m, n, k, row_alpha, bias",
    [
        (1, 64, 128, False, False),   # decode, aligned
        (3, 37, 77, True, False),     # K not a multiple of 8, N not of the block
        (17, 100, 200, False, True),  # M past one decode tile, bias
        (1, 130, 13, True, True),     # K < 8·2, N past two blocks
        (70, 65, 129, True, False),   # the larger (prefill) tile, ragged everywhere
    ],
)
def test_triton_matches_reference(dtype, m, n, k, row_alpha, bias):
    x, w, sign, alpha, b = _case(m, n, k, dtype, row_alpha, bias)
    ref = bitdelta_linear(x.float(), w.float(), sign, alpha, None if b is None else b.float())
    dev = [t.to(DEVICE) if t is not None else None for t in (x, w, sign, alpha, b)]
    y = bitdelta_linear_triton(*dev)
    assert y.shape == (m, n) and y.dtype == dtype and y.device.type == DEVICE
    atol = TOL[dtype] * ref.abs().max().item()
    torch.testing.assert_close(y.float().cpu(), ref, rtol=0, atol=atol)
    # the delta term is far above the tolerance, so a kernel ignoring it (or flipping a bit order) fails
    base_only = x.float() @ w.float().t() + (0 if b is None else b.float())
    assert (ref - base_only).abs().max().item() > 5 * atol


def test_wrong_bit_order_would_be_caught():
    x, w, sign, alpha, _ = _case(2, 32, 64, torch.bfloat16, False, False)
    flipped = torch.tensor([int(f"{v:08b}"[::-1], 2) for v in sign.flatten().tolist()], dtype=torch.uint8).view_as(sign)
    ref = bitdelta_linear(x.float(), w.float(), sign, alpha)
    y = bitdelta_linear_triton(*(t.to(DEVICE) for t in (x, w, flipped, alpha)))
    assert (y.float().cpu() - ref).abs().max() > 4 * TOL[torch.bfloat16] * ref.abs().max()


def test_contract_errors():
    x, w, sign, alpha, _ = _case(2, 16, 24, torch.bfloat16, False, False)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        bitdelta_linear_triton(x.float(), w.float(), sign, alpha)
    with pytest.raises(ValueError, match=r"sign must be uint8 \[16, 3\]"):
        bitdelta_linear_triton(x, w, sign[:, :2], alpha)
    with pytest.raises(ValueError, match=r"alpha must be \[\] or \[16\]"):
        bitdelta_linear_triton(x, w, sign, torch.ones(5))
    # another device's weight or signs: refused before a launch (on a GPU it faulted the context)
    with pytest.raises(ValueError, match="weight is on meta but x is on cpu: x, weight and the signs must be on one device"):
        bitdelta_linear_triton(x, w.to("meta"), sign, alpha)
    with pytest.raises(ValueError, match="sign is on meta but x is on cpu"):
        bitdelta_linear_triton(x, w, sign.to("meta"), alpha)
    with pytest.raises(ValueError, match="alpha must be a torch.Tensor, got float"):
        bitdelta_linear_triton(x, w, sign, 0.5)
    with pytest.raises(ValueError, match="weight has 0 input features; K must be ≥ 1"):
        bitdelta_linear_triton(x[:, :0], w[:, :0], sign[:, :0], alpha)


def test_custom_op_traces_with_its_fake_and_matches_the_kernel():
    """torch.ops.deltafleet.bitdelta_linear: opcheck (schema, fake tensor, dispatch) and a
    fullgraph torch.compile (aot_eager) trace through the fake implementation."""
    from deltafleet.kernels.ops import bitdelta_linear_op

    x, w, sign, alpha, b = (t.to(DEVICE) if t is not None else None
                            for t in _case(3, 40, 24, torch.bfloat16, True, True))
    torch.library.opcheck(bitdelta_linear_op, (x, w, sign, alpha, b),
                          test_utils=("test_schema", "test_faketensor"))
    compiled = torch.compile(lambda *a: torch.ops.deltafleet.bitdelta_linear(*a) * 2, backend="aot_eager",
                             fullgraph=True)
    torch.testing.assert_close(compiled(x, w, sign, alpha, b), 2 * bitdelta_linear_triton(x, w, sign, alpha, b),
                               rtol=0, atol=0)
    # a meta argument dispatches to the fake implementation, not the kernel: it checks devices too
    with pytest.raises(ValueError, match=f"weight is on meta but x is on {x.device.type}"):
        torch.ops.deltafleet.bitdelta_linear(x, w.to("meta"), sign, alpha, b)
    for i, name in ((3, "alpha"), (4, "bias")):  # α and bias may be elsewhere (moved), but not on meta
        args = [x, w, sign, alpha, b]
        args[i] = args[i].to("meta")
        with pytest.raises(ValueError, match=f"{name} is on the meta device \\(no data\\) but x is on"):
            torch.ops.deltafleet.bitdelta_linear(*args)


def test_dispatcher_uses_the_reference_off_cuda():
    from deltafleet import kernels

    x, w, sign, alpha, _ = _case(2, 16, 24, torch.bfloat16, False, False)
    torch.testing.assert_close(kernels.bitdelta_linear(x, w, sign, alpha),
                               kernels.bitdelta_linear_reference(x, w, sign, alpha), rtol=0, atol=0)
    if torch.cuda.is_available():
        y = kernels.bitdelta_linear(*(t.cuda() for t in (x, w, sign, alpha)))
        torch.testing.assert_close(y.cpu(), bitdelta_linear_triton(*(t.cuda() for t in (x, w, sign, alpha))).cpu(),
                                   rtol=0, atol=0)


BATCHED_CASES = [
    (5, 37, 77, 3, True, False),    # ragged N and K, rows of 3 tenants and base-only rows
    (9, 64, 300, 4, False, True),   # more rows than one block of 4, matrix α, bias
    (1, 20, 13, 1, True, True),     # one token
]


@pytest.mark.parametrize("impl", ["fma", "lut"])
@pytest.mark.parametrize("dtype, m, n, k, tenants, row_alpha, bias",
                         [(d, *c) for d in (torch.bfloat16, torch.float16) for c in BATCHED_CASES]
                         # two row blocks of 16 and K split across programs (bf16: the slowest case
                         # under the interpreter; fp16 takes the same code path as in the others)
                         + [(torch.bfloat16, 18, 24, 1000, 5, True, False)],
                         ids=lambda v: str(v) if isinstance(v, torch.dtype) else None)
def test_batched_triton_matches_reference(impl, dtype, m, n, k, tenants, row_alpha, bias):
    from deltafleet.kernels.reference import bitdelta_linear_batched
    from deltafleet.kernels.triton_bitdelta import bitdelta_linear_batched_triton

    g = torch.Generator().manual_seed(m * 31 + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (0.05 * torch.randn(n, k, generator=g)).to(dtype)
    signs = torch.stack([pack_signs(torch.randn(n, k, generator=g)) for _ in range(tenants)])
    alphas = (0.03 + 0.05 * torch.rand(tenants, n, generator=g)) if row_alpha else 0.03 + 0.05 * torch.rand(tenants, generator=g)
    slot = torch.randint(-1, tenants, (m,), generator=g, dtype=torch.int32)
    slot[0] = tenants - 1  # at least one row with a delta
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    ref = bitdelta_linear_batched(x.float(), w.float(), signs, alphas, slot, None if b is None else b.float())
    y = bitdelta_linear_batched_triton(*(t.to(DEVICE) if t is not None else None for t in (x, w, signs, alphas, slot, b)),
                                       impl=impl)
    assert y.shape == (m, n) and y.dtype == dtype
    # no rounding of W + α·s here: only the inputs' and the output's own rounding
    atol = TOL[dtype] * ref.abs().max().item()
    torch.testing.assert_close(y.float().cpu(), ref, rtol=0, atol=atol)
    # each row really used its own tenant: swapping two tenants' signs changes the rows that use them
    if tenants > 1:
        swapped = bitdelta_linear_batched(x.float(), w.float(), signs.flip(0), alphas, slot,
                                          None if b is None else b.float())
        rows = slot >= 0
        assert (swapped[rows] - y.float().cpu()[rows]).abs().max() > 4 * atol


def test_batched_contract_errors():
    from deltafleet.kernels.triton_bitdelta import bitdelta_linear_batched_triton

    x = torch.randn(2, 16).bfloat16()
    w = torch.randn(8, 16).bfloat16()
    signs = torch.zeros(2, 8, 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"slot indices must lie in \[-1, 2\), got \[-1, 2\]"):
        bitdelta_linear_batched_triton(x, w, signs, torch.ones(2), torch.tensor([-1, 2]))
    with pytest.raises(ValueError, match=r"alphas must be \[2\] or \[2, 8\]"):
        bitdelta_linear_batched_triton(x, w, signs, torch.ones(3), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="impl must be 'fma', 'lut', 'gluon' or 'planes', got 'gemm'"):
        bitdelta_linear_batched_triton(x, w, signs, torch.ones(2), torch.tensor([0, 1]), impl="gemm")
    with pytest.raises(ValueError, match="impl='planes' needs a Hopper GPU, two rows or more, K a multiple of 128"):
        bitdelta_linear_batched_triton(x, w, signs, torch.ones(2), torch.tensor([0, 1]), impl="planes")
    with pytest.raises(ValueError, match="weight is on meta but x is on cpu: x, weight and the signs must be on one device"):
        bitdelta_linear_batched_triton(x, w.to("meta"), signs, torch.ones(2), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="signs is on meta but x is on cpu"):
        bitdelta_linear_batched_triton(x, w, signs.to("meta"), torch.ones(2), torch.tensor([0, 1]))


@pytest.mark.parametrize("m", [1, 3])
def test_split_k_partial_sums_meet_and_the_workspace_is_left_zero(m):
    """K = 1000 spans two K-chunks of the decode kernel (interpreter tiles: 2 × 32 bytes = 512 k), so
    the two programs' partial sums meet in the float32 workspace; calling twice gives the same y and
    leaves the workspace and its counters at zero."""
    from deltafleet.kernels import triton_bitdelta as tb

    x, w, sign, alpha, b = _case(m, 24, 1000, torch.bfloat16, True, True, seed=3)
    ref = bitdelta_linear(x.float(), w.float(), sign, alpha, b.float())
    dev = [t.to(DEVICE) for t in (x, w, sign, alpha, b)]
    y1 = bitdelta_linear_triton(*dev)
    y2 = bitdelta_linear_triton(*dev)
    torch.testing.assert_close(y1.float().cpu(), ref, rtol=0, atol=TOL[torch.bfloat16] * ref.abs().max().item())
    assert torch.equal(y1, y2)
    ws, cnt = tb._WORKSPACE[y1.device]
    assert ws.abs().max().item() == 0 and cnt.abs().max().item() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["fma", "lut"])
@pytest.mark.parametrize("n, k, tenants", [(8192, 28672, 16), (57344, 8192, 16), (8192, 28672, 8)],
                         ids=["down-T16", "gate_up-T16", "down-T8"])
def test_mixed_tenant_kernels_at_70b_shapes_stay_finite_and_clean(impl, n, k, tenants):
    """The CUDA-core mixed-tenant kernels (``"fma"``, ``"lut"``), autotuned, on Llama-2-70B's widest
    layers (``down``: K = 28672; ``gate_up``: N = 57344) with one row per tenant: the shapes where K
    is split over the most programs and the split-K workspace is largest. Called twice (the second
    call reuses the tuned tile and the workspace the first left behind), each output has no NaN,
    matches the float32 reference within the dtype tolerance, and leaves the workspace and its
    counters zero."""
    from deltafleet.kernels import triton_bitdelta as tb
    from deltafleet.kernels.reference import bitdelta_linear_batched

    g = torch.Generator(device="cuda").manual_seed(n + k + tenants)
    w = (0.02 * torch.randn(n, k, device="cuda", generator=g)).bfloat16()
    signs = torch.randint(0, 256, (tenants, n, k // 8), device="cuda", dtype=torch.uint8, generator=g)
    alphas = 0.004 + 0.002 * torch.rand(tenants, n, device="cuda", generator=g)
    slot = torch.arange(tenants, device="cuda", dtype=torch.int32)
    x = torch.randn(tenants, k, device="cuda", generator=g).bfloat16()
    ref = bitdelta_linear_batched(x.float(), w.float(), signs, alphas, slot)
    atol = TOL[torch.bfloat16] * ref.abs().max().item()
    for call in range(2):
        y = tb.bitdelta_linear_batched_triton(x, w, signs, alphas, slot, impl=impl)
        torch.cuda.synchronize()
        assert not y.isnan().any(), f"call {call}: NaN in rows {y.isnan().any(1).nonzero().flatten().tolist()}"
        torch.testing.assert_close(y.float(), ref, rtol=0, atol=atol, msg=lambda s, call=call: f"call {call}: {s}")
        ws, cnt = tb._workspace(y.device, 0, 0)
        assert not ws.any() and not cnt.any(), f"call {call} left the split-K workspace dirty"


def test_batched_custom_op_and_dispatcher():
    from deltafleet import kernels
    from deltafleet.kernels.ops import bitdelta_linear_batched_op
    from deltafleet.kernels.triton_bitdelta import bitdelta_linear_batched_triton

    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 40, generator=g).bfloat16()
    w = (0.05 * torch.randn(16, 40, generator=g)).bfloat16()
    signs = torch.stack([pack_signs(torch.randn(16, 40, generator=g)) for _ in range(2)])
    alphas = 0.03 + 0.05 * torch.rand(2, 16, generator=g)
    slot = torch.tensor([1, -1, 0], dtype=torch.int32)
    dev = [t.to(DEVICE) for t in (x, w, signs, alphas, slot)]
    torch.library.opcheck(bitdelta_linear_batched_op, tuple(dev), test_utils=("test_schema", "test_faketensor"))
    compiled = torch.compile(lambda *a: torch.ops.deltafleet.bitdelta_linear_batched(*a) + 1, backend="aot_eager",
                             fullgraph=True)
    torch.testing.assert_close(compiled(*dev), bitdelta_linear_batched_triton(*dev) + 1, rtol=0, atol=0)
    with pytest.raises(ValueError, match=f"signs is on meta but x is on {dev[0].device.type}"):
        torch.ops.deltafleet.bitdelta_linear_batched(dev[0], dev[1], dev[2].to("meta"), *dev[3:])
    # the dispatcher: the reference off CUDA (exactly), the Triton kernel on CUDA
    torch.testing.assert_close(kernels.bitdelta_linear_batched(x, w, signs, alphas, slot),
                               kernels.bitdelta_linear_batched_reference(x, w, signs, alphas, slot), rtol=0, atol=0)
    if torch.cuda.is_available():
        cuda = [t.cuda() for t in (x, w, signs, alphas, slot)]
        torch.testing.assert_close(kernels.bitdelta_linear_batched(*cuda), bitdelta_linear_batched_triton(*cuda),
                                   rtol=0, atol=0)
        # traced, the dispatcher hands torch.compile the custom op (a whole graph, through its fake)
        traced = torch.compile(kernels.bitdelta_linear_batched, backend="aot_eager", fullgraph=True)
        torch.testing.assert_close(traced(*cuda), bitdelta_linear_batched_triton(*cuda), rtol=0, atol=0)


def test_bias_is_checked_and_read_through_its_strides():
    """A bias that is a strided view gives the same y as a contiguous one; a bias of the wrong
    shape, or a weight that is not 2-D, is refused by the reference and both Triton paths alike."""
    from deltafleet.kernels.reference import bitdelta_linear_batched
    from deltafleet.kernels.triton_bitdelta import bitdelta_linear_batched_triton

    x, w, sign, alpha, _ = _case(3, 16, 24, torch.bfloat16, True, False, seed=7)
    wide = torch.randn(32, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    strided, dense = wide[::2], wide[::2].contiguous()
    assert not strided.is_contiguous()
    dev = [t.to(DEVICE) for t in (x, w, sign, alpha)]
    torch.testing.assert_close(bitdelta_linear_triton(*dev, strided.to(DEVICE)), bitdelta_linear_triton(*dev, dense.to(DEVICE)),
                               rtol=0, atol=0)
    signs, alphas, slot = sign[None], alpha[None], torch.tensor([0, -1, 0], dtype=torch.int32)
    for impl in ("fma", "lut"):
        torch.testing.assert_close(
            bitdelta_linear_batched_triton(dev[0], dev[1], signs.to(DEVICE), alphas.to(DEVICE), slot.to(DEVICE),
                                           strided.to(DEVICE), impl=impl),
            bitdelta_linear_batched_triton(dev[0], dev[1], signs.to(DEVICE), alphas.to(DEVICE), slot.to(DEVICE),
                                           dense.to(DEVICE), impl=impl), rtol=0, atol=0)
    for bad in (torch.zeros(1), torch.zeros(17), torch.zeros(3, 16)):
        for call in (lambda b: bitdelta_linear(x, w, sign, alpha, b), lambda b: bitdelta_linear_triton(x, w, sign, alpha, b),
                     lambda b: bitdelta_linear_batched(x, w, signs, alphas, slot, b),
                     lambda b: bitdelta_linear_batched_triton(x, w, signs, alphas, slot, b)):
            with pytest.raises(ValueError, match=re.escape(f"bias must be [16], got {tuple(bad.shape)}")):
                call(bad.to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"weight must be \[N, K\], got shape \(2, 16, 24\)"):
        bitdelta_linear_triton(x, w.expand(2, 16, 24), sign, alpha)
    with pytest.raises(ValueError, match=r"weight must be \[N, K\], got shape \(24,\)"):
        bitdelta_linear(x, w[0], sign, alpha)


@pytest.mark.parametrize("impl", ["fma", "lut"])
def test_batched_with_no_slots_is_the_base_product(impl):
    """S = 0 (no variant loaded) and every row base-only: y = x·Wᵀ, and nothing is read from the
    empty signs / alphas (the FMA kernel masks those loads by the row's slot)."""
    from deltafleet.kernels.reference import bitdelta_linear_batched
    from deltafleet.kernels.triton_bitdelta import bitdelta_linear_batched_triton

    x, w, sign, alpha, _ = _case(3, 16, 24, torch.bfloat16, True, False, seed=9)
    signs, alphas = sign[None][:0], alpha[None][:0]
    slot = torch.full((3,), -1, dtype=torch.int32)
    ref = bitdelta_linear_batched(x.float(), w.float(), signs, alphas, slot)
    torch.testing.assert_close(ref, x.float() @ w.float().t())
    y = bitdelta_linear_batched_triton(*(t.to(DEVICE) for t in (x, w, signs, alphas, slot)), impl=impl)
    torch.testing.assert_close(y.float().cpu(), ref, rtol=0, atol=TOL[torch.bfloat16] * ref.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool], ids=str)
def test_slot_must_be_an_integer_tensor(dtype):
    from deltafleet.kernels.reference import bitdelta_linear_batched
    from deltafleet.kernels.triton_bitdelta import bitdelta_linear_batched_triton

    x, w, sign, alpha, _ = _case(2, 8, 16, torch.bfloat16, True, False)
    slot = torch.tensor([0, 0]).to(dtype)
    for fn in (bitdelta_linear_batched, bitdelta_linear_batched_triton):
        with pytest.raises(ValueError, match=f"slot must be an integer tensor, got {dtype}"):
            fn(x, w, sign[None], alpha[None], slot)


def test_register_operand_prefill_refuses_a_ring_too_short_for_its_lookahead():
    """A loop body waits for its U ring stages before releasing any (with PRE also for the next body's
    first), so a ring of fewer stages (with PRE: no more) than K steps per body would deadlock: the
    wrapper refuses it before launching, and no listed configuration is such."""
    from deltafleet.kernels import gluon_prefill_rs as pr

    x, w, sign, alpha, _ = _case(4, 128, 256, torch.bfloat16, True, False)
    y = torch.empty(4, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"config \(256, 4, 4, True, 240\): PRE needs more ring stages than K steps"):
        pr.bitdelta_linear_prefill_rs(x, w, sign, alpha, None, y, (256, 4, 4, True, 240))
    with pytest.raises(ValueError, match=r"config \(256, 3, 4, False, 240\): the ring needs at least as many stages as K"):
        pr.bitdelta_linear_prefill_rs(x, w, sign, alpha, None, y, (256, 3, 4, False, 240))
    assert all(stages >= u + pre for _, stages, u, pre, _ in pr.CONFIGS)


@pytest.mark.gpu  # a Hopper GPU only: Gluon has no interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "m, n, k, row_alpha, bias",
    [
        (130, 264, 136, True, True),    # M, N and K all past a tile (K = 2·64 + 8)
        (300, 200, 1024, False, False),  # one α per matrix, N below one tile
        (2048, 384, 512, True, False),   # prefill size
        (5, 256, 64, True, True),        # fewer rows than a tile
        (1100, 3900, 384, True, True),   # 155 output tiles (partial in M and N), 6 K steps: tiles start mid-ring
    ],
)
def test_gluon_prefill_matches_reference(dtype, m, n, k, row_alpha, bias):
    from deltafleet.kernels import gluon_bitdelta as gb

    x, w, sign, alpha, b = _case(m, n, k, dtype, row_alpha, bias)
    ref = bitdelta_linear(x.float(), w.float(), sign, alpha, None if b is None else b.float())
    x, w, sign, alpha = x.cuda(), w.cuda(), sign.cuda(), alpha.cuda()
    b = b.cuda() if b is not None else None
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("not a Hopper GPU")
    assert gb.supported(x, w)
    atol = TOL[dtype] * ref.abs().max().item()
    for config in gb.CONFIGS:
        y = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
        gb.bitdelta_linear_gluon(x, w, sign, alpha, b, y, config)
        torch.testing.assert_close(y.float().cpu(), ref, rtol=0, atol=atol, msg=lambda s: f"{config}: {s}")
    from deltafleet.kernels import gluon_prefill_rs as pr

    assert pr.rs_supported(x, w, sign) == (k % 64 == 0)
    usable = pr.usable_configs(x, w, sign)
    if k % 64:
        assert usable == []
    elif m > 128:
        assert usable == [c for c in pr.ordered_configs(m, n, pr.multiprocessors(x.device)) if k % (64 * c[2]) == 0]
    else:  # the smallest token tile that holds every row first, none over twice the rows (at least 8)
        assert usable and usable[0][0] >= m and all(c[0] <= max(8, 2 * triton.next_power_of_2(m)) for c in usable)
    for config in pr.CONFIGS if k % 64 == 0 else ():  # the register-operand prefill kernel (α rounded to the dtype)
        y = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
        if k % (64 * config[2]):
            with pytest.raises(ValueError, match=f"K = {k} is not a multiple of {64 * config[2]}"):
                pr.bitdelta_linear_prefill_rs(x, w, sign, alpha, b, y, config)
            continue
        pr.bitdelta_linear_prefill_rs(x, w, sign, alpha, b, y, config)
        torch.testing.assert_close(y.float().cpu(), ref, rtol=0, atol=atol, msg=lambda s: f"rs {config}: {s}")


@pytest.mark.gpu  # a Hopper GPU only: Gluon has no interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "m, n, k, row_alpha, bias, tiled",
    [
        (2, 264, 640, True, True, False),     # 10 K steps: splits 1…5 of 5 two-step bodies, N past a tile
        (16, 384, 1024, False, False, True),  # tiled signs, one α
        (37, 200, 1152, True, False, False),  # rows past a token tile of 32, N below one feature tile
        (128, 256, 512, True, True, True),
        (100, 2048, 1024, True, True, False),  # 208+ work units: persistent programs walk several each
    ],
)
def test_register_operand_kernel_small_batches_and_k_splits(dtype, m, n, k, row_alpha, bias, tiled):
    """Every small-batch configuration (``gluon_prefill_rs.SMALL_CONFIGS``) at K splits of 1, 2, 3
    and 16 (more chunks than loop bodies: rounded down), with the first half of the tiles whole (a
    count rounded down to whole feature tiles, and past every tile), one program per work unit and
    persistent, matches the reference, and leaves the split-K workspace as it found it (zeros), so
    the next call is right too."""
    from deltafleet.kernels import gluon_prefill_rs as pr
    from deltafleet.kernels import tile_signs
    from deltafleet.kernels.triton_bitdelta import _workspace

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("not a Hopper GPU")
    x, w, sign, alpha, b = _case(m, n, k, dtype, row_alpha, bias, seed=3)
    ref = bitdelta_linear(x.float(), w.float(), sign, alpha, None if b is None else b.float())
    x, w, alpha = x.cuda(), w.cuda(), alpha.cuda()
    sign = (tile_signs(sign) if tiled else sign).cuda()
    b = b.cuda() if b is not None else None
    atol = TOL[dtype] * ref.abs().max().item()
    for config in pr.SMALL_CONFIGS:
        half = triton.cdiv(m, config[0]) * (triton.cdiv(n, 128) // 2)  # the first half of the feature tiles
        for split, whole in ((1, 0), (2, 0), (3, 0), (16, 0), (2, half), (3, half + 1), (3, 1 << 20)):
            for persistent in (False, True):
                for _ in range(2):  # twice: the second call reads the workspace the first one left
                    y = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
                    pr.bitdelta_linear_prefill_rs(x, w, sign, alpha, b, y, config, split, persistent, whole)
                    torch.testing.assert_close(
                        y.float().cpu(), ref, rtol=0, atol=atol,
                        msg=lambda s: f"{config} split {split} whole {whole} persistent {persistent}: {s}")
    ws, cnt = _workspace(x.device, 1, 1)
    assert not ws.any() and not cnt.any()


@pytest.mark.gpu
@pytest.mark.parametrize("m", [2, 3, 4, 5, 8, 16, 24, 64, 100])
def test_dispatcher_from_two_rows_matches_reference(m):
    """``bitdelta_linear`` from two rows up (on a Hopper GPU the register-operand kernel with K split;
    timed, the CUDA-core decode kernel competes up to four rows) matches the reference, untimed (the
    tests' quick tuning) and timed."""
    from deltafleet.kernels import gluon_prefill_rs as pr
    from deltafleet.kernels import triton_bitdelta as tb

    x, w, sign, alpha, b = _case(m, 512, 1024, torch.bfloat16, True, True, seed=m)
    ref = bitdelta_linear(x.float(), w.float(), sign, alpha, b.float())
    args = [t.cuda() for t in (x, w, sign, alpha, b)]
    atol = TOL[torch.bfloat16] * ref.abs().max().item()
    torch.testing.assert_close(tb.bitdelta_linear_triton(*args).float().cpu(), ref, rtol=0, atol=atol)
    tb._PREFILL_CHOICE.clear()
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("DELTAFLEET_TRITON_QUICK_TUNE", raising=False)
        mp.setattr(tb, "AUTOTUNE", True)
        y = tb.bitdelta_linear_triton(*args)
    torch.testing.assert_close(y.float().cpu(), ref, rtol=0, atol=atol)
    if torch.cuda.get_device_capability()[0] == 9 and m <= 64:  # the register-operand kernel or decode
        (pick, ) = tb._PREFILL_CHOICE.values()
        assert pick[0] == "rs" if m > 4 else pick == "decode" or pick[0] == "rs"
        tb._PREFILL_CHOICE.clear()  # untimed: the register-operand kernel from two rows up
        launches, launch = [], pr.bitdelta_linear_prefill_rs
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(pr, "bitdelta_linear_prefill_rs", lambda *a: launches.append(a[6:]) or launch(*a))
            torch.testing.assert_close(tb.bitdelta_linear_triton(*args).float().cpu(), ref, rtol=0, atol=atol)
        config = pr.usable_configs(args[0], args[1], args[2])[0]
        split, whole = pr.default_split(m, 512, 1024, config, pr.multiprocessors(args[0].device))
        assert launches == [(config, split, True, whole)]


def test_register_operand_split_fills_one_wave_and_no_more():
    """The K split (``gluon_prefill_rs.default_split``, ``(split, whole)``): a matrix of few 128-feature
    tiles is split until its units fill one wave of programs, one per multiprocessor, and no further;
    one of more tiles runs its full waves whole and splits the rest over the multiprocessors when that
    rest is at most half a wave, else nothing; every chunk holds at least one loop body. The cases
    are the Llama-2 layers whose best form an H100 sweep found (docs/kernels.md)."""
    from deltafleet.kernels import gluon_prefill_rs as pr

    c16, c64, c128 = (next(c for c in pr.SMALL_CONFIGS if c[0] == bt) for bt in (16, 64, 128))
    assert pr.default_split(16, 4096, 4096, c16, 132) == (4, 0)       # Llama-2-7B o: 32 tiles, 128 units
    assert pr.default_split(16, 4096, 11008 // 128 * 128, c16, 132) == (4, 0)
    assert pr.default_split(16, 8192, 28672, c16, 132) == (2, 0)      # 70B down: 64 tiles
    assert pr.default_split(16, 12288, 4096, c16, 132) == (1, 0)      # 7B qkv: 96 tiles, 73% of a wave
    assert pr.default_split(64, 10240, 8192, c64, 132) == (1, 0)      # 70B qkv: 80 tiles
    assert pr.default_split(128, 4096, 4096, c128, 132) == (4, 0)
    assert pr.default_split(200, 4096, 4096, c64, 132) == (1, 0)      # 4 token tiles × 32: one wave
    # 7B gate_up, 172 tiles: 132 whole, the other 40 in 3 chunks (120 units); 70B gate_up, 448: 396 + 52 × 2
    assert pr.default_split(16, 22016, 4096, c16, 132) == (3, 132)
    assert pr.default_split(64, 22016, 4096, c64, 132) == (3, 132)
    assert pr.default_split(64, 57344, 8192, c64, 132) == (2, 396)
    assert pr.default_split(128, 22016, 4096, c64, 132) == (1, 0)     # 344 tiles: a rest of 80, over half
    assert pr.default_split(128, 70 * 128, 4096, c64, 132) == (16, 132)  # whole tiles: both token tiles
    assert pr.default_split(16, 264 * 128, 4096, c16, 132) == (1, 0)  # two full waves
    assert pr.default_split(16, 128, 128, c16, 132) == (1, 0)         # one body of K: nothing to split
    assert pr.default_split(16, 128, 640, c16, 132) == (5, 0)         # at most one chunk per body
    assert pr.default_split(16, 128, 768, c16, 132) == (6, 0)
    assert pr.default_split(16, 256, 640, c16, 3) == (1, 0)           # 2 tiles on 3 multiprocessors
    for m, n, k in ((256, 4096, 4096), (512, 22016, 4096), (2048, 8192, 28672)):  # 256-token tiles: whole
        assert pr.default_split(m, n, k, pr.CONFIGS[0], 132) == (1, 0)


def test_register_operand_default_token_tile_fills_half_a_wave_unsplit():
    """Up to 128 rows the smallest token tile that holds the rows leads; beyond, the largest of 256,
    128 and 64 tokens whose tiles, unsplit, occupy half of the multiprocessors (else the 64-token
    tile), ahead of the others (``gluon_prefill_rs.ordered_configs``)."""
    from deltafleet.kernels import gluon_prefill_rs as pr

    def lead(m, n):
        return pr.ordered_configs(m, n, 132)[0][0]

    assert [lead(m, 4096) for m in (2, 5, 16, 17, 64, 100, 128)] == [8, 8, 16, 32, 64, 128, 128]
    assert lead(256, 12288) == 256    # 7B qkv: 96 tiles of 256 tokens
    assert lead(256, 22016) == 256    # 7B gate_up: 172
    assert lead(256, 10240) == 256    # 70B qkv: 80 of 132, over half
    assert lead(256, 8192) == 128     # 70B o and down: 64 tiles of 256, 128 of 128
    assert lead(256, 4096) == 64      # 7B o and down: 32 · 64 · 128 tiles
    assert lead(200, 4096) == 64
    assert lead(2048, 4096) == 256    # prefill: 8 token tiles × 32
    assert lead(256, 1024) == 64      # too few tiles at any size: the smallest
    for m, n in ((129, 512), (256, 4096), (2048, 57344)):
        configs = pr.ordered_configs(m, n, 132)
        assert sorted(configs) == sorted(list(pr.CONFIGS) + [next(c for c in pr.SMALL_CONFIGS if c[0] == bt)
                                                             for bt in (128, 64)])
        assert len(set(configs)) == len(configs)


def test_register_operand_refuses_a_split_that_is_not_a_count():
    from deltafleet.kernels import gluon_prefill_rs as pr

    x, w, sign, alpha, _ = _case(4, 128, 256, torch.bfloat16, True, False)
    y = torch.empty(4, 128, dtype=torch.bfloat16)
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match=f"split must be 1 or more K chunks, got {bad}"):
            pr.bitdelta_linear_prefill_rs(x, w, sign, alpha, None, y, pr.SMALL_CONFIGS[0], bad)


def _tenant_case(m, n, k, dtype, row_alpha, bias):
    """A mixed-tenant batch of three slots with row 0 base-only and the last row's slot out of range
    (a kernel gives it the base): the float32 reference and ``(x, w, signs, alphas, slot, bias)`` on
    the GPU."""
    from deltafleet.kernels.reference import bitdelta_linear_batched

    g = torch.Generator().manual_seed(m * 1000 + n)
    n_slots = 3
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (0.05 * torch.randn(n, k, generator=g)).to(dtype)
    signs = torch.randint(0, 256, (n_slots, n, k // 8), generator=g, dtype=torch.uint8)
    alphas = 0.01 + 0.02 * torch.rand((n_slots, n) if row_alpha else (n_slots,), generator=g)
    slot = torch.randint(-1, n_slots, (m,), generator=g, dtype=torch.int32)
    slot[0], slot[-1] = -1, n_slots + 5
    b = (0.1 * torch.randn(n, generator=g)).to(dtype) if bias else None
    ref = bitdelta_linear_batched(x.float(), w.float(), signs, alphas, torch.where(slot < n_slots, slot, -1),
                                  None if b is None else b.float())
    return ref, [t.cuda() if t is not None else None for t in (x, w, signs, alphas, slot, b)]


@pytest.mark.gpu  # a Hopper GPU only: Gluon has no interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "m, n, k, row_alpha, bias",
    [
        (2, 264, 320, True, True),     # N past a tile, K = 5·64
        (3, 200, 1024, False, False),  # one α per matrix, N below a tile, a base-only row
        (16, 1024, 4096, True, False),  # a full row block, K split across programs
        (17, 136, 128, True, True),    # two row blocks, the second of one row
        (33, 512, 2048, False, True),  # three row blocks
    ],
)
def test_gluon_tenants_match_reference(dtype, m, n, k, row_alpha, bias):
    """The Hopper mixed-tenant kernel, every configuration usable for the row count, with K split
    and not: equal to the float32 reference, rows of slot −1 and of an out-of-range slot getting the
    base only, and the split-K workspace left zero."""
    from deltafleet.kernels import gluon_bitdelta as gb
    from deltafleet.kernels import triton_bitdelta as tb

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("not a Hopper GPU")
    ref, dev = _tenant_case(m, n, k, dtype, row_alpha, bias)
    assert gb.tenants_supported(dev[0], dev[1], dev[2])
    atol = TOL[dtype] * ref.abs().max().item()
    rows = max(2, min(16, triton.next_power_of_2(m)))
    for config in gb.tenant_configs(rows):
        for split in (1, 3):
            y = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
            ws, cnt = tb._workspace(y.device, m * n, m * triton.cdiv(n, 2))
            gb.bitdelta_linear_batched_gluon(*dev, y, ws, cnt, config, split=split)
            torch.cuda.synchronize()
            torch.testing.assert_close(y.float().cpu(), ref, rtol=0, atol=atol,
                                       msg=lambda s: f"{config} split {split}: {s}")
            assert not ws.any() and not cnt.any(), f"{config} split {split} left the workspace dirty"
    y = tb.bitdelta_linear_batched_triton(*dev[:5], dev[5])  # the dispatcher's pick for this shape
    torch.testing.assert_close(y.float().cpu(), ref, rtol=0, atol=atol)


@pytest.mark.parametrize("k", [96, 8192 + 160])
def test_activation_planes_split_x_into_two_int8_planes_in_the_permuted_order(k):
    """``activation_planes`` (the int8 tensor-core tenant kernel's input): every activation is
    ``scale·(256·hi + lo)`` to within ``scale/2``, with ``scale = max|x|/32639``, stored at logical
    position ``4a + j`` of its 32-block for physical ``a + 8j``; ``Σq`` is the sum of the integers.
    An all-zero row gets scale 0 and zero planes."""
    from deltafleet.kernels.gluon_planes import PLANE_MAX, activation_planes

    g = torch.Generator().manual_seed(5)
    m = 3
    x = torch.randn(m, k, generator=g)
    x[1, 7] = 40.0  # an outlier sets its row's scale
    x[2] = 0.0
    x = x.to(torch.bfloat16)
    planes, sc = activation_planes(x.to(DEVICE))
    planes, sc = planes.cpu(), sc.cpu()
    assert planes.shape == (2 * m, k) and planes.dtype == torch.int8 and sc.shape == (m, 2)
    kl = torch.arange(k)
    phys = (kl // 32) * 32 + (kl % 32) // 4 + 8 * (kl % 4)
    assert sorted(phys.tolist()) == list(range(k))  # a permutation within each 32-block
    q = 256 * planes[0::2].int() + planes[1::2].int()  # [m, k], logical order
    scale = x.float().abs().amax(dim=1) / PLANE_MAX
    torch.testing.assert_close(sc[:, 0], scale)
    back = torch.empty(m, k)
    back[:, phys] = q.float() * scale[:, None]
    err = (back - x.float()).abs()
    # scale/2, plus float32 rounding of x/scale and of q·scale (|q| ≤ 32639: about 0.004·scale)
    assert (err <= scale[:, None] * 0.505 + 1e-12).all(), (err / scale[:, None].clamp_min(1e-30)).max()
    assert q.abs().max() <= PLANE_MAX and q[1].abs().max() == PLANE_MAX
    torch.testing.assert_close(sc[:, 1], q.sum(dim=1).float())
    assert not planes[4:].any() and sc[2, 0] == 0


@pytest.mark.parametrize("k", [128, 384, 1024 + 384])  # the last: past one default chunk, ragged
def test_activation_bitplanes_pack_the_16_bit_copy_as_the_binary_mmas_read_it(k):
    """``activation_bitplanes`` (the binary tensor-core path's input): every activation is
    ``scale·q`` to within ``scale/2`` with ``scale = max|x|/32767``; bit p of ``q`` (16-bit two's
    complement) for weight ``128j + 32t + i`` is bit i of word ``[row, j, p % 8, t, p // 8]``; and the
    identity the kernel uses, ``s·q = 2·Σ_p w_p·popc(s' & b_p) − Σq`` with ``w_15 = −2^15``, holds
    for packed sign bits s' (``deltafleet.kernels.reference.pack_signs``' bit order). An all-zero row gets
    scale 0 and zero planes."""
    from deltafleet.kernels.gluon_planes import BIT_MAX, activation_bitplanes

    g = torch.Generator().manual_seed(11)
    m = 4
    x = torch.randn(m, k, generator=g)
    x[1, 5] = -40.0  # an outlier (negative) sets its row's scale
    x[2] = 0.0
    x[3] *= 1e-36  # below TINY: 32767/max|x| would overflow float32, so the row counts as zero
    x = x.to(torch.bfloat16)
    bits, sc = activation_bitplanes(x.to(DEVICE))
    bits, sc = bits.cpu(), sc.cpu()
    assert bits.shape == (m, k // 128, 64) and bits.dtype == torch.int32 and sc.shape == (m, 2)
    words = bits.view(m, k // 128, 8, 4, 2).long() & 0xFFFFFFFF           # [row, j, g, t, mm]
    planes = words.permute(0, 4, 2, 1, 3).reshape(m, 16, k // 32)       # [row, p = 8·mm + g, word]
    b = (planes[..., None] >> torch.arange(32)) & 1                     # [row, p, word, i]
    b = b.reshape(m, 16, k)
    weight = 2 ** torch.arange(16)
    weight[15] = -(2 ** 15)
    q = (b * weight[None, :, None]).sum(dim=1)                          # [row, k]
    scale = x.float().abs().amax(dim=1) / BIT_MAX
    scale[3] = 0.0
    torch.testing.assert_close(sc[:, 0], scale)
    err = (q.float() * scale[:, None] - x.float()).abs()
    assert (err[:3] <= scale[:3, None] * 0.505 + 1e-12).all(), (err / scale[:, None].clamp_min(1e-30)).max()
    assert q.abs().max() <= BIT_MAX and q[1].abs().max() == BIT_MAX and q[1, 5] == -BIT_MAX
    torch.testing.assert_close(sc[:, 1], q.sum(dim=1).float())
    assert not bits[2:].any() and sc[2, 0] == 0 and sc[3, 0] == 0 and err[3].max() < 1e-30
    # the kernel's product: popc of AND per plane, over packed sign words
    s = torch.where(torch.rand(m, k, generator=g) < 0.5, -1.0, 1.0)
    sw = pack_signs(s).view(m, k // 32, 4).long()                       # bytes → 32-bit words, little end
    sw = sw[..., 0] | sw[..., 1] << 8 | sw[..., 2] << 16 | sw[..., 3] << 24
    sbits = ((sw[..., None] >> torch.arange(32)) & 1).reshape(m, k)
    popc = (sbits[:, None, :] & b).sum(dim=2)                           # [row, p]
    got = 2 * (popc * weight).sum(dim=1) - q.sum(dim=1)
    assert torch.equal(got, (s.long() * q).sum(dim=1))


def test_activation_bitplanes_chunk_and_warps_change_nothing_but_speed():
    """Programs over 128- or 256-weight chunks with 8 warps write the same words and row sums as the
    default (1024-weight chunks, 4 warps), K past one chunk and not a multiple of the largest."""
    from deltafleet.kernels.gluon_planes import activation_bitplanes

    g = torch.Generator().manual_seed(5)
    x = (torch.randn(3, 384, generator=g) * torch.tensor([[1.0], [30.0], [1e-3]])).to(torch.bfloat16).to(DEVICE)
    ref = activation_bitplanes(x)
    for chunk, warps in ((128, 8), (256, 4), (512, 8)):
        bits, sc = activation_bitplanes(x, chunk=chunk, num_warps=warps)
        assert torch.equal(bits.cpu(), ref[0].cpu()), (chunk, warps)
        assert torch.equal(sc.cpu(), ref[1].cpu()), (chunk, warps)


def test_activation_bitplanes_refuses_a_chunk_or_warp_count_it_does_not_take():
    from deltafleet.kernels.gluon_planes import activation_bitplanes

    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    for chunk in (64, 384, 16384):
        with pytest.raises(ValueError, match=f"^chunk = {chunk} is not a power of two from 128 to 8192$"):
            activation_bitplanes(x, chunk=chunk)
    with pytest.raises(ValueError, match=r"^num_warps = 2: the bit-plane kernel runs with 4 or 8$"):
        activation_bitplanes(x, num_warps=2)


@pytest.mark.parametrize("name, multiple, bad_k", [
    ("activation_bitplanes", 128, 200),  # the binary mmas read 128 weights at a time
    ("activation_planes", 32, 40),       # the permutation (logical 4a + j ← physical a + 8j) works on
                                         # whole 32-blocks: K = 40 would read up to index 57 of the row
])
def test_activation_plane_kernels_refuse_what_they_cannot_read(name, multiple, bad_k):
    """Both activation-plane wrappers refuse K not a positive multiple of their block, other dtypes
    and a stride along K other than 1, before any launch."""
    from deltafleet.kernels import gluon_planes

    fn = getattr(gluon_planes, name)
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=f"^K = {bad_k} is not a positive multiple of {multiple}$"):
        fn(x[:, :bad_k].contiguous())
    with pytest.raises(ValueError, match=f"^K = 0 is not a positive multiple of {multiple}$"):
        fn(x[:, :0])
    with pytest.raises(ValueError, match=r"^x must be a 2-D bf16/fp16 tensor with unit stride along K, got "
                                         r"torch.float32 \(2, 256\)"):
        fn(x.float())
    with pytest.raises(ValueError, match=r"unit stride along K, got torch.bfloat16 \(256, 2\) with strides \(1, 256\)"):
        fn(x.t())


def test_warp_specialised_kernel_refuses_a_configuration_it_cannot_launch():
    """16 rows in warpgroups of 2 would need 8 consumer warpgroups (the kernel has at most 4), 16 in
    one warpgroup would lose the base product of rows 8–15, and K must be a whole number of K steps:
    all refused before any launch, as are loader warps other than 1, 2 or 4, signs not tiled for the
    configuration, persistent + PDL without bits, splits below 1 or fractional, and configurations
    that are not five values."""
    from deltafleet.kernels.gluon_planes import bitdelta_linear_batched_planes

    x, w = torch.zeros(16, 128, dtype=torch.bfloat16), torch.zeros(64, 128, dtype=torch.bfloat16)
    signs, alphas = torch.zeros(1, 64, 16, dtype=torch.uint8), torch.ones(1)

    def launch(config, split=1, **options):
        bitdelta_linear_batched_planes(x, w, signs, alphas, torch.zeros(16, dtype=torch.int32), None,
                                       torch.empty(16, 64), torch.zeros(1024), torch.zeros(1, dtype=torch.int32),
                                       config, split=split, **options)

    for rh in (2, 16):
        with pytest.raises(ValueError, match=f"{rh} rows per warpgroup do not split 16 rows into 1, 2 or 4"):
            launch((128, rh, 3, 96, 1))
    with pytest.raises(ValueError, match="K = 128 is not a multiple of the configuration's BLOCK_K = 256"):
        launch((256, 8, 2, 128, 1))
    with pytest.raises(ValueError, match=r"^tiled signs of shape \(1, 64, 16\) are not tile_signs\(…, 128\) of "
                                         r"\[S, 64, 16\]$"):
        launch((128, 4, 4, 96, 1), tiled=True)
    for loaders in (0, 3, 8):
        with pytest.raises(ValueError, match=f"^{loaders} loader warps: the kernel takes 1, 2 or 4$"):
            launch((128, 4, 4, 96, loaders))
    with pytest.raises(ValueError, match=r"^a persistent launch with programmatic dependent launch needs bits=True"):
        launch((128, 4, 4, 96, 1), pdl=True, persistent=True)
    for split in (0, -2, 1.5):  # an empty grid would launch nothing and leave y as it was
        with pytest.raises(ValueError, match=f"^split must be 1 or more K chunks, got {split}$"):
            launch((128, 4, 4, 96, 1), split=split)
    with pytest.raises(ValueError, match=r"^config must be \(BLOCK_K, rows per warpgroup, stages, registers, loader "
                                         r"warps\), got \(128, 4, 4, 96\)$"):
        launch((128, 4, 4, 96))


def test_ws_slots_counts_resident_programs_by_registers_and_shared_memory():
    """``ws_slots``: 16 rows in four warpgroups and two loader warps (20 warps) at 96 registers take
    61 440 of the 65 536 registers, so one program per multiprocessor; two 8-row warpgroups and two
    loaders (12 warps) at 80 registers would allow two by registers, and with the binary path (no int8
    planes) three 36 KiB stages fit twice in 228 KiB, with the planes (40 KiB a stage) once."""
    from deltafleet.kernels.gluon_planes import ws_slots

    assert ws_slots(16, (128, 4, 4, 96, 2), 132, bits=True) == 132
    assert ws_slots(16, (128, 8, 3, 80, 2), 132, bits=True) == 264
    assert ws_slots(16, (128, 8, 3, 80, 2), 132, bits=False) == 132
    assert ws_slots(16, (128, 8, 6, 80, 2), 132, bits=True) == 132  # 216 KiB of ring: one program
    assert ws_slots(8, (128, 4, 3, 80, 2), 132) == 264            # 12 warps at 80 registers, 3 × 26 KiB
    # 8 warps at 80 registers would allow three, but the 76 800-byte ring (77 116 bytes compiled) plus
    # the 1 KiB the hardware reserves per block fits twice in 228 KiB, not three times
    assert ws_slots(4, (128, 4, 3, 80, 1), 132) == 264


@pytest.mark.parametrize("tiles, kt, split, nprog, per", [
    (160, 64, 1, 160, 0),    # one program per unit (qkv at T = 16)
    (160, 64, 3, 132, 0),    # persistent over 480 units of 22, 22 and 20 steps
    (160, 64, 1, 132, 78),   # stream-K: 10 240 steps in runs of 78 over 132 programs
    (896, 64, 1, 132, 435),  # gate_up: runs longer than a tile
    (3, 5, 1, 4, 4),         # runs longer than a tile of 5 steps, the last program short
])
def test_work_pieces_cover_every_tile_step_once_and_count_a_tiles_pieces(tiles, kt, split, nprog, per):
    """The warp-specialised kernel's cut of the work (``ws_pieces``, the kernel's ``_ws_piece``
    arithmetic): every (tile, K step) is in exactly one piece, each tile's step 0 in one, a tile's
    piece count as every piece of it reports (the epilogue waits for that many), and under stream-K
    no program gets more than ``per`` steps."""
    from deltafleet.kernels.gluon_planes import ws_pieces

    if per:
        nprog = -(-tiles * kt // per)
    seen = torch.zeros(tiles, kt, dtype=torch.int32)
    pieces = {}
    for pid in range(nprog):
        steps = 0
        for t, k0, nk, count in ws_pieces(pid, nprog, tiles, kt, split, per):
            if nk > 0:
                seen[t, k0:k0 + nk] += 1
            pieces.setdefault(t, []).append(count)
            steps += max(nk, 0)
        assert not per or 0 < steps <= per
    assert torch.equal(seen, torch.ones_like(seen))
    assert all(len(c) == c[0] and len(set(c)) == 1 for c in pieces.values()), pieces


def test_tile_signs_stores_each_k_step_tile_whole():
    """``tile_signs``: ``out[s, f, j]`` is the sign tile of slot s, features ``64f … 64f + 63`` (zero
    past N) and K step j, checked against slicing for both K steps; bad arguments refused."""
    from deltafleet.kernels.gluon_planes import tile_signs

    g = torch.Generator().manual_seed(3)
    signs = torch.randint(0, 256, (3, 100, 64), generator=g, dtype=torch.uint8)  # N = 100, K = 512
    for bk in (128, 256):
        t = tile_signs(signs, bk)
        sb = bk // 8
        assert t.shape == (3, 2, 512 // bk, 64, sb) and t.is_contiguous() and t.dtype == torch.uint8
        for s in range(3):
            for f in range(2):
                for j in range(512 // bk):
                    want = torch.zeros(64, sb, dtype=torch.uint8)
                    rows = signs[s, 64 * f:64 * f + 64, j * sb:(j + 1) * sb]
                    want[:rows.shape[0]] = rows
                    assert torch.equal(t[s, f, j], want), (bk, s, f, j)
    with pytest.raises(ValueError, match="^block_k must be 128 or 256, got 64$"):
        tile_signs(signs, 64)
    with pytest.raises(ValueError, match="^48 sign bytes per row are not a whole number of 32-byte K steps$"):
        tile_signs(signs[..., :48], 256)
    with pytest.raises(ValueError, match=r"^signs must be uint8 \[S, N, K/8\], got torch.int8 \(3, 100, 64\)$"):
        tile_signs(signs.to(torch.int8), 256)
    with pytest.raises(ValueError, match=r"^signs must be uint8 \[S, N, K/8\], got torch.uint8 \(100, 64\)$"):
        tile_signs(signs[0], 256)


def test_untimed_configuration_is_the_first_whose_k_step_divides_k():
    """``default_config``: the first ``WS_CONFIGS`` entry whose ``BLOCK_K`` divides K (at four rows
    the default takes K steps of 256, so K = 384 falls to the first with steps of 128), None when
    none does."""
    from deltafleet.kernels import gluon_planes as gp

    assert gp.default_config(4, 8192) == gp.WS_CONFIGS[4][0] and gp.WS_CONFIGS[4][0][0] == 256
    assert gp.default_config(4, 384) == next(c for c in gp.WS_CONFIGS[4] if c[0] == 128)
    assert gp.default_config(16, 384)[0] == 128
    assert gp.default_config(2, 64) is None


def test_warp_specialised_split_follows_the_wave_model():
    """``ws_split``: programs per multiprocessor from registers and shared memory, then the split
    with the fewest K steps over all waves, ``ceil(tiles·split/slots)·(ceil(steps/split) + 3)``."""
    from deltafleet.kernels.gluon_planes import ws_split

    # 16 rows, 5 warpgroups × 96 registers and 160 KiB of ring: one program per multiprocessor
    assert ws_split(16, 8192, 8192, (128, 4, 4, 96, 1), 132) == 1    # 128 tiles fill one wave: 67 steps
    assert ws_split(16, 10240, 8192, (128, 4, 4, 96, 1), 132) == 4   # 160 tiles: 5 waves of 19 beat 2 of 67
    # 8 rows, 3 warpgroups × 80 registers and 90 KiB: two per multiprocessor (264 slots)
    assert ws_split(8, 8192, 8192, (128, 4, 3, 80, 1), 132) == 2     # 256 programs, one wave of 35
    assert ws_split(8, 10240, 8192, (128, 4, 3, 80, 1), 132) == 3    # 480 programs, two waves of 25
    assert ws_split(2, 1024, 512, (128, 2, 3, 80, 1), 132) == 1      # K = 4 steps: no split
    # four rows, (128, 4, 3, 80, 1): two programs per multiprocessor with the int8 planes' ring, three
    # without (bits): 160 tiles at split 3 take 2 waves of 25 steps (int8), at split 2 one of 35 (bits)
    assert ws_split(4, 10240, 8192, (128, 4, 3, 80, 1), 132) == 3
    assert ws_split(4, 10240, 8192, (128, 4, 3, 80, 1), 132, bits=True) == 2
    assert ws_split(16, 57344, 8192, (256, 8, 2, 128, 1), 132) == 1  # 896 tiles: 7 waves of 35 beat 14 of 19


@pytest.mark.gpu  # a Hopper GPU only: Gluon has no interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "m, n, k, row_alpha, bias",
    [
        (2, 264, 384, True, True),     # N past a tile, K = 3·128
        (3, 200, 1024, False, False),  # one α per matrix, N below a tile, a base-only row
        (16, 1024, 4096, True, False),  # a full row block, K split across programs
        (17, 136, 128, True, True),    # two row blocks, the second of one row
        (33, 512, 2048, False, True),  # three row blocks
        (8, 192, 8192, True, False),   # eight rows, two plane groups, a long K
        (16, 320, 768, False, False),  # sixteen rows, K = 3·256
    ],
)
def test_planes_tenants_match_reference(dtype, m, n, k, row_alpha, bias):
    """The int8 tensor-core mixed-tenant kernel (``deltafleet.kernels.gluon_planes``), every configuration and
    the default with programmatic dependent launch, and with the base product spread over the
    consumers (``base_spread``), and with the sign part on the binary tensor cores (``bits``, on
    rows and tiled signs, spread or not, and with programmatic dependent launch), with K split and not: equal to the float32
    reference within the dtype tolerance, rows of slot −1 and of an out-of-range slot getting the
    base only, and the split-K workspace left zero."""
    from deltafleet.kernels import gluon_planes as gp
    from deltafleet.kernels import triton_bitdelta as tb

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("not a Hopper GPU")
    ref, dev = _tenant_case(m, n, k, dtype, row_alpha, bias)
    assert gp.planes_supported(dev[0], dev[1], dev[2])
    atol = TOL[dtype] * ref.abs().max().item()
    rows = max(2, min(16, triton.next_power_of_2(m)))
    configs = [dict(config=cfg) for cfg in gp.WS_CONFIGS[rows] if k % cfg[0] == 0]
    configs.append(dict(config=gp.default_config(rows, k), pdl=True))  # programmatic dependent launch
    configs += [dict(config=cfg, pdl=True) for cfg in gp.WS_CONFIGS[rows] if cfg[4] > 1][:1]  # and with loaders
    # sign tiles stored whole (tile_signs), for the default and the first configuration with K steps of 256
    configs += [dict(config=cfg, tiled=True) for cfg in list(gp.WS_CONFIGS[rows][:1]) + [
        c for c in gp.WS_CONFIGS[rows] if c[0] == 256][:1] if k % cfg[0] == 0]
    # the base product spread over the consumers' K slices, rows and tiled signs
    configs += [dict(config=cfg, base_spread=True, tiled=tiled) for cfg in gp.WS_CONFIGS[rows][:2]
                if k % cfg[0] == 0 and rows // min(rows, cfg[1]) > 1 for tiled in (False, True)]
    # the sign part on the binary tensor cores, rows and tiled signs, spread or not
    configs += [dict(config=cfg, bits=True, tiled=tiled, base_spread=spread) for cfg in gp.WS_CONFIGS[rows][:2]
                if k % cfg[0] == 0 for tiled in (False, True) for spread in (False, True)
                if not spread or rows // min(rows, cfg[1]) > 1]
    configs += [dict(config=gp.WS_CONFIGS[rows][0], bits=True, tiled=True, pdl=True)] if k % 128 == 0 else []
    # persistent launches (one program per resident slot walking the units) and stream-K
    configs += [dict(config=gp.WS_CONFIGS[rows][0], persistent=True, **extra) for extra in (
        dict(tiled=True), dict(tiled=True, bits=True), dict(tiled=True, bits=True, pdl=True),
        dict(bits=True, base_spread=True)) if k % 128 == 0 and gp.WS_CONFIGS[rows][0][0] == 128]
    configs += [dict(config=gp.WS_CONFIGS[rows][0], stream_k=True, **extra) for extra in (
        dict(tiled=True, bits=True), dict(bits=True, base_spread=True), dict(tiled=True))
        if k % 128 == 0 and gp.WS_CONFIGS[rows][0][0] == 128]
    # and at 256-weight K steps and with four loader warps, as the dispatcher also times them
    configs += [dict(config=cfg, bits=True, **launch) for cfg in [c for c in gp.WS_CONFIGS[rows] if c[0] == 256][:1]
                + [c for c in gp.WS_CONFIGS[rows] if c[4] == 4][:1] if k % cfg[0] == 0
                for launch in (dict(persistent=True), dict(stream_k=True))]
    # at sixteen rows the dispatcher times every 128-step configuration as bits + PDL + stream-K
    configs += [dict(config=cfg, bits=True, tiled=True, pdl=True, stream_k=True) for cfg in gp.WS_CONFIGS[rows]
                if rows == 16 and cfg[0] == 128 and k % 128 == 0]
    only = os.environ.get("DELTAFLEET_PLANES_TEST_ONLY")  # e.g. "persistent,stream_k": a device run's subset
    if only:
        configs = [c for c in configs if any(c.get(o) for o in only.split(","))]
        assert configs, f"DELTAFLEET_PLANES_TEST_ONLY={only!r} selects no configuration"
    for config in configs:
        args = list(dev)
        if config.get("tiled"):
            args[2] = gp.tile_signs(dev[2], config["config"][0])
        for split in (1, ) if config.get("stream_k") else (1, 3):  # stream-K cuts its own runs
            y = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
            ws, cnt = tb._workspace(y.device, m * n, m * triton.cdiv(n, 2))
            gp.bitdelta_linear_batched_planes(*args, y, ws, cnt, split=split, **config)
            torch.cuda.synchronize()
            what = f"{config} split {split}"
            torch.testing.assert_close(y.float().cpu(), ref, rtol=0, atol=atol, msg=lambda s: f"{what}: {s}")
            assert not ws.any() and not cnt.any(), f"{what} left the workspace dirty"
    y = tb.bitdelta_linear_batched_triton(*dev[:5], dev[5], impl="planes")
    torch.testing.assert_close(y.float().cpu(), ref, rtol=0, atol=atol)


@pytest.mark.parametrize("k", [3072, 2048 + 136])
def test_every_autotuning_tile_is_correct_under_the_wrappers_even_rule(k):
    """Each autotuning configuration of the decode and mixed-tenant kernels, launched as the wrappers
    launch it (``EVEN`` = K a multiple of the longest K step, so no K masks), gives the reference
    result. K = 3072 is a multiple of 1024 but not of the 2048-weight step of ``BLOCK_KB = 256``: an
    ``EVEN`` rule of ``K % 1024`` read past every row there."""
    from deltafleet.kernels import triton_bitdelta as tb
    from deltafleet.kernels.reference import bitdelta_linear_batched

    m, n = 2, 4
    x, w, sign, alpha, _ = _case(m, n, k, torch.bfloat16, True, False, seed=5)
    signs = torch.stack([sign, pack_signs(torch.randn(n, k, generator=torch.Generator().manual_seed(6)))])
    alphas = torch.stack([alpha, alpha.flip(0)])
    slot = torch.tensor([1, 0], dtype=torch.int32)
    kb = (k + 7) // 8
    ref1 = bitdelta_linear(x.float(), w.float(), sign, alpha)
    refb = bitdelta_linear_batched(x.float(), w.float(), signs, alphas, slot)
    x, w, sign, alpha, signs, alphas, slot = (v.to(DEVICE) for v in (x, w, sign, alpha, signs, alphas, slot))
    atol1, atolb = (TOL[torch.bfloat16] * r.abs().max().item() for r in (ref1, refb))
    cases = [("decode", c, True, m, tb._DECODE_EVEN) for c in tb._decode_configs(False)] \
        + [("tenants-fma", c, False, m, tb._BATCHED_EVEN) for c in tb._decode_configs(True)] \
        + [("tenants-fma-1row", c, False, 1, tb._DECODE_EVEN) for c in tb._decode_configs(False)]
    for name, cfg, one, rows, even in cases:
        y = torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        ws, cnt = tb._workspace(x.device, rows * n, rows * n)
        bm = cfg.kwargs.get("BLOCK_M", 1 if rows == 1 or not one else 2)
        s_, a_, st = (sign, alpha, (0, sign.stride(0), 0)) if one else (signs, alphas, (signs.stride(0), signs.stride(1), alphas.stride(0)))
        args = (x, w, s_, a_, slot, a_, y, ws, cnt, rows, n, k, kb, 2, x.stride(0), w.stride(0), st[0], st[1], st[2],
                y.stride(0))
        kw = {**cfg.kwargs, "BLOCK_M": bm}
        tb._decode_kernel[tb._decode_grid(n, kb, rows, bm)(kw)](
            *args, ONE_DELTA=one, ALPHA_PER_ROW=True, HAS_BIAS=False, EVEN=k % even == 0, **kw)
        ref = ref1[:rows] if one else refb[:rows] if rows == m else bitdelta_linear_batched(
            x[:1].float().cpu(), w.float().cpu(), signs.cpu(), alphas.cpu(), slot[:1].cpu())
        torch.testing.assert_close(y.float().cpu(), ref, rtol=0, atol=atol1 if one else atolb,
                                   msg=lambda s: f"{name} {cfg.kwargs}: {s}")
    for cfg in tb._lut_configs():
        y = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        ws, cnt = tb._workspace(x.device, m * n, m * n)
        args = (x, w, signs, alphas, slot, alphas, y, ws, cnt, m, n, k, kb, 2, x.stride(0), w.stride(0),
                signs.stride(0), signs.stride(1), alphas.stride(0), y.stride(0))
        kw = {**cfg.kwargs, "BLOCK_M": 2}
        grid = (triton.cdiv(n, kw["BLOCK_N"]), triton.cdiv(kb, kw["BLOCK_K"] // 8 * kw["CHUNK_ITERS"]), 1)
        tb._tenants_kernel[grid](*args, ALPHA_PER_ROW=True, HAS_BIAS=False, EVEN=k % tb._LUT_EVEN == 0,
                                 DOT_FP32=tb._interpret(), **kw)
        torch.testing.assert_close(y.float().cpu(), refb, rtol=0, atol=atolb, msg=lambda s: f"lut {cfg.kwargs}: {s}")


def test_autotune_off_keeps_one_tile_per_kernel():
    """``DELTAFLEET_TRITON_AUTOTUNE=0`` (read at import, for servers that must answer at once): every
    autotuner holds its first tile only, and with it on, all of them."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("from deltafleet.kernels import triton_bitdelta as tb; "
            "print([len(t.configs) for t in (tb._decode_tuned, tb._batched_tuned, tb._batched1_tuned, tb._mm_tuned, "
            "tb._lut_tuned)], tb.AUTOTUNE)")
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "DELTAFLEET_TRITON_AUTOTUNE"}
    on = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=root, check=True)
    off = subprocess.run([sys.executable, "-c", code], env={**env, "DELTAFLEET_TRITON_AUTOTUNE": "0"},
                         capture_output=True, text=True, cwd=root, check=True)
    from deltafleet.kernels import triton_bitdelta as tb

    full = [len(tb._decode_configs(False)), len(tb._decode_configs(True)), len(tb._decode_configs(False)),
            len(tb._mm_configs()), len(tb._lut_configs())]
    assert on.stdout.strip() == f"{full} True"
    assert off.stdout.strip() == "[1, 1, 1, 1, 1] False"


def test_fastest_retimes_the_finalists_interleaved_and_takes_the_lowest_median():
    """``_fastest``: a failing run is skipped; the first pass keeps the ``finalists`` fastest; those are
    timed ``rounds`` times, interleaved, and the lowest median wins, not the first pass's minimum."""
    from deltafleet.kernels.triton_bitdelta import _fastest

    calls = []
    first = {"a": 1.00, "b": 1.01, "c": 1.02, "d": 1.50}
    again = {"a": iter([1.05, 1.06, 0.90]), "b": iter([1.00, 1.01, 1.00]), "c": iter([1.03, 1.03, 1.03])}
    timed = []

    def bench(fn):
        key = fn()
        timed.append(key)
        return first[key] if timed.count(key) == 1 else next(again[key])

    def run(key):
        def fn():
            calls.append(key)
            return key
        return fn

    def broken():
        raise RuntimeError("does not fit")

    runs = {k: run(k) for k in first} | {"e": broken}
    assert _fastest(runs, bench=bench, finalists=3, rounds=3) == "b"  # a's median 1.05 > b's 1.00
    # first pass: a warm-up call and one timing each (e failed); then three interleaved rounds of a, b, c
    assert timed == ["a", "b", "c", "d"] + ["a", "b", "c"] * 3
    assert [k for k in calls if k == "d"] == ["d", "d"]
    assert _fastest({"x": broken}, bench=bench) is None
    # a finalist that fails while timed again (out of memory, …) drops out instead of raising
    flaky_calls = []

    def flaky():
        flaky_calls.append(1)
        if len(flaky_calls) > 2:
            raise RuntimeError("out of memory")
        return "f"

    first["f"] = 0.5
    again["c"] = iter([1.03, 1.03, 1.03])
    again["b"] = iter([1.00, 1.01, 1.00])
    timed.clear()
    assert _fastest({"f": flaky, "b": run("b"), "c": run("c")}, bench=bench, finalists=3, rounds=3) == "b"
    # every finalist fails when timed again: the fastest of the rest, not a finalist that just failed
    fails = {"a": 0, "b": 0}

    def once(key):
        def fn():
            fails[key] += 1
            if fails[key] > 2:  # the warm-up call and the first timing pass work, then out of memory
                raise RuntimeError("out of memory")
            return key
        return fn

    first.update(a=1.0, b=1.1, d=2.0)
    timed.clear()
    assert _fastest({"a": once("a"), "b": once("b"), "d": run("d")}, bench=bench, finalists=2, rounds=3) == "d"
    fails.update(a=0, b=0)
    assert _fastest({"a": once("a"), "b": once("b")}, bench=bench, finalists=2, rounds=3) is None
    assert _fastest({"a": run("a")}, bench=lambda fn: 1.0) == "a"


def test_fastest_times_each_call_on_operands_cycled_past_the_l2():
    """``_fastest(operands=...)``: every run is called as ``run(*operands)``, and the timed calls cycle
    through copies whose others hold twice the L2 (here 3 sets of 1 KiB for an L2 of 1 KiB, the first
    the caller's tensors), as a decode step reads each layer's weights from memory; operands of twice
    the L2 or more, or an L2 of 0, are not copied."""
    from deltafleet.kernels.triton_bitdelta import _fastest

    w = torch.zeros(256)  # 1 KiB
    x = torch.zeros(1, dtype=torch.uint8)
    seen: dict = {"a": [], "b": []}

    def run(key):
        def fn(w, x):
            seen[key].append((w.data_ptr(), x.data_ptr()))
        return fn

    def bench(fn):
        for _ in range(4):
            fn()
        return 1.0

    assert _fastest({"a": run("a"), "b": run("b")}, bench=bench, finalists=1, operands=(w, x), l2_bytes=1024) == "a"
    ptrs = [p for p, _ in seen["a"]]
    assert len(set(ptrs)) == 3 and ptrs[0] == w.data_ptr() and ptrs[:2] == ptrs[3:5]  # cycled, in order
    assert len({p for _, p in seen["a"]}) == 3  # every tensor of a set copied with it
    assert set(ptrs) == {p for p, _ in seen["b"]}  # each run on the same copies
    for l2 in (512, 0):  # the operands hold twice the L2 themselves, or no L2 given: no copy
        seen["a"].clear()
        _fastest({"a": run("a")}, bench=bench, operands=(w, x), l2_bytes=l2)
        assert {p for p, _ in seen["a"]} == {w.data_ptr()}


def test_the_dispatchers_time_their_candidates_on_copies_of_the_operands(monkeypatch):
    """``_prefill_choice`` and ``_tenants_choice`` hand ``_fastest`` their activations, weight, signs
    and scales: each candidate (the register-operand kernel, the CUDA-core decode kernel, the int8
    mixed-tenant kernel) is timed on the copies, not on the caller's tensors alone. The kernels are
    replaced by recorders (the CPU has no Gluon)."""
    from types import SimpleNamespace

    from deltafleet.kernels import gluon_planes as gp
    from deltafleet.kernels import gluon_prefill_rs as rs
    from deltafleet.kernels import timing
    from deltafleet.kernels import triton_bitdelta as tb

    monkeypatch.delenv("DELTAFLEET_TRITON_QUICK_TUNE", raising=False)
    monkeypatch.setattr(tb, "AUTOTUNE", True)
    monkeypatch.setattr(tb, "_PREFILL_CHOICE", {})
    monkeypatch.setattr(tb, "_TENANTS_CHOICE", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # the CPU build has none
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(timing, "l2_size", lambda device: 1 << 20)  # 1 MiB: the operands below need copies
    real = tb._fastest

    def fastest(runs, **kw):
        return real(runs, bench=lambda fn: [fn() for _ in range(3)] and 1.0, **kw)

    monkeypatch.setattr(tb, "_fastest", fastest)
    seen = []
    x, w = torch.zeros(8, 256, dtype=torch.bfloat16), torch.zeros(64, 256, dtype=torch.bfloat16)
    sign, alpha = torch.zeros(64, 32, dtype=torch.uint8), torch.ones(64)
    monkeypatch.setattr(rs, "usable_configs", lambda *a: ["cfg"])
    monkeypatch.setattr(rs, "multiprocessors", lambda device: 132)
    monkeypatch.setattr(rs, "default_split", lambda *a: (1, 0))
    monkeypatch.setattr(rs, "bitdelta_linear_prefill_rs", lambda x2, weight, *a: seen.append(("rs", weight.data_ptr())))

    def decode(x2=x, weight=w, sign=sign, alpha=alpha):
        seen.append(("decode", weight.data_ptr()))

    tb._prefill_choice(x, w, sign, alpha, None, None, None, {}, alpha, decode)
    for kind in ("rs", "decode"):
        ptrs = {p for k, p in seen if k == kind}
        assert w.data_ptr() in ptrs and len(ptrs) > 2, (kind, ptrs)
    seen.clear()
    monkeypatch.setattr(gp, "planes_supported", lambda *a: True)
    monkeypatch.setattr(gp, "bitdelta_linear_batched_planes",
                        lambda x, weight, *a, **k: seen.append(("planes", weight.data_ptr())))
    signs, alphas = torch.zeros(2, 64, 32, dtype=torch.uint8), torch.ones(2)
    tb._tenants_choice(x, w, signs, alphas, torch.zeros(8, dtype=torch.int32), None, None, None, None, None)
    ptrs = {p for _, p in seen}
    assert w.data_ptr() in ptrs and len(ptrs) > 2, ptrs
    # past 64 rows the Gluon and Triton prefill kernels are timed too; without the int8 kernel, the
    # Hopper CUDA-core tenant kernel and the table lookup (its argument tuple's tensors replaced)
    from deltafleet.kernels import gluon_bitdelta as gb

    seen.clear()
    monkeypatch.setattr(gb, "bitdelta_linear_gluon", lambda x2, weight, *a: seen.append(("gluon", weight.data_ptr())))
    monkeypatch.setattr(tb, "_mm_triton", lambda x2, weight, *a: seen.append(("mm", weight.data_ptr())))
    x128 = torch.zeros(128, 256, dtype=torch.bfloat16)
    tb._prefill_choice(x128, w, sign, alpha, None, None, None, {}, alpha)
    monkeypatch.setattr(gp, "planes_supported", lambda *a: False)
    monkeypatch.setattr(gb, "bitdelta_linear_batched_gluon",
                        lambda x, weight, *a: seen.append(("tenants", weight.data_ptr())))
    monkeypatch.setattr(tb, "_lut_launch", lambda args, *a: seen.append(("lut", args[1].data_ptr())))
    tb._tenants_choice(x, w, signs, alphas, torch.zeros(8, dtype=torch.int32), None, None, None, None,
                       (x, w, signs, alphas) + (None,) * 16)
    for kind in ("gluon", "mm", "tenants", "lut"):
        ptrs = {p for k, p in seen if k == kind}
        assert w.data_ptr() in ptrs and len(ptrs) > 2, (kind, ptrs)


def test_tenant_choice_is_kept_apart_for_signs_the_int8_kernel_cannot_read(monkeypatch):
    """The dispatcher's cached choice per shape also keys on whether the int8/binary kernel can run
    (16-byte aligned signs): a first call with unaligned signs (timed among the Hopper CUDA-core
    tiles) must not fix the choice for aligned ones, which are timed among the int8/binary kernel's
    launches. The timing itself (``_fastest``) is replaced by "the first candidate"."""
    from types import SimpleNamespace

    from deltafleet.kernels import gluon_bitdelta as gb
    from deltafleet.kernels import gluon_planes as gp
    from deltafleet.kernels import triton_bitdelta as tb

    monkeypatch.delenv("DELTAFLEET_TRITON_QUICK_TUNE", raising=False)
    monkeypatch.setattr(tb, "AUTOTUNE", True)
    monkeypatch.setattr(tb, "_TENANTS_CHOICE", {})
    monkeypatch.setattr(tb, "_fastest", lambda runs, **kw: next(iter(runs)))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # the CPU build has none
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(multi_processor_count=132))
    x, w = torch.zeros(8, 256, dtype=torch.bfloat16), torch.zeros(64, 256, dtype=torch.bfloat16)
    signs, alphas = torch.zeros(2, 64, 32, dtype=torch.uint8), torch.ones(2)
    aligned = {"now": False}
    monkeypatch.setattr(gp, "planes_supported", lambda *a: aligned["now"])
    args = (x, w, signs, alphas, torch.zeros(8, dtype=torch.int32), None, None, None, None, None)
    assert tb._tenants_choice(*args) == gb.tenant_configs(8)[0]
    aligned["now"] = True
    assert tb._tenants_choice(*args)[0] == "planes"
    aligned["now"] = False
    assert tb._tenants_choice(*args) == gb.tenant_configs(8)[0]
    assert len(tb._TENANTS_CHOICE) == 2


@pytest.mark.parametrize("n, k", [(22016, 4096), (57344, 8192)], ids=["llama2-7b-gate_up", "llama2-70b-gate_up"])
def test_the_decode_split_k_counters_cover_every_tile(n, k):
    """Found by a reviewer: the one-variant decode asked for cdiv(N, 2) split-K counters, and its
    autotuned tiles go down to one row of W a program (``BLOCK_N = 1`` with K split), whose counters
    are one per row: atomics past the buffer's end on the GPU for the gate_up layers. Every tile that
    splits K has a counter of its own in what the wrapper asks for (a host-side check: the wrapper's
    request, ``decode_counters``, the workspace it gets, the configurations and the launch grid)."""
    from deltafleet.kernels import triton_bitdelta as tb

    m, kb = 1, (k + 7) // 8
    saved = dict(tb._WORKSPACE)
    tb._WORKSPACE.clear()
    try:
        _, cnt = tb._workspace(torch.device("cpu"), m * n, tb.decode_counters(n))
    finally:
        tb._WORKSPACE.clear()
        tb._WORKSPACE.update(saved)
    short = [cfg.kwargs for cfg in tb._decode_configs(False) + tb._decode_configs_tiled()
             if (grid := tb._decode_grid(n, kb, m, 1)(cfg.kwargs))[1] > 1 and grid[0] * grid[2] > cnt.numel()]
    assert not short, f"{len(short)} splitting tiles with more tiles than {cnt.numel()} counters: {short[:3]}"
