"""Adapter-only weight sync: a LoRA run sends vLLM its adapters, not the base weights
(docs/rollout.md, "LoRA runs"). ``write_adapter(adapters, root, version=v, ...)`` writes

    root/v00000007/params/       the adapters as a PEFT LoRA adapter (adapter_config.json +
                                 adapter_model.safetensors: `models.lora.save_peft`), which
                                 vLLM loads as it is (``/v1/load_lora_adapter``)
    root/v00000007/manifest.json {format: ADAPTER_FORMAT, version, step, config, lora, files,
                                  digest, hmac}

through the same temp-dir, rename and prune as the full sync (`weight_sync._write_version`),
with the same file table (`sync_checks`) and HMAC (`manifest_auth`). The server's worker checks
a version (``bapo_check_adapter``: `check_adapter`) before the client has vLLM load it under
``adapter_name(version)``. Single-process trainers only for now.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from bapo_jax.models.config import LoRAConfig, Qwen2Config
from bapo_jax.rollout import weight_sync as ws
from bapo_jax.rollout.manifest_auth import sign_manifest, verify_manifest
from bapo_jax.rollout.sync_checks import check_header, file_fields, verify_hashes, verify_layout

__all__ = [
    "ADAPTER_FORMAT",
    "adapter_name",
    "check_adapter",
    "is_adapter_version",
    "write_adapter",
]

ADAPTER_FORMAT = "bapo-peft-lora-v1"  # a PEFT LoRA adapter under params/
ADAPTER_PREFIX = "policy-v"


def adapter_name(version: int) -> str:
    """The name a version's adapter is loaded under, and requests of that version name."""
    return f"{ADAPTER_PREFIX}{int(version)}"


def is_adapter_version(path: str | os.PathLike) -> bool:
    """Whether the synced version at ``path`` is an adapter version (by its manifest)."""
    try:
        return ws.read_manifest(path).get("format") == ADAPTER_FORMAT
    except (OSError, ValueError):
        return False  # the full load reports what is wrong with it


def write_adapter(
    adapters: Mapping[str, np.ndarray],
    root: str | os.PathLike,
    *,
    version: int,
    step: int,
    config: Qwen2Config,
    lora: LoRAConfig,
    keep: int = 3,
    manifest_key: bytes | None = None,
    dir_mode: int = ws.DIR_MODE,
) -> str:
    """Write the stacked adapters (`models.lora` names, host arrays) as version ``version``;
    returns the version directory (module doc)."""
    from bapo_jax.models.lora import save_peft

    if jax.process_count() > 1:
        raise ValueError("the adapter-only sync runs on a single-process trainer")

    def fill(tmp: str) -> dict[str, Any]:
        save_peft(os.path.join(tmp, "params"), adapters, lora)
        manifest = {
            "format": ADAPTER_FORMAT,
            "version": version,
            "step": step,
            "config": config.to_hf_dict(),
            "lora": {"rank": lora.rank, "alpha": lora.alpha, "targets": list(lora.targets)},
            **file_fields(tmp),
        }
        return sign_manifest(manifest, manifest_key)

    return ws._write_version(root, version, step, keep, fill, dir_mode=dir_mode)


def check_adapter(
    path: str | os.PathLike,
    *,
    version: int,
    manifest_key: bytes | None,
    config: Qwen2Config | None = None,
) -> dict[str, Any]:
    """The manifest of the adapter version at ``path``, once its HMAC (with the key), format,
    version, base config and every file's size and hashes pass; ValueError naming what failed
    otherwise. Nothing is loaded."""
    path = os.fspath(path)
    manifest = ws.read_manifest(path)
    verify_manifest(path, manifest, manifest_key)  # before any field of it is used
    check_header(manifest, ADAPTER_FORMAT, config, version=version)
    verify_layout(path, manifest)
    verify_hashes(path, manifest)
    return manifest
