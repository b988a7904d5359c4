"""Math prompts as chat messages, rendered to token ids by the model's chat template.

Two styles, both asking for the answer in `\\boxed{}` (what `math_reward` reads):

- `qwen_math` (Qwen2.5-Math, SimpleRL / DAPO-style RL on Qwen2.5 base models): one user
  message, `problem + "\\n" + BOXED_INSTRUCTION`. No system message unless one is given, in
  which case the chat template's default applies (Qwen2.5's template writes
  "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.").
- `r1_distill` (DeepSeek-R1-Distill-Qwen): DeepSeek's usage recommendations for the R1
  series are no system prompt (all instructions in the user turn), the same step-by-step /
  `\\boxed{}` directive for math, and forcing the response to start with "<think>\\n". The
  distill chat template writes `<｜begin▁of▁sentence｜>`, then `<｜User｜>` + content, then
  `<｜Assistant｜>` (recent revisions append "<think>\\n" themselves); `render_prompt` adds
  "<think>\\n" when the template did not.

Rendering goes through the tokenizer (`bapo_jax.models.tokenizer.Tokenizer` or anything with
its `apply_chat_template` / `encode` API), so the model's own template decides the text.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

Message = dict[str, str]


class ChatTokenizer(Protocol):
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = ...,
        tokenize: bool = ...,
    ) -> list[int] | str: ...

    def encode(self, text: str) -> list[int]: ...


@dataclasses.dataclass(frozen=True)
class PromptStyle:
    """How a problem becomes a chat prompt.

    allow_system_prompt: whether a system message may be added.
    response_prefix: text the rendered prompt must end with (added when the template's
      generation prompt does not end with it).
    """

    name: str
    allow_system_prompt: bool
    response_prefix: str
    description: str


QWEN_MATH = PromptStyle(
    name="qwen_math",
    allow_system_prompt=True,
    response_prefix="",
    description="Qwen2.5-Math: user = problem + step-by-step/boxed instruction",
)
R1_DISTILL = PromptStyle(
    name="r1_distill",
    allow_system_prompt=False,
    response_prefix="<think>\n",
    description="DeepSeek-R1-Distill: no system prompt, same instruction, response opens <think>",
)
PROMPT_STYLES: dict[str, PromptStyle] = {s.name: s for s in (QWEN_MATH, R1_DISTILL)}


def prompt_style(style: PromptStyle | str) -> PromptStyle:
    """A PromptStyle from itself or its name."""
    if isinstance(style, PromptStyle):
        return style
    if style not in PROMPT_STYLES:
        raise ValueError(f"style must be one of {sorted(PROMPT_STYLES)}, got {style!r}")
    return PROMPT_STYLES[style]


def build_messages(
    problem: str, style: PromptStyle | str = QWEN_MATH, *, system_prompt: str | None = None
) -> list[Message]:
    """The chat messages asking `problem` in `style`."""
    style = prompt_style(style)
    if not isinstance(problem, str) or not problem.strip():
        raise ValueError(f"problem must be a non-empty string, got {problem!r:.80}")
    if system_prompt is not None and not style.allow_system_prompt:
        raise ValueError(
            f"system_prompt must be None for style {style.name!r} (DeepSeek: no system prompt "
            f"for R1 models; put instructions in the user turn), got {system_prompt!r:.80}"
        )
    messages: list[Message] = []
    if system_prompt is not None:
        messages.append({"role": "system", "content": system_prompt})
    messages.append({"role": "user", "content": f"{problem.strip()}\n{BOXED_INSTRUCTION}"})
    return messages


def render_prompt_text(
    messages: Sequence[Mapping[str, str]], tokenizer: ChatTokenizer, style: PromptStyle | str
) -> str:
    """The prompt text: the chat template with the generation prompt, then the style's
    response prefix if the template did not already end with it."""
    style = prompt_style(style)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if style.response_prefix and not text.endswith(style.response_prefix):
        text += style.response_prefix
    return text


def render_prompt(
    messages: Sequence[Mapping[str, str]], tokenizer: ChatTokenizer, style: PromptStyle | str
) -> list[int]:
    """Token ids of `render_prompt_text` (special tokens in the text map to their ids)."""
    return tokenizer.encode(render_prompt_text(messages, tokenizer, style))


@dataclasses.dataclass(frozen=True)
class LengthFilter:
    """Which prompts fit `max_prompt_tokens`: `kept` are indices into the input."""

    kept: tuple[int, ...]
    dropped: int
    max_prompt_tokens: int


def filter_by_prompt_length(lengths: Sequence[int], max_prompt_tokens: int) -> LengthFilter:
    """Keep prompts with at most `max_prompt_tokens` tokens; count the others."""
    if isinstance(max_prompt_tokens, bool) or not isinstance(max_prompt_tokens, int):
        raise ValueError(f"max_prompt_tokens must be an int, got {max_prompt_tokens!r}")
    if max_prompt_tokens < 1:
        raise ValueError(f"max_prompt_tokens must be >= 1, got {max_prompt_tokens}")
    kept = tuple(i for i, n in enumerate(lengths) if n <= max_prompt_tokens)
    return LengthFilter(
        kept=kept, dropped=len(lengths) - len(kept), max_prompt_tokens=max_prompt_tokens
    )
