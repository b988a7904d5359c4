"""Weight sync to vLLM servers through Orbax checkpoints: the vLLM path's `WeightUpdater`.

`OrbaxSync(root, config, target)` owns the whole update. `begin_update(v, params, step)`
writes the params-only Orbax checkpoint of version v (atomic, a manifest with every file's
size and hash, the last K kept; `rollout.weight_sync`) in a background thread (in the calling
thread on a multi-process run: the write is collective), then asks the servers to stage it
(`SyncTarget.stage_weights`: each worker reads and checks the files into host memory in a
thread of its own while the engine keeps generating). `finish_update(handle)` waits for that,
then `SyncTarget.load_checkpoint` pauses the servers and copies the staged arrays in. The
servers switch only in `finish_update` (after the loop's drain no batch sees two versions; in
flight, each token carries the one that sampled it); the write reads the params before
`finish_update` returns (the next train step donates them).

A version a server did not take is written again and loaded again, up to `attempts` times,
while servers remain in rotation: one refused before loading (e.g. a file damaged on disk
between write and load: the worker's file check refuses it before reading, and the server keeps
serving the previous version), or one restarted on the last good version (its load failed, or
its process died). Servers that hold the run's secret refuse a version whose manifest lacks a
valid HMAC (`manifest_auth`): `manifest_key` (`run_secret.manifest_key` of that secret) signs
every write, and a version forged by someone else between write and load is written again.

The servers are seen through `SyncTarget` alone (five members; `VLLMEngine` is one): the sync
never calls back into whoever owns it. `reserve_memory()`, once before the first sync, has
every worker grow its heap to what a sync holds (the restored arrays beside vLLM's
re-allocated model): a run's first syncs are then as fast as the rest (docs/rollout.md).

Multi-process runs: every process runs the same `OrbaxSync` (each process writes its shards;
`weight_sync` lets process 0 alone write the manifest, rename and prune). Process 0's target
is its `VLLMEngine` wrapped in `BroadcastingTarget`, which broadcasts the outcome (success,
refusal, the workers' replies); the other processes' target is their `FollowerEngine`, whose
load waits for that outcome and reproduces it, so every process retries alike and reports the
same timings.
"""

from __future__ import annotations

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
from bapo_jax.rollout.types import Rollout, SamplingParams, SyncTimings, check_update_args
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
    staged: Replies = dataclasses.field(default_factory=dict)


class OrbaxSync:
    """root: the shared-filesystem directory the vLLM workers read; target: the servers;
    dtype: bf16 by default; keep: versions kept on disk; attempts: writes of one version
    before giving up; overlap: run the first write and the staging in a background thread
    (single process); manifest_key: signs each version's manifest (`run_secret.manifest_key`
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
        overlap: bool = True,
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
        self.overlap = overlap
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
        if self.lora is not None:
            from bapo_jax.models.lora import LoRAParam
            from bapo_jax.rollout.adapter_sync import write_adapter

            adapters = nnx.to_pure_dict(nnx.split_state(params, LoRAParam, ...)[0])["layers"]
            host = {
                k: np.asarray(jax.device_get(v).astype(self.dtype)) for k, v in adapters.items()
            }
            return write_adapter(
                host, self.root, version=version, step=step, config=self.model_config,
                lora=self.lora, keep=self.keep, manifest_key=self.manifest_key,
                dir_mode=self.dir_mode,
            )  # fmt: skip
        return weight_sync.write_orbax(
            nnx.to_pure_dict(params),
            self.root,
            version=version,
            step=step,
            config=self.model_config,
            dtype=self.dtype,
            keep=self.keep,
            manifest_key=self.manifest_key,
            dir_mode=self.dir_mode,
        )

    def _write_and_stage(self, handle: OrbaxHandle) -> None:
        try:
            t0 = time.perf_counter()
            handle.path = self.write(handle.version, handle.params, handle.step)
            handle.write_span = (t0, time.perf_counter())
        except BaseException as error:  # re-raised by finish_update
            handle.error = error
            return
        if self.lora is not None:  # vLLM loads an adapter in one step: nothing to stage
            return
        try:  # asked at write_span[1]
            handle.staged = self.target.stage_weights(handle.version, handle.path)
        except Exception as error:  # an optimization: the load repeats every check
            handle.staged = {"error": {"ok": False, "error": f"{error}"}}

    def begin_update(self, version: int, params: nnx.State, *, step: int) -> OrbaxHandle:
        """Write `params` as `version` and have the servers stage it, generation going on."""
        check_update_args(version, step)
        handle = OrbaxHandle(version, params, step)
        if self.overlap and jax.process_count() == 1:
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
            except WeightSyncError as error:
                if attempt == self.attempts or not target.servers:
                    raise
                print(
                    f"weight sync: version {handle.version} refused ({error}); writing it "
                    f"again (attempt {attempt + 1} of {self.attempts})",
                    flush=True,
                )
                continue
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
        raise AssertionError("unreachable")

    def update_weights(self, version: int, params: nnx.State, *, step: int = 0) -> SyncTimings:
        return self.finish_update(self.begin_update(version, params, step=step))


# ---- multi-process: process 0 loads, the outcome is broadcast -----------------------------------
def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=lambda x: np.asarray(x).tolist()))


def target_for(engine: SyncTarget) -> SyncTarget:
    """Process 0's target: the engine itself, or on a multi-process run (the others load
    through their `FollowerEngine`s) the engine with its outcome broadcast."""
    return engine if jax.process_count() == 1 else BroadcastingTarget(engine)


class BroadcastingTarget:
    """Process 0's target on a multi-process run: its engine's load, then the outcome
    broadcast to the `FollowerEngine`s (a collective: every process is in `finish_update`)."""

    def __init__(self, engine: SyncTarget):
        self._engine = engine

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
            self._share(f"{type(error).__name__}: {error}", type(error).__name__, {})
            raise
        self._share(None, None, replies)
        return replies

    def _share(self, message: str | None, kind: str | None, replies: Replies) -> None:
        from bapo_jax.sharding.distributed import broadcast_bytes

        outcome = {
            "error": message,
            "kind": kind,
            "servers": len(self._engine.servers),
            "replies": _jsonable(replies),
            "policy_version": int(self._engine.policy_version),
        }
        broadcast_bytes(json.dumps(outcome).encode())


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

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingParams | None = None,
        seed: int = 0,
        *,
        greedy: bool = False,
    ) -> Rollout:
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
