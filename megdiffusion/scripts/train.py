"""Train a DDPM: ``python -m megdiffusion.scripts.train [--flagfile configs/cifar10.cfg] [--name=value ...]``.

Without a ``--flagfile`` a recipe that fits the data is read first (``training.recipes``): the CPU recipe
(configs/fashion_mnist_cpu.cfg) for the embedded Fashion-MNIST split, so plain ``python -m
megdiffusion.scripts.train`` trains something on a laptop; for one's own images (a folder, an npz, a prepared file)
configs/own32.cfg or own64.cfg by their size; CIFAR-10's paper recipe for CIFAR-10. Flags given on the command line
override it, and ``--help`` shows its values as the defaults. ``--resume --logdir RUN`` without a flagfile continues
RUN's run as its newest checkpoint holds it; the command line may then set only what does not change the weights
(``recipes.RESUME_SETTINGS``: the steps, time limit, outputs and their cadence, the machine, the data's path).
``--num_gpus N`` trains on N GPUs with the same recipe.
Bad flags or data: one line on stderr, exit code 2, nothing written.
"""
import sys

from absl import flags

from megdiffusion import environment
from megdiffusion.compat import quiet_megengine
from megdiffusion.scripts import cli
from megdiffusion.scripts.cli import (UsageError, check_flags_matter, given_on_command_line, megengine_failures,
                                      one_line_errors, parse_into, reject_arguments)
from megdiffusion.training import config, recipes
from megdiffusion.training.config import as_flag, define_flags, to_flagfile

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


def main(argv, resumed=None):
    """Train the config the flags give; ``resumed``: ``(cfg, path)`` of the checkpoint a run without a flagfile
    continues (``recipes.resumed_config``)."""
    reject_arguments(argv)
    quiet_megengine()
    from megdiffusion.training.config import config_from_flags
    from megdiffusion.training.trainer import train

    with one_line_errors():
        check_flags_matter(FLAGS, FLAG_NEEDS)
        if resumed is not None:
            check_resume_flags(*resumed)
        cfg, images = config_from_flags(FLAGS)
        with megengine_failures("continue with the same command and --resume"):
            train(cfg, images)


def check_resume_flags(stored, path):
    """``UsageError`` naming the flags on the command line that change a run continued from checkpoint ``path``
    (config ``stored``) beyond ``recipes.RESUME_SETTINGS``."""
    changed = [f"--{name}" for name in sorted(given_on_command_line(FLAGS)) if name not in recipes.RESUME_SETTINGS
               and as_flag(name, FLAGS[name].value) != as_flag(name, getattr(stored, name))]
    if changed:
        raise UsageError(f"--resume continues the run of {path} as it was trained, and {', '.join(changed)} would "
                         "change it; drop them, or start a new --logdir (--init_from takes that run's weights)")


def read_recipe(argv):
    """Without --flagfile: make the recipe a command line ``argv`` reads first (``recipes``) the flags' defaults, so
    that --help shows them and the command line overrides them; ``(cfg, path)`` of a continued run, else None."""
    if any(arg.startswith(cli.FLAGFILE_FLAGS) for arg in argv[1:]):
        return None
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
    return resumed


def _read_recipe_first():
    environment.check()  # before MegEngine reads its own variables, which it could crash on
    quiet_megengine()  # before a continued run's checkpoint is read
    return {"resumed": read_recipe(sys.argv)}


def run():
    """Console-script entry point."""
    cli.run_command(main, first=_read_recipe_first)


if __name__ == "__main__":
    run()
