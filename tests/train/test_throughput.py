"""FLOP counts against a hand count on a small config."""

import pytest

from bapo_jax.models import Qwen2Config
from bapo_jax.train.throughput import matmul_params, throughput

CONFIG = Qwen2Config(
    vocab_size=100,
    hidden_size=8,
    intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)


def test_matmul_params_by_hand():
    # Per layer: q 8*4*2=64, k and v 8*2*2=32 each, o 4*2*8=64, MLP 3*8*16=384 -> 576.
    # Two layers 1152, plus the head 100*8=800 (tied: it still is a matmul) -> 1952.
    assert matmul_params(CONFIG) == 1952


def test_flops_per_token_by_hand():
    # 6 * 1952 + 6 * L(2) * T(10) * N*H(8) = 11712 + 960 = 12672 per token of a sequence of 10.
    out = throughput(
        CONFIG, sequence_lengths=[10], seconds=1.0, num_devices=1, peak_flops_per_device=None
    )
    assert out["model_flops_per_s"] == 10 * 12672.0


def test_throughput_and_mfu():
    out = throughput(
        CONFIG, sequence_lengths=[10] * 100, seconds=2.0, num_devices=4, peak_flops_per_device=1e6
    )
    assert out["tokens_per_s"] == 500.0
    assert out["model_flops_per_s"] == 500.0 * 12672.0
    assert out["mfu"] == pytest.approx(500.0 * 12672.0 / 4e6)
    assert "mfu" not in throughput(
        CONFIG, sequence_lengths=[1], seconds=1.0, num_devices=1, peak_flops_per_device=None
    )
    with pytest.raises(ValueError, match="seconds must be > 0, got 0"):
        throughput(CONFIG, sequence_lengths=[1], seconds=0, num_devices=1, peak_flops_per_device=1)


def test_throughput_counts_attention_at_each_sequences_own_length():
    # Sequences of 10 and 4 tokens: 10 * (6 * 1952 + 96 * 10) + 4 * (6 * 1952 + 96 * 4), where
    # 96 = 6 * L(2) * N*H(8): 126720 + 48384 = 175104 FLOPs in 2 s.
    out = throughput(
        CONFIG, sequence_lengths=[10, 4], seconds=2.0, num_devices=1, peak_flops_per_device=None
    )
    assert out["model_flops_per_s"] == pytest.approx(175104.0 / 2)
    assert out["tokens_per_s"] == 7.0
