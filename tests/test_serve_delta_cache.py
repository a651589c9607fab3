"""The delta cache inside the engine and through HTTP: eviction under a byte budget, requests in
flight protecting their variant, hot load/unload confined to the artifact root, the optional
API key (with the real ``openai`` client), and the cache's metrics."""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import threading
import time
from pathlib import Path

import openai
import pytest
import torch
from fastapi.testclient import TestClient

from deltafleet.serve.app import create_app
from deltafleet.serve.cache import DeltaCache
from deltafleet.serve.engine import Engine, SamplingParams, VariantUnavailableError
from deltafleet.serve.request import ModelNotFoundError
from tests.conftest import api_error

GREEDY = SamplingParams(max_tokens=6, temperature=0)


@pytest.fixture(scope="module")
def root(tiny_family, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cache_root")
    shutil.copytree(tiny_family.base_dir, root / "models" / "base")
    shutil.copytree(tiny_family.artifacts_dir, root / "artifacts")
    return root


def _engine(root: Path, **cache) -> Engine:
    return Engine(root / "models" / "base", root / "artifacts", family="tiny", delta_cache=cache)


@pytest.fixture(scope="module")
def delta_bytes(root) -> int:
    """Bytes of one variant slot on the device (every variant of a family takes one slot)."""
    return _engine(root).slots.slot_bytes


@pytest.mark.parametrize("layout", ["rows", "tiled"])
def test_a_budget_of_one_variant_evicts_the_other_and_outputs_stay_exact(root, layout):
    """Also with the slots' signs tiled: the host tier keeps the slot's (tiled) copy, which goes back
    into a slot as it is."""
    ref = _engine(root)
    want = {m: ref.complete(m, "def main(", GREEDY).text for m in ("tiny-coder", "tiny-writer")}
    delta_bytes = _engine(root, sign_layout=layout).slots.slot_bytes
    engine = _engine(root, device_slots=1, host_budget_bytes=delta_bytes, sign_layout=layout)
    events = []
    engine.add_listener(lambda ev, m, s, tier: events.append((ev, m, tier)))
    assert engine.complete("tiny-coder", "def main(", GREEDY).text == want["tiny-coder"]
    assert engine.complete("tiny-writer", "def main(", GREEDY).text == want["tiny-writer"]
    assert engine.cache.tier("tiny-coder") == "host" and engine.cache.tier("tiny-writer") == "device"
    assert ("evict", "tiny-coder", "device") in events
    assert engine.complete("tiny-coder", "def main(", GREEDY).text == want["tiny-coder"]  # back from host
    assert ("load", "tiny-coder", "host") in events
    assert engine.complete("tiny-writer", "def main(", GREEDY).text == want["tiny-writer"]  # and again
    assert engine.cache.device_bytes == delta_bytes and engine.cache.host_bytes <= delta_bytes
    assert engine.slots.n_slots == 1 and engine.slots.free_slots == 0


def test_a_device_budget_below_one_slot_is_refused(root, delta_bytes):
    with pytest.raises(ValueError, match=rf"device_budget_bytes=100 is less than one variant slot \({delta_bytes} bytes\)"):
        _engine(root, device_budget_bytes=100)


def test_a_request_in_flight_keeps_its_variant_and_another_variant_waits_or_gets_503(root, delta_bytes):
    engine = _engine(root, device_budget_bytes=delta_bytes + 1, wait_timeout_s=0.3)  # one slot
    held = engine.prepare("tiny-coder", engine.encode_prompt("x"), GREEDY)  # admitted, not yet run
    with pytest.raises(VariantUnavailableError, match=r"no room on the device for variant `tiny-writer`.*"
                                                      r"\(tiny-coder\) is in flight or pinned"):
        engine.prepare("tiny-writer", engine.encode_prompt("x"), GREEDY)
    assert engine.cache.tier("tiny-coder") == "device"
    steps = list(engine.run(held))  # running it to the end releases the variant
    assert steps and engine.cache.snapshot()["tiny-coder"]["in_flight"] == 0
    assert engine.complete("tiny-writer", "x", GREEDY).completion_tokens >= 1
    assert engine.cache.tier("tiny-coder") in ("host", "disk")


def _behind_a_busy_slot(root, max_waiting, check) -> list:
    """45 requests for tiny-writer, waiting while the one device slot's variant (tiny-coder) is in
    flight; ``check(tc)`` runs once the gauges count them all, then the slot comes free. Returns their
    responses."""
    engine = _engine(root, device_slots=1, wait_timeout_s=60)
    held = engine.prepare("tiny-coder", engine.encode_prompt("x"), GREEDY)  # the one slot, in flight
    body = {"model": "tiny-writer", "prompt": "x", "max_tokens": 2}
    answers: list = []
    with TestClient(create_app(engine, max_waiting=max_waiting)) as tc:
        threads = [threading.Thread(target=lambda: answers.append(tc.post("/v1/completions", json=body)))
                   for _ in range(45)]
        try:
            for t in threads:
                t.start()
            deadline = time.time() + 30
            while 'deltafleet:num_requests_waiting{model_name="tiny-writer"} 45.0' not in tc.get("/metrics").text:
                assert time.time() < deadline, "the requests waiting for tiny-writer's deltas are not counted"
                time.sleep(0.05)
            assert not answers  # all still wait
            check(tc)
        finally:
            engine.release(held)
            for t in threads:
                t.join(timeout=90)
    return answers


def test_requests_waiting_for_a_variant_count_as_waiting_and_hold_up_no_other(root):
    """A request waits for its variant's deltas (no free slot: the one slot's variant is in flight)
    as vLLM's requests wait past ``max_loras``: counted in the waiting gauges and
    ``waiting_lora_adapters``, and in ``max_waiting`` (429 past it), and holding none of the threads
    every other request needs. Found by a fresh user: such requests were in no gauge, and 40 of
    them (anyio's thread limit) stalled every request of the server, the base's too, until their
    ``wait_timeout_s`` ran out."""
    def counted(tc):
        metrics = tc.get("/metrics").text
        assert 'vllm:num_requests_waiting{model_name="tiny"} 45.0' in metrics
        assert re.search(r'vllm:lora_requests_info\{max_lora="1",running_lora_adapters="",'
                         r'waiting_lora_adapters="tiny-writer"\}', metrics)
        r = tc.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
        assert api_error(r, 429)["code"] == "overloaded"

    def base_answered(tc):  # no max_waiting: the base is answered while the 45 wait
        r = tc.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2

    for max_waiting, check in ((45, counted), (None, base_answered)):
        answers = _behind_a_busy_slot(root, max_waiting, check)
        assert sorted(r.status_code for r in answers) == [200] * 45


def test_a_later_choice_of_a_request_never_waits_behind_the_load_its_first_choice_blocks(root):
    """A request's choices are acquired one after another and none starts before all are: a later
    choice (``held``: the first holds the variant) does not wait behind a load that drains the
    variant, since that load waits for the first choice's hold to end. Found by a review: with one
    slot, ``n=2`` for the resident variant while another variant's load waited for room made both
    wait out ``wait_timeout_s``, then that load got a 503."""
    engine = _engine(root, device_slots=1, wait_timeout_s=20)
    ids = engine.encode_prompt("x")
    first = engine.prepare("tiny-coder", ids, GREEDY)  # choice 0: holds the one slot, not started
    other: list = []
    cold = threading.Thread(target=lambda: other.append(engine.prepare("tiny-writer", ids, GREEDY)))
    cold.start()
    deadline = time.time() + 10
    while not engine.cache._entries["tiny-coder"].draining:  # the writer's load waits for room
        assert time.time() < deadline
        time.sleep(0.01)
    t0 = time.monotonic()
    second = engine.prepare("tiny-coder", ids, GREEDY, held=first.delta)  # choice 1 of the same request
    assert time.monotonic() - t0 < 5 and second.delta is first.delta
    for r in (first, second):
        engine.release(r)
    cold.join(timeout=20)
    assert [r.model_id for r in other] == ["tiny-writer"] and engine.cache.tier("tiny-writer") == "device"
    engine.release(other[0])


def test_a_generation_never_read_gives_its_variant_back(root):
    """``Engine.generate`` holds the variant from its call: an iterator closed or dropped before its
    first step is read ends the request, so the variant is neither held for ever nor kept from
    removal. Found by a review: the request was submitted only at the first step read, and its
    hold was never released."""
    from tests.conftest import wait_released

    engine = _engine(root)
    gen = engine.generate("tiny-coder", engine.encode_prompt("x"), GREEDY)
    gen.close()
    del gen
    wait_released(engine, "tiny-coder")
    engine.remove_variant("tiny-coder")  # no request in flight: 409 before
    assert "tiny-coder" not in [c.id for c in engine.models()]
    ids = engine.encode_prompt("x")  # read to the end as ever
    steps = list(engine.generate("tiny-writer", ids, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)))
    assert [s.finish_reason for s in steps] == [None, None, "length"]


