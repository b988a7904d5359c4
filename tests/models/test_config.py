"""Qwen2Config: presets, HF config.json both ways, validation; ModelOptions."""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import pytest

from bapo_jax.models import PRESETS, ModelOptions, Qwen2Config

HUB_PRESETS = [
    "qwen2.5-0.5b",
    "qwen2.5-1.5b",
    "qwen2.5-3b",
    "qwen2.5-7b",
    "qwen2.5-14b",
    "qwen2.5-32b",
    "qwen2.5-math-7b",
    "r1-distill-qwen-7b",
    "r1-distill-qwen-32b",
]


def test_the_hub_presets_exist_with_exactly_these_names():
    assert set(HUB_PRESETS) <= set(PRESETS)
    assert set(PRESETS) - set(HUB_PRESETS) == {"tiny", "tiny-tied", "tiny-hd64"}


# (vocab, hidden, mlp, layers, heads, kv heads, max positions, theta, rms eps, tied)
EXPECTED = {
    "qwen2.5-0.5b": (151936, 896, 4864, 24, 14, 2, 32768, 1e6, 1e-6, True),
    "qwen2.5-1.5b": (151936, 1536, 8960, 28, 12, 2, 131072, 1e6, 1e-6, True),
    "qwen2.5-3b": (151936, 2048, 11008, 36, 16, 2, 32768, 1e6, 1e-6, True),
    "qwen2.5-7b": (152064, 3584, 18944, 28, 28, 4, 131072, 1e6, 1e-6, False),
    "qwen2.5-14b": (152064, 5120, 13824, 48, 40, 8, 131072, 1e6, 1e-5, False),
    "qwen2.5-32b": (152064, 5120, 27648, 64, 40, 8, 131072, 1e6, 1e-5, False),
    "qwen2.5-math-7b": (152064, 3584, 18944, 28, 28, 4, 4096, 1e4, 1e-6, False),
    "r1-distill-qwen-7b": (152064, 3584, 18944, 28, 28, 4, 131072, 1e4, 1e-6, False),
    "r1-distill-qwen-32b": (152064, 5120, 27648, 64, 40, 8, 131072, 1e6, 1e-5, False),
}


@pytest.mark.parametrize("name", HUB_PRESETS)
def test_hub_preset_architecture(name):
    c = Qwen2Config.preset(name)
    got = (
        c.vocab_size,
        c.hidden_size,
        c.intermediate_size,
        c.num_hidden_layers,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.max_position_embeddings,
        c.rope_theta,
        c.rms_norm_eps,
        c.tie_word_embeddings,
    )
    assert got == EXPECTED[name]
    assert c.head_dim == 128 if c.hidden_size >= 1536 else c.head_dim == 64
    assert c.bos_token_id == 151643 and c.eos_token_id == 151643


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_round_trips_through_hf_dict(name, tmp_path):
    c = Qwen2Config.preset(name)
    d = c.to_hf_dict()
    assert d["model_type"] == "qwen2" and d["architectures"] == ["Qwen2ForCausalLM"]
    assert d["rope_parameters"] == {"rope_type": "default", "rope_theta": c.rope_theta}
    assert d["rope_theta"] == c.rope_theta
    assert Qwen2Config.from_hf(d) == c
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert Qwen2Config.from_hf(tmp_path) == c  # a checkpoint directory
    assert Qwen2Config.from_hf(tmp_path / "config.json") == c


