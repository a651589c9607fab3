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
    # b's slot went; the one remaining (a's) would keep none of b's quality: the gate sends b to the base
    assert pool.task_to_slot["b"] is None and pool.log[-1]["evicted"]["b"]["slot"] is None
    # the merged slot's update has the mean norm of its tasks' updates (OPCM's rescaling)
    s0 = pool.slots[0]
    norm = math.sqrt(sum(float(d.pow(2).sum()) for d in dense(s0.factors).values()))
    mean = sum(math.sqrt(sum(float(d.pow(2).sum()) for d in dense(own[x]).values())) for x in ("a", "a2")) / 2
    assert norm == pytest.approx(mean, rel=1e-6)


def test_with_one_slot_an_evicted_task_is_served_by_the_newcomer_where_the_gate_holds():
    own = {"a": adapter(50), "b": adapter(51)}
    one = AdapterPool("kmerge", rank=2, k=1).slot_bytes(own["a"])

    def quality(task, f):  # a is served as well by b's adapter as by its own; the merge serves neither
        return float(max(similarity(f, own[t]) for t in ({"a", "b"} if task == "a" else {"b"})) > 0.999)

    for q, a_served in ((quality, True), (_quality_by_cosine(own), False)):
        pool = AdapterPool("budget_opcm", rank=2, byte_budget=one, gate=0.99, quality=q)
        pool.admit("a", own["a"])
        pool.admit("b", own["b"])  # the gate refuses the merge, the only slot is replaced
        assert pool.log[-1]["action"] == "evicted_lru_and_stored"
        assert (pool.slot_for("a") is pool.slot_for("b")) is a_served  # else a goes back to the base
        assert pool.slots[pool.task_to_slot["b"]].tasks == (["b", "a"] if a_served else ["b"])
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
    with pytest.raises(ValueError, match=r"kmerge needs k ≥ 1 slots \(an integer\), got None"):
        AdapterPool("kmerge")
    with pytest.raises(ValueError, match="budget_opcm needs byte_budget and a quality function"):
        AdapterPool("budget_opcm", byte_budget=10)
    pool = AdapterPool("budget_opcm", rank=2, byte_budget=10, quality=lambda t, f: 1.0)
    with pytest.raises(ValueError, match=r"the byte budget \(10 bytes\) is smaller than one slot"):
        pool.admit("a", adapter(1))


# ------------------------------------------------------------------ mutation sweep
def test_similarity_needs_a_shared_module_and_a_zero_update_counts_as_cosine_0():
    """A module whose ΔW is 0 has no direction: it adds a cosine of 0 to the mean (x against itself
    with one of two modules zeroed: (1 + 0) / 2); adapters without a common module are refused."""
    x = adapter(60)
    zeroed = {"q": x["q"], "v": (x["v"][0], torch.zeros_like(x["v"][1]))}
    assert similarity(x, zeroed) == pytest.approx(0.5, rel=1e-12)
    with pytest.raises(ValueError, match="the adapters share no module"):
        similarity({"q": x["q"]}, {"v": x["v"]})


def test_every_slot_has_the_pool_rank_and_remembers_the_adapters_own_norm():
    """A rank-2 adapter in a rank-8 pool is zero-padded to 8 (every slot the same size); in a rank-1
    budget_opcm pool it is truncated, but the norm kept for OPCM's rescaling is its own ‖B·A‖_F."""
    x = adapter(61)
    pool = AdapterPool("kmerge", rank=8, k=2)
    slot = pool.slots[pool.admit("x", x)]
    for m, (o, i) in MODULES.items():
        a, b = slot.factors[m]
        assert a.shape == (8, i) and b.shape == (o, 8)
        torch.testing.assert_close(b @ a, dense(x)[m], rtol=1e-9, atol=1e-9)
    pool = AdapterPool("budget_opcm", rank=1, byte_budget=10**6, quality=lambda t, f: 1.0)
    slot = pool.slots[pool.admit("x", x)]
    want = math.sqrt(sum(float(d.pow(2).sum()) for d in dense(x).values()))
    assert slot.tau_norms == [pytest.approx(want, rel=1e-9)]


