"""A synthetic, verifiable multi-step integer arithmetic task (the CPU main job's data).

A problem is an expression of non-negative integer operands and the operators + - *, e.g.
``12+7*3-5``, evaluated with the usual precedence (products first, then left to right). Its
supervised target is a short scratchpad, one binary operation per step, and the answer boxed.
Two scratchpads: "rewrite" (default) continues the prompt's equation, rewriting the whole
expression after each operation, so a k-operation problem turns into a (k-1)-operation one;
"steps" lists the operations:

    prompt:            "12+7*3-5="
    target, rewrite:   "12+21-5=33-5=28.\\boxed{28}"
    target, steps:     "7*3=21,12+21=33,33-5=28.\\boxed{28}"

Splits are disjoint by construction: a problem's split is a pure function of its canonical
expression string (a salted SHA-256 of it, read as a fraction in [0, 1), falls into one split's
interval of `SPLIT_FRACTIONS`). So no expression can be in two splits, whatever generator
settings or seeds produced the two sets. Generation is seeded (same config, split, count and
seed -> the same list) and has no duplicates within a split.

The reward is 1.0 iff the response's LAST complete ``\\boxed{...}`` holds exactly the answer's
canonical integer text (``-4``, never ``-04``, ``+4`` or ``4.0``); anything else is 0.0.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Sequence

import numpy as np

from bapo_jax.data.pipeline import PromptExample
from bapo_jax.rewards.boxed import extract_last_boxed

OPERATORS = ("+", "-", "*")
SCRATCHPADS = ("rewrite", "steps")
# Fractions of the hash space [0, 1) per split: SFT warm start, RL prompts, held-out eval.
SPLIT_FRACTIONS: dict[str, tuple[float, float]] = {
    "sft": (0.0, 0.4),
    "rl": (0.4, 0.8),
    "eval": (0.8, 1.0),
}
_HASH_SALT = b"bapo-jax/arithmetic/v1:"
_INTEGER = re.compile(r"-?(0|[1-9][0-9]*)")


@dataclasses.dataclass(frozen=True)
class ArithmeticConfig:
    """Which problems the generator draws.

    min_ops, max_ops: number of binary operations, drawn uniformly in [min_ops, max_ops].
    min_operand, max_operand: operands drawn uniformly in [min_operand, max_operand].
    operators: subset of "+", "-", "*", each operation's operator drawn uniformly.
    max_mul_operand: operands next to a "*" are drawn in [min_operand, max_mul_operand] (keeps
      products small), None = no special range.
    scratchpad: "rewrite" (the target rewrites the whole expression after each operation, so a
      k-operation problem becomes a (k-1)-operation one) or "steps" (one ``a op b = c`` per
      operation).
    """

    min_ops: int = 2
    max_ops: int = 3
    min_operand: int = 0
    max_operand: int = 99
    operators: tuple[str, ...] = ("+", "-")
    max_mul_operand: int | None = None
    scratchpad: str = "rewrite"

    def __post_init__(self):
        object.__setattr__(self, "operators", tuple(self.operators))
        for name in ("min_ops", "max_ops", "min_operand", "max_operand"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"ArithmeticConfig.{name} must be an int, got {value!r}")
        if self.min_ops < 1:
            raise ValueError(f"ArithmeticConfig.min_ops must be >= 1, got {self.min_ops}")
        if self.max_ops < self.min_ops:
            raise ValueError(
                f"ArithmeticConfig.max_ops must be >= min_ops ({self.min_ops}), got {self.max_ops}"
            )
        if self.min_operand < 0:
            raise ValueError(f"ArithmeticConfig.min_operand must be >= 0, got {self.min_operand}")
        if self.max_operand < self.min_operand:
            raise ValueError(
                f"ArithmeticConfig.max_operand must be >= min_operand ({self.min_operand}), "
                f"got {self.max_operand}"
            )
        if not self.operators or any(op not in OPERATORS for op in self.operators):
            raise ValueError(
                f"ArithmeticConfig.operators must be a non-empty subset of {OPERATORS}, "
                f"got {self.operators!r}"
            )
        if len(set(self.operators)) != len(self.operators):
            raise ValueError(f"ArithmeticConfig.operators has duplicates: {self.operators!r}")
        if self.scratchpad not in SCRATCHPADS:
            raise ValueError(
                f"ArithmeticConfig.scratchpad must be one of {SCRATCHPADS}, got {self.scratchpad!r}"
            )
        m = self.max_mul_operand
        if m is not None and (
            isinstance(m, bool) or not isinstance(m, int) or m < self.min_operand
        ):
            raise ValueError(
                f"ArithmeticConfig.max_mul_operand must be None or an int >= min_operand "
                f"({self.min_operand}), got {m!r}"
            )


@dataclasses.dataclass(frozen=True)
class ArithmeticProblem:
    """One problem: the canonical expression, its value, its binary steps (``7*3=21``), its
    rewrite chain (the expression after each step), and which of the two the target shows."""

    expression: str
    answer: int
    steps: tuple[str, ...]
    chain: tuple[str, ...]
    scratchpad: str = "rewrite"

    @property
    def split(self) -> str:
        return split_of(self.expression)

    @property
    def id(self) -> str:
        return "arith-" + _digest(self.expression).hex()[:16]

    @property
    def prompt_text(self) -> str:
        return f"{self.expression}="

    @property
    def target_text(self) -> str:
        """The supervised response, then the boxed answer: "rewrite" continues the prompt's
        equation chain (``12+21-5=33-5=28``), "steps" lists the operations
        (``7*3=21,12+21=33,33-5=28``)."""
        body = "=".join(self.chain) if self.scratchpad == "rewrite" else ",".join(self.steps)
        return body + f".\\boxed{{{self.answer}}}"


def _digest(expression: str, salt: bytes = _HASH_SALT) -> bytes:
    return hashlib.sha256(salt + expression.encode("utf-8")).digest()


def hash_fraction(expression: str, salt: bytes = _HASH_SALT) -> float:
    """The expression's position in [0, 1) of the hash space (first 8 digest bytes); `salt`
    names the task (another task's problems split independently)."""
    return int.from_bytes(_digest(expression, salt)[:8], "big") / 2.0**64


def split_of(expression: str, salt: bytes = _HASH_SALT) -> str:
    """The one split this expression belongs to."""
    fraction = hash_fraction(expression, salt)
    for name, (low, high) in SPLIT_FRACTIONS.items():
        if low <= fraction < high:
            return name
    raise AssertionError(f"SPLIT_FRACTIONS does not cover {fraction}")  # unreachable


def _render(values: Sequence[int], ops: Sequence[str]) -> str:
    return str(values[0]) + "".join(f"{op}{v}" for op, v in zip(ops, values[1:], strict=True))


def evaluate(
    operands: Sequence[int], operators: Sequence[str]
) -> tuple[int, tuple[str, ...], tuple[str, ...]]:
    """(value, steps, chain) of ``operands[0] operators[0] operands[1] ...``.

    Products first, left to right; then sums and differences left to right. `steps[i]` is the
    i-th binary operation ``a op b = c``; `chain[i]` is the whole expression after it, with that
    operation replaced by its result (the last entry is the value)."""
    if len(operands) != len(operators) + 1:
        raise ValueError(
            f"need len(operands) == len(operators) + 1, got {len(operands)} and {len(operators)}"
        )
    values, ops = [int(v) for v in operands], list(operators)
    steps, chain = [], []
    while ops:
        i = ops.index("*") if "*" in ops else 0
        a, op, b = values[i], ops[i], values[i + 1]
        result = a * b if op == "*" else (a + b if op == "+" else a - b)
        steps.append(f"{a}{op}{b}={result}")
        values[i : i + 2] = [result]
        del ops[i]
        chain.append(_render(values, ops))
    return values[0], tuple(steps), tuple(chain)


def make_problem(
    operands: Sequence[int], operators: Sequence[str], scratchpad: str = "rewrite"
) -> ArithmeticProblem:
    """The problem ``operands[0] operators[0] operands[1] ...`` with its scratchpad."""
    if scratchpad not in SCRATCHPADS:
        raise ValueError(f"scratchpad must be one of {SCRATCHPADS}, got {scratchpad!r}")
    for op in operators:
        if op not in OPERATORS:
            raise ValueError(f"operator must be one of {OPERATORS}, got {op!r}")
    for v in operands:
        if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 0:
            raise ValueError(f"operands must be non-negative ints, got {v!r}")
    answer, steps, chain = evaluate(operands, operators)
    return ArithmeticProblem(
        expression=_render(operands, operators),
        answer=answer,
        steps=steps,
        chain=chain,
        scratchpad=scratchpad,
    )


def _draw(config: ArithmeticConfig, rng: np.random.Generator) -> ArithmeticProblem:
    num_ops = int(rng.integers(config.min_ops, config.max_ops + 1))
    ops = [config.operators[int(k)] for k in rng.integers(0, len(config.operators), num_ops)]
    near_mul = [
        (i > 0 and ops[i - 1] == "*") or (i < num_ops and ops[i] == "*") for i in range(num_ops + 1)
    ]
    operands = []
    for i in range(num_ops + 1):
        high = config.max_operand
        if near_mul[i] and config.max_mul_operand is not None:
            high = config.max_mul_operand
        operands.append(int(rng.integers(config.min_operand, high + 1)))
    return make_problem(operands, ops, config.scratchpad)


def generate_problems(
    config: ArithmeticConfig, split: str, count: int, seed: int
) -> list[ArithmeticProblem]:
    """`count` distinct problems of `split`, drawn from `config` with `seed` (deterministic).

    Draws are rejected until their hash falls in the split; raises ValueError when the
    config's problem space cannot supply `count` distinct problems of the split."""
    return draw_distinct(lambda rng: _draw(config, rng), config, split, count, seed)


def draw_distinct(draw, config, split: str, count: int, seed: int, stream: int = 0) -> list:
    """`count` distinct problems of `split` from `draw(rng)` (a problem with `expression` and
    `split`), with numpy's generator seeded by (seed, the split's index[, stream])."""
    if split not in SPLIT_FRACTIONS:
        raise ValueError(f"split must be one of {sorted(SPLIT_FRACTIONS)}, got {split!r}")
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"count must be an int >= 0, got {count!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    split_index = list(SPLIT_FRACTIONS).index(split)
    rng = np.random.default_rng([seed, split_index, *([stream] if stream else [])])
    low, high = SPLIT_FRACTIONS[split]
    max_draws = 50 * count / (high - low) + 1000
    seen: set[str] = set()
    problems: list = []
    draws = 0
    while len(problems) < count:
        if draws >= max_draws:
            raise ValueError(
                f"count={count} distinct {split!r} problems not found in {draws} draws (found "
                f"{len(problems)}); the config's problem space is too small: {config}"
            )
        draws += 1
        problem = draw(rng)
        if problem.expression in seen or problem.split != split:
            continue
        seen.add(problem.expression)
        problems.append(problem)
    return problems


def arithmetic_reward(response_text: str, answer: int | str) -> float:
    """1.0 iff the last complete ``\\boxed{...}`` of the response is exactly the integer
    `answer` in canonical form (optional "-", no leading zeros, no sign "+", no spaces inside
    beyond the trimmed ends); 0.0 otherwise (no box, a wrong number, garbage, a nested box)."""
    if not isinstance(response_text, str):
        raise ValueError(f"response_text must be a str, got {type(response_text).__name__}")
    if isinstance(answer, bool) or not isinstance(answer, int | str):
        raise ValueError(f"answer must be an int or its decimal text, got {answer!r}")
    if isinstance(answer, str):
        if not _INTEGER.fullmatch(answer.strip()):
            raise ValueError(f"answer must be a canonical integer text, got {answer!r}")
        answer = int(answer)
    content = extract_last_boxed(response_text)
    return 1.0 if content is not None and content == str(answer) else 0.0


class ArithmeticSource:
    """Random-access prompts (grain's data-source protocol) for
    `bapo_jax.data.pipeline.prompt_iterator`: item i is a `PromptExample` whose `prompt_ids`
    are `[bos] + encode(prompt_text)` (no bos with `add_bos=False`).

    tokenizer: anything with `encode(text) -> list[int]` and `bos_id`
      (`bapo_jax.models.spm_tokenizer.SentencePieceTokenizer`).
    """

    def __init__(self, problems: Sequence[ArithmeticProblem], tokenizer, *, add_bos: bool = True):
        if not problems:
            raise ValueError("problems must be non-empty, got 0 problems")
        self.problems = tuple(problems)
        self.tokenizer = tokenizer
        prefix = [tokenizer.bos_id] if add_bos else []
        self._prompt_ids = [
            tuple(prefix + list(tokenizer.encode(p.prompt_text))) for p in self.problems
        ]

    def __len__(self) -> int:
        return len(self.problems)

    def __getitem__(self, position: int) -> PromptExample:
        problem = self.problems[position]
        return PromptExample(
            index=int(position),
            id=problem.id,
            problem=problem.expression,
            answer=str(problem.answer),
            messages=({"role": "user", "content": problem.prompt_text},),
            prompt_ids=self._prompt_ids[position],
        )

    def target_ids(self, position: int) -> list[int]:
        """The supervised response ids: encode(target_text) + [eos]."""
        problem = self.problems[position]
        return [*self.tokenizer.encode(problem.target_text), self.tokenizer.eos_id]


def tokenizer_corpus(problems: Sequence[ArithmeticProblem]) -> list[str]:
    """Prompt and target texts of the problems (what the task tokenizer is trained on)."""
    return [text for p in problems for text in (p.prompt_text, p.target_text)]
