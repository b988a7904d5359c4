"""How many programs a jitted function has needed, counted from its calls (`Specialisations`):
the rows' `compile/<name>` fields, which show a recompile."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import jax


class Specialisations:
    """A jitted function that counts the distinct abstract signatures of its calls.

    jit compiles one program per signature of the arguments it is called with: their pytree
    structure and, per leaf, shape, dtype, weak type, sharding and whether the array is
    committed to it (the trainer's jitted functions take no static arguments). The number of
    signatures seen is thus the number of programs the function has needed: 1 for a run whose
    calls all have one shape, more once it recompiled. Counted here, from the calls, because
    jit's own count (`_cache_size()`) is private API, and `jax.monitoring`'s compile events are
    process-wide and name a function only by its Python name (the train step's is "step"): in a
    process with several trainers (the tests, a study) they would mix. Thread-safe: the teacher
    calls the log-prob function from the rollout thread.
    """

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        self._seen: set[Any] = set()
        self._lock = threading.Lock()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, treedef = jax.tree.flatten((args, kwargs))
        # Read before the call: the train step donates its state's buffers.
        key = (treedef, tuple(_leaf_signature(x) for x in leaves))
        with self._lock:
            self._seen.add(key)
        return self.fn(*args, **kwargs)

    @property
    def count(self) -> int:
        """Distinct signatures called so far (0 before the first call)."""
        with self._lock:
            return len(self._seen)


def _leaf_signature(x: Any) -> Any:
    """What jit compiles one argument leaf for: `jax.typeof` gives shape, dtype and weak type
    (also of numpy arrays and Python scalars); a jax.Array adds where it lives."""
    if isinstance(x, jax.Array):
        return jax.typeof(x), x.sharding, x.committed
    return jax.typeof(x)
