"""Kinds of a setting's value, as the jobs' checks at the boundary test them (Hydra gives Python's
own types, and YAML's ``true`` is an int to Python, so a bool is neither kind)."""
from __future__ import annotations

import math


def whole(v) -> bool:
    """An integer, not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def real(v) -> bool:
    """A finite int or float, not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
