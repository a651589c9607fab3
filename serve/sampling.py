"""Sampling for a whole step at once, on the device: greedy, temperature, top-k, top-p and a seed per
request, one host synchronisation per step.

Every row's randomness is a pure function of its request's seed, the position of the token being
sampled and the candidate token's id: a counter-based hash (MurmurHash3's 32-bit finaliser, applied
in rounds) gives each candidate a uniform draw, and the Gumbel-max trick (the argmax of the scaled
logits plus Gumbel noise, Gumbel 1954; Maddison et al. 2014) samples from the row's distribution,
restricted to its top-k and top-p (nucleus, Holtzman et al. 2019) tokens and, with ``min_p``, to
those at least ``min_p`` times as likely as the most likely (Nguyen et al. 2024). Before that, a
row's penalties change its logits (vLLM's semantics): ``repetition_penalty`` r divides a positive
logit by r and multiplies a negative one by r for every token of its prompt or output (Keskar et al.
2019); ``frequency_penalty`` subtracts f times the token's count in its output and
``presence_penalty`` p once for any token of its output (OpenAI's). So a request samples the
same tokens whatever else shares its batch, a seed reproduces a completion exactly, and nothing is
drawn from a stateful generator. Requests without a seed get a random one when they are admitted.

A row whose logits hold NaN or +inf (or are all −inf) gets token −1: its request fails alone
(:class:`~deltafleet.serve.engine.GenerationError`), the others go on.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from deltafleet.serve.fuse import fused
from deltafleet.serve.transfer import upload

SAMPLING_EPS = 1e-5  # temperatures below this sample greedily, as in vLLM
_M1, _M2 = 0x85EBCA6B - 2**32, 0xC2B2AE35 - 2**32  # MurmurHash3 fmix32's multipliers, as int32
_GOLDEN = 0x9E3779B9 - 2**32
_U_MAX = 1.0 - 2**-24  # the largest float32 below 1


def request_seed(seed: int) -> int:
    """A request's seed (any integer) as the sampler's 64-bit seed: 64 bits of its BLAKE2b hash, so
    that seeds equal modulo 2**32 or 2**64 still sample apart."""
    return int.from_bytes(hashlib.blake2b(str(seed).encode(), digest_size=8).digest(), "little", signed=True)


def _shr(x: Tensor, s: int) -> Tensor:
    """Logical right shift of int32 ``x`` (``>>`` is arithmetic in torch)."""
    return (x >> s) & ((1 << (32 - s)) - 1)


def _fmix32(h: Tensor) -> Tensor:
    """MurmurHash3's finaliser on int32 (multiplication wraps, as in C's uint32 arithmetic)."""
    h = h ^ _shr(h, 16)
    h = h * _M1
    h = h ^ _shr(h, 13)
    h = h * _M2
    return h ^ _shr(h, 16)


@dataclass
class SamplingBatch:
    """What a step samples with, one entry per row, on the logits' device.

    Attributes:
        temperature: float32 ``[B]``; below :data:`SAMPLING_EPS`: greedy.
        top_p: float32 ``[B]`` in (0, 1]; 1: no nucleus.
        top_k: int64 ``[B]``; 0: no limit.
        key: int32 ``[B, 2]``: the request's 64-bit seed (:func:`request_seed`) as two words.
        position: int32 ``[B]``: the position of the token each row samples (a new draw per step).
        truncate: whether any row has ``top_p < 1`` or ``top_k > 0`` (known on the host: the sort
            that truncation needs is skipped when none does).
        draw: whether any row samples at all (no noise is made for a step of greedy rows).
        banned: ``(rows, tokens)`` int64 index tensors of the tokens that cannot be drawn this step
            (a request's eos and stop token ids before its ``min_tokens``), or None.
        penalties: ``(rows, entry_rows, tokens, counts, repetition, frequency, presence)``: the
            penalized rows (int64 ``[P]``), their penalties (float32 ``[P]`` each), and one entry per
            (row, token) seen in the row's prompt or output: its row among the P (int64), the token
            (int64) and its count in the output (float32; 0 for a prompt token). A token may come in
            several entries (the counts add up): the last output token of a row whose previous step
            is still in flight is taken from that step's tokens, on the device. None when no row has
            penalties.
        min_p: float32 ``[B]``, or None when no row has one.
        allowed: int32 ``[B, ceil(V / 32)]``, every row's allowed tokens in xgrammar's layout (bit ``j``
            of word ``i``: token ``32·i + j``), all bits set for a row not held to a grammar
            (serve/grammar.py); None when no row is.
    """

    temperature: Tensor
    top_p: Tensor
    top_k: Tensor
    key: Tensor
    position: Tensor
    truncate: bool
    draw: bool = True
    banned: tuple[Tensor, Tensor] | None = None
    penalties: tuple[Tensor, ...] | None = None
    min_p: Tensor | None = None
    allowed: Tensor | None = None

    @classmethod
    def build(cls, rows: list[tuple[float, float, int, int, int]], device: torch.device | str,
              banned: list[tuple[int, int]] = (), penalties: list[tuple[int, int, int, float, float, float]] = (),
              min_p: list[float] | None = None,
              fed: tuple[list[tuple[int, int, float, float, float]], Tensor] | None = None) -> SamplingBatch:
        """From ``(temperature, top_p, top_k, seed, position)`` per row, ``seed`` as
        :func:`request_seed` gives it, the ``(row, token)`` pairs that cannot be drawn, the
        ``(row, token, output count, repetition, frequency, presence)`` entries of the rows with
        penalties, and each row's ``min_p`` (None: no row has one). ``fed``: ``(entries, prev)``, one
        more output token for rows with penalties, ``(row, i, repetition, frequency, presence)`` for
        token ``prev[i]`` (the previous step's sampled tokens, on the device: asynchronous scheduling)."""
        temperature, top_p, top_k, seeds, position = zip(*rows)
        pen = None
        fed_entries, prev = fed if fed is not None else ((), None)
        if penalties or fed_entries:
            params = {e[0]: e[3:] for e in penalties} | {e[0]: e[2:] for e in fed_entries}
            order = sorted(params)
            at = {r: k for k, r in enumerate(order)}
            rep, freq, pres = (upload([params[r][j] for r in order], torch.float32, device) for j in range(3))
            entry_rows = upload([at[e[0]] for e in penalties] + [at[e[0]] for e in fed_entries], torch.int64, device)
            tokens = upload([e[1] for e in penalties], torch.int64, device)
            counts = upload([float(e[2]) for e in penalties] + [1.0] * len(fed_entries), torch.float32, device)
            if fed_entries:  # the tokens still on the device (−1, a failed row: counted as 0, which ends anyway)
                src = upload([e[1] for e in fed_entries], torch.int64, device)
                tokens = torch.cat([tokens, prev.clamp(min=0)[src]])
            pen = (upload(order, torch.int64, device), entry_rows, tokens, counts, rep, freq, pres)
        # two host-to-device copies for the whole batch, queued behind the step's forward (serve/transfer.py)
        seeds = np.array(seeds, dtype=np.int64).view(np.uint64)  # two's complement bits
        ints = np.stack([np.array(top_k, dtype=np.int64), (seeds & 0xFFFFFFFF).astype(np.int64),
                         (seeds >> np.uint64(32)).astype(np.int64), np.array(position, dtype=np.int64)])
        floats = upload(np.array([temperature, top_p], dtype=np.float32), torch.float32, device)
        ints = upload(ints, torch.int64, device)
        key = ints[1:3].t().to(torch.int32).contiguous()  # the seed's two 32-bit words, wrapped to int32
        return cls(floats[0], floats[1], ints[0], key, ints[3].to(torch.int32),
                   any(p < 1.0 for p in top_p) or any(k > 0 for k in top_k),
                   any(t >= SAMPLING_EPS for t in temperature),
                   tuple(upload(v, torch.int64, device) for v in zip(*banned)) if banned else None,
                   pen, None if min_p is None else upload(min_p, torch.float32, device))


def unpack_bitmask(bitmask: Tensor, vocab: int) -> Tensor:
    """The bool ``[R, vocab]`` of a token bitmask in xgrammar's layout (see :class:`SamplingBatch`)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask[:, :, None] >> shifts) & 1).reshape(bitmask.shape[0], -1)[:, :vocab].bool()


def gumbel_noise(key: Tensor, position: Tensor, tokens: Tensor) -> Tensor:
    """Gumbel(0, 1) draws, float32 ``[B, N]``: row b's draw for token ``tokens[b, n]`` (or ``tokens[n]``)
    at ``position[b]`` under ``key[b]``; a pure function of those three."""
    row = _fmix32(key[:, 0] ^ _fmix32(key[:, 1] ^ _fmix32(position * _GOLDEN + 1)))  # [B]
    tok = _fmix32(tokens.to(torch.int32) * _GOLDEN + 0x165667B1)
    h = _fmix32(row[:, None] ^ tok)
    # uniform in (0, 1), 24 bits. In float32 the largest, (2^24 − 0.5)/2^24, rounds to 1, whose noise is
    # +inf, and −inf + inf is NaN, which argmax picks: a banned or masked token would be drawn. Clamped
    # to the largest float32 below 1, every noise is finite.
    u = (((h & 0xFFFFFF).float() + 0.5) * (1.0 / 2**24)).clamp(max=_U_MAX)
    return -torch.log(-torch.log(u))


def sample(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """One token per row from ``logits`` ``[B, V]`` (float32): argmax for greedy rows, else a draw
    from softmax(logits / T) over the row's top-k tokens and, of those, the smallest set whose
    probability, renormalised over the top-k, reaches top-p (the most likely token always stays);
    ``batch.banned`` tokens never. Returns int64 ``[B]`` on the device, −1 for a row whose logits are
    not finite (NaN or +inf, or all −inf). On CUDA the greedy and the untruncated cases are compiled
    functions (serve/fuse.py): the hash, the noise and the argmax fuse. The truncated case runs
    eagerly: inductor (torch 2.11) fails to generate its cumulative sum over a dynamic vocabulary
    dimension, and its sort dominates it anyway."""
    if batch.penalties is not None:  # (in place, as below: the step's logits are not read again)
        _penalize(logits, *batch.penalties)
    if batch.banned is not None:
        logits.index_put_(batch.banned, torch.full((), float("-inf"), device=logits.device))
    if batch.allowed is not None:
        logits = _masked(logits, batch.allowed)
    if batch.min_p is not None:
        _min_p(logits, batch.min_p, batch.temperature)
    if not batch.draw:
        return _greedy(logits)
    if batch.truncate:
        return _truncated(logits, batch.temperature, batch.top_p, batch.top_k, batch.key, batch.position)
    return _plain(logits, batch.temperature, batch.key, batch.position)


def _penalize(logits: Tensor, rows: Tensor, entry_rows: Tensor, tokens: Tensor, counts: Tensor, repetition: Tensor,
              frequency: Tensor, presence: Tensor) -> None:
    """Apply the penalties of :class:`SamplingBatch` to ``logits`` in place (see the module docstring),
    over a dense ``[P, V]`` view of the penalized rows' counts (entries of one token add up)."""
    v = logits[rows]
    count = torch.zeros_like(v).index_put_((entry_rows, tokens), counts, accumulate=True)
    seen = torch.zeros_like(v, dtype=torch.bool).index_put_((entry_rows, tokens),
                                                             torch.ones_like(counts, dtype=torch.bool))
    rep = repetition[:, None]
    v = torch.where(seen, torch.where(v > 0, v / rep, v * rep), v)
    v = v - frequency[:, None] * count - presence[:, None] * (count > 0).float()
    logits[rows] = v


def _min_p(logits: Tensor, min_p: Tensor, temperature: Tensor) -> None:
    """Drop, in place, the tokens below ``min_p`` times the likeliest one's probability at the row's
    temperature: logit < max + T·log(min_p). Greedy rows keep their argmax; ``min_p`` 0 drops nothing."""
    t = torch.where(temperature < SAMPLING_EPS, torch.ones_like(temperature), temperature)
    floor = logits.amax(-1) + t * torch.log(min_p)  # −inf where min_p is 0
    logits.masked_fill_(logits < floor[:, None], float("-inf"))


@fused
def _masked(logits: Tensor, bitmask: Tensor) -> Tensor:
    """``logits`` with the tokens ``bitmask`` does not allow at −inf: one kernel on CUDA, whatever the
    number of rows held to a grammar (free rows have every bit set)."""
    return logits.masked_fill(~unpack_bitmask(bitmask, logits.shape[-1]), float("-inf"))


@fused
def _greedy(logits: Tensor) -> Tensor:
    tokens = logits.argmax(-1)
    return torch.where(torch.isfinite(logits.amax(-1)), tokens, torch.full_like(tokens, -1))  # amax keeps NaN


def _scaled(logits: Tensor, temperature: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(logits − max) / T`` (≤ 0 before scaling: no overflow; T = 1 for greedy rows), greedy, finite."""
    top = logits.amax(-1)
    greedy = temperature < SAMPLING_EPS
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    return (logits - top[:, None]) / t[:, None], greedy, torch.isfinite(top)


@fused
def _plain(logits: Tensor, temperature: Tensor, key: Tensor, position: Tensor) -> Tensor:
    scaled, greedy, finite = _scaled(logits, temperature)
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    drawn = (scaled + gumbel_noise(key, position, vocab)).argmax(-1)
    tokens = torch.where(greedy, logits.argmax(-1), drawn)
    return torch.where(finite, tokens, torch.full_like(tokens, -1))


def _truncated(logits: Tensor, temperature: Tensor, top_p: Tensor, top_k: Tensor, key: Tensor,
               position: Tensor) -> Tensor:
    scaled, greedy, finite = _scaled(logits, temperature)
    values, order = scaled.sort(-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)
    k = top_k[:, None]
    values = values.masked_fill((k > 0) & (rank >= k), float("-inf"))
    probs = values.softmax(-1)  # over the top-k, renormalised (as vLLM and transformers apply top-p)
    before = probs.cumsum(-1) - probs  # probability of the tokens ranked above
    values = values.masked_fill((top_p[:, None] < 1.0) & (before > top_p[:, None]), float("-inf"))
    pick = (values + gumbel_noise(key, position, order)).argmax(-1)
    drawn = order.gather(-1, pick[:, None])[:, 0]
    tokens = torch.where(greedy, logits.argmax(-1), drawn)
    return torch.where(finite, tokens, torch.full_like(tokens, -1))
