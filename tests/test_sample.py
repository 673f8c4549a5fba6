"""Sampling many images: determinism, resume, split invariance, EMA vs raw, launched processes, the CLI."""
import dataclasses
import json
import multiprocessing
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

from megdiffusion import sampling
from megdiffusion.sampling import jobs
from megdiffusion.compat import cuda_driver_loadable, quiet_megengine
from megdiffusion.diffusion.solvers import SOLVERS
from megdiffusion.diffusion.generation import Autoguidance, _Guided, generate_images
from megdiffusion.diffusion.sampler_settings import SamplerSettings
from megdiffusion.nn.options import NO_CLASS
from megdiffusion.training import checkpoint as ckpt
from megdiffusion.training import distributed
from megdiffusion.training.trainer import TrainingRun

mge = quiet_megengine()

SHAPE = (1, 8, 8)


@pytest.fixture(scope="module")
def logdir(tmp_path_factory, tiny_config, tiny_images):
    """A tiny trained run: 8x8 gray, T=40, a few steps with a fast EMA so EMA and raw weights differ."""
    logdir = tmp_path_factory.mktemp("run")
    cfg = tiny_config(lr=1e-2, ema_decay=0.5, total_steps=3, logdir=str(logdir))
    TrainingRun(cfg, tiny_images(32), progress=False).run()
    return logdir


def test_an_opened_model_is_the_loaded_one_and_lets_its_checkpoint_go_once_built(logdir):
    """``open_model`` reads the run's config and step without a network; ``build()`` makes the network ``load`` makes
    (the same EMA weights, for the newest checkpoint), and only once: what it read is not kept beside the network."""
    from megdiffusion.sampling.model import open_model

    newest = ckpt.load_file_or_newest(str(logdir))[0]
    opened = open_model(logdir)
    assert opened.step == newest["step"] == 3 and opened.config == ckpt.config_of(newest, str(logdir))
    assert opened.source["file"] == os.path.abspath(ckpt.checkpoint_path(str(logdir), 3))
    built = opened.build().state_dict()
    assert list(built) == list(newest["ema"]) and all(np.array_equal(built[n], newest["ema"][n]) for n in built)
    with pytest.raises(RuntimeError, match="called before"):
        opened.build()


@pytest.fixture(scope="module")
def loaded(logdir):
    model, diffusion, _, _ = sampling.load_model(str(logdir))
    return model, diffusion


def generate(loaded, indices, seed=0, sampler="ddpm", steps=None, batch_size=8):
    model, diffusion = loaded
    return generate_images(model, diffusion, SHAPE, indices, seed, SamplerSettings(sampler, steps), batch_size)


def test_same_seed_same_bytes_other_seed_other_images(loaded):
    a = generate(loaded, range(8))
    np.testing.assert_array_equal(a, generate(loaded, range(8)))
    assert not np.array_equal(a, generate(loaded, range(8), seed=1))
    assert len({a[i].tobytes() for i in range(8)}) == 8  # every image has its own noise


def test_split_runs_equal_one_run(loaded):
    whole = generate(loaded, range(16), sampler="ddim", steps=5)
    parts = np.concatenate([generate(loaded, range(0, 8), sampler="ddim", steps=5),
                            generate(loaded, range(8, 16), sampler="ddim", steps=5)])
    np.testing.assert_array_equal(whole, parts)


def test_ema_and_raw_weights_differ(logdir):
    ema_model, diffusion, _, _ = sampling.load_model(str(logdir), ema=True)
    raw_model, _, _, _ = sampling.load_model(str(logdir), ema=False)
    ema = generate_images(ema_model, diffusion, SHAPE, range(4), 0, SamplerSettings("ddim", 5))
    raw = generate_images(raw_model, diffusion, SHAPE, range(4), 0, SamplerSettings("ddim", 5))
    assert not np.array_equal(ema, raw)


