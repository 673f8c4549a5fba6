"""``megdiffusion.load`` and ``scripts.export``: the Python API on checkpoints, exports to diffusers (bit for bit
back through our own import; run by diffusers itself where ``MEGDIFFUSION_TORCH_PYTHON`` names a python with torch
and diffusers), to a ``.mge`` graph (MegEngine Lite and MegEngine's graph loader, sampled with every sampler) and to
ONNX (onnxruntime), each equal to the checkpoint's network to <= 1e-4 relative."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import megdiffusion
from megdiffusion.compat import quiet_megengine
from megdiffusion.diffusion.choices import SAMPLERS
from megdiffusion.formats import ConvertError
from megdiffusion.training import checkpoint
from megdiffusion.training.config import TrainConfig, build_model

mge = quiet_megengine()
REPO = Path(__file__).resolve().parents[1]
RTOL = 1e-4  # the issue's: max |diff| / max |ref|
BASE = dict(image_size=8, image_channels=1, model_channels=8, channel_mult=(1, 2), num_res_blocks=1,
            attention_resolutions=(4,), norm_groups=4, dropout=0.0, num_timesteps=40, sample_steps=4)
# The kinds of model the recipes train, small: the CPU recipe's (cosine, posterior variance), improved-diffusion's
# (learned range, scale-shift, heads, its embedding and padding; T=1000 so that diffusers can describe its rescaled
# timesteps) and a class-conditional one.
CONFIGS = {
    "cpu_recipe": dict(BASE, beta_schedule="cosine", var_type="fixedsmall"),
    "iddpm": dict(BASE, image_channels=3, model_channels=16, num_heads=2,
                  use_scale_shift_norm=True, time_embedding="iddpm", downsample_padding="symmetric", norm_eps=1e-5,
                  num_timesteps=1000, beta_schedule="cosine", var_type="learned_range", loss_type="hybrid",
                  rescale_timesteps=True),
    "classes": dict(BASE, num_classes=3),
}


def _weights(cfg, seed):
    """Random weights for ``cfg``'s network, large enough that a wrong layer shows."""
    rng = np.random.default_rng(seed)
    return {name: (rng.standard_normal(value.shape) * 0.2).astype(np.float32)
            for name, value in build_model(cfg).state_dict().items()}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``{name: checkpoint path}`` of each config, raw and EMA weights different, step 7."""
    directory = tmp_path_factory.mktemp("checkpoints")
    paths = {}
    for seed, (name, fields) in enumerate(sorted(CONFIGS.items())):
        cfg = TrainConfig(**fields)
        state = checkpoint.weights_snapshot(cfg, _weights(cfg, seed), {"format": "test"})
        state.update(step=7, model=_weights(cfg, seed + 100))
        paths[name] = directory / f"{name}.pkl"
        checkpoint.save_checkpoint(str(paths[name]), state)
    return paths


def _inputs(model, batch, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, model.image_channels, model.image_size, model.image_size)).astype(np.float32)
    t = rng.integers(0, model.num_timesteps, batch)
    y = rng.integers(-1, model.num_classes, batch) if model.num_classes else None
    return x, t, y


def _relative(got, ref):
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def _run(script, *args):
    return subprocess.run([sys.executable, "-m", f"megdiffusion.scripts.{script}", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


# --- the Python API -----------------------------------------------------------------------------------------

def test_load_says_what_the_model_is_and_calls_the_network_at_integer_timesteps(checkpoints):
    model = megdiffusion.load(checkpoints["iddpm"])
    assert (model.image_size, model.image_channels, model.num_classes, model.num_timesteps, model.beta_schedule,
            model.mean_type, model.var_type, model.out_channels, model.step, model.weights) == \
        (8, 3, 0, 1000, "cosine", "eps", "learned_range", 6, 7, "ema")
    assert repr(model) == ("Model(8x8x3, T=1000 cosine, predicts eps, variance learned_range, step 7, ema weights)")
    x, t, _ = _inputs(model, 3)
    network = build_model(model.config)
    network.load_state_dict(checkpoint.load_checkpoint(str(checkpoints["iddpm"]))["ema"])
    network.eval()
    # rescaled timesteps: the network sees t * 1000 / T, here T = 1000, so t itself as float32
    expected = network(mge.tensor(x), mge.tensor(t.astype(np.float32))).numpy()
    assert np.array_equal(model(x, t), expected)
    assert model(x, 5).shape == (3, 6, 8, 8)  # one timestep for all
    raw = megdiffusion.load(checkpoints["iddpm"], ema=False)
    assert raw.weights == "raw" and _relative(raw(x, t), expected) > 0.1


@pytest.mark.parametrize("call, message", [
    (lambda m, x, t, y: m(x[..., :4], t, y), r"x must be \(N, 1, 8, 8\), got \(3, 1, 8, 4\)"),
    (lambda m, x, t, y: m(x, t + 40, y), r"t must lie in 0..39"),
    (lambda m, x, t, y: m(x, t + 0.5, y), "t must be integers"),
    (lambda m, x, t, y: m(x, t[:2], y), "t must be one integer or 3 of them"),
    (lambda m, x, t, y: m(x, t), "y .* is needed: the model is class-conditional"),
    (lambda m, x, t, y: m(x, t, y + 3), r"y must lie in -1..2"),
])
def test_bad_calls_say_what_is_wrong(checkpoints, call, message):
    model = megdiffusion.load(checkpoints["classes"])
    with pytest.raises(ValueError, match=message):
        call(model, *_inputs(model, 3))


def test_sample_draws_the_images_the_sample_script_writes(checkpoints, tmp_path):
    model = megdiffusion.load(checkpoints["classes"])
    images = model.sample(3, seed=5, sampler="ddim", steps=3, class_label=2)
    result = _run("sample", f"--ckpt={checkpoints['classes']}", f"--output={tmp_path}", "--num_images=3", "--seed=5",
                  "--sampler=ddim", "--steps=3", "--class_label=2")
    assert result.returncode == 0, result.stderr
    assert images.dtype == np.uint8 and images.shape == (3, 8, 8, 1)
    assert np.array_equal(images, megdiffusion.sampling.read_samples(tmp_path, 3))


# --- diffusers ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_diffusers_export_reads_back_bit_for_bit(checkpoints, tmp_path, name):
    model = megdiffusion.load(checkpoints[name])
    model.export(tmp_path / "pipe", "diffusers")
    index = json.loads((tmp_path / "pipe" / "model_index.json").read_text())
    assert index["unet"] == ["diffusers", "UNet2DModel"] and index["scheduler"] == ["diffusers", "DDPMScheduler"]
    back = megdiffusion.load(tmp_path / "pipe")
    ours, theirs = model.state_dict(), back.state_dict()
    assert list(ours) == list(theirs) and all(np.array_equal(ours[k], theirs[k]) for k in ours)
    # At T = 1000 rescaled timesteps are the timesteps themselves: diffusers' config reads back as not rescaled.
    fields = [f for f in checkpoint.NETWORK_FIELDS + checkpoint.GUIDE_FIELDS if f != "rescale_timesteps"]
    assert {f: getattr(back.config, f) for f in fields} == {f: getattr(model.config, f) for f in fields}
    x, t, y = _inputs(model, 2)
    assert np.array_equal(back(x, t, y), model(x, t, y))


@pytest.mark.parametrize("change, missing", [
    (dict(rescale_timesteps=True), "rescaled timesteps at T != 1000"),
    (dict(var_type="learned", image_channels=1), "var_type learned"),
])
def test_networks_diffusers_cannot_describe_are_refused_in_one_line(tmp_path, change, missing):
    cfg = TrainConfig(**{**BASE, **change})
    path = tmp_path / "ckpt.pkl"
    checkpoint.save_checkpoint(str(path), checkpoint.weights_snapshot(cfg, _weights(cfg, 0), {}))
    result = _run("export", path, tmp_path / "pipe", "--to=diffusers")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("error: diffusers cannot describe this network: ") and missing in lines[0]
    assert not (tmp_path / "pipe").exists() and sorted(os.listdir(tmp_path)) == ["ckpt.pkl"]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_diffusers_runs_the_export_as_our_network_and_steps_as_our_sampler(checkpoints, tmp_path, name,
                                                                           diffusers_run):
    model = megdiffusion.load(checkpoints[name])
    model.export(tmp_path / "pipe", "diffusers")
    x, t, y = _inputs(model, 3)
    if model.num_classes:
        y = np.abs(y)  # diffusers' class embedding has no "no class" label
    x_T = np.random.default_rng(1).standard_normal(x.shape).astype(np.float32)
    theirs = diffusers_run(tmp_path / "pipe", x=x, t=t, x_T=x_T, **({"y": y} if y is not None else {}))
    assert _relative(theirs["out"], model(x, t, y)) <= RTOL
    T = model.num_timesteps
    assert list(theirs["timesteps"]) == [T - 1, T - 2]
    labels = {"y": mge.tensor(y, dtype="int32")} if y is not None else {}
    sample = mge.tensor(x_T)
    for step, noise, expected in zip(theirs["timesteps"], theirs["noises"], theirs["samples"]):
        steps = mge.tensor(np.full(len(x_T), step, np.int32))
        network = (lambda n: lambda h, s: n(h, s, **labels))(model.network)
        sample, _ = model.diffusion.p_sample_step(network, sample, steps, noise=mge.tensor(noise))
        assert _relative(sample.numpy(), expected) <= RTOL


# --- the .mge graph -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def graphs(checkpoints, tmp_path_factory):
    """``{name: .mge path}`` of each checkpoint's EMA network, traced at batch 2."""
    directory = tmp_path_factory.mktemp("graphs")
    paths = {}
    for name, path in checkpoints.items():
        paths[name] = directory / f"{name}.mge"
        megdiffusion.load(path).export(paths[name], "mge", batch_size=2)
    return paths


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("batch", [1, 2, 5])
def test_the_mge_through_megengine_lite_equals_the_checkpoint(checkpoints, graphs, name, batch):
    model, deployed = megdiffusion.load(checkpoints[name]), megdiffusion.load(graphs[name])
    assert deployed.deployed and repr(deployed) == repr(model)[:-1] + ", deployed graph)"
    x, t, y = _inputs(model, batch, seed=batch)
    assert _relative(deployed(x, t, y), model(x, t, y)) <= RTOL


