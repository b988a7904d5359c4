"""Orbax / safetensors weight-sync format: round trip, bf16 default, atomicity, keep-K,
manifest validation, digest check, and the worker's HF mapping (without vLLM)."""

from __future__ import annotations

import json
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bapo_jax.models import PRESETS, init_model, iter_hf_tensors, load_pretrained
from bapo_jax.rollout import weight_sync as ws
from bapo_jax.rollout.vllm_worker import hf_tensors_from_flat

CONFIG = PRESETS["tiny"]


@pytest.fixture(scope="module")
def model():
    return init_model(CONFIG, seed=1)


def _params(model):
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def test_orbax_round_trip_fp32_and_manifest(model, tmp_path):
    path = ws.write_orbax(_params(model), tmp_path, version=3, step=30, config=CONFIG, dtype=None)
    assert path == ws.version_dir(tmp_path, 3)
    manifest = ws.read_manifest(path)
    assert (manifest["version"], manifest["step"], manifest["format"]) == (3, 30, ws.ORBAX_FORMAT)
    assert ws.validate_manifest(manifest, CONFIG, version=3) == CONFIG
    flat = ws.restore_orbax(path)
    want = ws.flatten_params(_params(model))
    assert sorted(flat) == sorted(want) == sorted(manifest["params"])
    chex.assert_trees_all_equal(flat, {k: np.asarray(v) for k, v in want.items()})
    assert manifest["digest"] == ws.digest_arrays(flat)


def test_bf16_default_and_keep_last_k(model, tmp_path):
    for v in range(5):
        ws.write_orbax(_params(model), tmp_path, version=v, step=v, config=CONFIG, keep=2)
    assert ws.list_versions(tmp_path) == [3, 4]
    assert not [d for d in os.listdir(tmp_path) if d.startswith(".")]  # no temp dirs left
    flat = ws.restore_orbax(ws.version_dir(tmp_path, 4))
    assert {a.dtype.name for a in flat.values()} == {"bfloat16"}
    want = ws.flatten_params(_params(model))["layers/q_proj"].astype(jnp.bfloat16)
    np.testing.assert_array_equal(flat["layers/q_proj"], np.asarray(want))


def test_digest_mismatch_is_refused(model, tmp_path):
    path = ws.write_orbax(_params(model), tmp_path, version=1, step=1, config=CONFIG)
    manifest = ws.read_manifest(path)
    manifest["digest"] = "f" * 32
    with open(os.path.join(path, ws.MANIFEST), "w") as f:
        json.dump(manifest, f)
    with pytest.raises(ValueError, match="digest mismatch"):
        ws.restore_orbax(path)


@pytest.mark.parametrize("fault", ["missing", "shape", "unexpected"])
def test_manifest_validation_names_the_problem(model, tmp_path, fault):
    flat = ws.flatten_params(_params(model))
    if fault == "missing":
        flat.pop("layers/k_bias")
        pattern = r"missing parameters \['layers/k_bias'\]"
    elif fault == "shape":
        flat["norm"] = flat["norm"][:-1]
        pattern = r"wrong shapes \['norm: \(63,\) != expected \(64,\)'\]"
    else:
        flat["extra"] = flat["norm"]
        pattern = r"unexpected \['extra'\]"
    path = ws.write_orbax(ws.unflatten_params(flat), tmp_path, version=1, step=1, config=CONFIG)
    with pytest.raises(ValueError, match=pattern):
        ws.validate_manifest(ws.read_manifest(path), CONFIG)


def test_manifest_config_and_version_checked(model, tmp_path):
    path = ws.write_orbax(_params(model), tmp_path, version=1, step=1, config=CONFIG)
    with pytest.raises(ValueError, match="manifest version is 1, expected 2"):
        ws.validate_manifest(ws.read_manifest(path), CONFIG, version=2)
    with pytest.raises(ValueError, match="differs from the served model"):
        ws.validate_manifest(ws.read_manifest(path), PRESETS["tiny-tied"])
    with pytest.raises(ValueError, match="version must be an int in"):
        ws.write_orbax(_params(model), tmp_path, version=-1, step=0, config=CONFIG)


def test_worker_hf_mapping_equals_save_pretrained_layout(model):
    """What the worker feeds vLLM equals what save_pretrained writes (same names, layout)."""
    flat = {k: np.asarray(v) for k, v in ws.flatten_params(_params(model)).items()}
    fed = dict(t for group in hf_tensors_from_flat(flat, CONFIG) for t in group)
    written = dict(iter_hf_tensors(model))
    assert sorted(fed) == sorted(written)
    chex.assert_trees_all_equal(fed, written)


def test_safetensors_export_loads_back(model, tmp_path):
    path = ws.write_safetensors(model, tmp_path, version=2, step=2, dtype=jnp.float32)
    manifest = ws.read_manifest(path)
    assert manifest["format"] == ws.SAFETENSORS_FORMAT
    ws.validate_manifest(manifest, CONFIG, version=2)
    back = load_pretrained(os.path.join(path, "hf"))
    chex.assert_trees_all_equal(
        jax.tree.map(np.asarray, _params(back)), jax.tree.map(np.asarray, _params(model))
    )
