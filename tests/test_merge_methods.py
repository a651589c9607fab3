"""Merge methods (merge/methods.py) against plain references written here from the papers."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from deltafleet.merge.methods import REGISTRY, get_method, opcm_project, trim_top
from deltafleet.merge.soup import merge_param


def _setup(shape=(6, 5), n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=g)
    models = [base + 0.3 * torch.randn(shape, generator=g) for _ in range(n)]
    return base, models


def test_registry_names_every_method_of_the_issue():
    assert set(REGISTRY) == {"linear", "task_arithmetic", "ties", "dare_linear", "dare_ties", "monosoup",
                             "svd_soup", "opcm", "slerp"}
    with pytest.raises(ValueError, match="unknown merge method 'model_stock'; known: dare_linear, dare_ties"):
        get_method("model_stock")
    with pytest.raises(ValueError, match="merge method 'ties' has no parameter 'densty'; its parameters: "
                                         "weights, density, scaling$"):
        get_method("ties", densty=0.5)
    with pytest.raises(ValueError, match="merge method 'ties' has no parameter 'rank'"):
        get_method("ties", rank=4)  # svd_soup's
    bad = [("ties", "density", "abc", "a finite number"), ("ties", "density", True, "a finite number"),
           ("ties", "scaling", float("nan"), "a finite number"), ("task_arithmetic", "scaling", float("inf"),
                                                                  "a finite number"),
           ("dare_ties", "seed", 1.5, "an integer"), ("linear", "normalize", 1, "true or false"),
           ("monosoup", "rank_mode", 3, "a text"), ("ties", "weights", [1, "x"], "a list of numbers, one per model"),
           ("linear", "weights", 2.0, "a list of numbers, one per model")]
    for method, key, value, kind in bad:  # what a command line can give (params.density=abc)
        with pytest.raises(ValueError, match=re.escape(f"merge method '{method}': {key} must be {kind}, "
                                                       f"got {value!r}")):
            get_method(method, **{key: value})
    assert get_method("dare_ties", seed=7.0, density=1).density == 1.0  # integral numbers are fine
    with pytest.raises(ValueError, match=r"density must be in \(0, 1\], got 1.5"):
        get_method("dare_ties", density=1.5)


def test_linear_and_task_arithmetic():
    base, ms = _setup()
    got = get_method("linear", weights=[1, 3, 0]).merge("w", base, ms)
    torch.testing.assert_close(got, (ms[0] + 3 * ms[1]) / 4)
    got = get_method("task_arithmetic", scaling=0.4).merge("w", base, ms)
    torch.testing.assert_close(got, base + 0.4 * sum(m - base for m in ms))
    with pytest.raises(ValueError, match="2 weights for 3 models"):
        get_method("linear", weights=[1, 2]).merge("w", base, ms)
    bf = get_method("linear").merge("w", base.bfloat16(), [m.bfloat16() for m in ms])
    assert bf.dtype == torch.bfloat16
    ints = torch.arange(4)
    assert torch.equal(get_method("ties").merge("pos", ints, [ints + 1, ints + 2]), ints)  # integer buffers: the base


def _ties_reference(base, models, density, scaling, weights):
    """TIES-Merging, Alg. 1 of arXiv:2306.01708, entry by entry in numpy (keep the top-k magnitudes)."""
    taus = [(m.double() - base.double()).numpy().ravel() for m in models]
    k = math.ceil(density * taus[0].size)
    trimmed = []
    for t in taus:
        keep = np.argsort(-np.abs(t), kind="stable")[:k]
        tt = np.zeros_like(t)
        tt[keep] = t[keep]
        trimmed.append(tt)
    out = np.zeros_like(taus[0])
    for j in range(out.size):
        vals = [w * t[j] for w, t in zip(weights, trimmed)]
        gamma = np.sign(sum(vals))
        agree = [(v, abs(w)) for v, w in zip(vals, weights) if v != 0 and np.sign(v) == gamma]
        out[j] = sum(v for v, _ in agree) / sum(w for _, w in agree) if agree else 0.0
    return base + scaling * torch.from_numpy(out).view_as(base)


@pytest.mark.parametrize("density, weights", [(0.2, [1, 1, 1]), (0.6, [1, 2, 0.5]), (1.0, [1, 1, 1])])
def test_ties_matches_the_papers_algorithm(density, weights):
    base, ms = _setup(seed=3)
    got = get_method("ties", density=density, scaling=0.7, weights=weights).merge("w", base, ms)
    torch.testing.assert_close(got, _ties_reference(base, ms, density, 0.7, weights).float(), rtol=1e-5, atol=1e-6)
    t = torch.tensor([0.1, -3.0, 2.0, -0.5])
    assert torch.equal(trim_top(t, 0.5), torch.tensor([0.0, -3.0, 2.0, 0.0]))


def test_blocks_of_rows_give_the_same_ties_as_the_whole_tensor(monkeypatch):
    """TIES' thresholds are taken over the whole tensor, even when the rows come in blocks."""
    import deltafleet.merge.methods as mm

    base, ms = _setup((64, 16), seed=8)
    whole = get_method("ties", density=0.3).merge("w", base, ms)
    monkeypatch.setattr(mm, "BLOCK_ELEMENTS", 16 * 5)  # 5 rows per block
    blocked = get_method("ties", density=0.3).merge("w", base, ms)
    torch.testing.assert_close(blocked, whole, rtol=0, atol=0)
    torch.testing.assert_close(whole, _ties_reference(base, ms, 0.3, 1.0, [1, 1, 1]).float(), rtol=1e-5, atol=1e-6)


