"""The ODE / SDE solvers against diffusers 0.42 and the exact probability-flow ODE, on an analytic model.

The reference set (``tests/fixtures/solvers``, or the directory in ``MEGDIFFUSION_SOLVER_REFERENCE``; its README has
the conventions) drives diffusers' schedulers with the exact denoiser of a Gaussian mixture and records every
model call. Every case and every exact run the files list is checked; a scheduler configuration this file cannot
map to one of our samplers fails its case instead of being skipped. Every tolerance is the set's (``cases.json``,
``exact.json``, and its README's rules: ``tolerance``), scaled by max(1, max|reference|) as its README says.

Where we differ from diffusers, on purpose:
- Euler and Heun start from the VP state x_T = z, i.e. y = z sqrt(1 + sigma_max^2) (diffusers: sigma_max z, which is
  not the marginal at sigma_max); the cases are replayed from diffusers' own x_T, and
  ``test_euler_heun_start_convention`` shows the difference.
- DPM-Solver++ and UniPC on Karras sigmas call the model at the solver's own sigma (diffusers rounds the timestep),
  which also runs on the cosine schedule where diffusers fails (``test_karras_grids_where_diffusers_fails``).
"""
import json
import os
from pathlib import Path

import numpy as np
import pytest

from megengine import Tensor

from megdiffusion.diffusion import GaussianDiffusion, make_beta_schedule, samplers, solvers
from megdiffusion.diffusion.sampler_settings import SamplerSettings

REFERENCE = Path(os.environ.get("MEGDIFFUSION_SOLVER_REFERENCE") or Path(__file__).parent / "fixtures" / "solvers")
CASES = json.loads((REFERENCE / "cases.json").read_text())["cases"]
EXACT = json.loads((REFERENCE / "exact.json").read_text())
ARRAYS = dict(np.load(REFERENCE / "cases.npz"))
EXACT_ARRAYS = dict(np.load(REFERENCE / "exact.npz"))
MEAN_TYPES = {"epsilon": "eps", "v_prediction": "v", "sample": "xstart"}
# The README's rules ("Tolerances and self-check"): float64 code following its conventions meets ``final_f64`` at
# 1e-8; a float32 run's tolerance is max(2e-5, 4 x its gap to float64).
F64_TOL, F32_FLOOR, F32_GAPS = 1e-8, 2e-5, 4
PREDICTION = {"eps": 0, "xstart": 1, "v": 2}  # index into gmm_predict's outputs


def gmm_predict(x_in, abar, means, stds, weights):
    """The exact (eps, x_0, v) predictions of the mixture sum_k w_k N(mu_k, s_k^2 I) at x_t = x_in (float64)."""
    x = np.asarray(x_in, dtype=np.float64).reshape(x_in.shape[0], -1)
    a, b = np.sqrt(abar), np.sqrt(1 - abar)
    var = abar * stds ** 2 + (1 - abar)
    diff = x[:, None, :] - a * means[None]
    logits = np.log(weights) - 0.5 * x.shape[1] * np.log(var) - 0.5 * (diff ** 2).sum(-1) / var
    post = np.exp(logits - logits.max(1, keepdims=True))
    post /= post.sum(1, keepdims=True)
    eps = b * np.einsum("bk,bkd->bd", post / var, diff)
    x0 = post @ means + a * np.einsum("bk,bkd->bd", post * stds ** 2 / var, diff)
    return [u.reshape(x_in.shape) for u in (eps, x0, a * eps - b * x0)]


def solver_settings(scheduler, kwargs):
    """(sampler, order, spacing, lower_order_final, lambda_min_clipped) of a diffusers scheduler configuration;
    AssertionError for one we do not reproduce, so its case fails rather than passing unchecked."""
    spacing = "karras" if kwargs.get("use_karras_sigmas") else kwargs.get("timestep_spacing", "linspace")
    clipped = kwargs.get("lambda_min_clipped")
    clipped = -np.inf if clipped is None else clipped
    lower_order_final = kwargs.get("lower_order_final", True)
    if scheduler == "DPMSolverMultistepScheduler":
        assert kwargs.get("solver_type", "midpoint") == "midpoint" and kwargs.get("final_sigmas_type", "zero") == "zero"
        algorithm, order = kwargs.get("algorithm_type", "dpmsolver++"), kwargs.get("solver_order", 2)
        sampler = {("dpmsolver++", 2): "dpmpp_2m", ("dpmsolver++", 3): "dpmpp_3m",
                   ("sde-dpmsolver++", 2): "dpmpp_2m_sde"}[(algorithm, order)]
        return sampler, None, spacing, lower_order_final, clipped
    if scheduler == "UniPCMultistepScheduler":
        assert kwargs.get("solver_type", "bh2") == "bh2" and lower_order_final and not kwargs.get("disable_corrector")
        return "unipc", kwargs.get("solver_order", 2), spacing, True, -np.inf
    if scheduler in ("EulerDiscreteScheduler", "HeunDiscreteScheduler"):
        return scheduler[:-len("DiscreteScheduler")].lower(), None, spacing, True, -np.inf
    assert scheduler == "DDIMScheduler" and not kwargs.get("clip_sample", True) and kwargs.get("set_alpha_to_one")
    assert kwargs.get("steps_offset", 0) == 0
    return "ddim", None, spacing, True, -np.inf


