"""Rollout engines behind one interface (``types.RolloutEngine``) and the weight sync to them.

Submodules: ``types`` (SamplingParams, Sample, Rollout, RolloutEngine), ``vllm_client``
(VLLMEngine over vLLM servers) with ``vllm_http`` (its connections, control plane and reply
parsing) and ``vllm_recovery`` (repairing a server: reload, restart or retire), ``weight_sync``
(Orbax / safetensors versions on disk), ``vllm_worker`` (runs inside vLLM), ``serve`` (the
launcher and ``ServerGroup`` restarts), ``embedded`` (the in-process JAX sampler),
``agreement`` (rollout/trainer log-prob mismatch).
"""

from bapo_jax.rollout.types import (
    FINISH_REASONS,
    Rollout,
    RolloutEngine,
    Sample,
    SamplingParams,
    validate_prompts,
)

__all__ = [
    "FINISH_REASONS",
    "Rollout",
    "RolloutEngine",
    "Sample",
    "SamplingParams",
    "validate_prompts",
]
