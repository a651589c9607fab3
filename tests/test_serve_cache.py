"""The tiered delta cache (serve/cache.py): single-flight loads, weighted-LRU eviction with
pinning and in-flight protection, the host tier, stale and removed artifacts."""
from __future__ import annotations

import sys
import threading
import time

import pytest

from deltafleet.serve.cache import ArtifactGoneError, CacheFullError, DeltaCache


class Delta:
    def __init__(self, name: str, nbytes: int, where: str = "host"):
        self.name, self.nbytes, self.where = name, nbytes, where


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Disk:
    """Fake artifacts: sizes by model id, a read counter, optional gates and failures."""

    def __init__(self, sizes: dict[str, int]):
        self.sizes, self.reads = dict(sizes), {m: 0 for m in sizes}
        self.stamps = {m: 1 for m in sizes}
        self.gates: dict[str, threading.Event] = {}
        self.fail: set[str] = set()
        self.delay = 0.0  # seconds each read takes
        self.lock = threading.Lock()

    def read(self, m: str) -> Delta:
        with self.lock:
            self.reads[m] += 1
        if m in self.gates:
            assert self.gates[m].wait(10)
        time.sleep(self.delay)
        if m in self.fail:
            raise OSError(f"cannot read {m}")
        return Delta(m, self.sizes[m])

    def stamp(self, m: str):
        return self.stamps.get(m)


def make(disk: Disk, **kw) -> tuple[DeltaCache, list]:
    events: list = []
    cache = DeltaCache(disk.read, lambda d: Delta(d.name, d.nbytes, "device"), disk.stamp,
                       to_host=lambda d: Delta(d.name, d.nbytes, "host"), **kw)
    cache.add_listener(lambda ev, m, s, tier: events.append((ev, m, tier)))
    return cache, events


def use(cache: DeltaCache, m: str):
    d = cache.acquire(m)
    cache.release(m)
    return d


def in_load(thread: threading.Thread) -> bool:
    """Whether ``thread`` is inside :meth:`DeltaCache._load` (reading, or waiting for the one read)."""
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code is DeltaCache._load.__code__:
            return True
        frame = frame.f_back
    return False


def test_concurrent_requests_for_a_cold_variant_trigger_exactly_one_read():
    disk = Disk({"a": 100})
    disk.gates["a"] = threading.Event()
    cache, events = make(disk)
    got, start = [], threading.Barrier(9)

    def req():
        start.wait()
        got.append(cache.acquire("a"))

    threads = [threading.Thread(target=req) for _ in range(8)]
    for t in threads:
        t.start()
    start.wait()
    # all eight are inside the cache's load (one reading, the others behind it) before the read ends:
    # none can come late and find the delta already loaded
    deadline = time.monotonic() + 10
    while not all(in_load(t) for t in threads):
        assert time.monotonic() < deadline, "the eight requests never all reached the cache's load"
        time.sleep(0.005)
    disk.gates["a"].set()
    for t in threads:
        t.join(10)
    assert disk.reads["a"] == 1
    assert len(got) == 8 and all(d is got[0] for d in got) and got[0].where == "device"
    assert [e for e in events if e[0] == "load"] == [("load", "a", "disk")]
    assert cache.snapshot()["a"]["in_flight"] == 8


def test_a_slow_load_does_not_block_other_variants():
    disk = Disk({"a": 100, "b": 100})
    disk.gates["a"] = threading.Event()
    cache, _ = make(disk)
    t = threading.Thread(target=use, args=(cache, "a"))
    t.start()
    deadline = time.monotonic() + 10
    while disk.reads["a"] < 1:  # a's read has started (and blocks on its gate)
        assert time.monotonic() < deadline, "a's read never started"
        time.sleep(0.005)
    t0 = time.perf_counter()
    assert use(cache, "b").name == "b"  # while a's read is still blocked
    assert time.perf_counter() - t0 < 1.0 and t.is_alive()
    disk.gates["a"].set()
    t.join(10)
    assert cache.tier("a") == cache.tier("b") == "device"


