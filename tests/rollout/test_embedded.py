"""The embedded JAX sampler: cached decoding equals the full forward, behaviour log-probs equal
teacher-forced log-probs, greedy equals transformers' `generate`, seeds are deterministic."""

import chex
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from bapo_jax.models import decode, init_model, load_pretrained
from bapo_jax.models.config import Qwen2Config
from bapo_jax.models.logprobs import model_token_logprobs
from bapo_jax.rollout.embedded import EmbeddedEngine
from bapo_jax.rollout.types import SamplingParams
from tests.models.hf_fixtures import TinySpec, make_hf_checkpoint

PROMPTS = [[5, 17, 42, 7, 99], [3, 8], [250, 251, 252, 253, 254, 255, 256, 1, 9]]
EOS = 2


@pytest.fixture(scope="module")
def model():
    return init_model(Qwen2Config.preset("tiny"), seed=3)


def left_pad(prompts, pad=0):
    width = max(map(len, prompts))
    ids = np.full((len(prompts), width), pad, np.int32)
    mask = np.zeros((len(prompts), width), np.int32)
    for r, p in enumerate(prompts):
        ids[r, width - len(p) :], mask[r, width - len(p) :] = p, 1
    return jnp.asarray(ids), jnp.asarray(mask)


def test_prefill_and_decode_equal_the_full_forward(model):
    ids, mask = left_pad(PROMPTS)
    continuation = jnp.asarray([[11, 12, 13], [21, 22, 23], [31, 32, 33]], jnp.int32)
    full_ids = jnp.concatenate([ids, continuation], axis=1)
    full_mask = jnp.concatenate([mask, jnp.ones_like(continuation)], axis=1)
    expected = model(full_ids, attention_mask=full_mask)  # [B, P + 3, V]

    p = ids.shape[1]
    logits, positions, cache = decode.prefill(model, ids, mask, p + 3)
    chex.assert_trees_all_close(logits, expected[:, p - 1], atol=1e-5)
    for i in range(3):
        logits, cache = decode.decode_step(model, continuation[:, i], positions + i, cache)
        chex.assert_trees_all_close(logits, expected[:, p + i], atol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_behaviour_logprobs_equal_teacher_forced(model, temperature):
    engine = EmbeddedEngine(model, eos_token_ids=[EOS])
    sampling = SamplingParams(max_tokens=12, temperature=temperature)
    rollout = engine.generate(PROMPTS, n=2, sampling=sampling, seed=0)
    assert len(rollout.samples) == 6
    for sample in rollout.samples:
        prompt = PROMPTS[sample.prompt_index]
        seq = jnp.asarray([list(prompt) + list(sample.token_ids)], jnp.int32)
        targets = jnp.roll(seq, -1, axis=1)
        logp, _ = model_token_logprobs(model, seq, None, targets, temperature=temperature)
        teacher = np.asarray(logp[0, len(prompt) - 1 : -1])
        np.testing.assert_allclose(sample.logprobs, teacher, atol=1e-5)
        assert sample.finish_reason == ("stop" if sample.token_ids[-1] == EOS else "length")
        assert EOS not in sample.token_ids[:-1]
        assert (sample.versions == 0).all()


def test_same_seed_same_samples_and_version_tag(model):
    engine = EmbeddedEngine(model, eos_token_ids=[EOS], version=4)
    sampling = SamplingParams(max_tokens=10, temperature=1.0)
    a = engine.generate(PROMPTS, n=3, sampling=sampling, seed=7)
    b = engine.generate(PROMPTS, n=3, sampling=sampling, seed=7)
    c = engine.generate(PROMPTS, n=3, sampling=sampling, seed=8)
    ids = lambda r: [tuple(s.token_ids) for s in r.samples]
    assert ids(a) == ids(b)
    assert ids(a) != ids(c)
    assert all((s.versions == 4).all() for s in a.samples)


def test_top_k_one_is_greedy_with_zero_logprob(model):
    engine = EmbeddedEngine(model, eos_token_ids=[EOS])
    top1 = engine.generate(PROMPTS, 1, SamplingParams(max_tokens=6, temperature=1.0, top_k=1), 0)
    greedy = engine.generate(
        PROMPTS, 1, SamplingParams(max_tokens=6, temperature=1.0), 0, greedy=True
    )
    for s, g in zip(top1.samples, greedy.samples, strict=True):
        np.testing.assert_array_equal(s.token_ids, g.token_ids)
        np.testing.assert_allclose(s.logprobs, 0.0, atol=1e-6)  # processed: one token kept


def test_greedy_equals_transformers_generate(tmp_path):
    hf = make_hf_checkpoint(tmp_path, TinySpec(tied=True), seed=1)
    model = load_pretrained(tmp_path)
    engine = EmbeddedEngine(model, eos_token_ids=[EOS])
    rollout = engine.generate(
        PROMPTS, 1, SamplingParams(max_tokens=8, temperature=1.0), 0, greedy=True
    )
    ids, mask = left_pad(PROMPTS)
    with torch.no_grad():
        out = hf.generate(
            input_ids=torch.tensor(np.asarray(ids), dtype=torch.long),
            attention_mask=torch.tensor(np.asarray(mask), dtype=torch.long),
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=EOS,
            pad_token_id=0,
        )
    for r, sample in enumerate(rollout.samples):
        expected = out[r, ids.shape[1] :].tolist()
        if EOS in expected:
            expected = expected[: expected.index(EOS) + 1]
        assert sample.token_ids.tolist() == expected


def test_unsupported_sampling_fields_are_refused(model):
    engine = EmbeddedEngine(model, eos_token_ids=[EOS])
    with pytest.raises(ValueError, match=r"repetition_penalty=1\.1 is not supported"):
        engine.generate(
            PROMPTS, 1, SamplingParams(max_tokens=4, temperature=1.0, repetition_penalty=1.1), 0
        )
    with pytest.raises(ValueError, match="update_weights needs params="):
        engine.update_weights(1)


def test_update_weights_switches_policy(model):
    engine = EmbeddedEngine(model, eos_token_ids=[EOS])
    other = init_model(Qwen2Config.preset("tiny"), seed=11)
    sampling = SamplingParams(max_tokens=6, temperature=1.0)
    before = engine.generate(PROMPTS, 1, sampling, 0, greedy=True)
    engine.update_weights(1, params=nnx.state(other))
    after = engine.generate(PROMPTS, 1, sampling, 0, greedy=True)
    assert engine.policy_version == 1 and all((s.versions == 1).all() for s in after.samples)
    assert [s.token_ids.tolist() for s in before.samples] != [
        s.token_ids.tolist() for s in after.samples
    ]
