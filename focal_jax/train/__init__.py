"""The trainer: `python -m focal_jax.train --config experiments/X.py:ARG --workdir DIR [--config.key=value ...]`,
or `focal_jax.train.train(config, workdir)` from Python."""

from focal_jax.train.trainer import train

__all__ = ["train"]
