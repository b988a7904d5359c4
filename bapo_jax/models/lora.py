"""LoRA adapters on the decoder's matrices, and PEFT's file format both ways.

An adapted matrix W [in..., out...] (the stacked training layout, `qwen2.DecoderStack`: q/k/v
[D, N|K, H], o [N, H, D], gate/up [D, F], down [F, D]) becomes

    W' = W + s A B,   s = alpha / r,   A [in..., r],  B [r, out...]

per layer (`LoRAConfig`). The adapters are `LoRAParam` variables of the decoder stack, not
`nnx.Param`s, so everything that reads the base weights (HF export of the base, the sharding
of the base, the vLLM sync of the base) is unchanged; their logical axes derive from the
matrix's own declaration (its in-axes + "lora_rank", "lora_rank" + its out-axes).

How the forward applies them: `LoraProjections` merges each layer's W' inside the scanned
layer body (one layer's matrices at a time, in the compute dtype) and runs the usual
projections with their custom VJPs; autodiff then gives A and B their gradients through the
merge. (Unmerged, x W + s (x A) B would skip the base weights' gradient GEMMs; merging keeps
every projection, and its memory-saving backward, in one place.)

PEFT stores, per layer and target, ``base_model.model.model.layers.{i}.<self_attn|mlp>.<t>.
lora_A.weight`` [r, in] and ``...lora_B.weight`` [out, r] (torch Linear layout), beside an
``adapter_config.json`` (`save_peft`, `load_peft`); the merged model is `merged_stacked`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array

from bapo_jax.models import layers as L
from bapo_jax.models.config import LoRAConfig, Qwen2Config

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "LoRAParam",
    "LoraProjections",
    "adapter_axes",
    "adapter_names",
    "adapter_shapes",
    "create",
    "in_dims",
    "initial_adapters",
    "load_peft",
    "merge",
    "merged_stacked",
    "peft_tensors",
    "read_adapter_config",
    "save_peft",
    "set_adapters",
]

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
LORA_RANK = "lora_rank"
# The leading (input) dims of each target's stacked matrix, after the "layers" axis.
_IN_DIMS = {"q_proj": 1, "k_proj": 1, "v_proj": 1, "o_proj": 2}
_MODULE = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn"}
_MODULE |= {"o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


class LoRAParam(nnx.Variable):
    """A LoRA adapter matrix: trained while the base `nnx.Param`s stay frozen."""


def in_dims(target: str) -> int:
    """How many of a target matrix's dims (after "layers") are its input dims."""
    return _IN_DIMS.get(target, 1)


def adapter_names(target: str) -> tuple[str, str]:
    """The stacked-dict keys of a target's A and B."""
    return f"{target}_lora_a", f"{target}_lora_b"


def _uniform_a(key: Array, shape: tuple[int, ...], fan_in: int, dtype: Any) -> Array:
    """PEFT's A init, kaiming-uniform with a = sqrt(5): U(-1 / sqrt(fan_in), 1 / sqrt(fan_in))."""
    bound = 1.0 / math.sqrt(fan_in)
    return jax.random.uniform(key, shape, jnp.float32, -bound, bound).astype(dtype)


def create(
    weights: Mapping[str, nnx.Param], lora: LoRAConfig, rngs: nnx.Rngs, dtype: Any
) -> dict[str, LoRAParam]:
    """Fresh adapters for the stacked matrices `weights` (target -> [L, in..., out...] Param):
    A uniform (`_uniform_a`), B zero, so the adapted model starts equal to the base."""
    out = {}
    for target in lora.targets:
        w = weights[target]
        shape, axes = w.get_value().shape, tuple(w.get_metadata("out_sharding"))
        k = in_dims(target)
        a_shape = (shape[0], *shape[1 : 1 + k], lora.rank)  # [L, in..., r]
        b_shape = (shape[0], lora.rank, *shape[1 + k :])  # [L, r, out...]
        a = _uniform_a(rngs.params(), a_shape, math.prod(shape[1 : 1 + k]), dtype)
        name_a, name_b = adapter_names(target)
        out[name_a] = LoRAParam(a, out_sharding=(*axes[: 1 + k], LORA_RANK), eager_sharding=False)
        out[name_b] = LoRAParam(
            jnp.zeros(b_shape, dtype),
            out_sharding=(axes[0], LORA_RANK, *axes[1 + k :]),
            eager_sharding=False,
        )
    return out


def initial_adapters(
    config: Qwen2Config, lora: LoRAConfig, seed: int, dtype: Any = jnp.float32
) -> dict[str, np.ndarray]:
    """Fresh adapters (as `create` makes them) as host arrays, for a model loaded from a
    checkpoint (`hf.load_pretrained`); one key per target from `seed`."""
    keys = jax.random.split(jax.random.key(seed), len(lora.targets))
    out = {}
    for key, target in zip(keys, lora.targets, strict=True):
        a_shape, b_shape = adapter_shapes(config, target, lora.rank)
        name_a, name_b = adapter_names(target)
        fan_in = math.prod(a_shape[1:-1])
        out[name_a] = np.asarray(_uniform_a(key, a_shape, fan_in, dtype))
        out[name_b] = np.zeros(b_shape, np.dtype(jnp.dtype(dtype)))
    return out


