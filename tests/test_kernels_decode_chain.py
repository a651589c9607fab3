"""The decode chain (kernels/decode_chain.py): the base GEMM with a bias, add + RMSNorm and SiLU·up,
against the model's own functions (serve/model.py) and float64 products.

On the CPU the kernels run under ``TRITON_INTERPRET=1`` without programmatic dependent launch (the
interpreter has no ``griddepcontrol``); with ``DELTAFLEET_TRITON_DEVICE=cuda`` (``make test-gpu``) on
the GPU with it, where a tiny model's logits with the chain on must match those with it off, eagerly
and replayed from a CUDA graph. The interpreter's casts to half precision may truncate where the GPU
rounds, so the CPU bounds allow a unit in the last place.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

DEVICE = os.environ.get("DELTAFLEET_TRITON_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []

from deltafleet.kernels import decode_chain  # noqa: E402
from deltafleet.serve import model as M  # noqa: E402

PDL = DEVICE == "cuda"
ULP = {torch.bfloat16: 2**-7, torch.float16: 2**-10}  # one unit in the last place, relative
# units in the last place allowed: the interpreter truncates each of the norm's three roundings; on
# the GPU the model's compiled norm may keep the residual sum unrounded where the kernel rounds it
ULPS = 4 if DEVICE == "cpu" else 2
HOPPER = DEVICE == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _randn(*shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("rows, d", [(1, 4096), (5, 1000), (64, 256)], ids=["one-7b-row", "ragged", "64-rows"])
def test_add_rms_norm_matches_the_models(rows, d, dtype):
    """``(h, norm)`` as serve/model.py's ``add_rms_norm`` gives them: ``h = x + y`` rounded once, the
    normalised row rounded before the weight; a 3-D ``[B, 1, D]`` stream as the model passes it."""
    x, y = _randn(rows, 1, d, dtype=dtype, seed=d), _randn(rows, 1, d, dtype=dtype, seed=d + 1, scale=3.0)
    w = _randn(d, dtype=dtype, seed=d + 2)
    h, n = decode_chain.add_rms_norm(x, y, w, 1e-5, pdl=PDL)
    h_ref, n_ref = M.add_rms_norm(x, y, w, 1e-5)
    assert h.shape == n.shape == x.shape and h.dtype == n.dtype == dtype
    for got, ref in ((h, h_ref), (n, n_ref)):
        torch.testing.assert_close(got.float(), ref.float(), rtol=ULPS * ULP[dtype], atol=ULP[dtype] * 1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("rows, f", [(1, 11008), (7, 700), (64, 2048)], ids=["7b", "ragged", "one-block"])
def test_silu_mul_reads_the_halves_of_a_fused_output(rows, f, dtype):
    """``silu(gate)·up`` of the two column halves of one ``[rows, 1, 2F]`` gate/up output (strided
    views, as ``MLP.forward`` splits it), computed in float32 and rounded once."""
    gate_up = _randn(rows, 1, 2 * f, dtype=dtype, seed=f, scale=2.0)
    gate, up = gate_up.split(f, -1)
    out = decode_chain.silu_mul(gate, up, pdl=PDL)
    ref = (F.silu(gate.double()) * up.double()).to(dtype)
    assert out.shape == gate.shape and out.dtype == dtype and out.is_contiguous()
    torch.testing.assert_close(out.float(), ref.float(), rtol=ULPS * ULP[dtype] / 2, atol=ULP[dtype] * 1e-3)


@pytest.mark.parametrize("rows", [1, 16, 40, 64])
def test_linear_with_bias_matches_the_float64_product(rows):
    """The chain's GEMM (``triton_base.base_mm`` at the chain's ring depth, with a bias) on ``[B, 1, K]``
    activations: within 2⁻⁶ of the largest float64 output, shaped ``[B, 1, N]``; a bias read whole."""
    x = _randn(rows, 1, 384, dtype=torch.bfloat16, seed=rows)
    w = _randn(200, 384, dtype=torch.bfloat16, seed=rows + 1)
    b = _randn(200, dtype=torch.bfloat16, seed=rows + 2)
    y = decode_chain.linear(x, w, b, pdl=PDL)
    ref = x.double().cpu()[:, 0] @ w.double().cpu().t() + b.double().cpu()
    assert y.shape == (rows, 1, 200) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y[:, 0].double().cpu(), ref, rtol=0, atol=2**-6 * ref.abs().max().item())


def test_linear_falls_back_to_f_linear_where_its_gemm_does_not_take_the_shapes():
    """K not a multiple of the GEMM's K step, or x strided: ``F.linear`` itself (the same bits)."""
    w = _randn(64, 200, dtype=torch.bfloat16, seed=1)
    x = _randn(3, 200, dtype=torch.bfloat16, seed=2)
    assert torch.equal(decode_chain.linear(x, w, pdl=PDL), F.linear(x, w))
    w2 = _randn(64, 256, dtype=torch.bfloat16, seed=3)
    xt = _randn(256, 3, dtype=torch.bfloat16, seed=4).t()  # unit stride along rows, not along K
    assert torch.equal(decode_chain.linear(xt, w2, pdl=PDL), F.linear(xt, w2))


