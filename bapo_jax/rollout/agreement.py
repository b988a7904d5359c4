"""Rollout/trainer agreement: recompute the behaviour log-probs of a rollout on the trainer side
and measure how far the engine's numbers are from them.

The engine (vLLM kernels in bf16, another batch layout) and the trainer never agree exactly;
`ratio_base="recomputed"` turns the gap into truncated IS weights min(pi_trainer / pi_engine, C).
These statistics tell whether that is needed, and catch a broken weight sync (a large gap).
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from bapo_jax.rollout.types import Rollout

# (input_ids [B, T], attention_mask [B, T]) -> token-aligned log-probs [B, T] at the sampling
# temperature, e.g. `lambda ids, mask: make_logprob_fn(graphdef, config)(params, ids, mask)[0]`
# with `bapo_jax.train.step.make_logprob_fn`.
LogprobFn = Callable[[jnp.ndarray, jnp.ndarray], jnp.ndarray]


def rollout_token_arrays(rollout: Rollout, pad_id: int) -> dict[str, np.ndarray]:
    """Prompt + response rows, left-padded prompts and right-padded responses, all [B, T]:
    input_ids, attention_mask, response_mask and the engine's behaviour log-probs aligned with
    the response tokens."""
    rows = [(rollout.prompt_ids[s.prompt_index], s) for s in rollout.samples]
    prompt_len = max(len(p) for p, _ in rows)
    response_len = max((len(s.token_ids) for _, s in rows), default=0)
    width = prompt_len + response_len
    ids = np.full((len(rows), width), pad_id, np.int32)  # [B, T]
    attention = np.zeros((len(rows), width), np.int32)
    response = np.zeros((len(rows), width), np.float32)
    behavior = np.zeros((len(rows), width), np.float32)
    for r, (prompt, sample) in enumerate(rows):
        start = prompt_len - len(prompt)
        end = prompt_len + len(sample.token_ids)
        ids[r, start:prompt_len] = prompt
        ids[r, prompt_len:end] = sample.token_ids
        attention[r, start:end] = 1
        response[r, prompt_len:end] = 1.0
        behavior[r, prompt_len:end] = sample.logprobs
    return {
        "input_ids": ids,
        "attention_mask": attention,
        "response_mask": response,
        "behavior_logp": behavior,
    }


def logprob_mismatch(
    rollout: Rollout, logprob_fn: LogprobFn, *, pad_id: int, threshold: float = 0.05
) -> dict[str, float]:
    """Statistics of |engine log-prob - trainer log-prob| over the rollout's response tokens:
    max, mean, the share above `threshold`, and the mean of (trainer - engine) (a bias)."""
    arrays = rollout_token_arrays(rollout, pad_id)
    trainer = np.asarray(
        logprob_fn(jnp.asarray(arrays["input_ids"]), jnp.asarray(arrays["attention_mask"]))
    )
    mask = arrays["response_mask"] > 0
    if not mask.any():
        return {"max_abs_diff": 0.0, "mean_abs_diff": 0.0, "frac_above": 0.0, "mean_diff": 0.0}
    diff = (trainer - arrays["behavior_logp"])[mask]
    return {
        "max_abs_diff": float(np.max(np.abs(diff))),
        "mean_abs_diff": float(np.mean(np.abs(diff))),
        "frac_above": float(np.mean(np.abs(diff) > threshold)),
        "mean_diff": float(np.mean(diff)),
    }