def test_autoguidance_samples_the_guide_plus_weight_times_the_difference(logdir):
    """Guided by the raw weights with w = 2.5, the images are those of a model that returns bad + 2.5 (good - bad),
    computed here by MegEngine's own modules (the fast path runs neither network there), and not the unguided ones."""
    good, diffusion, _, _ = sampling.load_model(str(logdir), ema=True)
    bad = sampling.load_model(str(logdir), ema=False)[0]
    guided = generate_images(good, diffusion, SHAPE, range(6), 0,
                             SamplerSettings("ddpm", 5), guidance=Autoguidance(bad, 2.5))
    by_hand = generate_images(lambda x, t: bad(x, t) + 2.5 * (good(x, t) - bad(x, t)), diffusion, SHAPE, range(6), 0,
                              SamplerSettings("ddpm", 5))
    assert np.abs(guided.astype(int) - by_hand).max() <= 1  # float rounding of the two networks' arithmetic
    unguided = generate_images(good, diffusion, SHAPE, range(6), 0, SamplerSettings("ddpm", 5))
    assert np.abs(guided.astype(int) - unguided).mean() > 2


def test_autoguidance_guides_the_prediction_and_keeps_the_good_models_variance():
    def constant(prediction, variance):
        return lambda x, t: mge.tensor(np.array([prediction, variance], np.float32).reshape(1, 2, 1, 1))

    out = _Guided(constant(3.0, 0.5), constant(1.0, -0.5), 2.0, channels=1)(None, None).numpy()
    np.testing.assert_allclose(out.reshape(2), [1.0 + 2.0 * (3.0 - 1.0), 0.5])


@pytest.fixture(scope="module")
def conditional_logdir(tmp_path_factory, tiny_config, tiny_images):
    """A tiny class-conditional run (3 classes) on an npz of labelled images."""
    root = tmp_path_factory.mktemp("conditional")
    np.savez(root / "data.npz", arr_0=tiny_images(32), arr_1=np.arange(32) % 3)
    cfg = tiny_config(lr=1e-2, ema_decay=0.5, total_steps=3, logdir=str(root / "run"), dataset="npz",
                      data_path=str(root / "data.npz"), num_classes=3)
    TrainingRun(cfg, tiny_images(32), progress=False).run()
    return root / "run"


def test_a_class_conditional_models_image_i_is_of_class_i_mod_num_classes(conditional_logdir):
    """Image i is the image i of the model called with class i mod 3 (each class computed here by MegEngine's own
    modules; the product's call runs on the numpy pass), in any batch; guided, both networks get the labels."""
    from megdiffusion.compat import assign_

    good, diffusion, _, _ = sampling.load_model(str(conditional_logdir), ema=True)
    bad = sampling.load_model(str(conditional_logdir), ema=False)[0]
    for model, seed in ((good, 1), (bad, 2)):  # classes far apart, so that a wrong label shows
        assign_(model.class_emb.weight, mge.tensor(np.random.default_rng(seed).normal(0, 3, (3, 128)), "float32"))

    def of_class(c, guided=False):
        def network(x, t):
            y = mge.tensor(np.full(len(x), c, np.int32))
            return bad(x, t, y) + 2.5 * (good(x, t, y) - bad(x, t, y)) if guided else good(x, t, y)

        return generate_images(network, diffusion, SHAPE, range(6), 0, SamplerSettings("ddpm", 5), batch_size=6)

    images = generate_images(good, diffusion, SHAPE, range(6), 0, SamplerSettings("ddpm", 5), batch_size=4)
    guided = generate_images(good, diffusion, SHAPE, range(6), 0, SamplerSettings("ddpm", 5), batch_size=4,
                             guidance=Autoguidance(bad, 2.5))
    for got, is_guided in ((images, False), (guided, True)):
        by_class = [of_class(c, is_guided) for c in range(3)]
        expected = np.stack([by_class[i % 3][i] for i in range(6)])
        assert np.abs(got.astype(int) - expected).max() <= 1  # float rounding of the two paths
        assert np.abs(by_class[0].astype(int) - by_class[1]).mean() > 2
    one_class = generate_images(good, diffusion, SHAPE, range(6), 0,
                                SamplerSettings("ddpm", 5), batch_size=4, class_label=2)
    assert np.abs(one_class.astype(int) - of_class(2)).max() <= 1


