"""One process of the two-process RL-loop test (`test_multihost_loop.py` launches two).

Run as a script with the launcher's environment (`tests/multihost_launch.py`). It joins the
other process through `maybe_initialize`, builds the mesh over every device of both processes,
runs `STEPS` RL iterations of the toy task of `loop_fixtures` on the embedded engine (its
params span both processes), and writes the gathered final params and its process facts to
`<out>/result.<process>.npz`. The test builds the same trainer (`build_trainer`) on one
process with the same device count as the reference.
"""

from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ == "__main__":
    sys.path.insert(0, REPO)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from bapo_jax.algorithms.bapo import BAPOConfig  # noqa: E402
from bapo_jax.data.pipeline import PipelineConfig, prompt_iterator  # noqa: E402
from bapo_jax.models import init_model  # noqa: E402
from bapo_jax.rollout.embedded import EmbeddedEngine  # noqa: E402
from bapo_jax.sharding import mesh as mesh_lib  # noqa: E402
from bapo_jax.train.config import (  # noqa: E402
    AlgorithmConfig,
    CheckpointConfig,
    LoggingConfig,
    OffPolicyConfig,
    TrainerConfig,
)
from bapo_jax.train.loop import Trainer  # noqa: E402
from bapo_jax.train.state import state_shardings  # noqa: E402
from tests.train import loop_fixtures  # noqa: E402

MESH = mesh_lib.MeshConfig(fsdp=2, tensor=2)  # 4 devices: 2 processes x 2, or 1 x 4
STEPS = 2


def config(checkpoint_dir: str) -> TrainerConfig:
    """B=4 x G=4, staleness 1 (batch 1 is generated before the update on batch 0), one
    checkpoint at the end (async, as in a real run), a KL penalty to the initial policy (its
    frozen copy spans both processes; its log-probs are gathered from both)."""
    return loop_fixtures.small_config(
        steps=STEPS,
        algorithm=AlgorithmConfig(bapo=BAPOConfig(kl_coef=0.05)),
        offpolicy=OffPolicyConfig(staleness=1),
        checkpoint=CheckpointConfig(directory=checkpoint_dir, every=STEPS, keep=1),
        logging=LoggingConfig(plot_every=STEPS, progress=True),
    )


def build_trainer(out_dir: str, checkpoint_dir: str, devices: list | None = None) -> Trainer:
    """The toy trainer on `MESH` (over `devices`, default all of every process), the policy
    sharded the way `run.build.build_policy` does it."""
    mesh = mesh_lib.make_mesh(MESH, devices)
    model = init_model(loop_fixtures.MODEL, seed=0)
    graphdef, params = nnx.split(model)
    model = nnx.merge(graphdef, jax.device_put(params, state_shardings(params, mesh)))
    engine = EmbeddedEngine(
        model, eos_token_ids=loop_fixtures.STOP_IDS, pad_token_id=0, length_bucket=8
    )
    prompts = prompt_iterator(loop_fixtures.ToySource(), PipelineConfig(batch_size=4, seed=0))
    return Trainer(
        config(checkpoint_dir),
        model=model,
        engine=engine,
        prompts=prompts,
        reward_fn=loop_fixtures.toy_reward,
        decode=loop_fixtures.decode,
        pad_id=0,
        out_dir=out_dir,
        mesh=mesh,
    )


def flat_params(params: nnx.State) -> dict[str, np.ndarray]:
    """{"layers/q_proj": array, ...} of a fully addressable params State."""
    flat = {}
    for path, value in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(params))[0]:
        flat["/".join(str(getattr(k, "key", k)) for k in path)] = np.asarray(value)
    return flat


def main() -> None:
    from jax.experimental import multihost_utils

    from bapo_jax.sharding import distributed

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, help="directory shared by the processes")
    args = parser.parse_args()
    if not distributed.maybe_initialize():
        raise RuntimeError("the launcher environment did not ask for a multi-process run")
    index = jax.process_index()
    trainer = build_trainer(
        os.path.join(args.out, f"run.{index}"),  # each process its own: who wrote what
        os.path.join(args.out, "checkpoints"),  # one shared directory, as on a cluster
    )
    summary = trainer.run()
    params = multihost_utils.process_allgather(trainer.state.params, tiled=True)
    arrays = {f"params/{k}": v for k, v in flat_params(params).items()}
    arrays.update(
        {
            "meta/process_count": np.asarray(jax.process_count()),
            "meta/device_count": np.asarray(jax.device_count()),
            "meta/local_device_count": np.asarray(jax.local_device_count()),
            "meta/steps": np.asarray(summary["steps"]),
            "meta/optimizer_step": np.asarray(int(trainer.state.step)),
        }
    )
    np.savez(os.path.join(args.out, f"result.{index}.npz"), **arrays)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
