"""The LoRA adapter pool (merge/kmerge.py) against dense references: similarity, re-factorisation,
K-Merge's running average, K-Merge++'s threshold, the byte-budget/OPCM policy with its quality gate,
and a pool that survives a restart."""
from __future__ import annotations

import math

import pytest
import torch

from deltafleet.merge.kmerge import AdapterPool, refactor, similarity

MODULES = {"q": (12, 10), "v": (8, 10)}  # name → (d_out, d_in)


def adapter(seed: int, rank: int = 2, like: dict | None = None, noise: float = 1.0) -> dict:
    """Random LoRA factors; ``like``: the same plus ``noise`` times fresh ones (a similar task)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for m, (o, i) in MODULES.items():
        a, b = torch.randn(rank, i, generator=g, dtype=torch.float64), torch.randn(o, rank, generator=g, dtype=torch.float64)
        if like is not None:
            a0, b0 = like[m]
            a, b = a0 + noise * a, b0 + noise * b
        out[m] = (a, b)
    return out


def dense(f: dict) -> dict:
    return {m: b @ a for m, (a, b) in f.items()}


def test_similarity_is_the_mean_cosine_of_the_dense_updates():
    x, y = adapter(1), adapter(2)
    dx, dy = dense(x), dense(y)
    want = sum(float((dx[m] * dy[m]).sum() / (dx[m].norm() * dy[m].norm())) for m in MODULES) / len(MODULES)
    assert similarity(x, y) == pytest.approx(want, rel=1e-10)
    assert similarity(x, x) == pytest.approx(1.0)


def test_refactor_is_the_truncated_svd_of_the_weighted_sum():
    x, y = adapter(3, rank=3), adapter(4, rank=3)
    a, b = refactor([(0.25, *x["q"]), (0.75, *y["q"])], rank=2)
    d = 0.25 * dense(x)["q"] + 0.75 * dense(y)["q"]
    u, s, vh = torch.linalg.svd(d)
    torch.testing.assert_close(b @ a, (u[:, :2] * s[:2]) @ vh[:2], rtol=1e-9, atol=1e-9)
    a6, b6 = refactor([(0.25, *x["q"]), (0.75, *y["q"])], rank=6)  # rank enough: exact
    torch.testing.assert_close(b6 @ a6, d, rtol=1e-9, atol=1e-9)
    assert a6.shape == (6, 10) and b6.shape == (12, 6)


def test_kmerge_first_k_get_slots_then_the_running_average_into_the_most_similar():
    base = adapter(10)
    ads = {"t0": base, "t1": adapter(11), "t2": adapter(12, like=base, noise=0.1), "t3": adapter(13, like=base, noise=0.2)}
    pool = AdapterPool("kmerge", rank=8, k=2)  # rank 8 ≥ 3 × 2: the merges are exact
    slots = [pool.admit(t, f) for t, f in ads.items()]
    assert slots[:2] == [0, 1] and slots[2:] == [0, 0]  # t2, t3 resemble t0
    want = {m: (dense(ads["t0"])[m] + dense(ads["t2"])[m] + dense(ads["t3"])[m]) / 3 for m in MODULES}
    got = dense(pool.slot_for("t3").factors)
    for m in MODULES:
        torch.testing.assert_close(got[m], want[m], rtol=1e-9, atol=1e-9)
    assert pool.slot_for("t1").id == 1 and pool.slots[0].n == 3 and pool.slots[0].tasks == ["t0", "t2", "t3"]
    assert [r["action"] for r in pool.log] == ["new_slot", "new_slot", "merged", "merged"]
    with pytest.raises(KeyError, match="task 'nope' was never admitted"):
        pool.slot_for("nope")


def test_kmerge_plus_plus_opens_a_slot_only_below_the_threshold():
    base = adapter(20)
    pool = AdapterPool("kmerge++", rank=8, k=3, threshold=0.5)
    assert pool.admit("a", base) == 0
    assert pool.admit("a-like", adapter(21, like=base, noise=0.1)) == 0  # similar: merged, a slot still free
    assert pool.admit("b", adapter(22)) == 1                             # dissimilar: its own slot
    assert len(pool.slots) == 2 and pool.log[1]["action"] == "merged"


def _quality_by_cosine(own: dict):
    """A stand-in metric: how much of the task's own update the served slot keeps (cosine, ≥ 0)."""
    return lambda task, f: max(similarity(f, own[task]), 0.0)


