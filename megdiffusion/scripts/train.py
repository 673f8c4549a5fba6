"""Train a DDPM: ``python -m megdiffusion.scripts.train [--flagfile configs/cifar10.cfg] [--name=value ...]``.

Without a ``--flagfile`` a recipe that fits the data is read first (``training.recipes``): the CPU recipe
(configs/fashion_mnist_cpu.cfg) for the embedded Fashion-MNIST split, so plain ``python -m
megdiffusion.scripts.train`` trains something on a laptop; for one's own images (a folder, an npz, a prepared file)
configs/own32.cfg or own64.cfg by their size; CIFAR-10's paper recipe for CIFAR-10. Flags given on the command line
override it, and ``--help`` shows its values as the defaults. ``--resume --logdir RUN`` without a flagfile continues
RUN's run as its newest checkpoint holds it; with or without a flagfile, a resumed run may not change its network or
maths, nor its training settings unless ``--allow_changes`` (each field's role: ``config.RESUME_REFUSES``).
``--num_gpus N`` trains on N GPUs with the same recipe.
Bad flags or data: one line on stderr, exit code 2, nothing written.
"""
import sys

from absl import flags

from megdiffusion import environment
from megdiffusion.scripts import cli
from megdiffusion.scripts.cli import (check_flags_matter, megengine_failures,
                                      one_line_errors, parse_into, reject_arguments)
from megdiffusion.training import config, recipes
from megdiffusion.training.config import define_flags, to_flagfile

FLAGS = flags.FLAGS
define_flags(FLAGS)
flags.DEFINE_boolean("allow_changes", False, "With --resume: continue with other training settings than the run's "
                     "(flips, dropout, lr, warmup, batch size, clipping, EMA, seed); refused without it, since the run "
                     "would no longer equal an unbroken one. Asked anew at each resume, not kept in the run.")
flags.adopt_module_key_flags(config)  # so that --help lists the training flags

_SAMPLING = (lambda f: f.sample_every > 0 or f.fid_every > 0, "--sample_every or --fid_every (what samples with it)")
_FID = (lambda f: f.fid_every > 0, "--fid_every")
_MACHINES = (lambda f: (f.world_size or f.num_gpus) > f.num_gpus, "--world_size above --num_gpus (several machines)")
# What each flag needs to matter when written on the command line (``cli.check_flags_matter``).
FLAG_NEEDS = {"sample_sampler": _SAMPLING, "sample_steps": _SAMPLING, "sample_spacing": _SAMPLING,
              "sample_order": _SAMPLING, "sample_num": (lambda f: f.sample_every > 0, "--sample_every"),
              "fid_num_images": _FID, "fid_metrics": _FID, "master_ip": _MACHINES, "rank_start": _MACHINES}


def main(argv):
    """Train the config the flags give."""
    reject_arguments(argv)
    from megdiffusion.training.config import config_from_flags
    from megdiffusion.training.start import train

    with one_line_errors():
        check_flags_matter(FLAGS, FLAG_NEEDS)
        cfg, images = config_from_flags(FLAGS)
        with megengine_failures("continue with the same command and --resume"):
            train(cfg, images, allow_changes=FLAGS.allow_changes)


def read_recipe(argv):
    """Without --flagfile: make the recipe a command line ``argv`` reads first (``recipes``) the flags' defaults, so
    that --help shows them and the command line overrides them."""
    if any(arg.startswith(cli.FLAGFILE_FLAGS) for arg in argv[1:]):
        return
    resumed = recipes.resumed_config(argv[1:])
    if resumed is not None:
        source, args = f"the config of {resumed[1]}", to_flagfile(resumed[0]).splitlines()
    else:
        source = recipes.default_flagfile(argv[1:])
        args = [f"--flagfile={source}"]
    recipe = flags.FlagValues()
    define_flags(recipe)
    parse_into(recipe, [argv[0], *args])
    for name in recipe:
        if recipe[name].present:
            FLAGS.set_default(name, recipe[name].value)
    sys.modules["__main__"].__doc__ = f"{__doc__}\nThis command line reads {source} first: the defaults below.\n"


def _read_recipe_first():
    environment.check()  # before MegEngine reads its own variables, which it could crash on
    read_recipe(sys.argv)


def run():
    """Console-script entry point."""
    cli.run_command(main, first=_read_recipe_first)


if __name__ == "__main__":
    run()
