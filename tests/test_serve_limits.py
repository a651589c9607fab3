"""Defects a fresh user found in the server, through the app in-process (``TestClient``): a prompt
certainly longer than the context refused without tokenizing, a body over ``max_request_bytes``
(413), unloading a variant that stops serving it until it is loaded again, strict parameter types,
and the error code of a body that is not UTF-8. The real server's side (8 MiB from conf/serve.yaml,
chunked bodies, a good request beside a huge one) is in tests/test_serve_api.py."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from deltafleet.serve.app import create_app
from tests.conftest import api_error
from deltafleet.serve.engine import Engine, SamplingParams

REPO = Path(__file__).resolve().parents[1]

GREEDY = dict(temperature=0, max_tokens=4)


def _post_raw(tc, path: str, raw: bytes):
    return tc.post(f"/v1/{path}", content=raw, headers={"Content-Type": "application/json"})


# ------------------------------------------------------------------------------------ prompt length


def test_longest_token_bounds_the_characters_of_every_token(engine):
    """L = the longest decoded token + 1 (no normalizer in the tiny byte-level BPE): 25 + 1 here, and
    no text of the tokenizer's corpus has more characters than L × its tokens."""
    tok = engine.tokenizer
    assert engine.max_token_chars == max(len(tok.decode([i])) for i in range(len(tok))) + 1 == 26
    text = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
    for piece in (text, " " * 5000, "é中𝄞" * 300, "\n" + " " * 24 + "x"):
        assert len(piece) <= engine.max_token_chars * len(tok.encode(piece, add_special_tokens=False))


