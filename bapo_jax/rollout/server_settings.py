"""Every vLLM server setting, declared once (`ServerSettings`), and what a group of servers
serves (`ServerSpec`). A run's ``engine.server`` section, the command line of ``python -m
bapo_jax.rollout.serve`` and the servers ``python -m bapo_jax.eval`` launches all read
`ServerSettings`; their flags are shortcuts for its fields (`bapo_jax.overrides.add_flags`),
each field's help text its metadata, each check in ``__post_init__`` (`bapo_jax.checks`).
`serve` builds the command from them."""

from __future__ import annotations

import dataclasses
import os
from typing import Literal

from bapo_jax.checks import check_choice, check_field, check_int, choices, is_finite_number

__all__ = [
    "KEYED_FLAGS",
    "LOOPBACK",
    "ServerSettings",
    "ServerSpec",
    "check_vllm_heads",
    "parse_cores",
    "parse_devices",
    "vllm_lora_rank",
]

VLLM_PYTHON_ENV = "BAPO_VLLM_PYTHON"
SYNC_ROOT_ENV = "BAPO_SYNC_ROOT"  # the worker loads versions only from under this directory


ServerDtype = Literal["auto", "float32", "bfloat16"]
# vLLM 0.32's --max-lora-rank choices (vllm/config/lora.py), 0: LoRA off
VLLMLoRARank = Literal[0, 1, 8, 16, 32, 64, 128, 256, 320, 512]


def vllm_lora_rank(rank: int) -> int:
    """The smallest --max-lora-rank vLLM takes that holds adapters of rank ``rank``."""
    fits = [r for r in choices(VLLMLoRARank) if r >= rank]
    check_field(bool(fits) and rank >= 1, "lora rank", "in [1, 512] for vLLM", rank)
    return min(fits)


# The vLLM flags `build_command` sets with a value, and what sets each (so `args` cannot give
# them another; flags without a value, e.g. --enforce-eager, may repeat harmlessly).
KEYED_FLAGS = {
    "--model": "the spec's model, a run's model.hf_dir",
    "--served-model-name": "served_model_name",
    "--host": "host",
    "--port": "port",
    "--dtype": "dtype",
    "--max-model-len": "the spec's max_model_len, a run's prompt + response caps",
    "--tensor-parallel-size": "tensor_parallel_size",
    "-tp": "tensor_parallel_size",
    "--gpu-memory-utilization": "gpu_memory_utilization",
    "--enable-lora": "max_lora_rank",
    "--max-lora-rank": "max_lora_rank",
    "--max-loras": "max_lora_rank",
}
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _help(text: str, default=None):
    return dataclasses.field(default=default, metadata={"help": text})


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    """How every vLLM server starts (module doc). What a server serves (the checkpoint, the max
    length) is the `ServerSpec` around it."""

    python: str | None = _help(
        f"the vLLM environment's interpreter (default ${VLLM_PYTHON_ENV}, else the project's "
        ".venv-vllm)"
    )
    served_model_name: str | None = _help(
        "the name requests carry (vLLM --served-model-name; default: the checkpoint path, or "
        "for a server given by URL the one model it lists)"
    )
    dtype: ServerDtype = _help(  # noqa: RUF009 (a dataclasses.field)
        "vLLM --dtype (float32 for parity tests, bfloat16 on GPUs)", "auto"
    )
    host: str = _help("bind address; loopback unless the network is trusted", "127.0.0.1")
    port: int = _help("first port: server i listens on port + i", 8000)
    devices: tuple[str, ...] = _help(
        'GPU builds, per server: its GPUs, e.g. "4,5;6,7" for 2 servers x TP 2 (its '
        "CUDA_VISIBLE_DEVICES, indices among the launcher's own; none: every GPU it sees)",
        (),
    )
    tensor_parallel_size: int = _help("GPUs per server (vLLM --tensor-parallel-size)", 1)
    gpu_memory_utilization: float | None = _help(
        "share of each server GPU's memory vLLM takes, weights + KV cache (vLLM "
        "--gpu-memory-utilization; default vLLM's, 0.9)"
    )
    cpu_cores: tuple[str, ...] = _help(
        "CPU builds, per server: the cores it runs on and binds its OpenMP threads to, e.g. "
        '"0;1" (VLLM_CPU_OMP_THREADS_BIND; none: vLLM\'s own binding)',
        (),
    )
    cpu_kvcache_gib: int = _help("CPU builds: KV cache GiB per server (VLLM_CPU_KVCACHE_SPACE)", 1)
    enforce_eager: bool = _help("no graph capture or compilation (fast boot; CPU tests)", False)
    max_lora_rank: int = _help(
        "LoRA runs: serve LoRA adapters up to this rank, loaded at runtime (vLLM --enable-lora "
        "--max-lora-rank, one adapter at a time; 0: off)",
        0,
    )
    with_tokenizer: bool = _help("initialise the tokenizer (default: token ids in and out)", False)
    args: tuple[str, ...] = _help(
        "extra vLLM flags, appended verbatim (not those the fields above set)", ()
    )
    secret_file: str | None = _help(
        "the run's secret file (run_secret): every route of the servers then requires its "
        "bearer token (default: $BAPO_RUN_SECRET_FILE, else a launched group makes a fresh one)"
    )

    def __post_init__(self) -> None:
        check_field(0 < self.port < 65536, "port", "a port in (0, 65536)", self.port)
        check_choice("dtype", self.dtype, ServerDtype)
        check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        check_int("cpu_kvcache_gib", self.cpu_kvcache_gib, 1)
        check_int("max_lora_rank", self.max_lora_rank, 0)
        check_choice("max_lora_rank", self.max_lora_rank, VLLMLoRARank)
        share = self.gpu_memory_utilization
        ok = share is None or (is_finite_number(share) and 0 < share <= 1)
        check_field(ok, "gpu_memory_utilization", "a share in (0, 1] (or None)", share)
        for cores in self.cpu_cores:
            _parsed("cpu_cores", parse_cores, cores)
        taken: dict[int, int] = {}
        for i, text in enumerate(self.devices):
            gpus = _parsed("devices", parse_devices, text)
            check_field(
                len(gpus) == self.tensor_parallel_size,
                "devices",
                f"tensor_parallel_size={self.tensor_parallel_size} GPUs per server",
                text,
            )
            for gpu in gpus:
                rule = f"GPUs no two servers share (GPU {gpu}: servers {taken.get(gpu)} and {i})"
                check_field(gpu not in taken, "devices", rule, self.devices)
                taken[gpu] = i
        for arg in self.args:
            flag = arg.split("=", 1)[0]
            check_field(
                flag not in KEYED_FLAGS,
                "args",
                f"free of {flag} (set by {KEYED_FLAGS.get(flag)})",
                self.args,
            )


