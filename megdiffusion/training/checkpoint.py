"""Checkpoints: what one holds, numbered files that rotate, and finding the newest one that loads.

A checkpoint is a pickled dict of numpy arrays and plain Python values, written by ``snapshot`` and read
back into a run by ``restore``:

- ``step``: optimizer steps taken; ``config``: the run's ``TrainConfig.to_dict()``;
- ``model``, ``ema``: the network's and its moving average's state dicts; ``optimizer``: Adam's;
- ``loader``: the data position (``BatchLoader.state_dict()``);
- ``rng``: ``{"seed", "scheme"}``, the scheme step randomness is drawn with (``draws``; a resumed run keeps it);
- ``loss_scale``: the ``LossScaler``'s state of an ``--amp`` run, else None (absent before mixed precision);
- ``data``: ``{"count", "checksum"}`` of the images it trained on (``datasets.dataset_identity``; absent before);
- ``ema_profiles``: post-hoc EMA's profiles (``{name: array}`` each, in ``--ema_profiles`` order) of a run that
  tracks them, else None (absent before).

A run that tracks profiles with ``--snapshot_every`` also writes snapshots of them,
``<logdir>/ema_snapshots/snapshot_<step:08d>.pkl`` (``save_profile_snapshot``; never pruned): ``step``, ``t`` (images
seen), ``sigma_rel`` (one per profile), ``profiles`` (their weights, stored as ``--snapshot_dtype``), ``config``.

A network trained elsewhere (``weights_snapshot``, written by ``scripts.convert``; ``scripts.posthoc_ema``'s rebuilt
EMA too, at its step) has the same layout with the weights as both ``model`` and ``ema``, step 0, ``optimizer`` and
``loader`` None, and ``source`` (a dict of
strings) saying where they came from: it samples and scores like any checkpoint, and starts runs
(``--init_from``), but does not resume one.

Files live at ``<logdir>/checkpoints/ckpt_<step:07d>.pkl`` and are written atomically. They are read with
``torch_archive.load_array_pickle``, which builds numpy arrays and plain values only: a file that asks for
any other class is refused before anything in it runs. A loaded checkpoint's config is validated like
flags (``config_of``) and its weights are checked against the network before they are loaded
(``load_weights``).
"""
import os
import pickle
import re
import sys

import numpy as np

from megdiffusion.errors import MegdiffusionError, one_line
from megdiffusion.files.disk import atomic_write
from megdiffusion.files.torch_archive import WeightsError, load_array_pickle
from megdiffusion.training.config import (NETWORK, TRAINING, ConfigError, TrainConfig, as_flag, names, output_channels,
                                          profile_sigma_rels, refused_on_resume, validate)
from megdiffusion.training.draws import SCHEMES

CHECKPOINT_DIR = "checkpoints"
SNAPSHOT_DIR = "ema_snapshots"
_SNAPSHOT_NAME = re.compile(r"^snapshot_(\d+)\.pkl$")
REQUIRED_KEYS = ("step", "config", "model", "ema", "optimizer", "loader")
# Config fields that define the network: weights fit (and compute the same function) only where these agree.
# (The output channels follow var_type: ``load_init`` compares them too.)
NETWORK_FIELDS = names(role=NETWORK)
# Config fields a guiding model (``sampling.jobs.open_guidance``) must share with the sampled one: what the network sees
# and what it predicts.
GUIDE_FIELDS = names(guide=True)
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
        obj = load_array_pickle(path)
    except WeightsError as err:
        raise CheckpointError(f"cannot read checkpoint {path}: {err}") from None
    if not isinstance(obj, dict) or any(key not in obj for key in REQUIRED_KEYS):
        raise CheckpointError(f"{path} is not a megdiffusion training checkpoint (missing keys)")
    return obj


def load_latest(logdir, warn=None):
    """The newest checkpoint of ``logdir`` that loads, as ``(checkpoint, path)``, or ``None`` if none exist.

    A newest file that fails to load is skipped for the previous one, and reported through ``warn`` (default: a
    line on stderr) once an older one loads. ``CheckpointError`` (naming why the newest failed, nothing else
    printed) if checkpoints exist but none loads.
    """
    warn = warn or (lambda message: print(message, file=sys.stderr, flush=True))
    paths = list_checkpoints(logdir)
    skipped = []
    for path in reversed(paths):
        try:
            found = load_checkpoint(path), path
        except CheckpointError as err:
            skipped.append(err)
            continue
        for err in skipped:
            warn(f"warning: skipping checkpoint: {err}")
        return found
    if paths:
        raise CheckpointError(f"none of the {len(paths)} checkpoints in {checkpoint_dir(logdir)} loads (the newest: "
                              f"{skipped[0]}); move them out of {checkpoint_dir(logdir)} to train that run again "
                              "from the start, or use another run")
    return None


