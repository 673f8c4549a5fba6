"""Sampling a trained run: the model from its checkpoint, resumable output directories, grids and npz, on
one device or on several GPUs (``run_job``).

Image ``i`` depends only on (seed, i) (``megdiffusion.diffusion.generation``): a run split into pieces, resumed after
a crash, or spread over several GPUs writes the same images as one uninterrupted run.
"""
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
from megdiffusion.progress import progress_bar

from megdiffusion.errors import MegdiffusionError
from megdiffusion.files.disk import output_directory, save_npz, write_text
from megdiffusion.diffusion.sampler_settings import SamplerSettings
from megdiffusion.files.images import make_grid, read_image, save_png
from megdiffusion.nn.options import check_class_label
from megdiffusion.diffusion.chain import DiffusionChain
from megdiffusion.sampling.model import OpenedModel, load, open_model
from megdiffusion.training import checkpoint, distributed

MANIFEST = "manifest.json"


class SamplingError(MegdiffusionError):
    """Bad sampling input; the message is one line that says what to fix."""


@dataclass(frozen=True)
class SampleJob:
    """What a sampling run writes, handed whole to each process: launched ones need no parsed flags."""

    ckpt: str  # a checkpoint file or a run's logdir (its newest checkpoint)
    output: str
    num_images: int
    seed: int = 0
    settings: SamplerSettings = SamplerSettings()
    batch_size: int = 64  # per process
    ema: bool = True
    progress: bool = True
    npz: bool = True  # also write samples.npz
    guide_ckpt: Optional[str] = None  # autoguidance: the weaker model (``open_guidance``)
    guidance: float = 1.0  # its weight w: bad + w (good - bad); 1 is no guidance
    guide_unconditional: bool = False  # the guide predicts without a class (classifier-free guidance)
    class_label: Optional[int] = None  # a class-conditional model: every image of this class (None: i mod classes)

    def manifest(self, step, diffusion, guide_step=None):
        """The settings that decide the images (``manifest.json``), resolved (``SamplerSettings.resolved``: defaults
        filled in) and whole: a directory never mixes two of them, and spelling a default out changes nothing."""
        return {"checkpoint": os.path.abspath(self.ckpt), "step": step, "ema": self.ema,
                "eta": float(self.settings.eta), "seed": self.seed, **self.settings.resolved(diffusion),
                "guide_checkpoint": os.path.abspath(self.guide_ckpt) if self.guide_ckpt else None,
                "guide_step": guide_step, "guidance": float(self.guidance),
                "guide_unconditional": self.guide_unconditional, "class_label": self.class_label}


def run_job(job, num_gpus=1):
    """Write the job's missing images into ``job.output``, in this process or in one spawned process per
    GPU (``distributed.launch``), then its grid and npz; returns the checkpoint's step. Everything is checked
    before anything is written, and the output directory is locked meanwhile; what the run's config and step show
    wrong, before MegEngine is imported (the networks are built last)."""
    distributed.check_launch(num_gpus)
    checked = open_checked(job.ckpt, job.ema, job.settings, job.guide_ckpt, job.guidance, job.guide_unconditional,
                           job.class_label)
    manifest = job.manifest(checked.model.step, checked.chain, checked.guide_step)
    with output_directory(job.output, "--output", MANIFEST):
        written = check_output(job.output, manifest, checked.chain)
        loaded, guidance = checked.build()
        if not written:  # only once the weights fit the network
            _write_manifest(job.output, manifest)
        if num_gpus == 1:
            sample_share(job, loaded, guidance)
        else:
            distributed.launch(sample_share, (job,), num_gpus)
        write_summaries(job.output, job.num_images, npz=job.npz)
    return checked.model.step


@dataclass(frozen=True)
class CheckedModels:
    """A model and its guide opened (``open_model``) and checked against the sampler settings, the class and the
    guidance flags (``open_checked``), their networks not built yet."""

    model: OpenedModel
    chain: DiffusionChain  # the model's diffusion, without MegEngine: what the settings were checked against
    guide: Optional[OpenedModel]
    guide_step: Optional[int]
    guidance: float
    guide_unconditional: bool

    def build(self):
        """``(loaded, autoguidance)``: ``load_model``'s four and the guide's ``Autoguidance`` (None: none); MegEngine
        from here, the weights checked against the networks."""
        return _parts(self.model.build()), _autoguidance(self.guide, self.guidance, self.guide_unconditional)


