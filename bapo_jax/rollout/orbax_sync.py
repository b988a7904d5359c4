"""Weight sync to vLLM servers through Orbax checkpoints: the vLLM path's `WeightUpdater`.

`OrbaxSync(root, config, target)` owns the whole update (docs/rollout.md, "In-flight weight
updates"). `begin_update(v, params, step)` writes version v (`weight_sync`; a LoRA run: its
adapters, `adapter_sync`) in a background thread (in the calling thread on a multi-process
run: the write is collective), then asks the servers to stage it. `finish_update(handle)` waits
for that, then `SyncTarget.load_checkpoint` switches the servers (only there); the write has
read the params before `finish_update` returns (the next train step donates them). A version
a server did not take (refused before loading, e.g. a damaged or forged file, or restarted on
the last good version) is written and loaded again, up to `attempts` times, while servers
remain in rotation. `manifest_key` signs every write (`manifest_auth`).

The servers are seen through `SyncTarget` alone: the sync never calls back into whoever owns
it. Multi-process runs: every process runs the same `OrbaxSync` (each writes its shards);
process 0's target is its `VLLMEngine` behind `BroadcastingTarget`, which broadcasts the
load's outcome; the others' is their `FollowerEngine`, which reproduces it, so every process
retries alike and reports the same timings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bapo_jax.models.config import LoRAConfig, Qwen2Config
from bapo_jax.rollout import weight_sync
from bapo_jax.rollout.manifest_auth import check_key
from bapo_jax.rollout.types import Rollout, SyncTimings, check_update_args
from bapo_jax.rollout.vllm_http import WeightSyncError

Replies = dict[str, dict[str, Any]]  # server -> its worker's JSON reply


class SyncTarget(Protocol):
    """What `OrbaxSync` loads into: the servers, through five members."""

    @property
    def policy_version(self) -> int:
        """The version the servers serve now."""
        ...

    @property
    def servers(self) -> Sequence[Any]:
        """The servers in rotation (a refused version is retried only while there are some)."""
        ...

    def reserve_sync_memory(self, checkpoint_bytes: int, parameters: int) -> Replies:
        """Every server sets aside, once, the host memory a sync of a checkpoint of that many
        bytes and parameters needs."""
        ...

    def stage_weights(self, version: int, checkpoint: str) -> Replies:
        """Every server starts reading + checking the version dir; generation goes on."""
        ...

    def load_checkpoint(self, version: int, checkpoint: str) -> Replies:
        """Every server switches to the version dir; the workers' replies (timings: restore_s,
        load_s, staged). Raises `WeightSyncError` if a server did not take it."""
        ...


@dataclasses.dataclass
class OrbaxHandle:
    """One sync in flight: the write (+ staging) runs in `thread` (None: already done)."""

    version: int
    params: Any
    step: int
    thread: threading.Thread | None = None
    path: str | None = None
    error: BaseException | None = None
    write_span: tuple[float, float] | None = None


class OrbaxSync:
    """root: the shared-filesystem directory the vLLM workers read; target: the servers;
    dtype: bf16 by default; keep: versions kept on disk; attempts: writes of one version
    before giving up; manifest_key: signs each version's manifest (`run_secret.manifest_key`
    of the secret the servers hold; None: unsigned, which such servers refuse); dir_mode: the
    mode of the sync root if a write creates it (owner-only by default); lora: a LoRA run's
    adapters config: each version is then the adapters alone (`adapter_sync`, at `dtype`),
    loaded by vLLM as a LoRA adapter, with nothing to stage or reserve."""

    def __init__(
        self,
        root: str,
        model_config: Qwen2Config,
        target: SyncTarget,
        *,
        dtype=jnp.bfloat16,
        keep: int = 3,
        attempts: int = 3,
        manifest_key: bytes | None = None,
        dir_mode: int = weight_sync.DIR_MODE,
        lora: LoRAConfig | None = None,
    ):
        if attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {attempts}")
        if manifest_key is not None:
            check_key(manifest_key)  # here, not in the first (background) write
        self.root = os.fspath(root)
        self.model_config = model_config
        self.target = target
        self.dtype = dtype
        self.keep = keep
        self.attempts = attempts
        self.manifest_key = manifest_key  # never written: the manifests carry its HMAC only
        self.dir_mode = dir_mode
        self.lora = lora

    def reserve_memory(self) -> Replies:
        """Have every server set aside the host memory one version of this sync needs (its
        bytes at `dtype`); the workers' replies (`reserved_bytes`, `seconds`, or `why` not).
        An adapter sync needs none."""
        if self.lora is not None:
            return {}
        nbytes = weight_sync.checkpoint_bytes(self.model_config, self.dtype)
        return self.target.reserve_sync_memory(nbytes, nbytes // jnp.dtype(self.dtype).itemsize)

    def write(self, version: int, params: nnx.State, step: int) -> str:
        """Write version `version` (a LoRA run's: its adapters); returns its directory."""
        where = dict(
            version=version,
            step=step,
            config=self.model_config,
            keep=self.keep,
            manifest_key=self.manifest_key,
            dir_mode=self.dir_mode,
        )
        if self.lora is None:
            return weight_sync.write_orbax(
                nnx.to_pure_dict(params), self.root, dtype=self.dtype, **where
            )
        from bapo_jax.models.lora import LoRAParam
        from bapo_jax.rollout.adapter_sync import write_adapter

        adapters = nnx.to_pure_dict(nnx.split_state(params, LoRAParam, ...)[0])["layers"]
        host = {k: np.asarray(jax.device_get(v).astype(self.dtype)) for k, v in adapters.items()}
        return write_adapter(host, self.root, lora=self.lora, **where)

    def _write_and_stage(self, handle: OrbaxHandle) -> None:
        try:
            t0 = time.perf_counter()
            handle.path = self.write(handle.version, handle.params, handle.step)
            handle.write_span = (t0, time.perf_counter())
        except BaseException as error:  # re-raised by finish_update
            handle.error = error
            return
        if self.lora is None:  # vLLM loads an adapter in one step: nothing to stage
            with contextlib.suppress(Exception):  # an optimization: the load repeats every check
                self.target.stage_weights(handle.version, handle.path)  # asked at write_span[1]

    def begin_update(self, version: int, params: nnx.State, *, step: int) -> OrbaxHandle:
        """Write `params` as `version` and have the servers stage it, generation going on."""
        check_update_args(version, step)
        handle = OrbaxHandle(version, params, step)
        if jax.process_count() == 1:
            handle.thread = threading.Thread(
                target=self._write_and_stage, args=(handle,), name=f"bapo-sync-v{version}"
            )
            handle.thread.start()
        else:  # every process writes, in the same order as its other collectives
            self._write_and_stage(handle)
        return handle

    def finish_update(
        self, handle: OrbaxHandle, generating_until: float | None = None
    ) -> SyncTimings:
        """Load the version `begin_update` wrote on every server. generating_until: when the
        generation that ran meanwhile ended (perf_counter; None: now); the hidden seconds are
        those of the sync's work before it."""
        cut = time.perf_counter()
        cut = cut if generating_until is None else min(cut, generating_until)
        if handle.thread is not None:
            handle.thread.join()
        if handle.error is not None:
            raise handle.error
        start, end = handle.write_span
        write_s, write_hidden = end - start, max(0.0, min(end, cut) - start)
        path, target = handle.path, self.target
        for attempt in range(1, self.attempts + 1):
            if attempt > 1:
                t0 = time.perf_counter()
                path = self.write(handle.version, handle.params, handle.step)
                write_s += time.perf_counter() - t0
            try:
                replies = list(target.load_checkpoint(handle.version, path).values())
                break
            except WeightSyncError as error:
                if attempt == self.attempts or not target.servers:
                    raise
                print(
                    f"weight sync: version {handle.version} refused ({error}); writing it "
                    f"again (attempt {attempt + 1} of {self.attempts})",
                    flush=True,
                )
        return SyncTimings(
            write_s=write_s,
            load_s=max((r["restore_s"] + r["load_s"] for r in replies), default=0.0),
            write_hidden_s=write_hidden,
            load_hidden_s=max(  # the staged reads, from when they were asked for
                (
                    max(0.0, min(end + r["restore_s"], cut) - end)
                    for r in replies
                    if r.get("staged") and attempt == 1
                ),
                default=0.0,
            ),
            attempts=attempt,
            server_version=min((r["version"] for r in replies), default=-1),
        )

    def update_weights(self, version: int, params: nnx.State, *, step: int = 0) -> SyncTimings:
        return self.finish_update(self.begin_update(version, params, step=step))


# ---- multi-process: process 0 loads, the outcome is broadcast -----------------------------------
def target_for(engine: SyncTarget) -> SyncTarget:
    """Process 0's target: the engine itself, or on a multi-process run (the others load
    through their `FollowerEngine`s) the engine with its outcome broadcast."""
    return engine if jax.process_count() == 1 else BroadcastingTarget(engine)


class BroadcastingTarget:
    """Process 0's target on a multi-process run: its engine's load, then the outcome
    broadcast to the `FollowerEngine`s (a collective: every process is in `finish_update`).
    The other members are the engine's, declared (no forwarding of whatever is asked)."""

    def __init__(self, engine: SyncTarget):
        self._engine = engine

    @property
    def policy_version(self) -> int:
        return self._engine.policy_version

    @property
    def servers(self) -> Sequence[Any]:
        return self._engine.servers

    def reserve_sync_memory(self, checkpoint_bytes: int, parameters: int) -> Replies:
        return self._engine.reserve_sync_memory(checkpoint_bytes, parameters)

    def stage_weights(self, version: int, checkpoint: str) -> Replies:
        return self._engine.stage_weights(version, checkpoint)

    def load_checkpoint(self, version: int, checkpoint: str) -> Replies:
        try:
            replies = self._engine.load_checkpoint(version, checkpoint)
        except BaseException as error:
            self._share(error, {})
            raise
        self._share(None, replies)
        return replies

    def _share(self, error: BaseException | None, replies: Replies) -> None:
        from bapo_jax.sharding.distributed import broadcast_bytes

        outcome = {
            "error": None if error is None else f"{type(error).__name__}: {error}",
            "kind": None if error is None else type(error).__name__,
            "servers": len(self._engine.servers),
            "replies": replies,
            "policy_version": int(self._engine.policy_version),
        }
        broadcast_bytes(json.dumps(outcome, default=lambda x: np.asarray(x).tolist()).encode())


class FollowerEngine:
    """The engine of a process other than 0 on a multi-process run with vLLM servers. Process 0
    alone launches and talks to the servers, so there is no client here: this engine is the
    `SyncTarget` of its process's `OrbaxSync` (the load's outcome comes from process 0, a
    refusal raised as `WeightSyncError` so that `OrbaxSync` retries as process 0 does).
    Generating here is a bug, and the error says so."""

    restarted: tuple = ()

    def __init__(self, *, version: int = 0):
        self.policy_version = int(version)
        self.servers: list[int] = []

    def generate(self, *args: Any, **kwargs: Any) -> Rollout:
        raise RuntimeError(
            f"engine.generate called on process {jax.process_index()}: only process 0 talks "
            "to the vLLM servers (rollout.orbax_sync)"
        )

    def server_versions(self) -> dict[str, dict[str, Any]]:
        return {}  # process 0 asks the servers

    def reserve_sync_memory(self, checkpoint_bytes: int, parameters: int) -> Replies:
        return {}  # process 0 asks the servers

    def stage_weights(self, version: int, checkpoint: str) -> Replies:
        return {}  # process 0 stages on the servers

    def load_checkpoint(self, version: int, checkpoint: str) -> Replies:
        from bapo_jax.sharding.distributed import broadcast_bytes

        outcome = json.loads(broadcast_bytes(None))
        self.servers = list(range(outcome["servers"]))
        self.policy_version = outcome["policy_version"]
        if outcome["error"] is None:
            return outcome["replies"]
        if outcome["kind"] == "WeightSyncError":
            raise WeightSyncError(f"on process 0: {outcome['error']}")
        raise RuntimeError(f"weight sync failed on process 0: {outcome['error']}")
