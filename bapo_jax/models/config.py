"""Qwen2-architecture configuration (what an HF ``config.json`` describes) and runtime options.

``Qwen2Config`` holds the architecture only: it is what ``config.json`` says and what a checkpoint
needs to be read back. How the model is *run* (parameter dtype, compute dtype, remat policy) is in
the separate ``ModelOptions``, so the same config serves a bf16 GPU run and an fp32 parity test.
The named presets (``PRESETS``, ``Qwen2Config.preset``) are in ``presets.py``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any, Literal

import jax.numpy as jnp

from bapo_jax.checks import check_choice

__all__ = ["LORA_TARGETS", "LoRAConfig", "ModelOptions", "Qwen2Config", "RematPolicy"]

# Keys of an HF Qwen2 config.json that carry no architecture information for this port (runtime
# flags of transformers, bookkeeping); accepted on read, never needed.
_IGNORED_HF_KEYS = frozenset(
    {
        "_name_or_path",
        "_attn_implementation_autoset",
        "architectures",
        "model_type",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "use_cache",
        "output_hidden_states",
        "output_attentions",
        "return_dict",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "id2label",
        "label2id",
        "problem_type",
        "tie_encoder_decoder",
        "unsloth_fixed",
        "unsloth_version",
        "quantization_config",
    }
)


@dataclasses.dataclass(frozen=True)
class Qwen2Config:
    """Architecture of a Qwen2 decoder, field names as in HF ``config.json``.

    ``head_dim`` is derived (``hidden_size // num_attention_heads``), as in HF Qwen2.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int = 32768
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 151643
    eos_token_id: int | tuple[int, ...] | None = 151643
    pad_token_id: int | None = None
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    attention_dropout: float = 0.0
    # Sliding-window fields exist in every Qwen2 config.json; all supported checkpoints have
    # use_sliding_window=false, so they are carried for a faithful round trip only.
    use_sliding_window: bool = False
    sliding_window: int | None = None
    max_window_layers: int = 28

    def __post_init__(self) -> None:
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"Qwen2Config.{name} must be a positive int, got {value!r}")
        for name in ("rope_theta", "rms_norm_eps", "initializer_range"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"Qwen2Config.{name} must be a positive number, got {value!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                "Qwen2Config.hidden_size must be divisible by num_attention_heads, got "
                f"hidden_size={self.hidden_size}, num_attention_heads={self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                "Qwen2Config.num_attention_heads must be a multiple of num_key_value_heads, got "
                f"{self.num_attention_heads} and {self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"Qwen2Config.head_dim must be even for RoPE, got {self.head_dim}")
        if self.hidden_act != "silu":
            raise ValueError(f"Qwen2Config.hidden_act must be 'silu', got {self.hidden_act!r}")
        if self.use_sliding_window:
            raise ValueError("Qwen2Config.use_sliding_window=True is not supported")
        if self.attention_dropout != 0.0:
            raise ValueError(
                f"Qwen2Config.attention_dropout must be 0.0, got {self.attention_dropout!r}"
            )
        for name in ("bos_token_id", "pad_token_id"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"Qwen2Config.{name} must be an int or None, got {value!r}")
        eos = self.eos_token_id
        eos_ids = eos if isinstance(eos, tuple) else (() if eos is None else (eos,))
        if any(isinstance(i, bool) or not isinstance(i, int) for i in eos_ids):
            raise ValueError(f"Qwen2Config.eos_token_id must be int(s) or None, got {eos!r}")

    # ---- derived -------------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_kv_groups(self) -> int:
        """Query heads per KV head (G in the [K, G] split of the query heads)."""
        return self.num_attention_heads // self.num_key_value_heads

    def num_params(self) -> int:
        d, f, h = self.hidden_size, self.intermediate_size, self.head_dim
        n, k = self.num_attention_heads, self.num_key_value_heads
        attn = d * n * h + 2 * d * k * h + (n + 2 * k) * h + n * h * d
        layer = attn + 3 * d * f + 2 * d
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.num_hidden_layers * layer + d + head

    def replace(self, **changes: Any) -> Qwen2Config:
        return dataclasses.replace(self, **changes)

    # ---- HF config.json ------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, path_or_dict: str | os.PathLike | Mapping[str, Any]) -> Qwen2Config:
        """Read an HF ``config.json`` (a dict, the file, or the checkpoint directory).

        ``rope_theta`` is read from the top level (transformers 4) or from ``rope_parameters``
        (transformers 5); only the default RoPE (no scaling) is supported.
        """
        if isinstance(path_or_dict, Mapping):
            raw = dict(path_or_dict)
        else:
            path = os.fspath(path_or_dict)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
        model_type = raw.get("model_type", "qwen2")
        if model_type != "qwen2":
            raise ValueError(f"config.json model_type must be 'qwen2', got {model_type!r}")

        layer_types = raw.pop("layer_types", None)
        if layer_types is not None and any(t != "full_attention" for t in layer_types):
            raise ValueError(f"config.json layer_types {sorted(set(layer_types))} not supported")
        if raw.pop("use_mrope", False):
            raise ValueError("config.json use_mrope=true (multimodal RoPE) is not supported")
        rope_theta = raw.pop("rope_theta", None)
        rope_parameters = raw.pop("rope_parameters", None)
        rope_scaling = raw.pop("rope_scaling", None)
        for rope in (rope_parameters, rope_scaling):
            if rope is None:
                continue
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            if rope_type != "default":
                raise ValueError(f"config.json rope type {rope_type!r} is not supported")
            if "rope_theta" in rope:
                if rope_theta is not None and float(rope["rope_theta"]) != float(rope_theta):
                    raise ValueError(
                        "config.json has two different rope_theta values: "
                        f"{rope_theta} (top level) and {rope['rope_theta']} (rope parameters)"
                    )
                rope_theta = rope["rope_theta"]
        head_dim = raw.pop("head_dim", None)

        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        unknown = []
        for key, value in raw.items():
            if key in fields:
                kwargs[key] = value
            elif key not in _IGNORED_HF_KEYS:
                unknown.append(key)
        if unknown:
            # Architecture keys we do not model would silently change the network: refuse.
            raise ValueError(f"config.json has keys this Qwen2 port does not support: {unknown}")
        if rope_theta is not None:
            kwargs["rope_theta"] = float(rope_theta)
        if "num_key_value_heads" not in kwargs and "num_attention_heads" in kwargs:
            kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
        if "sliding_window" in kwargs and kwargs["sliding_window"] is not None:
            kwargs["sliding_window"] = int(kwargs["sliding_window"])
        missing = [
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.name not in kwargs
        ]
        if missing:
            raise ValueError(f"config.json is missing required keys: {missing}")
        config = cls(**kwargs)
        if head_dim is not None and int(head_dim) != config.head_dim:
            raise ValueError(
                f"config.json head_dim={head_dim} differs from hidden_size // "
                f"num_attention_heads = {config.head_dim}; not supported"
            )
        return config

    def to_hf_dict(self, *, dtype: Any = None) -> dict[str, Any]:
        """An HF ``config.json`` dict that transformers 5 and vLLM load as ``Qwen2ForCausalLM``.

        RoPE theta is written both at the top level (read by transformers 4 / older vLLM) and in
        ``rope_parameters`` (the transformers 5 form).
        """
        out: dict[str, Any] = {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
        }
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        out["rope_theta"] = float(self.rope_theta)
        out["rope_parameters"] = {"rope_type": "default", "rope_theta": float(self.rope_theta)}
        out["rope_scaling"] = None
        if dtype is not None:
            name = jnp.dtype(dtype).name
            out["torch_dtype"] = name
        out["use_cache"] = True
        return dict(sorted(out.items()))

    # ---- presets (``presets.py``) ----------------------------------------------------------------
    @classmethod
    def preset(cls, name: str) -> Qwen2Config:
        from bapo_jax.models.presets import PRESETS  # the table is built from this class

        try:
            return PRESETS[name]
        except KeyError:
            raise ValueError(
                f"unknown Qwen2Config preset {name!r}; known: {sorted(PRESETS)}"
            ) from None


RematPolicy = Literal["none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable"]
AttentionImpl = Literal["plain", "blockwise", "cudnn"]
# The decoder's matrices a LoRA adapter can target, as PEFT names them.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Low-rank adapters (Hu et al. 2021) on the decoder's matrices: W + (alpha / r) A B with
    A [in, r], B [r, out] per layer and target (`models.lora`; PEFT's LoRA, which stores
    lora_A [r, in] and lora_B [out, r]).

    rank:    r, the adapters' inner dimension.
    alpha:   lora_alpha; the update is scaled by alpha / r (PEFT's default scaling).
    targets: the matrices adapted, PEFT's names (`LORA_TARGETS`, every one by default; kept
             in that order).
    """

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = LORA_TARGETS

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRAConfig.rank must be an int >= 1, got {self.rank!r}")
        if not isinstance(self.alpha, int | float) or not self.alpha > 0:
            raise ValueError(f"LoRAConfig.alpha must be > 0, got {self.alpha!r}")
        targets = tuple(self.targets)
        unknown = [t for t in targets if t not in LORA_TARGETS]
        if not targets or unknown or len(set(targets)) != len(targets):
            raise ValueError(
                f"LoRAConfig.targets must be distinct names among {list(LORA_TARGETS)}, got "
                f"{list(self.targets)}"
            )
        # canonical order (PEFT stores a set): equal configs compare equal
        object.__setattr__(self, "targets", tuple(t for t in LORA_TARGETS if t in targets))

    @property
    def scale(self) -> float:
        """alpha / r."""
        return self.alpha / self.rank


@dataclasses.dataclass(frozen=True)
class ModelOptions:
    """How the model is run (not architecture).

    param_dtype:   dtype the parameters are stored in (fp32 for training).
    compute_dtype: dtype matmuls run in (bf16 on GPU; fp32 on CPU and in parity tests). RMSNorm
                   statistics, softmax and the logits are always fp32.
    remat:         rematerialisation of each scanned decoder layer in the backward pass:
                   "none" (fastest, most memory), "full" (recompute everything), or one of the
                   ``jax.checkpoint_policies`` that save matmul outputs.
    scan_unroll:   ``jax.lax.scan`` unroll factor over the layers (1 keeps compile time flat).
    attention:     the attention core (`bapo_jax.models.attention`, all numerically equal):
                   "plain" (dense [T, T] scores), "blockwise" (memory-efficient online softmax
                   with a recomputing custom VJP; any backend; long sequences), or "cudnn"
                   (``jax.nn.dot_product_attention`` flash attention; GPU only, errors elsewhere).
    attention_block_q, attention_block_kv: query / key tile lengths of "blockwise".
    lora:          low-rank adapters on the decoder's matrices (`LoRAConfig`; None: none).
    """

    param_dtype: Any = jnp.float32
    compute_dtype: Any = jnp.float32
    remat: RematPolicy = "none"
    scan_unroll: int = 1
    attention: AttentionImpl = "plain"
    attention_block_q: int = 512
    attention_block_kv: int = 512
    lora: LoRAConfig | None = None

    def __post_init__(self) -> None:
        for name in ("param_dtype", "compute_dtype"):
            dt = jnp.dtype(getattr(self, name))
            if not jnp.issubdtype(dt, jnp.floating):
                raise ValueError(f"ModelOptions.{name} must be a float dtype, got {dt}")
        check_choice("ModelOptions.remat", self.remat, RematPolicy)
        if not isinstance(self.scan_unroll, int) or self.scan_unroll < 1:
            raise ValueError(
                f"ModelOptions.scan_unroll must be an int >= 1, got {self.scan_unroll}"
            )
        check_choice("ModelOptions.attention", self.attention, AttentionImpl)
        for name in ("attention_block_q", "attention_block_kv"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelOptions.{name} must be an int >= 1, got {value!r}")
        if self.lora is not None and not isinstance(self.lora, LoRAConfig):
            raise ValueError(f"ModelOptions.lora must be a LoRAConfig or None, got {self.lora!r}")
