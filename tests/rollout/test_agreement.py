"""Trainer-side recomputation of an embedded rollout's behaviour log-probs."""

import numpy as np

from bapo_jax.models import Qwen2Config, init_model
from bapo_jax.rollout.agreement import logprob_mismatch, rollout_token_arrays
from bapo_jax.rollout.embedded import EmbeddedEngine
from bapo_jax.rollout.types import SamplingParams
from bapo_jax.train.state import split_model
from bapo_jax.train.step import StepConfig, make_logprob_fn

CONFIG = Qwen2Config.preset("tiny")
PROMPTS = [[5, 17, 42, 7], [3, 8], [250, 251, 252]]


def _logprob_fn(model, temperature):
    graphdef, params = split_model(model)
    fn = make_logprob_fn(graphdef, StepConfig(temperature=temperature))
    return lambda ids, mask: fn(params, ids, mask)[0]


def test_token_arrays_layout():
    model = init_model(CONFIG, seed=0)
    rollout = EmbeddedEngine(model, eos_token_ids=[2]).generate(
        PROMPTS, 2, SamplingParams(max_tokens=5, temperature=1.0), seed=0
    )
    arrays = rollout_token_arrays(rollout, pad_id=0)
    sample = rollout.samples[2]  # prompt 1 ([3, 8]), first sample
    row = arrays["input_ids"][2]
    k = len(sample.token_ids)
    np.testing.assert_array_equal(row[2:4], [3, 8])  # left-padded to the longest prompt (4)
    np.testing.assert_array_equal(row[4 : 4 + k], sample.token_ids)
    np.testing.assert_array_equal(arrays["behavior_logp"][2, 4 : 4 + k], sample.logprobs)
    assert arrays["response_mask"][2].sum() == k and arrays["attention_mask"][2].sum() == 2 + k


def test_same_weights_agree_and_changed_weights_do_not():
    model = init_model(CONFIG, seed=0)
    engine = EmbeddedEngine(model, eos_token_ids=[2])
    sampling = SamplingParams(max_tokens=8, temperature=0.6)
    rollout = engine.generate(PROMPTS, 2, sampling, seed=1)
    same = logprob_mismatch(rollout, _logprob_fn(model, 0.6), pad_id=0)
    assert same["max_abs_diff"] < 1e-5 and same["frac_above"] == 0.0

    other = init_model(CONFIG, seed=9)  # as if the sync had loaded other weights
    changed = logprob_mismatch(rollout, _logprob_fn(other, 0.6), pad_id=0, threshold=0.05)
    assert changed["max_abs_diff"] > 0.05 and changed["frac_above"] > 0.0
    # The wrong temperature is caught too.
    hot = logprob_mismatch(rollout, _logprob_fn(model, 1.0), pad_id=0)
    assert hot["mean_abs_diff"] > 1e-3
