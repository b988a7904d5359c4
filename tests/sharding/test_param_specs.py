"""The PartitionSpec of every parameter kind of the 7B preset on the `7b` and `32b` meshes,
written out by hand and checked against what the declared logical axes + rules produce."""

import jax
from jax.sharding import PartitionSpec as P

from bapo_jax.models import Qwen2Config, logical_axes
from bapo_jax.sharding import rules

# Declared layouts: embedding / LM head [V, D]; q/k/v [L, D, heads, H]; o [L, N, H, D];
# biases [L, heads, H]; MLP [L, D, F] / [L, F, D]; norms [L, D] / [D].
EXPECTED_7B = {
    "embed_tokens": P("tensor", "fsdp"),
    "lm_head": P("tensor", "fsdp"),
    "norm": P("fsdp"),
    "layers": {
        "input_layernorm": P(None, "fsdp"),
        "post_attention_layernorm": P(None, "fsdp"),
        "q_proj": P(None, "fsdp", "tensor", None),
        "k_proj": P(None, "fsdp", "tensor", None),
        "v_proj": P(None, "fsdp", "tensor", None),
        "o_proj": P(None, "tensor", None, "fsdp"),
        "q_bias": P(None, "tensor", None),
        "k_bias": P(None, "tensor", None),
        "v_bias": P(None, "tensor", None),
        "gate_proj": P(None, "fsdp", "tensor"),
        "up_proj": P(None, "fsdp", "tensor"),
        "down_proj": P(None, "tensor", "fsdp"),
    },
}


def test_every_7b_parameter_has_the_hand_written_spec():
    axes = logical_axes(Qwen2Config.preset("qwen2.5-7b"))
    specs = rules.tree_specs(axes)
    assert jax.tree.structure(specs) == jax.tree.structure(EXPECTED_7B)
    for (path, got), want in zip(
        jax.tree_util.tree_leaves_with_path(specs), jax.tree.leaves(EXPECTED_7B), strict=True
    ):
        assert got == want, (jax.tree_util.keystr(path), got, want)


def test_tied_models_have_no_lm_head():
    axes = logical_axes(Qwen2Config.preset("qwen2.5-0.5b"))
    assert "lm_head" not in axes
    assert rules.tree_specs(axes)["embed_tokens"] == P("tensor", "fsdp")
