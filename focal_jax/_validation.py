"""Checks of user-given settings that nn/, data/, train/ and eval/ share (not public API)."""

import numbers


def is_integer(value) -> bool:
    """A Python or numpy integer; a bool is not one."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(name: str, value, minimum: int) -> int:
    """`value` as a Python int if it is an integer (`is_integer`) >= `minimum`, else a ValueError naming it."""
    if not is_integer(value) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {name}={value!r}")
    return int(value)


def check_distinct(name: str, values) -> None:
    """A ValueError naming `values` (a sequence of hashables) when one of them appears twice."""
    if len(set(values)) < len(values):
        raise ValueError(f"{name} must be distinct, got {name}={list(values)}")
