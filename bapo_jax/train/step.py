"""The jitted train step: chunked log-probs -> registered policy loss -> grads -> AdamW.

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
     full-batch gradient. A micro-batch without trained tokens (the empty tail of a packed
     update, `train.packing`) is skipped (`lax.cond`): it would add exactly zero. A loss that
     needs a statistic of the whole update before its backward declares it
     (`registry.UpdateStatistic`; BAPO's bound search): a forward-only pass computes every
     micro-batch's part, the parts add, and the loss's `finish` runs once on the sum;
  4. optax (clip by global norm, AdamW, warm-up schedule).

With `scored_length` W the output head (and the loss) sees only each row's trained tokens,
gathered in order into [B, W] (the rest masked): prompt positions never reach the LM head,
forward or backward. Each metric combines over micro-batches and updates as its loss declares
(`registry.LossSpec.metrics`; the step's own in `reductions.STEP_METRICS`).

Under a mesh the step is one `jax.jit` with the state's shardings in and out; every sum in the
loss and the search is global, so all devices see the same bounds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from bapo_jax.algorithms import losses, registry
from bapo_jax.checks import check_choice, check_field, check_int, is_finite_number, is_int
from bapo_jax.models import logprobs as logprobs_lib
from bapo_jax.sharding import rules as rules_lib
from bapo_jax.train import state as state_lib
from bapo_jax.train.batch import TrainBatch
from bapo_jax.train.config import AlgorithmConfig, RatioBase, TrainerConfig
from bapo_jax.train.reductions import combine_micro_metrics
from bapo_jax.train.state import TrainState


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """What one optimizer update computes.

    loss: registered loss name (`registry.loss_names()`; default: the trainer's default).
    loss_config: that loss's config (default: its config class's defaults).
    temperature: sampling temperature T; log-probs are log_softmax(logits / T).
    ratio_base: "behavior" (r = pi_theta / pi_behaviour, paper) or "recomputed"
      (r = pi_theta / pi_old, engine mismatch as truncated IS weights capped at
      `loss_config.is_cap`); "recomputed" needs `TrainBatch.old_logp`.
    num_micro_batches: gradient-accumulation steps per update.
    logprob_chunk_size, vocab_block_size: tiling of the chunked log-prob path.
    scored_length: None (log-probs at every position), or W: the most trained tokens a row
      holds (the trainer's response cap L; packed rows are packed to respect it); the head
      and the loss run on [B, W] gathered positions.
    max_grad_norm: the optimizer's global-norm clip (None: none), for the metric
      `grad_norm_clipped` = min(||g||, max_grad_norm) (the clip itself is the optimizer's).
    gradient_by_sign_every: 0 (off), or n: every n-th update (step % n == 0) also splits its
      gradient g = g_+ + g_- by the sign of the tokens' advantages (g_-: the A < 0 tokens'
      terms) and logs ||g_+||, ||g_-|| and grad_share_neg = ||g_-|| / (||g_+|| + ||g_-||)
      (NaN on the other updates): one more backward pass on those updates (+~2/3 of one).
    """

    loss: str = AlgorithmConfig.loss
    loss_config: Any = None
    temperature: float = 1.0
    ratio_base: RatioBase = "behavior"
    num_micro_batches: int = 1
    logprob_chunk_size: int = logprobs_lib.DEFAULT_CHUNK_SIZE
    vocab_block_size: int = logprobs_lib.DEFAULT_VOCAB_BLOCK_SIZE
    scored_length: int | None = None
    max_grad_norm: float | None = None
    gradient_by_sign_every: int = 0

    def __post_init__(self):
        spec = registry.get_loss(self.loss)
        if self.loss_config is None:
            object.__setattr__(self, "loss_config", spec.config_cls())
        elif not isinstance(self.loss_config, spec.config_cls):
            raise ValueError(
                f"StepConfig.loss_config must be a {spec.config_cls.__name__} for "
                f"loss={self.loss!r}, got {type(self.loss_config).__name__}"
            )
        check_field(self.temperature > 0, "StepConfig.temperature", "> 0", self.temperature)
        check_choice("ratio_base", self.ratio_base, RatioBase)
        for name in ("num_micro_batches", "logprob_chunk_size", "vocab_block_size"):
            check_int(f"StepConfig.{name}", getattr(self, name), 1)
        w, c = self.scored_length, self.max_grad_norm
        check_field(w is None or is_int(w, 1), "StepConfig.scored_length", "None or an int >= 1", w)
        ok = c is None or (is_finite_number(c) and c > 0)
        check_field(ok, "StepConfig.max_grad_norm", "None or finite > 0", c)
        check_int("StepConfig.gradient_by_sign_every", self.gradient_by_sign_every, 0)

    @property
    def update_statistic(self) -> registry.UpdateStatistic | None:
        """The loss's update-wide statistic hook, when its config uses one."""
        return registry.get_loss(self.loss).update_statistic_for(self.loss_config)


def trainer_step_config(config: TrainerConfig) -> StepConfig:
    """The step a trainer runs (and the memory plan compiles): its loss, temperature, ratio
    base and micro-batches, with the head on the trained tokens (at most the response cap a
    row; packed rows are packed to respect it)."""
    algo = config.algorithm
    return StepConfig(
        loss=algo.loss,
        loss_config=algo.loss_config,
        temperature=config.rollout.temperature,
        ratio_base=algo.ratio_base,
        num_micro_batches=algo.micro_batches,
        scored_length=config.rollout.max_response_tokens,
        max_grad_norm=config.optimizer.max_grad_norm,
        gradient_by_sign_every=config.logging.gradient_by_sign_every,
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ScoredTokens:
    """The loss's per-token inputs at the positions whose log-probs are computed, [B, W]:
    every column (columns None, W = T), or each row's trained tokens in order (W =
    `StepConfig.scored_length`; columns = their column in the row, mask 0 after the last)."""

    columns: Int[Array, "B W"] | None
    mask: Float[Array, "B W"]
    advantages: Float[Array, "B W"]
    behavior_logp: Float[Array, "B W"]
    old_logp: Float[Array, "B W"] | None
    ref_logp: Float[Array, "B W"] | None
    segment_ids: Int[Array, "B W"] | None
    lags: Int[Array, "B W"] | None = None


def scored_columns(
    loss_mask: Float[Array, "B T"], width: int
) -> tuple[Int[Array, "B W"], Bool[Array, "B W"]]:
    """Column of each row's first `width` trained tokens, in order (0 after the last), and
    which entries are real. Rows must hold at most `width` trained tokens (not checked here:
    `check_scored_width` on the host)."""
    columns = jax.vmap(lambda m: jnp.nonzero(m > 0, size=width, fill_value=0)[0])(loss_mask)
    count = jnp.sum(loss_mask > 0, axis=1, keepdims=True)  # [B, 1]
    return columns.astype(jnp.int32), jnp.arange(width)[None, :] < count  # [B, W] each


def check_scored_width(loss_mask, width: int | None) -> None:
    """Host check: no row holds more than `width` trained tokens (they would be dropped)."""
    if width is None:
        return
    most = int(np.max(np.sum(np.asarray(loss_mask) > 0, axis=1), initial=0))
    if most > width:
        raise ValueError(f"a row holds {most} trained tokens > StepConfig.scored_length={width}")


def scored_tokens(batch: TrainBatch, width: int | None) -> ScoredTokens:
    """The batch's per-token loss inputs at its scored positions (see `ScoredTokens`)."""
    if width is None:
        return ScoredTokens(
            None,
            batch.loss_mask,
            batch.advantages,
            batch.behavior_logp,
            batch.old_logp,
            batch.ref_logp,
            batch.segment_ids,
            batch.lags,
        )
    columns, valid = scored_columns(batch.loss_mask, width)

    def take(x):
        return None if x is None else jnp.take_along_axis(x, columns, axis=1)

    return ScoredTokens(
        columns,
        jnp.where(valid, take(batch.loss_mask), 0.0),
        take(batch.advantages),
        take(batch.behavior_logp),
        take(batch.old_logp),
        take(batch.ref_logp),
        take(batch.segment_ids),
        take(batch.lags),
    )


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
    columns: Int[Array, "B W"] | None = None,
) -> tuple[Float[Array, "B W"], Float[Array, "B W"] | None]:
    """log pi(input_ids[t] | input_ids[<t]) at the temperature, and the entropy of the
    distribution that produced token t: at the given `columns` (each >= 1; [B, W]), or
    token-aligned at every column ([B, T], 0 at t = 0).

    Packed rows (``segment_ids``): the shift never crosses a segment boundary -- the first token
    of each segment gets 0 (it is a prompt token, never trained on)."""
    model = nnx.merge(graphdef, params)
    if segment_ids is None:
        hidden = model.hidden_states(input_ids, attention_mask=attention_mask)  # [B, T, D]
    else:
        hidden = model.hidden_states(input_ids, positions=positions, segment_ids=segment_ids)

    def head(hidden, targets):
        return logprobs_lib.token_logprobs(
            hidden,
            model.unembedding(),
            targets,
            temperature=config.temperature,
            chunk_size=config.logprob_chunk_size,
            vocab_block_size=config.vocab_block_size,
            return_entropy=with_entropy,
        )

    if columns is not None:  # only the scored positions reach the head
        before = jnp.maximum(columns - 1, 0)[..., None]  # [B, W, 1]: position t predicts t + 1
        hidden = jnp.take_along_axis(hidden, before, axis=1)  # [B, W, D]
        return head(hidden, jnp.take_along_axis(input_ids, columns, axis=1))  # [B, W] each
    logp, entropy = head(hidden[:, :-1], input_ids[:, 1:])  # [B, T-1] each

    def align(x):
        if x is None:
            return None
        x = jnp.pad(x, ((0, 0), (1, 0)))  # [B, T]
        if segment_ids is None:
            return x
        same = jnp.pad(segment_ids[:, 1:] == segment_ids[:, :-1], ((0, 0), (1, 0)))  # [B, T]
        return jnp.where(same, x, 0.0)

    return align(logp), align(entropy)


def _ratio_inputs(tokens: ScoredTokens, config: StepConfig):
    """(pi_base log-probs, truncated IS weights or None) for the configured ratio base."""
    if config.ratio_base == "behavior":
        return tokens.behavior_logp, None
    if tokens.old_logp is None:
        raise ValueError('ratio_base="recomputed" needs TrainBatch.old_logp, got None')
    weights = losses.importance_weights(
        tokens.old_logp, tokens.behavior_logp, tokens.mask, config.loss_config,
        tokens.segment_ids,
    )  # fmt: skip
    return tokens.old_logp, weights


def _counts(batch: TrainBatch) -> tuple[Array, Array]:
    """Global trained-token and trained-sequence (rows, or segments of packed rows) counts."""
    num_tokens = jnp.sum(batch.loss_mask)
    return num_tokens, losses.count_sequences(batch.loss_mask, batch.segment_ids)


def _check_reference_input(batch: TrainBatch, config: StepConfig) -> None:
    """beta = kl_coef > 0 needs log pi_ref of every token (the trainer's reference pass)."""
    kl_coef = config.loss_config.kl_coef
    if kl_coef > 0 and batch.ref_logp is None:
        raise ValueError(
            f"{config.loss}.kl_coef={kl_coef} > 0 needs TrainBatch.ref_logp (log pi_ref of every "
            "token, `train.reference`), got None"
        )


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
    spec = registry.get_loss(config.loss)
    hook = config.update_statistic

    def batch_logprobs(params, batch: TrainBatch, columns, with_entropy: bool):
        return sequence_logprobs(
            graphdef,
            params,
            batch.input_ids,
            batch.attention_mask,
            config,
            with_entropy=with_entropy,
            segment_ids=batch.segment_ids,
            positions=batch.positions,
            columns=columns,
        )

    def loss_of_logprobs(tokens: ScoredTokens, logp, entropy, update_statistic, counts):
        base_logp, is_weights = _ratio_inputs(tokens, config)
        extra = {} if update_statistic is None else {hook.keyword: update_statistic}
        if tokens.lags is not None:  # staleness-aware losses only (`TrainBatch.lags`)
            extra["lags"] = tokens.lags
        num_tokens, num_sequences = counts
        loss, metrics = spec.fn(
            logp,
            base_logp,
            tokens.advantages,
            tokens.mask,
            config.loss_config,
            is_weights=is_weights,
            ref_logp=tokens.ref_logp,
            num_tokens=num_tokens,
            num_sequences=num_sequences,
            entropy=entropy,
            segment_ids=tokens.segment_ids,
            **extra,
        )
        # |log pi_theta - log pi_behaviour| of this update's tokens (`BEHAVIOUR_GAP`): at a
        # batch's first update, with every token sampled by the current weights, the
        # engine / trainer mismatch, free (the loop reads it there).
        gap = jnp.abs(jax.lax.stop_gradient(logp) - tokens.behavior_logp) * tokens.mask
        metrics = dict(metrics)
        metrics["behavior_gap_sum"] = jnp.sum(gap)
        metrics["behavior_gap_max"] = jnp.max(gap)
        metrics["behavior_gap_tokens"] = jnp.sum(tokens.mask)
        return loss, metrics

    def loss_fn(trainable, whole, batch: TrainBatch, update_statistic, num_tokens, num_sequences):
        """The loss of the params `whole(trainable)` (the frozen part closed over)."""
        tokens = scored_tokens(batch, config.scored_length)
        logp, entropy = batch_logprobs(whole(trainable), batch, tokens.columns, with_entropy=True)
        return loss_of_logprobs(
            tokens, logp, entropy, update_statistic, (num_tokens, num_sequences)
        )

    def grads_by_sign(trainable, whole, batch: TrainBatch, update_statistic, counts):
        """(metrics, (g, g_-)): the loss's gradient at the per-token log-probs is pulled back
        through the model twice, whole and restricted to the A < 0 tokens (exact: the pullback
        is linear in its cotangent)."""
        tokens = scored_tokens(batch, config.scored_length)
        (logp, entropy), pullback = jax.vjp(
            lambda t: batch_logprobs(whole(t), batch, tokens.columns, with_entropy=True),
            trainable,
        )
        (_, metrics), cotangents = jax.value_and_grad(
            lambda lp, h: loss_of_logprobs(tokens, lp, h, update_statistic, counts),
            argnums=(0, 1),
            has_aux=True,
        )(logp, entropy)
        negative = (tokens.advantages < 0).astype(logp.dtype)  # [B, W]
        (grads,) = pullback(cotangents)
        (grads_neg,) = pullback(tuple(c * negative for c in cotangents))
        return metrics, (grads, grads_neg)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def if_trained(batch: TrainBatch, compute, *args):
        """compute(*args), or zeros of its shapes when `batch` has no trained token."""

        def skip(*args):
            shapes = jax.eval_shape(compute, *args)
            return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

        return jax.lax.cond(jnp.any(batch.loss_mask > 0), compute, skip, *args)

    def update_wide_statistic(params, micro: TrainBatch):
        """Forward-only pass over all micro-batches: the loss's parts add; `finish` once."""

        def part_of(batch):
            tokens = scored_tokens(batch, config.scored_length)
            logp, _ = batch_logprobs(params, batch, tokens.columns, with_entropy=False)
            base_logp, _ = _ratio_inputs(tokens, config)
            ratio = losses.safe_ratio(logp, base_logp, tokens.mask)
            lags = {} if tokens.lags is None else {"lags": tokens.lags}
            return hook.partial(
                ratio, tokens.advantages, tokens.mask, base_logp, config.loss_config, **lags
            )

        def add_part(total, batch):
            return jax.tree.map(jnp.add, total, if_trained(batch, part_of, batch)), None

        total, _ = jax.lax.scan(add_part, hook.zeros(config.loss_config), micro)
        return hook.finish(total, config.loss_config)

    def gradients(trainable, whole, batch: TrainBatch, statistic, counts, split):
        """(grads of `trainable`, metrics); with the split on, grads is (g, g_-), g_- = 0
        where not `split`."""
        if not config.gradient_by_sign_every:
            (_, metrics), grads = grad_fn(trainable, whole, batch, statistic, *counts)
            return grads, metrics

        def all_tokens():
            (_, metrics), grads = grad_fn(trainable, whole, batch, statistic, *counts)
            return (grads, jax.tree.map(jnp.zeros_like, grads)), metrics

        def by_sign():
            metrics, grads = grads_by_sign(trainable, whole, batch, statistic, counts)
            return grads, metrics

        return jax.lax.cond(split, by_sign, all_tokens)

    def step(state: TrainState, batch: TrainBatch):
        _check_reference_input(batch, config)
        counts = _counts(batch)
        # With LoRA adapters only they train (`state.split_trainable`); else every Param.
        trainable, frozen = state_lib.split_trainable(state.params)
        whole = lambda t: state_lib.merge_trainable(t, frozen)
        every = config.gradient_by_sign_every
        split = (state.step % every == 0) if every else None
        m = config.num_micro_batches
        if m == 1:
            grads, metrics = gradients(trainable, whole, batch, None, counts, split)
        else:
            micro = batch.split(m)
            statistic = None if hook is None else update_wide_statistic(state.params, micro)

            def micro_grads(batch):
                return gradients(trainable, whole, batch, statistic, counts, split)

            def accumulate(acc, batch):
                grads, metrics = if_trained(batch, micro_grads, batch)
                return jax.tree.map(jnp.add, acc, grads), metrics

            zeros = jax.tree.map(jnp.zeros_like, trainable)
            grads, stacked = jax.lax.scan(accumulate, (zeros, zeros) if every else zeros, micro)
            tokens = jnp.sum(micro.loss_mask, axis=(1, 2))  # [M]
            metrics = combine_micro_metrics(stacked, tokens, config.loss)

        metrics = dict(metrics)
        if every:
            grads, grads_neg = grads
            norm_neg = optax.tree.norm(grads_neg)
            norm_pos = optax.tree.norm(jax.tree.map(jnp.subtract, grads, grads_neg))
            share = norm_neg / jnp.maximum(norm_pos + norm_neg, 1e-30)
            metrics["grad_norm_neg"] = jnp.where(split, norm_neg, jnp.nan)
            metrics["grad_norm_pos"] = jnp.where(split, norm_pos, jnp.nan)
            metrics["grad_share_neg"] = jnp.where(split, share, jnp.nan)
        updates, opt_state = optimizer.update(grads, state.opt_state, trainable)
        trained = optax.apply_updates(trainable, updates)
        params = whole(trained)
        grad_norm = optax.tree.norm(grads)
        metrics["grad_norm"] = grad_norm
        if config.max_grad_norm is not None:
            metrics["grad_norm_clipped"] = jnp.minimum(grad_norm, config.max_grad_norm)
        metrics["param_norm"] = optax.tree.norm(trained)  # of what trains
        metrics["num_tokens"] = counts[0]
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
    """Jitted `(params, input_ids, attention_mask, segment_ids=None, positions=None,
    loss_mask=None) -> (logp, entropy)`, token-aligned [B, T] (packed rows: pass segment ids
    and positions): the recomputed old log-probs (ratio_base="recomputed"), reference
    log-probs, and the rollout/trainer agreement check. With `loss_mask` and
    `config.scored_length` the head runs only on the trained tokens (0 elsewhere)."""

    def fn(params, input_ids, attention_mask, segment_ids=None, positions=None, loss_mask=None):
        columns = valid = None
        if loss_mask is not None and config.scored_length is not None:
            columns, valid = scored_columns(loss_mask, config.scored_length)
        out = sequence_logprobs(
            graphdef,
            params,
            input_ids,
            attention_mask,
            config,
            with_entropy=with_entropy,
            segment_ids=segment_ids,
            positions=positions,
            columns=columns,
        )
        if columns is None:
            return out
        rows = jnp.arange(input_ids.shape[0])[:, None]  # [B, 1]

        def scatter(x):  # [B, W] -> [B, T], 0 off the trained tokens
            if x is None:
                return None
            zeros = jnp.zeros(input_ids.shape, x.dtype)
            return zeros.at[rows, columns].add(jnp.where(valid, x, 0.0))

        return scatter(out[0]), scatter(out[1])

    return jax.jit(fn)


def shard_batch(batch: TrainBatch, mesh: jax.sharding.Mesh) -> TrainBatch:
    """Places every [B, T] array with B split over the mesh's batch axes (data x fsdp)."""
    return jax.device_put(batch, rules_lib.batch_sharding(mesh, ndim=2))
