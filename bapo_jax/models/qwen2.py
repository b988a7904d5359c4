"""The Qwen2 decoder in Flax NNX, with stacked, scanned layers.

Parameters are ``nnx.Param`` variables. Each declares its logical axis names once, at creation,
in the standard NNX ``out_sharding`` metadata (e.g. ``("layers", "embed", "q_heads",
"head_dim")``); ``logical_axes`` / ``logical_partition_specs`` read them back for the sharding
code, which maps logical names to mesh axes. Mesh axis names never appear here. Variables are
created with ``eager_sharding=False`` so that building a model needs no mesh; sharded creation
goes through ``jax.jit(..., out_shardings=...)`` (or ``load_pretrained(..., mesh=...)``).

The decoder layers are one ``DecoderStack`` module whose parameters carry a leading "layers"
axis; the model's forward is `forward.forward`, which scans a pure layer function
(``layers.decoder_layer``) over them, so compile time does not grow with depth. (Chosen over
``nnx.scan``: the layer body is a plain function of arrays, so scan/remat compose without NNX
graph bookkeeping in the traced loop.)
"""

from __future__ import annotations

import functools
from typing import Any

import chex
import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from bapo_jax.models import layers as L
from bapo_jax.models import lora as lora_lib
from bapo_jax.models.config import LoRAConfig, ModelOptions, Qwen2Config
from bapo_jax.models.forward import forward

__all__ = [
    "DecoderStack",
    "Qwen2ForCausalLM",
    "abstract_model",
    "init_model",
    "logical_axes",
    "logical_partition_specs",
]

# Logical axis names (the vocabulary shared with the sharding rules).
LAYERS, VOCAB, EMBED, Q_HEADS, KV_HEADS, HEAD_DIM, MLP = (
    "layers",
    "vocab",
    "embed",
    "q_heads",
    "kv_heads",
    "head_dim",
    "mlp",
)


def _param(value: Array, axes: tuple[str, ...]) -> nnx.Param:
    if len(axes) != value.ndim:
        raise ValueError(f"logical axes {axes} do not match a rank-{value.ndim} parameter")
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], std: float, dtype: Any) -> Array:
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class DecoderStack(nnx.Module):
    """All decoder layers' parameters, stacked on a leading "layers" axis (HF init: N(0, 0.02)
    weights, zero biases, unit norms)."""

    def __init__(self, config: Qwen2Config, options: ModelOptions, *, rngs: nnx.Rngs):
        c, dt = config, options.param_dtype
        nl, d, f = c.num_hidden_layers, c.hidden_size, c.intermediate_size
        n, k, h = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        std = c.initializer_range
        self.input_layernorm = _param(jnp.ones((nl, d), dt), (LAYERS, EMBED))  # [L, D]
        self.q_proj = _param(
            _normal(rngs, (nl, d, n, h), std, dt), (LAYERS, EMBED, Q_HEADS, HEAD_DIM)
        )
        self.q_bias = _param(jnp.zeros((nl, n, h), dt), (LAYERS, Q_HEADS, HEAD_DIM))  # [L, N, H]
        self.k_proj = _param(
            _normal(rngs, (nl, d, k, h), std, dt), (LAYERS, EMBED, KV_HEADS, HEAD_DIM)
        )
        self.k_bias = _param(jnp.zeros((nl, k, h), dt), (LAYERS, KV_HEADS, HEAD_DIM))  # [L, K, H]
        self.v_proj = _param(
            _normal(rngs, (nl, d, k, h), std, dt), (LAYERS, EMBED, KV_HEADS, HEAD_DIM)
        )
        self.v_bias = _param(jnp.zeros((nl, k, h), dt), (LAYERS, KV_HEADS, HEAD_DIM))  # [L, K, H]
        self.o_proj = _param(
            _normal(rngs, (nl, n, h, d), std, dt), (LAYERS, Q_HEADS, HEAD_DIM, EMBED)
        )
        self.post_attention_layernorm = _param(jnp.ones((nl, d), dt), (LAYERS, EMBED))  # [L, D]
        self.gate_proj = _param(
            _normal(rngs, (nl, d, f), std, dt), (LAYERS, EMBED, MLP)
        )  # [L, D, F]
        self.up_proj = _param(_normal(rngs, (nl, d, f), std, dt), (LAYERS, EMBED, MLP))  # [L, D, F]
        self.down_proj = _param(
            _normal(rngs, (nl, f, d), std, dt), (LAYERS, MLP, EMBED)
        )  # [L, F, D]
        self.lora = None  # `attach_lora` adds the adapters

    def attach_lora(self, lora: LoRAConfig, rngs: nnx.Rngs, dtype: Any) -> None:
        """Adds fresh LoRA adapters on `lora.targets` (`lora.create`: B = 0)."""
        matrices = {t: getattr(self, t) for t in lora.targets}
        for name, variable in lora_lib.create(matrices, lora, rngs, dtype).items():
            setattr(self, name, variable)  # [L, in..., r] / [L, r, out...]
        self.lora = lora

    PARAM_NAMES = (
        "input_layernorm",
        "q_proj",
        "q_bias",
        "k_proj",
        "k_bias",
        "v_proj",
        "v_bias",
        "o_proj",
        "post_attention_layernorm",
        "gate_proj",
        "up_proj",
        "down_proj",
    )

    def stacked(self, dtype: Any) -> dict[str, Array]:
        """The stacked parameter arrays, cast to ``dtype`` (a no-op when they already are)."""
        return {name: getattr(self, name).get_value().astype(dtype) for name in self.PARAM_NAMES}

    def adapters(self, dtype: Any) -> dict[str, Array]:
        """The LoRA adapters' stacked arrays (`lora.adapter_names`; none without LoRA)."""
        if self.lora is None:
            return {}
        names = [n for t in self.lora.targets for n in lora_lib.adapter_names(t)]
        return {name: getattr(self, name).get_value().astype(dtype) for name in names}

    def merged(self, dtype: Any) -> dict[str, Array]:
        """The stacked base arrays with the adapters merged in (W + s A B; `stacked` without
        LoRA): what the decode layout, an HF export and a full-weight sync take."""
        stacked = self.stacked(dtype)
        if self.lora is None:
            return stacked
        return lora_lib.merged_stacked({**stacked, **self.adapters(dtype)}, self.lora)


