"""Rollout engines behind one interface (``types.RolloutEngine``) and the weight sync to them
(``types.WeightUpdater``).

Submodules: ``types`` (SamplingParams, Sample, Rollout, RolloutEngine, WeightUpdater),
``vllm_client`` (VLLMEngine over vLLM servers) with ``vllm_http`` (its connections, control
plane and reply parsing) and ``vllm_recovery`` (repairing a server: reload, restart or retire),
``weight_sync`` (Orbax versions on disk), ``orbax_sync`` (the vLLM path's weight update: write,
stage, load, retry), ``vllm_worker`` (runs inside vLLM), ``serve`` (the launcher and
``ServerGroup`` restarts), ``embedded`` (the in-process JAX sampler). The rollout/trainer
log-prob agreement is the trainer's (``train.behaviour``, ``train.assemble.logprob_gap``).
"""

from bapo_jax.rollout.types import (
    FINISH_REASONS,
    Rollout,
    RolloutEngine,
    Sample,
    SamplingParams,
    WeightUpdater,
    validate_prompts,
)

__all__ = [
    "FINISH_REASONS",
    "Rollout",
    "RolloutEngine",
    "Sample",
    "SamplingParams",
    "WeightUpdater",
    "validate_prompts",
]
