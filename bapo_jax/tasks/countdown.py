"""A countdown-like search task: reach a target with the given numbers; any valid expression
scores, and failures run long.

A problem is k numbers in a fixed order (each in [1, max_number]) and a target: the value of
one way of putting + or - between them (the first number positive). A response searches:
it writes attempts ``a+b-c+d=v`` one after another and stops at the first whose value is the
target, boxing that expression:

    prompt:  "5,3,2,1:7="
    target:  "5+3+2+1=11,5+3-2-1=5,5+3-2+1=7.\\boxed{5+3-2+1}"

The supervised demonstrations try the 2^(k-1) sign patterns in an order drawn per problem
(seeded), so the warm-started policy is a random searcher. Every valid expression scores, so a
prompt can have several correct answers and the entropy of the search has value; a response
cap shorter than the whole enumeration makes a search that has not found a solution in time a
failure that runs to the cap, so wrong responses are longer than right ones (the regime where
BAPO's rho at r = 1 falls below 1/2; `train.balance`).

Splits are disjoint by construction, as in `tasks.arithmetic`: a problem's split is a pure
function of its prompt text. The reward is 1.0 iff the response's LAST complete
``\\boxed{...}`` is the numbers in order with + or - between them (no spaces, no other
characters) and evaluates to the target; anything else is 0.0.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import re
from collections.abc import Sequence

import numpy as np

from bapo_jax.rewards.boxed import extract_last_boxed
from bapo_jax.tasks import arithmetic as arith

_HASH_SALT = b"bapo-jax/countdown/v1:"
_SIGNED = re.compile(r"[0-9]+|[+-]")


@dataclasses.dataclass(frozen=True)
class CountdownConfig:
    """numbers: k, how many numbers a problem gives; max_number: each in [1, max_number]."""

    numbers: int = 4
    max_number: int = 9

    def __post_init__(self):
        for name, low in (("numbers", 2), ("max_number", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"CountdownConfig.{name} must be an int >= {low}, got {value!r}")


def render(numbers: Sequence[int], signs: Sequence[str]) -> str:
    """``n0 s0 n1 s1 n2 ...`` without spaces, e.g. ``5+3-2+1``."""
    return str(numbers[0]) + "".join(f"{s}{n}" for s, n in zip(signs, numbers[1:], strict=True))


def value_of(numbers: Sequence[int], signs: Sequence[str]) -> int:
    return int(numbers[0]) + sum(
        n if s == "+" else -n for s, n in zip(signs, numbers[1:], strict=True)
    )


def sign_patterns(k: int) -> list[tuple[str, ...]]:
    """The 2^(k-1) sign patterns between k numbers, "+" before "-" at each place."""
    return list(itertools.product("+-", repeat=k - 1))


@dataclasses.dataclass(frozen=True)
class CountdownProblem:
    """numbers (in order), target, and `order`: the sign patterns the demonstration tries, in
    its order, up to and including the first that reaches the target."""

    numbers: tuple[int, ...]
    target: int
    order: tuple[tuple[str, ...], ...]

    @property
    def expression(self) -> str:
        """The problem's identity (what the split hash and the prompt read)."""
        return ",".join(map(str, self.numbers)) + f":{self.target}"

    @property
    def answer(self) -> str:
        """What the reward needs: the numbers and the target (`expression`)."""
        return self.expression

    @property
    def split(self) -> str:
        return split_of(self.expression)

    @property
    def id(self) -> str:
        return "countdown-" + hashlib.sha256(_HASH_SALT + self.expression.encode()).hexdigest()[:16]

    @property
    def prompt_text(self) -> str:
        return f"{self.expression}="

    @property
    def solutions(self) -> tuple[str, ...]:
        """Every expression that scores."""
        return solutions(self.numbers, self.target)

    @property
    def target_text(self) -> str:
        """The demonstration: each attempt and its value, the last one boxed."""
        attempts = [f"{render(self.numbers, s)}={value_of(self.numbers, s)}" for s in self.order]
        return ",".join(attempts) + f".\\boxed{{{render(self.numbers, self.order[-1])}}}"


def solutions(numbers: Sequence[int], target: int) -> tuple[str, ...]:
    return tuple(
        render(numbers, s) for s in sign_patterns(len(numbers)) if value_of(numbers, s) == target
    )


def split_of(text: str) -> str:
    return arith.split_of(text, _HASH_SALT)


def _draw(config: CountdownConfig, rng: np.random.Generator) -> CountdownProblem:
    numbers = tuple(int(v) for v in rng.integers(1, config.max_number + 1, config.numbers))
    patterns = sign_patterns(config.numbers)
    target = value_of(numbers, patterns[int(rng.integers(len(patterns)))])
    order = [patterns[int(i)] for i in rng.permutation(len(patterns))]
    first = next(i for i, s in enumerate(order) if value_of(numbers, s) == target)
    return CountdownProblem(numbers, target, tuple(order[: first + 1]))


def generate_problems(
    config: CountdownConfig, split: str, count: int, seed: int
) -> list[CountdownProblem]:
    """`count` distinct problems of `split` (deterministic in config, split, count and seed);
    raises ValueError when the config's problem space cannot supply them."""
    return arith.draw_distinct(lambda rng: _draw(config, rng), config, split, count, seed, 1)


def parse_answer(answer: str) -> tuple[tuple[int, ...], int]:
    """``"5,3,2,1:7"`` -> ((5, 3, 2, 1), 7)."""
    try:
        numbers, target = answer.split(":")
        return tuple(int(v) for v in numbers.split(",")), int(target)
    except ValueError:
        raise ValueError(f"answer must read 'n0,n1,...:target', got {answer!r}") from None


def boxed_expression(response_text: str, answer: str) -> str | None:
    """The response's last boxed expression when it scores, else None."""
    numbers, target = parse_answer(answer)
    content = extract_last_boxed(response_text)
    if content is None:
        return None
    pieces = _SIGNED.findall(content)
    if "".join(pieces) != content or len(pieces) != 2 * len(numbers) - 1:
        return None
    digits, signs = pieces[::2], pieces[1::2]
    if not all(d.isdigit() and d[0] != "0" for d in digits) or any(s not in "+-" for s in signs):
        return None
    if tuple(int(d) for d in digits) != numbers or value_of(numbers, signs) != target:
        return None
    return content


def countdown_reward(response_text: str, answer: str) -> float:
    """1.0 iff the last boxed expression uses the numbers in order, + or - between them, and
    reaches the target; 0.0 otherwise."""
    if not isinstance(response_text, str):
        raise ValueError(f"response_text must be a str, got {type(response_text).__name__}")
    return 0.0 if boxed_expression(response_text, answer) is None else 1.0
