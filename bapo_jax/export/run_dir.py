"""What a run directory says about its policy, and its checkpointed params, read-only.

A run directory (`python -m experiments.NAME --out-dir DIR`) holds::

    config.json      the RunConfig (`run.config.dump`): its model section names an hf_dir or a
                     preset, and the tokenizer (model.tokenizer_dir, else hf_dir, else the
                     shipped Qwen2.5 files); trainer.checkpoint.directory the checkpoints
    checkpoints/     `train.checkpoint.RunCheckpointer` steps (default place)
    model/           the policy's HF config.json and tokenizer files, everything of an HF
                     checkpoint but the weights (`export.record_policy`, written by
                     `run.build.build_trainer` for every run). When present it wins over
                     config.json's model section: it holds what the trainer really trained (a
                     dry run's stand-in, the CPU arithmetic job's model and tokenizer), and it
                     stays right when model.hf_dir moves. Runs written before it existed are
                     read from config.json alone.

Relative paths in config.json are relative to the directory the run was started from: they are
looked up from the current directory, then from the run directory and each of its parents.

Nothing here writes into the run directory or its checkpoints (unlike opening a
`RunCheckpointer`, which sweeps unfinished saves): a live run can be read. The params are read
alone (`partial_restore`: no optimizer state, no optimizer built), as host numpy arrays.
Errors name the flag the eval and export command lines share (--run, --step).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bapo_jax.models.config import LORA_TARGETS, LoRAConfig, ModelOptions, Qwen2Config
from bapo_jax.models.lora import LoRAParam
from bapo_jax.models.qwen2 import Qwen2ForCausalLM, abstract_model
from bapo_jax.models.tokenizer import SHIPPED_TOKENIZER_DIR, missing_tokenizer_files
from bapo_jax.train.checkpoint import spec_differences

__all__ = [
    "MODEL_RECORD",
    "RUN_CONFIG",
    "RunDirError",
    "RunModel",
    "build_model",
    "is_run_dir",
    "read_params",
    "read_run",
]

RUN_CONFIG = "config.json"
MODEL_RECORD = "model"
_STATE_ITEM = "state"  # `train.checkpoint`: the TrainState item of a step directory


class RunDirError(ValueError):
    """A run directory, step or checkpoint that cannot be read; the message names the flag."""


@dataclasses.dataclass(frozen=True)
class RunModel:
    """A run's policy, as its directory describes it (no weights read).

    run_dir: absolute path. architecture / architecture_from: the policy's `Qwen2Config` and the
    file or preset it comes from. tokenizer_dir: a directory of HF tokenizer files (None: the
    shipped Qwen2.5 tokenizer). checkpoint_dir: the run's checkpoints; steps: its complete
    steps, ascending. param_dtype: the run's model.param_dtype ("float32" without a config).
    lora: the LoRA adapters its params hold (`models.config.LoRAConfig`, from the run config's
    model.lora_* keys or its lora_adapter's file; None: full fine-tuning).
    """

    run_dir: str
    architecture: Qwen2Config
    architecture_from: str
    tokenizer_dir: str | None
    checkpoint_dir: str
    steps: tuple[int, ...]
    param_dtype: str = "float32"
    lora: LoRAConfig | None = None

    def step(self, step: int | None = None) -> int:
        """`step`, checked to be a complete checkpoint; None = the latest."""
        if not self.steps:
            raise RunDirError(
                f"--run {self.run_dir!r}: no complete checkpoint in {self.checkpoint_dir!r}"
            )
        if step is None:
            return self.steps[-1]
        if step not in self.steps:
            raise RunDirError(
                f"--step {step}: no complete checkpoint for that step in {self.checkpoint_dir!r}; "
                f"complete steps: {list(self.steps)}"
            )
        return step


def is_run_dir(path: str | os.PathLike) -> bool:
    """A directory whose config.json is a RunConfig (not an HF model config)."""
    file = os.path.join(os.fspath(path), RUN_CONFIG)
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "trainer" in data and "model_type" not in data


def _resolve(path: str, run_dir: str) -> str | None:
    """An existing path: as given (absolute, or from the current directory), else under the run
    directory or one of its parents; None when none exists."""
    if os.path.isabs(path):
        return path if os.path.exists(path) else None
    if os.path.exists(path):
        return os.path.abspath(path)
    here = run_dir
    while True:
        candidate = os.path.join(here, path)
        if os.path.exists(candidate):
            return candidate
        parent = os.path.dirname(here)
        if parent == here:
            return None
        here = parent


def _section_path(value: Any, key: str, run_dir: str) -> str | None:
    if value is None:
        return None
    found = _resolve(str(value), run_dir)
    if found is None:
        raise RunDirError(
            f"--run {run_dir!r}: config.json's {key} {value!r} does not exist (looked from the "
            "current directory and from the run directory up)"
        )
    return found


def read_run(run_dir: str | os.PathLike) -> RunModel:
    """The policy `run_dir` describes (module doc); RunDirError names what is missing."""
    run_dir = os.path.abspath(os.fspath(run_dir))
    if not os.path.isdir(run_dir):
        raise RunDirError(f"--run {run_dir!r} is not a directory")
    record = os.path.join(run_dir, MODEL_RECORD)
    has_record = os.path.isfile(os.path.join(record, "config.json"))
    config_file = os.path.join(run_dir, RUN_CONFIG)
    raw: dict[str, Any] = {}
    if os.path.isfile(config_file):
        with open(config_file, encoding="utf-8") as f:
            raw = json.load(f)
        if not isinstance(raw, dict) or "model_type" in raw:
            raise RunDirError(
                f"--run {run_dir!r}: config.json is not a RunConfig (an HF model directory? "
                "evaluate it with --model-dir)"
            )
    elif not has_record:
        raise RunDirError(
            f"--run {run_dir!r}: no config.json (the run's RunConfig) and no {MODEL_RECORD}/ "
            "record; is it a run directory?"
        )
    model = raw.get("model") or {}
    record_tokenizer = has_record and not missing_tokenizer_files(record)
    hf_dir = tokenizer_dir = None
    if not (has_record and record_tokenizer):  # the record has all: config.json's paths unused
        hf_dir = _section_path(model.get("hf_dir"), "model.hf_dir", run_dir)
        tokenizer_dir = _section_path(model.get("tokenizer_dir"), "model.tokenizer_dir", run_dir)

    if has_record:
        arch_from = os.path.join(record, "config.json")
        architecture = Qwen2Config.from_hf(arch_from)
    elif hf_dir is not None:
        arch_from = os.path.join(hf_dir, "config.json")
        if not os.path.isfile(arch_from):
            raise RunDirError(f"--run {run_dir!r}: model.hf_dir {hf_dir!r} has no config.json")
        architecture = Qwen2Config.from_hf(arch_from)
    else:
        preset = model.get("preset", "tiny-hd64")
        arch_from = f"preset {preset!r}"
        try:
            architecture = Qwen2Config.preset(preset)
        except ValueError as error:
            raise RunDirError(f"--run {run_dir!r}: model.preset: {error}") from None

    if record_tokenizer:
        tokenizer = record
    else:
        tokenizer = tokenizer_dir or hf_dir
        key = "model.tokenizer_dir" if tokenizer_dir else "model.hf_dir"
        if tokenizer is not None and (missing := missing_tokenizer_files(tokenizer)):
            raise RunDirError(
                f"--run {run_dir!r}: {key} {tokenizer!r} has no tokenizer (missing "
                f"{', '.join(missing)}) and the run has no {MODEL_RECORD}/ record with one"
            )
    checkpoint = (raw.get("trainer") or {}).get("checkpoint") or {}
    checkpoint_dir = os.path.join(run_dir, "checkpoints")
    if checkpoint.get("directory"):
        checkpoint_dir = _section_path(
            checkpoint["directory"], "trainer.checkpoint.directory", run_dir
        )
    return RunModel(
        run_dir=run_dir,
        architecture=architecture,
        architecture_from=arch_from,
        tokenizer_dir=tokenizer,
        checkpoint_dir=checkpoint_dir,
        steps=tuple(_complete_steps(checkpoint_dir)),
        param_dtype=str(model.get("param_dtype", "float32")),
        lora=_run_lora(model, run_dir),
    )


def _run_lora(model: dict[str, Any], run_dir: str) -> LoRAConfig | None:
    """The adapters a run's model section trains (`run.config.ModelSection.lora`'s rule)."""
    adapter = model.get("lora_adapter")
    if adapter is not None:
        from bapo_jax.models.lora import read_adapter_config

        return read_adapter_config(_section_path(adapter, "model.lora_adapter", run_dir))
    rank = int(model.get("lora_rank") or 0)
    if not rank:
        return None
    targets = tuple(model.get("lora_targets") or LORA_TARGETS)
    return LoRAConfig(rank, float(model.get("lora_alpha", 16.0)), targets)


def _complete_steps(directory: str) -> list[int]:
    """Finalised steps (in-flight saves live in temp dirs that are not listed)."""
    if not os.path.isdir(directory):
        return []
    import orbax.checkpoint as ocp

    return sorted(ocp.path.step.checkpoint_steps(directory))


def _strip_values(tree: Any) -> Any:
    """The checkpoint's nnx.State layout ({"embed_tokens": {"value": x}}) as a pure dict."""
    if isinstance(tree, dict):
        if set(tree) == {"value"} and not isinstance(tree["value"], dict):
            return tree["value"]
        return {k: _strip_values(v) for k, v in tree.items()}
    return tree


