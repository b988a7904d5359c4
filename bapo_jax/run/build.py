"""RunConfig -> a ready `Trainer`: tokenizer, policy, prompts, rewards, engine, sync, eval.

Everything a run opens (reward workers, vLLM clients, launched servers) is registered in an
`contextlib.ExitStack`, so `with build_trainer(config, out_dir) as trainer: trainer.run()`
releases it whatever happens.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from bapo_jax.data.datasets import SHIPPED_SETS, read_math_rows, shipped_set
from bapo_jax.data.pipeline import PipelineConfig, PromptSource, prompt_iterator
from bapo_jax.models import init_model, load_pretrained
from bapo_jax.models.config import ModelOptions, Qwen2Config
from bapo_jax.models.tokenizer import Tokenizer, load_tokenizer
from bapo_jax.rewards.pool import RewardPool
from bapo_jax.run.config import RunConfig, validate_run
from bapo_jax.sharding import mesh as mesh_lib
from bapo_jax.train.loop import Trainer
from bapo_jax.train.sync import EmbeddedPublisher, OrbaxPublisher


def model_options(config: RunConfig) -> ModelOptions:
    m = config.model
    return ModelOptions(
        param_dtype=jnp.dtype(m.param_dtype),
        compute_dtype=jnp.dtype(m.compute_dtype),
        remat="full" if m.remat else "none",
    )


def build_tokenizer(config: RunConfig) -> Tokenizer:
    """The model directory's tokenizer, an explicit one, or the shipped Qwen2.5 files."""
    return load_tokenizer(config.model.tokenizer_dir or config.model.hf_dir)


def build_policy(
    config: RunConfig, arch: Qwen2Config | None, mesh: jax.sharding.Mesh | None, seed: int
):
    """The HF checkpoint (arch None), or a random init of `arch`; sharded over `mesh`."""
    options = model_options(config)
    if config.model.hf_dir is not None and arch is None:
        return load_pretrained(
            config.model.hf_dir, dtype=options.param_dtype, mesh=mesh, options=options
        )
    model = init_model(arch or config.model.architecture(), options, seed=seed)
    if mesh is None:
        return model
    from flax import nnx

    from bapo_jax.train.state import state_shardings

    graphdef, params = nnx.split(model)
    return nnx.merge(graphdef, jax.device_put(params, state_shardings(params, mesh)))


def build_prompts(config: RunConfig, tokenizer) -> Iterator:
    d, r = config.data, config.trainer.rollout
    path = shipped_set(d.train).path(d.split) if d.train in SHIPPED_SETS else d.train
    rows, _ = read_math_rows(path)
    source = PromptSource(
        rows, style=d.prompt_style, tokenizer=tokenizer, max_prompt_tokens=r.max_prompt_tokens
    )
    return prompt_iterator(source, PipelineConfig(batch_size=r.prompts_per_step, seed=d.seed))


def stop_ids(tokenizer, arch: Qwen2Config) -> tuple[int, ...]:
    ids = {int(tokenizer.eos_id)}
    eos = arch.eos_token_id
    ids.update([eos] if isinstance(eos, int) else list(eos or ()))
    return tuple(sorted(ids))


def _vllm_engine(config: RunConfig, arch, out_dir: str, stack: contextlib.ExitStack):
    from bapo_jax.rollout import serve
    from bapo_jax.rollout.vllm_client import VLLMClientConfig, VLLMEngine

    e, m = config.engine, config.model
    urls = list(e.vllm_urls)
    restart = None
    if e.launch_servers:  # launched here, so restartable from the last good version
        spec = serve.ServerSpec(
            model=m.hf_dir,
            max_model_len=config.trainer.rollout.max_prompt_tokens
            + max(config.trainer.rollout.max_response_tokens, config.eval.max_tokens),
        )
        group = serve.ServerGroup(spec, e.launch_servers, log_dir=os.path.join(out_dir, "vllm"))
        stack.callback(group.stop)
        group.wait_healthy()
        urls += group.urls
        restart = group.restart if not e.vllm_urls else None
    engine = VLLMEngine(
        VLLMClientConfig(urls=tuple(urls), model=m.hf_dir, pause_mode=e.pause_mode),
        expected_config=arch,
        restart=restart,
    )
    stack.callback(engine.close)
    publisher = OrbaxPublisher(
        e.sync_dir or os.path.join(out_dir, "weight_sync"),
        arch,
        dtype=jnp.dtype(e.sync_dtype),
        keep=e.sync_keep,
    )
    return engine, publisher


def _eval_fn(config: RunConfig, engine, tokenizer, pool: RewardPool, arch: Qwen2Config):
    """AIME avg@k with the engine's current weights (`eval.metrics.avg_at_k`)."""
    from bapo_jax.eval.__main__ import evaluate
    from bapo_jax.eval.metrics import avg_at_k
    from bapo_jax.rollout.types import SamplingParams

    ev = config.eval
    sets = {}
    for name in ev.sets:
        rows, _ = read_math_rows(shipped_set(name).path("test"))
        sets[name] = rows[: ev.limit] if ev.limit else rows
    sampling = SamplingParams(
        max_tokens=ev.max_tokens,
        temperature=ev.temperature,
        stop_token_ids=stop_ids(tokenizer, arch),
    )

    def run(params, version: int) -> dict[str, float]:
        out = {}
        for name, rows in sets.items():
            results = evaluate(
                engine,
                tokenizer,
                rows,
                k=ev.samples,
                sampling=sampling,
                prompt_style=config.data.prompt_style,
                seed=version,
                batch_size=ev.batch_size,
                pool=pool,
            )
            correct = np.asarray([r.correct for r in results]) > 0.5
            out[f"{name}/avg@{ev.samples}"] = avg_at_k(correct)
        return out

    return run


@contextlib.contextmanager
def build_trainer(
    config: RunConfig,
    out_dir: str,
    *,
    mesh: jax.sharding.Mesh | None = None,
    seed: int = 0,
    architecture: Qwen2Config | None = None,
):
    """Yields a `Trainer` for `config`, releasing every resource on exit. `architecture`
    replaces the configured model's (random init; the dry run's stand-in)."""
    arch = validate_run(config, architecture=architecture)
    if mesh is None and config.mesh != "cpu1":
        mesh = mesh_lib.make_mesh(mesh_lib.mesh_preset(config.mesh))
    tokenizer = build_tokenizer(config)
    with contextlib.ExitStack() as stack:
        pool = stack.enter_context(RewardPool(config.reward_workers))
        model = build_policy(config, architecture, mesh, seed)
        if config.engine.kind == "vllm":
            engine, publisher = _vllm_engine(config, arch, out_dir, stack)
        else:
            from bapo_jax.rollout.embedded import EmbeddedEngine

            engine = EmbeddedEngine(
                model, eos_token_ids=stop_ids(tokenizer, arch), pad_token_id=tokenizer.pad_id
            )
            publisher = EmbeddedPublisher()
        eval_fn = (
            _eval_fn(config, engine, tokenizer, pool, arch) if config.trainer.eval_every else None
        )
        yield Trainer(
            config.trainer,
            model=model,
            engine=engine,
            publisher=publisher,
            prompts=build_prompts(config, tokenizer),
            reward_fn=pool.score_batch,
            decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
            pad_id=tokenizer.pad_id,
            out_dir=out_dir,
            mesh=mesh,
            eval_fn=eval_fn,
        )
