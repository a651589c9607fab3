"""A Llama-family decoder that serves a base and its BitDelta variants from one copy of the weights.

Read like gpt-fast's ``model.py``: a config dataclass with named presets, RMSNorm, RoPE, attention
with grouped-query heads, a SwiGLU MLP. :meth:`Transformer.forward` runs one sequence (or a batch of
equal ones) over a static KV cache written by index, the reference path; the serving engine runs
:meth:`Transformer.forward_paged`, a flat batch of many sequences over the paged KV cache of
serve/attention.py. The one new idea is
that every weight can carry a variant's 1-bit delta (BitDelta, Liu et al., arXiv:2402.10193, Eq. 2:
``W_ft ≈ W_base + α·sign(Δ)``) that is applied on the fly:

- a linear (q, k, v, o, gate, up, down, lm_head) with a delta runs ``deltafleet.kernels.bitdelta_linear``,
  otherwise a plain ``F.linear`` on the base weight;
- the token embedding adds ``α·(2·bits − 1)`` of the looked-up rows only;
- a norm weight or bias that the artifact stores in full is used instead of the base's.

The variant is an explicit argument of ``forward`` (a :class:`VariantDelta`, or ``None`` for the
base), so one resident model serves every variant and no per-variant dense copy is ever built.
Modules carry their Hugging Face parameter names (``model.layers.0.self_attn.q_proj``), which are
also the artifact's keys, so the checkpoint loads without renaming and deltas are found by name.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from deltafleet.kernels import bitdelta_linear, unpack_signs
from deltafleet.serve.batch import BatchDeltas
from deltafleet.serve.delta import VariantDelta, hf_name
from deltafleet.serve.fuse import fused

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
@fused
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm (Zhang & Sennrich 2019) in fp32, as HF's Llama: ``weight · (x / rms(x))`` in x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@fused
def add_rms_norm(x: Tensor, y: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``(h, rms_norm(h))`` for the residual ``h = x + y``."""
    h = x + y
    hf = h.float()
    hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return h, weight * hf.to(h.dtype)