def test_an_unconditional_guide_predicts_without_a_class(conditional_logdir):
    """Autoguidance(unconditional=True): image i is guide(NO_CLASS) + 2.5 (model(class i mod 3) - guide(NO_CLASS)),
    computed here by MegEngine's own modules, with an earlier model as the guide and with the model itself
    (classifier-free guidance); not the images of a guide that sees the class."""
    from megdiffusion.compat import assign_

    good, diffusion, _, _ = sampling.load_model(str(conditional_logdir), ema=True)
    bad = sampling.load_model(str(conditional_logdir), ema=False)[0]
    for model, seed in ((good, 1), (bad, 2)):  # classes far apart, so that a wrong label shows
        assign_(model.class_emb.weight, mge.tensor(np.random.default_rng(seed).normal(0, 3, (3, 128)), "float32"))

    def of_class(c, guide):
        def network(x, t):
            y, none = mge.tensor(np.full(len(x), c, np.int32)), mge.tensor(np.full(len(x), NO_CLASS, np.int32))
            return guide(x, t, none) + 2.5 * (good(x, t, y) - guide(x, t, none))

        return generate_images(network, diffusion, SHAPE, range(6), 0, SamplerSettings("ddpm", 5), batch_size=6)

    for guide in (bad, good):
        got = generate_images(good, diffusion, SHAPE, range(6), 0, SamplerSettings("ddpm", 5), batch_size=4,
                              guidance=Autoguidance(guide, 2.5, unconditional=True))
        by_class = [of_class(c, guide) for c in range(3)]
        assert np.abs(got.astype(int) - np.stack([by_class[i % 3][i] for i in range(6)])).max() <= 1
    seeing_the_class = generate_images(good, diffusion, SHAPE, range(6), 0,
                                       SamplerSettings("ddpm", 5), guidance=Autoguidance(bad, 2.5))
    unconditional_guide = generate_images(good, diffusion, SHAPE, range(6), 0, SamplerSettings("ddpm", 5),
                                          guidance=Autoguidance(bad, 2.5, unconditional=True))
    assert np.abs(seeing_the_class.astype(int) - unconditional_guide).mean() > 2


def test_class_label_of_the_sample_script(conditional_logdir, tmp_path):
    """--class_label: every image of that class, and a setting of the output directory (refused classes:
    test_bad_input)."""
    job = sampling.SampleJob(str(conditional_logdir), str(tmp_path / "c1"), 3, settings=SamplerSettings("ddim", 3),
                             progress=False, class_label=1)
    sampling.run_job(job)
    assert json.loads((tmp_path / "c1" / "manifest.json").read_text())["class_label"] == 1
    good, diffusion, _, _ = sampling.load_model(str(conditional_logdir))
    np.testing.assert_array_equal(sampling.read_samples(tmp_path / "c1", 3),
                                  generate_images(good, diffusion, SHAPE, range(3), 0,
                                                  SamplerSettings("ddim", 3), class_label=1))
    with pytest.raises(sampling.SamplingError, match="holds images made with other settings .*class_label: 1 -> 2"):
        sampling.run_job(dataclasses.replace(job, class_label=2))


def test_interrupted_run_resumes_to_the_same_images(loaded, tmp_path, monkeypatch):
    model, diffusion = loaded
    args = (model, diffusion, SHAPE)
    sampling.sample_to_directory(*args, tmp_path / "straight", 12, seed=3, batch_size=4, progress=False)

    written = []
    real_save = jobs.save_png

    def save_then_crash(path, image):
        if len(written) == 6:  # mid-way through the second batch
            raise KeyboardInterrupt
        real_save(path, image)
        written.append(path)

    monkeypatch.setattr(jobs, "save_png", save_then_crash)
    with pytest.raises(KeyboardInterrupt):
        sampling.sample_to_directory(*args, tmp_path / "resumed", 12, seed=3, batch_size=4, progress=False)
    monkeypatch.setattr(jobs, "save_png", real_save)
    assert len(sampling.missing_indices(tmp_path / "resumed", 12)) == 6
    assert sampling.sample_to_directory(*args, tmp_path / "resumed", 12, seed=3, batch_size=4,
                                        progress=False) == 6
    np.testing.assert_array_equal(sampling.read_samples(tmp_path / "resumed", 12),
                                  sampling.read_samples(tmp_path / "straight", 12))


