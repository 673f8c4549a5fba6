"""Conformance with openai/improved-diffusion: its own numbers for the diffusion maths (diffusion.npz: schedules,
respacing, posterior, p_mean_variance, vb terms, training losses and gradients, one ancestral and one DDIM step,
the bpd loop) and for a small random-weight improved UNet (unet_small.pt, io.npz: forward pass, intermediates and
one end-to-end respaced training loss with gradients), at the tolerances of the reference README:
``max|a - b| <= tol * max(1, max|ref|)``.

The reference set is ``$MEGDIFFUSION_IDDPM_REFERENCE`` or tests/fixtures/iddpm. The tests iterate over the cases
and keys its files list, and the last test checks that every key of both files was compared by one of them.
"""
import os
from pathlib import Path

import numpy as np
import pytest

from megdiffusion.compat import quiet_megengine

mge = quiet_megengine()
from megengine.autodiff import GradManager  # noqa: E402

from megdiffusion.diffusion import GaussianDiffusion, make_beta_schedule  # noqa: E402
from megdiffusion.diffusion import losses  # noqa: E402
from megdiffusion.diffusion.spacing import space_timesteps  # noqa: E402

REFERENCE = Path(os.environ.get("MEGDIFFUSION_IDDPM_REFERENCE") or Path(__file__).parent / "fixtures" / "iddpm")
DIFFUSION = dict(np.load(REFERENCE / "diffusion.npz"))
IO = dict(np.load(REFERENCE / "io.npz"))
CASES = [str(case) for case in DIFFUSION["cases"]]
SCHEDULE_TOL, DIFFUSION_TOL, UNET_TOL = 1e-12, 1e-4, 5e-5  # the README's: schedules; arrays, temb, grads; UNet
CHECKED = {"diffusion": set(), "io": set()}  # the keys each test compared (or used as inputs)


def ref(key, file="diffusion"):
    """A reference array, recorded as used."""
    CHECKED[file].add(key)
    return (DIFFUSION if file == "diffusion" else IO)[key]


def assert_conforms(got, key, tol=DIFFUSION_TOL, file="diffusion"):
    """``got`` equals the reference ``key`` within ``tol * max(1, max|ref|)``."""
    expected = ref(key, file)
    got = got.numpy() if isinstance(got, mge.Tensor) else np.asarray(got)
    assert got.shape == expected.shape, (key, got.shape, expected.shape)
    error = float(np.abs(got.astype(np.float64) - expected).max()) if expected.size else 0.0
    assert error <= tol * max(1.0, float(np.abs(expected).max())), f"{key}: max error {error:.3g}"


def case_keys(case, prefix=""):
    """The names (after ``<case>.``) of the case's keys that start with ``prefix``."""
    start = f"{case}.{prefix}"
    return [key[len(f"{case}."):] for key in DIFFUSION if key.startswith(start)]


def diffusion_of(case):
    """(the base diffusion, the case's possibly respaced one): improved-diffusion's create_gaussian_diffusion with
    learn_sigma, rescale_timesteps and rescale_learned_sigmas (LEARNED_RANGE, EPSILON, RESCALED_MSE)."""
    schedule, steps = str(ref(f"{case}.schedule")), int(ref(f"{case}.original_num_steps"))
    base = GaussianDiffusion(make_beta_schedule(schedule, steps), var_type="learned_range", loss_type="hybrid",
                             rescale_timesteps=True)
    return base, base.respaced(respacing=str(ref(f"{case}.respacing")) or None)


class FakeModel:
    """Returns the given outputs (one per call, the last one repeated) whatever its input; records the timesteps."""

    def __init__(self, *outputs):
        self.outputs = [output if isinstance(output, mge.Tensor) else mge.tensor(output) for output in outputs]
        self.seen = []

    def __call__(self, x, t):
        self.seen.append(t.numpy())
        return self.outputs[min(len(self.seen), len(self.outputs)) - 1]


def inputs(case):
    return tuple(mge.tensor(ref(f"{case}.{name}")) for name in ("x_start", "x_t", "t"))


# ---------------------------------------------------------------- schedules and respacing


@pytest.mark.parametrize("case", CASES)
def test_schedule_arrays_and_timestep_map(case):
    base, d = diffusion_of(case)
    assert d.num_timesteps == ref(f"{case}.num_timesteps") and d.original_num_steps == base.num_timesteps
    np.testing.assert_array_equal(d.timestep_map, ref(f"{case}.timestep_map"))
    arrays = [name for name in case_keys(case) if DIFFUSION[f"{case}.{name}"].dtype == np.float64]
    assert {"betas", "alphas_cumprod", "posterior_log_variance_clipped"} <= set(arrays)
    for name in arrays:
        owner, attribute = (base, name[len("base_"):]) if name.startswith("base_") else (d, name)
        assert_conforms(getattr(owner, attribute), f"{case}.{name}", SCHEDULE_TOL)


@pytest.mark.parametrize("key", [key for key in DIFFUSION if key.startswith("space.")])
def test_respacing_maps(key):
    _, steps, spec = key.split(".", 2)
    np.testing.assert_array_equal(space_timesteps(int(steps), spec), ref(key))


