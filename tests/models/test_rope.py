"""RoPE cos/sin: computed in the program and gathered from a host table, both against
transformers' Qwen2RotaryEmbedding (the reference), and the table path's compiled program holds
no cos/sin (the reason it exists: XLA recomputes them inside every layer's RoPE fusion)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bapo_jax.models import layers as L

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _hf_cos_sin(positions: np.ndarray, head_dim: int, theta: float):
    config = transformers.Qwen2Config(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=theta,
        max_position_embeddings=8192,
    )
    rotary = transformers.models.qwen2.modeling_qwen2.Qwen2RotaryEmbedding(config)
    x = torch.zeros((), dtype=torch.float32)
    cos, sin = rotary(x, torch.as_tensor(positions))  # [B, T, H], the halves repeated
    return cos.numpy()[..., : head_dim // 2], sin.numpy()[..., : head_dim // 2]


@pytest.mark.parametrize("head_dim, theta", [(64, 10000.0), (128, 1000000.0), (16, 10000.0)])
def test_both_paths_match_transformers(head_dim, theta):
    positions = np.array([[0, 1, 2, 7, 31, 500], [4095, 4000, 1234, 3, 0, 2048]], np.int32)
    want_cos, want_sin = _hf_cos_sin(positions, head_dim, theta)
    direct = L.rope_cos_sin(jnp.asarray(positions), head_dim, theta)
    table = L.rope_cos_sin(jnp.asarray(positions), head_dim, theta, table_length=4096)
    for cos, sin in (direct, table):
        chex.assert_shape([cos, sin], (2, 6, head_dim // 2))
        # The same fp32 angles (an ulp off in one inverse frequency would be ~1e-4 by position
        # 4000); cos / sin then differ by their float32 rounding only: 2 ulps of 1.
        np.testing.assert_allclose(cos, want_cos, rtol=0, atol=2.5e-7)
        np.testing.assert_allclose(sin, want_sin, rtol=0, atol=2.5e-7)
    np.testing.assert_array_equal(table[0][0, 0], np.ones(head_dim // 2))  # position 0: cos 1
    np.testing.assert_array_equal(table[1][0, 0], np.zeros(head_dim // 2))  # and sin 0


def test_the_table_path_computes_no_cos_or_sin_at_run_time():
    def rotate(x, positions, table_length):
        cos, sin = L.rope_cos_sin(positions, 64, 10000.0, table_length=table_length)
        return L.apply_rope(x, cos, sin)

    x = jnp.ones((2, 3, 4, 64), jnp.float32)  # [B, T, X, H]
    positions = jnp.array([[0, 1, 2], [5, 6, 7]], jnp.int32)
    program = {
        length: jax.jit(rotate, static_argnums=2).lower(x, positions, length).compile().as_text()
        for length in (None, 8)
    }
    assert "cosine(" in program[None] and "sine(" in program[None]
    assert "cosine(" not in program[8] and "sine(" not in program[8]
    np.testing.assert_allclose(rotate(x, positions, 8), rotate(x, positions, None), atol=1e-6)
