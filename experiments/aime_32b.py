"""The paper's 32B setting: BAPO on a Qwen2.5-32B policy (e.g. R1-Distill-Qwen-32B), AIME avg@16.

    python -m experiments.aime_32b --model-dir /models/DeepSeek-R1-Distill-Qwen-32B \\
        --vllm-url http://node-0:8000 ... --vllm-url http://node-3:8000 [--mesh 32b-32gpu]
        [--recipe paper|authors]
    python -m experiments.aime_32b --dry-run          # CPU: compile for the mesh + a toy step

Hyperparameters (../docs/algorithms.md, the spec's section 5): 256 prompts x 16 samples per
step, 64-prompt mini-batches x 2 epochs (E = 8 updates per rollout batch), AdamW lr 1e-6,
weight decay 0.1, 10% warm-up, grad clip 1.0, temperature 0.6, responses up to 8k tokens,
prompts up to 1k, BAPO defaults (rho0 0.4, c_low 0.6..0.9, c_high 1.2..3.0), token-mean loss;
`--recipe paper|authors` as for aime_7b (docs/pod.md, "What the run trains on").

Layout: four 8-GPU nodes (H100 80 GB), colocated (`engine.colocate`). The trainer, one JAX
process per node with all 8 of its GPUs (`srun`, docs/sharding.md), makes the 32-device
`32b-32gpu` mesh: ZeRO-3 over 8 x tensor parallel over 4 (40 q / 8 kv heads; a tensor group
stays inside a node), blockwise attention. On each node one vLLM server of tensor parallel 8,
started by hand before the trainer (`python -m bapo_jax.rollout.serve ... --tensor-parallel-size
8 --gpu-memory-utilization 0.3`, docs/pod.md) and given with --vllm-url, holds 30% of every GPU's
memory; the trainer gets the plan's 85% less that, 55% (44 GB), and the two take turns
(staleness 0). One micro-batch row per batch device: 128 micro-batches of 8 x 9,216 tokens per
update. Memory plan at 1,024 + 8,192 tokens (`python -m bapo_jax.sharding.plan --model
qwen2.5-32b --mesh 32b-32gpu --attention blockwise --num-micro-batches 128 --packed
--scored-length 8192`, and this run's dry run): 41.93 GB per device within its 44 GB. The
run checks this plan before compute. Of the splits and colocated layouts of the four nodes that
the plan proves fit, the pod's cost model ranks this one first, 1.99x faster per iteration than
16 trainer GPUs + 8 servers x 2 at staleness 0 (1.42x at staleness 1, the previous default;
`python -m bapo_jax.run.estimate experiments.aime_32b --rank 4`). One server per node also
means one read of each synced version per node, shared by its 8 ranks (docs/rollout.md).
"""

import dataclasses

from bapo_jax.run.cli import main
from experiments import aime_7b

# The 7B run's hyperparameters; the policy, the mesh and the trainer's devices change (all 8
# GPUs of each of the four nodes), and the colocated servers, one TP-8 server on each node
# started by hand (docs/pod.md), are given with --vllm-url.
CONFIG = dataclasses.replace(
    aime_7b.CONFIG,
    model=dataclasses.replace(aime_7b.CONFIG.model, preset="r1-distill-qwen-32b"),
    engine=dataclasses.replace(
        aime_7b.CONFIG.engine,
        launch_servers=0,
        server=dataclasses.replace(
            aime_7b.CONFIG.engine.server,
            devices=(),
            tensor_parallel_size=8,
            gpu_memory_utilization=0.3,
        ),
    ),
    mesh="32b-32gpu",
    trainer_devices=None,
)

if __name__ == "__main__":
    main(CONFIG, module="experiments.aime_32b", description=__doc__.splitlines()[0])
