"""A trainer run that can SIGKILL itself mid-update, mid-rollout or mid-save (resume tests).

    python -m tests.train.resume_worker OUT_DIR [--kill update|rollout|save:N]

The run uses every piece of state a checkpoint must carry: stale rollouts (queued batches),
partial rollouts (responses in flight), replay, experience reuse, async saves. At the end the
final parameters are written to OUT_DIR/final_params.npz.
"""

from __future__ import annotations

import argparse
import os
import signal

import jax
import numpy as np

from bapo_jax.train.config import AlgorithmConfig, CheckpointConfig, OffPolicyConfig
from tests.train.loop_fixtures import make_trainer, small_config

CONFIG = small_config(
    steps=6,
    algorithm=AlgorithmConfig(epochs=2, mini_batches=2),
    offpolicy=OffPolicyConfig(
        staleness=1, partial_budget=4, partial_pool=6, replay_ratio=0.5, replay_capacity=8
    ),
    checkpoint=CheckpointConfig(every=2, keep=2, async_save=True),
)


def _kill_on_call(fn, n: int):
    calls = [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            os.kill(os.getpid(), signal.SIGKILL)
        return fn(*args, **kwargs)

    return wrapped


def _kill_after_call(fn, n: int):
    calls = [0]

    def wrapped(*args, **kwargs):
        out = fn(*args, **kwargs)
        calls[0] += 1
        if calls[0] == n:  # the async save is still being written
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    return wrapped


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--kill", default=None, help="update:N | rollout:N | save:N")
    args = parser.parse_args()
    trainer = make_trainer(CONFIG, args.out_dir)
    if args.kill:
        where, n = args.kill.split(":")
        if where == "update":
            trainer.train_step = _kill_on_call(trainer.train_step, int(n))
        elif where == "rollout":
            trainer.engine.generate = _kill_on_call(trainer.engine.generate, int(n))
        elif where == "save":
            trainer.checkpointer.save = _kill_after_call(trainer.checkpointer.save, int(n))
        else:
            raise ValueError(f"--kill must be update|rollout|save:N, got {args.kill!r}")
    trainer.run()
    flat = jax.tree_util.tree_flatten_with_path(jax.device_get(trainer.state.params))[0]
    np.savez(
        os.path.join(args.out_dir, "final_params.npz"),
        **{jax.tree_util.keystr(k): np.asarray(v) for k, v in flat},
    )


if __name__ == "__main__":
    main()
