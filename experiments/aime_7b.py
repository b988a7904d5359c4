"""The paper's 7B setting: BAPO on R1-Distill-Qwen-7B, AIME avg@16.

    python -m experiments.aime_7b --model-dir /models/DeepSeek-R1-Distill-Qwen-7B \\
        [--recipe paper|authors] [--mesh 7b-8gpu] [--trainer-devices 8] [--accelerator h100]
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

Layout: one 8-GPU node (H100 80 GB), colocated (`engine.colocate`, verl's layout with a static
memory split): the trainer on all 8 GPUs (`trainer_devices=8`, the `7b-8gpu` mesh: ZeRO-3 over
8) with blockwise attention, and two vLLM servers of tensor parallel 4 on the same GPUs ("0,1,2,3"
and "4,5,6,7"), each holding 40% of every GPU's memory (`--gpu-memory-utilization 0.4`); the
trainer's JAX pool and its memory plan get the plan's 85% less that, 45% (36 GB). Generation and
training take turns (staleness 0). One micro-batch row per batch device: 128 micro-batches of
8 x 9,216 tokens per update, a token budget of 73,728 tokens per micro-batch, filled with whole
packed sequences (`algorithm.packing`: fewer micro-batches run when responses are short).
Memory plan at 1,024 + 8,192 tokens (`python -m bapo_jax.sharding.plan --model qwen2.5-7b
--mesh 7b-8gpu --attention blockwise --num-micro-batches 128 --packed --scored-length 8192`,
and this run's dry run): 29.98 GB per device within its 36 GB. The run checks this plan
before compute and sets JAX's GPU pool to the same 45% (`bapo_jax.run.preflight`). Of every
split and colocated layout of the node that the plan proves fit, the pod's cost model ranks
this one first, 1.99x faster per iteration than 4 trainer GPUs + 4 one-GPU servers at
staleness 0 (1.59x at staleness 1, the previous default; `python -m bapo_jax.run.estimate
experiments.aime_7b --rank 1`, docs/pod.md, "Which layout"). The previous split (the
trainer on GPUs 0-3, four servers on 4-7, staleness 1) is `SEPARATE` below, and on the
command line `--trainer-devices 4 --mesh 7b --server-devices "4;5;6;7"
--gpu-memory-utilization 0.9 engine.colocate=false trainer.offpolicy.staleness=1
trainer.algorithm.micro_batches=256`.
"""

from bapo_jax.algorithms.bapo import BAPOConfig
from bapo_jax.overrides import apply_overrides
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
            loss="bapo", bapo=BAPOConfig(), mini_batches=4, epochs=2, micro_batches=128
        ),
        optimizer=OptimizerConfig(
            learning_rate=1e-6, weight_decay=0.1, warmup_steps=STEPS * 8 // 10, max_grad_norm=1.0
        ),
        # Staleness 0: colocated servers and trainer take turns on the same GPUs (module doc).
        offpolicy=OffPolicyConfig(staleness=0),
        checkpoint=CheckpointConfig(every=10, keep=3),
        logging=LoggingConfig(peak_flops_per_device=989e12),  # H100 SXM dense bf16
    ),
    model=ModelSection(
        preset="r1-distill-qwen-7b", compute_dtype="bfloat16", remat="full", attention="blockwise"
    ),
    data=DataSection(train="math_l3to5", prompt_style="r1_distill"),
    # One 8-GPU node (H100 80 GB), colocated: 2 servers x TP 4 on the trainer's own GPUs, each
    # GPU's memory 40% vLLM's (weights 15.2 GB over 4 GPUs + KV cache), 45% the trainer's. TP 4
    # divides the 7B's 28 query and 4 KV heads (TP 8 would not: vLLM refuses it); on 4 GPUs
    # each, the weights stream from 4 HBMs per decoding step and the KV room is ~113 GB a
    # server (the ranking's estimate beats 4 x TP 2 and 8 x TP 1 at this share). Each server:
    # --max-model-len 9,216 (1,024 prompt + 8,192 response caps), the served name model.hf_dir,
    # CUDA_VISIBLE_DEVICES its GPUs; prompts in flight per server derived from its KV room
    # (`engine.requests_per_server`, run.estimate); one request (a prompt's 16 samples, up to
    # 8,192 tokens each) may take 30 minutes.
    # `--vllm-url URL ...` replaces these launched servers with servers started by hand.
    engine=EngineSection(
        kind="vllm",
        launch_servers=2,
        server=ServerSettings(
            devices=("0,1,2,3", "4,5,6,7"),
            tensor_parallel_size=4,
            gpu_memory_utilization=0.4,
            dtype="bfloat16",
        ),
        request_timeout_s=1800.0,
        colocate=True,
    ),
    eval=EvalSection(sets=("aime2024", "aime2025"), samples=16, max_tokens=8192, temperature=0.6),
    mesh="7b-8gpu",
    trainer_devices=8,
    accelerator="h100",
)

# The split on separate GPUs, the default before colocation (docs/pod.md, "Which layout"): the
# trainer on GPUs 0-3 (`7b` mesh, ZeRO-3 over 4, 256 micro-batches of 4 rows), four one-GPU
# servers on GPUs 4-7 at vLLM's 0.9 share, staleness 1 (generation hidden behind the update).
SEPARATE = apply_overrides(
    CONFIG,
    [
        "mesh=7b",
        "trainer_devices=4",
        "trainer.algorithm.micro_batches=256",
        "trainer.offpolicy.staleness=1",
        "engine.colocate=false",
        "engine.launch_servers=4",
        'engine.server.devices=["4","5","6","7"]',
        "engine.server.tensor_parallel_size=1",
        "engine.server.gpu_memory_utilization=0.9",
    ],
)

if __name__ == "__main__":
    main(CONFIG, module="experiments.aime_7b", description=__doc__.splitlines()[0])