@pytest.mark.parametrize("half_life, victim", [(60.0, "b"), (0.01, "a")])
def test_eviction_is_lru_weighted_by_request_rate(half_life, victim):
    """a: five requests at t = 0..4; b: one at t = 10. With a 60 s half-life a's decayed count (≈ 4.4
    at t = 11) beats b's (≈ 1.0), so b goes although it was used last; with a tiny half-life the
    counts are just recency (plain LRU) and a goes."""
    disk = Disk({"a": 100, "b": 100, "c": 100})
    clock = Clock()
    cache, events = make(disk, device_budget_bytes=200, half_life_s=half_life, clock=clock)
    for t in range(5):
        clock.t = t
        use(cache, "a")
    clock.t = 10
    use(cache, "b")
    clock.t = 11
    use(cache, "c")
    assert cache.tier(victim) == "host"
    assert ("evict", victim, "device") in events
    assert {m for m in "abc" if cache.tier(m) == "device"} == set("abc") - {victim}


def test_pinned_by_name_and_top_n_are_never_evicted():
    disk = Disk({m: 100 for m in "abcd"})
    clock = Clock()
    cache, _ = make(disk, device_budget_bytes=200, pinned=["a"], half_life_s=0.01, clock=clock)
    for t, m in enumerate("abcd"):
        clock.t = t
        use(cache, m)
    assert cache.tier("a") == "device"  # the oldest, but pinned
    # top-1 by traffic: b gets many requests, then newer variants churn around it
    disk2 = Disk({m: 100 for m in "bcde"})
    cache2, _ = make(disk2, device_budget_bytes=200, pin_top_n=1, half_life_s=1000.0, clock=clock)
    for _ in range(5):
        use(cache2, "b")
    for m in "cde":
        clock.t += 100  # long after b's requests: b is the least recently used
        use(cache2, m)
    assert cache2.tier("b") == "device" and cache2.snapshot()["b"]["pinned"]


class _Room(threading.Condition):
    """The cache's condition for room on the device (``DeltaCache._room``), telling when a load waits on it."""

    def __init__(self, lock):
        super().__init__(lock)
        self.waiting = threading.Event()

    def wait(self, timeout=None):
        self.waiting.set()  # set with the lock held: whoever takes it next finds the load waiting
        return super().wait(timeout)


def test_a_variant_in_flight_is_never_evicted_and_a_load_waits_for_room():
    disk = Disk({"a": 100, "b": 100, "c": 100})
    cache, _ = make(disk, device_budget_bytes=200, wait_timeout_s=0.3)
    cache.acquire("a")
    cache.acquire("b")  # both in flight
    with pytest.raises(CacheFullError, match=r"no room on the device for variant `c` \(100 bytes\): every "
                                             r"resident variant \(a, b\) is in flight or pinned"):
        cache.acquire("c")
    assert cache.tier("a") == cache.tier("b") == "device"
    assert cache.snapshot()["c"]["in_flight"] == 0  # the failed request released itself
    # b's request ends while c's load waits for room (a timer could fire before the wait begins on a
    # loaded machine): the load is woken by it, long before its wait_timeout_s, and evicts b
    cache2, _ = make(disk, device_budget_bytes=200, wait_timeout_s=60)
    cache2._room = room = _Room(cache2._lock)
    cache2.acquire("a")
    cache2.acquire("b")
    got = []
    t = threading.Thread(target=lambda: got.append(cache2.acquire("c")), daemon=True)
    t.start()
    assert room.waiting.wait(30), "c's load did not wait for room"
    assert t.is_alive() and not got and cache2.tier("b") == "device"  # b in flight: not evicted
    cache2.release("b")
    t.join(30)
    assert [d.name for d in got] == ["c"], "the load was not woken when b's request ended"
    assert cache2.tier("b") == "host" and cache2.tier("a") == "device"


def test_close_ends_the_loads_waiting_for_room_and_refuses_later_waits():
    """Found by a fresh user: at a shutdown, a request whose variant waited for room on the device was
    held until a running request ended, or for the whole wait and then a 'retry later' 503. ``close``
    (the server's drain) raises its error in the waiting load at once; a load that can evict, or a
    variant already on the device, still goes."""
    disk = Disk({"a": 100, "b": 100, "c": 100, "d": 100})
    cache, _ = make(disk, device_budget_bytes=200, wait_timeout_s=60)
    cache._room = room = _Room(cache._lock)
    cache.acquire("a")
    cache.acquire("b")
    got = []

    def load():
        try:
            got.append(cache.acquire("c"))
        except RuntimeError as e:
            got.append(e)

    t = threading.Thread(target=load, daemon=True)
    t.start()
    assert room.waiting.wait(30), "c's load did not wait for room"
    error = RuntimeError("shutting down")
    cache.close(error)
    t.join(30)
    assert got == [error] and cache.snapshot()["c"]["in_flight"] == 0
    with pytest.raises(RuntimeError, match="shutting down"):  # a later load that would wait
        cache.acquire("d")
    assert cache.acquire("a").name == "a"  # on the device: no wait
    cache.release("b")
    assert cache.acquire("d").name == "d"  # b evicted: no wait either


