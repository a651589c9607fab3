"""The tiered delta cache of the serving engine (docs/serving.md, "Delta cache").

A variant's deltas (packed signs, scales, the few tensors kept in full; :class:`deltafleet.serve.delta.VariantDelta`)
live in one of three tiers:

* **device** — on the serving device, under ``device_budget_bytes``; only these are served.
* **host** — in (pinned, when the device is a GPU) host memory, under ``host_budget_bytes``: a
  variant evicted from the device is kept here, so its next cold load is a host-to-device copy.
  The tiers are exclusive: a variant is in one of them at a time.
* **disk** — the artifact folder; read (and its hashes checked) on a miss in both tiers.

Eviction is LRU weighted by request rate: every variant carries a request count that decays with
a half-life (``half_life_s``): ``c ← c · 2^(−Δt/half_life) + 1`` per request. A hot load
(:meth:`DeltaCache.load`, ahead of traffic) is no request: it counts in neither that count nor the
hits and misses, only as the load it is. The victim is the
evictable variant with the smallest decayed count, so a variant used often keeps its slot over one
used once slightly more recently, and with a short half-life the policy is plain LRU. Never
evicted: a variant with requests in flight (:meth:`DeltaCache.acquire` … :meth:`DeltaCache.release`),
a variant pinned by name (``pinned``), and the ``pin_top_n`` variants with the highest counts.
When nothing can be evicted, a load waits for a request to finish, then fails with
:class:`CacheFullError`: each request waits at most ``wait_timeout_s`` from its arrival (plus the
time its own read of the artifact takes), also when it queued behind another request's load of the
same variant. While it waits, the coldest resident it could evict once idle is *draining*: its new
requests wait behind the load (first come, first served) instead of keeping it in flight for ever,
so a variant without a slot is not starved by steady traffic to the resident ones; they go on once
the load has evicted it (then as a miss, loading it again) or given up.

Loading is single-flight: concurrent requests for a variant that is not on the device wait for
one load of it, and share its outcome, a failure too (a request that arrives after it ended tries
again), and requests for other variants are not held up by it (the per-variant lock is held during
the read; the cache-wide lock only for bookkeeping). An artifact changed on disk
(``stamp``) is read again on its next request: the old version, while requests still run on it,
is *retired* (it keeps its place on the device, counted in the budget, is never evicted and serves
only those requests, each of which releases it by the delta it was given), and the new one is
loaded beside it like any miss, so a variant under steady traffic moves to its new version at
once; the old one leaves the device with its last request. One removed is dropped
(:class:`ArtifactGoneError`).
"""
from __future__ import annotations

import copy
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

Tier = Literal["device", "host", "disk"]
# event ("hit", "miss", "load", "load_failed", "evict", "unload"), model id, seconds (loads), tier
CacheListener = Callable[[str, str, float, "str | None"], None]


class CacheFullError(RuntimeError):
    """No room on the device for a variant: the delta alone exceeds the budget, or every resident
    variant is in flight or pinned and none finished within the wait (HTTP 503)."""


class ArtifactGoneError(LookupError):
    """The variant's artifact was removed from disk since it was found (HTTP 404)."""


def _again(error: BaseException) -> BaseException:
    """``error`` to raise in another thread: a copy where it copies (its type, message and
    attributes), without the first raise's traceback."""
    try:
        error = copy.copy(error)
    except Exception:  # an exception that cannot be built again from its args: the same one
        pass
    return error.with_traceback(None)


@dataclass
class _Entry:
    model_id: str
    count: float = 0.0          # decayed request count at time `t_count`
    t_count: float = 0.0
    in_flight: int = 0
    device: Any = None          # the delta on the serving device (tier 1)
    host: Any = None            # the delta in host memory (tier 2)
    nbytes: int = 0
    stamp: Any = None           # the artifact's stamp when it was read
    draining: bool = False      # a load waits for its room: new requests wait too (DeltaCache._make_room)
    moving: bool = False        # its host copy is being loaded onto the device: not a host-tier victim
    gone: bool = False          # its artifact is gone: it leaves every tier with its last request (discard)
    lock: threading.Lock = field(default_factory=threading.Lock)  # single flight
    loads: int = 0              # loads of it ended (or failed), for the requests queued behind one
    error: BaseException | None = None  # how the last of them failed (None: it did not)


