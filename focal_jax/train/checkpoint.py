"""Checkpoints with orbax's `CheckpointManager`, and the one init precedence of a run.

A checkpoint at step s holds the items `params` (the trainable parameters only when the run starts from a
pretrained model, the whole model otherwise), `opt_state`, `data` (the data iterator's state, JSON) and `meta`
(JSON: the config, `init_from`, which parameters were saved). Saving is asynchronous; orbax writes each step to a
temporary directory and renames it when complete, so a crash during a save never leaves a partial step that looks
like the latest one. Init precedence: resume the run's own workdir > `init_from` (a pretrained focal_jax workdir or a
Hugging Face directory; only the parameters the config declares as new may be missing) > scratch.
"""

import contextlib
import fcntl
import json
import os
import socket

import jax
import numpy as np
import orbax.checkpoint as ocp

from focal_jax.train.config import ConfigError
from focal_jax.train.optimizer import path_str


def checkpoint_dir(workdir: str) -> str:
    return os.path.join(os.path.abspath(workdir), "checkpoints")


LOCK_FILE = "train.lock"


@contextlib.contextmanager
def workdir_lock(workdir: str):
    """Hold `WORKDIR/train.lock` while a run trains there. A second run started in the same workdir (a job
    submitted twice, a requeue while the first still runs) gets a ConfigError naming the holder, instead of two
    runs writing the same checkpoints. The lock is an advisory `flock`, released when the block ends or the process
    dies (killed too); none is held on a file system without `flock` (some network mounts). Process 0 holds it for
    a multi-process run."""
    if jax.process_index() != 0:
        yield
        return
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, LOCK_FILE)
    with open(path, "a+") as file:
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            holder = file.read().strip() or "a process that wrote no name"
            raise ConfigError(f"workdir {workdir} is in use by another training run ({holder} holds {path}): wait "
                              f"for it to end, stop it, or use another workdir") from None
        except OSError:  # no flock here: the run goes on unguarded
            pass
        else:
            file.seek(0)
            file.truncate()
            file.write(f"pid {os.getpid()} on {socket.gethostname()}")
            file.flush()
        yield


@contextlib.contextmanager
def reading(workdir: str, step: int):
    """Reads checkpoint `step` of `workdir` in this block: orbax's errors on a damaged or partly copied checkpoint
    (an item directory missing, a file cut short: KeyError, ValueError, OSError, each with a long traceback) become
    one ConfigError naming the step and what to do."""
    try:
        yield
    except ConfigError:
        raise
    except (KeyError, ValueError, OSError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConfigError(f"the checkpoint of step {step} in {workdir!r} cannot be read: it is damaged or partly "
                          f"copied ({type(e).__name__}: {first_line[:300]}); delete its directory "
                          f"{os.path.join(checkpoint_dir(workdir), str(step))} to resume from the step before, or "
                          f"copy it again") from None


@contextlib.contextmanager
def open_manager(workdir: str):
    """`make_manager(workdir, create=False)` for reading, closed when the block ends without an error. (Closed
    after a failed read of a damaged checkpoint, its pending reads printed dozens of 'Event loop is closed'
    tracebacks after the error; left open, one.)"""
    manager = make_manager(workdir, create=False)
    yield manager
    manager.close()


def make_manager(workdir: str, *, keep: int = 3, create: bool = True) -> ocp.CheckpointManager:
    """The CheckpointManager over `WORKDIR/checkpoints`, keeping the last `keep` steps, saving asynchronously.
    With `create=False` it makes no directory (for reading a workdir that may hold no run)."""
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True, create=create)
    handlers = {"params": ocp.StandardCheckpointHandler(), "opt_state": ocp.StandardCheckpointHandler(),
                "data": ocp.JsonCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
    return ocp.CheckpointManager(checkpoint_dir(workdir), options=options, item_handlers=handlers)


def save(manager: ocp.CheckpointManager, step: int, *, params, opt_state, data_state: dict, meta: dict,
         force: bool = False) -> bool:
    """Start an asynchronous save of step `step` (returns at once; `manager.wait_until_finished()` to block)."""
    args = ocp.args.Composite(params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt_state),
                              data=ocp.args.JsonSave(data_state), meta=ocp.args.JsonSave(meta))
    return manager.save(step, args=args, force=force)


def _abstract(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s), tree, shardings)


