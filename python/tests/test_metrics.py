"""norm_ratio / max_abs / assert_close follow FLA's testing utilities."""

from __future__ import annotations

import math

import numpy as np
import pytest

import deltaref


def test_norm_ratio_by_hand():
    ref, x = np.array([3.0, 4.0]), np.array([2.7, 4.0])
    want = math.sqrt(0.09 / 2) / (math.sqrt(25 / 2) + 1e-8)
    assert deltaref.norm_ratio(ref, x) == pytest.approx(want, rel=1e-14)
    assert deltaref.max_abs(ref, x) == pytest.approx(0.3, rel=1e-14)


def test_assert_close_semantics():
    deltaref.assert_close("o", np.zeros(3), np.full(3, 1e-7), 1e-12)  # max_abs ≤ 1e-6 passes
    deltaref.assert_close("o", np.ones(4), np.array([1.0, 1.0, 1.0, 1.001]), 1e-3)
    with pytest.raises(AssertionError, match=r"^dq: norm_ratio .* \(at index \[0, 0\]\)"):
        deltaref.assert_close("dq", np.ones((2, 2)), np.array([[1.1, 1.0], [1.0, 1.0]]), 5e-3)
    # The index is the tensor's own: element [1, 2, 0] of a [2, 3, 2] tensor (flat 10).
    x = np.ones((2, 3, 2))
    x[1, 2, 0] = 3.0
    with pytest.raises(AssertionError, match=r"\(at index \[1, 2, 0\]\)"):
        deltaref.assert_close("o", np.ones((2, 3, 2)), x, 5e-3)
    with pytest.raises(AssertionError, match="dk"):
        deltaref.assert_close("dk", np.ones(3), np.array([1.0, np.nan, 1.0]), 1.0)
    assert math.isnan(deltaref.norm_ratio(np.ones(2), np.array([np.nan, 1.0])))


def test_metrics_take_float32_and_lists():
    assert deltaref.norm_ratio([1.0, 2.0], np.array([1.0, 2.0], dtype=np.float32)) == 0.0
