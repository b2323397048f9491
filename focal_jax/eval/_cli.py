"""Checks shared by the `focal_jax.eval` command lines, made before a model loads: an output path that cannot be
written, or a setting out of range, would otherwise fail only after the whole evaluation, its results lost."""

import argparse
import math
import os


def rope_ntk_factor(text: str) -> float:
    """argparse type of `--rope-ntk-factor`: a finite float >= 1 (as `AttentionConfig.rope_ntk_factor`);
    anything else is a usage error naming the value."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {text!r}") from None
    if not 1 <= value < math.inf:  # (NaN too)
        raise argparse.ArgumentTypeError(f"the dynamic NTK scaling factor must be a finite number >= 1, got {text!r}")
    return value


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
