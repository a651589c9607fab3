"""The local byte-level BPE tokenizer, trained on a small real corpus from `train.data`."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import json
import sysconfig
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from transformers import AutoTokenizer

from deltafleet.train import data as D
from deltafleet.train.tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, train_tokenizer

REPO = Path(__file__).resolve().parents[1]
VOCAB = 700


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    cfg = OmegaConf.load(REPO / "conf/data/default.yaml")
    cfg.merge_with({"val_fraction": 0.1, "test_fraction": 0.1, "math_problems": 800,
                    "max_chars": {"coder": 200_000, "math": 40_000, "writer": 150_000, "legal": 100_000}})
    if cfg.sources.austen is None:
        cfg.sources.austen = str(D.find_austen(None, REPO / "data").parent)
    data_dir = tmp_path_factory.mktemp("data")
    D.prepare(cfg, data_dir)
    return data_dir


@pytest.fixture(scope="module")
def tok_dir(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("models") / "tok"
    train_tokenizer([corpus / "general" / "train.jsonl", corpus / "math" / "train.jsonl"], VOCAB, out,
                    model_max_length=256)
    return out


@pytest.fixture(scope="module")
def tok(tok_dir):
    return AutoTokenizer.from_pretrained(tok_dir)   # offline: a local folder, HF_HUB_OFFLINE=1


def test_vocab_size_and_special_tokens(tok):
    assert len(tok) == VOCAB
    assert tok.convert_tokens_to_ids(SPECIAL_TOKENS) == [0, 1, 2, 3]
    assert SPECIAL_TOKENS == ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>"]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (0, 0, 0, 0)
    assert tok.model_max_length == 256
    assert tok.encode("<|user|>\nhi<|endoftext|>", add_special_tokens=False)[0] == 2
    assert tok.encode("<|user|>\nhi<|endoftext|>")[-1] == 0
    assert tok("hello").input_ids == tok("hello", add_special_tokens=False).input_ids   # nothing added


def roundtrip(tok, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert tok.convert_tokens_to_string(tok.convert_ids_to_tokens(ids)) == text


def test_roundtrip_python_source(tok):
    src = (Path(sysconfig.get_paths()["stdlib"]) / "json" / "decoder.py").read_text(encoding="utf-8")
    roundtrip(tok, src)
    roundtrip(tok, "def f(x):\n\tif x:\n\t\treturn  x  \r\n\n\n    # trailing   \n\t \n")
    roundtrip(tok, "a = {'k': [1, 2.50, -3e-7]}  ;  print( a ) ,  . ? ! 's n't")


def test_roundtrip_austen_prose(tok, corpus):
    with open(corpus / "writer" / "test.jsonl", encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f][:20]
    for text in texts:
        roundtrip(tok, text)
    ids = tok.encode(texts[0], add_special_tokens=False)
    assert len(ids) < len(texts[0]) / 2.0      # BPE learned English: well under 2 chars per token


def test_roundtrip_unicode(tok):
    for text in ["naïve café — “quotes” … £5", "日本語のテキスト", "emoji 🙂👩‍👩‍👧 flags 🇫🇷",
                 "e\u0301 combining, \u200b zero width, \u00a0 nbsp",
                 "שלום עולם مرحبا", "\x00\x7f\ufeff"]:
        roundtrip(tok, text)


def test_digits_are_single_tokens(tok):
    tokens = tok.tokenize("Answer: 34801")
    assert tokens[-5:] == ["3", "4", "8", "0", "1"]


def test_chat_template_exact(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3 + 3?"}]
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok.apply_chat_template(messages, tokenize=False) == (
        "<|system|>\nBe brief.<|endoftext|>\n<|user|>\nWhat is 2 + 2?<|endoftext|>\n"
        "<|assistant|>\n4<|endoftext|>\n<|user|>\nAnd 3 + 3?<|endoftext|>\n")
    assert tok.apply_chat_template(messages[1:2], tokenize=False, add_generation_prompt=True) == (
        "<|user|>\nWhat is 2 + 2?<|endoftext|>\n<|assistant|>\n")
    ids = tok.encode(tok.apply_chat_template(messages[1:2], tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)
    assert ids[0] == 2 and ids.count(0) == 1 and ids[-2] == 3
    with pytest.raises(Exception, match="unknown chat role"):
        tok.apply_chat_template([{"role": "function", "content": "x"}], tokenize=False)


def test_the_chat_template_renders_tools_calls_and_results_in_the_hermes_format(tok):
    """With ``tools``: a system turn listing them after the system message's content; an assistant's
    calls as ``<tool_call>`` blocks (serve/tools.py parses the same); a tool's result as a user turn."""
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1 + 2?"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "3"}]
    assert tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True) == (
        "<|system|>\nBe brief.\n\nYou may call these functions (their arguments are JSON Schemas):\n<tools>\n"
        '{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}\n</tools>\n'
        'To call one, answer <tool_call>{"name": <name>, "arguments": <object>}</tool_call>.<|endoftext|>\n'
        "<|user|>\n1 + 2?<|endoftext|>\n"
        '<|assistant|>\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call><|endoftext|>\n'
        "<|user|>\n<tool_response>\n3\n</tool_response><|endoftext|>\n<|assistant|>\n")


