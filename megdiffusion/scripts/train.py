"""Train a DDPM: ``python -m megdiffusion.scripts.train [--flagfile configs/cifar10.cfg] [--flags...]``.

Without a ``--flagfile`` a recipe that fits the data is read first (``training.recipes``): the CPU recipe
(configs/fashion_mnist_cpu.cfg) for the embedded Fashion-MNIST split, so plain ``python -m
megdiffusion.scripts.train`` trains something on a laptop; for one's own images (a folder, an npz, a prepared file)
configs/own32.cfg or own64.cfg by their size; CIFAR-10's paper recipe for CIFAR-10. Flags given on the command line
override it. ``--num_gpus N`` trains on N GPUs with the same recipe.
Bad flags or data: one line on stderr, exit code 2, nothing written.
"""
import sys

from absl import app, flags

from megdiffusion.scripts.cli import (check_flags_matter, megengine_failures, one_line_errors, parse_flags,
                                      reject_arguments)
from megdiffusion.compat import quiet_megengine
from megdiffusion.training import config, recipes
from megdiffusion.training.config import define_flags

FLAGS = flags.FLAGS
define_flags(FLAGS)
flags.adopt_module_key_flags(config)  # so that --help lists the training flags

_SAMPLING = (lambda f: f.sample_every > 0 or f.fid_every > 0, "--sample_every or --fid_every (what samples with it)")
_FID = (lambda f: f.fid_every > 0, "--fid_every")
_MACHINES = (lambda f: (f.world_size or f.num_gpus) > f.num_gpus, "--world_size above --num_gpus (several machines)")
# What each flag needs to matter when written on the command line (``cli.check_flags_matter``).
FLAG_NEEDS = {"sample_sampler": _SAMPLING, "sample_steps": _SAMPLING, "sample_spacing": _SAMPLING,
              "sample_order": _SAMPLING, "sample_num": (lambda f: f.sample_every > 0, "--sample_every"),
              "fid_num_images": _FID, "fid_metrics": _FID, "master_ip": _MACHINES, "rank_start": _MACHINES}


def main(argv):
    reject_arguments(argv)
    quiet_megengine()
    from megdiffusion.training.config import config_from_flags
    from megdiffusion.training.trainer import train

    with one_line_errors():
        check_flags_matter(FLAGS, FLAG_NEEDS)
        cfg, images = config_from_flags(FLAGS)
        with megengine_failures("continue with the same command and --resume"):
            train(cfg, images)


def with_default_flagfile(argv):
    """``argv`` with ``default_flagfile``'s recipe inserted first when no --flagfile is given."""
    if any(arg.startswith(("--flagfile", "-flagfile")) for arg in argv[1:]):
        return argv
    with one_line_errors():
        return [argv[0], f"--flagfile={recipes.default_flagfile(argv[1:])}"] + argv[1:]


def run():
    """Console-script entry point."""
    app.run(main, argv=with_default_flagfile(sys.argv), flags_parser=parse_flags)


if __name__ == "__main__":
    run()
