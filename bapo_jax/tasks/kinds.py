"""The CPU job's task kinds: their problem sets, rewards and evaluation.

    arithmetic  (`tasks.arithmetic`) one right answer per problem; the warm start sees 1-2
                operation problems (and a few 3-operation ones), RL and evaluation 3-operation
                ones.
    countdown   (`tasks.countdown`) reach a target with k given numbers; every valid expression
                scores, and a search that misses runs to the response cap. The warm start sees
                k - 1 number problems (and a few k-number ones), RL and evaluation k-number ones.

Evaluation: greedy accuracy over the held-out problems, and with `samples` > 0, `samples`
sampled responses per problem at temperature 1: pass@samples (the share of problems with at
least one correct response), the mean accuracy of the samples, and the distinct correct
answers per problem (what "several correct answers" means for countdown; at most 1 for
arithmetic).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np

from bapo_jax.rewards.boxed import extract_last_boxed
from bapo_jax.rollout.types import RolloutEngine, SamplingParams
from bapo_jax.tasks import arithmetic as arith
from bapo_jax.tasks import countdown

TaskKind = Literal["arithmetic", "countdown"]
Problems = tuple[list, list, list]  # warm start, RL, held out


def problem_sets(
    kind: str, *, size: int, max_number: int, n_basic: int, n_target: int, n_eval: int,
    rl_prompts: int, seed: int,
) -> Problems:  # fmt: skip
    """The warm-start, RL and held-out problems of `kind`; `size` is the RL problems' size
    (operations for arithmetic, numbers for countdown), the warm start's basic ones are smaller."""
    if kind == "arithmetic":
        basic = arith.ArithmeticConfig(min_ops=1, max_ops=size - 1, max_operand=max_number)
        target = arith.ArithmeticConfig(min_ops=size, max_ops=size, max_operand=max_number)
        draw = arith.generate_problems
    elif kind == "countdown":
        basic = countdown.CountdownConfig(numbers=size - 1, max_number=max_number)
        target = countdown.CountdownConfig(numbers=size, max_number=max_number)
        draw = countdown.generate_problems
    else:
        raise ValueError(f"task kind must be 'arithmetic' or 'countdown', got {kind!r}")
    warm = draw(basic, "sft", n_basic, seed) + draw(target, "sft", n_target, seed + 1)
    return warm, draw(target, "rl", rl_prompts, seed), draw(target, "eval", n_eval, seed)


def reward_of(kind: str) -> Callable[[str, str], float]:
    return countdown.countdown_reward if kind == "countdown" else arith.arithmetic_reward


def correct_answer(kind: str, text: str, answer: str) -> str | None:
    """What a correct response answered (its boxed expression or integer), None if wrong."""
    if kind == "countdown":
        return countdown.boxed_expression(text, answer)
    return extract_last_boxed(text) if arith.arithmetic_reward(text, answer) else None


def rewards(kind: str, texts: Sequence[str], answers: Sequence[str]) -> np.ndarray:
    score = reward_of(kind)
    return np.asarray([score(t, a) for t, a in zip(texts, answers, strict=True)], np.float64)


def evaluate(
    engine: RolloutEngine,
    kind: str,
    source,
    decode: Callable[[Sequence[int]], str],
    stop_id: int,
    max_tokens: int,
    samples: int = 0,
) -> dict[str, float]:
    """Greedy accuracy over `source`'s problems, plus pass@samples, sampled accuracy and the
    distinct correct answers per problem when `samples` > 0 (seed 0: the same draws for every
    version)."""
    prompts = [source[i].prompt_ids for i in range(len(source))]
    answers = [source[i].answer for i in range(len(source))]
    sampling = SamplingParams(max_tokens=max_tokens, temperature=1.0, stop_token_ids=(stop_id,))
    greedy = engine.generate(prompts, 1, sampling, seed=0, greedy=True)
    texts = [decode(s.token_ids) for s in greedy.samples]
    out = {"accuracy": float(rewards(kind, texts, answers).mean())}
    if samples > 0:
        rollout = engine.generate(prompts, samples, sampling, seed=0)
        texts = [decode(s.token_ids) for s in rollout.samples]
        found = [
            correct_answer(kind, t, answers[i // samples]) for i, t in enumerate(texts)
        ]  # [P x samples]
        per_prompt = [found[i * samples : (i + 1) * samples] for i in range(len(prompts))]
        out[f"pass@{samples}"] = float(np.mean([any(f) for f in per_prompt]))
        out["sampled_accuracy"] = float(np.mean([f is not None for f in found]))
        out["distinct_correct"] = float(
            np.mean([len({a for a in f if a is not None}) for f in per_prompt])
        )
    return out
