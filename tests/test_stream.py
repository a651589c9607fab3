"""deltafleet.checkpoint: the no-mmap safetensors reader the export streams through."""
from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import deltafleet.compress.bitdelta as bd
from deltafleet.checkpoint import Checkpoint, CheckpointError, read_header
from deltafleet.kernels import pack_signs


@pytest.fixture
def ckpt_dir(tmp_path):
    torch.manual_seed(0)
    tensors = {
        "a.weight": torch.randn(37, 19, dtype=torch.bfloat16),
        "b.weight": torch.randn(5, 3, 4, dtype=torch.float16),
        "c.bias": torch.randn(11),
        "d.scalar": torch.tensor(3.5, dtype=torch.float64),
        "e.ids": torch.arange(7, dtype=torch.int64),
        "f.empty": torch.zeros(0, 4),
    }
    save_file(tensors, tmp_path / "model.safetensors")
    return tmp_path, tensors


def test_reads_every_tensor_exactly(ckpt_dir):
    path, tensors = ckpt_dir
    ckpt = Checkpoint(path)
    assert ckpt.names() == sorted(tensors)
    assert ckpt.nbytes() == sum(t.numel() * t.element_size() for t in tensors.values())
    for name, t in tensors.items():
        got = ckpt.get(name)
        assert got.dtype == t.dtype and got.shape == t.shape, name
        assert torch.equal(got, t), name


def test_rows_and_flat_slices(ckpt_dir):
    path, tensors = ckpt_dir
    ckpt = Checkpoint(path)
    assert torch.equal(ckpt.get_rows("a.weight", 3, 10), tensors["a.weight"][3:10])
    # a 3-D tensor is read as [prod(shape[:-1]), shape[-1]]
    assert torch.equal(ckpt.get_rows("b.weight", 4, 9), tensors["b.weight"].reshape(15, 4)[4:9])
    assert torch.equal(ckpt.get_flat("c.bias", 2, 9), tensors["c.bias"][2:9])
    assert ckpt.get_rows("a.weight", 5, 5).shape == (0, 19)
    with pytest.raises(IndexError, match=r"rows 30:38 out of range for 37 rows"):
        ckpt.get_rows("a.weight", 30, 38)


def test_sharded_checkpoint_and_bad_index(ckpt_dir, tmp_path):
    path, tensors = ckpt_dir
    out = tmp_path / "sharded"
    out.mkdir()
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[:3]}, out / "model-00001-of-00002.safetensors")
    save_file({n: tensors[n] for n in names[3:]}, out / "model-00002-of-00002.safetensors")
    wm = {n: f"model-0000{1 if i < 3 else 2}-of-00002.safetensors" for i, n in enumerate(names)}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    ckpt = Checkpoint(out)
    for n in names:
        assert torch.equal(ckpt.get(n), tensors[n])
    wm[names[0]] = "model-00002-of-00002.safetensors"  # the index lies about where a tensor is
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    with pytest.raises(CheckpointError, match=r"'a.weight' is not in shard 'model-00002-of-00002"):
        Checkpoint(out)
    (out / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not a Hugging Face safetensors index"):
        Checkpoint(out)


def test_truncated_file_is_refused_before_any_read(ckpt_dir):
    path, _ = ckpt_dir
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=r"does not fit the file .*truncated or corrupt"):
        Checkpoint(path)


def _hdr(obj: bytes, data: bytes = b"") -> bytes:
    return struct.pack("<Q", len(obj)) + obj + data


@pytest.mark.parametrize(
    "header, match",
    [
        (b"\xff" * 8, "header length"),
        (_hdr(b"[1]"), "must be a JSON object"),
        (_hdr(b"{{{{"), "not valid JSON"),
        (_hdr(b'{"x": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 1]}}', b"\0"), "malformed header entry for 'x'"),
        (_hdr(b'{"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}', b"\0" * 8), "byte range"),
        (_hdr(b'{"x": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}', b"\0" * 8), "malformed shape"),
    ],
    ids=["length", "not-object", "not-json", "dtype", "size", "negative-dim"],
)
def test_malformed_headers(tmp_path, header, match):
    f = tmp_path / "model.safetensors"
    f.write_bytes(header)
    with pytest.raises(CheckpointError, match=match):
        read_header(f)