def tolerance(tol, reference):
    """``tol`` scaled as the set's README says: by max(1, max|reference|)."""
    return tol * max(1.0, float(np.abs(reference).max()))


def float32_tolerance(schedule, prediction_type, *gaps):
    """A float32 run's tolerance on ``schedule`` with ``prediction_type``: the largest the set's cases of that
    schedule and prediction type have (float32 rounding grows with the schedule: cosine + epsilon), and at least
    the README's max(2e-5, 4 x gap) of ``gaps``, the run's own float32 against float64 differences."""
    family = [case["tol"] for case in CASES.values()
              if (case["schedule"], case["prediction_type"]) == (schedule, prediction_type)]
    return max(family + [F32_FLOOR] + [F32_GAPS * gap for gap in gaps])


def diffusion_of(schedule, mean_type="eps"):
    """Our chain whose alphas_cumprod are diffusers' float32 table of ``schedule`` (as float64)."""
    abar = ARRAYS[f"schedule.{schedule}.alphas_cumprod"].astype(np.float64)
    return GaussianDiffusion(1.0 - abar / np.append(1.0, abar[:-1]), mean_type=mean_type)


def gmm(name):
    return [ARRAYS[f"gmm.{name}.{part}"] for part in ("means", "stds", "weights")]


def float64_run(sampler, order, spacing, schedule, gmm_name, steps, y, draw_noise=None, lower_order_final=True,
                lambda_min_clipped=-np.inf):
    """``solvers.solve`` in float64 numpy with the model evaluated at the solver's own sigma."""
    abar = ARRAYS[f"schedule.{schedule}.alphas_cumprod"].astype(np.float64)
    grid = solvers.make_grid(abar, steps, spacing, sampler, lambda_min_clipped)
    mixture = gmm(gmm_name)

    def denoise(i, state):
        level = 1.0 / (1.0 + grid.sigmas[i] ** 2)
        return gmm_predict(state * np.sqrt(level), level, *mixture)[1]

    return solvers.solve(sampler, y, grid.sigmas, denoise, order, draw_noise, lower_order_final=lower_order_final), grid


