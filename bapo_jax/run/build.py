"""RunConfig -> a ready `Trainer`: task, policy, engine, weight sync, eval.

Every run is built here, whatever its task and engine: the math runs (`math_task`, the
default: `data` prompts, the math-verify reward pool, AIME avg@k) and the CPU arithmetic job
(`tasks.arithmetic_job.arithmetic_task`) differ only in the `RunTask` they pass. The engine is
the embedded sampler or vLLM servers (given by URL, or launched here with the vLLM
environment's interpreter and restarted on the last synced version if one dies).

Everything a run opens (reward workers, vLLM clients, launched servers) is registered in a
`contextlib.ExitStack`, so `with build_trainer(config, out_dir) as trainer: trainer.run()`
releases it whatever happens.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Callable, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bapo_jax.data.datasets import MalformedRowError, ReadReport
from bapo_jax.data.files import read_rows
from bapo_jax.data.pipeline import PipelineConfig, PromptSource, prompt_iterator
from bapo_jax.models import init_model, load_pretrained
from bapo_jax.models.config import ModelOptions, Qwen2Config
from bapo_jax.models.lora import load_peft, set_adapters
from bapo_jax.models.tokenizer import Tokenizer, load_tokenizer, missing_tokenizer_files
from bapo_jax.rewards.function import RewardFunction, reward_pool_for
from bapo_jax.rewards.plugins import MATH_VERIFY
from bapo_jax.rewards.pool import RewardPool
from bapo_jax.rollout import run_secret, serve
from bapo_jax.rollout.orbax_sync import FollowerEngine, OrbaxSync, target_for
from bapo_jax.rollout.server_settings import vllm_lora_rank
from bapo_jax.rollout.types import RolloutEngine, SamplingParams
from bapo_jax.run import servers
from bapo_jax.run.config import RunConfig, RunConfigError, config_errors, validate_run
from bapo_jax.run.estimate import ACCELERATOR_SPECS, batch_deadline_s, requests_per_server
from bapo_jax.run.preflight import trainer_mesh
from bapo_jax.run.servers import max_model_len
from bapo_jax.train import reference
from bapo_jax.train.loop import Trainer
from bapo_jax.train.producer import Decode, RewardFn
from bapo_jax.train.state import state_shardings

READ_ERRORS = (FileNotFoundError, MalformedRowError)  # a data file that cannot be read
# (engine, policy version) -> metrics, with the engine holding that version's weights.
Evaluate = Callable[[RolloutEngine, int], Mapping[str, float]]


@dataclasses.dataclass(frozen=True)
class RunTask:
    """What a run trains on and how it is scored: everything but the policy, engine and loop.

    prompts: an iterator of prompt batches with get_state/set_state (`data.pipeline`);
    reward_fn(texts, answers, metadata) -> rewards (`train.producer.RewardFn`); decode(token
    ids) -> text; pad_id: the tokenizer's;
    stop_token_ids: ids that end a response (sent to every engine); evaluate: None, or run
    every `trainer.eval_every` iterations through the run's engine; data_metrics: logged in
    every row (the math task's data/skipped_rows and data/dropped_prompts).
    """

    prompts: Iterator
    reward_fn: RewardFn
    decode: Decode
    pad_id: int
    stop_token_ids: tuple[int, ...]
    evaluate: Evaluate | None = None
    data_metrics: Mapping[str, float] = dataclasses.field(default_factory=dict)


# Builds a run's task; the stack owns whatever the task opens (e.g. a reward pool).
TaskFactory = Callable[[RunConfig, Qwen2Config, contextlib.ExitStack], RunTask]


def estimate_followers(config: RunConfig, arch, out_dir: str) -> tuple:
    """On a GPU/TPU pod (vLLM servers not on CPU cores), the follower that prints the run's
    iteration estimate redone from its own first iterations (`measured.RedoneEstimate`)."""
    e = config.engine
    if e.kind != "vllm" or e.server.cpu_cores or config.accelerator not in ACCELERATOR_SPECS:
        return ()
    from bapo_jax.run.measured import RedoneEstimate

    return (functools.partial(RedoneEstimate, config, arch, out_dir),)


def model_options(config: RunConfig) -> ModelOptions:
    """How the policy runs: the model section's dtypes, remat policy, scan unroll and attention
    core."""
    m = config.model
    return ModelOptions(
        param_dtype=jnp.dtype(m.param_dtype),
        compute_dtype=jnp.dtype(m.compute_dtype),
        remat=m.remat,
        scan_unroll=m.scan_unroll,
        attention=m.attention,
        lora=m.lora(),
    )


def build_tokenizer(config: RunConfig) -> Tokenizer:
    """The model directory's tokenizer, an explicit one, or the shipped Qwen2.5 files. A
    directory without the files `load_tokenizer` needs is refused first, naming them and the key
    (before the policy loads)."""
    m = config.model
    directory = m.tokenizer_dir or m.hf_dir
    if directory is not None and (missing := missing_tokenizer_files(directory)):
        key = "model.tokenizer_dir" if m.tokenizer_dir else "model.hf_dir (--model-dir)"
        raise RunConfigError(
            f"{key}: {directory!r} has no tokenizer: missing {', '.join(missing)}; copy them "
            "from the model's hub repository, or set model.tokenizer_dir to a directory with them"
        )
    return load_tokenizer(directory)


def build_policy(
    config: RunConfig, arch: Qwen2Config | None, mesh: jax.sharding.Mesh | None, seed: int
):
    """The HF checkpoint (arch None), or a random init of `arch`; sharded over `mesh`."""
    options = model_options(config)
    adapters = None
    if config.model.lora_adapter is not None:  # a PEFT adapter to start from
        _, adapters = load_peft(config.model.lora_adapter, arch or config.model.architecture())
    if config.model.hf_dir is not None and arch is None:
        return load_pretrained(
            config.model.hf_dir,
            dtype=options.param_dtype,
            mesh=mesh,
            options=options,
            adapters=adapters,
            seed=seed,
        )
    model = init_model(arch or config.model.architecture(), options, seed=seed)
    if adapters is not None:
        set_adapters(model, adapters)
    if mesh is None:
        return model
    graphdef, params = nnx.split(model)
    return nnx.merge(graphdef, jax.device_put(params, state_shardings(params, mesh)))


def check_reference(config: RunConfig, *, stand_in: bool = False) -> None:
    """Before any compute: kl_coef > 0 with `trainer.algorithm.reference_hf_dir` needs a
    directory with a config.json of the policy's architecture (not compared for a stand-in
    policy); kl_coef == 0 checks nothing (`train.reference`)."""
    policy = None if stand_in else config.model.architecture()
    with config_errors("trainer."):
        reference.check_reference_source(config.trainer.algorithm, policy)


@dataclasses.dataclass(frozen=True)
class TrainPrompts:
    """The training prompts of `data.train`: `batches` (`data.pipeline.prompt_iterator`, with
    get_state/set_state), what the reader left out (`read_report`: bad rows' lines and reasons,
    data.on_bad_row="skip") and `dropped_prompts` (over trainer.rollout.max_prompt_tokens)."""

    batches: Iterator
    read_report: ReadReport
    dropped_prompts: int

    def metrics(self) -> dict[str, float]:
        """What every metrics row of the run says about its data."""
        return {
            "data/skipped_rows": self.read_report.num_skipped,
            "data/dropped_prompts": self.dropped_prompts,
        }


def build_prompts(config: RunConfig, tokenizer) -> TrainPrompts:
    """The training prompt batches of `data.train`, read with the data section's
    `DataFileSpec`, and what the reader left out."""
    d, r = config.data, config.trainer.rollout
    with config_errors("data.train: ", READ_ERRORS):
        rows, report = read_rows(d.file_spec())
    source = PromptSource(
        rows, style=d.prompt_style, tokenizer=tokenizer, max_prompt_tokens=r.max_prompt_tokens
    )
    batches = prompt_iterator(source, PipelineConfig(batch_size=r.prompts_per_step, seed=d.seed))
    return TrainPrompts(batches, report, source.num_dropped)


def stop_ids(tokenizer, arch: Qwen2Config) -> tuple[int, ...]:
    ids = {int(tokenizer.eos_id)}
    eos = arch.eos_token_id
    ids.update([eos] if isinstance(eos, int) else list(eos or ()))
    return tuple(sorted(ids))


def math_task(config: RunConfig, arch: Qwen2Config, stack: contextlib.ExitStack) -> RunTask:
    """The math runs' task: `data` prompts, the `rewards` section's reward (math-verify by
    default, or exact match, or a plug-in, plus an optional format term) scored in a worker
    pool, and AIME avg@k (`eval.metrics.avg_at_k`, always math-verify, in the same pool) with
    the engine's current weights. A bad `rewards.fn` plug-in fails here, before any worker
    starts."""
    tokenizer = build_tokenizer(config)
    pool = stack.enter_context(reward_pool_for(config.rewards))
    stops = stop_ids(tokenizer, arch)
    prompts = build_prompts(config, tokenizer)
    return RunTask(
        prompts=prompts.batches,
        reward_fn=RewardFunction(config.rewards, pool),
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        pad_id=tokenizer.pad_id,
        stop_token_ids=stops,
        evaluate=EvalSets(config, tokenizer, pool, stops),
        data_metrics=prompts.metrics(),
    )


class EvalSets:
    """avg@k on each of `eval.sets` with the engine's current weights (`Evaluate`).

    Shipped sets and files are read with the eval section's `DataFileSpec`s; metrics
    "<set or file stem>/avg@k", and "<name>/skipped_rows" for a file whose bad rows
    eval.on_bad_row="skip" left out. `reward[name]`: a shipped set is scored by math-verify
    (its answers are math), a file by the run's `rewards.fn` (the correctness term alone; a
    response counts as correct when it scores > 0.5). `rows[name]`, `skipped[name]`: what was
    read and left out."""

    def __init__(self, config: RunConfig, tokenizer, pool: RewardPool, stops: Sequence[int]):
        self.config, self.tokenizer, self.pool = config, tokenizer, pool
        ev = config.eval
        self.rows, self.skipped, self.reward = {}, {}, {}
        for name, spec in ev.set_specs().items():  # shipped sets and files (`EvalSection`)
            with config_errors("eval.sets: ", READ_ERRORS):
                rows, report = read_rows(spec)
            self.rows[name] = rows[: ev.limit] if ev.limit else rows
            self.skipped[name] = report.num_skipped
            self.reward[name] = MATH_VERIFY if name in ev.sets else config.rewards.fn
        self.sampling = SamplingParams(
            max_tokens=ev.max_tokens, temperature=ev.temperature, stop_token_ids=tuple(stops)
        )

    def __call__(self, engine: RolloutEngine, version: int) -> dict[str, float]:
        from bapo_jax.eval.__main__ import evaluate
        from bapo_jax.eval.metrics import avg_at_k

        ev, out = self.config.eval, {}
        for name, rows in self.rows.items():
            results = evaluate(
                engine,
                self.tokenizer,
                rows,
                k=ev.samples,
                sampling=self.sampling,
                prompt_style=self.config.data.prompt_style,
                seed=version,
                batch_size=ev.batch_size,
                pool=self.pool,
                reward=self.reward[name],
            )
            correct = np.asarray([r.correct for r in results]) > 0.5
            out[f"{name}/avg@{ev.samples}"] = avg_at_k(correct)
            if self.skipped[name]:
                out[f"{name}/skipped_rows"] = self.skipped[name]
        return out


def sync_root(config: RunConfig, out_dir: str) -> str:
    """The run's weight-sync directory: engine.sync_dir, else <out_dir>/weight_sync."""
    return config.engine.sync_dir or os.path.join(out_dir, "weight_sync")


