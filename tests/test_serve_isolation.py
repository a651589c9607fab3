"""One client must never hurt another: an error in a step reaches the requests it affects (a 5xx
before the first byte, an in-band event after it) and ends only them; no sampling parameter the API
accepts makes the sampler fail; stop strings are checked in time linear in the new text; request
sizes are bounded before any work; the OpenAPI document lists what the server really answers;
slow and silent connections are closed.

The app in-process (``TestClient``) for what needs a fault injected; the real server
(``python serve/run.py``, one request timeout of 1 s) for timing, memory and raw sockets.
"""
from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from deltafleet.serve.app import create_app
from deltafleet.serve import sampling
from deltafleet.serve.detokenize import TextStream, token_bytes
from deltafleet.serve.engine import Engine
from deltafleet.serve.sampling import SamplingBatch
from deltafleet.serve.protocol import MAX_MESSAGES, MAX_STOP_CHARS, NULL_IS_DEFAULT
from tests.conftest import api_error, free_port, is_utf8, stop_server, wait_healthy

REPO = Path(__file__).resolve().parents[1]
GREEDY = dict(temperature=0, max_tokens=24)


def _events(r) -> list:
    """The data of an SSE response: JSON objects, and "[DONE]" as it is."""
    data = [line.removeprefix("data: ") for line in r.text.split("\n\n") if line]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


def _all_at_once(engine: Engine, calls: list) -> list:
    """Run every ``call()`` in its own thread while the model is held, so that all their requests
    enter the continuous batch in the same scheduler step; their results in order."""
    results: list = [None] * len(calls)

    def go(i, call):
        results[i] = call()

    with engine._gen_lock:
        threads = [threading.Thread(target=go, args=(i, c)) for i, c in enumerate(calls)]
        for t in threads:
            t.start()
        deadline = time.time() + 30
        while sum(engine.scheduler.waiting().values()) < len(calls):
            assert time.time() < deadline, engine.scheduler.waiting()
            time.sleep(0.01)
    for t in threads:
        t.join(60)
    return results


# ------------------------------------------------------------------------------------ step errors


def test_a_tiny_temperature_samples_greedily(tc):
    """The issue's repro: temperature 1e-40 made the sampler divide into NaN and the client got a
    200 with empty text. Below 1e-5 a temperature is greedy (as in vLLM): the same completion as 0."""
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4}
    tiny = tc.post("/v1/completions", json={**body, "temperature": 1e-40})
    greedy = tc.post("/v1/completions", json={**body, "temperature": 0})
    assert tiny.status_code == greedy.status_code == 200
    assert tiny.json()["choices"] == greedy.json()["choices"]
    assert tiny.json()["usage"] == greedy.json()["usage"]
    assert greedy.json()["usage"]["completion_tokens"] >= 1


def test_sampling_takes_any_finite_logits_and_refuses_nan():
    huge = torch.tensor([[3e38, -3e38, 1.0, 0.0]] * 3)
    batch = SamplingBatch.build([(t, 0.5, 0, 7, 3) for t in (1e-5, 1e-3, 2.0)], "cpu")
    assert sampling.sample(huge, batch).tolist() == [0, 0, 0]  # logits / T would overflow to NaN
    bad = torch.tensor([[0.0, float("-inf"), 1.0], [float("nan"), 1.0, 0.0], [float("inf"), 1.0, 0.0],
                        [float("-inf")] * 3])
    for t in (1.0, 0.0):
        tokens = sampling.sample(bad, SamplingBatch.build([(t, 1.0, 0, 7, 3)] * 4, "cpu")).tolist()
        assert tokens[0] in (0, 2) and tokens[1:] == [-1, -1, -1]


@pytest.fixture
def nan_writer(tiny_family, monkeypatch):
    """An engine whose ``tiny-writer`` deltas make NaN logits (its final norm, stored in full in the
    artifact, read as NaN), as a variant broken numerically would."""
    engine = Engine(tiny_family.base_dir, tiny_family.artifacts_dir, family="tiny")
    read = engine.cache._read

    def read_nan(model_id):
        delta = read(model_id)
        if model_id == "tiny-writer":
            delta.full["model.norm.weight"] = torch.full_like(delta.full["model.norm.weight"], float("nan"))
        return delta

    monkeypatch.setattr(engine.cache, "_read", read_nan)
    return engine


def test_a_failed_request_is_a_500_and_its_batch_goes_on(nan_writer):
    """Four requests enter one step: two on the NaN variant (plain and streaming) get a 500 error
    object before any byte of a 200; the base's stream and the coder's completion decode to the end,
    as each does alone. Before, the whole step failed and every client got a 200 with cut text."""
    engine = nan_writer
    ok_stream = {"model": "tiny", "prompt": "def main(", **GREEDY, "stream": True}
    ok_plain = {"model": "tiny-coder", "prompt": "import os\n", **GREEDY}
    with TestClient(create_app(engine)) as tc:
        alone = [tc.post("/v1/completions", json=b) for b in (ok_stream, ok_plain)]
        bad = {"model": "tiny-writer", "prompt": "The quick brown", **GREEDY}
        got = _all_at_once(engine, [lambda b=b: tc.post("/v1/completions", json=b)
                                    for b in (ok_stream, bad, {**bad, "stream": True}, ok_plain)])
        assert tc.get("/health").json() == {"status": "ok"}
        again = tc.post("/v1/completions", json=ok_plain)
    for r in got[1:3]:
        err = api_error(r, 500)
        assert err["type"] == "server_error" and err["code"] == "generation_failed"
        assert "not finite" in err["message"]
    assert got[0].status_code == 200 and _texts(got[0]) == _texts(alone[0])
    assert got[3].status_code == 200
    assert got[3].json()["choices"] == alone[1].json()["choices"] == again.json()["choices"]
    assert got[3].json()["usage"] == alone[1].json()["usage"]


def test_every_choice_of_a_failed_request_is_counted_streamed_or_not(nan_writer):
    """Each choice of a request whose generation fails counts once in ``request_success`` (an error,
    or an abort where it was cut off for its sibling's), streamed as not. Found by a reviewer: a stream
    whose first choice failed before its first token counted that choice alone, the others never."""
    def ended(tc) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in tc.get("/metrics").text.splitlines()
                   if line.startswith('deltafleet:request_success_total{') and 'model_name="tiny-writer"' in line)

    body = {"model": "tiny-writer", "prompt": "The quick brown", **GREEDY, "n": 3}
    with TestClient(create_app(nan_writer)) as tc:
        for stream in (False, True):
            before = ended(tc)
            assert api_error(tc.post("/v1/completions", json={**body, "stream": stream}), 500)["code"] \
                == "generation_failed"
            deadline = time.time() + 10
            while ended(tc) - before < 3 and time.time() < deadline:
                time.sleep(0.02)
            time.sleep(0.2)  # (none counted twice)
            assert ended(tc) - before == 3, stream


def _texts(r) -> tuple[str, str]:
    """A stream's whole text and its finish reason (it ends with a finish, then [DONE])."""
    events = _events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    return "".join(c["choices"][0]["text"] for c in chunks), chunks[-1]["choices"][0]["finish_reason"]


def test_an_error_after_the_first_token_is_an_in_band_event(engine, monkeypatch):
    """A stream whose generation fails at its third token: a 200 with its first two tokens, an
    OpenAI error object as an event, then [DONE] (no usage: the count would be a lie); the same
    request not streamed is a 500, never a 200 with cut text."""
    calls = {"n": 0}
    sample = sampling.sample

    def failing_third(logits, batch):
        calls["n"] += 1
        if calls["n"] % 3 == 0:
            logits = torch.full_like(logits, float("nan"))
        return sample(logits, batch)

    monkeypatch.setattr(sampling, "sample", failing_third)
    body = {"model": "tiny", "prompt": "def main(", "temperature": 0, "max_tokens": 8}
    with TestClient(create_app(engine)) as tc:
        r = tc.post("/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
        calls["n"] = 0
        plain = tc.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _events(r)
    assert events[-1] == "[DONE]"
    assert events[-2] == {"error": {"message": "Generation failed: the model's next-token logits for this request "
                                               "are not finite (NaN or inf).", "type": "server_error",
                                    "param": None, "code": "generation_failed"}}
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-2])  # no finish, no usage
    assert api_error(plain, 500)["code"] == "generation_failed"


