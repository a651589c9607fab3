"""Merging checkpoints of one model in task-vector space: MonoSoup, SVD soup, plain average.

Everything here is a plain function on tensors of one parameter (no Lightning, no I/O), so the
training callback (``train/callbacks.py``) and the merge toolkit can stream a model one tensor at
a time. For a parameter ``W`` with base (pre-fine-tuning) value ``W_base`` the *task vector* is
``Δ = W − W_base``.

Conventions for every function:

* Matrices (≥ 2-D tensors) are viewed as ``[shape[0], prod(shape[1:])]`` for the SVD (a linear
  layer's ``[d_out, d_in]``; a convolution's ``[out, in·k_h·k_w]``) and reshaped back.
* Arithmetic runs in float32 (the SVD of a bf16/fp16 matrix is not stable); results come back in
  the dtype (and on the device) of the input checkpoint tensors.
* The spectrum comes from the float64 Gram matrix of the smaller side (``ΔΔᵀ`` or ``ΔᵀΔ``) and its
  symmetric eigendecomposition, not from an SVD of ``Δ``: the rank-``k`` part is the projection
  ``U_kU_kᵀΔ`` (or ``ΔV_kV_kᵀ``), the same matrix as ``U_kΣ_kV_kᵀ``. A model's merge makes one
  decomposition per weight matrix; one GEMM and one ``eigh`` of a ``min(m, n)``-square matrix
  cost less than a thin SVD, most of all for tall matrices such as a token embedding, and keep
  clear of cuSOLVER's SVD of single mid-sized matrices, which is slow. In float64 the singular
  values agree with an SVD's to about 1e-7 of ``σ_1``; only directions far below that, which carry
  no energy, are blurred.
* 0-D and 1-D parameters (norm gains, biases) are averaged by every method except ``"none"``.

Sources:

* MonoSoup — A. Abdollahpoorrostam, N. Dimitriadis, A. Hazimeh, P. Frossard, "Model soups need
  only one ingredient", arXiv:2602.09689 (v2), method section; formulas as spelled out in the
  authors' explainer "MonoSoup Mathematics" (alirezaabdollahpour.github.io/MonoSoup/blog/
  2026-02-05-monosoup-math), cited below as [E §n].
* SVD soup — this project's variant: truncate each checkpoint's task vector to rank ``r``
  (the Eckart–Young best rank-``r`` approximation) and average the truncations.
"""
from __future__ import annotations

import math
from typing import Literal, Sequence

import torch

from deltafleet.values import real, whole

MERGE_METHODS = ("monosoup", "svd_soup", "average", "none")
RANK_MODES = ("energy", "effective_rank")
RankMode = Literal["energy", "effective_rank"]
MergeMethod = Literal["monosoup", "svd_soup", "average", "none"]


def check_soup_settings(method: str = "monosoup", every_n_steps: int = 1000, energy_ratio: float = 0.8,
                        rank_mode: str = "energy", rank: int = 8, val_batches: int = 8, min_rel_update: float = 1e-6,
                        monitor: str = "val/loss", prefix: str = "") -> None:
    """Check the settings of a merge every N steps during training (``MonoSoupCallback``, ``conf/merge``),
    each of its kind and range; ``prefix`` leads each setting's name in the message (``merge.``).

    Raises:
        ValueError: naming the first wrong setting, what it must be and what it is.
    """
    checks = (("method", method, method in MERGE_METHODS, f"one of {', '.join(MERGE_METHODS)}"),
              ("every_n_steps", every_n_steps, whole(every_n_steps) and every_n_steps >= 1, "a whole number ≥ 1"),
              ("energy_ratio", energy_ratio, real(energy_ratio) and 0 < energy_ratio <= 1, "a number in (0, 1]"),
              ("rank_mode", rank_mode, rank_mode in RANK_MODES, f"one of {', '.join(RANK_MODES)}"),
              ("rank", rank, whole(rank) and rank >= 1, "a whole number ≥ 1"),
              ("val_batches", val_batches, whole(val_batches) and val_batches >= 0, "a whole number ≥ 0"),
              ("min_rel_update", min_rel_update, real(min_rel_update) and min_rel_update >= 0, "a number ≥ 0"),
              ("monitor", monitor, isinstance(monitor, str) and bool(monitor), "a logged metric's name"))
    for name, value, ok, what in checks:
        if not ok:
            raise ValueError(f"{prefix}{name} must be {what}, got {value!r}")


_EPS = 1e-12  # numerical guard of the explainer's formulas (ε in [E §1, §4, §5])


