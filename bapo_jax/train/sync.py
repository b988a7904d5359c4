"""Weight publishing after an update: how a new policy version reaches the rollout engine.

EmbeddedPublisher  in process: the engine gets a private copy of the params (the train step
                   donates its buffers, so the engine must not alias them).
OrbaxPublisher     vLLM: params-only Orbax checkpoint for version v (atomic, manifest with
                   digest, last K kept; `rollout.weight_sync`), then every server loads it.
                   A version a server did not take is written again and loaded again, up to
                   `attempts` times, while servers remain in rotation: one refused before
                   loading (e.g. a file damaged on disk between write and load: the worker's
                   restore or digest check fails and the server keeps serving the previous
                   version), or one restarted on the last good version (its load failed, or
                   its process died).

`publish` returns its timings (seconds): write_s (the checkpoint), load_s (the slowest server's
restore + load, measured in its worker; the engine's own update in process), attempts, and
server_version: the lowest version the servers' workers report having loaded.
"""

from __future__ import annotations

import os
import time
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from bapo_jax.models.config import Qwen2Config
from bapo_jax.rollout import weight_sync


class WeightPublisher(Protocol):
    def publish(self, engine: Any, version: int, params: nnx.State, step: int) -> dict[str, float]:
        """Make `engine` sample from `params` as policy `version` (`step`: optimizer steps);
        returns {write_s, load_s, attempts, server_version} (module doc)."""
        ...


class EmbeddedPublisher:
    def publish(self, engine, version: int, params: nnx.State, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        engine.update_weights(version, params=jax.tree.map(jnp.copy, params))
        return {
            "write_s": 0.0,
            "load_s": time.perf_counter() - t0,
            "attempts": 1,
            "server_version": engine.policy_version,
        }


class OrbaxPublisher:
    """root: the shared-filesystem directory the vLLM workers read; dtype: bf16 by default;
    keep: versions kept on disk; attempts: writes of one version before giving up."""

    def __init__(
        self,
        root: str,
        model_config: Qwen2Config,
        *,
        dtype=jnp.bfloat16,
        keep: int = 3,
        attempts: int = 3,
    ):
        if attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {attempts}")
        self.root = os.fspath(root)
        self.model_config = model_config
        self.dtype = dtype
        self.keep = keep
        self.attempts = attempts

    def write(self, version: int, params: nnx.State, step: int) -> str:
        """Write version `version`; returns its directory."""
        return weight_sync.write_orbax(
            nnx.to_pure_dict(params),
            self.root,
            version=version,
            step=step,
            config=self.model_config,
            dtype=self.dtype,
            keep=self.keep,
        )

    def publish(self, engine, version: int, params: nnx.State, step: int) -> dict[str, float]:
        from bapo_jax.rollout.vllm_client import WeightSyncError

        write_s = 0.0
        for attempt in range(1, self.attempts + 1):
            t0 = time.perf_counter()
            path = self.write(version, params, step)
            write_s += time.perf_counter() - t0
            try:
                engine.update_weights(version, checkpoint=path)
            except WeightSyncError as error:
                if attempt == self.attempts or not engine.servers:
                    raise
                print(
                    f"weight sync: version {version} refused ({error}); writing it again "
                    f"(attempt {attempt + 1} of {self.attempts})",
                    flush=True,
                )
                continue
            replies = list(engine.last_update.values())  # each worker's answer to the load
            return {
                "write_s": write_s,
                "load_s": max((r["restore_s"] + r["load_s"] for r in replies), default=0.0),
                "attempts": attempt,
                "server_version": min((r["version"] for r in replies), default=-1),
            }
        raise AssertionError("unreachable")
