"""The paper's 32B setting: BAPO on a Qwen2.5-32B policy (e.g. R1-Distill-Qwen-32B), AIME avg@16.

    python -m experiments.aime_32b --model-dir /models/DeepSeek-R1-Distill-Qwen-32B \\
        --vllm-url http://vllm-node-1:8000 --vllm-url http://vllm-node-2:8000 [--mesh 32b]
        [--recipe paper|authors]
    python -m experiments.aime_32b --dry-run          # CPU: compile for the mesh + a toy step

Hyperparameters (../docs/algorithms.md, the spec's section 5): 256 prompts x 16 samples per
step, 64-prompt mini-batches x 2 epochs (E = 8 updates per rollout batch), AdamW lr 1e-6,
weight decay 0.1, 10% warm-up, grad clip 1.0, temperature 0.6, responses up to 8k tokens,
prompts up to 1k, BAPO defaults (rho0 0.4, c_low 0.6..0.9, c_high 1.2..3.0), token-mean loss;
`--recipe paper|authors` as for aime_7b (docs/pod.md, "What the run trains on").

Layout: four 8-GPU nodes (H100 80 GB). Two trainer nodes, one JAX process each with all 8 of
its GPUs (`srun`, docs/sharding.md), make the 16-device `32b` mesh: ZeRO-3 over 4 x tensor
parallel over 4 (40 q / 8 kv heads; a tensor group stays inside a node), blockwise attention;
two more nodes run the vLLM servers. One micro-batch row per batch device: 256 micro-batches
of 4 x 9,216 tokens per update, a token budget of 36,864 tokens per micro-batch filled with
whole packed sequences. Memory plan at 1,024 + 8,192 tokens (`python -m bapo_jax.sharding.plan
--model qwen2.5-32b --mesh 32b --attention blockwise --num-micro-batches 256 --packed
--scored-length 8192`, and this run's dry run): 65.20 GB per device, budget 68 GB (85% of 80
GB): fits (82% of the device). The run checks this plan before compute. Staleness 1, as
aime_7b: the pod's cost model ranks 16 trainer GPUs + 8 servers x 2 at staleness 1 within 0.4%
of the best split that fits and 1.38x faster than at staleness 0 (`python -m
bapo_jax.run.estimate experiments.aime_32b --servers 8 --server-gpus 2 --rank 4`).
"""

import dataclasses

from bapo_jax.run.cli import main
from experiments import aime_7b

# The 7B run's hyperparameters; the policy, the mesh and the trainer's devices change (all 8
# GPUs of each trainer node), and the servers run on their own nodes (docs/pod.md: 8 servers x
# TP 2, started with `python -m bapo_jax.rollout.serve`), given with --vllm-url.
CONFIG = dataclasses.replace(
    aime_7b.CONFIG,
    model=dataclasses.replace(aime_7b.CONFIG.model, preset="r1-distill-qwen-32b"),
    engine=dataclasses.replace(
        aime_7b.CONFIG.engine,
        launch_servers=0,
        server=dataclasses.replace(
            aime_7b.CONFIG.engine.server, devices=(), tensor_parallel_size=2
        ),
    ),
    mesh="32b",
    trainer_devices=None,
)

if __name__ == "__main__":
    main(CONFIG, module="experiments.aime_32b", description=__doc__.splitlines()[0])
