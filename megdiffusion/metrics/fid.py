"""Frechet Inception Distance, following the TTUR / pytorch-fid protocol.

Protocol (see docs/evaluation.md):
- network: the TF Inception-v3 "2015-12-05" graph, pool3 features (``megdiffusion.metrics.inception``);
- input: RGB uint8; grayscale repeated to 3 channels; bilinear resize to 299x299 with
  ``align_corners=False`` semantics and no antialiasing (pytorch-fid's ``F.interpolate``), done on the
  float image before scaling; then (x - 128) / 128 (:func:`preprocess`);
- statistics: mu and sigma of the 2048-d features, in float64, saved as npz with keys ``mu`` and ``sigma``
  (readable by pytorch-fid and TTUR, and able to read theirs), and on request the features themselves (``features``,
  float32 (N, 2048)), which KID and precision/recall (``megdiffusion.metrics.kid_pr``) need;
- distance: |mu1 - mu2|^2 + tr S1 + tr S2 - 2 tr sqrt(S1 S2), with the last trace taken from the
  eigenvalues of the symmetric PSD matrix sqrt(S1) S2 sqrt(S1) (no ``scipy.linalg.sqrtm``).
"""
import dataclasses
import functools
import math
import os
import zipfile
from typing import Optional

import numpy as np

from megdiffusion.errors import MegdiffusionError
from megdiffusion.files.disk import read_npz, save_npz
from megdiffusion.metrics import FEATURE_DIM, INPUT_SIZE


class FIDError(MegdiffusionError):
    """Bad input to the metrics (images, features, statistics files, sources); the message is one line saying what
    to fix."""


# ---------------------------------------------------------------------------------------------------
# Preprocessing.

def _bilinear_matrix(size_in, size_out):
    """(size_out, size_in) interpolation weights of torch's bilinear resize with align_corners=False."""
    src = (np.arange(size_out, dtype=np.float64) + 0.5) * (size_in / size_out) - 0.5
    src = np.maximum(src, 0.0)
    low = np.minimum(np.floor(src).astype(np.int64), size_in - 1)
    high = np.minimum(low + 1, size_in - 1)
    frac = src - low
    matrix = np.zeros((size_out, size_in), np.float64)
    rows = np.arange(size_out)
    np.add.at(matrix, (rows, low), 1.0 - frac)
    np.add.at(matrix, (rows, high), frac)
    return matrix


def resize_bilinear(images, height, width):
    """Resize float NHWC images to (height, width): bilinear, ``align_corners=False``, no antialiasing.

    Output pixel i samples the input at (i + 0.5) * in / out - 0.5 (clamped at 0), interpolating the two
    neighbouring pixels (the last pixel repeats at the far edge): pytorch's ``F.interpolate`` convention.
    """
    rows = _bilinear_matrix(images.shape[1], height).astype(np.float32)
    cols = _bilinear_matrix(images.shape[2], width).astype(np.float32)
    out = np.einsum("oh,nhwc->nowc", rows, images, optimize=True)
    return np.einsum("pw,nowc->nopc", cols, out, optimize=True)


def preprocess(images):
    """uint8 images -> the Inception input: float32 NCHW (N, 3, 299, 299) in [-1, 1).

    ``images``: uint8 NHWC with 1 (gray) or 3 (RGB) channels, or NHW gray. Gray is repeated to 3
    channels; images not 299x299 are resized with :func:`resize_bilinear` (on the 0..255 float values,
    unrounded); then x -> (x - 128) / 128.
    """
    images = np.asarray(images)
    if images.dtype != np.uint8:
        raise FIDError(f"images must be uint8 (0..255), got {images.dtype}; convert samples with to_uint8")
    if images.ndim == 3:
        images = images[..., None]
    if images.ndim != 4 or images.shape[3] not in (1, 3):
        raise FIDError(f"images must be NHWC with 1 or 3 channels, got shape {images.shape}")
    x = images.astype(np.float32)
    if x.shape[3] == 1:
        x = np.repeat(x, 3, axis=3)
    if x.shape[1:3] != (INPUT_SIZE, INPUT_SIZE):
        x = resize_bilinear(x, INPUT_SIZE, INPUT_SIZE)
    x = (x - 128.0) / 128.0
    return np.ascontiguousarray(x.transpose(0, 3, 1, 2), dtype=np.float32)


