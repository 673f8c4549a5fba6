"""Gaussian diffusion: schedules and posterior against closed forms, samplers against numpy reference
loops, per-image seeds, and a small MLP that learns a mixture of 8 Gaussians."""
import math

import numpy as np
import pytest

from megdiffusion.compat import quiet_megengine

mge = quiet_megengine()
import megengine.functional as F  # noqa: E402
import megengine.module as M  # noqa: E402
from megengine.autodiff import GradManager  # noqa: E402
from megengine.optimizer import Adam  # noqa: E402

from megdiffusion.diffusion import GaussianDiffusion, make_beta_schedule  # noqa: E402
from megdiffusion.diffusion.spacing import sampling_timesteps, space_timesteps, timestep_subsequence  # noqa: E402
from megdiffusion.nn.layers import timestep_embedding  # noqa: E402


def tensor(a):
    return mge.Tensor(np.asarray(a, dtype=np.float32))


def alpha_bar(betas):
    """Cumulative product of 1 - beta by an explicit loop (independent of the class)."""
    out, acc = [], 1.0
    for b in betas:
        acc *= 1.0 - b
        out.append(acc)
    return np.array(out)


# ---------------------------------------------------------------- schedules


def test_linear_schedule():
    betas = make_beta_schedule("linear", 1000)
    assert betas.dtype == np.float64 and betas.shape == (1000,)
    assert betas[0] == pytest.approx(1e-4) and betas[-1] == pytest.approx(0.02)
    assert GaussianDiffusion(betas).alphas_cumprod[-1] == pytest.approx(4.04e-5, rel=2e-3)
    short = make_beta_schedule("linear", 250)  # scaled by 1000 / T
    assert short[0] == pytest.approx(4e-4) and short[-1] == pytest.approx(0.08)


def test_cosine_schedule():
    T, s = 100, 0.008
    betas = make_beta_schedule("cosine", T)
    f = lambda t: math.cos((t / T + s) / (1 + s) * math.pi / 2) ** 2  # noqa: E731
    expected = np.array([f(t + 1) / f(0) for t in range(T)])
    uncapped = betas < 0.999
    assert uncapped[:-1].all() and betas[-1] == 0.999  # the last beta hits the cap
    np.testing.assert_allclose(alpha_bar(betas)[:-1], expected[:-1], rtol=1e-10)


@pytest.mark.parametrize("name, T", [("quadratic", 100), ("linear", 20), ("linear", 1)])
def test_bad_schedule_raises(name, T):
    with pytest.raises(ValueError):
        make_beta_schedule(name, T)


def test_bad_diffusion_arguments_raise():
    betas = make_beta_schedule("linear", 100)
    with pytest.raises(ValueError, match="mean_type"):
        GaussianDiffusion(betas, mean_type="velocity")
    with pytest.raises(ValueError, match="var_type"):
        GaussianDiffusion(betas, var_type="learnt")
    with pytest.raises(ValueError, match="between 0 and 1"):
        GaussianDiffusion(np.append(betas, 1.0))
    with pytest.raises(ValueError, match="loss_type 'hybrid' weights the vb term"):
        GaussianDiffusion(betas, var_type="fixedsmall", loss_type="hybrid")
    with pytest.raises(ValueError, match="loss_type"):
        GaussianDiffusion(betas, var_type="learned_range", loss_type="kl")


# ---------------------------------------------------------------- closed forms


def test_posterior_matches_gaussian_conditioning():
    betas = make_beta_schedule("linear", 1000)
    d = GaussianDiffusion(betas)
    ab = alpha_bar(betas)
    for t in (1, 2, 10, 500, 999):
        # x_{t-1} ~ N(sqrt(ab[t-1]) x0, 1 - ab[t-1]);  x_t = sqrt(1 - beta_t) x_{t-1} + sqrt(beta_t) n
        var_prev, var_t = 1 - ab[t - 1], 1 - ab[t]
        cov = math.sqrt(1 - betas[t]) * var_prev
        # E[x_{t-1} | x_t, x0] = sqrt(ab[t-1]) x0 + cov / var_t (x_t - sqrt(ab[t]) x0)
        coef_xt = cov / var_t
        coef_x0 = math.sqrt(ab[t - 1]) - coef_xt * math.sqrt(ab[t])
        assert d.posterior_mean_coef1[t] == pytest.approx(coef_x0, rel=1e-9)
        assert d.posterior_mean_coef2[t] == pytest.approx(coef_xt, rel=1e-9)
        assert d.posterior_variance[t] == pytest.approx(var_prev - cov ** 2 / var_t, rel=1e-7)
        # the paper's eq. 7 for the variance
        assert d.posterior_variance[t] == pytest.approx((1 - ab[t - 1]) / (1 - ab[t]) * betas[t], rel=1e-9)
    assert d.posterior_variance[0] == 0
    assert d.posterior_log_variance_clipped[0] == pytest.approx(math.log(d.posterior_variance[1]))
    np.testing.assert_allclose(d.alphas_cumprod_prev[1:], ab[:-1])
    assert d.alphas_cumprod_prev[0] == 1.0