def test_dare_drops_and_rescales_and_is_seeded_per_tensor():
    base = torch.zeros(200, 200)
    tau = torch.ones(200, 200)
    m = get_method("dare_linear", density=0.25, seed=7)
    got = m.merge("layer.w", base, [base + tau])
    kept = got != 0
    assert abs(kept.float().mean().item() - 0.25) < 0.01  # p = 1 − density dropped
    assert torch.all(got[kept] == 4.0)  # the rest rescaled by 1/density
    assert torch.equal(m.merge("layer.w", base, [base + tau]), got)  # same seed and name: same mask
    assert not torch.equal(m.merge("other.w", base, [base + tau]), got)
    # expectation: over many seeds the mean is the task vector (DARE's unbiasedness, Eq. 3)
    mean = torch.stack([get_method("dare_linear", density=0.5, seed=s).merge("x", base[:20, :20], [tau[:20, :20]])
                        for s in range(400)]).mean(0)
    assert abs(mean.mean().item() - 1.0) < 0.02


def test_dare_ties_is_dare_then_disjoint_merge():
    base, ms = _setup(seed=5)
    m = get_method("dare_ties", density=0.5, seed=1, weights=[1, 1, 1])
    got = m.merge("p", base, ms)
    dropped = m._dropped("p", 0, [x - base for x in ms])  # one block: the tensor is small
    ref = _ties_reference(base, [base + d for d in dropped], 1.0, 1.0, [1, 1, 1])
    torch.testing.assert_close(got, ref.float(), rtol=1e-5, atol=1e-6)


def test_monosoup_and_svd_soup_are_the_training_callbacks_functions():
    base, ms = _setup((12, 9), seed=2)
    torch.testing.assert_close(get_method("monosoup").merge("w", base, ms), merge_param("monosoup", base, ms)[0])
    torch.testing.assert_close(get_method("svd_soup", rank=2).merge("w", base, ms),
                               merge_param("svd_soup", base, ms, rank=2)[0])


@pytest.mark.parametrize("shape", [(8, 8), (12, 5), (5, 12)])
@pytest.mark.parametrize("alpha", [0.3, 0.7])
def test_opcm_projection_equals_the_full_svd_definition(shape, alpha):
    g = torch.Generator().manual_seed(11)
    r, tau = torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(shape, generator=g, dtype=torch.float64)
    u, s, vh = torch.linalg.svd(r, full_matrices=True)
    k = int(((s.cumsum(0) / s.sum()) > alpha).float().argmax())
    p = u.T @ tau @ vh.T
    p.diagonal().zero_()
    p[:k, :k] = 0
    want = u @ p @ vh
    torch.testing.assert_close(opcm_project(r, tau, alpha), want, rtol=1e-9, atol=1e-9)
    assert k > 0 or alpha < 0.5  # at 0.7 the dominant block is really removed


