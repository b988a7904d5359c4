"""Weight publishing after an update: how a new policy version reaches the rollout engine.

EmbeddedPublisher  in process: the engine gets a private copy of the params (the train step
                   donates its buffers, so the engine must not alias them).
OrbaxPublisher     vLLM: params-only Orbax checkpoint for version v (atomic, manifest with
                   digest, last K kept; `rollout.weight_sync`), then every server loads it.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from bapo_jax.models.config import Qwen2Config
from bapo_jax.rollout import weight_sync


class WeightPublisher(Protocol):
    def publish(self, engine: Any, version: int, params: nnx.State, step: int) -> None:
        """Make `engine` sample from `params` as policy `version` (`step`: optimizer steps)."""
        ...


class EmbeddedPublisher:
    def publish(self, engine, version: int, params: nnx.State, step: int) -> None:
        engine.update_weights(version, params=jax.tree.map(jnp.copy, params))


class OrbaxPublisher:
    """root: the shared-filesystem directory the vLLM workers read; dtype: bf16 by default."""

    def __init__(self, root: str, model_config: Qwen2Config, *, dtype=jnp.bfloat16, keep: int = 3):
        self.root = os.fspath(root)
        self.model_config = model_config
        self.dtype = dtype
        self.keep = keep

    def publish(self, engine, version: int, params: nnx.State, step: int) -> None:
        path = weight_sync.write_orbax(
            nnx.to_pure_dict(params),
            self.root,
            version=version,
            step=step,
            config=self.model_config,
            dtype=self.dtype,
            keep=self.keep,
        )
        engine.update_weights(version, checkpoint=path)
