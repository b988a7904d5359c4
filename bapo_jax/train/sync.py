"""Weight publishing after an update: how a new policy version reaches the rollout engine.

EmbeddedPublisher  in process: the engine gets a private copy of the params (the train step
                   donates its buffers, so the engine must not alias them).
OrbaxPublisher     vLLM: params-only Orbax checkpoint for version v (atomic, manifest with
                   every file's size and CRC-32, last K kept; `rollout.weight_sync`), then
                   every server loads it.
                   A version a server did not take is written again and loaded again, up to
                   `attempts` times, while servers remain in rotation: one refused before
                   loading (e.g. a file damaged on disk between write and load: the worker's
                   file check refuses it before reading and the server keeps serving the
                   previous version), or one restarted on the last good version (its load failed, or
                   its process died).

Overlap. `begin(engine, version, params, step)` starts the publish and returns a handle;
`finish(handle)` completes it; `publish` is `finish(begin(...))`. The loop calls `begin` as
soon as the update ends and `finish` after the drain, so what `begin` starts runs while the
servers still generate the last batch of the previous version. OrbaxPublisher.begin writes
the checkpoint in a background thread (in the calling thread on a multi-process run: the
write is collective) and then asks every server to stage it (`VLLMEngine.stage_weights`: the
worker reads and checks the files into host memory in a thread of its own, the engine keeps
stepping); `finish` waits for that, then `update_weights` pauses the servers and copies the
staged arrays in. The servers switch only in `finish`, so no batch sees two versions. The
write reads the params before `finish` returns (the next train step donates them).
EmbeddedPublisher has no `begin` (its update is an in-process copy): the loop publishes after
the drain.

`finish` (and `publish`) return timings (seconds): write_s (the checkpoint), load_s (the
slowest server's restore + load, measured in its worker; the engine's own update in process),
write_hidden_s and load_hidden_s (the part of each done while generation still ran: before
`finish`'s `generating_until`, the end of the generation the loop drained; for the load, the
staged read, from when it was asked for), attempts, and server_version: the lowest version
the servers' workers report having loaded.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from bapo_jax.models.config import Qwen2Config
from bapo_jax.rollout import weight_sync


class WeightPublisher(Protocol):
    """`publish`; a publisher that can overlap also has `begin(engine, version, params,
    step) -> handle` (start, without switching the engine) and `finish(handle) -> timings`."""

    def publish(self, engine: Any, version: int, params: nnx.State, step: int) -> dict[str, float]:
        """`finish(begin(...))`: make `engine` sample from `params` as policy `version`."""
        ...


def _check_args(version: int, step: int) -> None:
    for name, value in (("version", version), ("step", step)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")


class EmbeddedPublisher:
    """No `begin`: the engine's update is a copy in process, nothing to overlap."""

    def publish(self, engine, version: int, params: nnx.State, step: int) -> dict[str, float]:
        _check_args(version, step)
        t0 = time.perf_counter()
        engine.update_weights(version, params=jax.tree.map(jnp.copy, params))
        return {
            "write_s": 0.0,
            "load_s": time.perf_counter() - t0,
            "write_hidden_s": 0.0,
            "load_hidden_s": 0.0,
            "attempts": 1,
            "server_version": engine.policy_version,
        }


def begin(
    publisher: Any, engine: Any, version: int, params: nnx.State, step: int, *, remote: bool
) -> Any:
    """`publisher.begin(...)`'s handle, None if the publisher has no `begin`. remote: a
    multi-process run's remote engine (`multihost.publish_remote`, every process calls)."""
    if not hasattr(publisher, "begin"):
        return None
    if remote:
        from bapo_jax.train import multihost

        return multihost.publish_remote(publisher, engine, version, params, step, begin_only=True)
    return publisher.begin(engine, version, params, step)


def finish(
    handle: Any,
    publisher: Any,
    engine: Any,
    version: int,
    params: nnx.State,
    step: int,
    *,
    remote: bool,
    generating_until: float | None = None,
) -> dict[str, float]:
    """`publisher.finish(handle, generating_until)`, or with no handle the whole `publish`."""
    if handle is not None:
        return publisher.finish(handle, generating_until)
    if remote:
        from bapo_jax.train import multihost

        return multihost.publish_remote(publisher, engine, version, params, step)
    return publisher.publish(engine, version, params, step)


def generation_end(batches: Any) -> float:
    """When the last engine call of `batches` (`ProducedBatch.generation_spans`) ended."""
    return max((end for b in batches for _, end in b.generation_spans), default=0.0)