def test_opcm_rescales_to_the_mean_task_vector_norm_over_the_whole_model():
    g = torch.Generator().manual_seed(4)
    params = {"a.weight": torch.randn(10, 6, generator=g), "a.bias": torch.randn(10, generator=g)}
    models = [{k: v + s * torch.randn(v.shape, generator=g) for k, v in params.items()} for s in (0.1, 0.3, 0.2)]
    m = get_method("opcm", alpha=0.5)
    for k, v in params.items():
        m.observe(k, v, [x[k] for x in models])
    out = {k: m.merge(k, v, [x[k] for x in models]) for k, v in params.items()}
    # by hand: running sums, then one global scale
    sums = {}
    for k, v in params.items():
        taus = [x[k] - v for x in models]
        r = taus[0]
        for t in taus[1:]:
            r = r + (opcm_project(r, t, 0.5) if t.dim() == 2 else t)
        sums[k] = r
    norm_r = math.sqrt(sum(float(r.pow(2).sum()) for r in sums.values()))
    mean_tau = np.mean([math.sqrt(sum(float((x[k] - params[k]).pow(2).sum()) for k in params)) for x in models])
    for k in params:
        torch.testing.assert_close(out[k], params[k] + sums[k] * (mean_tau / norm_r), rtol=1e-5, atol=1e-6)
    merged_norm = math.sqrt(sum(float((out[k] - params[k]).pow(2).sum()) for k in params))
    assert merged_norm == pytest.approx(mean_tau, rel=1e-5)
    one = get_method("opcm")  # a single model is returned as it is
    one.observe("a.weight", params["a.weight"], [models[0]["a.weight"]])
    torch.testing.assert_close(one.merge("a.weight", params["a.weight"], [models[0]["a.weight"]]), models[0]["a.weight"])
    with pytest.raises(RuntimeError, match="observe"):
        get_method("opcm").merge("a.weight", params["a.weight"], [models[0]["a.weight"]])


# --------------------------------------------------------------------------------------------
# mutation sweep: cases the tests above left open
# --------------------------------------------------------------------------------------------


def test_task_arithmetic_and_dare_linear_apply_the_weights():
    """``W₀ + λ Σ w_i τ_i``: each model's weight scales its own task vector (task arithmetic, and
    DARE's linear merge of the dropped-and-rescaled vectors at density 1, where nothing is dropped)."""
    base, ms = _setup(seed=6)
    w = [1.0, -0.5, 2.0]
    want = base + 0.4 * sum(wi * (m - base) for wi, m in zip(w, ms))
    torch.testing.assert_close(get_method("task_arithmetic", scaling=0.4, weights=w).merge("w", base, ms), want)
    torch.testing.assert_close(get_method("dare_linear", density=1.0, scaling=0.4, weights=w).merge("w", base, ms),
                               want)


def test_ties_with_a_negative_weight_divides_by_the_weights_magnitudes():
    """The disjoint mean divides by ``Σ |w_i|`` over the agreeing entries (a negative weight flips a
    task vector, it does not subtract from the count)."""
    base, ms = _setup(seed=3)
    w = [1.0, -2.0, 0.5]
    got = get_method("ties", density=0.6, scaling=0.7, weights=w).merge("w", base, ms)
    torch.testing.assert_close(got, _ties_reference(base, ms, 0.6, 0.7, w).float(), rtol=1e-5, atol=1e-6)


def test_dare_draws_a_fresh_mask_for_each_block_of_rows(monkeypatch):
    """A tensor merged in blocks of rows gets an independent mask per block: two blocks of the same
    constant task vector must not drop the same columns (about density² of the entries agree)."""
    import deltafleet.merge.methods as mm

    monkeypatch.setattr(mm, "BLOCK_ELEMENTS", 64 * 8)  # 8 rows of 64 per block
    base, tau = torch.zeros(16, 64), torch.ones(16, 64)
    got = get_method("dare_linear", density=0.5, seed=3).merge("w", base, [tau])
    first, second = got[:8] != 0, got[8:] != 0
    assert abs(first.float().mean().item() - 0.5) < 0.1 and abs(second.float().mean().item() - 0.5) < 0.1
    assert not torch.equal(first, second)
    assert (first == second).float().mean().item() < 0.7  # independent: ~0.5 agreement, not 1


def test_a_model_of_another_shape_is_a_value_error():
    """Every model must have the base's shape; a mismatch is named, not broadcast or reshaped."""
    base, ms = _setup((6, 5))
    for method in ("linear", "task_arithmetic", "ties", "opcm"):
        with pytest.raises(ValueError, match=r"w: shape \(5, 6\) differs from the base's \(6, 5\)"):
            get_method(method).merge("w", base, [ms[0], ms[1].T.contiguous()])


