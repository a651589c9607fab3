"""BitDelta export, artifact reader and `compress/run.py` on tiny real Llama checkpoints.

Each checkpoint is a `transformers.LlamaForCausalLM` saved with `save_pretrained`; the
"fine-tune" perturbs most 2-D weights, leaves one matrix untouched and shifts one RMSNorm, so the
artifact holds signs + alphas, one full 1-D tensor, and omissions. Expected values are computed
here independently from the safetensors files, not through `compress.bitdelta`.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import deltafleet.compress.bitdelta as bd
from deltafleet.compress import (
    Artifact,
    ArtifactError,
    FingerprintMismatchError,
    compress,
    fingerprint,
    load_artifact,
    materialize,
)

REPO = Path(__file__).resolve().parents[1]
UNCHANGED_MATRIX = "model.layers.1.self_attn.o_proj.weight"
CHANGED_NORM = "model.layers.0.input_layernorm.weight"


def _tiny_family(root: Path, dtype: torch.dtype = torch.float32, hidden: int = 32, seed: int = 0):
    """Save a tiny Llama base and a perturbed fine-tune under root/{base,ft}; return both dirs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM(cfg).to(dtype)
    model.save_pretrained(root / "base")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and name != UNCHANGED_MATRIX:
                p.add_(torch.randn_like(p) * 0.02)
        model.get_parameter(CHANGED_NORM).add_(0.125)
    model.save_pretrained(root / "ft")
    return root / "base", root / "ft"


@pytest.fixture(scope="session")
def family(tmp_path_factory):
    return _tiny_family(tmp_path_factory.mktemp("family"))


@pytest.fixture(scope="session")
def artifact_dir(family, tmp_path_factory):
    out = tmp_path_factory.mktemp("artifacts") / "coder"
    compress(*family, out, variant="coder")
    return out