def load_file_or_newest(path):
    """The checkpoint at ``path``, a checkpoint file or a run's logdir (its newest loadable checkpoint), as
    ``(state, file)``."""
    if not os.path.isdir(path):
        return load_checkpoint(path), path
    latest = load_latest(path)
    if latest is None:
        raise CheckpointError(f"no checkpoints in {path}")
    return latest


def config_of(state, path):
    """The ``TrainConfig`` stored in checkpoint dict ``state`` (read from ``path``), validated like flags;
    ``CheckpointError`` when it is unusable."""

    try:
        if not isinstance(state["config"], dict):
            raise ConfigError(f"a {type(state['config']).__name__} where a dict belongs")
        cfg = TrainConfig.from_dict(state["config"])
        validate(cfg)
    except (ConfigError, TypeError) as err:
        raise CheckpointError(f"{path} holds an unusable training config: {err}") from None
    return cfg


def load_weights(module, weights, path):
    """Load the state dict ``weights`` of checkpoint ``path`` into ``module``; ``CheckpointError`` when its
    names, shapes or kinds of number do not fit the network (a damaged or edited file)."""
    expected = module.state_dict()
    problem = None
    if not isinstance(weights, dict):
        problem = f"a {type(weights).__name__} where a dict of arrays belongs"
    elif set(weights) != set(expected):
        missing, unknown = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected), key=str)
        problem = f"{len(missing)} arrays missing ({', '.join(missing[:3])}), {len(unknown)} unknown " \
                  f"({', '.join(map(str, unknown[:3]))})"
    else:
        for name, value in expected.items():
            got = weights[name]
            if not (isinstance(got, np.ndarray) and got.shape == value.shape and got.dtype.kind == value.dtype.kind):
                found = f"{got.dtype} {got.shape}" if isinstance(got, np.ndarray) else type(got).__name__
                problem = f"{name} is {found}, the network's {value.dtype} {value.shape}"
                break
    if problem:
        raise CheckpointError(f"{path}: its weights do not fit the network of its config: {problem}")
    module.load_state_dict(weights)


def differences(stored, cfg, names):
    """``{name: "--name=<stored value>"}`` for each of ``names`` where config ``stored`` differs from ``cfg``."""
    return {name: as_flag(name, getattr(stored, name)) for name in names
            if getattr(stored, name) != getattr(cfg, name)}


def snapshot(trainer, loader, data=None):
    """The checkpoint dict of a run: ``trainer`` (a ``Trainer``), its ``BatchLoader`` (or ``StepFeed``) and what it
    trains on (``data``: ``datasets.dataset_identity``)."""
    with trainer.state() as state:
        return {"step": trainer.step_count, "config": trainer.cfg.to_dict(), "model": state.model.state_dict(),
                "data": data, "ema": state.ema.state_dict(), "optimizer": state.optimizer.state_dict(),
                "loader": loader.state_dict(), "rng": {"seed": trainer.cfg.seed, "scheme": trainer.draw_scheme},
                "loss_scale": None if trainer.scaler is None else trainer.scaler.state_dict(),
                "ema_profiles": trainer.engine.profile_weights() if trainer.profile_gammas else None}


def snapshot_path(logdir, step):
    """The file of the post-hoc EMA snapshot at ``step``."""
    return os.path.join(logdir, SNAPSHOT_DIR, f"snapshot_{step:08d}.pkl")


def save_profile_snapshot(trainer, logdir):
    """Write the post-hoc EMA profiles of ``trainer`` at its step (atomically), stored as ``--snapshot_dtype``.
    Returns the path."""
    cfg, step = trainer.cfg, trainer.step_count
    profiles = [{name: value.astype(cfg.snapshot_dtype) for name, value in weights.items()}
                for weights in trainer.engine.profile_weights()]
    path = snapshot_path(logdir, step)
    save_checkpoint(path, {"step": step, "t": step * cfg.batch_size, "sigma_rel": list(profile_sigma_rels(cfg)),
                           "profiles": profiles, "config": cfg.to_dict()})
    return path


def list_snapshots(logdir):
    """``[(step, path)]`` of the post-hoc EMA snapshots of a run, oldest first."""
    directory = os.path.join(logdir, SNAPSHOT_DIR)
    names = os.listdir(directory) if os.path.isdir(directory) else []
    return sorted((int(m.group(1)), os.path.join(directory, name)) for name in names
                  if (m := _SNAPSHOT_NAME.match(name)))


def rebuilt_path(directory, sigma_rel):
    """The file a rebuilt EMA of ``sigma_rel`` is written to in ``directory``, e.g. ema_0.070.pkl."""
    return os.path.join(directory, f"ema_{sigma_rel:.3f}.pkl")