def check_vllm_heads(tensor_parallel_size: int, num_attention_heads: int, kv_heads: int) -> None:
    """Refuses a tensor-parallel size vLLM refuses for the model: one that does not divide its
    query heads, or neither divides nor is a multiple of its KV heads (vLLM replicates KV heads
    over a larger group only in whole copies)."""
    g = tensor_parallel_size
    check_field(
        num_attention_heads % g == 0 and (kv_heads % g == 0 or g % kv_heads == 0),
        "tensor_parallel_size",
        f"a size dividing the model's {num_attention_heads} query heads and dividing (or a "
        f"multiple of) its {kv_heads} KV heads",
        g,
    )


def _parsed(name: str, parse, text: str):
    try:
        return parse(text)
    except ValueError as error:
        raise ValueError(f"{name}: {error}") from None


@dataclasses.dataclass(frozen=True)
class ServerSpec:
    """What servers launched together serve: ``model``, the HF checkpoint directory (version
    0 of the policy), with a context of ``max_model_len`` tokens (a run's prompt + response
    caps: ``run.servers.max_model_len``), loading synced versions only from under
    ``sync_root`` (a run's sync directory; None: none), started as ``server`` says."""

    model: str
    max_model_len: int
    server: ServerSettings = dataclasses.field(default_factory=ServerSettings)
    sync_root: str | None = None

    def __post_init__(self) -> None:
        check_field(os.path.isdir(self.model), "model", "a checkpoint directory", self.model)
        check_int("max_model_len", self.max_model_len, 1)


def parse_cores(text: str) -> set[int]:
    """A CPU list in vLLM's (and taskset's) form, "1", "0,2" or "0-3,6" -> {core ids}."""
    cores: set[int] = set()
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise ValueError(f"cpu cores {text!r}: want a list like '1', '0,2' or '0-3'")
        cores.update(range(int(first), int(last or first) + 1))
    return cores


def parse_devices(text: str) -> list[int]:
    """A server's GPUs as CUDA_VISIBLE_DEVICES lists them, "4" or "4,5" -> [4, 5] (distinct)."""
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() for p in parts) or len(set(parts)) != len(parts):
        raise ValueError(f"GPU list {text!r}: want distinct GPU indices like '4' or '4,5'")
    return [int(p) for p in parts]
