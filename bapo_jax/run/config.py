"""A whole RL run as one frozen config tree: the trainer plus what it runs on.

    RunConfig
      trainer:  TrainerConfig   (rollout, algorithm, offpolicy, optimizer, checkpoint, logging)
      model:    ModelSection    initial policy: an HF directory, or a preset (random init)
      data:     DataSection     training prompts (a shipped set or a JSONL file) and style
      engine:   EngineSection   embedded sampler or vLLM servers (by URL or launched), sync
      eval:     EvalSection     AIME avg@k during training
      rewards:  RewardSection   the reward (math_verify, exact_match, a plug-in), its weights
                and worker pool (`bapo_jax.rewards.config`, docs/rewards.md)
      mesh:     the trainer mesh: a `sharding.mesh` preset name ("7b", "32b", "cpu1", ...) or an
                explicit shape "data=1,fsdp=4,tensor=1" (`mesh.parse_mesh`)
      trainer_devices: the local devices the trainer process uses: None = all it sees, N = the
                first N, (0, 1, 2, 3) = those (on GPU, JAX is restricted to them before it
                starts, so it never touches the GPUs the vLLM servers run on)
      accelerator: the device the run is planned for (`mesh.ACCELERATORS`: h100, h200, ...)
      skip_plan: do not refuse a run whose memory plan does not fit (`run.preflight`)
      trainer_cpu_cores: CPU cores the trainer process runs on (() = all it was given); a CPU
                run beside vLLM servers pinned with engine.server.cpu_cores keeps them apart

`validate_run` checks what can be checked before any compute (files exist, the mesh divides
the model's heads, the batch splits over the mesh, servers answer) and names the key at fault.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from typing import Literal

from bapo_jax.checks import check_choice, check_dir_mode, check_int
from bapo_jax.data.datasets import SHIPPED_SETS
from bapo_jax.data.files import (
    DATA_SUFFIXES,
    DataFileSpec,
    DataSpecError,
    FileColumns,
    spec_with_columns,
)
from bapo_jax.data.prompts import PROMPT_STYLES
from bapo_jax.models.config import LORA_TARGETS, AttentionImpl, LoRAConfig, Qwen2Config, RematPolicy
from bapo_jax.models.lora import read_adapter_config
from bapo_jax.models.presets import PRESETS
from bapo_jax.overrides import config_to_dict
from bapo_jax.rewards.config import RewardSection
from bapo_jax.rewards.plugins import PluginError, load_plugin
from bapo_jax.rollout import serve
from bapo_jax.rollout.server_settings import check_vllm_heads
from bapo_jax.sharding import mesh as mesh_lib
from bapo_jax.train.config import TrainerConfig

Dtype = Literal["float32", "bfloat16"]


class RunConfigError(ValueError):
    """A run setting that cannot work; the message names the key."""


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise RunConfigError(f"{key}: {message}")


@contextlib.contextmanager
def config_errors(prefix: str = "", errors: type | tuple[type, ...] = ValueError):
    """Re-raises `errors` from a check inside as a RunConfigError, its message after `prefix`
    (the key, when the check's own message does not name it)."""
    try:
        yield
    except errors as error:
        raise RunConfigError(f"{prefix}{error}") from None


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """hf_dir: HF checkpoint directory (config.json + safetensors) of the initial policy;
    preset: `Qwen2Config` preset, the architecture when hf_dir is None (random init: tests,
    dry runs); tokenizer_dir: None = hf_dir, or the shipped Qwen2.5 tokenizer;
    param_dtype / compute_dtype; remat: recompute each layer in the backward ("full", "none",
    or a `ModelOptions.remat` policy that saves matmul outputs; true/false = full/none);
    scan_unroll: layers per iteration of the scan over the decoder layers (1: compile time flat
    in depth, what 7B/32B need; the number of layers: every layer inlined; docs/model.md);
    attention: the attention core, "plain" (dense [T, T] scores), "blockwise" (online softmax,
    O(T) memory; what the 7B/32B layouts need at 9k tokens) or "cudnn" (GPU only).

    LoRA (`models.lora`, docs/model.md): lora_rank r > 0 trains low-rank adapters on
    lora_targets (PEFT's names) scaled by lora_alpha / r, the base weights frozen (0: full
    fine-tuning); lora_adapter: a PEFT adapter directory to start from (its rank, alpha and
    targets then; lora_rank 0 or the same)."""

    hf_dir: str | None = None
    preset: str = "tiny-hd64"
    tokenizer_dir: str | None = None
    param_dtype: Dtype = "float32"
    compute_dtype: Dtype = "bfloat16"
    remat: bool | RematPolicy = "full"
    scan_unroll: int = 1
    attention: AttentionImpl = "plain"
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = LORA_TARGETS
    lora_adapter: str | None = None

    def __post_init__(self):
        _require(self.preset in PRESETS, "preset", f"unknown preset {self.preset!r}")
        if isinstance(self.remat, bool):  # true/false: full/none
            object.__setattr__(self, "remat", "full" if self.remat else "none")
        with config_errors():
            check_int("lora_rank", self.lora_rank, 0)
            check_choice("remat", self.remat, RematPolicy)
            check_int("scan_unroll", self.scan_unroll, 1)
            check_choice("attention", self.attention, AttentionImpl)
            check_choice("param_dtype", self.param_dtype, Dtype)
            check_choice("compute_dtype", self.compute_dtype, Dtype)
        if self.lora_rank:
            with config_errors("lora: "):
                LoRAConfig(self.lora_rank, self.lora_alpha, tuple(self.lora_targets))

    def architecture(self) -> Qwen2Config:
        if self.hf_dir is None:
            return Qwen2Config.preset(self.preset)
        return Qwen2Config.from_hf(self.hf_dir)

    def lora(self) -> LoRAConfig | None:
        """The adapters' config: lora_adapter's file, else the lora_* keys (None: no LoRA)."""
        if self.lora_adapter is not None:
            found = read_adapter_config(self.lora_adapter)
            _require(
                self.lora_rank in (0, found.rank),
                "model.lora_rank",
                f"{self.lora_rank}, but the adapter {self.lora_adapter!r} has rank {found.rank}",
            )
            return found
        if not self.lora_rank:
            return None
        return LoRAConfig(self.lora_rank, self.lora_alpha, tuple(self.lora_targets))


def _check_columns(section) -> None:
    """The column fields of a Data/EvalSection make a valid `DataFileSpec` (key named)."""
    with config_errors(errors=DataSpecError):
        spec_with_columns("columns.jsonl", section)


@dataclasses.dataclass(frozen=True)
class DataSection(FileColumns):
    """train: a shipped set name (e.g. "math_l3to5") or a .jsonl/.json/.parquet file;
    split: the shipped set's split; prompt_style: `data.prompts` style; seed: shuffle order.

    How the train file is read: the `data.files.FileColumns` keys (docs/data.md tables them).
    A shipped set keeps its own layout: only template (its field is {problem}; on the command
    line in JSON quotes for the \\n: '"{question}\\nAnswer in \\\\boxed{{}}."') and on_bad_row
    apply to it. Rows on_bad_row="skip" leaves out are counted in the metric data/skipped_rows."""

    train: str = "math_l3to5"
    split: str = "train"
    prompt_style: str = "qwen_math"
    seed: int = 0

    def __post_init__(self):
        _require(
            self.prompt_style in PROMPT_STYLES,
            "prompt_style",
            f"one of {sorted(PROMPT_STYLES)}, got {self.prompt_style!r}",
        )
        _require(
            self.train in SHIPPED_SETS or self.train.lower().endswith(DATA_SUFFIXES),
            "train",
            f"{self.train!r} is neither a shipped set ({sorted(SHIPPED_SETS)}) nor a "
            f"{'/'.join(DATA_SUFFIXES)} file",
        )
        _check_columns(self)

    def file_spec(self) -> DataFileSpec:
        """The train file (a shipped set's `split` file) and how to read it."""
        if self.train in SHIPPED_SETS:
            path = SHIPPED_SETS[self.train].path(self.split)
            return spec_with_columns(path, self, shipped=True)
        return spec_with_columns(self.train, self)


@dataclasses.dataclass(frozen=True)
class EngineSection:
    """kind: "embedded" (in-process JAX sampler) or "vllm"; length_bucket: the embedded
    engine's prompt-length bucket; cpu_kernels: the embedded engine decodes with the CPU
    kernels where they can serve the model (False: XLA's ops; docs/rollout.md compares them).

    vLLM servers. vllm_urls: running servers; launch_servers: servers this run starts itself
    (`rollout.serve`, from model.hf_dir); server: how every launched server starts
    (`serve.ServerSettings`, the one declaration the `serve` command line shares: interpreter,
    dtype, port, per-server GPUs or CPU cores, tensor-parallel size, GPU memory share, extra
    flags), and its served_model_name is the name requests carry to any server (None: model.
    hf_dir for launched servers, the one model a given server lists). Every launched server
    gets --max-model-len = the prompt cap + the response (or eval) cap
    (`run.servers.max_model_len`); every server, given or launched, is checked to hold it.

    Requests. requests_per_server: concurrent generation requests per server (one per prompt,
    its G samples in it; None: enough to fill a server, `run.estimate.requests_per_server`);
    request_timeout_s: how long one generation request may take (all G samples of one prompt)
    before it is retried on another server; deadline_s: how long one rollout batch may take
    over all its requests and retries (None: `run.estimate.batch_deadline_s`);
    unresponsive_after_s: a server that answers no health probe for this long is out of
    rotation, its requests resubmitted to the others, until it answers again with the current
    version (`rollout.vllm_liveness`, docs/rollout.md; None: no probes).

    Colocation. colocate: the vLLM servers run on the trainer's own GPUs (the embedded engine
    ignores it), holding engine.server.gpu_memory_utilization u of each (for servers given by
    URL: the u they were started with), the trainer the memory plan's share less u; generation
    and training take turns (docs/pod.md, "Colocated").

    Weight sync. sync_dir: shared directory of the Orbax sync (default <out>/weight_sync);
    sync_dir_mode: its permissions when the run creates it (octal digits, "700": owner-only);
    sync_dtype; sync_keep: versions kept; sync_attempts: writes of a version the servers refuse
    before loading. Every version's manifest is signed with the run secret's manifest key
    (`rollout.run_secret`; launched servers get a fresh secret per run, given ones
    server.secret_file's)."""

    kind: Literal["embedded", "vllm"] = "embedded"
    length_bucket: int = 32
    cpu_kernels: bool = True
    vllm_urls: tuple[str, ...] = ()
    launch_servers: int = 0
    server: serve.ServerSettings = dataclasses.field(default_factory=serve.ServerSettings)
    requests_per_server: int | None = None
    request_timeout_s: float = 600.0
    deadline_s: float | None = None
    unresponsive_after_s: float | None = 20.0
    colocate: bool = False
    sync_dir: str | None = None
    sync_dir_mode: str = "700"
    sync_dtype: Dtype = "bfloat16"
    sync_keep: int = 3
    sync_attempts: int = 3

    def __post_init__(self):
        _require(self.kind in ("embedded", "vllm"), "kind", f"embedded or vllm, got {self.kind!r}")
        _require(self.length_bucket >= 1, "length_bucket", f">= 1, got {self.length_bucket}")
        _require(
            isinstance(self.cpu_kernels, bool), "cpu_kernels", f"a bool, got {self.cpu_kernels!r}"
        )
        _require(self.launch_servers >= 0, "launch_servers", ">= 0")
        for name in ("cpu_cores", "devices"):
            given = getattr(self.server, name)
            _require(
                not given or len(given) == self.launch_servers,
                f"server.{name}",
                f"one entry per launched server ({self.launch_servers}), got {given}",
            )
        _require(
            self.requests_per_server is None or self.requests_per_server >= 1,
            "requests_per_server",
            f">= 1 (or None: derived), got {self.requests_per_server}",
        )
        _require(
            self.request_timeout_s > 0,
            "request_timeout_s",
            f"> 0 seconds, got {self.request_timeout_s}",
        )
        _require(
            self.deadline_s is None or self.deadline_s > 0,
            "deadline_s",
            f"> 0 seconds (or None: derived), got {self.deadline_s}",
        )
        with config_errors():
            check_dir_mode("sync_dir_mode", self.sync_dir_mode)
        _require(
            self.unresponsive_after_s is None or self.unresponsive_after_s > 0,
            "unresponsive_after_s",
            f"> 0 seconds (or None: no probes), got {self.unresponsive_after_s}",
        )
        _require(self.sync_keep >= 1, "sync_keep", ">= 1")
        _require(self.sync_attempts >= 1, "sync_attempts", ">= 1")
        _require(isinstance(self.colocate, bool), "colocate", f"a bool, got {self.colocate!r}")
        if self.colocated:
            _require(
                not self.launch_servers or bool(self.server.devices),
                "colocate",
                f"places launched vLLM servers on the trainer's GPUs: set "
                f"engine.server.devices (got launch_servers={self.launch_servers}, "
                f"server.devices={self.server.devices!r})",
            )
            _require(
                self.server.gpu_memory_utilization is not None,
                "server.gpu_memory_utilization",
                "colocated servers need their share of each GPU's memory (e.g. 0.4; the "
                "trainer takes the memory plan's share less it), got None",
            )

    @property
    def colocated(self) -> bool:
        """vLLM servers on the trainer's GPUs (`colocate` with kind vllm; the embedded engine
        runs in the trainer's process whatever the flag says)."""
        return self.colocate and self.kind == "vllm"


@dataclasses.dataclass(frozen=True)
class EvalSection(FileColumns):
    """sets: evaluation sets, each a shipped set with a test split (its metrics are named
    "<set>/avg@k") or a .jsonl/.json/.parquet file ("<file stem>/avg@k"); samples: k of avg@k
    (the paper's 16); max_tokens and temperature of the evaluation samples; limit: first N
    problems per set (None = all).

    How the files among `sets` are read: problem_key, answer_key, id_key, messages_key,
    metadata_keys, template, on_bad_row, as in `DataSection` (this section's own values, not
    data's; shipped sets keep their layout, and get only template and on_bad_row)."""

    sets: tuple[str, ...] = ("aime2024", "aime2025")
    samples: int = 16
    max_tokens: int = 8192
    temperature: float = 0.6
    limit: int | None = None
    batch_size: int = 8

    def __post_init__(self):
        names = []
        for entry in self.sets:
            if entry in SHIPPED_SETS:
                splits = sorted(SHIPPED_SETS[entry].splits)
                _require("test" in splits, "sets", f"{entry!r} has no test split ({splits})")
                names.append(entry)
                continue
            _require(
                entry.lower().endswith(DATA_SUFFIXES),
                "sets",
                f"{entry!r} is neither a shipped set ({sorted(SHIPPED_SETS)}) nor a "
                f"{'/'.join(DATA_SUFFIXES)} file",
            )
            _require(os.path.isfile(entry), "sets", f"file not found: {entry!r}")
            names.append(os.path.splitext(os.path.basename(entry))[0])
        _require(len(set(names)) == len(names), "sets", f"two sets share a metric name: {names}")
        _require(self.samples >= 1, "samples", ">= 1")
        _check_columns(self)

    def set_specs(self) -> dict[str, DataFileSpec]:
        """Metric name (shipped set, or file stem) -> its test file and how to read it."""
        specs = {}
        for entry in self.sets:
            if entry in SHIPPED_SETS:
                path = SHIPPED_SETS[entry].path("test")
                specs[entry] = spec_with_columns(path, self, shipped=True)
            else:
                spec = spec_with_columns(entry, self)
                specs[os.path.splitext(os.path.basename(entry))[0]] = spec
        return specs


@dataclasses.dataclass(frozen=True)
class RunConfig:
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    data: DataSection = dataclasses.field(default_factory=DataSection)
    engine: EngineSection = dataclasses.field(default_factory=EngineSection)
    eval: EvalSection = dataclasses.field(default_factory=EvalSection)
    mesh: str = "cpu1"
    trainer_devices: int | tuple[int, ...] | None = None
    accelerator: str = "h100"
    skip_plan: bool = False
    rewards: RewardSection = dataclasses.field(default_factory=RewardSection)
    trainer_cpu_cores: tuple[int, ...] = ()

    def __post_init__(self):
        with config_errors("mesh: "):
            mesh_config = mesh_lib.parse_mesh(self.mesh)
        _require(
            "memory_gb" not in self.mesh,
            "mesh",
            f"{self.mesh!r}: a run takes its device memory from accelerator=, not memory_gb",
        )
        _require(
            self.accelerator in mesh_lib.ACCELERATORS,
            "accelerator",
            f"one of {sorted(mesh_lib.ACCELERATORS)}, got {self.accelerator!r}",
        )
        self._check_trainer_devices(mesh_config.num_devices)
        if self.trainer_cpu_cores and hasattr(os, "sched_getaffinity"):
            usable = os.sched_getaffinity(0)
            _require(
                set(self.trainer_cpu_cores) <= usable,
                "trainer_cpu_cores",
                f"{self.trainer_cpu_cores} are not all among this process's cores {sorted(usable)}",
            )

    def _check_trainer_devices(self, mesh_devices: int) -> None:
        spec = self.trainer_devices
        if spec is None:
            return
        if isinstance(spec, int) and not isinstance(spec, bool):
            _require(spec >= 1, "trainer_devices", f"a device count >= 1, got {spec}")
            count = spec
        else:
            ids = tuple(spec)
            _require(
                bool(ids) and all(isinstance(i, int) and i >= 0 for i in ids),
                "trainer_devices",
                f"a count or a list of device ids >= 0, got {spec!r}",
            )
            _require(len(set(ids)) == len(ids), "trainer_devices", f"repeats a device: {ids}")
            count = len(ids)
        _require(
            mesh_devices % count == 0,
            "trainer_devices",
            f"{count} devices per trainer process cannot make up the mesh {self.mesh!r} of "
            f"{mesh_devices} devices (each process gives the same number)",
        )

    def mesh_config(self) -> mesh_lib.MeshConfig:
        """The trainer mesh's shape, with the memory of one `accelerator` device."""
        return dataclasses.replace(
            mesh_lib.parse_mesh(self.mesh),
            device_memory_bytes=mesh_lib.accelerator_memory_bytes(self.accelerator),
        )


def validate_run(
    config: RunConfig,
    *,
    check_engine: bool = True,
    check_servers: bool = True,
    architecture: Qwen2Config | None = None,
    model_dir_pending: bool = False,
) -> Qwen2Config:
    """Every check that needs no compute; returns the model architecture. `check_engine` False
    skips the engine section (dry runs use the embedded engine), `check_servers` False skips
    contacting servers; `architecture` stands in for the configured model's;
    `model_dir_pending`: model.hf_dir is not there yet (a job that makes it first)."""
    m = config.model
    if m.hf_dir is not None:
        _require(os.path.isdir(m.hf_dir), "model.hf_dir", f"{m.hf_dir!r} is not a directory")
        _require(
            os.path.isfile(os.path.join(m.hf_dir, "config.json")),
            "model.hf_dir",
            f"{m.hf_dir!r} has no config.json",
        )
    if m.tokenizer_dir is not None:
        _require(
            os.path.isdir(m.tokenizer_dir),
            "model.tokenizer_dir",
            f"{m.tokenizer_dir!r} is not a directory",
        )
    arch = architecture or m.architecture()
    r, context = config.trainer.rollout, arch.max_position_embeddings
    _require(
        r.max_prompt_tokens + r.max_response_tokens <= context,
        "trainer.rollout.max_response_tokens",
        f"a row of {r.max_prompt_tokens} prompt + {r.max_response_tokens} response tokens = "
        f"{r.max_prompt_tokens + r.max_response_tokens} is longer than the model's context, "
        f"max_position_embeddings {context}",
    )
    evaluates = config.trainer.eval_every > 0 or config.trainer.eval_at_start
    _require(
        not evaluates or r.max_prompt_tokens + config.eval.max_tokens <= context,
        "eval.max_tokens",
        f"{r.max_prompt_tokens} prompt + {config.eval.max_tokens} eval tokens = "
        f"{r.max_prompt_tokens + config.eval.max_tokens} is longer than the model's context, "
        f"max_position_embeddings {context}",
    )
    mesh_config = config.mesh_config()
    with config_errors("mesh: "):
        mesh_config.check_heads(arch.num_attention_heads, arch.num_key_value_heads)
    if config.engine.kind == "vllm" and config.engine.launch_servers:
        with config_errors("engine.server."):
            check_vllm_heads(
                config.engine.server.tensor_parallel_size,
                arch.num_attention_heads,
                arch.num_key_value_heads,
            )
    per_micro = config.trainer.rows_per_micro_batch
    _require(
        per_micro % mesh_config.batch_parallelism == 0,
        "trainer.algorithm.micro_batches",
        f"{per_micro} rows per micro-batch do not split over the {config.mesh!r} mesh's "
        f"{mesh_config.batch_parallelism} batch devices",
    )
    d = config.data
    if d.train in SHIPPED_SETS:
        splits = SHIPPED_SETS[d.train].splits
        _require(d.split in splits, "data.split", f"{d.train!r} has splits {sorted(splits)}")
    else:
        _require(
            os.path.isfile(d.train),
            "data.train",
            f"{d.train!r} is neither a shipped set ({sorted(SHIPPED_SETS)}) nor a file",
        )
    if config.rewards.plugin is not None:  # imported here too: a typo fails before any compute
        with config_errors(errors=PluginError):
            load_plugin(config.rewards.plugin)
    if m.lora_adapter is not None:
        _require(
            os.path.isfile(os.path.join(m.lora_adapter, "adapter_config.json")),
            "model.lora_adapter",
            f"{m.lora_adapter!r} has no adapter_config.json (a PEFT LoRA adapter directory)",
        )
    e = config.engine
    _require(
        not (
            e.kind == "vllm"
            and (m.lora_rank or m.lora_adapter)
            and config.trainer.offpolicy.inflight
        ),
        "trainer.offpolicy.inflight",
        "a LoRA run's requests name their version's adapter when they start, so an update "
        "cannot switch a running one: set inflight=false (or model.lora_rank=0)",
    )
    _require(
        not (check_engine and config.trainer.offpolicy.inflight and e.kind != "vllm"),
        "trainer.offpolicy.inflight",
        f"in-flight weight updates need engine.kind=vllm, got engine.kind={e.kind!r} (the "
        "embedded engine generates in the trainer's process)",
    )
    if e.colocated:  # the servers wait while the trainer updates, on the same GPUs
        o = config.trainer.offpolicy
        _require(
            o.staleness == 0 and not o.inflight,
            "engine.colocate",
            f"colocated servers and trainer take turns on the same GPUs: needs "
            f"trainer.offpolicy.staleness=0 and inflight=false, got staleness={o.staleness}, "
            f"inflight={o.inflight}",
        )
        from bapo_jax.sharding.memory_plan import FIT_FRACTION

        share = e.server.gpu_memory_utilization or 0.0
        _require(
            share < FIT_FRACTION,
            "engine.server.gpu_memory_utilization",
            f"{share} leaves the colocated trainer nothing of the memory plan's {FIT_FRACTION} "
            "of each GPU; give the servers less (the trainer's step must fit the rest)",
        )
    if check_engine and e.kind == "vllm":
        from bapo_jax.run import servers  # it imports this module

        _require(
            bool(e.vllm_urls) or e.launch_servers > 0,
            "engine.vllm_urls",
            "give server URLs or engine.launch_servers > 0",
        )
        _require(
            e.launch_servers == 0 or m.hf_dir is not None or model_dir_pending,
            "engine.launch_servers",
            "launching vLLM needs model.hf_dir",
        )
        if e.launch_servers:
            why = serve.missing_vllm_python(serve.vllm_python(e.server.python))
            _require(why is None, "engine.server.python", str(why))
            servers.check_devices(config)  # no GPU both the trainer's and a server's
        if check_servers:  # each serves the run's model, holding its prompt + response caps
            for url in e.vllm_urls:
                servers.check_server(config, url)
    return arch


def dump(config: RunConfig, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config_to_dict(config), f, indent=2, sort_keys=True)
