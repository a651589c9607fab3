"""train/compare_merges.py: the pieces of its report that do not need training runs."""
from __future__ import annotations

import pytest

from deltafleet.train.compare_merges import base_dir, roughness


def test_the_report_names_the_base_the_model_override_picks():
    assert base_dir([]) == "models/base"
    assert base_dir(["trainer=gpu", "model=smollm2"]) == "models/smollm2-base"


def test_roughness_is_the_mean_absolute_second_difference():
    assert roughness([1.0, 2.0, 3.0, 4.0]) == 0.0  # a straight line
    assert roughness([1.0, 3.0, 1.0]) == 4.0
    assert roughness([0.0, 1.0, 0.0, 1.0]) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="at least 3 points"):
        roughness([1.0, 2.0])