def test_an_evicted_variant_comes_back_from_the_host_tier_without_a_read():
    disk = Disk({"a": 100, "b": 100, "c": 100})
    clock = Clock()
    cache, events = make(disk, device_budget_bytes=100, host_budget_bytes=100, clock=clock)
    for t, m in enumerate("ab"):
        clock.t = t
        use(cache, m)
    assert cache.tier("a") == "host" and cache.device_bytes == 100 and cache.host_bytes == 100
    clock.t = 2
    assert use(cache, "a").where == "device"
    assert disk.reads == {"a": 1, "b": 1, "c": 0}
    assert ("load", "a", "host") in events
    clock.t = 3
    use(cache, "c")  # a → host (b's host copy, older, makes room); c on the device
    assert cache.tier("b") == "disk" and cache.tier("a") == "host" and cache.tier("c") == "device"
    assert ("evict", "b", "host") in events
    assert cache.host_bytes == 100 and cache.device_bytes == 100


def test_a_delta_larger_than_the_device_budget_is_refused():
    cache, _ = make(Disk({"big": 500}), device_budget_bytes=400)
    with pytest.raises(CacheFullError, match=r"`big` needs 500 bytes of deltas, more than the whole device "
                                             r"budget \(400 bytes\)"):
        cache.acquire("big")
    assert cache.device_bytes == 0


def test_changed_artifact_is_reread_and_removed_one_is_gone():
    disk = Disk({"a": 100})
    cache, _ = make(disk)
    first = use(cache, "a")
    assert use(cache, "a") is first and disk.reads["a"] == 1
    disk.stamps["a"] = 2  # re-exported
    again = use(cache, "a")
    assert again is not first and disk.reads["a"] == 2 and cache.device_bytes == 100
    del disk.stamps["a"]  # removed
    with pytest.raises(ArtifactGoneError, match="the artifact of `a` is gone"):
        cache.acquire("a")
    assert cache.device_bytes == 0 and "a" not in cache.snapshot()


def test_failed_read_is_not_cached_and_frees_its_request():
    disk = Disk({"a": 100})
    disk.fail.add("a")
    cache, events = make(disk)
    with pytest.raises(OSError, match="cannot read a"):
        cache.acquire("a")
    assert ("load_failed", "a", "disk") in events and cache.device_bytes == 0
    assert cache.snapshot()["a"]["in_flight"] == 0
    disk.fail.clear()
    assert use(cache, "a").name == "a" and disk.reads["a"] == 2


def test_unload_refuses_a_variant_in_flight():
    cache, _ = make(Disk({"a": 100}))
    cache.acquire("a")
    with pytest.raises(RuntimeError, match="variant `a` has 1 request in flight"):
        cache.unload("a")
    cache.release("a")
    assert cache.unload("a") is True and cache.tier("a") == "disk" and cache.device_bytes == 0
    assert cache.unload("a") is False
    assert cache.load("a") == "disk" and cache.tier("a") == "device"
    assert cache.load("a") == "device"


def test_a_hot_load_is_a_load_not_a_request():
    """Found by a reviewer: a hot load (``load``, ahead of traffic) counted as a request, a miss (then a
    hit) and one more in the request count eviction ranks by. It is the load alone: a variant loaded
    so ranks below one requested once, and goes first when room is needed."""
    disk, clock = Disk({"a": 100, "b": 100, "c": 100}), Clock()
    cache, events = make(disk, device_budget_bytes=200, clock=clock)
    use(cache, "a")
    clock.t = 1
    assert cache.load("b") == "disk" and cache.load("b") == "device"
    assert [ev for ev in events if ev[1] == "b"] == [("load", "b", "disk")]
    assert cache.snapshot()["b"]["requests"] == 0.0 and cache.snapshot()["b"]["in_flight"] == 0
    clock.t = 2
    use(cache, "c")  # room for c: b goes (no request), not a (one request, older)
    assert cache.tier("b") == "host" and cache.tier("a") == "device"
    assert ("evict", "b", "device") in events
    use(cache, "b")  # its first request: a miss, counted
    assert [ev for ev in events if ev[1] == "b"][-2:] == [("miss", "b", None), ("load", "b", "host")]
    assert cache.snapshot()["b"]["requests"] == 1.0