# ------------------------------------------------------------------------------------ stop strings


class _CharTokenizer:
    """Token i decodes to ``VOCAB[i]``; concatenation, as a byte-level BPE's decode is."""

    VOCAB = ["a", "b", "c", "d", "ab", "cd", "abc", "x", " ", "\n"]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.VOCAB[i] for i in ids)


def _stream(ids: list[int], stop: tuple[str, ...], tokenizer=None, min_tokens: int = 0,
            context: tuple[int, ...] = ()) -> tuple[str, bool, list[str]]:
    ts = TextStream(tokenizer or _CharTokenizer(), stop, threading.Lock(), min_tokens, context=context)
    pieces = []
    for t in ids:
        piece, stopped = ts.push(t)
        pieces.append(piece)
        if stopped:
            return "".join(pieces), True, pieces
    rest, stopped = ts.flush()
    pieces.append(rest)
    return "".join(pieces), stopped, pieces


def _expected(text: str, stop: tuple[str, ...]) -> tuple[str, bool]:
    """The text up to the first stop string to end (of two ending together, the longer)."""
    ends = [(text.find(s) + len(s), -len(s)) for s in stop if s and s in text]
    if not ends:
        return text, False
    end, minus = min(ends)
    return text[:end + minus], True


def test_stop_strings_cut_the_text_before_the_first_one_and_hold_back_what_may_begin_one():
    assert _stream([4, 5], ("cd",))[:2] == ("ab", True)  # "ab" | "cd"
    assert _stream([0, 1, 2], ("cd", "bcx"))[2] == ["a", "", ""] + ["bc"]  # "bc" held, released at the end
    assert _stream([6, 3], ("bcd", "cd"))[:2] == ("a", True)  # both end at "d": the longer wins
    assert _stream([0, 2, 3, 1], ("cdb", "d"))[:2] == ("ac", True)  # "d" ends first
    assert _stream([0, 0, 0, 1], ("aab",))[:2] == ("a", True)  # a partial match restarts (KMP)
    assert _stream([0, 1], ("",))[:2] == ("ab", False)  # an empty stop never matches


def test_matched_names_the_stop_string_that_ended_the_text():
    """``TextStream.matched`` (vLLM's ``stop_reason``): the stop that ended the text, the longer of
    two that one character completes, whichever order they are given in; None until one does."""
    for stop in (("cd", "bcd", "x"), ("x", "bcd", "cd")):
        ts = TextStream(_CharTokenizer(), stop, threading.Lock())
        assert ts.push(6) == ("a", False) and ts.matched is None  # "abc": "bc" held, it may begin "bcd"
        assert ts.push(3) == ("", True) and ts.matched == "bcd"
    ts = TextStream(_CharTokenizer(), ("zz", "b"), threading.Lock())
    assert ts.push(0) == ("a", False) and ts.matched is None
    assert ts.push(1) == ("", True) and ts.matched == "b"  # the second given


def test_stop_strings_end_nothing_before_min_tokens():
    """vLLM's ``min_tokens``: a stop string completed within the first ``min_tokens`` tokens ends
    nothing (its text is released); one completed later ends the text, also when it began earlier."""
    assert _stream([0, 1, 0, 1], ("ab",), min_tokens=3)[:2] == ("ab", True)  # the first "ab" (token 2) passes
    assert _stream([0, 1, 0, 1], ("ab",), min_tokens=2)[:2] == ("", True)    # token 2 counts
    assert _stream([0, 1, 2], ("bc",), min_tokens=3)[:2] == ("a", True)      # begun at 2, completed at 3
    assert _stream([0, 1], ("b",), min_tokens=5)[:2] == ("ab", False)


def test_stop_strings_match_a_brute_force_reference_on_random_tokens(engine):
    """Random ids of the tiny family's byte-level BPE (partial UTF-8 included) and stops cut from
    their text: the streamed pieces concatenate to the reference; no piece holds a stop. The reference
    ends before a character the ids' bytes leave unfinished (Python's incremental UTF-8 decoder holds
    it back), whose U+FFFD the text drops."""
    import codecs
    import random

    rng = random.Random(0)
    tok = engine.detokenizer
    unfinished = 0
    for _ in range(400):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 24))]
        text = tok.decode(ids, skip_special_tokens=True)
        raw = b"".join(token_bytes(tok, ids))
        if codecs.getincrementaldecoder("utf-8")("replace").decode(raw, final=False) != raw.decode("utf-8", "replace"):
            assert text.endswith("\ufffd")
            text, unfinished = text[:-1], unfinished + 1
        stops = []
        for _ in range(rng.randrange(0, 4)):
            a = rng.randrange(len(text) + 1)
            stops.append(text[a:a + rng.randrange(1, 6)] or "zz")  # U+FFFD too: an incomplete character
        out, stopped, _ = _stream(ids, tuple(stops), tok)
        assert (out, stopped) == _expected(text, tuple(stops)), (ids, stops)
    assert unfinished > 20  # the case is drawn often


def test_each_token_spells_its_own_bytes_pieces_of_characters_too(engine):
    """``token_bytes`` (OpenAI's logprobs ``bytes``): the tiny family's byte-level BPE splits these
    characters into tokens that are no UTF-8 alone, and their bytes concatenate to the text's; an
    added token's are its text. A SentencePiece-style tokenizer (``▁`` for spaces, ``<0xNN>`` byte
    tokens) spells a space and single bytes."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    tok = engine.detokenizer
    text = "def é(x): return '你🙂'"
    ids = tok.encode(text, add_special_tokens=False)
    got = token_bytes(tok, ids)
    assert b"".join(got) == text.encode()
    assert any(not is_utf8(b) for b in got)  # pieces of a character: the case the field is for
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    assert token_bytes(tok, [eos]) == [b"<|endoftext|>"]

    vocab = {"<unk>": 0, "<0xC3>": 1, "<0xA9>": 2, "\u2581a": 3, "b": 4}
    sp = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    sp.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    sp = PreTrainedTokenizerFast(tokenizer_object=sp)
    assert token_bytes(sp, [3, 1, 2, 4]) == [b" a", b"\xc3", b"\xa9", b"b"]
    assert sp.decode([3, 1, 2, 4]) == " aéb"


def _sentencepiece_style():
    """A tokenizer decoding as Llama-2's does: ``▁`` to spaces, ``<0xNN>`` byte tokens, and the text's
    first space stripped."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<0xC3>": 1, "<0xA9>": 2, "\u2581a": 3, "b": 4, "\u2581Hello": 5, "<0xE2>": 6, "<0x82>": 7,
             "<0xAC>": 8}
    sp = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    sp.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=sp)


def test_a_completion_is_detokenized_after_its_prompt():
    """The stream starts from the prompt's last tokens: a SentencePiece decoder strips the first space
    of a text, so the completion's first word alone lost it; a character whose first bytes end the
    prompt is the completion's first once its last bytes come, and stays the prompt's (U+FFFD there,
    not here) when they do not."""
    sp = _sentencepiece_style()
    assert sp.decode([3, 5]) == "a Hello" and sp.decode([5]) == "Hello"
    assert _stream([5, 5], (), sp, context=(3,))[0] == " Hello Hello"
    assert _stream([5], (), sp)[0] == "Hello"  # nothing before it: the decoder's own first word
    assert _stream([2, 4], (), sp, context=(3, 1))[0] == "éb"
    assert _stream([7, 8, 4], (), sp, context=(3, 6))[2] == ["", "€", "b", ""]
    assert _stream([8], (), sp, context=(6, 7))[0] == "€"
    assert _stream([5], (), sp, context=(3, 1))[0] == " Hello"  # é never finished: the prompt's U+FFFD
    assert _stream([7, 5], (), sp, context=(6,))[0] == "\ufffd Hello"  # its own byte 0x82 is the completion's
    assert _stream([], (), sp, context=(3, 1))[0] == ""