def server_spec(config: RunConfig, sync_dir: str | None = None):
    """How the run launches its vLLM servers (`serve.ServerSpec`): model.hf_dir, --max-model-len
    the prompt + response caps, started as engine.server says, under the served name
    `servers.served_model_name(config)`, loading versions only from under `sync_dir`."""
    settings = dataclasses.replace(
        config.engine.server, served_model_name=servers.served_model_name(config)
    )
    if (lora := config.model.lora()) is not None:  # the run syncs adapters (adapter_sync)
        rank = max(settings.max_lora_rank, vllm_lora_rank(lora.rank))
        settings = dataclasses.replace(settings, max_lora_rank=rank)
    return serve.ServerSpec(config.model.hf_dir, max_model_len(config), settings, sync_dir)


def launch_servers(config: RunConfig, out_dir: str):
    """Starts `engine.launch_servers` servers of `server_spec(config)`; returns the
    `serve.ServerGroup` (the caller stops it) once every server answers /health and its
    /v1/models shows the run's served name and max length (`run.servers.check_server`).
    Their secret (bearer token, manifest key): engine.server.secret_file, else
    $BAPO_RUN_SECRET_FILE, else a fresh one in <out_dir>/vllm/run_secret."""
    spec = server_spec(config, sync_root(config, out_dir))
    group = serve.ServerGroup(
        spec, config.engine.launch_servers, log_dir=os.path.join(out_dir, "vllm")
    )
    try:
        group.wait_healthy()
        for url in group.urls:
            servers.check_server(config, url, launched=True, token=group.token)
    except BaseException:
        group.stop()
        raise
    return group