def test_model_variances():
    betas = make_beta_schedule("linear", 1000)
    large = GaussianDiffusion(betas, var_type="fixedlarge")
    small = GaussianDiffusion(betas, var_type="fixedsmall")
    ab = alpha_bar(betas)
    post1 = (1 - ab[0]) / (1 - ab[1]) * betas[1]
    for t in (1, 7, 999):
        assert large.model_log_variance[t] == pytest.approx(math.log(betas[t]))
        posterior = (1 - ab[t - 1]) / (1 - ab[t]) * betas[t]
        assert small.model_log_variance[t] == pytest.approx(math.log(posterior))
    assert large.model_log_variance[0] == pytest.approx(math.log(post1))  # Ho's code, not log(beta_0)
    assert small.model_log_variance[0] == pytest.approx(math.log(post1))


def test_q_sample_moments():
    d = GaussianDiffusion(make_beta_schedule("linear", 1000))
    n = 20000
    mge.random.seed(0)
    for t in (0, 100, 999):
        x0 = tensor(np.full((n, 1), 0.5))
        xt = d.q_sample(x0, np.full(n, t), mge.random.normal(size=(n, 1))).numpy()
        mean, std = math.sqrt(d.alphas_cumprod[t]) * 0.5, math.sqrt(1 - d.alphas_cumprod[t])
        assert abs(xt.mean() - mean) < 4 * std / math.sqrt(n)
        assert xt.std() == pytest.approx(std, rel=0.03)


def test_eps_xstart_round_trip():
    d = GaussianDiffusion(make_beta_schedule("linear", 1000))
    rng = np.random.default_rng(0)
    x0, eps = tensor(rng.uniform(-1, 1, (4, 3, 2, 2))), tensor(rng.standard_normal((4, 3, 2, 2)))
    t = mge.Tensor([0, 3, 400, 999], dtype="int32")
    xt = d.q_sample(x0, t, eps)
    x0_back = d.predict_xstart_from_eps(xt, t, eps)
    np.testing.assert_allclose(x0_back.numpy(), x0.numpy(), atol=2e-4)
    np.testing.assert_allclose(d.predict_eps_from_xstart(xt, t, x0_back).numpy(), eps.numpy(), atol=2e-4)


def test_v_round_trip():
    """v = sqrt(alpha_bar) eps - sqrt(1 - alpha_bar) x_0 (alpha_bar from an independent product) gives back x_0 at
    every noise level, the noisiest included, and an error in v moves x_0 by at most as much."""
    betas = make_beta_schedule("cosine", 1000)
    d = GaussianDiffusion(betas, mean_type="v")
    rng = np.random.default_rng(1)
    x0, eps = rng.uniform(-1, 1, (4, 3, 2, 2)), rng.standard_normal((4, 3, 2, 2))
    t = np.array([0, 3, 400, 999])
    ab = alpha_bar(betas)[t].reshape(-1, 1, 1, 1)
    v = np.sqrt(ab) * eps - np.sqrt(1 - ab) * x0
    np.testing.assert_allclose(d.v_target(tensor(x0), t, tensor(eps)).numpy(), v, atol=1e-6)
    xt = d.q_sample(tensor(x0), t, tensor(eps))
    np.testing.assert_allclose(d.predict_xstart_from_v(xt, t, tensor(v)).numpy(), x0, atol=1e-5)
    moved = d.predict_xstart_from_v(xt, t, tensor(v + 0.01)).numpy() - d.predict_xstart_from_v(xt, t, tensor(v)).numpy()
    assert np.abs(moved).max() <= 0.01 + 1e-6


def exact_model(d, mean_type, x0, noise):
    """A model that returns the exact target of ``mean_type`` for the x_t made from (x0, noise)."""
    ab = d.alphas_cumprod

    def model(x_t, t):
        t = t.numpy()
        if mean_type == "eps":
            return tensor(noise)
        if mean_type == "xstart":
            return tensor(x0)
        if mean_type == "v":
            return tensor(np.sqrt(ab[t])[:, None] * noise - np.sqrt(1 - ab[t])[:, None] * x0)
        c1 = (np.sqrt(ab[t - 1] if t[0] else 1.0) * d.betas[t] / (1 - ab[t]))[:, None]
        c2 = (np.sqrt(1 - d.betas[t]) * (1 - (ab[t - 1] if t[0] else 1.0)) / (1 - ab[t]))[:, None]
        return tensor(c1 * x0 + c2 * x_t.numpy())

    return model


