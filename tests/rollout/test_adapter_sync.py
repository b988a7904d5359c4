"""The adapter-only sync of a LoRA run (`rollout.adapter_sync`): a version is a PEFT adapter
with the full sync's manifest (file hashes, HMAC), written atomically and checked before any
server loads it; a damaged, forged or mislabelled version is refused naming what failed."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from bapo_jax.models import lora as lora_lib
from bapo_jax.models.config import LoRAConfig, Qwen2Config
from bapo_jax.rollout import adapter_sync
from bapo_jax.rollout import weight_sync as ws

CONFIG = Qwen2Config.preset("tiny")
LORA = LoRAConfig(rank=4, alpha=8.0, targets=("q_proj", "down_proj"))
KEY = b"k" * 32


def _adapters(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    fresh = lora_lib.initial_adapters(CONFIG, LORA, seed=seed)
    return {k: rng.normal(size=v.shape).astype(np.float32) for k, v in fresh.items()}


def _write(root, version: int, **kw) -> str:
    kw = {"manifest_key": KEY, **kw}
    return adapter_sync.write_adapter(
        _adapters(version), root, version=version, step=version, config=CONFIG, lora=LORA, **kw
    )


def test_a_version_is_a_peft_adapter_with_a_signed_manifest(tmp_path):
    path = _write(tmp_path, 3)
    assert path == ws.version_dir(tmp_path, 3) and adapter_sync.is_adapter_version(path)
    manifest = adapter_sync.check_adapter(path, version=3, manifest_key=KEY, config=CONFIG)
    assert manifest["format"] == adapter_sync.ADAPTER_FORMAT
    assert manifest["lora"] == {"rank": 4, "alpha": 8.0, "targets": ["q_proj", "down_proj"]}
    assert sorted(manifest["files"]) == [
        "params/adapter_config.json", "params/adapter_model.safetensors",
    ]  # fmt: skip
    # what vLLM loads is PEFT's directory, and it holds exactly the adapters written
    got_lora, got = lora_lib.load_peft(os.path.join(path, "params"), CONFIG)
    assert got_lora == LORA
    for name, array in _adapters(3).items():
        np.testing.assert_array_equal(got[name], array)
    assert adapter_sync.adapter_name(3) == "policy-v3"


def test_versions_are_kept_as_the_full_sync_keeps_them(tmp_path):
    for v in range(5):
        _write(tmp_path, v, keep=2)
    ws.wait_pruned()
    assert ws.list_versions(tmp_path) == [3, 4]
    assert not adapter_sync.is_adapter_version(tmp_path / "v00000000")  # pruned


@pytest.mark.parametrize(
    "damage, message",
    [
        ("flip", r"adapter_model.safetensors damaged: xxh3 mismatch"),
        ("truncate", r"adapter_model.safetensors has \d+ bytes, the manifest says"),
        ("forge", r"manifest HMAC mismatch"),
        ("version", r"manifest version is 2, expected 3"),
    ],
)
def test_a_damaged_or_forged_version_is_refused_before_loading(tmp_path, damage, message):
    path = _write(tmp_path, 2)
    weights = os.path.join(path, "params", "adapter_model.safetensors")
    version = 2
    if damage == "flip":
        with open(weights, "r+b") as f:
            f.seek(-7, os.SEEK_END)
            byte = f.read(1)[0]
            f.seek(-7, os.SEEK_END)
            f.write(bytes([byte ^ 0xFF]))
    elif damage == "truncate":
        os.truncate(weights, os.path.getsize(weights) - 4)
    elif damage == "forge":  # a field changed after signing
        manifest_file = os.path.join(path, ws.MANIFEST)
        with open(manifest_file, encoding="utf-8") as f:
            manifest = json.load(f)
        manifest["step"] = 99
        with open(manifest_file, "w", encoding="utf-8") as f:
            json.dump(manifest, f)
    else:
        version = 3
    with pytest.raises(ValueError, match=message):
        adapter_sync.check_adapter(path, version=version, manifest_key=KEY, config=CONFIG)
    other = Qwen2Config.preset("tiny-tied")
    with pytest.raises(ValueError, match="differs from the served model"):
        adapter_sync.check_adapter(_write(tmp_path, 5), version=5, manifest_key=KEY, config=other)