def adapter_axes(model: nnx.Module) -> dict[str, tuple[str, ...]]:
    """Each adapter's logical axes, as its `LoRAParam` declares them (name -> axes)."""
    state = nnx.to_pure_dict(
        jax.tree.map(
            lambda v: tuple(v.get_metadata("out_sharding")),
            nnx.state(model, LoRAParam),
            is_leaf=lambda v: isinstance(v, nnx.Variable),
        )
    )
    return dict(state.get("layers", {}))


def set_adapters(model: nnx.Module, adapters: Mapping[str, np.ndarray]) -> None:
    """Puts `adapters` (name -> stacked array, e.g. `load_peft`'s) into `model`'s LoRAParams,
    each cast to its variable's dtype; a name it lacks or a shape it does not have is refused."""
    stack = model.layers
    if stack.lora is None:
        raise ValueError("set_adapters: the model has no LoRA adapters (ModelOptions.lora)")
    expected = {n for t in stack.lora.targets for n in adapter_names(t)}
    if set(adapters) != expected:
        raise ValueError(f"set_adapters: got {sorted(adapters)}, the model has {sorted(expected)}")
    for name, array in adapters.items():
        variable = getattr(stack, name)
        current = variable.get_value()
        if tuple(np.shape(array)) != tuple(current.shape):
            raise ValueError(f"set_adapters: {name} is {np.shape(array)}, need {current.shape}")
        variable.set_value(jnp.asarray(array, current.dtype))


def merge(w: Array, a: Array, b: Array, scale: float) -> Array:
    """W + s A B for one layer's matrix (A [in..., r], B [r, out...]) in W's dtype."""
    delta = jnp.tensordot(a, b, axes=1)  # [in..., out...]
    return w + jnp.asarray(scale, w.dtype) * delta.astype(w.dtype)


def merged_stacked(stacked: Mapping[str, Array], lora: LoRAConfig) -> dict[str, Array]:
    """The stacked base matrices with every adapter merged in ([L, ...] each; the adapter
    keys dropped)."""
    out = {k: v for k, v in stacked.items() if "_lora_" not in k}
    for target in lora.targets:
        name_a, name_b = adapter_names(target)
        out[target] = jax.vmap(lambda w, a, b: merge(w, a, b, lora.scale))(
            stacked[target], stacked[name_a], stacked[name_b]
        )
    return out


class LoraProjections:
    """`layers.Projections` of the stacked training layout with adapters: each call merges the
    matrices it uses (per layer, inside the scan) and runs `layers.SEPARATE`'s."""

    _USES: ClassVar[dict[str, tuple[str, ...]]] = {
        "qkv": ("q_proj", "k_proj", "v_proj"),
        "output": ("o_proj",),
        "mlp": ("gate_proj", "up_proj", "down_proj"),
    }

    def __init__(self, lora: LoRAConfig):
        self.lora = lora

    def _merged(self, p: Mapping[str, Array], block: str) -> dict[str, Array]:
        out = dict(p)
        for target in self._USES[block]:
            if target in self.lora.targets:
                name_a, name_b = adapter_names(target)
                out[target] = merge(p[target], p[name_a], p[name_b], self.lora.scale)
        return out

    def qkv(self, p, x, eps):
        return L.SEPARATE.qkv(self._merged(p, "qkv"), x, eps)

    def output(self, p, x, a):
        return L.SEPARATE.output(self._merged(p, "output"), x, a)

    def mlp(self, p, x, eps):
        return L.SEPARATE.mlp(self._merged(p, "mlp"), x, eps)


# ---- PEFT's format -----------------------------------------------------------------------------
def _peft_name(layer: int, target: str, which: str) -> str:
    return f"base_model.model.model.layers.{layer}.{_MODULE[target]}.{target}.lora_{which}.weight"


def peft_tensors(adapters: Mapping[str, np.ndarray], lora: LoRAConfig) -> dict[str, np.ndarray]:
    """Stacked adapters ([L, in..., r] and [L, r, out...] host arrays) -> PEFT's tensors:
    lora_A [r, in] and lora_B [out, r] per layer (torch Linear layout, flattened heads)."""
    out = {}
    for target in lora.targets:
        name_a, name_b = adapter_names(target)
        a, b = np.asarray(adapters[name_a]), np.asarray(adapters[name_b])
        for i in range(a.shape[0]):
            out[_peft_name(i, target, "A")] = np.ascontiguousarray(
                a[i].reshape(-1, lora.rank).T
            )  # [r, in]
            out[_peft_name(i, target, "B")] = np.ascontiguousarray(
                b[i].reshape(lora.rank, -1).T
            )  # [out, r]
    return out


