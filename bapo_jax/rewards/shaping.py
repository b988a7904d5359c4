"""Reward shaping that depends only on lengths: DAPO's soft overlong penalty.

DAPO (Yu et al., 2025, eq. 13) penalises a response of length |y| given the maximum length
L_max and a buffer length L_cache:

    R_length(y) = 0                                  if |y| <= L_max - L_cache
                = ((L_max - L_cache) - |y|) / L_cache   if L_max - L_cache < |y| <= L_max
                = -1                                 if L_max < |y|

The penalty falls linearly from 0 to -1 across the buffer, and is added to the correctness
reward. A numpy function of host-side lengths (rewards are computed on the host).
"""

from __future__ import annotations

import numpy as np
from jaxtyping import Float, Int


def overlong_penalty(
    lengths: Int[np.ndarray, " B"] | int, max_length: int, buffer_length: int
) -> Float[np.ndarray, " B"]:
    """DAPO soft overlong penalty in [-1, 0] for each response length (see module docstring).

    Args:
      lengths: response lengths in tokens, [B] (or a scalar, giving a 0-d array).
      max_length: L_max > 0.
      buffer_length: L_cache, 0 < L_cache <= L_max.
    """
    if isinstance(max_length, bool) or not isinstance(max_length, (int, np.integer)):
        raise ValueError(f"max_length must be an int, got {max_length!r}")
    if isinstance(buffer_length, bool) or not isinstance(buffer_length, (int, np.integer)):
        raise ValueError(f"buffer_length must be an int, got {buffer_length!r}")
    if max_length <= 0:
        raise ValueError(f"max_length must be > 0, got {max_length}")
    if not 0 < buffer_length <= max_length:
        raise ValueError(
            f"buffer_length must be in (0, max_length={max_length}], got {buffer_length}"
        )
    lengths = np.asarray(lengths)
    if not np.issubdtype(lengths.dtype, np.integer):
        raise ValueError(f"lengths must be integers, got dtype {lengths.dtype}")
    if np.any(lengths < 0):
        raise ValueError(f"lengths must be >= 0, got min {int(lengths.min())}")
    threshold = max_length - buffer_length
    ramp = (threshold - lengths.astype(np.float64)) / buffer_length  # [B]
    penalty = np.where(lengths <= threshold, 0.0, np.where(lengths <= max_length, ramp, -1.0))
    return penalty.astype(np.float32)
