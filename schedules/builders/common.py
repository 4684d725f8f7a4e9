"""Helpers shared by the schedule builders."""
from __future__ import annotations


def check_count(name: str, value: object, minimum: int = 1) -> int:
    """Return `value` if it is an int >= minimum, else raise a ValueError naming it."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value