def test_an_open_character_after_a_space_in_one_token():
    """Byte-level BPE (SmolLM2's, GPT-2's) spells " 🌱" as a token of the space and the emoji's first
    bytes ("ĠðŁ") and then its last: the space stays the prompt's, the emoji is the completion's, found
    by a fresh user (the first emoji was dropped when its bytes came one token at a time, and the
    space repeated when one token finished it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"I": 0, "Ġlove": 1, "ĠðŁ": 2, "Į": 3, "±": 4, "ðŁ": 5, "Ġ": 6}
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe)
    assert tok.decode([0, 1, 2, 3, 4, 5, 3, 4]) == "I love 🌱🌱"
    assert _stream([3, 4, 5, 3, 4], (), tok, context=(0, 1, 2))[0] == "🌱🌱"
    assert _stream([4, 5, 3, 4], (), tok, context=(0, 1, 2, 3))[0] == "🌱🌱"
    assert _stream([6, 5], (), tok, context=(0, 1, 2))[0] == " "  # neither emoji finished: no U+FFFD
    assert _stream([3, 4, 5, 3, 4], ("🌱",), tok, min_tokens=3, context=(0, 1, 2))[:2] == ("🌱", True)


def test_a_character_left_unfinished_at_the_end_is_dropped():
    """A generation that ends inside a character (``max_tokens`` between its bytes) ends before it, as
    vLLM's does, whether a token holds some of its bytes or one byte each; found by a fresh user (the
    text ended in U+FFFD). Bytes that begin no character stay U+FFFD, wherever they are."""
    sp = _sentencepiece_style()
    assert _stream([5, 6, 7], (), sp, context=(3,))[0] == " Hello"  # € = E2 82 AC, cut after two bytes
    assert _stream([5, 6], (), sp, context=(3,))[0] == " Hello"
    assert _stream([5, 6, 7, 8], (), sp, context=(3,))[0] == " Hello€"
    assert _stream([5, 7], (), sp, context=(3,))[0] == " Hello\ufffd"  # a lone continuation byte
    assert _stream([5, 7, 6], (), sp, context=(3,))[0] == " Hello\ufffd"  # it stays; the unfinished € goes
    assert _stream([5, 1, 6, 7], (), sp, context=(3,))[0] == " Hello\ufffd"  # é's first byte, then €'s two
    assert _stream([7, 5], (), sp, context=(3,))[0] == "\ufffd Hello"
    assert _stream([6], (), sp, context=(3,))[0] == ""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(vocab={"I": 0, "Ġlove": 1, "ĠðŁ": 2, "Į": 3, "±": 4}, merges=[]))
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe)
    assert _stream([1, 2, 3], (), tok, context=(0,))[0] == " love "  # the space is whole; 🌱 is not
    assert _stream([1, 2, 3, 4], (), tok, context=(0,))[0] == " love 🌱"


def test_a_character_left_unfinished_before_skipped_special_tokens_is_dropped():
    """A generation that ends with special tokens, left out of the text (``skip_special_tokens``),
    after the first bytes of a character: the character is dropped as at any end (its U+FFFD was the
    text's end: the special tokens' own bytes hid the open character). Kept in the text, a special
    token ends the character, whose U+FFFD stays."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(vocab={"I": 0, "Ġlove": 1, "ĠðŁ": 2, "Į": 3, "±": 4}, merges=[]))
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe)
    tok.add_special_tokens({"additional_special_tokens": ["<|user|>"]})
    user = tok.convert_tokens_to_ids("<|user|>")
    assert _stream([1, 2, 3, user], (), tok, context=(0,))[0] == " love "
    assert _stream([1, 2, user, 3, user, user], (), tok, context=(0,))[0] == " love "
    assert _stream([1, 2, user, 3, 4, user], (), tok, context=(0,))[0] == " love 🌱"  # finished across it
    for skip, text in ((True, " love "), (False, " love \ufffd<|user|>")):
        ts = TextStream(tok, (), threading.Lock(), skip_special_tokens=skip, context=(0,))
        assert "".join(ts.push(t)[0] for t in (1, 2, user)) + ts.flush()[0] == text


def test_a_prompt_cut_anywhere_leaves_the_completion_its_characters(engine):
    """Byte-level BPE: a prompt of the text's first tokens, cut anywhere (inside a character too), and
    the rest generated: the completion's text is the text from the first character the prompt does
    not hold whole, also with stop strings and ``min_tokens`` counting generated tokens only."""
    tok = engine.detokenizer
    text = "def é(x): return '你🙂 ok'"
    ids = tok.encode(text, add_special_tokens=False)
    ends = {len(text[:i].encode()): i for i in range(len(text) + 1)}  # character ends, in bytes
    for j in range(1, len(ids)):
        held = len(b"".join(token_bytes(tok, ids[:j])))
        first = ends[max(b for b in ends if b <= held)]
        assert _stream(ids[j:], (), tok, context=tuple(ids[:j]))[0] == text[first:], j
    j = len(tok.encode("def é(x): return", add_special_tokens=False))
    assert _stream(ids[j:], ("'",), tok, context=tuple(ids[:j]))[:2] == (" ", True)
    assert _stream(ids[j:], (" ",), tok, min_tokens=2, context=tuple(ids[:j]))[:2] == (" '你🙂", True)


def test_a_long_held_stop_prefix_costs_time_linear_in_the_new_text():
    """A stop of MAX_STOP_CHARS characters whose every prefix the text keeps matching: each token
    feeds the automata its new characters once (the old code re-scanned every prefix of the stop
    on every token: len(stop)² character comparisons each)."""
    n, held = 5000, MAX_STOP_CHARS - 1
    stop = "a" * held + "b"
    t0 = time.perf_counter()
    out, stopped, pieces = _stream([0] * n + [1], (stop,))
    elapsed = time.perf_counter() - t0
    assert (out, stopped) == ("a" * (n - held), True)
    assert pieces[:held] == [""] * held and pieces[held:n] == ["a"] * (n - held)
    assert elapsed < 5.0, elapsed  # the old code: minutes


# ------------------------------------------------------------------------------------ sizes and types


@pytest.mark.parametrize("prompt", [[False, True], [1.0, 2.0], ["1", 2], [1, "2"], [-1], [], ""])
def test_token_id_prompts_are_integers_only(tc, prompt):
    err = api_error(tc.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1}), 400)
    assert err["param"].startswith("prompt") and err["type"] == "invalid_request_error"


def test_what_the_schema_admits_and_the_engine_refuses(tc, engine):
    vocab = engine.model.args.vocab_size
    assert tc.post("/v1/completions", json={"model": "tiny", "prompt": [vocab - 1], "max_tokens": 1}).status_code == 200
    err = api_error(tc.post("/v1/completions", json={"model": "tiny", "prompt": [vocab], "max_tokens": 1}), 400)
    assert err["param"] == "prompt" and str(vocab) in err["message"]


def test_more_messages_than_allowed_are_refused_by_count(tc):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1)}
    assert api_error(tc.post("/v1/chat/completions", json=body), 400) == {
        "message": f"Invalid 'messages': array too long. Expected an array with maximum length {MAX_MESSAGES}, "
                   f"but got an array with length {MAX_MESSAGES + 1} instead.",
        "type": "invalid_request_error", "param": "messages", "code": "array_above_max_length"}
    body["messages"] = body["messages"][:8]
    assert tc.post("/v1/chat/completions", json={**body, "max_tokens": 1}).status_code == 200


