"""Host-to-device copies that do not wait for the device, and tokens that never leave it.

A plain ``torch.tensor(values, device="cuda")`` copies from pageable memory and then waits for the
stream, that is for every kernel queued before it: the host stalls until the GPU drains. With
asynchronous scheduling (serve/scheduler.py) the next step is prepared while the current one runs, so
every copy on that path goes through pinned memory with ``non_blocking=True``; PyTorch's pinned
allocator keeps each buffer until its copy has run. And the decode rows whose last token the previous
step sampled read it where it is, on the device (:func:`feed_tokens`).

A leaf module.
"""
from __future__ import annotations

import torch
from torch import Tensor


def upload(values, dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """``values`` (a list, a number or a NumPy array) as a ``dtype`` tensor on ``device``, copied behind
    the work already queued there without the host waiting for it."""
    t = torch.as_tensor(values, dtype=dtype)
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def feed_tokens(tokens: Tensor, prev_rows: Tensor, prev: Tensor) -> None:
    """``tokens[i] = prev[prev_rows[i]]`` for the first ``len(prev_rows)`` tokens where ``prev_rows[i] ≥
    0``, in place, on the device (``StepInput.prev_rows``, serve/runner.py). A row whose token was −1
    (its logits were not finite: its sequence ends) is fed token 0 meanwhile."""
    n = prev_rows.shape[0]
    fed = prev.clamp(min=0)[prev_rows.clamp(min=0)]
    tokens[:n] = torch.where(prev_rows >= 0, fed, tokens[:n])
