"""Supervised warm start: next-token cross-entropy on target (response) tokens only.

For a row x = prompt ++ target (right-padded to a fixed length T) with loss mask m_t = 1 on
the target tokens,

    L = - sum_{b,t} m_{b,t} log p_theta(x_{b,t} | x_{b,<t})  /  sum_{b,t} m_{b,t}

(a token mean over the whole batch; 0 for an empty mask). The log-probs come from the same
chunked path as the RL step (`bapo_jax.train.step.sequence_logprobs`, temperature 1), so the
[B, T, V] logits are never whole in memory; the optimizer is `bapo_jax.train.optim`'s AdamW.
Batches are drawn by `epoch_batches`: a seeded permutation per epoch, so the same seed gives
the same run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jaxtyping import Array, Float, Int

from bapo_jax.train import state as state_lib
from bapo_jax.train.state import TrainState
from bapo_jax.train.step import StepConfig, sequence_logprobs


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SFTBatch:
    """input_ids: prompt + target ids, right-padded [B, T]; attention_mask: 1 on real tokens
    [B, T]; loss_mask: 1.0 on target tokens (the trained ones) [B, T]."""

    input_ids: Int[Array, "B T"]
    attention_mask: Int[Array, "B T"]
    loss_mask: Float[Array, "B T"]

    def check(self) -> None:
        chex.assert_rank([self.input_ids, self.attention_mask, self.loss_mask], 2)
        chex.assert_equal_shape([self.input_ids, self.attention_mask, self.loss_mask])
        chex.assert_type(self.input_ids, int)


def make_sft_batch(
    prompts: Sequence[Sequence[int]],
    targets: Sequence[Sequence[int]],
    *,
    pad_id: int,
    length: int,
) -> SFTBatch:
    """Right-padded rows prompt ++ target of `length` tokens (fixed, so one compiled step serves
    every batch); the loss mask covers exactly the target tokens."""
    if len(prompts) != len(targets) or not prompts:
        raise ValueError(
            f"prompts and targets must be non-empty and of equal length, got {len(prompts)} "
            f"and {len(targets)}"
        )
    ids = np.full((len(prompts), length), pad_id, np.int32)  # [B, T]
    attention = np.zeros((len(prompts), length), np.int32)  # [B, T]
    loss_mask = np.zeros((len(prompts), length), np.float32)  # [B, T]
    for b, (prompt, target) in enumerate(zip(prompts, targets, strict=True)):
        if not prompt or not target:
            raise ValueError(f"row {b}: prompt and target must be non-empty")
        p, n = len(prompt), len(prompt) + len(target)
        if n > length:
            raise ValueError(f"row {b}: prompt + target is {n} tokens, longer than length={length}")
        ids[b, :p], ids[b, p:n] = prompt, target
        attention[b, :n] = 1
        loss_mask[b, p:n] = 1.0
    return SFTBatch(jnp.asarray(ids), jnp.asarray(attention), jnp.asarray(loss_mask))


def sft_loss(
    graphdef: nnx.GraphDef, params: nnx.State, batch: SFTBatch
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """Token-mean negative log-likelihood of the target tokens (module doc), with metrics:
    loss, num_tokens, and target_logp_min (mean over rows of the row's least likely target
    token's log-prob: how close the weakest step of each answer is to being learned)."""
    logp, _ = sequence_logprobs(
        graphdef, params, batch.input_ids, batch.attention_mask, StepConfig(), with_entropy=False
    )  # [B, T], temperature 1
    mask = batch.loss_mask
    num_tokens = jnp.sum(mask)
    loss = -jnp.sum(logp * mask) / jnp.maximum(num_tokens, 1.0)
    row_has_tokens = jnp.any(mask > 0, axis=-1)  # [B]
    row_min = jnp.min(jnp.where(mask > 0, logp, 0.0), axis=-1)  # [B]
    rows = jnp.maximum(jnp.sum(row_has_tokens), 1)
    metrics = {
        "loss": loss,
        "num_tokens": num_tokens,
        "target_logp_min": jnp.sum(jnp.where(row_has_tokens, row_min, 0.0)) / rows,
    }
    return loss, metrics


def make_sft_step(
    graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation
) -> Callable[[TrainState, SFTBatch], tuple[TrainState, dict[str, Array]]]:
    """The jitted `(state, batch) -> (new_state, metrics)`; the state's buffers are donated."""

    def loss_fn(trainable, frozen, batch):
        return sft_loss(graphdef, state_lib.merge_trainable(trainable, frozen), batch)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def step(state: TrainState, batch: SFTBatch):
        batch.check()
        trainable, frozen = state_lib.split_trainable(state.params)  # LoRA: the adapters
        (_, metrics), grads = grad_fn(trainable, frozen, batch)
        updates, opt_state = optimizer.update(grads, state.opt_state, trainable)
        params = state_lib.merge_trainable(optax.apply_updates(trainable, updates), frozen)
        metrics = dict(metrics)
        metrics["grad_norm"] = optax.tree.norm(grads)
        return TrainState(state.step + 1, params, opt_state), metrics

    return jax.jit(step, donate_argnums=(0,))


def epoch_batches(num_examples: int, batch_size: int, seed: int) -> Iterator[np.ndarray]:
    """Endless index batches: epoch e is the permutation of `default_rng([seed, e])`, cut into
    `batch_size` pieces (the remainder of each epoch is dropped)."""
    if batch_size < 1 or num_examples < batch_size:
        raise ValueError(
            f"batch_size must be in [1, num_examples={num_examples}], got {batch_size}"
        )
    epoch = 0
    while True:
        order = np.random.default_rng([seed, epoch]).permutation(num_examples)
        for start in range(0, num_examples - batch_size + 1, batch_size):
            yield order[start : start + batch_size]
        epoch += 1