def test_an_opcm_merge_keeps_the_pool_rank_where_a_module_is_narrower_than_it():
    """Found by a reviewer: OPCM's re-factorisation kept min(rank, d_out, d_in) singular directions, so a
    merged budget_opcm slot of a 4 × 6 module in a rank-8 pool held rank-4 factors where every other slot
    (a new one, a K-Merge average) is zero-padded to 8. Both its factors and its unscaled sum are now."""
    g = torch.Generator().manual_seed(90)
    a = {"m": (torch.randn(2, 6, generator=g, dtype=torch.float64), torch.randn(4, 2, generator=g, dtype=torch.float64))}
    b = {"m": (a["m"][0] + 0.01 * torch.randn(2, 6, generator=g, dtype=torch.float64), a["m"][1])}
    pool = AdapterPool("budget_opcm", rank=8, byte_budget=AdapterPool("kmerge", rank=8, k=1).slot_bytes(a), gate=0.5,
                       quality=lambda t, f: 1.0)
    pool.admit("a", a)
    assert pool.admit("b", b) == 0 and pool.log[-1]["action"] == "merged"
    slot = pool.slots[0]
    for fa, fb in (slot.factors["m"], slot.raw["m"]):
        assert fa.shape == (8, 6) and fb.shape == (4, 8)
        assert not fa[4:].any() and not fb[:, 4:].any()  # the padding is zeros: ΔW is unchanged
    d = slot.raw["m"][1] @ slot.raw["m"][0]
    assert torch.linalg.matrix_rank(d) <= 4 and d.abs().max() > 0


def test_the_gate_needs_every_task_of_the_slot_to_keep_its_quality():
    """A newcomer ten times larger than the slot's task dominates the merge: it keeps its own
    quality, the old task does not; one task below the gate is enough to refuse the merge."""
    own = {"a": adapter(62), "big": {m: (10 * a, b) for m, (a, b) in adapter(63).items()}}
    quality = _quality_by_cosine(own)
    pool = AdapterPool("budget_opcm", rank=2, byte_budget=AdapterPool("kmerge", rank=2, k=1).slot_bytes(own["a"]),
                       gate=0.9, quality=quality)
    pool.admit("a", own["a"])
    pool.admit("big", own["big"])
    gate = pool.log[-1]["gate"]
    assert gate["big"] >= 0.9 > gate["a"]
    assert pool.log[-1]["action"] == "evicted_lru_and_stored"


def test_the_gate_reads_a_negative_own_quality_as_a_loss_to_keep_small():
    """Found by a reviewer: with an own quality below 0 (a validation gain below the base's) the gate
    divided, so a merge 50 times worse kept "50.0" of it and passed."""
    from deltafleet.merge.kmerge import kept_share

    assert kept_share(0.8, 1.0) == pytest.approx(0.8) and kept_share(-0.5, -0.01) == pytest.approx(-48.0)
    assert kept_share(-0.0105, -0.01) == pytest.approx(0.95) and kept_share(0.0, 0.0) == 1.0
    assert kept_share(-1e-9, 0.0) == 0.0
    own = {"a": adapter(62), "b": adapter(63)}
    for merged_q, action in ((-0.5, "evicted_lru_and_stored"), (-0.0105, "merged")):
        quality = lambda t, f, q=merged_q: -0.01 if f is own[t] else q  # noqa: E731
        pool = AdapterPool("budget_opcm", rank=2, byte_budget=AdapterPool("kmerge", rank=2, k=1).slot_bytes(own["a"]),
                           gate=0.9, quality=quality)
        pool.admit("a", own["a"])
        pool.admit("b", own["b"])
        assert pool.log[-1]["action"] == action, pool.log[-1]


def _clocked_budget_pool(own: dict, n_slots: int):
    t = iter(range(100))
    one = AdapterPool("kmerge", rank=2, k=1).slot_bytes(next(iter(own.values())))
    return AdapterPool("budget_opcm", rank=2, byte_budget=n_slots * one, gate=0.9,
                       quality=_quality_by_cosine(own), clock=lambda: next(t))


def test_serving_and_merging_both_count_as_use_for_lru():
    """LRU by the clock: a slot just served (slot_for) or just merged into is not the one evicted."""
    own = {"a": adapter(64), "b": adapter(65), "c": adapter(66)}
    pool = _clocked_budget_pool(own, 2)
    pool.admit("a", own["a"])  # t=0
    pool.admit("b", own["b"])  # t=1
    pool.slot_for("a")         # t=2: now b's slot is the least recently used
    pool.admit("c", own["c"])
    assert pool.log[-1]["action"] == "evicted_lru_and_stored" and set(pool.slots) == {0, 2}
    own = {"a": adapter(67), "b": adapter(68), "c": adapter(69)}
    own["a2"] = adapter(70, like=own["a"], noise=0.05)
    pool = _clocked_budget_pool(own, 2)
    pool.admit("a", own["a"])    # t=0
    pool.admit("b", own["b"])    # t=1
    pool.admit("a2", own["a2"])  # merged into slot 0 at t=2
    assert pool.log[-1]["action"] == "merged"
    pool.admit("c", own["c"])
    assert pool.log[-1]["action"] == "evicted_lru_and_stored" and set(pool.slots) == {0, 2}


