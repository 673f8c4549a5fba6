"""A run's images by index: image ``i`` depends only on (seed, i), whatever the batch it is drawn in.

Its starting noise and every noise draw of the sampler come from a generator seeded by
``image_seed(seed, i)``. So a run split into pieces, resumed after a crash, or spread over several GPUs
gives the same images as one uninterrupted run (for a given batch size). Used by the training grids,
FID scoring (``evaluate``) and ``sampling``. On the fast CPU path the network runs outside MegEngine
(``native.NativeModel``).
"""
import numpy as np

from megdiffusion.images import to_uint8
from megdiffusion.native import NativeModel


def image_seed(seed, index):
    """The integer seed of image ``index`` in a run seeded with ``seed``."""
    return (int(seed) << 32) + int(index)


def generate_images(model, diffusion, image_shape, indices, seed, sampler="ddpm", steps=None, eta=0.0,
                    batch_size=64, progress=None, respacing=None):
    """Sample the images ``indices`` of a run (each from ``image_seed(seed, i)``) as uint8 NHWC.

    ``image_shape`` is (C, H, W); ``progress`` is an optional tqdm bar advanced per image; ``respacing`` (instead
    of ``steps``): see ``GaussianDiffusion.sample``. Bad sampler settings raise ValueError
    (``GaussianDiffusion.check_sampling``), even for no indices.
    """
    diffusion.check_sampling(sampler, steps, eta, respacing)
    indices = list(indices)
    out = []
    network = NativeModel.for_sampling(model) if indices else model
    try:
        for start in range(0, len(indices), batch_size):
            chunk = indices[start:start + batch_size]
            x = diffusion.sample(network, (len(chunk),) + tuple(image_shape), sampler=sampler, steps=steps, eta=eta,
                                 seeds=[image_seed(seed, i) for i in chunk], respacing=respacing)
            out.append(to_uint8(x))
            if progress is not None:
                progress.update(len(chunk))
    finally:
        if network is not model:
            network.close()
    c, h, w = image_shape
    return np.concatenate(out) if out else np.zeros((0, h, w, c), np.uint8)
