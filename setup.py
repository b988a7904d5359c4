"""bapo-jax: stable off-policy RL for LLMs with BAPO, in JAX."""

from pathlib import Path

from setuptools import find_namespace_packages, setup

CORE = [
    "jax>=0.10.2,<0.13",
    "flax>=0.12.8,<0.13",
    "optax>=0.2.8,<0.3",
    "orbax-checkpoint>=0.12.8,<0.13",
    "chex>=0.1.90,<0.2",
    "jaxtyping>=0.3.9,<0.4",
    "numpy>=2.0,<3",
    "safetensors>=0.6,<1",
    "xxhash>=3.4,<5",  # the synced checkpoint's file hashes (rollout.sync_checks)
    "tokenizers>=0.22,<0.24",
    "jinja2>=3.1,<4",
    "sentencepiece>=0.2,<0.3",
    "math-verify>=0.8,<0.10",
    "requests>=2.31,<3",
    "tqdm>=4.60,<5",
    "matplotlib>=3.8,<4",  # the trainer's PNG plots
    "pillow>=10,<14",  # encodes the plots' PNGs (cut from one drawn figure)
    # The trainer's TensorBoard event files (SummaryWriter; purge_step hides a killed run's
    # steps after the checkpoint it resumed from). Imports torch only if torch is installed.
    "tensorboardX>=2.6,<3",
    # The data pipeline (TFDS array_record builders read without TensorFlow, grain batching).
    "tensorflow-datasets>=4.9.9,<5",
    "grain>=0.2.12,<0.3",
]
# Optional Weights & Biases logging (`trainer.logging.wandb=true`; `pip install -e '.[wandb]'`).
# Below 0.32: the settings the trainer passes (x_disable_stats, reinit="create_new") and the
# tests' reading of its .wandb transaction logs are checked against 0.31.
WANDB = ["wandb>=0.31,<0.32"]
TEST = [
    "pytest>=8,<10",
    "pytest-xdist>=3.5,<4",  # `make test` runs the suite in TEST_WORKERS processes
    "hypothesis>=6.100,<7",
    "ruff>=0.15,<0.18",
    # The import contracts in pyproject.toml [tool.importlinter] (tests/test_structure.py).
    "import-linter>=2.17,<3",
    # The numerical reference only. This exact CPU build is on this machine's local index;
    # an unpinned torch would pull a multi-GB CUDA build.
    "torch==2.13.0",
    "transformers>=5.20,<6",
    "peft>=0.21,<0.22",  # LoRA's reference: the same logits, gradients and files (models.lora)
    "tensorboard>=2.16,<3",  # an independent reader of the trainer's event files
    *WANDB,  # the W&B logging tests (offline mode: no account, no network)
]

# The trainer on NVIDIA GPUs: the same JAX with its CUDA 12 plugin and the CUDA libraries from
# pip (`pip install -e '.[gpu]'`; README "On a GPU pod"). CORE's jax alone runs on CPU only.
GPU = ["jax[cuda12]>=0.10.2,<0.13"]

# What the vLLM worker extension needs inside a vLLM environment (GPU pod: `pip install
# --no-deps bapo-jax` then this extra; `make test-vllm` does the same against vLLM's pins).
VLLM_WORKER = [
    "jax[cpu]>=0.10.2,<0.13",
    "flax>=0.12.8,<0.13",
    "orbax-checkpoint>=0.12.8,<0.13",
    "chex>=0.1.90,<0.2",
    "jaxtyping>=0.3.9,<0.4",
    "safetensors>=0.6,<1",
    "xxhash>=3.4,<5",
    "requests>=2.31,<3",
]

setup(
    name="bapo-jax",
    version="0.1.0",
    description="BAPO (Balanced Policy Optimization with Adaptive Clipping) for LLM RL in JAX",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    # Namespace discovery also lists the asset folders (data only), as setuptools wants.
    packages=find_namespace_packages(
        include=["bapo_jax", "bapo_jax.*", "experiments", "benchmarks"], exclude=["*.__pycache__"]
    ),
    package_data={"bapo_jax": ["assets/**/*", "kernels/*.cc", "kernels/*.h"]},
    include_package_data=True,
    install_requires=CORE,
    extras_require={"test": TEST, "gpu": GPU, "vllm-worker": VLLM_WORKER, "wandb": WANDB},
)