class Qwen2ForCausalLM(nnx.Module):
    """Qwen2 causal LM: ``model(input_ids, attention_mask=mask)`` -> fp32 logits [B, T, V].

    ``config`` is the architecture, ``options`` the runtime choices (dtypes, remat, unroll).
    Embedding and LM head are both stored [V, D] (HF layout); tied models have no ``lm_head``.
    """

    def __init__(self, config: Qwen2Config, options: ModelOptions | None = None, *, rngs: nnx.Rngs):
        options = options or ModelOptions()
        self.config = config
        self.options = options
        c, dt = config, options.param_dtype
        self.embed_tokens = _param(
            _normal(rngs, (c.vocab_size, c.hidden_size), c.initializer_range, dt), (VOCAB, EMBED)
        )  # [V, D]
        self.layers = DecoderStack(c, options, rngs=rngs)
        self.norm = _param(jnp.ones((c.hidden_size,), dt), (EMBED,))  # [D]
        if not c.tie_word_embeddings:
            self.lm_head = _param(
                _normal(rngs, (c.vocab_size, c.hidden_size), c.initializer_range, dt),
                (VOCAB, EMBED),
            )  # [V, D]
        else:
            self.lm_head = None
        if options.lora is not None:  # last: the base's init does not depend on the adapters
            self.layers.attach_lora(options.lora, rngs, dt)

    # ---- public surface ------------------------------------------------------------------------
    def unembedding(self) -> Float[Array, "V D"]:
        """The [V, D] output-head matrix (the embedding itself when tied)."""
        if self.lm_head is None:
            return self.embed_tokens.get_value()
        return self.lm_head.get_value()

    def hidden_states(
        self,
        input_ids: Int[Array, "B T"],
        attention_mask: Int[Array, "B T"] | Bool[Array, "B T"] | None = None,
        positions: Int[Array, "B T"] | None = None,
        segment_ids: Int[Array, "B T"] | None = None,
    ) -> Float[Array, "B T D"]:
        """Final-normed hidden states [B, T, D] in the compute dtype.

        Either ``attention_mask`` (0/1 per token, left/right padding allowed; positions default
        to the HF derivation from the mask) or ``segment_ids`` (packed rows: 1, 2, ... per
        sequence, 0 for padding; positions default to restarting at 0 in each segment), not
        both. A token attends to earlier tokens of its own segment only. Padded positions hold
        finite values that mean nothing.
        """
        c, o = self.config, self.options
        chex.assert_rank(input_ids, 2)
        chex.assert_type(input_ids, int)
        b, t = input_ids.shape
        if attention_mask is not None and segment_ids is not None:
            raise ValueError("pass attention_mask or segment_ids to hidden_states, not both")
        if segment_ids is not None:
            chex.assert_shape(segment_ids, (b, t))
            chex.assert_type(segment_ids, int)
        elif attention_mask is not None:
            chex.assert_shape(attention_mask, (b, t))
            segment_ids = (attention_mask != 0).astype(jnp.int32)  # one segment per row
        else:
            segment_ids = jnp.ones((b, t), jnp.int32)
        if positions is None:
            positions = L.positions(segment_ids)
        chex.assert_shape(positions, (b, t))
        stacked, embed = self.layers.stacked(o.compute_dtype), self.embed_tokens.get_value()
        projections: L.Projections = L.SEPARATE
        if o.lora is not None:  # the adapters ride along the scanned layers, merged per layer
            stacked = {**stacked, **self.layers.adapters(o.compute_dtype)}
            projections = lora_lib.LoraProjections(o.lora)
        x, _ = forward(
            stacked,
            embed,
            input_ids,
            segment_ids,
            positions,
            config=c,
            options=o,
            projections=projections,
        )
        return L.rms_norm(x, self.norm.get_value(), c.rms_norm_eps)  # [B, T, D]

    def __call__(
        self,
        input_ids: Int[Array, "B T"],
        attention_mask: Int[Array, "B T"] | Bool[Array, "B T"] | None = None,
        positions: Int[Array, "B T"] | None = None,
        segment_ids: Int[Array, "B T"] | None = None,
    ) -> Float[Array, "B T V"]:
        h = self.hidden_states(
            input_ids, attention_mask=attention_mask, positions=positions, segment_ids=segment_ids
        )
        w = self.unembedding().astype(h.dtype)  # [V, D]
        b, t, d = h.shape
        # One token axis (B*T): the backward's dW is then a plain GEMM (see `layers._tokens`).
        logits = jnp.einsum("td,vd->tv", h.reshape(b * t, d), w, preferred_element_type=jnp.float32)
        return logits.reshape(b, t, w.shape[0])  # [B, T, V]