def test_the_mge_through_megengines_graph_loader_equals_the_checkpoint(checkpoints, graphs):
    from megengine.utils.comp_graph_tools import GraphInference

    model = megdiffusion.load(checkpoints["classes"])
    x, t, y = _inputs(model, 3)
    out = GraphInference(str(graphs["classes"])).run(
        inp_dict={"x": x, "t": t.astype(np.float32), "y": y.astype(np.int32)})["out"]
    assert _relative(out, model(x, t, y)) <= RTOL


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_every_sampler_draws_the_checkpoints_images_from_the_mge(checkpoints, graphs, sampler):
    for name in ("iddpm", "classes"):
        model, deployed = megdiffusion.load(checkpoints[name]), megdiffusion.load(graphs[name])
        settings = dict(num_images=3, seed=3, sampler=sampler, steps=4, batch_size=3)
        ours, theirs = model.sample(**settings), deployed.sample(**settings)
        assert np.abs(ours.astype(int) - theirs).max() <= 1, (name, sampler)  # float32 rounding, at most one level


def test_the_sample_script_samples_an_mge(checkpoints, graphs, tmp_path):
    common = ["--num_images=2", "--sampler=ddim", "--steps=3"]
    for source, out in ((checkpoints["cpu_recipe"], "ckpt"), (graphs["cpu_recipe"], "mge")):
        result = _run("sample", f"--ckpt={source}", f"--output={tmp_path / out}", *common)
        assert result.returncode == 0, result.stderr
    read = megdiffusion.sampling.read_samples
    assert np.abs(read(tmp_path / "ckpt", 2).astype(int) - read(tmp_path / "mge", 2)).max() <= 1


