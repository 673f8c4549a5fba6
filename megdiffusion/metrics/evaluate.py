"""Scoring a model: FID, KID and precision/recall (sample with per-image seeds, then compare Inception features)
and the negative log-likelihood bound in bits per dimension.

The metrics are used by the train script (``--fid_every``), ``scripts/fid.py --ckpt`` and the demo, so all three
measure the same way; the NLL by ``scripts/nll.py``.
"""
import os

import numpy as np

from megdiffusion.diffusion.generation import generate_images, image_seed
from megdiffusion.diffusion.sampler_settings import SamplerSettings
from megdiffusion.files.images import to_float
from megdiffusion.metrics import fid
from megdiffusion.metrics.kid_pr import KID_SEED, KID_SUBSETS
from megdiffusion.metrics.scores import check_sizes, compare, needs_features


def reference_statistics(images, cache_path=None, batch_size=50, progress=False, keep_features=False):
    """:class:`fid.Statistics` of the real ``images`` (uint8 NHWC), computed once and cached at ``cache_path`` (again
    when ``keep_features`` and the cache has none)."""
    if cache_path and os.path.isfile(cache_path):
        stats = fid.load_statistics(cache_path)
        if stats.features is not None or not keep_features:
            return stats
    stats = fid.statistics_of_images(images, batch_size=batch_size, progress=progress, keep_features=keep_features)
    if cache_path:
        fid.save_statistics(cache_path, stats)
    return stats


def model_scores(model, diffusion, image_shape, reference, num_images, seed=0, settings=SamplerSettings("ddim", 50),
                 batch_size=64, progress=False, guidance=None, metrics=("fid",), kid_subsets=KID_SUBSETS,
                 kid_subset_size=None, kid_seed=KID_SEED):
    """``metrics`` (``scores.compare``) of ``num_images`` samples of ``model`` by ``settings`` (with ``guidance``, a
    ``generation.Autoguidance``, or None) against ``reference``, a :class:`fid.Statistics` (with features for KID and
    precision/recall); returns ``(scores, samples)`` with the samples as uint8 NHWC. Image i uses the seed of
    (seed, i). The sizes are checked before sampling."""
    if needs_features(metrics) and reference.features is None:
        raise fid.FIDError("the reference holds only mu and sigma; KID and precision/recall need its features")
    check_sizes(metrics, num_images, len(reference.features) if needs_features(metrics) else num_images,
                kid_subset_size)
    bar = None
    if progress:
        from megdiffusion.progress import progress_bar

        bar = progress_bar(total=num_images, unit="img", desc=f"sampling ({settings.sampler})")
    samples = generate_images(model, diffusion, image_shape, range(num_images), seed, settings, batch_size,
                              progress=bar, guidance=guidance)
    if bar is not None:
        bar.close()
    keep = needs_features(metrics) or fid.worth_keeping(num_images)
    generated = fid.statistics_of_images(samples, progress=progress, keep_features=keep)
    return compare(generated, reference, metrics, kid_subsets, kid_subset_size, kid_seed), samples


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
