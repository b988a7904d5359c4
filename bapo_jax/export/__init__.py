"""Any run checkpoint as an HF checkpoint, and a run's policy for evaluation.

    python -m bapo_jax.export --run runs/my_run [--step 40] --out exports/my_run-40 [--dtype bf16]

    from bapo_jax.export import export_run, load_run_policy
    export_run("runs/my_run", "exports/my_run-40", step=40, dtype="bfloat16")
    policy = load_run_policy("runs/my_run")  # (model, config, tokenizer, step, run)

An export is what transformers and vLLM load as-is: model.safetensors (or shards + index),
config.json, generation_config.json (every eos id: the tokenizer's and the config's; the
tokenizer's pad id) and the run's tokenizer files -- copied from its tokenizer directory (Qwen2.5
runs: model.tokenizer_dir, else model.hf_dir, else the shipped Qwen2.5 files), or, for the CPU
arithmetic job, the HF form of its SentencePiece tokenizer the job recorded in <run>/model/
(`export.tokenizer_files`). How the run directory is read: `export.run_dir`. The export is
written beside `out` and renamed into place: a reader never sees half of one. A LoRA run
(model.lora_*) exports its merged weights, and its adapter in PEFT's format in
`<out>/lora_adapter/` (`peft.PeftModel.from_pretrained(base, "<out>/lora_adapter")` on the
base checkpoint the run started from).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import tempfile
from typing import Any, NamedTuple

import jax.numpy as jnp

from bapo_jax.export.run_dir import (
    MODEL_RECORD,
    RunDirError,
    RunModel,
    build_model,
    is_run_dir,
    read_params,
    read_run,
    shipped_or,
)
from bapo_jax.export.tokenizer_files import copy_tokenizer_files
from bapo_jax.models.config import ModelOptions, Qwen2Config
from bapo_jax.models.hf import replace_directory, save_pretrained
from bapo_jax.models.qwen2 import Qwen2ForCausalLM
from bapo_jax.models.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "DTYPES",
    "ExportResult",
    "RunDirError",
    "RunModel",
    "RunPolicy",
    "export_run",
    "generation_ids",
    "is_run_dir",
    "load_run_policy",
    "parse_dtype",
    "read_run",
    "record_policy",
]

LORA_ADAPTER = "lora_adapter"  # a LoRA run's adapter inside its export, PEFT's format
# Accepted spellings of the export dtype -> its name.
DTYPES = {
    "fp32": "float32",
    "float32": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
}


def parse_dtype(value: str | None, flag: str = "--dtype") -> str | None:
    """ "bf16" / "bfloat16" / "fp32" / "float32" -> the dtype name (None stays None)."""
    if value is None:
        return None
    if value not in DTYPES:
        raise ValueError(f"{flag} must be one of {sorted(DTYPES)}, got {value!r}")
    return DTYPES[value]


class RunPolicy(NamedTuple):
    """A run's policy at one step: the model, its architecture, the run's tokenizer, the step
    and what the run directory says (`RunModel`)."""

    model: Qwen2ForCausalLM
    config: Qwen2Config
    tokenizer: Tokenizer
    step: int
    run: RunModel


def load_run_policy(
    run_dir: str | os.PathLike,
    step: int | None = None,
    *,
    dtype: Any = None,
    options: ModelOptions | None = None,
    on_device: bool = True,
) -> RunPolicy:
    """The policy of `run_dir`'s checkpoint at `step` (None: the latest), params only (no
    optimizer state is read), cast to `dtype` (None: the checkpoint's); on the default device,
    or kept as host numpy arrays with `on_device=False`. RunDirError names the flag at fault."""
    run = read_run(run_dir)
    step = run.step(step)  # before loading the tokenizer: a bad step fails first
    tokenizer = load_tokenizer(shipped_or(run.tokenizer_dir))
    params, step = read_params(run, step)
    options = dataclasses.replace(options or ModelOptions(), lora=run.lora)  # the run's adapters
    model = build_model(run.architecture, params, dtype=dtype, options=options, on_device=on_device)
    return RunPolicy(model, run.architecture, tokenizer, step, run)


def generation_ids(config: Qwen2Config, tokenizer: Tokenizer) -> dict[str, Any]:
    """generation_config.json's ids: eos = the tokenizer's and the config's (what the trainer
    stops at, `run.build.stop_ids`), pad = the tokenizer's."""
    eos = {int(tokenizer.eos_id)}
    value = config.eos_token_id
    eos.update([value] if isinstance(value, int) else list(value or ()))
    ids = sorted(eos)
    return {"eos_token_id": ids[0] if len(ids) == 1 else ids, "pad_token_id": tokenizer.pad_id}


