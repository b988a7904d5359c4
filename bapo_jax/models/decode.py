"""Incremental decoding with a KV cache: prefill a left-padded prompt batch, then one token at
a time. Used by the embedded sampler (`bapo_jax.rollout.embedded`).

Weights. `decode_weights` lays the model out for T = 1 steps once per policy: one dict per
layer (the decode loop never slices the stacked [L, ...] arrays, which XLA would copy every
step), q/k/v fused into one [D, (N + 2K) H] matrix and gate/up into one [D, 2F] matrix, the
output head transposed to [D, V]. A decode step reads every weight once for a handful of rows,
so it is bound by how fast the dots stream weights. Each matrix [in, out] is then stored one
of two ways:
* `packed=True` (fp32 on one device; the embedded engine's choice wherever the kernel builds):
  a `PackedMatrix` in the column panels of the CPU kernel `bapo_jax.kernels.panel_matmul`,
  which runs a 16-row step's dots about 1.4x faster than XLA's (docs/rollout.md) and also does
  the RMSNorm before a product and the residual add after it (`block_linear(norm=, residual=)`:
  fewer XLA thunks per step); a decode step then also runs its attention in the CPU kernel
  `bapo_jax.kernels.decode_attention`;
* otherwise cut into `column_blocks` column blocks, x @ W = concat_j(x @ W_j): XLA runs the
  independent block dots on separate cores, where one [16, 512] x [512, E] dot keeps mostly
  one core busy.
Fusing, cutting and packing compute exactly the same dot products as the separate matrices.

Cache layout: per layer keys k [B, K, H, S] and values v [B, K, S, H] in the compute dtype,
S = cache length, so both attention dots contract over the rows of their cache operand
(q [G, H] @ k [H, S], probs [G, S] @ v [S, H]). With [B, K, S, H] keys, contracted over their
minor dim, XLA's CPU score dot is several times slower than the value dot of the same size
(docs/rollout.md). Slot s of row b holds the key/value of the token written
at step s. Prompts are left-padded to a common length P, so every row writes slot P + i at
decode step i and one `dynamic_update_slice` per layer serves the whole batch (in place: the
caches are loop carries). `key_valid` [B, S] marks the slots holding real tokens (padding stays
False); in a decode step every valid slot is at or before the query, so `key_valid` alone is
the mask. `grow_cache` pads a cache to a longer S, so a sampler can attend over a short cache
while responses are short.

Decode attention with grouped KV heads (G = N // K), one query per row:

    s[b,k,g,t] = q[b,k,g] . K[b,k,t] / sqrt(H)   (fp32, -inf-like where the slot is invalid)
    out[b,k,g] = sum_t softmax_t(s)[b,k,g,t] V[b,k,t]

Positions follow the HF convention of the forward pass (`cumsum(mask) - 1`), so the cached
computation equals `model(...)` on the full sequence.
"""

from __future__ import annotations

import dataclasses
import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from bapo_jax.kernels import decode_attention, panel_matmul
from bapo_jax.models import layers as L
from bapo_jax.models.config import Qwen2Config
from bapo_jax.models.qwen2 import Qwen2ForCausalLM

# Column blocks per weight matrix: one independent dot per CPU core of the benchmark machine.
COLUMN_BLOCKS = 2

