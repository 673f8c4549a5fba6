"""Trainer.step on tiny configs: learning, clipping, warmup, EMA, guards, determinism."""
import functools

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from megdiffusion.cpu import batch_threads

from megdiffusion.compat import quiet_megengine
from megdiffusion.data.loader import BatchLoader
from megdiffusion.nn.options import NO_CLASS
from megdiffusion.training import checkpoint as ckpt
from megdiffusion.cpu import onednn
from megdiffusion.cpu.flat_update import FlatUpdateError
from megdiffusion.training import distributed
from megdiffusion.training.engine import ENGINES, EngineSource
from megdiffusion.training.trainer import NonFiniteLossError, Trainer, ema_decay_at, warmup_lr

mge = quiet_megengine()
from megengine.autodiff import GradManager  # noqa: E402


def toy_batch(n=8, seed=0):
    """Smooth images (horizontal or vertical ramps): easy to learn, far from white noise."""
    ramp = np.linspace(-1, 1, 8, dtype=np.float32)
    rng = np.random.default_rng(seed)
    images = np.where(rng.random(n)[:, None, None] < 0.5, ramp[None, :, None], ramp[None, None, :])
    return np.broadcast_to(images, (n, 8, 8))[:, None].astype(np.float32).copy()


def params_numpy(module):
    return [p.numpy().copy() for p in module.parameters()]


def ema_numpy(trainer):
    with trainer.state() as state:
        return params_numpy(state.ema)


def adam_state(trainer):
    """Adam's per-parameter state, {index: {"exp_avg", "exp_avg_sq", "step"}}."""
    with trainer.state() as state:
        return state.optimizer.state_dict()["state"]


def state_by_kind(trainer):
    """{"model", "ema", "exp_avg", "exp_avg_sq", "step", "profiles"}: lists of numpy arrays in parameter order (the
    post-hoc EMA profiles' one after the other)."""
    state = adam_state(trainer)
    kinds = {"model": params_numpy(trainer.model), "ema": ema_numpy(trainer)}
    kinds.update({key: [state[i][key] for i in sorted(state)] for key in ("exp_avg", "exp_avg_sq", "step")})
    names = trainer.engine.param_names
    kinds["profiles"] = [weights[name] for weights in trainer.engine.profile_weights() for name in names]
    return kinds


def full_state(trainer):
    """Parameters, EMA weights, Adam's moments and step counts: one list of numpy arrays."""
    return [array for arrays in state_by_kind(trainer).values() for array in arrays]


def fixed_loss(trainer, x0):
    """Mean training loss at fixed timesteps and noise (no randomness), in eval mode."""
    rng = np.random.default_rng(123)
    t = rng.integers(0, trainer.diffusion.num_timesteps, size=len(x0)).astype(np.int32)
    noise = rng.standard_normal(x0.shape, dtype=np.float32)
    trainer.model.eval()
    loss = trainer.diffusion.training_losses(trainer.model, mge.tensor(x0), mge.tensor(t), mge.tensor(noise))["loss"]
    return float(loss.mean())


@pytest.fixture(params=ENGINES)
def engine(request):
    """Run the test on both engines: MegEngine's autodiff and update (as on a GPU), and the CPU engine's numpy pass
    and numpy update (``flat_update``)."""
    if request.param == "numpy" and not onednn.available():
        pytest.skip("the numpy pass needs oneDNN")
    return request.param


def applied_step(trainer, x0):
    """Step ``trainer`` on ``x0``: its metrics, the learning rate the step applied, and the norm of the gradient
    it applied (its first step only), read back from the parameters and Adam's state."""
    before = params_numpy(trainer.model)
    metrics = trainer.step(x0)
    state = adam_state(trainer)
    k = float(state[0]["step"])
    exp_avg = [state[i]["exp_avg"].astype(np.float64) for i in range(len(before))]
    exp_avg_sq = [state[i]["exp_avg_sq"].astype(np.float64) for i in range(len(before))]
    ratios = []
    for old, new, m, v in zip(before, params_numpy(trainer.model), exp_avg, exp_avg_sq):
        delta = (m / (1 - 0.9 ** k)) / (np.sqrt(v / (1 - 0.999 ** k)) + 1e-8)
        ratios.append(((old - new) / delta)[np.abs(delta) > 0.5])
    grad_norm = np.sqrt(sum((m ** 2).sum() for m in exp_avg)) / (1 - 0.9) if k == 1 else None
    return metrics, float(np.median(np.concatenate(ratios))), grad_norm


