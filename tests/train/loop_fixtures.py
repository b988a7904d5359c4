"""A toy RL task for the trainer tests: random-token prompts, a reward the policy can move.

Prompts are deterministic token sequences; answers alternate "parity" and "always". The reward
of a response is 1 when its first token id is even ("parity": depends on the sample, so the
group has signal) or always 1 ("always": every response scores alike, so GRPO gives the group
no signal -- what dynamic sampling drops).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from bapo_jax.data.pipeline import PipelineConfig, PromptExample, prompt_iterator
from bapo_jax.models import Qwen2Config, init_model
from bapo_jax.rollout.embedded import EmbeddedEngine
from bapo_jax.train.config import (
    CheckpointConfig,
    LoggingConfig,
    RolloutConfig,
    TrainerConfig,
)
from bapo_jax.train.optim import OptimizerConfig

MODEL = Qwen2Config.preset("tiny")
# Every id divisible by 8 ends a response (about 1 in 8 tokens of the random tiny model), so
# response lengths vary and groups finish in different generation rounds.
STOP_IDS = tuple(range(8, MODEL.vocab_size, 8))


class ToySource:
    """`size` prompts; prompt i has 3..6 tokens drawn from a generator seeded by i."""

    def __init__(self, size: int = 512, answers: tuple[str, ...] = ("parity", "always")):
        self.size, self.answers = size, answers

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> PromptExample:
        rng = np.random.default_rng(i)
        ids = tuple(int(x) for x in rng.integers(3, MODEL.vocab_size, size=3 + i % 4))
        answer = self.answers[i % len(self.answers)]
        return PromptExample(i, f"p{i}", "", answer, (), ids)


def toy_reward(responses, answers, metadata=None) -> np.ndarray:
    out = []
    for text, answer in zip(responses, answers, strict=True):
        first = text.split()[0] if text.split() else "1"
        out.append(1.0 if answer == "always" or int(first) % 2 == 0 else 0.0)
    return np.asarray(out, np.float32)


def decode(ids) -> str:
    return " ".join(str(i) for i in ids)


def small_config(**sections) -> TrainerConfig:
    """B=4 prompts x G=4 samples, 12-token responses, everything written, no async saves."""
    base = TrainerConfig(
        steps=4,
        rollout=RolloutConfig(
            prompts_per_step=4, samples_per_prompt=4, max_prompt_tokens=8, max_response_tokens=12
        ),
        optimizer=OptimizerConfig(learning_rate=1e-3, weight_decay=0.0),
        checkpoint=CheckpointConfig(every=2, keep=2, async_save=False),
        logging=LoggingConfig(plot_every=2, progress=False),
    )
    return dataclasses.replace(base, **sections)


def make_trainer(
    config: TrainerConfig, out_dir, *, source=None, seed: int = 0, wrap=None, **kwargs
):
    """wrap(engine): what the loop gets instead of the embedded engine (default: itself)."""
    from bapo_jax.train.loop import Trainer

    model = init_model(MODEL, seed=seed)
    engine = EmbeddedEngine(model, eos_token_ids=STOP_IDS, pad_token_id=0, length_bucket=8)
    engine = engine if wrap is None else wrap(engine)
    prompts = prompt_iterator(source or ToySource(), PipelineConfig(batch_size=4, seed=seed))
    return Trainer(
        config,
        model=model,
        engine=engine,
        prompts=prompts,
        reward_fn=toy_reward,
        decode=decode,
        pad_id=0,
        out_dir=str(out_dir),
        **kwargs,
    )
