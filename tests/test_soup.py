"""merge.soup against plain-torch references written here: full SVDs, explicit sums of rank-1 terms,
spectra chosen so that the rank each rule picks is known by hand."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deltafleet.merge.soup import _leading, _spectrum, choose_rank, merge_param, monosoup_update, summarize, svd_truncate


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny SVDs: one thread is fastest, and it leaves the machine's other cores alone."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def orthogonal(n: int, gen: torch.Generator) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))


def with_spectrum(sigma: list[float], m: int, n: int, seed: int = 0) -> torch.Tensor:
    """An ``[m, n]`` float64 matrix U diag(σ) Vᵀ with random orthogonal U, V (σ padded with zeros)."""
    gen = torch.Generator().manual_seed(seed)
    u, v = orthogonal(m, gen), orthogonal(n, gen)
    s = torch.zeros(min(m, n), dtype=torch.float64)
    s[: len(sigma)] = torch.tensor(sigma, dtype=torch.float64)
    return (u[:, : s.numel()] * s) @ v[:, : s.numel()].T


# ------------------------------------------------------------------ references
def ref_rank_energy(sigma: list[float], ratio: float) -> int:
    total = sum(s * s for s in sigma)
    acc = 0.0
    for k, s in enumerate(sigma, start=1):
        acc += s * s
        if acc / total >= ratio:
            return k
    return len(sigma)


def ref_rank_effective(sigma: list[float]) -> int:
    total = sum(sigma)
    h = -sum((s / total) * math.log(s / total + 1e-12) for s in sigma)
    return min(len(sigma), max(1, math.ceil(math.exp(h))))


def ref_monosoup(delta: torch.Tensor, k: int) -> torch.Tensor:
    """Σ_i c_i σ_i u_i v_iᵀ over the full SVD, c_i = λ_high for i ≤ k, λ_low after (explainer §5)."""
    d = delta.double().reshape(delta.shape[0], -1)
    u, s, vh = torch.linalg.svd(d, full_matrices=True)
    s = s.tolist()
    total = sum(x * x for x in s)
    p_k = sum(x * x for x in s[:k]) / total
    rho = (s[k] / s[0]) ** 2 if k < len(s) else 0.0
    lam_low = rho + (1 - rho) * math.sqrt(1 - p_k)
    lam_high = 1 - lam_low
    out = torch.zeros_like(d)
    for i, si in enumerate(s):
        out += (lam_high if i < k else lam_low) * si * torch.outer(u[:, i], vh[i])
    return out.reshape(delta.shape)


def ref_truncate(delta: torch.Tensor, r: int) -> torch.Tensor:
    d = delta.double().reshape(delta.shape[0], -1)
    u, s, vh = torch.linalg.svd(d, full_matrices=True)
    out = torch.zeros_like(d)
    for i in range(min(r, s.numel())):
        out += s[i] * torch.outer(u[:, i], vh[i])
    return out.reshape(delta.shape)


# ------------------------------------------------------------------ rank rules
SIGMA = [10.0, 5.0, 1.0, 0.1, 0.05, 0.01]  # energies 100, 25, 1, .01, .0025, .0001 (total 126.0126)


@pytest.mark.parametrize("ratio, k", [(0.5, 1), (0.79, 1), (0.8, 2), (0.99, 2), (0.995, 3), (0.99997, 4),
                                      (0.99999, 5), (1.0, 6)])
def test_energy_rank_known_spectrum(ratio, k):
    assert ref_rank_energy(SIGMA, ratio) == k  # the hand count: 100/126.01 = .794, 125/126.01 = .992, ...
    assert choose_rank(torch.tensor(SIGMA), "energy", ratio) == k


@pytest.mark.parametrize("sigma, k", [(SIGMA, 3), ([1.0] * 5, 5), ([1.0, 0.0, 0.0], 1), ([3.0, 1.0, 1.0, 1.0], 4),
                                      ([10.0, 1.0, 0.1], 2)])
def test_effective_rank_known_spectrum(sigma, k):
    # SIGMA: p = σ/16.16, H = 0.886, exp(H) = 2.43 -> 3; equal σ: exp(H) = n; one σ: 1
    assert ref_rank_effective(sigma) == k
    assert choose_rank(torch.tensor(sigma), "effective_rank") == k


def test_choose_rank_errors():
    with pytest.raises(ValueError, match="rank mode"):
        choose_rank(torch.tensor(SIGMA), "variance")
    with pytest.raises(ValueError, match=r"energy_ratio must be in \(0, 1\]"):
        choose_rank(torch.tensor(SIGMA), "energy", 1.5)
    with pytest.raises(ValueError, match="non-empty 1-D"):
        choose_rank(torch.ones(2, 2))


# ------------------------------------------------------------------ MonoSoup
@pytest.mark.parametrize("mode, ratio, k", [("energy", 0.8, 2), ("energy", 0.995, 3), ("effective_rank", 0.8, 3)])
def test_monosoup_update_matches_reference(mode, ratio, k):
    delta = with_spectrum(SIGMA, 24, 40, seed=1).float()
    new, info = monosoup_update(delta, rank_mode=mode, energy_ratio=ratio)
    assert info["rank"] == k and info["full_rank"] == 24 and info["processed"]
    total = sum(s * s for s in SIGMA)
    assert info["energy_kept"] == pytest.approx(sum(s * s for s in SIGMA[:k]) / total, rel=1e-5)
    rho = (SIGMA[k] / SIGMA[0]) ** 2
    assert info["rho"] == pytest.approx(rho, rel=1e-4)
    assert info["lambda_low"] == pytest.approx(rho + (1 - rho) * math.sqrt(1 - info["energy_kept"]), rel=1e-5)
    assert info["lambda_high"] + info["lambda_low"] == pytest.approx(1.0)
    torch.testing.assert_close(new.double(), ref_monosoup(delta, k), atol=2e-5, rtol=1e-4)


def test_monosoup_full_rank_kept_is_identity():
    # R = 1 keeps every direction: ρ = 0, P_k = 1, λ_low = 0, λ_high = 1 -> Δ unchanged
    delta = with_spectrum([3.0, 2.0, 1.0], 3, 5, seed=2).float()
    new, info = monosoup_update(delta, energy_ratio=1.0)
    assert info["rank"] == 3 and info["lambda_high"] == pytest.approx(1.0) and info["rho"] == 0.0
    torch.testing.assert_close(new, delta, atol=1e-5, rtol=1e-5)


def test_monosoup_relative_update_test_skips_tiny_updates():
    base = torch.randn(16, 16, generator=torch.Generator().manual_seed(3))
    delta = 1e-8 * torch.randn(16, 16, generator=torch.Generator().manual_seed(4))
    new, info = monosoup_update(delta, base, min_rel_update=1e-6)
    assert not info["processed"] and torch.equal(new, delta)
    _, info = monosoup_update(delta, base, min_rel_update=1e-12)
    assert info["processed"]
    zero, info = monosoup_update(torch.zeros(4, 6))
    assert not info["processed"] and torch.equal(zero, torch.zeros(4, 6))


def test_merge_monosoup_is_monosoup_of_the_mean_task_vector():
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(20, 12, generator=gen, dtype=torch.float64)
    d1 = with_spectrum([4.0, 2.0, 0.5, 0.2], 20, 12, seed=6)
    d2 = with_spectrum([3.0, 1.0, 0.3], 20, 12, seed=7)
    ws = [(base + d1).float(), (base + d2).float()]
    mean_delta = (ws[0].double() + ws[1].double()) / 2 - base.float().double()
    s = torch.linalg.svd(mean_delta).S.tolist()
    for mode in ("energy", "effective_rank"):
        k = ref_rank_energy(s, 0.8) if mode == "energy" else ref_rank_effective(s)
        merged, info = merge_param("monosoup", base.float(), ws, rank_mode=mode, energy_ratio=0.8)
        assert info["rank"] == k
        ref = base.float().double() + ref_monosoup(mean_delta, k)
        torch.testing.assert_close(merged.double(), ref, atol=2e-5, rtol=1e-4)


def test_monosoup_conv_shaped_tensor_uses_out_by_rest_view():
    delta = torch.randn(6, 3, 2, 2, generator=torch.Generator().manual_seed(8))
    new, info = monosoup_update(delta, energy_ratio=0.8)
    k = ref_rank_energy(torch.linalg.svd(delta.reshape(6, 12).double()).S.tolist(), 0.8)
    assert new.shape == delta.shape and info["rank"] == k
    torch.testing.assert_close(new.double(), ref_monosoup(delta, k), atol=2e-5, rtol=1e-4)


@settings(max_examples=20, deadline=None)
@given(m=st.integers(2, 12), n=st.integers(2, 12), seed=st.integers(0, 10_000),
       ratio=st.floats(0.05, 1.0), mode=st.sampled_from(["energy", "effective_rank"]))
def test_monosoup_shrinks_and_keeps_the_subspaces(m, n, seed, ratio, mode):
    """λ ∈ [0, 1] on orthogonal parts: the edit never grows Δ, and its singular vectors are Δ's."""
    delta = torch.randn(m, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).float()
    new, info = monosoup_update(delta, rank_mode=mode, energy_ratio=ratio)
    assert 0.0 <= info["lambda_low"] <= 1.0 and 0.0 <= info["lambda_high"] <= 1.0
    assert 1 <= info["rank"] <= min(m, n)
    assert torch.linalg.norm(new) <= torch.linalg.norm(delta) * (1 + 1e-5)
    torch.testing.assert_close(new.double(), ref_monosoup(delta, info["rank"]), atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------ SVD soup, average, none
def test_svd_truncate_is_eckart_young():
    delta = with_spectrum([6.0, 4.0, 2.0, 1.0, 0.5], 16, 10, seed=9).float()
    for r in (1, 2, 3, 10, 50):
        approx = svd_truncate(delta, r)
        torch.testing.assert_close(approx.double(), ref_truncate(delta, r), atol=1e-5, rtol=1e-5)
        err = torch.linalg.norm(delta.double() - approx.double()) ** 2
        assert err.item() == pytest.approx(sum(s * s for s in [6.0, 4.0, 2.0, 1.0, 0.5][r:]), abs=1e-4)
        assert torch.linalg.matrix_rank(approx.double(), atol=1e-4).item() == min(r, 5)
    with pytest.raises(ValueError, match="rank must be >= 1"):
        svd_truncate(delta, 0)


def test_merge_svd_soup_is_base_plus_mean_of_truncations():
    gen = torch.Generator().manual_seed(10)
    base = torch.randn(14, 9, generator=gen)
    ws = [base + torch.randn(14, 9, generator=gen) for _ in range(3)]
    merged, info = merge_param("svd_soup", base, ws, rank=2)
    ref = base.double() + sum(ref_truncate(w - base, 2) for w in ws) / 3
    torch.testing.assert_close(merged.double(), ref, atol=1e-5, rtol=1e-5)
    assert info["rank"] == 2 and info["full_rank"] == 9 and 0.0 < info["energy_kept"] < 1.0


def test_average_none_and_vectors():
    gen = torch.Generator().manual_seed(11)
    base, a, b = (torch.randn(7, 5, generator=gen) for _ in range(3))
    merged, info = merge_param("average", base, [a, b])
    torch.testing.assert_close(merged, (a + b) / 2)
    assert info == {"rank": 5, "full_rank": 5, "energy_kept": 1.0}
    out, info = merge_param("none", base, [a, b])
    assert out is a and info == {}
    vb, va, vc = (torch.randn(7, generator=gen) for _ in range(3))
    for method in ("monosoup", "svd_soup", "average"):
        out, info = merge_param(method, vb, [va, vc])
        torch.testing.assert_close(out, (va + vc) / 2)
        assert info == {}
        out, _ = merge_param(method, torch.tensor(1.0), [torch.tensor(2.0), torch.tensor(4.0)])
        assert out.item() == 3.0
    assert merge_param("none", vb, [va, vc])[0] is va


@pytest.mark.parametrize("method", ["monosoup", "svd_soup", "average", "none"])
def test_dtype_preserved(method):
    gen = torch.Generator().manual_seed(12)
    base = torch.randn(12, 8, generator=gen)
    ws = [(base + 0.3 * torch.randn(12, 8, generator=gen)).bfloat16() for _ in range(2)]
    merged, _ = merge_param(method, base, ws)
    assert merged.dtype == torch.bfloat16 and merged.shape == base.shape
    ref, _ = merge_param(method, base, [w.float() for w in ws])
    torch.testing.assert_close(merged.float(), ref, atol=0.03, rtol=0.02)  # bf16 rounding of the result
    v, _ = merge_param(method, base[0], [w[0] for w in ws])
    assert v.dtype == torch.bfloat16
    new, _ = monosoup_update(ws[0].float().half() - base.half())
    assert new.dtype == torch.float16


def test_errors_are_clear():
    a, b = torch.zeros(3, 4), torch.zeros(4, 3)
    with pytest.raises(ValueError, match=r"unknown merge method 'ties'"):
        merge_param("ties", a, [a])
    with pytest.raises(ValueError, match=r"shape mismatch: ws\[1\] has shape \(4, 3\), w_base has shape \(3, 4\)"):
        merge_param("average", a, [a, b])
    with pytest.raises(ValueError, match="at least one checkpoint"):
        merge_param("monosoup", a, [])
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        monosoup_update(torch.zeros(5))
    with pytest.raises(ValueError, match="w_base shape"):
        monosoup_update(a, b)


def test_summarize_means_over_matrices():
    infos = [{"rank": 2, "energy_kept": 0.5, "lambda_high": 0.4, "lambda_low": 0.6, "processed": True},
             {"rank": 4, "energy_kept": 0.9, "lambda_high": 0.8, "lambda_low": 0.2, "processed": False}, {}]
    s = summarize(infos)
    assert s == pytest.approx({"matrices": 2.0, "mean_rank": 3.0, "mean_energy_kept": 0.7,
                               "mean_lambda_high": 0.6, "mean_lambda_low": 0.4, "processed": 1.0})
    assert math.isnan(summarize([{}])["mean_rank"])


@pytest.mark.parametrize("shape", [(7, 30), (30, 7), (12, 12)])
def test_spectrum_matches_svd_for_wide_tall_and_square(shape):
    """The Gram-matrix spectrum equals the SVD's, and the rank-k projection equals U_k Σ_k V_kᵀ."""
    g = torch.Generator().manual_seed(sum(shape))
    d = torch.randn(*shape, generator=g)
    sigma, vectors, left = _spectrum(d)
    assert left == (shape[0] <= shape[1])
    ref = torch.linalg.svd(d.double(), full_matrices=False)
    torch.testing.assert_close(sigma, ref.S, atol=1e-10, rtol=1e-8)
    for k in (1, 3, min(shape)):
        want = (ref.U[:, :k] * ref.S[:k]) @ ref.Vh[:k]
        torch.testing.assert_close(_leading(d, vectors, left, k).double(), want, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ mutation sweep: boundaries and defaults
def test_energy_rank_is_the_smallest_k_that_reaches_the_ratio_exactly():
    """Σ_{i≤k} σ_i² / Σ σ_i² ≥ R: a fraction that lands exactly on R already counts (four equal σ,
    R = 0.5: k = 2, not 3)."""
    assert ref_rank_energy([1.0] * 4, 0.5) == 2
    assert choose_rank(torch.tensor([1.0] * 4), "energy", 0.5) == 2
    assert choose_rank(torch.tensor([1.0] * 4), "energy", 0.75) == 3


SIGMA_DEFAULTS = [math.sqrt(0.6), math.sqrt(0.21), math.sqrt(0.19)]  # energy 0.6, 0.81, 1.0; exp(H) ≈ 2.9


def test_monosoup_defaults_are_energy_rank_at_r_0_8():
    """Without arguments both monosoup_update and merge_param use rank_mode="energy" with R = 0.8:
    on a spectrum whose energy fractions are 0.6, 0.81, 1.0 that is k = 2 (R = 0.85 or 0.9 would
    give 3, and so would the effective rank)."""
    assert ref_rank_energy(SIGMA_DEFAULTS, 0.8) == 2 and ref_rank_effective(SIGMA_DEFAULTS) == 3
    delta = with_spectrum(SIGMA_DEFAULTS, 10, 7, seed=13).float()
    new, info = monosoup_update(delta)
    assert info["rank"] == 2
    torch.testing.assert_close(new.double(), ref_monosoup(delta, 2), atol=1e-5, rtol=1e-4)
    base = torch.randn(10, 7, generator=torch.Generator().manual_seed(14))
    merged, info = merge_param("monosoup", base, [base + delta])
    assert info["rank"] == 2
    torch.testing.assert_close(merged.double(), base.double() + ref_monosoup(delta, 2), atol=1e-5, rtol=1e-4)


def test_relative_update_threshold_defaults_to_1e_6_and_merge_param_applies_it():
    """τ defaults to 1e-6 (the reference implementation's): a relative update of 1e-5 is edited, one
    of 1e-7 is kept as it is, and merge_param measures it against the base it is given."""
    base = torch.randn(12, 12, generator=torch.Generator().manual_seed(15))
    noise = torch.randn(12, 12, generator=torch.Generator().manual_seed(16))
    unit = noise * (torch.linalg.norm(base) / torch.linalg.norm(noise))  # ‖unit‖_F = ‖base‖_F
    _, info = monosoup_update(1e-5 * unit, base)
    assert info["processed"]
    small = 1e-7 * unit
    new, info = monosoup_update(small, base)
    assert not info["processed"] and torch.equal(new, small)
    merged, info = merge_param("monosoup", base, [base + small])
    assert not info["processed"] and info["lambda_high"] == 1.0
    torch.testing.assert_close(merged, base + small, rtol=0, atol=0)


def test_svd_soup_energy_kept_is_the_mean_over_checkpoints_and_rank_defaults_to_8():
    """energy_kept of svd_soup is mean_i (Σ_{j≤r} σ_ij² / Σ_j σ_ij²) with each checkpoint's own
    spectrum; without ``rank`` the truncation rank is 8; a rank above min(m, n) reports min(m, n)."""
    s1 = [4.0, 2.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]
    s2 = [3.0, 3.0, 1.0, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1]
    base = torch.zeros(12, 10)
    ws = [with_spectrum(s1, 12, 10, seed=17).float(), with_spectrum(s2, 12, 10, seed=18).float()]
    for r in (1, 3):
        _, info = merge_param("svd_soup", base, ws, rank=r)
        want = (sum(x * x for x in s1[:r]) / sum(x * x for x in s1) + sum(x * x for x in s2[:r]) / sum(x * x for x in s2)) / 2
        assert info["rank"] == r and info["energy_kept"] == pytest.approx(want, rel=1e-6)
    merged, info = merge_param("svd_soup", base, ws)
    assert info["rank"] == 8
    torch.testing.assert_close(merged.double(), (ref_truncate(ws[0], 8) + ref_truncate(ws[1], 8)) / 2, atol=1e-5, rtol=1e-5)
    merged, info = merge_param("svd_soup", base, ws, rank=50)
    assert info == {"rank": 10, "full_rank": 10, "energy_kept": pytest.approx(1.0)}
    torch.testing.assert_close(merged, (ws[0] + ws[1]) / 2, atol=1e-5, rtol=1e-5)


def test_rank_of_a_conv_shaped_average_uses_the_out_by_rest_view():
    """A [6, 3, 2, 2] tensor is the 6 × 12 matrix of the module docstring: full rank 6 (not
    min(6, 2) from the last axis), for average and svd_soup alike."""
    gen = torch.Generator().manual_seed(19)
    base, a, b = (torch.randn(6, 3, 2, 2, generator=gen) for _ in range(3))
    _, info = merge_param("average", base, [a, b])
    assert info == {"rank": 6, "full_rank": 6, "energy_kept": 1.0}
    _, info = merge_param("svd_soup", base, [a, b], rank=50)
    assert info["rank"] == 6 and info["full_rank"] == 6