def test_stop_strings_over_the_limit_are_refused(tc):
    body = {"model": "tiny", "prompt": "x", "max_tokens": 1}
    at_limit = ["s" * (MAX_STOP_CHARS // 4)] * 4
    assert tc.post("/v1/completions", json={**body, "stop": at_limit}).status_code == 200
    for stop in (at_limit[:3] + [at_limit[3] + "s"], "s" * (MAX_STOP_CHARS + 1)):
        assert api_error(tc.post("/v1/completions", json={**body, "stop": stop}), 400) == {
            "message": f"Invalid 'stop': {MAX_STOP_CHARS + 1} characters in all; at most {MAX_STOP_CHARS} characters "
                       "of stop sequences are allowed per request.",
            "type": "invalid_request_error", "param": "stop", "code": "string_above_max_length"}


def test_developer_is_the_system_role_and_an_unknown_role_is_refused(tc):
    base = {"model": "tiny", "max_tokens": 4, "temperature": 0}
    dev = tc.post("/v1/chat/completions", json={**base, "messages": [{"role": "developer", "content": "Be brief."},
                                                                     {"role": "user", "content": "Hi"}]})
    sys_ = tc.post("/v1/chat/completions", json={**base, "messages": [{"role": "system", "content": "Be brief."},
                                                                      {"role": "user", "content": "Hi"}]})
    assert dev.status_code == 200 and dev.json()["choices"] == sys_.json()["choices"]
    assert dev.json()["usage"] == sys_.json()["usage"]
    err = api_error(tc.post("/v1/chat/completions", json={**base, "messages": [{"role": "function", "content": "1"}]}),
                    400)
    assert err["param"] == "messages.0.role"
    err = api_error(tc.post("/v1/chat/completions", json={**base, "messages": [{"role": "tool", "content": "1"}]}),
                    400)
    assert err["param"] == "messages.0.tool_call_id"  # a tool's result answers a call (tests/test_serve_tools.py)


def test_a_chat_that_spells_special_tokens_is_encoded_in_one_pass(engine):
    """The placeholder path of ``encode_chat`` (a content spelling ``<|user|>``) puts each content back
    once: a content that spells another message's placeholder stays as it is (it was replaced by that
    message's content), and the spelled marker stays text."""
    messages = [{"role": "user", "content": "\ue0001\ue001 and"}, {"role": "assistant", "content": "<|user|> x"}]
    ids = engine.encode_chat(messages)
    user = engine.tokenizer.convert_tokens_to_ids("<|user|>")
    assert ids.count(user) == 1  # the template's, for the first message
    text = engine.tokenizer.decode(ids)
    assert "\ue0001\ue001 and" in text and "<|user|> x" in text


# ------------------------------------------------------------------------------------ OpenAPI


def test_the_openapi_document_lists_every_status_with_the_error_schema(tc):
    doc = tc.get("/openapi.json").json()
    assert "422" not in json.dumps(doc) and "HTTPValidationError" not in doc["components"]["schemas"]
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            for status, resp in op["responses"].items():
                if status != "200":
                    assert resp["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/"
                                                                                      "ErrorResponse"}, (path, status)
    assert set(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert set(doc["paths"][path]["post"]["responses"]["200"]["content"]) == {"application/json",
                                                                                 "text/event-stream"}
        assert set(doc["paths"][path]["post"]["responses"]) == {"200", "400", "404", "408", "413", "429", "500",
                                                                "503"}
    roles = doc["components"]["schemas"]["ChatMessage"]["properties"]["role"]["enum"]
    assert roles == ["system", "user", "assistant", "developer", "tool"]
    assert doc["components"]["schemas"]["CompletionRequest"]["then"] == {
        "required": ["stream"], "properties": {"stream": {"const": True}}}  # stream_options needs stream


def test_a_body_sent_as_another_media_type_is_refused_saying_so(tc):
    """``curl -d`` sends JSON as a form (``application/x-www-form-urlencoded``); FastAPI reads such a
    body as bytes, and the answer names the header to set, not a body "missing or not an object"."""
    body = json.dumps({"model": "tiny", "prompt": "def ", "max_tokens": 2, "temperature": 0}).encode()
    for media in ("application/x-www-form-urlencoded", "text/plain; charset=utf-8"):
        err = api_error(tc.post("/v1/completions", content=body, headers={"content-type": media}), 400)
        assert err == {"message": f"The request body must be JSON, sent with `Content-Type: application/json` "
                                  f"(this request's is `{media}`).", "type": "invalid_request_error",
                       "param": None, "code": "invalid_content_type"}
    answers = [tc.post("/v1/completions", content=body, headers={"content-type": media})
               for media in ("application/json; charset=utf-8", "application/vnd.x+json")]
    assert [r.status_code for r in answers] == [200, 200]
    assert len({r.json()["choices"][0]["text"] for r in answers}) == 1
    r = tc.post("/v1/completions", content=body)  # no Content-Type: a strict FastAPI does not parse it
    if r.status_code != 200:
        assert api_error(r, 400)["message"].endswith("(this request has none).")
    err = api_error(tc.post("/v1/completions", content=b"[1]", headers={"content-type": "application/json"}), 400)
    assert err["code"] == "invalid_body"  # JSON, but not an object


def test_the_document_allows_null_where_the_server_takes_it_as_the_default(tc):
    """A field the server reads null as its default (OpenAI's clients send nulls) is nullable in the
    document, with its type, bounds and default kept (schemathesis flagged ``"echo": null`` as
    accepted against a schema of booleans); and the server answers such a body as one without them."""
    doc = tc.get("/openapi.json").json()
    for schema, body in (("CompletionRequest", {"model": "tiny", "prompt": "def ", "max_tokens": 4}),
                         ("ChatCompletionRequest", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                                    "max_tokens": 4})):
        props = doc["components"]["schemas"][schema]["properties"]
        nullable = [f for f in NULL_IS_DEFAULT if f in props]
        assert len(nullable) >= len(NULL_IS_DEFAULT) - 1  # chat has no echo
        for f in nullable:
            assert props[f]["anyOf"][-1] == {"type": "null"} and "default" in props[f], (schema, f)
        assert props["temperature"]["anyOf"][0] == {"type": "number", "minimum": 0.0, "maximum": 2.0}
        assert props["echo" if "echo" in props else "stream"]["anyOf"][0] == {"type": "boolean"}
        assert "anyOf" not in props["model"]  # required fields stay as they are
        path = "/v1/completions" if schema == "CompletionRequest" else "/v1/chat/completions"
        plain = tc.post(path, json=body | {"temperature": 0}).json()
        nulls = tc.post(path, json=body | {"temperature": 0} | {f: None for f in nullable if f != "temperature"})
        assert nulls.status_code == 200, nulls.text
        assert nulls.json()["choices"] == plain["choices"]


def test_every_answer_is_documented_for_its_operation(nan_writer):
    """Real requests of every kind this server refuses or answers, each checked against the
    document: its status is listed for the operation, with the media type the answer has."""
    cases = [
        ("get", "/health", None), ("get", "/metrics", None), ("get", "/v1/models", None),
        ("get", "/v1/models/tiny", None), ("get", "/v1/models/nope", None), ("get", "/v1/delta_cache", None),
        ("post", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2}),
        ("post", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2, "stream": True}),
        ("post", "/v1/completions", {"model": "nope", "prompt": "x"}),
        ("post", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 10**6}),
        ("post", "/v1/completions", b"{not json"),
        ("post", "/v1/completions", {"model": "tiny", "prompt": "x" * 5000}),  # over max_request_bytes
        ("post", "/v1/completions", {"model": "tiny-writer", "prompt": "x"}),  # NaN: 500
        ("post", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                          "max_tokens": 2, "stream": True}),
        ("post", "/v1/chat/completions", {"model": "tiny", "messages": []}),
        ("post", "/v1/load_variant", {"variant": "../x"}), ("post", "/v1/load_variant", {"variant": "nothere"}),
        ("post", "/v1/unload_variant", {"variant": "nothere"}),
    ]
    seen = set()
    with TestClient(create_app(nan_writer, max_request_bytes=4096)) as tc:
        doc = tc.get("/openapi.json").json()
        for method, path, body in cases:
            kw = {} if body is None else {"content": body} if isinstance(body, bytes) else {"json": body}
            r = tc.request(method, path, **kw)
            template = next(t for t in doc["paths"] if re.fullmatch(re.sub(r"\{\w+\}", "[^/]+", t), path))
            responses = doc["paths"][template][method]["responses"]
            assert str(r.status_code) in responses, (path, body, r.status_code, r.text)
            media = r.headers["content-type"].split(";")[0]
            assert media in responses[str(r.status_code)]["content"], (path, r.status_code, media)
            seen.add(r.status_code)
    assert seen == {200, 400, 404, 413, 500}


def test_405_keeps_its_allow_header(tc):
    r = tc.delete("/v1/completions")
    assert api_error(r, 405)["code"] == "method_not_allowed"
    assert r.headers["allow"] == "POST"


# ------------------------------------------------------------------------------------ the real server