def test_a_two_level_unet_learns_and_runs_after_its_steps(tiny_config, synchronous):
    """The UNet train-step test: Trainer steps (loss, backward, clipping, Adam, EMA) on a UNet with a
    downsample, an upsample and attention learn smooth images. The first ones run with shape inference
    checked eagerly: MegEngine 1.9 failed the forward after such a step (``compat.upsample_nearest_2x``)."""
    trainer = Trainer(tiny_config(channel_mult=(1, 2), attention_resolutions=(4,), num_timesteps=100, lr=2e-3))
    x0 = toy_batch(16)
    before = fixed_loss(trainer, x0)
    with synchronous():
        trainer.step(toy_batch(8, seed=0))
        trainer.step(toy_batch(8, seed=1))
    for k in range(2, 40):
        trainer.step(toy_batch(8, seed=k))
    after = fixed_loss(trainer, x0)
    assert after < 0.5 * before, (before, after)


def test_tiny_clip_bounds_the_applied_gradient_norm(tiny_config, engine):
    metrics, _, applied_norm = applied_step(Trainer(tiny_config(grad_clip=1e-3), engine=engine), toy_batch())
    assert metrics["grad_norm"] > 100 * 1e-3  # the logged norm is the one before clipping
    assert applied_norm == pytest.approx(1e-3, rel=1e-4)


def test_clip_zero_leaves_gradients_alone(tiny_config, engine):
    metrics, _, applied_norm = applied_step(Trainer(tiny_config(grad_clip=0.0), engine=engine), toy_batch())
    assert applied_norm == pytest.approx(metrics["grad_norm"], rel=1e-5)
    assert metrics["grad_norm"] > 1e-2


def test_warmup_learning_rates(tiny_config, engine):
    cfg = tiny_config(lr=1e-3, warmup_steps=4)
    assert [warmup_lr(cfg, k) for k in range(6)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
    assert warmup_lr(tiny_config(lr=1e-3, warmup_steps=0), 0) == 1e-3
    trainer = Trainer(cfg, engine=engine)
    steps = [applied_step(trainer, toy_batch(seed=k)) for k in range(5)]
    logged = [metrics["lr"] for metrics, _, _ in steps]
    assert logged == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])
    assert [lr for _, lr, _ in steps] == pytest.approx(logged, rel=1e-3)  # the optimizer really used them


def test_ema_warmup_decays(tiny_config):
    cfg = tiny_config(ema_decay=0.9, ema_warmup=True)
    # (1 + n) / (10 + n) until it reaches --ema_decay: 0.9 from n = 80 on.
    assert [ema_decay_at(cfg, n) for n in (0, 1, 2, 8, 79, 80, 81, 10 ** 6)] == pytest.approx(
        [0.1, 2 / 11, 0.25, 0.5, 80 / 89, 0.9, 0.9, 0.9])
    assert [ema_decay_at(cfg.replace(ema_warmup=False), n) for n in (0, 1, 80)] == [0.9, 0.9, 0.9]


@pytest.mark.parametrize("warmup", [False, True])
def test_ema_matches_closed_form(tiny_config, engine, warmup):
    decay, steps = 0.9, 4
    trainer = Trainer(tiny_config(ema_decay=decay, ema_warmup=warmup), engine=engine)
    history = [params_numpy(trainer.model)]
    for k in range(steps):
        trainer.step(toy_batch(seed=k))
        history.append(params_numpy(trainer.model))
    # ema_k = d_{k-1} ema_{k-1} + (1 - d_{k-1}) p_k, ema_0 = p_0; d_n = 0.9, or (1 + n) / (10 + n) warming up.
    decays = [(1 + n) / (10 + n) if warmup else decay for n in range(steps)]
    for j, ema_param in enumerate(ema_numpy(trainer)):
        expected = history[0][j].astype(np.float64)
        for i in range(1, steps + 1):
            expected = decays[i - 1] * expected + (1 - decays[i - 1]) * history[i][j]
        np.testing.assert_allclose(ema_param, expected, rtol=1e-5, atol=1e-6)
    assert not np.allclose(ema_numpy(trainer)[0], history[-1][0])


