"""The RL loop on several processes: who does what, and the broadcasts that keep them in step
(the table in docs/sharding.md, "The RL loop on several processes").

Every process runs the same `Trainer.run` (the train step is one SPMD program over the global
mesh). With one process nothing here issues a collective and the loop is unchanged. With a
remote engine (vLLM) process 0 alone produces and its batches are broadcast (`broadcast_batch`;
the weight sync's own broadcast: `rollout.orbax_sync`). With an in-process engine spanning
every process, every process produces, inline in the main thread (`InlineExecutor`), so its
collectives and the train step's are issued in the same order everywhere; rewards are scored
on process 0 and broadcast (`primary_rewards`). Metrics are written by process 0; the run
checkpoint's host state is broadcast from it (`broadcast_state`) before every process saves.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import io
import json
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from bapo_jax.sharding.distributed import broadcast_bytes
from bapo_jax.train.buffers import groups_from_state, groups_to_state


@dataclasses.dataclass(frozen=True)
class Roles:
    """This process's part in the run (module doc)."""

    process_count: int
    process_index: int
    engine_spans_processes: bool

    @property
    def multi(self) -> bool:
        return self.process_count > 1

    @property
    def primary(self) -> bool:
        return self.process_index == 0

    @property
    def produces(self) -> bool:
        """Whether this process runs the producer."""
        return not self.multi or self.primary or self.engine_spans_processes

    @property
    def inline_generation(self) -> bool:
        """Generation in the main thread (collectives in program order on every process)."""
        return self.multi and self.engine_spans_processes

    @property
    def broadcast_batches(self) -> bool:
        return self.multi and not self.engine_spans_processes

    @property
    def evaluates(self) -> bool:
        """Process 0 with a remote engine (it queries the servers), else all (they generate)."""
        return not self.multi or self.primary or self.engine_spans_processes

    def check(self, config: Any) -> None:
        """Refuses the settings a multi-process run does not support."""
        if self.multi and config.logging.logprob_agreement:
            raise ValueError(
                "logging.logprob_agreement=True is not supported on a multi-process run "
                f"({self.process_count} processes): the teacher's forward pass would run in the "
                "producer's thread of one process; turn it off"
            )


def roles_for(engine: Any) -> Roles:
    """The roles of this process for `engine` (in process: an `EmbeddedEngine`)."""
    from bapo_jax.rollout.embedded import EmbeddedEngine

    return Roles(jax.process_count(), jax.process_index(), isinstance(engine, EmbeddedEngine))


class InlineExecutor(cf.Executor):
    """`submit` runs the call at once in the calling thread; the Future is already done."""

    def submit(self, fn: Callable, /, *args, **kwargs) -> cf.Future:
        future: cf.Future = cf.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as error:  # delivered by result(), as a thread pool would
            future.set_exception(error)
        return future


# ---- broadcasts (collectives: every process calls them, in the same order) ----------------------
def broadcast_state(
    meta: Any, arrays: Mapping[str, np.ndarray] | None
) -> tuple[Any, dict[str, np.ndarray]]:
    """Process 0's (JSON metadata, arrays) on every process (the others pass anything), sent
    as one ``.npz``."""
    packed = None
    if jax.process_index() == 0:
        out = io.BytesIO()
        payload = {f"a/{k}": np.asarray(v) for k, v in arrays.items()}
        np.savez(out, __meta__=np.frombuffer(json.dumps(meta).encode(), np.uint8), **payload)
        packed = out.getvalue()
    with np.load(io.BytesIO(broadcast_bytes(packed)), allow_pickle=False) as f:
        meta = json.loads(f["__meta__"].tobytes().decode())
        return meta, {k.removeprefix("a/"): f[k] for k in f.files if k != "__meta__"}


def broadcast_batch(batch):
    """Process 0's `ProducedBatch` on every process (the others pass None). Generation spans
    are process 0's clock; only process 0 reports them."""
    from bapo_jax.train.producer import ProducedBatch

    meta, arrays = None, {}
    if jax.process_index() == 0:
        groups, arrays = groups_to_state(batch.groups, "batch")
        meta = {
            "index": batch.index,
            "groups": groups,
            "active": list(batch.active),
            "metrics": batch.metrics,
            "spans": [list(s) for s in batch.generation_spans],
        }
    meta, arrays = broadcast_state(meta, arrays)
    return ProducedBatch(
        index=int(meta["index"]),
        groups=groups_from_state(meta["groups"], arrays, "batch"),
        active=[bool(a) for a in meta["active"]],
        metrics=dict(meta["metrics"]),
        generation_spans=[(float(a), float(b)) for a, b in meta["spans"]],
    )


def primary_rewards(score: Callable[[], Any], shape: tuple[int, ...]) -> np.ndarray:
    """`score()` on process 0 (float32 of `shape`), broadcast to every process."""
    from jax.experimental import multihost_utils

    if jax.process_index() == 0:
        rewards = np.asarray(score(), np.float32)
        if rewards.size != int(np.prod(shape)):
            raise ValueError(f"reward_fn returned {rewards.size} rewards, expected {shape}")
        rewards = rewards.reshape(shape)
    else:
        rewards = np.zeros(shape, np.float32)
    return np.asarray(multihost_utils.broadcast_one_to_all(rewards), np.float32)


def to_host(array: jax.Array) -> np.ndarray:
    """The whole of a (possibly process-spanning) global array as numpy on every process: a
    plain copy with one process, an all-gather of every process's shards with several."""
    if jax.process_count() == 1:
        return np.asarray(jax.device_get(array))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(array, tiled=True))