@pytest.fixture(scope="module")
def server(tiny_family, tmp_path_factory):
    """``python serve/run.py`` on the tiny family with ``timeout_request_s=1`` and 8 MiB bodies (the
    default is 2 MiB), so that a huge body reaches the parser; yields (url, pid)."""
    port = free_port()
    out = tmp_path_factory.mktemp("isolation")
    log = open(out / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "serve/run.py", f"paths.root={tiny_family.root}", f"port={port}",
                             "log_level=warning", "timeout_request_s=1", "max_request_bytes=8388608",
                             f"hydra.run.dir={out}"],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, out / "server.log", 60)
    yield url, proc.pid
    stop_server(proc, log, 10)


def _cpu_seconds(pid: int) -> float:
    """The CPU time the process ``pid`` has used (all its threads, user and system), in seconds."""
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _four_tokens_meanwhile(url: str, send) -> tuple[httpx.Response, float, float]:
    """``send()`` in a thread; meanwhile a 4-token request on another model. Returns the latter's
    response and seconds, and the seconds the same request took alone just before (after one to warm
    up): how fast the machine is now (on a loaded one, several times slower than idle)."""
    def four() -> tuple[httpx.Response, float]:
        t0 = time.perf_counter()
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny-coder", "prompt": "def ", "max_tokens": 4,
                                                      "temperature": 0}, timeout=30)
        return r, time.perf_counter() - t0

    four()
    alone = four()[1]
    t = threading.Thread(target=send)
    t.start()
    time.sleep(0.05)
    r, seconds = four()
    t.join(60)
    return r, seconds, alone


def test_a_huge_chat_body_is_refused_at_once_without_holding_memory(server):
    """The issue's 440,000 empty messages (7.9 MB) took 9–12 s to refuse and left the server 770 MB
    larger; now the count is checked before any message is validated. What a refusal costs is measured
    as the server's CPU time (nothing else runs in it meanwhile): on a loaded machine its wall time is
    several times that (2.7 s for 0.25 s of CPU)."""
    url, pid = server
    body = json.dumps({"model": "tiny", "messages": [{"role": "user"}] * 440_000}, separators=(",", ":"))
    assert len(body) < 8 * 2**20
    before = _rss_bytes(pid)
    for _ in range(2):
        t0, cpu0 = time.perf_counter(), _cpu_seconds(pid)
        r = httpx.post(f"{url}/v1/chat/completions", content=body, headers={"Content-Type": "application/json"},
                       timeout=60)
        seconds, cpu = time.perf_counter() - t0, _cpu_seconds(pid) - cpu0
        assert api_error(r, 400)["code"] == "array_above_max_length"
        assert cpu < 1.0 and seconds < 10, (cpu, seconds)
    grown = _rss_bytes(pid) - before
    assert grown < 200 * 2**20, grown


def test_a_400k_character_stop_is_refused_at_once_and_others_go_on(server):
    url, _ = server
    got = {}

    def send():
        got["r"] = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 4,
                                                             "stop": "x" * 400_000}, timeout=60)

    r, seconds, alone = _four_tokens_meanwhile(url, send)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    # idle: alone 0.06 s, so about 1 s; on a loaded machine (alone several times longer) that much more
    assert seconds < 1.0 + 4 * alone, (seconds, alone)
    assert api_error(got["r"], 400)["code"] == "string_above_max_length"


def test_stops_at_the_limit_do_not_slow_the_others(server):
    url, _ = server
    got = {}
    stops = ["a" * (MAX_STOP_CHARS // 4 - 1) + c for c in "bcde"]

    def send():
        got["r"] = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 64,
                                                             "temperature": 0, "stop": stops}, timeout=60)

    r, seconds, alone = _four_tokens_meanwhile(url, send)
    assert r.status_code == 200 and seconds < 1.0 + 4 * alone, (seconds, alone)
    assert got["r"].status_code == 200


@pytest.mark.parametrize("override,message", [
    ("timeout_request_s=0", "timeout_request_s must be a finite number of seconds > 0 or null (none), got 0"),
    ("timeout_keep_alive_s=null", "timeout_keep_alive_s must be a finite number of seconds > 0, got None"),
    ("gil_switch_interval_ms=0", "gil_switch_interval_ms must be a finite number of milliseconds > 0, got 0"),
    ("timeout_graceful_shutdown_s=-1", "timeout_graceful_shutdown_s must be a finite number of seconds > 0 or null "
                                       "(none), got -1"),
    # found by a reviewer: inf passed, and SIGTERM's drain then died in threading.Timer (OverflowError)
    ("timeout_graceful_shutdown_s=inf", "timeout_graceful_shutdown_s must be a finite number of seconds > 0 or "
                                        "null (none), got inf"),
    # found by a reviewer: a body between the two got 503 with Retry-After on every try, never a 413
    ("max_pending_body_bytes=1000", "max_pending_body_bytes (1000) must be at least max_request_bytes (2097152), "
                                    "the largest body one request may send"),
])
def test_bad_timeouts_are_refused_at_startup(tiny_family, override, message):
    out = subprocess.run([sys.executable, "serve/run.py", f"paths.root={tiny_family.root}", override], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert f"error: {message}" in out.stderr


def test_bodies_received_at_once_are_bounded_together():
    """Two slow clients each hold part of a body: the one that takes all bodies being received past
    ``pending_limit`` gets a 503 (Retry-After, connection closed); the first one goes on, and once it
    is done the budget is free again."""
    import asyncio

    from deltafleet.serve.app import BodyLimit

    async def echo(scope, receive, send):
        body = (await receive())["body"]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})

    limit = BodyLimit(echo, limit=None, pending_limit=100)
    scope = {"type": "http", "method": "POST", "headers": []}

    async def client(chunks: list[bytes], gate: asyncio.Event | None, sent: list):
        messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
                    for i, c in enumerate(chunks)]

        async def receive():
            if len(messages) == 1 and gate is not None:
                await gate.wait()
            return messages.pop(0)

        async def send(message):
            sent.append(message)

        await limit(scope, receive, send)

    async def main():
        gate, first, second, third = asyncio.Event(), [], [], []
        task = asyncio.create_task(client([b"a" * 60, b"b" * 10], gate, first))
        await asyncio.sleep(0.01)  # the first holds 60 bytes, waiting for its last chunk
        await client([b"c" * 30, b"d" * 30], None, second)  # 60 + 60 > 100
        gate.set()
        await task
        await client([b"e" * 60, b"f" * 30], None, third)  # the budget is free again
        return first, second, third

    first, second, third = asyncio.run(main())
    assert first[0]["status"] == 200 and first[1]["body"] == b"a" * 60 + b"b" * 10
    assert second[0]["status"] == 503
    headers = dict(second[0]["headers"])
    assert headers[b"retry-after"] == b"1" and headers[b"connection"] == b"close"
    assert json.loads(second[1]["body"])["error"]["code"] == "server_busy"
    assert third[0]["status"] == 200 and limit.pending == 0

    async def alone():  # found by a reviewer: a body too large for pending_limit on its own got 503 every try
        sent: list = []
        await BodyLimit(echo, limit=None, pending_limit=100)(scope, _messages([b"g" * 60, b"h" * 60]), _append(sent))
        return sent

    sent = asyncio.run(alone())
    assert sent[0]["status"] == 413 and json.loads(sent[1]["body"])["error"]["code"] == "request_too_large"


def _messages(chunks: list[bytes]):
    """An ASGI ``receive`` giving ``chunks`` as one body."""
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]

    async def receive():
        return messages.pop(0)
    return receive


def _append(out: list):
    """An ASGI ``send`` that keeps what is sent in ``out``."""
    async def send(message):
        out.append(message)
    return send


def _recv_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_slow_and_silent_connections_are_closed_and_others_served(server):
    """``timeout_request_s=1``: a connection that never sends a whole head is closed after about a
    second (before, it stayed open for ever); a body that stops arriving gets a 408."""
    url, _ = server
    port = int(url.rsplit(":", 1)[1])
    silent, slow, body = (socket.create_connection(("127.0.0.1", port)) for _ in range(3))
    t0 = time.perf_counter()
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and never the rest
    body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"model\": ")
    assert httpx.get(f"{url}/health").status_code == 200  # a normal client meanwhile
    for s in (silent, slow, body):
        s.settimeout(10)
    assert _recv_all(silent) == b"" and _recv_all(slow) == b""
    answer = _recv_all(body)
    assert time.perf_counter() - t0 < 5
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ")
    assert json.loads(payload)["error"]["code"] == "request_timeout"
    for s in (silent, slow, body):
        s.close()


