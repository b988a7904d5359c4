"""HF checkpoints both ways, against transformers on CPU torch (fp32)."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from bapo_jax.models import (  # noqa: E402
    ModelOptions,
    Qwen2Config,
    init_model,
    iter_hf_tensors,
    load_pretrained,
    save_pretrained,
    weight_map,
)
from bapo_jax.sharding import mesh as mesh_lib  # noqa: E402

from .hf_fixtures import (  # noqa: E402
    TinySpec,
    left_padded_batch,
    make_hf_checkpoint,
    torch_logits,
)

TOL = 1e-4

# GQA groups of 7, 2 and 1; tied and untied heads; default and non-default RoPE theta.
SPECS = {
    "gqa7-untied": TinySpec(heads=7, kv_heads=1, head_dim=16, tied=False, rope_theta=10000.0),
    "gqa2-tied": TinySpec(heads=4, kv_heads=2, head_dim=16, tied=True, rope_theta=10000.0),
    "gqa1-untied-theta": TinySpec(heads=2, kv_heads=2, head_dim=32, tied=False, rope_theta=1e6),
    "gqa2-tied-theta3l": TinySpec(
        heads=4, kv_heads=2, head_dim=16, tied=True, rope_theta=500.0, layers=3
    ),
}


def _masked_max_diff(a: np.ndarray, b: np.ndarray, mask: np.ndarray) -> float:
    return float(np.max(np.abs(a - b) * mask[..., None]))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for name, spec in SPECS.items():
        path = tmp_path_factory.mktemp(name)
        model = make_hf_checkpoint(path, spec, seed=len(out))
        out[name] = (path, spec, model)
    return out


@pytest.mark.parametrize("name", sorted(SPECS))
def test_logits_match_transformers_with_left_padding(checkpoints, name):
    path, spec, ref_model = checkpoints[name]
    model = load_pretrained(path)
    assert model.config.tie_word_embeddings == spec.tied
    assert model.config.num_kv_groups == spec.heads // spec.kv_heads
    assert model.config.rope_theta == spec.rope_theta
    ids, mask = left_padded_batch(spec.vocab, [12, 9, 4, 1], 12, seed=1)
    ours = np.asarray(model(jnp.asarray(ids), attention_mask=jnp.asarray(mask)))
    ref = torch_logits(ref_model, ids, mask)
    assert ours.shape == ref.shape == (4, 12, spec.vocab)
    assert ours.dtype == np.float32
    assert _masked_max_diff(ours, ref, mask) <= TOL
    assert np.isfinite(ours).all()


@pytest.mark.parametrize("name", sorted(SPECS))
def test_logits_match_transformers_without_mask(checkpoints, name):
    path, spec, ref_model = checkpoints[name]
    model = load_pretrained(path)
    ids = np.random.default_rng(2).integers(0, spec.vocab, (2, 16)).astype(np.int32)
    ours = np.asarray(model(jnp.asarray(ids)))
    assert float(np.max(np.abs(ours - torch_logits(ref_model, ids)))) <= TOL


def test_left_padded_row_equals_the_unpadded_sequence(checkpoints):
    path, spec, _ = checkpoints["gqa7-untied"]
    model = load_pretrained(path)
    ids, mask = left_padded_batch(spec.vocab, [10, 6], 10, seed=3)
    padded = np.asarray(model(jnp.asarray(ids), attention_mask=jnp.asarray(mask)))
    alone = np.asarray(model(jnp.asarray(ids[1:, 4:])))
    np.testing.assert_allclose(padded[1, 4:], alone[0], atol=TOL, rtol=0)


def test_hidden_states_and_unembedding_give_the_logits(checkpoints):
    path, spec, _ = checkpoints["gqa2-tied"]
    model = load_pretrained(path)
    ids, mask = left_padded_batch(spec.vocab, [8, 5], 8, seed=4)
    h = model.hidden_states(jnp.asarray(ids), attention_mask=jnp.asarray(mask))
    assert h.shape == (2, 8, spec.hidden)
    w = model.unembedding()
    assert w.shape == (spec.vocab, spec.hidden)
    np.testing.assert_array_equal(np.asarray(w), np.asarray(model.embed_tokens.get_value()))  # tied
    logits = model(jnp.asarray(ids), attention_mask=jnp.asarray(mask))
    np.testing.assert_allclose(
        np.asarray(jnp.einsum("btd,vd->btv", h, w)), np.asarray(logits), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("name", ["gqa7-untied", "gqa2-tied"])
def test_saved_checkpoint_loads_in_transformers_with_same_logits(checkpoints, tmp_path, name):
    path, spec, _ = checkpoints[name]
    model = load_pretrained(path)
    out = tmp_path / "export"
    save_pretrained(model, out)
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors"]
    hf_model, info = transformers.Qwen2ForCausalLM.from_pretrained(out, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set() and not info["error_msgs"]
    assert hf_model.config.tie_word_embeddings == spec.tied
    from safetensors import safe_open

    with safe_open(os.fspath(out / "model.safetensors"), framework="numpy") as f:
        names = set(f.keys())
    assert ("lm_head.weight" in names) == (not spec.tied)
    ids, mask = left_padded_batch(spec.vocab, [11, 7, 3], 11, seed=5)
    ours = np.asarray(model(jnp.asarray(ids), attention_mask=jnp.asarray(mask)))
    assert _masked_max_diff(ours, torch_logits(hf_model.eval(), ids, mask), mask) <= TOL


@pytest.mark.slow  # long: in `make test-slow` (CI runs it)
def test_random_init_model_exports_to_transformers(tmp_path):
    for preset in ("tiny", "tiny-tied", "tiny-hd64"):
        model = init_model(Qwen2Config.preset(preset), seed=3)
        save_pretrained(model, tmp_path / preset)
        hf_model, info = transformers.Qwen2ForCausalLM.from_pretrained(
            tmp_path / preset, output_loading_info=True
        )
        assert not info["missing_keys"] and not info["unexpected_keys"], preset
        ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 9)).astype(np.int32)
        ours = np.asarray(model(jnp.asarray(ids)))
        assert float(np.max(np.abs(ours - torch_logits(hf_model.eval(), ids)))) <= TOL, preset


def test_sharded_save_round_trips(checkpoints, tmp_path):
    path, spec, ref_model = checkpoints["gqa2-tied-theta3l"]
    model = load_pretrained(path)
    out = tmp_path / "sharded"
    save_pretrained(model, out, max_shard_bytes=40_000)
    files = sorted(os.listdir(out))
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 2 and "model.safetensors.index.json" in files
    assert all(
        f.startswith("model-") and f.endswith(f"-of-{len(shards):05d}.safetensors") for f in shards
    )
    with open(out / "model.safetensors.index.json") as f:
        index = json.load(f)
    expected = {n for m in weight_map(model.config) for n in m.hf_names(model.config)}
    assert set(index["weight_map"]) == expected
    assert set(index["weight_map"].values()) == set(shards)
    total = sum(t.nbytes for _, t in iter_hf_tensors(model))
    assert index["metadata"]["total_size"] == total

    again = load_pretrained(out)
    for a, b in zip(
        jax.tree.leaves(jax.tree.map(np.asarray, _params(model))),
        jax.tree.leaves(jax.tree.map(np.asarray, _params(again))),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)
    hf_model, info = transformers.Qwen2ForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids, mask = left_padded_batch(spec.vocab, [9, 2], 9, seed=6)
    ours = np.asarray(again(jnp.asarray(ids), attention_mask=jnp.asarray(mask)))
    assert _masked_max_diff(ours, torch_logits(hf_model.eval(), ids, mask), mask) <= TOL
    assert _masked_max_diff(ours, torch_logits(ref_model, ids, mask), mask) <= TOL


def _params(model):
    from flax import nnx

    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def test_save_replaces_an_existing_checkpoint_and_leaves_no_temp_dirs(tmp_path):
    out = tmp_path / "ckpt"
    save_pretrained(init_model(Qwen2Config.preset("tiny"), seed=0), out)
    second = init_model(Qwen2Config.preset("tiny-tied"), seed=1)
    save_pretrained(second, out, max_shard_bytes=50_000)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert "model.safetensors" not in os.listdir(out)  # old single file gone
    assert Qwen2Config.from_hf(out) == second.config


def test_load_in_bfloat16_and_save_converts_dtype(checkpoints, tmp_path):
    path, spec, _ = checkpoints["gqa2-tied"]
    model = load_pretrained(path, dtype=jnp.bfloat16)
    assert model.embed_tokens.get_value().dtype == jnp.bfloat16
    assert model.layers.q_proj.get_value().dtype == jnp.bfloat16
    assert model.options.param_dtype == jnp.bfloat16
    ids = np.random.default_rng(0).integers(0, spec.vocab, (1, 6)).astype(np.int32)
    assert np.isfinite(np.asarray(model(jnp.asarray(ids)))).all()
    save_pretrained(model, tmp_path / "f32", dtype=jnp.float32)
    with open(tmp_path / "f32" / "config.json") as f:
        assert json.load(f)["torch_dtype"] == "float32"
    back = load_pretrained(tmp_path / "f32")
    np.testing.assert_array_equal(
        np.asarray(back.layers.q_proj.get_value()),
        np.asarray(model.layers.q_proj.get_value().astype(jnp.float32)),
    )


def test_load_places_each_tensor_into_its_sharding_on_a_mesh(checkpoints):
    path, spec, ref_model = checkpoints["gqa2-tied"]
    devices = np.array(jax.devices())
    assert devices.size >= 2
    mesh = jax.sharding.Mesh(devices[:2], ("model",))
    P = jax.sharding.PartitionSpec

    # A stand-in for the sharding rules: vocab and kv heads over "model", the rest replicated.
    def shardings(axes):
        spec_ = tuple("model" if a in ("vocab", "kv_heads") else None for a in axes)
        return jax.sharding.NamedSharding(mesh, P(*spec_))

    model = load_pretrained(path, mesh=mesh, shardings=shardings)
    emb = model.embed_tokens.get_value()
    assert emb.sharding.spec == P("model", None)
    assert len(emb.addressable_shards) == 2
    assert emb.addressable_shards[0].data.shape == (spec.vocab // 2, spec.hidden)
    assert model.layers.k_proj.get_value().sharding.spec == P(None, None, "model", None)

    # Default: the project's rules on a (data, fsdp, tensor) mesh.
    project_mesh = mesh_lib.make_mesh(mesh_lib.mesh_preset("cpu-fsdp4-tp2"), list(devices[:8]))
    ruled = load_pretrained(path, mesh=project_mesh)
    assert ruled.layers.q_proj.get_value().sharding.spec == P(None, "fsdp", "tensor", None)
    assert ruled.embed_tokens.get_value().sharding.spec == P("tensor", "fsdp")
    ids, mask = left_padded_batch(spec.vocab, [7, 5], 7, seed=7)
    ref = torch_logits(ref_model, ids, mask)
    for m in (model, ruled):
        ours = np.asarray(m(jnp.asarray(ids), attention_mask=jnp.asarray(mask)))
        assert _masked_max_diff(ours, ref, mask) <= TOL


def test_load_rejects_a_checkpoint_that_does_not_match_its_config(checkpoints, tmp_path):
    path, _, _ = checkpoints["gqa2-tied"]
    bad = tmp_path / "bad"
    bad.mkdir()
    with open(path / "config.json") as f:
        config = json.load(f)
    config["num_hidden_layers"] = 3
    with open(bad / "config.json", "w") as f:
        json.dump(config, f)
    os.link(path / "model.safetensors", bad / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing \['model\.layers\.2\."):
        load_pretrained(bad)


def test_load_with_options_keeps_runtime_choices(checkpoints):
    path, spec, ref_model = checkpoints["gqa7-untied"]
    model = load_pretrained(path, options=ModelOptions(remat="full"))
    assert model.options.remat == "full" and model.options.param_dtype == jnp.float32
    ids, mask = left_padded_batch(spec.vocab, [6, 3], 6, seed=8)
    ours = np.asarray(model(jnp.asarray(ids), attention_mask=jnp.asarray(mask)))
    assert _masked_max_diff(ours, torch_logits(ref_model, ids, mask), mask) <= TOL
