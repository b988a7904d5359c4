"""bapo_jax.checks: the one wording of every input check, and choices from Literal aliases."""

from typing import Literal

import numpy as np
import pytest

from bapo_jax.checks import (
    check_choice,
    check_field,
    check_finite,
    check_int,
    choices,
    is_finite_number,
    is_int,
)

Color = Literal["red", "green"]


def test_choices_come_from_the_literal_alias_in_order():
    assert choices(Color) == ("red", "green")
    with pytest.raises(TypeError, match="wants a Literal"):
        choices(str)
    check_choice("color", "green", Color)
    with pytest.raises(ValueError, match=r"^color must be one of \('red', 'green'\), got 'blue'$"):
        check_choice("color", "blue", Color)


def test_numbers_ints_and_the_message_naming_field_and_value():
    assert is_finite_number(1) and is_finite_number(np.float32(0.5))
    assert not any(is_finite_number(v) for v in (True, float("nan"), float("inf"), "1", None))
    assert is_int(3, 3) and is_int(np.int64(4), 0)
    assert not any(is_int(v, 0) for v in (True, 1.0, -1, "2"))
    assert check_int("n", np.int32(5), 1) == 5 and type(check_int("n", np.int32(5), 1)) is int
    with pytest.raises(ValueError, match=r"^n must be an int >= 1, got 0$"):
        check_int("n", 0, 1)
    with pytest.raises(ValueError, match=r"^n must be an int >= 0, got False$"):
        check_int("n", False, 0)
    assert check_finite("x", np.float32(2.0)) == 2.0
    with pytest.raises(ValueError, match=r"^x must be a finite number, got nan$"):
        check_finite("x", float("nan"))
    check_field(True, "y", "anything", 1)
    with pytest.raises(ValueError, match=r"^y must be > 0, got -2$"):
        check_field(False, "y", "> 0", -2)
