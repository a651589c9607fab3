"""The synthetic family (serve/synthetic.py): a base and variants generated on the device, each
tensor-parallel rank its own slice. Served by ``serve/run.py synthetic=... tp=2`` (two gloo ranks)
through the real openai client it answers like one process; the memory it predicts is the bytes of
the tensors it builds."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deltafleet.serve.batch import DeltaSlots
from deltafleet.serve.synthetic import SyntheticFamily, check_options, predict_memory, read_synthetic, write_base_dir
from deltafleet.serve.tp import TPContext

REPO = Path(__file__).resolve().parents[1]
SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)
# alpha as large as the weights' std, so that every variant's greedy text differs from the base's
OPTS = {"shape": SHAPE, "variants": 3, "seed": 7, "std": 0.02, "alpha": 0.02}
# the repository first, then the caller's PYTHONPATH (where a GPU host keeps extra wheels)
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))}
LLAMA_2_70B = dict(vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                   num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    from deltafleet.serve.bench import stdlib_tokenizer

    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    stdlib_tokenizer(out, SHAPE["vocab_size"], SHAPE["max_position_embeddings"])
    return out


def _tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t.data_ptr() not in seen:  # a tied head is the embedding
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


# ---------------------------------------------------------------------------------------- memory


@pytest.mark.parametrize("sign_layout", ["rows", "tiled"])
@pytest.mark.parametrize("layout", ["llama-gqa", "llama-bias-tied"])
@pytest.mark.parametrize("world", [1, 2])
def test_predicted_memory_is_the_bytes_of_the_tensors(layout, world, sign_layout):
    shape = dict(SHAPE, **({"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True}
                           if layout == "llama-bias-tied" else {}))
    fam = SyntheticFamily(shape, variants=3)
    for rank in range(world):
        model = fam.build_base("cpu", torch.bfloat16, tp=None if world == 1 else (rank, world, None))
        slots = DeltaSlots(model, 3, sign_layout)
        cache = model.new_cache(4, 32)
        got = predict_memory(shape, world=world, rank=rank, n_slots=3, dtype=torch.bfloat16, max_batch=4, max_seq_len=32,
                             sign_layout=sign_layout)
        assert got["base_bytes"] == _tensor_bytes(model.parameters()), (rank, "base")
        assert got["params"] == sum(p.numel() for p in model.parameters())
        assert got["slots_bytes"] == _tensor_bytes([*slots.signs.values(), *slots.alphas.values(), *slots.full.values()])
        assert got["slot_bytes"] == DeltaSlots.bytes_per_slot(model, sign_layout) == slots.slot_bytes
        assert got["kv_cache_bytes"] == _tensor_bytes([t for c in cache for t in (c.k, c.v)])
        assert got["total_bytes"] == got["base_bytes"] + got["slots_bytes"] + got["kv_cache_bytes"]
    if layout == "llama-bias-tied" and world == 2:  # rank 0 alone adds the row-parallel biases
        assert predict_memory(shape, world=2, rank=0)["params"] - predict_memory(shape, world=2, rank=1)["params"] \
            == SHAPE["num_hidden_layers"] * (SHAPE["hidden_size"] + SHAPE["hidden_size"])  # o_proj + down_proj


def test_a_shape_the_ranks_cannot_cut_is_refused_as_shard_model_refuses_it():
    """Found by a reviewer: a row-parallel width that is not whole sign bytes per rank was predicted,
    while the server refuses the shape."""
    shape = dict(SHAPE, intermediate_size=344)  # 172 per rank of 2: not a multiple of 8
    assert predict_memory(shape, world=1)["params"] > 0
    with pytest.raises(ValueError, match=r"^down_proj: K = 344 over 2 ranks is not a multiple of 8 per rank"):
        predict_memory(shape, world=2)
    with pytest.raises(ValueError, match=r"down_proj.*: K = 344 over 2 ranks is not a multiple of 8 per rank"):
        SyntheticFamily(shape, variants=1).build_base("cpu", torch.float32, tp=(0, 2, None))


def test_70b_prediction_against_its_published_parameter_count():
    with pytest.raises(ValueError, match=r"^sign_layout must be one of \('rows', 'tiled'\), got 'cols'$"):
        predict_memory(LLAMA_2_70B, sign_layout="cols")  # not sized as rows
    whole = predict_memory(LLAMA_2_70B, world=1, n_slots=0)
    assert whole["params"] == 68_976_648_192  # Llama-2-70B
    assert whole["base_bytes"] == 2 * 68_976_648_192  # bf16: the 138 GB that cannot be written there
    replicated = 2 * 32000 * 8192 + (2 * 80 + 1) * 8192  # embedding, head, norms
    r0 = predict_memory(LLAMA_2_70B, world=2, rank=0, n_slots=14, max_batch=16, max_seq_len=1024)
    assert r0["params"] == (68_976_648_192 - replicated) // 2 + replicated
    signs = (68_976_648_192 - replicated) // 2 // 8 + 2 * 32000 * 8192 // 8  # 1 bit per weight of the slice
    alphas = 4 * (80 * (4096 + 512 + 512 + 8192 + 14336 + 14336 + 8192) + 2 * 32000)  # fp32 per row of the slice
    assert r0["slot_bytes"] == signs + alphas + 2 * (2 * 80 + 1) * 8192
    assert r0["kv_cache_bytes"] == 2 * 80 * 16 * 4 * 1024 * 128 * 2  # K and V, 4 of the 8 KV heads per rank
    assert 120 * 2**30 < r0["total_bytes"] < 130 * 2**30  # fits in an H200's ~139 GiB, with room to run
    assert predict_memory(LLAMA_2_70B, world=2, rank=1, n_slots=14, max_batch=16, max_seq_len=1024) == r0  # no biases


# ---------------------------------------------------------------------------------------- the family


def test_rank_slices_are_cut_from_the_same_whole_model():
    fam = SyntheticFamily(SHAPE, variants=2, seed=3)
    whole = fam.build_base()
    ranks = [fam.build_base(tp=(r, 2, None)) for r in range(2)]
    q = "layers.1.self_attn.q_proj.weight"
    down = "layers.0.mlp.down_proj.weight"
    p = [dict(m.named_parameters()) for m in ranks]
    w = dict(whole.named_parameters())
    assert torch.equal(torch.cat([p[0][q], p[1][q]], 0), w[q])  # column parallel: rows
    assert torch.equal(torch.cat([p[0][down], p[1][down]], 1), w[down])  # row parallel: columns
    for name in ("embed_tokens.weight", "lm_head.weight", "norm.weight"):
        assert torch.equal(p[1][name], w[name])
    assert torch.equal(w["norm.weight"], torch.ones(64)) and 0.015 < float(w[q].std()) < 0.025
    assert not torch.equal(w[q], w["layers.0.self_attn.q_proj.weight"])  # a seed per parameter
    assert torch.equal(SyntheticFamily(SHAPE, variants=2, seed=3).build_base().lm_head.weight, w["lm_head.weight"])
    assert not torch.equal(SyntheticFamily(SHAPE, variants=2, seed=4).build_base().lm_head.weight, w["lm_head.weight"])
    # the variants' signs: the ranks' slots hold the whole variant's cut (row-layout slots, to cut)
    slots = DeltaSlots(whole, 2, sign_layout="rows")
    whole_v1 = slots.put(fam.variant("v01"))
    for m, r in zip(ranks, range(2)):
        v = DeltaSlots(m, 2, sign_layout="rows").put(fam.variant("v01", tp=(r, 2, None)))
        name = "model.layers.0.mlp.down_proj.weight"
        assert torch.equal(v.signs[name], whole_v1.signs[name][:, 8 * r:8 * (r + 1)])
        name = "model.layers.0.self_attn.k_proj.weight"
        assert torch.equal(v.signs[name], whole_v1.signs[name][16 * r:16 * (r + 1)])
        assert torch.equal(v.alphas[name], torch.full((16,), 1e-3))
    v0 = slots.put(fam.variant("v00"))
    assert not torch.equal(v0.signs[name], whole_v1.signs[name])
    with pytest.raises(KeyError, match="no synthetic variant 'v02'"):
        fam.variant("v02")


def test_pad_bits_are_zero_and_options_are_checked():
    fam = SyntheticFamily(dict(SHAPE, intermediate_size=132), variants=1)  # down_proj: K = 132, 4 pad bits
    sign = fam.variant("v00").signs["model.layers.0.mlp.down_proj.weight"]
    assert sign.shape == (64, 17) and int((sign[:, -1] >> 4).max()) == 0 and int(sign[:, -1].max()) > 0
    assert check_options({"shape": SHAPE})["variants"] == 14
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['varients'\]"):
        check_options({"shape": SHAPE, "varients": 3})
    with pytest.raises(ValueError, match="`shape`"):
        check_options({"variants": 3})
    with pytest.raises(ValueError, match="variants must be an integer ≥ 1"):
        check_options({"shape": SHAPE, "variants": 0})


def _without(key: str) -> dict:
    return {k: v for k, v in SHAPE.items() if k != key}


# Found by a fresh user: each of these ended `serve/run.py synthetic=...` in a traceback (a shape that
# is no mapping, or lacks a field; a std torch refuses; a layer count of 0 or 2.5; a shape the config
# or RoPE cannot take), or was served (variants 2.7 or true, std 0 or NaN: a family of zero weights).
@pytest.mark.parametrize("opts, message", [
    ({"shape": 5}, "synthetic: shape must be a mapping of Hugging Face config fields (vocab_size, hidden_size, "
                   "intermediate_size, num_hidden_layers, num_attention_heads, ...), got 5"),
    ({"shape": _without("vocab_size")}, "synthetic: shape.vocab_size is required (the shape needs vocab_size, "
                                        "hidden_size, intermediate_size, num_hidden_layers, num_attention_heads)"),
    ({"shape": _without("intermediate_size")}, "synthetic: shape.intermediate_size is required (the shape needs "
                                               "vocab_size, hidden_size, intermediate_size, num_hidden_layers, "
                                               "num_attention_heads)"),
    ({"shape": dict(SHAPE, num_hidden_layers=0)}, "synthetic: shape.num_hidden_layers must be an integer ≥ 1, got 0"),
    ({"shape": dict(SHAPE, num_hidden_layers=2.5)}, "synthetic: shape.num_hidden_layers must be an integer ≥ 1, "
                                                    "got 2.5"),
    ({"shape": dict(SHAPE, vocab_size=True)}, "synthetic: shape.vocab_size must be an integer ≥ 1, got True"),
    ({"shape": dict(SHAPE, num_key_value_heads=-2)}, "synthetic: shape.num_key_value_heads must be an integer ≥ 1, "
                                                     "got -2"),
    ({"shape": dict(SHAPE, max_position_embeddings="128")}, "synthetic: shape.max_position_embeddings must be an "
                                                            "integer ≥ 1, got '128'"),
    ({"shape": dict(SHAPE, hidden_size=66)}, "synthetic: shape.hidden_size (66) must be a multiple of "
                                             "shape.num_attention_heads (4)"),
    ({"shape": dict(SHAPE, num_key_value_heads=3)}, "synthetic: shape.num_attention_heads (4) must be a multiple of "
                                                    "shape.num_key_value_heads (3)"),
    ({"shape": dict(SHAPE, hidden_size=28)}, "synthetic: the shape's head_dim (7: hidden_size / num_attention_heads) "
                                             "must be even (RoPE rotates pairs of dimensions)"),
    ({"shape": dict(SHAPE, model_type="gpt2")}, "synthetic: shape is not a model this server serves: model_type "
                                                "'gpt2' is not served (supported: ('llama', 'mistral', 'qwen2'))"),
    # found by a second fresh user: a traceback (exit 1), or a server whose every request failed
    ({"shape": dict(SHAPE, rope_theta=-1)}, "synthetic: shape.rope_theta must be a finite number > 0, got -1"),
    ({"shape": dict(SHAPE, rms_norm_eps="abc")}, "synthetic: shape.rms_norm_eps must be a finite number > 0, "
                                                 "got 'abc'"),
    ({"shape": dict(SHAPE, torch_dtype="int8")}, "synthetic: shape.torch_dtype is not part of a shape: the dtype "
                                                 "served is the `dtype` setting"),
    ({"shape": dict(SHAPE, attention_bias="yes")}, "synthetic: shape is not a valid Llama config: Validation error "
                                                   "for field 'attention_bias': TypeError: Field 'attention_bias' "
                                                   "expected bool, got str (value: 'yes')"),
    ({"variants": 2.7}, "synthetic: variants must be an integer ≥ 1, got 2.7"),
    ({"variants": True}, "synthetic: variants must be an integer ≥ 1, got True"),
    ({"variants": "3"}, "synthetic: variants must be an integer ≥ 1, got '3'"),
    ({"seed": 1.5}, "synthetic: seed must be an integer, got 1.5"),
    ({"std": -1}, "synthetic: std (of the base's weights) must be a finite number > 0, got -1"),
    ({"std": 0}, "synthetic: std (of the base's weights) must be a finite number > 0, got 0"),
    ({"std": float("nan")}, "synthetic: std (of the base's weights) must be a finite number > 0, got nan"),
    ({"std": float("inf")}, "synthetic: std (of the base's weights) must be a finite number > 0, got inf"),
    ({"alpha": -1e-3}, "synthetic: alpha (every delta matrix's ±α) must be a finite number ≥ 0, got -0.001"),
    ({"alpha": float("inf")}, "synthetic: alpha (every delta matrix's ±α) must be a finite number ≥ 0, got inf"),
    ({"tokenizer_dir": 5}, "synthetic: tokenizer_dir must be null or a tokenizer's folder, got 5"),
    (5, "synthetic must be null or a mapping of shape, variants, seed, std, alpha, tokenizer_dir; got 5"),
])
def test_a_bad_synthetic_option_is_refused_by_name(opts, message):
    check_options({"shape": SHAPE, "variants": 2, "std": 0.02, "alpha": 0, "tokenizer_dir": "tok"})  # these pass
    check_options({"shape": dict(SHAPE, num_key_value_heads=None, head_dim=32)})  # null: the field's default
    check_options({"shape": dict(SHAPE, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)})
    with pytest.raises(ValueError) as e:
        check_options({"shape": SHAPE, **opts} if isinstance(opts, dict) else opts)
    assert str(e.value) == message


def test_the_folder_holds_no_weights_and_pads_the_tokenizer(tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    base = write_base_dir(tmp_path / "base", OPTS, tokenizer_dir)
    assert not list(base.glob("*.safetensors"))
    assert len(AutoTokenizer.from_pretrained(base)) == SHAPE["vocab_size"]
    assert read_synthetic(base) == SyntheticFamily(read_synthetic(base).config, variants=3, seed=7, alpha=0.02)
    assert read_synthetic(tmp_path) is None
    with pytest.raises(ValueError, match="more than shape.vocab_size=300"):
        write_base_dir(tmp_path / "small", {**OPTS, "shape": dict(SHAPE, vocab_size=300)}, tokenizer_dir)


class _OneRank(TPContext):
    """Rank 0 of a tensor-parallel world of one, recording what it announces to the (absent) others."""

    def __init__(self):
        super().__init__(0, 1)
        self.sent = []

    def _broadcast(self, cmd):
        self.sent.append(cmd)

    def _gather(self, reply):  # rank 0's own place only: no follower to answer a load
        return [None]


def test_a_variant_evicted_to_the_host_tier_comes_back_and_the_ranks_are_told(tokenizer_dir, tmp_path):
    """One slot for three variants: each load evicts the previous one to the host tier, and a load from
    there announces the variant's source again (it was lost with the slot's views)."""
    from deltafleet.serve.engine import Engine, SamplingParams

    base = write_base_dir(tmp_path / "base", OPTS, tokenizer_dir)
    tp = _OneRank()
    eng = Engine(base, None, family="syn", tp=tp, delta_cache={"device_slots": 1, "host_budget_bytes": 10**9})
    greedy = SamplingParams(max_tokens=6, temperature=0)
    first = eng.complete("syn-v00", "def main(", greedy).text
    eng.complete("syn-v01", "def main(", greedy)
    assert eng.cache.tier("syn-v00") == "host"
    again = eng.complete("syn-v00", "def main(", greedy).text
    loads = [c for c in tp.sent if c[0] == "load"]
    # ("load", rank 0's read, source, slot, from the host tier, stamp): the last from the host copy of read 0
    assert loads == [("load", 0, "synthetic:v00", 0, False, None), ("load", 1, "synthetic:v01", 0, False, None),
                     ("load", 0, "synthetic:v00", 0, True, None)]
    assert again == first
    eng.shutdown()


# ---------------------------------------------------------------------------------------- the server


def _free_ports(n: int) -> list[int]:
    from tests.conftest import free_port

    ports: list[int] = []
    for _ in range(n):
        ports.append(free_port(tuple(ports)))
    return ports


def _tp_server(tokenizer_dir, tmp_path: Path, port: int, tp_port: int, out) -> subprocess.Popen:
    """``serve/run.py`` over the synthetic family of :data:`OPTS` as two gloo ranks, its output to ``out``."""
    from deltafleet.serve.bench import hydra_value

    return subprocess.Popen([sys.executable, "serve/run.py", f"synthetic={hydra_value({**OPTS, 'tokenizer_dir': tokenizer_dir})}",
                             "model.name=syn", f"port={port}", f"tp_port={tp_port}", "tp=2", "threads=1",
                             "log_level=warning", f"hydra.run.dir={tmp_path / 'run'}", f"paths.root={tmp_path}"],
                            cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=ENV)


def test_a_synthetic_family_served_tensor_parallel_answers_like_one_process(tokenizer_dir, tmp_path):
    """``serve/run.py tp=2 synthetic=...`` (two gloo ranks, each generating its slices): every variant is
    listed with its parent and resident before the server answers; greedy answers through the openai
    client, sent together (mixed batches), equal a one-process engine's of the same seed; variants
    differ from the base."""
    import httpx
    import openai

    from deltafleet.serve.engine import Engine, SamplingParams
    from tests.conftest import complete_concurrently, stop_server, wait_healthy

    port, tp_port = _free_ports(2)
    log = open(tmp_path / "server.log", "w")
    proc = _tp_server(tokenizer_dir, tmp_path, port, tp_port, log)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, tmp_path / "server.log", 180)
        listed = {m["id"]: m["parent"] for m in httpx.get(url + "/v1/models").json()["data"]}
        assert listed == {"syn": None, "syn-v00": "syn", "syn-v01": "syn", "syn-v02": "syn"}
        cache = httpx.get(url + "/v1/delta_cache").json()["variants"]
        assert {m: v["tier"] for m, v in cache.items()} == {f"syn-v0{i}": "device" for i in range(3)}  # preloaded
        assert (tmp_path / "run" / "synthetic-base" / "synthetic.json").is_file()

        ref = Engine(write_base_dir(tmp_path / "ref", OPTS, tokenizer_dir), None, family="syn")  # one process
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        prompts = ("def main(", "The quick brown")
        jobs = [(m, p) for m in listed for p in prompts]
        got = complete_concurrently(client, jobs, 8, 180)
        want = {(m, p): ref.complete(m, p, SamplingParams(max_tokens=8, temperature=0)).text for m, p in jobs}
        assert got == want
        texts = {m: tuple(want[(m, p)] for p in prompts) for m in listed}
        assert len(set(texts.values())) == 4, texts  # every variant answers its own way, none like the base
    finally:
        stop_server(proc, log, 30)


def test_a_port_taken_once_the_ranks_start_ends_the_server_with_its_error(tokenizer_dir, tmp_path):
    """The launcher checks the port before it starts the ranks, rank 0 again before it serves; in
    between something else may take it. Rank 0 then exits with its error line while the other rank
    is still in a collective of its own start (a synthetic base checks its replicas): the launcher
    must exit 2 with that line, and no rank may be left behind (a broadcast to stop them waited for
    that rank forever)."""
    import signal
    import socket
    import time

    from tests.conftest import process_alive, started_ranks

    port, tp_port = _free_ports(2)
    log = tmp_path / "server.log"
    ranks: list[str] = []
    with open(log, "w") as out:
        proc = _tp_server(tokenizer_dir, tmp_path, port, tp_port, out)
        try:
            ranks = started_ranks(proc, log)
            with socket.socket() as taken:
                taken.bind(("127.0.0.1", port))
                taken.listen()
                assert proc.wait(timeout=60) == 2, log.read_text()[-2000:]
        finally:
            if proc.poll() is None:
                proc.kill()
            time.sleep(0.5)
            left = [pid for pid in ranks if process_alive(pid)]
            for pid in left:  # the ranks have process groups of their own: the launcher's kill misses them
                os.kill(int(pid), signal.SIGKILL)
    assert not left, f"ranks left behind: {left}"
    text = log.read_text()
    assert f"error: cannot listen on 127.0.0.1:{port}" in text and "Traceback" not in text, text[-2000:]


@pytest.mark.parametrize("value, message", [
    ("{variants: 3}", "error: synthetic: `shape`"),
    ("{shape: 5}", "error: synthetic: shape must be a mapping"),  # a traceback (exit 1) once
    ("{shape: {hidden_size: 64}}", "error: synthetic: shape.vocab_size is required"),  # the same
    # found by a second fresh user: {} served the family on disk as if null; a tokenizer folder that is
    # missing or holds none gave a model hub message, or five lines
    ("{}", "error: synthetic: `shape`"),
    ("{shape: {vocab_size: 512, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, "
     "num_attention_heads: 4}, tokenizer_dir: /nonexistent}", "error: synthetic: tokenizer_dir /nonexistent is not "
                                                               "a folder"),
    ("{shape: {vocab_size: 512, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, "
     "num_attention_heads: 4}, tokenizer_dir: conf}", "error: synthetic: tokenizer_dir conf holds no tokenizer "
                                                      "transformers can read: "),
])
def test_bad_synthetic_options_are_named_before_anything_starts(tmp_path, value, message):
    r = subprocess.run([sys.executable, "serve/run.py", f"synthetic={value}", f"hydra.run.dir={tmp_path}",
                        f"paths.root={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env=ENV)
    assert r.returncode == 2 and r.stderr.startswith(message) and r.stderr.count("\n") == 1, r.stderr[-2000:]
