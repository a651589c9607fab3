"""Merge methods over task vectors, one parameter tensor at a time, in a registry (as mergekit's
``merge_method`` names them).

For a parameter with base value ``W₀`` and fine-tuned values ``W_i`` (i = 1…n), the task vectors are
``τ_i = W_i − W₀`` (Ilharco et al. 2023, "Editing models with task arithmetic", arXiv:2212.04089).
Every method returns the merged tensor in the dtype of ``W₀``; the arithmetic runs in float32.
Non-floating tensors (integer buffers) are taken from the base.

=================  =========================================================================================
``linear``         ``Σ w_i W_i / Σ w_i`` (weight averaging, Wortsman et al. 2022 "model soups")
``task_arithmetic``  ``W₀ + λ Σ w_i τ_i`` (arXiv:2212.04089 Eq. 1)
``ties``           trim each ``τ_i`` to its top-``density`` magnitudes, elect a sign per entry from the
                   summed trimmed mass, average the entries that agree with it: ``W₀ + λ τ_m``
                   (TIES-Merging, Yadav et al. 2023, arXiv:2306.01708, Alg. 1)
``dare_linear``    drop each entry of ``τ_i`` with probability ``1 − density``, rescale the rest by
                   ``1/density``, then task arithmetic (DARE, Yu et al. 2024, arXiv:2311.03099 Eq. 2–3)
``dare_ties``      DARE's drop and rescale, then TIES' sign election and disjoint mean
``monosoup``       MonoSoup of the mean task vector (merge/soup.py, arXiv:2602.09689)
``svd_soup``       mean of the rank-``rank`` truncations of the ``τ_i`` (merge/soup.py)
``slerp``          spherical interpolation from the base (``t = 0``) to one model (``t = 1``), each tensor
                   one vector: ``sin((1−t)θ)/sin θ · W₀ + sin(tθ)/sin θ · W₁``, θ the angle between them;
                   linear where they are nearly parallel (Shoemake 1985; mergekit's ``slerp``)
``opcm``           continual: the models arrive one at a time; each new task vector is projected out of
                   the dominant singular subspace of the running merged task vector, added, and the sum
                   is rescaled to the mean task-vector norm of the whole model (OPCM, Tang et al. 2025,
                   arXiv:2501.09522, §3)
=================  =========================================================================================

A method that needs statistics of the whole model (``opcm``: norms over every parameter) says so
with ``two_pass = True``: :func:`deltafleet.merge.stream.merge_checkpoints` first shows it every tensor
(:meth:`MergeMethod.observe`), then asks for the merged tensors.
"""
from __future__ import annotations

import inspect
import math
import zlib
from typing import Callable, ClassVar, Iterator, Sequence

import torch
from torch import Tensor

from deltafleet.merge.soup import check_soup_settings, merge_param

REGISTRY: dict[str, type[MergeMethod]] = {}


def register(name: str):
    def deco(cls):
        cls.name = name
        REGISTRY[name] = cls
        return cls
    return deco


def get_method(name: str, **params) -> MergeMethod:
    """An instance of the registered method ``name`` with ``params``.

    Raises:
        ValueError: unknown name (the message lists the known ones) or a bad parameter.
    """
    if name not in REGISTRY:
        raise ValueError(f"unknown merge method {name!r}; known: {', '.join(sorted(REGISTRY))}")
    _check_params(name, REGISTRY[name], params)
    try:
        return REGISTRY[name](**params)
    except (TypeError, ValueError) as e:
        raise ValueError(f"merge method {name!r}: {e}") from None


