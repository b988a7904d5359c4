"""A trainer run that can SIGKILL itself mid-update, mid-rollout or mid-save (resume tests).

    python -m tests.train.resume_worker OUT_DIR [--kill update|rollout|save:N]

The run uses every piece of state a checkpoint must carry: stale rollouts (queued batches),
partial rollouts (responses in flight), replay, experience reuse, async saves. At the end the
final parameters are written to OUT_DIR/final_params.npz and the number of calls each kill
point saw to OUT_DIR/calls.json, with the counts at the start of each save ("at_save"): how
many rollouts a run makes depends on when the random model's responses stop, so the tests pick
kill points from an uninterrupted run's counts.
"""

from __future__ import annotations

import argparse
import json
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


KILL_POINTS = ("update", "rollout", "save")


def _counted(fn, calls: dict[str, int], where: str, kill_at: int | None):
    """fn, counting its calls; SIGKILLs the process on call `kill_at` (before it for updates
    and rollouts, after it for saves, whose async write is then still in flight)."""

    kill_after = where == "save"

    def wrapped(*args, **kwargs):
        calls[where] += 1
        if calls[where] == kill_at and not kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
        out = fn(*args, **kwargs)
        if calls[where] == kill_at and kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    return wrapped


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--kill", default=None, help="update:N | rollout:N | save:N")
    args = parser.parse_args()
    trainer = make_trainer(CONFIG, args.out_dir)
    kill_where, kill_at = None, None
    if args.kill:
        kill_where, _, n = args.kill.partition(":")
        if kill_where not in KILL_POINTS or not n.isdigit():
            raise ValueError(f"--kill must be update|rollout|save:N, got {args.kill!r}")
        kill_at = int(n)
    calls = dict.fromkeys(KILL_POINTS, 0)
    at_save: list[dict[str, int]] = []  # the counts when each save starts
    save = trainer.checkpointer.save

    def recorded_save(*a, **kw):
        at_save.append(dict(calls))
        return save(*a, **kw)

    trainer.checkpointer.save = recorded_save
    targets = {
        "update": (trainer, "train_step"),
        "rollout": (trainer.engine, "generate"),
        "save": (trainer.checkpointer, "save"),
    }
    for where, (obj, name) in targets.items():
        at = kill_at if where == kill_where else None
        setattr(obj, name, _counted(getattr(obj, name), calls, where, at))
    trainer.run()
    with open(os.path.join(args.out_dir, "calls.json"), "w") as f:
        json.dump({**calls, "at_save": at_save}, f)
    flat = jax.tree_util.tree_flatten_with_path(jax.device_get(trainer.state.params))[0]
    np.savez(
        os.path.join(args.out_dir, "final_params.npz"),
        **{jax.tree_util.keystr(k): np.asarray(v) for k, v in flat},
    )


if __name__ == "__main__":
    main()