@pytest.mark.parametrize("parser", ["h11", "httptools"])
def test_the_head_timeout_of_each_http_parser(parser):
    """``http_protocol(0.5, parser)`` under a real uvicorn server: a silent connection and one whose
    head stops halfway are closed after the timeout; a keep-alive connection that answered a request
    is closed when the next head does not come in time; a request pipelined behind a slow one (its
    head in before the first response ends) is answered, not cut off by the timer the first response
    re-arms (the second as slow); a head past ``MAX_HEAD_BYTES``, and one with two Host headers, are
    refused; ``auto`` is httptools where it is installed."""
    import asyncio

    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from deltafleet.serve.app import http_protocol

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await asyncio.sleep(0.8 if scope["path"] == "/slow" else 0)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": scope["path"][-2:].encode()})

    port = free_port()
    protocol = http_protocol(0.5, parser)
    assert issubclass(protocol, H11Protocol if parser == "h11" else HttpToolsProtocol)
    assert issubclass(http_protocol(None, "auto"), HttpToolsProtocol)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, http=protocol, loop="asyncio",
                                           lifespan="off", log_level="warning", timeout_keep_alive=30))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        # t0 before connecting: the server's timers start when it takes the connections, after t0 (taken
        # after them, a test thread held up for 0.1 s there would see a timely close come "early")
        t0 = time.monotonic()
        conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
        silent, half, idle, piped = conns
        for c in conns:
            c.settimeout(5)
        half.sendall(b"GET /ab HTTP/1.1\r\nHost: x\r\n")
        idle.sendall(b"GET /cd HTTP/1.1\r\nHost: x\r\n\r\n")
        piped.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n" * 2)
        assert _recv_all(silent) == b"" and _recv_all(half) == b""
        assert 0.4 < time.monotonic() - t0 < 3
        first = _recv_all(idle)  # answered, then closed when no next head came
        assert first.startswith(b"HTTP/1.1 200 ") and first.endswith(b"\r\n\r\ncd")
        answers = _recv_all(piped)  # both answered, though each outlasts the timeout
        assert answers.count(b"HTTP/1.1 200 ") == 2 and answers.count(b"\r\n\r\now") == 2
        for c in conns:
            c.close()
        # a head of 12 KB is served; one past MAX_HEAD_BYTES, sent in pieces (a header, or the
        # request line), is refused with 400 long before its end (by either parser)
        ok = socket.create_connection(("127.0.0.1", port))
        ok.sendall(b"GET /gh HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 12_000 + b"\r\nConnection: close\r\n\r\n")
        assert _recv_all(ok).startswith(b"HTTP/1.1 200 ")
        ok.close()
        if parser == "httptools":  # past MAX_HEAD_BYTES in one read: 400 too (found by a fresh user: 200)
            whole = socket.create_connection(("127.0.0.1", port))
            whole.settimeout(5)
            whole.sendall(b"GET /mn HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n")
            assert _recv_all(whole).startswith(b"HTTP/1.1 400 ")
            whole.close()
        dup = socket.create_connection(("127.0.0.1", port))  # two Host headers: 400 (RFC 9112), by either
        dup.sendall(b"GET /kl HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n")
        dup.settimeout(5)
        assert _recv_all(dup).startswith(b"HTTP/1.1 400 ")
        dup.close()
        for start in (b"GET /ij HTTP/1.1\r\nHost: x\r\nX-Big: ", b"GET /?q="):
            big = socket.create_connection(("127.0.0.1", port))
            big.settimeout(5)
            sent = 0
            try:
                big.sendall(start)
                while sent < 10_000_000:
                    big.sendall(b"a" * 8192)
                    sent += 8192
                    time.sleep(0.001)
            except OSError:  # the server closed the connection
                pass
            assert sent < 200_000, sent
            try:
                answer = _recv_all(big)
            except ConnectionResetError:
                answer = b""
            assert answer.startswith(b"HTTP/1.1 400 ") or (parser == "h11" and answer == b""), answer[:80]
            big.close()
    finally:
        server.should_exit = True
        thread.join(10)
    with pytest.raises(ValueError, match="http_parser must be auto, h11 or httptools, got 'picohttp'"):
        http_protocol(1, "picohttp")


def test_skip_special_tokens_false_keeps_them_in_the_text(engine):
    """vLLM's ``skip_special_tokens``: true (the default) leaves a generated special token out of the
    text, false keeps it as the tokenizer spells it."""
    tok = engine.tokenizer
    ids = tok.encode("def f", add_special_tokens=False) + [tok.convert_tokens_to_ids("<|user|>")] + tok.encode(
        " x", add_special_tokens=False)
    texts = {}
    for skip in (True, False):
        ts = TextStream(tok, (), threading.Lock(), 0, skip)
        texts[skip] = "".join(ts.push(t)[0] for t in ids) + ts.flush()[0]
    assert texts[True] == "def f x" and texts[False] == "def f<|user|> x"


def test_chat_template_kwargs_reach_the_template(engine):
    """vLLM's ``chat_template_kwargs`` are variables of the template's rendering; the ones the server
    sets itself are refused by name."""
    from deltafleet.serve.request import InvalidRequestError

    messages = [{"role": "user", "content": "hi"}]
    template = engine.tokenizer.chat_template
    engine.tokenizer.chat_template = "{% if shout %}LOUD {% endif %}" + template
    try:
        quiet, loud = engine.encode_chat(messages), engine.encode_chat(messages, {"shout": True})
        assert engine.tokenizer.decode(loud).startswith("LOUD ") and engine.tokenizer.decode(loud)[5:] == \
            engine.tokenizer.decode(quiet)
        with pytest.raises(InvalidRequestError, match=r"may not set \['add_generation_prompt'\]"):
            engine.encode_chat(messages, {"add_generation_prompt": False})
    finally:
        engine.tokenizer.chat_template = template


def test_chat_template_kwargs_cannot_bring_a_template_or_rendering_options(engine, tc):
    """Found by probing as a vLLM user: ``chat_template_kwargs: {"chat_template": ...}`` replaced the
    model's template, so a 100-byte request rendered text that no length check had seen (millions of
    tokens to encode under the tokenizer's one lock) and the top-level ``chat_template``'s refusal
    was bypassed. Every option of ``apply_chat_template`` is now refused by name, before rendering."""
    from deltafleet.serve.request import InvalidRequestError

    messages = [{"role": "user", "content": "hi"}]
    for name, value in [("chat_template", "{{ 'ab ' * 2000000 }}"), ("documents", [{"text": "x"}]),
                        ("tokenizer_kwargs", {}), ("return_dict", True)]:
        with pytest.raises(InvalidRequestError, match=rf"may not set \['{name}'\]"):
            engine.encode_chat(messages, {name: value})
    bomb = {"chat_template_kwargs": {"chat_template": "{{ 'ab ' * 2000000 }}"}}
    for path, body in [("/v1/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": 1, **bomb}),
                       ("/tokenize", {"messages": messages, **bomb})]:
        err = api_error(tc.post(path, json=body), 400)
        assert (err["param"], err["code"]) == ("chat_template_kwargs", "invalid_value"), err
        assert "['chat_template']" in err["message"]


def _server(tiny_family, out: Path, *settings: str):
    """``serve/run.py`` over the tiny family on a free port with ``settings``, its output in
    ``out/server.log``: ``(process, url, log file)``."""
    port = free_port()
    log = open(out / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "serve/run.py", f"paths.root={tiny_family.root}", f"port={port}",
                             "log_level=warning", *settings, f"hydra.run.dir={out}"], cwd=REPO, stdout=log,
                            stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}", log


