"""KID and precision/recall beyond the conformance numbers: their expectations, the blocked distances, bad input, and
how the scripts name and print the metrics."""
import numpy as np
import pytest
import scipy.spatial.distance

from megdiffusion.metrics import fid, kid_pr, scores


def _gaussian(seed, n, d=16, shift=0.0):
    return np.random.default_rng(seed).normal(0.5 + shift, 0.3, (n, d))


def test_mmd2_is_the_pairwise_definition_and_symmetric():
    x, y = _gaussian(0, 5, 4), _gaussian(1, 6, 4)
    k = lambda a, b: (a @ b / 4 + 1) ** 3  # noqa: E731
    expected = (sum(k(x[i], x[j]) for i in range(5) for j in range(5) if i != j) / 20
                + sum(k(y[i], y[j]) for i in range(6) for j in range(6) if i != j) / 30
                - 2 * sum(k(a, b) for a in x for b in y) / 30)
    assert kid_pr.mmd2_unbiased(x, y) == pytest.approx(expected, rel=1e-12)
    assert kid_pr.mmd2_unbiased(y, x) == pytest.approx(expected, rel=1e-12)


def test_kid_is_near_zero_for_one_distribution_and_grows_with_a_shift():
    a, b = _gaussian(2, 300), _gaussian(3, 300)
    same = kid_pr.kernel_inception_distance(a, b, subsets=20, subset_size=100)
    shifted = kid_pr.kernel_inception_distance(a, _gaussian(3, 300, shift=0.3), subsets=20, subset_size=100)
    assert abs(same.mean) < 3 * same.std + 1e-12
    assert shifted.mean > 20 * abs(same.mean) and shifted.mean > 10 * shifted.std
    assert len(same.values) == 20 and same.subset_size == 100
    again = kid_pr.kernel_inception_distance(a, b, subsets=20, subset_size=100)
    np.testing.assert_array_equal(again.values, same.values)  # the seed decides the subsets
    other_seed = kid_pr.kernel_inception_distance(a, b, subsets=20, subset_size=100, seed=1)
    assert not np.array_equal(other_seed.values, same.values)


def test_kid_subset_size_defaults_to_1000_capped_at_the_smaller_set():
    assert kid_pr.kid_subset_size(5000, 2000) == 1000
    assert kid_pr.kid_subset_size(500, 700) == 500
    assert kid_pr.kid_subset_size(500, 700, 300) == 300
    assert kid_pr.kernel_inception_distance(_gaussian(4, 40), _gaussian(5, 30), subsets=3).subset_size == 30


def test_precision_recall_of_identical_and_of_far_apart_sets():
    a = _gaussian(6, 50)
    assert kid_pr.precision_recall(a, a) == (1.0, 1.0, 1.0)
    far = kid_pr.precision_recall(a, _gaussian(7, 40, shift=100.0))
    assert far == (0.0, 0.0, 0.0)


def test_blocked_distances_equal_the_whole_matrix():
    a, b = _gaussian(8, 23, 5), _gaussian(9, 17, 5, shift=0.1)
    whole = scipy.spatial.distance.cdist(a, b) ** 2
    blocks = np.zeros_like(whole)
    for i, j, d2 in kid_pr._squared_distance_blocks(a, b, 4):
        blocks[i:i + d2.shape[0], j:j + d2.shape[1]] = d2
    np.testing.assert_allclose(blocks, whole, rtol=1e-12, atol=1e-12)
    within = np.sort(scipy.spatial.distance.cdist(a, a), axis=1)[:, 3] ** 2  # the self-distance first
    np.testing.assert_allclose(kid_pr.neighbour_radii(a, 3, block=4), within, rtol=1e-10, atol=1e-12)
    assert kid_pr.precision_recall(a, b, block=4) == kid_pr.precision_recall(a, b, block=1000)
    assert 0 < kid_pr.precision_recall(a, b).precision < 1


@pytest.mark.parametrize("call, message", [
    (lambda: kid_pr.kernel_inception_distance(np.zeros((1, 4)), np.zeros((5, 4))),
     "KID needs at least 2 images in each set, got 1 generated and 5 real"),
    (lambda: kid_pr.kernel_inception_distance(np.zeros((5, 4)), np.zeros((6, 4)), subset_size=6),
     r"the KID subset size \(--kid_subset_size\) must be between 2 and the smaller set's 5 images \(5 generated, 6 "
     r"real\), got 6"),
    (lambda: kid_pr.precision_recall(np.zeros((3, 4)), np.zeros((9, 4))),
     r"precision/recall need at least 4 images in each set \(k=3 nearest neighbours\), got 3 generated and 9 real"),
    (lambda: kid_pr.precision_recall(np.zeros((5, 4)), np.zeros((5, 3))),
     r"the feature sets must be \(N, d\) arrays of one d, got generated \(5, 4\) and real \(5, 3\)"),
    (lambda: kid_pr.kernel_inception_distance(np.zeros((5, 4)), np.zeros((5, 3))), "arrays of one d"),
])
def test_bad_feature_sets_are_reported(call, message):
    with pytest.raises(fid.FIDError, match=message):
        call()


def test_metric_names_and_lines():
    assert scores.parse_metrics("all") == ("fid", "kid", "pr")
    assert scores.parse_metrics("pr,fid") == ("fid", "pr")
    with pytest.raises(fid.FIDError, match=r"unknown metric 'is', 'kd' in --metrics 'kd,fid,is'; choose from fid, "
                                           r"kid, pr or all"):
        scores.parse_metrics("kd,fid,is")
    a, b = _gaussian(10, 40), _gaussian(11, 30, shift=0.2)
    got = scores.compare(fid.statistics_of_features(a, keep=True), fid.statistics_of_features(b, keep=True),
                         scores.METRICS, kid_subsets=5)
    kid = kid_pr.kernel_inception_distance(a, b, 5)
    pr = kid_pr.precision_recall(a, b)
    assert scores.score_lines(got) == [
        f"FID: {fid.frechet_distance(a.mean(0), np.cov(a, rowvar=False), b.mean(0), np.cov(b, rowvar=False)):.4f}",
        f"KID (Inception-v3 pool3, 5 subsets of 30): {kid.mean * 1e3:.2f} ± {kid.std * 1e3:.2f} x 1e-3",
        f"precision {pr.precision:.4f} recall {pr.recall:.4f} F {pr.f_score:.4f} (Inception-v3 pool3, k=3)"]
