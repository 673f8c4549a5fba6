"""The UNet outside MegEngine (``cpu.numpy_unet``, ``native``, ``group_workers``):
the same outputs, gradients and training steps as MegEngine's autodiff, and bit-identical on any number of
processes."""
import functools
import os
import signal

import numpy as np
import pytest

from megdiffusion.compat import quiet_megengine
from megdiffusion.cpu import numpy_unet, onednn
from megdiffusion.cpu.choice import cpu_engine_enabled, use_cpu_engine
from megdiffusion.nn.layers import timestep_embedding
from megdiffusion.nn.options import NO_CLASS
from megdiffusion.nn.unet import UNet
from megdiffusion.cpu import native
from megdiffusion.training.config import build_diffusion, build_model
from megdiffusion.training.engine import choose_engine
from megdiffusion.cpu.group_workers import GroupWorkers, WorkerError
from megdiffusion.training.trainer import Trainer

mge = quiet_megengine()
from megengine.autodiff import GradManager  # noqa: E402

pytestmark = pytest.mark.skipif(not onednn.available(), reason="the numpy pass needs oneDNN")

UNETS = {
    # The CPU recipe's shape, smaller: three levels, attention at 7 with 2 heads, two blocks per level.
    "recipe": dict(in_channels=1, model_channels=16, channel_mult=(1, 2, 4), num_res_blocks=2,
                   attention_resolutions=(7,), image_size=28, norm_groups=4, num_heads=2),
    # pytorch-ddpm's padding and time embedding, 3 channels, attention at the top.
    "cifar": dict(in_channels=3, model_channels=8, channel_mult=(1, 2), num_res_blocks=1, attention_resolutions=(8,),
                  image_size=8, norm_groups=4, downsample_padding="symmetric", time_embedding="pytorch_ddpm"),
    # improved-diffusion's: AdaGN, heads of fixed width, its time embedding, a learned variance's output channels.
    "iddpm": dict(in_channels=3, out_channels=6, model_channels=8, channel_mult=(1, 2), num_res_blocks=1,
                  attention_resolutions=(4,), image_size=8, norm_groups=4, use_scale_shift_norm=True,
                  num_head_channels=4, time_embedding="iddpm"),
}


def randomised(model, seed=0):
    """Every parameter drawn at random: the near-zero inits would hide a wrong gradient."""
    rng = np.random.default_rng(seed)
    for p in model.parameters():
        p._reset(mge.tensor(rng.standard_normal(p.shape).astype(np.float32) * 0.2))
    return model


def megengine_gradients(params, loss):
    """The gradients of ``loss()`` with respect to ``params`` by MegEngine's autodiff and native kernels, its
    interpreter synchronous: asynchronous, its CPU backward now and then returns wrong gradients (docs/cpu.md)."""
    previous, previous_level = cpu_engine_enabled(), mge.config.async_level
    use_cpu_engine(False)
    mge.config.async_level = 0
    try:
        grad_manager = GradManager().attach(params)
        with grad_manager:
            grad_manager.backward(loss())
        return [p.grad.numpy() for p in params]
    finally:
        use_cpu_engine(previous)
        mge.config.async_level = previous_level


def assert_gradients_close(got, expected):
    scale = max(np.abs(g).max() for g in expected)
    for a, b in zip(got, expected):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.parametrize("name", sorted(UNETS))
