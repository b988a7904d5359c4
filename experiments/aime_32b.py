"""The paper's 32B setting: BAPO on a Qwen2.5-32B policy (e.g. R1-Distill-Qwen-32B), AIME avg@16.

    python -m experiments.aime_32b --model-dir /models/DeepSeek-R1-Distill-Qwen-32B \\
        --vllm-url http://gpu-node-1:8000 [--mesh 32b] [key.sub=value ...]
    python -m experiments.aime_32b --dry-run          # CPU: compile for the mesh + a toy step

Hyperparameters (../docs/algorithms.md, the spec's section 5): 256 prompts x 16 samples per
step, 64-prompt mini-batches x 2 epochs (E = 8 updates per rollout batch), AdamW lr 1e-6,
weight decay 0.1, 10% warm-up, grad clip 1.0, temperature 0.6, responses up to 8k tokens,
prompts up to 1k, BAPO defaults (rho0 0.4, c_low 0.6..0.9, c_high 1.2..3.0), token-mean loss.
The 32b mesh is ZeRO-3 over 8 x tensor parallel over 4 (40 q / 8 kv heads); one micro-batch row
per batch device (8 x 9,216 tokens; `python -m bapo_jax.sharding.plan --model qwen2.5-32b`).
"""

import dataclasses

from bapo_jax.run.cli import main
from experiments import aime_7b

# The 7B run's hyperparameters; only the policy and the mesh change.
CONFIG = dataclasses.replace(
    aime_7b.CONFIG,
    model=dataclasses.replace(aime_7b.CONFIG.model, preset="r1-distill-qwen-32b"),
    mesh="32b",
)

if __name__ == "__main__":
    main(CONFIG, module="experiments.aime_32b", description=__doc__.splitlines()[0])
