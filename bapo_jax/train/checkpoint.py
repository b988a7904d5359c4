"""Run checkpoints: the whole trainer state in one Orbax `CheckpointManager` step directory.

Layout of ``directory/<step>/`` (one Orbax composite checkpoint per saved step)::

    state/         TrainState (step, params, optimizer state), sharded arrays (StandardSave)
    host/          the host dict: counters, data-iterator state, seeds, run config (JSON)
    array_index/   {name: {key, shape, dtype}} of the host arrays (JSON)
    arrays/        the non-empty host arrays under keys a00000, a00001, ... (PyTree, numpy)

Host arrays are stored under generated keys (names may hold any characters), and zero-size
arrays, which Orbax refuses to write, live in the index alone.

Atomicity (Orbax ``AtomicRenameTemporaryPath``, the default on local and POSIX filesystems):
every item is written inside ``<step>.orbax-checkpoint-tmp``, which is renamed to ``<step>``
only after all items are committed. ``latest_step`` lists finalised step directories on disk,
so a save interrupted at any point, even by SIGKILL, is never seen; the next `RunCheckpointer`
on the directory deletes the leftover temp directory when it opens, so a resumed run can save
the same step again. On GCS Orbax uses a
``commit_success.txt`` marker instead, with the same guarantee.

What a kill guarantees. ``save`` returns once the arrays are snapshotted to host memory (device
buffers may then be donated or deleted, host inputs mutated); the write continues in a
background thread. A process killed after ``save(s)`` returned and before ``wait()`` leaves
either the complete step ``s`` or nothing of it: ``latest_step`` is then ``s`` or the previous
complete step, and either restores exactly. Only after ``wait()`` (or the next ``save``, which
waits for the previous one) is step ``s`` known to be on disk. Steps beyond ``keep`` are
removed after a newer save completes; a kill during that removal can only leave an older,
superseded step partially deleted, never the newest. Durability against power loss is the
filesystem's (Orbax does not fsync the renamed directory).

Multi-host: every process constructs the `RunCheckpointer` and calls ``save``/``restore``/
``wait`` in the same order (they are collective). Orbax writes ``host``, ``array_index`` and
``arrays`` from the primary process (process 0), so they must be identical on every process
(the RL loop broadcasts process 0's, `train.multihost`); ``state`` is written shard by shard,
each process its own shards. ``directory`` must be one shared filesystem path.

Permissions: a ``directory`` the checkpointer creates is owner-only (``dir_mode``, 0o700 by
default): the checkpoint holds the whole model and optimizer state, and the steps Orbax
writes inside it take the umask's modes. An existing directory keeps its mode.
"""

from __future__ import annotations

import copy
import glob
import math
import os
import shutil
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from bapo_jax.checks import check_field, check_int, is_int

__all__ = ["DIR_MODE", "RunCheckpointer", "with_shardings"]

DIR_MODE = 0o700  # of a checkpoint directory `RunCheckpointer` creates (module doc)

# item -> (save args, restore args); registered up front so a fresh process can read metadata.
ITEMS = {
    "state": (ocp.args.StandardSave, ocp.args.StandardRestore),
    "host": (ocp.args.JsonSave, ocp.args.JsonRestore),
    "array_index": (ocp.args.JsonSave, ocp.args.JsonRestore),
    "arrays": (ocp.args.PyTreeSave, ocp.args.PyTreeRestore),
}
FORMAT = "bapo-run-checkpoint-v1"
# Element kinds tensorstore writes: bool, signed/unsigned int, float, complex (+ ml_dtypes floats).
_ARRAY_KINDS = frozenset("biufc")
_STEP_KEY = "step"  # always present in `arrays`, so the item is never an empty tree


def with_shardings(abstract_state: Any, shardings: Any) -> Any:
    """``abstract_state`` (ShapeDtypeStructs, e.g. ``abstract_train_state(...)[1]``) with each
    leaf's ``.sharding`` set from ``shardings``: a tree of the same structure or a prefix of it,
    such as ``state_shardings(abstract_state, mesh)`` (one sharding per ``nnx.Param``)."""

    def attach(sharding, subtree):
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), subtree
        )

    return jax.tree.map(attach, shardings, abstract_state)


# ---- validation --------------------------------------------------------------------------------
def _check_json(value: Any, where: str) -> None:
    """Refuse anything that would not come back from JSON as the same Python value."""
    if value is None or isinstance(value, bool | int | float | str):
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{where} has a non-str key {key!r}; JSON keys must be str")
            _check_json(item, f"{where}[{key!r}]")
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            _check_json(item, f"{where}[{i}]")
        return
    hint = " (use a list)" if isinstance(value, tuple) else ""
    raise ValueError(
        f"{where} is a {type(value).__name__}, which does not round-trip through JSON{hint}"
    )


