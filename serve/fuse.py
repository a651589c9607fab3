"""Elementwise chains compiled into one kernel on CUDA (``torch.compile``), eager elsewhere.

At decode, a step is bound by launches as much as by bytes: RMSNorm alone is five kernels eagerly,
and a 32-layer step launches hundreds of such short ones. :func:`fused` compiles a function of
tensors and calls it when its first argument is a CUDA tensor; on the CPU (tests, the CPU demo) the
plain function runs. ``DELTAFLEET_FUSE=0`` keeps every function eager (to compare, or to debug).

Only the token dimension is dynamic: dimension 0 of every tensor argument whose first dimension is
the first argument's (so every batch size shares one kernel after the first), while the widths
(hidden size, intermediate size, heads) stay constants of the kernel. With every dimension dynamic,
a strided view's index (SiLU·up reads the two halves of the fused gate/up output) costs a 64-bit
division by a runtime width per element; with the widths constant it is a multiply and a shift.

A leaf module (torch only).
"""
from __future__ import annotations

import os

import torch

FUSE = os.environ.get("DELTAFLEET_FUSE", "1") != "0"  # 0: every @fused function stays eager on CUDA too


def fused(fn):
    """``fn`` compiled by ``torch.compile`` (one graph, the token dimension dynamic: see the module
    docstring) when its first argument is a CUDA tensor, so that its elementwise chain is one kernel
    instead of one per op (at decode, launches rather than bytes bound these); eager elsewhere, and
    with ``DELTAFLEET_FUSE=0``."""
    compiled = None

    def call(*args):
        nonlocal compiled
        if FUSE and args[0].is_cuda:
            if compiled is None:
                compiled = torch.compile(fn, fullgraph=True)
            tokens = args[0].shape[0]
            for a in args:
                if isinstance(a, torch.Tensor) and a.dim() and a.shape[0] == tokens:
                    torch._dynamo.maybe_mark_dynamic(a, 0)
            return compiled(*args)
        return fn(*args)

    call.__doc__, call.__name__ = fn.__doc__, fn.__name__
    return call
