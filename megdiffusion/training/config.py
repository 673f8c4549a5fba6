"""The training configuration: one typed dataclass, its flags and checks, and the model/diffusion it builds.

Every field except ``image_channels`` is a command-line flag of the same name (see ``define_flags``).
A field's metadata holds its help text, its choices and its bounds: ``define_flags`` turns choices into
``DEFINE_enum`` flags (so ``--help`` lists them) and ``validate`` checks them all in one loop.
``image_channels`` and, when not given, ``image_size`` are read from the dataset. The config travels
inside every checkpoint (``to_dict``/``from_dict``), so sampling rebuilds the network without retyped flags;
a field added later says in ``absent`` what a stored config without it meant.
"""
import dataclasses
import json
import math
import operator
import os
import re
import typing
from dataclasses import dataclass, field, fields
from typing import Optional, Tuple

from megdiffusion.cpu.choice import cpu_engine_enabled
from megdiffusion.data.datasets import DATASETS
from megdiffusion.metrics.scores import check_sizes, parse_metrics
from megdiffusion.diffusion.choices import LEARNED_VAR_TYPES, LOSS_TYPES, MEAN_TYPES, SAMPLERS, SPACINGS, VAR_TYPES
from megdiffusion.diffusion.sampler_settings import SamplerSettings
from megdiffusion.diffusion.schedules import SCHEDULES
from megdiffusion.errors import MegdiffusionError
from megdiffusion.nn.options import DOWNSAMPLE_PADDING, DOWNSAMPLE_PADDINGS, NORM_EPS, NORM_GROUPS, TIME_EMBEDDING, \
    TIME_EMBEDDINGS, UNetConfig
from megdiffusion.training.posthoc_ema import MAX_SIGMA_REL, parse_sigma_rels

# The recipes' flagfiles, and the CPU recipe (the embedded Fashion-MNIST): what the train script and the demo read
# without a flagfile.
CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
CPU_RECIPE = os.path.join(CONFIGS, "fashion_mnist_cpu.cfg")

# Bound keywords of ``_flag``: (name, how it reads, the test a value must pass).
_BOUNDS = (("min", ">=", operator.ge), ("above", ">", operator.gt), ("max", "<=", operator.le),
           ("below", "<", operator.lt))


class ConfigError(MegdiffusionError):
    """A bad flag or flag combination; the message is one line saying what to change."""


# A field's role: what it decides, and so what a run continued with --resume may change (``RESUME_REFUSES``).
NETWORK = "network"  # the network's function: weights fit only where these agree (``checkpoint.NETWORK_FIELDS``)
MATHS = "maths"  # the diffusion and the loss: with the network, the recipe a checkpoint continues
TRAINING = "training"  # the data stream and the update: a change breaks exact resume, so it must be asked for
STEP = "step"  # how one update is computed (micro-batches, float16, a traced graph): its maths are the same
RUN = "run"  # where a run stops, what it writes and when, the machine, where its data lies
ROLES = (NETWORK, MATHS, TRAINING, STEP, RUN)
# What --resume refuses to change, by role.
ALWAYS, UNLESS_ASKED, NEVER = "always", "unless --allow_changes", "never"
RESUME_REFUSES = {NETWORK: ALWAYS, MATHS: ALWAYS, TRAINING: UNLESS_ASKED, STEP: NEVER, RUN: NEVER}


def _flag(default, help_text, *, role, **metadata):
    """A config field of ``role`` (one of ``ROLES``): ``choices`` (allowed values), bounds ``min``/``max``
    (inclusive) and ``above``/``below`` (exclusive), ``flag=False`` for a field that is not a command-line flag,
    ``absent``: the value a stored config (``from_dict``) that lacks the field stands for, when that is not the
    default; ``guide=True``: a guiding model must share it (what the network sees and predicts);
    ``width_depth=True``: it sizes the network, so a command line giving it composes its own recipe;
    ``megengine_only=True``: it runs on MegEngine's kernels alone (``check_step_options``);
    ``whole_run=True``: it holds from a run's first step, so no resume changes it, asked or not;
    ``sparse=True``: stored (``to_dict``) only when it differs from the default, so a run that does not use an option
    added later keeps a config that earlier versions (which refuse unknown keys) still read."""
    if role not in ROLES:
        raise ValueError(f"role {role!r} is not one of {ROLES}")
    return field(default=default, metadata={"help": help_text, "role": role, **metadata})


