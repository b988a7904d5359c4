"""HF checkpoints both ways: ``load_pretrained`` and ``save_pretrained``.

One name map (``weight_map``) ties every HF tensor name to a parameter of the NNX tree and says
how the layout changes (torch ``Linear`` weights are [out, in]; here projections are [in, ...]
with heads split out, and decoder-layer tensors live in stacked [L, ...] arrays). Both
directions, and the vLLM weight sync, use the same map.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from bapo_jax.models import lora as lora_lib
from bapo_jax.models.config import ModelOptions, Qwen2Config
from bapo_jax.models.qwen2 import Qwen2ForCausalLM, abstract_model, logical_axes
from bapo_jax.sharding import rules as sharding_rules

__all__ = [
    "TensorMapping",
    "iter_hf_tensors",
    "load_pretrained",
    "save_pretrained",
    "weight_map",
]

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5 * 1000**3  # transformers' default "5GB"

# HF tensors that carry no parameter (old checkpoints store RoPE buffers).
_IGNORABLE = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")

Shardings = Callable[[tuple[str, ...]], jax.sharding.Sharding]


@dataclasses.dataclass(frozen=True)
class TensorMapping:
    """One HF tensor (per layer when ``stacked``) <-> one parameter of the NNX tree.

    hf_name: HF tensor name; "{i}" stands for the layer index when ``stacked``.
    path:    keys of the parameter in ``nnx.to_pure_dict(nnx.state(model, nnx.Param))``.
    stacked: the parameter has a leading "layers" axis; HF has one tensor per layer.
    to_tree: HF layout -> tree layout (of one layer when stacked).
    to_hf:   tree layout -> HF layout.
    """

    hf_name: str
    path: tuple[str, ...]
    stacked: bool
    to_tree: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]

    def hf_names(self, config: Qwen2Config) -> list[str]:
        if not self.stacked:
            return [self.hf_name]
        return [self.hf_name.format(i=i) for i in range(config.num_hidden_layers)]


def _same(x: np.ndarray) -> np.ndarray:
    return x


def weight_map(config: Qwen2Config) -> list[TensorMapping]:
    """The HF <-> tree name/layout map for ``config`` (no ``lm_head`` when tied)."""
    n, k, h, d = (
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        config.hidden_size,
    )

    def heads_in(heads: int):  # torch Linear [heads*H, D] <-> [D, heads, H]
        return (
            lambda w: w.reshape(heads, h, d).transpose(2, 0, 1),
            lambda p: p.transpose(1, 2, 0).reshape(heads * h, d),
        )

    def heads_bias(heads: int):  # [heads*H] <-> [heads, H]
        return (lambda b: b.reshape(heads, h), lambda p: p.reshape(heads * h))

    out_heads = (  # o_proj: torch [D, N*H] <-> [N, H, D]
        lambda w: w.reshape(d, n, h).transpose(1, 2, 0),
        lambda p: p.transpose(2, 0, 1).reshape(d, n * h),
    )
    linear = (lambda w: w.T, lambda p: p.T)  # torch [out, in] <-> [in, out]
    same = (_same, _same)

    pre = "model.layers.{i}."
    layer: list[tuple[str, str, tuple]] = [
        ("input_layernorm.weight", "input_layernorm", same),
        ("self_attn.q_proj.weight", "q_proj", heads_in(n)),
        ("self_attn.q_proj.bias", "q_bias", heads_bias(n)),
        ("self_attn.k_proj.weight", "k_proj", heads_in(k)),
        ("self_attn.k_proj.bias", "k_bias", heads_bias(k)),
        ("self_attn.v_proj.weight", "v_proj", heads_in(k)),
        ("self_attn.v_proj.bias", "v_bias", heads_bias(k)),
        ("self_attn.o_proj.weight", "o_proj", out_heads),
        ("post_attention_layernorm.weight", "post_attention_layernorm", same),
        ("mlp.gate_proj.weight", "gate_proj", linear),
        ("mlp.up_proj.weight", "up_proj", linear),
        ("mlp.down_proj.weight", "down_proj", linear),
    ]
    maps = [TensorMapping("model.embed_tokens.weight", ("embed_tokens",), False, *same)]
    maps += [TensorMapping(pre + hf, ("layers", name), True, *fns) for hf, name, fns in layer]
    maps.append(TensorMapping("model.norm.weight", ("norm",), False, *same))
    if not config.tie_word_embeddings:
        maps.append(TensorMapping("lm_head.weight", ("lm_head",), False, *same))
    return maps


def _get(tree: dict, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


# ---- loading -----------------------------------------------------------------------------------
def _tensor_files(path: str) -> dict[str, str]:
    """HF tensor name -> safetensors file that holds it."""
    index = os.path.join(path, SAFE_INDEX)
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            names = json.load(f)["weight_map"]
        return {name: os.path.join(path, file) for name, file in names.items()}
    single = os.path.join(path, SAFE_SINGLE)
    files = (
        [single]
        if os.path.exists(single)
        else sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    )
    if not files:
        raise FileNotFoundError(f"no *.safetensors checkpoint in {path}")
    out: dict[str, str] = {}
    for file in files:
        with safe_open(file, framework="numpy") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                out[name] = file
    return out


class _Reader:
    """Reads tensors one at a time, keeping at most one safetensors file open."""

    def __init__(self, files: dict[str, str]):
        self.files = files
        self._file: str | None = None
        self._handle: Any = None

    def get(self, name: str) -> np.ndarray:
        if name not in self.files:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        file = self.files[name]
        if file != self._file:
            self.close()
            self._handle = safe_open(file, framework="numpy").__enter__()
            self._file = file
        return self._handle.get_tensor(name)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.__exit__(None, None, None)
        self._handle, self._file = None, None


def load_pretrained(
    path: str | os.PathLike,
    *,
    dtype: Any = jnp.float32,
    mesh: jax.sharding.Mesh | None = None,
    options: ModelOptions | None = None,
    shardings: Shardings | None = None,
    adapters: Mapping[str, np.ndarray] | None = None,
    seed: int = 0,
) -> Qwen2ForCausalLM:
    """Load an HF Qwen2 checkpoint directory (config.json + safetensors, single or sharded).

    dtype:     parameter dtype (the compute dtype is ``options.compute_dtype``).
    mesh:      when given, each parameter is placed straight into its sharding on this mesh.
    shardings: maps a parameter's logical axes (e.g. ``("layers", "embed", "mlp")``) to its
               ``jax.sharding.Sharding``. Default with a mesh: the project's logical-axis rules
               (``bapo_jax.sharding.rules.DEFAULT_RULES``) on that mesh.
    adapters:  with ``options.lora``, the LoRA adapters' stacked arrays (e.g. from
               `lora.load_peft`); None: fresh ones from ``seed`` (B = 0: the base model's
               outputs).

    Tensors are read one at a time; each stacked parameter is filled layer by layer into one
    preallocated host buffer, converted to a device array once, and the buffer dropped, so the
    host never holds the model twice.
    """
    path = os.fspath(path)
    config = Qwen2Config.from_hf(path)
    options = dataclasses.replace(options or ModelOptions(), param_dtype=dtype)
    np_dtype = np.dtype(jnp.dtype(dtype))
    if shardings is None and mesh is not None:
        shardings = lambda axes: jax.sharding.NamedSharding(
            mesh, sharding_rules.logical_to_spec(axes)
        )

    abstract = abstract_model(config, options)
    graphdef, state = nnx.split(abstract)
    shapes = nnx.to_pure_dict(state)
    axes = logical_axes(abstract)
    files = _tensor_files(path)
    maps = weight_map(config)
    expected = {name for m in maps for name in m.hf_names(config)}
    unexpected = sorted(
        name
        for name in files
        if name not in expected
        and not _IGNORABLE.match(name)
        and not (config.tie_word_embeddings and name == "lm_head.weight")
    )
    missing = sorted(expected - set(files))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path} does not match its config: missing {missing[:8]}"
            f"{'...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
            f"{'...' if len(unexpected) > 8 else ''}"
        )

    reader = _Reader(files)
    values: dict = {}
    try:
        for m in maps:
            shape = tuple(_get(shapes, m.path).shape)
            buf = np.empty(shape, np_dtype)  # [L, ...] or the full tensor
            for i, name in enumerate(m.hf_names(config)):
                tensor = m.to_tree(reader.get(name))
                dst = buf[i] if m.stacked else buf
                if tensor.shape != dst.shape:
                    raise ValueError(
                        f"{name}: shape {tensor.shape} (tree layout) does not match the "
                        f"config's {dst.shape}"
                    )
                dst[...] = tensor  # casts to the parameter dtype
                del tensor
            _set(values, m.path, _place(buf, _get(axes, m.path), shardings))
            del buf
    finally:
        reader.close()
    if options.lora is not None:
        if adapters is None:
            adapters = lora_lib.initial_adapters(config, options.lora, seed, dtype)
        for name, axes_of in lora_lib.adapter_axes(abstract).items():
            array = np.asarray(adapters[name], np_dtype)
            expected_shape = tuple(shapes["layers"][name].shape)
            if array.shape != expected_shape:
                raise ValueError(f"adapters[{name!r}]: shape {array.shape}, need {expected_shape}")
            values["layers"][name] = _place(array, axes_of, shardings)
    nnx.replace_by_pure_dict(state, values)
    return nnx.merge(graphdef, state)


def _place(buf: np.ndarray, axes: tuple[str, ...], shardings: Shardings | None) -> jax.Array:
    if shardings is None:
        return jnp.asarray(buf)
    sharding = shardings(axes)
    # Each device receives only its own slice of the host buffer.
    return jax.make_array_from_callback(buf.shape, sharding, lambda idx: buf[idx])


# ---- saving ------------------------------------------------------------------------------------
def iter_hf_tensors(
    model: Qwen2ForCausalLM, *, dtype: Any = None
) -> Iterator[tuple[str, np.ndarray]]:
    """Yield ``(hf_name, host array in HF layout)`` one tensor at a time (stacked parameters
    are sliced per layer on device, so a single HF tensor is on the host at once). A model
    with LoRA adapters yields its merged matrices, W + s A B (`models.lora`)."""
    config = model.config
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    if model.layers.lora is not None:
        dtype_in = model.layers.q_proj.get_value().dtype
        merged = model.layers.merged(dtype_in)
        params["layers"] = {**params["layers"], **{t: merged[t] for t in model.layers.lora.targets}}
    for m in weight_map(config):
        array = _get(params, m.path)
        for i, name in enumerate(m.hf_names(config)):
            piece = array[i] if m.stacked else array
            host = np.asarray(jax.device_get(piece))
            if dtype is not None:
                host = host.astype(np.dtype(jnp.dtype(dtype)))
            yield name, np.ascontiguousarray(m.to_hf(host))


def save_pretrained(
    model: Qwen2ForCausalLM,
    path: str | os.PathLike,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dtype: Any = None,
    generation_config: Mapping[str, Any] | None = None,
    extra_files: Callable[[str], None] | None = None,
) -> None:
    """Write ``path`` as an HF checkpoint transformers and vLLM load as-is.

    config.json + ``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` with
    ``model.safetensors.index.json`` when the tensors exceed ``max_shard_bytes``. Tied models
    write no ``lm_head.weight``. ``dtype`` converts on the way out (default: parameter dtype).
    generation_config.json holds the config's bos/eos ids, updated by ``generation_config``
    (e.g. every eos id and the pad id of the tokenizer). ``extra_files(directory)`` writes more
    files into the checkpoint (the tokenizer's) before it is renamed into place.
    The directory is written beside ``path`` and renamed into place, so a reader never sees a
    half-written checkpoint (an existing ``path`` is replaced).
    """
    path = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    config = model.config
    out_dtype = (
        jnp.dtype(dtype) if dtype is not None else jnp.dtype(model.embed_tokens.get_value().dtype)
    )
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.tmp-", dir=parent)
    try:
        shards: list[tuple[str, list[str]]] = []
        current: dict[str, np.ndarray] = {}
        current_bytes = total = 0

        def flush() -> None:
            nonlocal current, current_bytes
            if current:
                name = f"shard-{len(shards):05d}.safetensors"
                save_file(current, os.path.join(tmp, name), metadata={"format": "pt"})
                shards.append((name, list(current)))
            current, current_bytes = {}, 0

        for name, tensor in iter_hf_tensors(model, dtype=out_dtype):
            if current and current_bytes + tensor.nbytes > max_shard_bytes:
                flush()
            current[name] = tensor
            current_bytes += tensor.nbytes
            total += tensor.nbytes
        flush()

        if len(shards) == 1:
            os.rename(os.path.join(tmp, shards[0][0]), os.path.join(tmp, SAFE_SINGLE))
        else:
            weight_index: dict[str, str] = {}
            for k, (name, tensors) in enumerate(shards):
                final = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
                os.rename(os.path.join(tmp, name), os.path.join(tmp, final))
                weight_index.update(dict.fromkeys(tensors, final))
            index = {"metadata": {"total_size": total}, "weight_map": weight_index}
            _write_json(os.path.join(tmp, SAFE_INDEX), index)
        _write_json(os.path.join(tmp, "config.json"), config.to_hf_dict(dtype=out_dtype))
        generation = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}
        generation.update(generation_config or {})
        if isinstance(generation["eos_token_id"], tuple):
            generation["eos_token_id"] = list(generation["eos_token_id"])
        _write_json(os.path.join(tmp, "generation_config.json"), generation)
        if extra_files is not None:
            extra_files(tmp)

        replace_directory(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def replace_directory(tmp: str, path: str) -> None:
    """Move the finished directory `tmp` to `path` (same parent) by a rename; an existing
    `path` is moved aside first and deleted after, so `path` is never half written."""
    if os.path.exists(path):
        old = tempfile.mkdtemp(
            prefix=f".{os.path.basename(path)}.old-", dir=os.path.dirname(path) or "."
        )
        os.rename(path, os.path.join(old, "x"))
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, path)


def _write_json(file: str, obj: Any) -> None:
    with open(file, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
