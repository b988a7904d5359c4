"""tokens/s and MFU from `train.throughput` (hand-counted on a tiny config, a given time and a
stated device peak) reach the metric rows and the progress line of `train.metrics`, as the
trainer's iteration passes them on (`Trainer._train_on`: `metrics.update(throughput(...))`).
The FLOP convention itself: tests/train/test_throughput.py."""

import io
import math

import numpy as np
import pytest
from flax import nnx

from bapo_jax.models import Qwen2Config
from bapo_jax.models.qwen2 import abstract_model
from bapo_jax.train.metrics import MetricsLogger, read_jsonl
from bapo_jax.train.throughput import matmul_params, throughput

# d = 16, f = 32, L = 1, N = 2 query heads, K = 1 KV head, head_dim h = 16 / 2 = 8, V = 64,
# untied LM head.
CONFIG = Qwen2Config(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
)
# q d*N*h = 256, k and v d*K*h = 128 each, o N*h*d = 256, MLP 3*d*f = 1536 -> 2304 per layer;
# one layer plus the head V*d = 1024 -> 3328 parameters in matmuls.
MATMUL_PARAMS = 3328
# At T = 32: 6 * 3328 + 6 * L * T * N*h = 19968 + 6 * 1 * 32 * 16 = 19968 + 3072 = 23040.
FLOPS_PER_TOKEN_AT_32 = 23040.0


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_matmul_params_are_the_models_projection_and_head_weights():
    assert matmul_params(CONFIG) == MATMUL_PARAMS
    # The same count from the model itself: its *_proj kernels and lm_head (no embedding,
    # norms or biases).
    params = nnx.to_pure_dict(nnx.state(abstract_model(CONFIG), nnx.Param))
    layers = params["layers"]
    in_matmuls = [v for k, v in layers.items() if k.endswith("_proj")] + [params["lm_head"]]
    assert sum(math.prod(v.shape) for v in in_matmuls) == MATMUL_PARAMS


def test_flops_per_token_by_hand():
    out = throughput(
        CONFIG, sequence_lengths=[32], seconds=1.0, num_devices=1, peak_flops_per_device=None
    )
    assert out["model_flops_per_s"] == 32 * FLOPS_PER_TOKEN_AT_32


def test_tokens_per_s_and_mfu_by_hand():
    # 2048 tokens in sequences of 32 in 4 s on 2 devices of 1e8 FLOP/s each:
    # tokens/s = 2048 / 4 = 512; FLOP/s = 512 * 23040 = 11_796_480;
    # MFU = 11_796_480 / (2 * 1e8) = 0.0589824.
    out = throughput(
        CONFIG, sequence_lengths=[32] * 64, seconds=4.0, num_devices=2, peak_flops_per_device=1e8
    )
    assert out["tokens_per_s"] == 512.0
    assert out["model_flops_per_s"] == 11_796_480.0
    assert out["mfu"] == pytest.approx(0.0589824, rel=1e-12)


def test_mfu_with_per_sequence_attention_by_hand():
    # Sequences of 20 and 12 tokens (32) in 0.5 s on one device of 1e7 FLOP/s; per token
    # 6 * 3328 = 19968 plus attention 6 * L * n * N*h = 96 n:
    # 20 * (19968 + 1920) + 12 * (19968 + 1152) = 437760 + 253440 = 691200 FLOPs,
    # / 0.5 s = 1_382_400 FLOP/s; tokens/s = 32 / 0.5 = 64; MFU = 1_382_400 / 1e7 = 0.13824.
    out = throughput(
        CONFIG,
        sequence_lengths=np.asarray([20, 12]),
        seconds=0.5,
        num_devices=1,
        peak_flops_per_device=1e7,
    )
    assert out == {
        "tokens_per_s": 64.0,
        "model_flops_per_s": pytest.approx(1_382_400.0, rel=1e-12),
        "mfu": pytest.approx(0.13824, rel=1e-12),
    }


def _iteration_metrics(peak):
    """The throughput part of one iteration's metrics (2048 tokens, 4 s, 2 devices)."""
    return {
        "loss": 0.25,
        **throughput(
            CONFIG,
            sequence_lengths=[32] * 64,
            seconds=4.0,
            num_devices=2,
            peak_flops_per_device=peak,
        ),
    }


def test_the_metric_row_and_the_progress_line_carry_them(tmp_path):
    stream = io.StringIO()
    logger = MetricsLogger(tmp_path, total_steps=3, tensorboard=False, plots=False, stream=stream)
    logger.log(0, _iteration_metrics(peak=1e8))
    logger.close()
    (row,) = read_jsonl(tmp_path / "metrics.jsonl")
    assert row["tokens_per_s"] == 512.0
    assert row["model_flops_per_s"] == 11_796_480.0
    assert row["mfu"] == pytest.approx(0.0589824, rel=1e-12)
    # Not a terminal: one plain line; tok/s as an integer, MFU as a percentage (5.89824 %).
    (line,) = stream.getvalue().splitlines()
    assert line.startswith("train:") and "1/3" in line
    assert line.endswith("tok/s=512, mfu=5.9%]")


def test_the_terminal_bar_shows_them(tmp_path):
    terminal = _Terminal()
    logger = MetricsLogger(tmp_path, total_steps=3, tensorboard=False, plots=False, stream=terminal)
    logger.log(0, _iteration_metrics(peak=1e8))
    logger.close()
    assert "tok/s=512, mfu=5.9%" in terminal.getvalue()


def test_without_a_device_peak_there_is_no_mfu(tmp_path):
    stream = io.StringIO()
    logger = MetricsLogger(tmp_path, total_steps=3, tensorboard=False, plots=False, stream=stream)
    logger.log(0, _iteration_metrics(peak=None))
    logger.close()
    (row,) = read_jsonl(tmp_path / "metrics.jsonl")
    assert row["tokens_per_s"] == 512.0 and "mfu" not in row
    (line,) = stream.getvalue().splitlines()
    assert line.endswith("tok/s=512]") and "mfu" not in line
