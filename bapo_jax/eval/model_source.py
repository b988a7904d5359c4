"""Where `python -m bapo_jax.eval` gets its model, and the vLLM servers it launches itself.

Model sources (exactly one):

    --model-dir DIR        an HF checkpoint (an export of a run is one). A run directory given
                           here is refused, pointing at --run (no silent guessing).
    --run DIR [--step N]   a run directory's checkpoint (`bapo_jax.export.run_dir`; latest step
                           by default): the policy params alone are read, with the run's own
                           architecture and tokenizer (--tokenizer-dir overrides the latter).
    --tiny-random          random weights, embedded engine (smoke tests)

Engines: embedded (in process), or vLLM servers given by URL (--vllm-url) and/or launched here
(--launch-servers N, `rollout.serve.ServerGroup` with the vLLM environment's interpreter:
--vllm-python, else $BAPO_VLLM_PYTHON, else the project's .venv-vllm). Launched servers serve
--model-dir, or for --run an export of the checkpoint (`export.export_run`, in --dtype) written
to a temp dir under --out-dir; the servers are stopped and the temp export deleted when the eval
ends. --run with --vllm-url alone is refused: a given server serves the weights it was started
with, not the run's checkpoint.

A run checkpoint and its fp32 export give the same report: the same params, architecture,
tokenizer and stop ids (the tokenizer's eos and the config's; an export's
generation_config.json lists exactly these).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from bapo_jax import overrides
from bapo_jax.eval.usage import UsageError, require
from bapo_jax.rollout import serve

__all__ = [
    "ManagedEngine",
    "add_flags",
    "build_engine",
    "tokenizer_dir",
    "uses_model_source",
    "validate",
]


# Flags that are shortcuts for `serve.ServerSettings` fields (their help is the field's).
SERVER_FLAGS = {
    "--vllm-python": "python",
    "--server-port": "port",
    "--server-devices": "devices",
    "--tensor-parallel-size": "tensor_parallel_size",
    "--gpu-memory-utilization": "gpu_memory_utilization",
    "--secret-file": "secret_file",
}


def add_flags(ap: argparse.ArgumentParser) -> None:
    """The run-checkpoint and launched-server flags (module doc)."""
    run = ap.add_argument_group("run checkpoint (instead of --model-dir)")
    run.add_argument(
        "--run", default=None, help="a run directory: evaluate its checkpoint (the run's tokenizer)"
    )
    run.add_argument("--step", type=int, default=None, help="with --run: the step (default latest)")
    vllm = ap.add_argument_group("vLLM servers launched by the eval (--engine vllm)")
    vllm.add_argument(
        "--launch-servers",
        type=int,
        default=0,
        help="start N servers of --model-dir (or of a temp export of --run); stopped at the end",
    )
    overrides.add_flags(vllm, SERVER_FLAGS, serve.ServerSettings)
    vllm.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="vLLM --max-model-len (default: the model's max_position_embeddings)",
    )
    vllm.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra vLLM flag, repeatable (e.g. --server-arg=--enforce-eager)",
    )


def uses_model_source(args: argparse.Namespace) -> bool:
    """Whether `build_engine` here (not the eval's own) builds the engine."""
    return args.run is not None or args.launch_servers > 0


def _read_run(args: argparse.Namespace):
    from bapo_jax.export import RunDirError, read_run

    try:
        run = read_run(args.run)
        run.step(args.step)
    except RunDirError as error:
        raise UsageError(str(error)) from None
    return run


def validate(args: argparse.Namespace) -> None:
    """Model-source and engine checks (before any model is loaded); UsageError names the flag."""
    sources = [
        flag
        for flag, given in (
            ("--model-dir", args.model_dir is not None),
            ("--run", args.run is not None),
            ("--tiny-random", args.tiny_random),
        )
        if given
    ]
    if "--model-dir" in sources:
        require(
            Path(args.model_dir).is_dir(),
            f"--model-dir must be an existing directory, got {args.model_dir!r}",
        )
        from bapo_jax.export import is_run_dir

        require(
            not is_run_dir(args.model_dir),
            f"--model-dir {args.model_dir!r} is a run directory (its config.json is a RunConfig); "
            f"evaluate its checkpoint with --run {args.model_dir}",
        )
        require(not args.tiny_random, "--tiny-random and --model-dir exclude each other")
    require(len(sources) <= 1, f"{' and '.join(sources)} exclude each other")
    require(args.step is None or args.run is not None, "--step is only for --run")
    require(args.step is None or args.step >= 0, f"--step must be >= 0, got {args.step}")
    require(args.launch_servers >= 0, f"--launch-servers must be >= 0, got {args.launch_servers}")
    if args.run is not None:
        _read_run(args)
    if args.engine == "embedded":
        require(
            args.model_dir is not None or args.run is not None or args.tiny_random,
            "--model-dir is required with --engine embedded (or --run for a run's checkpoint; "
            "--tiny-random for a random smoke-test model)",
        )
        require(not args.vllm_url, "--vllm-url is only for --engine vllm")
        require(not args.launch_servers, "--launch-servers is only for --engine vllm")
        return
    require(not args.tiny_random, "--tiny-random is only for --engine embedded")
    require(
        bool(args.vllm_url) or args.launch_servers > 0,
        "--engine vllm needs at least one --vllm-url (or --launch-servers N)",
    )
    require(
        args.run is None or not args.vllm_url,
        "--run with --vllm-url: a given server serves the weights it was started with, not the "
        "run's checkpoint; use --launch-servers N (the eval exports the checkpoint and serves "
        "it), or export it (python -m bapo_jax.export --run DIR --out HF_DIR) and serve that",
    )
    require(
        args.model_dir is not None or args.run is not None or args.tokenizer_dir is not None,
        "--engine vllm needs --model-dir (or --tokenizer-dir) for the tokenizer",
    )
    require(
        args.vllm_model is not None or args.model_dir is not None or args.launch_servers > 0,
        "--engine vllm needs --vllm-model (the served model name) when --model-dir is absent",
    )
    if args.launch_servers:
        require(
            args.model_dir is not None or args.run is not None,
            "--launch-servers needs --model-dir or --run (the model the servers load)",
        )
        require(
            args.max_model_len is None or args.max_model_len >= 1,
            f"--max-model-len must be >= 1, got {args.max_model_len}",
        )
        settings = _server_settings(args)
        why = serve.missing_vllm_python(serve.vllm_python(settings.python))
        require(why is None, f"--vllm-python: {why}")


def tokenizer_dir(args: argparse.Namespace) -> str | None:
    """The tokenizer directory to load: --tokenizer-dir, else --model-dir, else the run's (None:
    the shipped Qwen2.5 files)."""
    if args.tokenizer_dir or args.model_dir:
        return args.tokenizer_dir or args.model_dir
    if args.run is not None:
        return _read_run(args).tokenizer_dir
    return None


def _stop_ids(tokenizer, config_eos: Any, model_dir: str | None = None) -> tuple[int, ...]:
    """The tokenizer's eos, the config's eos and generation_config.json's (as the eval does for
    --model-dir)."""
    ids = {int(tokenizer.eos_id)}
    values = [config_eos]
    if model_dir is not None and (Path(model_dir) / "generation_config.json").is_file():
        text = (Path(model_dir) / "generation_config.json").read_text(encoding="utf-8")
        values.append(json.loads(text).get("eos_token_id"))
    for value in values:
        if isinstance(value, int):
            ids.add(value)
        elif value is not None:
            ids.update(int(i) for i in value)
    return tuple(sorted(ids))


class ManagedEngine:
    """An engine that also releases what it was built on (launched servers, a temp export)
    when closed; everything else is the wrapped engine's."""

    def __init__(self, engine, stack: contextlib.ExitStack):
        self._engine, self._stack = engine, stack

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def close(self) -> None:
        self._stack.close()


def _check_vocab(tokenizer, vocab_size: int, source: str) -> None:
    require(
        tokenizer.vocab_size <= vocab_size,
        f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocab_size is "
        f"{vocab_size} ({source})",
    )


def build_engine(args: argparse.Namespace, tokenizer) -> tuple[Any, tuple[int, ...], str, Any]:
    """(engine, stop ids, model description, max context) for --run or --launch-servers."""
    if args.engine == "embedded":
        import jax.numpy as jnp

        from bapo_jax.export import load_run_policy
        from bapo_jax.rollout.embedded import EmbeddedEngine

        run = _read_run(args)
        _check_vocab(tokenizer, run.architecture.vocab_size, "--tokenizer-dir / --run mismatch")
        policy = load_run_policy(args.run, args.step, dtype=jnp.dtype(args.dtype))
        config = policy.config
        stops = _stop_ids(tokenizer, config.eos_token_id)
        engine = EmbeddedEngine(policy.model, eos_token_ids=stops, pad_token_id=tokenizer.pad_id)
        description = f"run:{run.run_dir}@step{policy.step}"
        return engine, stops, description, config.max_position_embeddings
    return _launched_engine(args, tokenizer)


def _server_settings(args: argparse.Namespace, served: str | None = None):
    """The launched servers' `serve.ServerSettings`: the server flags, the eval's --dtype."""
    given = overrides.flag_overrides(args, SERVER_FLAGS, serve.ServerSettings)
    if args.server_arg:
        given.append("args=" + json.dumps(args.server_arg))
    try:
        base = serve.ServerSettings(dtype=args.dtype, served_model_name=served)
        return overrides.apply_overrides(base, given)
    except ValueError as error:
        raise UsageError(f"vLLM server flags: {error}") from None


def _launched_engine(args: argparse.Namespace, tokenizer):
    from bapo_jax.models.config import Qwen2Config
    from bapo_jax.rollout.vllm_client import VLLMClientConfig, VLLMEngine

    stack = contextlib.ExitStack()
    try:
        model_dir, what = args.model_dir, str(args.model_dir)
        if args.run is not None:  # vLLM loads HF checkpoints: export the step first
            from bapo_jax.export import export_run

            os.makedirs(args.out_dir, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=".export-", dir=args.out_dir)
            stack.callback(shutil.rmtree, tmp, ignore_errors=True)
            result = export_run(args.run, os.path.join(tmp, "hf"), args.step, dtype=args.dtype)
            model_dir, what = result.path, f"run:{os.path.abspath(args.run)}@step{result.step}"
        config = Qwen2Config.from_hf(model_dir)
        _check_vocab(tokenizer, config.vocab_size, "--tokenizer-dir / model mismatch")
        served = args.vllm_model or model_dir
        spec = serve.ServerSpec(
            model_dir,
            args.max_model_len or config.max_position_embeddings,
            _server_settings(args, served),
        )
        try:
            group = serve.ServerGroup(
                spec, args.launch_servers, log_dir=os.path.join(args.out_dir, "vllm")
            )
        except OSError as error:
            raise UsageError(f"--server-port {spec.server.port}: {error}") from None
        stack.callback(group.stop)
        group.wait_healthy()
        engine = VLLMEngine(
            VLLMClientConfig(
                urls=tuple(args.vllm_url) + tuple(group.urls), model=served, token=group.token
            )
        )
        stack.callback(engine.close)
        stops = _stop_ids(tokenizer, config.eos_token_id, model_dir)
        return ManagedEngine(engine, stack), stops, f"vllm:launched {what}", None
    except BaseException:
        stack.close()
        raise
