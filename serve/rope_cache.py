"""RoPE on a layer's new queries and keys, and the paged-cache write of its keys and values, as one
kernel (vLLM's ``rotary_embedding`` and ``reshape_and_cache`` together).

At decode the tensors are a few rows, so a step is bound by its kernel launches, not its bytes:
rotating ``q`` and ``k`` (one fused kernel) then copying ``k`` and ``v`` into their cache slots (two
``index_copy_``) is three launches a layer for what one program per (token, head) does in one:
program ``(t, h)`` rotates query head ``h`` of token ``t`` (``h < H``), or rotates key head ``h − H``
and writes it and the value head to the token's slot of the cache, and, when asked, returns the
rotated key too (a whole prompt's attention reads it from there; a decode step reads the cache only).

RoPE in Hugging Face's half-split layout (serve/model.py, ``apply_rope``): with ``x = (x₁, x₂)``
and ``cos``/``sin`` of the token's position, ``(x₁·cos₁ − x₂·sin₁, x₂·cos₂ + x₁·sin₂)``, in float32,
rounded once to the tensors' dtype, as the compiled ``rope_qk`` rounds.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _rope_store_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, slot_ptr, kc_ptr, vc_ptr, qo_ptr, ko_ptr,
                       stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct,
                       stride_ch, stride_cs, H, KV, HALF, BLOCK: tl.constexpr, STORE_K: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK)
    live = d < HALF
    cs = cos_ptr + t * stride_ct
    sn = sin_ptr + t * stride_ct
    c1 = tl.load(cs + d, mask=live, other=0.0).to(tl.float32)
    c2 = tl.load(cs + HALF + d, mask=live, other=0.0).to(tl.float32)
    s1 = tl.load(sn + d, mask=live, other=0.0).to(tl.float32)
    s2 = tl.load(sn + HALF + d, mask=live, other=0.0).to(tl.float32)
    hd = 2 * HALF
    if h < H:
        src = q_ptr + t * stride_qt + h * stride_qh
        x1 = tl.load(src + d, mask=live, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF + d, mask=live, other=0.0).to(tl.float32)
        dst = qo_ptr + (t * H + h) * hd
        tl.store(dst + d, (x1 * c1 - x2 * s1).to(qo_ptr.dtype.element_ty), mask=live)
        tl.store(dst + HALF + d, (x2 * c2 + x1 * s2).to(qo_ptr.dtype.element_ty), mask=live)
    else:
        j = h - H
        slot = tl.load(slot_ptr + t).to(tl.int64)
        src = k_ptr + t * stride_kt + j * stride_kh
        x1 = tl.load(src + d, mask=live, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF + d, mask=live, other=0.0).to(tl.float32)
        o1 = (x1 * c1 - x2 * s1).to(ko_ptr.dtype.element_ty)
        o2 = (x2 * c2 + x1 * s2).to(ko_ptr.dtype.element_ty)
        if STORE_K:
            dst = ko_ptr + (t * KV + j) * hd
            tl.store(dst + d, o1, mask=live)
            tl.store(dst + HALF + d, o2, mask=live)
        cache = j * stride_ch + slot * stride_cs
        tl.store(kc_ptr + cache + d, o1, mask=live)
        tl.store(kc_ptr + cache + HALF + d, o2, mask=live)
        vsrc = v_ptr + t * stride_vt + j * stride_vh
        tl.store(vc_ptr + cache + d, tl.load(vsrc + d, mask=live), mask=live)
        tl.store(vc_ptr + cache + HALF + d, tl.load(vsrc + HALF + d, mask=live), mask=live)


def rope_store(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, kc: Tensor, vc: Tensor,
               slots: Tensor, want_k: bool = True) -> tuple[Tensor, Tensor | None]:
    """Rotate ``q`` ``[T, H, 1, hd]`` and ``k`` ``[T, KV, 1, hd]`` by ``cos``/``sin`` ``[T, 1, 1, hd]``,
    write the rotated keys and ``v`` ``[T, KV, 1, hd]`` to ``kc``/``vc`` ``[KV, S, hd]`` at ``slots``
    int64 ``[T]``; returns the rotated ``q`` and ``k`` (new, contiguous tensors of those shapes), or
    ``(q, None)`` with ``want_k=False``: the rotated keys then go to the cache only (a step whose
    attention reads every key from the cache).

    One warp per program: a head's half is 32–64 elements, so wider programs would idle.

    The head dimension must be contiguous in every argument (the step's projections are views of one
    GEMM output, so their token and head strides are taken as they are). Trusts its inputs: the
    engine step built them (slots in range, one dtype)."""
    t, n_head, _, hd = q.shape
    n_kv = k.shape[1]
    qo = torch.empty(t, n_head, 1, hd, dtype=q.dtype, device=q.device)
    ko = torch.empty(t, n_kv, 1, hd, dtype=k.dtype, device=k.device) if want_k else None
    if t == 0:
        return qo, ko
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == kc.stride(-1) == vc.stride(-1) == 1
    assert kc.stride() == vc.stride() and cos.stride() == sin.stride()
    half = hd // 2
    _rope_store_kernel[(t, n_head + n_kv)](
        q, k, v, cos, sin, slots, kc, vc, qo, qo if ko is None else ko,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        kc.stride(0), kc.stride(1), n_head, n_kv, half, BLOCK=triton.next_power_of_2(half),
        STORE_K=want_k, num_warps=1)
    return qo, ko
