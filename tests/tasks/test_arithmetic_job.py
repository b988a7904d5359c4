"""The main job's model shape -> Qwen2 config mapping (`benchmarks.embedded_decode` reuses it)."""

from __future__ import annotations

import chex

from bapo_jax.tasks.arithmetic_job import ModelShape


def test_model_shape_config_has_the_shape_a_tied_head_and_the_token_ids():
    config = ModelShape(layers=3, hidden=64, heads=4, kv_heads=2).qwen2_config(
        48, bos_token_id=1, eos_token_id=2, pad_token_id=0
    )
    chex.assert_equal(
        (config.vocab_size, config.hidden_size, config.intermediate_size), (48, 64, 256)
    )
    chex.assert_equal((config.num_hidden_layers, config.max_window_layers), (3, 3))
    chex.assert_equal((config.num_attention_heads, config.num_key_value_heads), (4, 2))
    chex.assert_equal((config.head_dim, config.tie_word_embeddings), (16, True))
    chex.assert_equal((config.bos_token_id, config.eos_token_id, config.pad_token_id), (1, 2, 0))