def open_checked(ckpt, ema, settings, guide_ckpt=None, guidance=1.0, guide_unconditional=False, class_label=None):
    """``CheckedModels`` of ``ckpt`` (a file or logdir, ``ema``: its EMA weights) sampled with ``settings``, guided by
    ``guide_ckpt`` with weight ``guidance`` (``open_guidance``) and of ``class_label``: ``SamplingError`` for any of
    them the run's config refuses."""
    from megdiffusion.training.config import build_diffusion

    opened = open_model(ckpt, ema)
    chain = build_diffusion(opened.config, chain_only=True)
    check_sampler(chain, settings)
    try:
        check_class_label(class_label, opened.config.num_classes)
    except ValueError as err:
        raise SamplingError(f"--class_label: {err}") from None
    guide, guide_step = open_guidance(guide_ckpt, guidance, opened.config, ema, guide_unconditional)
    return CheckedModels(opened, chain, guide, guide_step, guidance, guide_unconditional)


def sample_share(job, loaded=None, guidance=None):
    """Write this process's share of the job's missing images (all of them outside a launched group).

    ``loaded``, ``guidance``: what ``CheckedModels.build`` returned, when the caller has them; launched processes
    load them here.
    """
    if loaded is None:
        loaded, guidance = open_checked(job.ckpt, job.ema, job.settings, job.guide_ckpt, job.guidance,
                                        job.guide_unconditional, job.class_label).build()
    model, diffusion, cfg, _ = loaded
    rank, world_size = distributed.rank_and_world()
    return sample_to_directory(model, diffusion, cfg.image_shape, job.output, job.num_images, job.seed, job.settings,
                               job.batch_size, rank, world_size, job.progress, guidance, job.class_label)


def _parts(model):
    return model.network, model.diffusion, model.config, model.step


def load_model(ckpt_or_logdir, ema=True):
    """The network of anything ``megdiffusion.load`` reads (a checkpoint file, a run's logdir: its newest checkpoint,
    a ``.mge`` graph, a published checkpoint) as ``(network, diffusion, cfg, step)``: the network in eval mode with
    the EMA weights (``ema=False``: the raw ones) and the run's ``TrainConfig``."""
    return _parts(load(ckpt_or_logdir, ema))


def open_guidance(guide_ckpt, weight, cfg, ema=True, unconditional=False):
    """``(OpenedModel, step)`` of the guide in ``guide_ckpt``, its network not built; ``(None, None)`` without
    guidance (no ``guide_ckpt`` and weight 1). ``unconditional``: the guide predicts without a class. Raises
    ``SamplingError`` for a weight below 1, one without the other, a guide that sees or predicts other things
    (``checkpoint.GUIDE_FIELDS``: its width and depth may differ), or an unconditional guide that was not trained to
    be one (``--class_dropout``)."""
    if not math.isfinite(weight) or weight < 1:
        raise SamplingError(f"--guidance must be a number >= 1 (1: no guidance; Karras et al. use 1.5 to 3), "
                            f"got {weight:g}")
    if not guide_ckpt:
        if unconditional:
            raise SamplingError("--guide_unconditional needs --guide_ckpt (the sampled checkpoint itself for "
                                "classifier-free guidance)")
        if weight != 1:
            raise SamplingError(f"--guidance {weight:g} needs --guide_ckpt, the weaker model to guide with (an "
                                "earlier checkpoint of the same run)")
        return None, None
    if weight == 1:
        raise SamplingError("--guide_ckpt needs --guidance above 1 (with 1 the guide is not used; try 2)")
    guide = open_model(guide_ckpt, ema)
    changed = checkpoint.differences(guide.config, cfg, checkpoint.GUIDE_FIELDS)
    if changed:
        raise SamplingError(f"--guide_ckpt {guide_ckpt} was trained with different {', '.join(changed)} "
                            f"({' '.join(changed.values())}) than the sampled model; guide with a checkpoint of "
                            "the same run")
    if unconditional and not guide.config.class_dropout:
        raise SamplingError(f"--guide_unconditional: {guide_ckpt} was trained without --class_dropout, so it never "
                            "learnt to predict without a class; guide it with the class (drop the flag)")
    return guide, guide.step


def _autoguidance(guide, weight, unconditional):
    """The ``Autoguidance`` of an opened guide (None: none), its network built here."""
    if guide is None:
        return None
    from megdiffusion.diffusion.generation import Autoguidance  # MegEngine's, as the network is

    return Autoguidance(guide.build().network, float(weight), unconditional)


