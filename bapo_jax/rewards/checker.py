"""Answer equivalence with math-verify: the code that runs inside a reward worker process.

`check_answer(pred, gold)` decides whether the extracted final answer `pred` (the content of
the response's last `\\boxed{}`) equals the gold answer:

1. Both strings get the normalisations math-verify lacks (`normalize_answer`): thousands
   separators written as thin spaces (`1\\,000`), a trailing full stop (`18.`), a number and
   its unit inside one `\\text{}` (`\\text{18 dollars}`).
2. Integers are compared exactly, without sympy: `033 == 33` (AIME answers, leading zeros).
3. Otherwise both are parsed by math-verify's LaTeX extraction (latex2sympy's ANTLR grammar:
   the text is parsed, never run as Python) and compared with `math_verify.verify`:
   symbolic equality, numbers to 6 decimal places (so `0.5 == \\frac{1}{2}`, and a decimal
   agreeing with the exact value to 6 places counts as that value), sets, intervals,
   tuples, matrices, equations `x = 5` against `5`. A percent sign is read as a unit:
   `18\\%` matches a gold `18` (math-verify compares both readings).

math-verify's expression extractor (sympy `parse_expr`, which calls `eval`) is never used.
Its SIGALRM timeouts are off (`None`): the worker's own interval timer (`soft_timeout`) bounds
interruptible work, and the parent kills the worker when even that does not return.
"""

from __future__ import annotations

import functools
import logging
import re
import signal
from collections.abc import Iterator
from contextlib import contextmanager

OK = "ok"
SOFT_TIMEOUT = "soft_timeout"
ERROR = "error"

# A digit group separator between digits, followed by exactly three digits: `1\,000`, `1 000`.
_THOUSANDS_SPACE = re.compile(r"(?<=\d)(?:\\,|\\!|\\;|\\:|\\ |~| )(?=\d{3}(?!\d))")
# `\text{18 dollars}` -> `18\text{ dollars}`: math-verify strips units after a number only.
_NUMBER_IN_TEXT = re.compile(r"\\(?:text|textrm|mbox)\s*\{\s*(-?\d[\d,]*(?:\.\d+)?)\s+([^{}]*)\}")
_INTEGER = re.compile(r"[+-]?\d+")
_INTEGER_WITH_COMMAS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+")


class SoftTimeout(BaseException):
    """Raised by the worker's interval timer; passes through math-verify's `except Exception`."""


def normalize_answer(text: str) -> str:
    """The normalisations applied to both answers before comparison (see module docstring)."""
    text = text.strip()
    text = _THOUSANDS_SPACE.sub("", text)
    text = _NUMBER_IN_TEXT.sub(r"\1\\text{ \2}", text)
    if text.endswith(".") and not text.endswith(".."):
        text = text[:-1].rstrip()
    return text


def as_integer(text: str) -> int | None:
    """`text` as an int when it is a plain integer (`033`, `-7`, `1,000`); else None."""
    text = text.strip()
    if text.startswith("\\$"):
        text = text[2:].lstrip()
    if _INTEGER.fullmatch(text) or _INTEGER_WITH_COMMAS.fullmatch(text):
        return int(text.replace(",", ""))
    return None


def _silence_math_verify() -> None:
    # With timeouts off, math-verify warns once per process that the caller must bound the
    # time; this worker does. Its per-failure debug/warning logs are noise here too.
    for name in ("math_verify", "latex2sympy2_extended"):
        logging.getLogger(name).setLevel(logging.ERROR)


@functools.cache
def _latex_config():
    from math_verify import LatexExtractionConfig

    _silence_math_verify()
    return [LatexExtractionConfig(boxed_match_priority=0)]


def _parse(latex: str) -> list:
    from math_verify import parse

    return parse(
        latex, extraction_config=_latex_config(), fallback_mode="first_match", parsing_timeout=None
    )


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> list:
    """The gold answer as `\\boxed{gold}`, else as plain inline math `$gold$`. Golds
    repeat (k samples per problem): each is parsed once per worker."""
    return _parse(f"\\boxed{{{gold}}}") or _parse(f"${gold}$")


def check_answer(pred: str, gold: str) -> bool:
    """Whether the extracted answer `pred` equals `gold` (both LaTeX or plain text)."""
    from math_verify import verify

    pred = normalize_answer(pred)
    gold = normalize_answer(gold)
    if not pred or not gold:
        return False
    gold_int, pred_int = as_integer(gold), as_integer(pred)
    if gold_int is not None and pred_int is not None:
        return gold_int == pred_int
    gold_parsed = _parse_gold(gold)
    pred_parsed = _parse(f"\\boxed{{{pred}}}")
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


def _raise_soft_timeout(signum, frame):
    raise SoftTimeout()


@contextmanager
def soft_timeout(seconds: float | None) -> Iterator[None]:
    """Raise `SoftTimeout` in this (main) thread after `seconds` of wall time (None = off)."""
    if seconds is None:
        yield
        return
    previous = signal.signal(signal.SIGALRM, _raise_soft_timeout)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def score_answer(pred: str, gold: str, soft_timeout_s: float | None) -> tuple[float, str]:
    """(1.0 or 0.0, status): `check_answer` under the soft timeout; errors score 0."""
    try:
        with soft_timeout(soft_timeout_s):
            correct = check_answer(pred, gold)
    except SoftTimeout:
        return 0.0, SOFT_TIMEOUT
    except Exception:  # RecursionError, MemoryError (address-space limit), parser errors
        return 0.0, ERROR
    return (1.0 if correct else 0.0), OK


def warm_up() -> None:
    """Import sympy/latex2sympy and build the parser once, before the worker reports ready."""
    check_answer("\\frac{1}{2}", "0.5")