def _copy_artifact(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _expected_state(base_dir: Path, ft_dir: Path, granularity: str, use_alphas: dict | None = None):
    """Independent BitDelta reconstruction: W_base + α·sign(Δ), sign(Δ) = +1 if Δ > 0 else −1.

    α is the exact mean |Δ| (float64, rounded to float32). ``use_alphas`` (e.g. an artifact's)
    replaces it in the reconstruction, for exact weight comparisons: the export sums |Δ| in
    float32 per row, which may differ from the exact mean in the last bit; the α themselves are
    compared with a relative tolerance.
    """
    base, ft = load_file(base_dir / "model.safetensors"), load_file(ft_dir / "model.safetensors")
    out, alphas = {}, {}
    for name, w_ft in ft.items():
        w = base[name]
        if w.dim() == 2:
            delta = w_ft.float() - w.float()
            # token-indexed matrices get one α per row under either granularity
            vocab = name in ("model.embed_tokens.weight", "lm_head.weight")
            # α is the float32 rounding of the exact mean |Δ| (summed in float64)
            if granularity == "matrix" and not vocab:
                alpha = (delta.double().abs().sum() / delta.numel()).float()
                a = alpha
            else:
                alpha = (delta.double().abs().sum(dim=1) / delta.shape[1]).float()
                a = alpha[:, None]
            if use_alphas is not None and name in use_alphas:
                a = use_alphas[name] if use_alphas[name].dim() == 0 else use_alphas[name][:, None]
            sign = torch.where(delta > 0, 1.0, -1.0)
            out[name] = (w.float() + a * sign).to(w.dtype) if delta.any() else w
            alphas[name] = alpha
        else:
            out[name] = w_ft
    return out, alphas


# --------------------------------------------------------------------------------------------
# export → load → materialize
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("granularity", ["matrix", "row"])
def test_round_trip_matches_independent_reconstruction(tmp_path, dtype, granularity):
    base_dir, ft_dir = _tiny_family(tmp_path, dtype)
    manifest = compress(base_dir, ft_dir, tmp_path / "art", variant="coder", granularity=granularity)
    art = load_artifact(tmp_path / "art", base_fingerprint=fingerprint(base_dir))
    assert isinstance(art, Artifact)
    assert art.variant == "coder" and art.granularity == granularity and art.manifest == manifest

    expected, alphas = _expected_state(base_dir, ft_dir, granularity, use_alphas=art.alphas)
    ft = load_file(ft_dir / "model.safetensors")
    # what is stored: every changed 2-D matrix as signs + alpha, the changed norm in full
    changed_2d = {n for n, t in ft.items() if t.dim() == 2 and n != UNCHANGED_MATRIX}
    assert set(art.signs) == set(art.alphas) == changed_2d
    assert UNCHANGED_MATRIX not in art.signs and UNCHANGED_MATRIX not in art.full
    assert set(art.full) == {CHANGED_NORM}  # other norms are unchanged → omitted
    assert art.full[CHANGED_NORM].dtype == dtype
    assert torch.equal(art.full[CHANGED_NORM], ft[CHANGED_NORM])
    for name in changed_2d:
        s, a = art.signs[name], art.alphas[name]
        assert s.dtype == torch.uint8 and s.shape == (ft[name].shape[0], (ft[name].shape[1] + 7) // 8)
        assert a.dtype == torch.float32
        per_row = granularity == "row" or name in ("model.embed_tokens.weight", "lm_head.weight")
        assert a.shape == ((ft[name].shape[0],) if per_row else ())
        torch.testing.assert_close(a, alphas[name], rtol=1e-6, atol=0)

    state = materialize(base_dir, art)
    assert state.keys() == ft.keys()
    for name, t in state.items():
        assert t.dtype == ft[name].dtype and t.shape == ft[name].shape, name
        torch.testing.assert_close(t, expected[name], rtol=1e-6, atol=1e-6, msg=name)

    stats = manifest["stats"]
    assert stats["parameters"] == sum(t.numel() for t in ft.values())
    assert stats["compressed_parameters"] == sum(ft[n].numel() for n in changed_2d)
    assert stats["full_parameters"] == ft[CHANGED_NORM].numel()
    assert stats["bytes"] == (tmp_path / "art" / "delta.safetensors").stat().st_size
    assert stats["bits_per_parameter"] == pytest.approx(8 * stats["bytes"] / stats["parameters"])


def test_materialized_model_is_closer_to_finetune_than_base(family, artifact_dir):
    base_dir, ft_dir = family
    base, ft = load_file(base_dir / "model.safetensors"), load_file(ft_dir / "model.safetensors")
    state = materialize(base_dir, load_artifact(artifact_dir))
    name = "model.layers.0.mlp.down_proj.weight"
    err_bitdelta = (state[name] - ft[name]).norm()
    err_base = (base[name] - ft[name]).norm()
    assert err_bitdelta < 0.7 * err_base  # sign + mean|Δ| keeps most of a Gaussian Δ


def test_bits_per_parameter_below_two(tmp_path):
    base_dir, ft_dir = _tiny_family(tmp_path, torch.bfloat16, hidden=64)
    stats = compress(base_dir, ft_dir, tmp_path / "art", variant="v")["stats"]
    assert stats["compressed_parameters"] > 0.9 * stats["parameters"]  # mostly 2-D (one matrix is unchanged)
    assert 1.0 < stats["bits_per_parameter"] < 2.0


def test_manifest_keys_exact(family, artifact_dir):
    manifest = json.loads((artifact_dir / "bitdelta.json").read_text())
    assert list(manifest) == [
        "format", "format_version", "variant", "base", "granularity", "files", "stats", "provenance"
    ]
    assert manifest["format"] == "bitdelta" and manifest["format_version"] == 1
    assert manifest["variant"] == "coder" and manifest["granularity"] == "matrix"
    assert manifest["base"] == {"name_or_path": str(family[0]), "fingerprint": fingerprint(family[0])}
    assert list(manifest["files"]) == ["delta.safetensors"]
    assert len(manifest["files"]["delta.safetensors"]) == 64
    assert set(manifest["stats"]) == {
        "parameters", "compressed_parameters", "full_parameters", "bytes", "bits_per_parameter"
    }
    prov = manifest["provenance"]
    assert set(prov) == {"run_id", "config", "created", "finetuned", "deltafleet_version"}
    assert prov["created"].endswith("+00:00")
    assert prov["finetuned"] == {"name_or_path": str(family[1]), "fingerprint": fingerprint(family[1])}
    assert sorted(os.listdir(artifact_dir)) == ["bitdelta.json", "delta.safetensors"]


def test_provenance_and_base_name_are_recorded(family, tmp_path):
    m = compress(
        *family, tmp_path / "a", variant="v", base_name_or_path="meta-llama/Llama-2-7b-hf",
        provenance={"run_id": "abc", "config": {"lr": 1e-3}, "wandb": "offline-run-1"},
    )
    assert m["base"]["name_or_path"] == "meta-llama/Llama-2-7b-hf"
    assert m["provenance"]["run_id"] == "abc"
    assert m["provenance"]["config"] == {"lr": 1e-3}
    assert m["provenance"]["wandb"] == "offline-run-1"


def test_edge_cases_resized_new_missing_and_zero_delta(tmp_path):
    (tmp_path / "b").mkdir(), (tmp_path / "f").mkdir()
    g = torch.Generator().manual_seed(0)
    base = {
        "model.embed_tokens.weight": torch.randn(10, 4, generator=g),
        "same.weight": torch.randn(3, 5, generator=g),
        "lin.weight": torch.randn(3, 9, generator=g),
        "bias": torch.randn(3, generator=g),
    }
    ft = dict(base)
    ft["model.embed_tokens.weight"] = torch.randn(12, 4, generator=g)  # resized embedding → full
    ft["new.weight"] = torch.randn(2, 2, generator=g)  # not in base → full
    ft["lin.weight"] = base["lin.weight"].clone()
    ft["lin.weight"][1, 2] += 0.5  # a single changed entry: Δ == 0 elsewhere packs to bit 0
    ft["bias"] = base["bias"].to(torch.float16)  # dtype changed → full, original dtype
    save_file(base, tmp_path / "b" / "model.safetensors")
    save_file(ft, tmp_path / "f" / "model.safetensors")
    m = compress(tmp_path / "b", tmp_path / "f", tmp_path / "art", variant="v")
    art = load_artifact(tmp_path / "art")
    assert set(art.signs) == {"lin.weight"}
    assert set(art.full) == {"model.embed_tokens.weight", "new.weight", "bias"}
    assert art.full["bias"].dtype == torch.float16
    assert art.signs["lin.weight"].tolist() == [[0, 0], [4, 0], [0, 0]]  # bit 2 of row 1
    assert art.alphas["lin.weight"].item() == pytest.approx(0.5 / 27)
    assert m["stats"]["compressed_parameters"] == 27 and m["stats"]["full_parameters"] == 48 + 4 + 3
    state = materialize(tmp_path / "b", art)
    assert state["model.embed_tokens.weight"].shape == (12, 4) and torch.equal(state["same.weight"], base["same.weight"])

    # a base parameter missing from the fine-tune is an error, and nothing is left behind
    del ft["same.weight"]
    save_file(ft, tmp_path / "f" / "model.safetensors")
    with pytest.raises(ArtifactError, match="same.weight"):
        compress(tmp_path / "b", tmp_path / "f", tmp_path / "art2", variant="v")
    assert not (tmp_path / "art2").exists()


def test_identical_checkpoints_give_an_empty_but_valid_artifact(family, tmp_path, caplog):
    """Valid (a variant may change nothing), with a warning (found by a fresh user: the base exported
    against itself gave a 40-byte artifact, "249971.2x smaller", without a word)."""
    with caplog.at_level("WARNING", logger="deltafleet.compress.bitdelta"):
        m = compress(family[0], family[0], tmp_path / "art", variant="same")
    assert [r.getMessage() for r in caplog.records] == [
        f"same: the fine-tune equals the base (every Δ is zero): the artifact serves the base itself "
        f"(is {family[0]} the fine-tune?)"]
    caplog.clear()
    compress(*family, tmp_path / "art2", variant="coder")
    assert not caplog.records
    art = load_artifact(tmp_path / "art")
    assert not art.signs and not art.full and art.nbytes == 0
    assert m["stats"]["compressed_parameters"] == m["stats"]["full_parameters"] == 0
    state = materialize(family[0], art)
    base = load_file(family[0] / "model.safetensors")
    assert all(torch.equal(state[n], base[n]) for n in base)


def test_bad_arguments(family, tmp_path):
    with pytest.raises(ValueError, match="granularity"):
        compress(*family, tmp_path / "a", variant="v", granularity="column")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        compress(tmp_path / "empty", family[1], tmp_path / "a", variant="v")
    for bad in (0, -5, "abc", 1.5):
        with pytest.raises(ValueError, match=rf"max_shard_bytes must be a positive integer \(bytes\) or None, got {bad!r}"):
            compress(*family, tmp_path / "a", variant="v", max_shard_bytes=bad)
    assert sorted(os.listdir(tmp_path)) == ["empty"]  # nothing written


def test_a_fine_tune_of_another_architecture_is_refused(family, tmp_path):
    """Found by a fresh user: a Qwen2 fine-tune over a Llama base, or one with a layer more, was
    exported with its extra tensors (q/k/v biases, a whole layer) stored in full; ``format=hf`` then
    wrote the base's config, and transformers dropped them on load. Refused, naming the key."""
    import json
    import shutil

    from transformers import Qwen2Config, Qwen2ForCausalLM

    base, ft = family
    qwen = Qwen2ForCausalLM(Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))
    qwen.save_pretrained(tmp_path / "qwen")
    with pytest.raises(ValueError, match=rf"^the checkpoints are of different architectures: model_type \"llama\" "
                                         rf"in {base}/config.json, \"qwen2\" in {tmp_path}/qwen/config.json$"):
        compress(base, tmp_path / "qwen", tmp_path / "a", variant="v")
    deeper = tmp_path / "deeper"
    shutil.copytree(ft, deeper)
    config = json.loads((deeper / "config.json").read_text())
    (deeper / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(ValueError, match=r"different architectures: num_hidden_layers 2 in .*, 3 in "):
        compress(base, deeper, tmp_path / "a", variant="v")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["deeper", "qwen"]  # nothing written


def test_a_fine_tunes_own_eos_and_chat_template_are_named_as_dropped(family, tmp_path):
    """Found by a fresh user: an instruct fine-tune's end-of-sequence ids and chat template were
    dropped without a word (the artifact is weights only; the server and format=hf use the base's)."""
    import json
    import shutil
    import warnings

    base, ft = family
    same = tmp_path / "same-ft"  # the same ids written as a list, and a null architectures: no warning, no refusal
    shutil.copytree(ft, same)
    gen = json.loads((same / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2
    (same / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [2]}))
    config = json.loads((same / "config.json").read_text())
    (same / "config.json").write_text(json.dumps({**config, "architectures": None}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compress(base, same, tmp_path / "same", variant="v")
    chat = tmp_path / "chat"
    shutil.copytree(ft, chat)
    (chat / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [2, 9]}))
    (chat / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    with pytest.warns(UserWarning, match=re.escape(f"{chat} has another eos_token_id [2, 9] against [2] and chat "
                                                   f"template than the base {base}; the artifact keeps the weights "
                                                   "only, and the server and format=hf use the base's")):
        compress(base, chat, tmp_path / "a", variant="v")


# --------------------------------------------------------------------------------------------
# fingerprint
# --------------------------------------------------------------------------------------------


def test_fingerprint_stable_and_sensitive(family, tmp_path):
    base_dir, ft_dir = family
    fp = fingerprint(base_dir)
    assert fp.startswith("sha256:") and len(fp) == len("sha256:") + 64
    assert fingerprint(base_dir) == fp == fingerprint(str(base_dir))
    assert fingerprint(ft_dir) != fp

    tensors = load_file(base_dir / "model.safetensors")

    def fp_of(ts: dict, name: str) -> str:
        (tmp_path / name).mkdir()
        save_file(ts, tmp_path / name / "model.safetensors")
        return fingerprint(tmp_path / name)

    assert fp_of(tensors, "copy") == fp  # same tensors, another file: same fingerprint
    w = "model.layers.1.mlp.up_proj.weight"
    assert fp_of({**tensors, w: tensors[w] * 1.001}, "content") != fp
    assert fp_of({**tensors, w: tensors[w].to(torch.float16).float()}, "rounded") != fp
    assert fp_of({**tensors, w: tensors[w].to(torch.bfloat16)}, "dtype") != fp
    assert fp_of({**tensors, w: tensors[w].reshape(32, -1)}, "shape") != fp
    renamed = {("x." + k if k == w else k): v for k, v in tensors.items()}
    assert fp_of(renamed, "name") != fp
    norm = dict(tensors)
    norm[CHANGED_NORM] = norm[CHANGED_NORM].clone()
    norm[CHANGED_NORM][17] += 1e-3
    assert fp_of(norm, "norm") != fp  # small 1-D tensors are hashed whole


def test_fingerprint_samples_rows_of_nd_and_chunks_of_long_1d(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"experts": torch.randn(4, 6, 8, generator=g), "long": torch.randn(100_000, generator=g)}

    def fp_with(name: str, edit) -> str:
        ts = {k: v.clone() for k, v in tensors.items()}
        edit(ts)
        (tmp_path / name).mkdir()
        save_file(ts, tmp_path / name / "model.safetensors")
        return fingerprint(tmp_path / name)

    fp = fp_with("orig", lambda ts: None)
    # 24 rows of 8: rows 0, 3, 7, 10, 13, 16, 20, 23 are sampled (23 = experts[3, 5])
    assert fp_with("last_row", lambda ts: ts["experts"][3, 5].add_(1)) != fp
    assert fp_with("row_7", lambda ts: ts["experts"][1, 1, 4].add_(1)) != fp
    assert fp_with("row_1", lambda ts: ts["experts"][0, 1].add_(1)) == fp  # a sample, by design
    assert fp_with("long_head", lambda ts: ts["long"][0].add_(1)) != fp
    assert fp_with("long_tail", lambda ts: ts["long"][-1].add_(1)) != fp


def test_fingerprint_ignores_sharding(family, tmp_path):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(family[0])
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert fingerprint(tmp_path / "sharded") == fingerprint(family[0])


# --------------------------------------------------------------------------------------------
# loading: fingerprint, integrity, format
# --------------------------------------------------------------------------------------------


def test_wrong_base_fingerprint(family, artifact_dir):
    other = "sha256:" + "0" * 64
    with pytest.raises(FingerprintMismatchError) as e:
        load_artifact(artifact_dir, base_fingerprint=other)
    assert other in str(e.value) and fingerprint(family[0]) in str(e.value)
    assert isinstance(e.value, ArtifactError)
    art = load_artifact(artifact_dir, base_fingerprint=other, force=True)
    assert art.signs and art.nbytes > 0


def test_tampered_file_is_rejected(artifact_dir, tmp_path):
    art = _copy_artifact(artifact_dir, tmp_path / "art")
    data = bytearray((art / "delta.safetensors").read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit in the packed signs
    (art / "delta.safetensors").write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=r"delta\.safetensors does not match its sha256"):
        load_artifact(art)
    load_artifact(art, verify_hashes=False)  # the caller's explicit choice
    (art / "delta.safetensors").unlink()
    with pytest.raises(ArtifactError, match=r"delta\.safetensors .*missing"):
        load_artifact(art)


@pytest.mark.parametrize(
    "edit, match",
    [
        ({"format_version": 3}, r"format_version 3 is not supported \(this reader reads versions 1, 2\)"),
        ({"granularity": "rowcol"}, "granularity 'rowcol' needs format_version 2, the manifest says 1"),
        ({"format_version": "1"}, "format_version '1' is not supported"),
        ({"format": "lora"}, "format is 'lora'"),
        ({"granularity": "column"}, "granularity 'column'"),
        ({"files": {"../model.safetensors": "00"}}, "plain file name"),
        # found by a reviewer: loaded, and the variant's name was then a number or None
        ({"variant": 5}, "variant must be a non-empty string, got 5"),
        ({"variant": None}, "variant must be a non-empty string, got None"),
    ],
)
def test_bad_manifest_is_rejected(artifact_dir, tmp_path, edit, match):
    art = _copy_artifact(artifact_dir, tmp_path / "art")
    manifest = json.loads((art / "bitdelta.json").read_text())
    (art / "bitdelta.json").write_text(json.dumps({**manifest, **edit}))
    with pytest.raises(ArtifactError, match=match):
        load_artifact(art)


def test_a_file_linked_from_outside_the_artifact_folder_is_refused_by_name(artifact_dir, tmp_path):
    """Found by a reviewer: a listed file (or the manifest) that is a symbolic link to a file outside the
    artifact folder was followed, its hash checked and its tensors served. It is refused, by name, also
    where the hashes and the values are not read (the server's check at start); a link within the
    folder, and a folder that is itself a link, still load."""
    art = _copy_artifact(artifact_dir, tmp_path / "art")
    outside = tmp_path / "elsewhere.safetensors"
    (art / "delta.safetensors").rename(outside)
    (art / "delta.safetensors").symlink_to(outside)
    for kwargs in ({}, {"values": False}, {"verify_hashes": False}):
        with pytest.raises(ArtifactError, match=r"art: file delta\.safetensors is a symbolic link leading outside "
                                                r"the artifact folder"):
            load_artifact(art, **kwargs)
    (art / "delta.safetensors").unlink()
    (art / ".blob").write_bytes(outside.read_bytes())
    (art / "delta.safetensors").symlink_to(".blob")
    assert load_artifact(art).signs.keys() == load_artifact(artifact_dir).signs.keys()
    (tmp_path / "link").symlink_to(art, target_is_directory=True)
    assert load_artifact(tmp_path / "link").variant == "coder"
    (tmp_path / "manifest.json").write_bytes((art / "bitdelta.json").read_bytes())
    (art / "bitdelta.json").unlink()
    (art / "bitdelta.json").symlink_to(tmp_path / "manifest.json")
    with pytest.raises(ArtifactError, match=r"art: file bitdelta\.json is a symbolic link leading outside"):
        load_artifact(art)


def test_missing_or_garbled_manifest(tmp_path):
    with pytest.raises(ArtifactError, match="no bitdelta.json"):
        load_artifact(tmp_path)
    (tmp_path / "bitdelta.json").write_text("{not json")
    with pytest.raises(ArtifactError, match="cannot parse"):
        load_artifact(tmp_path)


def _unblocked(fn, seconds: float = 10):
    """What ``fn()`` raised (None if nothing), failing the test where it blocks (a read of a named pipe)."""
    raised: list = []

    def run():
        try:
            fn()
            raised.append(None)
        except BaseException as e:  # noqa: BLE001 (SystemExit too: the caller asserts which)
            raised.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert raised, f"{fn} blocked"
    return raised[0]


def test_every_reader_of_a_manifest_names_one_that_is_no_regular_file_or_no_json(family, tmp_path):
    """Found by a reviewer: the export's check of its out_dir (``not_artifact``), ``export_hf``,
    distillation's source, eval's ``existing`` and the training summary opened ``bitdelta.json`` as it
    was: a named pipe there blocked them for ever, a directory or bytes that are no JSON gave an error
    naming neither the file nor the problem (or "no bitdelta.json"). All read it through
    ``manifest_json``, which names what it is; the summary counts such an artifact gone."""
    from omegaconf import OmegaConf

    from deltafleet.compress.distill import _source_artifact
    from deltafleet.train.eval import existing_artifacts
    from deltafleet.train.summary import _artifact_now

    base_dir, ft_dir = family
    pipe, folder, garbled = tmp_path / "pipe", tmp_path / "folder", tmp_path / "garbled"
    for d in (pipe, folder, garbled):
        d.mkdir()
    os.mkfifo(pipe / "bitdelta.json")
    (folder / "bitdelta.json").mkdir()
    (garbled / "bitdelta.json").write_bytes(b"\xff{")
    try:
        for art, what in ((pipe, "the manifest is a named pipe, not a regular file"),
                          (folder, "the manifest is a directory, not a regular file"),
                          (garbled, "cannot parse the manifest (")):
            named = f"{art / 'bitdelta.json'}: {what}"
            for fn in (lambda: load_artifact(art), lambda: bd.export_hf(base_dir, art, tmp_path / "hf"),
                       lambda: _source_artifact(OmegaConf.create({"artifact_dir": str(art), "granularity": None,
                                                                  "variant": {"name": "coder"}}), tmp_path)):
                e = _unblocked(fn)
                assert type(e) is ArtifactError and str(e).startswith(named), (fn, e)
            e = _unblocked(lambda: compress(base_dir, ft_dir, art, variant="coder"))  # not_artifact(out_dir)
            assert type(e) is ValueError and f"not an earlier export's output ({named}" in str(e), e
            e = _unblocked(lambda: existing_artifacts(OmegaConf.create({"existing": {"mine": str(art)}}), "coder"))
            assert type(e) is ValueError and str(e).startswith(f"existing.mine: {named}"), e
            gone: list = []
            assert _unblocked(lambda: gone.append(_artifact_now({"export/out_dir": str(art), "run_id": "r"}))) is None
            assert gone == [{"artifact": "gone"}]
        assert bd.manifest_json(tmp_path / "nowhere") is None
    finally:
        with contextlib.suppress(OSError):  # a reader still blocked in open() gets end of file
            os.close(os.open(pipe / "bitdelta.json", os.O_WRONLY | os.O_NONBLOCK))


def _rewrite_delta(art: Path, edit) -> None:
    """Apply edit(tensors) to delta.safetensors and re-sign it in the manifest."""
    tensors = load_file(art / "delta.safetensors")
    edit(tensors)
    save_file(tensors, art / "delta.safetensors")
    manifest = json.loads((art / "bitdelta.json").read_text())
    manifest["files"]["delta.safetensors"] = bd._sha256_file(art / "delta.safetensors")
    (art / "bitdelta.json").write_text(json.dumps(manifest))


W = "model.layers.0.mlp.gate_proj.weight"


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda t: t.pop(W + ".alpha"), r"gate_proj.weight.sign has no matching .*\.alpha"),
        (lambda t: t.update({W + ".alpha": torch.ones(64)}), r"alpha must be float32 \[\]"),
        (lambda t: t.update({W + ".alpha": torch.tensor(0.1, dtype=torch.float64)}), "float32"),
        (lambda t: t.update({W + ".alpha": torch.tensor(float("nan"))}), "non-finite"),
        (lambda t: t.update({W + ".sign": t[W + ".sign"].to(torch.int16)}), "must be uint8"),
    ],
)
def test_malformed_tensors_are_rejected(artifact_dir, tmp_path, edit, match):
    art = _copy_artifact(artifact_dir, tmp_path / "art")
    _rewrite_delta(art, edit)
    with pytest.raises(ArtifactError, match=match):
        load_artifact(art)