def test_exporting_and_sampling_a_class_conditional_graph_print_no_megengine_warnings(checkpoints, tmp_path):
    """MegEngine's graph optimiser warns about the class embedding's gather: advice on our operators, not news."""
    result = _run("export", checkpoints["classes"], tmp_path / "c.mge", "--to=mge")
    assert result.returncode == 0 and result.stderr == "", result.stderr
    result = _run("sample", f"--ckpt={tmp_path / 'c.mge'}", f"--output={tmp_path / 'out'}", "--num_images=2",
                  "--sampler=ddim", "--steps=2", "--class_label=1")
    assert result.returncode == 0 and "WRN" not in result.stderr, result.stderr


def test_noema_exports_the_raw_weights_and_the_graph_says_which(checkpoints, tmp_path):
    result = _run("export", checkpoints["cpu_recipe"], tmp_path / "raw.mge", "--to=mge", "--noema")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"wrote {tmp_path / 'raw.mge'}: a MegEngine graph traced at batch 1")
    deployed, raw = megdiffusion.load(tmp_path / "raw.mge"), megdiffusion.load(checkpoints["cpu_recipe"], ema=False)
    assert deployed.weights == "raw" and deployed.step == 7
    x, t, _ = _inputs(raw, 2)
    assert _relative(deployed(x, t), raw(x, t)) <= RTOL
    megdiffusion.load(checkpoints["cpu_recipe"]).export(tmp_path / "ema.mge", "mge")
    with pytest.raises(megdiffusion.LoadError, match="holds the EMA weights; export the checkpoint again "
                                                     "with --noema"):
        megdiffusion.load(tmp_path / "ema.mge", ema=False)


