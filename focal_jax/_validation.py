"""Checks of user-given settings that nn/, data/, train/, eval/ and convert/ share (not public API)."""

import dataclasses
import numbers
import os

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


def _nearest_existing(path: str) -> str:
    """`path`, or its nearest ancestor that exists."""
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def _folder_error(flag: str, path: str, folder: str, *, make_folder: bool) -> str:
    """Why `folder` (absolute) cannot receive the output `flag`=`path`, '' when it can: it exists as a writable
    directory, or `make_folder` and its nearest existing ancestor is one."""
    existing = _nearest_existing(folder)
    if existing != folder and not make_folder:
        return f"{flag}={path}: its directory {folder} does not exist; expected an existing directory (create it)"
    if not os.path.isdir(existing):
        return f"{flag}={path}: expected a path under a directory, but {existing} is a file"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{flag}={path}: directory {existing} is not writable"
    return ""


def output_file_error(flag: str, path: str, *, make_folder: bool) -> str:
    """Why the command line option `flag` (e.g. '--out') cannot name `path` as the file a command writes once it has
    run, '' when it can. An existing file is fine (the commands overwrite it); a directory is not; the file's folder
    must exist, or with `make_folder` (the command creates it) lie below an existing directory; all writable."""
    if os.path.isdir(path):
        return f"{flag}={path} is a directory; expected the path of a file to write"
    if os.path.exists(path) and not os.access(path, os.W_OK):
        return f"{flag}={path} is a file that cannot be overwritten (not writable)"
    return _folder_error(flag, path, os.path.dirname(os.path.abspath(path)), make_folder=make_folder)


def output_dir_error(flag: str, path: str) -> str:
    """Why the command line option `flag` cannot name `path` as the directory a command writes its files into
    (creating it and its parents), '' when it can: it must be a writable directory, or not exist yet below one."""
    if os.path.exists(path) and not os.path.isdir(path):
        return f"{flag}={path} is a file; expected a directory (the command writes its files into it, creating it)"
    return _folder_error(flag, path, os.path.abspath(path), make_folder=True)
