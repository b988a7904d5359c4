"""DAPO's soft overlong penalty, against hand-computed values."""

import numpy as np
import pytest

from bapo_jax.rewards import overlong_penalty


def test_overlong_penalty_small_hand_computed():
    # L_max = 20, L_cache = 5: no penalty up to 15, then -(|y| - 15) / 5, then -1 past 20.
    lengths = np.array([0, 10, 15, 16, 18, 20, 21, 100])
    expected = np.array([0.0, 0.0, 0.0, -0.2, -0.6, -1.0, -1.0, -1.0], np.float32)
    np.testing.assert_allclose(overlong_penalty(lengths, 20, 5), expected, rtol=0, atol=1e-7)


def test_overlong_penalty_dapo_setting():
    # DAPO: L_max = 20480, L_cache = 4096, so the ramp starts at 16384.
    lengths = np.array([16384, 17408, 18432, 20480, 20481])
    expected = np.array([0.0, -0.25, -0.5, -1.0, -1.0], np.float32)
    np.testing.assert_allclose(overlong_penalty(lengths, 20480, 4096), expected, rtol=0, atol=1e-7)


def test_overlong_penalty_scalar_and_whole_range_buffer():
    assert overlong_penalty(3, 4, 4).shape == ()
    np.testing.assert_allclose(overlong_penalty(3, 4, 4), -0.75)
    np.testing.assert_allclose(overlong_penalty(np.arange(5), 4, 4), [0, -0.25, -0.5, -0.75, -1])


@pytest.mark.parametrize(
    ("lengths", "max_length", "buffer_length", "message"),
    [
        ([1], 0, 1, "max_length must be > 0, got 0"),
        ([1], 10, 0, "buffer_length must be in \\(0, max_length=10\\], got 0"),
        ([1], 10, 11, "buffer_length must be in \\(0, max_length=10\\], got 11"),
        ([-1], 10, 5, "lengths must be >= 0"),
        ([1.5], 10, 5, "lengths must be integers"),
        ([1], 10.0, 5, "max_length must be an int"),
    ],
)
def test_overlong_penalty_rejects_bad_input(lengths, max_length, buffer_length, message):
    with pytest.raises(ValueError, match=message):
        overlong_penalty(np.asarray(lengths), max_length, buffer_length)
