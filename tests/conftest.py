"""Shared fixtures: a tiny model family (tokenizer + base + variants + BitDelta artifacts) on disk.

Layout under the fixture's root, the same as the pipeline's (``conf/paths``)::

    models/base/            HF LlamaForCausalLM checkpoint + tokenizer (vocab 512, hidden 64,
                            2 layers, 4 heads, 2 kv heads)
    models/<variant>/       "fine-tuned" checkpoints: the base's weights perturbed
    artifacts/<variant>/    their BitDelta artifacts (compress.bitdelta.compress, matrix granularity)

Variants: ``coder`` perturbs every matrix; ``writer`` also changes the final norm and one layer's
input norm (stored in full in the artifact).
"""
from __future__ import annotations

import json
import os
import sysconfig

# Triton's CPU interpreter must be chosen before anything imports triton (DeepSpeed and torch do,
# early): set for the whole session unless the Triton tests are pointed at a GPU.
TRITON_DEVICE = os.environ.get("DELTAFLEET_TRITON_DEVICE", "cpu")
if TRITON_DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
# pytest-xdist's workers fill the cores (`make test`: one per logical CPU). Each worker, and every
# process it starts (training runs, servers), then uses one OpenMP thread: more would spin-wait
# against the other workers' (a real-base fine-tune took 3x its time alone beside the compile test).
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

STDLIB_FILES = ("textwrap.py", "string.py", "fnmatch.py", "shlex.py")


@dataclass
class TinyFamily:
    root: Path  # paths.root
    base_dir: Path
    artifacts_dir: Path
    variants: dict[str, Path]  # variant name → fine-tuned checkpoint dir
    family: str = "tiny"


def train_tiny_tokenizer(out_dir: Path, data_dir: Path, vocab_size: int = 512):
    """The family's byte-level BPE (``deltafleet.train.tokenizer``: eos ``<|endoftext|>``, role tokens, chat
    template), trained on a few stdlib modules."""
    from deltafleet.train.tokenizer import train_tokenizer

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    data_dir.mkdir(parents=True, exist_ok=True)
    corpus = data_dir / "tokenizer_corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": (stdlib / f).read_text()}) + "\n" for f in STDLIB_FILES))
    return train_tokenizer([corpus], vocab_size, out_dir)