def _vllm_engine(
    config: RunConfig, arch, out_dir: str, stack: contextlib.ExitStack
) -> tuple[RolloutEngine, OrbaxSync]:
    """The vLLM client (on processes other than 0: a `FollowerEngine`) and the `OrbaxSync`
    that loads each version into its servers."""
    e = config.engine
    if config.model.lora() is not None and jax.process_count() > 1:
        raise RunConfigError(
            f"model.lora_rank: the adapter-only sync to vLLM runs on a single-process trainer "
            f"for now, this run has {jax.process_count()} processes"
        )

    def orbax_sync(target, secret: bytes | None = None) -> OrbaxSync:
        root, dtype = sync_root(config, out_dir), jnp.dtype(e.sync_dtype)
        key = None if secret is None else run_secret.manifest_key(secret)
        return OrbaxSync(
            root, arch, target, dtype=dtype, keep=e.sync_keep, attempts=e.sync_attempts,
            manifest_key=key, dir_mode=int(e.sync_dir_mode, 8), lora=config.model.lora(),
        )  # fmt: skip

    if jax.process_index() != 0:  # the write is collective; process 0 alone signs and loads
        follower = FollowerEngine()
        return follower, orbax_sync(follower)
    from bapo_jax.rollout.vllm_client import VLLMClientConfig, VLLMEngine

    names = {servers.check_server(config, url) for url in e.vllm_urls}  # before any launch
    if e.launch_servers:
        names.add(servers.served_model_name(config))
    if len(names) != 1:
        raise RunConfigError(f"engine.vllm_urls: the servers serve different models {names}")
    (name,) = names
    urls = list(e.vllm_urls)
    restart = alive = None
    secret_file = e.server.secret_file or os.environ.get(run_secret.SECRET_FILE_ENV)
    if e.launch_servers:  # launched here, so restartable from the last good version
        group = launch_servers(config, out_dir)
        stack.callback(group.stop)
        urls += group.urls
        secret_file = group.secret_file
        if not e.vllm_urls:
            restart, alive = group.restart, group.alive
    secret = None if secret_file is None else run_secret.read_secret(secret_file)
    requests = requests_per_server(config, arch)
    engine = VLLMEngine(
        VLLMClientConfig(
            urls=tuple(urls),
            model=name,
            max_inflight_per_server=requests,
            sequences_per_server=requests * config.trainer.rollout.samples_per_prompt,
            request_timeout_s=e.request_timeout_s,
            deadline_s=batch_deadline_s(config, arch),
            token=None if secret is None else run_secret.bearer_token(secret),
            unresponsive_after_s=e.unresponsive_after_s,
        ),
        expected_config=arch,
        restart=restart,
        alive=alive,
    )
    stack.callback(engine.close)
    sync = orbax_sync(target_for(engine), secret)
    for url, reply in sync.reserve_memory().items():  # before the first sync (docs/rollout.md)
        if reply.get("ok"):
            done = f"{reply['reserved_bytes'] / 1e6:,.0f} MB in {reply['seconds']:.1f} s"
            print(f"{url}: host memory for syncs: {reply.get('why', done)}", flush=True)
        else:
            print(f"{url}: host memory for syncs not reserved: {reply['error']}", flush=True)
    return engine, sync