@pytest.mark.parametrize("ignored", [False, True])
def test_sighup_shuts_down_as_sigterm_unless_ignored(tiny_family, tmp_path, ignored):
    """Found by a fresh user: SIGHUP (a closed terminal) killed the server at once, status 129, its
    streams cut without an error event and its waiting requests without an answer. It now drains as
    SIGTERM does and exits with 0; where it is ignored (``nohup``), the server goes on serving."""
    import signal

    def hup():  # set either way: a test run under nohup would hand its SIG_IGN down
        signal.signal(signal.SIGHUP, signal.SIG_IGN if ignored else signal.SIG_DFL)

    port = free_port()
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "serve/run.py", f"paths.root={tiny_family.root}", f"port={port}",
                             "log_level=warning", f"hydra.run.dir={tmp_path}"], cwd=REPO, stdout=log,
                            stderr=subprocess.STDOUT, preexec_fn=hup)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, tmp_path / "server.log", 120)
        proc.send_signal(signal.SIGHUP)
        if ignored:
            time.sleep(1)
            assert proc.poll() is None and httpx.get(f"{url}/health").status_code == 200
            proc.terminate()
        assert proc.wait(timeout=60) == 0, (tmp_path / "server.log").read_text()[-2000:]
    finally:
        stop_server(proc, log, 10)


def test_sigterm_gives_requests_in_flight_a_bounded_time(tiny_family, tmp_path):
    """Found by a fresh user: on SIGTERM the server waited for every request in flight to finish
    (minutes for a long one). ``timeout_graceful_shutdown_s`` bounds that wait: the requests still
    running then are cut off (no complete answer) and the server exits."""
    proc, url, log = _server(tiny_family, tmp_path, "timeout_graceful_shutdown_s=1")
    try:
        wait_healthy(proc, url, tmp_path / "server.log", 120)
        body = {"model": "tiny", "prompt": "x", "max_tokens": 120, "ignore_eos": True, "n": 128, "logprobs": 5}
        t0 = time.time()
        alone = httpx.post(f"{url}/v1/completions", timeout=600, json=body)
        took = time.time() - t0
        assert alone.status_code == 200, alone.text
        got = {}

        def long_request():
            try:
                got["r"] = httpx.post(f"{url}/v1/completions", timeout=600, json=body)
            except httpx.HTTPError as e:
                got["r"] = e

        threads = [threading.Thread(target=long_request) for _ in range(4)]

        def metric(text, name):
            m = re.search(rf'^{re.escape(name)}{{model_name="tiny"}} (\S+)$', text, re.M)
            return float(m.group(1)) if m else 0.0

        prompt_tokens = metric(httpx.get(f"{url}/metrics").text, "deltafleet:prompt_tokens_total")
        assert prompt_tokens > 0
        for t in threads:
            t.start()
        # the requests are generating (alone, each one takes `took` seconds): all four admitted (their
        # choices' prompts counted), and choices running
        deadline = time.time() + 60
        while True:
            text = httpx.get(f"{url}/metrics").text
            if metric(text, "deltafleet:prompt_tokens_total") == 5 * prompt_tokens \
                    and metric(text, "deltafleet:num_requests_running") >= 1:
                break
            assert time.time() < deadline, "the four requests never were all admitted and generating"
            time.sleep(0.02)
        t0 = time.time()
        proc.terminate()
        assert proc.wait(timeout=60) == 0
        assert time.time() - t0 < 1 + took, "the server waited for the requests in flight"
        for t in threads:
            t.join(timeout=30)
        # each request has choices that never started (8 rows run at once): refused with a JSON 503
        for t in threads:
            assert isinstance(got.get("r"), httpx.Response), got
            assert api_error(got["r"], 503)["code"] == "shutting_down"
    finally:
        stop_server(proc, log, 10)


def test_a_shutdown_refuses_waiting_requests_and_cuts_off_running_ones_with_503(tiny_family):
    """Found by a fresh user: at a graceful shutdown, requests still running at its end got uvicorn's
    plain-text 500 and requests that had not started waited for the whole grace. Now (a real server on
    loopback, told to exit as a SIGTERM does) a request not started gets a JSON 503 ``shutting_down``
    at once, and a stream running past the grace gets its in-band error event, then ``[DONE]``."""
    import openai
    import uvicorn

    from deltafleet.serve.run import ANSWER_S, _draining_server

    eng = Engine(tiny_family.base_dir, tiny_family.artifacts_dir, family="tiny", max_batch=1)
    real = eng.scheduler.runner.execute

    def slow(step, prev=None):  # 100 tokens take 2 s or more: past the grace
        time.sleep(0.02)
        return real(step, prev)

    eng.scheduler.runner.execute = slow
    app, port, grace = create_app(eng), free_port(), 0.5
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off",
                            timeout_graceful_shutdown=grace + ANSWER_S)
    listening = []  # whether the port took a connection when the server announced itself

    def announce():
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            listening.append(True)

    server = _draining_server(config, lambda: app.state.drain(grace), announce)
    runs = threading.Thread(target=server.run)
    runs.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while not server.started:
            assert time.time() < deadline and runs.is_alive(), "the server did not start"
            time.sleep(0.02)
        assert listening == [True]  # found by a fresh user: `serving … at` came before uvicorn listened
        body = {"model": "tiny-coder", "prompt": "def ", "max_tokens": 100, "ignore_eos": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}, timeout=60) as running:
            assert running.status_code == 200  # its first token came: it runs, and holds the one row
            lines = running.iter_lines()
            first = next(line for line in lines if line)
            assert json.loads(first.removeprefix("data: "))["choices"][0]["text"] is not None
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
            waiting: dict = {}

            def wait():
                try:
                    client.completions.create(model="tiny-writer", prompt="The", max_tokens=4)
                except openai.APIStatusError as e:
                    waiting["error"], waiting["at"] = e, time.time()

            asker = threading.Thread(target=wait)
            asker.start()
            while not eng.scheduler.waiting():
                time.sleep(0.01)
            t0 = time.time()
            server.handle_exit(15, None)  # what SIGTERM calls
            asker.join(timeout=30)
            err = waiting["error"]
            assert err.status_code == 503 and err.body["code"] == "shutting_down", err.body
            assert "shutting down" in err.body["message"]
            rest = [line for line in lines if line]
            cut = time.time()
        assert rest[-1] == "data: [DONE]" and len(rest) >= 2, rest
        error = json.loads(rest[-2].removeprefix("data: ")).get("error")
        assert error, rest[-3:]
        assert error["code"] == "shutting_down" and "0.5 s of grace" in error["message"], error
        assert all("choices" in json.loads(line.removeprefix("data: ")) for line in rest[:-2])
        assert waiting["at"] - t0 < cut - t0 and cut - t0 >= grace  # refused first; cut off at the grace
        runs.join(timeout=30)
        assert not runs.is_alive()
    finally:
        server.should_exit = True
        runs.join(timeout=30)


def test_a_shutdown_refuses_a_body_still_arriving_at_once(tiny_family):
    """Found by a fresh user: at SIGTERM, a request whose body was still arriving (9 of 100 bytes sent)
    held the shutdown until its 408 came, ``timeout_request_s`` later. Now it gets its 503
    ``shutting_down`` at once, the connection is closed, and the server exits."""
    import uvicorn

    from deltafleet.serve.run import ANSWER_S, _draining_server

    eng = Engine(tiny_family.base_dir, tiny_family.artifacts_dir, family="tiny", max_batch=1)
    app, port = create_app(eng, request_timeout_s=30.0), free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off",
                            timeout_graceful_shutdown=5 + ANSWER_S)
    server = _draining_server(config, lambda: app.state.drain(5.0), lambda: None)
    runs = threading.Thread(target=server.run)
    runs.start()
    try:
        deadline = time.time() + 60
        while not server.started:
            assert time.time() < deadline and runs.is_alive(), "the server did not start"
            time.sleep(0.02)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as slow:
            slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"model\":")
            time.sleep(0.3)  # the head is in, the body arriving
            t0 = time.time()
            server.handle_exit(15, None)  # what SIGTERM calls
            answer = b""
            while chunk := slow.recv(65536):  # until the server closes the connection
                answer += chunk
            took = time.time() - t0
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 "), answer
        assert b"connection: close" in head.lower(), head
        assert json.loads(body)["error"]["code"] == "shutting_down", body
        assert took < 3, took  # not the 30 s of timeout_request_s
        runs.join(timeout=15)
        assert not runs.is_alive()
    finally:
        server.should_exit = True
        runs.join(timeout=30)


