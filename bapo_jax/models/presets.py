"""Named ``Qwen2Config`` presets: the public hub checkpoints this port targets, and tiny test sizes.

``PRESETS`` maps a name to its config; ``Qwen2Config.preset(name)`` looks one up (with a clear
error for an unknown name). Each hub preset is copied from that repository's ``config.json``.
"""

from __future__ import annotations

from typing import Any

from bapo_jax.models.config import Qwen2Config

__all__ = ["PRESETS"]


def _qwen(**kw: Any) -> Qwen2Config:
    return Qwen2Config(**kw)


# Each preset is copied from the public config.json of the named HF hub repository
# (https://huggingface.co/<repo>/blob/main/config.json). Fields not in Qwen2Config
# (torch_dtype, transformers_version, use_cache, use_mrope) are left out.
PRESETS: dict[str, Qwen2Config] = {
    # Qwen/Qwen2.5-0.5B
    "qwen2.5-0.5b": _qwen(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-06,
        tie_word_embeddings=True,
        bos_token_id=151643,
        eos_token_id=151643,
        sliding_window=32768,
        max_window_layers=24,
    ),
    # Qwen/Qwen2.5-1.5B
    "qwen2.5-1.5b": _qwen(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=131072,
        rope_theta=1000000.0,
        rms_norm_eps=1e-06,
        tie_word_embeddings=True,
        bos_token_id=151643,
        eos_token_id=151643,
        sliding_window=131072,
        max_window_layers=28,
    ),
    # Qwen/Qwen2.5-3B
    "qwen2.5-3b": _qwen(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-06,
        tie_word_embeddings=True,
        bos_token_id=151643,
        eos_token_id=151643,
        sliding_window=32768,
        max_window_layers=36,
    ),
    # Qwen/Qwen2.5-7B
    "qwen2.5-7b": _qwen(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        max_position_embeddings=131072,
        rope_theta=1000000.0,
        rms_norm_eps=1e-06,
        tie_word_embeddings=False,
        bos_token_id=151643,
        eos_token_id=151643,
        sliding_window=131072,
        max_window_layers=28,
    ),
    # Qwen/Qwen2.5-14B
    "qwen2.5-14b": _qwen(
        vocab_size=152064,
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=48,
        num_attention_heads=40,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        rope_theta=1000000.0,
        rms_norm_eps=1e-05,
        tie_word_embeddings=False,
        bos_token_id=151643,
        eos_token_id=151643,
        sliding_window=131072,
        max_window_layers=48,
    ),
    # Qwen/Qwen2.5-32B
    "qwen2.5-32b": _qwen(
        vocab_size=152064,
        hidden_size=5120,
        intermediate_size=27648,
        num_hidden_layers=64,
        num_attention_heads=40,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        rope_theta=1000000.0,
        rms_norm_eps=1e-05,
        tie_word_embeddings=False,
        bos_token_id=151643,
        eos_token_id=151643,
        sliding_window=131072,
        max_window_layers=64,
    ),
    # Qwen/Qwen2.5-Math-7B: rope_theta 10000 and a 4096-token context.
    "qwen2.5-math-7b": _qwen(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rms_norm_eps=1e-06,
        tie_word_embeddings=False,
        bos_token_id=151643,
        eos_token_id=151643,
        sliding_window=4096,
        max_window_layers=28,
    ),
    # deepseek-ai/DeepSeek-R1-Distill-Qwen-7B (from Qwen2.5-Math-7B: rope_theta 10000, but a
    # 131072-token max_position_embeddings).
    "r1-distill-qwen-7b": _qwen(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        max_position_embeddings=131072,
        rope_theta=10000.0,
        rms_norm_eps=1e-06,
        tie_word_embeddings=False,
        bos_token_id=151643,
        eos_token_id=151643,
        sliding_window=4096,
        max_window_layers=28,
    ),
    # deepseek-ai/DeepSeek-R1-Distill-Qwen-32B (from Qwen2.5-32B).
    "r1-distill-qwen-32b": _qwen(
        vocab_size=152064,
        hidden_size=5120,
        intermediate_size=27648,
        num_hidden_layers=64,
        num_attention_heads=40,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        rope_theta=1000000.0,
        rms_norm_eps=1e-05,
        tie_word_embeddings=False,
        bos_token_id=151643,
        eos_token_id=151643,
        sliding_window=131072,
        max_window_layers=64,
    ),
    # ---- tiny, for tests (not on the hub) -------------------------------------------------------
    "tiny": _qwen(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        max_window_layers=2,
    ),
    "tiny-tied": _qwen(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        max_window_layers=2,
    ),
    # head_dim 64 (what fused GPU attention kernels, e.g. in vLLM, want) at a tiny size.
    "tiny-hd64": _qwen(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        max_window_layers=2,
    ),
}