def row_metrics(timings: dict[str, float]) -> dict[str, float]:
    """A publish's timings as the loop's metrics row fields."""
    return {
        "time/sync_write": timings["write_s"],
        "time/sync_load": timings["load_s"],
        "time/sync_write_hidden": timings["write_hidden_s"],
        "time/sync_load_hidden": timings["load_hidden_s"],
        "sync/attempts": timings["attempts"],
        "sync/engine_version": timings["server_version"],
    }


@dataclasses.dataclass
class OrbaxHandle:
    """One publish in flight: the write (+ staging) runs in `thread` (None: already done)."""

    engine: Any
    version: int
    params: Any
    step: int
    thread: threading.Thread | None = None
    path: str | None = None
    error: BaseException | None = None
    write_span: tuple[float, float] | None = None
    staged: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)


class OrbaxPublisher:
    """root: the shared-filesystem directory the vLLM workers read; dtype: bf16 by default;
    keep: versions kept on disk; attempts: writes of one version before giving up;
    overlap: run the first write and the staging in a background thread (single process)."""

    def __init__(
        self,
        root: str,
        model_config: Qwen2Config,
        *,
        dtype=jnp.bfloat16,
        keep: int = 3,
        attempts: int = 3,
        overlap: bool = True,
    ):
        if attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {attempts}")
        self.root = os.fspath(root)
        self.model_config = model_config
        self.dtype = dtype
        self.keep = keep
        self.attempts = attempts
        self.overlap = overlap

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

    def _write_and_stage(self, handle: OrbaxHandle) -> None:
        try:
            t0 = time.perf_counter()
            handle.path = self.write(handle.version, handle.params, handle.step)
            handle.write_span = (t0, time.perf_counter())
        except BaseException as error:  # re-raised by finish
            handle.error = error
            return
        if hasattr(handle.engine, "stage_weights"):  # asked at write_span[1]
            try:
                handle.staged = handle.engine.stage_weights(handle.version, handle.path)
            except Exception as error:  # an optimization: the load repeats every check
                handle.staged = {"error": {"ok": False, "error": f"{error}"}}

    def begin(self, engine, version: int, params: nnx.State, step: int) -> OrbaxHandle:
        _check_args(version, step)
        handle = OrbaxHandle(engine, version, params, step)
        if self.overlap and jax.process_count() == 1:
            handle.thread = threading.Thread(
                target=self._write_and_stage, args=(handle,), name=f"bapo-sync-v{version}"
            )
            handle.thread.start()
        else:  # every process writes, in the same order as its other collectives
            self._write_and_stage(handle)
        return handle

    def finish(
        self, handle: OrbaxHandle, generating_until: float | None = None
    ) -> dict[str, float]:
        """generating_until: when the generation that ran meanwhile ended (perf_counter; None:
        now); the hidden seconds are those of the sync's work before it."""
        from bapo_jax.rollout.vllm_client import WeightSyncError

        cut = time.perf_counter()
        cut = cut if generating_until is None else min(cut, generating_until)
        if handle.thread is not None:
            handle.thread.join()
        if handle.error is not None:
            raise handle.error
        start, end = handle.write_span
        write_s, write_hidden = end - start, max(0.0, min(end, cut) - start)
        path = handle.path
        for attempt in range(1, self.attempts + 1):
            if attempt > 1:
                t0 = time.perf_counter()
                path = self.write(handle.version, handle.params, handle.step)
                write_s += time.perf_counter() - t0
            try:
                handle.engine.update_weights(handle.version, checkpoint=path)
            except WeightSyncError as error:
                if attempt == self.attempts or not handle.engine.servers:
                    raise
                print(
                    f"weight sync: version {handle.version} refused ({error}); writing it "
                    f"again (attempt {attempt + 1} of {self.attempts})",
                    flush=True,
                )
                continue
            replies = list(handle.engine.last_update.values())  # each worker's answer
            return {
                "write_s": write_s,
                "load_s": max((r["restore_s"] + r["load_s"] for r in replies), default=0.0),
                "write_hidden_s": write_hidden,
                "load_hidden_s": max(  # the staged reads, from when they were asked for
                    (
                        max(0.0, min(end + r["restore_s"], cut) - end)
                        for r in replies
                        if r.get("staged") and attempt == 1
                    ),
                    default=0.0,
                ),
                "attempts": attempt,
                "server_version": min((r["version"] for r in replies), default=-1),
            }
        raise AssertionError("unreachable")

    def publish(self, engine, version: int, params: nnx.State, step: int) -> dict[str, float]:
        return self.finish(self.begin(engine, version, params, step))
