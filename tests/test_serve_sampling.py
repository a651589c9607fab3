"""The step sampler (serve/sampling.py) against references written here: greedy is argmax; the
draws follow softmax(logits / T) restricted to top-k and top-p (frequencies over many seeds within
a few standard errors); a row samples the same token alone or in any batch; a seed reproduces."""
from __future__ import annotations

import math

import pytest
import torch

from deltafleet.serve.sampling import SamplingBatch, gumbel_noise, request_seed, sample


def _batch(rows, device="cpu"):
    return SamplingBatch.build(rows, device)


def _allowed(logits: torch.Tensor, temperature: float, top_p: float, top_k: int) -> torch.Tensor:
    """The distribution a row samples from, written plainly: softmax(logits / T), the top_k most likely
    tokens, then the smallest prefix (by probability) reaching top_p, renormalised."""
    p = torch.softmax(logits.double() / temperature, -1)
    order = torch.argsort(p, descending=True)
    keep = torch.zeros_like(p, dtype=torch.bool)
    total = 0.0
    for rank, i in enumerate(order.tolist()):
        if (top_k and rank >= top_k) or (top_p < 1.0 and total > top_p):
            break
        keep[i] = True
        total += float(p[i])
    q = torch.where(keep, p, torch.zeros_like(p))
    return q / q.sum()


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.7, 1.0, 0), (1.3, 0.8, 0),
                                                     (1.0, 1.0, 3), (0.9, 0.6, 4), (1.0, 0.05, 0)])
def test_draws_follow_the_truncated_softmax(temperature, top_p, top_k):
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, float("-inf")])
    n = 40_000
    rows = [(temperature, top_p, top_k, request_seed(s), 17) for s in range(n)]
    tokens = sample(logits.expand(n, -1).contiguous(), _batch(rows))
    freq = torch.bincount(tokens, minlength=len(logits)).double() / n
    want = _allowed(logits, temperature, top_p, top_k)
    stderr = torch.sqrt(want * (1 - want) / n)
    assert torch.all((freq - want).abs() <= 5 * stderr + 1e-12), (freq, want)
    assert freq[want == 0].sum() == 0  # nothing outside top-k / top-p, nor the -inf token


def test_greedy_rows_take_the_argmax_beside_sampled_rows():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    rows = [(0.0, 1.0, 0, 1, 5), (1e-6, 0.3, 2, 2, 5), (1.0, 1.0, 0, 3, 5)] * 2
    tokens = sample(logits, _batch(rows))
    assert tokens[[0, 1, 3, 4]].tolist() == logits[[0, 1, 3, 4]].argmax(-1).tolist()


@pytest.mark.parametrize("temperature,top_p,top_k", [(0.0, 1.0, 0), (1.0, 1.0, 0), (1.0, 0.9, 5)])
def test_banned_tokens_are_never_drawn_and_other_rows_are_untouched(temperature, top_p, top_k):
    """``banned`` (row, token) pairs (a request's eos and stop token ids before its min_tokens): the
    row never draws them, greedy takes the best token left, and rows without bans draw as before."""
    logits = torch.tensor([[5.0, 4.0, 0.0, -1.0]]).expand(400, -1).contiguous()
    rows = [(temperature, top_p, top_k, request_seed(s), 3) for s in range(400)]
    free = sample(logits.clone(), _batch(rows))
    banned = [(i, t) for i in range(0, 400, 2) for t in (0, 1)]  # even rows: tokens 0 and 1 banned
    got = sample(logits.clone(), SamplingBatch.build(rows, "cpu", banned))
    assert torch.equal(got[1::2], free[1::2])
    assert not torch.isin(got[0::2], torch.tensor([0, 1])).any()
    if temperature == 0.0:
        assert got[0::2].tolist() == [2] * 200


