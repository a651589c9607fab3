"""BitDelta export across model layouts (Llama, Mistral, Qwen2) and checkpoint dtypes (fp32, fp16, bf16).

Each base is a tiny random ``transformers`` model (hidden 64, 2 layers, 4 heads / 2 kv heads,
vocabulary 200) saved with ``save_pretrained`` in the dtype under test; its "fine-tune" perturbs
every matrix except one, a norm or two and (Qwen2) two of the q/k/v biases, and leaves the rest
bit-identical. What the artifact must hold, the materialised weights and the logits are computed
here independently, in plain torch, from the two safetensors files:

    Δ = W_ft − W_base (float32),  α = mean|Δ| (or per row),  W ≈ W_base + α·s,  s = +1 if Δ > 0 else −1

Tolerances: α is checked against a float64 mean to 1e-6 (a float32 mean is not bit-reproducible
across memory layouts); with those α, weights are compared exactly (the same float32 arithmetic,
then the same cast to the checkpoint dtype). Logits of two models with bit-identical weights, both run by transformers in
float32, are compared at ``1e-5``. The served path (``deltafleet.serve.model``) always runs in float32 here
(``load_model(dtype=float32)``) and reconstructs ``W_base + α·s`` on the fly
without rounding it to the checkpoint dtype, so against an HF model with the *unrounded* float32
reconstruction it matches at ``1e-5`` for every dtype, and against the ``export_hf`` checkpoint
(whose weights are rounded to fp16/bf16) only to that rounding: see ``_export_vs_served_tol``.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch.testing import assert_close
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from deltafleet.compress.bitdelta import compress, export_hf, fingerprint, load_artifact, materialize
from deltafleet.serve.delta import VariantDelta
from deltafleet.serve.loading import load_model

VOCAB = 200
ADDED_TOKENS = 8
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
UNCHANGED_MATRIX = "model.layers.1.self_attn.o_proj.weight"
LAYOUTS = {  # name → (config class, model class)
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
}
CHANGED_NORMS = ("model.layers.0.input_layernorm.weight", "model.norm.weight")
CHANGED_BIASES = {  # Qwen2 has q/k/v biases: two change, the other four stay bit-identical
    "qwen2": ("model.layers.0.self_attn.q_proj.bias", "model.layers.1.self_attn.v_proj.bias"),
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = dict(atol=1e-5, rtol=1e-5)


def _export_vs_served_tol(dtype: torch.dtype, logits: torch.Tensor) -> dict:
    """Tolerance between the export_hf checkpoint and the fp32 served path.

    export_hf rounds each reconstructed weight to the checkpoint dtype (unit roundoff u = 2⁻¹¹
    fp16, 2⁻⁸ bf16); the served path keeps ``W_base + α·s`` in float32. Through two layers that
    moves the logits by about 2·u·max|logits| (measured: 1.9e-3–4.1e-3 fp16, 1.7e-2–2.6e-2 bf16
    at max|logits| ≈ 3.5), so the bound is 4·u·max|logits|. In float32 both sides hold the same
    weights and differ only in operation order: ``TOL``.
    """
    if dtype == torch.float32:
        return TOL
    return dict(atol=4 * (torch.finfo(dtype).eps / 2) * logits.abs().max().item(), rtol=0.0)


# --------------------------------------------------------------------------------------------
# Tiny checkpoints
# --------------------------------------------------------------------------------------------


def _model(layout: str, dtype: torch.dtype, tied: bool, seed: int = 0):
    """A random tiny model of ``layout`` with non-trivial norms and biases, cast to ``dtype``."""
    config_cls, model_cls = LAYOUTS[layout]
    cfg = config_cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                     initializer_range=0.1, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.3)
    return model.to(dtype)


def _finetune(model, layout: str, seed: int, resize: bool = False):
    """Perturb ``model`` in place: every matrix but UNCHANGED_MATRIX, the changed norms and biases.

    The perturbation is computed in float32 and rounded to the model's dtype once, as training
    in that dtype would store it. ``resize`` first adds ADDED_TOKENS rows (new tokens) to the
    vocabulary matrices, as ``resize_token_embeddings`` does for a fine-tune with added tokens.
    """
    if resize:
        model.resize_token_embeddings(VOCAB + ADDED_TOKENS, mean_resizing=False)
    changed_1d = set(CHANGED_NORMS) | set(CHANGED_BIASES.get(layout, ()))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied lm_head is not listed again
            w = p.float()
            if p.dim() == 2 and name != UNCHANGED_MATRIX:
                p.copy_(w + 0.5 * w.std() * torch.randn(w.shape, generator=g))
            elif name in changed_1d:
                p.copy_(w + 0.3 * torch.randn(w.shape, generator=g))
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``get(layout, dtype, tied=False, resize=False) → (base_dir, ft_dir)``, each built once per module."""
    cache: dict[tuple, tuple[Path, Path]] = {}

    def get(layout: str, dtype: torch.dtype, tied: bool = False, resize: bool = False):
        key = (layout, dtype, tied, resize)
        if key not in cache:
            root = tmp_path_factory.mktemp(f"{layout}-{str(dtype)[6:]}-{'tied' if tied else 'untied'}")
            _model(layout, dtype, tied).save_pretrained(root / "base")
            _finetune(_model(layout, dtype, tied), layout, seed=1, resize=resize).save_pretrained(root / "ft")
            cache[key] = root / "base", root / "ft"
        return cache[key]

    return get


