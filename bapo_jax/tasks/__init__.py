"""Synthetic verifiable tasks: the CPU main job's multi-step integer arithmetic, and the
countdown search of the study v2 (`tasks.countdown`; both through `tasks.kinds`)."""

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
