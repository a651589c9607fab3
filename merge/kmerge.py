"""A fixed-size pool of LoRA adapters that arrive online (K-Merge, arXiv:2510.13537), for devices
that can store only a few adapters.

An adapter is a set of modules, each a LoRA pair ``(A [r, d_in], B [d_out, r])`` with
``ΔW = B·A`` (the LoRA scaling folded into ``B``). The pool keeps at most ``K`` slots, each a LoRA of
the same rank ``r`` standing for one or more tasks, and a task → slot map, so a request for any
adapter ever admitted is served by the slot that holds it. Policies:

* ``kmerge`` — the paper's K-Merge: the first K adapters get a slot each; every later one is merged
  into the most similar slot. Similarity = mean over modules of the cosine of ``ΔW``. The merge is
  the history-aware running average ``ΔW_s ← (n_s·ΔW_s + ΔW_new)/(n_s + 1)``, taken exactly on
  ``ΔW`` and re-factorised to rank r by truncated SVD, so storage stays fixed.
* ``kmerge++`` — K-Merge++: a new slot opens only when the newcomer's similarity to every stored
  slot is below ``threshold`` (and a slot is free); otherwise it merges as above.
* ``budget_opcm`` — this project's policy: the number of slots comes from a byte budget; the merge
  operator is OPCM (merge/methods.py: the newcomer's ``ΔW`` projected out of the slot's dominant
  singular directions, added, rescaled to the mean norm of the slot's tasks' ``ΔW``); a quality
  gate keeps a merge only if every task of the slot keeps ``gate`` of its own adapter's quality
  (:func:`kept_share`: it loses at most ``1 − gate`` of that quality's size, also where it is < 0),
  else the least-recently-used slot is evicted and the newcomer is stored alone. The evicted slot's
  tasks pass the same gate: each is served by the most similar remaining slot (the newcomer's, where
  none remains) only if it keeps ``gate`` of its own quality there, and by the base otherwise. A slot's
  tasks are every task it serves, so a later merge into it is gated on the tasks it took in too.

The pool persists to a folder (``pool.json`` + one safetensors file per slot that it names, each
written to a temporary file and renamed) and is restored by :meth:`AdapterPool.load`.
"""
from __future__ import annotations

import json
import math
import os
import re
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from deltafleet.merge.methods import opcm_project

Policy = Literal["kmerge", "kmerge++", "budget_opcm"]
_SLOT_FILE = re.compile(r"slot-\d+(\.[0-9a-f]+)?\.safetensors")  # a slot's file: slot-<id>[.<version>].safetensors
Factors = dict[str, tuple[Tensor, Tensor]]  # module → (A [r, d_in], B [d_out, r])


def lora_inner(x: Factors, y: Factors, module: str) -> float:
    """``⟨B_x A_x, B_y A_y⟩_F = tr((B_xᵀ B_y)(A_y A_xᵀ))``, without forming either ``ΔW``."""
    ax, bx = x[module]
    ay, by = y[module]
    return float(torch.trace((bx.T.double() @ by.double()) @ (ay.double() @ ax.T.double())))


def similarity(x: Factors, y: Factors) -> float:
    """Mean over the modules both hold of the cosine of their ``ΔW`` (K-Merge's similarity)."""
    mods = sorted(set(x) & set(y))
    if not mods:
        raise ValueError("the adapters share no module")
    cos = []
    for m in mods:
        nx, ny = math.sqrt(max(lora_inner(x, x, m), 0.0)), math.sqrt(max(lora_inner(y, y, m), 0.0))
        cos.append(lora_inner(x, y, m) / (nx * ny) if nx > 0 and ny > 0 else 0.0)
    return sum(cos) / len(cos)


