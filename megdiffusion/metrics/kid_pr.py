"""Kernel Inception Distance and precision/recall of two feature sets, with torch-fidelity 0.4's conventions.

The generated set comes first, the real set second (torch-fidelity's input1 and input2). Everything is computed in
float64, whatever the features' dtype.

- KID (Binkowski et al. 2018): the unbiased MMD^2 with the kernel k(x, y) = (x . y / d + 1)^3, on ``subsets`` pairs
  of ``subset_size`` rows; subset i draws ``choice(n_generated, m, replace=False)`` then ``choice(n_real, m,
  replace=False)`` from one ``np.random.RandomState(seed)``. KID is the mean over subsets with their population std.
- precision/recall (Kynkaanniemi et al. 2019): each point's radius is the distance to its k-th nearest other point
  of its own set; a point is inside the other set's manifold when its distance to some point of that set is at most
  that point's radius. precision = share of generated points inside the real manifold, recall = share of real
  points inside the generated manifold, F = 2 P R / max(1e-5, P + R). Distances are computed in blocks of
  ``block`` x ``block`` rows, so 50,000-image sets never hold a 50,000 x 50,000 matrix.
"""
from typing import NamedTuple

import numpy as np

from megdiffusion.metrics.fid import FIDError

KID_SUBSETS = 100
KID_SUBSET_SIZE = 1000  # capped at the smaller set unless given
KID_SEED = 2020
NEIGHBOURS = 3  # precision/recall's k
BLOCK = 2048  # rows per side of a block of distances: 32 MB of float64


class KID(NamedTuple):
    mean: float
    std: float
    values: np.ndarray  # the MMD^2 of each subset
    subset_size: int


class PrecisionRecall(NamedTuple):
    precision: float
    recall: float
    f_score: float


def _check_sets(generated, real):
    """The two feature sets as float64 (N, d) arrays of one d; FIDError if they are not."""
    generated, real = np.asarray(generated), np.asarray(real)
    if generated.ndim != 2 or real.ndim != 2 or generated.shape[1] != real.shape[1]:
        raise FIDError(f"the feature sets must be (N, d) arrays of one d, got generated {generated.shape} and real "
                       f"{real.shape}")
    return generated.astype(np.float64), real.astype(np.float64)


def kid_subset_size(n_generated, n_real, subset_size=None):
    """The subset size KID uses for sets of these sizes: ``subset_size``, or when None ``KID_SUBSET_SIZE`` capped at
    the smaller set; FIDError when a set has fewer than 2 images or ``subset_size`` is not in 2..the smaller set."""
    smaller = min(n_generated, n_real)
    if smaller < 2:
        raise FIDError(f"KID needs at least 2 images in each set, got {n_generated} generated and {n_real} real")
    if subset_size is None:
        return min(KID_SUBSET_SIZE, smaller)
    if not 2 <= subset_size <= smaller:
        raise FIDError(f"the KID subset size (--kid_subset_size) must be between 2 and the smaller set's {smaller} "
                       f"images ({n_generated} generated, {n_real} real), got {subset_size}")
    return subset_size


def check_precision_recall_sizes(n_generated, n_real, k=NEIGHBOURS):
    """FIDError unless each set has the k + 1 images precision/recall needs (a point and its k neighbours)."""
    if min(n_generated, n_real) < k + 1:
        raise FIDError(f"precision/recall need at least {k + 1} images in each set (k={k} nearest neighbours), got "
                       f"{n_generated} generated and {n_real} real")


def polynomial_kernel(x, y):
    """k(x_i, y_j) = (x_i . y_j / d + 1)^3 for every pair of rows."""
    return (x @ y.T / x.shape[1] + 1) ** 3


def mmd2_unbiased(x, y):
    """The unbiased MMD^2 of rows ``x`` (m) and ``y`` (n) under :func:`polynomial_kernel`: the off-diagonal means
    of k(x, x) and k(y, y) minus twice the mean of k(x, y)."""
    m, n = len(x), len(y)
    kxx, kyy = polynomial_kernel(x, x), polynomial_kernel(y, y)
    return float((kxx.sum() - np.trace(kxx)) / (m * (m - 1)) + (kyy.sum() - np.trace(kyy)) / (n * (n - 1))
                 - 2 * polynomial_kernel(x, y).sum() / (m * n))


def kid_subsets(n_generated, n_real, subsets, subset_size, seed):
    """The rows of KID's subsets: (subsets, subset_size) index arrays into the generated and the real set."""
    rng = np.random.RandomState(seed)
    drawn = [(rng.choice(n_generated, subset_size, replace=False), rng.choice(n_real, subset_size, replace=False))
             for _ in range(subsets)]
    return np.array([a for a, _ in drawn]), np.array([b for _, b in drawn])


def kernel_inception_distance(generated, real, subsets=KID_SUBSETS, subset_size=None, seed=KID_SEED):
    """KID of two feature sets (``subset_size``: see :func:`kid_subset_size`)."""
    generated, real = _check_sets(generated, real)
    subset_size = kid_subset_size(len(generated), len(real), subset_size)
    if subsets < 1:
        raise FIDError(f"KID needs at least 1 subset, got {subsets}")
    rows_generated, rows_real = kid_subsets(len(generated), len(real), subsets, subset_size, seed)
    values = np.array([mmd2_unbiased(generated[a], real[b]) for a, b in zip(rows_generated, rows_real)])
    return KID(float(values.mean()), float(values.std()), values, subset_size)


def _squared_distance_blocks(x, y, block):
    """(i, j, squared distances of x[i:i + block] to y[j:j + block]) over every block, clamped at 0."""
    for i in range(0, len(x), block):
        a = x[i:i + block]
        for j in range(0, len(y), block):
            b = y[j:j + block]
            yield i, j, np.maximum((a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2 * a @ b.T, 0)


def neighbour_radii(x, k=NEIGHBOURS, block=BLOCK):
    """Squared distance of each row of ``x`` to its k-th nearest other row: the (k + 1)-th smallest of its row of
    distances, its own zero distance the first (torch's ``kthvalue(k + 1)``)."""
    nearest = np.full((len(x), k + 1), np.inf)
    for i, _, d2 in _squared_distance_blocks(x, x, block):
        rows = slice(i, i + len(d2))
        nearest[rows] = np.partition(np.concatenate([nearest[rows], d2], axis=1), k, axis=1)[:, :k + 1]
    return nearest.max(axis=1)


def inside_manifold(x, y, radii, block=BLOCK):
    """Whether each row of ``x`` lies within the ball of some row of ``y`` (squared ``radii``, ties inside)."""
    inside = np.zeros(len(x), bool)
    for i, j, d2 in _squared_distance_blocks(x, y, block):
        inside[i:i + len(d2)] |= (d2 <= radii[j:j + d2.shape[1]]).any(axis=1)
    return inside


def precision_recall(generated, real, k=NEIGHBOURS, block=BLOCK):
    """Precision, recall and F-score of the generated features against the real ones (k nearest neighbours)."""
    generated, real = _check_sets(generated, real)
    check_precision_recall_sizes(len(generated), len(real), k)
    precision = float(inside_manifold(generated, real, neighbour_radii(real, k, block), block).mean())
    recall = float(inside_manifold(real, generated, neighbour_radii(generated, k, block), block).mean())
    return PrecisionRecall(precision, recall, 2 * precision * recall / max(1e-5, precision + recall))
