"""One read of a synced version per node, shared by every rank of a vLLM server there.

vLLM's weight loaders take whole HF tensors and cut each rank's slice themselves, so a rank
restoring the version for itself would hold a whole copy (docs/rollout.md, "Tensor-parallel
servers read a version once"). Instead the node's first rank of the server (its *reader*)
restores the version once into the server's *sync buffer*, a file in shared memory
(``/dev/shm``), hashing every byte once and dropping each file's cached pages after it
(``sync_read``); the other ranks (*followers*) map the same buffer and hand vLLM views of it.

Protocol. The buffer ``/dev/shm/bapo-sync-<owner>.buf`` is created by the reader, grown when a
version needs more, and reused by every sync (its pages are faulted in once, by
``reserve``, not at each sync); ``<owner>`` is the pid all the server's ranks on this node
share (their parent, vLLM's engine core). Beside it, ``.ready`` names the version whose bytes the
buffer holds (``{"key": ...}``) or the reader's refusal of it (``{"key": ..., "error": ...}``),
written by rename. The reader clears it before it writes the buffer; a follower waits until
it names the version it was asked for. A follower never reads while the reader rewrites the
buffer: vLLM runs a load on all ranks and answers once all are done, and the client stages
or loads the next version only after that answer. Buffers whose owner process is gone (a
stopped or killed server) are removed by ``serve.stop`` and by the next reader on the node
(``remove_stale``).

Followers trust their reader: same node, same sync root, same run's secret. Each still checks
the manifest itself (its HMAC, format, config), which is cheap.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from bapo_jax.rollout.sync_read import Allocate, numpy_dtype

__all__ = ["SHM_DIR", "NodeShare", "buffer_layout", "remove_stale"]

SHM_DIR = "/dev/shm"
PREFIX = "bapo-sync-"
ALIGN = 4096  # each array starts on a page


def buffer_layout(manifest: Mapping[str, Any]) -> tuple[dict[str, tuple[int, tuple, str]], int]:
    """The arrays of a version in the buffer: ``{name: (offset, shape, dtype)}`` in name order,
    each on a page boundary, and the bytes they span."""
    out, offset = {}, 0
    for name in sorted(manifest["params"]):
        spec = manifest["params"][name]
        shape, dtype = tuple(spec["shape"]), spec["dtype"]
        out[name] = (offset, shape, dtype)
        size = int(np.prod(shape, dtype=np.int64)) * numpy_dtype(dtype).itemsize
        offset += -(-size // ALIGN) * ALIGN
    return out, offset


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(directory: str | None = None) -> None:
    """Remove the sync buffers (and state files) of servers on this node that are gone.
    Readers call it before they write; ``serve.stop`` after it stops servers."""
    directory = directory or SHM_DIR
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            pid = name[len(PREFIX) :].split(".", 1)[0]
            if name.startswith(PREFIX) and pid.isdigit() and not _alive(int(pid)):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(directory, name))


class NodeShare:
    """A server's sync buffer on this node (module doc). owner: the pid the server's ranks on
    this node share; index: this rank's place among them (0: the reader); ranks: how many.
    directory: where the buffer lives (default ``SHM_DIR``); timeout_s: how long a follower
    waits for its reader."""

    def __init__(
        self,
        owner: int,
        index: int,
        ranks: int,
        *,
        directory: str | None = None,
        timeout_s: float = 900.0,
    ):
        if not 0 <= index < ranks:
            raise ValueError(f"index must be in [0, ranks={ranks}), got {index}")
        self.owner, self.index, self.ranks = int(owner), int(index), int(ranks)
        self.directory, self.timeout_s = directory or SHM_DIR, float(timeout_s)
        self.base = os.path.join(self.directory, f"{PREFIX}{self.owner}")
        self._map: mmap.mmap | None = None

    @property
    def reader(self) -> bool:
        return self.index == 0

    # ---- the buffer --------------------------------------------------------------------------
    def _mapping(self, size: int) -> mmap.mmap:
        """The buffer mapped (read-write for the reader, copy-on-write for a follower: vLLM
        gets writable arrays and never writes them), at least ``size`` bytes."""
        if self._map is not None and len(self._map) >= size:
            return self._map
        self.close()
        path = self.base + ".buf"
        flags = os.O_RDWR | os.O_CREAT if self.reader else os.O_RDONLY
        fd = os.open(path, flags, 0o600)
        try:
            have = os.fstat(fd).st_size
            if self.reader and have < size:
                fs = os.statvfs(self.directory)
                free = fs.f_bavail * fs.f_frsize
                if size - have > free:  # a full tmpfs would kill the writer (SIGBUS), not fail
                    raise OSError(
                        f"{self.directory} has {free / 1e9:.2f} GB free, the sync buffer needs "
                        f"{(size - have) / 1e9:.2f} GB more (a container: --shm-size or "
                        "--ipc=host, as vLLM asks for tensor parallelism anyway)"
                    )
                os.ftruncate(fd, size)
            elif have < size:
                raise ValueError(f"{path}: {have} bytes, the version needs {size}")
            access = mmap.ACCESS_WRITE if self.reader else mmap.ACCESS_COPY
            self._map = mmap.mmap(fd, max(size, have), access=access)
        finally:
            os.close(fd)
        return self._map

    def _views(self, manifest: Mapping[str, Any]) -> dict[str, np.ndarray]:
        layout, size = buffer_layout(manifest)
        buf = self._mapping(size)
        return {
            name: np.ndarray(shape, numpy_dtype(dtype), buffer=buf, offset=offset)
            for name, (offset, shape, dtype) in layout.items()
        }

    def reserve(self, nbytes: int) -> int:
        """The reader grows the buffer to ``nbytes`` and writes every page once, so that no
        sync faults them in; returns the buffer's size (0 on a follower)."""
        if not self.reader:
            return 0
        remove_stale(self.directory)
        buf = self._mapping(int(nbytes))
        np.frombuffer(buf, np.uint8)[:] = 0
        return len(buf)

    def close(self) -> None:
        if self._map is not None:
            with contextlib.suppress(BufferError):  # arrays still viewing it keep it mapped
                self._map.close()
            self._map = None

    # ---- one version -------------------------------------------------------------------------
    def _state(self, **state: Any) -> None:
        tmp = f"{self.base}.ready.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(state, f)
        os.replace(tmp, self.base + ".ready")

    def read(
        self, key: str, manifest: Mapping[str, Any], produce: Callable[[Allocate], Any]
    ) -> dict[str, np.ndarray]:
        """The version ``key`` names (the same string on every rank, e.g. version and digest)
        as arrays in the buffer. The reader clears ``.ready``, calls ``produce(allocate)`` to
        fill the buffer (it reads, hashes and checks; whatever it raises is published to the
        followers and raised), then publishes ``key``; a follower waits for ``key`` and maps
        the buffer."""
        if self.reader:
            remove_stale(self.directory)
            self._state(key=None)
            try:  # any failure (a full /dev/shm included) is the followers' answer too
                views = self._views(manifest)
                produce(lambda name, shape, dtype: views[name])
            except Exception as error:
                self._state(key=key, error=f"{type(error).__name__}: {error}")
                raise
            self._state(key=key)
            return views
        state = self._wait(key)
        if "error" in state:
            raise ValueError(f"refused by this node's reading rank: {state['error']}")
        return self._views(manifest)

    def _wait(self, key: str) -> dict[str, Any]:
        deadline, pause = time.monotonic() + self.timeout_s, 0.001
        while True:
            with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
                with open(self.base + ".ready", encoding="utf-8") as f:
                    state = json.load(f)
                if state.get("key") == key:
                    return state
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"this node's reading rank did not publish {key} in {self.timeout_s:g} s "
                    f"({self.base}.ready)"
                )
            time.sleep(pause)
            pause = min(0.05, pause * 2)