def test_in_graphs_nests_per_thread():
    """``in_graphs`` turns the chain's steps on for its thread until it ends, back to what it was
    outside (nested, or after an exception); another thread does not see it."""
    import threading

    def on():
        return getattr(decode_chain._graphs, "on", False)

    seen = []
    with decode_chain.in_graphs():
        worker = threading.Thread(target=lambda: seen.append(on()))
        worker.start()
        worker.join()
        with decode_chain.in_graphs():
            assert on()
        assert on()
    assert not on() and seen == [False]
    with pytest.raises(KeyError):
        with decode_chain.in_graphs():
            raise KeyError("x")
    assert not on()


def test_takes_only_a_few_half_precision_rows_on_hopper(monkeypatch):
    """The chain never runs on the CPU (nor under the interpreter); on a Hopper GPU, in a graph's
    steps (``in_graphs``), it takes 1 to ``MAX_ROWS`` rows of bf16/fp16 with unit stride along K, tensors read beside x of x's shape and
    dtype, and nothing with ``CHAIN`` off."""
    x = torch.zeros(8, 1, 256, dtype=torch.bfloat16)
    with decode_chain.in_graphs():
        assert not decode_chain.takes(x)
    if not HOPPER:
        return
    x = x.cuda()
    assert not decode_chain.takes(x), "outside a graph's steps"
    monkeypatch.setattr(decode_chain._graphs, "on", True)
    assert decode_chain.takes(x) and decode_chain.takes(x, x.clone())
    rows = decode_chain.MAX_ROWS
    assert decode_chain.takes(torch.zeros(rows, 256, dtype=torch.half, device="cuda"))
    assert not decode_chain.takes(torch.zeros(rows + 1, 256, dtype=torch.bfloat16, device="cuda"))
    assert not decode_chain.takes(torch.zeros(0, 256, dtype=torch.bfloat16, device="cuda"))
    assert not decode_chain.takes(x.float())
    assert not decode_chain.takes(x, x[:4])                          # another shape beside x
    assert not decode_chain.takes(x, x.half())                       # another dtype beside x
    assert not decode_chain.takes(torch.zeros(256, 8, dtype=torch.bfloat16, device="cuda").t())
    monkeypatch.setattr(decode_chain, "CHAIN", False)
    assert not decode_chain.takes(x)


def _tiny_model() -> M.Transformer:
    args = M.ModelArgs(vocab_size=512, dim=256, n_layer=2, n_head=4, n_local_heads=2, intermediate_size=640,
                       max_seq_len=64)
    model = M.Transformer(args)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g) if p.dim() == 1 else 0.05 * torch.randn(p.shape, generator=g))
    for layer in model.layers:
        layer.self_attn.fuse()
        layer.mlp.fuse()
    return model.to(DEVICE, torch.bfloat16)


@pytest.mark.skipif(not HOPPER, reason="the chain runs on a Hopper GPU only")
def test_a_decode_step_gives_the_same_logits_in_and_out_of_the_chain():
    """Eight rows of one decode step in a graph's steps (the GEMMs, norms and SiLU·up by the chain, with
    programmatic dependent launch): the logits outside (cuBLAS and the compiled functions) within a
    bf16 rounding or two of the largest; and the chain's step replayed from a CUDA graph, with new
    tokens copied in, equal to the chain run eagerly bit for bit."""
    model = _tiny_model()
    tokens = torch.randint(0, 512, (8, 1), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    pos = torch.zeros(1, dtype=torch.long, device=DEVICE)
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode():
        off = model(tokens, pos).float()  # outside a graph's steps: cuBLAS and the compiled functions
        with decode_chain.in_graphs():
            model(tokens, pos)  # the kernels compile
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                on = model(tokens, pos).float()
                torch.cuda.synchronize()
        ran = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
        assert {"_add_rms_norm_kernel", "_silu_mul_kernel", "_base_mm_kernel"} <= ran, ran
        torch.testing.assert_close(on, off, rtol=0, atol=2**-6 * off.abs().max().item())

        static = tokens.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), decode_chain.in_graphs():
            out = model(static, pos)
        other = torch.randint(0, 512, (8, 1), generator=torch.Generator().manual_seed(2)).to(DEVICE)
        static.copy_(other)
        graph.replay()
        with decode_chain.in_graphs():
            assert torch.equal(out, model(other, pos))