def test_a_prompt_certainly_over_the_context_is_refused_without_tokenizing(engine, tc, monkeypatch):
    """Just over L × max_model_len characters: the same 400 context_length_exceeded as a tokenized
    prompt that is too long, without calling the tokenizer nor waiting for its lock (held here, as
    while a huge prompt is being encoded)."""
    n, per = engine.max_model_len, 26  # the longest token + 1 (test above)
    assert n == 128
    tokenized = api_error(tc.post("/v1/completions", json={"model": "tiny", "prompt": "x" * (per * n)}), 400)
    assert tokenized["message"].startswith("This model's maximum context length is 128 tokens, but there are ")

    calls = []
    real_encode = engine.tokenizer.encode
    monkeypatch.setattr(engine.tokenizer, "encode", lambda *a, **k: calls.append(a) or real_encode(*a, **k))
    chat = [{"role": "system", "content": "a" * (per * n // 2)},
            {"role": "user", "content": " b" * (per * n // 4) + "cc"}]  # 1664 + 1665: a template may trim the space
    results = {}

    def ask():
        results["prompt"] = tc.post("/v1/completions", json={"model": "tiny-coder", "prompt": "x" * (per * n + 1)})
        results["messages"] = tc.post("/v1/chat/completions", json={"model": "tiny", "messages": chat})

    with engine._tok_lock:
        t = threading.Thread(target=ask)
        t.start()
        t.join(20)
        assert not t.is_alive(), "an over-long prompt waited for the tokenizer"
    assert calls == []
    assert api_error(results["prompt"], 400) == {
        "message": "This model's maximum context length is 128 tokens, but `prompt` holds 3329 characters: more than "
                   "128 tokens even at 26 characters per token (the most one token stands for), which leaves no room "
                   "for the completion. Please reduce the length of the prompt.",
        "type": "invalid_request_error", "param": "prompt", "code": "context_length_exceeded"}
    assert {k: tokenized[k] for k in ("type", "param", "code")} == \
        {"type": "invalid_request_error", "param": "prompt", "code": "context_length_exceeded"}
    assert api_error(results["messages"], 400) == {
        "message": "This model's maximum context length is 128 tokens, but `messages` holds 3329 characters: more "
                   "than 128 tokens even at 26 characters per token (the most one token stands for), which leaves "
                   "no room for the completion. Please reduce the length of the messages.",
        "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}
    # /tokenize generates nothing: the same refusal says so (found by a fresh user)
    said = api_error(tc.post("/tokenize", json={"model": "tiny", "prompt": "x" * (per * n + 1)}), 400)
    assert said["code"] == "context_length_exceeded" and "completion" not in said["message"]
    assert said["message"].endswith("(the most one token stands for), so it is not tokenized. Please reduce the "
                                    "length of the prompt.")
    said = api_error(tc.post("/tokenize", json={"model": "tiny", "messages": chat}), 400)
    assert said["param"] == "messages" and "so it is not tokenized" in said["message"]
    # At the bound it is tokenized as before (the lock is free again).
    assert api_error(tc.post("/v1/completions", json={"model": "tiny", "prompt": "x" * (per * n)}), 400) == tokenized
    assert len(calls) == 1


# ------------------------------------------------------------------------------------ body size


def test_a_body_over_max_request_bytes_is_413_before_parsing(engine):
    body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 2, "pad": ""})
    fill = 1000 - len(body)
    at_limit = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 2, "pad": "p" * fill}).encode()
    assert len(at_limit) == 1000
    with TestClient(create_app(engine, max_request_bytes=1000)) as tc:
        assert _post_raw(tc, "completions", at_limit).status_code == 200
        for raw in (at_limit + b" ", b"{not json" * 200):  # never parsed: not a 400
            assert api_error(_post_raw(tc, "completions", raw), 413) == {
                "message": "The request body is larger than this server's limit of 1000 bytes.",
                "type": "invalid_request_error", "param": None, "code": "request_too_large"}
        assert tc.get("/health").json() == {"status": "ok"}
    with TestClient(create_app(engine, max_request_bytes=None)) as tc:  # no limit
        assert _post_raw(tc, "completions", at_limit + b" " * 10_000).status_code == 200


# ------------------------------------------------------------------------------------ unload


def test_vllm_lora_adapter_routes_unload_and_load_a_variant(tiny_family):
    """vLLM's ``/v1/unload_lora_adapter`` and ``/v1/load_lora_adapter`` (what the Gateway API
    Inference Extension's adapter sync calls), with ``lora_name`` the model id: the same as our
    routes, answered in vLLM's plain text; bad names and unknown adapters are OpenAI errors."""
    engine = Engine(tiny_family.base_dir, tiny_family.artifacts_dir, family="tiny")
    body = {"model": "tiny-coder", "prompt": "def ", **GREEDY}
    with TestClient(create_app(engine)) as tc:
        before = tc.post("/v1/completions", json=body).json()["choices"][0]["text"]
        r = tc.post("/v1/unload_lora_adapter", json={"lora_name": "tiny-coder"})
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'tiny-coder' removed successfully."
        assert [m["id"] for m in tc.get("/v1/models").json()["data"]] == ["tiny", "tiny-writer"]
        gone = api_error(tc.post("/v1/unload_lora_adapter", json={"lora_name": "tiny-coder"}), 404)
        assert (gone["code"], gone["param"]) == ("model_not_found", "lora_name")
        r = tc.post("/v1/load_lora_adapter", json={"lora_name": "tiny-coder", "lora_path": "coder"})
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'tiny-coder' added successfully."
        assert tc.post("/v1/completions", json=body).json()["choices"][0]["text"] == before
        # a bare lora_name is served under that name too, as vLLM does (and listed as tiny-again)
        r = tc.post("/v1/load_lora_adapter", json={"lora_name": "again", "lora_path": "coder"})
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'again' added successfully."
        assert tc.post("/v1/completions", json=body | {"model": "again"}).json()["choices"][0]["text"] == before
        assert "tiny-again" in [m["id"] for m in tc.get("/v1/models").json()["data"]]
        # a name already served is refused, as vLLM does (found by a fresh user: the second load replaced
        # the first silently), by either name; load_inplace replaces it
        for name in ("again", "tiny-again"):
            twice = tc.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": "writer"})
            assert twice.status_code == 400 and twice.json()["error"] == {
                "message": f"The lora adapter '{name}' has already been loaded.", "type": "invalid_request_error",
                "param": "lora_name", "code": "already_loaded"}
        assert tc.post("/v1/completions", json=body | {"model": "again"}).json()["choices"][0]["text"] == before
        yes = tc.post("/v1/load_lora_adapter", json={"lora_name": "again", "lora_path": "writer", "load_inplace": "yes"})
        assert yes.status_code == 400 and yes.json()["error"]["param"] == "load_inplace"  # a JSON boolean only
        r = tc.post("/v1/load_lora_adapter", json={"lora_name": "again", "lora_path": "writer", "load_inplace": True})
        assert r.status_code == 200, r.text
        writer = tc.post("/v1/completions", json=body | {"model": "tiny-writer"}).json()["choices"][0]["text"]
        assert writer != before
        assert tc.post("/v1/completions", json=body | {"model": "again"}).json()["choices"][0]["text"] == writer
        assert tc.post("/v1/unload_lora_adapter", json={"lora_name": "again"}).status_code == 200
        assert api_error(tc.post("/v1/completions", json=body | {"model": "again"}), 404)["code"] == "model_not_found"
        assert api_error(tc.post("/v1/load_lora_adapter", json={"lora_name": "../x"}), 400)["param"] == "lora_name"
        missing = api_error(tc.post("/v1/load_lora_adapter", json={"lora_name": "tiny-nothing"}), 400)
        assert (missing["code"], missing["param"]) == ("artifact_not_found", "lora_path")


def test_two_loads_of_one_new_lora_name_at_once_load_it_once(tiny_family, monkeypatch):
    """Found by a reviewer: the ``already_loaded`` check ran before the load, so a second
    ``/v1/load_lora_adapter`` of a new name sent while the first was loading passed it too, and both
    answered success (vLLM refuses the second). A name being loaded counts as loaded."""
    import asyncio
    import time

    engine = Engine(tiny_family.base_dir, tiny_family.artifacts_dir, family="tiny")
    add = engine.add_variant
    calls = []

    def slow_add(name, path=None):  # the first load still runs when the second arrives
        calls.append(name)
        time.sleep(0.5)
        return add(name, path)

    monkeypatch.setattr(engine, "add_variant", slow_add)
    app = create_app(engine)

    async def both():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as client:
            body = {"lora_name": "twice", "lora_path": "coder"}
            return await asyncio.gather(client.post("/v1/load_lora_adapter", json=body),
                                        client.post("/v1/load_lora_adapter", json=body))

    answers = asyncio.run(both())
    assert sorted(r.status_code for r in answers) == [200, 400] and calls == ["twice"]
    refused = next(r for r in answers if r.status_code == 400)
    assert refused.json()["error"]["code"] == "already_loaded"
    assert "tiny-twice" in [c.id for c in engine.models()]


def test_unload_stops_serving_a_variant_until_it_is_loaded_again(tiny_family):
    engine = Engine(tiny_family.base_dir, tiny_family.artifacts_dir, family="tiny")
    body = {"model": "tiny-coder", "prompt": "def ", **GREEDY}
    gone = {"message": "The model `tiny-coder` does not exist", "type": "invalid_request_error",
            "param": "model", "code": "model_not_found"}
    with TestClient(create_app(engine)) as tc:
        before = tc.post("/v1/completions", json=body).json()["choices"][0]["text"]
        assert tc.post("/v1/unload_variant", json={"variant": "coder"}).json() == \
            {"id": "tiny-coder", "object": "model", "unloaded": True}
        for _ in range(2):  # listing rescans the artifact root: it is not found again
            assert [m["id"] for m in tc.get("/v1/models").json()["data"]] == ["tiny", "tiny-writer"]
        assert api_error(tc.get("/v1/models/tiny-coder"), 404) == gone
        assert api_error(tc.post("/v1/completions", json=body), 404) == gone
        assert "tiny-coder" not in tc.get("/v1/delta_cache").json()["variants"]
        assert api_error(tc.post("/v1/unload_variant", json={"variant": "tiny-coder"}), 404) == gone | {"param": "variant"}

        r = tc.post("/v1/load_variant", json={"variant": "coder"})  # by name, from the artifact root
        assert r.status_code == 200 and r.json()["id"] == "tiny-coder" and r.json()["loaded_from"] == "disk"
        assert sorted(m["id"] for m in tc.get("/v1/models").json()["data"]) == ["tiny", "tiny-coder", "tiny-writer"]
        assert tc.post("/v1/completions", json=body).json()["choices"][0]["text"] == before
        assert tc.post("/v1/unload_variant", json={"variant": "tiny-coder"}).status_code == 200
        r = tc.post("/v1/load_variant", json={"variant": "coder", "path": "coder"})  # by path
        assert r.status_code == 200 and r.json()["loaded_from"] == "disk"
        assert tc.post("/v1/completions", json=body).json()["choices"][0]["text"] == before

        held = engine.prepare("tiny-writer", engine.encode_prompt("x"), SamplingParams(**GREEDY))
        assert api_error(tc.post("/v1/unload_variant", json={"variant": "writer"}), 409) == {
            "message": "variant `tiny-writer` has 1 request in flight; retry when they have finished",
            "type": "invalid_request_error", "param": "variant", "code": "variant_in_use"}
        assert "tiny-writer" in [m["id"] for m in tc.get("/v1/models").json()["data"]]
        engine.release(held)
        assert tc.post("/v1/unload_variant", json={"variant": "writer"}).status_code == 200

        for path, what in (("unload_variant", "unloaded"), ("load_variant", "loaded as a variant")):
            assert api_error(tc.post(f"/v1/{path}", json={"variant": "tiny"}), 400) == {
                "message": f"`tiny` is the base model, which is always loaded: it cannot be {what}",
                "type": "invalid_request_error", "param": "variant", "code": "base_model"}
        assert tc.post("/v1/completions", json={**body, "model": "tiny"}).status_code == 200
    assert [c.id for c in engine.discover()] == ["tiny", "tiny-coder"]


def test_a_synthetic_variant_unloaded_is_generated_again_by_load_variant(tmp_path):
    from deltafleet.serve.bench import stdlib_tokenizer
    from deltafleet.serve.synthetic import write_base_dir

    shape = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128)
    stdlib_tokenizer(tmp_path / "tok", shape["vocab_size"], shape["max_position_embeddings"])
    opts = {"shape": shape, "variants": 2, "seed": 7, "alpha": 0.02}
    base = write_base_dir(tmp_path / "base", opts, tmp_path / "tok")
    engine = Engine(base, None, family="syn")
    body = {"model": "syn-v01", "prompt": "def ", **GREEDY}
    with TestClient(create_app(engine)) as tc:
        before = tc.post("/v1/completions", json=body).json()["choices"][0]["text"]
        assert tc.post("/v1/unload_variant", json={"variant": "v01"}).status_code == 200
        assert [m["id"] for m in tc.get("/v1/models").json()["data"]] == ["syn", "syn-v00"]
        assert api_error(tc.post("/v1/completions", json=body), 404)["code"] == "model_not_found"
        r = tc.post("/v1/load_variant", json={"variant": "v01"})
        assert r.status_code == 200 and r.json()["id"] == "syn-v01" and r.json()["loaded_from"] == "disk"
        assert tc.post("/v1/completions", json=body).json()["choices"][0]["text"] == before


# ------------------------------------------------------------------------------------ validation


def _invalid(param: str, msg: str) -> dict:
    return {"message": f"Invalid request: {param}: {msg}", "type": "invalid_request_error", "param": param,
            "code": "invalid_value"}


STOP5 = {"message": "Invalid 'stop': array too long. Expected an array with maximum length 4, but got an array "
                    "with length 5 instead.", "type": "invalid_request_error", "param": "stop",
         "code": "array_above_max_length"}
STREAM_OPTIONS = {"message": "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                  "type": "invalid_request_error", "param": "stream_options", "code": "invalid_value"}


@pytest.mark.parametrize("path,extra,error", [
    ("completions", '"max_tokens": true', _invalid("max_tokens", "Input should be a valid integer")),
    ("completions", '"max_tokens": 2.5', _invalid("max_tokens", "Input should be a valid integer")),
    ("chat/completions", '"max_completion_tokens": true', _invalid("max_completion_tokens",
                                                                   "Input should be a valid integer")),
    ("completions", '"seed": false', _invalid("seed", "Input should be a valid integer")),
    ("completions", '"stream": "yes"', _invalid("stream", "Input should be a valid boolean")),
    ("chat/completions", '"stream": 1', _invalid("stream", "Input should be a valid boolean")),
    ("completions", '"stop": ["a", "b", "c", "d", "e"]', STOP5),
    ("chat/completions", '"stop": ["a", "b", "c", "d", "e"]', STOP5),
    ("completions", '"stream_options": {"include_usage": true}', STREAM_OPTIONS),
    ("chat/completions", '"stream": false, "stream_options": {"include_usage": true}', STREAM_OPTIONS),
    ("completions", '"temperature": NaN', _invalid("temperature", "Input should be a finite number")),
    ("chat/completions", '"top_p": Infinity', _invalid("top_p", "Input should be a finite number")),
    ("completions", '"temperature": true', _invalid("temperature", "Input should be a valid number")),
    ("completions", '"stream": true, "stream_options": {"include_usage": "yes"}',
     _invalid("stream_options.include_usage", "Input should be a valid boolean")),
    ("chat/completions", '"stream_options": {"include_usage": 1}',
     _invalid("stream_options.include_usage", "Input should be a valid boolean")),
])
def test_loose_parameter_values_are_400(tc, path, extra, error):
    first = '"prompt": "x"' if path == "completions" else '"messages": [{"role": "user", "content": "x"}]'
    raw = f'{{"model": "tiny", {first}, "max_tokens": 2, {extra}}}'.encode()
    assert api_error(_post_raw(tc, path, raw), 400) == error


def test_what_openai_accepts_is_still_accepted(tc):
    r = tc.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2, "temperature": 0,
                                         "top_p": 1, "stop": ["a", "b", "c", "d"], "stream": False,
                                         "stream_options": None, "seed": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_a_body_that_is_not_utf8_is_invalid_json(tc, path):
    first = b'"prompt": "\xff"' if path == "completions" else b'"messages": [{"role": "user", "content": "\xe9t\xe9"}]'
    err = api_error(_post_raw(tc, path, b'{"model": "tiny", ' + first + b"}"), 400)
    assert err == {"message": "The request body is not valid JSON: it is not UTF-8 text.",
                   "type": "invalid_request_error", "param": None, "code": "invalid_json"}
    assert api_error(_post_raw(tc, path, b"{not json"), 400)["code"] == err["code"]  # as malformed JSON
    # found by a second fresh user: an encoded surrogate (not UTF-8, though Python's JSON parser takes
    # it) and a UTF-16 body (the parser guesses the encoding) were let through
    surrogate = b'{"model": "tiny", "prompt": "\xed\xa0\x80"}'
    utf16 = '{"model": "tiny", "prompt": "x", "max_tokens": 2}'.encode("utf-16-le")
    assert api_error(_post_raw(tc, path, surrogate), 400) == err
    assert api_error(_post_raw(tc, path, utf16), 400) == err
    # one message a reason (found by a fresh user: a body nested too deeply read "could not be parsed")
    deep = api_error(_post_raw(tc, path, b'{"model": "tiny", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
                     400)
    assert deep == {**err, "message": "The request body is not valid JSON: it is nested too deeply."}
    # a number longer than the parser reads (found by a fresh user: it read "not valid JSON" alone)
    huge = api_error(_post_raw(tc, path, b'{"model": "tiny", "seed": ' + b"9" * 5000 + b"}"), 400)
    assert huge == {**err, "message": "The request body cannot be read: a number in it has more than 4300 digits."}


def test_lone_surrogate_has_its_error_code_and_a_prompt_list_is_answered(tc):
    r = tc.post("/v1/completions", content=b'{"model": "tiny", "prompt": "a\\ud800b", "max_tokens": 2}',
                headers={"content-type": "application/json"})
    assert api_error(r, 400) == {"message": "`prompt` is not valid Unicode (a lone surrogate at character 1)",
                              "type": "invalid_request_error", "param": "prompt", "code": "invalid_unicode"}
    r = tc.post("/v1/completions", json={"model": "tiny", "prompt": ["a", "b"], "max_tokens": 2})
    assert r.status_code == 200 and [c["index"] for c in r.json()["choices"]] == [0, 1]
    r = tc.post("/v1/completions", content=b'{"model": "tiny", "prompt": ["a", "b\\ud800"], "max_tokens": 2}',
                headers={"content-type": "application/json"})
    assert api_error(r, 400)["code"] == "invalid_unicode"  # the second prompt: nothing generated
    # found by a fresh user: a stop string and chat_template_kwargs took one (200), and one in a schema's
    # key came back as the grammar library's own message (a message's `name` is not read)
    chat = b'{"model": "tiny", "messages": [{"role": "user", "content": "a"}], "max_tokens": 2'
    for body, param in [(b'{"model": "tiny", "prompt": "a", "stop": ["x\\ud800"], "max_tokens": 2}', "stop"),
                        (chat + b', "chat_template_kwargs": {"k": "\\ud800"}}', "chat_template_kwargs"),
                        (chat + b', "response_format": {"type": "json_schema", "json_schema": {"name": "x", '
                         b'"schema": {"type": "object", "properties": {"\\ud800": {"type": "integer"}}}}}}',
                         "response_format")]:
        path = "/v1/completions" if b'"prompt"' in body else "/v1/chat/completions"
        r = tc.post(path, content=body, headers={"content-type": "application/json"})
        err = api_error(r, 400)
        assert (err["param"], err["code"]) == (param, "invalid_unicode"), (body, err)
        assert err["message"].startswith(f"`{param}` is not valid Unicode (a lone surrogate at character "), err


def test_a_bad_cors_setting_is_refused_by_name():
    from omegaconf import OmegaConf

    from deltafleet.serve.run import _check_cors

    _check_cors(OmegaConf.create({"cors": None}))
    _check_cors(OmegaConf.create({"cors": {"allow_origins": ["http://a.example"], "allow_credentials": True}}))
    for bad, msg in [({"allow_origin": ["*"]}, "cors must be null or a mapping of allow_origins"),
                     ({"allow_origins": "*"}, "cors.allow_origins must be a list of strings"),
                     ({"allow_credentials": "yes"}, "cors.allow_credentials must be true or false")]:
        with pytest.raises(ValueError, match=msg):
            _check_cors(OmegaConf.create({"cors": bad}))


def test_duplicate_token_texts_keep_their_highest_log_probability():
    """Completions' top_logprobs are keyed by text: tokens that decode alike (pieces of one UTF-8
    character, "�") keep the highest log-probability, whatever their order."""
    from deltafleet.serve.app import _top_dict

    assert _top_dict([("a", -1.0), ("\ufffd", -2.0), ("\ufffd", -1.5), ("b", -3.0), ("\ufffd", -2.5)]) == {
        "a": -1.0, "\ufffd": -1.5, "b": -3.0}


def test_the_server_checks_its_thread_setting_as_every_job():
    from omegaconf import OmegaConf

    from deltafleet.serve.run import _threads

    assert _threads(OmegaConf.create({"threads": 3})) == 3
    for bad in (0, -3, True, 1.5):
        with pytest.raises(ValueError, match="threads must be null or a positive integer"):
            _threads(OmegaConf.create({"threads": bad}))


def test_the_gil_switch_interval_is_a_tenth_of_a_millisecond_unless_set():
    """Each torch call of the model thread gives the GIL up and waits up to the interval for it
    while the HTTP thread runs Python: serve.yaml and a config without the key take 0.1 ms."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from deltafleet.serve.run import _switch_interval

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="serve")
    assert _switch_interval(cfg) == pytest.approx(1e-4)
    assert _switch_interval(OmegaConf.create({})) == pytest.approx(1e-4)
    assert _switch_interval(OmegaConf.create({"gil_switch_interval_ms": 2})) == pytest.approx(2e-3)


def test_a_max_waiting_below_one_is_refused_at_startup(tmp_path):
    """``max_waiting`` 0 or less would refuse every request: the server does not start, and says why."""
    r = subprocess.run([sys.executable, "serve/run.py", f"paths.root={tmp_path}", "max_waiting=0"], cwd=REPO,
                       capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2 and "max_waiting must be null or an integer ≥ 1, got 0" in r.stderr


def _serve_cfg(*overrides: str):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name="serve", overrides=list(overrides))


FAMILY = ("family (the base's model id; variants are <family>-<variant>) must be 1–64 letters, digits, '.', '_' "
          "or '-', starting with a letter or digit, got ")


# Found by a fresh user: each of these started the server (force=no even served an artifact made for
# another base, any non-empty string being true), or failed later with a traceback or a 500.
@pytest.mark.parametrize("override, message", [
    ("force=no", "force must be true or false, got 'no'"),
    ("cuda_graphs=maybe", "cuda_graphs must be true or false, got 'maybe'"),
    ("prefill_graphs=1", "prefill_graphs must be true or false, got 1"),
    ("max_batch=abc", "max_batch must be an integer ≥ 1, got 'abc'"),
    ("max_batch=1.5", "max_batch must be an integer ≥ 1, got 1.5"),
    ("max_num_batched_tokens=0", "max_num_batched_tokens must be an integer ≥ 1, got 0"),
    ("tp=abc", "tp must be an integer ≥ 1, got 'abc'"),
    ("long_prefill_token_threshold=-1", "long_prefill_token_threshold must be an integer ≥ 0, got -1"),
    ("delta_cache.device_slots=0", "delta_cache.device_slots must be null or an integer ≥ 1, got 0"),
    ("max_request_bytes=abc", "max_request_bytes must be null or an integer ≥ 1, got 'abc'"),
    ("port=abc", "port must be a port number from 0 to 65535, got 'abc'"),
    ("port=70000", "port must be a port number from 0 to 65535, got 70000"),
    ("delta_cache.wait_timeout_s=abc", "delta_cache.wait_timeout_s must be a number ≥ 0, got 'abc'"),
    ("delta_cache.half_life_s=abc", "delta_cache.half_life_s must be a number > 0, got 'abc'"),
    ("delta_cache.host_budget_gb=-1", "delta_cache.host_budget_gb must be a number ≥ 0 or null, got -1"),
    ("delta_cache.pin_top_n=-1", "delta_cache.pin_top_n must be an integer ≥ 0, got -1"),
    ("delta_cache.pinned=coder", "delta_cache.pinned must be a list of variant names, got 'coder'"),
    ("delta_cache.pinned=5", "delta_cache.pinned must be a list of variant names, got 5"),
    ("delta_cache.pinned=[coder,3]", "delta_cache.pinned must be a list of variant names, got ['coder', 3]"),
    ("tp_port=0", "tp_port must be a port number from 1 to 65535, got 0"),
    ("tp_timeout_s=0", "tp_timeout_s must be a number of seconds > 0, got 0"),
    ("tp_timeout_s=inf", "tp_timeout_s must be a number of seconds > 0, got inf"),
    ("tp_timeout_s=null", "tp_timeout_s must be a number of seconds > 0, got None"),
    ("log_level=foo", "log_level must be one of critical, error, warning, info, debug, trace (or a number), got 'foo'"),
    ("device=foo", "device must be cpu, cuda or cuda:N, got 'foo'"),
    ("api_key=123", "api_key must be a string or null, got 123"),
    ("family=null", FAMILY + "None"),  # a traceback once the model was loaded
    ("family=''", FAMILY + "''"),  # served the base as model "" and its variants as -<variant>
    ("family=a/b", FAMILY + "'a/b'"),  # served, but GET /v1/models/a/b found no model
    ("family=-x", FAMILY + "'-x'"),
    ("family=7", FAMILY + "7"),
    # refused only once the base had loaded (found by a fresh user)
    ("attention=foo", "attention must be one of auto, flex, sdpa, got 'foo'"),
    ("delta_cache.sign_layout=diag", "delta_cache.sign_layout must be one of ('rows', 'tiled'), got 'diag'"),
])
def test_a_bad_serve_setting_is_refused_by_name(override, message):
    from deltafleet.serve.run import check_settings

    check_settings(_serve_cfg())  # the defaults pass, and so do these
    check_settings(_serve_cfg("port=0", "delta_cache.half_life_s=inf", "log_level=20", "delta_cache.pinned=[coder]"))
    with pytest.raises(ValueError) as e:
        check_settings(_serve_cfg(override))
    assert str(e.value) == message


def test_a_setting_conf_serve_yaml_lacks_is_refused_by_name():
    """Found by a fresh user: Hydra takes ``+name=value`` for any name, so a misspelt setting was
    ignored without a word. Settings conf/serve.yaml lacks are refused at the top level and in its
    sections, naming the ones there are; the groups (``paths``, ``model``) and ``+cors`` pass."""
    from deltafleet.serve.run import check_settings

    check_settings(_serve_cfg("+cors={allow_origins: [x]}", "paths.root=/tmp/x", "model=tiny"))
    with pytest.raises(ValueError) as e:
        check_settings(_serve_cfg("+max_batchs=4"))
    head, _, names = str(e.value).partition(": ")
    assert head == "max_batchs is not a setting of conf/serve.yaml; its settings"
    assert {"max_batch", "kv_cache", "paths", "model"} <= set(names.split(", ")) and "hydra" not in names
    with pytest.raises(ValueError) as e:
        check_settings(_serve_cfg("+kv_cache.blok_size=64"))
    assert str(e.value) == ("kv_cache.blok_size is not a setting of conf/serve.yaml; its settings under kv_cache: "
                            "block_size, gpu_memory_utilization, max_tokens")
    check_settings(_serve_cfg("model=smollm2"))  # a group's key: any of its files'
    with pytest.raises(ValueError, match=r"^model\.nmae is not a setting of conf/serve\.yaml; its settings under "
                                         r"model: .*\bname_or_path\b"):
        check_settings(_serve_cfg("+model.nmae=x"))
    with pytest.raises(ValueError, match=r"^paths\.rooot is not a setting"):
        check_settings(_serve_cfg("+paths.rooot=/x"))


def test_a_pinned_variant_that_is_not_served_is_named_in_a_warning(tiny_family, caplog):
    """``delta_cache.pinned=[nosuch]`` starts the server (its artifact may come later), with a warning."""
    from deltafleet.serve.engine import Engine

    with caplog.at_level("WARNING", logger="deltafleet.serve.engine"):
        Engine(tiny_family.base_dir, tiny_family.artifacts_dir, family="tiny",
               delta_cache={"pinned": ["coder", "nosuch", "tiny"]})
    said = [r.getMessage() for r in caplog.records if "pinned" in r.getMessage()]
    assert said == ["delta_cache.pinned names tiny-nosuch, which is not served (no artifact for it yet)",
                    "delta_cache.pinned names tiny, the base, which is always on the device"]


@pytest.mark.parametrize("busy_s", [60.0, 0.2])
def test_threads_a_request_left_busy_hold_the_exit_a_bounded_time(busy_s):
    """Found in a review: a worker thread spinning in a grammar check held the stopped server's exit
    for good (the interpreter joins every non-daemon thread). ``_leave_busy_threads`` waits its
    bound, then names the thread and exits 0; a thread that ends within the bound is waited for and
    the process exits normally."""
    import time

    code = ("import threading, time\n"
            "from deltafleet.serve.run import _leave_busy_threads\n"
            f"threading.Thread(target=time.sleep, args=({busy_s},), name='grammar-check').start()\n"
            "_leave_busy_threads(1.0)\n"
            "print('returned', flush=True)\n")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50, cwd=REPO)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    if busy_s > 1.0:
        assert took < 30, took  # not the thread's 60 s
        assert "returned" not in r.stdout
        assert "threads still busy 1 s after the server stopped (grammar-check)" in r.stderr, r.stderr
    else:
        assert r.stdout == "returned\n" and "busy" not in r.stderr, (r.stdout, r.stderr)


def test_a_ctrl_c_while_the_server_loads_exits_130_without_a_traceback(tmp_path, monkeypatch):
    """Found by a fresh user: a Ctrl-C before the server listens (loading the model) printed a
    KeyboardInterrupt traceback. It ends the server with status 130 (after that, the server drains)."""
    from deltafleet.serve import run

    def loading(cfg, device):
        raise KeyboardInterrupt

    monkeypatch.setattr(run, "_serve", loading)
    with pytest.raises(SystemExit) as e:
        run.main.__wrapped__(_serve_cfg(f"paths.root={tmp_path}"))  # main without Hydra's wrapper
    assert e.value.code == 130


def test_a_flag_that_is_not_a_bool_stops_the_server_before_it_loads(tmp_path):
    """Through the real entry point: exit status 2 and the key named, no traceback, nothing loaded (the
    base checkpoint is not even looked for)."""
    r = subprocess.run([sys.executable, "serve/run.py", f"paths.root={tmp_path}", "force=no"], cwd=REPO,
                       capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2 and r.stderr.strip() == "error: force must be true or false, got 'no'", r.stderr


def test_a_family_that_is_no_model_id_stops_the_server_before_it_loads(tiny_family, tmp_path):
    """Found by a fresh user: ``family=null`` loaded the model, then ended in a traceback (exit 1)
    where the model ids are listed. Now exit status 2 and the key named, before anything loads."""
    from deltafleet.serve.run import check_settings

    r = subprocess.run([sys.executable, "serve/run.py", f"paths.root={tmp_path}", f"base_dir={tiny_family.base_dir}",
                        f"artifacts_dir={tiny_family.artifacts_dir}", "port=0", "family=null"], cwd=REPO,
                       capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2 and r.stderr.strip() == "error: " + FAMILY + "None", r.stderr[-2000:]
    check_settings(_serve_cfg("family=Llama-3.1-8B_ft.v2"))  # a model id as Hugging Face spells them passes
    check_settings(_serve_cfg("model=smollm2"))  # and so does every model group's name (the default family)


def test_tensor_parallel_settings_that_cannot_start_stop_with_one_line(tiny_family, tmp_path):
    """Found by a fresh user: with tp > 1, a tp that does not split the heads, a taken HTTP port or
    rendezvous port (tp_port), a missing base, or a setting only rank 0 checks (attention) ended in
    the ranks' tracebacks and exit status 1. Each is now one error line and exit 2: the first four
    before any rank starts, the rest from rank 0, whose exit status the launcher passes on, also
    where every rank fails (no weights) and another rank may fail first."""
    import socket

    def run(*overrides):
        return subprocess.run([sys.executable, "serve/run.py", f"paths.root={tmp_path}", "threads=1", *overrides],
                              cwd=REPO, capture_output=True, text=True, timeout=180,
                              env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)})

    with socket.socket() as taken, socket.socket() as free:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        free.bind(("127.0.0.1", 0))
        busy, port = taken.getsockname()[1], free.getsockname()[1]
        free.close()
        base = f"base_dir={tiny_family.base_dir}"
        for overrides, message in (
                ((base, "tp=3"), "error: tp=3 does not split the base's 4 query / 2 key-value heads: choose a tp "
                                 "that divides both"),
                ((base, "tp=2", f"port={busy}"), f"error: cannot listen on 127.0.0.1:{busy} (Address already in use): "
                                                 "choose another port=N or host=..."),
                ((base, "tp=2", f"tp_port={busy}", "port=0"), f"error: cannot listen on 127.0.0.1:{busy} (Address "
                                                              "already in use): choose another tp_port=N")):
            r = run(*overrides)
            assert r.returncode == 2 and r.stderr.strip() == message, r.stderr
        r = run(f"base_dir={tmp_path / 'none'}", "tp=2", f"tp_port={port}", "port=0")
        assert r.returncode == 2 and r.stderr.startswith("error: no base checkpoint at") and r.stderr.count("\n") == 1
        r = run(base, f"artifacts_dir={tiny_family.artifacts_dir}", "tp=2", f"tp_port={port}", "port=0",
                "kv_cache.block_size=0")  # rank 0's own check, once the ranks have started
        assert r.returncode == 2 and r.stderr.strip() == "error: kv_cache.block_size must be an integer ≥ 1, got 0", \
            r.stderr
        # every rank fails on this one, the other rank often first: rank 0's line and status still
        no_weights = tmp_path / "no-weights"
        shutil.copytree(tiny_family.base_dir, no_weights, ignore=shutil.ignore_patterns("*.safetensors"))
        r = run(f"base_dir={no_weights}", f"artifacts_dir={tiny_family.artifacts_dir}", "tp=2", f"tp_port={port}",
                "port=0")
        assert r.returncode == 2 and r.stderr.strip() == f"error: {no_weights}: no model.safetensors or " \
                                                          "model.safetensors.index.json", r.stderr


def test_the_announced_url_brackets_an_ipv6_host():
    """Found by a fresh user: ``host=::1`` announced ``http://::1:8000/v1``, which no client parses (the
    host's colons read as the port's). An IPv6 literal is bracketed (RFC 3986); other hosts as they are."""
    from deltafleet.serve.run import _url

    assert _url("::1", 8000) == "http://[::1]:8000/v1"
    assert _url("::", 8123) == "http://[::]:8123/v1"
    assert _url("fe80::1%lo", 8124) == "http://[fe80::1%lo]:8124/v1"
    assert _url("127.0.0.1", 8000) == "http://127.0.0.1:8000/v1"
    assert _url("localhost", 8125) == "http://localhost:8125/v1"
    assert httpx.URL(_url("::1", 8000)).host == "::1"  # what a client makes of it


def test_cuda_without_a_cuda_device_is_refused_by_name():
    import torch

    from deltafleet.serve.run import check_settings

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(ValueError, match=r"^device=cuda, but torch .* sees no CUDA device: serve on device=cpu"):
        check_settings(_serve_cfg("device=cuda"))


def test_a_port_in_use_is_refused_before_the_model_loads():
    """Found by a fresh user: with the port taken, the server loaded the model and printed ``serving …
    at http://127.0.0.1:PORT/v1`` before uvicorn's bind error. The port is checked first."""
    import socket

    from deltafleet.serve.run import _check_port

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=rf"^cannot listen on 127\.0\.0\.1:{port} \(Address already in use\): "
                                             r"choose another port=N or host=\.\.\.$"):
            _check_port("127.0.0.1", port)
    assert _check_port("127.0.0.1", port) == port  # free again
    picked = _check_port("127.0.0.1", 0)  # port=0: a free port, the one the server then announces and binds
    assert 0 < picked <= 65535 and _check_port("127.0.0.1", picked) == picked
