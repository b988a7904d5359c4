"""The frozen reference policy pi_ref of the KL penalty.

With beta = the loss section's `kl_coef` > 0 the loss adds (`algorithms.losses`)

    beta * agg(KL_t),   KL_t = k1: log pi_theta(y_t) - log pi_ref(y_t)
                               k3: pi_ref/pi_theta - log(pi_ref/pi_theta) - 1   (Schulman 2020)

so the trainer needs log pi_ref(y_t) of every trained response token, at the rollout
temperature. pi_ref is

  * a frozen copy of the initial policy (the `model` the `Trainer` is built from), by default;
  * the HF checkpoint `algorithm.reference_hf_dir` when set (same architecture as the policy:
    its log-probs are computed with the policy's module, so every field that changes the
    forward pass must agree).

Its params live in fresh buffers (the train step donates the policy's), with the policy's
dtype and, under a mesh, the policy's `NamedSharding`s (`state.state_shardings`): one more
params-sized array set per device, nothing when kl_coef == 0 (no reference is read, checked
or built then). The run checkpoint does not store it: a resumed run rebuilds it identically
from the same initial model (same seed or `model.hf_dir`) or the same `reference_hf_dir`.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from flax import nnx

from bapo_jax.models.config import Qwen2Config
from bapo_jax.models.qwen2 import Qwen2ForCausalLM
from bapo_jax.train.config import AlgorithmConfig
from bapo_jax.train.state import split_model, state_shardings

# Architecture fields that change the forward pass: a reference must match the policy in all.
FORWARD_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "rope_theta",
    "rms_norm_eps",
    "tie_word_embeddings",
    "hidden_act",
)


def check_same_architecture(reference: Qwen2Config, policy: Qwen2Config, key: str) -> None:
    """Refuse a reference whose forward pass differs from the policy's, naming the fields."""
    diff = {
        name: (getattr(reference, name), getattr(policy, name))
        for name in FORWARD_FIELDS
        if getattr(reference, name) != getattr(policy, name)
    }
    if diff:
        shown = ", ".join(f"{k}: reference {r!r} vs policy {p!r}" for k, (r, p) in diff.items())
        raise ValueError(f"{key}: the reference's architecture differs from the policy's ({shown})")


def check_reference_source(algorithm: AlgorithmConfig, policy: Qwen2Config | None = None) -> None:
    """Before any compute: with kl_coef > 0, `reference_hf_dir` (if set) is a directory with a
    config.json whose architecture is the policy's (when `policy` is given). kl_coef == 0:
    nothing is checked (the reference is never built)."""
    directory, key = algorithm.reference_hf_dir, "algorithm.reference_hf_dir"
    if algorithm.kl_coef == 0 or directory is None:
        return
    why = f"(the reference policy of {algorithm.loss}.kl_coef={algorithm.kl_coef} > 0)"
    if not os.path.isdir(directory):
        raise ValueError(f"{key}: {directory!r} is not a directory {why}")
    if not os.path.isfile(os.path.join(directory, "config.json")):
        raise ValueError(f"{key}: {directory!r} has no config.json {why}")
    if policy is not None:
        check_same_architecture(Qwen2Config.from_hf(directory), policy, key)


def _fresh_copy(params: nnx.State, mesh: jax.sharding.Mesh | None) -> nnx.State:
    """New buffers holding `params`, laid out like the policy's params on `mesh`."""
    shardings = None if mesh is None else state_shardings(params, mesh)
    return jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=shardings)(params)


def _layout(params: nnx.State) -> list[tuple[str, tuple[int, ...], str]]:
    """(path, shape, dtype) of every array of a params tree."""
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    return [(jax.tree_util.keystr(k), tuple(x.shape), str(x.dtype)) for k, x in flat]


def build_reference_params(
    algorithm: AlgorithmConfig,
    model: Qwen2ForCausalLM,
    *,
    reference: Qwen2ForCausalLM | None = None,
    mesh: jax.sharding.Mesh | None = None,
) -> nnx.State | None:
    """pi_ref's params (an `nnx.State` matching the policy's graphdef), or None when
    kl_coef == 0.

    model: the initial policy, before any update. reference: an already built reference
    model (e.g. a stand-in's); None = load `reference_hf_dir` (in the policy's dtype and
    options, straight into its shardings) or, when that is None, copy `model`'s params.
    """
    if algorithm.kl_coef == 0:
        if reference is not None:
            raise ValueError(
                f"reference: a reference model was given but {algorithm.loss}.kl_coef = 0 "
                "(a reference is only held when kl_coef > 0)"
            )
        return None
    if reference is None:
        check_reference_source(algorithm, model.config)
        if algorithm.reference_hf_dir is None:
            reference = model
        else:
            from bapo_jax.models.hf import load_pretrained

            reference = load_pretrained(
                algorithm.reference_hf_dir,
                dtype=model.options.param_dtype,
                mesh=mesh,
                options=model.options,
            )
    check_same_architecture(reference.config, model.config, "reference")
    _, params = split_model(reference)
    _, policy_params = split_model(model)
    if _layout(params) != _layout(policy_params):
        raise ValueError("reference: its params' names, shapes or dtypes differ from the policy's")
    return _fresh_copy(params, mesh)