def test_non_finite_loss_stops_without_updating(tiny_config, engine):
    trainer, reference = Trainer(tiny_config(), engine=engine), Trainer(tiny_config(), engine=engine)
    trainer.step(toy_batch())
    reference.step(toy_batch())
    before, ema_before = params_numpy(trainer.model), ema_numpy(trainer)
    bad = toy_batch()
    bad[0, 0, 0, 0] = np.nan
    with pytest.raises(NonFiniteLossError, match="non-finite loss nan .* at step 1"):
        trainer.step(bad)
    assert trainer.step_count == 1
    for a, b in zip(before + ema_before, params_numpy(trainer.model) + ema_numpy(trainer)):
        np.testing.assert_array_equal(a, b)
    # The run goes on as if the bad batch had never come (Adam's state and the step count untouched).
    trainer.step(toy_batch(seed=1))
    reference.step(toy_batch(seed=1))
    for a, b in zip(full_state(trainer), full_state(reference)):
        np.testing.assert_array_equal(a, b)


def test_a_transient_non_finite_gradient_costs_one_recomputed_step(tiny_config, engine, monkeypatch):
    """Step 1's first gradients come out NaN (its batch corrupted for that computation only, as a transient fault
    would): the step is computed again from the same weights and draws, counted, and the run equals one without the
    fault, bit for bit. A fault that persists stops the run (``test_non_finite_loss_stops_without_updating``)."""
    original, attempts = Trainer._gradients, []

    def flaky(self, x0, draws):
        attempts.append(self.step_count)
        if attempts.count(1) == 1 and self.step_count == 1:
            x0 = x0.copy()
            x0[0, 0, 0, 0] = np.nan
        return original(self, x0, draws)

    reference = Trainer(tiny_config(), engine=engine)
    reference_metrics = [reference.step(toy_batch(seed=k)) for k in range(3)]
    monkeypatch.setattr(Trainer, "_gradients", flaky)
    trainer = Trainer(tiny_config(), engine=engine)
    metrics = [trainer.step(toy_batch(seed=k)) for k in range(3)]
    assert attempts == [0, 1, 1, 2] and trainer.recomputed_steps == 1
    assert [m.get("recomputed_steps") for m in metrics] == [None, 1, None]
    assert [m["loss"] for m in metrics] == [m["loss"] for m in reference_metrics]
    for a, b in zip(full_state(trainer), full_state(reference)):
        np.testing.assert_array_equal(a, b)


IMPROVED = dict(var_type="learned_range", loss_type="hybrid", use_scale_shift_norm=True, num_heads=2,
                beta_schedule="cosine", rescale_timesteps=True, time_embedding="iddpm")


def ramps_of_class(labels):
    """Class 0: horizontal ramps; class 1: vertical ones (as ``toy_batch``)."""
    ramp = np.linspace(-1, 1, 8, dtype=np.float32)
    images = np.where((labels == 0)[:, None, None], ramp[None, :, None], ramp[None, None, :])
    return np.broadcast_to(images, (len(labels), 8, 8))[:, None].astype(np.float32).copy()


def train_on_ramps(trainer, steps):
    """``steps`` updates on batches of 8 ramps of random classes."""
    for k in range(steps):
        batch_labels = np.random.default_rng(k).integers(0, 2, 8).astype(np.int32)
        trainer.step(ramps_of_class(batch_labels), batch_labels)


def denoising_loss(trainer, given):
    """The model's mean loss at t = 20 on 16 ramps of classes 0, 1, 0, ... told they are of the classes ``given``."""
    x0 = ramps_of_class(np.arange(16, dtype=np.int32) % 2)
    noise = np.random.default_rng(99).standard_normal((16, 1, 8, 8), dtype=np.float32)
    network = functools.partial(trainer.model, y=mge.tensor(given))
    return float(trainer.diffusion.training_losses(network, mge.tensor(x0), mge.tensor(np.full(16, 20, np.int32)),
                                                   mge.tensor(noise))["loss"].mean().numpy())


def test_a_class_conditional_unet_learns_what_its_labels_mean(tiny_config):
    """Two classes that differ only in orientation: after 80 steps on labelled batches, denoising at t = 20 of 100
    with the true labels has a loss well below the one with the labels swapped (0.30 of it when written); before
    training the two are the same (the output layer starts at zero)."""
    trainer = Trainer(tiny_config(channel_mult=(1, 2), attention_resolutions=(4,), num_timesteps=100, lr=2e-3,
                                  num_classes=2))
    labels = np.arange(16, dtype=np.int32) % 2
    assert denoising_loss(trainer, labels) == denoising_loss(trainer, 1 - labels)
    train_on_ramps(trainer, 80)
    assert denoising_loss(trainer, labels) < 0.6 * denoising_loss(trainer, 1 - labels)