def refactor(parts: list[tuple[float, Tensor, Tensor]], rank: int) -> tuple[Tensor, Tensor]:
    """The best rank-``rank`` factors ``(A, B)`` of ``Σ w_j B_j A_j`` (truncated SVD, Eckart–Young),
    computed in the span of the factors: QR of ``[w_j B_j]`` and of ``[A_jᵀ]``, SVD of the small core."""
    bs = torch.cat([w * b.double() for w, _, b in parts], 1)      # [d_out, Σr]
    at = torch.cat([a.double().T for _, a, _ in parts], 1)        # [d_in, Σr]
    qb, rb = torch.linalg.qr(bs)
    qa, ra = torch.linalg.qr(at)
    u, s, vh = torch.linalg.svd(rb @ ra.T)
    k = min(rank, s.numel())
    root = s[:k].sqrt()
    a, b = _pad(root[:, None] * (vh[:k] @ qa.T), (qb @ u[:, :k]) * root, rank)
    dtype = parts[0][1].dtype
    return a.to(dtype), b.to(dtype)


def svd_factors(d: Tensor, rank: int) -> tuple[Tensor, Tensor]:
    """The best rank-``rank`` factors ``(A [rank, d_in], B [d_out, rank])`` of a dense ``d [d_out, d_in]``
    (truncated SVD, the singular values split evenly: ``A = √s·Vᵀ``, ``B = U·√s``), in ``d``'s dtype;
    zero-padded to ``rank`` where ``min(d_out, d_in) < rank``, as :func:`refactor` pads."""
    u, s, vh = torch.linalg.svd(d, full_matrices=False)
    k = min(rank, s.numel())
    root = s[:k].sqrt()
    return _pad(root[:, None] * vh[:k], u[:, :k] * root, rank)


def _pad(a: Tensor, b: Tensor, rank: int) -> tuple[Tensor, Tensor]:
    """``(A, B)`` of rank ``k ≤ rank`` zero-padded to ``rank`` (A's rows, B's columns): every slot keeps
    the same size, whatever the rank its update has."""
    k = a.shape[0]
    if k < rank:
        b = torch.cat([b, b.new_zeros(b.shape[0], rank - k)], 1)
        a = torch.cat([a, a.new_zeros(rank - k, a.shape[1])], 0)
    return a, b


@dataclass
class Slot:
    id: int
    factors: Factors
    tasks: list[str]                     # every task it serves: merged into it, or taken in at an eviction
    n: int = 1                           # adapters merged into it (the running average's count)
    last_used: float = 0.0
    own_quality: dict[str, float] = field(default_factory=dict)  # task → its own adapter's quality
    raw: Factors | None = None           # budget_opcm: the unscaled sum (OPCM's R), kept factorised
    tau_norms: list[float] = field(default_factory=list)  # budget_opcm: ‖ΔW‖ of each merged adapter


def _shapes(pair) -> str:
    """What ``pair`` is, for an error message: its tensors' shapes and dtypes, else its type."""
    if isinstance(pair, (tuple, list)):
        return "(" + ", ".join(f"{list(t.shape)} {t.dtype}" if isinstance(t, Tensor) else type(t).__name__
                               for t in pair) + ")"
    return type(pair).__name__


def kept_share(merged: float, own: float) -> float:
    """How much of its own adapter's quality ``own`` a task keeps at ``merged``: ``1 + (merged − own) /
    |own|``, which is ``merged / own`` where ``own > 0`` and stays a loss where ``own < 0`` (a gain
    below the base's: then ``merged / own`` would rank a worse merge higher); at ``own == 0``, 1 for
    ``merged >= 0``, else 0."""
    if own == 0:
        return 1.0 if merged >= 0 else 0.0
    return 1.0 + (merged - own) / abs(own)