def test_an_unload_is_no_eviction():
    """Found by a reviewer: an unload was told to the listeners as ``evict`` (and counted in
    ``delta_cache_evictions``). It is ``unload``, with the tier the deltas left, device or host."""
    disk, clock = Disk({"a": 100, "b": 100}), Clock()
    cache, events = make(disk, device_budget_bytes=100, clock=clock)
    use(cache, "a")
    clock.t = 1
    use(cache, "b")  # a goes down to the host tier: that is an eviction
    events.clear()
    assert cache.unload("b") is True and cache.unload("a") is True
    assert events == [("unload", "b", "device"), ("unload", "a", "host")]
    assert cache.device_bytes == cache.host_bytes == 0


def test_unload_forgets_a_variant_whose_deltas_left_every_tier_already():
    """Found by a reviewer: a variant evicted to the disk tier (no host tier) and then unloaded stayed in
    the snapshot (``/v1/delta_cache``) with its request count, unlike one unloaded from the device,
    and a load of it again went on counting from it."""
    cache, _ = make(Disk({"a": 100, "b": 100}), device_budget_bytes=100, host_budget_bytes=0)
    for _ in range(3):
        use(cache, "a")
    use(cache, "b")  # a leaves the device, and is kept nowhere
    assert cache.snapshot()["a"]["tier"] == "disk"
    assert cache.unload("a") is False and "a" not in cache.snapshot()
    use(cache, "a")
    assert cache.snapshot()["a"]["requests"] == 1.0


def test_a_host_copy_moving_up_is_not_evicted_by_the_demotion_it_makes_room_with():
    """One device slot, one host slot: a on the host, b on the device. a's load demotes b to the host
    tier, where a's own copy is still counted until it is on the device: that copy is not the host
    tier's victim (it was let go, ``free_host`` called on it and an eviction counted, and under
    tensor parallelism the other ranks read a from disk), and b's copy stays, since a's room comes
    free. A failed load gives the host tier back its budget. Found by a review."""
    disk, clock, gone = Disk({"a": 100, "b": 100}), Clock(), []
    cache, events = make(disk, device_budget_bytes=100, host_budget_bytes=100, clock=clock,
                         free_host=lambda d: gone.append(d.name))
    use(cache, "a")
    clock.t = 1
    use(cache, "b")                                       # a goes down to the host tier
    assert cache.tier("a") == "host" and cache.tier("b") == "device"
    events.clear()
    clock.t = 2
    assert use(cache, "a").where == "device"
    assert events == [("miss", "a", None), ("evict", "b", "device"), ("load", "a", "host")]
    assert gone == [] and cache.tier("b") == "host" and cache.host_bytes == 100
    # the same move failing on its way to the device: b's copy came down meanwhile, one of the two goes
    cache2, _ = make(disk, device_budget_bytes=100, host_budget_bytes=100, clock=clock)
    clock.t = 3
    use(cache2, "a")
    clock.t = 4
    use(cache2, "b")
    cache2._to_device = lambda d: (_ for _ in ()).throw(RuntimeError("device copy failed"))
    clock.t = 5
    with pytest.raises(RuntimeError, match="device copy failed"):
        cache2.acquire("a")
    assert cache2.host_bytes == 100 and cache2.device_bytes == 0