@pytest.mark.parametrize("t", [0, 5, 300, 999])
def test_mean_types_agree_with_an_exact_model(t):
    betas = make_beta_schedule("linear", 1000)
    rng = np.random.default_rng(t)
    x0, noise = rng.uniform(-1, 1, (8, 2)), rng.standard_normal((8, 2))
    ts = np.full(8, t)
    means, losses = [], []
    for mean_type in ("eps", "xstart", "xprev", "v"):
        d = GaussianDiffusion(betas, mean_type=mean_type)
        model = exact_model(d, mean_type, x0, noise)
        xt = d.q_sample(tensor(x0), ts, tensor(noise))
        p = d.p_mean_variance(d.run_model(model, xt, ts), xt, ts, clip_denoised=False)
        np.testing.assert_allclose(p["pred_xstart"].numpy(), x0, atol=5e-3 if t == 999 else 5e-4)
        means.append(p["mean"].numpy())
        losses.append(d.training_losses(model, tensor(x0), ts, tensor(noise))["loss"].numpy())
    np.testing.assert_allclose(means[1], means[0], atol=5e-4)
    np.testing.assert_allclose(means[2], means[0], atol=5e-4)
    np.testing.assert_allclose(means[3], means[0], atol=5e-4)
    for loss in losses:
        assert loss.shape == (8,) and loss.max() < 1e-8


def test_training_loss_is_per_sample_mse():
    d = GaussianDiffusion(make_beta_schedule("linear", 100))
    rng = np.random.default_rng(0)
    noise = rng.standard_normal((3, 2, 4, 4))
    loss = d.training_losses(lambda x, t: x * 0, tensor(rng.uniform(-1, 1, (3, 2, 4, 4))), None, tensor(noise))["loss"]
    np.testing.assert_allclose(loss.numpy(), (noise ** 2).reshape(3, -1).mean(axis=1), rtol=1e-5)


@pytest.mark.parametrize("mean_type", ["eps", "xstart", "v"])
def test_min_snr_weighting(mean_type):
    """Min-SNR-5: the loss of timestep t is the mse times min(SNR_t, 5) / SNR_t (eps), min(SNR_t, 5) (xstart) or
    min(SNR_t, 5) / (SNR_t + 1) (v: its mse is x_0's times SNR_t + 1), SNR_t = alpha_bar_t / (1 - alpha_bar_t)
    from an independent product; gamma 0 leaves Ho's mse."""
    betas = make_beta_schedule("linear", 1000)
    snr = alpha_bar(betas) / (1.0 - alpha_bar(betas))
    rng = np.random.default_rng(3)
    x0, noise = rng.uniform(-1, 1, (4, 1, 3, 3)), rng.standard_normal((4, 1, 3, 3))
    ts = np.array([0, 150, 400, 999])  # SNR above and below 5
    assert snr[ts[0]] > 5 > snr[ts[-1]]
    plain = GaussianDiffusion(betas, mean_type=mean_type).training_losses(
        lambda x, t: x * 0, tensor(x0), ts, tensor(noise))
    weighted = GaussianDiffusion(betas, mean_type=mean_type, min_snr_gamma=5.0).training_losses(
        lambda x, t: x * 0, tensor(x0), ts, tensor(noise))
    ab = alpha_bar(betas)[ts].reshape(-1, 1, 1, 1)
    target = {"eps": noise, "xstart": x0, "v": np.sqrt(ab) * noise - np.sqrt(1 - ab) * x0}[mean_type]
    mse = (target ** 2).reshape(4, -1).mean(axis=1)
    weight = np.minimum(snr[ts], 5.0) / {"eps": snr[ts], "xstart": 1.0, "v": snr[ts] + 1.0}[mean_type]
    np.testing.assert_allclose(plain["loss"].numpy(), mse, rtol=1e-5)
    np.testing.assert_allclose(weighted["mse"].numpy(), mse, rtol=1e-5)
    np.testing.assert_allclose(weighted["loss"].numpy(), mse * weight, rtol=1e-5)
    with pytest.raises(ValueError, match="min_snr_gamma"):
        GaussianDiffusion(betas, mean_type="xprev", min_snr_gamma=5.0)


