"""The sampling plan (cua_rollout/runtime/sampling.py): DART's dynamic rollout number. The
plan's passes, group sizes, resume and barrier are tested through the loader that feeds it
(tests/unit/test_task_loader.py)."""

from __future__ import annotations

import pytest

from cua_rollout.runtime.sampling import dynamic_rollout_n


@pytest.mark.parametrize(("rate", "n"), [(0.6, 8), (0.75, 5), (0.9, 3), (1.0, 2)])
def test_dynamic_rollout_formula(rate: float, n: int) -> None:
    assert dynamic_rollout_n(rate, threshold=0.6, min_n=2) == n


def test_dynamic_rollout_formula_below_threshold_and_floor() -> None:
    assert dynamic_rollout_n(0.5, threshold=0.6, min_n=2) is None
    assert dynamic_rollout_n(0.0, threshold=0.0, min_n=2) is None
    assert dynamic_rollout_n(1.0, threshold=0.6, min_n=4) == 4