def check_sampler(diffusion, settings):
    """``settings.check(diffusion)`` for the scripts, before any work: ``SamplingError`` instead of ValueError."""
    try:
        settings.check(diffusion)
    except ValueError as err:
        raise SamplingError(str(err)) from None


def image_path(output, index):
    return Path(output) / f"{index:06d}.png"


# What a manifest written before a setting existed meant by its absence.
_ABSENT = {"guide_checkpoint": None, "guide_step": None, "guidance": 1.0, "guide_unconditional": False,
           "class_label": None, "spacing": None, "order": None}


def prepare_output(output, settings, diffusion):
    """Write ``settings`` (``SampleJob.manifest``) as the manifest of directory ``output``, or check that its
    manifest holds exactly them (``check_output``)."""
    if not check_output(output, settings, diffusion):
        _write_manifest(output, settings)


def _write_manifest(output, settings):
    write_text(Path(output) / MANIFEST, json.dumps(settings, indent=2, sort_keys=True) + "\n")


def check_output(output, settings, diffusion):
    """Whether directory ``output`` has a manifest; ``SamplingError`` unless it holds exactly ``settings``, resolved
    the same way (``SamplerSettings.resolved``): every key both ways.

    A directory written with other settings is refused, so images of two models or samplers never mix.
    """
    manifest = Path(output) / MANIFEST
    if not manifest.exists():
        return False
    try:
        previous = json.loads(manifest.read_text())
    except (OSError, ValueError):
        previous = None
    if not isinstance(previous, dict) or not isinstance(previous.get("sampler"), str):
        raise SamplingError(f"{manifest} is unreadable; delete it or choose another --output")
    previous = {**_ABSENT, **previous}
    try:
        previous.update(SamplerSettings(**{key: previous.get(key) for key in (
            "sampler", "steps", "respacing", "spacing", "order")}).resolved(diffusion))
    except (KeyError, TypeError):
        raise SamplingError(f"{manifest} is unreadable; delete it or choose another --output") from None
    changed = sorted(k for k in set(settings) | set(previous) if previous.get(k) != settings.get(k))
    if changed:
        details = ", ".join(f"{k}: {previous.get(k)!r} -> {settings.get(k)!r}" for k in changed)
        raise SamplingError(f"{output} holds images made with other settings ({details}); "
                            "choose another --output or delete it")
    return True


def missing_indices(output, num_images, rank=0, world_size=1):
    """This rank's share (i % world_size == rank) of the images not yet written in ``output``."""
    return [i for i in range(rank, num_images, world_size) if not image_path(output, i).exists()]


def sample_to_directory(model, diffusion, image_shape, output, num_images, seed, settings=SamplerSettings(),
                        batch_size=64, rank=0, world_size=1, progress=True, guidance=None, class_label=None):
    """Write this rank's missing images ``000000.png ...`` into ``output`` (``settings``, ``guidance``,
    ``class_label``: see ``generate_images``); returns how many it wrote.

    Each PNG is written atomically as soon as its batch is done, so an interrupted run loses at most
    one batch and a rerun continues where it stopped.
    """
    from megdiffusion.diffusion.generation import generate_images, sampling_networks

    todo = missing_indices(output, num_images, rank, world_size)
    if not todo:
        return 0
    bar = progress_bar(total=len(todo), unit="img", desc=f"sampling ({settings.sampler})",
                       disable=not (progress and rank == 0))
    with bar, sampling_networks(model, guidance) as (network, guidance):  # the workers start once, not per batch
        for start in range(0, len(todo), batch_size):
            chunk = todo[start:start + batch_size]
            images = generate_images(network, diffusion, image_shape, chunk, seed, settings, batch_size,
                                     progress=bar, guidance=guidance, class_label=class_label)
            for index, image in zip(chunk, images):
                save_png(image_path(output, index), image)
    return len(todo)


def read_samples(output, num_images):
    """Read images 0..num_images-1 of ``output`` as uint8 NHWC (channels as written)."""
    return np.stack([read_image(image_path(output, i), mode=None) for i in range(num_images)])


def write_summaries(output, num_images, npz=True, grid_size=64):
    """Write ``grid.png`` (the first ``grid_size`` images) and, with ``npz``, ``samples.npz`` (arr_0)."""
    images = read_samples(output, num_images)
    save_png(Path(output) / "grid.png", make_grid(images[:grid_size]))
    if npz:
        save_npz(Path(output) / "samples.npz", arr_0=images)
    return images