@fused
def rope_qk(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """``q`` and ``k`` rotated by position (:func:`apply_rope`)."""
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


@fused
def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up


def _chain(x: Tensor, *others: Tensor):
    """``deltafleet.kernels.decode_chain`` where it takes ``x`` (and ``others``), else None: a decode
    step's few rows on a Hopper GPU, as a programmatic-dependent-launch chain of the base GEMMs, the
    add + RMSNorm and SiLU·up. Imported at the first CUDA tensor (CPU callers never import triton)."""
    if not x.is_cuda:
        return None
    from deltafleet.kernels import decode_chain

    return decode_chain if decode_chain.takes(x, *others) else None


def base_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """The base product of base rows: ``F.linear``, or in the decode chain (:func:`_chain`)."""
    chain = _chain(x)
    return F.linear(x, weight, bias) if chain is None else chain.linear(x, weight, bias)


@dataclass
class ModelArgs:
    vocab_size: int = 32000
    dim: int = 4096
    n_layer: int = 32
    n_head: int = 32
    n_local_heads: int = -1  # key/value heads (GQA); -1: same as n_head
    head_dim: int = 0  # 0: dim // n_head
    intermediate_size: int = 11008
    max_seq_len: int = 2048  # max_position_embeddings: the context length served
    rope_base: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "linear" | "llama3", ...} as in HF configs
    norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2, or Llama with attention_bias
    o_bias: bool = False  # Llama with attention_bias
    mlp_bias: bool = False

    def __post_init__(self):
        if self.n_local_heads == -1:
            self.n_local_heads = self.n_head
        if self.head_dim == 0:
            self.head_dim = self.dim // self.n_head
        if self.n_head % self.n_local_heads:
            raise ValueError(f"n_head={self.n_head} is not a multiple of n_local_heads={self.n_local_heads}")

    @classmethod
    def from_name(cls, name: str) -> ModelArgs:
        """Shape preset by name (benchmarks, tests); real checkpoints use :meth:`from_hf_config`."""
        return cls(**transformer_configs[name])

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelArgs:
        """Build from a Hugging Face ``config.json`` dict (Llama, Mistral, Qwen2).

        Reads both the transformers-5 ``rope_parameters`` and the older ``rope_theta`` /
        ``rope_scaling`` fields.

        Raises:
            NotImplementedError: on another architecture, activation or RoPE type.
        """
        model_type = config.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise NotImplementedError(f"model_type {model_type!r} is not served (supported: {SUPPORTED_MODEL_TYPES})")
        if config.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act {config['hidden_act']!r} (only SwiGLU with silu is supported)")
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        rope_base = rope.pop("rope_theta", config.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3"):
            raise NotImplementedError(f"rope_type {rope_type!r} (supported: default, linear, llama3)")
        max_seq_len = config.get("max_position_embeddings", 2048)
        window = config.get("sliding_window")
        if window and (model_type == "mistral" or config.get("use_sliding_window")):
            # Full attention within the window is exact; the served context is capped there.
            max_seq_len = min(max_seq_len, window)
        attention_bias = bool(config.get("attention_bias", False))
        return cls(
            vocab_size=config["vocab_size"],
            dim=config["hidden_size"],
            n_layer=config["num_hidden_layers"],
            n_head=config["num_attention_heads"],
            n_local_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
            head_dim=config.get("head_dim") or 0,
            intermediate_size=config["intermediate_size"],
            max_seq_len=max_seq_len,
            rope_base=float(rope_base),
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            norm_eps=config.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias or model_type == "qwen2",
            o_bias=attention_bias,
            mlp_bias=bool(config.get("mlp_bias", False)),
        )


transformer_configs = {
    "tiny": dict(vocab_size=4096, dim=256, n_layer=4, n_head=8, n_local_heads=4, intermediate_size=688, max_seq_len=512),
    "llama-2-7b": dict(dim=4096, n_layer=32, n_head=32, intermediate_size=11008, max_seq_len=4096),
    "llama-2-70b": dict(dim=8192, n_layer=80, n_head=64, n_local_heads=8, intermediate_size=28672, max_seq_len=4096),
    "llama-3-8b": dict(vocab_size=128256, dim=4096, n_layer=32, n_head=32, n_local_heads=8,
                       intermediate_size=14336, max_seq_len=8192, rope_base=500000.0),
}


# --------------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------------


class KVCache:
    """Static per-layer key/value cache ``[B, n_kv_heads, max_seq_len, head_dim]``, written by index."""

    def __init__(self, batch_size: int, max_seq_len: int, n_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        shape = (batch_size, n_heads, max_seq_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        self.k.index_copy_(2, input_pos, k)
        self.v.index_copy_(2, input_pos, v)
        return self.k, self.v


class DeltaLinear(nn.Module):
    """``nn.Linear`` over the base weight, plus the active variant's 1-bit delta if it has one."""

    delta_kind = "linear"  # what serve/batch.py's variant slots hold signs for

    def __init__(self, in_features: int, out_features: int, bias: bool, name: str):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.name = name  # HF prefix of this module's parameters, e.g. "model.layers.0.mlp.up_proj"
        self.tp_group = None  # row parallel (serve/tp.py): the ranks whose partial products are summed

    def forward(self, x: Tensor, delta: VariantDelta | BatchDeltas | None) -> Tensor:
        y = self._local(x, delta)
        if self.tp_group is not None:
            torch.distributed.all_reduce(y, group=self.tp_group)
        return y

    def _local(self, x: Tensor, delta: VariantDelta | BatchDeltas | None) -> Tensor:
        if delta is None:
            return base_linear(x, self.weight, self.bias)
        if isinstance(delta, BatchDeltas):  # rows of different variants
            return delta.linear(self, x)
        bias = delta.full.get(f"{self.name}.bias", self.bias)
        weight = delta.full.get(f"{self.name}.weight")  # a matrix the artifact keeps uncompressed
        if weight is not None:
            return F.linear(x, weight, bias)
        sa = delta.sign_alpha(f"{self.name}.weight")
        if sa is None:
            return F.linear(x, self.weight, bias)
        return bitdelta_linear(x, self.weight, sa[0], sa[1], bias, delta.beta(f"{self.name}.weight"))


def fuse_rows(*mods: DeltaLinear) -> tuple[Tensor, Tensor | None, list[int]]:
    """Put the weights (and biases) of linears that read the same input into one matrix, each
    module's weight becoming a row view of it (gpt-fast's ``wqkv``): the base product of all of them
    is then one GEMM, and no weight is stored twice. Returns ``(weight, bias or None, out sizes)``."""
    weight = torch.cat([m.weight.detach() for m in mods])
    has_bias = [m.bias is not None for m in mods]
    bias = torch.cat([m.bias.detach() for m in mods]) if all(has_bias) else None
    sizes, first = [m.weight.shape[0] for m in mods], 0
    for m, n in zip(mods, sizes):
        m.weight = nn.Parameter(weight[first:first + n], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[first:first + n], requires_grad=False)
        first += n
    if any(has_bias) and bias is None:  # some biased, some not: the fused product cannot add them
        return weight, None, []
    return weight, bias, sizes


class DeltaEmbedding(nn.Module):
    """Token embedding; a variant adds ``α·(2·bits − 1)`` to the rows it looks up (α scalar or per row)."""

    delta_kind = "embedding"  # its signs are gathered by token: held as rows

    def __init__(self, vocab_size: int, dim: int, name: str):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, dim), requires_grad=False)
        self.name = name

    def forward(self, tokens: Tensor, delta: VariantDelta | BatchDeltas | None) -> Tensor:
        if delta is None:
            return F.embedding(tokens, self.weight)
        if isinstance(delta, BatchDeltas):
            return delta.embedding(self, tokens)
        full = delta.full.get(f"{self.name}.weight")
        if full is not None:
            return F.embedding(tokens, full)
        x = F.embedding(tokens, self.weight)
        sa = delta.sign_alpha(f"{self.name}.weight")
        if sa is None:
            return x
        sign, alpha = sa
        signs = unpack_signs(sign[tokens], self.weight.shape[1], torch.float32)  # [..., dim] of ±1
        beta = delta.beta(f"{self.name}.weight")
        if beta is not None:  # column scales (granularity rowcol): one per embedding feature
            signs = signs * beta
        scale = alpha if alpha.dim() == 0 else alpha[tokens].unsqueeze(-1)
        return (x.float() + scale * signs).to(x.dtype)  # same rounding as reconstructing W in fp32


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, name: str):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.name = name

    def weight_for(self, delta: VariantDelta | BatchDeltas | None) -> Tensor:
        """The weight ``delta`` runs with: ``[D]``, or ``[B, 1, D]`` (each row's own) for a batch."""
        if delta is None:
            return self.weight
        if isinstance(delta, BatchDeltas):
            return delta.norm_weight(self)
        return delta.full.get(f"{self.name}.weight", self.weight)

    def forward(self, x: Tensor, delta: VariantDelta | None) -> Tensor:
        return rms_norm(x, self.weight_for(delta), self.eps)

    def add(self, x: Tensor, residual: Tensor | None, delta) -> tuple[Tensor, Tensor]:
        """``(h, norm of h)`` for the residual stream ``h = x + residual`` (``residual=None``: ``x``),
        the add and the norm in one kernel (``add_rms_norm``)."""
        if residual is None:
            return x, self(x, delta)
        weight = self.weight_for(delta)
        chain = _chain(x, residual) if weight.dim() == 1 else None
        if chain is not None:
            return chain.add_rms_norm(x, residual, weight, self.eps)
        return add_rms_norm(x, residual, weight, self.eps)


