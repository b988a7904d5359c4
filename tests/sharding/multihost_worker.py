"""One process of the two-process train-step test (`test_multihost.py` launches two).

Run as a script with the launcher's environment (BAPO_COORDINATOR, BAPO_NUM_PROCESSES,
BAPO_PROCESS_ID; XLA_FLAGS giving 4 CPU devices per process). It joins the other process
through `maybe_initialize`, builds the global mesh over all 8 devices, runs the same three BAPO
steps as `tests/train/test_step.py` (same model, optimizer, batches), feeding each process's
rows of the batch with `jax.make_array_from_process_local_data`, and writes the gathered
parameters and per-step metrics to an .npz file.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEP_TEST = os.path.join(REPO, "tests", "train", "test_step.py")
METRICS = ("loss", "c_low", "c_high", "grad_norm")


def load_step_test():
    """tests/train/test_step.py as a module (the tests directory is not a package)."""
    spec = importlib.util.spec_from_file_location("bapo_test_step", STEP_TEST)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def flat_params(params: nnx.State) -> dict[str, np.ndarray]:
    """{"layers/q_proj": array, ...} of a (gathered) params State."""
    flat = {}
    for path, value in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(params))[0]:
        flat["/".join(str(getattr(k, "key", k)) for k in path)] = np.asarray(value)
    return flat


def run(mesh_name: str, num_steps: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    from bapo_jax.algorithms.bapo import BAPOConfig
    from bapo_jax.sharding import distributed
    from bapo_jax.sharding import mesh as mesh_lib
    from bapo_jax.sharding import rules as rules_lib
    from bapo_jax.train import optim
    from bapo_jax.train.state import init_train_state, state_shardings
    from bapo_jax.train.step import StepConfig, make_logprob_fn, make_train_step

    if not distributed.maybe_initialize():
        raise RuntimeError("the launcher environment did not ask for a multi-process run")
    ref = load_step_test()
    cfg = mesh_lib.mesh_preset(mesh_name)
    mesh = mesh_lib.make_mesh(cfg)  # all devices of all processes
    batch_sharding = rules_lib.batch_sharding(mesh, ndim=2)
    step_config = StepConfig(loss="bapo", loss_config=BAPOConfig(rho0=0.6))

    optimizer = optim.make_optimizer(ref.OPT)
    graphdef, state = init_train_state(ref.CONFIG, optimizer, seed=0, mesh=mesh)
    jit_logp = make_logprob_fn(graphdef, step_config)
    step = make_train_step(
        graphdef,
        optimizer,
        step_config,
        learning_rate_fn=optim.learning_rate_schedule(ref.OPT),
        state_shardings=state_shardings(state, mesh),
    )

    def global_from_full(x):
        """Every process holds the whole array: each device takes its slice (callback)."""
        full = np.asarray(x)
        return jax.make_array_from_callback(full.shape, batch_sharding, lambda idx: full[idx])

    def logp_fn(params, ids, attention):
        logp, _ = jit_logp(params, global_from_full(ids), global_from_full(attention))
        return multihost_utils.process_allgather(logp, tiled=True), None

    start, stop = distributed.process_row_range(ref.B)
    history = {key: [] for key in METRICS}
    for i in range(num_steps):
        full = ref.make_batch(i, logp_fn, state.params)  # same rows on every process
        rows = jax.tree.map(lambda x: np.asarray(x)[start:stop], full)
        batch = distributed.global_batch_from_process_rows(rows, mesh)
        state, metrics = step(state, batch)
        metrics = multihost_utils.process_allgather(metrics, tiled=True)
        for key in METRICS:
            history[key].append(np.asarray(metrics[key]))
    params = multihost_utils.process_allgather(state.params, tiled=True)
    return flat_params(params), {key: np.stack(v) for key, v in history.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mesh", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", required=True, help=".npz path; the process id is appended")
    args = parser.parse_args()
    params, history = run(args.mesh, args.steps)
    info = {
        "meta/process_count": np.asarray(jax.process_count()),
        "meta/device_count": np.asarray(jax.device_count()),
        "meta/local_device_count": np.asarray(jax.local_device_count()),
    }
    arrays = {f"params/{k}": v for k, v in params.items()}
    arrays.update({f"metrics/{k}": v for k, v in history.items()})
    arrays.update(info)
    np.savez(f"{args.out}.{jax.process_index()}.npz", **arrays)
    jax.distributed.shutdown()


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    main()
