"""One decode step's attention against the KV cache on CPU, fp32 (`decode_attention.cc`, an
XLA FFI custom call). For row b, KV head k and its G = N / K query heads:

    s[g, t] = q[b, k, g] . keys[b, k, :, t]            (q scaled by 1 / sqrt(H) beforehand)
    out[b, k, g] = sum_t softmax_t(s[g] | valid[b])[t] values[b, k, t]

over the slots t where `valid[b, t]`; keys [B, K, H, S] and values [B, K, S, H] are the cache
layouts of `bapo_jax.models.forward`. In XLA the same step is ~7 small thunks per layer; the
kernel does it in one call, the (row, KV head) groups shared between threads. Built and
registered by `bapo_jax.kernels.library` (`available()`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from bapo_jax.kernels.library import available

__all__ = ["TARGET", "available", "decode_attention"]

TARGET = "bapo_decode_attention"


def decode_attention(
    q: Float[Array, "B K G H"],
    keys: Float[Array, "B K H S"],
    values: Float[Array, "B K S H"],
    valid: Bool[Array, "B S"],
) -> Float[Array, "B K G H"]:
    """softmax(q keys | valid) values per (row, KV head); every row needs a valid slot. Needs
    `available()`."""
    if q.ndim != 4 or keys.ndim != 4:
        raise ValueError(
            f"decode_attention: want q [B, K, G, H], keys [B, K, H, S]; got {q.shape}, {keys.shape}"
        )
    b, kv, _, h = q.shape
    s = keys.shape[-1]
    for name, a in {"q": q, "keys": keys, "values": values}.items():
        if a.dtype != jnp.float32:
            raise ValueError(f"decode_attention takes fp32, got {name} {a.dtype}")
    if valid.dtype != jnp.bool_:
        raise ValueError(f"decode_attention: valid must be bool, got {valid.dtype}")
    want = {"keys": (b, kv, h, s), "values": (b, kv, s, h), "valid": (b, s)}
    for name, a in {"keys": keys, "values": values, "valid": valid}.items():
        if a.shape != want[name]:
            raise ValueError(
                f"decode_attention: {name} has shape {a.shape}, want {want[name]} for q {q.shape}"
            )
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    return jax.ffi.ffi_call(TARGET, out)(q, keys, values, valid)