class RecordingModel:
    """The mixture as a network: the k-th call checks its input and timestep against diffusers' k-th call and
    answers (float32) at that call's alpha_bar, as the reference generator did."""

    def __init__(self, name, mean_type):
        self.prefix, self.case, self.calls = name + ".", CASES[name], 0
        self.prediction = PREDICTION[mean_type]

    def __call__(self, x_in, t):
        k, p = self.calls, self.prefix
        assert k < len(ARRAYS[p + "call_t"]), f"call {k}: diffusers made only {len(ARRAYS[p + 'call_t'])} calls"
        x_in = x_in.numpy()
        expected = ARRAYS[p + "model_in"][k]
        assert np.abs(x_in - expected).max() <= tolerance(self.case["tol_model_in"], expected), \
            f"call {k}: the model input differs"
        # t is held in float32 (README): ours and diffusers' may round to neighbouring float32 values of t <= T - 1
        last_t = len(ARRAYS[f"schedule.{self.case['schedule']}.alphas_cumprod"]) - 1
        np.testing.assert_allclose(t.numpy(), ARRAYS[p + "call_t"][k], rtol=0, atol=2 * np.spacing(np.float32(last_t)),
                                   err_msg=f"call {k}: timestep")
        self.calls += 1
        outputs = gmm_predict(x_in, ARRAYS[p + "call_abar"][k], *gmm(self.case["gmm"]))
        return Tensor(outputs[self.prediction].astype(np.float32))


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_diffusers(name):
    """Our sampler, through ``GaussianDiffusion`` on MegEngine in float32, makes diffusers' model calls (inputs and
    timesteps) and reaches its final sample within the case's tolerance; in float64 it reaches the generator's
    float64 re-implementation within the README's float64 tolerance."""
    case, p = CASES[name], name + "."
    sampler, order, spacing, lower_order_final, clipped = solver_settings(case["scheduler"], case["scheduler_config"])
    mean_type = MEAN_TYPES[case["prediction_type"]]
    diffusion = diffusion_of(case["schedule"], mean_type)
    model = RecordingModel(name, mean_type)
    steps = case["num_inference_steps"]
    x_T = ARRAYS[p + "x_T"]
    top = solvers.make_grid(diffusion.alphas_cumprod, steps, spacing, sampler, clipped).sigmas[0]
    ve_scale = np.sqrt(1.0 + top ** 2)  # y = x_t sqrt(1 + sigma^2) at the first level
    noise = list(ARRAYS.get(p + "noise", []))
    draws = iter(noise)
    if sampler == "ddim":
        chain = diffusion.respaced(steps, spacing=spacing)
        final = samplers.ddim_sample(chain, model, Tensor(x_T), 0.0, False, None, False).numpy()
    else:
        start = x_T.astype(np.float64)
        if sampler in ("euler", "heun"):  # diffusers' state is already y = sigma_max z
            start = start / ve_scale
        final = diffusion.solve(model, Tensor(start.astype(np.float32)), sampler, steps, spacing, order,
                                clip_denoised=False, draw_noise=lambda: Tensor(next(draws)),
                                lambda_min_clipped=clipped, lower_order_final=lower_order_final).numpy()
        assert solvers.calls_per_image(sampler, steps) == case["model_calls"]
    assert model.calls == case["model_calls"]
    reference = ARRAYS[p + "final"]
    assert np.abs(final - reference).max() <= tolerance(case["tol"], reference)
    if case["stochastic"]:
        assert sum(1 for _ in draws) == 1, "noise is drawn at every step but the last"
    if sampler == "ddim":
        return
    draws = iter(noise)
    y = x_T.astype(np.float64)
    if sampler not in ("euler", "heun"):
        y = y * ve_scale
    exact, _ = float64_run(sampler, order, spacing, case["schedule"], case["gmm"], steps, y,
                           lambda: next(draws).astype(np.float64), lower_order_final, clipped)
    reference = ARRAYS[p + "final_f64"]
    assert np.abs(exact - reference).max() <= tolerance(F64_TOL, reference)



def pipeline_start(sampler, z, top):
    """The float64 state y of an exact run's start, from the float32 x_T its pipeline holds (as the set's float64
    runs start): z itself for the VP solvers, float32 z sqrt(1 + sigma_max^2) for Euler and Heun (README)."""
    z = z.astype(np.float32)
    if sampler in ("euler", "heun"):
        return (z * np.float32(np.sqrt(1.0 + top ** 2))).astype(np.float64)
    return z.astype(np.float64) * np.sqrt(1.0 + top ** 2)


EXACT_SOLVERS = sorted((ex, name) for ex in EXACT for name in EXACT[ex]["solvers"])


