"""Scoring a model: FID (sample with per-image seeds, then compare Inception statistics) and the negative
log-likelihood bound in bits per dimension.

FID is used by the train script (``--fid_every``), ``scripts/fid.py --ckpt`` and the demo, so all three
measure the same way; the NLL by ``scripts/nll.py``.
"""
import os

import numpy as np

from megdiffusion.generation import generate_images, image_seed
from megdiffusion.images import to_float
from megdiffusion.metrics import fid


def reference_statistics(images, cache_path=None, batch_size=50, progress=False):
    """(mu, sigma) of the real ``images`` (uint8 NHWC), computed once and cached at ``cache_path``."""
    if cache_path and os.path.isfile(cache_path):
        return fid.load_statistics(cache_path)
    mu, sigma = fid.statistics_of_images(images, batch_size=batch_size, progress=progress)
    if cache_path:
        fid.save_statistics(cache_path, mu, sigma)
    return mu, sigma


def model_fid(model, diffusion, image_shape, reference, num_images, seed=0, sampler="ddim", steps=50,
              eta=0.0, batch_size=64, progress=False, respacing=None, guidance=None, spacing=None, order=None):
    """FID of ``num_images`` samples of ``model`` (with ``guidance``, a ``generation.Autoguidance``, or None)
    against ``reference`` = (mu, sigma); returns ``(fid, samples)`` with the samples as uint8 NHWC. Image i uses
    the seed of (seed, i)."""
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=num_images, unit="img", desc=f"sampling ({sampler})", dynamic_ncols=True)
    samples = generate_images(model, diffusion, image_shape, range(num_images), seed, sampler, steps, eta,
                              batch_size, progress=bar, respacing=respacing, guidance=guidance, spacing=spacing,
                              order=order)
    if bar is not None:
        bar.close()
    mu, sigma = fid.statistics_of_images(samples, progress=progress)
    return fid.frechet_distance(mu, sigma, *reference), samples


def bits_per_dim(model, diffusion, images, seed=0, batch_size=50, progress=None):
    """The variational bound (negative log-likelihood) of each uint8 NHWC image in bits per dimension, over every
    timestep of ``diffusion`` (respace it for fewer), with clipped x_0 predictions; image i's noise comes from
    ``image_seed(seed, i)``. ``images`` is an array or a sequence of HWC images; ``progress`` a tqdm bar counting
    images. Returns float64 arrays ``total_bpd`` and ``prior_bpd`` (N,) and ``vb`` (N, n), column t for t."""
    from megdiffusion.compat import quiet_megengine
    from megdiffusion.diffusion.gaussian import noise_source

    mge = quiet_megengine()
    parts = []
    for start in range(0, len(images), batch_size):
        indices = range(start, min(start + batch_size, len(images)))
        x = mge.tensor(to_float(np.stack([np.asarray(images[i]) for i in indices])))
        draw_noise = noise_source(tuple(x.shape), seeds=[image_seed(seed, i) for i in indices])
        parts.append(diffusion.calc_bpd_loop(model, x, draw_noise=draw_noise, progress=progress))
    return {name: np.concatenate([part[name] for part in parts]) for name in ("total_bpd", "prior_bpd", "vb")}
