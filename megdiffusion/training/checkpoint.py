"""Checkpoints: atomic writes, numbered files that rotate, and finding the newest one that loads.

A checkpoint is a pickled dict of numpy arrays and plain Python values:
``step``, ``config`` (``TrainConfig.to_dict()``), ``model``, ``ema`` (state dicts), ``optimizer``,
``loader`` (data position) and ``rng`` (how step seeds are derived). Files live at
``<logdir>/checkpoints/ckpt_<step:07d>.pkl``.

Loading unpickles, which can run code stored in the file (as ``torch.load`` and ``megengine.load``
do): only load checkpoints you trust.
"""
import os
import pickle
import re
import sys

from megdiffusion.errors import MegdiffusionError
from megdiffusion.fileio import atomic_write

CHECKPOINT_DIR = "checkpoints"
REQUIRED_KEYS = ("step", "config", "model", "ema", "optimizer", "loader")
_NAME = re.compile(r"^ckpt_(\d+)\.pkl$")


class CheckpointError(MegdiffusionError):
    """A missing, unreadable or incomplete checkpoint; the message is one line."""


def checkpoint_dir(logdir):
    """Where a run's checkpoints live."""
    return os.path.join(logdir, CHECKPOINT_DIR)


def checkpoint_path(logdir, step):
    """The file name of the checkpoint at ``step``."""
    return os.path.join(checkpoint_dir(logdir), f"ckpt_{step:07d}.pkl")


def save_checkpoint(path, obj):
    """Pickle ``obj`` to ``path`` atomically: a temporary file in the same directory, then a rename."""
    with atomic_write(path) as f:
        pickle.dump(obj, f, protocol=pickle.HIGHEST_PROTOCOL)


def list_checkpoints(logdir_or_dir):
    """Checkpoint paths in a logdir (or its checkpoints directory), oldest step first."""
    directory = logdir_or_dir
    if os.path.isdir(checkpoint_dir(logdir_or_dir)):
        directory = checkpoint_dir(logdir_or_dir)
    if not os.path.isdir(directory):
        return []
    found = [(int(m.group(1)), name) for name in os.listdir(directory) if (m := _NAME.match(name))]
    return [os.path.join(directory, name) for _, name in sorted(found)]


def prune_checkpoints(logdir, keep):
    """Delete all but the ``keep`` newest checkpoints of a run."""
    for path in list_checkpoints(logdir)[:-keep]:
        os.remove(path)


def load_checkpoint(path):
    """Load one checkpoint dict; ``CheckpointError`` if the file is missing, corrupt or incomplete."""
    if not os.path.isfile(path):
        raise CheckpointError(f"no checkpoint file at {path}")
    try:
        with open(path, "rb") as f:
            obj = pickle.load(f)
    except Exception as err:  # pickle raises many types on truncated or garbled data
        raise CheckpointError(f"cannot read checkpoint {path}: {type(err).__name__}: {err}") from None
    if not isinstance(obj, dict) or any(key not in obj for key in REQUIRED_KEYS):
        raise CheckpointError(f"{path} is not a megdiffusion training checkpoint (missing keys)")
    return obj


def load_latest(logdir, warn=None):
    """The newest checkpoint of ``logdir`` that loads, as ``(checkpoint, path)``, or ``None`` if none exist.

    A newest file that fails to load is reported through ``warn`` (default: a line on stderr) and the
    previous one is tried. ``CheckpointError`` if checkpoints exist but none loads.
    """
    warn = warn or (lambda message: print(message, file=sys.stderr, flush=True))
    paths = list_checkpoints(logdir)
    for path in reversed(paths):
        try:
            return load_checkpoint(path), path
        except CheckpointError as err:
            warn(f"warning: skipping checkpoint: {err}")
    if paths:
        raise CheckpointError(f"none of the {len(paths)} checkpoints in {checkpoint_dir(logdir)} loads")
    return None


def load_model_for_sampling(ckpt_path_or_logdir, ema=True):
    """Rebuild the trained network from a checkpoint file or a run's logdir (its newest checkpoint).

    Returns ``(model, diffusion, config_dict, step)`` with the model in eval mode; ``ema=False`` gives
    the raw weights instead of the EMA ones. Raises ``CheckpointError``.
    """
    from megdiffusion.training.config import ConfigError, TrainConfig, build_diffusion, build_model

    if os.path.isdir(ckpt_path_or_logdir):
        latest = load_latest(ckpt_path_or_logdir)
        if latest is None:
            raise CheckpointError(f"no checkpoints in {ckpt_path_or_logdir}")
        ckpt = latest[0]
    else:
        ckpt = load_checkpoint(ckpt_path_or_logdir)
    try:
        cfg = TrainConfig.from_dict(ckpt["config"])
    except (ConfigError, TypeError) as err:
        raise CheckpointError(f"checkpoint config is unusable: {err}") from None
    model = build_model(cfg)
    model.load_state_dict(ckpt["ema" if ema else "model"])
    model.eval()
    return model, build_diffusion(cfg), cfg.to_dict(), ckpt["step"]
