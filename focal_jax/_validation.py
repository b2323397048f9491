"""Checks of user-given settings that nn/, data/, train/ and eval/ share (not public API)."""

import dataclasses
import numbers

import numpy as np


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


def plain_numbers(config) -> None:
    """Replace each numpy scalar field (`np.int64(4)`, `np.float32(0.4)`: a sweep's values) of the frozen
    dataclass `config` by the Python number it holds, before its checks: configs are checked as Python numbers,
    hashed as static data and written to JSON."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if isinstance(value, (np.integer, np.floating)):
            object.__setattr__(config, field.name, value.item())


def float_field(mapping: dict, key: str, default, where: str) -> float:
    """`mapping[key]` (`default` when absent) as a float; a ValueError naming `where`, the key and the value when it
    is not a number (`float('x')` named neither)."""
    value = mapping.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):
        raise ValueError(f"{where} {key}={value!r} must be a number")
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{where} {key}={value!r} must be a number") from None