def test_rope_theta_is_read_from_either_place():
    base = Qwen2Config.preset("tiny").to_hf_dict()
    v5 = {k: v for k, v in base.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {"rope_type": "default", "rope_theta": 12345.0}
    assert Qwen2Config.from_hf(v5).rope_theta == 12345.0
    v4 = {k: v for k, v in base.items() if k != "rope_parameters"}
    v4["rope_theta"] = 777.0
    assert Qwen2Config.from_hf(v4).rope_theta == 777.0
    both = dict(base, rope_theta=1.0)
    with pytest.raises(ValueError, match="two different rope_theta"):
        Qwen2Config.from_hf(both)


def test_reads_the_config_json_that_transformers_writes(tmp_path):
    transformers = pytest.importorskip("transformers")
    hf = transformers.Qwen2Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=4321.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    hf.save_pretrained(tmp_path)
    assert "rope_parameters" in json.loads((tmp_path / "config.json").read_text())
    c = Qwen2Config.from_hf(tmp_path)
    assert (c.rope_theta, c.tie_word_embeddings, c.num_kv_groups) == (4321.0, True, 2)
    assert (c.bos_token_id, c.eos_token_id, c.max_position_embeddings) == (1, 2, 32768)


@pytest.mark.parametrize("name", ["qwen2.5-math-7b", "qwen2.5-0.5b", "tiny"])
def test_transformers_reads_our_hf_dict_back(name):
    transformers = pytest.importorskip("transformers")
    c = Qwen2Config.preset(name)
    hf = transformers.Qwen2Config.from_dict(c.to_hf_dict())
    assert hf.rope_parameters["rope_theta"] == c.rope_theta
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
    ):
        assert getattr(hf, key) == getattr(c, key), key
    assert hf.layer_types == ["full_attention"] * c.num_hidden_layers


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"hidden_size": 0}, "hidden_size"),
        ({"vocab_size": 10.5}, "vocab_size"),
        ({"num_key_value_heads": 3}, "num_attention_heads"),
        ({"hidden_size": 66}, "hidden_size"),
        ({"rope_theta": -1.0}, "rope_theta"),
        ({"rms_norm_eps": 0}, "rms_norm_eps"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"attention_dropout": 0.1}, "attention_dropout"),
        ({"bos_token_id": "a"}, "bos_token_id"),
        ({"eos_token_id": [1, "x"]}, "eos_token_id"),
        ({"num_hidden_layers": True}, "num_hidden_layers"),
    ],
)
def test_validation_names_the_field(change, field):
    fields = dataclasses.asdict(Qwen2Config.preset("tiny"))
    with pytest.raises(ValueError, match=field):
        Qwen2Config(**{**fields, **change})


def test_from_hf_refuses_what_it_cannot_model():
    base = Qwen2Config.preset("tiny").to_hf_dict()
    with pytest.raises(ValueError, match="model_type"):
        Qwen2Config.from_hf(dict(base, model_type="llama"))
    with pytest.raises(ValueError, match="yarn"):
        Qwen2Config.from_hf(dict(base, rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(ValueError, match="mlp_bias"):
        Qwen2Config.from_hf(dict(base, mlp_bias=True))
    with pytest.raises(ValueError, match="layer_types"):
        Qwen2Config.from_hf(dict(base, layer_types=["full_attention", "sliding_attention"]))
    with pytest.raises(ValueError, match="use_mrope"):
        Qwen2Config.from_hf(dict(base, use_mrope=True))
    assert Qwen2Config.from_hf(dict(base, use_mrope=False, layer_types=["full_attention"] * 2))
    with pytest.raises(ValueError, match="head_dim"):
        Qwen2Config.from_hf(dict(base, head_dim=32))
    assert Qwen2Config.from_hf(dict(base, head_dim=16)).head_dim == 16
    with pytest.raises(ValueError, match="vocab_size"):
        Qwen2Config.from_hf({k: v for k, v in base.items() if k != "vocab_size"})


def test_eos_list_becomes_a_tuple_and_is_written_as_a_list():
    c = Qwen2Config.preset("tiny").replace(eos_token_id=[151645, 151643])
    assert c.eos_token_id == (151645, 151643)
    assert c.to_hf_dict()["eos_token_id"] == [151645, 151643]
    assert Qwen2Config.from_hf(c.to_hf_dict()) == c
    hash(c)  # frozen and hashable: usable as a static jit argument


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"qwen2\.5-7b"):
        Qwen2Config.preset("qwen2.5-72b")


def test_model_options():
    o = ModelOptions()
    assert o.param_dtype == jnp.float32 and o.compute_dtype == jnp.float32 and o.remat == "none"
    with pytest.raises(ValueError, match="remat"):
        ModelOptions(remat="sometimes")
    with pytest.raises(ValueError, match="compute_dtype"):
        ModelOptions(compute_dtype=jnp.int32)
    with pytest.raises(ValueError, match="scan_unroll"):
        ModelOptions(scan_unroll=0)
