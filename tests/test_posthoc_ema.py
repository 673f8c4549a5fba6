"""Conformance of the post-hoc EMA maths with EDM2's equations (the reference set: float64, numpy), at the set's
tolerances.

The set is ``$MEGDIFFUSION_POSTHOC_EMA_REFERENCE`` or tests/fixtures/posthoc_ema. Every case cases.json lists is
checked, with the tolerances read from its ``conventions``; the last test fails if a case was left unchecked.
"""
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

from megdiffusion.training import posthoc_ema as ph

REFERENCE = Path(os.environ.get("MEGDIFFUSION_POSTHOC_EMA_REFERENCE")
                 or Path(__file__).parent / "fixtures" / "posthoc_ema")
CASES = json.loads((REFERENCE / "cases.json").read_text())
KINDS = ("sigma_rel_to_gamma", "beta", "inner", "coefficients")
CHECKED = set()  # (kind, index) of each case compared, and ("trajectory", 0)


def tolerance(name):
    """The leading number of the tolerance the conventions give for ``name`` ("1e-12 relative", ...)."""
    [text] = [value for key, value in CASES["conventions"]["tolerance"].items() if name in key.split(", ")]
    return float(re.match(r"[0-9.e+-]+", text).group())


def close(got, expected, rel, scale=None):
    assert abs(got - expected) <= rel * abs(expected if scale is None else scale), (got, expected, rel)


def test_the_set_uses_our_conventions():
    conventions = CASES["conventions"]
    assert conventions["dtype"] == "float64"
    assert conventions["t"].startswith("images seen after the step (t_next)")
    assert {kind for kind in KINDS} <= set(CASES)


@pytest.mark.parametrize("index", range(len(CASES["sigma_rel_to_gamma"])))
def test_gamma_and_back(index):
    case = CASES["sigma_rel_to_gamma"][index]
    close(ph.gamma_of(case["sigma_rel"]), case["gamma"], tolerance("gamma"))
    close(ph.sigma_rel_of(case["gamma"]), case["sigma_rel_back"], tolerance("gamma"))
    CHECKED.add(("sigma_rel_to_gamma", index))


@pytest.mark.parametrize("index", range(len(CASES["beta"])))
def test_beta(index):
    case = CASES["beta"][index]
    close(ph.beta(ph.gamma_of(case["sigma_rel"]), case["t_next"], case["t_delta"]), case["beta"], tolerance("beta"))
    CHECKED.add(("beta", index))


@pytest.mark.parametrize("index", range(len(CASES["inner"])))
def test_inner_product(index):
    case = CASES["inner"][index]
    got = ph.inner(case["t_a"], ph.gamma_of(case["sigma_rel_a"]), case["t_b"], ph.gamma_of(case["sigma_rel_b"]))
    close(got, case["inner"], tolerance("inner"))
    CHECKED.add(("inner", index))


@pytest.mark.parametrize("index", range(len(CASES["coefficients"])))
def test_coefficients(index):
    case = CASES["coefficients"][index]
    weights, condition = ph.coefficients(case["snapshots"], case["target"])
    close(condition, case["condition_number"], 1e-6)
    rel = tolerance("coefficients") * case["condition_number"]
    largest = max(abs(c) for c in case["coefficients"])
    assert len(weights) == len(case["coefficients"])
    for got, expected in zip(weights, case["coefficients"]):
        close(got, expected, rel, scale=largest)
    CHECKED.add(("coefficients", index))


def test_a_tracked_trajectory_and_its_reconstruction():
    spec = CASES["trajectory"]
    data = np.load(REFERENCE / spec["file"])
    steps, batch, every = spec["steps"], spec["batch"], spec["snapshot_every"]
    raw = data["raw"]
    assert raw.shape == (steps + 1, spec["dims"])
    tracker, target = ph.Tracker(raw[0], spec["profiles"]), ph.Tracker(raw[0], [spec["target"]])
    snapshots, profiles = [], []
    for step in range(1, steps + 1):
        tracker.update(raw[step], step * batch, batch)
        target.update(raw[step], step * batch, batch)
        if step % every == 0:
            snapshots += [average.copy() for average in tracker.averages]
            profiles += [(step * batch, s) for s in spec["profiles"]]
    rel = tolerance("trajectory")
    np.testing.assert_allclose(profiles, data["snapshot_profiles"], rtol=0)
    np.testing.assert_allclose(snapshots, data["snapshots"], rtol=0, atol=rel * np.abs(data["snapshots"]).max())
    weights, condition = ph.coefficients(profiles, (steps * batch, spec["target"]))
    close(condition, spec["condition_number"], 1e-6)
    np.testing.assert_allclose(weights, data["coefficients"], rtol=0,
                               atol=tolerance("coefficients") * condition * np.abs(data["coefficients"]).max())
    reconstructed = weights @ np.array(snapshots)
    scale = np.abs(data["reconstructed"]).max()
    np.testing.assert_allclose(reconstructed, data["reconstructed"], rtol=0, atol=rel * condition * scale)
    np.testing.assert_allclose(target.averages[0], data["tracked_target"], rtol=0,
                               atol=rel * np.abs(data["tracked_target"]).max())
    error = np.linalg.norm(reconstructed - target.averages[0]) / np.linalg.norm(target.averages[0] - raw[-1])
    close(error, spec["reconstruction_vs_tracked_rel_err"], 1e-6)
    CHECKED.add(("trajectory", 0))


def test_every_listed_case_was_checked():
    expected = {(kind, i) for kind in KINDS for i in range(len(CASES[kind]))} | {("trajectory", 0)}
    assert CHECKED == expected