def rebuild_ema(logdir, targets, output, step=None):
    """Rebuild the EMA of each sigma_rel in ``targets`` from the snapshots of ``logdir`` up to ``step`` (default:
    the newest; a step with snapshots), and write each as a checkpoint, ``rebuilt_path(output, sigma_rel)``
    (``posthoc_ema.coefficients``, summed in float64 one snapshot at a time). Returns one dict per target:
    sigma_rel, path, condition_number, coefficient_abs_sum, step, t, snapshots (their count) and tracked."""
    from megdiffusion.training.posthoc_ema import coefficients

    found = list_snapshots(logdir)
    if not found:
        raise CheckpointError(f"{logdir} holds no post-hoc EMA snapshots ({SNAPSHOT_DIR}/snapshot_*.pkl): train with "
                              "--ema_profiles 0.05,0.10 --snapshot_every N")
    steps = [s for s, _ in found]
    step = steps[-1] if step is None else step
    if step not in steps:
        raise CheckpointError(f"--step {step} has no snapshot in {logdir}; its {len(steps)} snapshots are at steps "
                              f"{steps[0]} to {steps[-1]}: give one of those")
    used = [path for s, path in found if s <= step]
    profiles, last = [], None
    for path in used:  # first the profiles alone: one snapshot in memory at a time, whatever the network's size
        last = load_snapshot(path)
        profiles += [(last["t"], s) for s in last["sigma_rel"]]
    t, tracked = last["t"], sorted({s for _, s in profiles})
    mixes = [coefficients(profiles, (t, target)) for target in targets]
    sums, index = [{} for _ in targets], 0
    for path in used:
        for weights in load_snapshot(path)["profiles"]:
            for total, (mix, _) in zip(sums, mixes):
                for name, value in weights.items():
                    total[name] = total.get(name, 0.0) + mix[index] * value.astype(np.float64)
            index += 1
    cfg = TrainConfig.from_dict(last["config"])
    os.makedirs(output, exist_ok=True)
    rebuilt = []
    for target, (mix, condition), total in zip(targets, mixes, sums):
        path = rebuilt_path(output, target)
        source = {"format": "post-hoc EMA", "weights": f"EMA of sigma_rel {target:g}", "sigma_rel": f"{target:g}",
                  "tracked": ",".join(f"{s:g}" for s in tracked), "run": os.path.abspath(logdir), "step": str(step)}
        save_checkpoint(path, weights_snapshot(cfg, {name: value.astype(np.float32) for name, value in total.items()},
                                               source, step))
        rebuilt.append({"sigma_rel": target, "path": path, "condition_number": condition,
                        "coefficient_abs_sum": float(np.abs(mix).sum()), "step": step, "t": t,
                        "snapshots": len(used), "tracked": tracked})
    return rebuilt


def load_snapshot(path):
    """One snapshot dict (``save_profile_snapshot``'s); ``CheckpointError`` for a file that is not one."""
    try:
        obj = load_array_pickle(path)
    except WeightsError as err:
        raise CheckpointError(f"cannot read snapshot {path}: {err}") from None
    keys = ("step", "t", "sigma_rel", "profiles", "config")
    if not isinstance(obj, dict) or any(key not in obj for key in keys) \
            or len(obj["sigma_rel"]) != len(obj["profiles"]):
        raise CheckpointError(f"{path} is not a megdiffusion post-hoc EMA snapshot (missing keys)")
    return obj


def weights_snapshot(cfg, weights, source, step=0):
    """The checkpoint dict of weights without a run to resume: ``weights`` (name -> array) under config ``cfg``,
    trained to ``step`` (0: a network not trained here)."""
    return {"step": step, "config": cfg.to_dict(), "model": weights, "ema": weights, "optimizer": None, "loader": None,
            "source": source}


def load_init(cfg):
    """The checkpoint ``cfg.init_from`` names (a file or a logdir's newest), checked to hold ``cfg``'s network:
    ``(state, path)``."""

    state, path = load_file_or_newest(cfg.init_from)
    stored = config_of(state, path)
    check_channels(stored, cfg, f"--init_from {cfg.init_from}", "start without --init_from")
    changed = differences(stored, cfg, NETWORK_FIELDS)
    if output_channels(stored) != output_channels(cfg):
        changed["var_type"] = as_flag("var_type", stored.var_type)  # a learned variance doubles the outputs
    if changed:
        raise CheckpointError(f"--init_from {cfg.init_from} holds a network with different {', '.join(changed)} "
                              f"({' '.join(changed.values())}); set those flags")
    return state, path