def _check_params(name: str, cls: type, params: dict) -> None:
    """Each of ``params`` is a parameter of ``cls``, of its default's kind: a number where the
    default is a float, an integer where it is an int, true/false, a text, or (``weights``) a list of
    numbers. Raises ValueError naming the parameter and what it got."""
    sig = inspect.signature(cls.__init__)
    known = [p for p in sig.parameters if p != "self"]
    for key, value in params.items():
        if key not in known:
            raise ValueError(f"merge method {name!r} has no parameter {key!r}; its parameters: {', '.join(known)}")
        default = sig.parameters[key].default
        if key == "weights":
            ok = isinstance(value, (list, tuple)) and all(_is_number(w) for w in value)
            kind = "a list of numbers, one per model"
        elif isinstance(default, bool):
            ok, kind = isinstance(value, bool), "true or false"
        elif isinstance(default, int):
            ok = _is_number(value) and float(value).is_integer()
            kind = "an integer"
        elif isinstance(default, float):  # nan or inf would write a model of NaNs
            ok, kind = _is_number(value) and math.isfinite(float(value)), "a finite number"
        elif isinstance(default, str):
            ok, kind = isinstance(value, str), "a text"
        else:
            continue
        if not ok:
            raise ValueError(f"merge method {name!r}: {key} must be {kind}, got {value!r}")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


BLOCK_ELEMENTS = 1 << 22  # rows per block of an elementwise method: about this many elements (fixed:
# DARE's random masks are drawn per block, so the result must not depend on a memory setting)

Rows = Callable[[int, int], "tuple[Tensor, list[Tensor]]"]  # read(start, stop) -> (base rows, [model rows])


