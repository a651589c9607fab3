"""Elementwise chains compiled into one kernel on CUDA (``torch.compile``), eager elsewhere.

At decode, a step is bound by launches as much as by bytes: RMSNorm alone is five kernels eagerly,
and a 32-layer step launches hundreds of such short ones. :func:`fused` compiles a function of
tensors once, with dynamic shapes (so every batch size shares one compiled kernel), and calls it
when its first argument is a CUDA tensor; on the CPU (tests, the CPU demo) the plain function runs.
``DELTAFLEET_FUSE=0`` keeps every function eager (to compare, or to debug).

A leaf module (torch only).
"""
from __future__ import annotations

import os

import torch

FUSE = os.environ.get("DELTAFLEET_FUSE", "1") != "0"  # 0: every @fused function stays eager on CUDA too


def fused(fn):
    """``fn`` compiled by ``torch.compile`` (dynamic shapes, one graph) when its first argument is a CUDA
    tensor, so that its elementwise chain is one kernel instead of one per op (at decode, launches
    rather than bytes bound these); eager elsewhere, and with ``DELTAFLEET_FUSE=0``."""
    compiled = None

    def call(*args):
        nonlocal compiled
        if FUSE and args[0].is_cuda:
            if compiled is None:
                compiled = torch.compile(fn, dynamic=True, fullgraph=True)
            return compiled(*args)
        return fn(*args)

    call.__doc__, call.__name__ = fn.__doc__, fn.__name__
    return call
