"""The mini-batch cut (whole groups or single rows) and BAPO's precondition measures, by hand."""

import dataclasses

import numpy as np
import pytest

from bapo_jax.train import balance
from bapo_jax.train.assemble import RowArrays
from bapo_jax.train.config import AlgorithmConfig, RolloutConfig, TrainerConfig
from bapo_jax.train.loop import shuffled_rows


def _rows(advantages, lengths, rewards, logp=None, active=None, width=6) -> RowArrays:
    """One row per response: `lengths[i]` response tokens of advantage `advantages[i]`."""
    n = len(advantages)
    adv = np.zeros((n, width), np.float32)
    mask = np.zeros((n, width), np.float32)
    for i, (a, t) in enumerate(zip(advantages, lengths, strict=True)):
        adv[i, :t], mask[i, :t] = a, 1.0
    behavior = np.zeros((n, width), np.float32) if logp is None else np.asarray(logp, np.float32)
    zeros = np.zeros((n, width))
    return RowArrays(
        input_ids=zeros.astype(np.int32),
        attention_mask=mask.astype(np.int32),
        loss_mask=mask,
        advantages=adv,
        behavior_logp=behavior,
        versions=zeros.astype(np.int64),
        scheduled_versions=zeros.astype(np.int64),
        trainer_logp=np.full((n, width), np.nan, np.float32),
        rewards=np.asarray(rewards, np.float32),
        response_lengths=np.asarray(lengths, np.int32),
        overlong=np.zeros(n, bool),
        replayed=np.zeros(n, bool),
        active=np.ones(n, bool) if active is None else np.asarray(active, bool),
    )


def test_groups_cut_keeps_each_group_in_one_mini_batch():
    order = shuffled_rows(np.random.default_rng(0), 24, 4, "groups")
    assert sorted(order) == list(range(24))
    chunks = order.reshape(-1, 4)  # any cut at a multiple of G = 4
    for chunk in chunks:
        assert chunk[0] % 4 == 0 and list(chunk) == list(range(chunk[0], chunk[0] + 4))
    assert list(chunks[:, 0] // 4) != list(range(6))  # the groups themselves are shuffled


def test_rows_cut_is_the_permutation_of_rows():
    order = shuffled_rows(np.random.default_rng(3), 24, 4, "rows")
    np.testing.assert_array_equal(order, np.random.default_rng(3).permutation(24))


def test_rho_at_one_is_the_positive_advantage_mass():
    def rho(rows, name="balance/rho_r1"):
        return balance.precondition_metrics(rows, [np.array([0, 1])], 2, 0.4)[name]

    # A = +1 over 2 tokens, A = -1 over 4: P = 2, N = 4 -> rho = 1/3.
    assert rho(_rows([1.0, -1.0], [2, 4], [1.0, 0.0])) == pytest.approx(1 / 3)
    # Eq. 8's weights: pi = 0.5 on the positive tokens, 0.25 on the negative ones:
    # P = 2 x 0.5 = 1, N = 4 x 0.25 = 1 -> rho = 1/2.
    logp = np.log(np.array([[0.5] * 6, [0.25] * 6]))
    weighted = _rows([1.0, -1.0], [2, 4], [1.0, 0.0], logp=logp)
    assert rho(weighted, "balance/rho_r1_pi") == pytest.approx(0.5)
    assert np.isnan(rho(_rows([0.0, 0.0], [2, 2], [1.0, 1.0])))


def test_length_ratio_and_zero_variance_share_per_group():
    # Group 0: right ones 2 and 4 tokens long (mean 3), wrong ones 6 and 6 -> ratio 2.
    # Group 1: every reward 1 (zero variance, no ratio). Group 2 inactive (masked filler).
    rows = _rows(
        [1, 1, -1, -1, 0, 0, 0, 0, 1, -1, 1, -1],
        [2, 4, 6, 6, 3, 3, 3, 3, 1, 5, 1, 5],
        [1, 1, 0, 0, 1, 1, 1, 1, 1, 0, 1, 0],
        active=[True] * 8 + [False] * 4,
        width=6,
    )
    assert balance.length_ratio(rows, 4) == pytest.approx(2.0)
    assert balance.zero_variance_share(rows, 4) == pytest.approx(0.5)


def test_precondition_metrics_per_update():
    # Two groups of 2 (GRPO: advantages +-1). Group 0: right 2 tokens, wrong 4 (rho 1/3);
    # group 1: right 3, wrong 3 (rho 1/2).
    rows = _rows([1, -1, 1, -1], [2, 4, 3, 3], [1, 0, 1, 0])
    by_group = balance.precondition_metrics(rows, [np.array([0, 1]), np.array([2, 3])], 2, 0.4)
    assert by_group["balance/advantage_sum_max"] == 0.0  # whole groups: GRPO's zero sum
    assert by_group["balance/rho_r1"] == pytest.approx((1 / 3 + 1 / 2) / 2)
    assert by_group["balance/rho_r1_min"] == pytest.approx(1 / 3)
    assert by_group["balance/rho_r1_below"] == 0.5  # 1/3 < 0.4 <= 1/2
    assert by_group["balance/length_ratio"] == pytest.approx((4 / 2 + 3 / 3) / 2)
    assert (by_group["balance/length_pos"], by_group["balance/length_neg"]) == (2.5, 3.5)
    # Rows across groups: update {0, 2} is all positive (rho 1), {1, 3} all negative (rho 0).
    by_rows = balance.precondition_metrics(rows, [np.array([0, 2]), np.array([1, 3])], 2, 0.4)
    assert by_rows["balance/advantage_sum_max"] == 2.0
    assert by_rows["balance/rho_r1"] == pytest.approx(0.5)
    assert by_rows["balance/rho_r1_min"] == 0.0 and by_rows["balance/rho_r1_below"] == 0.5
    assert (
        by_group["balance/rho_r1_below_half"] == 0.5 and by_rows["balance/rho_r1_below_half"] == 0.5
    )


def test_groups_cut_needs_whole_groups_per_update():
    rollout = RolloutConfig(prompts_per_step=6, samples_per_prompt=4)
    with pytest.raises(ValueError, match=r"algorithm\.mini_batches.*6 groups"):
        TrainerConfig(rollout=rollout, algorithm=AlgorithmConfig(mini_batches=4))
    rows = AlgorithmConfig(mini_batches=4, minibatch="rows")  # 24 rows: 6 each
    assert TrainerConfig(rollout=rollout, algorithm=rows).rows_per_batch == 24
    with pytest.raises(ValueError, match="minibatch"):
        AlgorithmConfig(minibatch="tokens")
    assert dataclasses.replace(AlgorithmConfig(), mini_batches=3).minibatch == "groups"


def test_the_threshold_is_the_active_losss_rho0_or_the_papers():
    from bapo_jax.algorithms.bapo import BAPOConfig

    assert balance.rho0_of(AlgorithmConfig(loss="bapo", bapo=BAPOConfig(rho0=0.5))) == 0.5
    assert balance.rho0_of(AlgorithmConfig(loss="ppo_clip")) == balance.PAPER_RHO0 == 0.4
