"""A synthetic family: a base with seeded random weights and variants with random 1-bit deltas, each
tensor-parallel rank building its own slice on its own device — no checkpoint or artifact on disk.

For shapes that cannot be written where they are served (a Llama-2-70B-shaped base is 138 GB in
bf16, each of its variants 8.6 GB of sign bits), ``serve/run.py synthetic={shape: {...}, variants: 14}``
serves such a family through the same engine, scheduler, delta slots and BitDelta kernels as a
real one:

* the base — every parameter generated whole on the device from its own seed (a hash of the
  family seed and the parameter's Hugging Face name), cut to this rank's slice by
  :func:`deltafleet.serve.tp.slice_for` (as a checkpoint's tensors are read) after :func:`deltafleet.serve.tp.shard_model`
  has cut the (meta) model, and the whole tensor freed at once. Weight matrices and biases are
  N(0, std²), norm weights 1. Every rank computes the same whole tensors (same seed, same kind of
  device; checked across ranks), so the slices form one model: W ranks serve the model one
  process serves.
* variant ``v{i:02d}`` — for every weight matrix, packed sign bytes uniform in 0..255 (pad bits
  0) from a seed of (family seed, i, name) and one α (fp32, per matrix), cut by
  :func:`deltafleet.serve.tp.shard_sign`. The signs are generated one matrix at a time as
  :meth:`deltafleet.serve.batch.DeltaSlots.put` reads them, straight into the variant's device slot: nothing
  of a variant exists outside its slot (and one matrix in flight).

The served folder (``base_dir``, :func:`write_base_dir`) holds ``config.json`` (the shape), the
tokenizer and ``synthetic.json`` (how to generate the rest); :func:`read_synthetic` finds it.
:func:`predict_memory` gives the bytes of tensors each device holds.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from deltafleet.kernels import packed_width, tiled_shape
from deltafleet.serve.batch import check_sign_layout
from deltafleet.serve.delta import VariantDelta, hf_name
from deltafleet.serve.model import ModelArgs, Transformer
from deltafleet.serve.tp import _kind, shard_model, shard_sign, slice_for
from deltafleet.values import real as _finite
from deltafleet.values import whole as _integer

SPEC_NAME = "synthetic.json"
SOURCE_PREFIX = "synthetic:"  # a synthetic variant's `source` (what rank 0 tells the other ranks to load)
DEFAULTS = {"variants": 14, "seed": 0, "std": 0.02, "alpha": 1e-3, "tokenizer_dir": None}  # besides `shape`


def _seed(*parts) -> int:
    """A 63-bit seed from ``parts`` (stable across processes and Python versions, unlike ``hash``)."""
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:8], "little") >> 1


def _generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device).manual_seed(seed)


@dataclass(frozen=True)
class SyntheticFamily:
    """A family whose weights are generated, not read (see the module docstring).

    Args:
        config: the base's Hugging Face ``config.json`` fields (a Llama, Mistral or Qwen2 shape).
        variants: number of variants, named ``v00``, ``v01``, ... (≥ 1).
        seed: the family's seed (base and variants).
        std: standard deviation of the base's weight matrices and biases.
        alpha: every variant matrix's scale α: its delta is ±alpha (fp32).
    """

    config: dict
    variants: int = DEFAULTS["variants"]
    seed: int = DEFAULTS["seed"]
    std: float = DEFAULTS["std"]
    alpha: float = DEFAULTS["alpha"]
    _shapes: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.variants < 1:
            raise ValueError(f"a synthetic family needs ≥ 1 variant, got {self.variants}")

    @property
    def args(self) -> ModelArgs:
        """The model's shape (raises NotImplementedError for an unsupported ``config``)."""
        return ModelArgs.from_hf_config(self.config)

    @property
    def names(self) -> list[str]:
        """The variants' names: ``v00`` … (wider past 100)."""
        width = max(2, len(str(self.variants - 1)))
        return [f"v{i:0{width}d}" for i in range(self.variants)]

    @property
    def fingerprint(self) -> str:
        """Stands for :func:`deltafleet.compress.bitdelta.fingerprint` of a checkpoint: ``"synthetic:sha256:<hex>"``
        of the shape, seed and std (what fixes the base's weights)."""
        spec = json.dumps({"config": self.config, "seed": self.seed, "std": self.std}, sort_keys=True)
        return f"{SOURCE_PREFIX}sha256:{hashlib.sha256(spec.encode()).hexdigest()}"

    def full_shapes(self) -> dict[str, torch.Size]:
        """Whole (unsharded) shapes by Hugging Face parameter name, from a meta-device model."""
        if not self._shapes:
            with torch.device("meta"):
                self._shapes.update(Transformer(self.args).hf_param_shapes())
        return self._shapes

    # ------------------------------------------------------------------ the base

    def base_tensor(self, name: str, device: str | torch.device, dtype: torch.dtype) -> Tensor:
        """The whole base parameter ``name`` (HF name) on ``device`` in ``dtype``: ones for a norm weight,
        else N(0, std²) drawn in fp32 from the parameter's own seed, then cast.

        Raises:
            KeyError: ``name`` is not a parameter of the shape.
        """
        shape, device = self.full_shapes()[name], torch.device(device)
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=dtype, device=device)
        t = torch.empty(shape, dtype=torch.float32, device=device)
        return t.normal_(0.0, self.std, generator=_generator(device, _seed(self.seed, "base", name))).to(dtype)

    def build_base(self, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                   tp: tuple | None = None) -> Transformer:
        """The base as :func:`deltafleet.serve.loading.load_model` would load it from a checkpoint
        holding these weights: on ``device`` in ``dtype``, and with ``tp = (rank, world, group)`` this
        rank's slice only (the whole of one parameter exists on the device at a time, in fp32).

        Raises:
            ValueError: the shape does not split over ``world`` (:func:`deltafleet.serve.tp.shard_model`).
            RuntimeError: the ranks generated different replicated weights (devices that do not draw
                the same random numbers from the same seed).
        """
        args = self.args
        with torch.device("meta"):
            model = Transformer(args)
        full_shapes = model.hf_param_shapes()
        rank, world = (0, 1) if tp is None else tp[:2]
        if tp is not None:
            shard_model(model, *tp)
        state: dict[str, Tensor] = {}
        for pname, p in model.named_parameters():  # a tied head is the embedding: listed once
            name = hf_name(pname)
            whole = self.base_tensor(name, device, dtype)
            t = slice_for(name, whole, rank, world)
            state[pname] = t.clone() if t.numel() < whole.numel() else t  # the slice only, not a view
            del whole, t
            if state[pname].shape != p.shape:
                raise ValueError(f"{name}: generated slice {tuple(state[pname].shape)}, the model holds {tuple(p.shape)}")
        model.adopt(state, full_shapes, device)
        if world > 1 and dist.is_available() and dist.is_initialized():
            _check_replicas(model, tp[2])
        return model

    # ------------------------------------------------------------------ the variants

    def variant(self, name: str, device: str | torch.device = "cpu", tp: tuple | None = None) -> VariantDelta:
        """Variant ``name``'s deltas for this rank (``tp = (rank, world, group)``; None: whole), to pass
        to :meth:`deltafleet.serve.batch.DeltaSlots.put`: a :class:`~deltafleet.serve.delta.VariantDelta` whose ``signs``
        (uint8 ``[N, ceil(K/8)]``, cut like :func:`deltafleet.serve.tp.shard_delta` cuts an artifact's) are
        generated on ``device`` each time one is read and not kept; ``alphas`` fp32 ``[]``; no full
        tensors. ``source`` is ``"synthetic:<name>"``.

        Raises:
            KeyError: ``name`` is not one of :attr:`names`.
        """
        if name not in self.names:
            raise KeyError(f"no synthetic variant {name!r} (this family has {', '.join(self.names)})")
        device = torch.device(device)
        rank, world = (0, 1) if tp is None else tp[:2]
        shapes = {k: s for k, s in self.full_shapes().items() if len(s) == 2}
        alpha = torch.tensor(self.alpha, dtype=torch.float32, device=device)
        out = object.__new__(VariantDelta)
        out.name = name
        out.signs = _SeededSigns(shapes, (self.seed, "variant", self.names.index(name)), device, alpha, rank, world)
        out.alphas = {k: alpha for k in shapes}
        out.betas = {}
        out.full = {}
        out.source = f"{SOURCE_PREFIX}{name}"
        return out