def _until(cond, what: str, timeout_s: float = 20) -> None:
    deadline = time.time() + timeout_s
    while not cond():
        assert time.time() < deadline, what
        time.sleep(0.02)


def test_a_request_cancelled_while_waiting_for_its_variant_gives_the_hold_back(root):
    """A request task cancelled while its thread waits for the variant's deltas (an ASGI client's
    timeout; uvicorn's cancel at the end of its graceful shutdown): the thread goes on, and the hold
    it then takes is given back, as is the request's admission. Found by a fresh user: the variant
    stayed held for good (never evicted, every other variant 503, unload 409)."""
    import asyncio

    import httpx

    engine = _engine(root, device_slots=1, wait_timeout_s=20)
    held = engine.prepare("tiny-coder", engine.encode_prompt("x"), GREEDY)  # the one slot
    app = create_app(engine, max_waiting=1)

    async def cancelled():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(c.post("/v1/completions", json={"model": "tiny-writer", "prompt": "x",
                                                                        "max_tokens": 2}), 0.5)
        engine.release(held)  # the slot comes free: the thread left behind loads tiny-writer
        deadline = time.time() + 20  # (the event loop runs meanwhile, as a server's does)
        while engine.cache.tier("tiny-writer") != "device" or engine.cache.snapshot()["tiny-writer"]["in_flight"]:
            assert time.time() < deadline, f"tiny-writer's hold was never given back: {engine.cache.snapshot()}"
            await asyncio.sleep(0.02)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            r = await c.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 200  # its admission was given back too (max_waiting=1)

    asyncio.run(cancelled())