# --- ONNX -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_onnx_export_through_onnxruntime_equals_the_checkpoint(checkpoints, tmp_path, onnxruntime_out, name):
    model = megdiffusion.load(checkpoints[name])
    result = _run("export", checkpoints[name], tmp_path / "m.onnx", "--to=onnx")
    assert result.returncode == 0, result.stderr
    x, t, y = _inputs(model, 3)
    feeds = {"x": x, "t": model.diffusion.model_timesteps(t).numpy().astype(np.float32)}
    if y is not None:
        feeds["y"] = y.astype(np.int32)
    out = onnxruntime_out(tmp_path / "m.onnx", feeds)
    assert _relative(out, model(x, t, y)) <= RTOL


# --- bad input ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case, args, message", [
    ("no-target", ["{ckpt}", "{tmp}/m.mge"], "error: --to is required: one of diffusers, mge, onnx"),
    ("one-argument", ["{ckpt}", "--to=mge"], "error: expected two arguments, CKPT OUT; got 1"),
    ("missing", ["{tmp}/nope.pkl", "{tmp}/m.mge", "--to=mge"], "error: no checkpoint file at {tmp}/nope.pkl"),
    ("exists", ["{ckpt}", "{tmp}/kept.bin", "--to=onnx"],
     "error: OUT {tmp}/kept.bin exists; give a new path, or --overwrite to replace it"),
    ("directory-exists", ["{ckpt}", "{tmp}/other", "--to=diffusers"],
     "error: OUT {tmp}/other exists; give a new directory, or --overwrite to replace it"),
    ("not-a-pipeline", ["{ckpt}", "{tmp}/other", "--to=diffusers", "--overwrite"],
     "error: OUT {tmp}/other holds files but no model_index.json: not a diffusers pipeline, so --overwrite does not "
     "replace it; give a new directory"),
    ("graph-as-source", ["{mge}", "{tmp}/m.onnx", "--to=onnx"],
     "error: {mge} is already an exported graph; export the checkpoint it came from"),
    ("opset", ["{ckpt}", "{tmp}/m.onnx", "--to=onnx", "--opset=18"], "--opset"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(checkpoints, graphs, tmp_path, case, args, message):
    (tmp_path / "kept.bin").write_bytes(b"kept")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    names = {"ckpt": checkpoints["cpu_recipe"], "mge": graphs["cpu_recipe"], "tmp": tmp_path}
    before = sorted(os.walk(tmp_path))
    result = _run("export", *(arg.format(**names) for arg in args))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert message.format(**names) in lines[0]
    assert sorted(os.walk(tmp_path)) == before and (tmp_path / "kept.bin").read_bytes() == b"kept"


def test_overwrite_replaces_a_pipeline_whole(checkpoints, tmp_path):
    pipe = tmp_path / "pipe"
    megdiffusion.load(checkpoints["cpu_recipe"]).export(pipe, "diffusers")
    (pipe / "stale.txt").write_text("from before")
    result = _run("export", checkpoints["classes"], pipe, "--to=diffusers", "--overwrite")
    assert result.returncode == 0, result.stderr
    assert not (pipe / "stale.txt").exists() and megdiffusion.load(pipe).num_classes == 3
    assert sorted(os.listdir(tmp_path)) == ["pipe"]  # no temporary directory left beside it


def test_a_failed_export_leaves_no_partial_output(checkpoints, tmp_path, monkeypatch):
    import safetensors.numpy

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.numpy, "save_file", fail)
    with pytest.raises(OSError):
        megdiffusion.load(checkpoints["cpu_recipe"]).export(tmp_path / "pipe", "diffusers")
    assert os.listdir(tmp_path) == []
    with pytest.raises(ConvertError, match="opset 12 is not supported"):
        megdiffusion.load(checkpoints["cpu_recipe"]).export(tmp_path / "m.onnx", "onnx", opset=12)
    assert os.listdir(tmp_path) == []
