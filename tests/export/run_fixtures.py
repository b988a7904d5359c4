"""Tiny run directories the way a run leaves them: config.json (the RunConfig) and Orbax run
checkpoints written by `RunCheckpointer` (TrainState: step, params, optimizer state)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence

import optax

from bapo_jax.models import Qwen2Config, init_model, save_pretrained
from bapo_jax.models.tokenizer import SHIPPED_TOKENIZER_DIR
from bapo_jax.run.config import ModelSection, RunConfig, dump
from bapo_jax.train import optim
from bapo_jax.train.checkpoint import RunCheckpointer
from bapo_jax.train.state import init_train_state

ADAMW = optim.make_optimizer(optim.OptimizerConfig())


def make_run(
    run_dir: str | os.PathLike,
    architecture: Qwen2Config,
    model: ModelSection,
    seeds: Sequence[tuple[int, int]],
    optimizer: optax.GradientTransformation = ADAMW,
) -> dict[int, dict]:
    """Write `run_dir`: config.json with `model` as its model section, and one checkpoint per
    (step, seed) holding a fresh TrainState of `architecture` from that seed (params and the
    optimizer's state). Returns step -> the params' pure dict (host numpy)."""
    import jax
    import numpy as np
    from flax import nnx

    os.makedirs(run_dir, exist_ok=True)
    dump(RunConfig(model=model), os.path.join(run_dir, "config.json"))
    saved = {}
    with RunCheckpointer(os.path.join(run_dir, "checkpoints"), async_save=False) as ckpt:
        for step, seed in seeds:
            _, state = init_train_state(architecture, optimizer, seed=seed)
            ckpt.save(step, state, {"iteration": step}, {})
            saved[step] = jax.tree.map(np.asarray, nnx.to_pure_dict(state.params))
    return saved


def hf_dir_with_tokenizer(path: str | os.PathLike, architecture: Qwen2Config, seed: int) -> str:
    """An HF checkpoint of a random `architecture` with the shipped Qwen2.5 tokenizer files (a
    run's model.hf_dir)."""
    save_pretrained(init_model(architecture, seed=seed), path)
    for name in os.listdir(SHIPPED_TOKENIZER_DIR):
        source = os.path.join(SHIPPED_TOKENIZER_DIR, name)
        if os.path.isfile(source):
            shutil.copy(source, os.path.join(path, name))
    return os.fspath(path)