def rope_inv_freq(args: ModelArgs) -> Tensor:
    """RoPE inverse frequencies ``[head_dim/2]`` (Su et al. 2021), with linear or Llama-3 scaling."""
    hd = args.head_dim
    inv_freq = 1.0 / (args.rope_base ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    s = args.rope_scaling
    if s is None:
        return inv_freq
    if s["rope_type"] == "linear":
        return inv_freq / s["factor"]
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth ramp in between.
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
    return torch.where(medium, smoothed, scaled)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x [B, H, T, hd]`` by position; HF's half-split layout, so HF q/k weights load as is."""
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, prefix: str):
        super().__init__()
        self.n_head, self.n_kv, self.head_dim = args.n_head, args.n_local_heads, args.head_dim
        q_out, kv_out = args.n_head * args.head_dim, args.n_local_heads * args.head_dim
        self.q_proj = DeltaLinear(args.dim, q_out, args.qkv_bias, f"{prefix}.q_proj")
        self.k_proj = DeltaLinear(args.dim, kv_out, args.qkv_bias, f"{prefix}.k_proj")
        self.v_proj = DeltaLinear(args.dim, kv_out, args.qkv_bias, f"{prefix}.v_proj")
        self.o_proj = DeltaLinear(q_out, args.dim, args.o_bias, f"{prefix}.o_proj")
        self.qkv: tuple[Tensor, Tensor | None, list[int]] | None = None  # fuse(): one base GEMM

    def fuse(self) -> None:
        """q, k and v weights as row views of one matrix (:func:`fuse_rows`)."""
        self.qkv = fuse_rows(self.q_proj, self.k_proj, self.v_proj)

    def _apply(self, fn, recurse=True):  # .to(), .half(), …: convert, then fuse the new tensors again
        out = super()._apply(fn, recurse)
        if self.qkv is not None:
            self.fuse()
        return out

    def project(self, x: Tensor, delta: VariantDelta | BatchDeltas | None) -> tuple[Tensor, Tensor, Tensor]:
        """``(q, k, v)`` of ``x``: the base's by one GEMM once fused, else one linear each."""
        if self.qkv is not None and self.qkv[2]:
            if delta is None:
                weight, bias, sizes = self.qkv
                return base_linear(x, weight, bias).split(sizes, -1)
            if isinstance(delta, BatchDeltas):  # grouped rows: one base GEMM, the planes shared
                qkv = delta.linears((self.q_proj, self.k_proj, self.v_proj), x, self.qkv)
                if qkv is not None:
                    return tuple(qkv)
        return self.q_proj(x, delta), self.k_proj(x, delta), self.v_proj(x, delta)

    def heads(self, x: Tensor, delta) -> tuple[Tensor, Tensor, Tensor]:
        """``q, k, v`` of ``x [B, T, D]``, heads first (``[B, heads, T, hd]``), not rotated (views of
        the projections)."""
        b, t, _ = x.shape
        q, k, v = self.project(x, delta)
        q = q.view(b, t, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        return q, k, v

    def qkv_heads(self, x: Tensor, cos: Tensor, sin: Tensor, delta) -> tuple[Tensor, Tensor, Tensor]:
        """``q, k, v`` of ``x [B, T, D]``, heads first (``[B, heads, T, hd]``), q and k rotated."""
        q, k, v = self.heads(x, delta)
        q, k = rope_qk(q, k, cos, sin)
        return q, k, v

    def out(self, y: Tensor, delta) -> Tensor:
        """The output projection of the attention ``y [B, H, T, hd]``: ``[B, T, D]``."""
        b, _, t, _ = y.shape
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1), delta)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, input_pos: Tensor,
                cache: KVCache | None, delta: VariantDelta | None) -> Tensor:
        if getattr(cache, "paged", False):  # serve/attention.py: a flat batch over the paged cache
            q, k, v = self.heads(x, delta)
            if cache.rotates(q):  # rotation and the cache write in one kernel
                return self.out(cache.attend(q, k, v, rope=(cos, sin)), delta)
            q, k = rope_qk(q, k, cos, sin)
            return self.out(cache.attend(q, k, v), delta)
        q, k, v = self.qkv_heads(x, cos, sin, delta)
        if cache is not None:
            k, v = cache.update(input_pos, k, v)
        # Query head h reads key/value head h // (n_head / n_kv), as HF's repeat_kv does.
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           enable_gqa=self.n_kv != self.n_head)
        return self.out(y, delta)


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` (Shazeer 2020)."""

    def __init__(self, args: ModelArgs, prefix: str):
        super().__init__()
        self.gate_proj = DeltaLinear(args.dim, args.intermediate_size, args.mlp_bias, f"{prefix}.gate_proj")
        self.up_proj = DeltaLinear(args.dim, args.intermediate_size, args.mlp_bias, f"{prefix}.up_proj")
        self.down_proj = DeltaLinear(args.intermediate_size, args.dim, args.mlp_bias, f"{prefix}.down_proj")
        self.gate_up: tuple[Tensor, Tensor | None, list[int]] | None = None  # fuse(): one base GEMM

    def fuse(self) -> None:
        """gate and up weights as row views of one matrix (:func:`fuse_rows`)."""
        self.gate_up = fuse_rows(self.gate_proj, self.up_proj)

    def _apply(self, fn, recurse=True):  # as Attention._apply
        out = super()._apply(fn, recurse)
        if self.gate_up is not None:
            self.fuse()
        return out

    def forward(self, x: Tensor, delta: VariantDelta | None) -> Tensor:
        gate_up = None
        if self.gate_up is not None and self.gate_up[2]:
            if delta is None:
                weight, bias, sizes = self.gate_up
                gate_up = base_linear(x, weight, bias).split(sizes, -1)
            elif isinstance(delta, BatchDeltas):  # grouped rows: one base GEMM, the planes shared
                gate_up = delta.linears((self.gate_proj, self.up_proj), x, self.gate_up)
        gate, up = gate_up if gate_up is not None else (self.gate_proj(x, delta), self.up_proj(x, delta))
        chain = _chain(gate, up)
        return self.down_proj(silu_mul(gate, up) if chain is None else chain.silu_mul(gate, up), delta)


class Block(nn.Module):
    def __init__(self, args: ModelArgs, i: int):
        super().__init__()
        prefix = f"model.layers.{i}"
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps, f"{prefix}.input_layernorm")
        self.self_attn = Attention(args, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps, f"{prefix}.post_attention_layernorm")
        self.mlp = MLP(args, f"{prefix}.mlp")

    # The residual stream leaves a layer as two terms, ``(h, m)`` with ``h + m`` the stream (``m`` the
    # MLP's output): the next layer's input norm adds them in the same kernel (``add_rms_norm``), so
    # no layer launches a kernel for the residual add alone. ``residual=None``: the stream is ``x``.

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, input_pos: Tensor,
                cache: KVCache | None, delta: VariantDelta | None,
                residual: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The residual stream ``x + residual`` through the layer: the next one's ``(h, m)``."""
        h, n = self.input_layernorm.add(x, residual, delta)
        a = self.self_attn(n, cos, sin, mask, input_pos, cache, delta)
        return self.after_attention(h, a, delta)

    def before_attention(self, x: Tensor, cos: Tensor, sin: Tensor, delta, residual: Tensor | None = None,
                         rotate: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The layer up to its attention: the stream ``x + residual`` and ``q, k, v`` of it (q and k
        rotated unless ``rotate`` is False: the attention rotates them, serve/rope_cache.py)."""
        h, n = self.input_layernorm.add(x, residual, delta)
        if not rotate:
            return (h, *self.self_attn.heads(n, delta))
        return (h, *self.self_attn.qkv_heads(n, cos, sin, delta))

    def after_attention(self, h: Tensor, a: Tensor, delta) -> tuple[Tensor, Tensor]:
        """The layer from its attention's projected output ``a`` on (the stream ``h`` before it): the
        next stream as ``(h + a, MLP output)``."""
        h, n = self.post_attention_layernorm.add(h, a, delta)
        return h, self.mlp(n, delta)


# --------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------


class Transformer(nn.Module):
    """Llama-family causal LM whose ``forward`` takes the variant to run as an argument."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = DeltaEmbedding(args.vocab_size, args.dim, "model.embed_tokens")
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.n_layer))
        self.norm = RMSNorm(args.dim, args.norm_eps, "model.norm")
        # A tied head reads the embedding matrix, and so the embedding's delta too.
        head_name = "model.embed_tokens" if args.tie_word_embeddings else "lm_head"
        self.lm_head = DeltaLinear(args.dim, args.vocab_size, False, head_name)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def new_cache(self, batch_size: int, max_seq_len: int | None = None) -> list[KVCache]:
        """A fresh static KV cache for ``batch_size`` sequences of up to ``max_seq_len`` tokens."""
        n = min(max_seq_len or self.args.max_seq_len, self.args.max_seq_len)
        a = self.args
        return [KVCache(batch_size, n, a.n_local_heads, a.head_dim, self.dtype, self.device) for _ in self.layers]

    def forward(self, tokens: Tensor, input_pos: Tensor, cache: list[KVCache] | None = None,
                delta: VariantDelta | None = None) -> Tensor:
        """Logits for ``tokens``.

        Args:
            tokens: int64 ``[B, T]``.
            input_pos: int64 ``[T]``, the positions of ``tokens`` in the sequence. Without a
                cache it must be ``arange(T)`` (a whole sequence); with one, the new tokens'
                positions, whose keys/values are written into the cache at those indices.
            cache: from :meth:`new_cache`, or None for a one-shot forward.
            delta: the variant to run, or None for the base.

        Returns:
            ``[B, T, vocab_size]`` logits in the model's dtype.
        """
        if cache is None:
            mask = None  # a whole sequence: plain causal attention
        else:
            # Row t attends to cache slots ≤ input_pos[t]; unwritten slots lie beyond and are masked.
            mask = torch.arange(cache[0].k.shape[2], device=tokens.device) <= input_pos[:, None]
        freqs = input_pos[:, None].float() * self.inv_freq[None, :]  # [T, hd/2], fp32 as in HF
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)
        x, r = self.embed_tokens(tokens, delta), None
        for i, layer in enumerate(self.layers):
            x, r = layer(x, cos, sin, mask, input_pos, None if cache is None else cache[i], delta, r)
        return self.head(x, delta, r)

    def forward_paged(self, tokens: Tensor, positions: Tensor, step, delta: BatchDeltas | None,
                      logits_rows: Tensor | None = None) -> Tensor:
        """One engine step over the paged KV cache (serve/attention.py): a flat batch of ``T``
        tokens, token ``i`` at ``positions[i]`` of its sequence, run with its own variant
        (``delta.slots[i]``; None: every token on the base); decode rows and prefill chunks together.

        Args:
            tokens, positions: int64 ``[T]``.
            step: a :class:`~deltafleet.serve.attention.PagedStep` (where keys go, what each token reads).
            logits_rows: int64 ``[R]``, the tokens whose next-token logits are wanted (None: all).

        Returns:
            ``[R, vocab_size]`` logits in the model's dtype; equal (up to kernel rounding) to running
            each sequence alone with :meth:`forward` and its own variant.
        """
        cos, sin = self.rope(positions)
        x, r = self.embed_tokens(tokens[:, None], delta), None
        for i, layer in enumerate(self.layers):
            x, r = layer(x, cos, sin, None, positions, step.layer(i), delta, r)
        if logits_rows is not None:
            if not len(logits_rows):  # a step of prompt chunks that all go on: nothing samples
                return x.new_empty(0, self.args.vocab_size)
            x, r = x[logits_rows], r[logits_rows]
            delta = None if delta is None else delta.select(logits_rows)
        return self.head(x, delta, r)[:, 0]

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """``cos, sin`` ``[T, 1, 1, hd]`` in the model's dtype for the flat batch's ``positions [T]``."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]    # [T, 1, 1, hd]
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def head(self, x: Tensor, delta, residual: Tensor | None = None) -> Tensor:
        """Logits ``[B, T, vocab]`` of the stream ``x + residual`` (``[B, T, D]``): final norm, then
        the head."""
        return self.lm_head(self.norm.add(x, residual, delta)[1], delta)

    def hf_param_shapes(self) -> dict[str, torch.Size]:
        """Shapes by Hugging Face parameter name (what an artifact may hold deltas for)."""
        shapes = {hf_name(k): p.shape for k, p in self.named_parameters()}
        if self.args.tie_word_embeddings:
            shapes.pop("lm_head.weight", None)
        return shapes

    def fuse_projections(self) -> None:
        """The base products of q, k, v and of gate, up as one GEMM each (:func:`fuse_rows`); call it
        again after replacing those weights (serve/tp.py's ``shard_model`` does)."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def adopt(self, state: dict[str, Tensor], full_shapes: dict[str, torch.Size],
              device: str | torch.device) -> Transformer:
        """Take ``state`` (parameter name → tensor, already on ``device`` and of this rank's slice) as
        the weights: tie the head to the embedding if the config says so, fuse the base's q/k/v and
        gate/up matrices (:func:`fuse_rows`), put the RoPE frequencies on
        ``device``, freeze every parameter and record ``full_shapes`` (the unsharded HF shapes, which
        artifacts are checked against). Returns ``self`` in eval mode."""
        self.load_state_dict(state, strict=False, assign=True)
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.fuse_projections()
        self.inv_freq = rope_inv_freq(self.args).to(device)
        for p in self.parameters():
            p.requires_grad_(False)
        self.full_param_shapes = full_shapes
        return self.eval()