def test_likelihood_helpers():
    inputs = {key: mge.tensor(DIFFUSION[key]) for key in DIFFUSION if key.startswith("losses.")}
    for key in inputs:
        CHECKED["diffusion"].add(key)
    kl = losses.normal_kl(*(inputs[f"losses.normal_kl.{n}"] for n in ("mean1", "logvar1", "mean2", "logvar2")))
    assert_conforms(kl, "losses.normal_kl.out")
    dgll = losses.discretized_gaussian_log_likelihood(
        *(inputs[f"losses.dgll.{n}"] for n in ("x", "means", "log_scales")))
    assert_conforms(dgll, "losses.dgll.out")
    assert_conforms(losses.approx_standard_normal_cdf(inputs["losses.approx_cdf.x"]), "losses.approx_cdf.out")


# ---------------------------------------------------------------- the maths with a fixed model output


@pytest.mark.parametrize("case", CASES)
def test_forward_process_posterior_and_prior(case):
    _, d = diffusion_of(case)
    x_start, _, t = inputs(case)
    assert_conforms(d.q_sample(x_start, t, mge.tensor(ref(f"{case}.noise"))), f"{case}.x_t")
    for name, value in zip(("mean", "variance", "log_variance"), d.q_mean_variance(x_start, t)):
        assert_conforms(value, f"{case}.q_{name}")
    posterior = d.q_posterior_mean_variance(x_start, mge.tensor(ref(f"{case}.x_t")), t)
    for name, value in zip(("mean", "variance", "log_variance_clipped"), posterior):
        assert_conforms(value, f"{case}.post_{name}")
    assert_conforms(d.prior_bpd(x_start), f"{case}.prior_bpd")


@pytest.mark.parametrize("clip", ["clip", "noclip"])
@pytest.mark.parametrize("case", CASES)
def test_p_mean_variance_and_vb_terms(case, clip):
    _, d = diffusion_of(case)
    x_start, x_t, t = inputs(case)
    model = FakeModel(ref(f"{case}.model_output"))
    p = d.p_mean_variance(d.run_model(model, x_t, t), x_t, t, clip_denoised=clip == "clip")
    assert_conforms(model.seen[0], f"{case}.model_t")
    for name in case_keys(case, f"pmv_{clip}."):
        assert_conforms(p[name.split(".")[1]], f"{case}.{name}")
    vb = d.vb_terms_bpd(model.outputs[0], x_start, x_t, t, clip_denoised=clip == "clip")
    for name in case_keys(case, f"vb_{clip}."):
        assert_conforms(vb[name.split(".")[1].removesuffix("_bpd")], f"{case}.{name}")


@pytest.mark.parametrize("case", CASES)
def test_training_losses_and_their_gradient(case):
    _, d = diffusion_of(case)
    x_start, _, t = inputs(case)
    output = mge.tensor(ref(f"{case}.model_output"))
    gm = GradManager().attach([output])
    with gm:
        terms = d.training_losses(FakeModel(output), x_start, t, mge.tensor(ref(f"{case}.noise")))
        gm.backward(terms["loss"].sum())
    for name in case_keys(case, "train."):
        term = name.split(".")[1]
        assert_conforms(output.grad if term == "grad_model_output" else terms[term], f"{case}.{name}")


@pytest.mark.parametrize("case", CASES)
def test_one_ancestral_and_one_ddim_step_with_the_recorded_noise(case):
    _, d = diffusion_of(case)
    _, x_t, t = inputs(case)
    model, noise = FakeModel(ref(f"{case}.model_output")), mge.tensor(ref(f"{case}.sample_noise"))
    results = {"p_sample": d.p_sample_step(model, x_t, t, noise=noise),
               "ddim_eta0": d.ddim_step(model, x_t, t, eta=0.0, noise=noise),
               "ddim_eta1": d.ddim_step(model, x_t, t, eta=1.0, noise=noise),
               "ddim_reverse": (d.ddim_reverse_step(model, x_t, t),)}
    for step, (sample, *pred_xstart) in results.items():
        for name in case_keys(case, f"{step}."):
            assert_conforms(sample if name.endswith(".sample") else pred_xstart[0], f"{case}.{name}")


@pytest.mark.parametrize("case", [case for case in CASES if case_keys(case, "bpd.")])
def test_the_bpd_loop(case):
    _, d = diffusion_of(case)
    outputs, noises = ref(f"{case}.bpd.model_output"), ref(f"{case}.bpd.noise")  # in loop order, t = n-1 .. 0
    model, draws = FakeModel(*outputs), iter(noises)
    result = d.calc_bpd_loop(model, mge.tensor(ref(f"{case}.bpd.x_start")), draw_noise=lambda: mge.tensor(next(draws)))
    assert_conforms(np.stack(model.seen), f"{case}.bpd.model_t")
    for name in case_keys(case, "bpd."):
        term = name.split(".")[1]
        if term in result:  # per-t columns are stored in loop order: column k is t = n-1-k
            assert_conforms(result[term][:, ::-1] if result[term].ndim == 2 else result[term], f"{case}.{name}")