def _as_matrix(t: torch.Tensor) -> torch.Tensor:
    """``t`` (≥ 2-D) viewed as ``[shape[0], -1]`` in float32."""
    if t.dim() < 2:
        raise ValueError(f"expected a tensor with at least 2 dimensions, got shape {tuple(t.shape)}")
    return t.reshape(t.shape[0], -1).float()


def _spectrum(d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Singular values of the 2-D ``d`` (float64, decreasing) and the singular vectors of its smaller
    side (columns, float64, same order), from ``eigh`` of the float64 Gram matrix. The flag is
    ``True`` for left vectors (``d`` is wide or square: ``U``), ``False`` for right ones (``V``)."""
    d64 = d.double()
    left = d.shape[0] <= d.shape[1]
    gram = d64 @ d64.T if left else d64.T @ d64
    eigenvalues, vectors = torch.linalg.eigh(gram)
    return eigenvalues.flip(0).clamp_min(0.0).sqrt(), vectors.flip(1), left


def _leading(d: torch.Tensor, vectors: torch.Tensor, left: bool, k: int) -> torch.Tensor:
    """The rank-``k`` part ``U_kΣ_kV_kᵀ`` of ``d`` as the projection onto its ``k`` leading singular
    vectors (``U_kU_kᵀd`` or ``dV_kV_kᵀ``), in ``d``'s dtype."""
    v = vectors[:, :k].to(d.dtype)
    return v @ (v.T @ d) if left else (d @ v) @ v.T


def choose_rank(sigma: torch.Tensor, mode: RankMode = "energy", energy_ratio: float = 0.8) -> int:
    """Number ``k`` of leading singular directions that form the high-energy part [E §4].

    Args:
        sigma: singular values ``[r]``, non-negative and sorted in decreasing order (as returned by
            ``torch.linalg.svd`` or this module's spectrum); any float dtype.
        mode: ``"energy"`` — the smallest ``k`` with ``Σ_{i≤k} σ_i² / Σ_i σ_i² ≥ R`` (the explainer's
            "variance" mode); ``"effective_rank"`` — ``k = ⌈exp(H)⌉`` with ``H = −Σ p_i log(p_i + ε)``
            and ``p_i = σ_i / Σ_j σ_j`` (Roy & Vetterli's effective rank; the explainer's
            "freevariance" mode, used by the paper).
        energy_ratio: ``R`` in ``(0, 1]``, used by ``mode="energy"`` only.

    Returns:
        ``k`` in ``[1, r]`` (``1`` for an all-zero spectrum).

    Raises:
        ValueError: unknown ``mode``, ``R`` outside ``(0, 1]``, or an empty / non-1-D ``sigma``.
    """
    if mode not in RANK_MODES:
        raise ValueError(f"rank mode must be one of {RANK_MODES}, got {mode!r}")
    if sigma.dim() != 1 or sigma.numel() == 0:
        raise ValueError(f"sigma must be a non-empty 1-D tensor, got shape {tuple(sigma.shape)}")
    s = sigma.detach().double().abs()  # the selection is scalar work: float64 keeps it exact
    r = s.numel()
    if mode == "energy":
        if not 0.0 < energy_ratio <= 1.0:
            raise ValueError(f"energy_ratio must be in (0, 1], got {energy_ratio}")
        energy = s.square()
        total = energy.sum()
        if total <= 0:
            return 1
        cumulative = energy.cumsum(0) / total
        # first index where the cumulative fraction reaches R; rounding can leave the last
        # entry a hair below 1.0, so the search is clamped to r
        k = int((cumulative < energy_ratio).sum().item()) + 1
        return max(1, min(k, r))
    total = s.sum()
    if total <= 0:
        return 1
    p = s / total
    entropy = -(p * torch.log(p + _EPS)).sum()
    return max(1, min(math.ceil(math.exp(entropy.item())), r))


def monosoup_update(
    delta: torch.Tensor,
    w_base: torch.Tensor | None = None,
    *,
    rank_mode: RankMode = "energy",
    energy_ratio: float = 0.8,
    min_rel_update: float = 1e-6,
) -> tuple[torch.Tensor, dict]:
    """MonoSoup's edit of one weight matrix's task vector (arXiv:2602.09689; [E §1–§5]).

    With ``ΔW = U Σ Vᵀ`` (the thin SVD of the ``[d_out, d_in]`` view, from the Gram matrix as
    above) and ``k`` from :func:`choose_rank`:

    * ``ΔW_high = U_{:k} Σ_{:k} V_{:k}ᵀ``, ``ΔW_low = ΔW − ΔW_high``  [E §3]
    * ``P_k = Σ_{i≤k} σ_i² / Σ_i σ_i²``, ``ρ = (σ_{k+1} / (σ_1 + ε))²`` (``ρ = 0`` when ``k = r``)
    * ``cos α = √(1 − P_k)`` — the cosine between ``ΔW`` and ``ΔW_low`` (the geometric term)
    * ``λ_low = ρ + (1 − ρ) cos α``, ``λ_high = 1 − λ_low``
    * ``ΔW_mono = λ_high ΔW_high + λ_low ΔW_low``  [E §5]; the merged layer is ``W_0 + ΔW_mono``.

    A matrix whose relative update is small, ``‖ΔW‖_F / (‖W_0‖_F + ε) < τ`` [E §1], or whose
    spectrum is all zero, is returned unchanged (``info["processed"] = False``).

    Args:
        delta: task vector ``ΔW``, ≥ 2-D, any float dtype.
        w_base: base weights ``W_0`` of the same shape, for the relative-update test only; ``None``
            skips the test.
        rank_mode: how ``k`` is chosen, see :func:`choose_rank` (the paper's default is
            ``"effective_rank"``; this project's config uses ``"energy"`` with ``R = 0.8``).
        energy_ratio: ``R`` for ``rank_mode="energy"``.
        min_rel_update: ``τ`` of the relative-update test (the reference implementation's default).

    Returns:
        ``(ΔW_mono, info)``: the edited task vector in ``delta``'s shape, dtype and device, and
        ``info`` with ``rank`` (k), ``full_rank`` (r), ``energy_kept`` (P_k), ``rho``,
        ``lambda_high``, ``lambda_low`` (Python floats/ints) and ``processed`` (bool).

    Raises:
        ValueError: ``delta`` has fewer than 2 dimensions, or ``w_base``'s shape differs.
    """
    d = _as_matrix(delta)
    r = min(d.shape)
    info: dict = {"rank": r, "full_rank": r, "energy_kept": 1.0, "rho": 0.0, "lambda_high": 1.0,
                  "lambda_low": 0.0, "processed": False}
    if w_base is not None:
        if w_base.shape != delta.shape:
            raise ValueError(f"w_base shape {tuple(w_base.shape)} != delta shape {tuple(delta.shape)}")
        base_norm = torch.linalg.vector_norm(w_base.float()).item()
        if torch.linalg.vector_norm(d).item() / (base_norm + _EPS) < min_rel_update:
            return delta.clone(), info
    sigma, vectors, left = _spectrum(d)
    energy = sigma.square()
    total = energy.sum().item()
    if total <= 0.0:  # an all-zero update (the relative-update test catches merely small ones)
        return delta.clone(), info
    k = choose_rank(sigma, rank_mode, energy_ratio)
    p_k = min(1.0, energy[:k].sum().item() / total)
    rho = (sigma[k].item() / (sigma[0].item() + _EPS)) ** 2 if k < r else 0.0
    cos_alpha = math.sqrt(max(0.0, 1.0 - p_k))
    lambda_low = rho + (1.0 - rho) * cos_alpha
    lambda_high = 1.0 - lambda_low
    high = _leading(d, vectors, left, k)
    low = d - high
    out = lambda_high * high + lambda_low * low
    info.update(rank=k, energy_kept=p_k, rho=rho, lambda_high=lambda_high, lambda_low=lambda_low, processed=True)
    return out.reshape(delta.shape).to(delta.dtype), info


def svd_truncate(delta: torch.Tensor, rank: int) -> torch.Tensor:
    """Best rank-``rank`` approximation of ``delta`` in Frobenius norm (Eckart–Young).

    Args:
        delta: ≥ 2-D tensor, any float dtype, viewed as ``[shape[0], -1]``.
        rank: ``r ≥ 1``; ``r ≥ min(d_out, d_in)`` returns ``delta`` itself (up to float32 rounding).

    Returns:
        ``U_{:r} Σ_{:r} V_{:r}ᵀ`` in ``delta``'s shape, dtype and device.

    Raises:
        ValueError: ``rank < 1`` or ``delta`` has fewer than 2 dimensions.
    """
    return _svd_truncate(delta, rank)[0]


def _svd_truncate(delta: torch.Tensor, rank: int) -> tuple[torch.Tensor, float, int]:
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    d = _as_matrix(delta)
    sigma, vectors, left = _spectrum(d)
    k = min(rank, sigma.numel())
    energy = sigma.square()
    total = energy.sum().item()
    kept = energy[:k].sum().item() / total if total > 0 else 1.0
    out = _leading(d, vectors, left, k)
    return out.reshape(delta.shape).to(delta.dtype), kept, k


def merge_param(
    method: MergeMethod,
    w_base: torch.Tensor,
    ws: Sequence[torch.Tensor],
    *,
    energy_ratio: float = 0.8,
    rank_mode: RankMode = "energy",
    rank: int = 8,
    min_rel_update: float = 1e-6,
) -> tuple[torch.Tensor, dict]:
    """Merge checkpoints ``ws`` of one parameter that share the base ``w_base``.

    Methods (``Δ_i = ws[i] − w_base``, ``n = len(ws)``):

    * ``"monosoup"`` — MonoSoup (:func:`monosoup_update`) applied to the mean task vector:
      ``W = W_base + mono(mean_i Δ_i)``.
    * ``"svd_soup"`` — ``W = W_base + mean_i svd_truncate(Δ_i, rank)``.
    * ``"average"`` — ``W = mean_i ws[i]``.
    * ``"none"`` — ``ws[0]`` unchanged (the callback's "current weights").

    0-D/1-D parameters are averaged (``mean_i ws[i]``) by every method except ``"none"``.

    Args:
        method: one of :data:`MERGE_METHODS`.
        w_base: base weights, same shape as each ``ws[i]``; any float dtype and device.
        ws: one or more checkpoints' tensors of this parameter (same shape, dtype and device).
        energy_ratio, rank_mode, min_rel_update: MonoSoup's ``R``, rank rule and ``τ``.
        rank: SVD soup's truncation rank ``r ≥ 1``.

    Returns:
        ``(merged, info)``: ``merged`` in ``ws[0]``'s dtype and device; ``info`` for matrices holds
        ``rank`` (kept rank; for ``average`` the untruncated ``min(d_out, d_in)``), ``full_rank``,
        ``energy_kept`` (fraction of the task vector's spectral energy in the kept directions:
        MonoSoup's ``P_k``; SVD soup's mean over checkpoints; ``1.0`` for ``average``) and, for
        MonoSoup, ``rho``, ``lambda_high``, ``lambda_low``, ``processed``. Empty for 0-D/1-D
        parameters and for ``"none"``.

    Raises:
        ValueError: unknown ``method``, empty ``ws``, or any shape that differs from ``w_base``'s.
    """
    if method not in MERGE_METHODS:
        raise ValueError(f"unknown merge method {method!r}; expected one of {MERGE_METHODS}")
    if len(ws) == 0:
        raise ValueError("merge_param needs at least one checkpoint tensor in ws")
    for i, w in enumerate(ws):
        if w.shape != w_base.shape:
            raise ValueError(f"shape mismatch: ws[{i}] has shape {tuple(w.shape)}, "
                             f"w_base has shape {tuple(w_base.shape)}")
    if method == "none":
        return ws[0], {}
    out_dtype, device = ws[0].dtype, ws[0].device
    stacked = torch.stack([w.to(device=device, dtype=torch.float32) for w in ws])
    if w_base.dim() < 2 or method == "average" or w_base.numel() == 0:  # an empty matrix has no spectrum
        merged = stacked.mean(0).to(out_dtype)
        if w_base.dim() < 2:
            return merged, {}
        r = min(w_base.shape[0], w_base[0].numel()) if w_base.shape[0] else 0
        return merged, {"rank": r, "full_rank": r, "energy_kept": 1.0}
    base = w_base.to(device=device, dtype=torch.float32)
    deltas = stacked - base
    if method == "monosoup":
        new_delta, info = monosoup_update(deltas.mean(0), base, rank_mode=rank_mode, energy_ratio=energy_ratio,
                                          min_rel_update=min_rel_update)
        return (base + new_delta).to(out_dtype), info
    # svd_soup
    total = torch.zeros_like(base)
    kept, k = [], 0
    for d in deltas:
        approx, e, k = _svd_truncate(d, rank)
        total += approx
        kept.append(e)
    merged = base + total / len(ws)
    return merged.to(out_dtype), {"rank": k, "full_rank": min(base.shape[0], base[0].numel()),
                                  "energy_kept": sum(kept) / len(kept)}


def summarize(infos: Sequence[dict]) -> dict:
    """Means over the matrices of a merge: ``mean_rank``, ``mean_energy_kept`` and, when present,
    ``mean_lambda_high`` / ``mean_lambda_low``; ``matrices`` counts the entries with a rank and
    ``processed`` those MonoSoup edited. Values are ``float('nan')`` when no matrix has them."""
    rows = [i for i in infos if "rank" in i]
    out = {"matrices": float(len(rows))}
    for key, name in (("rank", "mean_rank"), ("energy_kept", "mean_energy_kept"),
                      ("lambda_high", "mean_lambda_high"), ("lambda_low", "mean_lambda_low")):
        vals = [float(i[key]) for i in rows if key in i]
        if vals or key in ("rank", "energy_kept"):
            out[name] = sum(vals) / len(vals) if vals else float("nan")
    if any("processed" in i for i in rows):
        out["processed"] = float(sum(bool(i.get("processed")) for i in rows))
    return out