def test_a_row_samples_the_same_alone_as_in_any_batch():
    """Batch invariance, the property continuous batching needs: each row's token depends only on its
    logits, parameters, seed and position, whoever else is in the step."""
    torch.manual_seed(1)
    logits = torch.randn(12, 300) * 3
    rows = [(t, p, k, request_seed(i), 40 + i) for i, (t, p, k) in
            enumerate([(1.0, 1.0, 0), (0.8, 0.9, 0), (1.2, 1.0, 20), (0.0, 1.0, 0)] * 3)]
    together = sample(logits, _batch(rows)).tolist()
    alone = [int(sample(logits[i:i + 1], _batch([rows[i]]))[0]) for i in range(12)]
    assert together == alone
    reordered = list(reversed(range(12)))
    assert sample(logits[reordered], _batch([rows[i] for i in reordered])).tolist() == together[::-1]
    only_plain = [i for i, r in enumerate(rows) if r[1] == 1.0 and r[2] == 0]  # no sort in that step
    assert sample(logits[only_plain], _batch([rows[i] for i in only_plain])).tolist() == \
        [together[i] for i in only_plain]


def test_seeds_and_positions_give_new_draws_and_reproduce():
    logits = torch.zeros(1, 1000)  # uniform: every draw is the noise's argmax
    def draw(seed, position):
        return int(sample(logits, _batch([(1.0, 1.0, 0, request_seed(seed), position)]))[0])

    assert draw(5, 10) == draw(5, 10)
    assert len({draw(5, pos) for pos in range(20)}) >= 15
    assert len({draw(s, 10) for s in (-1, 0, 1, 2**32 + 1, 2**64 - 1, 10**30)}) == 6


def test_gumbel_noise_is_standard_gumbel():
    key = torch.tensor([[123, -456]], dtype=torch.int32)
    g = gumbel_noise(key, torch.tensor([7], dtype=torch.int32), torch.arange(200_000))[0].double()
    euler_gamma = 0.5772156649
    assert abs(float(g.mean()) - euler_gamma) < 0.02
    assert abs(float(g.var()) - math.pi ** 2 / 6) < 0.05


def test_top_k_through_the_api(tiny_family):
    """``top_k`` (vLLM's parameter, ignored before): 1 at any temperature is greedy; -1, 0 and null
    are no limit; below -1 is a 400."""
    from fastapi.testclient import TestClient

    from deltafleet.serve.app import create_app
    from deltafleet.serve.engine import Engine

    engine = Engine(tiny_family.base_dir, tiny_family.artifacts_dir, family="tiny")
    body = {"model": "tiny-coder", "prompt": "def main(", "max_tokens": 12}
    with TestClient(create_app(engine)) as tc:
        greedy = tc.post("/v1/completions", json={**body, "temperature": 0}).json()["choices"][0]["text"]
        one = tc.post("/v1/completions", json={**body, "temperature": 1.5, "top_k": 1, "seed": 3})
        assert one.json()["choices"][0]["text"] == greedy
        free = [tc.post("/v1/completions", json={**body, "temperature": 1.5, "seed": 3, **k}).json()
                for k in ({}, {"top_k": -1}, {"top_k": 0}, {"top_k": None})]
        assert len({f["choices"][0]["text"] for f in free}) == 1 and free[0]["choices"][0]["text"] != greedy
        assert tc.post("/v1/completions", json={**body, "top_k": -2}).status_code == 400


@pytest.mark.gpu
def test_the_gpu_draws_what_the_cpu_draws():
    """The hash is integer arithmetic (int32 products wrap alike on both), so the noise agrees to float
    rounding and, on logits without near-ties, so do the tokens: a seed means the same on any device."""
    torch.manual_seed(2)
    logits = torch.randn(256, 32000) * 4
    rows = [(t, p, k, request_seed(i), 100 + i) for i, (t, p, k) in
            enumerate([(1.0, 1.0, 0), (0.7, 0.9, 0), (1.0, 1.0, 50), (0.0, 1.0, 0)] * 64)]
    cpu = sample(logits, _batch(rows))
    gpu = sample(logits.cuda(), _batch(rows, "cuda")).cpu()
    assert (cpu == gpu).float().mean() >= 0.99
    key = torch.tensor([[11, -7]], dtype=torch.int32)
    pos = torch.tensor([3], dtype=torch.int32)
    noise_cpu = gumbel_noise(key, pos, torch.arange(32000))
    noise_gpu = gumbel_noise(key.cuda(), pos.cuda(), torch.arange(32000, device="cuda")).cpu()
    assert torch.allclose(noise_cpu, noise_gpu, rtol=1e-5, atol=1e-5)
