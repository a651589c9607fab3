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
    """The distribution a row samples from, written plainly: softmax(logits / T) over the top_k most
    likely tokens, renormalised, then its smallest prefix (by probability) reaching top_p, renormalised
    (vLLM's and transformers' order: top-p measures the top-k's own distribution)."""
    p = torch.softmax(logits.double() / temperature, -1)
    order = torch.argsort(p, descending=True)
    if top_k:
        p[order[top_k:]] = 0.0
        p = p / p.sum()
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
                                                     (1.0, 1.0, 3), (0.9, 0.6, 4), (1.0, 0.05, 0),
                                                     (1.0, 0.5, 2)])
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


def _all_ones_hash(key: torch.Tensor, vocab: int) -> tuple[int, int]:
    """The first ``(position, token)`` whose hash under ``key`` has its low 24 bits all ones (the draw
    that rounds to 1 in float32), searched position by position (about one in 500 holds one)."""
    from deltafleet.serve import sampling as s

    tok = s._fmix32(torch.arange(vocab, dtype=torch.int32) * s._GOLDEN + 0x165667B1)
    for p0 in range(0, 1 << 16, 256):
        pos = torch.arange(p0, p0 + 256, dtype=torch.int32)
        row = s._fmix32(key[0, 0] ^ s._fmix32(key[0, 1] ^ s._fmix32(pos * s._GOLDEN + 1)))
        hit = ((s._fmix32(row[:, None] ^ tok) & 0xFFFFFF) == 0xFFFFFF).nonzero()
        if len(hit):
            return p0 + int(hit[0, 0]), int(hit[0, 1])
    raise AssertionError("no all-ones hash in 65 536 positions")


@pytest.mark.parametrize("top_k", [0, 5])
def test_a_banned_token_is_not_drawn_when_its_uniform_draw_rounds_to_one(top_k):
    """(2^24 − 0.5)/2^24 rounds to 1 in float32, whose Gumbel noise would be +inf: on a banned token
    (−inf) that made NaN, which argmax takes. At exactly that position and token, the noise is finite
    and the banned token (also one outside the top k) is never drawn."""
    vocab, seed = 32000, request_seed(7)
    key = _batch([(1.0, 1.0, 0, seed, 0)]).key
    position, token = _all_ones_hash(key, vocab)
    noise = gumbel_noise(key, torch.tensor([position], dtype=torch.int32), torch.arange(vocab))
    assert torch.isfinite(noise).all()
    logits = torch.linspace(0.0, 1.0, vocab)[None]
    logits[0, token] = -5.0  # the least likely: outside the top k too
    batch = SamplingBatch.build([(1.0, 1.0, top_k, seed, position)], "cpu", banned=[(0, token)])
    drawn = int(sample(logits.clone(), batch)[0])
    assert drawn != token and 0 <= drawn < vocab


def _penalized(logits: torch.Tensor, prompt: list[int], output: list[int], rep: float, freq: float,
               pres: float) -> torch.Tensor:
    """The penalties written plainly, token by token (vLLM's semantics)."""
    out = logits.clone()
    for t in set(prompt) | set(output) if rep != 1.0 else set(output):
        v = float(out[t])
        v = v / rep if v > 0 else v * rep
        out[t] = v - freq * output.count(t) - pres * (t in output)
    return out


def test_penalties_match_their_plain_reference_and_leave_other_rows_alone():
    torch.manual_seed(1)
    logits = torch.randn(3, 40) * 3
    prompt, output = [1, 2, 3, 2], [5, 5, 9, 3, 5]
    cases = [(1.3, 0.0, 0.0), (1.0, 0.7, 0.4), (0.8, -0.5, 1.5)]
    for rep, freq, pres in cases:
        want = _penalized(logits[0], prompt, output, rep, freq, pres)
        seen = {t: output.count(t) for t in output} | ({t: 0 for t in set(prompt) - set(output)} if rep != 1.0 else {})
        entries = [(0, t, c, rep, freq, pres) for t, c in seen.items()]
        got = logits.clone()
        rows = [(0.0, 1.0, 0, 1, 7)] * 3
        batch = SamplingBatch.build(rows, "cpu", penalties=entries)
        tokens = sample(got, batch)  # applies the penalties to `got` in place, then greedy
        torch.testing.assert_close(got[0], want)
        assert torch.equal(got[1:], logits[1:]) and tokens[0] == want.argmax()