def test_density_zero_and_other_bad_method_parameters_are_refused():
    """Density 0 would drop everything (DARE then divides by 0), so it is outside (0, 1]; OPCM's alpha
    lies in (0, 1); non-finite weights and weights summing to 0 in a normalised linear merge are refused."""
    for method in ("ties", "dare_linear", "dare_ties"):
        with pytest.raises(ValueError, match=r"density must be in \(0, 1\], got 0"):
            get_method(method, density=0.0)
    for alpha in (0.0, 1.0):
        with pytest.raises(ValueError, match=rf"alpha must be in \(0, 1\), got {alpha}"):
            get_method("opcm", alpha=alpha)
    with pytest.raises(ValueError, match=r"weights must be finite, got \[1.0, nan\]"):
        get_method("linear", weights=[1.0, float("nan")])
    # found by a fresh user: ties with weights [0, 0] gave the base back, where linear refused them; an
    # out-of-range seed was torch's "Overflow when unpacking long long"; monosoup took a negative
    # min_rel_update, and neither soup checked its settings as the training callback does
    for method in ("ties", "task_arithmetic", "dare_linear", "linear"):
        with pytest.raises(ValueError, match=rf"^merge method '{method}': weights are all 0, so no model would "
                                             r"take part in the merge: \[0, 0\]$"):
            get_method(method, weights=[0, 0])
    for params, message in [(dict(seed=99999999999999), "seed must be an integer of magnitude below 2^40, got "
                                                          "99999999999999")]:
        with pytest.raises(ValueError, match=re.escape(f"merge method 'dare_ties': {message}")):
            get_method("dare_ties", **params)
    assert get_method("dare_linear", seed=-(2**40 - 1)).seed == -(2**40 - 1)
    for method, params, message in [
            ("monosoup", dict(min_rel_update=-5.0), "min_rel_update must be a number ≥ 0, got -5.0"),
            ("monosoup", dict(energy_ratio=1.5), "energy_ratio must be a number in (0, 1], got 1.5"),
            ("monosoup", dict(rank_mode="big"), "rank_mode must be one of "),
            ("svd_soup", dict(rank=0), "rank must be a whole number ≥ 1, got 0")]:
        with pytest.raises(ValueError, match="^" + re.escape(f"merge method '{method}': {message}")):
            get_method(method, **params)
    # found by a fresh user: refused only once the merge reached its first tensor; now by get_method
    with pytest.raises(ValueError, match=r"^merge method 'linear': the weights sum to 0, which a normalised merge "
                                         r"divides by: \[1, -1\]"):
        get_method("linear", weights=[1, -1])
    base, ms = _setup(n=2)
    # normalize=False: a plain weighted sum of the models, zero-sum weights allowed
    torch.testing.assert_close(get_method("linear", weights=[1, -1], normalize=False).merge("w", base, ms),
                               ms[0] - ms[1])


def test_the_merge_help_lists_every_method_with_its_defaults():
    """Found by a fresh user: ``merge/run.py --help`` listed every config group under conf/ (``merge``:
    the training callbacks, which the merge job refuses) and no method; ``--cfg job`` shows params as
    null. The help lists each registered method with its parameters' defaults, as the code has them."""
    import inspect
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "merge/run.py", "--help"], cwd=repo, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    listed = dict(re.findall(r"^  (\w+) {2,}(.+)$", out.stdout, re.M))
    assert sorted(listed) == sorted(REGISTRY)
    for name, cls in REGISTRY.items():
        params = [p for p in inspect.signature(cls.__init__).parameters.values() if p.name != "self"]
        want = ", ".join(p.name if p.default is None else
                         f"{p.name}={str(p.default).lower() if isinstance(p.default, bool) else p.default}"
                         for p in params)
        assert listed[name].split(" (")[0] == want, (name, listed[name])
    assert "Configuration groups" not in out.stdout and "trainer" not in out.stdout