class _SeededSigns(Mapping):
    """One variant's packed signs by HF name, generated on every lookup (see :meth:`SyntheticFamily.variant`)."""

    def __init__(self, shapes: dict, seed_parts: tuple, device: torch.device, alpha: Tensor, rank: int, world: int):
        self.shapes, self.parts, self.device, self.alpha, self.rank, self.world = \
            shapes, seed_parts, device, alpha, rank, world

    def __getitem__(self, name: str) -> Tensor:
        n, k = self.shapes[name]
        g = _generator(self.device, _seed(*self.parts, name))
        sign = torch.randint(0, 256, (n, packed_width(k)), generator=g, dtype=torch.uint8, device=self.device)
        if k % 8:
            sign[:, -1] &= (1 << (k % 8)) - 1  # pad bits are 0 (the artifact format)
        return shard_sign(name, sign, self.alpha, self.rank, self.world)[0]

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def _check_replicas(model: Transformer, group) -> None:
    """Raise RuntimeError unless every rank holds the same replicated parameters (embeddings, norms,
    head), compared by a checksum of a sample of each (a collective: every rank calls it)."""
    sums = [p.reshape(-1)[:: max(1, p.numel() // 65536)].double().sum()
            for n, p in model.named_parameters() if _kind(hf_name(n)) is None]
    lo = torch.stack(sums)
    hi = lo.clone()
    dist.all_reduce(lo, dist.ReduceOp.MIN, group=group)
    dist.all_reduce(hi, dist.ReduceOp.MAX, group=group)
    if not torch.equal(lo, hi):
        raise RuntimeError("tensor-parallel ranks generated different replicated weights from the same seed "
                           "(devices of different kinds?): the synthetic base would not be one model")


# --------------------------------------------------------------------------------------------
# The served folder
# --------------------------------------------------------------------------------------------


# the Hugging Face config fields the model cannot be built without (ModelArgs.from_hf_config), and
# the optional sizes: each an integer ≥ 1 where given (null: its default)
SHAPE_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
SHAPE_OPTIONAL = ("num_key_value_heads", "head_dim", "max_position_embeddings")



def check_options(opts) -> dict:
    """The ``synthetic`` section of conf/serve.yaml, checked, with its defaults filled in: ``shape``
    (Hugging Face config fields: vocab_size, hidden_size, intermediate_size, num_hidden_layers,
    num_attention_heads, num_key_value_heads, max_position_embeddings, ...), ``variants``, ``seed``,
    ``std``, ``alpha``, ``tokenizer_dir`` (see :data:`DEFAULTS`). The one place they are checked:
    serve/run.py calls it before anything is written or any rank starts, and what it returns is
    trusted from there on (:func:`write_base_dir`, :class:`SyntheticFamily`).

    ``shape`` must hold every one of :data:`SHAPE_REQUIRED`, each an integer ≥ 1, as must any of
    :data:`SHAPE_OPTIONAL` it sets; hidden_size a multiple of num_attention_heads, which must be a
    multiple of num_key_value_heads; an even head_dim (RoPE rotates pairs); and a model the server
    serves (:meth:`deltafleet.serve.model.ModelArgs.from_hf_config`). ``variants``: an integer ≥ 1;
    ``seed``: an integer; ``std``: a finite number > 0; ``alpha``: a finite number ≥ 0;
    ``tokenizer_dir``: null or a folder. Booleans are not numbers here.

    Raises:
        ValueError: ``opts`` is not a mapping, an unknown key, no ``shape``, or the first option not
            of its kind, named as ``synthetic: <option> ...``.
    """
    if not isinstance(opts, Mapping):
        raise ValueError(f"synthetic must be null or a mapping of shape, {', '.join(DEFAULTS)}; got {opts!r}")
    opts = dict(opts)
    unknown = sorted(set(opts) - set(DEFAULTS) - {"shape"})
    if unknown:
        raise ValueError(f"synthetic: unknown option(s) {unknown}; valid: shape, {', '.join(DEFAULTS)}")
    if not opts.get("shape"):
        raise ValueError("synthetic: `shape` (Hugging Face config fields of the base) is required")
    if not isinstance(opts["shape"], Mapping):
        raise ValueError(f"synthetic: shape must be a mapping of Hugging Face config fields "
                         f"({', '.join(SHAPE_REQUIRED)}, ...), got {opts['shape']!r}")
    out = {**DEFAULTS, **opts, "shape": dict(opts["shape"])}
    _check_shape(out["shape"])
    if not _integer(v := out["variants"]) or v < 1:
        raise ValueError(f"synthetic: variants must be an integer ≥ 1, got {v!r}")
    if not _integer(v := out["seed"]):
        raise ValueError(f"synthetic: seed must be an integer, got {v!r}")
    if not _finite(v := out["std"]) or not v > 0:
        raise ValueError(f"synthetic: std (of the base's weights) must be a finite number > 0, got {v!r}")
    if not _finite(v := out["alpha"]) or v < 0:
        raise ValueError(f"synthetic: alpha (every delta matrix's ±α) must be a finite number ≥ 0, got {v!r}")
    if (v := out["tokenizer_dir"]) is not None and (not isinstance(v, str) or not v):
        raise ValueError(f"synthetic: tokenizer_dir must be null or a tokenizer's folder, got {v!r}")
    return out


def _check_shape(shape: dict) -> None:
    """Raises ValueError unless ``shape`` is a model the server can build (see :func:`check_options`)."""
    missing = [k for k in SHAPE_REQUIRED if shape.get(k) is None]
    if missing:
        raise ValueError(f"synthetic: shape.{missing[0]} is required (the shape needs {', '.join(SHAPE_REQUIRED)})")
    for key in SHAPE_REQUIRED + SHAPE_OPTIONAL:
        if (v := shape.get(key)) is not None and (not _integer(v) or v < 1):
            raise ValueError(f"synthetic: shape.{key} must be an integer ≥ 1, got {v!r}")
    heads, kv_heads = shape["num_attention_heads"], shape.get("num_key_value_heads") or shape["num_attention_heads"]
    if shape["hidden_size"] % heads:
        raise ValueError(f"synthetic: shape.hidden_size ({shape['hidden_size']}) must be a multiple of "
                         f"shape.num_attention_heads ({heads})")
    if heads % kv_heads:
        raise ValueError(f"synthetic: shape.num_attention_heads ({heads}) must be a multiple of "
                         f"shape.num_key_value_heads ({kv_heads})")
    head_dim = shape.get("head_dim") or shape["hidden_size"] // heads
    if head_dim % 2:
        raise ValueError(f"synthetic: the shape's head_dim ({head_dim}"
                         f"{'' if shape.get('head_dim') else ': hidden_size / num_attention_heads'}) must be even "
                         "(RoPE rotates pairs of dimensions)")
    for key in ("rms_norm_eps", "rope_theta"):
        if (v := shape.get(key)) is not None and (not _finite(v) or not v > 0):
            raise ValueError(f"synthetic: shape.{key} must be a finite number > 0, got {v!r}")
    for key in ("torch_dtype", "dtype"):
        if key in shape:
            raise ValueError(f"synthetic: shape.{key} is not part of a shape: the dtype served is the `dtype` setting")
    try:
        ModelArgs.from_hf_config({"model_type": "llama", **shape})  # as write_base_dir's config.json
    except (NotImplementedError, ValueError, TypeError) as e:
        raise ValueError(f"synthetic: shape is not a model this server serves: {e}") from None
    from transformers import LlamaConfig

    try:  # the fields the checks above leave to transformers (types, ranges), as the served folder is read
        LlamaConfig(**shape)
    except Exception as e:  # noqa: BLE001 - transformers' and huggingface_hub's validation errors vary
        said = " ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__
        raise ValueError(f"synthetic: shape is not a valid Llama config: {said}") from None


def write_base_dir(out: str | Path, opts: Mapping, tokenizer_dir: str | Path) -> Path:
    """Write the served folder of a synthetic family (atomically; replaces ``out``): ``config.json``
    (``opts["shape"]`` as a Llama config, eos/pad = the tokenizer's eos), the tokenizer of
    ``tokenizer_dir`` padded with plain tokens ``<t{i}>`` up to ``vocab_size`` (every id the model
    can sample decodes to text), and ``synthetic.json`` (variants, seed, std, alpha). No weights.

    Args:
        out: the folder to write. opts: as :func:`check_options` returns it.
        tokenizer_dir: a Hugging Face tokenizer folder (``AutoTokenizer``).

    Raises:
        ValueError: the tokenizer has more entries than ``vocab_size``, or bad ``opts``.
        OSError: ``tokenizer_dir`` holds no tokenizer.
    """
    from transformers import AutoTokenizer

    from deltafleet.atomic import staged_dir

    opts = check_options(opts)
    shape = opts["shape"]
    if not Path(tokenizer_dir).is_dir():
        raise ValueError(f"synthetic: tokenizer_dir {tokenizer_dir} is not a folder")
    try:
        tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds for a folder that holds none
        said = " ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__
        raise ValueError(f"synthetic: tokenizer_dir {tokenizer_dir} holds no tokenizer transformers can read: "
                         f"{said}") from None
    vocab = int(shape["vocab_size"])
    if len(tok) > vocab:
        raise ValueError(f"synthetic: the tokenizer of {tokenizer_dir} has {len(tok)} entries, more than "
                         f"shape.vocab_size={vocab}")
    if len(tok) < vocab:
        tok.add_tokens([f"<t{i}>" for i in range(len(tok), vocab)])
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu", **shape,
              "eos_token_id": tok.eos_token_id, "bos_token_id": None, "pad_token_id": tok.eos_token_id}
    spec = {"format": "deltafleet-synthetic", **{k: opts[k] for k in ("variants", "seed", "std", "alpha")}}
    out = Path(out)
    with staged_dir(out) as tmp:
        tok.save_pretrained(tmp)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / SPEC_NAME).write_text(json.dumps(spec, indent=2) + "\n")
    return out


