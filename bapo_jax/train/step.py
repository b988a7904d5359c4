"""The jitted train step: chunked log-probs -> policy loss (BAPO or a baseline) -> grads -> AdamW.

One call is one optimizer update on one `TrainBatch`:

  1. log pi_theta(y_t) at the sampling temperature for every token, through the chunked
     log-prob path (the [B, T, V] logits are never whole in memory);
  2. the registered loss (`StepConfig.loss`) with r_t = pi_theta / pi_base, pi_base the
     behaviour policy (`ratio_base="behavior"`, the paper) or the recomputed old policy
     (`"recomputed"`, with truncated IS weights min(pi_old / pi_behaviour, C)); with
     beta = `loss_config.kl_coef` > 0 it adds beta * agg(KL_t) against the frozen reference's
     `TrainBatch.ref_logp` (k1: log pi_theta - log pi_ref; k3: pi_ref/pi_theta -
     log(pi_ref/pi_theta) - 1; no gradient through pi_ref);
  3. gradient accumulation over `num_micro_batches`: the loss of each micro-batch is normalised
     by the token (and sequence) counts of the WHOLE update, so the summed gradient equals the
     full-batch gradient. BAPO's bound search covers the whole update (paper): a forward-only
     pass tabulates every micro-batch's `GridSums`, which add, and the search runs once on the
     sum before the first backward. `BAPOConfig.scope="micro_batch"` searches per micro-batch
     (the authors' code) instead;
  4. optax (clip by global norm, AdamW, warm-up schedule).

Under a mesh the step is one `jax.jit` with the state's shardings in and out; every sum in the
loss and the search is global, so all devices see the same bounds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jaxtyping import Array, Float, Int

from bapo_jax.algorithms import bapo_search, losses
from bapo_jax.models import logprobs as logprobs_lib
from bapo_jax.sharding import rules as rules_lib
from bapo_jax.train.batch import TrainBatch
from bapo_jax.train.state import TrainState

RATIO_BASES = ("behavior", "recomputed")


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """What one optimizer update computes.

    loss: registered loss name ("bapo", "ppo_clip", "clip_higher").
    loss_config: that loss's config (default: its defaults, e.g. `BAPOConfig()`).
    temperature: sampling temperature T; log-probs are log_softmax(logits / T).
    ratio_base: "behavior" (r = pi_theta / pi_behaviour, paper) or "recomputed"
      (r = pi_theta / pi_old, engine mismatch as truncated IS weights capped at
      `loss_config.is_cap`); "recomputed" needs `TrainBatch.old_logp`.
    num_micro_batches: gradient-accumulation steps per update.
    logprob_chunk_size, vocab_block_size: tiling of the chunked log-prob path.
    """

    loss: str = "bapo"
    loss_config: Any = None
    temperature: float = 1.0
    ratio_base: str = "behavior"
    num_micro_batches: int = 1
    logprob_chunk_size: int = logprobs_lib.DEFAULT_CHUNK_SIZE
    vocab_block_size: int = logprobs_lib.DEFAULT_VOCAB_BLOCK_SIZE

    def __post_init__(self):
        spec = losses.get_loss(self.loss)
        if self.loss_config is None:
            object.__setattr__(self, "loss_config", spec.config_cls())
        elif not isinstance(self.loss_config, spec.config_cls):
            raise ValueError(
                f"StepConfig.loss_config must be a {spec.config_cls.__name__} for "
                f"loss={self.loss!r}, got {type(self.loss_config).__name__}"
            )
        if not self.temperature > 0:
            raise ValueError(f"StepConfig.temperature must be > 0, got {self.temperature!r}")
        losses.check_choice("ratio_base", self.ratio_base, RATIO_BASES)
        for name in ("num_micro_batches", "logprob_chunk_size", "vocab_block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"StepConfig.{name} must be an int >= 1, got {value!r}")

    @property
    def update_wide_search(self) -> bool:
        spec = losses.get_loss(self.loss)
        return spec.adaptive_bounds and getattr(self.loss_config, "scope", "update") == "update"


def sequence_logprobs(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    input_ids: Int[Array, "B T"],
    attention_mask: Int[Array, "B T"],
    config: StepConfig,
    *,
    with_entropy: bool = True,
    segment_ids: Int[Array, "B T"] | None = None,
    positions: Int[Array, "B T"] | None = None,
) -> tuple[Float[Array, "B T"], Float[Array, "B T"] | None]:
    """Token-aligned log pi(input_ids[t] | input_ids[<t]) at the temperature (0 at t = 0), and
    the entropy of the distribution that produced token t.

    Packed rows (``segment_ids``): the shift never crosses a segment boundary -- the first token
    of each segment gets 0 (it is a prompt token, never trained on)."""
    model = nnx.merge(graphdef, params)
    if segment_ids is None:
        hidden = model.hidden_states(input_ids, attention_mask=attention_mask)  # [B, T, D]
    else:
        hidden = model.hidden_states(input_ids, positions=positions, segment_ids=segment_ids)
    logp, entropy = logprobs_lib.token_logprobs(
        hidden[:, :-1],
        model.unembedding(),
        input_ids[:, 1:],
        temperature=config.temperature,
        chunk_size=config.logprob_chunk_size,
        vocab_block_size=config.vocab_block_size,
        return_entropy=with_entropy,
    )  # [B, T-1] each: position t predicts token t + 1

    def align(x):
        if x is None:
            return None
        x = jnp.pad(x, ((0, 0), (1, 0)))  # [B, T]
        if segment_ids is None:
            return x
        same = jnp.pad(segment_ids[:, 1:] == segment_ids[:, :-1], ((0, 0), (1, 0)))  # [B, T]
        return jnp.where(same, x, 0.0)

    return align(logp), align(entropy)


def _ratio_inputs(batch: TrainBatch, config: StepConfig):
    """(pi_base log-probs, truncated IS weights or None) for the configured ratio base."""
    if config.ratio_base == "behavior":
        return batch.behavior_logp, None
    if batch.old_logp is None:
        raise ValueError('ratio_base="recomputed" needs TrainBatch.old_logp, got None')
    weights = losses.truncated_is_weights(
        batch.old_logp, batch.behavior_logp, cap=config.loss_config.is_cap, mask=batch.loss_mask
    )
    return batch.old_logp, weights


def _counts(batch: TrainBatch) -> tuple[Array, Array]:
    """Global response-token and response-sequence counts of the update."""
    num_tokens = jnp.sum(batch.loss_mask)
    num_sequences = jnp.sum(jnp.any(batch.loss_mask > 0, axis=-1).astype(jnp.float32))
    return num_tokens, num_sequences


def _check_packed_aggregation(batch: TrainBatch, config: StepConfig) -> None:
    """Sequence-level aggregations treat a row as one sequence; packed rows hold several."""
    aggregation = getattr(config.loss_config, "aggregation", "token_mean")
    if batch.segment_ids is not None and aggregation != "token_mean":
        raise ValueError(
            f"packed batches (segment_ids) need aggregation='token_mean', got {aggregation!r}"
        )


def _check_reference_input(batch: TrainBatch, config: StepConfig) -> None:
    """beta = kl_coef > 0 needs log pi_ref of every token (the trainer's reference pass)."""
    kl_coef = config.loss_config.kl_coef
    if kl_coef > 0 and batch.ref_logp is None:
        raise ValueError(
            f"{config.loss}.kl_coef={kl_coef} > 0 needs TrainBatch.ref_logp (log pi_ref of every "
            "token, `train.reference`), got None"
        )


# Metrics that are already normalised by the global counts add over micro-batches; extrema
# combine by min/max; everything else is a per-token share or mean, weighted by token count.
_SUMMED = ("loss", "pg_loss", "kl_ref")
_MIN, _MAX = ("ratio_min",), ("ratio_max", "iterations")


def combine_micro_metrics(
    metrics: dict[str, Array], tokens: Float[Array, " M"]
) -> dict[str, Array]:
    """Reduce [M]-stacked micro-batch metrics to update-level scalars."""
    weights = tokens / jnp.maximum(jnp.sum(tokens), 1.0)
    out = {}
    for key, value in metrics.items():
        if key in _SUMMED:
            out[key] = jnp.sum(value)
        elif key in _MIN:
            out[key] = jnp.min(jnp.where(tokens > 0, value, jnp.inf))
        elif key in _MAX:
            out[key] = jnp.max(value)
        elif value.dtype == jnp.bool_:
            out[key] = jnp.all(value)
        else:
            out[key] = jnp.sum(weights * value)
    return out


def make_train_step(
    graphdef: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    config: StepConfig,
    *,
    learning_rate_fn: optax.Schedule | None = None,
    state_shardings=None,
) -> Callable[[TrainState, TrainBatch], tuple[TrainState, dict[str, Array]]]:
    """The jitted `(state, batch) -> (new_state, metrics)`; the state's buffers are donated.

    Inputs keep the shardings they arrive with (place the batch with `shard_batch`); with
    `state_shardings` the new state is pinned to the same layout as the old one.
    `learning_rate_fn` (e.g. `optim.learning_rate_schedule(cfg)`) only adds a metric.
    """
    spec = losses.get_loss(config.loss)

    def batch_logprobs(params, batch: TrainBatch, with_entropy: bool):
        return sequence_logprobs(
            graphdef,
            params,
            batch.input_ids,
            batch.attention_mask,
            config,
            with_entropy=with_entropy,
            segment_ids=batch.segment_ids,
            positions=batch.positions,
        )

    def loss_fn(params, batch: TrainBatch, bounds, num_tokens, num_sequences):
        logp, entropy = batch_logprobs(params, batch, with_entropy=True)
        base_logp, is_weights = _ratio_inputs(batch, config)
        extra = {"bounds": bounds} if spec.adaptive_bounds else {}
        loss, metrics = spec.fn(
            logp,
            base_logp,
            batch.advantages,
            batch.loss_mask,
            config.loss_config,
            is_weights=is_weights,
            ref_logp=batch.ref_logp,
            num_tokens=num_tokens,
            num_sequences=num_sequences,
            entropy=entropy,
            **extra,
        )
        return loss, metrics

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def update_wide_bounds(params, micro: TrainBatch) -> bapo_search.BoundSearchResult:
        """Forward-only pass over all micro-batches; the grid sums add; one search."""

        def add_sums(total, batch):
            logp, _ = batch_logprobs(params, batch, with_entropy=False)
            base_logp, _ = _ratio_inputs(batch, config)
            ratio = losses.safe_ratio(logp, base_logp, batch.loss_mask)
            # Same log-probs as `policy_loss` receives, so both scopes weight alike (Eq. 8).
            sums = bapo_search.grid_sums(
                ratio, batch.advantages, batch.loss_mask, config.loss_config, base_logp
            )
            return total + sums, None

        cfg = config.loss_config
        zeros = bapo_search.GridSums(
            pos=jnp.zeros(len(cfg.high_grid), jnp.float32),
            neg=jnp.zeros(len(cfg.low_grid), jnp.float32),
        )
        total, _ = jax.lax.scan(add_sums, zeros, micro)
        return bapo_search.search_from_sums(total, cfg)

    def step(state: TrainState, batch: TrainBatch):
        _check_packed_aggregation(batch, config)
        _check_reference_input(batch, config)
        num_tokens, num_sequences = _counts(batch)
        m = config.num_micro_batches
        if m == 1:
            (_, metrics), grads = grad_fn(state.params, batch, None, num_tokens, num_sequences)
        else:
            micro = batch.split(m)
            bounds = update_wide_bounds(state.params, micro) if config.update_wide_search else None

            def accumulate(acc, batch):
                (_, metrics), grads = grad_fn(
                    state.params, batch, bounds, num_tokens, num_sequences
                )
                return jax.tree.map(jnp.add, acc, grads), metrics

            zeros = jax.tree.map(jnp.zeros_like, state.params)
            grads, stacked = jax.lax.scan(accumulate, zeros, micro)
            metrics = combine_micro_metrics(stacked, jnp.sum(micro.loss_mask, axis=(1, 2)))

        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = dict(metrics)
        metrics["grad_norm"] = optax.tree.norm(grads)
        metrics["param_norm"] = optax.tree.norm(params)
        metrics["num_tokens"] = num_tokens
        if learning_rate_fn is not None:
            metrics["learning_rate"] = learning_rate_fn(state.step)
        return TrainState(state.step + 1, params, opt_state), metrics

    if state_shardings is None:
        return jax.jit(step, donate_argnums=(0,))
    mesh = jax.tree.leaves(state_shardings)[0].mesh

    def step_on_mesh(state, batch):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # for `rules.constrain`
            return step(state, batch)

    return jax.jit(step_on_mesh, donate_argnums=(0,), out_shardings=(state_shardings, None))


def make_logprob_fn(
    graphdef: nnx.GraphDef, config: StepConfig, *, with_entropy: bool = False
) -> Callable[..., tuple[Float[Array, "B T"], Float[Array, "B T"] | None]]:
    """Jitted `(params, input_ids, attention_mask, segment_ids=None, positions=None) -> (logp,
    entropy)`, token-aligned (packed rows: pass segment ids and positions): the
    recomputed old log-probs (ratio_base="recomputed"), reference log-probs, and the
    rollout/trainer agreement check."""

    def fn(params, input_ids, attention_mask, segment_ids=None, positions=None):
        return sequence_logprobs(
            graphdef,
            params,
            input_ids,
            attention_mask,
            config,
            with_entropy=with_entropy,
            segment_ids=segment_ids,
            positions=positions,
        )

    return jax.jit(fn)


def shard_batch(batch: TrainBatch, mesh: jax.sharding.Mesh) -> TrainBatch:
    """Places every [B, T] array with B split over the mesh's batch axes (data x fsdp)."""
    return jax.device_put(batch, rules_lib.batch_sharding(mesh, ndim=2))