# --------------------------------------------------------------------------------------------
# The independent reconstruction
# --------------------------------------------------------------------------------------------


def _is_vocab(name: str) -> bool:
    return name in (EMBED, HEAD)


def _alpha(d: torch.Tensor, per_row: bool) -> torch.Tensor:
    """BitDelta Eq. 1: α = mean|Δ| (float64 accumulation, rounded to float32), per row or per matrix."""
    a = d.double().abs()
    return (a.mean(dim=1) if per_row else a.mean()).float()


def _checked_alphas(art, base: dict, ft: dict, granularity: str) -> dict:
    """The artifact's α, after checking each against :func:`_alpha` (shape exact, value to 1e-6).

    A float32 mean is not bit-reproducible across memory layouts (SIMD reduction order), so the
    exact weight comparisons below use these checked values, not a second float32 reduction.
    """
    for name, a in art.alphas.items():
        want = _alpha(ft[name].float() - base[name].float(), granularity == "row" or _is_vocab(name))
        assert a.dtype == torch.float32 and a.shape == want.shape, name
        assert_close(a, want, rtol=1e-6, atol=0, msg=name)
    return art.alphas


def _expected(base: dict, ft: dict, granularity: str, alphas: dict, round_to_dtype: bool = True) -> dict:
    """``W_base + α·s`` for every 2-D same-shape tensor, the fine-tune's tensor for everything else.

    ``alphas`` from :func:`_checked_alphas`; they must exist exactly for the changed 2-D tensors
    (row α for ``granularity="row"`` and always for the embedding and LM head). With
    ``round_to_dtype=False`` the reconstruction stays float32 (what the served path computes).
    """
    out = {}
    for name, w_ft in ft.items():
        w_b = base.get(name)
        if w_b is not None and w_ft.dim() == 2 and w_b.shape == w_ft.shape:
            d = w_ft.float() - w_b.float()
            if not d.any():
                assert name not in alphas, name
                out[name] = w_b if round_to_dtype else w_b.float()
                continue
            per_row = granularity == "row" or _is_vocab(name)
            alpha = alphas[name]
            assert alpha.shape == ((w_ft.shape[0],) if per_row else ()), name
            w = w_b.float() + (alpha.reshape(-1, 1) if per_row else alpha) * torch.where(d > 0, 1.0, -1.0)
            out[name] = w.to(w_ft.dtype) if round_to_dtype else w
        else:
            out[name] = w_ft if round_to_dtype else w_ft.float()
    return out


def _stored_keys(art_dir: Path) -> set[str]:
    with safe_open(art_dir / "delta.safetensors", framework="pt") as f:
        return set(f.keys())


def _tokens(vocab: int, b: int = 2, t: int = 11) -> torch.Tensor:
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(7))


def _hf_with(ft_dir: Path, state: dict):
    """The fine-tune's HF architecture in float32 with ``state`` loaded (tied lm_head follows the embedding)."""
    hf = AutoModelForCausalLM.from_pretrained(ft_dir, dtype=torch.float32).eval()
    missing, unexpected = hf.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    assert not unexpected
    assert set(missing) <= ({HEAD} if hf.config.tie_word_embeddings else set()), missing
    return hf