def adapter_shapes(config: Qwen2Config, target: str, rank: int) -> tuple[tuple, tuple]:
    """A's and B's stacked shapes for `target` of `config`."""
    d, f = config.hidden_size, config.intermediate_size
    n, k, h, layers = (
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        config.num_hidden_layers,
    )
    io = {
        "q_proj": ((d,), (n, h)),
        "k_proj": ((d,), (k, h)),
        "v_proj": ((d,), (k, h)),
        "o_proj": ((n, h), (d,)),
        "gate_proj": ((d,), (f,)),
        "up_proj": ((d,), (f,)),
        "down_proj": ((f,), (d,)),
    }[target]
    return (layers, *io[0], rank), (layers, rank, *io[1])


def adapter_params(config: Qwen2Config, lora: LoRAConfig) -> int:
    """The adapters' parameter count (every layer's A and B of every target)."""
    return sum(
        math.prod(shape) for t in lora.targets for shape in adapter_shapes(config, t, lora.rank)
    )


def save_peft(
    path: str | os.PathLike,
    adapters: Mapping[str, np.ndarray],
    lora: LoRAConfig,
    *,
    base_model: str | None = None,
) -> None:
    """Writes `path` as a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors)
    that `peft.PeftModel.from_pretrained` loads onto the base model; written beside `path`
    and renamed into place."""
    from safetensors.numpy import save_file

    from bapo_jax.models.hf import replace_directory

    path = os.path.abspath(os.fspath(path))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.tmp-", dir=os.path.dirname(path))
    try:
        save_file(
            peft_tensors(adapters, lora),
            os.path.join(tmp, ADAPTER_WEIGHTS),
            metadata={"format": "pt"},
        )
        config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": lora.rank,
            "lora_alpha": lora.alpha,
            "lora_dropout": 0.0,
            "target_modules": sorted(lora.targets),
            "bias": "none",
            "fan_in_fan_out": False,
            "use_rslora": False,
            "inference_mode": True,
            "base_model_name_or_path": base_model,
        }
        with open(os.path.join(tmp, ADAPTER_CONFIG), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, sort_keys=True)
            f.write("\n")
        replace_directory(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_adapter_config(path: str | os.PathLike) -> LoRAConfig:
    """A PEFT adapter directory's `LoRAConfig`. Refused, naming the setting: anything but
    plain LoRA (bias, rsLoRA, DoRA, fan_in_fan_out; dropout is ignored: inference), a target
    outside `LORA_TARGETS`."""
    path = os.fspath(path)
    with open(os.path.join(path, ADAPTER_CONFIG), encoding="utf-8") as f:
        meta = json.load(f)
    for key, plain in (("peft_type", "LORA"), ("bias", "none"), ("use_rslora", False),
                       ("use_dora", False), ("fan_in_fan_out", False)):  # fmt: skip
        if meta.get(key, plain) != plain:
            raise ValueError(f"{path}: {ADAPTER_CONFIG} {key}={meta[key]!r}; only {plain!r} loads")
    targets = meta["target_modules"]
    targets = [targets] if isinstance(targets, str) else list(targets)
    return LoRAConfig(rank=int(meta["r"]), alpha=float(meta["lora_alpha"]), targets=tuple(targets))


def load_peft(
    path: str | os.PathLike, config: Qwen2Config
) -> tuple[LoRAConfig, dict[str, np.ndarray]]:
    """A PEFT LoRA adapter directory -> (its `LoRAConfig`, stacked adapters as host arrays);
    refused as `read_adapter_config` refuses, or for a tensor of the wrong shape."""
    from safetensors.numpy import load_file

    path = os.fspath(path)
    lora = read_adapter_config(path)
    tensors = load_file(os.path.join(path, ADAPTER_WEIGHTS))
    adapters = {}
    for target in lora.targets:
        for which, shape in zip("AB", adapter_shapes(config, target, lora.rank), strict=True):
            layers = []
            for i in range(shape[0]):
                name = _peft_name(i, target, which)
                if name not in tensors:
                    raise ValueError(f"{path}: {ADAPTER_WEIGHTS} has no {name}")
                t = tensors[name].T  # A: [in, r]; B: [r, out]
                rank = t.shape[-1] if which == "A" else t.shape[0]
                if t.size != math.prod(shape[1:]) or rank != lora.rank:
                    raise ValueError(
                        f"{path}: {name} is {tensors[name].shape}, not rank {lora.rank} of "
                        f"{shape[1:]}"
                    )
                layers.append(t.reshape(shape[1:]))
            adapters[adapter_names(target)["AB".index(which)]] = np.stack(layers)
    return lora, adapters