def names(role=None, **metadata):
    """The config fields, in their order, of ``role`` (one or a tuple of ``ROLES``) whose metadata holds
    ``metadata`` (e.g. ``guide=True``)."""
    roles = (role,) if isinstance(role, str) else role
    return tuple(f.name for f in fields(TrainConfig) if (roles is None or f.metadata["role"] in roles)
                 and all(f.metadata.get(key) == value for key, value in metadata.items()))


def check_step_options(cfg, engine=None):
    """``ConfigError`` (one line) for ``--amp`` or ``--trace`` with an ``engine`` (default: the CPU engine when it is
    chosen, ``cpu.choice``) that does not run MegEngine's kernels: the CPU engine computes outside MegEngine, in
    float32, eagerly."""
    wanted = [f"--{name}" for name in names(megengine_only=True) if getattr(cfg, name)]
    if not wanted:  # nothing to ask of the machine (its CUDA probe imports MegEngine on a GPU machine)
        return
    if not (engine == "megengine" if engine else not cpu_engine_enabled()):
        raise ConfigError(f"{' and '.join(wanted)} run{'s' if len(wanted) == 1 else ''} on MegEngine's own kernels, "
                          "which this machine's fast CPU path replaces; train on a GPU, or set "
                          "MEGDIFFUSION_FAST_CONV=0 to use MegEngine's (slow) CPU kernels")


def refused_on_resume(allow_changes=False):
    """The fields a resumed run may not change (``RESUME_REFUSES``)."""
    refused = [role for role, rule in RESUME_REFUSES.items()
               if rule == ALWAYS or (rule == UNLESS_ASKED and not allow_changes)]
    return tuple(name for name in names() if name in names(role=tuple(refused)) or name in names(whole_run=True))


