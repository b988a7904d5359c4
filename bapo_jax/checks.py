"""Input checks shared by every config and module boundary, with one wording.

Each check raises ``ValueError("<name> must be <rule>, got <value!r>")``: the message names the
field and the value it got. A choice field is typed with a ``Literal`` alias declared once; its
allowed values come from that alias (`choices`), never from a second list.
"""

from __future__ import annotations

import math
import numbers
import typing
from typing import Any

import numpy as np


def choices(literal: Any) -> tuple[Any, ...]:
    """The values of a ``Literal[...]`` alias, in declaration order."""
    if typing.get_origin(literal) is not typing.Literal:
        raise TypeError(f"choices wants a Literal[...] alias, got {literal!r}")
    return typing.get_args(literal)


def is_finite_number(value: Any) -> bool:
    """A real, finite, non-bool number (Python or NumPy scalar)."""
    real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    return real and math.isfinite(value)


def is_int(value: Any, low: int) -> bool:
    """An int (Python or NumPy, not bool) >= low."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool) and value >= low


def check_field(ok: bool, name: str, rule: str, value: Any) -> None:
    """Raise ValueError("<name> must be <rule>, got <value!r>") unless ok."""
    if not ok:
        raise ValueError(f"{name} must be {rule}, got {value!r}")


def check_choice(name: str, value: Any, literal: Any) -> None:
    """`value` is one of the `Literal` alias's values."""
    allowed = choices(literal)
    check_field(value in allowed, name, f"one of {allowed}", value)


def check_int(name: str, value: Any, low: int) -> int:
    """`value` is an int >= low; returned as a Python int."""
    check_field(is_int(value, low), name, f"an int >= {low}", value)
    return int(value)


def check_finite(name: str, value: Any) -> float:
    """`value` is a finite real number; returned as a Python float."""
    check_field(is_finite_number(value), name, "a finite number", value)
    return float(value)


def check_dir_mode(name: str, value: Any) -> int:
    """`value` is a directory's permissions as octal digits ("700", "750"); returned as an int."""
    ok = isinstance(value, str) and 1 <= len(value) <= 4 and set(value) <= set("01234567")
    check_field(ok, name, 'permissions in octal digits, e.g. "700"', value)
    return int(value, 8)
