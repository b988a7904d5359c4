"""The paper's 7B setting: BAPO on R1-Distill-Qwen-7B (or Qwen2.5-Math-7B), AIME avg@16.

    python -m experiments.aime_7b --model-dir /models/DeepSeek-R1-Distill-Qwen-7B \\
        --vllm-url http://gpu-node-1:8000 [--mesh 7b] [key.sub=value ...]
    python -m experiments.aime_7b --dry-run          # CPU: compile for the mesh + a toy step

Hyperparameters (../docs/algorithms.md, the spec's section 5): 256 prompts x 16 samples per
step, 64-prompt mini-batches x 2 epochs (E = 8 updates per rollout batch), AdamW lr 1e-6,
weight decay 0.1, 10% warm-up, grad clip 1.0, temperature 0.6, responses up to 8k tokens,
prompts up to 1k, BAPO defaults (rho0 0.4, c_low 0.6..0.9, c_high 1.2..3.0), token-mean loss.
One micro-batch row per batch device (8 x 9,216 tokens; `python -m bapo_jax.sharding.plan`).
"""

from bapo_jax.algorithms.bapo import BAPOConfig
from bapo_jax.run.cli import main
from bapo_jax.run.config import DataSection, EngineSection, EvalSection, ModelSection, RunConfig
from bapo_jax.train.config import (
    AlgorithmConfig,
    CheckpointConfig,
    LoggingConfig,
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
            loss="bapo", bapo=BAPOConfig(), mini_batches=4, epochs=2, micro_batches=128
        ),
        optimizer=OptimizerConfig(
            learning_rate=1e-6, weight_decay=0.1, warmup_steps=STEPS * 8 // 10, max_grad_norm=1.0
        ),
        checkpoint=CheckpointConfig(every=10, keep=3),
        logging=LoggingConfig(peak_flops_per_device=989e12),  # H100 SXM dense bf16
    ),
    model=ModelSection(preset="r1-distill-qwen-7b", compute_dtype="bfloat16", remat=True),
    data=DataSection(train="math_l3to5", prompt_style="r1_distill"),
    engine=EngineSection(kind="vllm", launch_servers=0),
    eval=EvalSection(sets=("aime2024", "aime2025"), samples=16, max_tokens=8192, temperature=0.6),
    mesh="7b",
)

if __name__ == "__main__":
    main(CONFIG, module="experiments.aime_7b", description=__doc__.splitlines()[0])
