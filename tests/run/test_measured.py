"""Kernels fitted to runs' metrics (`run.measured`): rows made from known kernels give them back."""

from __future__ import annotations

import dataclasses
import json

import pytest

from bapo_jax.overrides import apply_overrides
from bapo_jax.run import measured
from bapo_jax.run.config import dump
from experiments import cpu_arithmetic

STEP, PER_TOKEN, TRAIN, UPDATE, FORWARD = 0.012, 1.5e-4, 8e-5, 0.06, 2e-5


def _rows(config, prompts: int, staleness_zero_overhead: float) -> list[dict]:
    """Rows whose times follow the module's equations exactly (the first, compiling, is off)."""
    g, p = config.trainer.rollout.samples_per_prompt, config.trainer.rollout.max_prompt_tokens
    rows = []
    for i, (mean, longest) in enumerate([(30.0, 40.0), (18.0, 26.0), (19.0, 28.0), (17.5, 25.0)]):
        n = prompts * g
        generated = n * mean
        steps = longest  # every batch runs in one wave (--max-num-seqs 256)
        tokens = n * p + generated
        row = {
            "rollout/prompts_drawn": prompts,
            "rollout/generated_tokens": generated,
            "response_length/max": longest,
            "time/generate": steps * STEP + generated * PER_TOKEN,
            "time/update": tokens * TRAIN + 4 * UPDATE,
            "updates": 4,
            "time/teacher_logprobs": tokens * FORWARD,
            "time/reward": n * 1e-3,
            "time/sync_write": 0.1,
            "time/sync_load": 0.03,
        }
        phases = sum(v for k, v in row.items() if k.startswith("time/"))
        row["time/iteration"] = phases + staleness_zero_overhead + (5.0 if i == 0 else 0.0)
        rows.append(row)
    return rows


def _run(tmp_path, name: str, prompts: int, staleness: int) -> str:
    config = apply_overrides(
        cpu_arithmetic.VLLM_RUN,
        [f"trainer.rollout.prompts_per_step={prompts}", f"trainer.offpolicy.staleness={staleness}"],
    )
    directory = tmp_path / name
    directory.mkdir()
    dump(config, str(directory / "config.json"))
    with open(directory / "metrics.jsonl", "w") as f:
        for row in _rows(config, prompts, 0.04):
            f.write(json.dumps(row) + "\n")
    return str(directory)


def test_two_batch_sizes_give_back_the_kernels(tmp_path):
    runs = [
        measured.load_run(_run(tmp_path, "big", 32, 0)),
        measured.load_run(_run(tmp_path, "small", 8, 0)),
    ]
    found = measured.fit(runs)
    k = found.kernels
    assert found.rows == 6  # 3 rows a run: the first compiles
    assert k.decode_step_s == pytest.approx(STEP, rel=1e-6)
    assert k.decode_token_s == pytest.approx(PER_TOKEN, rel=1e-6)
    assert k.train_token_s == pytest.approx(TRAIN, rel=1e-6)
    assert k.update_s == pytest.approx(UPDATE, rel=1e-6)
    assert k.forward_token_s == pytest.approx(FORWARD, rel=1e-6)
    workers = cpu_arithmetic.VLLM_RUN.rewards.worker_count
    assert k.reward_s == pytest.approx(1e-3 * workers)
    assert (k.sync_write_s, k.sync_reload_s) == pytest.approx((0.1, 0.03))
    assert k.overhead_s == pytest.approx(0.04)  # the staleness-0 rows' rest
    assert found.rates.mean_response_tokens == pytest.approx((18 + 19 + 17.5) / 3)
    assert found.rates.longest_response_tokens == pytest.approx((26 + 28 + 25) / 3)