def test_an_evicted_slots_tasks_go_to_the_most_similar_remaining_slot():
    """Three slots (a, a-like, b); a's slot is the LRU one and is evicted: a is then served by the
    slot of a-like, the one most similar to it, not by b's."""
    own = {"a": adapter(71), "b": adapter(72), "d": adapter(73)}
    own["a-like"] = adapter(74, like=own["a"], noise=0.1)
    pool = _clocked_budget_pool(own, 3)
    for t in ("a", "a-like", "b"):
        pool.admit(t, own[t])
    assert len(pool.slots) == 3  # a free slot opens whatever the similarity
    pool.slot_for("a-like")
    pool.slot_for("b")
    pool.admit("d", own["d"])
    assert pool.log[-1]["action"] == "evicted_lru_and_stored" and 0 not in pool.slots
    assert pool.task_to_slot["a"] == pool.task_to_slot["a-like"] == 1


def test_an_evicted_task_passes_the_gate_of_the_slot_that_takes_it_in():
    """Found by a reviewer: the tasks of an evicted slot went to the most similar remaining slot without
    the quality gate every merge passes, and that slot's later merges did not check them either: a
    task could be served by a slot that keeps none of its quality (kmerge-eval: S < 0 below 4 slots).
    Now each goes to that slot only where it keeps ``gate`` of its own quality there, else to the base,
    and joins the slot's tasks, which every later merge into the slot must keep."""
    own = {"a": adapter(71), "b": adapter(72), "c": adapter(73)}
    pool = _clocked_budget_pool(own, 2)
    pool.admit("a", own["a"])
    pool.admit("b", own["b"])
    pool.admit("c", own["c"])  # unlike both: a's slot (the LRU one) goes; b's keeps none of a's quality
    assert pool.log[-1]["action"] == "evicted_lru_and_stored"
    assert pool.task_to_slot["a"] is None and pool.slot_for("a") is None
    assert pool.log[-1]["evicted"]["a"]["slot"] is None and pool.log[-1]["evicted"]["a"]["kept"] < 0.9
    assert pool.slots[1].tasks == ["b"]

    own = {"a": adapter(71), "b": adapter(72), "d": adapter(73)}
    own["a-like"] = adapter(74, like=own["a"], noise=0.1)
    own["a-like2"] = adapter(75, like=own["a-like"], noise=0.05)
    pool = _clocked_budget_pool(own, 3)
    for t in ("a", "a-like", "b"):
        pool.admit(t, own[t])
    pool.slot_for("a-like")
    pool.slot_for("b")
    pool.admit("d", own["d"])  # evicts a's slot: a-like's keeps most of a's quality and takes a in
    assert pool.log[-1]["evicted"]["a"]["slot"] == 1 and pool.log[-1]["evicted"]["a"]["kept"] >= 0.9
    assert pool.slots[1].tasks == ["a-like", "a"] and pool.slots[1].own_quality["a"] == pytest.approx(1.0)
    pool.admit("a-like2", own["a-like2"])  # merged into slot 1: the gate checks a too
    assert pool.log[-1]["slot"] == 1 and set(pool.log[-1]["gate"]) == {"a-like", "a", "a-like2"}


def test_the_eviction_rule_survives_a_restart_and_stale_slot_files_go(tmp_path):
    """evicted_to comes back from pool.json; saving a pool over a folder that holds slot files of
    slots it does not have (here: an earlier, larger pool) removes them."""
    big = AdapterPool("kmerge", rank=2, k=3)
    for i in range(3):
        big.admit(f"t{i}", adapter(81 + i))
    big.save(tmp_path)
    small = AdapterPool("kmerge", rank=2, k=1, evicted_to="base")
    small.admit("t0", adapter(81))
    small.save(tmp_path)
    import json

    slot0 = json.loads((tmp_path / "pool.json").read_text())["slots"]["0"]["file"]
    assert slot0.startswith("slot-0.") and sorted(p.name for p in tmp_path.iterdir()) == ["pool.json", slot0]
    assert AdapterPool.load(tmp_path).evicted_to == "base"


