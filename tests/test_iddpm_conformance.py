"""Conformance with openai/improved-diffusion: its own numbers for the diffusion maths (diffusion.npz: schedules,
respacing, posterior, p_mean_variance, vb terms, training losses and gradients, one ancestral and one DDIM step,
the bpd loop) and for a small random-weight improved UNet (unet_small.pt, io.npz: forward pass, intermediates and
one end-to-end respaced training loss with gradients), at the tolerances of the reference README:
``max|a - b| <= tol * max(1, max|ref|)``.

The reference set is ``$MEGDIFFUSION_IDDPM_REFERENCE`` or tests/fixtures/iddpm. The tests iterate over the cases
and keys its files list, and the last test checks that every key of both files was compared by one of them.
"""
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megdiffusion.compat import quiet_megengine

mge = quiet_megengine()
from megengine.autodiff import GradManager  # noqa: E402

from megdiffusion import sampling  # noqa: E402
from megdiffusion.diffusion import GaussianDiffusion, make_beta_schedule  # noqa: E402
from megdiffusion.diffusion import losses  # noqa: E402
from megdiffusion.diffusion.spacing import space_timesteps  # noqa: E402
from megdiffusion.formats import convert, names  # noqa: E402
from megdiffusion.cpu import choice  # noqa: E402
from megdiffusion.nn.layers import timestep_embedding  # noqa: E402
from megdiffusion.training.config import build_model  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
REFERENCE = Path(os.environ.get("MEGDIFFUSION_IDDPM_REFERENCE") or Path(__file__).parent / "fixtures" / "iddpm")
DIFFUSION = dict(np.load(REFERENCE / "diffusion.npz"))
IO = dict(np.load(REFERENCE / "io.npz"))
UNET = json.loads((REFERENCE / "unet_small.json").read_text())
# What improved-diffusion's file does not record: create_model's image size and head count.
UNET_FLAGS = {name: UNET["create_model_equivalent"][name] for name in ("image_size", "num_heads")}
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


# ---------------------------------------------------------------- the small improved UNet


@pytest.fixture(scope="module")
def converted():
    """``convert.convert`` of unet_small.pt with its image size and head count: (cfg, weights, mapping)."""
    path = str(REFERENCE / "unet_small.pt")
    cfg, weights, record = convert.convert(path, fmt="improved_diffusion", **UNET_FLAGS)
    assert record["format"] == "improved_diffusion"
    source = convert.read_source(path)
    assert list(source.tensors) == UNET["state_dict_keys"]
    pairs = names.mapping(source.layout, {n: a.shape for n, a in source.tensors.items()},
                            {n: w.shape for n, w in weights.items()}, len(cfg.channel_mult), cfg.num_res_blocks)
    return cfg, weights, dict(pairs)


def network(cfg, weights, train=False):
    model = build_model(cfg)
    model.load_state_dict(weights)
    model.train() if train else model.eval()
    return model


