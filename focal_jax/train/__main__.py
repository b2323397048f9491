"""`python -m focal_jax.train --config experiments/X.py:ARG --workdir DIR [--config.key=value ...]`.

Every process of a multi-host job runs this same command. `jax.distributed.initialize()` is called when the
environment describes several processes: a Cloud TPU pod slice, a SLURM job with more than one task, or the
`JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES` and `JAX_PROCESS_ID` variables set by hand.
"""

import os
import sys

import jax
from absl import app, flags, logging
from ml_collections import config_flags

# New keys are accepted here (the `model` section holds only the fields an experiment sets, yet any LlamaConfig /
# GPT2Config field may be given, e.g. --config.model.remat=True); `check_config` then rejects unknown ones by name.
config_flags.DEFINE_config_file("config", None, "experiment config file, e.g. experiments/quickstart.py:runlocal",
                                lock_config=False, accept_new_attributes=True)
flags.DEFINE_string("workdir", None, "directory for checkpoints, metrics and plots (resumed if it holds a run)")
flags.DEFINE_enum("distributed", "auto", ["auto", "on", "off"],
                  "call jax.distributed.initialize(): 'auto' when the environment describes several processes")
flags.mark_flags_as_required(["config", "workdir"])


def multi_process_environment() -> bool:
    """True on a multi-host TPU slice, in a SLURM job of several tasks, or with JAX_NUM_PROCESSES > 1."""
    if int(os.environ.get("JAX_NUM_PROCESSES", "1")) > 1:
        return True
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return True
    return "," in os.environ.get("TPU_WORKER_HOSTNAMES", "")


HELP_FLAGS = ("-?", "--help", "-help", "--helpshort", "-helpshort", "--helpfull", "-helpfull")


def _fail(message: str):
    """A usage error as one line on stderr (status 2), not a traceback."""
    print(f"python -m focal_jax.train: error: {message}", file=sys.stderr)
    sys.exit(2)


def flag_value(argv, flag: str) -> str | None:
    """The value of `--flag=VALUE` or `--flag VALUE` in `argv` (None when absent), read before absl parses them."""
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        name, eq, value = arg.lstrip("-").partition("=")
        if arg.startswith("-") and name == flag:
            return value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
    return None


def config_file(argv) -> str | None:
    """The file part of `--config FILE[:ARG]` in `argv` (None when absent)."""
    value = flag_value(argv, "config")
    return None if value is None else value.split(":", 1)[0]


def initialize_distributed(argv):
    """`jax.distributed.initialize()` when `--distributed` (read from `argv`) is 'on', or 'auto' (the default) in a
    multi-process environment. Called before the config file is read: a config that reads its base run's
    checkpoint (`init_from`) starts JAX's backend, after which `initialize` is refused."""
    distributed = flag_value(argv, "distributed") or "auto"
    if distributed not in ("auto", "on", "off"):
        _fail(f"--distributed={distributed!r} is not one of 'auto', 'on', 'off'")
    if distributed == "off" or (distributed == "auto" and not multi_process_environment()):
        return
    kwargs = {}
    if "JAX_NUM_PROCESSES" in os.environ:
        if "JAX_PROCESS_ID" not in os.environ:
            _fail(f"JAX_NUM_PROCESSES={os.environ['JAX_NUM_PROCESSES']} is set, so JAX_PROCESS_ID must be too: each "
                  f"process's id in [0, JAX_NUM_PROCESSES)")
        kwargs = dict(coordinator_address=os.environ.get("JAX_COORDINATOR_ADDRESS"),
                      num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
                      process_id=int(os.environ["JAX_PROCESS_ID"]))
    jax.distributed.initialize(**kwargs)


def parse_flags(argv):
    """absl's parsing, with each error one line naming the bad value: a `--config` file that does not exist
    (ml_collections ends in a traceback, and only once the config is read) and an error of the file's `get_config`
    (ml_collections gives its whole traceback) included; a section given a value (`--config.data.task_kwargs=
    n_pairs=8`, the form before 0.6.10) is told to set its keys one by one."""
    path = config_file(argv[1:])
    if not any(arg.split("=", 1)[0] in HELP_FLAGS for arg in argv[1:]):
        initialize_distributed(argv[1:])
    if path and not os.path.isfile(path):
        _fail(f"--config: no file {path!r} (relative paths are from the working directory {os.getcwd()}; the "
              f"experiments/ files are in the repository, not installed with the package: run from its root or give "
              f"their path)")
    try:
        return flags.FLAGS(argv)
    except SystemExit as e:  # absl's --help exits with status 1; asked-for help is a success, as in argparse
        if e.code == 1 and any(arg.split("=", 1)[0] in HELP_FLAGS for arg in argv[1:]):
            sys.exit(0)
        raise
    except flags.Error as e:
        message = str(e)
        if "Error whilst parsing config file:" in message:  # the exception's own line ends the traceback
            message = f"--config {path}: " + message.strip().splitlines()[-1].strip()
        elif " as a ConfigDict: " in message and message.startswith("flag --config."):
            section = message[len("flag --"):].split("=", 1)[0]
            message += f" ({section} is a section: set its keys one by one, --{section}.KEY=VALUE)"
        _fail(message)
    except (KeyError, ValueError, TypeError, AttributeError) as e:  # ml_collections, on an override below a
        _fail(override_error(argv[1:], e))  # missing, None or non-section key


def override_error(argv, error: Exception) -> str:
    """One line for ml_collections' error on a `--config.a.b.c=value` override whose section `a.b` the config lacks
    (KeyError "'b'", maybe with a did-you-mean line) or holds as None (ValueError 'Override a.b.c can not be applied
    because field "b" is None, ...'), naming the override and the section; other errors (a section that is a value,
    `--config.data.source.x`) with the overrides given."""
    overrides = [arg.split("=", 1)[0][2:] for arg in argv if arg.startswith("--config.")]
    lines = (str(error.args[0]) if error.args else str(error)).splitlines() or [""]
    if isinstance(error, KeyError):
        field = lines[0].strip("'\"")
        hint = " ".join(line.strip() for line in lines[1:])
        problem = "is not a key of this config" + (f" ({hint})" if hint else "")
    elif isinstance(error, ValueError) and 'field "' in lines[0] and " is None" in lines[0]:
        field = lines[0].split('field "', 1)[1].split('"', 1)[0]
        problem = "is None in this config, so its fields cannot be set one by one: give the section in the config file"
    else:
        given = ", ".join("--" + o for o in overrides)
        return f"--config overrides {given}: {type(error).__name__}: {' '.join(lines)}"
    override = next((o for o in overrides if field in o.split(".")[1:-1]), None)
    if override is None:
        return f"--config: {field!r} {problem}"
    path = override.split(".")
    return f"--{override}: {'.'.join(path[1:path.index(field, 1) + 1])} {problem}"


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # orbax logs every file operation at INFO
    # imported after `initialize_distributed` (in `parse_flags`): no JAX backend may start before it
    from focal_jax.train.config import ConfigError
    from focal_jax.train.trainer import check_run, train

    # The config's mistakes (an unknown key, a bad value, a workdir holding another run, a mesh that does not fit) as
    # one line naming them; so are those train finds once the data and model are built (ConfigError).
    try:
        check_run(flags.FLAGS.config, flags.FLAGS.workdir)
    except ValueError as e:
        _fail(str(e))
    try:
        train(flags.FLAGS.config, flags.FLAGS.workdir)
    except ConfigError as e:
        _fail(str(e))


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