@pytest.mark.parametrize("ex, name", EXACT_SOLVERS)
def test_exact_ode(ex, name):
    """Against the exact probability-flow ODE solution: our float64 runs have the errors (to x_exact and to the
    jump target D(y_exact(sigma_last), sigma_last)) of the generator's float64 runs of diffusers' algorithm (started,
    like them, from the pipeline's float32 x_T: ``pipeline_start``), so
    they converge at the rates the set reports: within the README's float64 tolerance, or as close as the set's
    float32 run came to its float64 one where a run is that sensitive to rounding (Heun's first step from the cosine
    schedule's sigma_max). DDIM runs through ``GaussianDiffusion`` in float32: its final against diffusers' float32
    final, and so its errors against diffusers' errors, within ``float32_tolerance``. Where diffusers failed,
    ``test_karras_grids_where_diffusers_fails`` runs ours instead."""
    entry, info = EXACT[ex]["solvers"][name], EXACT[ex]
    kwargs = {**entry["extra_kwargs"]}
    sampler, order, spacing, lower_order_final, _ = solver_settings(entry["scheduler"], kwargs)
    if entry.get("failed"):
        assert not entry["runs"]
        return
    z = EXACT_ARRAYS[f"{ex}.z"].astype(np.float64)
    x_exact = EXACT_ARRAYS[f"{ex}.x_exact"]
    for run in entry["runs"]:
        steps = run["steps"]
        target, reference = EXACT_ARRAYS[run["jump_target_key"]], EXACT_ARRAYS[run["final_key"]]
        scale = max(1.0, float(np.abs(reference).max()))  # the float32 run's gaps to float64, scaled as tolerances
        gaps = [abs(run[f"max_err{kind}"] - run[f"max_err{kind}_f64"]) / scale for kind in ("", "_jump")]
        if sampler == "ddim":
            diffusion = diffusion_of(info["schedule"])
            chain = diffusion.respaced(steps, spacing=spacing)
            model = AnalyticModel(info["gmm"], diffusion)
            final = samplers.ddim_sample(chain, model, Tensor(z.astype(np.float32)), 0.0, False, None, False)
            final, err, err_jump = final.numpy(), run["max_err"], run["max_err_jump"]
            tol = tolerance(float32_tolerance(info["schedule"], "epsilon", *gaps), reference)
            assert np.abs(final - reference).max() <= tol, f"{steps} steps"
        else:
            abar = ARRAYS[f"schedule.{info['schedule']}.alphas_cumprod"].astype(np.float64)
            top = solvers.make_grid(abar, steps, spacing, sampler).sigmas[0]
            assert top == pytest.approx(info["sigma_start"], rel=1e-6)
            final, _ = float64_run(sampler, order, spacing, info["schedule"], info["gmm"], steps,
                                   pipeline_start(sampler, z, top), lower_order_final=lower_order_final)
            err, err_jump = run["max_err_f64"], run["max_err_jump_f64"]
            tol = tolerance(max(F64_TOL, *gaps), reference)
        assert abs(np.abs(final - x_exact).max() - err) <= tol, f"{steps} steps"
        assert abs(np.abs(final - target).max() - err_jump) <= tol, f"{steps} steps"


class AnalyticModel:
    """The mixture's eps prediction as a network of a chain with integer timesteps."""

    def __init__(self, gmm_name, diffusion):
        self.mixture, self.abar = gmm(gmm_name), diffusion.alphas_cumprod

    def __call__(self, x_in, t):
        level = self.abar[int(t.numpy()[0])]
        return Tensor(gmm_predict(x_in.numpy(), level, *self.mixture)[0].astype(np.float32))


FAILED_IN_DIFFUSERS = [(ex, name) for ex, name in EXACT_SOLVERS if EXACT[ex]["solvers"][name].get("failed")]


@pytest.mark.parametrize("ex, name", FAILED_IN_DIFFUSERS)
def test_karras_grids_where_diffusers_fails(ex, name):
    """A different convention: diffusers' DPM-Solver and UniPC on Karras sigmas round the model's timestep and fail
    where the top sigmas share one table interval (the cosine schedule); ours call the model at the solver's sigma
    and converge there, at every step count the set uses, to within the Karras grid's own floor (the jump from
    sigma_min to 0) of the exact solution, as the set's Heun on the same grid does."""
    info, entry = EXACT[ex], EXACT[ex]["solvers"][name]
    sampler, order, spacing, _, _ = solver_settings(entry["scheduler"], entry["extra_kwargs"])
    assert spacing == "karras"
    z, x_exact = EXACT_ARRAYS[f"{ex}.z"].astype(np.float64), EXACT_ARRAYS[f"{ex}.x_exact"]
    steps = sorted({run["steps"] for solver in info["solvers"].values() for run in solver["runs"]})
    errors = []
    for n in steps:
        abar = ARRAYS[f"schedule.{info['schedule']}.alphas_cumprod"].astype(np.float64)
        top = solvers.make_grid(abar, n, spacing, sampler).sigmas[0]
        final, _ = float64_run(sampler, order, spacing, info["schedule"], info["gmm"], n, z * np.sqrt(1 + top ** 2))
        errors.append(np.abs(final - x_exact).max())
    heun = [run for run in info["solvers"]["heun_karras"]["runs"] if run["steps"] == steps[-1]]
    assert np.all(np.isfinite(errors)) and errors[-1] < errors[0] / 10
    assert errors[-1] <= 2 * heun[0]["max_err_f64"]


@pytest.mark.parametrize("name", sorted(n for n in CASES if CASES[n]["scheduler"] in ("EulerDiscreteScheduler",
                                                                                       "HeunDiscreteScheduler")))
