"""Synthetic verifiable tasks (the CPU main job's multi-step integer arithmetic)."""

from bapo_jax.tasks.arithmetic import (
    SPLIT_FRACTIONS,
    ArithmeticConfig,
    ArithmeticProblem,
    ArithmeticSource,
    arithmetic_reward,
    generate_problems,
    make_problem,
    split_of,
    tokenizer_corpus,
)

__all__ = [
    "SPLIT_FRACTIONS",
    "ArithmeticConfig",
    "ArithmeticProblem",
    "ArithmeticSource",
    "arithmetic_reward",
    "generate_problems",
    "make_problem",
    "split_of",
    "tokenizer_corpus",
]