def test_saved_in_hugging_face_format(tok_dir):
    names = {p.name for p in tok_dir.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json"} <= names
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert cfg["eos_token"] == "<|endoftext|>" and cfg["clean_up_tokenization_spaces"] is False
    assert not [p for p in tok_dir.parent.iterdir() if p.name.startswith(".")]   # no temp dirs left


def test_returned_tokenizer_matches_reload(corpus, tmp_path):
    out = tmp_path / "t"
    trained = train_tokenizer([corpus / "legal" / "train.jsonl"], 400, out)
    reloaded = AutoTokenizer.from_pretrained(out)
    text = "Permission is hereby granted, free of charge, to any person obtaining a copy"
    assert trained.encode(text) == reloaded.encode(text) and len(trained) == 400
    # deterministic: the same corpus gives the same tokenizer.json
    train_tokenizer([corpus / "legal" / "train.jsonl"], 400, tmp_path / "u")
    assert (out / "tokenizer.json").read_bytes() == (tmp_path / "u" / "tokenizer.json").read_bytes()


def test_saves_into_an_existing_model_dir(corpus, tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    (model_dir / "tokenizer.json").write_text("stale")
    train_tokenizer([corpus / "math" / "train.jsonl"], 300, model_dir)
    assert (model_dir / "config.json").read_text() == "{}"
    assert len(AutoTokenizer.from_pretrained(model_dir)) == 300
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_errors(tmp_path, corpus):
    with pytest.raises(FileNotFoundError, match="make data"):
        train_tokenizer([tmp_path / "missing.jsonl"], 500, tmp_path / "t")
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer([corpus / "math" / "train.jsonl"], 100, tmp_path / "t")
    assert not (tmp_path / "t").exists()


def test_a_checkpoint_without_a_tokenizer_is_named_in_one_line(tok_dir, tmp_path):
    """Found by a fresh user: a base folder without its tokenizer made the server (and every job)
    fail with transformers' "You need to have sentencepiece or tiktoken installed to convert a slow
    tokenizer"; the error now says which folder and what to save there."""
    import subprocess
    import sys

    from deltafleet.checkpoint import CheckpointError, load_tokenizer

    assert load_tokenizer(tok_dir).get_vocab() == AutoTokenizer.from_pretrained(tok_dir).get_vocab()
    bare = tmp_path / "models" / "base"
    bare.mkdir(parents=True)
    (bare / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CheckpointError, match=rf"^{bare}: no tokenizer that transformers can load \(no tokenizer "
                                              rf"files; a fast tokenizer is tokenizer.json\): save the model's"):
        load_tokenizer(bare)
    (bare / "tokenizer_config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"\(found tokenizer_config.json; a fast tokenizer is tokenizer.json\)"):
        load_tokenizer(bare)
    r = subprocess.run([sys.executable, "serve/run.py", f"paths.root={tmp_path}", "port=0"], cwd=REPO,
                       capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(f"error: {bare}: no tokenizer that transformers can load")
