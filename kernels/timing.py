"""Timing as a decode step runs: operands read from memory, not from the L2.

A CUDA graph replays its calls back to back with no flush, so a call that reads the same tensors
as the one before finds a matrix smaller than the L2 (Llama-2-7B's o, 32 MiB, in an H100's 50 MiB)
still there, where a decode step reads each layer's weights from memory (the other layers' weights
have evicted them). :func:`cold_copies` makes the fewest copies of a call's operands whose others
hold twice the L2, and :func:`rotating` calls on the next copy each time (in a graph's capture, each
captured call on its own), so that every timed call reads its operands from memory. The kernel
benchmark (kernels/bench.py) and the dispatchers' timing (``triton_bitdelta._fastest``) use them.
"""
from __future__ import annotations

import itertools

import torch


def cold_copies(tensors: tuple, l2_bytes: int, cap: int = 8) -> list[tuple]:
    """``tensors`` and clones of it (tensors cloned, other values shared): ``n`` sets in all, the
    fewest whose ``n − 1`` others hold at least twice ``l2_bytes`` (at most ``cap``), so that
    calls cycling through them (:func:`rotating`) find none of a set's bytes left in the L2; one set
    alone where it holds twice the L2 itself (a call reading it evicts its own tail before reaching
    it), or where ``l2_bytes`` is 0."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    n = 1 if nbytes >= 2 * l2_bytes else min(cap, 1 + -(-2 * l2_bytes // max(nbytes, 1)))
    return [tensors, *(tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in tensors)
                       for _ in range(n - 1))]


def rotating(fn, copies: list[tuple]):
    """A zero-argument callable calling ``fn(*copy)`` with the next of ``copies`` each time (in a CUDA
    graph's capture, each captured call with its own)."""
    sets = itertools.cycle(copies)
    return lambda: fn(*next(sets))


def l2_size(device: torch.device | str) -> int:
    """The L2 bytes of CUDA ``device`` (0 where it does not say, or off CUDA)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 0
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0))
