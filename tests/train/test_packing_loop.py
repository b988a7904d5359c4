"""Packing in the trainer: the same recorded rollout batches of the CPU task, trained with and
without `algorithm.packing`, give the same metrics rows and the same parameters.

The rollouts are recorded once (3 iterations of the main job's arithmetic task on a briefly
warm-started copy of its model, padded trainer) and replayed into every trainer, so the only
difference between two trainers is how their updates lay the sequences out.
"""

from __future__ import annotations

import copy
import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from bapo_jax.algorithms import registry
from bapo_jax.algorithms.bapo import BAPOConfig
from bapo_jax.algorithms.losses import PPOClipConfig
from bapo_jax.data.pipeline import PipelineConfig, prompt_iterator
from bapo_jax.tasks import arithmetic_job as job
from bapo_jax.train.config import AlgorithmConfig, CheckpointConfig, LoggingConfig
from bapo_jax.train.loop import Trainer
from experiments import cpu_arithmetic

STEPS = 3
# The main job's task and model shape; fewer problems (only the RL split is used).
TASK = dataclasses.replace(cpu_arithmetic.TASK, n_eval=10)
# A short warm start: a few answers right (the groups carry signal), responses of ~17 tokens.
WARM = dataclasses.replace(cpu_arithmetic.WARM_START, steps=60, learning_rate=3e-3, warmup_steps=0)
# The main job's trainer at half its batch (16 prompts x 8 samples, 4 updates of 32 rows) in 4
# micro-batches of 8 rows; a 64-token response cap (the job's is 32) makes rows of 12 + 64
# tokens, so that responses of the usual length pack two or more to a row.
CONFIG = dataclasses.replace(
    cpu_arithmetic.TRAINER,
    rollout=dataclasses.replace(
        cpu_arithmetic.TRAINER.rollout, prompts_per_step=16, max_response_tokens=64
    ),
    steps=STEPS,
    eval_every=0,
    checkpoint=CheckpointConfig(every=0, keep=1, async_save=False),
    logging=LoggingConfig(tensorboard=False, plots=False, progress=False),
)
# Keys that differ by design: timings, layout and compilation counters, throughput.
_LAYOUT_KEYS = ("time/", "packing/", "compile/", "overlap/", "sync/")
_THROUGHPUT_KEYS = ("tokens_per_s", "model_flops_per_s", "mfu")
# Declared loss metrics these runs leave out: the KL term's (kl_coef 0) and the IS weights'.
NOT_GIVEN = {"kl_ref", "is_weight_mean", "is_masked_frac"} | {
    f"{key}/lag{b}" for key in ("c_low", "c_high", "rho") for b in range(4)
}  # per lag bucket: staleness-aware BAPO only (lag_buckets > 1)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """The warm-started model and the 3 rollout batches a padded BAPO trainer generated."""
    task = job.build_task(TASK, cpu_arithmetic.SHAPE, rl_prompts=512)
    warm = job.WarmStart(task, WARM, seed=0)
    state, _ = warm.run(warm.initial, WARM.steps)
    params = jax.device_get(state.params)
    trainer = _trainer(
        task, warm.graphdef, params, _config("bapo", "token_mean", False), tmp_path_factory
    )
    batches = {}
    produce = trainer.producer.produce

    def record(engine, j):
        batches[j] = copy.deepcopy(produce(engine, j))
        return batches[j]

    trainer.producer.produce = record
    trainer.run()
    assert sorted(batches) == list(range(STEPS))
    rewards = np.concatenate([g.rewards for j in batches for g in batches[j].groups])
    assert 0.0 < rewards.mean() < 1.0  # the groups carry signal
    return task, warm.graphdef, params, batches


def _config(loss: str, aggregation: str, packing: bool):
    algorithm = AlgorithmConfig(
        loss=loss,
        bapo=BAPOConfig(rho0=0.5, aggregation=aggregation),
        ppo_clip=PPOClipConfig(aggregation=aggregation),
        mini_batches=4,
        micro_batches=4,
        packing=packing,
    )
    return dataclasses.replace(CONFIG, algorithm=algorithm)


def _trainer(task, graphdef, params, config, tmp_path_factory) -> Trainer:
    model = nnx.merge(graphdef, jax.tree.map(np.array, params))
    tok = task.tokenizer
    return Trainer(
        config,
        model=model,
        engine=job.engine_for(task, graphdef, params),
        prompts=prompt_iterator(task.rl, PipelineConfig(batch_size=16, seed=0)),
        reward_fn=job.reward_fn_of(task),
        decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
        pad_id=tok.pad_id,
        stop_token_ids=(tok.eos_id,),
        out_dir=str(tmp_path_factory.mktemp("run")),
    )


def _replay(recorded, config, tmp_path_factory):
    """Train on the recorded batches; (metrics rows, final params)."""
    task, graphdef, params, batches = recorded
    trainer = _trainer(task, graphdef, params, config, tmp_path_factory)
    trainer.producer.produce = lambda engine, j: copy.deepcopy(batches[j])
    rows = []
    log = trainer._iteration

    def iteration(i, executor, futures):
        rows.append(log(i, executor, futures))
        return rows[-1]

    trainer._iteration = iteration
    trainer.run()
    return rows, jax.device_get(trainer.state.params)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("loss", "aggregation"),
    [
        ("bapo", "token_mean"),
        ("bapo", "seq_mean_token_mean"),
        ("ppo_clip", "token_mean"),
        ("ppo_clip", "seq_mean_token_sum"),
    ],
)
def test_packed_trainer_equals_padded_trainer(recorded, tmp_path_factory, loss, aggregation):
    padded_rows, padded_params = _replay(
        recorded, _config(loss, aggregation, False), tmp_path_factory
    )
    packed_rows, packed_params = _replay(
        recorded, _config(loss, aggregation, True), tmp_path_factory
    )
    assert len(padded_rows) == len(packed_rows) == STEPS
    for i, (padded, packed) in enumerate(zip(padded_rows, packed_rows, strict=True)):
        compared = [
            k
            for k, v in padded.items()
            if isinstance(v, int | float)
            and not k.startswith(_LAYOUT_KEYS)
            and k not in _THROUGHPUT_KEYS
        ]
        # Every metric the loss declares is in the row, but the two that need an input these
        # runs do not give it (kl_coef 0: no reference log-probs; ratio_base "behavior": no IS
        # weights); the step adds the gradient's norm.
        declared = set(registry.get_loss(loss).metrics)
        logged = declared & set(padded)
        assert logged == declared - NOT_GIVEN, logged ^ (declared - NOT_GIVEN)
        assert (declared - NOT_GIVEN) | {"grad_norm"} <= set(compared)
        assert set(compared) <= set(packed), set(compared) - set(packed)
        for key in compared:
            np.testing.assert_allclose(
                packed[key], padded[key], rtol=1e-5, atol=1e-5, err_msg=f"iteration {i}: {key}"
            )
        # Packing ran fewer micro-batches with less padding, from one compiled step program.
        assert packed["packing/micro_batches"] < padded["packing/micro_batches"] == 4
        assert packed["packing/padding_share"] < padded["packing/padding_share"]
        assert packed["compile/train_step"] == padded["compile/train_step"] == 1
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), packed_params, padded_params
    )