def _served(base_dir: Path, art, x: torch.Tensor) -> torch.Tensor:
    """Logits of the served path: the base resident once, the variant applied on the fly (float32)."""
    model = load_model(base_dir, dtype=torch.float32)
    delta = VariantDelta(art, dtype=torch.float32)
    delta.check(model.hf_param_shapes())
    with torch.no_grad():
        return model(x, torch.arange(x.shape[1]), delta=delta)


# --------------------------------------------------------------------------------------------
# What is stored, and the round trip through materialize
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("granularity", ["matrix", "row"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_stored_tensors_and_materialize_match_independent_reconstruction(checkpoints, tmp_path, layout, dtype,
                                                                          granularity):
    base_dir, ft_dir = checkpoints(layout, dtype)
    compress(base_dir, ft_dir, tmp_path / "art", variant="v", granularity=granularity)
    art = load_artifact(tmp_path / "art", base_fingerprint=fingerprint(base_dir))
    base, ft = load_file(base_dir / "model.safetensors"), load_file(ft_dir / "model.safetensors")
    assert {t.dtype for t in ft.values()} == {dtype}

    matrices = {n for n, t in ft.items() if t.dim() == 2}
    assert {EMBED, HEAD} <= matrices
    changed_1d = set(CHANGED_NORMS) | set(CHANGED_BIASES.get(layout, ()))
    if layout == "qwen2":  # all six q/k/v biases exist; only two changed
        assert sum(n.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")) for n in ft) == 6
    compressed = matrices - {UNCHANGED_MATRIX}
    assert set(art.signs) == set(art.alphas) == compressed
    assert set(art.full) == changed_1d  # unchanged norms and biases are omitted
    assert _stored_keys(tmp_path / "art") == (
        {n + ".sign" for n in compressed} | {n + ".alpha" for n in compressed} | changed_1d
    )

    alphas = _checked_alphas(art, base, ft, granularity)
    for name in compressed:
        per_row = granularity == "row" or _is_vocab(name)
        assert alphas[name].shape == ((ft[name].shape[0],) if per_row else ()), name  # [vocab] for embed/head
        d = ft[name].float() - base[name].float()
        n, k = d.shape
        bits = (art.signs[name].unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1
        assert art.signs[name].dtype == torch.uint8 and art.signs[name].shape == (n, (k + 7) // 8)
        assert torch.equal(bits.reshape(n, -1)[:, :k].bool(), d > 0), name
    for name in changed_1d:
        assert art.full[name].dtype == dtype and torch.equal(art.full[name], ft[name]), name

    state, expected = materialize(base_dir, art), _expected(base, ft, granularity, alphas)
    assert state.keys() == ft.keys()
    for name, t in state.items():
        assert t.dtype == dtype and t.shape == ft[name].shape, name
        assert torch.equal(t, expected[name]), name


# --------------------------------------------------------------------------------------------
# export_hf: loads in transformers, matches the reconstruction and the served path
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_export_hf_logits_match_reconstruction_and_served_path(checkpoints, tmp_path, layout, dtype):
    base_dir, ft_dir = checkpoints(layout, dtype)
    granularity = "row" if layout == "mistral" else "matrix"
    compress(base_dir, ft_dir, tmp_path / "art", variant="v", granularity=granularity)
    out = export_hf(base_dir, tmp_path / "art", tmp_path / "hf")
    base, ft = load_file(base_dir / "model.safetensors"), load_file(ft_dir / "model.safetensors")

    art = load_artifact(tmp_path / "art")
    alphas = _checked_alphas(art, base, ft, granularity)
    exported = load_file(out / "model.safetensors")
    expected = _expected(base, ft, granularity, alphas)
    assert exported.keys() == ft.keys()
    for name, t in exported.items():
        assert t.dtype == dtype and torch.equal(t, expected[name]), name
    assert json.loads((out / "config.json").read_text())["model_type"] == layout

    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf) is LAYOUTS[layout][1]
    x = _tokens(VOCAB)
    with torch.no_grad():
        logits = hf(x).logits
        ref = _hf_with(ft_dir, expected)(x).logits  # (a) the rounded reconstruction, run by HF
        ref_fp32 = _hf_with(ft_dir, _expected(base, ft, granularity, alphas, round_to_dtype=False))(x).logits
        base_logits = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()(x).logits
    served = _served(base_dir, art, x)  # (b)
    assert ref.abs().max() > 1.0 and (logits - base_logits).abs().max() > 0.5  # not a degenerate comparison
    assert_close(logits, ref, **TOL)
    assert_close(served, ref_fp32, **TOL)
    assert_close(served, logits, **_export_vs_served_tol(dtype, logits))


# --------------------------------------------------------------------------------------------
# Tied embeddings
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["llama", "qwen2"])
def test_tied_embeddings_stay_tied(checkpoints, tmp_path, layout, dtype):
    base_dir, ft_dir = checkpoints(layout, dtype, tied=True)
    ft = load_file(ft_dir / "model.safetensors")
    assert EMBED in ft and HEAD not in ft  # a tied checkpoint stores the matrix once
    compress(base_dir, ft_dir, tmp_path / "art", variant="v", granularity="matrix")
    art = load_artifact(tmp_path / "art")
    assert not any(k.startswith("lm_head") for k in _stored_keys(tmp_path / "art"))
    assert EMBED in art.signs and art.alphas[EMBED].shape == (VOCAB,)  # row α even at matrix granularity

    out = export_hf(base_dir, tmp_path / "art", tmp_path / "hf")
    assert HEAD not in load_file(out / "model.safetensors")
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert hf.config.tie_word_embeddings
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()

    base = load_file(base_dir / "model.safetensors")
    alphas = _checked_alphas(art, base, ft, "matrix")
    x = _tokens(VOCAB)
    with torch.no_grad():
        logits = hf(x).logits
        ref = _hf_with(ft_dir, _expected(base, ft, "matrix", alphas))(x).logits
        ref_fp32 = _hf_with(ft_dir, _expected(base, ft, "matrix", alphas, round_to_dtype=False))(x).logits
    assert ref.abs().max() > 1.0
    assert_close(logits, ref, **TOL)
    assert_close(_served(base_dir, art, x), ref_fp32, **TOL)  # the served head reads the embedding's delta


# --------------------------------------------------------------------------------------------
# Resized vocabulary (added tokens)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "layout, dtype, tied",
    [("llama", torch.float32, False), ("qwen2", torch.bfloat16, False), ("mistral", torch.float16, True)],
    ids=["llama-fp32-untied", "qwen2-bf16-untied", "mistral-fp16-tied"],
)
def test_resized_vocabulary_is_stored_in_full_and_exported_with_its_size(checkpoints, tmp_path, layout, dtype, tied):
    base_dir, ft_dir = checkpoints(layout, dtype, tied=tied, resize=True)
    base, ft = load_file(base_dir / "model.safetensors"), load_file(ft_dir / "model.safetensors")
    vocab_matrices = {EMBED} if tied else {EMBED, HEAD}
    assert all(ft[n].shape == (VOCAB + ADDED_TOKENS, 64) for n in vocab_matrices)

    compress(base_dir, ft_dir, tmp_path / "art", variant="v", granularity="matrix")
    art = load_artifact(tmp_path / "art")
    changed_1d = set(CHANGED_NORMS) | set(CHANGED_BIASES.get(layout, ()))
    assert set(art.full) == vocab_matrices | changed_1d
    assert set(art.signs) == {n for n, t in ft.items() if t.dim() == 2} - vocab_matrices - {UNCHANGED_MATRIX}
    for name in vocab_matrices:
        assert art.full[name].dtype == dtype and torch.equal(art.full[name], ft[name]), name

    expected = _expected(base, ft, "matrix", _checked_alphas(art, base, ft, "matrix"))
    state = materialize(base_dir, art)
    assert state.keys() == ft.keys()
    for name, t in state.items():
        assert t.dtype == dtype and torch.equal(t, expected[name]), name

    # The served path refuses a resized vocabulary with a clear error rather than misreading it.
    model = load_model(base_dir)
    with pytest.raises(ValueError, match="resized vocabularies are not served"):
        VariantDelta(art).check(model.hf_param_shapes())

    out = export_hf(base_dir, tmp_path / "art", tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == VOCAB + ADDED_TOKENS  # not the base's vocabulary size
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert hf.model.embed_tokens.weight.shape == (VOCAB + ADDED_TOKENS, 64)
    x = _tokens(VOCAB + ADDED_TOKENS)
    x[:, -1] = VOCAB + ADDED_TOKENS - 1  # an added token
    with torch.no_grad():
        logits = hf(x).logits
        ref = _hf_with(ft_dir, expected)(x).logits
    assert logits.shape[-1] == VOCAB + ADDED_TOKENS
    assert_close(logits, ref, **TOL)