def test_pin_top_n_pins_the_most_requested_residents():
    """``pin_top_n`` keeps the n most requested variants on the device: a variant elsewhere, even one
    requested more (here one whose every load fails), takes no pin from them. Found by a review: the
    failing variant outranked the hottest resident, which was then evicted as if unpinned."""
    disk, clock = Disk({"a": 100, "b": 100, "bad": 100}), Clock()
    disk.fail.add("bad")
    cache, _ = make(disk, device_budget_bytes=100, pin_top_n=1, half_life_s=1000.0, wait_timeout_s=0.2, clock=clock)
    for _ in range(5):
        use(cache, "a")
    for _ in range(10):
        with pytest.raises(OSError):
            cache.acquire("bad")
    clock.t = 1
    with pytest.raises(CacheFullError, match=r"every resident variant \(a\) is in flight or pinned"):
        cache.acquire("b")
    assert cache.tier("a") == "device" and cache.snapshot()["a"]["pinned"]


def test_a_joining_choice_takes_the_version_its_request_holds_also_once_retired():
    """``join``: a request's later choice takes the delta its first choice holds, also once another
    request has retired that version for a re-export; then both versions' holds end apart. Found by
    a review: the joining choice found the new version's entry."""
    from types import SimpleNamespace

    version = {"a": 1}
    cache = DeltaCache(lambda m: SimpleNamespace(v=version[m], nbytes=1), lambda d: d, lambda m: version[m])
    first = cache.acquire("a")                  # a request's first choice: version 1
    version["a"] = 2                            # re-exported
    other = cache.acquire("a")                  # another request: version 1 retired, version 2 loaded
    assert (first.v, other.v) == (1, 2)
    joined = cache.acquire("a", join=first)     # the first request's second choice
    state = cache.snapshot()["a"]  # the first request's two choices on the old version, the other's on the new
    assert joined is first and (state["in_flight"], state["in_flight_old"]) == (3, 2)
    for d in (first, joined, other):
        cache.release("a", d)
    assert cache._retired == [] and cache.snapshot()["a"]["in_flight"] == 0


def test_unload_refuses_a_variant_whose_first_load_runs():
    """A request whose load is still reading the artifact is in flight too: unload refuses, rather
    than answer "not cached" and see the variant land on the device after it. Found by a review:
    ``Engine.add_variant`` replacing a folder relies on it."""
    disk = Disk({"a": 100})
    disk.gates["a"] = threading.Event()
    cache, _ = make(disk)
    t = threading.Thread(target=cache.acquire, args=("a",))
    t.start()
    try:
        deadline = time.time() + 10
        while disk.reads["a"] == 0:
            assert time.time() < deadline
            time.sleep(0.005)
        with pytest.raises(RuntimeError, match="variant `a` has 1 request in flight"):
            cache.unload("a")
    finally:
        disk.gates["a"].set()
        t.join(10)
    cache.release("a")
    assert cache.unload("a") is True and cache.tier("a") == "disk"


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="half_life_s must be > 0, got 0"):
        DeltaCache(print, print, print, half_life_s=0)
    with pytest.raises(ValueError, match="device_budget_bytes must be ≥ 0 or None, got -1"):
        DeltaCache(print, print, print, device_budget_bytes=-1)


def test_equal_counts_evict_the_least_recently_used():
    """With a half-life of 1 ms, counts 5 s old have decayed to exactly 0: the tie goes to recency."""
    disk = Disk({"a": 100, "b": 100, "c": 100})
    clock = Clock()
    cache, _ = make(disk, device_budget_bytes=200, half_life_s=0.001, clock=clock)
    for t, m in ((0.0, "a"), (5.0, "b"), (10.0, "c")):
        clock.t = t
        use(cache, m)
    assert (cache.tier("a"), cache.tier("b"), cache.tier("c")) == ("host", "device", "device")


def test_the_host_tier_keeps_its_copies_when_a_larger_one_cannot_fit():
    disk = Disk({"a": 100, "b": 100, "big": 300})
    clock = Clock()
    cache, events = make(disk, device_budget_bytes=300, host_budget_bytes=150, clock=clock)
    for t, m in enumerate("ab"):
        clock.t = t
        use(cache, m)
    clock.t = 2
    use(cache, "big")  # a and b leave the device; b's copy takes the colder a's place on the host
    assert cache.tier("a") == "disk" and cache.tier("b") == "host" and cache.host_bytes == 100
    host_evictions = [e for e in events if e[0] == "evict" and e[2] == "host"]
    clock.t = 3
    use(cache, "a")  # big leaves the device: 300 bytes never fit the host's 150, and b's copy stays
    assert cache.tier("big") == "disk" and cache.tier("b") == "host" and cache.host_bytes == 100
    assert [e for e in events if e[0] == "evict" and e[2] == "host"] == host_evictions == [("evict", "a", "host")]