def test_with_class_dropout_the_network_also_learns_without_a_class(tiny_config):
    """Trained as above with a third of the labels dropped, the network denoises without a class (NO_CLASS) better
    than with the wrong one and worse than with the right one: it has learnt the mixture of the two classes."""
    trainer = Trainer(tiny_config(channel_mult=(1, 2), attention_resolutions=(4,), num_timesteps=100, lr=2e-3,
                                  num_classes=2, class_dropout=0.3))
    labels = np.arange(16, dtype=np.int32) % 2
    train_on_ramps(trainer, 80)
    assert (denoising_loss(trainer, labels) < denoising_loss(trainer, np.full(16, NO_CLASS, np.int32))
            < denoising_loss(trainer, 1 - labels))


@pytest.mark.parametrize("recipe", [{}, IMPROVED], ids=["ddpm", "improved"])
def test_same_seed_same_run_and_state_round_trip(tiny_config, recipe, engine):
    def run(seed, steps):
        trainer = Trainer(tiny_config(seed=seed, dropout=0.2, ema_profiles="0.05,0.1", **recipe), engine=engine)
        for k in range(steps):
            trainer.step(toy_batch(seed=k))
        return trainer

    a, b, c = run(0, 3), run(0, 3), run(1, 3)
    for x, y in zip(params_numpy(a.model), params_numpy(b.model)):
        np.testing.assert_array_equal(x, y)
    assert not all(np.array_equal(x, y) for x, y in zip(params_numpy(a.model), params_numpy(c.model)))
    # Loading a state continues exactly like the original (dropout and noise come from the step seed).
    resumed = run(0, 0)
    loader = BatchLoader(np.zeros((8, 8, 8, 1), np.uint8), batch_size=8, seed=0)
    ckpt.restore(ckpt.snapshot(a, loader), "memory", resumed, loader)
    assert resumed.step_count == 3
    a.step(toy_batch(seed=3))
    resumed.step(toy_batch(seed=3))
    for x, y in zip(full_state(a), full_state(resumed), strict=True):
        np.testing.assert_array_equal(x, y)


def same_state(trainer, other):
    """Load ``other``'s weights, EMA, Adam state and step count into ``trainer`` (a checkpoint round trip)."""
    loader = BatchLoader(np.zeros((8, 8, 8, 1), np.uint8), batch_size=8, seed=0)
    ckpt.restore(ckpt.snapshot(other, loader), "memory", trainer, loader)


@pytest.mark.parametrize("grad_clip", [0.0, 1e-2])
def test_the_flat_update_is_megengine_clip_adam_and_ema(tiny_config, grad_clip):
    """From the same state, each step on the flat numpy update equals MegEngine's clip_grad_norm + Adam + EMA
    up to float32 rounding (the norm's summation order; sqrt where MegEngine takes a power of 0.5), and bit for
    bit where those do not enter."""
    cfg = tiny_config(grad_clip=grad_clip, warmup_steps=2, ema_decay=0.9, lr=1e-3, ema_profiles="0.05,0.2")
    megengine_run, flat_run = Trainer(cfg, engine="megengine"), Trainer(cfg, engine="numpy")
    flat_run.engine.native_step = MegEngineGradients(flat_run)  # the same gradients on both: only the updates differ
    for k in range(4):
        same_state(flat_run, megengine_run)
        expected = megengine_run.step(toy_batch(seed=k))
        got = flat_run.step(toy_batch(seed=k))
        assert got["loss"] == expected["loss"] and got["lr"] == expected["lr"]
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-6)
        assert grad_clip == 0 or expected["grad_norm"] > 10 * grad_clip  # clipping at work
        expected_state, state = state_by_kind(megengine_run), state_by_kind(flat_run)
        for kind, arrays in state.items():
            scale = max(np.abs(b).max() for b in expected_state[kind])  # small ones lose digits to cancellation
            for a, b in zip(arrays, expected_state[kind]):
                assert a.dtype == b.dtype and a.shape == b.shape
                np.testing.assert_allclose(a, b, rtol=2e-6, atol=2e-6 * scale)
        if grad_clip == 0:  # the same gradients: the same operations in the same order, but for sqrt's last bit
            for kind in ("exp_avg", "exp_avg_sq", "step"):
                for a, b in zip(state[kind], expected_state[kind]):
                    np.testing.assert_array_equal(a, b)
            for ema, expected, param, expected_param in zip(state["ema"], expected_state["ema"], state["model"],
                                                             expected_state["model"]):
                same = param == expected_param
                np.testing.assert_array_equal(ema[same], expected[same])