def test_a_later_choice_takes_the_version_its_request_holds(root, tmp_path):
    """A request's later choice (``held``) takes the variant's version that its first choice holds,
    even when the artifact was re-exported in between: it does not retire that version and wait,
    behind its own first choice, for room to load the new one. Found by a fresh user."""
    shutil.copytree(root / "models", tmp_path / "models")
    shutil.copytree(root / "artifacts", tmp_path / "artifacts")
    engine = _engine(tmp_path, device_slots=1, wait_timeout_s=20)
    ids = engine.encode_prompt("x")
    first = engine.prepare("tiny-coder", ids, GREEDY)
    manifest = tmp_path / "artifacts" / "coder" / "bitdelta.json"
    st = manifest.stat()
    os.utime(manifest, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # re-exported: its stamp changes
    t0 = time.monotonic()
    second = engine.prepare("tiny-coder", ids, GREEDY, held=first.delta)
    assert time.monotonic() - t0 < 5 and second.delta is first.delta
    for r in (first, second):
        engine.release(r)
    third = engine.prepare("tiny-coder", ids, GREEDY)  # a new request reads the new version
    assert third.delta is not first.delta
    engine.release(third)


def test_a_hot_load_is_no_waiting_request_and_a_new_variant_has_its_series(root, tmp_path):
    """``/v1/load_variant`` waiting for room is no request: the waiting gauges stay 0. A variant
    whose folder appeared after the start has its ``deltafleet:`` series from its first wait, so
    both gauges count that request. Found by a fresh user."""
    shutil.copytree(root / "models", tmp_path / "models")
    shutil.copytree(root / "artifacts", tmp_path / "artifacts")
    engine = _engine(tmp_path, device_slots=1, wait_timeout_s=20)
    held = engine.prepare("tiny-coder", engine.encode_prompt("x"), GREEDY)
    out: list = []
    with TestClient(create_app(engine)) as tc:
        shutil.copytree(tmp_path / "artifacts" / "writer", tmp_path / "artifacts" / "late")
        threads = [threading.Thread(target=lambda: out.append(tc.post("/v1/load_variant", json={"variant": "writer"}))),
                   threading.Thread(target=lambda: out.append(tc.post("/v1/completions", json={
                       "model": "tiny-late", "prompt": "x", "max_tokens": 2})))]
        try:
            threads[0].start()
            _until(lambda: engine.cache._entries.get("tiny-writer") is not None
                   and engine.cache._entries["tiny-coder"].draining, "the hot load never waited for room")
            metrics = tc.get("/metrics").text
            assert 'vllm:num_requests_waiting{model_name="tiny"} 0.0' in metrics
            assert 'deltafleet:num_requests_waiting{model_name="tiny-writer"} 0.0' in metrics
            threads[1].start()
            _until(lambda: engine.load()[1].get("tiny-late") == 1, "the request for tiny-late never waited")
            metrics = tc.get("/metrics").text
            assert 'vllm:num_requests_waiting{model_name="tiny"} 1.0' in metrics
            assert 'deltafleet:num_requests_waiting{model_name="tiny-late"} 1.0' in metrics
        finally:
            engine.release(held)
            for t in threads:
                if t.ident is not None:  # (started)
                    t.join(timeout=60)
    assert sorted(r.status_code for r in out) == [200, 200]


def test_a_stale_gone_answer_leaves_a_variant_added_again_meanwhile(root):
    """A request that found a variant, then saw its artifact gone while the variant was removed and
    added again, takes the variant served again: the new card stays listed, its deltas on the device.
    Found by a review (the interleaving forced by pausing the request's stamp)."""
    engine = _engine(root)
    engine.add_variant("mine", path="coder")
    removed, stamped, readded = threading.Event(), threading.Event(), threading.Event()
    real_stamp = engine.cache._stamp

    def paused_stamp(model_id):
        if threading.current_thread().name != "stale-request":
            return real_stamp(model_id)
        assert removed.wait(10)
        stamp = real_stamp(model_id)  # None: removed
        stamped.set()
        assert readded.wait(10)
        return stamp

    engine.cache._stamp = paused_stamp
    errors: list = []

    def request():
        try:
            engine.release_delta("tiny-mine", engine.acquire_delta("tiny-mine"))
        except Exception as e:  # noqa: BLE001 - recorded for the assertion
            errors.append(e)

    t = threading.Thread(target=request, name="stale-request")
    t.start()
    time.sleep(0.2)  # it found the card and waits in its stamp
    engine.remove_variant("tiny-mine")
    removed.set()
    assert stamped.wait(10)
    engine.add_variant("mine", path="coder")
    readded.set()
    t.join(10)
    assert errors == []  # its second look, under the cache's lock, finds the variant served again
    assert "tiny-mine" in [c.id for c in engine.models()] and engine.cache.tier("tiny-mine") == "device"


def test_pinned_variant_is_not_evicted(root, delta_bytes):
    engine = _engine(root, device_slots=2, pinned=["coder"], half_life_s=0.001)
    engine.get_delta("tiny-coder")
    engine.get_delta("tiny-writer")
    engine.get_delta("tiny-writer")
    shutil.copytree(root / "artifacts" / "writer", root / "artifacts" / "third")
    try:
        engine.get_delta("tiny-third")  # the oldest is coder, but it is pinned: writer goes
        assert engine.cache.tier("tiny-coder") == "device" and engine.cache.tier("tiny-writer") != "device"
    finally:
        shutil.rmtree(root / "artifacts" / "third")


@pytest.mark.parametrize("cache, warned", [({"device_slots": 1, "pinned": ["coder"]},
                                            "1 pinned variants and pin_top_n 0"),
                                           ({"device_slots": 2, "pinned": ["coder"], "pin_top_n": 1},
                                            "1 pinned variants and pin_top_n 1"),
                                           ({"device_slots": 2, "pinned": ["coder", "tiny"]}, None),
                                           ({"device_slots": 2, "pin_top_n": 1}, None)])
def test_pins_that_can_hold_every_device_slot_are_named_at_start(root, caplog, cache, warned):
    """Found by a reviewer: with every device slot pinned (by name or count), any other variant waits its
    ``wait_timeout_s`` and gets 503 on every request. Not an error (those variants may never come), but
    named at start; the base, pinned by name, takes no slot."""
    with caplog.at_level("WARNING", logger="deltafleet.serve.engine"):
        _engine(root, **cache)
    lines = [r.getMessage() for r in caplog.records if "can hold all" in r.getMessage()]
    if warned is None:
        assert lines == []
    else:
        assert len(lines) == 1 and lines[0].startswith(f"delta_cache: {warned} can hold all {cache['device_slots']} "
                                                       "device slots"), lines


def test_hot_load_and_unload_endpoints_confined_to_the_artifact_root(root, tmp_path):
    engine = _engine(root)
    outside = tmp_path / "outside"
    shutil.copytree(root / "artifacts" / "coder", outside)
    link = root / "artifacts" / "escape"
    os.symlink(outside, link)
    try:
        with TestClient(create_app(engine)) as tc:
            r = tc.post("/v1/load_variant", json={"variant": "coder2", "path": "coder"})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["id"] == "tiny-coder2" and body["parent"] == "tiny" and body["loaded_from"] == "disk"
            assert "tiny-coder2" in [m["id"] for m in tc.get("/v1/models").json()["data"]]
            assert tc.get("/v1/delta_cache").json()["variants"]["tiny-coder2"]["tier"] == "device"
            r = tc.post("/v1/completions", json={"model": "tiny-coder2", "prompt": "def ", "max_tokens": 3,
                                                 "temperature": 0})
            assert r.status_code == 200
            for path in ("../models/base", str(outside), "escape", "/etc"):
                r = tc.post("/v1/load_variant", json={"variant": "bad", "path": path})
                assert r.status_code == 400, (path, r.text)
                err = r.json()["error"]
                assert err["code"] == "path_not_allowed" and err["param"] == "path"
                assert str(outside) not in err["message"] and str(root) not in err["message"]
            r = tc.post("/v1/load_variant", json={"variant": "nothing", "path": "."})
            assert r.status_code == 400 and r.json()["error"]["code"] == "artifact_not_found"
            r = tc.post("/v1/load_variant", json={"variant": "../x"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "variant"
            assert tc.post("/v1/unload_variant", json={"variant": "coder2"}).json() == \
                {"id": "tiny-coder2", "object": "model", "unloaded": True}
            assert tc.get("/v1/delta_cache").json()["variants"].get("tiny-coder2", {"tier": "disk"})["tier"] == "disk"
            held = engine.prepare("tiny-writer", engine.encode_prompt("x"), GREEDY)
            r = tc.post("/v1/unload_variant", json={"variant": "tiny-writer"})
            assert r.status_code == 409 and r.json()["error"]["code"] == "variant_in_use"
            engine.release(held)
            assert tc.post("/v1/unload_variant", json={"variant": "tiny-writer"}).json()["unloaded"] is True
            r = tc.post("/v1/unload_variant", json={"variant": "tiny"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "variant"  # the base stays
    finally:
        link.unlink()


def test_api_key_with_the_openai_client(root):
    engine = _engine(root)
    with TestClient(create_app(engine, api_key="s3cret")) as tc:
        good = openai.OpenAI(base_url="http://testserver/v1", api_key="s3cret", http_client=tc, max_retries=0)
        assert {m.id for m in good.models.list()} >= {"tiny", "tiny-coder"}
        r = good.completions.create(model="tiny-coder", prompt="x", max_tokens=2, temperature=0)
        assert r.usage.completion_tokens >= 1
        bad = openai.OpenAI(base_url="http://testserver/v1", api_key="wrong", http_client=tc, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            bad.models.list()
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
        assert tc.get("/v1/models").status_code == 401  # no header at all
        assert tc.post("/v1/load_variant", json={"variant": "x"}).status_code == 401
        assert tc.get("/health").status_code == 200 and tc.get("/metrics").status_code == 200


def test_eviction_shows_in_metrics_and_concurrent_cold_requests_load_once(root, delta_bytes, monkeypatch):
    engine = _engine(root, device_slots=1, host_budget_bytes=0)
    reads = []
    real = engine.cache._read

    def counted(model_id):
        reads.append(model_id)
        time.sleep(0.3)
        return real(model_id)

    monkeypatch.setattr(engine.cache, "_read", counted)
    with TestClient(create_app(engine)) as tc:
        body = {"model": "tiny-coder", "prompt": "x", "max_tokens": 2, "temperature": 0}
        out = []
        threads = [threading.Thread(target=lambda: out.append(tc.post("/v1/completions", json=body).status_code))
                   for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert out == [200] * 4 and reads == ["tiny-coder"]
        assert tc.post("/v1/completions", json={**body, "model": "tiny-writer"}).status_code == 200
        text = tc.get("/metrics").text
        assert 'deltafleet:delta_cache_evictions_total{model_name="tiny-coder",tier="device"} 1.0' in text
        assert 'deltafleet:delta_cache_loads_total{model_name="tiny-coder"} 1.0' in text
        assert 'deltafleet:delta_load_seconds_count{model_name="tiny-writer",tier="disk"} 1.0' in text
        assert tc.get("/v1/delta_cache").json()["variants"]["tiny-coder"]["tier"] == "disk"  # no host tier


def test_a_hot_load_counts_as_a_load_not_as_a_request(root):
    """Found by a reviewer: ``/v1/load_variant`` counted in ``delta_cache_misses`` (then ``_hits``) and in
    the request count that eviction ranks by (``/v1/delta_cache``'s ``requests``), as a completion does.
    It counts as the load alone; the first completion is the first hit."""
    engine = _engine(root)
    with TestClient(create_app(engine)) as tc:
        assert tc.post("/v1/load_variant", json={"variant": "hot", "path": "coder"}).json()["loaded_from"] == "disk"
        assert tc.post("/v1/load_variant", json={"variant": "hot", "path": "coder"}).json()["loaded_from"] == "device"
        text = tc.get("/metrics").text
        assert 'deltafleet:delta_cache_loads_total{model_name="tiny-hot"} 1.0' in text
        assert 'deltafleet:delta_cache_hits_total{model_name="tiny-hot"} 0.0' in text
        assert 'deltafleet:delta_cache_misses_total{model_name="tiny-hot"} 0.0' in text
        assert tc.get("/v1/delta_cache").json()["variants"]["tiny-hot"]["requests"] == 0.0
        r = tc.post("/v1/completions", json={"model": "tiny-hot", "prompt": "x", "max_tokens": 1})
        assert r.status_code == 200, r.text
        text = tc.get("/metrics").text
        assert 'deltafleet:delta_cache_hits_total{model_name="tiny-hot"} 1.0' in text
        assert 'deltafleet:delta_cache_misses_total{model_name="tiny-hot"} 0.0' in text
        assert tc.get("/v1/delta_cache").json()["variants"]["tiny-hot"]["requests"] == pytest.approx(1.0, abs=0.01)


def test_an_unload_counts_as_an_unload_not_as_an_eviction(root):
    """Found by a reviewer: ``/v1/unload_variant`` counted in ``delta_cache_evictions``; an explicit
    unload is no eviction. It counts in ``delta_cache_unloads`` (by the tier it left), present at 0
    from the start as every series of a variant."""
    engine = _engine(root)
    with TestClient(create_app(engine)) as tc:
        assert 'deltafleet:delta_cache_unloads_total{model_name="tiny-coder",tier="device"} 0.0' in \
            tc.get("/metrics").text
        assert tc.post("/v1/load_variant", json={"variant": "gone", "path": "coder"}).status_code == 200
        assert tc.post("/v1/unload_variant", json={"variant": "gone"}).json()["unloaded"] is True
        text = tc.get("/metrics").text
        assert 'deltafleet:delta_cache_unloads_total{model_name="tiny-gone",tier="device"} 1.0' in text
        assert 'deltafleet:delta_cache_unloads_total{model_name="tiny-gone",tier="host"} 0.0' in text
        assert 'deltafleet:delta_cache_evictions_total{model_name="tiny-gone",tier="device"} 0.0' in text
        assert 'deltafleet:delta_cache_evictions_total{model_name="tiny-gone",tier="host"} 0.0' in text


def test_a_hot_loads_tier_is_its_own_not_a_concurrent_requests(root, monkeypatch):
    """Found by a reviewer: ``loaded_from`` was the last hit or load of the variant on any thread, so a
    request that hit the variant while a cold load returned made the load say ``device``."""
    import threading

    engine = _engine(root)
    add_variant = engine.add_variant

    def add_then_a_request_hits(name, path=None):
        card = add_variant(name, path)
        t = threading.Thread(target=lambda: engine.cache.release(card.id, engine.cache.acquire(card.id)))
        t.start()
        t.join()
        return card

    monkeypatch.setattr(engine, "add_variant", add_then_a_request_hits)
    with TestClient(create_app(engine)) as tc:
        r = tc.post("/v1/load_variant", json={"variant": "tiny-again", "path": "coder"})
        assert r.status_code == 200 and r.json()["loaded_from"] == "disk", r.json()
        assert tc.post("/v1/load_variant", json={"variant": "again", "path": "coder"}).json()["loaded_from"] == "device"


def test_hot_load_edge_cases_found_by_a_fresh_user(root, tmp_path):
    """A NUL byte in `path` (400), replacing a variant that is running (409), a model id as the name,
    unloading the base (400 naming it), and a symbolic link in the root that points outside (not served)."""
    engine = _engine(root)
    outside = tmp_path / "outside2"
    shutil.copytree(root / "artifacts" / "writer", outside)
    link = root / "artifacts" / "evil"
    os.symlink(outside, link)
    try:
        with TestClient(create_app(engine)) as tc:
            r = tc.post("/v1/load_variant", json={"variant": "x", "path": "a\u0000b"})
            assert r.status_code == 400 and r.json()["error"]["code"] == "path_not_allowed"
            r = tc.post("/v1/load_variant", json={"variant": "tiny-again", "path": "coder"})
            assert r.status_code == 200 and r.json()["id"] == "tiny-again" and r.json()["loaded_from"] == "disk"
            assert tc.post("/v1/load_variant", json={"variant": "again", "path": "coder"}).json()["loaded_from"] == "device"
            held = engine.prepare("tiny-again", engine.encode_prompt("x"), GREEDY)
            r = tc.post("/v1/load_variant", json={"variant": "again", "path": "writer"})  # another folder, in use
            assert r.status_code == 409 and r.json()["error"]["code"] == "variant_in_use"
            engine.release(held)
            r = tc.post("/v1/unload_variant", json={"variant": "tiny"})
            assert r.status_code == 400 and "is the base model" in r.json()["error"]["message"]
            assert "tiny-evil" not in [m["id"] for m in tc.get("/v1/models").json()["data"]]
            r = tc.post("/v1/completions", json={"model": "tiny-evil", "prompt": "x", "max_tokens": 2})
            assert r.status_code == 404
            # loaded by name (no path): the error names the variant's folder, not a `path` never sent
            err = api_error(tc.post("/v1/load_variant", json={"variant": "evil"}), 400)
            assert (err["param"], err["code"]) == ("variant", "path_not_allowed")
            assert err["message"].startswith("the folder `evil` of the artifact root leads outside it")
    finally:
        link.unlink()


def test_folders_that_name_no_variant_are_not_served_and_a_link_loop_is_400(root, tmp_path, caplog):
    """Found by a fresh user: a folder in the artifact root whose name is no variant name was served
    as ``tiny-<name>`` (a space, a leading '_': once unloaded, no load route could name it again), and
    one whose name is not UTF-8 made ``/v1/models`` and every later ``/metrics`` scrape a 500. They are
    skipped, each named once in a warning. A symbolic link that loops is a bad path (400), not a 500."""
    arts = tmp_path / "artifacts"
    names = ["has space", "_under", os.fsdecode(b"bad\xffname")]
    for name in ["coder", *names]:
        shutil.copytree(root / "artifacts" / "coder", arts / name)
    os.symlink(arts / "linkloop", arts / "linkloop")
    engine = Engine(root / "models" / "base", arts, family="tiny")
    with TestClient(create_app(engine)) as tc:
        for _ in range(2):
            r = tc.get("/v1/models")
            assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == ["tiny", "tiny-coder"]
            assert tc.get("/metrics").status_code == 200
        skipped = [r.getMessage() for r in caplog.records if "is no variant name" in r.getMessage()]
        assert len(skipped) == len(names), skipped  # once each, however often the root is listed
        assert [m.encode() for m in skipped]  # a name that is not UTF-8 is written escaped (else: UnicodeEncodeError)
        for variant in ("linkloop", "tiny-linkloop"):
            err = api_error(tc.post("/v1/load_variant", json={"variant": variant}), 400)
            assert (err["param"], err["code"]) == ("path", "path_not_allowed")
        err = api_error(tc.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "linkloop"}), 400)
        assert (err["param"], err["code"]) == ("lora_path", "path_not_allowed")
        assert tc.post("/v1/completions", json={"model": "tiny-coder", "prompt": "x", "max_tokens": 2}).status_code == 200


def test_an_artifact_with_a_full_matrix_is_503_and_evicts_nothing(root, tmp_path):
    from safetensors.torch import load_file, save_file

    from deltafleet.compress.bitdelta import _sha256_file

    bad = root / "artifacts" / "fullmat"
    shutil.copytree(root / "artifacts" / "coder", bad)
    try:
        t = load_file(bad / "delta.safetensors")
        name = "model.layers.0.self_attn.q_proj.weight"
        n = t.pop(f"{name}.sign").shape[0]
        t.pop(f"{name}.alpha")
        t[name] = torch.zeros(n, n)
        save_file(t, bad / "delta.safetensors")
        man = json.loads((bad / "bitdelta.json").read_text())
        man["files"]["delta.safetensors"] = _sha256_file(bad / "delta.safetensors")
        (bad / "bitdelta.json").write_text(json.dumps(man))
        engine = _engine(root, device_slots=1)
        engine.get_delta("tiny-coder")
        with pytest.raises(VariantUnavailableError, match=r"`tiny-fullmat` is unavailable: it stores "
                                                          r"'model.layers.0.self_attn.q_proj.weight' in full"):
            engine.get_delta("tiny-fullmat")
        assert engine.cache.tier("tiny-coder") == "device"  # nothing was evicted for it
        # hot-loaded under a name of its own, the unusable artifact is refused as a bad path (the caller's
        # to fix, as vLLM answers a failed adapter load: not a 5xx a client retries) and not left listed
        with TestClient(create_app(engine)) as tc:
            r = tc.post("/v1/load_variant", json={"variant": "c5", "path": "fullmat"})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert (err["code"], err["param"]) == ("artifact_unusable", "path")
            assert err["message"].startswith("the artifact in `fullmat` cannot be used: it stores "
                                             "'model.layers.0.self_attn.q_proj.weight' in full"), err
            assert "tiny-c5" not in [m["id"] for m in tc.get("/v1/models").json()["data"]]
            assert tc.get("/v1/models/tiny-c5").status_code == 404
            r = tc.post("/v1/load_lora_adapter", json={"lora_name": "c6", "lora_path": "fullmat"})  # vLLM's route
            assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text
            # nor kept anywhere else (found by a fresh user: each failed name stayed in the delta cache's
            # state and made metric series of its own, which any client could grow without end)
            assert not {"tiny-c5", "tiny-c6"} & set(tc.get("/v1/delta_cache").json()["variants"])
            assert 'model_name="tiny-c5"' not in tc.get("/metrics").text
            assert 'model_name="tiny-c6"' not in tc.get("/metrics").text
            assert 'delta_cache_load_failures_total{model_name="tiny-fullmat"}' in tc.get("/metrics").text  # listed
            # found by a fresh user: a variant served, unloaded, then named by a failed load lost its counters
            # (generation_tokens_total back to 0 at its next load); a counter only goes up in a process's life
            assert tc.post("/v1/completions", json={"model": "tiny-coder", "prompt": "x", "max_tokens": 3}).is_success
            before = _series(tc.get("/metrics").text, "tiny-coder")
            assert before["deltafleet:generation_tokens_total"] == 3.0
            assert tc.post("/v1/unload_variant", json={"variant": "coder"}).is_success
            assert tc.post("/v1/load_variant", json={"variant": "coder", "path": "fullmat"}).status_code == 400
            failed = _series(tc.get("/metrics").text, "tiny-coder")
            assert failed.keys() == before.keys() and all(failed[k] >= before[k] for k in before), (before, failed)
            assert failed["deltafleet:delta_cache_load_failures_total"] == 1 + before[
                "deltafleet:delta_cache_load_failures_total"]  # the failed load is counted on the name
            assert tc.post("/v1/load_variant", json={"variant": "coder"}).is_success
            after = _series(tc.get("/metrics").text, "tiny-coder")
            assert after["deltafleet:generation_tokens_total"] == 3.0
            assert after["deltafleet:delta_cache_loads_total"] == before["deltafleet:delta_cache_loads_total"] + 1
    finally:
        shutil.rmtree(bad)


def _series(text: str, model: str) -> dict[str, float]:
    """The counters of ``model`` in a /metrics text, by name (``_total`` samples with only its label)."""
    found = re.findall(rf'^(\S+_total)\{{model_name="{re.escape(model)}"\}} (\S+)$', text, re.M)
    return {name: float(value) for name, value in found}


def test_an_artifact_changed_in_place_or_for_another_base_is_seen_at_its_next_request(root):
    """Found by a fresh user: a shard truncated in place while its variant was loaded kept serving the
    old deltas (only the manifest's stat was compared), and a manifest rewritten for another base gave a
    503 and stayed listed where a server starting so answers 404 and does not list it."""
    from deltafleet.serve.engine import ModelNotFoundError

    engine = _engine(root)
    folders = [root / "artifacts" / name for name in ("inplace", "rebased")]
    try:
        for f in folders:
            shutil.copytree(root / "artifacts" / "coder", f)
            assert engine.get_delta(f"tiny-{f.name}") is not None
        shard = folders[0] / "delta.safetensors"
        with open(shard, "r+b") as fh:
            fh.truncate(shard.stat().st_size // 2)
        with pytest.raises(VariantUnavailableError, match="`tiny-inplace` is unavailable"):
            engine.get_delta("tiny-inplace")
        manifest = folders[1] / "bitdelta.json"
        man = json.loads(manifest.read_text())
        man["base"]["fingerprint"] = "0" * len(man["base"]["fingerprint"])
        manifest.write_text(json.dumps(man))
        with pytest.raises(ModelNotFoundError, match=r"`tiny-rebased` does not exist for this server's base: its "
                                                     r"artifact was exported against another base \(fingerprint 0+,"):
            engine.get_delta("tiny-rebased")
        assert "tiny-rebased" not in [c.id for c in engine.models()]
        assert "tiny-rebased" not in [c.id for c in engine.discover()]
    finally:
        for f in folders:
            shutil.rmtree(f)


def test_a_variant_re_exported_under_traffic_serves_its_new_deltas_at_once(root):
    """Found by a fresh user: with requests always running on a variant, its re-exported artifact was
    never read (the old deltas stayed while any request ran on them). A request already running keeps
    the version it started with, in its slot; the next request gets the new one, in another; the old
    slot is given back with the last request on it."""
    engine = _engine(root, device_slots=4)
    art = root / "artifacts" / "swap"
    prompt = "Question: What is 12 + 30?\nAnswer:"
    try:
        shutil.copytree(root / "artifacts" / "coder", art)
        want_old = engine.complete("tiny-coder", prompt, GREEDY).text
        want_new = engine.complete("tiny-writer", prompt, GREEDY).text
        assert want_old != want_new  # the two variants tell apart
        held = engine.acquire_delta("tiny-swap")  # a request running on the coder deltas
        free = engine.slots.free_slots
        staged = root / "artifacts" / ".swap-new"
        shutil.copytree(root / "artifacts" / "writer", staged)  # re-exported, as an export renames it in
        shutil.rmtree(art)
        staged.rename(art)
        assert engine.complete("tiny-swap", prompt, GREEDY).text == want_new
        assert engine.slots.free_slots == free - 1  # both versions on the device
        engine.release_delta("tiny-swap", held)
        assert engine.slots.free_slots == free  # the old one's slot given back with its last request
        assert engine.complete("tiny-swap", prompt, GREEDY).text == want_new
    finally:
        shutil.rmtree(art, ignore_errors=True)


def _rewrite_delta(art: Path, edit) -> None:
    """Apply ``edit(tensors)`` to the artifact's delta.safetensors and re-sign it in the manifest."""
    from safetensors.torch import load_file, save_file

    from deltafleet.compress.bitdelta import _sha256_file

    t = load_file(art / "delta.safetensors")
    edit(t)
    save_file(t, art / "delta.safetensors")
    man = json.loads((art / "bitdelta.json").read_text())
    man["files"]["delta.safetensors"] = _sha256_file(art / "delta.safetensors")
    (art / "bitdelta.json").write_text(json.dumps(man))


def test_an_unusable_artifact_is_named_in_one_warning_at_start(root, caplog):
    """Found by a fresh user: an artifact that cannot be served (a manifest that does not parse, a file
    it lists missing, tensors not of the base's shapes) was said nowhere until a request asked for it.
    The engine's start warns once for each, naming its folder and the problem, and serves the others;
    a request for one is still refused with the reason (503), so a repaired one needs no restart."""
    gate = "model.layers.0.mlp.gate_proj.weight"
    bad = {name: root / "artifacts" / name for name in ("badjson", "nofile", "shapes")}
    try:
        for f in bad.values():
            shutil.copytree(root / "artifacts" / "coder", f)
        (bad["badjson"] / "bitdelta.json").write_text("{not json")
        (bad["nofile"] / "delta.safetensors").unlink()
        _rewrite_delta(bad["shapes"], lambda t: t.update({f"{gate}.sign": t[f"{gate}.sign"][:-1].clone()}))
        with caplog.at_level("WARNING", logger="deltafleet.serve.engine"):
            engine = _engine(root)
        said = sorted(r.getMessage() for r in caplog.records if r.name == "deltafleet.serve.engine")
        assert len(said) == 3, said
        for line, (name, problem) in zip(said, (
                ("badjson", "bitdelta.json: cannot parse the manifest"),
                ("nofile", "file delta.safetensors listed in the manifest is missing"),
                ("shapes", f"{gate}.sign is torch.uint8 (127, 8), expected uint8 (128, 8)"))):
            assert line.startswith(f"variant tiny-{name} ({bad[name]}) is unavailable: ") and problem in line, line
            assert "\n" not in line
        assert {"tiny-badjson", "tiny-nofile", "tiny-shapes"} <= {c.id for c in engine.models()}  # listed, as before
        assert engine.complete("tiny-coder", "def main(", GREEDY).completion_tokens >= 1
        with pytest.raises(VariantUnavailableError, match=r"`tiny-shapes` is unavailable: .*expected uint8 \(128, 8\)"):
            engine.get_delta("tiny-shapes")
    finally:
        for f in bad.values():
            shutil.rmtree(f)


def test_an_artifact_removed_from_disk_leaves_the_model_list_at_once(root):
    """Found by a fresh user: a variant whose artifact folder was removed while the server ran stayed in
    ``/v1/models`` (and ``/v1/models/{id}``) until a request for it got its 404. The list is what is on
    disk now, read without loading anything; the variant leaves every cache tier, as a request would
    have dropped it (docs/serving.md, "Changed on disk"), and a request running on it finishes."""
    folders = {name: root / "artifacts" / name for name in ("gone", "going")}
    try:
        for f in folders.values():
            shutil.copytree(root / "artifacts" / "coder", f)
        engine = _engine(root)
        engine.get_delta("tiny-gone")  # resident on the device
        held = engine.prepare("tiny-going", engine.encode_prompt("x"), GREEDY)  # a request in flight on it
        events = []
        engine.add_listener(lambda ev, m, s, tier: events.append((ev, m)))
        with TestClient(create_app(engine)) as tc:
            for f in folders.values():
                shutil.rmtree(f)
            ids = [m["id"] for m in tc.get("/v1/models").json()["data"]]
            assert ids == ["tiny", "tiny-coder", "tiny-writer"]
            for model in ("tiny-gone", "gone", "tiny-going"):
                r = tc.get(f"/v1/models/{model}")
                assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
            assert "tiny-gone" not in engine.cache.snapshot()  # its slot is free again
            assert engine.cache.snapshot()["tiny-going"]["in_flight"] == 1
            assert [e for e in events if e[0] != "evict"] == []  # no load, no hit, no miss
            assert len(list(engine.run(held))) == GREEDY.max_tokens  # it finishes on what it holds
            r = tc.post("/v1/completions", json={"model": "tiny-going", "prompt": "x", "max_tokens": 2})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
            shutil.copytree(root / "artifacts" / "coder", folders["gone"])  # exported again: listed again
            assert "tiny-gone" in [m["id"] for m in tc.get("/v1/models").json()["data"]]
            assert tc.get("/v1/models/tiny-gone").status_code == 200
    finally:
        for f in folders.values():
            shutil.rmtree(f, ignore_errors=True)


def test_a_listed_variant_re_exported_for_another_base_leaves_the_model_list_at_once(root):
    """Found by a reviewer: a resident variant whose manifest was rewritten for another base stayed in
    ``/v1/models`` (``/v1/models/{id}`` 200) and in its device slot until a request for it read it,
    although the same scan logged that it was not served; only a removed folder left the list. It
    now leaves the list and its slot at the next scan, and its requests answer 404 saying why."""
    folder = root / "artifacts" / "rebased"
    try:
        shutil.copytree(root / "artifacts" / "coder", folder)
        engine = _engine(root)
        engine.get_delta("tiny-rebased")  # resident on the device
        with TestClient(create_app(engine)) as tc:
            assert "tiny-rebased" in [m["id"] for m in tc.get("/v1/models").json()["data"]]
            manifest = folder / "bitdelta.json"
            man = json.loads(manifest.read_text())
            man["base"]["fingerprint"] = "0" * len(man["base"]["fingerprint"])
            manifest.write_text(json.dumps(man))
            assert [m["id"] for m in tc.get("/v1/models").json()["data"]] == ["tiny", "tiny-coder", "tiny-writer"]
            assert "tiny-rebased" not in engine.cache.snapshot()  # its slot is free again
            r = tc.post("/v1/completions", json={"model": "tiny-rebased", "prompt": "x", "max_tokens": 2})
            err = api_error(r, 404)
            assert err["code"] == "model_not_found" and "exported against another base (fingerprint 0" in err["message"]
            assert tc.get("/v1/models/tiny-rebased").status_code == 404
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_what_a_killed_export_leaves_takes_no_slot_and_no_column_scales(root):
    """Found by a fresh user: ``kill -9`` during an export leaves its hidden staging folder
    (``.<name>.tmp-<host>.<pid>.<random>``, or ``.<name>.old-…``: the replaced artifact it was deleting)
    next to the artifacts until the next export of that variant removes it (deltafleet/atomic.py). One
    holding a manifest was never served, yet the server sized its device slots for it (a slot more) and
    took a rowcol one's granularity for column scales in every slot. The slots are now sized for the
    artifacts the server lists."""
    import socket

    host = socket.gethostname()
    left = {src: root / "artifacts" / f".{src}.{kind}-{host}.999999.0badf00d"
            for src, kind in (("coder", "tmp"), ("writer", "old"))}
    try:
        for src, f in left.items():
            shutil.copytree(root / "artifacts" / src, f)
        manifest = left["coder"] / "bitdelta.json"
        manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "granularity": "rowcol",
                                        "format_version": 2}))
        engine = _engine(root)
        assert [c.id for c in engine.models()] == ["tiny", "tiny-coder", "tiny-writer"]
        assert engine.slots.n_slots == 2 and engine.slots.betas == {}
    finally:
        for f in left.values():
            shutil.rmtree(f)


def test_an_alpha_beyond_the_dtype_served_is_refused_at_load_by_name(root):
    """Found by a fresh user: an α of 1e30, inf or nan passed the artifact's checks. inf and nan did not:
    reading the artifact refuses them, naming the tensor. A finite α beyond what the dtype the model is
    served in holds is now refused too, by name: the kernels round α·sign (and the weight plus it) to
    that dtype, where it is inf and the request's logits NaN. Inside the range (1e30 in bfloat16 or
    float32) it is left as it is: no bound on it is principled."""
    emb = "model.embed_tokens.weight"
    values = {"huge": 1e30, "huger": 3.4e38, "infinite": float("inf")}
    folders = {name: root / "artifacts" / name for name in values}

    def first_alpha(value):
        def edit(t):
            t[f"{emb}.alpha"] = t[f"{emb}.alpha"].clone()
            t[f"{emb}.alpha"][0] = value
        return edit

    try:
        for name, value in values.items():
            shutil.copytree(root / "artifacts" / "coder", folders[name])
            _rewrite_delta(folders[name], first_alpha(value))
        for dtype, refused in (("float16", {"huge", "huger"}), ("bfloat16", {"huger"}), ("float32", set())):
            engine = Engine(root / "models" / "base", root / "artifacts", family="tiny", dtype=dtype)
            for name in ("huge", "huger"):
                if name in refused:
                    want = (rf"`tiny-{name}` is unavailable: variant 'coder': {emb}\.alpha holds "
                            rf"{re.escape(f'{values[name]:.4g}')}, beyond what {dtype} \(the dtype served\) holds")
                    with pytest.raises(VariantUnavailableError, match=want):
                        engine.get_delta(f"tiny-{name}")
                else:
                    assert engine.get_delta(f"tiny-{name}") is not None
            with pytest.raises(VariantUnavailableError, match=rf"{emb}\.alpha has negative or non-finite values"):
                engine.get_delta("tiny-infinite")
    finally:
        for f in folders.values():
            shutil.rmtree(f)


def test_a_full_tensor_that_is_not_finite_is_refused_at_load_by_name(root):
    """Found by a fresh user: a norm set to NaN in delta.safetensors (its sha256 redone) was hot-loaded
    (200), and every request for the variant then failed with "logits are not finite", naming nothing.
    Reading the artifact refuses it, naming the tensor (400 ``artifact_unusable`` on a hot load); a
    finite value beyond the dtype served (7e4 in float16) is refused by name at load too. A norm of
    another shape is refused without the word "vocabularies" (it is none)."""
    norm = "model.layers.0.input_layernorm.weight"
    folders = {name: root / "artifacts" / name for name in ("nannorm", "bignorm", "shortnorm")}

    def norm_of(value=None, n=None):
        def edit(t):
            w = torch.ones(64) if n is None else torch.ones(n)
            if value is not None:
                w[1] = value
            t[norm] = w
        return edit

    try:
        for (name, f), edit in zip(folders.items(), (norm_of(float("nan")), norm_of(7e4), norm_of(n=7))):
            shutil.copytree(root / "artifacts" / "coder", f)
            _rewrite_delta(f, edit)
        engine = _engine(root)
        with TestClient(create_app(engine)) as tc:
            err = api_error(tc.post("/v1/load_variant", json={"variant": "nan2", "path": "nannorm"}), 400)
            assert (err["code"], err["param"]) == ("artifact_unusable", "path")
            assert f"{norm} (stored in full) has non-finite values" in err["message"], err
            assert "tiny-nan2" not in [m["id"] for m in tc.get("/v1/models").json()["data"]]
            err = api_error(tc.post("/v1/load_variant", json={"variant": "short2", "path": "shortnorm"}), 400)
            assert f"{norm} has shape (7,), the base (64,)" in err["message"] and "vocabular" not in err["message"]
        assert engine.get_delta("tiny-bignorm") is not None  # float32: 7e4 is finite
        engine = Engine(root / "models" / "base", root / "artifacts", family="tiny", dtype="float16")
        with pytest.raises(VariantUnavailableError, match=rf"`tiny-bignorm` is unavailable: variant 'coder': "
                                                          rf"{norm} \(stored in full\) is not finite in float16"):
            engine.get_delta("tiny-bignorm")
    finally:
        for f in folders.values():
            shutil.rmtree(f)


def test_a_long_tokenization_does_not_stall_generation(root):
    """Encoding holds the tokenizer's lock (a 4 MB prompt takes seconds); the running sequences
    detokenize with their own copy, so they go on."""
    engine = _engine(root)
    ids = engine.encode_prompt("def main(")
    with engine._tok_lock:  # as if a huge prompt were being encoded
        out = []
        t = threading.Thread(target=lambda: out.append(list(engine.run(engine.prepare("tiny", ids, GREEDY)))))
        t.start()
        t.join(30)
        assert out and len(out[0]) == GREEDY.max_tokens


def test_api_key_scheme_is_case_insensitive_and_docs_are_guarded(root):
    with TestClient(create_app(_engine(root), api_key="k1")) as tc:
        assert tc.get("/v1/models", headers={"Authorization": "bearer k1"}).status_code == 200
        assert tc.get("/v1/models", headers={"Authorization": "Basic k1"}).status_code == 401
        assert tc.get("/openapi.json").status_code == 401
        # vLLM's /ping (SageMaker's health check) is /health, answered without the key as /health is
        assert tc.get("/ping").json() == tc.get("/health").json() == {"status": "ok"}
        tc.app.state.drain(None)
        assert api_error(tc.get("/ping"), 503)["code"] == "shutting_down"
    with TestClient(create_app(_engine(root), api_key="")) as tc:  # empty: no key
        assert tc.get("/v1/models").status_code == 200


def _family(root: Path, tmp_path: Path) -> Path:
    """A private copy of the family (tests change its artifacts)."""
    shutil.copytree(root / "models", tmp_path / "models")
    shutil.copytree(root / "artifacts", tmp_path / "artifacts")
    return tmp_path


def test_load_lora_adapter_takes_the_gateway_sidecars_payload(root, tmp_path):
    """Found by a reviewer: the Gateway API Inference Extension's adapter sync sidecar, which
    docs/kubernetes.md points to, posts ``{"lora_name", "lora_path", "base_model_name"}``, and the
    route refused the last field (400), so the sidecar could load no variant. vLLM ignores it; so
    does this route."""
    engine = _engine(_family(root, tmp_path))
    with TestClient(create_app(engine)) as tc:
        r = tc.post("/v1/load_lora_adapter", json={"lora_name": "tiny-coder2", "lora_path": "coder",
                                                   "base_model_name": "tiny"})
        assert r.status_code == 200, r.text
        assert r.text == "Success: LoRA adapter 'tiny-coder2' added successfully."
        assert "tiny-coder2" in [m["id"] for m in tc.get("/v1/models").json()["data"]]


def test_delta_cache_reports_a_pinned_variant_as_pinned_while_it_serves(root, tmp_path):
    """Found by a reviewer: a variant pinned by name reported ``pinned: false`` whenever it had a
    request in flight, so the pin flickered off under traffic. ``pinned`` is the pin, whatever the
    requests."""
    engine = _engine(_family(root, tmp_path), pinned=["coder"])
    with TestClient(create_app(engine)) as tc:
        engine.get_delta("tiny-coder")
        assert tc.get("/v1/delta_cache").json()["variants"]["tiny-coder"]["pinned"] is True
        held = engine.prepare("tiny-coder", engine.encode_prompt("x"), GREEDY)
        try:
            state = tc.get("/v1/delta_cache").json()["variants"]["tiny-coder"]
            assert state["in_flight"] == 1
            assert state["pinned"] is True, state
        finally:
            engine.release(held)


def test_a_failed_replacement_leaves_the_served_variant_in_its_slot(root, tmp_path):
    """Found by a reviewer: a replacement whose artifact cannot be used (a 400) had already unloaded
    the variant it was to replace, here one pinned by name, which went to disk. The variant served
    under the name goes back onto the device."""
    fam = _family(root, tmp_path)
    bad = fam / "artifacts" / "bad"
    shutil.copytree(fam / "artifacts" / "coder", bad)
    data = bytearray((bad / "delta.safetensors").read_bytes())
    data[-10] ^= 0xFF  # the checksum in bitdelta.json no longer matches
    (bad / "delta.safetensors").write_bytes(bytes(data))
    engine = _engine(fam, pinned=["coder"])
    with TestClient(create_app(engine)) as tc:
        assert tc.post("/v1/completions", json={"model": "tiny-coder", "prompt": "x", "max_tokens": 2}).is_success
        before = tc.get("/v1/delta_cache").json()
        assert before["variants"]["tiny-coder"]["tier"] == "device"
        err = api_error(tc.post("/v1/load_variant", json={"variant": "coder", "path": "bad"}), 400)
        assert err["code"] == "artifact_unusable"
        after = tc.get("/v1/delta_cache").json()
        assert after["variants"]["tiny-coder"]["tier"] == "device", after
        assert after["device_bytes"] == before["device_bytes"], after


def test_concurrent_requests_for_an_unreadable_artifact_share_one_failed_read():
    """Found by a reviewer: when the one read of a single-flight load failed, each request queued
    behind it read the artifact again, one after another (N requests, N reads, the last 503 after N
    read times). They share the failure of the read they queued behind."""
    reads, gate = [], threading.Event()

    def read(m):
        reads.append(m)
        assert gate.wait(10)
        raise OSError("file delta.safetensors does not match its sha256")

    cache = DeltaCache(read, lambda d: d, lambda m: 1)
    errors: list = []

    def req():
        try:
            cache.acquire("a")
        except OSError as e:
            errors.append(e)

    threads = [threading.Thread(target=req) for _ in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while cache.snapshot().get("a", {}).get("in_flight", 0) < 4:  # all four joined the one load
        assert time.monotonic() < deadline
        time.sleep(0.01)
    gate.set()
    for t in threads:
        t.join(20)
    assert len(errors) == 4
    assert reads == ["a"], f"{len(reads)} reads of one unreadable artifact by 4 concurrent requests"


def test_a_hot_load_with_no_room_names_its_own_parameter(root, tmp_path):
    """Found by a reviewer: a hot load that finds no device slot in time (a 503) named ``param:
    "model"``, which neither ``/v1/load_variant`` (``variant``) nor ``/v1/load_lora_adapter``
    (``lora_name``) has."""
    engine = _engine(_family(root, tmp_path), device_slots=1, pinned=["coder"], wait_timeout_s=0.2)
    with TestClient(create_app(engine)) as tc:
        engine.get_delta("tiny-coder")  # pinned, in the only slot
        err = api_error(tc.post("/v1/load_variant", json={"variant": "writer"}), 503)
        assert err["code"] == "variant_unavailable"
        assert err["param"] == "variant", err
        err = api_error(tc.post("/v1/load_lora_adapter", json={"lora_name": "w2", "lora_path": "writer"}), 503)
        assert err["param"] == "lora_name", err


def test_unload_is_refused_while_a_request_runs_on_the_variants_previous_version(root, tmp_path):
    """Found by a reviewer: once a variant's artifact was re-exported and the new version loaded, the
    requests still running on the old version were invisible to ``/v1/delta_cache`` (``in_flight``
    0) and to unload, which answered 200 while one generated on it. They count: 409, as README says
    of a variant in use."""
    fam = _family(root, tmp_path)
    engine = _engine(fam, device_slots=2)
    with TestClient(create_app(engine)) as tc:
        held = engine.prepare("tiny-coder", engine.encode_prompt("x"), GREEDY)  # a request in flight
        try:
            shutil.copytree(fam / "artifacts" / "writer", fam / "artifacts" / ".new")  # re-exported
            shutil.rmtree(fam / "artifacts" / "coder")
            os.rename(fam / "artifacts" / ".new", fam / "artifacts" / "coder")
            assert tc.post("/v1/load_variant", json={"variant": "coder"}).status_code == 200
            state = tc.get("/v1/delta_cache").json()
            assert sum(v["in_flight"] for v in state["variants"].values()) == 1, state
            r = tc.post("/v1/unload_variant", json={"variant": "coder"})
            assert r.status_code == 409, r.text
        finally:
            engine.release(held)


def test_a_manifest_nested_past_the_json_parsers_depth_is_unusable_not_a_crash(root, caplog):
    """Found by a reviewer: a manifest nested deeper than Python's JSON parser recurses raised
    RecursionError from the scan of the artifact root, so the server did not start (and a later
    ``/v1/models`` was a 500). It is an artifact whose manifest does not parse: named in a warning at
    start, listed, and each request for it refused with the reason (503)."""
    bad = root / "artifacts" / "deep"
    try:
        shutil.copytree(root / "artifacts" / "coder", bad)
        (bad / "bitdelta.json").write_text("[" * 100_000 + "]" * 100_000)
        with caplog.at_level("WARNING", logger="deltafleet.serve.engine"):
            engine = _engine(root)
        said = [r.getMessage() for r in caplog.records if "tiny-deep" in r.getMessage()]
        assert len(said) == 1 and "bitdelta.json: cannot parse the manifest (maximum recursion depth" in said[0], said
        assert [c.id for c in engine.discover()] == ["tiny", "tiny-coder", "tiny-deep", "tiny-writer"]
        with pytest.raises(VariantUnavailableError, match=r"`tiny-deep` is unavailable: deep/bitdelta\.json: cannot parse "
                                                          r"the manifest \(maximum recursion depth"):
            engine.get_delta("tiny-deep")
        assert engine.cache.tier("tiny-deep") == "disk"
        assert engine.complete("tiny-coder", "def main(", GREEDY).completion_tokens >= 1
    finally:
        shutil.rmtree(bad)


def test_a_manifest_that_is_no_regular_file_does_not_hang_the_scan(root):
    """Found by a reviewer: the scan of the artifact root read every ``*/bitdelta.json`` it found, so a
    named pipe there (as a symbolic link to a device would be) blocked the server's start for ever. Only
    a regular file is read as a manifest; the folder is no artifact, and a request for it is a 404."""
    bad = root / "artifacts" / "pipe"
    bad.mkdir()
    os.mkfifo(bad / "bitdelta.json")
    started: list = []
    try:
        t = threading.Thread(target=lambda: started.append(_engine(root)), daemon=True)
        t.start()
        t.join(60)
        assert started, "the engine's start blocked on a named pipe in the artifact root"
        engine = started[0]
        assert engine.complete("tiny-coder", "def main(", GREEDY).completion_tokens >= 1
        with pytest.raises(ModelNotFoundError, match=r"^The model `tiny-pipe` does not exist$"):
            engine.get_delta("tiny-pipe")
        assert "tiny-pipe" not in [c.id for c in engine.discover()]
    finally:
        with contextlib.suppress(OSError):  # a reader still blocked in open() gets end of file
            os.close(os.open(bad / "bitdelta.json", os.O_WRONLY | os.O_NONBLOCK))
        shutil.rmtree(bad)
