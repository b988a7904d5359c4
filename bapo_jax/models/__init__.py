"""Qwen2.5 models in Flax NNX: configs, the decoder, HF checkpoints both ways."""

from bapo_jax.models.config import ModelOptions, Qwen2Config
from bapo_jax.models.hf import iter_hf_tensors, load_pretrained, save_pretrained, weight_map
from bapo_jax.models.presets import PRESETS
from bapo_jax.models.qwen2 import (
    Qwen2ForCausalLM,
    abstract_model,
    init_model,
    logical_axes,
    logical_partition_specs,
)

__all__ = [
    "PRESETS",
    "ModelOptions",
    "Qwen2Config",
    "Qwen2ForCausalLM",
    "abstract_model",
    "init_model",
    "iter_hf_tensors",
    "load_pretrained",
    "logical_axes",
    "logical_partition_specs",
    "save_pretrained",
    "weight_map",
]