def _snapshot_arrays(arrays: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """C-contiguous private copies, so the caller may reuse its buffers once `save` returns."""
    if not isinstance(arrays, Mapping):
        raise ValueError(f"arrays must be a dict of numpy arrays, got {type(arrays).__name__}")
    out = {}
    for name, value in arrays.items():
        if not isinstance(name, str):
            raise ValueError(f"arrays keys must be str, got {name!r}")
        if not isinstance(value, np.ndarray):
            raise ValueError(
                f"arrays[{name!r}] must be a host numpy array, got {type(value).__name__}"
            )
        ml_float = value.dtype.type.__module__.startswith("ml_dtypes")  # bfloat16, float8_*
        if value.dtype.kind not in _ARRAY_KINDS and not ml_float:
            raise ValueError(
                f"arrays[{name!r}] has dtype {value.dtype}; only bool, int, uint, float and "
                "complex arrays can be checkpointed"
            )
        out[name] = np.array(value, order="C", copy=True)
    return out


def _key_name(key: Any) -> str:
    for attr in ("name", "key", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _leaf_specs(tree: Any) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """{"params/embed_tokens/value": (shape, dtype), ...} of any tree of arrays, abstract
    arrays or Orbax ArrayMetadata (which stores custom nodes as nested dicts and lists)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {
        "/".join(_key_name(k) for k in path): (tuple(x.shape), jnp.dtype(x.dtype))
        for path, x in leaves
        if hasattr(x, "shape") and hasattr(x, "dtype")
    }


def spec_differences(
    have: Mapping[str, Any], want: Mapping[str, Any]
) -> tuple[list[str], list[str], list[str]]:
    """(missing, unexpected, "key: have vs want" of the differing) between two
    {leaf path: spec} maps, e.g. `_leaf_specs` of a checkpoint and of a restore target."""
    missing = sorted(set(want) - set(have))
    unexpected = sorted(set(have) - set(want))
    differing = [
        f"{k}: {have[k]} vs {want[k]}" for k in sorted(set(have) & set(want)) if have[k] != want[k]
    ]
    return missing, unexpected, differing


def _check_state_matches(saved: Any, abstract_state: Any, step: int) -> None:
    """Every leaf of the restore target must exist in the checkpoint with the same shape and
    dtype (Orbax would otherwise pad, truncate or cast silently)."""
    missing, unexpected, wrong = spec_differences(_leaf_specs(saved), _leaf_specs(abstract_state))
    if missing or unexpected or wrong:
        raise ValueError(
            f"checkpoint step {step} does not match the restore target: missing {missing}, "
            f"unexpected {unexpected}, mismatched (checkpoint vs target) {wrong}"
        )


def _make_directory(directory: str, mode: int) -> None:
    """Create ``directory`` (and its parents) with exactly ``mode`` (the umask ignored); one
    that exists, or that another process creates first, is left as it is."""
    try:
        os.makedirs(directory, mode=mode)
    except FileExistsError:
        return
    os.chmod(directory, mode)


def _remove_partial_saves(directory: str) -> None:
    """Delete the temp dirs of saves killed before their rename (never a complete step). One
    writer per directory is assumed; on a multi-process run process 0 deletes them while the
    others wait at a barrier (so no process starts a save in a directory still being swept)."""
    if jax.process_index() == 0:
        for path in glob.glob(os.path.join(glob.escape(directory), "*.orbax-checkpoint-tmp*")):
            shutil.rmtree(path, ignore_errors=True)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"bapo-run-checkpoint-sweep:{directory}")


# ---- the checkpointer --------------------------------------------------------------------------
class RunCheckpointer:
    """Saves and restores (TrainState, host dict, host arrays) per step; keeps the newest
    ``keep`` complete steps. See the module docstring for the atomicity guarantees; a
    ``directory`` created here gets ``dir_mode`` (owner-only by default)."""

    def __init__(
        self,
        directory: str | os.PathLike,
        keep: int = 3,
        async_save: bool = True,
        dir_mode: int = DIR_MODE,
    ):
        check_int("keep", keep, 1)
        check_field(isinstance(async_save, bool), "async_save", "a bool", async_save)
        ok = is_int(dir_mode, 0) and dir_mode <= 0o7777
        check_field(ok, "dir_mode", "a permission mode like 0o700", dir_mode)
        self.directory = os.path.abspath(os.fspath(directory))
        _make_directory(self.directory, dir_mode)
        _remove_partial_saves(self.directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            enable_async_checkpointing=async_save,
            # Done synchronously above: Orbax's background cleanup races with a second
            # checkpointer opened on the same directory (both rmtree the same temp dir).
            cleanup_tmp_directories=False,
            create=True,
        )
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        for item, (save_args, restore_args) in ITEMS.items():
            registry.add(item, save_args)
            registry.add(item, restore_args)
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, handler_registry=registry
        )
        self._last_saved: int | None = self.latest_step()

    # -- queries --
    def all_steps(self) -> list[int]:
        """Complete (finalised) steps on disk, ascending; in-flight saves are not included."""
        return sorted(ocp.path.step.checkpoint_steps(self.directory))

    def latest_step(self) -> int | None:
        """The newest complete checkpoint, or None."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    # -- save --
    def save(
        self,
        step: int,
        state: Any,
        host: Mapping[str, Any],
        arrays: Mapping[str, np.ndarray],
    ) -> None:
        """Start saving ``step``; returns once the inputs are snapshotted (device arrays copied
        to host, host data copied), while files are written in the background when async."""
        step = check_int("step", step, 0)
        if self._last_saved is not None and step <= self._last_saved:
            raise ValueError(
                f"step {step} is not newer than the last saved step {self._last_saved} in "
                f"{self.directory}; steps must increase"
            )
        if not isinstance(host, dict):
            raise ValueError(f"host must be a dict, got {type(host).__name__}")
        _check_json(host, "host")
        host = copy.deepcopy(host)  # written in the background: the caller may change its dict
        snap = _snapshot_arrays(arrays)
        index: dict[str, Any] = {}
        stored: dict[str, np.ndarray] = {_STEP_KEY: np.asarray(step, np.int64)}
        for i, name in enumerate(sorted(snap)):
            value = snap[name]
            key = f"a{i:05d}"
            index[name] = {"key": key, "shape": list(value.shape), "dtype": value.dtype.name}
            if value.size:
                stored[key] = value
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            host=ocp.args.JsonSave(host),
            array_index=ocp.args.JsonSave({"format": FORMAT, "step": step, "arrays": index}),
            arrays=ocp.args.PyTreeSave(stored),
        )
        if not self._manager.save(step, args=args):
            raise RuntimeError(f"Orbax declined to save step {step} in {self.directory}")
        self._last_saved = step

    # -- restore --
    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any], dict]:
        """(state, host, arrays) of complete step ``step``. ``state`` has the structure of
        ``abstract_state`` (so Param metadata and the pytree structure survive) and each array
        lands in its target leaf's ``.sharding``; a leaf without one gets the sharding recorded
        at save time. Host arrays come back as numpy with their saved shape and dtype."""
        steps = self.all_steps()
        if step not in steps:
            raise ValueError(
                f"no complete checkpoint for step {step!r} in {self.directory}; "
                f"complete steps: {steps}"
            )
        _check_state_matches(self._manager.item_metadata(step)["state"].tree, abstract_state, step)
        meta = self._manager.restore(
            step,
            args=ocp.args.Composite(
                host=ocp.args.JsonRestore(), array_index=ocp.args.JsonRestore()
            ),
        )
        index = meta.array_index
        if index.get("format") != FORMAT or index.get("step") != step:
            raise ValueError(
                f"checkpoint step {step} in {self.directory} has array index format "
                f"{index.get('format')!r} for step {index.get('step')!r}; expected {FORMAT!r}"
            )
        stored_keys = [_STEP_KEY] + [
            e["key"] for e in index["arrays"].values() if math.prod(e["shape"])
        ]
        restore_args = {k: ocp.RestoreArgs(restore_type=np.ndarray) for k in stored_keys}
        out = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state),
                arrays=ocp.args.PyTreeRestore(restore_args=restore_args),
            ),
        )
        arrays = {}
        for name, entry in index["arrays"].items():
            shape, dtype = tuple(entry["shape"]), jnp.dtype(entry["dtype"])
            value = out.arrays[entry["key"]] if math.prod(shape) else np.zeros(shape, dtype)
            value = np.asarray(value)
            if value.shape != shape or value.dtype != dtype:
                raise ValueError(
                    f"checkpoint step {step}: array {name!r} restored as {value.shape} "
                    f"{value.dtype}, index says {shape} {dtype}"
                )
            arrays[name] = value
        return out.state, meta.host, arrays

    # -- lifecycle --
    def wait(self) -> None:
        """Block until every started save is finalised on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Wait for pending saves, then release Orbax's threads."""
        self._manager.close()

    def __enter__(self) -> RunCheckpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
