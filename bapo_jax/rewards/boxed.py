"""Find the final `\\boxed{...}` answer of a model response, in one linear pass.

This runs in the trainer process on raw model output (possibly megabytes of text), so it is
plain string scanning: no regex backtracking, no recursion, no parsing of the answer.

Grouping braces are tracked with a stack. Escaped braces (`\\{`, `\\}`, set notation) and
LaTeX line breaks (`\\\\`) are not grouping braces. A box is *complete* when the brace that
opened it is closed; the answer is the content of the complete box whose closing brace comes
last (for nested boxes that is the outer one). A box left open at the end of a truncated
response is ignored, so `... \\boxed{3} ... \\boxed{1` answers 3.
"""

from __future__ import annotations

import re

# `\boxed{` / `\fbox{` (optional spaces before the brace), `\\`, an escaped brace, or a brace.
_TOKEN = re.compile(r"\\(?:boxed|fbox)\s*\{|\\\\|\\[{}]|[{}]")
_BOX_OPEN = 0
_GROUP_OPEN = 1


def extract_last_boxed(text: str) -> str | None:
    """Content of the last complete `\\boxed{...}` (or `\\fbox{...}`) of `text`, stripped.

    Returns None when `text` has no complete box. An empty box gives "". Time is linear in
    `len(text)`: every character is visited once by the tokenizing regex, which has no
    nested quantifiers.
    """
    if not isinstance(text, str):
        raise ValueError(f"text must be a str, got {type(text).__name__}")
    if "\\boxed" not in text and "\\fbox" not in text:
        return None
    stack: list[tuple[int, int]] = []  # (kind, index just after the opening brace)
    last: tuple[int, int] | None = None  # (content start, content end) of the last closed box
    for match in _TOKEN.finditer(text):
        token = match.group()
        if token == "{":
            stack.append((_GROUP_OPEN, match.end()))
        elif token == "}":
            if not stack:
                continue  # an unmatched closing brace: nothing to close
            kind, start = stack.pop()
            if kind == _BOX_OPEN:
                last = (start, match.start())
        elif token.endswith("{") and not token.endswith("\\{"):
            stack.append((_BOX_OPEN, match.end()))
        # `\\`, `\{` and `\}` are text, not grouping.
    if last is None:
        return None
    return text[last[0] : last[1]].strip()


def has_boxed_answer(text: str) -> bool:
    """True when `text` ends its reasoning with a complete, non-empty `\\boxed{...}`."""
    content = extract_last_boxed(text)
    return content is not None and content != ""