def test_a_headers_only_load_checks_the_structure_without_reading_the_tensors(artifact_dir, tmp_path):
    """``values=False`` (the server's check of every artifact at start): meta tensors of the dtypes and
    shapes a full load gives, the structural checks kept, the hashes and the scales' values not read."""
    full, meta = load_artifact(artifact_dir), load_artifact(artifact_dir, values=False)
    for kind in ("signs", "alphas", "betas", "full"):
        a, b = getattr(full, kind), getattr(meta, kind)
        assert {k: (v.dtype, v.shape) for k, v in a.items()} == {k: (v.dtype, v.shape) for k, v in b.items()}
        assert all(v.is_meta for v in b.values())
    art = _copy_artifact(artifact_dir, tmp_path / "art")
    data = bytearray((art / "delta.safetensors").read_bytes())
    data[-1] ^= 0x01  # a bit of the last tensor's data: the file no longer matches its sha256
    (art / "delta.safetensors").write_bytes(bytes(data))
    load_artifact(art, values=False)  # the data is not read: found by the full load
    _rewrite_delta(art, lambda t: t.update({W + ".alpha": torch.tensor(float("nan"))}))
    load_artifact(art, values=False)
    _rewrite_delta(art, lambda t: t.update({W + ".sign": t[W + ".sign"].to(torch.int16)}))
    with pytest.raises(ArtifactError, match="must be uint8"):
        load_artifact(art, values=False)


