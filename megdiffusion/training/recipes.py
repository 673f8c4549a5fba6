"""The recipe ``train`` reads first when no ``--flagfile`` is given: the one that fits the data the command line
names, or with ``--resume --logdir RUN`` the config of RUN's newest checkpoint."""
import os

from megdiffusion.data.prepared import is_prepared, read_record
from megdiffusion.data.spec import DataSpec
from megdiffusion.errors import MegdiffusionError
from megdiffusion.training.checkpoint import config_of, load_latest
from megdiffusion.training.config import CONFIGS, CPU_RECIPE, ConfigError, names

# One's own images: the datasets whose recipe ``train`` picks by image size without a --flagfile.
OWN_DATASETS = ("folder", "npz", "prepared")
# The recipes it reads for them, by image size.
OWN_DATA_RECIPES = {32: "own32.cfg", 64: "own64.cfg"}
# Flags that size the network: given without a --flagfile for images of another size, the user composes the
# recipe (on the CPU recipe's training settings).
NETWORK_FLAGS = names(width_depth=True)


def resumed_config(argv):
    """``(cfg, path)``: the config of the newest checkpoint of the run a command line without --flagfile continues
    (``--resume --logdir RUN``, RUN with checkpoints), else None."""
    logdir = _given(argv, "logdir")
    if logdir is None or not _given_bool(argv, "resume"):
        return None
    latest = load_latest(logdir, warn=lambda message: None)  # the run warns of a skipped file when it loads
    return None if latest is None else (config_of(*latest), latest[1])


def _given_bool(argv, name):
    """Whether the boolean flag ``--name`` is set on the command line (``--name``, ``--noname``, ``--name=false``)."""
    value = False
    for arg in argv:
        flag, _, text = arg.lstrip("-").partition("=")
        if arg.startswith("-") and flag in (name, f"no{name}"):
            value = flag == name and text.lower() not in ("false", "f", "0")
    return value


def _given(argv, name):
    """The value of flag ``--name`` on the command line (``--name=V``, ``--name V``, one dash too), or None."""
    value = None
    for i, arg in enumerate(argv):
        for prefix in (f"--{name}", f"-{name}"):
            if arg == prefix and i + 1 < len(argv):
                value = argv[i + 1]
            elif arg.startswith(prefix + "="):
                value = arg[len(prefix) + 1:]
    return value


def default_flagfile(argv):
    """The recipe to read first when no --flagfile is given: the CPU recipe for the embedded data, CIFAR-10's paper
    recipe for CIFAR-10, else the own-data recipe of the images' size (``--image_size``, or a prepared file's);
    the CPU recipe again under a command line that describes the network itself (``NETWORK_FLAGS``: a small model's
    training settings under it); ``ConfigError`` naming the flagfiles when no recipe fits."""
    dataset, data_path = _given(argv, "dataset"), _given(argv, "data_path")
    if dataset == "cifar10":
        return os.path.join(CONFIGS, "cifar10.cfg")
    prepared = data_path is not None and is_prepared(data_path)
    if not prepared and (dataset not in OWN_DATASETS or not _has_images(data_path)):
        return CPU_RECIPE  # the embedded data; or the data's own error comes from the flags and the data
    size = _given(argv, "image_size")
    if size is None and prepared:
        size = read_record(data_path)["size"]
    recipe = OWN_DATA_RECIPES.get(int(size)) if str(size).isdigit() else None
    if recipe is not None:
        return os.path.join(CONFIGS, recipe)
    if any(_given(argv, name) is not None for name in NETWORK_FLAGS):
        return CPU_RECIPE
    raise ConfigError(f"no recipe for {f'{size}x{size}' if size else 'images of unknown size'} without a "
                      "--flagfile: train at 32 or 64 (--image_size, or prepare at that size), or give one "
                      f"(configs/{OWN_DATA_RECIPES[32]}, configs/{OWN_DATA_RECIPES[64]}, configs/celebahq256.cfg for "
                      "256) and set --attention_resolutions to sizes the network has")


def _has_images(path):
    """Whether ``path`` names one's own images: an npz, or a folder holding an image file."""
    try:
        spec = DataSpec.parse(path) if path is not None else None
    except MegdiffusionError:
        return False
    return spec is not None and (spec.kind == "npz" or (spec.kind == "folder" and spec.has_images()))
