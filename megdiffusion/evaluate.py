"""Scoring a model with FID: sample with per-image seeds, then compare Inception statistics.

Used by the train script (``--fid_every``), ``scripts/fid.py --ckpt`` and the demo, so all three
measure the same way.
"""
import os

from megdiffusion.metrics import fid
from megdiffusion.generation import generate_images


def reference_statistics(images, cache_path=None, batch_size=50, progress=False):
    """(mu, sigma) of the real ``images`` (uint8 NHWC), computed once and cached at ``cache_path``."""
    if cache_path and os.path.isfile(cache_path):
        return fid.load_statistics(cache_path)
    mu, sigma = fid.statistics_of_images(images, batch_size=batch_size, progress=progress)
    if cache_path:
        fid.save_statistics(cache_path, mu, sigma)
    return mu, sigma


def model_fid(model, diffusion, image_shape, reference, num_images, seed=0, sampler="ddim", steps=50,
              eta=0.0, batch_size=64, progress=False):
    """FID of ``num_images`` samples of ``model`` against ``reference`` = (mu, sigma); returns
    ``(fid, samples)`` with the samples as uint8 NHWC. Image i uses the seed of (seed, i)."""
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=num_images, unit="img", desc=f"sampling ({sampler})", dynamic_ncols=True)
    samples = generate_images(model, diffusion, image_shape, range(num_images), seed, sampler, steps, eta,
                              batch_size, progress=bar)
    if bar is not None:
        bar.close()
    mu, sigma = fid.statistics_of_images(samples, progress=progress)
    return fid.frechet_distance(mu, sigma, *reference), samples