def _slerp_reference(v0: torch.Tensor, v1: torch.Tensor, t: float) -> torch.Tensor:
    """Shoemake's slerp of two tensors as vectors, in float64, as mergekit writes it (normalised
    copies for the angle, the originals blended; linear where |cos θ| > 0.9995)."""
    a, b = v0.double().flatten(), v1.double().flatten()
    na, nb = a.norm(), b.norm()
    cos = float((a / (na if na > 1e-8 else 1)) @ (b / (nb if nb > 1e-8 else 1)))
    if abs(cos) > 0.9995:
        out = (1 - t) * a + t * b
    else:
        theta = math.acos(cos)
        out = (math.sin((1 - t) * theta) * a + math.sin(t * theta) * b) / math.sin(theta)
    return out.reshape(v0.shape)


@pytest.mark.parametrize("t", [0.0, 0.3, 0.5, 1.0])
def test_slerp_follows_the_great_circle_from_the_base_to_the_model(t):
    """Found missing by a reviewer (mergekit's most used two-model merge). Each tensor is one vector:
    the reference's blend, the endpoints at t = 0 and 1, and for two orthogonal unit vectors a unit
    vector at angle tπ/2 (where linear interpolation would shorten it)."""
    base, (model,) = _setup(shape=(6, 5), n=1, seed=3)
    model = model + 2.0 * torch.randn(6, 5, generator=torch.Generator().manual_seed(9))  # far from parallel
    got = get_method("slerp", t=t).merge("w", base, [model])
    torch.testing.assert_close(got.double(), _slerp_reference(base, model, t), rtol=1e-5, atol=1e-5)
    e0, e1 = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    got = get_method("slerp", t=t).merge("v", e0, [e1])
    torch.testing.assert_close(got, torch.tensor([math.cos(t * math.pi / 2), math.sin(t * math.pi / 2)]))
    if t in (0.0, 1.0):
        torch.testing.assert_close(get_method("slerp", t=t).merge("w", base, [model]), model if t else base)


def test_slerp_of_nearly_parallel_or_zero_tensors_and_its_refusals():
    """Nearly parallel tensors (|cos θ| > 0.9995) and a zero tensor blend as the reference does; the
    blend keeps the base's dtype; t outside [0, 1] and another number of models than one are refused."""
    base = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    near = base * 1.5 + 1e-4
    torch.testing.assert_close(get_method("slerp", t=0.25).merge("w", base, [near]), 0.75 * base + 0.25 * near)
    zero = torch.zeros(4, 8)
    torch.testing.assert_close(get_method("slerp", t=0.5).merge("b", zero, [base]).double(),
                               _slerp_reference(zero, base, 0.5), rtol=1e-6, atol=1e-6)
    got = get_method("slerp", t=0.5).merge("w", base.bfloat16(), [(base + 1).bfloat16()])
    assert got.dtype == torch.bfloat16
    with pytest.raises(ValueError, match=re.escape("merge method 'slerp': t must be in [0, 1] (0: the base, 1: "
                                                   "the model), got 1.5")):
        get_method("slerp", t=1.5)
    with pytest.raises(ValueError, match="merge method 'slerp' merges the base with 1 model"):
        get_method("slerp").merge("w", base, [base, base])

def test_ties_keeps_only_the_top_density_share_of_a_bf16_task_vector():
    """TIES' trim keeps the top k = ceil(density·n) magnitudes (arXiv:2306.01708 Alg. 1; mergekit's
    topk). Found by a reviewer: every entry tied with the k-th largest was kept, and the task vector
    of a bf16 fine-tune is a few ulps an entry, so density=0.2 kept about 37% of the entries here."""
    g = torch.Generator().manual_seed(0)
    base = (0.02 * torch.randn(256, 256, generator=g)).bfloat16()
    model = (base.float() + 1e-4 * torch.randn(256, 256, generator=g)).bfloat16()
    tau = model.float() - base.float()
    density = 0.2
    k = math.ceil(density * tau.numel())
    got = get_method("ties", density=density, scaling=1.0).merge("w", base, [model])
    kept = (got.float() - base.float())  # one model: the merge is W0 + trimmed τ (exact in bf16)
    # the reference: the k largest magnitudes (which of several equal ones is kept does not matter)
    ref_mags = tau.abs().flatten().topk(k).values.sort().values
    got_mags = kept.abs().flatten()[kept.flatten() != 0].sort().values
    assert got_mags.numel() == k, f"density {density}: kept {got_mags.numel()} of {tau.numel()} entries, expected {k}"
    torch.testing.assert_close(got_mags, ref_mags, rtol=0, atol=0)