def _n_rows(shape: tuple[int, ...]) -> tuple[int, int]:
    width = shape[-1] if shape else 1
    return (math.prod(shape) // width if width else 0), width


class MergeMethod:
    """Base class: ``merge(name, base, models) -> merged`` for one parameter, or
    :meth:`merge_rows` for the same from rows read on demand (what the streaming merge uses).

    ``elementwise`` methods merge each entry from the same entry of the inputs (after any
    whole-tensor statistics, :meth:`_prepare`), so they run on blocks of rows and never hold a whole
    float32 copy of a large tensor; the others get whole tensors."""

    name: ClassVar[str] = ""
    two_pass: ClassVar[bool] = False
    elementwise: ClassVar[bool] = False
    n_models: ClassVar[int | None] = None  # how many models it merges with the base (None: any)
    # whether it merges task vectors W − W_base (the base their origin), not the weights themselves
    task_vectors: ClassVar[bool] = True

    def __init__(self, weights: Sequence[float] | None = None):
        if weights is not None and any(not math.isfinite(w) for w in weights):
            raise ValueError(f"weights must be finite, got {list(weights)}")
        if weights is not None and len(weights) and not any(weights):  # a merge of nothing: the base itself
            raise ValueError(f"weights are all 0, so no model would take part in the merge: {list(weights)}")
        self.weights = None if weights is None else [float(w) for w in weights]

    def _w(self, n: int) -> list[float]:
        if self.weights is None:
            return [1.0] * n
        if len(self.weights) != n:
            raise ValueError(f"{len(self.weights)} weights for {n} models")
        return self.weights

    def reset(self) -> None:
        """Forget what :meth:`observe` saw: a ``two_pass`` method's first pass of a new merge starts
        here, so one method object can merge several model sets (no-op otherwise)."""

    def observe(self, name: str, base: Tensor, models: Sequence[Tensor]) -> None:
        """First pass of a ``two_pass`` method (no-op otherwise)."""

    def merge(self, name: str, base: Tensor, models: Sequence[Tensor]) -> Tensor:
        """The merged tensor, in ``base``'s dtype and shape.

        Raises:
            ValueError: no models, another number of models than the method merges (``n_models``),
                or a shape that differs from the base's.
        """
        if not models:
            raise ValueError("no models to merge")
        if self.n_models is not None and len(models) != self.n_models:
            raise ValueError(f"merge method {self.name!r} merges the base with {self.n_models} model(s), "
                             f"got {len(models)}")
        for m in models:
            if m.shape != base.shape:
                raise ValueError(f"{name}: shape {tuple(m.shape)} differs from the base's {tuple(base.shape)}")
        if not base.is_floating_point():
            return base.clone()
        rows, width = _n_rows(tuple(base.shape))
        b2, ms2 = base.reshape(rows, width), [m.reshape(rows, width) for m in models]
        blocks = list(self.merge_rows(name, tuple(base.shape), lambda s, e: (b2[s:e], [m[s:e] for m in ms2])))
        return torch.cat(blocks, 0).reshape(base.shape) if blocks else base.clone()

    def merge_rows(self, name: str, shape: tuple[int, ...], read: Rows) -> Iterator[Tensor]:
        """The merged tensor as blocks of rows of its ``[prod(shape[:-1]), shape[-1]]`` view, in the
        base's dtype, with the inputs read through ``read(start, stop)``."""
        rows, width = _n_rows(shape)
        if not self.elementwise:
            b, ms = read(0, rows)
            bf = b.reshape(shape).float()
            yield self._merge(name, bf, [m.reshape(shape).float() - bf for m in ms]).to(b.dtype).reshape(rows, width)
            return
        self._prepare(name, shape, read)
        step = max(1, BLOCK_ELEMENTS // max(width, 1))
        for start in range(0, rows, step):
            b, ms = read(start, min(rows, start + step))
            bf = b.float()
            yield self._merge_block(name, start // step, bf, [m.float() - bf for m in ms]).to(b.dtype)

    def _prepare(self, name: str, shape: tuple[int, ...], read: Rows) -> None:
        """Whole-tensor statistics an elementwise method needs before its blocks (TIES' thresholds)."""

    def _merge(self, name: str, base: Tensor, taus: list[Tensor]) -> Tensor:
        return self._merge_block(name, 0, base, taus)

    def _merge_block(self, name: str, block: int, base: Tensor, taus: list[Tensor]) -> Tensor:
        raise NotImplementedError


@register("linear")
class Linear(MergeMethod):
    """``Σ w_i W_i / Σ w_i`` (``normalize=False``: ``Σ w_i W_i``)."""

    elementwise = True
    task_vectors = False

    def __init__(self, weights=None, normalize: bool = True):
        super().__init__(weights)
        if normalize and weights is not None and sum(self.weights) == 0:  # before any work, not at the first tensor
            raise ValueError(f"the weights sum to 0, which a normalised merge divides by: {list(weights)} "
                             "(normalize=false merges their plain weighted sum)")
        self.normalize = normalize

    def _merge_block(self, name, block, base, taus):
        w = self._w(len(taus))
        total = sum(w) if self.normalize else 1.0  # not 0: refused at construction
        return sum(wi * (base + t) for wi, t in zip(w, taus)) / total


@register("task_arithmetic")
class TaskArithmetic(MergeMethod):
    """``W₀ + λ Σ w_i τ_i``."""

    elementwise = True

    def __init__(self, weights=None, scaling: float = 0.3):
        super().__init__(weights)
        self.scaling = float(scaling)

    def _merge_block(self, name, block, base, taus):
        w = self._w(len(taus))
        return base + self.scaling * sum(wi * t for wi, t in zip(w, taus))


def _check_density(density: float) -> float:
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density}")
    return float(density)


def top_threshold(magnitudes: Tensor, density: float) -> tuple[float, int]:
    """TIES' cut of ``magnitudes`` at its ``k = ceil(density·numel)`` largest: ``(threshold, ties)``,
    the ``k``-th largest value and how many of the entries equal to it are kept (the first ones in
    row-major order), so that exactly ``k`` entries are kept however many magnitudes tie, as in
    bf16 task vectors of a few ulps (``(-inf, 0)``, every entry, when ``k ≥ numel``)."""
    n = magnitudes.numel()
    k = max(1, math.ceil(density * n))
    if k >= n:
        return -math.inf, 0
    flat = magnitudes.flatten()
    threshold = float(torch.kthvalue(flat, n - k + 1).values)
    return threshold, k - int((flat > threshold).sum())


class Trim:
    """Keeps the entries of ``τ`` that :func:`top_threshold` keeps, over row blocks given in order:
    those above the threshold, and the first ``ties`` equal to it."""

    def __init__(self, threshold: float, ties: int):
        self.threshold, self.ties = threshold, ties

    def __call__(self, tau: Tensor) -> Tensor:
        mag = tau.abs()
        keep = mag > self.threshold
        if self.ties > 0:
            equal = (mag == self.threshold).flatten()
            take = equal & (equal.cumsum(0) <= self.ties)
            self.ties -= int(take.sum())
            keep |= take.reshape(keep.shape)
        return torch.where(keep, tau, torch.zeros_like(tau))


def trim_top(tau: Tensor, density: float) -> Tensor:
    """``τ`` with all but its top ``ceil(density·numel)`` magnitudes set to 0 (TIES' trim; of entries
    tied at the cut, the first ones in row-major order are kept)."""
    return Trim(*top_threshold(tau.abs(), density))(tau)


def disjoint_merge(taus: Sequence[Tensor], weights: Sequence[float]) -> Tensor:
    """TIES' elect + disjoint merge: the sign of ``Σ w_i τ_i`` per entry, then the weighted mean of the
    entries whose sign agrees with it (entries equal to 0 do not vote or count)."""
    stack = torch.stack([w * t for w, t in zip(weights, taus)])
    sign = torch.sign(stack.sum(0))
    agree = (torch.sign(stack) == sign) & (stack != 0)
    wsum = sum(abs(w) * agree[i].float() for i, w in enumerate(weights))
    num = (stack * agree).sum(0)
    return torch.where(wsum > 0, num / wsum.clamp_min(1e-12), torch.zeros_like(num))


@register("ties")
class Ties(MergeMethod):
    """TIES-Merging: trim to ``density``, elect signs, disjoint mean, ``W₀ + λ τ_m``."""

    elementwise = True

    def __init__(self, weights=None, density: float = 0.2, scaling: float = 1.0):
        super().__init__(weights)
        self.density, self.scaling = _check_density(density), float(scaling)
        self._trims: list[Trim] = []

    def _prepare(self, name, shape, read):
        """Each model's magnitude threshold over the whole tensor, from one float32 buffer of |τ_i|
        filled block by block (one model at a time)."""
        rows, width = _n_rows(shape)
        step = max(1, BLOCK_ELEMENTS // max(width, 1))
        n_models = len(read(0, 0)[1])
        self._trims = []
        for i in range(n_models):
            buf = torch.empty(rows, width, dtype=torch.float32)
            for start in range(0, rows, step):
                b, ms = read(start, min(rows, start + step))
                buf[start:start + b.shape[0]] = (ms[i].float() - b.float()).abs()
            self._trims.append(Trim(*top_threshold(buf, self.density)))
            del buf

    def _merge_block(self, name, block, base, taus):  # blocks in order: the trims count the ties kept
        trimmed = [trim(t) for trim, t in zip(self._trims, taus)]
        return base + self.scaling * disjoint_merge(trimmed, self._w(len(taus)))


def dare(tau: Tensor, density: float, generator: torch.Generator) -> Tensor:
    """DARE: keep each entry with probability ``density`` and rescale kept ones by ``1/density``."""
    keep = torch.rand(tau.shape, generator=generator) < density
    return torch.where(keep, tau / density, torch.zeros_like(tau))


class _Dare(MergeMethod):
    elementwise = True

    def __init__(self, weights=None, density: float = 0.5, scaling: float = 1.0, seed: int = 0):
        super().__init__(weights)
        if isinstance(seed, bool) or not float(seed).is_integer():
            raise ValueError(f"seed must be an integer, got {seed!r}")
        if not abs(seed) < 2**40:  # the generator's seed, seed · 1_000_003 + ..., must fit in 64 bits
            raise ValueError(f"seed must be an integer of magnitude below 2^40, got {seed!r}")
        self.density, self.scaling, self.seed = _check_density(density), float(scaling), int(seed)

    def _dropped(self, name: str, block: int, taus: list[Tensor]) -> list[Tensor]:
        # one generator per (tensor, block of rows), seeded by the name: independent of tensor order
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()) + 7919 * block)
        return [dare(t, self.density, g) for t in taus]


@register("dare_linear")
class DareLinear(_Dare):
    def _merge_block(self, name, block, base, taus):
        dropped = self._dropped(name, block, taus)
        return base + self.scaling * sum(w * t for w, t in zip(self._w(len(taus)), dropped))


@register("dare_ties")
class DareTies(_Dare):
    def _merge_block(self, name, block, base, taus):
        return base + self.scaling * disjoint_merge(self._dropped(name, block, taus), self._w(len(taus)))


@register("monosoup")
class MonoSoup(MergeMethod):
    """MonoSoup on the mean task vector (merge/soup.py's ``merge_param``)."""

    def __init__(self, energy_ratio: float = 0.8, rank_mode: str = "energy", min_rel_update: float = 1e-6):
        super().__init__(None)
        check_soup_settings("monosoup", energy_ratio=energy_ratio, rank_mode=rank_mode, min_rel_update=min_rel_update)
        self.energy_ratio, self.rank_mode, self.min_rel_update = energy_ratio, rank_mode, min_rel_update

    def _merge(self, name, base, taus):
        return merge_param("monosoup", base, [base + t for t in taus], energy_ratio=self.energy_ratio,
                           rank_mode=self.rank_mode, min_rel_update=self.min_rel_update)[0]


@register("svd_soup")
class SvdSoup(MergeMethod):
    def __init__(self, rank: int = 8):
        super().__init__(None)
        check_soup_settings("svd_soup", rank=int(rank) if float(rank).is_integer() else rank)
        self.rank = int(rank)

    def _merge(self, name, base, taus):
        return merge_param("svd_soup", base, [base + t for t in taus], rank=self.rank)[0]


DOT_THRESHOLD = 0.9995  # slerp: |cos θ| above this interpolates linearly (mergekit's threshold)
_NORM_EPS = 1e-8  # slerp: a vector of norm at most this is not normalised (mergekit's)


@register("slerp")
class Slerp(MergeMethod):
    """Spherical linear interpolation between the base ``W₀`` (``t = 0``) and one model ``W₁``
    (``t = 1``), each tensor as one vector (Shoemake 1985, as mergekit's ``slerp``): with
    ``cos θ = ⟨W₀/‖W₀‖, W₁/‖W₁‖⟩`` (a vector of norm ≤ 1e-8 is not normalised), the merge is
    ``sin((1−t)θ)/sin θ · W₀ + sin(tθ)/sin θ · W₁``, or ``(1−t) W₀ + t W₁`` where
    ``|cos θ| > 0.9995``. To interpolate between two fine-tunes, give one of them as the base."""

    elementwise = True
    n_models = 1
    task_vectors = False  # the base is the t = 0 end, whatever it was fine-tuned from

    def __init__(self, t: float = 0.5):
        super().__init__(None)
        if not 0.0 <= t <= 1.0:
            raise ValueError(f"t must be in [0, 1] (0: the base, 1: the model), got {t}")
        self.t = float(t)
        self._coef = (1.0 - self.t, self.t)

    def _prepare(self, name, shape, read):
        """The angle over the whole tensor: its dot product and norms, in float64, block by block."""
        rows, width = _n_rows(shape)
        step = max(1, BLOCK_ELEMENTS // max(width, 1))
        dot = sq0 = sq1 = 0.0
        for start in range(0, rows, step):
            b, ms = read(start, min(rows, start + step))
            v0, v1 = b.double(), ms[0].double()
            dot, sq0, sq1 = dot + float((v0 * v1).sum()), sq0 + float(v0.pow(2).sum()), sq1 + float(v1.pow(2).sum())
        n0, n1 = (math.sqrt(x) for x in (sq0, sq1))
        cos = dot / ((n0 if n0 > _NORM_EPS else 1.0) * (n1 if n1 > _NORM_EPS else 1.0))
        if abs(cos) > DOT_THRESHOLD:
            self._coef = (1.0 - self.t, self.t)
            return
        theta = math.acos(max(-1.0, min(1.0, cos)))
        self._coef = (math.sin((1.0 - self.t) * theta) / math.sin(theta), math.sin(self.t * theta) / math.sin(theta))

    def _merge_block(self, name, block, base, taus):
        s0, s1 = self._coef
        return (s0 + s1) * base + s1 * taus[0]  # s0·W₀ + s1·W₁, with W₁ = W₀ + τ


def opcm_project(merged_tau: Tensor, tau: Tensor, alpha: float) -> Tensor:
    """OPCM's projection (arXiv:2501.09522 §3.2): in the singular bases ``U, V`` of the running merged
    task vector, ``P = Uᵀ τ V``; zero the block of the ``k`` dominant directions — ``k`` the first
    index where the cumulative share of singular values exceeds ``alpha`` — and the diagonal; map
    back, ``U P Vᵀ``. Computed with the reduced SVD as ``τ`` minus those components
    (``U_k U_kᵀ τ V_k V_kᵀ`` and ``Σ_{i≥k} (u_iᵀ τ v_i) u_i v_iᵀ``), which equals the full-SVD form
    without its ``m×m`` and ``n×n`` factors. Matrices only (2-D)."""
    u, s, vh = torch.linalg.svd(merged_tau, full_matrices=False)
    if s.sum() <= 0:
        return tau.clone()
    k = int(((s.cumsum(0) / s.sum()) > alpha).float().argmax())
    v = vh.T
    ut_tau = u.T @ tau                                  # [r, n]
    d = (ut_tau * vh).sum(1)                            # u_iᵀ τ v_i, [r]
    out = tau - u[:, k:] @ (d[k:, None] * vh[k:])       # the diagonal past the block
    if k:
        out = out - u[:, :k] @ (ut_tau[:k] @ v[:, :k]) @ vh[:k]
    return out


@register("opcm")
class OPCM(MergeMethod):
    """Orthogonal Projection-based Continual Merging, models in the given order.

    Per parameter, the running sum ``R_1 = τ_1``, ``R_t = R_{t−1} + proj(τ_t)`` (matrices projected by
    :func:`opcm_project` against ``R_{t−1}``; other parameters added as they are); the merged task
    vector is ``R_n · (mean_i ‖τ_i‖) / ‖R_n‖`` with the norms over the whole model — the paper's
    adaptive rescaling λ_t, which keeps the merged task vector as long as an average task vector.
    """

    two_pass = True

    def __init__(self, alpha: float = 0.5):
        super().__init__(None)
        if not 0.0 < alpha < 1.0:
            raise ValueError(f"alpha must be in (0, 1), got {alpha}")
        self.alpha = float(alpha)
        self.reset()

    def reset(self) -> None:
        self._sq_r = 0.0
        self._sq_tau: list[float] = []
        self._observed = False

    def _sum(self, taus: list[Tensor]) -> Tensor:
        r = taus[0].clone()
        for t in taus[1:]:
            r = r + (opcm_project(r, t, self.alpha) if t.dim() == 2 else t)
        return r

    def observe(self, name, base, models):
        if not base.is_floating_point():
            return
        b = base.float()
        taus = [m.float() - b for m in models]
        if not self._sq_tau:
            self._sq_tau = [0.0] * len(taus)
        for i, t in enumerate(taus):
            self._sq_tau[i] += float(t.pow(2).sum())
        self._sq_r += float(self._sum(taus).pow(2).sum())
        self._observed = True

    @property
    def scale(self) -> float:
        """``mean_i ‖τ_i‖ / ‖R_n‖`` over the whole model (after :meth:`observe` saw every tensor)."""
        if not self._observed:
            raise RuntimeError("opcm: observe() every tensor first (two passes)")
        norm_r = math.sqrt(self._sq_r)
        mean_tau = sum(math.sqrt(x) for x in self._sq_tau) / len(self._sq_tau)
        return mean_tau / norm_r if norm_r > 0 else 0.0

    def _merge(self, name, base, taus):
        return base + self._sum(taus) * self.scale