__all__ = [
    "COLUMN_BLOCKS",
    "DecodeWeights",
    "KVCache",
    "PackedMatrix",
    "block_linear",
    "decode_step",
    "decode_weights",
    "grow_cache",
    "init_cache",
    "prefill",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedMatrix:
    """A weight matrix [K, N] in the CPU decode kernel's column panels
    (`bapo_jax.kernels.panel_matmul.pack`): panels [ceil(N / 16), K, 16]."""

    panels: Float[Array, "P K 16"]
    n: int = dataclasses.field(metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeWeights:
    """A model's parameters in the compute dtype, laid out for decoding.

    layers: per layer {"input_layernorm" [D], "qkv" [D, (N+2K)H], "qkv_bias" [(N+2K)H],
      "o_proj" [NH, D], "post_attention_layernorm" [D], "gate_up" [D, 2F], "down_proj" [F, D]};
      the four matrices as tuples of column blocks or as `PackedMatrix` (the CPU kernel).
    unembed: the output head transposed to [D, V] (x @ W with W [in, out] is the faster layout
      for XLA's CPU dot at a handful of rows), stored like the layer matrices.
    """

    layers: tuple[dict[str, Array | tuple[Array, ...] | PackedMatrix], ...]
    embed: Float[Array, "V D"]
    norm: Float[Array, " D"]
    unembed: tuple[Float[Array, "D V"], ...] | PackedMatrix
    config: Qwen2Config = dataclasses.field(metadata=dict(static=True))

    @property
    def packed(self) -> bool:
        """Whether the matrices are in the CPU kernel's panels (then decoding also runs its
        attention kernel)."""
        return isinstance(self.unembed, PackedMatrix)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """k: per layer [B, K, H, S]; v: per layer [B, K, S, H]; key_valid: [B, S]; length: slots
    written so far (scalar)."""

    k: tuple[Float[Array, "B K H S"], ...]
    v: tuple[Float[Array, "B K S H"], ...]
    key_valid: Bool[Array, "B S"]
    length: Int[Array, ""]


def _column_blocks(w: Float[Array, "... I O"], blocks: int) -> tuple[Array, ...]:
    bounds = np.linspace(0, w.shape[-1], blocks + 1).round().astype(int)
    return tuple(w[..., lo:hi] for lo, hi in itertools.pairwise(bounds))


def block_linear(
    x: Float[Array, "... I"],
    blocks: tuple[Array, ...] | PackedMatrix,
    out_dtype=None,
    *,
    norm: Float[Array, " I"] | None = None,
    eps: float = 0.0,
    residual: Float[Array, "... O"] | None = None,
) -> Float[Array, "... O"]:
    """residual + rms_norm(x) @ W: the dot accumulated in fp32 and returned in `out_dtype`
    (default: x's dtype); the RMSNorm with scale `norm` only if given (`layers.rms_norm`), the
    residual only if given. W is a tuple of column blocks (one independent XLA dot per block)
    or a `PackedMatrix`: the CPU kernel, which does the norm and the residual inside its call."""
    if isinstance(blocks, PackedMatrix):
        rows = x.reshape(-1, x.shape[-1])  # [M, I]
        flat_residual = None if residual is None else residual.reshape(rows.shape[0], blocks.n)
        out = panel_matmul.panel_matmul(
            rows, blocks.panels, blocks.n, scale=norm, eps=eps, residual=flat_residual
        )  # [M, O] fp32
        return out.reshape(*x.shape[:-1], blocks.n).astype(out_dtype or x.dtype)
    if norm is not None:
        x = L.rms_norm(x, norm, eps)
    out = [jnp.einsum("...i,io->...o", x, w, preferred_element_type=jnp.float32) for w in blocks]
    out = jnp.concatenate(out, axis=-1).astype(out_dtype or x.dtype)
    return out if residual is None else residual + out


def decode_weights(
    model: Qwen2ForCausalLM, column_blocks: int = COLUMN_BLOCKS, *, packed: bool = False
) -> DecodeWeights:
    """Unstacks the layers, fuses q/k/v and gate/up, cuts every matrix into `column_blocks`
    column blocks (works on mesh-sharded params), or with `packed=True` stores every matrix in
    the CPU kernel's panels (fp32 compute, one device: `EmbeddedEngine` decides)."""
    if not isinstance(column_blocks, int) or column_blocks < 1:
        raise ValueError(f"column_blocks must be an int >= 1, got {column_blocks!r}")
    c, dtype = model.config, model.options.compute_dtype
    if packed and dtype != jnp.float32:
        raise ValueError(f"decode_weights(packed=True) needs fp32 compute, got {jnp.dtype(dtype)}")
    d, n, k, h = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    stacked = model.layers.stacked(dtype)
    qkv = jnp.concatenate(
        [
            stacked["q_proj"].reshape(-1, d, n * h),
            stacked["k_proj"].reshape(-1, d, k * h),
            stacked["v_proj"].reshape(-1, d, k * h),
        ],
        axis=-1,
    )  # [L, D, (N+2K)H]
    qkv_bias = jnp.concatenate(
        [
            stacked["q_bias"].reshape(-1, n * h),
            stacked["k_bias"].reshape(-1, k * h),
            stacked["v_bias"].reshape(-1, k * h),
        ],
        axis=-1,
    )  # [L, (N+2K)H]
    gate_up = jnp.concatenate([stacked["gate_proj"], stacked["up_proj"]], axis=-1)  # [L, D, 2F]
    o_proj = stacked["o_proj"].reshape(-1, n * h, d)  # [L, NH, D]
    if packed:
        cut = lambda w: PackedMatrix(panel_matmul.pack(w), w.shape[-1])
    else:
        cut = lambda w: _column_blocks(w, column_blocks)
    layers = tuple(
        {
            "input_layernorm": stacked["input_layernorm"][i],
            "qkv": cut(qkv[i]),
            "qkv_bias": qkv_bias[i],
            "o_proj": cut(o_proj[i]),
            "post_attention_layernorm": stacked["post_attention_layernorm"][i],
            "gate_up": cut(gate_up[i]),
            "down_proj": cut(stacked["down_proj"][i]),
        }
        for i in range(c.num_hidden_layers)
    )
    return DecodeWeights(
        layers=layers,
        embed=model.embed_tokens.get_value().astype(dtype),
        norm=model.norm.get_value().astype(dtype),
        unembed=cut(model.unembedding().astype(dtype).T),  # [D, V]
        config=c,
    )


def init_cache(weights: DecodeWeights, batch: int, length: int) -> KVCache:
    c = weights.config
    kv_heads, h, dtype = c.num_key_value_heads, c.head_dim, weights.embed.dtype
    k = tuple(jnp.zeros((batch, kv_heads, h, length), dtype) for _ in range(c.num_hidden_layers))
    v = tuple(jnp.zeros((batch, kv_heads, length, h), dtype) for _ in range(c.num_hidden_layers))
    return KVCache(k, v, jnp.zeros((batch, length), jnp.bool_), jnp.zeros((), jnp.int32))


def grow_cache(cache: KVCache, length: int) -> KVCache:
    """The same cache with S padded to `length` (new slots invalid)."""
    extra = length - cache.key_valid.shape[1]
    if extra < 0:
        raise ValueError(f"grow_cache length={length} is shorter than the cache's {extra + length}")
    pad_k = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, extra)))
    pad_v = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, extra), (0, 0)))
    return KVCache(
        tuple(map(pad_k, cache.k)),
        tuple(map(pad_v, cache.v)),
        jnp.pad(cache.key_valid, ((0, 0), (0, extra))),
        cache.length,
    )