def test_a_job_builds_its_network_once_and_writes_what_each_batch_would(loaded, tmp_path, monkeypatch):
    """``sample_to_directory`` builds the sampling network (and so its worker processes) once for all its batches,
    and closes it at the end; its images equal ``generate_images`` called batch by batch."""
    from megdiffusion.cpu import native
    model, diffusion = loaded
    built, closed = [], []
    real_init, real_close = native.NativeModel.__init__, native.NativeModel.close
    monkeypatch.setattr(native.NativeModel, "__init__", lambda self, m: (built.append(1), real_init(self, m))[1])
    monkeypatch.setattr(native.NativeModel, "close", lambda self: (closed.append(1), real_close(self))[1])
    assert sampling.sample_to_directory(model, diffusion, SHAPE, tmp_path, 12, seed=3,
                                        settings=SamplerSettings("ddim", 3), batch_size=4, progress=False) == 12
    assert built == closed == [1] if native.enabled() else built == []
    batches = [generate(loaded, range(i, i + 4), seed=3, sampler="ddim", steps=3) for i in (0, 4, 8)]
    np.testing.assert_array_equal(sampling.read_samples(tmp_path, 12), np.concatenate(batches))


def run_sample(*args):
    return subprocess.run([sys.executable, "-m", "megdiffusion.scripts.sample", *args],
                          capture_output=True, text=True, timeout=300)


def test_cli_writes_pngs_grid_npz_and_refuses_other_settings(logdir, tmp_path):
    out = tmp_path / "out"
    result = run_sample(f"--ckpt={logdir}", f"--output={out}", "--num_images=6", "--batch_size=4",
                        "--sampler=ddim", "--steps=4")
    assert result.returncode == 0, result.stderr
    assert "info: +" not in result.stderr  # MegEngine's CPU banner is filtered out
    images = np.load(out / "samples.npz")["arr_0"]
    assert images.shape == (6, 8, 8, 1) and images.dtype == np.uint8
    np.testing.assert_array_equal(images, sampling.read_samples(out, 6))
    assert (out / "grid.png").is_file()
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    result = run_sample(f"--ckpt={logdir}", f"--output={out}", "--num_images=6", "--sampler=ddim",
                        "--steps=4", "--seed=1")
    assert result.returncode == 2 and "other settings" in result.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.parametrize("case, message", [
    ("missing", "no checkpoint file"),
    ("corrupt", "cannot read checkpoint"),
    ("sampler", "--sampler=euler2: value should be one of <ddpm|ddim|euler|heun|dpmpp_2m|dpmpp_3m|dpmpp_2m_sde|unipc>"),
    ("steps", "between 1 and T=40"),
    ("output_file", "is a file"),
    ("gpus", "--num_gpus 2 needs CUDA GPUs"),
])
def test_cli_bad_input_one_line_exit_2(logdir, tmp_path, case, message):
    good = ckpt.list_checkpoints(str(logdir))[-1]
    corrupt = tmp_path / "ckpt_0000001.pkl"
    corrupt.write_bytes(b"\x80\x04garbage")
    output_file = tmp_path / "taken.txt"
    output_file.write_text("keep me")
    args = {"ckpt": good, "output": str(tmp_path / "out"), "sampler": "ddim", "steps": "4"}
    args.update({"missing": {"ckpt": str(tmp_path / "nope.pkl")}, "corrupt": {"ckpt": str(corrupt)},
                 "sampler": {"sampler": "euler2"}, "steps": {"steps": "41"},
                 "output_file": {"output": str(output_file)}, "gpus": {"num_gpus": "2"}}[case])
    if case == "gpus" and cuda_driver_loadable():
        pytest.skip("a machine with a CUDA driver may have 2 GPUs")
    result = run_sample(*(f"--{k}={v}" for k, v in args.items()), "--num_images=2")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], result.stderr
    assert output_file.read_text() == "keep me"
    assert not os.path.exists(tmp_path / "out")


def job(logdir, output, **changes):
    """4-step DDIM samples of the tiny run, written to ``output`` (``changes``: of the job, or of its sampler
    settings)."""
    names = {field.name for field in dataclasses.fields(SamplerSettings)}
    settings = SamplerSettings(**{"sampler": "ddim", "steps": 4,
                                  **{k: v for k, v in changes.items() if k in names}})
    values = dict(ckpt=str(logdir), output=str(output), num_images=6, settings=settings, batch_size=4, progress=False)
    return sampling.SampleJob(**{**values, **{k: v for k, v in changes.items() if k not in names}})