def test_the_file_describes_improved_diffusions_network(converted):
    cfg, weights, _ = converted
    kwargs = UNET["kwargs"]
    assert sum(w.size for w in weights.values()) == UNET["param_count"]
    assert (cfg.model_channels, cfg.channel_mult, cfg.num_res_blocks, cfg.use_scale_shift_norm, cfg.num_heads) == \
        (kwargs["model_channels"], tuple(kwargs["channel_mult"]), kwargs["num_res_blocks"],
         kwargs["use_scale_shift_norm"], kwargs["num_heads"])
    assert cfg.attention_resolutions == tuple(cfg.image_size // ds for ds in kwargs["attention_resolutions"])
    assert cfg.var_type == "learned_range" and kwargs["out_channels"] == 2 * kwargs["in_channels"]
    assert cfg.dropout == kwargs["dropout"] and cfg.rescale_timesteps  # improved-diffusion's defaults
    assert (cfg.time_embedding, cfg.norm_eps, cfg.norm_groups, cfg.downsample_padding) == \
        ("iddpm", 1e-5, 32, "symmetric")


def test_timesteps_the_model_sees():
    steps = int(ref("t_diffusion_steps", "io"))
    d = GaussianDiffusion(make_beta_schedule("cosine", steps), var_type="learned_range", rescale_timesteps=True)
    assert_conforms(d.model_timesteps(ref("t", "io")), "t_model", file="io")


def test_the_forward_pass_and_its_intermediates(converted):
    cfg, weights, _ = converted
    model = network(cfg, weights)
    t = mge.tensor(ref("t_model", "io"))
    assert_conforms(timestep_embedding(t, cfg.model_channels, cfg.time_embedding), "temb", file="io")
    temb = model.embed_time(t)
    assert_conforms(temb, "emb", UNET_TOL, file="io")
    middle, skips = model.encode(mge.tensor(ref("x", "io")), temb)
    assert_conforms(skips[0], "down0", UNET_TOL, file="io")
    assert_conforms(middle, "middle", UNET_TOL, file="io")
    for x, out in (("x", "out"), ("x_lowvar", "out_lowvar")):
        assert_conforms(model(mge.tensor(ref(x, "io")), t), out, UNET_TOL, file="io")


@pytest.mark.parametrize("fast_conv", [True, False], ids=["fast_conv", "native_conv"])
def _scaled_error(model, x, out):
    t = mge.tensor(IO["t_model"])
    return float(np.abs(model(mge.tensor(IO[x]), t).numpy() - IO[out]).max()) / max(1.0, float(np.abs(IO[out]).max()))


@pytest.mark.parametrize("change", [dict(time_embedding="ho"), dict(time_embedding="pytorch_ddpm"),
                                    dict(norm_eps=1e-6), dict(downsample_padding="bottom_right"), dict(num_heads=1),
                                    "qkv_not_per_head"], ids=str)
def test_each_wrong_convention_misses_the_reference(converted, change):
    cfg, weights, theirs_to_ours = converted
    if change == "qkv_not_per_head":  # [all q | all k | all v] instead of [q k v] per head
        source = convert.read_source(str(REFERENCE / "unet_small.pt"))
        weights = dict(weights)
        for theirs, ours in theirs_to_ours.items():
            part = names.qkv_part("improved_diffusion", ours)
            if part is not None:
                fused = source.tensors[theirs]
                weights[ours] = np.split(fused, 3)[part].reshape(weights[ours].shape)
    else:
        cfg = cfg.replace(**change)
    model = network(cfg, weights)
    errors = [_scaled_error(model, x, out) for x, out in (("x", "out"), ("x_lowvar", "out_lowvar"))]
    assert max(errors) > 10 * UNET_TOL, errors


@pytest.mark.parametrize("fast_conv", [True, False], ids=["fast_conv", "native_conv"])
def test_the_end_to_end_respaced_hybrid_loss_and_its_gradients(converted, fast_conv, monkeypatch):
    monkeypatch.setattr(choice, "_setting", fast_conv)
    cfg, weights, theirs_to_ours = converted
    steps, count = int(ref("e2e.steps", "io")), int(ref("e2e.num_timesteps", "io"))
    base = GaussianDiffusion(make_beta_schedule("cosine", steps), var_type="learned_range", loss_type="hybrid",
                             rescale_timesteps=True)
    d = base.respaced(respacing=str(count))
    np.testing.assert_array_equal(d.timestep_map, ref("e2e.timestep_map", "io"))
    model = network(cfg, weights, train=True)
    x_start, t, noise = (mge.tensor(ref(f"e2e.{name}", "io")) for name in ("x_start", "t", "noise"))
    assert_conforms(d.q_sample(x_start, t, noise), "e2e.x_t", file="io")
    assert_conforms(d.model_timesteps(t), "e2e.model_t", file="io")
    params = dict(model.named_parameters())
    gm = GradManager().attach(list(params.values()))
    with gm:
        terms = d.training_losses(model, x_start, t, noise)
        gm.backward(terms["loss"].sum())
    for term in ("mse", "vb", "loss"):
        assert_conforms(terms[term], f"e2e.train.{term}", file="io")
    for key in [key for key in IO if key.startswith("e2e.grad.")]:
        expected_shape = IO[key].shape
        assert_conforms(params[theirs_to_ours[key[len("e2e.grad."):]]].grad.numpy().reshape(expected_shape), key,
                        file="io")
    model.eval()
    x_t = mge.tensor(ref("e2e.x_t", "io"))
    p = d.p_mean_variance(d.run_model(model, x_t, t), x_t, t, clip_denoised=True)
    for key in [key for key in IO if key.startswith("e2e.pmv_clip.")]:
        assert_conforms(p[key.split(".")[-1]], key, file="io")


def test_the_converter_script_writes_a_checkpoint_that_gives_the_reference_outputs(tmp_path):
    out = tmp_path / "unet_small.pkl"
    flags = [f"--{name}={value}" for name, value in UNET_FLAGS.items()]
    result = subprocess.run([sys.executable, "-m", "megdiffusion.scripts.convert", str(REFERENCE / "unet_small.pt"),
                             str(out), "--format=improved_diffusion", *flags], cwd=REPO, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    heads = UNET_FLAGS["num_heads"]
    norm = ", scale-shift norm" if UNET["create_model_equivalent"]["use_scale_shift_norm"] else ""
    assert f"{UNET['param_count']:,} parameters" in result.stdout
    assert result.stdout.rstrip().endswith(f"{heads} attention head{'s' if heads > 1 else ''}{norm}"), result.stdout
    model, diffusion, cfg, _ = sampling.load_model(str(out))
    assert diffusion.learns_variance and cfg.rescale_timesteps and cfg.loss_type == "hybrid"
    got = model(mge.tensor(IO["x"]), mge.tensor(IO["t_model"]))
    error = float(np.abs(got.numpy() - IO["out"]).max())
    assert error <= UNET_TOL * max(1.0, float(np.abs(IO["out"]).max()))


def test_the_megengine_ports_pickle_of_an_improved_diffusion_model_converts_alike(converted, tmp_path):
    # MegEngine/MegDiffusion's tools/convert/iddpm wrote improved-diffusion's state dict with megengine.save, conv
    # biases reshaped to (1, C, 1, 1) and Conv1d (attention) biases to (1, C, 1).
    cfg, weights, _ = converted
    port = {}
    for name, array in convert.read_source(str(REFERENCE / "unet_small.pt")).tensors.items():
        if name.endswith(".bias") and "emb" not in name:
            array = array.reshape((1, -1, 1) if "qkv" in name or "proj" in name else (1, -1, 1, 1))
        port[name] = array
    path = tmp_path / "iddpm_unet_small_converted.pkl"
    path.write_bytes(pickle.dumps(port, protocol=4))
    port_cfg, port_weights, record = convert.convert(str(path), **UNET_FLAGS)
    assert record["format"] == "improved_diffusion" and port_cfg == cfg
    for name, value in weights.items():
        np.testing.assert_array_equal(port_weights[name], value, err_msg=name)


# ---------------------------------------------------------------- every key was compared


def test_every_key_of_the_reference_files_was_compared(request):
    """Runs last: the tests above record the keys they compared (or used as inputs). Skipped unless they all ran."""
    selected = {item.originalname for item in request.session.items if item.module is request.module}
    defined = {name for name in dir(request.module) if name.startswith("test_")}
    if selected != defined:
        pytest.skip("needs every test of this file")
    assert set(DIFFUSION) - {"cases"} - CHECKED["diffusion"] == set()
    assert set(IO) - CHECKED["io"] == set()