def test_the_host_tier_names_every_copy_it_lets_go():
    """``free_host`` gets each host copy the host tier lets go — evicted for a warmer one, not kept
    for want of room, dropped by unload — and none that moves up to the device (tensor-parallel
    ranks drop their own copies on it, serve/follower.py)."""
    disk = Disk({"a": 100, "b": 100, "big": 300})
    clock = Clock()
    gone: list = []
    cache, _ = make(disk, device_budget_bytes=300, host_budget_bytes=150, clock=clock,
                    free_host=lambda d: gone.append((d.name, d.where)))
    for t, m in enumerate(("a", "b", "big")):
        clock.t = t
        use(cache, m)
    assert gone == [("a", "host")]  # b's copy took the colder a's place
    clock.t = 3
    use(cache, "a")  # big leaves the device and its copy cannot fit the host's 150 bytes
    assert gone == [("a", "host"), ("big", "host")] and cache.tier("b") == "host"
    clock.t = 4
    use(cache, "b")  # b's copy moves up beside a: not let go
    assert gone == [("a", "host"), ("big", "host")] and cache.tier("b") == "device"
    clock.t = 5
    use(cache, "big")  # a and b leave the device; b's copy takes a's place again
    assert gone == [("a", "host"), ("big", "host"), ("a", "host")] and cache.tier("b") == "host"
    cache.unload("b")
    assert gone == [("a", "host"), ("big", "host"), ("a", "host"), ("b", "host")]


def test_a_variant_back_from_the_host_tier_leaves_it_and_is_counted_once():
    disk = Disk({"a": 100, "b": 100})
    clock = Clock()
    cache, events = make(disk, device_budget_bytes=100, host_budget_bytes=200, clock=clock)
    for t, m in enumerate("aba"):
        clock.t = t
        use(cache, m)
    assert ("load", "a", "host") in events and ("hit", "a", None) not in events
    assert cache.tier("a") == "device" and cache.tier("b") == "host"
    assert cache.device_bytes == 100 and cache.host_bytes == 100  # b's copy only
    assert cache.snapshot()["a"]["tier"] == "device"
    use(cache, "a")
    assert events[-1] == ("hit", "a", None)
    cache.unload("a")
    assert cache.load("b") == "host" and cache.load("b") == "device" and cache.load("a") == "disk"


def test_a_failed_copy_to_the_device_gives_its_room_back():
    disk = Disk({"a": 100})
    fail = [True]

    def to_device(d):
        if fail.pop():
            raise RuntimeError("CUDA error: out of memory")
        return Delta(d.name, d.nbytes, "device")

    fail.insert(0, False)
    cache = DeltaCache(disk.read, to_device, disk.stamp, device_budget_bytes=100, wait_timeout_s=0.2)
    with pytest.raises(RuntimeError, match="out of memory"):
        cache.acquire("a")
    assert cache.device_bytes == 0 and cache.snapshot()["a"]["in_flight"] == 0
    assert use(cache, "a").where == "device" and cache.device_bytes == 100


def test_a_changed_artifact_serves_new_requests_at_once_and_running_ones_to_their_end():
    """Found by a fresh user: under steady traffic a re-exported variant was never read again, since
    every request found the old version in flight. The old version is retired instead: the requests
    running on it keep it (in its place on the device, counted in the budget, never evicted) and it
    leaves with the last of them, kept nowhere; new requests get the new version at once."""
    disk = Disk({"a": 100, "b": 100})
    freed: list = []
    cache, events = make(disk, device_budget_bytes=200, wait_timeout_s=0.2,
                         free_device=lambda d, kept: freed.append((d.name, kept)))
    use(cache, "b")
    old = cache.acquire("a")  # in flight
    disk.stamps["a"] = 2  # re-exported
    new = cache.acquire("a")  # read again; b leaves the device for the host tier to make room
    assert new is not old and disk.reads["a"] == 2 and freed == [("b", True)]
    assert cache.device_bytes == 200 and cache.snapshot()["a"]["in_flight_old"] == 1
    assert cache.snapshot()["a"]["in_flight"] == 2  # each version's request
    assert use(cache, "a") is new and disk.reads["a"] == 2  # the new version is the one served
    disk.stamps["a"] = 3  # again, with both versions in flight and no room left: the load waits, then gives up
    with pytest.raises(CacheFullError, match="no room on the device for variant `a`"):
        cache.acquire("a")  # (read first: the new version's size is not known)
    cache.release("a", new)  # the second version's last request: it leaves the device
    cache.release("a", old)  # so does the first: each request released the version it was given
    assert freed == [("b", True), ("a", False), ("a", False)] and cache.device_bytes == 0
    third = use(cache, "a")
    assert third not in (old, new) and disk.reads["a"] == 4 and cache.device_bytes == 100