# ---------------------------------------------------------------------------------------------------
# Statistics.

class FeatureStatistics:
    """Running mean and covariance of feature rows in float64 (shifted sums, so any order gives the same)."""

    def __init__(self):
        self.count = 0
        self._shift = None
        self._sum = None
        self._outer = None

    def update(self, features):
        """Add a (B, D) batch of features."""
        features = np.asarray(features, np.float64)
        if self._shift is None:
            self._shift = features.mean(axis=0)
            self._sum = np.zeros_like(self._shift)
            self._outer = np.zeros((len(self._shift), len(self._shift)))
        centred = features - self._shift
        self._sum += centred.sum(axis=0)
        self._outer += centred.T @ centred
        self.count += len(features)

    def finalize(self):
        """(mu, sigma): the mean and the unbiased (N - 1) covariance, as np.cov computes them."""
        if self.count < 2:
            raise FIDError(f"need at least 2 images for a covariance, got {self.count}")
        mean_centred = self._sum / self.count
        sigma = (self._outer - self.count * np.outer(mean_centred, mean_centred)) / (self.count - 1)
        return self._shift + mean_centred, (sigma + sigma.T) / 2


@functools.lru_cache(maxsize=2)
def get_inception(weights_path=None):
    """The FID Inception network (loaded once per weights path and process)."""
    from megdiffusion.metrics.inception import build_inception

    return build_inception(weights_path)


def _batch(images, start, stop):
    """The network input (``preprocess``) for ``images[start:stop]``: an NHWC array (or prepared images), a sequence of
    images of one size that an index array reads at once (``shape``: a streamed folder, a ``Subset``), or a sequence
    of uint8 HWC images whose sizes may differ."""
    if isinstance(images, np.ndarray):
        return preprocess(images[start:stop])
    if getattr(images, "shape", (None, None))[1] is not None:
        return preprocess(images[np.arange(start, stop)])
    items = [np.asarray(images[i]) for i in range(start, stop)]
    if all(item.shape == items[0].shape for item in items):
        return preprocess(np.stack(items))
    return np.concatenate([preprocess(item[None]) for item in items])


def _feature_batches(images, batch_size=50, progress=False, weights_path=None):
    """The (B, 2048) float32 pool3 features of ``images``, yielded batch by batch.

    ``images``: uint8 NHWC array, or a sequence of uint8 HWC images (e.g. ``datasets.ImageFolder``), read
    batch by batch. ``progress`` shows a tqdm bar with images/s on stderr.
    """
    if batch_size < 1:
        raise FIDError(f"batch_size must be >= 1, got {batch_size}")
    network = get_inception(weights_path)
    bar = None
    if progress:
        from megdiffusion.progress import progress_bar

        bar = progress_bar(total=len(images), unit="img", desc="inception")
    for start in range(0, len(images), batch_size):
        stop = min(start + batch_size, len(images))
        yield network(_batch(images, start, stop))
        if bar is not None:
            bar.update(stop - start)
    if bar is not None:
        bar.close()


@dataclasses.dataclass(frozen=True)
class Statistics:
    """A set's mu and sigma (float64) and, when kept, its features (float32 (N, d))."""
    mu: np.ndarray
    sigma: np.ndarray
    features: Optional[np.ndarray] = None


def statistics_of_features(features, keep=False):
    """:class:`Statistics` of (N, d) features (accumulated 1000 rows at a time), keeping them when ``keep``."""
    stats = FeatureStatistics()
    for start in range(0, len(features), 1000):
        stats.update(features[start:start + 1000])
    return Statistics(*stats.finalize(), np.asarray(features, np.float32) if keep else None)


def statistics_of_images(images, batch_size=50, progress=False, weights_path=None, keep_features=False):
    """:class:`Statistics` of the pool3 features of ``images`` (see :func:`_feature_batches`); the features are
    accumulated batch by batch, and held in memory only when ``keep_features`` (50,000 images: 400 MB)."""
    stats, kept = FeatureStatistics(), []
    for features in _feature_batches(images, batch_size, progress, weights_path):
        stats.update(features)
        if keep_features:
            kept.append(features)
    return Statistics(*stats.finalize(), np.concatenate(kept) if keep_features else None)