def test_a_spawned_process_needs_only_the_job(logdir, tmp_path):
    """What a launched sampling process gets: a fresh interpreter (spawn), no parsed flags, the job."""
    here = job(logdir, tmp_path / "here")
    assert sampling.run_job(here) == 3
    process = multiprocessing.get_context("spawn").Process(target=sampling.sample_share,
                                                           args=(job(logdir, tmp_path / "spawned"),))
    process.start()
    process.join(timeout=240)
    assert process.exitcode == 0
    np.testing.assert_array_equal(sampling.read_samples(tmp_path / "spawned", 6), sampling.read_samples(here.output, 6))


def test_two_gpus_go_through_the_spawn_launcher_and_split_the_images(logdir, tmp_path, monkeypatch):
    """``run_job`` with --num_gpus 2, MegEngine's launcher replaced by one that runs both ranks here."""
    launches, start_methods = [], []

    def fake_launcher(func, n_gpus, world_size, rank_start, master_ip, port):
        launches.append((n_gpus, world_size, rank_start))

        def call(*args):
            func_copy, args_copy = pickle.loads(pickle.dumps((func, args)))  # what spawning needs
            for rank in range(n_gpus):
                monkeypatch.setattr(distributed, "rank_and_world", lambda rank=rank: (rank, n_gpus))
                func_copy(*args_copy)

        return call

    monkeypatch.setattr(quiet_megengine().distributed, "launcher", fake_launcher)
    monkeypatch.setattr(multiprocessing, "set_start_method", lambda method, force=False: start_methods.append(method))
    monkeypatch.setattr(distributed, "cuda_available", lambda: True)
    assert sampling.run_job(job(logdir, tmp_path / "two"), num_gpus=2) == 3
    assert launches == [(2, 2, 0)] and start_methods == ["spawn"]
    monkeypatch.undo()
    sampling.run_job(job(logdir, tmp_path / "one"))
    np.testing.assert_array_equal(sampling.read_samples(tmp_path / "two", 6),
                                  sampling.read_samples(tmp_path / "one", 6))


@pytest.mark.gpu
def test_launched_sampling_on_gpus_equals_one_process(logdir, tmp_path):
    gpus = min(2, quiet_megengine().device.get_device_count("gpu"))
    sampling.run_job(job(logdir, tmp_path / "one"))
    launched = job(logdir, tmp_path / "launched")
    if gpus > 1:
        sampling.run_job(launched, num_gpus=gpus)
    else:  # one GPU: still through the launcher, as one spawned process
        os.makedirs(launched.output)
        _, diffusion, _, step = sampling.load_model(launched.ckpt)
        sampling.prepare_output(launched.output, launched.manifest(step, diffusion), diffusion)
        distributed.launch(sampling.sample_share, (launched,), 1, use_launcher=True)
    one, many = (sampling.read_samples(tmp_path / name, 6).astype(int) for name in ("one", "launched"))
    assert np.abs(one - many).max() <= 1  # other processes, maybe other GPUs: rounding may differ


@pytest.mark.parametrize("sampler", SOLVERS)
def test_solvers_image_i_comes_from_seed_and_i_and_guidance_guides_every_call(logdir, sampler):
    """Every solver gives image i from (seed, i) alone (split runs equal one run; the SDE's noise too), and guided
    (on the fast path when it runs) equals the solver on a network computing bad + w (good - bad) with MegEngine's
    own modules."""
    good, diffusion, _, _ = sampling.load_model(str(logdir), ema=True)
    bad = sampling.load_model(str(logdir), ema=False)[0]
    steps = 4
    whole = generate_images(good, diffusion, SHAPE, range(6), 0, SamplerSettings(sampler, steps), batch_size=6)
    parts = [generate_images(good, diffusion, SHAPE, chunk, 0, SamplerSettings(sampler, steps), batch_size=len(chunk))
             for chunk in (range(0, 2), range(2, 6))]
    np.testing.assert_array_equal(whole, np.concatenate(parts))
    guided = generate_images(good, diffusion, SHAPE, range(6), 0, SamplerSettings(sampler, steps),
                             guidance=Autoguidance(bad, 2.5))
    by_hand = generate_images(lambda x, t: bad(x, t) + 2.5 * (good(x, t) - bad(x, t)), diffusion, SHAPE, range(6), 0,
                              SamplerSettings(sampler, steps))
    assert np.abs(guided.astype(int) - by_hand).max() <= 1
    assert np.abs(guided.astype(int) - whole).mean() > 2