def test_euler_heun_start_convention(name):
    """A different convention: our Euler and Heun start at the VP state z (y = z sqrt(1 + sigma_max^2), the
    marginal at sigma_max), diffusers' at y = sigma_max z. Replayed from diffusers' x_T scaled to our start, the
    final moves by about the start's relative change 1 / (2 sigma_max^2) times the scale of y (the start's, |z|, or
    the final's), far below what the sampler itself changes."""
    case, p = CASES[name], name + "."
    sampler, order, spacing, _, _ = solver_settings(case["scheduler"], case["scheduler_config"])
    steps, x_T = case["num_inference_steps"], ARRAYS[p + "x_T"].astype(np.float64)  # sigma_max z, float32
    abar = ARRAYS[f"schedule.{case['schedule']}.alphas_cumprod"].astype(np.float64)
    top = solvers.make_grid(abar, steps, spacing, sampler).sigmas[0]
    theirs, _ = float64_run(sampler, order, spacing, case["schedule"], case["gmm"], steps, x_T)
    ours, _ = float64_run(sampler, order, spacing, case["schedule"], case["gmm"], steps,
                          x_T * np.sqrt(1 + top ** 2) / top)
    reference = ARRAYS[p + "final_f64"]
    assert np.abs(theirs - reference).max() <= tolerance(F64_TOL, reference)
    moved = np.abs(ours - theirs).max()
    assert 0 < moved <= 10 * max(np.abs(x_T).max() / top, np.abs(reference).max()) / top ** 2


@pytest.mark.parametrize("sampler", solvers.SOLVERS)
def test_a_learned_variance_is_ignored_and_clipping_is_per_call(sampler):
    """A learned-variance model (twice the channels) samples as the same predictions without the variance half,
    whatever that half says; with clip_denoised every x_0 prediction is clipped, so a model predicting x_0 = 3 gives
    images at 1."""
    betas = make_beta_schedule("linear", 100)

    def make(var_type, variance):
        def model(x, t):
            eps = x * 0.5 + Tensor(np.cos(t.numpy() / 50.0).astype(np.float32)).reshape(-1, 1, 1, 1)
            return eps if variance is None else Tensor(np.concatenate([eps.numpy(), np.full(eps.shape, variance,
                                                                                          np.float32)], axis=1))
        return GaussianDiffusion(betas, var_type=var_type), model

    shape, seeds = (2, 1, 3, 3), [5, 6]
    base_diffusion, base_model = make("fixedlarge", None)
    base = base_diffusion.sample(base_model, shape, sampler, steps=6, seeds=seeds).numpy()
    for variance in (-1.0, 1.0):
        diffusion, model = make("learned_range", variance)
        np.testing.assert_array_equal(diffusion.sample(model, shape, sampler, steps=6, seeds=seeds).numpy(), base)
    x0_model = GaussianDiffusion(betas, mean_type="xstart")
    images = x0_model.sample(lambda x, t: x * 0 + 3.0, shape, sampler, steps=6, seeds=seeds).numpy()
    unclipped = x0_model.solve(lambda x, t: x * 0 + 3.0, Tensor(np.zeros(shape, np.float32)), sampler, 6, "karras",
                               clip_denoised=False, draw_noise=lambda: Tensor(np.zeros(shape, np.float32)))
    np.testing.assert_allclose(images, 1.0)
    np.testing.assert_allclose(unclipped.numpy(), 3.0, rtol=1e-6)


@pytest.mark.parametrize("sampler", solvers.SOLVERS)
@pytest.mark.parametrize("spacing", solvers.INTEGER_SPACINGS)
def test_a_solvers_steps_are_bounded_by_the_models_timesteps(sampler, spacing):
    """Past the bound an integer spacing repeats noise levels (or calls t = 0 or -1, dividing by zero): refused in
    one line that names the most steps; up to it every call is at a distinct level above 0. Euler and Heun on
    linspace call fractional timesteps: any count has distinct levels."""
    diffusion = GaussianDiffusion(make_beta_schedule("linear", 40))
    accepted = [steps for steps in range(3, 90) if _accepts(diffusion, sampler, steps, spacing)]  # dpmpp_3m: >= 3
    most = max(accepted)
    assert accepted == list(range(3, most + 1))
    fractional = sampler in (solvers.EULER, solvers.HEUN) and spacing == "linspace"
    assert most == 89 if fractional else most in (39, 40)
    grid = solvers.make_grid(diffusion.alphas_cumprod, most, spacing, sampler)
    assert np.all(np.diff(grid.sigmas[:-1]) < 0) and np.all(grid.sigmas[:-1] > 0)
    if not fractional:
        with pytest.raises(ValueError, match=f"{sampler} takes at most {most} steps there"):
            SamplerSettings(sampler, most + 1, spacing=spacing).check(diffusion)


def _accepts(diffusion, sampler, steps, spacing):
    try:
        SamplerSettings(sampler, steps, spacing=spacing).check(diffusion)
    except ValueError:
        return False
    return True