def restore(manager: ocp.CheckpointManager, step: int, *, params, opt_state, params_sharding, opt_sharding):
    """`(params, opt_state, data_state, meta)` of step `step`, restored with the shapes, dtypes and shardings of
    the given `params` / `opt_state` (abstract or concrete)."""
    args = ocp.args.Composite(params=ocp.args.StandardRestore(_abstract(params, params_sharding)),
                              opt_state=ocp.args.StandardRestore(_abstract(opt_state, opt_sharding)),
                              data=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore())
    with reading(os.path.dirname(str(manager.directory)), step):  # (the workdir of WORKDIR/checkpoints)
        restored = manager.restore(step, args=args)
    return restored["params"], restored["opt_state"], restored["data"], restored["meta"]


def read_meta(workdir: str, step: int | None = None) -> tuple[int, dict]:
    """`(step, meta)` of a focal_jax workdir's latest (or given) checkpoint; ValueError if it has none."""
    with open_manager(workdir) as manager:
        step = manager.latest_step() if step is None else step
        if step is None:
            raise ValueError(f"{workdir!r} holds no checkpoint (looked in {checkpoint_dir(workdir)})")
        with reading(workdir, step):
            meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    return step, meta


def saved_steps(workdir: str) -> list[int]:
    """The steps of the checkpoints a workdir keeps, in order (empty if none)."""
    with open_manager(workdir) as manager:
        return sorted(manager.all_steps())


def require_step(workdir: str, step: int | None, why: str = ""):
    """ValueError naming the saved steps unless `workdir` keeps checkpoint `step` (None: nothing to check)."""
    if step is None:
        return
    saved = saved_steps(workdir)
    if step not in saved:
        raise ValueError(f"{workdir!r} has no checkpoint at step={step}{f' ({why})' if why else ''}; saved steps: "
                         f"{saved}")


def saved_param_paths(workdir: str, step: int) -> dict[str, tuple]:
    """`{path: shape}` of the parameters saved in a workdir's checkpoint `step` (read from metadata only)."""
    with open_manager(workdir) as manager, reading(workdir, step):
        tree = manager.item_metadata(step)["params"]
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))[0]
    return {path_str(p): tuple(m.shape) for p, m in flat}


def load_params(workdir: str, step: int, target: dict, shardings: dict) -> dict:
    """The parameters saved at `step` of `workdir`, as a pure dict with `target`'s structure, shapes, dtypes and
    shardings. The checkpoint must hold exactly `target`'s parameters."""
    args = ocp.args.Composite(params=ocp.args.StandardRestore(_abstract(target, shardings)))
    with open_manager(workdir) as manager, reading(workdir, step):
        return manager.restore(step, args=args)["params"]


def is_hf_directory(path: str) -> bool:
    """A Hugging Face model directory: config.json next to safetensors weights."""
    return os.path.isfile(os.path.join(path, "config.json")) and any(
        f.endswith(".safetensors") for f in os.listdir(path))


def config_json(config) -> dict:
    """The config as plain JSON data (what checkpoints store and resumes compare)."""
    return json.loads(config.to_json_best_effort(sort_keys=True))


PATHS = (("init_from",), ("data", "tokenizer"))  # config fields holding a path
PATTERNS = (("data", "paths"), ("data", "eval_paths"))  # config fields holding glob patterns


def with_absolute_paths(config: dict) -> dict:
    """`config` (JSON data) with the relative paths of its `PATHS` and `PATTERNS` fields made absolute against the
    working directory (`~` expanded; glob patterns stay patterns, as a list): what a checkpoint stores, so that its
    run loads and evaluates from any directory, and what a resume compares."""
    def absolute(path):
        if not isinstance(path, str) or not path:
            return path
        path = os.path.expanduser(path)
        return path if os.path.isabs(path) else os.path.join(os.getcwd(), path)

    config = json.loads(json.dumps(config))
    for field in PATHS + PATTERNS:
        section = config
        for key in field[:-1]:
            section = section.get(key) if isinstance(section, dict) else None
        if not isinstance(section, dict) or section.get(field[-1]) is None:
            continue
        value = section[field[-1]]
        if field in PATHS:
            section[field[-1]] = absolute(value)
        else:  # a list, or a comma-separated string (`DataConfig.paths`)
            patterns = value.split(",") if isinstance(value, str) else value
            section[field[-1]] = [absolute(p.strip()) if isinstance(p, str) else p for p in patterns
                                  if not isinstance(p, str) or p.strip()]
    return config


def stored_config(meta: dict) -> dict:
    """The config (JSON data) a checkpoint's `meta` records, its paths absolute (`with_absolute_paths`: runs stored
    by 0.6.15 and earlier hold them as given, and they are read against the working directory, as they were)."""
    return with_absolute_paths(meta["config"])