def read_synthetic(base_dir: str | Path) -> SyntheticFamily | None:
    """The family of a folder written by :func:`write_base_dir`, or None for any other folder (a real
    checkpoint)."""
    d = Path(base_dir)
    if not (d / SPEC_NAME).is_file():
        return None
    spec = json.loads((d / SPEC_NAME).read_text())
    return SyntheticFamily(json.loads((d / "config.json").read_text()), variants=int(spec["variants"]),
                           seed=int(spec["seed"]), std=float(spec["std"]), alpha=float(spec["alpha"]))


# --------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------


def sign_bytes(n: int, k: int, tiled: bool) -> int:
    """Bytes of an ``[n, k]`` matrix's packed signs: in whole 64 × 16-byte tiles, or as rows."""
    if tiled:
        nt, kt, r, b = tiled_shape(n, k)
        return nt * kt * r * b
    return n * packed_width(k)


def predict_memory(config: dict, *, world: int = 1, rank: int = 0, n_slots: int = 1,
                   dtype: torch.dtype = torch.bfloat16, max_batch: int = 1, max_seq_len: int | None = None,
                   sign_layout: str = "tiled") -> dict:
    """Bytes of tensors one tensor-parallel rank holds when serving ``config``'s shape: its slice of
    the base (:func:`deltafleet.serve.tp.shard_model`), ``n_slots`` variant slots (:class:`deltafleet.serve.batch.DeltaSlots`:
    packed signs uint8 and α fp32 per row of every weight matrix of the slice, and every 1-D
    parameter ``n_slots + 1`` times), and the scheduler's KV cache (``max_batch`` sequences of
    ``max_seq_len`` tokens, this rank's key/value heads). Pure arithmetic on the shape, nothing
    allocated. Not included: the CUDA context, the allocator's cache, activations and workspaces.

    Args:
        config: Hugging Face ``config.json`` fields. world, rank: the tensor-parallel split (rank 0
            also holds the row-parallel biases). n_slots: variant slots. dtype: the served dtype.
        max_batch, max_seq_len: the KV cache (``max_seq_len`` None: the model's context).
        sign_layout: the slots' (``DeltaSlots``): ``"tiled"`` pads the linears' signs to whole
            64 × 16-byte tiles (the embedding's stay rows).

    Returns:
        ``{"base_bytes", "slot_bytes" (one slot, the 1-D parameters once), "slots_bytes" (all),
        "kv_cache_bytes", "total_bytes", "params"}`` — bytes, and ``params`` the base slice's
        parameter count.

    Raises:
        ValueError: heads or widths that do not split over ``world`` (a row-parallel width: in whole
            sign bytes, as :func:`deltafleet.serve.tp.shard_model` cuts it), or an unknown ``sign_layout``.
    """
    check_sign_layout(sign_layout)
    a = ModelArgs.from_hf_config(config)
    e = torch.empty((), dtype=dtype).element_size()
    if a.n_head % world or a.n_local_heads % world or a.intermediate_size % world:
        raise ValueError(f"the shape does not split over {world} ranks")
    q, kv, d, f = a.n_head * a.head_dim, a.n_local_heads * a.head_dim, a.dim, a.intermediate_size
    for name, k in (("o_proj", q), ("down_proj", f)):  # the row-parallel widths, as shard_model cuts them
        if world > 1 and (k // world) % 8:
            raise ValueError(f"{name}: K = {k} over {world} ranks is not a multiple of 8 per rank (sign bytes "
                             "cannot be cut)")
    col, row = "column", "row"
    layer = [(q, d, a.qkv_bias, col), (kv, d, a.qkv_bias, col), (kv, d, a.qkv_bias, col), (d, q, a.o_bias, row),
             (f, d, a.mlp_bias, col), (f, d, a.mlp_bias, col), (d, f, a.mlp_bias, row)]
    matrices = [(a.vocab_size, d)] * (1 if a.tie_word_embeddings else 2)  # embedding (and head): replicated
    # matrices[0] is the embedding (gathered by token: its signs stay rows in every layout)
    vectors = (2 * a.n_layer + 1) * d  # norm weights: replicated
    for n, k, bias, kind in layer:
        n_r, k_r = (n // world, k) if kind == col else (n, k // world)
        matrices += [(n_r, k_r)] * a.n_layer
        if bias and (kind == col or rank == 0):  # a row-parallel bias: rank 0 only
            vectors += n_r * a.n_layer
    params = sum(n * k for n, k in matrices) + vectors
    slot_matrices = sum(sign_bytes(n, k, sign_layout == "tiled" and i > 0) + 4 * n
                        for i, (n, k) in enumerate(matrices))
    seq = a.max_seq_len if max_seq_len is None else min(max_seq_len, a.max_seq_len)
    kv_bytes = 2 * a.n_layer * max_batch * (a.n_local_heads // world) * seq * a.head_dim * e
    out = {"params": params, "base_bytes": params * e, "slot_bytes": slot_matrices + vectors * e,
           "slots_bytes": n_slots * slot_matrices + (n_slots + 1) * vectors * e, "kv_cache_bytes": kv_bytes}
    out["total_bytes"] = out["base_bytes"] + out["slots_bytes"] + kv_bytes
    return out
