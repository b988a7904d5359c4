"""The paper's 7B setting: BAPO on R1-Distill-Qwen-7B, AIME avg@16.

    python -m experiments.aime_7b --model-dir /models/DeepSeek-R1-Distill-Qwen-7B \\
        [--recipe paper|authors] [--mesh 7b] [--trainer-devices 4] [--accelerator h100]
        [key.sub=value ...]
    python -m experiments.aime_7b --dry-run          # CPU: compile for the mesh + a toy step

Hyperparameters (../docs/algorithms.md, the spec's section 5): 256 prompts x 16 samples per
step, 64-prompt mini-batches x 2 epochs (E = 8 updates per rollout batch), AdamW lr 1e-6,
weight decay 0.1, 10% warm-up, grad clip 1.0, temperature 0.6, responses up to 8k tokens,
prompts up to 1k, BAPO defaults (rho0 0.4, c_low 0.6..0.9, c_high 1.2..3.0), token-mean loss.
`--recipe paper` / `--recipe authors` switch the learning rate, the temperature and the BAPO
search to the paper's or the authors' verl recipe's values (`bapo_jax.run.recipes`; all three
side by side, and the paper's data set: docs/pod.md, "What the run trains on").
A policy with a shorter context (Qwen2.5-Math-7B: 4,096 positions) needs smaller caps, e.g.
`trainer.rollout.max_response_tokens=3072 eval.max_tokens=3072`; longer rows are refused
before any compute, naming both numbers.

Layout: one 8-GPU node (H100 80 GB). The trainer takes GPUs 0-3 (`trainer_devices=4`, the `7b`
mesh: ZeRO-3 over 4) with blockwise attention; the vLLM servers take GPUs 4-7. One micro-batch
row per batch device: 256 micro-batches of 4 x 9,216 tokens per update, a token budget of
36,864 tokens per micro-batch, filled with whole packed sequences (`algorithm.packing`: fewer
micro-batches run when responses are short). Memory plan at 1,024 + 8,192 tokens (`python -m
bapo_jax.sharding.plan --model qwen2.5-7b --mesh 7b --attention blockwise --num-micro-batches
256 --packed --scored-length 8192`, and this run's dry run): 50.99 GB per device, budget 68 GB
(85% of 80 GB): fits; with plain attention the [T, T] scores put even one micro-batch over
(68.63 GB). The run checks this plan before compute and sets JAX's GPU pool to the same 85%
(`bapo_jax.run.preflight`). Staleness 1: the next batch generates while the trainer updates;
of the splits the plan proves fit, the pod's cost model ranks this one within 0.2% of the best
and 1.25x faster than staleness 0 (`python -m bapo_jax.run.estimate experiments.aime_7b
--rank 1`, docs/pod.md, "Which layout").
"""

from bapo_jax.algorithms.bapo import BAPOConfig
from bapo_jax.rollout.serve import ServerSettings
from bapo_jax.run.cli import main
from bapo_jax.run.config import DataSection, EngineSection, EvalSection, ModelSection, RunConfig
from bapo_jax.train.config import (
    AlgorithmConfig,
    CheckpointConfig,
    LoggingConfig,
    OffPolicyConfig,
    RolloutConfig,
    TrainerConfig,
)
from bapo_jax.train.optim import OptimizerConfig

STEPS = 200
CONFIG = RunConfig(
    trainer=TrainerConfig(
        steps=STEPS,
        eval_every=10,
        rollout=RolloutConfig(
            prompts_per_step=256,
            samples_per_prompt=16,
            max_prompt_tokens=1024,
            max_response_tokens=8192,
            temperature=0.6,
        ),
        algorithm=AlgorithmConfig(
            loss="bapo", bapo=BAPOConfig(), mini_batches=4, epochs=2, micro_batches=256
        ),
        optimizer=OptimizerConfig(
            learning_rate=1e-6, weight_decay=0.1, warmup_steps=STEPS * 8 // 10, max_grad_norm=1.0
        ),
        # Staleness 1: batch i + 1 generates while the trainer updates on batch i (the update
        # is the longer side, so the generation hides behind it; module doc).
        offpolicy=OffPolicyConfig(staleness=1),
        checkpoint=CheckpointConfig(every=10, keep=3),
        logging=LoggingConfig(peak_flops_per_device=989e12),  # H100 SXM dense bf16
    ),
    model=ModelSection(
        preset="r1-distill-qwen-7b", compute_dtype="bfloat16", remat="full", attention="blockwise"
    ),
    data=DataSection(train="math_l3to5", prompt_style="r1_distill"),
    # One 8-GPU node (H100 80 GB): the trainer on GPUs 0-3, vLLM on 4-7 as 4 servers x TP 1.
    # The 7B policy in bf16 (~15 GB) fits one GPU with ~50 GB left for KV cache at a 0.9 share
    # (~57 KB per token: 284 sequences at the mean resident context of 1,024 + 2,458 tokens, ~94
    # of a full 9,216: vLLM preempts and recomputes the newest when they outgrow it). Tensor
    # parallelism would split each layer over 2 GPUs and add 2 all-reduces per layer per
    # decoding step: lower latency per sequence, but no more throughput than 2 independent
    # replicas, and RL rollouts want throughput. 4 replicas also mean 4 schedulers and a dead
    # server costs 1/4 of generation. Each server: --max-model-len 9,216 (1,024 prompt + 8,192
    # response caps), the served name model.hf_dir, CUDA_VISIBLE_DEVICES its GPU. 18 prompts x
    # 16 samples in flight per server (`engine.requests_per_server`, derived from that KV room
    # by run.estimate); one request (a prompt's 16 samples, up to 8,192 tokens each) may take
    # 30 minutes.
    # `--vllm-url URL ...` replaces these launched servers with servers started by hand.
    engine=EngineSection(
        kind="vllm",
        launch_servers=4,
        server=ServerSettings(
            devices=("4", "5", "6", "7"),
            tensor_parallel_size=1,
            gpu_memory_utilization=0.9,
            dtype="bfloat16",
        ),
        request_timeout_s=1800.0,
    ),
    eval=EvalSection(sets=("aime2024", "aime2025"), samples=16, max_tokens=8192, temperature=0.6),
    mesh="7b",
    trainer_devices=4,
    accelerator="h100",
)

if __name__ == "__main__":
    main(CONFIG, module="experiments.aime_7b", description=__doc__.splitlines()[0])