@contextlib.contextmanager
def build_trainer(
    config: RunConfig,
    out_dir: str,
    *,
    task: TaskFactory = math_task,
    mesh: jax.sharding.Mesh | None = None,
    seed: int = 0,
    architecture: Qwen2Config | None = None,
):
    """Yields a `Trainer` for `config` and `task`, releasing every resource on exit.
    `architecture` replaces the configured model's (random init; the dry run's stand-in)."""
    arch = validate_run(config, architecture=architecture)
    stand_in = architecture is not None
    check_reference(config, stand_in=stand_in)
    if config.trainer_cpu_cores:  # from here on; servers launched below get their own cores
        os.sched_setaffinity(0, set(config.trainer_cpu_cores))
    if mesh is None:  # the trainer's devices (`trainer_devices`) in the `mesh` shape
        mesh = trainer_mesh(config)
    with contextlib.ExitStack() as stack:
        run_task = task(config, arch, stack)
        if jax.process_index() == 0:  # <out>/model/: what export and eval read of the policy
            from bapo_jax.export import record_policy

            record_policy(out_dir, arch, config.model.tokenizer_dir or config.model.hf_dir)
        model = build_policy(config, architecture, mesh, seed)
        weights = None  # the embedded engine takes its own
        if config.engine.kind == "vllm":
            engine, weights = _vllm_engine(config, arch, out_dir, stack)
        else:
            from bapo_jax.rollout.embedded import EmbeddedEngine

            engine = EmbeddedEngine(
                model,
                eos_token_ids=run_task.stop_token_ids,
                pad_token_id=run_task.pad_id,
                length_bucket=config.engine.length_bucket,
                cpu_kernels=config.engine.cpu_kernels,
            )
        eval_fn = None
        if run_task.evaluate is not None and config.trainer.eval_every:
            evaluate = run_task.evaluate
            eval_fn = lambda params, version: evaluate(engine, version)
        yield Trainer(
            config.trainer,
            model=model,
            engine=engine,
            weights=weights,
            prompts=run_task.prompts,
            reward_fn=run_task.reward_fn,
            decode=run_task.decode,
            pad_id=run_task.pad_id,
            out_dir=out_dir,
            mesh=mesh,
            eval_fn=eval_fn,
            stop_token_ids=run_task.stop_token_ids,
            # None: the trainer loads reference_hf_dir or copies the initial policy; a stand-in
            # (dry run) with kl_coef > 0 is its own reference (the configured one does not fit)
            reference=model if stand_in and config.trainer.algorithm.kl_coef > 0 else None,
            data_metrics=run_task.data_metrics,
            followers=estimate_followers(config, model.config, out_dir),
        )