def test_truncated_artifact_file_is_rejected(artifact_dir, tmp_path):
    """Cut short: refused by its sha256, and — hashes re-signed or skipped — by the reader."""
    art = _copy_artifact(artifact_dir, tmp_path / "art")
    data = (art / "delta.safetensors").read_bytes()
    (art / "delta.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(ArtifactError, match=r"delta\.safetensors does not match its sha256"):
        load_artifact(art)
    manifest = json.loads((art / "bitdelta.json").read_text())
    manifest["files"]["delta.safetensors"] = bd._sha256_file(art / "delta.safetensors")
    (art / "bitdelta.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=r"cannot read delta\.safetensors as safetensors"):
        load_artifact(art)


def test_truncated_checkpoint_is_refused_by_export(family, tmp_path):
    base_dir, ft_dir = family
    ft = tmp_path / "ft"
    ft.mkdir()
    for f in ft_dir.iterdir():
        (ft / f.name).write_bytes(f.read_bytes())
    data = (ft / "model.safetensors").read_bytes()
    (ft / "model.safetensors").write_bytes(data[:-64])
    with pytest.raises(bd.CheckpointError, match=r"model\.safetensors: tensor .* truncated or corrupt"):
        compress(base_dir, ft, tmp_path / "art", variant="coder")
    assert not (tmp_path / "art").exists()


def test_sign_that_does_not_fit_the_base(family, artifact_dir, tmp_path):
    art_dir = _copy_artifact(artifact_dir, tmp_path / "art")
    _rewrite_delta(art_dir, lambda t: t.update({W + ".sign": t[W + ".sign"][:, :-1].contiguous()}))
    art = load_artifact(art_dir)
    with pytest.raises(ArtifactError, match=r"gate_proj.weight.sign .* do not fit base weight \[64, 32\]"):
        materialize(family[0], art)


def _reshard(art: Path, stowaway: dict | None = None, edit_index=None) -> dict:
    """Cut ``art``'s one delta file into two shards (alternate tensors) with an index and a manifest
    that lists them, ``stowaway`` tensors added to the second shard only, ``edit_index(index)`` applied
    to the index before it is written and signed; returns the manifest."""
    tensors = load_file(art / "delta.safetensors")
    names = sorted(tensors)
    shards = {"delta-00001-of-00002.safetensors": names[::2], "delta-00002-of-00002.safetensors": names[1::2]}
    for file, ns in shards.items():
        extra = (stowaway or {}) if file.startswith("delta-00002") else {}
        save_file({**{n: tensors[n] for n in ns}, **extra}, art / file, metadata={"format": "pt"})
    index = {"metadata": {"total_size": 0}, "weight_map": {n: f for f, ns in shards.items() for n in ns}}
    if edit_index is not None:
        edit_index(index)
    (art / "delta.safetensors.index.json").write_text(json.dumps(index))
    (art / "delta.safetensors").unlink()
    manifest = json.loads((art / "bitdelta.json").read_text())
    manifest["files"] = {f: bd._sha256_file(art / f) for f in [*shards, "delta.safetensors.index.json"]}
    (art / "bitdelta.json").write_text(json.dumps(manifest))
    return manifest


def test_reads_sharded_artifact(family, artifact_dir, tmp_path):
    art = _copy_artifact(artifact_dir, tmp_path / "art")
    manifest = _reshard(art)

    sharded, single = load_artifact(art), load_artifact(artifact_dir)
    for field in ("signs", "alphas", "full"):
        a, b = getattr(sharded, field), getattr(single, field)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    del manifest["files"]["delta-00002-of-00002.safetensors"]
    (art / "bitdelta.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="delta-00002-of-00002.safetensors"):
        load_artifact(art)


# --------------------------------------------------------------------------------------------
# atomic writes
# --------------------------------------------------------------------------------------------


def _leftovers(parent: Path) -> list[str]:
    return sorted(p for p in os.listdir(parent) if p.startswith("."))


def test_failed_export_leaves_nothing(family, tmp_path, monkeypatch):
    real_pack, calls = bd.pack_signs, []

    def failing_pack(delta):  # the third matrix fails mid-export
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("disk on fire")
        return real_pack(delta)

    monkeypatch.setattr(bd, "pack_signs", failing_pack)
    with pytest.raises(RuntimeError, match="disk on fire"):
        compress(*family, tmp_path / "art", variant="v")
    assert len(calls) == 3
    assert os.listdir(tmp_path) == []  # neither the artifact nor its temporary folder


def test_failure_after_files_are_written_keeps_the_old_artifact(family, tmp_path, monkeypatch):
    out = tmp_path / "art"
    compress(*family, out, variant="v", provenance={"run_id": "first"})
    before = {f: (out / f).read_bytes() for f in os.listdir(out)}

    def exploding_dump(*args, **kwargs):  # the manifest write fails after delta.safetensors exists
        raise OSError("no space left on device")

    monkeypatch.setattr(bd.json, "dump", exploding_dump)
    with pytest.raises(OSError, match="no space"):
        compress(*family, out, variant="v", provenance={"run_id": "second"})
    assert {f: (out / f).read_bytes() for f in os.listdir(out)} == before
    assert _leftovers(tmp_path) == []


def test_reexport_replaces_existing_artifact(family, tmp_path):
    """An earlier export is replaced whole, its shards too; a file it did not write needs overwrite."""
    out = tmp_path / "art"
    compress(*family, out, variant="v", granularity="matrix", provenance={"run_id": "first"}, max_shard_bytes=4096)
    assert len(os.listdir(out)) > 3  # shards and their index
    (out / "stale.txt").write_text("not an export's")
    with pytest.raises(ValueError, match=r"\(files the export did not write: stale.txt\)"):
        compress(*family, out, variant="v", granularity="row")
    m = compress(*family, out, variant="v", granularity="row", provenance={"run_id": "second"}, overwrite=True)
    assert sorted(os.listdir(out)) == ["bitdelta.json", "delta.safetensors"]
    assert json.loads((out / "bitdelta.json").read_text()) == m
    art = load_artifact(out)
    assert art.granularity == "row" and art.manifest["provenance"]["run_id"] == "second"
    assert _leftovers(tmp_path) == []


# --------------------------------------------------------------------------------------------
# compress/run.py + conf/export.yaml
# --------------------------------------------------------------------------------------------


def test_export_config_composes():
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("export", overrides=["variant=coder", "paths.root=/r"])
    assert cfg.variant.name == "coder" and cfg.granularity == "matrix"
    assert cfg.base_dir == "/r/models/base"
    assert cfg.finetuned_dir == "/r/models/coder"
    assert cfg.out_dir == "/r/artifacts/coder"


def test_run_py_end_to_end(family, tmp_path):
    models = tmp_path / "models"
    for src, name in zip(family, ("base", "coder")):
        _copy_artifact(src, models / name)  # plain folder copy
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # run.py must find the repo itself
    proc = subprocess.run(
        [sys.executable, "compress/run.py", "variant=coder", f"paths.root={tmp_path}", "granularity=row"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    summary = [line for line in proc.stdout.splitlines() if line.startswith("coder:")]
    assert len(summary) == 1 and "bits/param" in summary[0] and "bf16" in summary[0]
    art = load_artifact(tmp_path / "artifacts" / "coder", base_fingerprint=fingerprint(models / "base"))
    assert art.variant == "coder" and art.granularity == "row"
    prov = art.manifest["provenance"]
    assert prov["run_id"].startswith("export/coder/")
    assert prov["config"]["finetuned_dir"] == str(models / "coder")
    assert (tmp_path / "outputs" / "export" / "coder").is_dir()
    stats = art.manifest["stats"]
    assert f"{stats['parameters']:,} params" in summary[0]


@pytest.mark.parametrize(
    "override, message",
    [
        ("granularity=column", "export: ValueError: granularity must be one of ('matrix', 'row', 'rowcol'), got 'column'"),
        ("max_shard_bytes=-5", "export: ValueError: max_shard_bytes must be a positive integer (bytes) or None, got -5"),
        ("variant=writer", "export: FileNotFoundError: "),
        ("variant=writer format=bogus", "export: ValueError: format must be 'bitdelta' or 'hf', got 'bogus'"),  # before the inputs
        ("variant.name=../escape", "export: ValueError: variant must be a name of 1 to 64 letters"),
        # found by a fresh user: Hydra keeps "no" as text, which bool() took for true: the out_dir was
        # replaced, and format=hf built a checkpoint against another base
        ("overwrite=no", "export: ValueError: overwrite must be true or false, got 'no'"),
        ("format=hf force=no", "export: ValueError: force must be true or false, got 'no'"),
        ("format=hf max_shard_bytes=0", "export: ValueError: max_shard_bytes must be a positive integer (bytes) or "
                                        "None, got 0"),
    ],
)
def test_run_py_reports_user_errors_in_one_line(family, tmp_path, override, message):
    models = tmp_path / "models"
    for src, name in zip(family, ("base", "coder")):
        _copy_artifact(src, models / name)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "compress/run.py", "variant=coder", f"paths.root={tmp_path}", *override.split()],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(message), proc.stderr
    assert not (tmp_path / "artifacts").exists() or not any((tmp_path / "artifacts").iterdir())


def test_a_fine_tune_holding_nan_is_refused_and_names_the_matrix(tmp_path):
    """Found by a fresh user: a fine-tune with one NaN weight exported, with α NaN for that matrix, an
    artifact the loader (and the server) then refused. The export fails at once, naming the matrix
    and the row, and writes nothing."""
    from safetensors.torch import load_file, save_file

    base_dir, ft_dir = _tiny_family(tmp_path)
    (shard,) = ft_dir.glob("*.safetensors")
    state = load_file(shard)
    name = "model.layers.1.mlp.up_proj.weight"
    state[name][5, 3] = float("nan")
    save_file(state, shard, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=re.escape(f"{name}: the fine-tune or the base holds NaN or inf (row 5 of Δ")):
        compress(base_dir, ft_dir, tmp_path / "art", variant="coder")
    assert not (tmp_path / "art").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    # found by another: a NaN in a norm, a tensor stored in full, was exported (and loaded) as it was
    state[name][5, 3] = 1.0
    norm = "model.layers.1.input_layernorm.weight"
    state[norm][0] = float("nan")
    save_file(state, shard, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=re.escape(f"{norm}: the fine-tune holds NaN or inf in this tensor, which "
                                                   "would be stored in full: nothing was exported")):
        compress(base_dir, ft_dir, tmp_path / "art", variant="coder")
    assert not (tmp_path / "art").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_missing_checkpoints_get_a_command_that_builds_them(family, tmp_path):
    """Found by a fresh user: ``variant=coder variant.name=mine`` without models/mine was told to run
    ``make train VARIANT=mine``, which fails (no conf/variant/mine.yaml), and a base_dir pointing
    elsewhere was told to run ``make base``, which builds models/base, not it."""
    models = tmp_path / "models"
    for src, name in zip(family, ("base", "coder")):
        _copy_artifact(src, models / name)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def export(*args: str) -> str:
        proc = subprocess.run([sys.executable, "compress/run.py", "variant=coder", f"paths.root={tmp_path}", *args],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        return proc.stderr.strip().splitlines()[-1]

    assert export("variant.name=mine") == (
        f"export: FileNotFoundError: no fine-tuned checkpoint at {models / 'mine'}: train it first "
        "(`python train/run.py variant=coder variant.name=mine`)")
    assert export("variant=writer") == (  # a config of its own: the family's command
        f"export: FileNotFoundError: no fine-tuned checkpoint at {models / 'writer'}: train it first "
        "(`make train VARIANT=writer`)")
    assert export(f"base_dir={tmp_path / 'elsewhere'}") == (
        f"export: FileNotFoundError: no base model at {tmp_path / 'elsewhere'} (no config.json): base_dir must be "
        f"a Hugging Face checkpoint folder (`make base` builds the family's own in {models / 'base'})")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_export_hf_is_base_plus_alpha_sign_and_refuses_another_base(tmp_path, dtype):
    from transformers import AutoModelForCausalLM

    base_dir, ft_dir = _tiny_family(tmp_path, dtype)
    compress(base_dir, ft_dir, tmp_path / "art", variant="coder")
    out = bd.export_hf(base_dir, tmp_path / "art", tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(out, dtype=dtype)
    art = load_artifact(tmp_path / "art")
    expected, alphas = _expected_state(base_dir, ft_dir, "matrix", use_alphas=art.alphas)
    for name, a in art.alphas.items():
        torch.testing.assert_close(a, alphas[name], rtol=1e-6, atol=0)
    got = model.state_dict()
    for name, t in expected.items():
        assert got[name].dtype == dtype
        torch.testing.assert_close(got[name].float(), t.float(), rtol=0, atol=0)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    # against a different base: refused, nothing written
    other, _ = _tiny_family(tmp_path / "o", dtype, seed=1)
    with pytest.raises(FingerprintMismatchError):
        bd.export_hf(other, tmp_path / "art", tmp_path / "hf2")
    assert not (tmp_path / "hf2").exists()


def test_sharded_export_matches_the_single_file_one(tmp_path):
    base_dir, ft_dir = _tiny_family(tmp_path)
    single = compress(base_dir, ft_dir, tmp_path / "one", variant="coder")
    sharded = compress(base_dir, ft_dir, tmp_path / "many", variant="coder", max_shard_bytes=4096)
    names = sorted(sharded["files"])
    n = len(names) - 1
    assert n > 1 and names[-1] == "delta.safetensors.index.json"
    assert names[:-1] == [f"delta-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((tmp_path / "many/delta.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(names[:-1])
    assert index["metadata"]["total_size"] == sum((tmp_path / "many" / f).stat().st_size for f in names[:-1])
    for shard in names[:-1]:  # no shard over the limit unless one tensor alone is larger
        t = load_file(tmp_path / "many" / shard)
        assert len(t) == 1 or sum(x.numel() * x.element_size() for x in t.values()) <= 4096
    assert sharded["stats"]["bytes"] == sum((tmp_path / "many" / f).stat().st_size for f in sharded["files"])
    a, b = load_artifact(tmp_path / "one"), load_artifact(tmp_path / "many")
    assert a.signs.keys() == b.signs.keys() and a.full.keys() == b.full.keys()
    for k in a.signs:
        assert torch.equal(a.signs[k], b.signs[k]) and torch.equal(a.alphas[k], b.alphas[k])
    from_sharded = materialize(base_dir, b)
    for k, t in materialize(base_dir, a).items():
        assert torch.equal(t, from_sharded[k])
    assert single["stats"]["parameters"] == sharded["stats"]["parameters"]


@pytest.fixture(scope="session")
def rowcol_dir(family, tmp_path_factory):
    out = tmp_path_factory.mktemp("artifacts") / "coder-rowcol"
    compress(*family, out, variant="coder", granularity="rowcol")
    return out


def test_rowcol_export_is_format_2_with_row_alpha_and_unit_beta(family, rowcol_dir):
    """Granularity rowcol (format version 2): float16 α per row = mean_j |Δ_rj| (rounded), float16 β
    per column = 1 (scale distillation fits it); a β written afterwards reaches the materialised weight
    as α_r·β_c; the bits count the β."""
    base_dir, ft_dir = family
    art = load_artifact(rowcol_dir)
    assert art.manifest["format_version"] == 2 and art.granularity == "rowcol"
    base, ft = load_file(base_dir / "model.safetensors"), load_file(ft_dir / "model.safetensors")
    assert art.signs.keys() == art.alphas.keys() == art.betas.keys() and W in art.signs
    for name, a in art.alphas.items():
        d = ft[name].float() - base[name].float()
        assert a.dtype == torch.float16 and art.betas[name].dtype == torch.float16
        torch.testing.assert_close(a, d.abs().mean(1).half(), rtol=0, atol=0)
        assert art.betas[name].shape == (d.shape[1],) and bool((art.betas[name] == 1).all())
    row = compress(*family, rowcol_dir.parent / "coder-row", variant="coder", granularity="row")
    extra = sum(2 * b.numel() - 2 * a.numel() for a, b in zip(art.alphas.values(), art.betas.values()))
    assert art.manifest["stats"]["bytes"] - row["stats"]["bytes"] == pytest.approx(extra, abs=4096)  # headers
    # a β ≠ 1 (as distillation writes it) is applied column by column
    beta = torch.linspace(0.5, 2.0, art.betas[W].numel()).half()
    art.betas[W] = beta
    w = bd.materialize(base_dir, art)[W]
    sign = torch.where(ft[W].float() - base[W].float() > 0, 1.0, -1.0)
    want = base[W].float() + art.alphas[W].float()[:, None] * beta.float()[None, :] * sign
    torch.testing.assert_close(w.float(), want.to(w.dtype).float(), rtol=0, atol=0)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda t: t.pop(W + ".beta"), r"gate_proj.weight.sign has no matching .*\.beta \(granularity rowcol\)"),
        (lambda t: t.update({W + ".beta": t[W + ".beta"].float()}), r"beta must be float16 \[d_in\]"),
        (lambda t: t.update({W + ".beta": t[W + ".beta"][:-8]}), r"beta must be float16 \[d_in\]"),
        (lambda t: t.update({W + ".beta": -t[W + ".beta"]}), r"beta has negative or non-finite values"),
        (lambda t: t.update({W + ".alpha": t[W + ".alpha"].float()}), r"alpha must be float16 \[64\]"),
    ],
)
def test_malformed_rowcol_tensors_are_rejected(rowcol_dir, tmp_path, edit, match):
    art = _copy_artifact(rowcol_dir, tmp_path / "art")
    _rewrite_delta(art, edit)
    with pytest.raises(ArtifactError, match=match):
        load_artifact(art)


def test_beta_in_a_row_artifact_is_rejected(family, tmp_path):
    art = tmp_path / "art"
    compress(*family, art, variant="coder", granularity="row")
    _rewrite_delta(art, lambda t: t.update({W + ".beta": torch.ones(32, dtype=torch.float16)}))
    with pytest.raises(ArtifactError, match=r"gate_proj.weight.beta is only valid with granularity 'rowcol'"):
        load_artifact(art)


def test_export_never_replaces_an_input_or_a_folder_it_did_not_write(family, tmp_path):
    """An ``out_dir`` that is an input, or that holds something other than an earlier artifact, is
    refused before any work and left as it was; an earlier artifact is replaced; ``overwrite`` replaces
    anything."""
    base_dir, ft_dir = family
    with pytest.raises(ValueError, match=r"out_dir .* overlaps the input .*: the export would replace"):
        compress(base_dir, ft_dir, base_dir, variant="coder")
    assert (base_dir / "config.json").is_file()
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "NOTES.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"holds files that are not an earlier export's output \(no readable "
                                         r"bitdelta.json; it holds NOTES.txt\)"):
        compress(base_dir, ft_dir, victim, variant="coder")
    assert [p.name for p in victim.iterdir()] == ["NOTES.txt"]
    art = tmp_path / "art"
    compress(base_dir, ft_dir, art, variant="coder")
    compress(base_dir, ft_dir, art, variant="coder", granularity="row")  # an earlier artifact: replaced
    assert load_artifact(art).manifest["granularity"] == "row"
    # found by a fresh user: a file of theirs beside an earlier artifact went with it
    (art / "mynotes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"holds files that are not an earlier export's output \(files the export "
                                         r"did not write: mynotes.txt\)"):
        compress(base_dir, ft_dir, art, variant="coder")
    assert (art / "mynotes.txt").read_text() == "mine" and load_artifact(art).manifest["granularity"] == "row"
    compress(base_dir, ft_dir, victim, variant="coder", overwrite=True)
    assert sorted(p.name for p in victim.iterdir()) == ["bitdelta.json", "delta.safetensors"]
    # found by a fresh user: another variant's artifact was replaced as "an earlier export", and the
    # refusal of a folder of artifacts (artifacts/ itself) did not say what it holds
    with pytest.raises(ValueError, match=r"\(it is the artifact of variant 'coder', not of 'math'\)"):
        compress(base_dir, ft_dir, art, variant="math")
    assert load_artifact(art).manifest["variant"] == "coder"
    shelf = tmp_path / "shelf"
    compress(base_dir, ft_dir, shelf / "coder", variant="coder")
    compress(base_dir, ft_dir, shelf / "math", variant="math")
    with pytest.raises(ValueError, match=r"\(no readable bitdelta.json; it holds coder/, math/\): the export replaces "
                                         r"the whole folder, which would delete them"):
        compress(base_dir, ft_dir, shelf, variant="coder")
    assert sorted(p.name for p in shelf.iterdir()) == ["coder", "math"]


def test_export_hf_refuses_a_weight_beyond_a_float16_bases_range(tmp_path):
    """Found by a reviewer: with a float16 base, ``W_base + α·sign`` past 65504 (a float32 α of 1e5),
    or a float32 tensor stored in full past it (a norm of 1e6), was cast to float16 and written as
    inf. Both are refused, naming the tensor and the range, and nothing is written; a weight inside
    the range (α 6e4) is written as it is."""
    from safetensors.torch import load_file, save_file

    base_dir, ft_dir = _tiny_family(tmp_path, dtype=torch.float16)
    (shard,) = ft_dir.glob("*.safetensors")
    state = {k: v.float() for k, v in load_file(shard).items()}
    state[CHANGED_NORM][0] = 1e6
    save_file(state, shard, metadata={"format": "pt"})
    art = tmp_path / "art"
    compress(base_dir, ft_dir, art, variant="coder")
    assert load_artifact(art).full[CHANGED_NORM].dtype == torch.float32  # the fine-tune's own, exact
    with pytest.raises(ArtifactError, match=re.escape(f"{art}: {CHANGED_NORM} (stored in full) holds 1e+06, beyond "
                                                      "what float16 (the base's dtype for it) holds (65504 at most)")):
        bd.export_hf(base_dir, art, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    _rewrite_delta(art, lambda t: t.update({CHANGED_NORM: torch.ones(32), W + ".alpha": torch.tensor(1e5)}))
    with pytest.raises(ArtifactError, match=re.escape(f"{art}: {W} (W_base + α·sign) holds 1e+05, beyond what "
                                                      "float16 (the base's dtype) holds (65504 at most)")):
        materialize(base_dir, load_artifact(art))
    with pytest.raises(ArtifactError, match=re.escape(f"{W} (W_base + α·sign) holds 1e+05")):
        bd.export_hf(base_dir, art, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    _rewrite_delta(art, lambda t: t.update({W + ".alpha": torch.tensor(6e4)}))
    exported = load_file(bd.export_hf(base_dir, art, tmp_path / "hf") / "model.safetensors")
    assert exported[W].dtype == torch.float16 and exported[W].abs().min() >= 59_968  # float16's steps of 32 there
    assert exported[W].abs().max() <= 60_032 and bool(torch.isfinite(exported[W]).all())


def test_export_hf_never_replaces_a_fine_tune(family, artifact_dir, tmp_path):
    """``format=hf`` writes ``bitdelta-export.json`` listing its files; a checkpoint folder without it (a
    fine-tune) is refused, an earlier export is replaced."""
    base_dir, ft_dir = family
    before = sorted(p.name for p in ft_dir.iterdir())
    with pytest.raises(ValueError, match=r"hf_out_dir .*\(no bitdelta-export.json of an export\)"):
        bd.export_hf(base_dir, artifact_dir, ft_dir)
    assert sorted(p.name for p in ft_dir.iterdir()) == before
    with pytest.raises(ValueError, match="hf_out_dir .* overlaps the input"):
        bd.export_hf(base_dir, artifact_dir, artifact_dir)
    out = bd.export_hf(base_dir, artifact_dir, tmp_path / "hf")
    record = json.loads((out / bd.HF_EXPORT_RECORD).read_text())
    assert record["files"] == sorted(p.name for p in out.iterdir())
    bd.export_hf(base_dir, artifact_dir, out)  # its own earlier output: replaced
    # found by a fresh user: another variant's materialised checkpoint was replaced as an earlier export
    assert json.loads((out / bd.HF_EXPORT_RECORD).read_text())["variant"] == "coder"
    other = tmp_path / "other-art"
    bd.compress(base_dir, ft_dir, other, variant="math")
    with pytest.raises(ValueError, match=r"hf_out_dir .*\(it is the checkpoint of variant 'coder', not of 'math'\)"):
        bd.export_hf(base_dir, other, out)
    assert json.loads((out / bd.HF_EXPORT_RECORD).read_text())["variant"] == "coder"


# --------------------------------------------------------------------------------------------
# format=hf streams: shards of max_shard_bytes, one tensor materialised at a time
# --------------------------------------------------------------------------------------------

HF_SHARD = 12_000  # bytes: the family's vocabulary matrices (16 KiB) get shards of their own, norms share


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def test_export_hf_in_shards_is_the_single_file_export_and_loads_the_same(family, artifact_dir, tmp_path):
    """Found by a reviewer: format=hf built the whole materialised model in memory and wrote one file.
    It now writes shards of at most ``max_shard_bytes`` (a larger tensor alone) named as transformers
    names them, with Hugging Face's index, holding bit for bit the tensors of the one-file export, and
    transformers loads the shards to the same logits."""
    from transformers import AutoModelForCausalLM

    base_dir, _ = family
    one = bd.export_hf(base_dir, artifact_dir, tmp_path / "one")
    many = bd.export_hf(base_dir, artifact_dir, tmp_path / "many", max_shard_bytes=HF_SHARD)
    assert not (one / "model.safetensors.index.json").exists()
    single = load_file(one / "model.safetensors")
    shards = sorted(many.glob("*.safetensors"))
    n = len(shards)
    assert n > 2 and [p.name for p in shards] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((many / "model.safetensors.index.json").read_text())
    assert index == {"metadata": {"total_size": sum(_nbytes(t) for t in single.values())},
                     "weight_map": index["weight_map"]}
    assert list(index["weight_map"]) == sorted(single)
    got: dict[str, torch.Tensor] = {}
    for shard in shards:
        tensors = load_file(shard)
        assert set(tensors) == {k for k, f in index["weight_map"].items() if f == shard.name}, shard.name
        assert len(tensors) == 1 or sum(_nbytes(t) for t in tensors.values()) <= HF_SHARD, shard.name
        got |= tensors
    assert max(len(load_file(s)) for s in shards) > 1  # the limit gathers tensors, not one per file
    assert got.keys() == single.keys()
    for k, t in single.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape and bd._tensor_bytes(got[k]) == bd._tensor_bytes(t)
    record = json.loads((many / bd.HF_EXPORT_RECORD).read_text())
    assert record["files"] == sorted(p.name for p in many.iterdir())
    assert (many / "config.json").read_text() == (one / "config.json").read_text()
    ids = torch.tensor([[1, 5, 9, 77, 3, 127]])
    with torch.no_grad():
        logits = [AutoModelForCausalLM.from_pretrained(d).eval()(ids).logits for d in (one, many)]
    assert torch.equal(*logits)
    assert _leftovers(tmp_path) == []


def test_run_py_format_hf_takes_max_shard_bytes(family, artifact_dir, tmp_path):
    """``format=hf`` cuts its shards at the export's ``max_shard_bytes`` (conf/export.yaml)."""
    models = tmp_path / "models"
    _copy_artifact(family[0], models / "base")
    _copy_artifact(artifact_dir, tmp_path / "artifacts" / "coder")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "compress/run.py", "variant=coder", f"paths.root={tmp_path}", "format=hf",
                           f"max_shard_bytes={HF_SHARD}"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = models / "coder-bitdelta"
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards


def test_export_hf_holds_one_shard_and_reads_the_base_as_it_writes(family, artifact_dir, tmp_path, monkeypatch):
    """The exporter's memory: no state dict of the whole model is built (``materialize`` is not
    called), every ``save_file`` gets at most ``max(max_shard_bytes, largest tensor)`` bytes, and each
    base tensor is read only once the shards before it are written (at most one tensor read ahead)."""
    base_dir, _ = family
    real_fingerprint = bd.fingerprint(base_dir)
    monkeypatch.setattr(bd, "fingerprint", lambda d: real_fingerprint)  # its reads are not the export's
    monkeypatch.setattr(bd, "materialize", lambda *a, **k: pytest.fail("the whole model was materialised"))
    events: list[tuple[str, object]] = []
    real_get, real_rows, real_save = bd.Checkpoint.get, bd.Checkpoint.get_rows, bd.save_file

    def get(self, name):
        events.append(("read", name))
        return real_get(self, name)

    def get_rows(self, name, start, stop):
        events.append(("read", name))
        return real_rows(self, name, start, stop)

    def save(tensors, path, metadata=None):
        events.append(("save", {k: _nbytes(t) for k, t in tensors.items()}))
        return real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(bd.Checkpoint, "get", get)
    monkeypatch.setattr(bd.Checkpoint, "get_rows", get_rows)
    monkeypatch.setattr(bd, "save_file", save)
    out = bd.export_hf(base_dir, artifact_dir, tmp_path / "hf", max_shard_bytes=HF_SHARD)
    largest = max(_nbytes(t) for s in out.glob("*.safetensors") for t in load_file(s).values())
    assert largest > HF_SHARD  # (so that the bound below is the larger tensor's for its shard)
    saves = [what for kind, what in events if kind == "save"]
    assert len(saves) == len(list(out.glob("*.safetensors"))) > 2
    for shard in saves:
        assert sum(shard.values()) <= max(HF_SHARD, largest)
        assert len(shard) == 1 or sum(shard.values()) <= HF_SHARD
    pending: set[str] = set()  # base tensors read and not yet written
    for kind, what in events:
        if kind == "read":
            pending.add(what)
        else:
            pending -= set(what)
            assert len(pending) <= 1, pending  # the tensor that did not fit the shard just written
    assert pending == set()


def test_an_interrupted_export_hf_leaves_no_output_and_no_temporary_folder(family, artifact_dir, tmp_path,
                                                                           monkeypatch):
    """A Ctrl-C (or any error) while the second shard is written removes the first one with the
    temporary folder: no out_dir, no temporary folder, no parent folder the export made; an earlier
    export in out_dir is left as it was."""
    base_dir, _ = family
    out = tmp_path / "out" / "hf"
    real_save, calls = bd.save_file, []

    def save(tensors, path, metadata=None):
        calls.append(Path(path))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(bd, "save_file", save)
    with pytest.raises(KeyboardInterrupt):
        bd.export_hf(base_dir, artifact_dir, out, max_shard_bytes=HF_SHARD)
    assert len(calls) == 2 and calls[0].parent.parent == out.parent
    assert not out.parent.exists()  # neither out_dir nor its temporary folder (nor the folder made for it)
    monkeypatch.setattr(bd, "save_file", real_save)
    before = _an_earlier_export(base_dir, artifact_dir, out)
    monkeypatch.setattr(bd, "save_file", save)
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        bd.export_hf(base_dir, artifact_dir, out, max_shard_bytes=HF_SHARD)
    assert len(calls) == 2
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before and _leftovers(out.parent) == []


@pytest.mark.parametrize("granularity", ["matrix", "row", "rowcol"])
def test_materialisation_in_blocks_of_rows_is_one_reconstruction_of_the_matrix(family, tmp_path, monkeypatch,
                                                                              granularity):
    """Each compressed matrix is reconstructed a block of rows at a time (the float32 intermediates of a
    block, not of a 70B model's 2 GB LM head), to the very bits of one ``reconstruct`` of the whole
    matrix; a value beyond the base dtype's range is refused with the largest of all blocks."""
    base_dir, ft_dir = family
    art = tmp_path / "art"
    compress(base_dir, ft_dir, art, variant="coder", granularity=granularity)
    monkeypatch.setattr(bd, "_RECONSTRUCT_ELEMENTS", 100)  # 3 rows of 32 per block
    real, sizes = bd.reconstruct, []

    def reconstruct(w, sign, alpha, beta=None):
        sizes.append(w.numel())
        return real(w, sign, alpha, beta)

    monkeypatch.setattr(bd, "reconstruct", reconstruct)
    a = load_artifact(art)
    if granularity == "rowcol":  # a β ≠ 1, as distillation writes it
        a.betas[W] = torch.linspace(0.5, 2.0, a.betas[W].numel()).half()
    state = bd.materialize(base_dir, a)
    assert sizes and max(sizes) <= 96
    base = load_file(base_dir / "model.safetensors")
    for name, sign in a.signs.items():
        whole = real(base[name], sign, a.alphas[name], a.betas.get(name)).to(base[name].dtype)
        assert bd._tensor_bytes(state[name]) == bd._tensor_bytes(whole), name
    # a float16 base: the largest value beyond its range, of whichever block, is named
    half = tmp_path / "half"
    half.mkdir()
    for f in base_dir.iterdir():
        shutil.copyfile(f, half / f.name)
    save_file({k: v.half() for k, v in base.items()}, half / "model.safetensors", metadata={"format": "pt"})
    a.alphas[W] = a.alphas[W].clone()
    if granularity == "matrix":
        a.alphas[W], want = torch.tensor(7e4), "7e+04"
    elif granularity == "row":  # beyond in the second block (rows 3-5) and, further, in the last
        a.alphas[W][5], a.alphas[W][-1], want = 6.6e4, 7e4, "7e+04"
    else:  # float16 α: beyond through β, α_r·β_c
        a.alphas[W][5], a.alphas[W][-1], want = 5.5e4, 6e4, "7.5e+04"
        a.betas[W] = torch.ones_like(a.betas[W])
        a.betas[W][-1] = 1.25
    with pytest.raises(ArtifactError, match=re.escape(f"{W} (W_base + α·sign) holds {want}")):
        bd.materialize(half, a)


# --------------------------------------------------------------------------------------------
# mutation sweep: cases the tests above left open
# --------------------------------------------------------------------------------------------


def _save_pair(root: Path, base: dict, ft: dict) -> tuple[Path, Path]:
    (root / "b").mkdir(parents=True), (root / "f").mkdir(parents=True)
    save_file(base, root / "b" / "model.safetensors")
    save_file(ft, root / "f" / "model.safetensors")
    return root / "b", root / "f"


def test_same_values_in_another_dtype_are_stored_in_full(tmp_path):
    """A 1-D parameter whose values equal the base's but whose dtype differs (an fp32 norm of ones
    saved as bf16 ones) is not "identical to the base": it is stored in full, in the fine-tune's dtype,
    and materialises in that dtype."""
    g = torch.Generator().manual_seed(0)
    base = {"norm.weight": torch.ones(8), "lin.weight": torch.randn(4, 8, generator=g)}
    ft = {"norm.weight": torch.ones(8, dtype=torch.bfloat16), "lin.weight": base["lin.weight"] + 0.1}
    b, f = _save_pair(tmp_path, base, ft)
    m = compress(b, f, tmp_path / "art", variant="v")
    art = load_artifact(tmp_path / "art")
    assert set(art.full) == {"norm.weight"} and art.full["norm.weight"].dtype == torch.bfloat16
    assert m["stats"]["full_parameters"] == 8
    assert materialize(b, art)["norm.weight"].dtype == torch.bfloat16


def test_a_full_tensor_colliding_with_a_scale_name_is_refused(tmp_path):
    """A new parameter named ``<matrix>.alpha`` would overwrite the compressed matrix's α in the
    artifact: the export refuses it (ArtifactError naming the tensor) and writes nothing."""
    g = torch.Generator().manual_seed(0)
    base = {"lin.weight": torch.randn(4, 8, generator=g)}
    ft = {"lin.weight": base["lin.weight"] + 0.1, "lin.weight.alpha": torch.full((4,), 7.0)}
    b, f = _save_pair(tmp_path, base, ft)
    with pytest.raises(ArtifactError, match=r"stored tensor name 'lin.weight.alpha' is produced twice"):
        compress(b, f, tmp_path / "art", variant="v")
    assert not (tmp_path / "art").exists()


def test_a_full_tensor_named_like_packed_signs_is_refused(tmp_path):
    """``P.sign`` is reserved for packed signs: a parameter of that name stored in full would be read
    back as a compressed matrix, so the export refuses it with a message that says why."""
    g = torch.Generator().manual_seed(0)
    base = {"lin.weight": torch.randn(4, 8, generator=g)}
    ft = {"lin.weight": base["lin.weight"] + 0.1, "gate.sign": torch.randn(3, generator=g)}
    b, f = _save_pair(tmp_path, base, ft)
    with pytest.raises(ArtifactError, match=r"parameter 'gate.sign' would be stored in full .* reserves for packed signs"):
        compress(b, f, tmp_path / "art", variant="v")
    assert not (tmp_path / "art").exists()


def test_sha256_digests_are_compared_case_insensitively(artifact_dir, tmp_path):
    """The manifest's hex digests may be upper case (hex is case-free); a wrong digest still fails."""
    art = _copy_artifact(artifact_dir, tmp_path / "art")
    manifest = json.loads((art / "bitdelta.json").read_text())
    manifest["files"] = {f: d.upper() for f, d in manifest["files"].items()}
    (art / "bitdelta.json").write_text(json.dumps(manifest))
    assert load_artifact(art).signs.keys() == load_artifact(artifact_dir).signs.keys()
    manifest["files"]["delta.safetensors"] = "0" * 64
    (art / "bitdelta.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="does not match its sha256"):
        load_artifact(art)


def test_a_shard_holding_tensors_the_index_does_not_map_to_it_is_rejected(artifact_dir, tmp_path):
    """Each shard must hold exactly the tensors the index maps to it: an extra tensor in a shard (which
    would otherwise be read as a parameter stored in full) is refused, naming the shard."""
    art = _copy_artifact(artifact_dir, tmp_path / "art")
    _reshard(art, {"stowaway.weight": torch.zeros(3)})
    with pytest.raises(ArtifactError, match=r"shard delta-00002-of-00002.safetensors does not hold the tensors "
                                            r"delta.safetensors.index.json maps to it"):
        load_artifact(art)


@pytest.mark.parametrize("values", [True, False])
def test_an_index_mapping_a_tensor_to_no_file_name_is_an_artifact_error(artifact_dir, tmp_path, values):
    """A weight_map value that is not a file name (a list here) is refused naming the index and the
    tensor, at the header read as at the full one (it raised TypeError, which took a server's start down)."""
    art = _copy_artifact(artifact_dir, tmp_path / "art")
    name = UNCHANGED_MATRIX.replace("o_proj", "q_proj") + ".sign"
    _reshard(art, edit_index=lambda index: index["weight_map"].update({name: [index["weight_map"][name]]}))
    with pytest.raises(ArtifactError, match=rf"delta.safetensors.index.json: the file of '{re.escape(name)}' must be "
                                            r"a file name, got \['delta-0000"):
        load_artifact(art, values=values)


def test_a_listed_shard_the_index_maps_no_tensor_to_is_an_artifact_error(artifact_dir, tmp_path):
    """The manifest lists (and signs) three shards, each holding whole parameters; the index maps the
    tensors of two. The third's matrices would be skipped and served as the base's, so the reader
    refuses the artifact, naming the shard."""
    art = _copy_artifact(artifact_dir, tmp_path / "art")
    tensors = load_file(art / "delta.safetensors")
    params = sorted({n.removesuffix(".sign").removesuffix(".alpha") for n in tensors})
    shards = {f"delta-0000{i + 1}-of-00003.safetensors": [n for n in tensors if n.removesuffix(".sign")
                                                          .removesuffix(".alpha") in params[i::3]] for i in range(3)}
    for file, names in shards.items():
        save_file({n: tensors[n] for n in names}, art / file, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: f for f in list(shards)[:2] for n in shards[f]}}
    (art / "delta.safetensors.index.json").write_text(json.dumps(index))
    (art / "delta.safetensors").unlink()
    manifest = json.loads((art / "bitdelta.json").read_text())
    manifest["files"] = {f: bd._sha256_file(art / f) for f in [*shards, "delta.safetensors.index.json"]}
    (art / "bitdelta.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=r"delta-00003-of-00003.safetensors in the manifest's files but no "
                                            r"tensor of delta.safetensors.index.json maps to it"):
        load_artifact(art)


def test_a_tied_base_that_stores_its_head_exports_no_head_delta(tmp_path):
    """A base whose config ties the head to the embedding but whose checkpoint stores ``lm_head.weight``
    too: transformers (and the server) ignore the stored head, so the export leaves it out rather than
    writing a head delta that no server can apply. An untied fine-tune of it keeps its head, in full."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()  # tied, and stored
    for name, tied in (("base", True), ("ft", True), ("untied", False)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**cfg.to_dict(), "tie_word_embeddings": tied}))
        if name != "base":
            g = torch.Generator().manual_seed(1)
            state = {k: v + 0.05 * torch.randn(v.shape, generator=g) if v.dim() == 2 else v for k, v in state.items()}
        save_file(state, tmp_path / name / "model.safetensors", metadata={"format": "pt"})
    compress(tmp_path / "base", tmp_path / "ft", tmp_path / "art", variant="v")
    art = load_artifact(tmp_path / "art")
    assert "model.embed_tokens.weight" in art.signs
    assert "lm_head.weight" not in {*art.signs, *art.full}
    compress(tmp_path / "base", tmp_path / "untied", tmp_path / "art2", variant="v")
    art2 = load_artifact(tmp_path / "art2")
    assert "lm_head.weight" not in art2.signs
    assert torch.equal(art2.full["lm_head.weight"], state["lm_head.weight"])


def test_an_unchanged_row_gets_alpha_zero_and_loads(tmp_path):
    """Row granularity: α_r = mean_j |Δ_rj| per row, so a row the fine-tune left alone has α_r = 0 —
    a valid scale (the reader refuses negative ones only) that reproduces the base row exactly."""
    g = torch.Generator().manual_seed(0)
    base = {"lin.weight": torch.randn(3, 10, generator=g)}
    delta = torch.randn(3, 10, generator=g)
    delta[1] = 0
    b, f = _save_pair(tmp_path, base, {"lin.weight": base["lin.weight"] + delta})
    compress(b, f, tmp_path / "art", variant="v", granularity="row")
    art = load_artifact(tmp_path / "art")
    torch.testing.assert_close(art.alphas["lin.weight"], delta.abs().mean(1), rtol=1e-6, atol=0)
    assert art.alphas["lin.weight"][1].item() == 0.0
    w = materialize(b, art)["lin.weight"]
    assert torch.equal(w[1], base["lin.weight"][1])


def test_a_beta_that_does_not_fit_the_base_columns_is_an_artifact_error(family, rowcol_dir, tmp_path):
    """A β one column short still passes the reader's ceil(d_in/8) check, so materialize compares it
    with the base weight's d_in and names the mismatch (not a broadcasting error)."""
    art_dir = _copy_artifact(rowcol_dir, tmp_path / "art")
    _rewrite_delta(art_dir, lambda t: t.update({W + ".beta": t[W + ".beta"][:-1].contiguous()}))
    art = load_artifact(art_dir)
    assert art.betas[W].shape == (31,)
    with pytest.raises(ArtifactError, match=r"gate_proj.weight.sign .* do not fit base weight \[64, 32\]"):
        materialize(family[0], art)


def test_artifact_files_are_readable_by_everyone(family, tmp_path):
    """safetensors creates 0600 files; the export makes every delta file 0644 so that a server running
    as another user can read the artifact (single file and shards alike)."""
    compress(*family, tmp_path / "one", variant="v")
    compress(*family, tmp_path / "many", variant="v", max_shard_bytes=4096)
    for folder in (tmp_path / "one", tmp_path / "many"):
        files = sorted(folder.glob("*.safetensors"))
        assert files and {oct(f.stat().st_mode & 0o777) for f in files} == {"0o644"}, folder


def test_export_hf_of_a_resized_vocabulary_fits_the_config(tmp_path):
    """A fine-tune with added tokens stores its resized embedding and LM head in full; the exported
    checkpoint's config.json (copied from the base) must name the new vocabulary size, or transformers
    refuses to load it."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(tmp_path / "base")
    model.resize_token_embeddings(136)
    with torch.no_grad():
        model.get_parameter("model.layers.0.mlp.up_proj.weight").add_(0.01)
    model.save_pretrained(tmp_path / "ft")
    compress(tmp_path / "base", tmp_path / "ft", tmp_path / "art", variant="v")
    out = bd.export_hf(tmp_path / "base", tmp_path / "art", tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 136
    assert json.loads((tmp_path / "base" / "config.json").read_text())["vocab_size"] == 128  # the base untouched
    loaded = AutoModelForCausalLM.from_pretrained(out)
    ft = load_file(tmp_path / "ft" / "model.safetensors")
    assert torch.equal(loaded.model.embed_tokens.weight, ft["model.embed_tokens.weight"])


def test_a_shard_limit_below_every_tensor_gives_one_parameter_per_shard(family, tmp_path):
    """With ``max_shard_bytes=1`` each stored parameter (a matrix's signs with its α, or a full tensor)
    gets a shard of its own, and no shard is empty: the index maps a tensor to every shard listed."""
    m = compress(*family, tmp_path / "art", variant="v", max_shard_bytes=1)
    shards = sorted(f for f in m["files"] if f.endswith(".safetensors"))
    index = json.loads((tmp_path / "art" / "delta.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    art = load_artifact(tmp_path / "art")
    assert len(shards) == len(art.signs) + len(art.full)
    for shard in shards:
        names = {n.removesuffix(".sign").removesuffix(".alpha") for n in load_file(tmp_path / "art" / shard)}
        assert len(names) == 1, (shard, names)


# --------------------------------------------------------------------------------------------
# found by a fresh user: export_hf's tokenizer and config, shapes, names
# --------------------------------------------------------------------------------------------


def test_export_hf_copies_every_tokenizer_layout_unties_an_own_head_and_keeps_the_base_dtype(tmp_path):
    """A base whose tokenizer is vocab.json + merges.txt (or tokenizer.model, added_tokens.json) lost
    those files, so the checkpoint's tokenizer loaded empty; a fine-tune that untied the head of a
    tied base kept ``tie_word_embeddings: true`` (an engine honouring it reads the embedding); and
    its bf16 norms, stored in full, came out bf16 in a float32 checkpoint."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
              num_key_value_heads=2)
    base = LlamaForCausalLM(LlamaConfig(**kw, tie_word_embeddings=True))
    base.save_pretrained(tmp_path / "base")
    assert "lm_head.weight" not in load_file(tmp_path / "base" / "model.safetensors")
    sidecars = {"vocab.json": '{"a": 0}', "merges.txt": "#version: 0.2\n", "tokenizer.model": "\x00sp",
                "added_tokens.json": '{"<x>": 64}', "tokenizer_config.json": '{"tokenizer_class": "GPT2Tokenizer"}'}
    for name, text in sidecars.items():
        (tmp_path / "base" / name).write_text(text)
    ft = LlamaForCausalLM(LlamaConfig(**kw, tie_word_embeddings=False))
    ft.load_state_dict(base.state_dict() | {"lm_head.weight": base.model.embed_tokens.weight.detach().clone()})
    with torch.no_grad():
        ft.lm_head.weight.add_(0.05)
        ft.model.layers[0].mlp.up_proj.weight.add_(0.01)
    ft.to(torch.bfloat16).save_pretrained(tmp_path / "ft")
    compress(tmp_path / "base", tmp_path / "ft", tmp_path / "art", variant="v")
    assert "lm_head.weight" in load_artifact(tmp_path / "art").full
    out = bd.export_hf(tmp_path / "base", tmp_path / "art", tmp_path / "hf")
    for name, text in sidecars.items():
        assert (out / name).read_text() == text, name
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    assert json.loads((tmp_path / "base" / "config.json").read_text())["tie_word_embeddings"] is True
    state = load_file(out / "model.safetensors")
    assert {t.dtype for t in state.values()} == {torch.float32}
    loaded = AutoModelForCausalLM.from_pretrained(out)
    head = load_file(tmp_path / "ft" / "model.safetensors")["lm_head.weight"].float()
    assert torch.equal(loaded.lm_head.weight, head) and not torch.equal(loaded.lm_head.weight,
                                                                        loaded.model.embed_tokens.weight)


def test_a_tied_fine_tunes_stored_head_is_ignored_as_transformers_ignores_it(tmp_path):
    """Found by a fresh user: a fine-tune whose config ties the head but whose file also holds
    ``lm_head.weight`` (some tools save both) had the head stored in full (about 5x the bytes here),
    and ``format=hf`` untied it. transformers ties such a model and ignores the tensor; so does the
    export: the artifact is the one of the same fine-tune saved without it."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    model.save_pretrained(tmp_path / "base")
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.add_(0.01)
    model.save_pretrained(tmp_path / "ft")
    shutil.copytree(tmp_path / "ft", tmp_path / "ft-head")
    state = load_file(tmp_path / "ft" / "model.safetensors")
    save_file({**state, "lm_head.weight": state["model.embed_tokens.weight"].clone()},
              tmp_path / "ft-head" / "model.safetensors", metadata={"format": "pt"})
    plain = compress(tmp_path / "base", tmp_path / "ft", tmp_path / "a", variant="v")
    headed = compress(tmp_path / "base", tmp_path / "ft-head", tmp_path / "b", variant="v")
    assert "lm_head.weight" not in load_artifact(tmp_path / "b").full
    assert headed["stats"] == plain["stats"]
    assert json.loads((bd.export_hf(tmp_path / "base", tmp_path / "b", tmp_path / "hf") / "config.json")
                      .read_text())["tie_word_embeddings"] is True


def test_a_matrix_of_another_shape_is_refused_but_a_resized_vocabulary_is_not(tmp_path):
    """Found by a fresh user: a fine-tune whose MLP matrix had other rows was exported (stored in full)
    and its ``format=hf`` checkpoint then failed to load. Only a vocabulary matrix may change shape,
    by its rows; anything else is named, and nothing is written."""
    g = torch.Generator().manual_seed(0)
    base = {"model.layers.0.mlp.up_proj.weight": torch.randn(8, 4, generator=g),
            "model.embed_tokens.weight": torch.randn(10, 4, generator=g)}
    ft = {"model.layers.0.mlp.up_proj.weight": torch.randn(6, 4, generator=g),
          "model.embed_tokens.weight": torch.randn(12, 4, generator=g)}
    b, f = _save_pair(tmp_path, base, ft)
    with pytest.raises(ArtifactError, match=r"model.layers.0.mlp.up_proj.weight: shape \[6, 4\] in .* differs from "
                                            r"the base's \[8, 4\] in .*: is this a fine-tune of that base\?"):
        compress(b, f, tmp_path / "art", variant="v")
    assert not (tmp_path / "art").exists()
    ft["model.layers.0.mlp.up_proj.weight"] = base["model.layers.0.mlp.up_proj.weight"] + 0.1
    b, f = _save_pair(tmp_path / "ok", base, ft)
    compress(b, f, tmp_path / "art", variant="v")
    assert set(load_artifact(tmp_path / "art").full) == {"model.embed_tokens.weight"}
    ft["model.embed_tokens.weight"] = torch.randn(10, 5, generator=g)  # columns: not a resized vocabulary
    b, f = _save_pair(tmp_path / "cols", base, ft)
    with pytest.raises(ArtifactError, match=r"model.embed_tokens.weight: shape \[10, 5\]"):
        compress(b, f, tmp_path / "art2", variant="v")


@pytest.mark.parametrize("name", ["a/b", "../escape", ".hidden", "-x", "", "x" * 65, "a b", "naïve"])
def test_a_variant_name_that_is_no_folder_name_is_refused(family, tmp_path, name):
    """Found by a fresh user: ``variant.name=a/b`` wrote ``artifacts/a/b``, which no server lists, and
    ``../escape`` wrote outside the artifact root. The name is a model id's rule (serve/request.py)."""
    with pytest.raises(ValueError, match=r"variant must be a name of 1 to 64 letters, digits"):
        compress(*family, tmp_path / "art", variant=name)
    assert not (tmp_path / "art").exists()
    bd.check_variant_name("coder-2.v_1")


def test_other_families_vocabulary_resizes_dtypes_and_nested_configs(tmp_path):
    """Found by a reviewer of the checks above: a resized vocabulary under another family's names
    (GPT-2's ``transformer.wte``, an LM head's bias) was refused; ``format=hf`` cast every tensor
    stored in full to one dtype (a float32 norm of a bfloat16 base's became bfloat16, a new float32
    head lost its precision); and a config with ``text_config``, or without the key (a family whose
    default is tied), kept its head tied."""
    g = torch.Generator().manual_seed(1)
    base = {"transformer.wte.weight": torch.randn(10, 4, generator=g).bfloat16(),
            "lm_head.bias": torch.randn(10, generator=g).bfloat16(),
            "h.0.w.weight": torch.randn(6, 4, generator=g).bfloat16(),
            "ln_f.weight": torch.ones(4)}
    ft = {"transformer.wte.weight": torch.randn(12, 4, generator=g).bfloat16(),
          "lm_head.bias": torch.randn(12, generator=g).bfloat16(),
          "h.0.w.weight": base["h.0.w.weight"] + 0.1,
          "ln_f.weight": torch.full((4,), 1.5).bfloat16(),                  # stored in full: back to float32
          "score.weight": torch.full((2, 4), 1.0001),                       # new: keeps float32
          "lm_head.weight": torch.randn(12, 4, generator=g).bfloat16()}   # new: untied head
    b, f = _save_pair(tmp_path, base, ft)
    (b / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 10, "tie_word_embeddings": True}}))
    compress(b, f, tmp_path / "art", variant="v")
    full = set(load_artifact(tmp_path / "art").full)
    assert full == {"transformer.wte.weight", "lm_head.bias", "ln_f.weight", "score.weight", "lm_head.weight"}
    out = bd.export_hf(b, tmp_path / "art", tmp_path / "hf")
    state = load_file(out / "model.safetensors")
    assert state["ln_f.weight"].dtype == torch.float32 and torch.equal(state["ln_f.weight"], torch.full((4,), 1.5))
    assert state["score.weight"].dtype == torch.float32 and torch.equal(state["score.weight"], ft["score.weight"])
    assert state["lm_head.weight"].dtype == torch.bfloat16 and state["h.0.w.weight"].dtype == torch.bfloat16
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["text_config"]["tie_word_embeddings"] is False
    assert config["text_config"]["vocab_size"] == 12 and "vocab_size" not in config
    ft["h.0.w.weight"] = torch.randn(6, 5, generator=g).bfloat16()  # not along the vocabulary: refused
    b, f = _save_pair(tmp_path / "bad", base, ft)
    (b / "config.json").write_text(json.dumps({"vocab_size": 10}))
    with pytest.raises(ArtifactError, match=r"h.0.w.weight: shape \[6, 5\]"):
        compress(b, f, tmp_path / "art2", variant="v")


# --------------------------------------------------------------------------------------------
# found by a fresh user: full tensors the reader passed, format=hf checkpoints that did not fit the base
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_full_tensor_holding_nan_or_inf_is_refused_by_name(artifact_dir, tmp_path, value, dtype):
    """A norm set to NaN in delta.safetensors (sha256 redone) loaded, and the server then answered every
    request for the variant with non-finite logits, naming nothing. The reader refuses it as it refuses
    a NaN α (the export refuses to write either); a headers-only load reads no values."""
    art = _copy_artifact(artifact_dir, tmp_path / "art")

    def poison(t):
        t[CHANGED_NORM] = t[CHANGED_NORM].clone().to(dtype)
        t[CHANGED_NORM][3] = value

    _rewrite_delta(art, poison)
    with pytest.raises(ArtifactError, match=rf"{re.escape(CHANGED_NORM)} \(stored in full\) has non-finite values"):
        load_artifact(art)
    assert CHANGED_NORM in load_artifact(art, values=False).full  # the structure is sound


def _an_earlier_export(base_dir: Path, artifact_dir: Path, out: Path) -> dict:
    bd.export_hf(base_dir, artifact_dir, out)
    return {f.name: f.read_bytes() for f in out.iterdir()}


@pytest.mark.parametrize("what", ["norm-shape", "orphan-head-alpha", "orphan-alpha"])
def test_export_hf_refuses_what_the_server_refuses_and_writes_nothing(family, artifact_dir, tmp_path, what):
    """``format=hf`` wrote a norm stored as [7] (the base's [32]), which transformers then refused to
    load, and an ``lm_head.weight.alpha`` whose signs were gone as a parameter of the checkpoint; the
    server refuses both. The export now does too, naming the tensor, before anything is written: an
    earlier export in ``out_dir`` is left as it was, and no temporary folder stays behind."""
    base_dir, _ = family
    art = _copy_artifact(artifact_dir, tmp_path / "art")
    if what == "norm-shape":
        name = CHANGED_NORM
        match = rf"{re.escape(CHANGED_NORM)} is stored in full with shape \[7\], the base's is \[32\]"
        _rewrite_delta(art, lambda t: t.update({CHANGED_NORM: t[CHANGED_NORM][:7].clone()}))
    else:
        p = "lm_head.weight" if what == "orphan-head-alpha" else W
        name, match = p + ".alpha", rf"{re.escape(p)}\.alpha has no matching {re.escape(p)}\.sign"
        _rewrite_delta(art, lambda t: t.pop(p + ".sign"))
    assert name in load_artifact(art).full  # the reader alone cannot tell (no base)
    with pytest.raises(ArtifactError, match=match):
        materialize(base_dir, load_artifact(art))
    out = tmp_path / "out" / "hf"
    with pytest.raises(ArtifactError, match=match):
        bd.export_hf(base_dir, art, out)
    assert not out.parent.exists() or os.listdir(out.parent) == []
    before = _an_earlier_export(base_dir, artifact_dir, out)
    with pytest.raises(ArtifactError, match=match):
        bd.export_hf(base_dir, art, out)
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before and _leftovers(out.parent) == []


def test_an_orphan_beta_is_refused_by_export_hf(family, rowcol_dir, tmp_path):
    """A rowcol matrix whose signs and α were removed leaves ``P.beta``, read as a tensor stored in full."""
    art = _copy_artifact(rowcol_dir, tmp_path / "art")
    _rewrite_delta(art, lambda t: [t.pop(W + ".sign"), t.pop(W + ".alpha")])
    with pytest.raises(ArtifactError, match=rf"{re.escape(W)}\.beta has no matching {re.escape(W)}\.sign"):
        bd.export_hf(family[0], art, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_the_served_shape_check_names_a_resized_vocabulary_only_for_one():
    """A norm of another shape was refused with "(resized vocabularies are not served)"; that reason is
    given only where the shape differs along the vocabulary."""
    from deltafleet.serve.delta import VariantDelta

    shapes = {"model.embed_tokens.weight": torch.Size([128, 32]), "lm_head.weight": torch.Size([128, 32]),
              "model.norm.weight": torch.Size([32])}

    def check(name, shape):
        art = Artifact(path=Path("x"), manifest={"variant": "v"}, full={name: torch.zeros(shape)})
        with pytest.raises(ValueError) as e:
            VariantDelta(art).check(shapes)
        return str(e.value)

    said = check("model.norm.weight", (7,))
    assert said == ("variant 'v': model.norm.weight has shape (7,), the base (32,) (not a tensor of the base's "
                    "shapes: is the artifact this base's?)")
    assert "resized vocabularies are not served" in check("model.embed_tokens.weight", (136, 32))
    assert "resized vocabularies are not served" in check("lm_head.weight", (136, 32))
    assert "vocabular" not in check("model.embed_tokens.weight", (128, 40))  # columns: not the vocabulary


def test_a_rowcol_scale_beyond_float16_is_refused_and_nothing_is_written(tmp_path):
    """Found by a reviewer: granularity rowcol stores α in float16; a row whose mean |Δ| exceeds
    float16's range was written as α = inf, an artifact that load_artifact then refused. The export
    refuses it, naming the matrix, the row and granularity row (float32 scales) as the way out."""
    b, f = _save_pair(tmp_path, {"w": torch.zeros(4, 8)}, {"w": torch.cat([torch.ones(3, 8), torch.full((1, 8), 1e5)])})
    with pytest.raises(ValueError, match=r"^w: row 3 has mean \|Δ\| 1e\+05, beyond float16's range .* granularity row"):
        compress(b, f, tmp_path / "art", variant="v", granularity="rowcol")
    assert not (tmp_path / "art").exists()
    compress(b, f, tmp_path / "art", variant="v", granularity="row")
    assert torch.equal(load_artifact(tmp_path / "art").alphas["w"], torch.tensor([1.0, 1, 1, 1e5]))


@pytest.mark.parametrize("shape", [(4, 0), (0, 4)])
def test_an_empty_matrix_is_left_out_of_the_export(tmp_path, shape):
    """Found by a reviewer: a 2-D parameter with no columns reached the sign packer and failed the whole
    export (``in_features must be ≥ 1``). An empty matrix, equal to the base's, is left out; the
    others are compressed."""
    b, f = _save_pair(tmp_path, {"e": torch.zeros(shape), "x": torch.zeros(2, 2)},
                      {"e": torch.zeros(shape), "x": torch.ones(2, 2)})
    compress(b, f, tmp_path / "art", variant="v")
    art = load_artifact(tmp_path / "art")
    assert set(art.signs) == {"x"} and not art.full


def _bitdelta_reference(w_base: torch.Tensor, w_ft: torch.Tensor, per_row: bool) -> torch.Tensor:
    """W_base + α·sign(Δ) (sign 0 → −1) in float64, cast to the base dtype."""
    delta = w_ft.double() - w_base.double()
    alpha = delta.abs().mean(1, keepdim=True) if per_row else delta.abs().mean()
    return (w_base.double() + alpha * torch.where(delta > 0, 1.0, -1.0)).to(w_base.dtype)


def test_integer_and_bool_matrices_are_no_weights(tmp_path):
    """Found by a reviewer: any changed 2-D tensor of the base's shape was compressed to signs, so a
    changed int64 table came back as base + α·sign cast to integers, and a bool mask failed the
    export (torch cannot subtract bools). Only floating-point matrices are weights: a changed integer
    table is stored whole, an unchanged mask left out."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 8, generator=g)
    mask = torch.rand(3, 8, generator=g) > 0.5
    base = {"lin.weight": w, "pos_ids": torch.arange(16).reshape(2, 8), "mask": mask}
    ft = {"lin.weight": w + 0.1, "pos_ids": torch.arange(16).reshape(2, 8) * 3, "mask": mask.clone()}
    b, f = _save_pair(tmp_path, base, ft)
    bd.compress(b, f, tmp_path / "art", variant="v")
    art = bd.load_artifact(tmp_path / "art", base_fingerprint=bd.fingerprint(b))
    assert set(art.signs) == {"lin.weight"} and set(art.full) == {"pos_ids"}
    state = bd.materialize(b, art)
    assert state["pos_ids"].dtype == torch.int64 and torch.equal(state["pos_ids"], ft["pos_ids"])
    assert torch.equal(state["mask"], mask)
    torch.testing.assert_close(state["lin.weight"], _bitdelta_reference(w, w + 0.1, per_row=False), rtol=0, atol=1e-6)


def test_a_float8_checkpoint_is_refused_in_one_line(tmp_path):
    """Found by a reviewer: the checkpoint reader takes float8 tensors, and their export failed inside
    torch ("Promotion for Float8 Types is not supported"), a traceback. Nothing serves float8 weights,
    so the export names the tensor and the dtype, and writes nothing."""
    w = torch.randn(4, 8).to(torch.float8_e4m3fn)
    b, f = _save_pair(tmp_path, {"w": w}, {"w": (w.float() + 0.25).to(torch.float8_e4m3fn)})
    with pytest.raises(ValueError, match=r"^w: .* holds F8_E4M3 weights; the BitDelta export takes float32"):
        bd.compress(b, f, tmp_path / "art", variant="v")
    assert not (tmp_path / "art").exists()


def test_format_hf_of_a_tied_base_that_stores_its_head_runs_the_fine_tuned_head(tmp_path):
    """Found by a reviewer: base and fine-tune tie the head and both also store ``lm_head.weight``. The
    export ignores the stored heads, as transformers does, but ``materialize`` kept the base's stored
    head, so format=hf wrote it untied beside the reconstructed embedding: the variant's output layer
    was the base's. Now the materialised model's head is the reconstructed embedding."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    state = {k: v.clone() for k, v in LlamaForCausalLM(cfg).state_dict().items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()  # tied, and stored
    g = torch.Generator().manual_seed(1)
    ft_state = {k: v + 0.05 * torch.randn(v.shape, generator=g) if v.dim() == 2 else v.clone()
                for k, v in state.items()}
    ft_state["lm_head.weight"] = ft_state["model.embed_tokens.weight"].clone()
    for name, s in (("base", state), ("ft", ft_state)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg.to_dict()))
        save_file(s, tmp_path / name / "model.safetensors", metadata={"format": "pt"})
    bd.compress(tmp_path / "base", tmp_path / "ft", tmp_path / "art", variant="v")
    bd.export_hf(tmp_path / "base", tmp_path / "art", tmp_path / "hf")

    emb = "model.embed_tokens.weight"
    expected = _bitdelta_reference(state[emb], ft_state[emb], per_row=True)  # vocabulary matrices: α per row
    model = LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    torch.testing.assert_close(model.model.embed_tokens.weight.detach(), expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(model.get_output_embeddings().weight.detach(), expected, rtol=0, atol=1e-6)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["tie_word_embeddings"] is True


@pytest.mark.parametrize("values", [True, False])
def test_a_manifest_or_index_nested_past_the_json_parsers_depth_is_an_artifact_error(artifact_dir, tmp_path, values):
    """Found by a reviewer: JSON nested deeper than Python's parser recurses raised RecursionError, which
    is no ArtifactError (nor ValueError): it passed the server's handling of unusable artifacts and took
    its start down. It is a manifest (or an index) that does not parse."""
    deep = "[" * 100_000 + "]" * 100_000
    art = _copy_artifact(artifact_dir, tmp_path / "art")
    (art / "bitdelta.json").write_text(deep)
    with pytest.raises(ArtifactError, match=r"bitdelta\.json: cannot parse the manifest \(maximum recursion depth"):
        load_artifact(art, values=values)
    sharded = _copy_artifact(artifact_dir, tmp_path / "sharded")
    manifest = _reshard(sharded)
    (sharded / "delta.safetensors.index.json").write_text(deep)
    manifest["files"]["delta.safetensors.index.json"] = bd._sha256_file(sharded / "delta.safetensors.index.json")
    (sharded / "bitdelta.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=r"delta\.safetensors\.index\.json: not a safetensors index \(maximum "
                                            r"recursion depth"):
        load_artifact(sharded, values=values)


@pytest.mark.parametrize("values", [True, False])
def test_a_parameter_stored_both_in_full_and_as_signs_is_an_artifact_error(family, artifact_dir, tmp_path, values):
    """Found by a reviewer: an artifact holding ``P`` in full beside ``P.sign``/``P.alpha`` (the export
    never writes both) loaded, and ``materialize`` took the full tensor and dropped the signs without a
    word. Which of the two is the variant cannot be told: the reader refuses it, naming ``P``."""
    art = _copy_artifact(artifact_dir, tmp_path / "art")
    full = load_file(family[1] / "model.safetensors")[W]
    _rewrite_delta(art, lambda t: t.update({W: full}))
    with pytest.raises(ArtifactError, match=rf"art: {re.escape(W)} is stored both in full and as packed signs "
                                            rf"\({re.escape(W)}\.sign\)"):
        load_artifact(art, values=values)