def test_a_solver_samples_a_class_conditional_model_per_class(conditional_logdir):
    """unipc on a class-conditional model: image i of class i mod 3 (each image equals the one drawn alone with
    --class_label i mod 3), and other classes give other images."""
    model, diffusion, _, _ = sampling.load_model(str(conditional_logdir))
    mixed = generate_images(model, diffusion, SHAPE, range(3), 0, SamplerSettings("unipc", 4))
    for i in range(3):
        alone = generate_images(model, diffusion, SHAPE, [i], 0, SamplerSettings("unipc", 4), class_label=i)
        np.testing.assert_array_equal(mixed[i], alone[0])
    other = generate_images(model, diffusion, SHAPE, [0], 0, SamplerSettings("unipc", 4), class_label=1)
    assert not np.array_equal(mixed[0], other[0])


def test_nan_samples_are_refused_and_nothing_of_them_is_written(logdir, tmp_path, monkeypatch):
    """A sampler that diverges (here: image 5 made NaN after sampling) is one error naming the images and the likely
    cause; the earlier batch stays on disk, the bad one is not written as white or black PNGs."""
    from megdiffusion.diffusion.gaussian import GaussianDiffusion
    from megdiffusion.diffusion.generation import NonFiniteSamples

    original = GaussianDiffusion.sample

    def diverging(self, model, shape, *args, seeds=None, **kwargs):
        x = original(self, model, shape, *args, seeds=seeds, **kwargs).numpy().copy()
        x[[i for i, seed in enumerate(seeds) if seed & 0xFFFFFFFF == 5]] = np.nan
        return x

    monkeypatch.setattr(GaussianDiffusion, "sample", diverging)
    with pytest.raises(NonFiniteSamples, match=r"1 of images 4\.\.5 came out NaN or infinite \(ddim-4, first: "
                                               r"image 5\): the sampling diverged; try more --steps or another"):
        sampling.run_job(job(logdir, tmp_path / "out"))
    assert sorted(p.name for p in (tmp_path / "out").glob("*.png")) == [f"{i:06d}.png" for i in range(4)]


def test_a_directory_continues_when_its_defaults_are_spelt_out(logdir, tmp_path):
    """The manifest holds resolved settings: unipc's default steps, spacing and order given explicitly are the same
    run, and continue it; the manifest lists every setting, those left at their default too."""
    output = tmp_path / "out"
    sampling.run_job(job(logdir, output, sampler="unipc", steps=None, num_images=2))
    manifest = json.loads((output / "manifest.json").read_text())
    assert (manifest["steps"], manifest["spacing"], manifest["order"], manifest["guidance"]) == (20, "karras", 2, 1.0)
    sampling.run_job(job(logdir, output, sampler="unipc", steps=20, spacing="karras", order=2, num_images=4))
    assert len(list(output.glob("*.png"))) == 4 + 1  # the images and grid.png
    with pytest.raises(sampling.SamplingError, match=r"other settings \(order: 2 -> 3\)"):
        sampling.run_job(job(logdir, output, sampler="unipc", order=3, steps=None, num_images=6))


def test_sampler_settings_are_the_sampler_arguments_of_gaussian_diffusion_sample():
    """``SamplerSettings`` is the one spelling of the sampler's arguments: each field is a keyword of
    ``GaussianDiffusion.sample`` with the same default, so ``arguments()`` passes them all and nothing else."""
    import inspect

    from megdiffusion.diffusion import GaussianDiffusion

    parameters = inspect.signature(GaussianDiffusion.sample).parameters
    for field in dataclasses.fields(SamplerSettings):
        assert parameters[field.name].default == field.default, field.name
    settings = SamplerSettings("unipc", 7, spacing="karras", order=3)
    assert settings.arguments() == dict(sampler="unipc", steps=7, eta=0.0, respacing=None, spacing="karras", order=3)
    assert settings.label() == "unipc3-7 karras"