def initialise(state, path, trainer):
    """Start ``trainer`` from the model and EMA weights of checkpoint dict ``state`` (read from ``path``; its
    optimizer stays new)."""
    with trainer.state() as modules:
        load_weights(modules.model, state["model"], path)
        load_weights(modules.ema, state["ema"], path)


def check_channels(stored, cfg, source, remedy):
    """``CheckpointError`` unless the network of config ``stored`` (of checkpoint ``source``) takes the image channels
    of ``cfg``'s data: read from the data, no flag sets them, so ``differences`` cannot name them."""
    if stored.image_channels != cfg.image_channels:
        raise CheckpointError(f"{source} was trained on images of {stored.image_channels} channel(s); this dataset's "
                              f"have {cfg.image_channels}: {remedy}")


def check_recipe(state, path, cfg, allow_changes=False):
    """``CheckpointError`` unless checkpoint dict ``state`` (read from ``path``) can continue a run of ``cfg``:
    it holds an optimizer and data position, and was trained with the same network, maths and, unless
    ``allow_changes`` (``train --allow_changes``), training settings (``config.RESUME_REFUSES``); returns
    ``differences`` of the training settings ``allow_changes`` lets change."""
    if state["optimizer"] is None:
        raise CheckpointError(f"{path} holds weights only (no optimizer or data position); start a run from it "
                              "with --init_from")
    stored = config_of(state, path)
    check_channels(stored, cfg, path, "resume on the run's data, or start a new --logdir")
    recipe = differences(stored, cfg, refused_on_resume(allow_changes=True))
    if recipe:
        raise CheckpointError(f"{path} was trained with different {', '.join(recipe)} "
                              f"({' '.join(recipe.values())}); use those flags, the run's flags.cfg or another "
                              "--logdir")
    training = differences(stored, cfg, names(role=TRAINING))
    if training and not allow_changes:
        raise CheckpointError(f"{path} was trained with different {', '.join(training)} "
                              f"({' '.join(training.values())}), and exact resume keeps them; use those flags, or "
                              "give --allow_changes to continue the run with the new ones")
    return training


def check_data(state, path, data):
    """``CheckpointError`` unless the run of checkpoint dict ``state`` trained on data like ``data`` (the same image
    count, and checksum where both know one): other data would continue with other batches."""
    saved = state.get("data") or {}
    counts = saved.get("count"), data["count"]
    checksums = saved.get("checksum"), data["checksum"]
    if (None not in counts and counts[0] != counts[1]) or (None not in checksums and checksums[0] != checksums[1]):
        raise CheckpointError(f"{path} was trained on {counts[0]:,} images (checksum {checksums[0] or 'unknown'}); "
                              f"this dataset has {counts[1]:,} (checksum {checksums[1] or 'unknown'}): resume on the "
                              "run's data, or start a new --logdir")


def draw_scheme_of(state):
    """The scheme a checkpoint's run draws its steps' randomness with (``draws``); ValueError for an unknown one."""
    scheme = state.get("rng", {}).get("scheme")
    if scheme not in SCHEMES:
        raise ValueError(f"unknown random-draw scheme {scheme!r}")
    return scheme


def restore(state, path, trainer, loader):
    """Load checkpoint dict ``state`` (read from ``path``) into ``trainer`` and ``loader`` (``check_recipe`` first:
    the network and maths; whether the training settings may change was ``check_logdir``'s question)."""
    check_recipe(state, path, trainer.cfg, allow_changes=True)
    with trainer.state() as modules:
        load_weights(modules.model, state["model"], path)
        load_weights(modules.ema, state["ema"], path)
        try:
            modules.optimizer.load_state_dict(state["optimizer"])
        except (AssertionError, AttributeError, IndexError, KeyError, TypeError, ValueError) as err:
            raise damaged(path, err) from None
    try:
        trainer.step_count = int(state["step"])
        loader.load_state_dict(state["loader"])
        trainer.draw_scheme = draw_scheme_of(state)
        if trainer.scaler is not None and state.get("loss_scale") is not None:
            trainer.scaler.load_state_dict(state["loss_scale"])  # else a new scale: --amp is turned on here
        if trainer.profile_gammas:  # check_recipe made sure the run tracked the same ones
            trainer.engine.load_profile_weights(state["ema_profiles"])
    except (AssertionError, AttributeError, IndexError, KeyError, TypeError, ValueError) as err:
        raise damaged(path, err) from None


def damaged(path, err):
    """The ``CheckpointError`` of a checkpoint whose optimizer state, step, data position or draw scheme fails to
    load with ``err``."""
    return CheckpointError(f"{path}: its optimizer, step, data position or random-draw scheme is damaged "
                           f"({type(err).__name__}: {one_line(err)})")