def test_the_numpy_pass_is_the_unet_and_its_gradients(name):
    kwargs = UNETS[name]
    mge.random.seed(0)
    model = randomised(UNet(dropout=0.0, **kwargs))
    model.train()
    rng = np.random.default_rng(1)
    size, channels = kwargs["image_size"], kwargs["in_channels"]
    x = rng.standard_normal((3, channels, size, size)).astype(np.float32)
    t = np.array([0, 17, 999], np.int32)
    dout = rng.standard_normal((3, kwargs.get("out_channels", channels), size, size)).astype(np.float32)
    params = list(model.parameters())
    outputs = []

    def loss():
        outputs.append(model(mge.tensor(x), mge.tensor(t)))
        return (outputs[0] * mge.tensor(dout)).sum()

    expected_grads = megengine_gradients(params, loss)
    expected_out = outputs[0].numpy()
    grads = [np.zeros(p.shape, np.float32) for p in params]
    temb_in = timestep_embedding(mge.tensor(t), model.model_channels, model.time_embedding).numpy()
    out, backward = numpy_unet.unet_forward(numpy_unet.describe(model, params), [p.numpy() for p in params], grads,
                                            np.ascontiguousarray(x.transpose(0, 2, 3, 1)), temb_in)
    backward(np.ascontiguousarray(dout.transpose(0, 2, 3, 1)))
    np.testing.assert_allclose(out.transpose(0, 3, 1, 2), expected_out, rtol=1e-4,
                               atol=1e-5 * np.abs(expected_out).max())
    assert_gradients_close(grads, expected_grads)


@pytest.mark.parametrize("loss", [dict(), dict(mean_type="xstart", min_snr_gamma=5.0), dict(mean_type="v"),
                                  dict(input_perturbation=0.1), dict(num_classes=3),
                                  dict(num_classes=3, class_dropout=0.3),
                                  dict(var_type="learned_range", loss_type="hybrid"), dict(var_type="learned"),
                                  dict(mean_type="xprev")],
                         ids=["eps", "xstart-minsnr", "v", "input-perturbation", "class-conditional", "no-class",
                              "learned-range-hybrid", "learned", "xprev"])
def test_native_loss_and_gradients_are_training_losses(tiny_config, loss):
    """NativeStep on a batch of 20 (three groups: a worker process computes some) against the batch mean of
    ``training_losses`` through MegEngine's autodiff, with Min-SNR weights, the x_0, v and x_{t-1} targets, input
    perturbation, class labels and learned variances (the vb term) too: the loss after the network is the
    diffusion's own."""
    cfg = tiny_config(channel_mult=(1, 2), attention_resolutions=(4,), norm_groups=4, num_timesteps=100, **loss)
    mge.random.seed(0)
    model = randomised(build_model(cfg))
    model.train()
    diffusion = build_diffusion(cfg)
    rng = np.random.default_rng(2)
    x0 = rng.uniform(-1, 1, (20, 1, 8, 8)).astype(np.float32)
    t = rng.integers(0, 100, 20).astype(np.int32)
    noise = rng.standard_normal(x0.shape).astype(np.float32)
    perturbation = (np.float32(cfg.input_perturbation) * rng.standard_normal(x0.shape).astype(np.float32)
                    if cfg.input_perturbation else None)
    labels = rng.integers(0, cfg.num_classes, 20).astype(np.int32) if cfg.num_classes else None
    if cfg.class_dropout:  # some labels dropped, as Trainer.step does
        labels[rng.random(20) < cfg.class_dropout] = NO_CLASS
    network = model if labels is None else functools.partial(model, y=mge.tensor(labels))
    params = list(model.parameters())
    losses = []

    def mean_loss():
        losses.append(diffusion.training_losses(network, mge.tensor(x0), mge.tensor(t), mge.tensor(noise),
                                                None if perturbation is None else mge.tensor(perturbation))
                      ["loss"].mean())
        return losses[0]

    expected_grads = megengine_gradients(params, mean_loss)
    step = native.NativeStep(model, diffusion, params)
    flat = np.concatenate([p.numpy().reshape(-1) for p in params])
    loss_value, gradient = step.loss_and_gradients(flat, x0, t, noise, perturbation=perturbation, labels=labels)
    assert loss_value == pytest.approx(float(losses[0].numpy()), rel=1e-5)
    bounds = np.cumsum([0] + [int(np.prod(p.shape)) for p in params])
    assert_gradients_close([gradient[a:b].reshape(p.shape) for a, b, p in zip(bounds, bounds[1:], params)],
                           expected_grads)
    step.workers.close()