def _shapes(tree: Any, prefix: str = "") -> dict[str, tuple[int, ...]]:
    """{"model/embed_tokens/embedding": shape, ...} of a nested dict of arrays."""
    out = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_shapes(value, path + "/"))
        else:
            out[path] = tuple(value.shape)
    return out


def read_params(run: RunModel, step: int | None = None) -> tuple[dict[str, Any], int]:
    """(params as a pure dict of host numpy arrays, the step) of the run's checkpoint at `step`
    (None: the latest). The params must be exactly those of `run.architecture` (names and
    shapes), else RunDirError says what differs."""
    import orbax.checkpoint as ocp

    step = run.step(step)
    path = os.path.join(os.path.abspath(run.checkpoint_dir), str(step), _STATE_ITEM)
    checkpointer = ocp.PyTreeCheckpointer()
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)  # "Metadata file does not exist": the item has none, as saved
    try:
        tree = checkpointer.metadata(path).item_metadata.tree
        if "params" not in tree:
            raise RunDirError(f"--step {step}: {path!r} holds no params (keys {sorted(tree)})")
        target = {
            "params": jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), tree["params"])
        }
        restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), target)
        restored = checkpointer.restore(
            path,
            args=ocp.args.PyTreeRestore(
                item=target, restore_args=restore_args, partial_restore=True
            ),
        )
    finally:
        absl.setLevel(level)
        checkpointer.close()
    params = _strip_values(restored["params"])
    abstract = nnx.to_pure_dict(
        nnx.state(
            abstract_model(run.architecture, ModelOptions(lora=run.lora)),
            nnx.Any(nnx.Param, LoRAParam),
        )
    )
    missing, unexpected, wrong = spec_differences(_shapes(params), _shapes(abstract))
    if missing or unexpected or wrong:
        raise RunDirError(
            f"--run {run.run_dir!r} step {step}: the checkpoint's params do not fit the "
            f"architecture from {run.architecture_from}: missing {missing}, unexpected "
            f"{unexpected}, shapes (checkpoint vs architecture) {wrong}"
        )
    return params, step


def build_model(
    architecture: Qwen2Config,
    params: dict[str, Any],
    *,
    dtype: Any = None,
    options: ModelOptions | None = None,
    on_device: bool = True,
) -> Qwen2ForCausalLM:
    """A model of `architecture` holding `params` (a pure dict, e.g. `read_params`'), cast to
    `dtype` (None: as they are). `on_device`: jax arrays on the default device; False keeps
    host numpy arrays (enough for `save_pretrained`, no second copy of the weights)."""

    def place(x: np.ndarray):
        x = x if dtype is None else x.astype(jnp.dtype(dtype))
        return jnp.asarray(x) if on_device else x

    values = jax.tree.map(place, params)
    first = jax.tree.leaves(values)[0]
    options = dataclasses.replace(options or ModelOptions(), param_dtype=first.dtype)
    graphdef, state = nnx.split(abstract_model(architecture, options))
    nnx.replace_by_pure_dict(state, values)
    return nnx.merge(graphdef, state)


def shipped_or(tokenizer_dir: str | None) -> str:
    """The tokenizer directory to read: the run's, else the shipped Qwen2.5 files."""
    return tokenizer_dir or str(SHIPPED_TOKENIZER_DIR)