def write_tiny_gguf(path: Path, tokenizer_dir: Path, dim: int = 64, layers: int = 2, heads: int = 4,
                    kv_heads: int = 2, ffn: int = 160, seed: int = 0) -> Path:
    """A small random Llama as a GGUF file, written with the ``gguf`` package the way llama.cpp lays one
    out: the byte-level BPE of ``tokenizer_dir`` (``tokenizer.ggml.model = gpt2``: its tokens, merges,
    special tokens as control tokens, chat template), float32 tensors under llama.cpp's names, and no
    ``output.weight`` (a tied head, as SmolLM2's). Returns ``path``."""
    import gguf
    import numpy as np

    tj = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    added = {t["content"]: t["id"] for t in tj.get("added_tokens", [])}
    vocab = {**tj["model"]["vocab"], **added}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))  # dense ids
    eos = added["<|endoftext|>"]
    hd, rng = dim // heads, np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama-test")
    w.add_context_length(256)
    w.add_embedding_length(dim)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(hd)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in added else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]])
    w.add_bos_token_id(eos)
    w.add_eos_token_id(eos)
    w.add_chat_template((tokenizer_dir / "chat_template.jinja").read_text())

    def add(name: str, *shape: int, scale: float = 0.08, one: bool = False):
        x = scale * rng.standard_normal(shape)
        w.add_tensor(name, ((1.0 + x) if one else x).astype(np.float32))

    add("token_embd.weight", len(tokens), dim, scale=0.1)
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", dim, scale=0.1, one=True)
        add(f"blk.{i}.attn_q.weight", dim, dim)
        add(f"blk.{i}.attn_k.weight", kv_heads * hd, dim)
        add(f"blk.{i}.attn_v.weight", kv_heads * hd, dim)
        add(f"blk.{i}.attn_output.weight", dim, dim)
        add(f"blk.{i}.ffn_norm.weight", dim, scale=0.1, one=True)
        add(f"blk.{i}.ffn_gate.weight", ffn, dim)
        add(f"blk.{i}.ffn_up.weight", ffn, dim)
        add(f"blk.{i}.ffn_down.weight", dim, ffn)
    add("output_norm.weight", dim, scale=0.1, one=True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tiny_llama(vocab_size: int, seed: int = 0, **overrides):
    """A random tiny LlamaForCausalLM with non-trivial norms (so that norms matter in comparisons)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    kw = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              initializer_range=0.1, bos_token_id=None, eos_token_id=0, pad_token_id=0)
    kw.update(overrides)
    model = LlamaForCausalLM(LlamaConfig(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    return model


def perturb(model, seed: int, scale: float = 0.5, norms: tuple[str, ...] = ()):
    """A "fine-tune" of ``model``: every matrix += scale·std(W)·noise; the named norms change too."""
    torch.manual_seed(seed)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    for k, v in sd.items():
        if v.dim() == 2:
            v += scale * v.std() * torch.randn_like(v)
        elif k in norms:
            v += 0.3 * torch.randn_like(v)
    return sd


def build_tiny_family(root: Path, variants: tuple[str, ...] = ("coder", "writer"), **shape) -> TinyFamily:
    """Tokenizer, base, the ``variants``' fine-tunes and their artifacts under ``root`` (module
    docstring); ``shape``: ``LlamaConfig`` overrides of :func:`tiny_llama`'s shape (hidden_size, ...)."""
    from deltafleet.compress.bitdelta import compress

    models, artifacts = root / "models", root / "artifacts"
    base_dir = models / "base"
    tok = train_tiny_tokenizer(base_dir, root / "data")
    kw = dict(shape, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    base = tiny_llama(len(tok), seed=0, **kw)
    base.save_pretrained(base_dir)
    norms = {"writer": ("model.norm.weight", "model.layers.1.input_layernorm.weight")}
    out = {}
    for i, v in enumerate(variants):
        sd = perturb(base, seed=100 + i, norms=norms.get(v, ()))
        ft = tiny_llama(len(tok), seed=0, **kw)
        ft.load_state_dict(sd)
        ft.save_pretrained(models / v)
        compress(base_dir, models / v, artifacts / v, variant=v)
        out[v] = models / v
    return TinyFamily(root, base_dir, artifacts, out)


def record_groupings(monkeypatch, long_m: int | None = None) -> list[list[int]]:
    """Make ``BatchDeltas`` multiply grouped by variant from two rows on (the GPU path, run here under
    Triton's interpreter) and record every grouping: the slots each ``group_rows`` call was given,
    in the returned list. ``long_m``: also cut each variant's run into whole blocks of that many rows
    first (``grouped_long_m``, Hopper's prompt-chunk blocks), wherever the batch holds one."""
    from deltafleet.kernels import triton_grouped
    from deltafleet.serve import batch

    groupings, real = [], triton_grouped.group_rows

    def group_rows(slot, n_slots, block_m=None, long_m=None):
        groupings.append(slot.tolist())
        return real(slot, n_slots, block_m, long_m)

    if long_m is not None:
        monkeypatch.setattr(triton_grouped, "grouped_long_m", lambda m, device: long_m if m >= long_m else None)

    monkeypatch.setattr(batch.BatchDeltas, "grouped",
                        staticmethod(lambda x2, sign_products=False: sign_products or x2.shape[0] >= 2))
    monkeypatch.setattr(batch, "bitdelta_linear_grouped", triton_grouped.bitdelta_linear_grouped)
    monkeypatch.setattr(batch, "bitdelta_linears_grouped", triton_grouped.bitdelta_linears_grouped)
    monkeypatch.setattr(triton_grouped, "group_rows", group_rows)
    return groupings


# Test modules by their time on a 2-core machine, longest first (each over a minute): see
# pytest_collection_modifyitems.
LONGEST = ("test_kernels_compile.py", "test_real_base.py", "test_kernels_triton.py", "test_e2e.py",
           "test_callback.py", "test_bench_serve.py", "test_kernels_tiled.py")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` run only on a CUDA device with the Triton kernels compiled for it
    (``DELTAFLEET_TRITON_DEVICE=cuda``, as ``make test-gpu`` sets; under the CPU interpreter a
    kernel cannot launch on CUDA tensors inside a CUDA graph, and the Gluon kernels not at all);
    elsewhere they are collected and skipped.

    The longest modules (:data:`LONGEST`, the ahead-of-time compiles first: minutes of compiling)
    are collected first, longest first, so that pytest-xdist (``make test``, one file per worker at
    a time) starts them at once and the short ones fill in after, instead of a long one running
    alone at the end."""
    rank = {f"tests/{name}": i for i, name in enumerate(LONGEST)}
    items.sort(key=lambda i: rank.get(i.nodeid.split("::", 1)[0], len(LONGEST)))  # stable: file order kept
    if TRITON_DEVICE == "cuda" and torch.cuda.is_available():
        return
    why = ("no CUDA device" if not torch.cuda.is_available()
           else "the Triton kernels run in the CPU interpreter: set DELTAFLEET_TRITON_DEVICE=cuda (make test-gpu)")
    skip = pytest.mark.skip(reason=f"gpu test: {why}")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_family(tmp_path_factory) -> TinyFamily:
    """Base + ``coder`` + ``writer`` variants and their artifacts, built once per session."""
    return build_tiny_family(tmp_path_factory.mktemp("tiny_family"))


@pytest.fixture(scope="module")
def engine(tiny_family):
    """An engine serving the tiny family in-process (its own scheduler thread), one per test module."""
    from deltafleet.serve.engine import Engine

    return Engine(tiny_family.base_dir, tiny_family.artifacts_dir, family="tiny")


@pytest.fixture(scope="module")
def tc(engine):
    """The app over ``engine`` through Starlette's ``TestClient``."""
    from fastapi.testclient import TestClient

    from deltafleet.serve.app import create_app

    with TestClient(create_app(engine)) as tc:
        yield tc


def is_utf8(b: bytes) -> bool:
    """Whether ``b`` is whole UTF-8 text (a token's bytes may be a piece of a character)."""
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def api_error(r, status: int) -> dict:
    """The OpenAI error object of the HTTP response ``r``, asserting its status and JSON shape."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def free_port(taken: tuple[int, ...] = ()) -> int:
    """A TCP port free on 127.0.0.1 now and not in ``taken``, drawn below the kernel's ephemeral
    range: a port bound to 0 comes from that range, where an outgoing connection made before the
    server binds (a client's, or gloo's between tensor-parallel workers) can take it first."""
    import random
    import socket

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux
        low = 32768
    rng = random.Random()  # seeded from the OS: pytest-xdist workers do not draw in step
    for _ in range(200):
        port = rng.randrange(max(1024, low // 2), low)
        if port in taken:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use
                continue
            return port
    with socket.socket() as s:  # all taken: the ephemeral range after all
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc, url: str, log: Path, timeout_s: float) -> None:
    """Wait until the server process ``proc`` answers ``GET {url}/health`` with 200. If it exits or
    ``timeout_s`` seconds pass, kill it and fail the test with the end of its ``log``."""
    import time

    import httpx

    deadline = time.time() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail(f"the server at {url} did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


def started_ranks(proc, log: Path, n: int = 2, timeout_s: float = 60) -> list[str]:
    """The pids of the ``n`` rank processes that the tensor-parallel launcher ``proc`` (``serve/run.py
    tp=n``) started, once they all run; fails with the end of its ``log`` if the launcher exits or
    ``timeout_s`` seconds pass first."""
    import subprocess
    import time

    deadline = time.time() + timeout_s
    while len(ranks := subprocess.run(["pgrep", "-P", str(proc.pid), "-f", "multiprocessing"],
                                      capture_output=True, text=True).stdout.split()) < n:
        assert time.time() < deadline and proc.poll() is None, log.read_text()[-2000:]
        time.sleep(0.05)
    return ranks


def process_alive(pid: str) -> bool:
    """Whether process ``pid`` runs (exists and is not a zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def stop_server(proc, log, timeout_s: float) -> None:
    """Stop the server process ``proc``: SIGTERM, then SIGKILL if it has not exited after
    ``timeout_s`` seconds; close its ``log`` file."""
    import subprocess

    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def openai_client_of_server(root: Path, out: Path):
    """A generator for a module fixture: ``serve/run.py`` over the family under ``root`` on a free
    loopback port (its log and Hydra run folder in ``out``), yielding an ``openai.OpenAI`` client of it,
    then stopping it."""
    import subprocess
    import sys

    import openai

    port = free_port()
    log = open(out / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "serve/run.py", f"paths.root={root}", f"port={port}", "log_level=warning",
                             f"hydra.run.dir={out}"], cwd=Path(__file__).resolve().parents[1], stdout=log,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, out / "server.log", 60)
    yield openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
    stop_server(proc, log, 10)


def complete_concurrently(client, jobs: list[tuple[str, str]], max_tokens: int, timeout_s: float) -> dict:
    """Send every ``(model, prompt)`` of ``jobs`` at once (one thread each) through the ``openai``
    ``client`` as a greedy completion of ``max_tokens``, so a server batches them together; returns
    ``{(model, prompt): text}``."""
    import threading

    got = {}
    threads = [threading.Thread(target=lambda m=m, p=p: got.__setitem__((m, p), client.completions.create(
        model=m, prompt=p, max_tokens=max_tokens, temperature=0).choices[0].text)) for m, p in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    return got


def complete_together(engine, jobs: list[tuple], run=None) -> list:
    """The token ids of ``engine.complete(model, prompt, params)`` (or what ``run(engine, model,
    prompt, params)`` returns) for every ``(model, prompt, params)`` of ``jobs``, all submitted while
    the model is held, so they are all waiting when the scheduler's loop resumes (one batch, whatever
    else the test checks about it)."""
    import threading
    import time

    results: list = [None] * len(jobs)
    run = run or (lambda engine, model, prompt, params: engine.complete(model, prompt, params).token_ids)

    def go(i, model, prompt, params):
        results[i] = run(engine, model, prompt, params)

    with engine._gen_lock:
        threads = [threading.Thread(target=go, args=(i, *job)) for i, job in enumerate(jobs)]
        for th in threads:
            th.start()
        deadline = time.time() + 30
        while sum(engine.scheduler.waiting().values()) < len(jobs):
            assert time.time() < deadline, "the requests did not all reach the scheduler's queues"
            time.sleep(0.01)
    for th in threads:
        th.join(120)
    return results


def wait_released(engine, model_id: str, timeout_s: float = 30) -> None:
    """Wait until no request holds ``model_id``'s variant and no sequence runs (a cancelled request's
    row and variant are given back after its step)."""
    import time

    deadline = time.time() + timeout_s
    while engine.cache.snapshot()[model_id]["in_flight"] or engine.scheduler.running:
        assert time.time() < deadline, f"{model_id} still held, or sequences still running"
        time.sleep(0.01)


def decode_alone(model, prompt: list[int], delta, steps: int) -> list[torch.Tensor]:
    """Greedy decode of one sequence through the one-variant path of ``model``
    (serve/model.py, a contiguous cache): the float32 logits of every step."""
    cache = model.new_cache(1, len(prompt) + steps)
    tokens, pos, out = torch.tensor([prompt]), torch.arange(len(prompt)), []
    for i in range(steps):
        logits = model(tokens, pos, cache, delta)[0, -1].float()
        out.append(logits)
        tokens, pos = torch.tensor([[int(logits.argmax())]]), torch.tensor([len(prompt) + i])
    return out


def prefill_step(prompts: list[list[int]], slots: list[int], tables: list[list[int]], where):
    """One engine step (serve/runner.py ``StepInput``) prefilling every prompt whole, sequence b
    with variant slot ``slots[b]``, block table ``tables[b]`` and cache slot ``where(b, position)``;
    the last token of each prompt samples."""
    from deltafleet.serve.runner import StepInput

    step = StepInput()
    for b, p in enumerate(prompts):
        step.chunks.append((len(step.tokens), len(p), 0, tables[b]))
        step.tokens += p
        step.positions += range(len(p))
        step.kv_slots += [where(b, t) for t in range(len(p))]
        step.variants += [slots[b]] * len(p)
        step.sample.append(len(step.tokens) - 1)
    return step