def test_a_request_that_sees_a_changed_artifact_does_not_take_the_old_versions_read():
    """Found by a reviewer: a request that found the artifact changed on disk while the first read of
    the old version still ran joined that read and got the old version. It now reads the new one once
    that read ends; the old version stays its own request's and leaves the device with it."""
    disk = Disk({"a": 100})
    disk.gates["a"] = threading.Event()
    freed: list = []
    cache, events = make(disk, free_device=lambda d, kept: freed.append((d.name, kept)))
    got = {}
    first = threading.Thread(target=lambda: got.setdefault("first", cache.acquire("a")))
    first.start()
    try:
        while disk.reads["a"] == 0:  # the first read of version 1 runs
            time.sleep(0.01)
        disk.stamps["a"] = 2  # re-exported
        second = threading.Thread(target=lambda: got.setdefault("second", cache.acquire("a")))
        second.start()
        while not in_load(second):
            time.sleep(0.01)
    finally:
        disk.gates["a"].set()
    first.join(10)
    second.join(10)
    assert disk.reads["a"] == 2 and got["second"] is not got["first"]
    # each request counted once, a miss (found by a reviewer: the second, reading again, counted two)
    assert [ev for ev in events if ev[0] in ("hit", "miss")] == [("miss", "a", None)] * 2
    state = cache.snapshot()["a"]  # the new version's request, and the old one's, retired
    assert (state["in_flight"], state["in_flight_old"]) == (2, 1)
    cache.release("a", got["first"])
    assert freed == [("a", False)]  # its last request ended: the old version leaves, kept nowhere
    assert use(cache, "a") is got["second"] and disk.reads["a"] == 2
    cache.release("a", got["second"])
    assert cache.snapshot()["a"]["in_flight"] == 0


def test_requests_in_flight_keep_a_removed_artifact_until_they_end():
    """A removal does not pull a delta from under running requests: new requests get the 404 at once,
    and the delta stays until the running ones have ended."""
    disk = Disk({"a": 100})
    cache, events = make(disk)
    held = cache.acquire("a")
    del disk.stamps["a"]
    with pytest.raises(ArtifactGoneError):
        cache.acquire("a")
    assert cache.tier("a") == "device" and cache.device_bytes == 100  # held by the running request
    assert cache.snapshot()["a"]["in_flight"] == 1
    cache.release("a", held)
    with pytest.raises(ArtifactGoneError):
        cache.acquire("a")
    assert cache.tier("a") == "disk" and cache.device_bytes == 0


@pytest.mark.parametrize("found_by", ["discard", "request"])
def test_a_removed_artifact_leaves_every_tier_with_its_last_request(found_by):
    """Found by a fresh user: a variant whose folder was removed while a request ran on it, and seen
    gone meanwhile (the scan of ``/v1/models``: :meth:`DeltaCache.discard`; or a request for it), kept
    its device slot, then its host copy, for ever: nothing asked for it again. It now leaves with the
    last running request, without another one coming."""
    disk = Disk({"a": 100, "b": 50})
    cache, events = make(disk)
    held = cache.acquire("a")
    use(cache, "b")
    del disk.stamps["a"]
    if found_by == "discard":
        cache.discard("a")
        cache.discard("b")  # not gone: discard is only called for what is; idle, it leaves at once
    else:
        with pytest.raises(ArtifactGoneError):
            cache.acquire("a")
    assert cache.tier("a") == "device" and cache.snapshot()["a"]["in_flight"] == 1  # the running one keeps it
    cache.release("a", held)
    assert "a" not in cache.snapshot() and cache.device_bytes == (0 if found_by == "discard" else 50)  # b's
    assert cache.host_bytes == 0 and ("evict", "a", "device") in events
    assert sorted(cache.snapshot()) == ([] if found_by == "discard" else ["b"])