@pytest.mark.parametrize("last", [5, 7, 2], ids=["seen", "new", "in-prompt-only"])
def test_a_last_output_token_on_the_device_counts_as_the_host_ones(last):
    """``fed``: a row's last output token taken from the previous step's tokens on the device (asynchronous
    scheduling) is counted as if it were on the host, whether the output already holds it, it is new, or
    only the prompt holds it (the repetition penalty's own)."""
    torch.manual_seed(2)
    logits = torch.randn(2, 40) * 3
    prompt, output = [1, 2, 3, 2], [5, 5, 9, 3, last]
    for rep, freq, pres in [(1.3, 0.0, 0.0), (1.0, 0.7, 0.4), (0.8, -0.5, 1.5)]:
        want = _penalized(logits[1], prompt, output, rep, freq, pres)
        known = output[:-1]
        seen = {t: known.count(t) for t in known} | ({t: 0 for t in set(prompt) - set(known)} if rep != 1.0 else {})
        entries = [(1, t, c, rep, freq, pres) for t, c in seen.items()]
        prev = torch.tensor([11, last, 12])  # the previous step's tokens: row 1 is this row's
        got = logits.clone()
        batch = SamplingBatch.build([(0.0, 1.0, 0, 1, 7)] * 2, "cpu", penalties=entries,
                                    fed=([(1, 1, rep, freq, pres)], prev))
        sample(got, batch)
        torch.testing.assert_close(got[1], want)
        assert torch.equal(got[0], logits[0])


@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.7])
def test_min_p_drops_the_unlikely_tokens_at_the_rows_temperature(temperature):
    """``min_p``: a token is drawn only if its probability at the row's temperature is at least min_p
    times the likeliest's; the rest follow the renormalised softmax; min_p 0 changes nothing."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.2, -0.5, -2.0])
    n, min_p = 40_000, 0.3
    rows = [(temperature, 1.0, 0, request_seed(s), 4) for s in range(n)]
    tokens = sample(logits.expand(n, -1).contiguous(), SamplingBatch.build(rows, "cpu", min_p=[min_p] * n))
    p = torch.softmax(logits.double() / temperature, -1)
    keep = p >= min_p * p.max()
    want = torch.where(keep, p, 0) / p[keep].sum()
    freq = torch.bincount(tokens, minlength=len(logits)).double() / n
    assert freq[~keep].sum() == 0 and keep.sum() < len(logits)
    assert torch.all((freq - want).abs() <= 5 * torch.sqrt(want * (1 - want) / n) + 1e-12), (freq, want)
    free = sample(logits.expand(n, -1).contiguous(), _batch(rows))
    assert torch.equal(sample(logits.expand(n, -1).contiguous(), SamplingBatch.build(rows, "cpu", min_p=[0.0] * n)),
                       free)


def test_penalties_through_the_engine_match_a_plain_greedy_loop(tiny_family):
    """Greedy generation with every penalty, through the scheduler's batched sampler, equals a loop
    written here: the whole sequence's logits, the penalties applied by hand, the argmax."""
    from deltafleet.serve.engine import Engine
    from deltafleet.serve.request import SamplingParams

    engine = Engine(tiny_family.base_dir, tiny_family.artifacts_dir, family="tiny")
    prompt = engine.encode_prompt("def main(x):\n    return x")
    params = dict(repetition_penalty=1.4, frequency_penalty=0.8, presence_penalty=0.5)
    got = [s.token_id for s in engine.generate("tiny-coder", prompt, SamplingParams(
        max_tokens=16, temperature=0.0, ignore_eos=True, **params))]
    ids, out = list(prompt), []
    delta = engine.get_delta("tiny-coder")
    with torch.inference_mode():
        for _ in range(16):
            logits = engine.model(torch.tensor([ids]), torch.arange(len(ids)), None, delta)[0, -1].float()
            tok = int(_penalized(logits, prompt, out, 1.4, 0.8, 0.5).argmax())
            ids.append(tok)
            out.append(tok)
    plain = [s.token_id for s in engine.generate("tiny-coder", prompt, SamplingParams(
        max_tokens=16, temperature=0.0, ignore_eos=True))]
    assert got == out and got != plain  # the penalties change this completion


def test_top_k_through_the_api(tiny_family):
    """``top_k`` (vLLM's parameter, ignored before): 1 at any temperature is greedy; -1, 0, null and a
    k past the vocabulary (up to past int64, which once failed every request of the step) are no
    limit; below -1 is a 400."""
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
                for k in ({}, {"top_k": -1}, {"top_k": 0}, {"top_k": None}, {"top_k": 2**31}, {"top_k": 2**64})]
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
