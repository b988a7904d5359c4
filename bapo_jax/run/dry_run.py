"""`--dry-run`: the whole path of a GPU run, exercised on CPU with simulated devices.

1. Validate the config (files, mesh vs heads, batch vs mesh) without compute.
2. Compile the REAL train step (the run's model architecture, loss, micro-batching and mesh) on
   abstract sharded arguments and report XLA's per-device memory (`sharding.memory_plan`):
   nothing of the real model is allocated.
3. Run one full RL iteration -- rollout, reward, advantages, update, weight sync, checkpoint,
   metrics -- on a tiny stand-in policy with the real tokenizer, data, reward workers and
   mesh, through the same `Trainer` the real run uses.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

from bapo_jax.run.config import ModelSection, RunConfig, validate_run
from bapo_jax.sharding import memory_plan
from bapo_jax.sharding import mesh as mesh_lib
from bapo_jax.train import step as step_lib
from bapo_jax.train.config import AlgorithmConfig, CheckpointConfig, LoggingConfig
from bapo_jax.train.optim import make_optimizer


def compile_real_step(config: RunConfig) -> dict[str, Any]:
    """Compile the run's train step for its model and mesh; XLA's memory numbers."""
    from bapo_jax.run.build import model_options

    arch = config.model.architecture()
    t = config.trainer
    mesh_config = mesh_lib.mesh_preset(config.mesh)
    per_update = t.rows_per_batch // t.algorithm.mini_batches
    step_config = step_lib.StepConfig(
        loss=t.algorithm.loss,
        loss_config=t.algorithm.loss_config,
        temperature=t.rollout.temperature,
        ratio_base=t.algorithm.ratio_base,
        num_micro_batches=t.algorithm.micro_batches,
    )
    result = memory_plan.plan_memory(
        arch,
        mesh_config,
        seq_len=t.rollout.max_prompt_tokens + t.rollout.max_response_tokens,
        micro_batch=per_update // t.algorithm.micro_batches // mesh_config.batch_parallelism,
        num_micro_batches=t.algorithm.micro_batches,
        options=model_options(config),
        step_config=step_config,
        optimizer=make_optimizer(t.optimizer),
    )
    return {
        "rows_per_update": per_update,
        "seq_len": result.seq_len,
        "peak_gb_per_device": round(result.peak_bytes / 1e9, 2),
        "device_memory_gb": round(result.device_memory_bytes / 1e9, 2),
        "fits": result.fits,
        "compile_seconds": round(result.compile_seconds, 1),
    }


def stand_in(config: RunConfig, out_dir: str) -> RunConfig:
    """The same run at toy size: a 2-layer policy whose heads split over the run's mesh, one
    iteration of B x G rows that split over its batch devices, short responses, no eval."""
    mesh_config = mesh_lib.mesh_preset(config.mesh)
    t = config.trainer
    groups = max(1, mesh_config.batch_parallelism // 4)
    trainer = dataclasses.replace(
        t,
        steps=1,
        eval_every=0,
        rollout=dataclasses.replace(
            t.rollout, prompts_per_step=groups, samples_per_prompt=4, max_response_tokens=16
        ),
        algorithm=AlgorithmConfig(
            loss=t.algorithm.loss,
            bapo=t.algorithm.bapo,
            ppo_clip=t.algorithm.ppo_clip,
            clip_higher=t.algorithm.clip_higher,
            advantage=t.algorithm.advantage,
            ratio_base=t.algorithm.ratio_base,
        ),
        offpolicy=dataclasses.replace(t.offpolicy, staleness=0, replay_ratio=0.0),
        checkpoint=CheckpointConfig(directory=os.path.join(out_dir, "checkpoints"), every=1),
        logging=LoggingConfig(plots=True, progress=False),
    )
    model = ModelSection(
        preset="tiny-tied",
        tokenizer_dir=config.model.tokenizer_dir or config.model.hf_dir,
        param_dtype="float32",
        compute_dtype="float32",
        remat=config.model.remat,
    )
    return dataclasses.replace(
        config,
        trainer=trainer,
        model=model,
        engine=dataclasses.replace(config.engine, kind="embedded"),
    )


def stand_in_architecture(tokenizer, mesh_config) -> Any:
    """tiny-tied widened so its heads split over the mesh's tensor axis and its vocabulary
    holds every tokenizer id."""
    from bapo_jax.models.config import Qwen2Config

    kv = max(2, mesh_config.tensor)
    return Qwen2Config.preset("tiny-tied").replace(
        vocab_size=-(-tokenizer.vocab_size // 128) * 128,
        hidden_size=32 * kv,
        num_attention_heads=2 * kv,
        num_key_value_heads=kv,
        max_position_embeddings=4096,
        bos_token_id=None,
        eos_token_id=int(tokenizer.eos_id),
    )


def dry_run(config: RunConfig, out_dir: str) -> dict[str, Any]:
    from bapo_jax.run import build

    start = time.perf_counter()
    validate_run(config, check_engine=False)
    report: dict[str, Any] = {"mesh": config.mesh, "model": dataclasses.asdict(config.model)}
    report["real_step"] = compile_real_step(config)
    print(f"dry run: real train step compiled: {report['real_step']}", flush=True)

    small = stand_in(config, out_dir)
    mesh_config = mesh_lib.mesh_preset(small.mesh)
    mesh = None if small.mesh == "cpu1" else mesh_lib.make_mesh(mesh_config)
    tokenizer = build.build_tokenizer(small)
    arch = stand_in_architecture(tokenizer, mesh_config)
    with build.build_trainer(small, out_dir, mesh=mesh, architecture=arch) as trainer:
        summary = trainer.run()
    report["stand_in_step"] = summary["final"]
    report["wall_time_s"] = round(time.perf_counter() - start, 1)
    with open(os.path.join(out_dir, "dry_run.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2, sort_keys=True)
    return report