def test_no_overhead_without_a_staleness_zero_run_and_refusals(tmp_path):
    found = measured.fit([measured.load_run(_run(tmp_path, "k1", 32, 1))])
    assert found.kernels.overhead_s == 0.0
    with pytest.raises(ValueError, match=r"no config\.json there"):
        measured.load_run(str(tmp_path))
    empty = tmp_path / "empty"
    empty.mkdir()
    dump(cpu_arithmetic.VLLM_RUN, str(empty / "config.json"))
    (empty / "metrics.jsonl").write_text(json.dumps({"step": 0}) + "\n")
    with pytest.raises(ValueError, match="no rows after each run's first"):
        measured.fit([measured.load_run(str(empty))])


def test_a_negative_coefficient_keeps_the_proportional_term():
    """A joint fit that wants a negative coefficient keeps the per-token (second) term alone,
    whichever single term would fit better: the fixed one alone would not scale with work."""
    import numpy as np

    x = np.array([[1.0, 10.0], [1.0, 20.0], [1.0, 30.0]])
    y = np.array([0.9, 2.0, 3.1])  # the fixed term would be negative: slope alone
    coef = measured._nonnegative_fit(x, y)
    assert coef[0] == 0.0 and coef[1] == pytest.approx(float(x[:, 1] @ y / (x[:, 1] @ x[:, 1])))
    # Here the fixed term alone fits better (the rows are nearly flat), the slope is negative
    # jointly; the slope alone is kept all the same.
    y = np.array([2.05, 2.0, 1.98])
    coef = measured._nonnegative_fit(x, y)
    assert coef[0] == 0.0 and coef[1] == pytest.approx(float(x[:, 1] @ y / (x[:, 1] @ x[:, 1])))
    x = np.array([[2.0, 10.0], [4.0, 40.0]])  # a joint fit with both terms positive stays
    coef = measured._nonnegative_fit(x, x @ np.array([0.5, 0.01]))
    np.testing.assert_allclose(coef, [0.5, 0.01])
    assert dataclasses.is_dataclass(measured.Measured)


def test_a_pod_run_prints_its_estimate_redone_from_its_first_iterations(capsys):
    """The follower stays silent until three rows past the compiling one, then prints the
    estimate from the kernels fitted to them, once; a resumed run says nothing again."""
    from bapo_jax.models.config import Qwen2Config

    config = cpu_arithmetic.VLLM_RUN
    model = Qwen2Config.preset("tiny")
    follower = measured.RedoneEstimate(config, model, "/runs/x", start_step=0)
    for step, row in enumerate(_rows(config, 32, 0.0)[:3]):
        follower.log(step, row, {})
    assert capsys.readouterr().out == ""
    follower.log(3, _rows(config, 32, 0.0)[3], {})
    out = capsys.readouterr().out
    assert out.startswith("iteration estimate redone from the first 3 measured iterations")
    assert "--measured /runs/x" in out and "kernels measured (fitted to 3 rows of 1 run(s))" in out
    follower.log(4, _rows(config, 32, 0.0)[0], {})
    assert capsys.readouterr().out == ""
    broken = measured.RedoneEstimate(config, model, "/runs/x", start_step=0, after=1)
    broken.log(0, {"step": 0}, {})
    broken.log(1, {"step": 1}, {})
    assert "not redone: KeyError" in capsys.readouterr().out
    resumed = measured.RedoneEstimate(config, model, "/runs/x", start_step=7)
    for step in range(7, 12):
        resumed.log(step, _rows(config, 32, 0.0)[1], {})
    assert capsys.readouterr().out == ""


def test_only_a_pod_run_gets_the_follower(tmp_path):
    from bapo_jax.models.config import Qwen2Config
    from bapo_jax.run.build import estimate_followers
    from experiments import aime_7b

    model = Qwen2Config.preset("tiny")
    assert len(estimate_followers(aime_7b.CONFIG, model, str(tmp_path))) == 1
    assert estimate_followers(cpu_arithmetic.VLLM_RUN, model, str(tmp_path)) == ()  # CPU cores
    assert estimate_followers(cpu_arithmetic.RUN, model, str(tmp_path)) == ()  # embedded
