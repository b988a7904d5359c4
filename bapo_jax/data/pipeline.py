"""Prompt batches with grain: seeded shuffling, epochs, and exact resumption.

    source = PromptSource(tfds.data_source("bapo_math/math_l3to5", split="train",
                                           data_dir=data_dir),
                          style="qwen_math", tokenizer=tokenizer, max_prompt_tokens=1024)
    iterator = prompt_iterator(source, PipelineConfig(batch_size=256, seed=0))
    batch = next(iterator)              # list of PromptExample
    state = iterator.get_state()        # a small JSON-serialisable dict: save it
    ...
    iterator = prompt_iterator(source, same_config); iterator.set_state(state)  # resume

The order is a pure function of (seed, epoch, position): grain's global shuffle of a
random-access source, reseeded each epoch. So the same seed gives the same batches, and a
restored state continues with exactly the batches the saved run would have produced next.
Prompt-length filtering happens once, when the source is built (`PromptSource.num_dropped`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import grain
import numpy as np

from bapo_jax.data.datasets import MathRow
from bapo_jax.data.files import prompt_messages
from bapo_jax.data.prompts import (
    ChatTokenizer,
    Message,
    PromptStyle,
    filter_by_prompt_length,
    prompt_style,
    render_prompt_text,
)
from bapo_jax.data.tfds_builders import decode_example


@dataclasses.dataclass(frozen=True)
class PromptExample:
    """One prompt. `index` is the row's position in the underlying source; `messages` the
    chat prompt (the row's own, or built from its problem and the style); `prompt_ids` is
    None when the source has no tokenizer; `metadata` the row's JSON-able metadata
    (`MathRow.metadata`: verl's data_source, ability, extra_info; empty for shipped sets)."""

    index: int
    id: str
    problem: str
    answer: str
    messages: tuple[Message, ...]
    prompt_ids: tuple[int, ...] | None
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict, hash=False)


def _as_row(item: MathRow | Mapping[str, Any]) -> MathRow:
    return item if isinstance(item, MathRow) else decode_example(item)


class PromptSource:
    """A random-access source of `PromptExample`s (grain's data-source protocol).

    A row's prompt is its own `messages` when it has them (a data file's chat prompt or
    rendered template, `data.files`), else `build_messages(problem, style)`; either way the
    tokenizer's chat template renders it, plus the style's response prefix.

    Args:
      rows: a `tfds.data_source(...)` of the math builders, or a sequence of MathRow.
      style: prompt style name or PromptStyle (see `bapo_jax.data.prompts`).
      system_prompt: optional system message (styles that allow one; put first unless the
        row's own messages have one).
      tokenizer: renders prompts to ids (`apply_chat_template` / `encode` API); None keeps
        only the messages.
      max_prompt_tokens: drop prompts longer than this (needs a tokenizer); the count is
        `num_dropped`.
    """

    def __init__(
        self,
        rows: Sequence[MathRow] | Sequence[Mapping[str, Any]],
        *,
        style: PromptStyle | str = "qwen_math",
        system_prompt: str | None = None,
        tokenizer: ChatTokenizer | None = None,
        max_prompt_tokens: int | None = None,
    ):
        if max_prompt_tokens is not None and tokenizer is None:
            raise ValueError("max_prompt_tokens needs a tokenizer, got tokenizer=None")
        self._rows = rows
        self.style = prompt_style(style)
        self.system_prompt = system_prompt
        self.tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens
        self.num_rows = len(rows)
        if max_prompt_tokens is None:
            self._kept = np.arange(self.num_rows)
            self.num_dropped = 0
        else:
            texts = [self._text(i) for i in range(self.num_rows)]
            encode_batch = getattr(tokenizer, "encode_batch", None)
            ids = encode_batch(texts) if encode_batch else [tokenizer.encode(t) for t in texts]
            kept = filter_by_prompt_length([len(x) for x in ids], max_prompt_tokens)
            self._kept = np.asarray(kept.kept, dtype=np.int64)
            self.num_dropped = kept.dropped
        if len(self._kept) == 0:
            raise ValueError(
                f"no prompts left: all {self.num_rows} rows are longer than "
                f"max_prompt_tokens={max_prompt_tokens}"
            )

    def _messages(self, row: MathRow) -> list[Message]:
        return prompt_messages(row, self.style, system_prompt=self.system_prompt)

    def _text(self, index: int) -> str:
        row = _as_row(self._rows[index])
        return render_prompt_text(self._messages(row), self.tokenizer, self.style)

    def __len__(self) -> int:
        return len(self._kept)

    def __getitem__(self, position: int) -> PromptExample:
        index = int(self._kept[position])
        row = _as_row(self._rows[index])
        messages = self._messages(row)
        prompt_ids = None
        if self.tokenizer is not None:
            text = render_prompt_text(messages, self.tokenizer, self.style)
            prompt_ids = tuple(self.tokenizer.encode(text))
        return PromptExample(
            index=index,
            id=row.id,
            problem=row.problem,
            answer=row.answer,
            messages=tuple(messages),
            prompt_ids=prompt_ids,
            metadata=dict(row.metadata),
        )


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """batch_size prompts per batch; seed fixes the order; num_epochs None = forever;
    read_threads: grain's reader threads (order does not depend on them)."""

    batch_size: int
    seed: int = 0
    shuffle: bool = True
    num_epochs: int | None = None
    drop_remainder: bool = True
    read_threads: int = 2

    def __post_init__(self):
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int):
            raise ValueError(f"batch_size must be an int, got {self.batch_size!r}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")
        if self.num_epochs is not None and self.num_epochs < 1:
            raise ValueError(f"num_epochs must be >= 1 or None, got {self.num_epochs}")
        if self.read_threads < 1:
            raise ValueError(f"read_threads must be >= 1, got {self.read_threads}")


def prompt_dataset(source: PromptSource, config: PipelineConfig) -> grain.MapDataset:
    """Batches (lists of PromptExample) as a grain MapDataset: shuffle -> repeat -> batch."""
    if config.batch_size > len(source) and config.drop_remainder and config.num_epochs:
        raise ValueError(
            f"batch_size must be <= the {len(source)} prompts when drop_remainder with "
            f"finite epochs, got {config.batch_size}"
        )
    dataset = grain.MapDataset.source(source)
    if config.shuffle:
        dataset = dataset.seed(config.seed).shuffle()
    dataset = dataset.repeat(config.num_epochs)
    return dataset.batch(config.batch_size, drop_remainder=config.drop_remainder, batch_fn=list)


def prompt_iterator(source: PromptSource, config: PipelineConfig) -> grain.DatasetIterator:
    """An iterator of batches with `get_state()` / `set_state(state)` for exact resumption."""
    read_options = grain.ReadOptions(num_threads=config.read_threads)
    return iter(prompt_dataset(source, config).to_iter_dataset(read_options))