@pytest.mark.parametrize("mean_type", ["eps", "v"])
def test_input_perturbation_moves_x_t_and_not_the_target(mean_type):
    """With a perturbation p, the network sees sqrt(alpha_bar) x_0 + sqrt(1 - alpha_bar) (noise + p) (from an
    independent product) while the target is the unperturbed one (the noise, or v of the noise)."""
    betas = make_beta_schedule("cosine", 1000)
    rng = np.random.default_rng(5)
    x0 = rng.uniform(-1, 1, (3, 1, 4, 4))
    noise, p = rng.standard_normal((2, 3, 1, 4, 4))
    ts = np.array([3, 500, 990])
    seen = []

    def model(x, t):
        seen.append(x.numpy())
        return x * 0

    terms = GaussianDiffusion(betas, mean_type=mean_type).training_losses(model, tensor(x0), ts, tensor(noise),
                                                                         tensor(0.1 * p))
    ab = alpha_bar(betas)[ts].reshape(-1, 1, 1, 1)
    np.testing.assert_allclose(seen[0], np.sqrt(ab) * x0 + np.sqrt(1 - ab) * (noise + 0.1 * p), rtol=1e-5, atol=1e-6)
    target = noise if mean_type == "eps" else np.sqrt(ab) * noise - np.sqrt(1 - ab) * x0
    np.testing.assert_allclose(terms["loss"].numpy(), (target ** 2).reshape(3, -1).mean(axis=1), rtol=1e-5)


def test_training_loss_draws_timesteps_in_range():
    d = GaussianDiffusion(make_beta_schedule("linear", 100))
    seen = []
    d.training_losses(lambda x, t: seen.append(t.numpy()) or x, tensor(np.zeros((500, 1))))
    seen = seen[0]
    assert seen.dtype == np.int32 and seen.min() >= 0 and seen.max() <= 99 and len(set(seen)) > 50


def learned_output(rng, shape):
    """A fixed model output for a learned variance: eps, then variance values v in (-1.5, 1.5)."""
    return tensor(np.concatenate([rng.standard_normal(shape), rng.uniform(-1.5, 1.5, shape)], axis=1))


