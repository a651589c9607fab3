"""A job's ``threads`` setting: how many CPU threads torch's operators use (``torch.set_num_threads``).

Every job's config has ``threads: null`` (torch's default: one per core). Set it to share a machine
between jobs, or to keep a job from oversubscribing cores that data-loader workers or another
process need. The server has its own default (``serve/run.py``: one core left to the event loop).
"""
from __future__ import annotations

import os


MAX_PER_CORE = 4  # threads per core beyond which a setting is refused (100,000 crashed torch's thread pool)


def check_threads(n) -> None:
    """Raises ValueError unless ``n`` is None or a positive integer of at most :data:`MAX_PER_CORE`
    threads per core of this machine."""
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"threads must be null or a positive integer, got {n!r}")
    cores = os.cpu_count() or 1
    if n is not None and n > MAX_PER_CORE * cores:
        raise ValueError(f"threads={n} is more than {MAX_PER_CORE} per core of this machine's {cores}: "
                         f"at most {MAX_PER_CORE * cores}")


def set_threads(cfg) -> int | None:
    """Apply ``cfg.threads`` (None or absent: leave torch's default); returns what was set.

    Raises:
        ValueError: if it is neither null nor a positive integer.
    """
    n = cfg.get("threads") if hasattr(cfg, "get") else None
    check_threads(n)
    if n is None:
        return None
    import torch

    torch.set_num_threads(n)
    return n
