"""A run's images by index: image ``i`` depends only on (seed, i), whatever the batch it is drawn in.

Its starting noise and every noise draw of the sampler come from a generator seeded by
``image_seed(seed, i)``. So a run split into pieces, resumed after a crash, or spread over several GPUs
gives the same images as one uninterrupted run (for a given batch size). Used by the training grids,
FID scoring (``evaluate``) and ``sampling``. On the fast CPU path the network runs outside MegEngine
(``native.NativeModel``).

Autoguidance (Karras et al. 2024, "Guiding a diffusion model with a bad version of itself"): the prediction at
each step is bad + w (good - bad), where the bad model is a weaker version of the good one with the same kinds of
error, such as an earlier checkpoint of the same run; w = 1 is the good model alone. It costs a second network
call per step; its effect on the CPU recipe is in benchmarks/README.md ("Autoguidance").
"""
import contextlib
import dataclasses
import functools

import numpy as np

import megengine as mge
import megengine.functional as F

from megdiffusion.diffusion.samplers import eval_mode
from megdiffusion.diffusion.sampler_settings import SamplerSettings
from megdiffusion.errors import MegdiffusionError
from megdiffusion.files.images import to_uint8
from megdiffusion.cpu.native import NativeModel
from megdiffusion.nn.options import NO_CLASS, check_class_label
from megdiffusion.nn.unet import UNet


@dataclasses.dataclass(frozen=True)
class Autoguidance:
    """Guide sampling with ``model``, a weaker version of the sampled model (same inputs and predictions):
    prediction = bad + ``weight`` * (good - bad). A learned variance is taken from the good model alone. With
    ``unconditional``, the guide (a class-conditional model trained with ``--class_dropout``) predicts without a
    class: classifier-free guidance when it is the sampled model itself, both kinds at once when it is earlier."""

    model: object
    weight: float
    unconditional: bool = False


class _Guided:
    """The network ``bad + weight * (good - bad)`` on the prediction channels (the first ``channels``); the bad
    network sees no class when ``unconditional``."""

    def __init__(self, good, bad, weight, channels, unconditional=False):
        self.good, self.bad, self.weight, self.channels = good, bad, weight, channels
        self.unconditional = unconditional

    def __call__(self, x, t, y=None):
        bad_y = F.full_like(y, NO_CLASS) if self.unconditional else y
        good, bad = self.good(x, t, **_labels(y)), self.bad(x, t, **_labels(bad_y))
        guided = bad + self.weight * (good - bad)
        if good.shape[1] == self.channels:
            return guided
        return F.concat([guided[:, :self.channels], good[:, self.channels:]], axis=1)


def _labels(y):
    """The keyword arguments of a network call with class labels ``y`` (None: an unconditional network)."""
    return {} if y is None else {"y": y}


def image_seed(seed, index):
    """The integer seed of image ``index`` in a run seeded with ``seed``."""
    return (int(seed) << 32) + int(index)


def image_classes(num_classes, indices):
    """The class labels of images ``indices`` of a class-conditional model: image i is of class i mod
    ``num_classes``, so every run of n images holds each class n / num_classes times (rounded)."""
    return (np.asarray(indices, dtype=np.int64) % num_classes).astype(np.int32)


def generate_images(model, diffusion, image_shape, indices, seed, settings=SamplerSettings(), batch_size=64,
                    progress=None, guidance=None, class_label=None):
    """Sample the images ``indices`` of a run (each from ``image_seed(seed, i)``) as uint8 NHWC.

    ``image_shape`` is (C, H, W); ``settings`` a ``SamplerSettings``; ``progress`` an optional tqdm bar advanced
    per image; ``guidance``: an ``Autoguidance``, or None. A class-conditional model (``num_classes`` > 0) draws
    every image of ``class_label``, or image i of class ``image_classes`` when that is None. Bad sampler settings
    raise ValueError (``SamplerSettings.check``), and so does a class the model does not know, even for no indices.
    """
    settings.check(diffusion)
    num_classes = getattr(model, "num_classes", 0)
    check_class_label(class_label, num_classes)
    indices = list(indices)
    out = []
    ready = sampling_networks(model, guidance) if indices else contextlib.nullcontext((model, guidance))
    with ready as (network, guidance):
        if guidance is not None:
            network = _Guided(network, guidance.model, guidance.weight, image_shape[0], guidance.unconditional)
        for start in range(0, len(indices), batch_size):
            chunk = indices[start:start + batch_size]
            conditioned = network
            if num_classes:
                labels = image_classes(num_classes, chunk) if class_label is None else np.full(len(chunk), class_label)
                conditioned = functools.partial(network, y=mge.tensor(labels, dtype="int32"))
            x = diffusion.sample(conditioned, (len(chunk),) + tuple(image_shape),
                                 seeds=[image_seed(seed, i) for i in chunk], **settings.arguments())
            out.append(to_uint8(finite_samples(x, chunk, settings, guidance)))
            if progress is not None:
                progress.update(len(chunk))
    c, h, w = image_shape
    return np.concatenate(out) if out else np.zeros((0, h, w, c), np.uint8)


class NonFiniteSamples(MegdiffusionError):
    """Sampling gave NaN or infinite images; the message names the images and the likely cause."""


def finite_samples(x, indices, settings, guidance):
    """``x`` (the float samples of images ``indices``) as numpy, or ``NonFiniteSamples`` when any is NaN or infinite:
    such images would be written as flat white or black, and scored as if they were images."""
    x = np.asarray(x.numpy() if hasattr(x, "numpy") else x)
    bad = ~np.isfinite(x.reshape(len(x), -1)).all(axis=1)
    if bad.any():
        label = settings.label()
        guided = f" guided with w={guidance.weight:g}" if guidance is not None else ""
        lower = "lower --guidance, or " if guidance is not None else ""
        raise NonFiniteSamples(f"{int(bad.sum())} of images {indices[0]}..{indices[-1]} came out NaN or infinite "
                               f"({label}{guided}, first: image {indices[int(np.argmax(bad))]}): the sampling "
                               f"diverged; {lower}try more --steps or another --sampler; they were not written")
    return x


@contextlib.contextmanager
def sampling_networks(model, guidance=None):
    """``(network, guidance)``: ``model`` and the guide as sampling calls them (a UNet as
    ``NativeModel.for_sampling``, in eval mode), built once for the block and closed after it. A command that samples
    batch after batch opens them around its loop and gives them to ``generate_images``, which uses them as they are."""
    with contextlib.ExitStack() as stack:
        network = _network(model, stack)
        if guidance is not None:
            guidance = dataclasses.replace(guidance, model=_network(guidance.model, stack))
        yield network, guidance


def _network(model, stack):
    """``model`` as sampling calls it (a UNet: ``NativeModel.for_sampling``), in eval mode, closed when ``stack``
    ends."""
    stack.enter_context(eval_mode(model))
    network = NativeModel.for_sampling(model) if isinstance(model, UNet) else model
    if network is not model:
        stack.callback(network.close)
    return network