def _attention_inputs(p, x, cos, sin, config: Qwen2Config):
    """Pre-norm, fused q/k/v projection with bias, RoPE on q and k: [B,T,N,H], [B,T,K,H] x 2."""
    b, t, _ = x.shape
    n, k, h = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    eps = config.rms_norm_eps
    qkv = block_linear(x, p["qkv"], norm=p["input_layernorm"], eps=eps)  # [B, T, (N+2K)H]
    qkv = qkv + p["qkv_bias"]
    q = qkv[..., : n * h].reshape(b, t, n, h)  # [B, T, N, H]
    kk = qkv[..., n * h : (n + k) * h].reshape(b, t, k, h)  # [B, T, K, H]
    v = qkv[..., (n + k) * h :].reshape(b, t, k, h)  # [B, T, K, H]
    return L.apply_rope(q, cos, sin), L.apply_rope(kk, cos, sin), v


def _attention_output_and_mlp(p, x, attn, config: Qwen2Config):
    """x + o(attn), then x + down(silu(gate) * up) with the fused gate/up matmul (the norm
    before it and both residual adds inside the matmuls: `block_linear`)."""
    b, t, n, h = attn.shape
    f, eps = config.intermediate_size, config.rms_norm_eps
    x = block_linear(attn.reshape(b, t, n * h), p["o_proj"], residual=x)  # [B, T, D]
    gate_up = block_linear(x, p["gate_up"], norm=p["post_attention_layernorm"], eps=eps)
    act = jax.nn.silu(gate_up[..., :f]) * gate_up[..., f:]  # [B, T, F]
    return block_linear(act, p["down_proj"], residual=x)  # [B, T, D]