def frechet_distance(mu1, sigma1, mu2, sigma2, features2=None):
    """FID between Gaussians N(mu1, sigma1) and N(mu2, sigma2); float, >= 0.

    tr sqrt(S1 S2) = sum of sqrt(eigenvalues of sqrt(S1) S2 sqrt(S1)): that matrix is symmetric PSD and
    similar to S1 S2, so ``eigh`` applies; tiny negative eigenvalues from rounding are clamped to 0. Works
    for rank-deficient covariances (fewer images than dimensions). ``features2``: the (N, d) features sigma2 is
    the covariance of, for N <= d: with A their centred rows over sqrt(N - 1) (S2 = A^T A), the nonzero eigenvalues
    of sqrt(S1) S2 sqrt(S1) are those of the N x N matrix A S1 A^T, so no d x d eigendecomposition is needed.
    """
    mu1, mu2 = np.asarray(mu1, np.float64), np.asarray(mu2, np.float64)
    sigma1, sigma2 = np.asarray(sigma1, np.float64), np.asarray(sigma2, np.float64)
    d = mu1.shape[0] if mu1.ndim == 1 else -1
    if mu1.shape != (d,) or mu2.shape != (d,) or sigma1.shape != (d, d) or sigma2.shape != (d, d):
        raise FIDError(f"statistics do not match: mu {mu1.shape} / {mu2.shape}, "
                       f"sigma {sigma1.shape} / {sigma2.shape}")
    if not all(np.isfinite(a).all() for a in (mu1, mu2, sigma1, sigma2)):
        raise FIDError("statistics contain NaN or infinity")
    sigma1, sigma2 = (sigma1 + sigma1.T) / 2, (sigma2 + sigma2.T) / 2
    if features2 is not None and 2 <= len(features2) <= d:
        factor = (np.asarray(features2, np.float64) - mu2) / math.sqrt(len(features2) - 1)
        product = factor @ sigma1 @ factor.T
    else:
        values, vectors = np.linalg.eigh(sigma1)
        sqrt_sigma1 = (vectors * np.sqrt(np.clip(values, 0, None))) @ vectors.T
        product = sqrt_sigma1 @ sigma2 @ sqrt_sigma1
    trace_sqrt = np.sqrt(np.clip(np.linalg.eigvalsh((product + product.T) / 2), 0, None)).sum()
    diff = mu1 - mu2
    fid = diff @ diff + np.trace(sigma1) + np.trace(sigma2) - 2 * trace_sqrt
    return float(max(fid, 0.0))


def worth_keeping(count):
    """Whether to keep the features of ``count`` images that no metric needs: at most ``FEATURE_DIM`` of them make
    the FID milliseconds instead of two d x d eigendecompositions (``fid_between``)."""
    return count <= FEATURE_DIM


def fid_between(a, b):
    """``frechet_distance`` of two :class:`Statistics`, through the features of the one holding fewer rows than
    dimensions when either does (the usual case for a few hundred samples: milliseconds instead of seconds)."""
    small = [s for s in (a, b) if s.features is not None and len(s.features) <= len(s.mu)]
    if not small:
        return frechet_distance(a.mu, a.sigma, b.mu, b.sigma)
    few = min(small, key=lambda s: len(s.features))
    other = b if few is a else a
    return frechet_distance(other.mu, other.sigma, few.mu, few.sigma, few.features)


# ---------------------------------------------------------------------------------------------------
# Statistics files and sources.

def save_statistics(path, stats):
    """Write ``stats`` to an npz file atomically: ``mu`` and ``sigma`` in float64 (pytorch-fid / TTUR format), and
    ``features`` in float32 when it holds them."""
    arrays = dict(mu=np.asarray(stats.mu, np.float64), sigma=np.asarray(stats.sigma, np.float64))
    if not all(np.isfinite(a).all() for a in (stats.mu, stats.sigma, stats.features) if a is not None):
        raise FIDError(f"the statistics for {path} hold NaN or infinity; nothing was written")
    if stats.features is not None:
        arrays["features"] = np.asarray(stats.features, np.float32)
    save_npz(path, **arrays)