class AdapterPool:
    """The pool (see the module docstring).

    Args:
        policy: ``"kmerge"``, ``"kmerge++"`` or ``"budget_opcm"``.
        rank: the rank of every slot.
        k: the number of slots (``kmerge``, ``kmerge++``).
        byte_budget: bytes for all slots (``budget_opcm``); the slot count is what fits.
        threshold: K-Merge++'s similarity below which a newcomer opens a slot.
        gate: ``budget_opcm``'s quality gate, a fraction of each task's own-adapter quality.
        alpha: OPCM's share of singular values kept out of the projection.
        quality: ``quality(task, factors) -> float`` (higher is better), needed by ``budget_opcm``.
        evicted_to: where the tasks of an evicted slot go: ``"similar"`` (the most similar remaining
            slot, where it passes the quality gate for the task, else the base) or ``"base"`` (no
            adapter: :meth:`slot_for` returns None for them).
        clock: seconds, for least-recently-used (tests pass a counter).
    """

    def __init__(self, policy: Policy = "kmerge", *, rank: int = 8, k: int | None = None,
                 byte_budget: int | None = None, threshold: float = 0.3, gate: float = 0.9, alpha: float = 0.5,
                 quality: Callable[[str, Factors], float] | None = None, evicted_to: str = "similar",
                 clock: Callable[[], float] = time.monotonic):
        if policy not in ("kmerge", "kmerge++", "budget_opcm"):
            raise ValueError(f"unknown policy {policy!r}; known: kmerge, kmerge++, budget_opcm")
        def whole(v) -> bool:  # a positive int, not a bool or a float
            return isinstance(v, int) and not isinstance(v, bool) and v >= 1

        if policy == "budget_opcm":
            if byte_budget is None or quality is None:
                raise ValueError("budget_opcm needs byte_budget and a quality function")
            if not whole(byte_budget):
                raise ValueError(f"byte_budget must be a positive number of bytes, got {byte_budget!r}")
        elif not whole(k):
            raise ValueError(f"{policy} needs k ≥ 1 slots (an integer), got {k!r}")
        if not whole(rank):
            raise ValueError(f"rank must be an integer ≥ 1, got {rank!r}")
        if evicted_to not in ("similar", "base"):
            raise ValueError(f"evicted_to must be 'similar' or 'base', got {evicted_to!r}")
        for name, value, ok, what in (("threshold", threshold, lambda v: -1 <= v <= 1, "in [-1, 1] (a cosine)"),
                                      ("gate", gate, lambda v: 0 < v <= 1, "in (0, 1]"),
                                      ("alpha", alpha, lambda v: 0 < v < 1, "in (0, 1)")):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):  # NaN fails each
                raise ValueError(f"{name} must be a number {what}, got {value!r}")
        self.evicted_to = evicted_to
        self.policy, self.rank, self.k, self.byte_budget = policy, rank, k, byte_budget
        self.threshold, self.gate, self.alpha, self.quality, self.clock = threshold, gate, alpha, quality, clock
        self.slots: dict[int, Slot] = {}
        self.task_to_slot: dict[str, int] = {}
        self._next_id = 0
        self.log: list[dict] = []  # one record per admission: what the pool did and why

    # ------------------------------------------------------------------ sizes

    def slot_bytes(self, factors: Factors) -> int:
        return sum(a.shape[1] * self.rank * a.element_size() + b.shape[0] * self.rank * b.element_size()
                   for a, b in factors.values())

    def capacity(self, factors: Factors) -> int:
        if self.policy != "budget_opcm":
            return self.k
        cap = self.byte_budget // self.slot_bytes(factors)
        if cap < 1:
            raise ValueError(f"the byte budget ({self.byte_budget} bytes) is smaller than one slot "
                             f"({self.slot_bytes(factors)} bytes)")
        return int(cap)

    # ------------------------------------------------------------------ admission

    def _new_slot(self, task: str, factors: Factors, own_q: float | None) -> Slot:
        f = {m: refactor([(1.0, a, b)], self.rank) for m, (a, b) in factors.items()}
        s = Slot(self._next_id, f, [task], 1, self.clock())
        if own_q is not None:
            s.own_quality[task] = own_q
        if self.policy == "budget_opcm":
            s.raw = f
            s.tau_norms = [self._norm(factors)]
        self._next_id += 1
        self.slots[s.id] = s
        self.task_to_slot[task] = s.id
        return s

    @staticmethod
    def _norm(f: Factors) -> float:
        return math.sqrt(sum(max(lora_inner(f, f, m), 0.0) for m in f))

    def _running_average(self, slot: Slot, factors: Factors) -> Factors:
        n = slot.n
        return {m: refactor([(n / (n + 1), a, b), (1 / (n + 1), *factors[m])], self.rank)
                for m, (a, b) in slot.factors.items()}

    def _opcm(self, slot: Slot, factors: Factors) -> tuple[Factors, Factors, list[float]]:
        """OPCM on ΔW per module: R ← R + proj(ΔW_new) (dense), then the slot = R rescaled so that
        its norm is the mean of its tasks' ``‖ΔW‖``; both re-factorised to rank r (:func:`svd_factors`:
        zero-padded to r, as every slot is, where ``ΔW`` has a side shorter than r)."""
        raw = {}
        for m, (a, b) in slot.raw.items():
            r_dense = (b.double() @ a.double())
            new = factors[m][1].double() @ factors[m][0].double()
            r_dense = r_dense + opcm_project(r_dense, new, self.alpha)
            ra, rb = svd_factors(r_dense, self.rank)
            raw[m] = (ra.to(a.dtype), rb.to(b.dtype))
        norms = slot.tau_norms + [self._norm(factors)]
        scale = (sum(norms) / len(norms)) / max(self._norm(raw), 1e-30)
        merged = {m: (a, (b.double() * scale).to(b.dtype)) for m, (a, b) in raw.items()}
        return merged, raw, norms

    def _check(self, task: str, factors: Factors) -> None:
        """Refuse, naming the task and the module, an adapter that is not LoRA factors this pool can
        hold: each module a pair ``(A [r, d_in], B [d_out, r])`` of finite floating tensors, and the
        same modules and shapes as the pool's slots (adapters of one base and one target list)."""
        if task in self.task_to_slot:
            raise ValueError(f"task {task!r} is already in the pool (slot {self.task_to_slot[task]}): its "
                             "adapter is merged there and cannot be taken out; admit the new one under another name")
        if not factors:
            raise ValueError(f"adapter {task!r} has no modules")
        for m, pair in factors.items():
            a, b = pair if isinstance(pair, (tuple, list)) and len(pair) == 2 else (None, None)
            if not (isinstance(a, Tensor) and isinstance(b, Tensor) and a.dim() == b.dim() == 2
                    and a.is_floating_point() and b.is_floating_point() and a.shape[0] == b.shape[1] >= 1):
                raise ValueError(f"adapter {task!r}, module {m!r}: expected LoRA factors (A [r, d_in], "
                                 f"B [d_out, r]) of floating tensors, got {_shapes(pair)}")
            if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
                raise ValueError(f"adapter {task!r}, module {m!r}: the factors hold NaN or inf")
        if self.slots:
            ref = next(iter(self.slots.values())).factors
            if set(factors) != set(ref):
                missing, extra = sorted(set(ref) - set(factors)), sorted(set(factors) - set(ref))
                raise ValueError(f"adapter {task!r} has other modules than the pool's: "
                                 f"missing {missing}, extra {extra}")
            for m, (a, b) in factors.items():
                want = (ref[m][1].shape[0], ref[m][0].shape[1])
                if (b.shape[0], a.shape[1]) != want:
                    raise ValueError(f"adapter {task!r}, module {m!r}: ΔW is {b.shape[0]} × {a.shape[1]}, the "
                                     f"pool's is {want[0]} × {want[1]}")

    def admit(self, task: str, factors: Factors) -> int:
        """Store or merge the adapter of ``task``; return its slot id.

        Raises:
            ValueError: a task already in the pool, or factors it cannot hold (:meth:`_check`).
        """
        if not isinstance(task, str) or not task:
            raise ValueError(f"a task is named by a non-empty string, got {task!r}")
        if self.policy == "budget_opcm" and self.quality is None:
            raise ValueError("this budget_opcm pool has no quality function to gate its merges: load it with "
                             "AdapterPool.load(folder, quality=...)")
        self._check(task, factors)
        rec: dict = {"task": task, "policy": self.policy}
        own_q = self.quality(task, factors) if self.quality is not None else None
        cap = self.capacity(factors)
        sims = {sid: similarity(factors, s.factors) for sid, s in self.slots.items()}
        best = max(sims, key=sims.get) if sims else None
        rec["similarities"] = {str(k): round(v, 4) for k, v in sims.items()}
        open_slot = len(self.slots) < cap and (self.policy != "kmerge++" or best is None
                                               or sims[best] < self.threshold)
        if best is None or open_slot:
            slot = self._new_slot(task, factors, own_q)
            rec["action"] = "new_slot"
        elif self.policy in ("kmerge", "kmerge++"):
            slot = self.slots[best]
            slot.factors = self._running_average(slot, factors)
            slot.n += 1
            slot.tasks.append(task)
            slot.last_used = self.clock()
            self.task_to_slot[task] = slot.id
            rec["action"] = "merged"
        else:
            slot = self.slots[best]
            merged, raw, norms = self._opcm(slot, factors)
            tasks = slot.tasks + [task]
            own = {**slot.own_quality, task: own_q}
            kept = {t: kept_share(self.quality(t, merged), own[t]) for t in tasks}
            rec["gate"] = {t: round(v, 4) for t, v in kept.items()}
            if all(v >= self.gate for v in kept.values()):
                slot.factors, slot.raw, slot.tau_norms = merged, raw, norms
                slot.n += 1
                slot.tasks = tasks
                slot.own_quality = own
                slot.last_used = self.clock()
                self.task_to_slot[task] = slot.id
                rec["action"] = "merged"
            else:
                orphans, rec["evicted"] = self._evict_lru()
                slot = self._new_slot(task, factors, own_q)
                for t, q in orphans.items():  # the evicted slot's tasks when no other slot remains
                    rec["evicted"][t] = self._take_in(slot, t, q)
                rec["action"] = "evicted_lru_and_stored"
        rec["slot"] = slot.id
        self.log.append(rec)
        return slot.id

    def _evict_lru(self) -> tuple[dict[str, float | None], dict[str, dict]]:
        """Drop the least recently used slot. Its tasks (all the tasks mapped to it) go to the base
        (``evicted_to="base"``), or each to the most similar remaining slot where the gate holds for it
        (:meth:`_take_in`), else to the base. Returns ``(orphans, log)``: the tasks with their own
        qualities where no slot remains (the caller gates them against the newcomer's slot), and
        task → where it went (``{"slot": id or None, "kept": share}``)."""
        victim = min(self.slots.values(), key=lambda s: s.last_used)
        del self.slots[victim.id]
        tasks = [t for t, sid in self.task_to_slot.items() if sid == victim.id]
        own = {t: victim.own_quality.get(t) for t in tasks}
        if self.evicted_to == "base":
            for t in tasks:
                self.task_to_slot[t] = None
            return {}, {t: {"slot": None} for t in tasks}
        if not self.slots:
            return own, {}
        to = max(self.slots.values(), key=lambda s: similarity(victim.factors, s.factors))
        return {}, {t: self._take_in(to, t, own[t]) for t in tasks}

    def _take_in(self, slot: Slot, task: str, own_q: float | None) -> dict:
        """Serve the evicted ``task`` by ``slot`` if it keeps ``gate`` of its own quality ``own_q`` there
        (:func:`kept_share`, the merge's gate), joining the slot's tasks, which every later merge into
        the slot must then keep; else by the base (``task_to_slot[task] = None``). A task whose own
        quality its evicted slot does not record (``own_q`` None) cannot pass the gate. Returns
        ``{"slot": id or None, "kept": share or None}``."""
        kept = None if own_q is None else kept_share(self.quality(task, slot.factors), own_q)
        if kept is not None and kept >= self.gate:
            slot.tasks.append(task)
            slot.own_quality[task] = own_q
            self.task_to_slot[task] = slot.id
            return {"slot": slot.id, "kept": round(kept, 4)}
        self.task_to_slot[task] = None
        return {"slot": None, "kept": None if kept is None else round(kept, 4)}

    # ------------------------------------------------------------------ serving

    def slot_for(self, task: str) -> Slot | None:
        """The slot that serves ``task`` (marks it used); None when its slot was evicted and it went to
        the base (``evicted_to="base"``, or no slot passed the gate for it). Raises KeyError for a task
        never admitted."""
        if task not in self.task_to_slot:
            raise KeyError(f"task {task!r} was never admitted to this pool")
        sid = self.task_to_slot[task]
        if sid is None:
            return None
        slot = self.slots[sid]
        slot.last_used = self.clock()
        return slot

    # ------------------------------------------------------------------ persistence

    def save(self, folder: str | Path) -> None:
        """Write the pool to ``folder``: each slot's factors (``slot-<id>.<version>.safetensors``, a new
        name each save) then ``pool.json``, which names them, each via a temporary file and a rename;
        then this pool's files that ``pool.json`` does not name are removed. A save that fails part-way
        leaves the previous ``pool.json`` with the slot files it names."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        version = secrets.token_hex(4)
        files = {}
        for s in self.slots.values():
            t = {f"{m}.lora_A": a.contiguous() for m, (a, _) in s.factors.items()}
            t.update({f"{m}.lora_B": b.contiguous() for m, (_, b) in s.factors.items()})
            if s.raw is not None:  # copies: a merged slot's factors share tensors with its raw sum
                t.update({f"raw.{m}.lora_A": a.clone(memory_format=torch.contiguous_format)
                          for m, (a, _) in s.raw.items()})
                t.update({f"raw.{m}.lora_B": b.clone(memory_format=torch.contiguous_format)
                          for m, (_, b) in s.raw.items()})
            files[s.id] = f"slot-{s.id}.{version}.safetensors"
            tmp = folder / f".slot-{s.id}.safetensors.tmp"
            save_file(t, tmp)
            os.replace(tmp, folder / files[s.id])
        state = {"policy": self.policy, "rank": self.rank, "k": self.k, "byte_budget": self.byte_budget,
                 "evicted_to": self.evicted_to,
                 "threshold": self.threshold, "gate": self.gate, "alpha": self.alpha, "next_id": self._next_id,
                 "task_to_slot": self.task_to_slot, "log": self.log,
                 "slots": {str(s.id): {"file": files[s.id], "tasks": s.tasks, "n": s.n, "last_used": s.last_used,
                                       "own_quality": s.own_quality, "tau_norms": s.tau_norms} for s in self.slots.values()}}
        tmp = folder / ".pool.json.tmp"
        tmp.write_text(json.dumps(state, indent=1))
        os.replace(tmp, folder / "pool.json")
        for f in folder.glob("slot-*.safetensors"):  # this pool's stale slots; any other file stays
            if _SLOT_FILE.fullmatch(f.name) and f.name not in files.values():
                f.unlink()

    @classmethod
    def load(cls, folder: str | Path, quality: Callable[[str, Factors], float] | None = None, *,
             clock: Callable[[], float] = time.monotonic) -> AdapterPool:
        """The pool saved in ``folder``, with ``clock`` (as the constructor's). Raises
        FileNotFoundError if there is none."""
        folder = Path(folder)
        state = json.loads((folder / "pool.json").read_text())
        pool = cls(state["policy"], rank=state["rank"], k=state["k"], byte_budget=state["byte_budget"],
                   threshold=state["threshold"], gate=state["gate"], alpha=state["alpha"],
                   evicted_to=state.get("evicted_to", "similar"),
                   quality=quality if quality is not None else (lambda t, f: 1.0), clock=clock)
        pool.quality = quality
        pool._next_id, pool.task_to_slot, pool.log = state["next_id"], state["task_to_slot"], state["log"]
        for sid, meta in state["slots"].items():
            file = meta.get("file", f"slot-{sid}.safetensors")  # (pools saved before versioned names)
            if not isinstance(file, str) or not _SLOT_FILE.fullmatch(file):
                raise ValueError(f"{folder / 'pool.json'}: slot {sid} names {file!r}, not a slot file")
            t = load_file(folder / file)
            mods = sorted({k[: -len(".lora_A")] for k in t if k.endswith(".lora_A") and not k.startswith("raw.")})
            factors = {m: (t[f"{m}.lora_A"], t[f"{m}.lora_B"]) for m in mods}
            raw = {m: (t[f"raw.{m}.lora_A"], t[f"raw.{m}.lora_B"]) for m in mods} if f"raw.{mods[0]}.lora_A" in t else None
            pool.slots[int(sid)] = Slot(int(sid), factors, meta["tasks"], meta["n"], meta["last_used"],
                                        meta["own_quality"], raw, meta["tau_norms"])
        # the saved times are another process's clock (time.monotonic restarts at boot): keep their
        # order, shifted to lie before this clock's now, so a slot used from here on is the more recent
        if pool.slots:
            now, latest = pool.clock(), max(s.last_used for s in pool.slots.values())
            if latest >= now:
                for s in pool.slots.values():
                    s.last_used -= latest - now + 1
        return pool