def test_the_snapshot_reports_pinning_not_requests_in_flight():
    cache, _ = make(Disk({"a": 100, "b": 100}), pinned=["b"])
    cache.acquire("a")
    use(cache, "b")
    snap = cache.snapshot()
    assert snap["a"]["in_flight"] == 1 and snap["a"]["pinned"] is False
    assert snap["b"]["in_flight"] == 0 and snap["b"]["pinned"] is True


def test_requests_queued_behind_a_waiting_load_give_up_with_it():
    """Found by a fresh user: three requests for a variant with no room on the device got their 503s
    after 30, 60 and 90 s, each starting its wait once the one before it had given up. Each waits
    ``wait_timeout_s`` from its own arrival: all three give up together."""
    disk = Disk({"a": 100, "b": 100})
    cache, _ = make(disk, device_budget_bytes=100, wait_timeout_s=2.0)
    cache.acquire("a")  # in flight: nothing can be evicted
    start, ended = time.monotonic(), []

    def req():
        with pytest.raises(CacheFullError, match="no room on the device for variant `b`"):
            cache.acquire("b")
        ended.append(time.monotonic() - start)

    threads = [threading.Thread(target=req, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(ended) == 3 and max(ended) < 3.5, ended  # one after another: 2, 4 and 6 s
    assert cache.snapshot()["b"]["in_flight"] == 0
    # found by a reviewer: with a slow read, each queued request read the artifact again after the one
    # before it failed, then failed at once: 503s one read apart, and a read each for nothing
    slow = Disk({"a": 100, "b": 100})
    slow.delay = 1.0
    cache, _ = make(slow, device_budget_bytes=100, wait_timeout_s=2.0)
    cache.acquire("a")
    start, ended[:] = time.monotonic(), []
    threads = [threading.Thread(target=req, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(ended) == 3 and max(ended) < 4.5, ended  # read 1 s, wait 2 s: all by 3 s, not 3, 4 and 5
    assert slow.reads["b"] == 1  # the size known, the others make room first: none reads for nothing


def test_a_variant_waiting_for_a_slot_is_served_before_new_requests_of_the_resident_one():
    """Found by a fresh user: with one device slot and a steady stream of requests to the resident
    variant, each overlapping the next, a request for another variant waited its whole wait_timeout_s
    and got a 503 while later requests of the resident one went through. Now, while its load waits,
    the resident is draining: a new request of it waits behind the load (first come, first served),
    the load takes the slot when the running request ends, and the new request then loads the
    resident back when the other variant's request ends. A variant pinned by name is never drained."""
    disk = Disk({"a": 100, "b": 100})
    cache, events = make(disk, device_budget_bytes=100, wait_timeout_s=60)
    cache._room = room = _Room(cache._lock)
    cache.acquire("a")                                   # a's first request runs
    order, threads = [], []

    def request(m):
        order.append((m, cache.acquire(m).name))

    threads.append(threading.Thread(target=request, args=("b",), daemon=True))
    threads[-1].start()
    assert room.waiting.wait(30), "b's load did not wait for room"
    threads.append(threading.Thread(target=request, args=("a",), daemon=True))  # a's second request
    threads[-1].start()
    time.sleep(0.3)
    assert order == [] and cache.snapshot()["a"]["in_flight"] == 1, "a's second request went past b's load"
    cache.release("a")                                   # a's first request ends: b takes the slot
    threads[0].join(30)
    assert order == [("b", "b")] and cache.tier("a") == "host"
    cache.release("b")                                   # b's request ends: a comes back for its second
    threads[1].join(30)
    assert order == [("b", "b"), ("a", "a")] and cache.tier("a") == "device" and cache.tier("b") == "host"
    cache.release("a")

    pinned, _ = make(disk, device_budget_bytes=100, wait_timeout_s=0.3, pinned=["a"])
    pinned.acquire("a")
    assert use(pinned, "a").name == "a"                  # no load waits: a hit as ever
    with pytest.raises(CacheFullError):
        pinned.acquire("b")                              # waits its 0.3 s: a is pinned, never drained
    assert use(pinned, "a").name == "a" and not pinned._entries["a"].draining
