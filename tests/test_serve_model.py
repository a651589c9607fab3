"""serve/model.py against Hugging Face: base logits, variant logits vs the materialised fine-tune,
GQA, biases, RoPE scaling, tied embeddings, and incremental decoding with the static KV cache.

All comparisons are in float32 with ``atol=1e-5, rtol=1e-5`` unless stated (logits of magnitude
≲ 10): the model computes the same operations as HF, in a different order only inside SDPA and
the fp32 delta kernel.
"""
from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close
from transformers import LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from deltafleet.compress.bitdelta import compress, load_artifact
from deltafleet.kernels import reconstruct
from deltafleet.serve.delta import VariantDelta
from deltafleet.serve.loading import load_model
from deltafleet.serve.model import ModelArgs
from tests.conftest import perturb, tiny_llama

TOL = dict(atol=1e-5, rtol=1e-5)


def _tokens(vocab: int, b: int = 2, t: int = 13, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


def _ours_vs_hf(hf, tmp_path, tol=TOL):
    hf.save_pretrained(tmp_path / "m")
    ours = load_model(tmp_path / "m")
    x = _tokens(hf.config.vocab_size)
    with torch.no_grad():
        ref = hf(x).logits
        out = ours(x, torch.arange(x.shape[1]))
    assert ref.abs().max() > 1.0  # not a degenerate comparison
    assert_close(out, ref, **tol)
    return ours


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa2", "mqa"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_base_logits_match_hf_llama(tmp_path, kv_heads, tied):
    hf = tiny_llama(97, num_key_value_heads=kv_heads, tie_word_embeddings=tied)
    ours = _ours_vs_hf(hf, tmp_path)
    assert ours.args.n_local_heads == kv_heads and ours.args.tie_word_embeddings == tied
    if tied:  # one copy of the matrix
        assert ours.lm_head.weight is ours.embed_tokens.weight


def test_fused_base_projections_are_views_and_survive_conversion(tmp_path):
    """q/k/v and gate/up of the base run as one GEMM each over one matrix whose row views are the
    modules' weights; ``.to()`` fuses the converted tensors again (a stale matrix would be float32)."""
    hf = tiny_llama(97, num_key_value_heads=2, attention_bias=True)
    ours = _ours_vs_hf(hf, tmp_path)
    attn, mlp = ours.layers[0].self_attn, ours.layers[0].mlp
    weight, bias, sizes = attn.qkv
    assert sizes == [attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0], attn.v_proj.weight.shape[0]]
    assert attn.k_proj.weight.data_ptr() == weight[sizes[0]:].data_ptr() and bias is not None
    assert mlp.up_proj.weight.data_ptr() == mlp.gate_up[0][mlp.gate_proj.weight.shape[0]:].data_ptr()
    x = _tokens(97)
    ours = ours.to(torch.float64)
    assert attn.qkv[0].dtype == torch.float64 and attn.v_proj.weight.data_ptr() == attn.qkv[0][-attn.v_proj.weight.shape[0]:].data_ptr()
    with torch.no_grad():
        fused = ours(x, torch.arange(x.shape[1]))
        for layer in ours.layers:
            layer.self_attn.qkv = layer.mlp.gate_up = None  # one linear each
        plain = ours(x, torch.arange(x.shape[1]))
    assert_close(fused, plain, atol=1e-12, rtol=1e-12)


def test_attention_and_mlp_bias_and_llama3_rope_match_hf(tmp_path):
    rope = {"rope_type": "llama3", "rope_theta": 5000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
    hf = tiny_llama(97, attention_bias=True, mlp_bias=True, rope_parameters=rope)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith(".bias"):
                p.normal_(0, 0.3)
    ours = _ours_vs_hf(hf, tmp_path)
    assert ours.args.rope_scaling["rope_type"] == "llama3" and ours.args.o_bias and ours.args.mlp_bias


def test_qwen2_qkv_bias_matches_hf(tmp_path):
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      initializer_range=0.1, tie_word_embeddings=False)
    hf = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if p.dim() == 1:
                p.normal_(0.5 if n.endswith("norm.weight") else 0.0, 0.3)
    ours = _ours_vs_hf(hf, tmp_path)
    assert ours.args.qkv_bias and not ours.args.o_bias