class DeltaCache:
    """Variants' deltas in device / host / disk tiers with weighted-LRU eviction (module docstring).

    Args:
        read: ``read(model_id) -> delta`` reads the artifact from disk into host memory (any
            object with an ``nbytes`` attribute, in bytes); may raise — the error reaches the request.
        to_device: ``to_device(host_delta) -> delta`` on the serving device (identity when the
            device is the CPU).
        to_host: ``to_host(device_delta) -> host delta``, used when a variant leaves the device and
            has no host copy yet (identity when the device is the CPU, where both tiers are the same
            memory and the budgets are bookkeeping).
        stamp: ``stamp(model_id)`` → a value that changes when the artifact changes on disk, or
            None once it is gone.
        free_device: ``free_device(delta, kept)`` when a device delta leaves the device, e.g. to
            give its slot back (serve/batch.py); ``kept``: whether a host copy of it goes to the host
            tier (an eviction; ``to_host`` was called first), rather than none (dropped, or a retired
            version's last request ended).
        free_host: called with a host copy when the host tier lets it go (evicted, not kept for want
            of room, or dropped), not when it moves up to the device: tensor-parallel ranks keep host
            copies of their own slices and drop them with rank 0's (serve/engine.py).
        size: bytes a delta takes on the device (default its ``nbytes``).
        device_budget_bytes, host_budget_bytes: tier sizes in bytes (None: unbounded; 0 host:
            no host tier).
        pinned: model ids never evicted. pin_top_n: also never evict the n most requested residents.
        half_life_s: half-life of the request counts, seconds.
        wait_timeout_s: how long a request waits for room on the device before CacheFullError,
            from its arrival (its own read of the artifact excluded).
        clock: monotonic seconds (tests pass a fake one).

    Raises (from :meth:`acquire`): CacheFullError, ArtifactGoneError, or whatever ``read`` raises.
    """

    def __init__(self, read: Callable[[str], Any], to_device: Callable[[Any], Any], stamp: Callable[[str], Any],
                 *, to_host: Callable[[Any], Any] = lambda d: d, free_device: Callable[[Any], None] | None = None,
                 free_host: Callable[[Any], None] | None = None, size: Callable[[Any], int] = lambda d: int(d.nbytes),
                 device_budget_bytes: int | None = None, host_budget_bytes: int | None = None, pinned: tuple[str, ...] | list[str] = (), pin_top_n: int = 0,
                 half_life_s: float = 60.0, wait_timeout_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic):
        if half_life_s <= 0:
            raise ValueError(f"half_life_s must be > 0, got {half_life_s}")
        for name, v in (("device_budget_bytes", device_budget_bytes), ("host_budget_bytes", host_budget_bytes)):
            if v is not None and v < 0:
                raise ValueError(f"{name} must be ≥ 0 or None, got {v}")
        if pin_top_n < 0:
            raise ValueError(f"pin_top_n must be ≥ 0, got {pin_top_n}")
        self._read, self._to_device, self._to_host, self._stamp = read, to_device, to_host, stamp
        self._free_device, self._free_host, self._size = free_device, free_host, size
        self.device_budget, self.host_budget = device_budget_bytes, host_budget_bytes
        self.pinned, self.pin_top_n = set(pinned), pin_top_n
        self.half_life, self.wait_timeout, self.clock = half_life_s, wait_timeout_s, clock
        self._entries: dict[str, _Entry] = {}
        self._retired: list[_Entry] = []  # old versions of changed artifacts, on the device for their requests
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # notified when a request ends or a delta leaves
        self._closed: BaseException | None = None  # set by close(): loads that would wait for room raise it
        self._listeners: list[CacheListener] = []
        self.device_bytes = 0   # bytes on the device, reserved ones included
        self.host_bytes = 0

    # ------------------------------------------------------------------ bookkeeping

    def add_listener(self, fn: CacheListener) -> None:
        """``fn(event, model_id, seconds, tier)`` on hit, miss, load (tier it came from), load_failed,
        evict (tier it left) and unload (tier it left: :meth:`unload`, an explicit drop, which is no
        eviction); each request's :meth:`acquire` is one hit or one miss, whatever it retries, and a
        hot load's (``request=False``) neither."""
        self._listeners.append(fn)

    def remove_listener(self, fn: CacheListener) -> None:
        self._listeners.remove(fn)

    def _emit(self, event: str, model_id: str, seconds: float = 0.0, tier: str | None = None) -> None:
        for fn in list(self._listeners):
            fn(event, model_id, seconds, tier)

    def _count(self, e: _Entry, now: float) -> float:
        return e.count * math.pow(2.0, -(now - e.t_count) / self.half_life)

    def _touch(self, e: _Entry) -> None:
        now = self.clock()
        e.count, e.t_count = self._count(e, now) + 1.0, now

    def _protected(self, now: float) -> set[str]:
        """Model ids that must not be evicted now: in flight, pinned by name, or in the top n."""
        return {m for m, e in self._entries.items() if e.in_flight > 0} | self.pinned | self._top_n(now)

    def _top_n(self, now: float) -> set[str]:
        """The ``pin_top_n`` most requested model ids on the device (one elsewhere, or whose loads
        fail, takes no pin from them)."""
        if not self.pin_top_n:
            return set()
        ranked = sorted((e for e in self._entries.values() if e.device is not None),
                        key=lambda e: self._count(e, now), reverse=True)
        return {e.model_id for e in ranked[:self.pin_top_n]}

    def _victim(self, tier: str, exclude: str) -> _Entry | None:
        now = self.clock()
        keep = self._protected(now) if tier == "device" else set()
        return self._coldest([e for e in self._entries.values() if getattr(e, tier) is not None
                              and e.model_id != exclude and e.model_id not in keep and not e.moving], now)

    def _coldest(self, entries: list[_Entry], now: float) -> _Entry | None:
        """The entry with the smallest decayed request count (the least recently used among equals)."""
        return min(entries, key=lambda e: (self._count(e, now), e.t_count), default=None)

    def _fits(self, used: int, budget: int | None, n: int) -> bool:
        return budget is None or used + n <= budget

    def _keep_on_host(self, e: _Entry, host_copy: Any) -> None:
        """Put ``host_copy`` in the host tier, evicting colder host copies; dropped if it cannot fit
        (called with the lock held)."""
        if e.host is not None or host_copy is None:
            return
        if self.host_budget is not None and e.nbytes > self.host_budget:
            self._let_go(host_copy)
            return
        # a copy moving up to the device leaves the host tier when its load ends: its room counts as free
        moving = sum(x.nbytes for x in self._entries.values() if x.moving and x.host is not None)
        while not self._fits(self.host_bytes - moving, self.host_budget, e.nbytes):
            if not self._evict_host(exclude=e.model_id):
                self._let_go(host_copy)
                return
        e.host = host_copy
        self.host_bytes += e.nbytes

    def _evict_host(self, exclude: str | None = None) -> bool:
        """Let the coldest host copy go (not ``exclude``'s, nor one moving up to the device); whether
        there was one (called with the lock held)."""
        v = self._victim("host", exclude=exclude)
        if v is None:
            return False
        self._let_go(v.host)
        v.host = None
        self.host_bytes -= v.nbytes
        self._emit("evict", v.model_id, 0.0, "host")
        return True

    def _trim_host(self) -> None:
        """Evict host copies until the host tier is within its budget again (called with the lock held)."""
        while not self._fits(self.host_bytes, self.host_budget, 0) and self._evict_host():
            pass

    def _let_go(self, host_copy: Any) -> None:
        if self._free_host is not None:
            self._free_host(host_copy)

    def _make_room(self, e: _Entry, deadline: float) -> None:
        """Evict device residents (coldest first, demoted to the host tier) until ``e`` fits, then
        reserve its bytes. Called with the lock held; waits for running requests if it must."""
        if self.device_budget is not None and e.nbytes > self.device_budget:
            raise CacheFullError(f"variant `{e.model_id}` needs {e.nbytes} bytes of deltas, more than the whole "
                                 f"device budget ({self.device_budget} bytes)")
        drained = None  # the resident this load drains while it waits (module docstring)
        try:
            while not self._fits(self.device_bytes, self.device_budget, e.nbytes):
                v = self._victim("device", exclude=e.model_id)
                if v is None:
                    if self._closed is not None:
                        raise self._closed
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise self._no_room(e)
                    if drained is None:
                        drained = self._drain(e)
                    self._room.wait(left)
                    continue
                self._evict_device(v)
        finally:
            if drained is not None:
                drained.draining = False
                self._room.notify_all()
        self.device_bytes += e.nbytes

    def _drain(self, e: _Entry) -> _Entry | None:
        """Mark the coldest device resident that ``e``'s load could evict once its requests end (not
        pinned by name or count, not already draining) as draining; returns it, or None."""
        now = self.clock()
        keep = self.pinned | self._top_n(now)
        v = self._coldest([x for x in self._entries.values() if x.device is not None and x is not e
                           and x.model_id not in keep and not x.draining], now)
        if v is not None:
            v.draining = True
        return v

    def _no_room(self, e: _Entry) -> CacheFullError:
        busy = sorted({m for m, x in self._entries.items() if x.device is not None}
                      | {r.model_id for r in self._retired})  # (an old version, held by its requests)
        return CacheFullError(f"no room on the device for variant `{e.model_id}` ({e.nbytes} bytes): every resident "
                              f"variant ({', '.join(busy)}) is in flight or pinned; retry later")

    def _evict_device(self, v: _Entry) -> None:
        host_copy = v.host if v.host is not None else self._to_host(v.device)
        if self._free_device is not None:
            self._free_device(v.device, True)
        v.device = None
        self.device_bytes -= v.nbytes
        self._emit("evict", v.model_id, 0.0, "device")
        self._keep_on_host(v, host_copy)

    def close(self, error: BaseException) -> None:
        """Make every load waiting for room on the device, and every later one that would wait, raise
        ``error`` (the server is shutting down)."""
        with self._lock:
            self._closed = error
            self._room.notify_all()

    # ------------------------------------------------------------------ requests

    def acquire(self, model_id: str, join: Any = None, request: bool = True) -> Any:
        """The variant's delta on the device, loaded if needed; counts one request in flight until
        :meth:`release`. Returns the delta object (keep it for the request's lifetime). ``join``: the
        delta the caller holds already (what this returned for another choice of its HTTP request),
        taken again as it is: its version, whatever changed on disk since, and without waiting
        behind a load that drains the variant (that load waits for the caller's hold to end).
        ``request``: False for a hot load (:meth:`load`), which is held in flight like a request
        while it runs but counts in neither the variant's request count nor the hits and misses
        (its load and evictions are emitted as any)."""
        if join is not None:
            with self._lock:
                e = self._entries.get(model_id)
                held = e if e is not None and e.device is join else next(
                    (r for r in self._retired if r.device is join), None)
                if held is not None:
                    self._touch(held)
                    held.in_flight += 1
                    self._emit("hit", model_id)
                    return join
        deadline = time.monotonic() + self.wait_timeout
        counted = not request  # this request counted in the variant's popularity (once, however many tries)
        # this request's hit or miss emitted (a try after a miss, a changed artifact, is no other request);
        # a hot load has none to emit
        missed = not request
        while True:
            stamp = self._stamp(model_id)
            with self._lock:
                while True:  # a draining variant's new requests wait behind the load that drains it
                    e = self._entries.setdefault(model_id, _Entry(model_id))
                    left = deadline - time.monotonic()
                    if not (e.draining and e.device is not None) or self._closed is not None or left <= 0:
                        break
                    self._room.wait(left)
                if not counted:
                    self._touch(e)
                    counted = True
                if stamp is None:  # again, under the lock: a variant served again since is not gone
                    stamp = self._stamp(model_id)
                if stamp is None:
                    self._discard(e)  # requests still running keep what they hold
                    raise ArtifactGoneError(f"the artifact of `{model_id}` is gone")
                e.gone = False  # back on disk (if it had gone) before its last request ended
                if e.stamp is not None and e.stamp != stamp and (e.in_flight == 0 or e.device is not None):
                    # changed on disk: read it again; requests running on the old version keep it
                    self._drop(e) if e.in_flight == 0 else self._retire(e)
                    e = self._entries.setdefault(model_id, _Entry(model_id, count=e.count, t_count=e.t_count))
                e.in_flight += 1
                if e.device is not None:
                    if not missed:
                        self._emit("hit", model_id)
                    return e.device
            if not missed:
                self._emit("miss", model_id)
                missed = True
            try:
                dev, read = self._load(e, stamp, deadline)
            except BaseException:
                self.release(model_id)
                raise
            if read == stamp:
                return dev
            # it joined a read that began before the artifact changed (the old version, for the request
            # that began it): this request is the new version's, so it gives that back and reads again
            self.release(model_id, dev)

    def _load(self, e: _Entry, stamp: Any, deadline: float) -> Any:
        """Bring ``e`` onto the device, waiting for room until ``deadline`` (monotonic seconds), which
        counts from the request's arrival, so that requests queued behind a load that waits for room
        give up with it rather than one wait after another; a read of the artifact extends it. When
        the variant's size is known (an earlier read's: a load that failed), room is made before the
        read, so that no request reads the artifact only to find no room. Returns the delta on the
        device and the stamp of the version it is (another request's, where this one found it loaded)."""
        queued = e.loads  # the loads that ended before this request queued for one
        with e.lock:  # single flight: the first request loads, the others find it loaded
            with self._lock:
                if e.device is not None:
                    return e.device, e.stamp
                if e.loads != queued and e.error is not None:  # the load it queued behind failed: so does it
                    raise _again(e.error)
                host = e.host
                e.moving = host is not None  # the host tier keeps this copy until it is on the device
            t0 = time.perf_counter()
            tier: Tier = "host" if host is not None else "disk"
            held = 0  # device bytes reserved for e
            try:
                if host is None and e.nbytes:
                    with self._lock:
                        self._make_room(e, deadline)
                        held = e.nbytes
                if host is None:
                    t_read = time.monotonic()
                    host = self._read(e.model_id)
                    e.nbytes = int(self._size(host))
                    deadline += time.monotonic() - t_read
                if held != e.nbytes:  # nothing reserved yet (or for another size)
                    with self._lock:
                        self.device_bytes -= held
                        held = 0
                        self._make_room(e, deadline)
                        held = e.nbytes
                dev = self._to_device(host)
            except BaseException as exc:
                with self._lock:
                    self.device_bytes -= held
                    e.moving = False
                    e.loads, e.error = e.loads + 1, exc
                    self._trim_host()  # a copy that stayed, over the room the demotions took meanwhile
                    self._room.notify_all()
                self._emit("load_failed", e.model_id, time.perf_counter() - t0, tier)
                raise
            with self._lock:
                e.moving = False
                e.loads, e.error = e.loads + 1, None
                e.device, e.stamp = dev, stamp
                if e.host is not None:  # the tiers are exclusive: the host copy moved up
                    e.host = None
                    self.host_bytes -= e.nbytes
            self._emit("load", e.model_id, time.perf_counter() - t0, tier)
            return dev, stamp

    def release(self, model_id: str, delta: Any = None) -> None:
        """End one request of ``model_id`` (pair of :meth:`acquire`); ``delta``: what its acquire
        returned, which tells a retired version's request from the current one's (None: the current
        version's)."""
        with self._lock:
            e = next((r for r in self._retired if r.device is delta), None) if delta is not None else None
            if e is None:
                e = self._entries.get(model_id)
            if e is not None and e.in_flight > 0:
                e.in_flight -= 1
                if e.in_flight == 0:
                    if e in self._retired:  # its last request: the old version leaves the device
                        self._retired.remove(e)
                        self._free(e, kept=False)
                        e.device = None
                    elif e.gone and self._entries.get(model_id) is e:  # its artifact went meanwhile
                        self._drop(e)
                    self._room.notify_all()

    # ------------------------------------------------------------------ admin

    def _free(self, e: _Entry, kept: bool, event: str = "evict") -> None:
        """``e``'s device delta leaves the device (called with the lock held; ``e.device`` set);
        ``event``: what the listeners are told (``"unload"`` for :meth:`unload`)."""
        if self._free_device is not None:
            self._free_device(e.device, kept)
        self.device_bytes -= e.nbytes
        self._emit(event, e.model_id, 0.0, "device")

    def _retire(self, e: _Entry) -> None:
        """Set aside ``e``, on the device and with requests in flight, as an old version of its
        variant (its artifact changed on disk): it stays where it is, counted in the device budget,
        for those requests alone, and leaves with the last (:meth:`release`). Called with the lock
        held; a device entry has no host copy (the tiers are exclusive)."""
        del self._entries[e.model_id]
        self._retired.append(e)

    def _drop(self, e: _Entry, event: str = "evict") -> None:
        """``e`` leaves every tier and the cache (called with the lock held); ``event``: what the
        listeners are told for each tier it leaves (``"unload"`` for :meth:`unload`)."""
        if e.device is not None:
            self._free(e, kept=False, event=event)
        if e.host is not None:
            self._let_go(e.host)
            self.host_bytes -= e.nbytes
            self._emit(event, e.model_id, 0.0, "host")
        e.device = e.host = None
        self._entries.pop(e.model_id, None)
        self._room.notify_all()

    def load(self, model_id: str) -> str:
        """Bring a variant onto the device now (a hot load, no request: :meth:`acquire` with
        ``request=False`` and its release); returns the tier it came from (``"device"`` if it was there)."""
        with self._lock:
            e = self._entries.get(model_id)
            was = "device" if e is not None and e.device is not None else \
                "host" if e is not None and e.host is not None else "disk"
        self.release(model_id, self.acquire(model_id, request=False))
        return was

    def unload(self, model_id: str) -> bool:
        """Drop a variant from every tier, and what the cache knows of it (its request count: it
        leaves :meth:`snapshot`). Returns False if it was not cached. The listeners are told
        ``unload`` with the tier it left, not ``evict``: nothing made room by it.

        Raises:
            RuntimeError: if it has requests in flight.
        """
        with self._lock:
            e = self._entries.get(model_id)
            # (also while its first load runs: it would land after; and on an old version of it)
            in_flight = (e.in_flight if e is not None else 0) + self._retired_in_flight(model_id)
            if in_flight:
                raise RuntimeError(f"variant `{model_id}` has {in_flight} request{'s' * (in_flight != 1)} in flight")
            if e is None:
                return False
            cached = e.device is not None or e.host is not None
            self._drop(e, "unload")
            return cached

    def discard(self, model_id: str) -> None:
        """Drop a variant whose artifact is gone from disk from every tier: now, or, with requests in
        flight, when the last of them ends (they keep what they hold). Nothing if it is not cached."""
        with self._lock:
            e = self._entries.get(model_id)
            if e is not None:
                self._discard(e)

    def _discard(self, e: _Entry) -> None:
        """:meth:`discard` with the lock held."""
        if e.in_flight == 0:
            self._drop(e)
        else:
            e.gone = True

    def forget(self, model_id: str) -> None:
        """Drop what the cache knows of a variant it holds in no tier and with no request in flight (its
        request count too): a name whose hot load failed leaves no entry in :meth:`snapshot`."""
        with self._lock:
            e = self._entries.get(model_id)
            if e is not None and e.device is None and e.host is None and not e.in_flight:
                del self._entries[model_id]

    def tier(self, model_id: str) -> Tier:
        """Where a variant is now: device, host or disk."""
        with self._lock:
            e = self._entries.get(model_id)
            return "device" if e and e.device is not None else "host" if e and e.host is not None else "disk"

    def snapshot(self) -> dict[str, dict]:
        """Per variant: tier, bytes, requests in flight (``in_flight_old`` of them on old versions, set
        aside on the device for them), decayed request count, pinned (by name or among the top n)."""
        with self._lock:
            now = self.clock()
            pins = self.pinned | self._top_n(now)  # what is protected whatever its requests
            return {m: {"tier": "device" if e.device is not None else "host" if e.host is not None else "disk",
                        "bytes": e.nbytes, "in_flight": e.in_flight + self._retired_in_flight(m),
                        "in_flight_old": self._retired_in_flight(m),
                        "requests": round(self._count(e, now), 3), "pinned": m in pins}
                    for m, e in sorted(self._entries.items())}

    def _retired_in_flight(self, model_id: str) -> int:
        """Requests still running on the old versions of ``model_id`` (called with the lock held)."""
        return sum(r.in_flight for r in self._retired if r.model_id == model_id)
