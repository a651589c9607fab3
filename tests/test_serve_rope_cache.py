"""RoPE and the paged-cache write in one kernel (serve/rope_cache.py) against the model's own RoPE
(serve/model.py ``apply_rope``) and ``index_copy_`` into the cache.

On the CPU the kernel runs under ``TRITON_INTERPRET=1``; with ``DELTAFLEET_TRITON_DEVICE=cuda``
(``make test-gpu``) on the GPU. The inputs are views of one projection output, as an engine step
has them (token stride the fused q/k/v width, head stride the head dimension). In float32 the
kernel and the reference differ by float32 rounding only; in bfloat16 the kernel rounds once where
the eager reference rounds each product, so within two bf16 ulps of the values (|x| ≤ 4 here).
"""
from __future__ import annotations

import os

import pytest
import torch

DEVICE = os.environ.get("DELTAFLEET_TRITON_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []

from deltafleet.serve.model import apply_rope  # noqa: E402
from deltafleet.serve.rope_cache import rope_store  # noqa: E402


def _case(t: int, n_head: int, n_kv: int, hd: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, 1, (n_head + 2 * n_kv) * hd, generator=g).to(dtype)
    q, k, v = qkv.split([n_head * hd, n_kv * hd, n_kv * hd], -1)
    views = [x.view(t, 1, n, hd).transpose(1, 2) for x, n in ((q, n_head), (k, n_kv), (v, n_kv))]  # [T, heads, 1, hd]
    pos = torch.randint(0, 4000, (t,), generator=g)
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    emb = torch.cat([pos[:, None].float() * inv] * 2, -1)[:, None, None, :]
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    n_slots = 4 * t + 8
    slots = torch.randperm(n_slots, generator=g)[:t]
    kc = torch.randn(n_kv, n_slots, hd, generator=g).to(dtype)
    vc = torch.randn(n_kv, n_slots, hd, generator=g).to(dtype)
    return [x.to(DEVICE) for x in (*views, cos, sin, kc, vc, slots)]


@pytest.mark.parametrize("t,n_head,n_kv,hd", [(1, 4, 4, 64), (7, 8, 2, 128), (33, 6, 3, 96)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_rotates_and_writes_the_cache_like_the_model(t, n_head, n_kv, hd, dtype):
    q, k, v, cos, sin, kc, vc, slots = _case(t, n_head, n_kv, hd, dtype)
    want_q, want_k = (apply_rope(x.float(), cos.float(), sin.float()) for x in (q, k))
    before, want_vc = kc.clone(), vc.clone()
    want_kc = kc.clone()
    want_kc.index_copy_(1, slots, want_k.to(dtype)[:, :, 0].transpose(0, 1))
    want_vc.index_copy_(1, slots, v[:, :, 0].transpose(0, 1))
    got_q, got_k = rope_store(q, k, v, cos, sin, kc, vc, slots)
    tol = {"rtol": 0, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 2**-7}
    assert got_q.shape == (t, n_head, 1, hd) and got_k.shape == (t, n_kv, 1, hd) and got_q.is_contiguous()
    torch.testing.assert_close(got_q.float(), want_q, **tol)
    torch.testing.assert_close(got_k.float(), want_k, **tol)
    torch.testing.assert_close(kc.float(), want_kc.float(), **tol)
    assert torch.equal(vc, want_vc)  # values are copied, not rotated
    untouched = torch.ones(kc.shape[1], dtype=torch.bool, device=kc.device)
    untouched[slots] = False
    assert torch.equal(kc[:, untouched], before[:, untouched])


def test_rope_store_without_the_keys_writes_the_cache_alone():
    """``want_k=False`` (a step whose attention reads only the cache): the same cache and queries as
    with the keys returned, and no key tensor."""
    q, k, v, cos, sin, kc, vc, slots = _case(9, 4, 2, 64, torch.bfloat16, seed=3)
    kc2, vc2 = kc.clone(), vc.clone()
    want_q, _ = rope_store(q, k, v, cos, sin, kc, vc, slots)
    got_q, got_k = rope_store(q, k, v, cos, sin, kc2, vc2, slots, want_k=False)
    assert got_k is None
    assert torch.equal(got_q, want_q) and torch.equal(kc2, kc) and torch.equal(vc2, vc)