def test_incremental_decode_with_kv_cache_equals_full_forward(tmp_path):
    hf = tiny_llama(97)
    hf.save_pretrained(tmp_path / "m")
    model = load_model(tmp_path / "m")
    x = _tokens(97, b=2, t=12)
    with torch.no_grad():
        full = model(x, torch.arange(12))
        cache = model.new_cache(2, 16)
        parts = [model(x[:, :5], torch.arange(5), cache)]  # prefill 5, then one token at a time
        parts += [model(x[:, i : i + 1], torch.tensor([i]), cache) for i in range(5, 12)]
    assert_close(torch.cat(parts, dim=1), full, **TOL)


def _materialised_hf(base_dir, artifact) -> LlamaForCausalLM:
    """HF model with W_base + α·sign(Δ) for every compressed weight and the artifact's full tensors."""
    hf = LlamaForCausalLM.from_pretrained(base_dir).eval()
    sd = hf.state_dict()
    for name, sign in artifact.signs.items():
        sd[name] = reconstruct(sd[name], sign, artifact.alphas[name])
    for name, t in artifact.full.items():
        sd[name] = t
    hf.load_state_dict(sd)
    return hf


@pytest.mark.parametrize("variant", ["coder", "writer"])
def test_variant_logits_match_hf_of_materialised_weights(tiny_family, variant):
    base_dir = tiny_family.base_dir
    artifact = load_artifact(tiny_family.artifacts_dir / variant)
    model = load_model(base_dir)
    delta = VariantDelta(artifact)
    delta.check(model.hf_param_shapes())
    # Every linear and the embedding carry a delta; writer also stores norms in full.
    assert "model.embed_tokens.weight" in delta.signs and "lm_head.weight" in delta.signs
    assert len(delta.signs) == 2 + 7 * model.args.n_layer
    if variant == "writer":
        assert {"model.norm.weight", "model.layers.1.input_layernorm.weight"} <= set(delta.full)

    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = _tokens(model.args.vocab_size)
    with torch.no_grad():
        ref = _materialised_hf(base_dir, artifact)(x).logits
        out = model(x, torch.arange(x.shape[1]), delta=delta)
        base_out = model(x, torch.arange(x.shape[1]))
        base_ref = LlamaForCausalLM.from_pretrained(base_dir).eval()(x).logits
    assert_close(out, ref, **TOL)
    assert_close(base_out, base_ref, **TOL)
    assert (out - base_out).abs().max() > 0.1  # the variant really is another model
    # The base weights are untouched and no dense per-variant copy exists: the variant costs its
    # signs (1 bit per weight), scales and full norms — well under a tenth of the fp32 weights.
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    assert delta.nbytes < dense / 20


def test_row_granularity_delta_and_kv_cache(tiny_family, tmp_path):
    out_dir = tmp_path / "coder-row"
    compress(tiny_family.base_dir, tiny_family.variants["coder"], out_dir, variant="coder", granularity="row")
    artifact = load_artifact(out_dir)
    assert next(iter(artifact.alphas.values())).dim() == 1
    model = load_model(tiny_family.base_dir)
    delta = VariantDelta(artifact)
    x = _tokens(model.args.vocab_size, b=1, t=9)
    with torch.no_grad():
        ref = _materialised_hf(tiny_family.base_dir, artifact)(x).logits
        cache = model.new_cache(1, 9)
        parts = [model(x[:, :4], torch.arange(4), cache, delta)]
        parts += [model(x[:, i : i + 1], torch.tensor([i]), cache, delta) for i in range(4, 9)]
    assert_close(torch.cat(parts, dim=1), ref, **TOL)


