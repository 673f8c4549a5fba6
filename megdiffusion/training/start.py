"""What ``train`` does before the first step, without MegEngine: every check of the config, the devices and the logdir
(a resumed run's checkpoint against the flags and the data), the logdir locked and the run files written; then the
training processes (``trainer.run_worker``). Bad input is refused here before MegEngine is imported."""
import os
import sys

from megdiffusion.data.datasets import dataset_identity
from megdiffusion.files.disk import output_directory
from megdiffusion.training import checkpoint as ckpt
from megdiffusion.training import distributed
from megdiffusion.training.config import ConfigError, as_flag, check_step_options, validate
from megdiffusion.training.outputs import RUN_MARKER, write_run_files


def check_logdir(cfg, images=None, allow_changes=False):
    """The checkpoint a run resumes from, ``(state, path)`` or None, checked before anything is written:
    ``CheckpointError`` for a fresh run on top of another run's checkpoints, a checkpoint of another recipe or of
    other data than ``images``, a run already past ``total_steps``, or ``--init_from`` weights that do not fit the
    network."""
    if not cfg.resume and ckpt.list_checkpoints(cfg.logdir):
        raise ckpt.CheckpointError(f"{cfg.logdir} already holds checkpoints; pass --resume to continue that "
                                   "run or choose another --logdir")
    latest = ckpt.load_latest(cfg.logdir) if cfg.resume else None
    if latest is not None:
        changed = ckpt.check_recipe(*latest, cfg, allow_changes)
        if changed:
            now = " ".join(as_flag(name, getattr(cfg, name)) for name in changed)
            print(f"note: --allow_changes: the run continues with {now} (was {' '.join(changed.values())}), so it no "
                  "longer equals an unbroken run", file=sys.stderr)
        if latest[0]["step"] > cfg.total_steps:
            raise ConfigError(f"--resume continues the run in {cfg.logdir}, which is at step {latest[0]['step']}, past "
                              f"--total_steps {cfg.total_steps}; give --total_steps above {latest[0]['step']} to train "
                              "on")
        if images is not None:
            ckpt.check_data(*latest, dataset_identity(cfg.dataset, cfg.data_path, len(images)))
        started_from = latest[0]["config"].get("init_from")
        if cfg.init_from and not same_path(cfg.init_from, started_from):
            raise ConfigError(f"--resume continues the run in {cfg.logdir}, which started from "
                              f"{started_from or 'scratch'}, and --init_from {cfg.init_from} would start another; drop "
                              "--init_from to continue the run, or give a new --logdir to start from it")
    elif cfg.init_from:
        ckpt.load_init(cfg)
    return latest


def same_path(a, b):
    """Whether path ``a`` and ``b`` (None: no path) name the same file or directory."""
    return b is not None and (a == b or (os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)))


def check_training(cfg):
    """What ``train`` checks before it writes anything, but the logdir: the config itself (``config.validate``), the
    devices and distributed flags, and the step's options (``config.check_step_options``); for callers that write
    before training (the demo)."""
    validate(cfg)
    distributed.check_launch(cfg.num_gpus, cfg.device, cfg.world_size, cfg.rank_start, cfg.port)
    check_step_options(cfg)


def train(cfg, images, progress=True, use_launcher=None, allow_changes=False):
    """Check the devices and the logdir, lock the logdir, write the run files, and train on one or more
    processes. Nothing is written before every check has passed.

    ``images`` (from ``config.resolve``) is used directly by a single process; launched workers
    each load the dataset themselves rather than receive a pickled copy. ``use_launcher``: see
    ``distributed.launch``; ``allow_changes``: a resumed run may change its training settings (``check_logdir``).
    Returns the step reached (a list, one per local rank, when launched).
    """
    check_training(cfg)
    with output_directory(cfg.logdir, "--logdir", RUN_MARKER):
        latest = check_logdir(cfg, images, allow_changes)
        write_run_files(cfg)
        from megdiffusion.training.trainer import run_worker  # MegEngine's, once all is checked

        launched = distributed.is_multiprocess(cfg.num_gpus, cfg.world_size) if use_launcher is None else use_launcher
        args = (cfg, None, None, progress) if launched else (cfg, images, latest, progress)
        return distributed.launch(run_worker, args, cfg.num_gpus,
                                  cfg.world_size, cfg.rank_start, cfg.master_ip, cfg.port, use_launcher=launched)