@pytest.mark.parametrize("var_type", ["learned_range", "learned"])
def test_learned_variances(var_type):
    betas = make_beta_schedule("cosine", 100)
    d = GaussianDiffusion(betas, var_type=var_type)
    rng = np.random.default_rng(0)
    output, x_t = learned_output(rng, (3, 2, 2, 2)), tensor(rng.standard_normal((3, 2, 2, 2)))
    t = np.array([0, 1, 99])
    p = d.p_mean_variance(output, x_t, t, clip_denoised=False)
    v = output.numpy()[:, 2:]
    if var_type == "learned":
        expected = v
    else:  # log-domain interpolation between beta_t (v = 1) and the clipped posterior variance (v = -1)
        frac = (v + 1) / 2
        expected = (frac * np.log(betas[t])[:, None, None, None]
                    + (1 - frac) * d.posterior_log_variance_clipped[t][:, None, None, None])
    np.testing.assert_allclose(p["log_variance"].numpy(), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(p["variance"].numpy(), np.exp(expected), rtol=1e-5)
    fixed = GaussianDiffusion(betas).p_mean_variance(output[:, :2], x_t, t, clip_denoised=False)
    np.testing.assert_allclose(p["mean"].numpy(), fixed["mean"].numpy(), atol=1e-6)  # v does not move the mean


def test_hybrid_weights_the_vb_term_by_t_over_1000_and_mse_does_not():
    betas = make_beta_schedule("cosine", 2000)
    rng = np.random.default_rng(1)
    x0 = tensor(np.round(rng.uniform(-1, 1, (4, 2, 3, 3)) * 127.5) / 127.5)
    noise, t = tensor(rng.standard_normal((4, 2, 3, 3))), np.array([0, 5, 900, 1999])
    output = learned_output(rng, (4, 2, 3, 3))
    terms = {loss: GaussianDiffusion(betas, var_type="learned_range", loss_type=loss).training_losses(
        lambda x, ts: output, x0, t, noise) for loss in ("mse", "hybrid")}
    np.testing.assert_allclose(terms["mse"]["mse"].numpy(), terms["hybrid"]["mse"].numpy())
    np.testing.assert_allclose(terms["hybrid"]["vb"].numpy(), 2.0 * terms["mse"]["vb"].numpy(), rtol=1e-6)
    for loss in terms.values():
        np.testing.assert_allclose(loss["loss"].numpy(), (loss["mse"] + loss["vb"]).numpy(), rtol=1e-6)
    eps = output.numpy()[:, :2]
    np.testing.assert_allclose(terms["mse"]["mse"].numpy(), ((eps - noise.numpy()) ** 2).reshape(4, -1).mean(1),
                               rtol=1e-5)
    assert "vb" not in GaussianDiffusion(betas).training_losses(lambda x, ts: output[:, :2], x0, t, noise)


def test_the_bound_of_a_perfect_denoiser_is_the_prior_plus_its_decoder_term():
    # A model that knows x_0 makes every KL term 0 for t > 0 with the true posterior variance (learned: v = the
    # clipped posterior log variance); what remains is the decoder NLL at t = 0 and the prior.
    d = GaussianDiffusion(make_beta_schedule("linear", 50), mean_type="xstart", var_type="learned")
    rng = np.random.default_rng(2)
    x0 = np.round(rng.uniform(-1, 1, (2, 1, 4, 4)) * 127.5).astype(np.float32) / 127.5

    def perfect(x, t):
        log_variance = d.posterior_log_variance_clipped[t.numpy()].astype(np.float32)
        return tensor(np.concatenate([x0, np.broadcast_to(log_variance[:, None, None, None], x0.shape)], axis=1))

    result = d.calc_bpd_loop(perfect, tensor(x0))
    assert np.abs(result["vb"][:, 1:]).max() < 1e-4 and result["vb"].shape == (2, 50)
    np.testing.assert_allclose(result["total_bpd"], result["vb"][:, 0] + result["prior_bpd"], rtol=1e-6)
    sigma = math.exp(0.5 * d.posterior_log_variance_clipped[0])  # the decoder's N(x_0, sigma^2) on bins of 2/255
    erf_mass = math.erf((1 / 255) / (sigma * math.sqrt(2)))
    interior = (np.abs(x0) < 0.999).reshape(2, -1)
    expected = np.where(interior, -math.log2(erf_mass), -math.log2(0.5 * (1 + erf_mass))).mean(axis=1)
    np.testing.assert_allclose(result["vb"][:, 0], expected, rtol=2e-3)  # tanh approximation of the CDF


# ---------------------------------------------------------------- samplers


def test_timestep_subsequence():
    np.testing.assert_array_equal(timestep_subsequence(1000, 50), np.arange(0, 1000, 20))
    np.testing.assert_array_equal(timestep_subsequence(1000, 3), [0, 333, 666])
    np.testing.assert_array_equal(timestep_subsequence(10), np.arange(10))
    for bad in (0, 11, 2.5):
        with pytest.raises(ValueError):
            timestep_subsequence(10, bad)


def test_respacing_specs():
    assert space_timesteps(10, "3") == [0, 4, 9] and space_timesteps(10, "ddim5") == [0, 2, 4, 6, 8]
    assert space_timesteps(10, "1,2") == [0, 5, 9]  # the first section keeps 1, the second its ends
    assert sampling_timesteps(10, steps=3) == [0, 3, 6] and sampling_timesteps(10) == list(range(10))
    for spec, message in (("abc", "respacing must be"), ("0", "respacing must be"), ("11", "cannot keep 11"),
                          ("ddim7", "no integer stride gives exactly 7"), ("3,3,3,3,3,3", "cannot keep 3")):
        with pytest.raises(ValueError, match=message):
            space_timesteps(10, spec)
    with pytest.raises(ValueError, match="not both"):
        sampling_timesteps(10, steps=3, respacing="3")


@pytest.mark.parametrize("sampler", ["ddpm", "ddim"])
def test_a_respaced_learned_variance_chain_feeds_the_model_its_rescaled_original_timesteps(sampler):
    d = GaussianDiffusion(make_beta_schedule("cosine", 400), var_type="learned_range", rescale_timesteps=True)
    seen = []

    def model(x, t):
        seen.append(t.numpy())
        return F.concat([x * 0.1, F.zeros_like(x)], axis=1)

    d.sample(model, (2, 1, 2, 2), sampler=sampler, respacing="5", seeds=[0, 1])
    kept = space_timesteps(400, "5")
    np.testing.assert_array_equal(np.stack(seen), np.repeat(np.array(kept[::-1])[:, None] * 2.5, 2, axis=1))
    assert np.stack(seen).dtype == np.float32


def test_ddim_ignores_the_learned_variance():
    betas = make_beta_schedule("linear", 100)
    learned, fixed = GaussianDiffusion(betas, var_type="learned_range"), GaussianDiffusion(betas)

    def with_variance(x, t):
        return F.concat([toy_model(x, t), F.sin(x * 7)], axis=1)

    a = learned.sample(with_variance, (1, 1, 2, 2), "ddim", steps=10, eta=0.5, seeds=[4]).numpy()
    b = fixed.sample(toy_model, (1, 1, 2, 2), "ddim", steps=10, eta=0.5, seeds=[4]).numpy()
    np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("sampler", ["ddpm", "ddim"])
def test_one_step_returns_the_clipped_prediction_of_x0(sampler):
    d = GaussianDiffusion(make_beta_schedule("linear", 100))
    x = np.random.default_rng(5).standard_normal((2, 1, 2, 2)).astype(np.float32)
    out = d.sample(toy_model, x.shape, sampler=sampler, steps=1, noise=x).numpy()  # timestep 0 alone
    ab = d.alphas_cumprod[0]
    expected = (x - math.sqrt(1 - ab) * toy_model_np(x, 0)) / math.sqrt(ab)
    np.testing.assert_allclose(out, np.clip(expected, -1, 1), atol=1e-5)


def test_respace_keeps_alphas_cumprod():
    d = GaussianDiffusion(make_beta_schedule("linear", 1000))
    ts = timestep_subsequence(1000, 50)
    r = d.respace(ts)
    np.testing.assert_allclose(r.alphas_cumprod, d.alphas_cumprod[ts], rtol=1e-12)
    np.testing.assert_allclose(d.respace(np.arange(1000)).betas, d.betas, rtol=1e-9)


def toy_model(x, t):
    """A fixed pointwise 'eps model' that depends on t (same function in numpy below)."""
    return F.sin(3 * x) * 0.5 + F.expand_dims(t.astype("float32") / 50.0, (1, 2, 3)) * 0.1


def toy_model_np(x, t):
    return np.sin(3 * x) * 0.5 + t / 50.0 * 0.1


def ddpm_reference(betas, x, noises):
    """Ho et al. Algorithm 2, sigma_t^2 = beta_t (fixedlarge for t >= 1), no clipping."""
    ab = alpha_bar(betas)
    for t in range(len(betas) - 1, -1, -1):
        eps = toy_model_np(x, t)
        x = (x - betas[t] / math.sqrt(1 - ab[t]) * eps) / math.sqrt(1 - betas[t])
        if t > 0:
            x = x + math.sqrt(betas[t]) * next(noises)
    return x


def ddim_reference(betas, ts, eta, x, noises):
    """Song et al. eq. 12 with sigma from eq. 16, no clipping."""
    ab = alpha_bar(betas)
    for i in range(len(ts) - 1, -1, -1):
        a, a_prev = ab[ts[i]], ab[ts[i - 1]] if i else 1.0
        eps = toy_model_np(x, ts[i])
        x0 = (x - math.sqrt(1 - a) * eps) / math.sqrt(a)
        sigma = eta * math.sqrt((1 - a_prev) / (1 - a) * (1 - a / a_prev))
        x = math.sqrt(a_prev) * x0 + math.sqrt(1 - a_prev - sigma ** 2) * eps
        if sigma > 0:
            x = x + sigma * next(noises)
    return x


def seeded_noise(seed, shape):
    """The draws a single-image seeded sample makes: x_T first, then one per noisy step."""
    rng = np.random.default_rng(seed)
    while True:
        yield rng.standard_normal(shape, dtype=np.float32)[None].astype(np.float64)


def test_ddpm_matches_algorithm_2():
    betas = make_beta_schedule("linear", 50)
    d = GaussianDiffusion(betas)
    out = d.sample(toy_model, (1, 1, 2, 2), seeds=[7], clip_denoised=False).numpy()
    noises = seeded_noise(7, (1, 2, 2))
    expected = ddpm_reference(betas, next(noises), noises)
    np.testing.assert_allclose(out, np.clip(expected, -1, 1), atol=2e-4)


@pytest.mark.parametrize("eta", [0.0, 0.5, 1.0])
def test_ddim_matches_song_et_al(eta):
    betas = make_beta_schedule("linear", 100)
    d = GaussianDiffusion(betas)
    out = d.sample(toy_model, (1, 1, 2, 2), sampler="ddim", steps=10, eta=eta, seeds=[3],
                   clip_denoised=False).numpy()
    noises = seeded_noise(3, (1, 2, 2))
    expected = ddim_reference(betas, np.arange(0, 100, 10), eta, next(noises), noises)
    np.testing.assert_allclose(out, np.clip(expected, -1, 1), atol=2e-4)


def test_ddim_full_eta1_is_ddpm_with_fixedsmall():
    # With every timestep and eta = 1, DDIM's sigma is the posterior variance: DDPM with fixedsmall.
    betas = make_beta_schedule("linear", 50)
    ddim = GaussianDiffusion(betas).sample(toy_model, (2, 1, 2, 2), "ddim", eta=1.0, seeds=[1, 2]).numpy()
    small = GaussianDiffusion(betas, var_type="fixedsmall")
    ddpm = small.sample(toy_model, (2, 1, 2, 2), seeds=[1, 2]).numpy()
    np.testing.assert_allclose(ddim, ddpm, atol=2e-4)


@pytest.mark.parametrize("sampler, steps", [("ddpm", 5), ("ddim", 5), ("ddpm", None)])
def test_samplers_see_original_timesteps_in_eval_mode(sampler, steps):
    d = GaussianDiffusion(make_beta_schedule("linear", 100))
    seen = []

    class Recorder(M.Module):
        def forward(self, x, t):
            seen.append((int(t.numpy()[0]), self.training))
            return x * 0.1

    model = Recorder()
    model.train()
    out = d.sample(model, (2, 3), sampler=sampler, steps=steps, seeds=[0, 1])
    expected = list(range(99, -1, -1)) if steps is None else [80, 60, 40, 20, 0]
    assert [t for t, _ in seen] == expected
    assert not any(training for _, training in seen) and model.training
    assert out.shape == (2, 3) and out.dtype == np.float32 and np.abs(out.numpy()).max() <= 1


@pytest.mark.parametrize("sampler", ["ddpm", "ddim"])
def test_seeds_make_images_independent_of_the_batch(sampler):
    d = GaussianDiffusion(make_beta_schedule("linear", 100))
    kwargs = dict(sampler=sampler, steps=20, eta=0.5 if sampler == "ddim" else 0.0)
    batch = d.sample(toy_model, (3, 1, 4, 4), seeds=[10, 11, 12], **kwargs).numpy()
    alone = d.sample(toy_model, (1, 1, 4, 4), seeds=[11], **kwargs).numpy()
    again = d.sample(toy_model, (3, 1, 4, 4), seeds=[10, 11, 12], **kwargs).numpy()
    np.testing.assert_array_equal(batch, again)
    np.testing.assert_allclose(batch[1], alone[0], atol=1e-6)
    assert np.abs(batch[0] - batch[1]).max() > 0.1


def test_given_noise_and_global_seed_are_deterministic():
    d = GaussianDiffusion(make_beta_schedule("linear", 100))
    noise = np.random.default_rng(0).standard_normal((2, 1, 2, 2)).astype(np.float32)
    runs = []
    for _ in range(2):
        mge.random.seed(5)
        runs.append(d.sample(toy_model, (2, 1, 2, 2), steps=10, noise=noise).numpy())
    np.testing.assert_array_equal(runs[0], runs[1])


def test_sample_argument_errors():
    d = GaussianDiffusion(make_beta_schedule("linear", 100))
    shape = (2, 1, 2, 2)
    with pytest.raises(ValueError, match="unknown sampler 'bogus'; choose one of ddpm, ddim, euler, heun"):
        d.sample(toy_model, shape, sampler="bogus")
    with pytest.raises(ValueError, match="only used by the ddim sampler"):
        d.sample(toy_model, shape, sampler="dpmpp_2m", eta=0.5)
    with pytest.raises(ValueError, match="unipc has order 2 or 3, not 4"):
        d.sample(toy_model, shape, sampler="unipc", order=4)
    with pytest.raises(ValueError, match="dpmpp_2m has order 2, not 3"):
        d.sample(toy_model, shape, sampler="dpmpp_2m", order=3)
    with pytest.raises(ValueError, match="--order is for the multistep solvers"):
        d.sample(toy_model, shape, sampler="ddim", order=2)
    with pytest.raises(ValueError, match="dpmpp_3m with --spacing karras needs --steps >= 3, got 2"):
        d.sample(toy_model, shape, sampler="dpmpp_3m", steps=2)
    with pytest.raises(ValueError, match="euler with --spacing logsnr needs --steps >= 2, got 1"):
        d.sample(toy_model, shape, sampler="euler", steps=1, spacing="logsnr")
    with pytest.raises(ValueError, match="--spacing must be one of leading, linspace, trailing, got 'karras'"):
        d.sample(toy_model, shape, sampler="ddim", steps=10, spacing="karras")
    with pytest.raises(ValueError, match="--respacing is for ddpm and ddim; heun takes --steps and --spacing"):
        d.sample(toy_model, shape, sampler="heun", respacing="ddim10")
    with pytest.raises(ValueError, match="unknown spacing 'uniform'"):
        d.sample(toy_model, shape, sampler="heun", spacing="uniform")
    with pytest.raises(ValueError, match="mean_type 'xprev' model"):
        GaussianDiffusion(make_beta_schedule("linear", 100), mean_type="xprev").sample(toy_model, shape, "unipc")
    with pytest.raises(ValueError, match="eta"):
        d.sample(toy_model, shape, sampler="ddpm", eta=0.5)
    with pytest.raises(ValueError, match="one per image"):
        d.sample(toy_model, shape, seeds=[1])
    with pytest.raises(ValueError, match="not both"):
        d.sample(toy_model, shape, seeds=[1, 2], noise=np.zeros(shape, np.float32))
    with pytest.raises(ValueError, match="noise has shape"):
        d.sample(toy_model, shape, noise=np.zeros((2, 1, 3, 3), np.float32))


def test_progress_bar(capsys, monkeypatch):
    from megdiffusion import progress

    monkeypatch.setattr(progress, "LINE_SECONDS", 0)  # stderr is no terminal here: a line per report
    d = GaussianDiffusion(make_beta_schedule("linear", 100))
    d.sample(toy_model, (1, 1, 2, 2), steps=10, progress=True)
    assert capsys.readouterr().err.startswith("0/10 it [")  # a bar over the 10 steps


# ---------------------------------------------------------------- learning

RADIUS, STD = 0.9, 0.06  # 8 modes on a circle, 0.69 apart: 3 std = 0.18 covers ~half the ring
MODES = RADIUS * np.stack([np.cos(np.arange(8) * np.pi / 4), np.sin(np.arange(8) * np.pi / 4)], axis=1)


class MLPDenoiser(M.Module):
    """eps model for 2-D points: random Fourier features of x (fixed), the sinusoidal time embedding
    added to each of three SiLU layers."""

    def __init__(self, hidden=128, temb=32, fourier=32, fourier_scale=8.0):
        super().__init__()
        rng = np.random.default_rng(1)
        self.freqs = tensor(rng.standard_normal((2, fourier)) * fourier_scale)
        self.temb = temb
        self.inp = M.Linear(2 + 2 * fourier, hidden)
        self.hidden = [M.Linear(hidden, hidden) for _ in range(2)]
        self.time = M.Linear(temb, 3 * hidden)
        self.out = M.Linear(hidden, 2)

    def forward(self, x, t):
        e = F.split(self.time(timestep_embedding(t, self.temb)), 3, axis=1)
        xf = F.matmul(x, self.freqs)
        h = F.silu(self.inp(F.concat([x, F.sin(xf), F.cos(xf)], axis=1)) + e[0])
        for layer, shift in zip(self.hidden, e[1:]):
            h = F.silu(layer(h) + shift)
        return self.out(h)


def mode_report(samples):
    """Fraction of samples within 3 std of a mode, and the sample count of each mode."""
    dist = np.linalg.norm(samples[:, None] - MODES[None], axis=2)
    near = dist.min(axis=1) < 3 * STD
    return near.mean(), np.bincount(dist.argmin(axis=1)[near], minlength=8)


def test_mlp_learns_a_mixture_of_8_gaussians():
    mge.random.seed(0)
    rng = np.random.default_rng(0)
    d = GaussianDiffusion(make_beta_schedule("linear", 1000))
    model = MLPDenoiser()
    params = list(model.parameters())
    gm = GradManager().attach(params)
    steps, batch, lr = 2000, 256, 6e-3
    opt = Adam(params, lr=lr)
    for step in range(steps):
        x0 = MODES[rng.integers(0, 8, batch)] + STD * rng.standard_normal((batch, 2))
        # t biased toward the small and middle timesteps, where the mixture's structure is decided;
        # uniform t would spend half the batch where x_t is nearly pure noise.
        t = (1000 * rng.random(batch) ** 1.5).astype(np.int32)
        with gm:
            loss = d.training_losses(model, tensor(x0), t, tensor(rng.standard_normal((batch, 2))))["loss"].mean()
            gm.backward(loss)
        opt.step().clear_grad()
        for group in opt.param_groups:
            group["lr"] = lr * (1 - (step + 1) / steps) + 1e-5
        if step % 10 == 0:  # wait for MegEngine now and then: unsynced, this loop peaked at 13 GB RSS
            loss.item()

    data_fraction, _ = mode_report(MODES[rng.integers(0, 8, 2000)] + STD * rng.standard_normal((2000, 2)))
    assert data_fraction > 0.97  # the criterion itself: the data passes it
    ring = rng.uniform(0, 2 * np.pi, 2000)
    ring_fraction, _ = mode_report(RADIUS * np.stack([np.cos(ring), np.sin(ring)], axis=1))
    assert ring_fraction < 0.6  # a model that only learned the circle fails it

    for sampler, sample_steps in (("ddpm", None), ("ddim", 50)):
        samples = d.sample(model, (500, 2), sampler=sampler, steps=sample_steps, seeds=range(500)).numpy()
        fraction, per_mode = mode_report(samples)
        assert fraction >= 0.9, (sampler, fraction, per_mode)
        assert per_mode.min() >= 25, (sampler, fraction, per_mode)  # every mode covered (62.5 expected)