class MegEngineGradients:
    """A CPU engine's source of gradients replaced by MegEngine's autodiff of the trainer's own network (whose weights
    the engine writes back after every update), so that its flat update can be compared with MegEngine's."""

    def __init__(self, trainer):
        params = list(trainer.model.parameters())
        self.source = EngineSource(trainer.model, trainer.diffusion, params, GradManager().attach(params))

    def batch_gradients(self, flat_weights, x0, draws, rows):
        loss = self.source(x0, draws, rows).item()
        return loss, np.concatenate([p.grad.numpy().reshape(-1) for p in self.source.params])


def test_state_handed_over_and_back_changes_nothing(tiny_config):
    """``Trainer.state`` writes the CPU engine's flat state into MegEngine's objects and the engine takes it back
    after the block: a run handed over after every step equals one never handed over until its end, bit for bit."""
    read = Trainer(tiny_config(dropout=0.2), engine="numpy")
    unread = Trainer(tiny_config(dropout=0.2), engine="numpy")
    for k in range(4):
        read.step(toy_batch(seed=k))
        unread.step(toy_batch(seed=k))
        full_state(read)
    for a, b in zip(full_state(read), full_state(unread)):
        np.testing.assert_array_equal(a, b)


def test_a_change_made_to_the_handed_over_state_is_what_the_engine_continues_from(tiny_config):
    changed, reference = (Trainer(tiny_config(), engine="numpy") for _ in range(2))
    for trainer in (changed, reference):
        trainer.step(toy_batch())
    with changed.state() as state:
        for p in state.ema.parameters():
            p._reset(p * 0)
    changed.step(toy_batch(seed=1))
    reference.step(toy_batch(seed=1))
    decay = ema_decay_at(changed.cfg, 1)
    for ema, expected in zip(ema_numpy(changed), params_numpy(changed.model)):
        np.testing.assert_allclose(ema, (1 - decay) * expected, rtol=1e-6, atol=1e-7)
    assert not np.allclose(ema_numpy(reference)[0], ema_numpy(changed)[0])