def full_state(trainer):
    with trainer.state() as modules:
        state = modules.optimizer.state_dict()["state"]
        arrays = [p.numpy() for p in modules.model.parameters()] + [p.numpy() for p in modules.ema.parameters()]
    return arrays + [state[i][key] for i in sorted(state) for key in ("exp_avg", "exp_avg_sq")]


def batch(seed, n=16):
    return np.random.default_rng(seed).uniform(-1, 1, (n, 1, 8, 8)).astype(np.float32)


@pytest.mark.parametrize("changes", [dict(), dict(input_perturbation=0.1), dict(num_classes=3),
                                     dict(num_classes=3, class_dropout=0.5),
                                     dict(var_type="learned_range", loss_type="hybrid", use_scale_shift_norm=True,
                                          rescale_timesteps=True, num_head_channels=4), dict(mean_type="xprev")],
                         ids=["recipe", "input-perturbation", "class-conditional", "class-dropout", "iddpm", "xprev"])
def test_native_steps_are_megengine_steps(tiny_config, changes):
    """Three Trainer steps of batch 16 on the CPU engine (the numpy pass and update) and on MegEngine's (its
    autodiff and update): the same losses, gradient norms and weights up to float32 rounding, with input
    perturbation, improved-diffusion's network and loss, x_{t-1} prediction and class labels (the class embedding's
    rows learn only from their own labels) too, some of them dropped (the network sees NO_CLASS for about that
    share of them, and the given class for the others)."""
    cfg = tiny_config(batch_size=16, channel_mult=(1, 2), attention_resolutions=(4,), norm_groups=4, lr=1e-3,
                      **changes)
    numpy_run, autodiff = Trainer(cfg, engine="numpy"), Trainer(cfg, engine="megengine")
    seen = []
    native_step = numpy_run.engine.native_step
    native_pass = native_step.loss_and_gradients
    native_step.loss_and_gradients = lambda *args, **kw: (seen.append(args[-1]), native_pass(*args, **kw))[1]
    labels = (np.arange(16) % 2).astype(np.int32) if cfg.num_classes else None  # class 2 is never seen
    if cfg.num_classes:
        unseen = numpy_run.model.class_emb.weight.numpy()[2]
    for k in range(3):
        got, expected = numpy_run.step(batch(k), labels), autodiff.step(batch(k), labels)
        assert got["loss"] == pytest.approx(expected["loss"], rel=1e-5)
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-4)
    for a, b in zip(full_state(numpy_run), full_state(autodiff)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    if cfg.num_classes:
        rows = numpy_run.model.class_emb.weight.numpy()
        np.testing.assert_array_equal(rows[2], unseen)
        assert np.abs(rows[:2] - autodiff.model.class_emb.weight.numpy()[:2]).max() < 1e-5
        seen = np.concatenate(seen)
        dropped = seen == NO_CLASS
        np.testing.assert_array_equal(seen[~dropped], np.tile(labels, 3)[~dropped])
        assert 0.5 - 0.25 < dropped.mean() < 0.5 + 0.25 if cfg.class_dropout else not dropped.any()
    numpy_run.engine.native_step.workers.close()


def test_native_steps_do_not_depend_on_the_number_of_processes(tiny_config, monkeypatch):
    """Three groups of 8 on one, two and three processes, with dropout: the same run, bit for bit."""
    states = []
    for cores in (1, 2, 3):
        monkeypatch.setattr(native, "THREADS", cores)
        trainer = Trainer(tiny_config(batch_size=24, dropout=0.3), engine="numpy")
        for k in range(2):
            trainer.step(batch(k, 24))
        assert len(trainer.engine.native_step.workers.processes) == cores - 1
        states.append(full_state(trainer))
        trainer.engine.native_step.workers.close()
    for other in states[1:]:
        for a, b in zip(states[0], other):
            np.testing.assert_array_equal(a, b)


def test_a_dead_worker_is_one_clear_error(tiny_config, monkeypatch):
    monkeypatch.setattr(native, "THREADS", 2)
    trainer = Trainer(tiny_config(batch_size=16), engine="numpy")
    trainer.step(batch(0))
    [process] = trainer.engine.native_step.workers.processes
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    with pytest.raises(WorkerError, match=rf"pid {process.pid}\) died, exit code -9"):
        trainer.step(batch(1))


def test_an_error_in_a_worker_is_raised_by_the_caller(tiny_config, monkeypatch):
    monkeypatch.setattr(native, "THREADS", 2)
    trainer = Trainer(tiny_config(batch_size=16), engine="numpy")
    step = trainer.engine.native_step
    flat = np.concatenate([p.numpy().reshape(-1) for p in trainer.model.parameters()])
    x_t = batch(0)
    t = np.zeros(16, np.int32)
    step.loss_and_gradients(flat, x_t, t, x_t)
    good = (x_t[:8], np.zeros((8, 32), np.float32), None, 0)
    bad = (x_t[:8], np.zeros((8, 31), np.float32), None, 0)  # a time embedding of the wrong width
    with pytest.raises(WorkerError, match="a training worker process failed: .*ValueError"):
        step.workers.gradients(flat, [good, bad], lambda index, output: (0.0, np.zeros_like(output)))
    assert step.workers.processes == []  # stopped


@pytest.mark.parametrize("change", [dict(var_type="learned_range", loss_type="hybrid"),
                                    dict(use_scale_shift_norm=True), dict(mean_type="xprev")])
def test_the_cpu_engine_trains_every_loss_and_network_and_says_what_it_does_not(tiny_config, change, monkeypatch):
    """Learned variances, AdaGN and x_{t-1} prediction train on the numpy pass; several ranks (MegEngine averages
    their gradients), ``MEGDIFFUSION_NATIVE_STEP=0`` and MegEngine's kernels chosen go to MegEngine's autodiff,
    with the reason where the CPU engine was chosen."""
    previous = cpu_engine_enabled()
    use_cpu_engine(True)
    try:
        cfg = tiny_config(**change)
        assert choose_engine(build_model(cfg), 1) == ("numpy", None)
        engine, why = choose_engine(build_model(cfg), 2)
        assert engine == "megengine" and "averaged across processes" in why
        monkeypatch.setenv(native.ENV_VAR, "0")
        assert choose_engine(build_model(cfg), 1) == ("megengine", f"{native.ENV_VAR}=0")
        use_cpu_engine(False)
        assert choose_engine(build_model(cfg), 1) == ("megengine", None)
    finally:
        use_cpu_engine(previous)


def test_dropout_keeps_each_value_with_probability_one_minus_the_rate_and_scales_it():
    layers = numpy_unet._Layers([], [], np.random.default_rng(0))
    x = np.ones((4, 16, 16, 64), np.float32)
    y, backward = layers.dropout(0.25, x)
    kept = y != 0
    assert abs(kept.mean() - 0.75) < 0.01
    np.testing.assert_allclose(y[kept], 1 / 0.75)
    np.testing.assert_array_equal(backward(2 * x), 2 * y)  # the same mask backward
    assert numpy_unet._Layers([], [], None).dropout(0.25, x)[0] is x  # eval mode: none


def test_dropout_masks_come_from_the_step_seed(tiny_config):
    """With dropout, a native run is deterministic given the seed, and the masks change the gradients."""
    norms = []
    for dropout in (0.3, 0.3, 0.0):
        trainer = Trainer(tiny_config(dropout=dropout), engine="numpy")
        norms.append([trainer.step(batch(k, 8))["grad_norm"] for k in range(2)])
    assert norms[0] == norms[1] and norms[0][0] != norms[2][0] and norms[0][1] != norms[2][1]


def test_eval_calls_keep_their_weight_preparations_only_while_the_weights_stay(tiny_config):
    """``outputs`` at the same weights array reuses the weights' oneDNN layouts (and the workers' copy); another
    array, or a training step in between, makes them afresh: every call equals a pass without preparations."""
    cfg = tiny_config(channel_mult=(1, 2), attention_resolutions=(4,), norm_groups=4)
    model = randomised(build_model(cfg))
    params = list(model.parameters())
    described, shapes = numpy_unet.describe(model, params), [tuple(p.shape) for p in params]
    first = np.concatenate([p.numpy().reshape(-1) for p in params])
    second = first * np.float32(1.1)
    rng = np.random.default_rng(2)
    groups = [(rng.standard_normal((8, 1, 8, 8)).astype(np.float32), rng.standard_normal((8, 32)).astype(np.float32),
               None) for _ in range(2)]

    def expected(flat):
        weights = [flat[a:b].reshape(shape) for a, b, shape in
                   zip(np.cumsum([0] + [int(np.prod(s)) for s in shapes]), np.cumsum([int(np.prod(s)) for s in shapes]),
                       shapes)]
        return [numpy_unet.unet_output(described, weights, *group) for group in groups]

    workers = GroupWorkers(described, shapes, 1)  # the second group runs in the worker
    try:
        training_group = (groups[0][0], groups[0][1], None, 0)
        for flat, train_before in ((first, False), (first, False), (second, False), (first.copy(), False),
                                   (second, True)):
            if train_before:  # the shared weights now hold the step's weights
                workers.gradients(first, [training_group, training_group], lambda i, out: (0.0, out))
            for got, want in zip(workers.outputs(flat, groups), expected(flat)):
                np.testing.assert_array_equal(got, want)
    finally:
        workers.close()


def test_the_numpy_pass_lowers_exactly_what_it_implements_and_names_the_rest(tiny_config):
    """Its allowlist (``numpy_unet.LOWERING``) covers every module, attribute and value of networks with every
    network option, holds nothing they lack, and refuses the rest in one line naming it: an unknown attribute, a
    module class of its own (a subclass too), a value outside what it implements. A refused network trains on
    MegEngine's engine, saying why."""
    built = [build_model(tiny_config(**changes)) for changes in (
        dict(), dict(channel_mult=(1, 2), attention_resolutions=(4,), norm_groups=4, num_heads=2, num_classes=3,
                     downsample_padding="symmetric", time_embedding="pytorch_ddpm"),
        dict(channel_mult=(1, 2), attention_resolutions=(8,), norm_groups=4, use_scale_shift_norm=True,
             num_head_channels=8, var_type="learned_range", rescale_timesteps=True, time_embedding="iddpm"))]
    present = {}
    for model in built:
        numpy_unet.describe(model, list(model.parameters()))  # every option lowers
        for module in model.modules():
            present.setdefault(type(module).__name__, set()).update(vars(module))
    for kind, entry in numpy_unet.LOWERING.items():
        named = entry["reads"] | set(entry.get("ignores", ())) | set(entry.get("supports", {}))
        assert named <= present[kind], f"{kind}: {sorted(named - present[kind])} named but never present"
    model = built[0]
    params = list(model.parameters())
    model.mid_block1.up = True  # improved-diffusion's resblock_updown, say
    with pytest.raises(numpy_unet.NotLowerable, match=r"^ResBlock\.up \(UNet\.mid_block1\) is an attribute"):
        numpy_unet.describe(model, params)
    del model.mid_block1.up
    model.conv_in.groups = 2
    with pytest.raises(numpy_unet.NotLowerable, match=r"^Conv2d\.groups=2 \(UNet\.conv_in\) is not implemented"):
        numpy_unet.describe(model, params)
    model.conv_in.groups = 1

    class GatedResBlock(type(model.mid_block2)):
        pass

    model.mid_block2.__class__ = GatedResBlock
    with pytest.raises(numpy_unet.NotLowerable, match=r"^UNet\.mid_block2 is a GatedResBlock, a module"):
        numpy_unet.describe(model, params)
    previous = cpu_engine_enabled()
    use_cpu_engine(True)
    try:
        engine, why = choose_engine(model, 1)
        assert engine == "megengine" and why.startswith("UNet.mid_block2 is a GatedResBlock")
    finally:
        use_cpu_engine(previous)