def _cached_attention(
    q: Float[Array, "B N H"],
    k_cache: Float[Array, "B K H S"],
    v_cache: Float[Array, "B K S H"],
    key_valid: Bool[Array, "B S"],
    *,
    kernel: bool,
) -> Float[Array, "B N H"]:
    """One query per row against the cache, grouped KV heads (K/V never repeated); with
    `kernel` in one call of the CPU kernel `bapo_jax.kernels.decode_attention` (fp32)."""
    b, n, h = q.shape
    kv = k_cache.shape[1]
    qg = q.reshape(b, kv, n // kv, h) * jnp.asarray(h**-0.5, q.dtype)  # [B, K, G, H]
    if kernel:
        return decode_attention.decode_attention(qg, k_cache, v_cache, key_valid).reshape(b, n, h)
    scores = jnp.einsum(
        "bkgh,bkhs->bkgs", qg, k_cache, preferred_element_type=jnp.float32
    )  # [B, K, G, S] fp32
    scores = jnp.where(key_valid[:, None, None, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_cache.dtype)  # [B, K, G, S]
    return jnp.einsum("bkgs,bksh->bkgh", probs, v_cache).reshape(b, n, h)  # [B, N, H]


def _logits(weights: DecodeWeights, x: Float[Array, "B D"]) -> Float[Array, "B V"]:
    """The final norm and the output head: fp32 logits [B, V]."""
    eps = weights.config.rms_norm_eps
    return block_linear(x, weights.unembed, jnp.float32, norm=weights.norm, eps=eps)


def prefill(
    weights: DecodeWeights,
    input_ids: Int[Array, "B P"],
    attention_mask: Int[Array, "B P"],
    cache_length: int,
) -> tuple[Float[Array, "B V"], Int[Array, " B"], KVCache]:
    """Runs the left-padded prompts and writes their keys/values into a fresh cache.

    The prompt attends over its own P keys (causal, padding masked), not over the whole cache.
    Returns the fp32 logits of the next token [B, V], the next position of each row [B] and the
    cache (length P).
    """
    chex.assert_rank([input_ids, attention_mask], 2)
    chex.assert_equal_shape([input_ids, attention_mask])
    c = weights.config
    b, p = input_ids.shape
    if cache_length < p:
        raise ValueError(f"cache_length={cache_length} must be >= the prompt length {p}")
    segments = (attention_mask > 0).astype(jnp.int32)  # [B, P]: one segment per row
    positions = L.positions(segments)  # [B, P]
    mask = L.causal_mask(segments)  # [B, P, P]
    x = jnp.take(weights.embed, input_ids, axis=0)  # [B, P, D]
    cos, sin = L.rope_cos_sin(positions, c.head_dim, c.rope_theta, table_length=p)  # [B, P, H/2]
    cache = init_cache(weights, b, cache_length)
    ks, vs = [], []
    for layer, k_cache, v_cache in zip(weights.layers, cache.k, cache.v, strict=True):
        q, k, v = _attention_inputs(layer, x, cos, sin, c)
        x = _attention_output_and_mlp(layer, x, L.attention(q, k, v, mask), c)
        # keys [B, P, K, H] -> [B, K, H, P], values -> [B, K, P, H], into slots [0, P)
        ks.append(jax.lax.dynamic_update_slice_in_dim(k_cache, k.transpose(0, 2, 3, 1), 0, 3))
        vs.append(jax.lax.dynamic_update_slice_in_dim(v_cache, v.transpose(0, 2, 1, 3), 0, 2))
    key_valid = jax.lax.dynamic_update_slice_in_dim(cache.key_valid, attention_mask > 0, 0, 1)
    next_position = jnp.sum(attention_mask, axis=-1).astype(jnp.int32)  # [B]
    cache = KVCache(tuple(ks), tuple(vs), key_valid, jnp.asarray(p, jnp.int32))
    return _logits(weights, x[:, -1]), next_position, cache


def decode_step(
    weights: DecodeWeights,
    tokens: Int[Array, " B"],
    positions: Int[Array, " B"],
    cache: KVCache,
) -> tuple[Float[Array, "B V"], KVCache]:
    """Feeds one token per row at slot `cache.length`; returns next-token logits [B, V].

    A row's position is at most its slot, so below the cache's slot count: RoPE's cos/sin come
    from a table of that many positions (`layers.rope_cos_sin(table_length=)`)."""
    chex.assert_rank([tokens, positions], 1)
    c = weights.config
    b = tokens.shape[0]
    index = cache.length
    key_valid = jax.lax.dynamic_update_slice_in_dim(
        cache.key_valid, jnp.ones((b, 1), jnp.bool_), index, 1
    )  # [B, S]
    x = jnp.take(weights.embed, tokens[:, None], axis=0)  # [B, 1, D]
    slots = cache.key_valid.shape[1]
    cos, sin = L.rope_cos_sin(
        positions[:, None], c.head_dim, c.rope_theta, table_length=slots
    )  # [B, 1, H/2]
    kernels = weights.packed  # fp32 on one device with the CPU kernels built
    ks, vs = [], []
    for layer, k_cache, v_cache in zip(weights.layers, cache.k, cache.v, strict=True):
        q, k, v = _attention_inputs(layer, x, cos, sin, c)
        # keys [B, 1, K, H] -> [B, K, H, 1], values -> [B, K, 1, H], into slot `index`
        k_cache = jax.lax.dynamic_update_slice_in_dim(k_cache, k.transpose(0, 2, 3, 1), index, 3)
        v_cache = jax.lax.dynamic_update_slice_in_dim(v_cache, v.transpose(0, 2, 1, 3), index, 2)
        attn = _cached_attention(q[:, 0], k_cache, v_cache, key_valid, kernel=kernels)  # [B, N, H]
        x = _attention_output_and_mlp(layer, x, attn[:, None], c)
        ks.append(k_cache)
        vs.append(v_cache)
    return _logits(weights, x[:, 0]), KVCache(tuple(ks), tuple(vs), key_valid, index + 1)