@dataclass
class TrainConfig:
    """Everything that defines a training run. The model, diffusion and optimiser defaults are the DDPM
    CIFAR-10 recipe's (``configs/cifar10.cfg``); the data default is the embedded Fashion-MNIST split."""

    # Data
    dataset: str = _flag("fashion_mnist", "The embedded Fashion-MNIST split (or its idx files), CIFAR-10's "
                         "python batches, a folder of images (read as the steps need them; with --num_classes, its "
                         "first-level subfolders are the classes), an npz of uint8 NHWC images, or a file made by "
                         "megdiffusion.scripts.prepare (read image by image; a --data_path to such a file is "
                         "recognised whatever --dataset says).", choices=DATASETS, role=RUN)
    data_path: Optional[str] = _flag(None, "Dataset location (directory or file); embedded data if unset.", role=RUN)
    image_size: Optional[int] = _flag(None, "Image size; unset = the dataset's size (required for folder).", min=1,
                                      max=4096, role=NETWORK, guide=True)
    random_flip: bool = _flag(True, "Random horizontal flips of training images.", role=TRAINING)
    image_channels: int = _flag(3, "Read from the dataset (1 gray, 3 RGB); not a flag.", flag=False,
                                role=NETWORK, guide=True)
    # Model (improved-diffusion's names)
    model_channels: int = _flag(128, "UNet base channel count.", min=1, max=8192, role=NETWORK, width_depth=True)
    channel_mult: Tuple[int, ...] = _flag((1, 2, 2, 2), "Channel multiplier per resolution level.",
                                          role=NETWORK, width_depth=True)
    num_res_blocks: int = _flag(2, "Residual blocks per resolution level.", min=1, max=64,
                                role=NETWORK, width_depth=True)
    attention_resolutions: Tuple[int, ...] = _flag((16,), "Resolutions (pixels) with self-attention.",
                                                   role=NETWORK, width_depth=True)
    dropout: float = _flag(0.1, "Dropout rate in the residual blocks.", min=0, below=1, role=TRAINING)
    norm_groups: int = _flag(NORM_GROUPS, "GroupNorm groups (Ho: 32); small models need fewer, see the CPU recipe.",
                             role=NETWORK)
    norm_eps: float = _flag(NORM_EPS, "GroupNorm epsilon (Ho: 1e-6; pytorch-ddpm: 1e-5).", above=0, role=NETWORK)
    downsample_padding: str = _flag(DOWNSAMPLE_PADDING, "Padding of the stride-2 downsample convolution: one row and "
                                    "column at the bottom and right (Ho's TF 'SAME') or one on every side "
                                    "(pytorch-ddpm; checkpoints written before this flag).",
                                    choices=DOWNSAMPLE_PADDINGS, absent="symmetric", role=NETWORK)
    time_embedding: str = _flag(TIME_EMBEDDING, "Timestep sinusoid: Ho's [sin | cos], pytorch-ddpm's interleaved "
                                "table, or improved-diffusion's [cos | sin].", choices=TIME_EMBEDDINGS, role=NETWORK)
    use_scale_shift_norm: bool = _flag(False, "Residual blocks apply the time embedding as a scale and shift of the "
                                       "second GroupNorm (improved-diffusion's AdaGN) instead of adding it.",
                                       role=NETWORK)
    num_heads: int = _flag(1, "Heads of every attention block (Ho: 1; improved-diffusion: 4).", min=1, max=1024,
                           role=NETWORK)
    num_head_channels: int = _flag(0, "Channels per attention head, the head count following the width; 0: use "
                                   "--num_heads.", min=0, role=NETWORK)
    num_classes: int = _flag(0, "Class-conditional training on the dataset's labels with this many classes "
                             "(improved-diffusion's class_cond; Fashion-MNIST and CIFAR-10: 10); sampling then "
                             "gives image i the class i mod num_classes. 0: unconditional.", min=0, max=100000,
                             role=NETWORK, guide=True)
    class_dropout: float = _flag(0.0, "Share of a class-conditional run's training images whose label is dropped "
                                 "(the network sees no class), so that the same network also predicts "
                                 "unconditionally: classifier-free guidance (Ho & Salimans 2022: 0.1-0.2).",
                                 min=0, below=1, role=MATHS)
    # Diffusion
    num_timesteps: int = _flag(1000, "Number of diffusion steps T.", min=2, max=100000, role=MATHS, guide=True)
    beta_schedule: str = _flag("linear", "Beta schedule.", choices=SCHEDULES, role=MATHS, guide=True)
    mean_type: str = _flag("eps", "What the network predicts: the noise, x_0, the mean of x_{t-1}, or v "
                           "(sqrt(alpha_bar) noise - sqrt(1 - alpha_bar) x_0, Salimans & Ho 2022).",
                           choices=MEAN_TYPES, role=MATHS, guide=True)
    var_type: str = _flag("fixedlarge", "Reverse-process variance: beta_t, the posterior variance, or learned by the "
                          "network (twice the output channels): interpolated between the two in the log domain "
                          "(improved-diffusion's learned_range) or the log variance itself.", choices=VAR_TYPES,
                          role=MATHS, guide=True)
    loss_type: str = _flag("mse", "mse: L_simple (for a learned variance plus the unweighted vb term); hybrid: "
                           "L_simple + vb * T / 1000 (L_simple + 0.001 L_vlb; needs a learned --var_type).",
                           choices=LOSS_TYPES, role=MATHS)
    min_snr_gamma: float = _flag(0.0, "0: Ho's L_simple; above 0, Min-SNR-gamma weighting of each timestep's mse "
                                 "(min(SNR_t, gamma) / SNR_t for eps prediction, min(SNR_t, gamma) for xstart, "
                                 "min(SNR_t, gamma) / (SNR_t + 1) for v; "
                                 "Hang et al. 2023 use 5).", min=0, role=MATHS)
    input_perturbation: float = _flag(0.0, "Input perturbation (DDPM-IP, Ning et al. 2023): x_t is made from the "
                                      "noise plus this times a second standard-normal draw, the target from the "
                                      "noise alone, so that training sees inputs as off as sampling's; 0: off "
                                      "(the paper: 0.1).", min=0, role=MATHS)
    rescale_timesteps: bool = _flag(False, "The network sees t * 1000 / T (fractional) instead of t, as "
                                    "improved-diffusion's models do.", role=NETWORK, guide=True)
    # Optimisation
    lr: float = _flag(2e-4, "Adam learning rate after warmup.", above=0, role=TRAINING)
    warmup_steps: int = _flag(5000, "Steps of linear learning-rate warmup: step n (from 0) "
                              "uses --lr * (n + 1) / warmup_steps; 0: the full rate from the first step.", min=0,
                              role=TRAINING)
    batch_size: int = _flag(128, "Global batch size, split evenly across all ranks.", min=1, max=2 ** 20, role=TRAINING)
    total_steps: int = _flag(800000, "Number of optimizer steps.", min=1, max=10 ** 9, role=RUN)
    grad_clip: float = _flag(1.0, "Clip the global gradient norm to this value; 0 disables.", min=0, role=TRAINING)
    ema_decay: float = _flag(0.9999, "Decay of the exponential moving average of the weights.", min=0, below=1,
                             role=TRAINING)
    ema_warmup: bool = _flag(False, "Warm the EMA up: update n (from 0) decays by min(--ema_decay, "
                             "(1 + n) / (10 + n)), so the early average is not mostly the random initial weights.",
                             role=TRAINING)
    ema_profiles: str = _flag("", "Post-hoc EMA (Karras et al. 2024, EDM2): the relative standard deviations "
                              "sigma_rel of the power-function EMA profiles to track beside --ema_decay's EMA, "
                              f"comma-separated, each in (0, {MAX_SIGMA_REL}] (EDM2's: 0.05,0.10); with "
                              "--snapshot_every, scripts.posthoc_ema rebuilds the EMA of any other length from their "
                              "snapshots. Empty: none.", role=TRAINING, whole_run=True, sparse=True)
    seed: int = _flag(0, "Seed of every random choice (data order, flips, timesteps, noise, dropout).", min=0,
                      max=2 ** 64 - 1, role=TRAINING)  # MegEngine's seeds are 64-bit
    # The step (how the update is computed: not part of the recipe)
    microbatch: int = _flag(0, "Cut each device's batch into micro-batches of this many samples and sum their "
                            "gradients: one update per step, equal to the whole batch's up to float32 rounding, in "
                            "less memory (improved-diffusion's --microbatch). 0: the whole batch at once.", min=0,
                            max=2 ** 20, role=STEP)
    amp: bool = _flag(False, "Mixed precision on MegEngine's kernels (GPUs): the forward and the loss under "
                      "megengine.amp.autocast (float16 convolutions and linear layers), float32 weights, Adam and EMA, "
                      "dynamic loss scaling that skips an update whose gradients overflow.", role=STEP,
                      megengine_only=True)
    trace: bool = _flag(False, "Run each micro-batch's forward and backward as one megengine.jit.trace(symbolic=True) "
                        "graph on MegEngine's kernels (GPUs); needs --dropout 0.", role=STEP, megengine_only=True)
    data_workers: int = _flag(1, "Processes that make the next steps' batches (reading and decoding images from disk) "
                              "and random draws while the current step runs; 0: in the training process. Any number "
                              "gives the same batches.", min=0, max=64, role=RUN)
    # Outputs
    logdir: str = _flag("runs/train", "Directory for checkpoints, metrics, sample grids and flags.", role=RUN)
    log_every: int = _flag(10, "Write metrics every this many steps.", min=1, role=RUN)
    save_every: int = _flag(5000, "Save a checkpoint every this many steps (0: only at the end).", min=0, role=RUN)
    keep_checkpoints: int = _flag(3, "How many of the newest checkpoints to keep.", min=1, max=1000, role=RUN)
    snapshot_every: int = _flag(0, "Save the --ema_profiles profiles every this many steps in LOGDIR/ema_snapshots "
                                "(never pruned: scripts.posthoc_ema reads them all); 0: never.", min=0, role=RUN,
                                sparse=True)
    snapshot_dtype: str = _flag("float32", "How snapshots store weights: float32, or float16 (half the disk).",
                                choices=("float32", "float16"), role=RUN, sparse=True)
    sample_every: int = _flag(5000, "Save an EMA sample grid every this many steps (0: never).", min=0, role=RUN)
    sample_num: int = _flag(64, "Images in each sample grid.", min=1, max=4096, role=RUN)
    sample_sampler: str = _flag("ddim", "Sampler for the grids (and for --fid_every).", choices=SAMPLERS, role=RUN)
    sample_steps: int = _flag(50, "Sampling steps for the grids (and for --fid_every), at most T.", role=RUN)
    sample_spacing: Optional[str] = _flag(None, "Where the grids' sampling steps lie (scripts.sample --spacing); "
                                          "unset: the sampler's default.", choices=SPACINGS, role=RUN)
    sample_order: Optional[int] = _flag(None, "The grids' solver order, for unipc (2 or 3); unset: its default.",
                                        role=RUN)
    resume: bool = _flag(False, "Continue from the newest loadable checkpoint in logdir.", role=RUN)
    init_from: Optional[str] = _flag(None, "Start from the model and EMA weights of this checkpoint (a file, e.g. "
                                     "from scripts.convert, or a logdir's newest) with a new optimizer at step 0; "
                                     "its network flags must match. A logdir with checkpoints resumes instead.",
                                     role=RUN)
    time_limit_minutes: float = _flag(0.0, "Stop with a checkpoint after this many minutes of training in "
                                      "this process (0: no limit); --resume continues later.", min=0, role=RUN)
    fid_every: int = _flag(0, "Score the EMA model with FID every this many steps (0: never); samples with "
                           "--sample_sampler/--sample_steps, reference stats cached in the logdir.", min=0, role=RUN)
    fid_num_images: int = _flag(1000, "Samples per FID evaluation during training (a covariance needs 2).", min=2,
                                max=2 ** 32, role=RUN)  # image i's seed is (seed << 32) + i: scripts.cli.MAX_IMAGES
    fid_metrics: str = _flag("fid", "What --fid_every scores: fid, kid, pr (precision/recall) comma-separated, or all; "
                             "KID and precision/recall keep the reference's features in fid_reference.npz.", role=RUN)
    # Devices
    device: str = _flag("auto", "auto: a GPU when MegEngine sees one.", choices=("auto", "cpu", "gpu"), role=RUN)
    num_gpus: int = _flag(1, "GPUs on this machine; more than 1 launches one process per GPU.", min=1, max=1024,
                          role=RUN)
    world_size: Optional[int] = _flag(None, "Total processes over all machines; unset = num_gpus.", min=1,
                                      max=65536, role=RUN)
    rank_start: int = _flag(0, "Rank of this machine's first process (multi-machine).", min=0, role=RUN)
    master_ip: str = _flag("localhost", "Address of the machine running rank 0.", role=RUN)
    port: int = _flag(0, "Port of the distributed server (0: pick a free one; set it for multi-machine).",
                      min=0, max=65535, role=RUN)

    @property
    def image_shape(self):
        """(C, H, W) of the images the model sees."""
        return (self.image_channels, self.image_size, self.image_size)

    @property
    def total_world_size(self):
        """Number of training processes over all machines."""
        return self.world_size if self.world_size is not None else self.num_gpus

    def to_dict(self):
        """A JSON-serialisable dict (tuples become lists; a ``sparse`` field only when set)."""
        return {f.name: list(v) if isinstance(v, tuple) else v for f, v in _items(self)
                if not (f.metadata.get("sparse") and v == f.default)}

    @classmethod
    def from_dict(cls, values):
        """Inverse of ``to_dict``; unknown keys are an error (a checkpoint from another version), a missing
        field takes its ``absent`` value, else its default."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ConfigError(f"unknown config keys {unknown}")
        kwargs = {f.name: f.metadata["absent"] for f in fields(cls) if "absent" in f.metadata}
        kwargs.update((k, tuple(v) if isinstance(v, list) else v) for k, v in values.items())
        return cls(**kwargs)

    def replace(self, **changes):
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)


def _items(cfg):
    return [(f, getattr(cfg, f.name)) for f in fields(cfg)]


def flag_fields():
    """The dataclass fields that are command-line flags."""
    return [f for f in fields(TrainConfig) if f.metadata.get("flag", True)]


def as_flag(name, value):
    """One setting as absl parses it: ``--name=value``, lists comma-separated, booleans ``--name``/``--noname``."""
    if isinstance(value, bool):
        return f"--{name}" if value else f"--no{name}"
    if isinstance(value, (list, tuple)):
        value = ",".join(str(v) for v in value)
    return f"--{name}={value}"


def to_flagfile(cfg):
    """The config as absl flagfile text that reproduces it (``--flagfile=...``); unset fields are left out."""
    return "".join(as_flag(f.name, getattr(cfg, f.name)) + "\n" for f in flag_fields()
                   if getattr(cfg, f.name) is not None)


def to_json(cfg):
    """The config as indented JSON text."""
    return json.dumps(cfg.to_dict(), indent=2, sort_keys=True) + "\n"


def rule(bounds):
    """Bounds (a field's metadata, or a dict with some of the keys ``min``, ``above``, ``max``, ``below``) as text
    (">= 0 and < 1"), or None when there are none."""
    parts = [f"{sign} {bounds[key]:{'d' if isinstance(bounds[key], int) else 'g'}}" for key, sign, _ in _BOUNDS
             if key in bounds]
    return " and ".join(parts) or None


def field_bounds(name):
    """The bounds of the ``TrainConfig`` field ``name`` (the ``rule`` keys of its metadata); ``KeyError`` for a name
    that is no field."""
    metadata = next(f.metadata for f in fields(TrainConfig) if f.name == name)
    return {key: metadata[key] for key, _, _ in _BOUNDS if key in metadata}


def check_bounds(name, value, bounds):
    """``ConfigError`` when the number ``value`` of flag ``--name`` is outside ``bounds`` (see ``rule``)."""
    if not all(test(value, bounds[key]) for key, _, test in _BOUNDS if key in bounds):
        raise ConfigError(f"--{name} must be {rule(bounds)}, got {value}")


_TYPE_NAMES = {int: "an integer", float: "a finite number", str: "a string", bool: "true or false",
               Optional[int]: "an integer or unset", Optional[str]: "a string or unset",
               Tuple[int, ...]: "a list of integers"}


def _has_type(value, annotation):
    """Whether ``value`` fits a field annotation (an int stands for a float; a bool for nothing but a bool)."""
    if typing.get_origin(annotation) is typing.Union:
        return any(_has_type(value, member) for member in typing.get_args(annotation))
    if typing.get_origin(annotation) is tuple:
        return isinstance(value, tuple) and all(_has_type(item, int) for item in value)
    if isinstance(value, bool) or annotation is bool:
        return isinstance(value, bool) and annotation is bool
    if annotation is float:
        return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))
    return isinstance(value, annotation)


def check_field(f, value):
    """Raise ``ConfigError`` when ``value`` does not have the type of field ``f`` (floats must be finite), or is
    outside its choices or bounds."""
    if not _has_type(value, f.type):
        raise ConfigError(f"--{f.name} must be {_TYPE_NAMES[f.type]}, got {value!r}")
    if value is None:
        return
    choices = f.metadata.get("choices")
    if choices is not None and value is not None and value not in choices:
        raise ConfigError(f"--{f.name} must be one of {', '.join(choices)}, got {value!r}")
    check_bounds(f.name, value, f.metadata)


def validate(cfg):
    """Raise ``ConfigError`` for settings that cannot train. Needs ``image_size`` resolved."""
    from megdiffusion.data.loader import LoaderError, per_rank_batch
    for f, value in _items(cfg):
        check_field(f, value)
    if cfg.image_size is None:
        raise ConfigError("--image_size is unset; it is read from the dataset (config.resolve) or given")
    if cfg.total_world_size < cfg.num_gpus:
        raise ConfigError(f"--world_size {cfg.world_size} is smaller than --num_gpus {cfg.num_gpus}")
    try:
        local_batch = per_rank_batch(cfg.batch_size, cfg.total_world_size)
    except LoaderError as err:
        raise ConfigError(f"--batch_size: {err}; the global batch is split evenly across ranks") from None
    try:
        unet_config(cfg)
    except ValueError as err:
        raise ConfigError(f"bad model flags: {err}") from None
    try:
        diffusion = build_diffusion(cfg, chain_only=True)
    except ValueError as err:
        raise ConfigError(f"bad diffusion flags: {err}") from None
    if cfg.microbatch and local_batch % cfg.microbatch:
        raise ConfigError(f"--microbatch {cfg.microbatch} does not divide the per-device batch of {local_batch} "
                          f"(--batch_size {cfg.batch_size} over {cfg.total_world_size} processes); choose a divisor")
    if cfg.trace and cfg.dropout:
        raise ConfigError(f"--trace needs --dropout 0 (got {cfg.dropout:g}): a traced graph keeps the dropout seed it "
                          "was traced with, so its masks could not follow each step's seed (exact resume)")
    if cfg.class_dropout and not cfg.num_classes:
        raise ConfigError("--class_dropout drops class labels: it needs a class-conditional run (--num_classes)")
    if cfg.input_perturbation and cfg.mean_type == "xprev":
        raise ConfigError("--input_perturbation needs --mean_type eps, xstart or v: the xprev target is made from "
                          "the perturbed x_t")
    check_sizes(parse_metrics(cfg.fid_metrics, "--fid_metrics"), cfg.fid_num_images, cfg.fid_num_images)
    if not profile_sigma_rels(cfg) and cfg.snapshot_every:
        raise ConfigError("--snapshot_every saves post-hoc EMA profiles: give --ema_profiles too (e.g. 0.05,0.10)")
    try:
        if cfg.sample_every or cfg.fid_every:  # the only users of the sampler settings
            grid_sampler(cfg).check(diffusion)
    except ValueError as err:  # its words name the sampling commands' flags, if any; training's are --sample_*
        named = re.sub(r"--(sampler|steps|spacing|order)\b", r"--sample_\1", str(err))
        raise ConfigError(named if named != str(err) else
                          f"--sample_sampler/--sample_steps/--sample_spacing/--sample_order: {err}") from None


def grid_sampler(cfg):
    """The ``SamplerSettings`` of the training grids and ``--fid_every``: --sample_sampler, --sample_steps,
    --sample_spacing and --sample_order."""
    return SamplerSettings(cfg.sample_sampler, cfg.sample_steps, spacing=cfg.sample_spacing, order=cfg.sample_order)


def profile_sigma_rels(cfg):
    """The ``ema_profiles`` as floats, in their order (``posthoc_ema.parse_sigma_rels``); ``ConfigError`` otherwise."""
    text = cfg.ema_profiles.strip()
    try:
        return parse_sigma_rels(text.split(","), "--ema_profiles") if text else ()
    except ValueError as err:
        raise ConfigError(str(err)) from None


def unet_config(cfg):
    """The ``UNetConfig`` of the config's network: its fields by name, the channels from the data and the variance
    (ValueError for one that cannot be built)."""
    given = {f.name: getattr(cfg, f.name) for f in fields(UNetConfig) if f.name not in ("in_channels", "out_channels")}
    return UNetConfig(in_channels=cfg.image_channels, out_channels=output_channels(cfg), **given)


def build_model(cfg):
    """The UNet the config describes."""
    from megdiffusion.nn import UNet

    return UNet(unet_config(cfg))


def output_channels(cfg):
    """The network's output channels: the image channels, twice that when it learns the variance."""
    return cfg.image_channels * (2 if cfg.var_type in LEARNED_VAR_TYPES else 1)


def build_diffusion(cfg, chain_only=False):
    """The GaussianDiffusion the config describes; ``chain_only``: its options and schedule alone (``DiffusionChain``,
    which needs no MegEngine: what validation reads)."""
    from megdiffusion.diffusion import make_beta_schedule
    from megdiffusion.diffusion.chain import DiffusionChain

    kind = DiffusionChain
    if not chain_only:
        from megdiffusion.diffusion.gaussian import GaussianDiffusion as kind
    return kind(make_beta_schedule(cfg.beta_schedule, cfg.num_timesteps), mean_type=cfg.mean_type,
                var_type=cfg.var_type, loss_type=cfg.loss_type, rescale_timesteps=cfg.rescale_timesteps,
                min_snr_gamma=cfg.min_snr_gamma)


def define_flags(flag_values):
    """Define one absl flag per ``TrainConfig`` flag field in ``flag_values``."""
    from absl import flags

    for f in flag_fields():
        help_text = f.metadata["help"] + (f" Must be {rule(f.metadata)}." if rule(f.metadata) else "")
        default = f.default
        if "choices" in f.metadata:
            flags.DEFINE_enum(f.name, default, f.metadata["choices"], help_text, flag_values=flag_values)
        elif f.type is bool:
            flags.DEFINE_bool(f.name, default, help_text, flag_values=flag_values)
        elif isinstance(default, tuple):
            flags.DEFINE_list(f.name, [str(v) for v in default], help_text, flag_values=flag_values)
        elif f.type in (int, Optional[int]):
            flags.DEFINE_integer(f.name, default, help_text, flag_values=flag_values)
        elif f.type is float:
            flags.DEFINE_float(f.name, default, help_text, flag_values=flag_values)
        else:
            flags.DEFINE_string(f.name, default, help_text, flag_values=flag_values)


def config_from_flags(flag_values):
    """Build a ``TrainConfig`` from parsed absl flags, then resolve and validate it against the data.

    Loads the dataset (to read its image size and channel count) and returns ``(cfg, images)``.
    Raises ``ConfigError`` or ``megdiffusion.data.datasets.DatasetError``; nothing is written.
    """
    values = {}
    for f in flag_fields():
        value = flag_values[f.name].value
        if isinstance(f.default, tuple):
            try:
                value = tuple(int(v) for v in value)
            except ValueError:
                raise ConfigError(f"--{f.name} needs comma-separated integers, "
                                  f"got {','.join(value)}") from None
        values[f.name] = value
    return resolve(TrainConfig(**values))


def resolve(cfg):
    """Open the dataset (a prepared file's images read when asked for, a folder as a list of paths whose headers are
    checked: nothing is decoded here), fill
    ``image_size``/``image_channels`` from it and validate: ``(cfg, images)``. A ``--data_path`` to a prepared file
    makes the dataset "prepared"."""
    from megdiffusion.data.datasets import class_names, load_dataset, load_labels
    from megdiffusion.data.prepared import is_prepared

    if cfg.data_path is not None and cfg.dataset != "prepared" and is_prepared(cfg.data_path):
        cfg = cfg.replace(dataset="prepared")
    if cfg.image_size is not None:
        validate(cfg)  # fail before reading a possibly large dataset
    images = load_dataset(cfg.dataset, path=cfg.data_path, image_size=cfg.image_size, resumed=cfg.resume)
    height, width, channels = images.shape[1:]
    if height != width:
        raise ConfigError(f"dataset images are {height}x{width}; set --image_size to centre-crop them square")
    cfg = cfg.replace(image_size=height, image_channels=channels)
    validate(cfg)
    if images.shape[0] < cfg.batch_size:
        raise ConfigError(f"the dataset has {images.shape[0]} images, "
                          f"fewer than --batch_size {cfg.batch_size}")
    if cfg.num_classes:
        check_labels(load_labels(cfg.dataset, path=cfg.data_path), len(images), cfg.num_classes)
        names = class_names(cfg.dataset, cfg.data_path, images)
        if names and len(names) != cfg.num_classes:
            raise ConfigError(f"{cfg.data_path} holds {len(names)} classes ({', '.join(names[:4])}"
                              f"{', ...' if len(names) > 4 else ''}), not --num_classes {cfg.num_classes}; set "
                              f"--num_classes {len(names)}")
    return cfg, images


def check_labels(labels, num_images, num_classes):
    """``ConfigError`` (one line) unless there is one label in [0, ``num_classes``) per image."""
    if len(labels) != num_images:
        raise ConfigError(f"the dataset has {num_images} images but {len(labels)} class labels")
    if len(labels) and labels.min() < 0:  # no --num_classes fixes that
        raise ConfigError(f"class label {labels.min()} is negative; the labels of a class-conditional run are "
                          f"0..{num_classes - 1}: number the dataset's classes from 0")
    outside = labels[labels >= num_classes]
    if len(outside):
        raise ConfigError(f"class label {outside[0]} is outside 0..{num_classes - 1}; set --num_classes to the "
                          f"number of classes (the labels go up to {labels.max()})")
