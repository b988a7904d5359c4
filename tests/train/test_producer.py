"""Rollout production: rounds, partial rollouts across policy versions, resumable state."""

from __future__ import annotations

import dataclasses
import json

import chex
import numpy as np

from bapo_jax.data.pipeline import PipelineConfig, prompt_iterator
from bapo_jax.models import init_model
from bapo_jax.rollout.embedded import EmbeddedEngine
from bapo_jax.train import assemble
from bapo_jax.train.buffers import PromptStream
from bapo_jax.train.config import OffPolicyConfig, RolloutConfig, TrainerConfig
from bapo_jax.train.producer import RolloutProducer, derive_seed
from bapo_jax.train.state import split_model
from bapo_jax.train.step import StepConfig, make_logprob_fn
from tests.train.loop_fixtures import MODEL, STOP_IDS, ToySource, decode, toy_reward

ROLLOUT = RolloutConfig(
    prompts_per_step=3, samples_per_prompt=2, max_prompt_tokens=8, max_response_tokens=12
)
PARTIAL = TrainerConfig(
    rollout=ROLLOUT, offpolicy=OffPolicyConfig(partial_budget=3, partial_pool=5)
)


def _producer(config: TrainerConfig) -> RolloutProducer:
    it = prompt_iterator(ToySource(answers=("parity",)), PipelineConfig(batch_size=4, seed=0))
    return RolloutProducer(config, PromptStream(it), toy_reward, decode)


def _rows(groups):
    return assemble.build_rows(
        groups,
        [True] * len(groups),
        [False] * len(groups),
        max_prompt_tokens=8,
        max_response_tokens=12,
        pad_id=0,
        overlong_filter=False,
    )


def test_derive_seed_is_a_pure_function():
    assert derive_seed(0, 1, 2) == derive_seed(0, 1, 2)
    assert len({derive_seed(0, j, r) for j in range(4) for r in range(4)}) == 16


def test_without_partial_rollouts_one_round_finishes_the_batch():
    producer = _producer(TrainerConfig(rollout=ROLLOUT))
    engine = EmbeddedEngine(init_model(MODEL, seed=0), eos_token_ids=STOP_IDS, length_bucket=8)
    batch = producer.produce(engine, 0)
    assert batch.metrics["rollout/rounds"] == 1 and len(batch.groups) == 3
    assert not producer.pool and not producer.ready
    for g in batch.groups:
        assert g.finished and g.rewards.shape == (2,)
        for r in g.responses:
            assert set(r.versions.tolist()) == {0}


def test_each_token_is_scored_against_the_version_that_sampled_it():
    """Partial rollouts continue responses with a newer policy; every token's behaviour
    log-prob is the teacher-forced log-prob under ITS version's weights, so the loss ratio
    pi_theta / pi_behaviour of a token is taken against the policy that produced it."""
    models = [init_model(MODEL, seed=s) for s in (0, 1)]
    params = [split_model(m)[1] for m in models]
    graphdef = split_model(models[0])[0]
    engine = EmbeddedEngine(models[0], eos_token_ids=STOP_IDS, length_bucket=8)
    producer = _producer(PARTIAL)
    producer.produce(engine, 0)
    assert producer.pool, "some responses must still be in flight after batch 0"
    engine.update_weights(1, params[1])
    groups = producer.produce(engine, 1).groups + producer.produce(engine, 2).groups
    rows = _rows(groups)
    mixed = [len(set(v[v >= 0].tolist())) > 1 for v in rows.versions]
    assert any(mixed), "no response mixes versions 0 and 1"

    logp_fn = make_logprob_fn(graphdef, StepConfig(temperature=1.0))
    logp = [np.asarray(logp_fn(p, rows.input_ids, rows.attention_mask)[0]) for p in params]
    for v in (0, 1):
        sel = rows.versions == v
        assert sel.sum() > 0
        np.testing.assert_allclose(rows.behavior_logp[sel], logp[v][sel], atol=1e-5)
    # The ratio the update with weights v1 sees: 1 on v1 tokens, pi_1 / pi_0 on v0 tokens.
    ratio = np.exp(logp[1] - rows.behavior_logp)
    np.testing.assert_allclose(ratio[rows.versions == 1], 1.0, atol=1e-4)
    old = rows.versions == 0
    np.testing.assert_allclose(ratio[old], np.exp(logp[1][old] - logp[0][old]), rtol=1e-4)
    assert np.abs(ratio[old] - 1).max() > 1e-2