def test_blocked_export_equals_whole_matrix_export(tmp_path):
    """Δ read in blocks of rows gives the same artifact bytes as one block per matrix."""
    torch.manual_seed(1)
    base = {"w": torch.randn(50, 24, dtype=torch.bfloat16), "lm_head.weight": torch.randn(40, 24)}
    ft = {k: (v.float() + 0.01 * torch.randn_like(v.float())).to(v.dtype) for k, v in base.items()}
    for d, sd in (("base", base), ("ft", ft)):
        (tmp_path / d).mkdir()
        save_file(sd, tmp_path / d / "model.safetensors")
    b, f = Checkpoint(tmp_path / "base"), Checkpoint(tmp_path / "ft")
    whole = {k: v for _, _, stored, _ in bd._compress_tensors(b, f, "matrix") for k, v in stored.items()}
    blocked = {k: v for _, _, stored, _ in bd._compress_tensors(b, f, "matrix", block_elements=7 * 24)
               for k, v in stored.items()}
    assert whole.keys() == blocked.keys() == {"w.sign", "w.alpha", "lm_head.weight.sign", "lm_head.weight.alpha"}
    for k in whole:
        assert torch.equal(whole[k], blocked[k]), k
    delta = ft["w"].float() - base["w"].float()
    assert blocked["w.alpha"].item() == pytest.approx(delta.double().abs().mean().item(), rel=1e-6)


def test_export_reads_without_memory_map(tmp_path, monkeypatch):
    """The export never opens a checkpoint through safetensors' memory-mapped reader."""
    import safetensors

    base = {"w": torch.randn(8, 16)}
    for d, sd in (("base", base), ("ft", {"w": base["w"] + 1})):
        (tmp_path / d).mkdir()
        save_file(sd, tmp_path / d / "model.safetensors")

    def refuse(*a, **k):
        raise AssertionError("safe_open used")

    monkeypatch.setattr(safetensors, "safe_open", refuse)
    monkeypatch.setattr(bd, "safe_open", refuse)
    bd.fingerprint(tmp_path / "base")
    stored = {k: v for _, _, s, _ in bd._compress_tensors(Checkpoint(tmp_path / "base"),
                                                          Checkpoint(tmp_path / "ft"), "matrix")
              for k, v in s.items()}
    assert stored["w.alpha"].item() == 1.0
    assert torch.equal(stored["w.sign"], torch.full((8, 2), 255, dtype=torch.uint8))
    assert load_file(tmp_path / "ft" / "model.safetensors")["w"].shape == (8, 16)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n=st.integers(1, 40),
    k=st.integers(1, 40),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    granularity=st.sampled_from(["matrix", "row"]),
    block_rows=st.integers(1, 50),
    seed=st.integers(0, 2**31 - 1),
)
def test_streamed_signs_and_alpha_match_the_dense_definition(tmp_path_factory, n, k, dtype, granularity,
                                                            block_rows, seed):
    """Any shape, dtype, granularity and block size: signs = pack(Δ > 0), α = mean|Δ| (BitDelta Eq. 1)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, k, generator=g).to(dtype)
    ft = (base.float() + 0.05 * torch.randn(n, k, generator=g)).to(dtype)
    d = tmp_path_factory.mktemp("pair")
    for name, t in (("base", base), ("ft", ft)):
        (d / name).mkdir()
        save_file({"w": t}, d / name / "model.safetensors")
    out = {k_: v for _, _, s, _ in bd._compress_tensors(Checkpoint(d / "base"), Checkpoint(d / "ft"), granularity,
                                                         block_elements=block_rows * k) for k_, v in s.items()}
    delta = ft.double() - base.double()
    if not bool(delta.any()):
        assert out == {}
        return
    assert torch.equal(out["w.sign"], pack_signs(delta.float()))
    want = delta.abs().mean(dim=1) if granularity == "row" else delta.abs().mean()
    assert out["w.alpha"].dtype == torch.float32 and out["w.alpha"].shape == want.shape
    torch.testing.assert_close(out["w.alpha"].double(), want, rtol=1e-6, atol=0)
