"""LoRA adapters (`models.lora`) against transformers + PEFT on CPU torch (fp32): the same
logits and adapter gradients, PEFT's files both ways, and the merged HF export equal to PEFT's
merge_and_unload."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from bapo_jax.models import ModelOptions, Qwen2Config, init_model, load_pretrained  # noqa: E402
from bapo_jax.models import lora as lora_lib  # noqa: E402
from bapo_jax.models.config import LORA_TARGETS, LoRAConfig  # noqa: E402
from bapo_jax.models.hf import save_pretrained  # noqa: E402

from .hf_fixtures import TinySpec, left_padded_batch, make_hf_checkpoint, torch_logits  # noqa: E402

TOL = 1e-4
SPEC = TinySpec(heads=4, kv_heads=2, head_dim=16, tied=False, layers=2)
LORA = LoRAConfig(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def adapted(tmp_path_factory):
    """A tiny HF checkpoint and PEFT's LoRA on it with random A and B (every target), saved."""
    base_dir = tmp_path_factory.mktemp("base")
    reference = make_hf_checkpoint(base_dir, SPEC, seed=3)
    config = peft.LoraConfig(
        r=LORA.rank,
        lora_alpha=LORA.alpha,
        target_modules=list(LORA_TARGETS),
        lora_dropout=0.0,
        init_lora_weights=False,  # B random too: the adapter changes the logits
    )
    torch.manual_seed(7)
    model = peft.get_peft_model(reference, config)
    model.eval()
    adapter_dir = tmp_path_factory.mktemp("adapter")
    model.save_pretrained(str(adapter_dir))
    return base_dir, adapter_dir, model


def ours(base_dir, adapter_dir):
    lora, adapters = lora_lib.load_peft(adapter_dir, Qwen2Config.from_hf(base_dir))
    return load_pretrained(base_dir, options=ModelOptions(lora=lora), adapters=adapters)


def test_a_peft_adapter_gives_peft_logits(adapted):
    base_dir, adapter_dir, reference = adapted
    model = ours(base_dir, adapter_dir)
    assert model.layers.lora == LORA
    ids, mask = left_padded_batch(SPEC.vocab, [10, 7, 3], 10, seed=2)
    got = np.asarray(model(jnp.asarray(ids), attention_mask=jnp.asarray(mask)))
    want = torch_logits(reference, ids, mask)
    assert np.max(np.abs(got - want) * mask[..., None]) <= TOL
    with reference.disable_adapter():  # the adapter does move them
        base = torch_logits(reference, ids, mask)
    assert np.max(np.abs(want - base) * mask[..., None]) > 100 * TOL


def test_adapter_gradients_equal_peft(adapted):
    """d(sum(logits * w)) / d(lora_A, lora_B) for every layer and target, both frameworks."""
    base_dir, adapter_dir, reference = adapted
    model = ours(base_dir, adapter_dir)
    ids, mask = left_padded_batch(SPEC.vocab, [8, 5], 8, seed=4)
    weights = np.random.default_rng(5).normal(size=(2, 8, SPEC.vocab)).astype(np.float32)
    weights *= mask[..., None]
    graphdef, adapters, rest = nnx.split(model, lora_lib.LoRAParam, ...)

    def loss(adapters):
        logits = nnx.merge(graphdef, adapters, rest)(
            jnp.asarray(ids), attention_mask=jnp.asarray(mask)
        )
        return jnp.sum(logits * weights)

    grads = nnx.to_pure_dict(jax.grad(loss)(adapters))["layers"]
    reference.zero_grad()
    out = reference(
        input_ids=torch.from_numpy(ids.astype(np.int64)),
        attention_mask=torch.from_numpy(mask.astype(np.int64)),
        position_ids=torch.from_numpy((np.cumsum(mask, -1) - 1).clip(0).astype(np.int64)),
    )
    (out.logits * torch.from_numpy(weights)).sum().backward()
    theirs = {
        name: p.grad.numpy()
        for name, p in reference.named_parameters()
        if "lora_" in name and p.grad is not None
    }
    ours_as_peft = {
        k.replace(".weight", ".default.weight"): v
        for k, v in lora_lib.peft_tensors(grads, LORA).items()
    }
    assert len(ours_as_peft) == 2 * len(LORA_TARGETS) * SPEC.layers
    for name, grad in ours_as_peft.items():
        np.testing.assert_allclose(grad, theirs[name], rtol=1e-3, atol=1e-4, err_msg=name)


def test_save_load_round_trips_exactly_and_peft_loads_ours(adapted, tmp_path):
    base_dir, adapter_dir, reference = adapted
    model = ours(base_dir, adapter_dir)
    adapters = {k: np.asarray(v) for k, v in model.layers.adapters(jnp.float32).items()}
    mine = tmp_path / "mine"
    lora_lib.save_peft(mine, adapters, LORA, base_model=str(base_dir))
    lora, back = lora_lib.load_peft(mine, model.config)
    assert lora == LORA and back.keys() == adapters.keys()
    for name in adapters:
        np.testing.assert_array_equal(back[name], adapters[name])
    import transformers

    fresh = transformers.Qwen2ForCausalLM.from_pretrained(str(base_dir))
    loaded = peft.PeftModel.from_pretrained(fresh, str(mine)).eval()
    ids, mask = left_padded_batch(SPEC.vocab, [6, 6], 6, seed=6)
    np.testing.assert_allclose(
        torch_logits(loaded, ids, mask), torch_logits(reference, ids, mask), atol=1e-5
    )


def test_merged_export_equals_peft_merge_and_unload(adapted, tmp_path):
    base_dir, adapter_dir, reference = adapted
    save_pretrained(ours(base_dir, adapter_dir), tmp_path / "merged")
    from safetensors.numpy import load_file

    exported = load_file(str(tmp_path / "merged" / "model.safetensors"))
    import copy

    merged = copy.deepcopy(reference).merge_and_unload().state_dict()
    assert exported.keys() == {k for k in merged if k != "lm_head.weight"} | {"lm_head.weight"}
    for name, tensor in exported.items():
        np.testing.assert_allclose(tensor, merged[name].numpy(), atol=1e-5, err_msg=name)


def test_fresh_adapters_leave_the_base_model_unchanged():
    config = Qwen2Config.preset("tiny")
    base = init_model(config, seed=0)
    adapted = init_model(config, ModelOptions(lora=LoRAConfig(rank=2, targets=("q_proj",))), seed=0)
    ids = jnp.asarray(np.random.default_rng(0).integers(3, config.vocab_size, (2, 6)))
    np.testing.assert_array_equal(np.asarray(adapted(ids)), np.asarray(base(ids)))
    a = adapted.layers.adapters(jnp.float32)
    assert set(a) == {"q_proj_lora_a", "q_proj_lora_b"}
    assert not np.any(np.asarray(a["q_proj_lora_b"])) and np.any(np.asarray(a["q_proj_lora_a"]))
    axes = lora_lib.adapter_axes(adapted)
    assert axes["q_proj_lora_a"] == ("layers", "embed", "lora_rank")
    assert axes["q_proj_lora_b"] == ("layers", "lora_rank", "q_heads", "head_dim")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"rank": 0}, "rank must be an int >= 1"),
        ({"alpha": 0.0}, "alpha must be > 0"),
        ({"targets": ("qkv",)}, "targets must be distinct names"),
        ({"targets": ()}, "targets must be distinct names"),
    ],
)
def test_bad_lora_configs_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(LORA, **kwargs)