def test_delta_check_rejects_artifact_of_another_shape(tiny_family, tmp_path):
    other = tiny_llama(97)  # another vocabulary: embeddings and lm_head differ in shape
    other.save_pretrained(tmp_path / "other")
    ft = tiny_llama(97)
    ft.load_state_dict(perturb(other, seed=5))
    ft.save_pretrained(tmp_path / "other-ft")
    compress(tmp_path / "other", tmp_path / "other-ft", tmp_path / "art", variant="x")
    model = load_model(tiny_family.base_dir)
    with pytest.raises(ValueError, match=r"\.sign is torch.uint8 \(97, 8\), expected uint8 \(512, 8\)"):
        VariantDelta(load_artifact(tmp_path / "art")).check(model.hf_param_shapes())


def test_model_args_from_hf_config_and_presets():
    a = ModelArgs.from_hf_config({"model_type": "llama", "vocab_size": 10, "hidden_size": 64, "num_hidden_layers": 1,
                                  "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 8,
                                  "max_position_embeddings": 32, "rope_theta": 1e6, "rms_norm_eps": 1e-6})
    assert (a.head_dim, a.n_local_heads, a.rope_base, a.norm_eps, a.max_seq_len) == (16, 2, 1e6, 1e-6, 32)
    assert ModelArgs.from_name("llama-2-70b").n_local_heads == 8
    with pytest.raises(NotImplementedError, match="gpt2"):
        ModelArgs.from_hf_config({"model_type": "gpt2"})


def test_a_sharded_base_whose_index_is_malformed_or_names_a_missing_shard_is_a_checkpoint_error(tmp_path):
    """Found by a reviewer: the served base's index was read apart from the checkpoint reader, so an
    index without ``weight_map`` raised KeyError, one whose ``weight_map`` is no object AttributeError,
    and one naming a shard outside the folder read that file. They are CheckpointErrors naming the
    index or the shard, as the export's reader (``deltafleet.checkpoint.Checkpoint``) gives."""
    import json
    import shutil

    from deltafleet.checkpoint import CheckpointError

    hf = tiny_llama(97)
    hf.save_pretrained(tmp_path / "m", max_shard_size="100KB")
    index_path = tmp_path / "m" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    load_model(tmp_path / "m")  # as saved
    for edit, match in [
        (lambda i: i.pop("weight_map"), r"model\.safetensors\.index\.json: not a Hugging Face safetensors index "
                                        r"\(KeyError\('weight_map'\)\)"),
        (lambda i: i.update(weight_map=[]), r"model\.safetensors\.index\.json: not a Hugging Face safetensors index "
                                            r"\(AttributeError"),
        (lambda i: i["weight_map"].update({k: f"../other/{shards[-1]}" for k, v in i["weight_map"].items()
                                           if v == shards[-1]}),
         rf"shard '\.\./other/{shards[-1]}' listed in the index is missing"),
    ]:
        broken = json.loads(json.dumps(index))
        edit(broken)
        index_path.write_text(json.dumps(broken))
        (tmp_path / "other").mkdir(exist_ok=True)
        shutil.copyfile(tmp_path / "m" / shards[-1], tmp_path / "other" / shards[-1])
        with pytest.raises(CheckpointError, match=match):
            load_model(tmp_path / "m")
    index_path.write_text(json.dumps(index))
    (tmp_path / "m" / shards[-1]).unlink()
    with pytest.raises(CheckpointError, match=rf"shard '{shards[-1]}' listed in the index is missing"):
        load_model(tmp_path / "m")


def test_a_base_tensor_of_another_shape_than_its_config_is_a_value_error(tmp_path):
    """Found by a reviewer: a base whose tensor's shape differs from its config raised RuntimeError
    ("size mismatch") from load_state_dict, not the ValueError load_model documents."""
    from safetensors.torch import load_file, save_file

    hf = tiny_llama(97)
    hf.save_pretrained(tmp_path / "m")
    path = tmp_path / "m" / "model.safetensors"
    state = load_file(path)
    name = "model.layers.0.mlp.down_proj.weight"
    shape = tuple(state[name].shape)
    state[name] = state[name][:, :-8].contiguous()
    save_file(state, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"checkpoint does not match its config: shapes of layers\.0\.mlp\.down_proj"
                                         rf"\.weight \({shape[0]}, {shape[1] - 8}\) \(config: \({shape[0]}, {shape[1]}\)\)"):
        load_model(tmp_path / "m")