# ---- construction helpers ----------------------------------------------------------------------
def init_model(
    config: Qwen2Config, options: ModelOptions | None = None, *, seed: int = 0
) -> Qwen2ForCausalLM:
    """A randomly initialised model (HF's init distribution), created by one jitted program."""

    graphdef, _ = nnx.split(abstract_model(config, options))
    return nnx.merge(graphdef, _init_state(config, options, jnp.asarray(seed, jnp.uint32)))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _init_state(config: Qwen2Config, options: ModelOptions | None, seed: Array) -> nnx.State:
    rngs = nnx.Rngs(params=jax.random.key(seed))
    return nnx.state(Qwen2ForCausalLM(config, options, rngs=rngs))


def abstract_model(config: Qwen2Config, options: ModelOptions | None = None) -> Qwen2ForCausalLM:
    """The model with ``jax.ShapeDtypeStruct`` leaves and no memory allocated (memory planning,
    sharded restore targets)."""
    return nnx.eval_shape(lambda: Qwen2ForCausalLM(config, options, rngs=nnx.Rngs(params=0)))


def _as_model(model_or_config: Qwen2ForCausalLM | Qwen2Config) -> Qwen2ForCausalLM:
    if isinstance(model_or_config, Qwen2Config):
        return abstract_model(model_or_config)
    return model_or_config


def logical_partition_specs(model_or_config: Qwen2ForCausalLM | Qwen2Config) -> nnx.State:
    """``nnx.State`` (same structure as ``nnx.state(model, nnx.Param)``) whose leaves are
    ``PartitionSpec``s of *logical* axis names; map them to mesh axes with the sharding rules."""
    return nnx.get_partition_spec(nnx.state(_as_model(model_or_config), nnx.Param))


def logical_axes(model_or_config: Qwen2ForCausalLM | Qwen2Config) -> dict[str, Any]:
    """Nested dict (same keys as ``nnx.to_pure_dict(nnx.state(model, nnx.Param))``) mapping each
    parameter to its tuple of logical axis names, e.g. ``{"layers": {"q_proj": ("layers",
    "embed", "q_heads", "head_dim"), ...}, "embed_tokens": ("vocab", "embed"), ...}``."""
    state = nnx.state(_as_model(model_or_config), nnx.Param)
    axes = jax.tree.map(
        lambda v: tuple(v.get_metadata("out_sharding")),
        state,
        is_leaf=lambda v: isinstance(v, nnx.Variable),
    )
    return nnx.to_pure_dict(axes)