def test_producer_state_round_trip_continues_identically():
    engine = EmbeddedEngine(init_model(MODEL, seed=0), eos_token_ids=STOP_IDS, length_bucket=8)
    a = _producer(PARTIAL)
    a.produce(engine, 0)
    host, arrays = a.get_state()
    b = _producer(PARTIAL)
    b.set_state(host, arrays)
    batch_a, batch_b = a.produce(engine, 1), b.produce(engine, 1)
    assert [g.uid for g in batch_a.groups] == [g.uid for g in batch_b.groups]
    for ga, gb in zip(batch_a.groups, batch_b.groups, strict=True):
        chex.assert_trees_all_equal(
            [dataclasses.asdict(r) for r in ga.responses],
            [dataclasses.asdict(r) for r in gb.responses],
        )
        np.testing.assert_array_equal(ga.advantages, gb.advantages)


def test_checkpoints_from_before_the_agreement_fields_restore_with_unknown_values():
    engine = EmbeddedEngine(init_model(MODEL, seed=0), eos_token_ids=STOP_IDS, length_bucket=8)
    a = _producer(PARTIAL)
    a.produce(engine, 0)
    host, arrays = a.get_state()
    pool_versions = arrays["pool/scheduled_versions"]
    assert pool_versions.size and np.all(pool_versions == 0)  # scheduled: version 0
    old = {k: v for k, v in arrays.items() if not k.endswith(("scheduled_versions", "logprobs"))}
    old.update({k: v for k, v in arrays.items() if k.endswith("/logprobs")})
    assert not any(k.endswith("trainer_logprobs") for k in old)
    b = _producer(PARTIAL)
    b.set_state(host, old)
    for g in b.pool:
        for r in g.responses:
            assert np.all(r.scheduled_versions == -1) and np.all(np.isnan(r.trainer_logprobs))
            assert len(r.scheduled_versions) == len(r.token_ids)


class _MetadataSource(ToySource):
    """ToySource prompts with per-row metadata (as a data file's verl columns give)."""

    def __getitem__(self, i: int):
        metadata = {"data_source": "toy", "extra_info": {"row": i, "tags": ["a", "b"]}}
        return dataclasses.replace(super().__getitem__(i), metadata=metadata)


class _RecordingReward:
    """toy_reward that records the metadata it gets and reports a counter per batch."""

    def __init__(self):
        self.metadata: list[dict] = []
        self.calls = 0

    def __call__(self, texts, answers, metadata):
        assert len(metadata) == len(texts) == len(answers)
        self.metadata.extend(metadata)
        self.calls += 1
        return toy_reward(texts, answers, metadata)

    def take_metrics(self) -> dict[str, float]:
        calls, self.calls = self.calls, 0
        return {"reward/calls": float(calls)}


def _metadata_producer(reward) -> RolloutProducer:
    source = _MetadataSource(answers=("parity",))
    it = prompt_iterator(source, PipelineConfig(batch_size=4, seed=0))
    return RolloutProducer(PARTIAL, PromptStream(it), reward, decode)


def test_reward_fn_gets_each_prompts_metadata_and_it_survives_a_checkpoint():
    engine = EmbeddedEngine(init_model(MODEL, seed=0), eos_token_ids=STOP_IDS, length_bucket=8)
    reward = _RecordingReward()
    a = _metadata_producer(reward)
    batch = a.produce(engine, 0)
    assert batch.metrics["reward/calls"] >= 1  # the reward function's take_metrics
    for g in batch.groups:
        assert g.metadata["extra_info"]["row"] == int(g.prompt_id[1:])
    rows = {m["extra_info"]["row"] for m in reward.metadata}
    assert {g.metadata["extra_info"]["row"] for g in batch.groups} <= rows
    assert all(m["data_source"] == "toy" for m in reward.metadata)
    assert a.pool and a.prompts._pending, "groups in flight and prompts pending"
    host, arrays = a.get_state()
    host = json.loads(json.dumps(host))  # as the checkpoint stores it
    b = _metadata_producer(_RecordingReward())
    b.set_state(host, arrays)
    assert [g.metadata for g in b.pool] == [g.metadata for g in a.pool]
    assert [p.metadata for p in b.prompts._pending] == [p.metadata for p in a.prompts._pending]
    later = b.produce(engine, 1)
    for g in later.groups:
        assert g.metadata["extra_info"]["row"] == int(g.prompt_id[1:])
