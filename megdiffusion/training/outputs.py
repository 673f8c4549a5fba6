"""Rank 0's training outputs: progress bar, metrics.jsonl, TensorBoard, EMA sample grids, run files.

Run directory layout::

    <logdir>/flags.cfg          the effective flags, reusable with --flagfile
    <logdir>/config.json        the resolved TrainConfig
    <logdir>/metrics.jsonl      one JSON object per logged step
    <logdir>/samples/step_<step:07d>.png   EMA sample grids
    <logdir>/checkpoints/       see checkpoint.py
    <logdir>/tensorboard/       when tensorboardX is installed
"""
import json
import os
import sys

from megdiffusion.progress import progress_bar

from megdiffusion.files.disk import write_text
from megdiffusion.files.images import make_grid
from megdiffusion.training.config import grid_sampler, to_flagfile, to_json


RUN_MARKER = "flags.cfg"  # the first file a run writes in its logdir


def write_run_files(cfg):
    """Save the effective flags (``flags.cfg``) and the resolved config (``config.json``) in the logdir."""
    write_text(os.path.join(cfg.logdir, RUN_MARKER), to_flagfile(cfg))
    write_text(os.path.join(cfg.logdir, "config.json"), to_json(cfg))


def sample_grid(model, diffusion, cfg):
    """An image grid (uint8 HWC) of ``model``'s images 0..sample_num-1 of the run seed (the same noise at
    every step and on resume), sampled with the grid sampler and step count; a class-conditional model's has a
    column per class."""
    from megdiffusion.diffusion.generation import generate_images  # MegEngine's: write_run_files comes before it

    images = generate_images(model, diffusion, cfg.image_shape, range(cfg.sample_num), cfg.seed, grid_sampler(cfg),
                             batch_size=cfg.sample_num)
    return make_grid(images, nrow=cfg.num_classes or None)


def grid_path(logdir, step):
    """Where the sample grid of ``step`` is saved."""
    return os.path.join(logdir, "samples", f"step_{step:07d}.png")


class RunLogger:
    """Progress bar, metrics.jsonl and (when tensorboardX imports) TensorBoard for one run."""

    def __init__(self, logdir, total_steps, start_step, progress=True):
        os.makedirs(logdir, exist_ok=True)
        self.metrics_file = open(os.path.join(logdir, "metrics.jsonl"), "a")
        self.bar = progress_bar(total=total_steps, initial=start_step, disable=not progress, unit="step")
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            self.tensorboard = None
        else:
            self.tensorboard = SummaryWriter(os.path.join(logdir, "tensorboard"))

    def advance(self, loss, images_per_s):
        """One step done: move the bar and show the loss and throughput (tqdm shows the ETA)."""
        self.bar.set_postfix(loss=f"{loss:.4f}", img_s=f"{images_per_s:.1f}", refresh=False)
        self.bar.update(1)

    def write_metrics(self, step, metrics):
        """Append ``{"step": step, **metrics}`` to metrics.jsonl and TensorBoard."""
        self.metrics_file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.metrics_file.flush()
        if self.tensorboard is not None:
            for name, value in metrics.items():
                self.tensorboard.add_scalar(f"train/{name}", value, step)

    def add_grid(self, step, grid):
        """Send a uint8 HWC sample grid to TensorBoard."""
        if self.tensorboard is not None:
            self.tensorboard.add_image("samples/ema", grid, step, dataformats="HWC")

    def message(self, text):
        """Print a line on stderr without breaking the progress bar."""
        self.bar.write(text, file=sys.stderr)

    def close(self):
        self.bar.close()
        self.metrics_file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