def test_a_second_ctrl_c_while_requests_run_exits_130_without_an_abort(tiny_family, tmp_path):
    """Found by a fresh user: a second Ctrl-C while requests ran ended the process with ``terminate
    called without an active exception`` (SIGABRT, status 134): the interpreter exited while the model
    thread was inside a step. A forced exit now leaves at once with status 130."""
    import signal

    proc, url, log = _server(tiny_family, tmp_path)
    try:
        wait_healthy(proc, url, tmp_path / "server.log", 120)
        body = {"model": "tiny-coder", "prompt": "x", "max_tokens": 120, "ignore_eos": True, "n": 64, "logprobs": 5}
        cut = []

        def ask():
            try:
                cut.append(httpx.post(f"{url}/v1/completions", json=body, timeout=120).status_code)
            except httpx.HTTPError:  # the forced exit closes the connection
                cut.append("closed")

        threads = [threading.Thread(target=ask, daemon=True) for _ in range(2)]
        for t in threads:
            t.start()
        deadline = time.time() + 60
        while not re.search(r'^deltafleet:num_requests_running{model_name="tiny-coder"} [1-9]',
                            httpx.get(f"{url}/metrics").text, re.M):
            assert time.time() < deadline, "the requests never ran"
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
        for t in threads:
            t.join(timeout=30)
        # the request running is cut off; the other, whose choices all waited, was refused at the first
        assert sorted(cut, key=str) == [503, "closed"]
    finally:
        stop_server(proc, log, 10)
    out = (tmp_path / "server.log").read_text()
    assert "terminate called" not in out and "Traceback" not in out, out[-2000:]


def test_once_draining_health_and_every_new_request_are_a_503(tiny_family):
    """After ``drain`` (the first SIGTERM), ``/health`` says so (a load balancer stops sending), and a
    request arriving on a connection still open is refused as one that had not started, streaming
    or not; the engine is otherwise unchanged."""
    eng = Engine(tiny_family.base_dir, tiny_family.artifacts_dir, family="tiny")
    with TestClient(create_app(eng)) as client:
        body = {"model": "tiny-coder", "prompt": "def ", "max_tokens": 3}
        assert client.post("/v1/completions", json=body).status_code == 200
        client.app.state.drain(None)
        assert api_error(client.get("/health"), 503)["code"] == "shutting_down"
        for extra in ({}, {"stream": True}):
            err = api_error(client.post("/v1/completions", json=body | extra), 503)
            assert err["code"] == "shutting_down" and err["type"] == "service_unavailable_error"
        err = api_error(client.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 3,
                                                                  "messages": [{"role": "user", "content": "hi"}]}), 503)
        assert err["code"] == "shutting_down"
        assert eng.scheduler.waiting() == {} and eng.scheduler.running == []


def test_two_ctrl_c_end_the_server_without_a_traceback(tiny_family, tmp_path):
    """Found by a fresh user: a second Ctrl-C during the shutdown printed uvicorn's lifespan task's
    tracebacks (the app has no lifespan events: the server runs with ``lifespan="off"``)."""
    import signal

    proc, url, log = _server(tiny_family, tmp_path)
    try:
        wait_healthy(proc, url, tmp_path / "server.log", 120)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130  # a forced exit
    finally:
        stop_server(proc, log, 10)
    out = (tmp_path / "server.log").read_text()
    assert out.startswith("serving tiny, tiny-coder, tiny-writer") and "Traceback" not in out, out[-2000:]


def test_log_probabilities_name_each_token_by_its_own_bytes():
    """Found by a fresh user: a SentencePiece token (``▁or``) decoded alone lost its leading space, so
    ``▁or`` and ``or`` were one name, and tokens read "rights" with bytes " rights"; every piece of a
    character read "�". Names are the token's own text, or ``bytes:\\xNN…`` (OpenAI's) for a piece, and
    ``text_offset`` counts a piece as its bytes decode alone."""
    from deltafleet.serve.detokenize import token_chars, token_name

    sp = _sentencepiece_style()
    names = [token_name(b) for b in token_bytes(sp, [5, 4, 6, 7, 1, 2])]
    assert names == [" Hello", "b", "bytes:\\xe2", "bytes:\\x82", "bytes:\\xc3", "bytes:\\xa9"]
    assert [token_chars(n) for n in names] == [6, 1, 1, 1, 1, 1]
    assert token_name(b"\xc3\xa9") == "é" and token_chars("bytes:\\xe2\\x82") == 1
    assert token_chars("bytes:\\xa5\\xa5") == 2 and token_chars("bytes:\\x20\\xf0\\x9f") == 2  # " " then a piece


def test_a_byte_fallback_vocabulary_without_one_letter_tokens_streams_as_a_utf8_decoder():
    """Found by a reviewer: the text after a run of byte tokens was decoded after a token of one
    letter (``x``, ``a``, ...); a vocabulary of none (only ``▁Hi``, ``▁b`` and the 256 byte tokens)
    fell back to the tokenizer's decode, which reads a run that is not whole UTF-8 as one U+FFFD a
    byte: "中" then a stray 0x80 streamed "中" and three U+FFFD. The byte token of the letter serves."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "\u2581Hi": 1, "\u2581b": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    sp = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    sp.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    sp = PreTrainedTokenizerFast(tokenizer_object=sp)
    assert sp.decode([3 + 0xE4, 3 + 0xB8, 3 + 0xAD, 3 + 0x80]) == "\ufffd" * 4  # the tokenizer's own reading
    text, _, pieces = _stream([3 + 0xE4, 3 + 0xB8, 3 + 0xAD, 3 + 0x80, 2], (), sp, context=(1,))
    assert (text, pieces) == ("中\ufffd b", ["", "", "中", "", "\ufffd b", ""])
    assert _stream([2, 3 + 0xC3, 3 + 0xA9, 3 + 0xFF, 1], (), sp, context=(1,))[0] == " bé\ufffd Hi"


def test_a_byte_fallback_text_cut_anywhere_ends_as_a_utf8_decoder_ends_it():
    """SentencePiece byte fallback (Llama-2's, Mistral's) decodes a run of byte tokens that is not
    whole UTF-8 as one U+FFFD a byte, the whole characters before the open one included; found by a
    fresh user, a text cut inside a character after a whole one ended "你��" instead of "你". Random
    cuts of random text end where Python's incremental UTF-8 decoder ends them."""
    import codecs
    import random

    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "\u2581Hi": 1, "a": 2, "\u2581b": 3, **{f"<0x{b:02X}>": 4 + b for b in range(256)}}
    sp = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    sp.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    sp = PreTrainedTokenizerFast(tokenizer_object=sp)

    def ids_of(char: str) -> list[int]:
        return [vocab[char]] if char in vocab else [4 + b for b in char.encode()]

    rng = random.Random(0)
    for _ in range(300):
        ids = [i for c in rng.choices(["你", "好", "é", "😀", "a", "\u2581b", "\u0301"], k=rng.randrange(1, 8))
               for i in ids_of(c)]
        ids = ids[:rng.randrange(1, len(ids) + 1)]
        want = codecs.getincrementaldecoder("utf-8")("replace").decode(b"".join(token_bytes(sp, ids)), final=False)
        assert _stream(ids, (), sp, context=(1,))[0] == want, ids
    # bytes that are no UTF-8 anywhere in the text (a stray continuation byte, a character cut short):
    # found by a reviewer, "中" then byte 0x80 streamed "中" and three U+FFFD (the tokenizer reads the
    # run as four, the stream had released "中" already); each reads U+FFFD as a UTF-8 decoder reads it
    pieces = ["你", "é", "😀", "a", "\u2581b", b"\x80", b"\xe4\xbd", b"\xf0\x9f", b"\xff"]
    for _ in range(300):
        ids = [i for c in rng.choices(pieces, k=rng.randrange(1, 9))
               for i in (ids_of(c) if isinstance(c, str) else [4 + b for b in c])]
        ids = ids[:rng.randrange(1, len(ids) + 1)]
        want = codecs.getincrementaldecoder("utf-8")("replace").decode(b"".join(token_bytes(sp, ids)), final=False)
        assert _stream(ids, (), sp, context=(1,))[0] == want, ids