class ExportResult(NamedTuple):
    """path: the export; step: the checkpoint step; dtype: of the weights; tokenizer_from:
    the tokenizer directory copied; architecture_from: where the config came from."""

    path: str
    step: int
    dtype: str
    tokenizer_from: str
    architecture_from: str


def export_run(
    run_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    step: int | None = None,
    *,
    dtype: str | None = None,
    overwrite: bool = False,
) -> ExportResult:
    """Write `run_dir`'s checkpoint at `step` (None: the latest) as an HF checkpoint in
    `out_dir` (module doc). dtype: "float32" / "bfloat16" (or fp32 / bf16; None: the
    checkpoint's). An existing non-empty `out_dir` is refused unless `overwrite` (then it is
    replaced whole, in one rename). The params stay on the host (never on an accelerator)."""
    out_dir = os.path.abspath(os.fspath(out_dir))
    dtype = parse_dtype(dtype)
    taken = os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir))
    if taken and not overwrite:
        raise RunDirError(
            f"--out {out_dir!r} exists and is not empty; choose another, or --overwrite"
        )
    run = read_run(run_dir)
    step = run.step(step)
    _check_out_apart(out_dir, run)
    tokenizer_from = shipped_or(run.tokenizer_dir)
    tokenizer = load_tokenizer(tokenizer_from)
    params, step = read_params(run, step)
    model = build_model(
        run.architecture, params, options=ModelOptions(lora=run.lora), on_device=False
    )
    out_dtype = dtype or jnp.dtype(model.embed_tokens.get_value().dtype).name
    if tokenizer.vocab_size > run.architecture.vocab_size:
        print(
            f"warning: the run's tokenizer has {tokenizer.vocab_size} ids, more than the model's "
            f"vocab_size {run.architecture.vocab_size} (the run trained on it that way)",
            file=sys.stderr,
        )
    save_pretrained(
        model,
        out_dir,
        dtype=out_dtype,
        generation_config=generation_ids(run.architecture, tokenizer),
        extra_files=lambda tmp: _extra_files(tmp, tokenizer_from, model, run, out_dtype),
    )
    return ExportResult(out_dir, step, out_dtype, tokenizer_from, run.architecture_from)


def _extra_files(tmp: str, tokenizer_from: str, model, run: RunModel, dtype: str) -> None:
    """The tokenizer's files, and a LoRA run's adapter in PEFT's format (`lora_adapter/`, on
    the base checkpoint the run started from; the export beside it holds the merged model)."""
    copy_tokenizer_files(tokenizer_from, tmp)
    if run.lora is not None:
        import numpy as np

        from bapo_jax.models.lora import save_peft

        adapters = {k: np.asarray(v) for k, v in model.layers.adapters(jnp.dtype(dtype)).items()}
        save_peft(os.path.join(tmp, LORA_ADAPTER), adapters, run.lora)


def _check_out_apart(out_dir: str, run: RunModel) -> None:
    """The export may live inside the run directory, but must not be (or hold) the run, its
    checkpoints or its model record (--overwrite would delete them), nor be inside them."""
    out = os.path.realpath(out_dir)
    run_path = os.path.realpath(run.run_dir)
    for name, path in (
        ("the run directory", run_path),
        ("the run's checkpoints", os.path.realpath(run.checkpoint_dir)),
        (f"the run's {MODEL_RECORD}/ record", os.path.join(run_path, MODEL_RECORD)),
    ):
        holds = out == path or path.startswith(out + os.sep)
        inside = out.startswith(path + os.sep) and path != run_path
        if holds or inside:
            raise RunDirError(f"--out {out_dir!r} would overwrite {name} ({path})")


def record_policy(
    run_dir: str | os.PathLike,
    architecture: Qwen2Config,
    tokenizer_dir: str | os.PathLike | None = None,
) -> str:
    """Write <run_dir>/model/: `architecture` as an HF config.json and the tokenizer files of
    `tokenizer_dir` (None: the shipped Qwen2.5 files; a directory without any: none copied), so
    the run directory alone names its policy (`export.run_dir`), whatever its config.json says
    (a dry run's stand-in) and wherever its model.hf_dir goes. `run.build.build_trainer` calls
    it for every run. Written through a temp dir and a rename; returns the path."""
    run_dir = os.fspath(run_dir)
    source = shipped_or(None if tokenizer_dir is None else os.fspath(tokenizer_dir))
    os.makedirs(run_dir, exist_ok=True)
    record = os.path.join(run_dir, MODEL_RECORD)
    tmp = tempfile.mkdtemp(prefix=f".{MODEL_RECORD}.tmp-", dir=run_dir)
    try:
        with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
            json.dump(architecture.to_hf_dict(), f, indent=2, sort_keys=True)
            f.write("\n")
        if os.path.isdir(source):
            copy_tokenizer_files(source, tmp)
        replace_directory(tmp, record)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return record
