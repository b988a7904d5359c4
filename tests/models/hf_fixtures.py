"""Random tiny Qwen2 checkpoints written by transformers itself (the parity reference).

torch/transformers are test-only dependencies: import this module only from tests.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import torch
import transformers


@dataclasses.dataclass(frozen=True)
class TinySpec:
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    layers: int = 2
    vocab: int = 300
    intermediate: int = 96
    tied: bool = False
    rope_theta: float = 10000.0

    @property
    def hidden(self) -> int:
        return self.heads * self.head_dim


def make_hf_checkpoint(path: str | os.PathLike, spec: TinySpec, seed: int = 0):
    """Create, randomise and ``save_pretrained`` a transformers Qwen2ForCausalLM; return it.

    Weights are drawn wider than HF's N(0, 0.02) init, and biases / norm scales are randomised
    too, so a wrong layout, a missing bias or a swapped norm shows up in the logits.
    """
    torch.manual_seed(seed)
    config = transformers.Qwen2Config(
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=512,
        rope_theta=spec.rope_theta,
        tie_word_embeddings=spec.tied,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.2)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
    model.eval()
    model.save_pretrained(os.fspath(path))
    return model


def left_padded_batch(vocab: int, lengths: list[int], total: int, seed: int = 0):
    """int32 ids [B, total] and 0/1 mask with each row's real tokens right-aligned."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, vocab, (len(lengths), total)).astype(np.int32)
    mask = np.zeros((len(lengths), total), np.int32)
    for row, n in enumerate(lengths):
        mask[row, total - n :] = 1
        ids[row, : total - n] = 0  # pad id
    return ids, mask


def hf_positions(mask: np.ndarray) -> np.ndarray:
    """transformers' generate-time position ids for a left-padded mask."""
    pos = np.cumsum(mask, axis=-1) - 1
    return np.where(mask > 0, pos, 0)


def torch_logits(model, ids: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """fp32 logits of the transformers model; with a mask, HF's mask-derived positions."""
    kwargs = {"input_ids": torch.from_numpy(ids.astype(np.int64))}
    if mask is not None:
        kwargs["attention_mask"] = torch.from_numpy(mask.astype(np.int64))
        kwargs["position_ids"] = torch.from_numpy(hf_positions(mask).astype(np.int64))
    with torch.no_grad():
        return model(**kwargs).logits.float().numpy()