def load_statistics(path):
    """:class:`Statistics` from an npz with keys ``mu`` and ``sigma`` (float64) and optionally ``features``
    (float32); :class:`FIDError` otherwise."""
    try:
        arrays = read_npz(path)
    except ValueError as exc:
        raise FIDError(str(exc)) from None
    missing = [key for key in ("mu", "sigma") if key not in arrays]
    if missing:
        raise FIDError(f"{path} has no {' and no '.join(repr(key) for key in missing)} array (it holds: "
                       f"{', '.join(arrays) or 'nothing'}); statistics files hold 'mu' and 'sigma', as "
                       "--save_stats writes them")
    mu, sigma = arrays["mu"], arrays["sigma"]
    if mu.shape != (FEATURE_DIM,) or sigma.shape != (FEATURE_DIM, FEATURE_DIM) \
            or not all(np.issubdtype(a.dtype, np.number) for a in (mu, sigma)):
        raise FIDError(f"{path} holds mu {mu.dtype} {mu.shape} and sigma {sigma.dtype} {sigma.shape}; FID statistics "
                       f"are those of the {FEATURE_DIM} Inception pool3 features, mu ({FEATURE_DIM},) and sigma "
                       f"({FEATURE_DIM}, {FEATURE_DIM}), as --save_stats writes them")
    features = arrays.get("features")
    if features is not None and (features.ndim != 2 or features.shape[1] != FEATURE_DIM
                                 or not np.issubdtype(features.dtype, np.number)):
        raise FIDError(f"{path} holds features {features.dtype} {features.shape}; they must be the (N, {FEATURE_DIM}) "
                       "Inception pool3 features, as --save_stats --save_features writes them")
    stats = Statistics(mu.astype(np.float64), sigma.astype(np.float64),
                       None if features is None else features.astype(np.float32))
    if not all(np.isfinite(a).all() for a in (stats.mu, stats.sigma, stats.features) if a is not None):
        raise FIDError(f"{path}: its statistics contain NaN or infinity")
    return stats


def random_subset(images, count, seed, skip=0):
    """``count`` of ``images`` drawn without replacement by ``seed`` (in their order), after the first ``skip`` of the
    same draw: disjoint for disjoint ranges. Lazy (``datasets.Subset``) for images not in memory."""
    from megdiffusion.data.datasets import Subset

    chosen = np.sort(np.random.default_rng(seed).permutation(len(images))[skip:skip + count])
    return Subset(images, chosen)


def _is_statistics_file(spec):
    """Whether ``spec`` is an npz that holds ``mu`` or ``sigma`` (one alone is reported by ``load_statistics``)."""
    if not (spec.endswith(".npz") and os.path.isfile(spec)):
        return False
    try:
        with np.load(spec) as npz:  # lists the names without reading the arrays
            return "mu" in npz.files or "sigma" in npz.files
    except (OSError, ValueError, AttributeError, zipfile.BadZipFile):  # AttributeError: a .npy has no names
        return False


def open_source(spec, num_images=None, need_features=False, image_size=None, seed=0):
    """The source ``spec`` names, checked before any network pass: a statistics npz's :class:`Statistics` (read and
    checked; with ``need_features`` it must hold features), or else the images ``DataSpec.parse(spec)`` names (at
    ``image_size``; ``num_images`` of them drawn at random by ``seed``, ``random_subset``), not yet read."""
    from megdiffusion.data.spec import DataSpec

    if _is_statistics_file(spec):
        stats = load_statistics(spec)
        if need_features and stats.features is None:
            raise FIDError(f"{spec} holds only mu and sigma; KID and precision/recall need the features: make it with "
                           "--save_stats --save_features")
        return stats
    images = DataSpec.parse(spec).images(image_size)
    if num_images is not None:
        if num_images > len(images):
            raise FIDError(f"{spec} has {len(images)} images, fewer than --num_images={num_images}")
        images = random_subset(images, num_images, seed)
    return images


def statistics_of_source(source, batch_size=50, progress=False, weights_path=None, keep_features=False):
    """:class:`Statistics` of what :func:`open_source` returned: statistics as they are, images through the
    network."""
    if isinstance(source, Statistics):
        return source
    return statistics_of_images(source, batch_size, progress, weights_path, keep_features)


def statistics_for_source(spec, batch_size=50, num_images=None, progress=False, weights_path=None,
                          keep_features=False, image_size=None, seed=0):
    """:class:`Statistics` for a source spec: a statistics npz is read as is; anything ``DataSpec``
    accepts is run through the network (``num_images`` of them at random, ``open_source``)."""
    return statistics_of_source(open_source(spec, num_images, keep_features, image_size, seed), batch_size, progress,
                                weights_path, keep_features)