def test_a_budget_pool_survives_a_restart_with_its_unscaled_sums(tmp_path):
    """budget_opcm keeps OPCM's unscaled sum R per slot; it comes back from disk. (A slot's factors
    shared tensors with its raw sum, which safetensors refused to save: no budget pool could be.)"""
    own = {"a": adapter(75), "b": adapter(76)}
    own["a2"] = adapter(78, like=own["a"], noise=0.05)
    pool = _clocked_budget_pool(own, 2)
    for t in ("a", "b", "a2"):
        pool.admit(t, own[t])
    pool.save(tmp_path / "pool")
    again = AdapterPool.load(tmp_path / "pool", quality=_quality_by_cosine(own))
    for sid in (0, 1):
        for m in MODULES:
            for i in (0, 1):
                torch.testing.assert_close(again.slots[sid].raw[m][i], pool.slots[sid].raw[m][i], rtol=0, atol=0)


def test_a_failed_save_leaves_the_previous_pool_json(tmp_path, monkeypatch):
    """pool.json is written to a temporary file and renamed: a write that dies half-way leaves the
    previous pool loadable."""
    from pathlib import Path

    pool = AdapterPool("kmerge", rank=4, k=2)
    pool.admit("t0", adapter(79))
    pool.save(tmp_path)
    pool.admit("t1", adapter(80))

    def half_written(self, text, *a, **kw):
        with open(self, "w") as f:
            f.write(text[: len(text) // 2])
        raise OSError("disk full")

    monkeypatch.setattr(Path, "write_text", half_written)
    with pytest.raises(OSError, match="disk full"):
        pool.save(tmp_path)
    monkeypatch.undo()
    assert list(AdapterPool.load(tmp_path).task_to_slot) == ["t0"]


@pytest.mark.parametrize("kwargs, match", [
    (dict(policy="kmerge", k=0), r"kmerge needs k ≥ 1 slots \(an integer\), got 0"),
    (dict(policy="kmerge", k=2, rank=0), "rank must be an integer ≥ 1, got 0"),
    (dict(policy="kmerge", k=2, evicted_to="void"), "evicted_to must be 'similar' or 'base', got 'void'"),
    # found by a fresh user: accepted, or a TypeError from a comparison or at the first admit
    (dict(policy="kmerge", k=2.5), r"kmerge needs k ≥ 1 slots \(an integer\), got 2.5"),
    (dict(policy="kmerge", k="2"), r"kmerge needs k ≥ 1 slots \(an integer\), got '2'"),
    (dict(policy="kmerge", k=2, rank=True), "rank must be an integer ≥ 1, got True"),
    (dict(policy="kmerge", k=2, rank=2.5), "rank must be an integer ≥ 1, got 2.5"),
    (dict(policy="kmerge", k=2, rank="8"), "rank must be an integer ≥ 1, got '8'"),
    (dict(policy="budget_opcm", byte_budget=-5, quality=lambda t, f: 1.0),
     "byte_budget must be a positive number of bytes, got -5"),
])
def test_more_bad_settings_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdapterPool(kwargs.pop("policy"), **kwargs)


def test_the_pool_refuses_what_it_cannot_hold_and_names_it():
    """Found by a fresh user: a NaN adapter raised numpy's LinAlgError from the SVD, a width mismatch
    "mat1 and mat2 shapes cannot be multiplied", a missing module a bare KeyError, a task admitted twice
    took a second slot (the first still listing it), and K-Merge++ took threshold=nan. Each is refused,
    naming the task and the module, and leaves the pool as it was."""
    pool = AdapterPool("kmerge", k=3, rank=2)
    pool.admit("a", adapter(1))
    bad_nan = adapter(2)
    bad_nan["v"][0][0, 0] = float("nan")
    wide = adapter(3)
    wide["q"] = (torch.randn(2, 11, dtype=torch.float64), wide["q"][1])
    cases = [("a", adapter(4), r"task 'a' is already in the pool \(slot 0\)"),
             ("n", bad_nan, r"adapter 'n', module 'v': the factors hold NaN or inf"),
             ("w", wide, r"adapter 'w', module 'q': ΔW is 12 × 11, the pool's is 12 × 10"),
             ("m", {"q": adapter(5)["q"]}, r"adapter 'm' has other modules than the pool's: missing \['v'\], extra \[\]"),
             ("r", {**adapter(6), "v": (torch.randn(3, 10), torch.randn(8, 2))},
              r"adapter 'r', module 'v': expected LoRA factors \(A \[r, d_in\], B \[d_out, r\]\) of floating "
              r"tensors, got \(\[3, 10\] torch.float32, \[8, 2\] torch.float32\)")]
    for task, factors, message in cases:
        with pytest.raises(ValueError, match=message):
            pool.admit(task, factors)
    assert pool.task_to_slot == {"a": 0} and [s.tasks for s in pool.slots.values()] == [["a"]] and len(pool.log) == 1
    with pytest.raises(ValueError, match=r"threshold must be a number in \[-1, 1\] \(a cosine\), got nan"):
        AdapterPool("kmerge++", k=2, threshold=float("nan"))


def test_a_loaded_budget_pool_without_quality_and_foreign_files_beside_a_pool(tmp_path):
    """Found by a fresh user: a budget_opcm pool loaded without its quality function failed at the
    next admit with "'NoneType' object is not callable", and saving beside a file named like a slot
    (slot-backup.safetensors) raised a ValueError after pool.json was replaced. Now the admit names
    what is missing, the foreign file stays, and a task is a non-empty string (123 came back "123")."""
    own = {"a": adapter(81), "b": adapter(82)}
    pool = _clocked_budget_pool(own, 2)
    pool.admit("a", own["a"])
    (tmp_path / "slot-backup.safetensors").write_bytes(b"mine")
    pool.save(tmp_path)
    assert (tmp_path / "slot-backup.safetensors").read_bytes() == b"mine"
    again = AdapterPool.load(tmp_path)
    with pytest.raises(ValueError, match=r"no quality function .*AdapterPool.load\(folder, quality=...\)"):
        again.admit("b", own["b"])
    assert list(again.task_to_slot) == ["a"]
    for bad in (123, ""):
        with pytest.raises(ValueError, match="a task is named by a non-empty string"):
            AdapterPool("kmerge", rank=2, k=2).admit(bad, adapter(83))


def test_lru_order_survives_a_restart_whose_clock_starts_again(tmp_path):
    """time.monotonic's reference point is undefined across processes (it restarts at boot): a pool
    saved late in one process and loaded early in the next must still treat a slot served after the
    restart as more recent than one untouched since before it."""
    own = {"a": adapter(91), "b": adapter(92), "c": adapter(93)}
    one = AdapterPool("kmerge", rank=2, k=1).slot_bytes(own["a"])
    before = iter(range(1000, 1100))
    pool = AdapterPool("budget_opcm", rank=2, byte_budget=2 * one, gate=0.9, quality=_quality_by_cosine(own),
                       clock=lambda: next(before))
    pool.admit("a", own["a"])  # t=1000
    pool.admit("b", own["b"])  # t=1001
    pool.save(tmp_path)
    after = iter(range(100))
    again = AdapterPool.load(tmp_path, quality=_quality_by_cosine(own), clock=lambda: next(after))
    again.slot_for("a")  # a's slot is used now: b's is the least recently used
    again.admit("c", own["c"])
    assert again.log[-1]["action"] == "evicted_lru_and_stored" and set(again.slots) == {0, 2}


def test_a_failed_save_leaves_the_previous_slots_with_the_previous_pool_json(tmp_path, monkeypatch):
    """A merge changes a slot's factors: a save that fails before pool.json is replaced must not leave
    the new factors under the old pool.json (a slot averaging t0 and t1, loaded as t0's alone, n = 1)."""
    from pathlib import Path

    pool = AdapterPool("kmerge", rank=4, k=1)
    pool.admit("t0", adapter(84))
    pool.save(tmp_path)
    saved = dense(AdapterPool.load(tmp_path).slots[0].factors)
    pool.admit("t1", adapter(85))  # merged into slot 0

    def fails(self, *a, **kw):
        raise OSError("disk full")

    monkeypatch.setattr(Path, "write_text", fails)
    with pytest.raises(OSError, match="disk full"):
        pool.save(tmp_path)
    monkeypatch.undo()
    again = AdapterPool.load(tmp_path)
    assert again.task_to_slot == {"t0": 0} and again.slots[0].n == 1
    for m in MODULES:
        torch.testing.assert_close(dense(again.slots[0].factors)[m], saved[m], rtol=0, atol=0)
    pool.save(tmp_path)  # the next save replaces it, and the files of the failed one go
    import json

    meta = json.loads((tmp_path / "pool.json").read_text())["slots"]["0"]
    assert meta["n"] == 2 and sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("slot-")) == [meta["file"]]
