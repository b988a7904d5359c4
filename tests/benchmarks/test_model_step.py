"""`benchmarks.model_step`: its JAX loss is the cross-entropy transformers computes on its side;
its timing measures the second of two back-to-back calls."""

import time
import types

import chex
import numpy as np
import pytest

from benchmarks import model_step
from benchmarks.model_step import _next_token_loss, back_to_back


def _reference(logits: np.ndarray, ids: np.ndarray) -> float:
    """Mean over positions 0..T-2 of -log softmax(logits[b, t])[ids[b, t + 1]], in float64."""
    z = logits[:, :-1].astype(np.float64)  # [B, T-1, V]
    logp = z - z.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    return float(-np.take_along_axis(logp, ids[:, 1:, None], axis=-1).mean())


def test_next_token_loss_matches_shifted_cross_entropy():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 7, 11)).astype(np.float32) * 3
    ids = rng.integers(0, 11, (3, 7)).astype(np.int32)
    got = float(_next_token_loss(logits, ids))
    np.testing.assert_allclose(got, _reference(logits, ids), rtol=1e-6)
    # The last position predicts nothing: its logits do not enter the loss.
    changed = logits.copy()
    changed[:, -1] = 100.0
    chex.assert_trees_all_equal(float(_next_token_loss(changed, ids)), got)


def test_back_to_back_times_only_the_second_call(monkeypatch):
    """The first call (a slow one here) is untimed; the second is timed. Wall time is read
    from a clock the calls advance (0.3 s, then 0.01 s), so no result depends on how fast the
    machine is; CPU time is real: the first call does 0.3 s of work, the second 0.02 s."""
    now = [1000.0]
    monkeypatch.setattr(model_step, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    calls: list[float] = []

    def run():
        calls.append(now[0])
        seconds = 0.3 if len(calls) == 1 else 0.02
        start = time.process_time()  # this process's CPU seconds, as back_to_back counts them
        while time.process_time() - start < seconds:
            pass
        now[0] += 0.3 if len(calls) == 1 else 0.01

    wall, cpu = back_to_back(run)
    assert calls == pytest.approx([1000.0, 1000.3])  # one untimed call, then the timed one
    assert wall == pytest.approx(0.01)  # the 0.3 s first call is not in it
    assert 0.01 <= cpu < 0.2, cpu  # the second call's CPU-seconds, not the first's