@pytest.mark.parametrize("saved_on, resumed_on", [("numpy", "megengine"), ("megengine", "numpy")])
def test_a_checkpoint_resumes_on_the_other_engine(tiny_config, saved_on, resumed_on):
    """A checkpoint has the same layout on both engines, and a run saved on one resumes on the other as it goes on
    on its own (up to the engines' float32 rounding)."""
    cfg = tiny_config(grad_clip=1e-2, ema_profiles="0.1")
    run = Trainer(cfg, engine=saved_on)
    for k in range(2):
        run.step(toy_batch(seed=k))
    loader = BatchLoader(np.zeros((8, 8, 8, 1), np.uint8), batch_size=8, seed=0)
    saved = ckpt.snapshot(run, loader)
    other = Trainer(cfg, engine=resumed_on)
    other.step(toy_batch())
    layout = ckpt.snapshot(other, loader)
    assert saved["optimizer"]["param_groups"] == layout["optimizer"]["param_groups"]
    for i, state in layout["optimizer"]["state"].items():
        assert {k: (v.dtype, v.shape) for k, v in saved["optimizer"]["state"][i].items()} == \
            {k: (v.dtype, v.shape) for k, v in state.items()}
    resumed = Trainer(cfg, engine=resumed_on)
    ckpt.restore(saved, "memory", resumed, loader)
    for k in range(2, 4):
        run.step(toy_batch(seed=k))
        resumed.step(toy_batch(seed=k))
    assert resumed.step_count == run.step_count == 4
    for a, b in zip(full_state(run), full_state(resumed)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_flat_update_refuses_adam_state_it_does_not_reproduce(tiny_config):
    trainer = Trainer(tiny_config(), engine="numpy")
    trainer.step(toy_batch())
    with pytest.raises(FlatUpdateError, match=r"step counts \[1.0, 7.0\]"):
        with trainer.state() as state:
            saved = state.optimizer.state_dict()
            saved["state"][0]["step"] = np.array(7.0, np.float32)  # a parameter that missed steps: no such UNet
            state.optimizer.load_state_dict(saved)


def test_flat_steps_do_not_depend_on_thread_counts(tiny_config, monkeypatch):
    states = []
    for threads in (1, 2):
        monkeypatch.setattr(batch_threads, "THREADS", threads)
        trainer = Trainer(tiny_config(model_channels=64, norm_groups=8), engine="numpy")
        with threadpool_limits(threads, user_api="blas"):
            for k in range(2):
                trainer.step(toy_batch(seed=k))
        states.append(full_state(trainer))
    for a, b in zip(*states):
        np.testing.assert_array_equal(a, b)


def test_input_perturbation_is_a_draw_after_the_others(tiny_config):
    """The perturbation changes the losses (once the network has learned to read its input: its initial output is
    near zero, whatever the input); scaled down to 1e-6 it leaves them where they are without one, so the timesteps
    and noise it is added to are the same draws."""
    def losses(ip):
        trainer = Trainer(tiny_config(input_perturbation=ip, lr=1e-2, warmup_steps=0))
        return np.array([trainer.step(toy_batch(seed=k))["loss"] for k in range(4)])

    plain = losses(0.0)
    np.testing.assert_allclose(losses(1e-6), plain, rtol=1e-3)
    assert abs(losses(0.5)[-1] - plain[-1]) > 0.05 * plain[-1]


def test_ranks_draw_different_timesteps_and_noise(tiny_config):
    first = Trainer(tiny_config(), world_size=1, rank=0)
    other = Trainer(tiny_config(), world_size=1, rank=1)  # world_size 1: no collective calls on CPU
    assert first.step(toy_batch())["loss"] != other.step(toy_batch())["loss"]


def test_distributed_pieces_on_cpu():
    assert distributed.allreduce_mean_callbacks(1) == []
    assert distributed.rank_and_world() == (0, 1)
    assert not distributed.is_multiprocess(1)
    assert distributed.is_multiprocess(1, world_size=2)
    with pytest.raises(distributed.LaunchError, match="--num_gpus 2 needs CUDA GPUs"):
        distributed.check_launch(2)
    with pytest.raises(distributed.LaunchError, match="--port"):
        distributed.check_launch(1, device="cpu", rank_start=1)


def _train_steps(cfg, steps):
    """Worker (module level, so spawned processes can import it): a few steps -> parameters (numpy)."""
    rank, world_size = distributed.rank_and_world()
    trainer = Trainer(cfg, world_size, rank)
    for k in range(steps):
        trainer.step(toy_batch(8, seed=k)[rank * 8 // world_size:(rank + 1) * 8 // world_size])
    return params_numpy(trainer.model)


@pytest.mark.gpu
def test_one_rank_launcher_run_equals_the_single_process_run(tiny_config):
    cfg = tiny_config(device="gpu")
    expected = _train_steps(cfg, 3)
    [launched] = distributed.launch(_train_steps, (cfg, 3), use_launcher=True)
    for a, b in zip(expected, launched):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_two_ranks_keep_identical_parameters(tiny_config):
    if mge.device.get_device_count("gpu") < 2:
        pytest.skip("needs 2 GPUs")
    first, second = distributed.launch(_train_steps, (tiny_config(num_gpus=2), 3), num_gpus=2)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)


def test_saved_flagfile_reproduces_the_config(tiny_config, tmp_path):
    from absl import flags

    from megdiffusion.training.config import config_from_flags, define_flags, to_flagfile

    cfg = tiny_config(image_size=28, attention_resolutions=(), channel_mult=(1, 2), random_flip=False,
                      data_path=None, logdir=str(tmp_path / "run"), batch_size=12, lr=3e-4)
    path = tmp_path / "flags.cfg"
    path.write_text(to_flagfile(cfg))
    flag_values = flags.FlagValues()
    define_flags(flag_values)
    flag_values(["train", f"--flagfile={path}"])
    parsed, images = config_from_flags(flag_values)
    assert parsed == cfg and images.shape == (10000, 28, 28, 1)