def test_budget_opcm_sizes_by_bytes_and_the_gate_evicts_the_lru_slot():
    base = adapter(30)
    own = {"a": base, "a2": adapter(31, like=base, noise=0.05), "b": adapter(32), "c": adapter(33)}
    one = AdapterPool("kmerge", rank=2, k=1).slot_bytes(own["a"])
    t = iter(range(100))
    pool = AdapterPool("budget_opcm", rank=4, byte_budget=2 * (one * 2) + 5, gate=0.9,
                       quality=_quality_by_cosine(own), clock=lambda: next(t))
    assert pool.capacity(own["a"]) == 2
    assert pool.admit("a", own["a"]) == 0
    assert pool.admit("b", own["b"]) == 1
    assert pool.admit("a2", own["a2"]) == 0 and pool.log[-1]["action"] == "merged"  # similar: the gate holds
    assert min(pool.log[-1]["gate"].values()) >= 0.9
    # c is unlike both: merging would drop quality, so the least recently used slot goes
    pool.slot_for("a")  # slot 0 used just now: slot 1 (b) is the LRU one
    sid = pool.admit("c", own["c"])
    assert pool.log[-1]["action"] == "evicted_lru_and_stored" and 1 not in pool.slots and sid == 2
    assert pool.task_to_slot["b"] in pool.slots  # b is still served, by the most similar remaining slot
    # the merged slot's update has the mean norm of its tasks' updates (OPCM's rescaling)
    s0 = pool.slots[0]
    norm = math.sqrt(sum(float(d.pow(2).sum()) for d in dense(s0.factors).values()))
    mean = sum(math.sqrt(sum(float(d.pow(2).sum()) for d in dense(own[x]).values())) for x in ("a", "a2")) / 2
    assert norm == pytest.approx(mean, rel=1e-6)


def test_with_one_slot_an_evicted_task_is_served_by_the_newcomer():
    own = {"a": adapter(50), "b": adapter(51)}
    pool = AdapterPool("budget_opcm", rank=2, byte_budget=AdapterPool("kmerge", rank=2, k=1).slot_bytes(own["a"]),
                       gate=0.99, quality=_quality_by_cosine(own))
    pool.admit("a", own["a"])
    pool.admit("b", own["b"])  # unlike a: the gate refuses the merge, the only slot is replaced
    assert pool.log[-1]["action"] == "evicted_lru_and_stored"
    assert pool.slot_for("a") is pool.slot_for("b")  # every admitted task is still served
    pool2 = AdapterPool("budget_opcm", rank=2, byte_budget=pool.byte_budget, gate=0.99,
                        quality=_quality_by_cosine(own), evicted_to="base")
    pool2.admit("a", own["a"])
    pool2.admit("b", own["b"])
    assert pool2.slot_for("a") is None and pool2.slot_for("b") is not None  # a: back to the base


def test_the_pool_survives_a_restart(tmp_path):
    ads = {f"t{i}": adapter(40 + i) for i in range(4)}
    pool = AdapterPool("kmerge", rank=4, k=2)
    for t in ("t0", "t1", "t2"):
        pool.admit(t, ads[t])
    pool.save(tmp_path / "pool")
    again = AdapterPool.load(tmp_path / "pool")
    assert again.task_to_slot == pool.task_to_slot and set(again.slots) == set(pool.slots)
    for sid, s in pool.slots.items():
        for m in MODULES:
            torch.testing.assert_close(again.slots[sid].factors[m][0], s.factors[m][0], rtol=0, atol=0)
    assert again.admit("t3", ads["t3"]) == pool.admit("t3", ads["t3"])  # continues as if never stopped
    for m in MODULES:
        torch.testing.assert_close(dense(again.slot_for("t3").factors)[m], dense(pool.slot_for("t3").factors)[m])


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="unknown policy 'lru'"):
        AdapterPool("lru", k=2)
    with pytest.raises(ValueError, match="kmerge needs k ≥ 1 slots, got None"):
        AdapterPool("kmerge")
    with pytest.raises(ValueError, match="budget_opcm needs byte_budget and a quality function"):
        AdapterPool("budget_opcm", byte_budget=10)
    pool = AdapterPool("budget_opcm", rank=2, byte_budget=10, quality=lambda t, f: 1.0)
    with pytest.raises(ValueError, match=r"the byte budget \(10 bytes\) is smaller than one slot"):
        pool.admit("a", adapter(1))
