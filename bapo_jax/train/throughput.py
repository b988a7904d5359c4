"""Training throughput: tokens/s and model FLOPs utilisation (MFU) of a train step.

FLOPs per token of one forward+backward (the PaLM appendix B convention, which counts matmuls
only and no rematerialisation):

    6 * N_matmul  +  6 * L * T * D_attn
    N_matmul = parameters that take part in matmuls (all but norms, biases and the input
               embedding, which is a gather; the LM head counts, tied or not)
    D_attn   = N_heads * head_dim; the second term is QK^T and AV for a causal sequence of
               length T, each 2 * T * D_attn per token forward, halved by causality, x3 for
               forward + backward -> 6 * L * T * D_attn (PaLM's 12 * L * H * Q * T without the
               causal discount is the usual over-count; we keep the causal one).

MFU = achieved FLOPs/s / (devices x peak FLOPs/s of one device). Given the real sequences'
lengths n_i (the trainer's rows: padding and packing aside), FLOPs = sum_i n_i x the per-token
FLOPs at length n_i: only real tokens count, and attention at each sequence's own length.
"""

from __future__ import annotations

import numpy as np

from bapo_jax.models.config import Qwen2Config


def matmul_params(config: Qwen2Config) -> int:
    """Parameters in matmuls: q/k/v/o and MLP kernels of every layer plus the LM head."""
    d, f = config.hidden_size, config.intermediate_size
    n, k, h = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    per_layer = d * n * h + 2 * d * k * h + n * h * d + 3 * d * f
    return config.num_hidden_layers * per_layer + config.vocab_size * d


def throughput(
    config: Qwen2Config,
    *,
    sequence_lengths,
    seconds: float,
    num_devices: int,
    peak_flops_per_device: float | None,
) -> dict[str, float]:
    """tokens/s, achieved FLOPs/s and MFU (MFU only when the device peak is known) of training
    on sequences of `sequence_lengths` real tokens, attention counted per sequence."""
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    n = np.asarray(sequence_lengths, np.float64)
    attention = 6.0 * config.num_hidden_layers * config.num_attention_heads * config.head_dim
    flops = float(np.sum(n * (6.0 * matmul_params(config) + attention * n))) / seconds
    out = {"tokens_per_s": float(n.sum()) / seconds, "model_flops_per_s": flops}
    if peak_flops_per_device:
        out["mfu"] = flops / (num_devices * peak_flops_per_device)
    return out
