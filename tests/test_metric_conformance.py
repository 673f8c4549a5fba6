"""Conformance of KID, precision/recall and FID with torch-fidelity 0.4's numbers on the reference feature sets, at
the tolerances of the reference README (generated = input1, real = input2).

The reference set is ``$MEGDIFFUSION_METRIC_REFERENCE`` or tests/fixtures/metrics. Every case metrics.json lists is
checked, with its sizes and settings read from the files; the last test fails if a case was left unchecked.
"""
import json
import os
from pathlib import Path

import numpy as np
import pytest

from megdiffusion.metrics import fid, kid_pr

REFERENCE = Path(os.environ.get("MEGDIFFUSION_METRIC_REFERENCE") or Path(__file__).parent / "fixtures" / "metrics")
METRICS = json.loads((REFERENCE / "metrics.json").read_text())
FEATURES = dict(np.load(REFERENCE / "features.npz"))
SUBSETS = dict(np.load(REFERENCE / "kid_subsets.npz"))
CASES = sorted(METRICS["cases"])
PARTS = ("kid", "prc", "fid")
CHECKED = set()  # (case, part) whose every number was compared


def features(case):
    """The case's generated and real features (float32, as stored), checked against its listed sizes."""
    spec = METRICS["cases"][case]
    generated, real = FEATURES[f"{case}.generated"], FEATURES[f"{case}.real"]
    assert generated.shape == (spec["n_gen"], spec["d"]) and real.shape == (spec["n_real"], spec["d"])
    return generated, real


def close(got, expected, rel):
    assert abs(got - expected) <= rel * abs(expected), (got, expected, rel)


def test_the_reference_uses_our_conventions():
    assert METRICS["convention"] == "input1 / features_1 = generated, input2 / features_2 = real"
    for case in CASES:
        spec = METRICS["cases"][case]
        effective = spec["kid_effective"]
        assert (effective["kid_kernel"], effective["degree"], effective["coef0"]) == ("poly", 3, 1)
        assert float(effective["gamma"].partition("=")[2]) == pytest.approx(1 / spec["d"], rel=1e-15)
        assert spec["prc"]["neighborhood"] == kid_pr.NEIGHBOURS


@pytest.mark.parametrize("case", CASES)
def test_kid(case):
    spec, effective = METRICS["cases"][case]["kid"], METRICS["cases"][case]["kid_effective"]
    generated, real = features(case)
    args = dict(subsets=effective["kid_subsets"], subset_size=effective["kid_subset_size"],
                seed=effective["rng_seed"])
    rows_generated, rows_real = kid_pr.kid_subsets(len(generated), len(real), **args)
    np.testing.assert_array_equal(rows_generated, SUBSETS[f"{case}.idx_generated"])
    np.testing.assert_array_equal(rows_real, SUBSETS[f"{case}.idx_real"])

    kid = kid_pr.kernel_inception_distance(generated.astype(np.float64), real.astype(np.float64), **args)
    assert kid.subset_size == effective["kid_subset_size"] and len(kid.values) == effective["kid_subsets"]
    close(kid.mean, spec["mean_float64_features"], 1e-9)
    close(kid.std, spec["std_float64_features"], 1e-9)
    close(kid.mean, spec["mean"], spec["tol_rel_vs_mean"])
    close(kid.std, spec["std"], spec["tol_rel_vs_mean"])
    per_subset = SUBSETS[f"{case}.mmd2_numpy_f64"]
    np.testing.assert_allclose(kid.values, per_subset, rtol=1e-9, atol=1e-9 * np.abs(per_subset).max())
    np.testing.assert_allclose(kid.values, SUBSETS[f"{case}.mmd2"], rtol=0, atol=5e-6)
    # float32 features give the same to float64 rounding: the computation is float64 whatever comes in
    assert kid_pr.kernel_inception_distance(generated, real, **args).mean == pytest.approx(kid.mean, rel=1e-12)

    # torch-fidelity's float32 value, with no tolerance of its own: the per-subset bound (5e-6) bounds their mean
    swapped = kid_pr.kernel_inception_distance(real, generated, **args)
    assert abs(swapped.mean - spec["mean_swapped_inputs"]) <= 5e-6 < abs(swapped.mean - kid.mean)
    full = kid_pr.mmd2_unbiased(generated.astype(np.float64), real.astype(np.float64))
    close(full, spec["mmd2_full_unbiased_numpy_f64"], 1e-9)
    if "mmd2_full_unbiased_tf_f64" in spec:
        close(full, spec["mmd2_full_unbiased_tf_f64"], 1e-9)
    CHECKED.add((case, "kid"))


@pytest.mark.parametrize("case", CASES)
def test_precision_recall(case):
    spec = METRICS["cases"][case]["prc"]
    generated, real = features(case)
    got = kid_pr.precision_recall(generated, real, k=spec["neighborhood"])
    assert round(got.precision * len(generated)) == spec["generated_inside_real"]
    assert round(got.recall * len(real)) == spec["real_inside_generated"]
    assert (got.precision, got.recall) == (spec["precision_exact"], spec["recall_exact"])
    close(got.f_score, spec["f_score_exact"], 1e-7)
    close(got.f_score, spec["f_score"], 1e-7)
    # torch-fidelity before its PR #70 took real first: precision and recall exchanged
    before_fix = spec["before_fix_70"]
    assert (got.recall, got.precision) == pytest.approx((before_fix["precision"], before_fix["recall"]), rel=1e-7)
    CHECKED.add((case, "prc"))


@pytest.mark.parametrize("case", CASES)
def test_fid(case):
    spec = METRICS["cases"][case]["fid"]
    generated, real = features(case)
    exact = [(x.mean(axis=0), np.cov(x, rowvar=False)) for x in (generated.astype(np.float64),
                                                                  real.astype(np.float64))]
    close(fid.frechet_distance(*exact[0], *exact[1]), spec["value_float64_features"], 1e-9)
    ours = [fid.statistics_of_features(x) for x in (generated, real)]  # the scripts' statistics of float32 features
    close(fid.frechet_distance(ours[0].mu, ours[0].sigma, ours[1].mu, ours[1].sigma), spec["value"],
          spec["tol_rel_vs_value"])
    CHECKED.add((case, "fid"))


def test_every_listed_case_was_checked():
    assert CHECKED == {(case, part) for case in CASES for part in PARTS}
