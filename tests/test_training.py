"""Trainer.step on tiny configs: learning, clipping, warmup, EMA, guards, determinism."""
import numpy as np
import pytest

from megdiffusion.compat import quiet_megengine
from megdiffusion.data.loader import BatchLoader
from megdiffusion.training import checkpoint as ckpt
from megdiffusion.training import distributed
from megdiffusion.training.trainer import NonFiniteLossError, Trainer, warmup_lr

mge = quiet_megengine()


def toy_batch(n=8, seed=0):
    """Smooth images (horizontal or vertical ramps): easy to learn, far from white noise."""
    ramp = np.linspace(-1, 1, 8, dtype=np.float32)
    rng = np.random.default_rng(seed)
    images = np.where(rng.random(n)[:, None, None] < 0.5, ramp[None, :, None], ramp[None, None, :])
    return np.broadcast_to(images, (n, 8, 8))[:, None].astype(np.float32).copy()


def params_numpy(module):
    return [p.numpy().copy() for p in module.parameters()]


def fixed_loss(trainer, x0):
    """Mean training loss at fixed timesteps and noise (no randomness), in eval mode."""
    rng = np.random.default_rng(123)
    t = rng.integers(0, trainer.diffusion.num_timesteps, size=len(x0)).astype(np.int32)
    noise = rng.standard_normal(x0.shape, dtype=np.float32)
    trainer.model.eval()
    loss = trainer.diffusion.training_losses(trainer.model, mge.tensor(x0), mge.tensor(t), mge.tensor(noise))["loss"]
    return float(loss.mean())


def record_applied_gradients(trainer):
    """Make ``trainer.optimizer.step`` record (global gradient norm, lr) just before it applies them."""
    applied = []
    original = trainer.optimizer.step

    def step():
        grads = [p.grad.numpy().astype(np.float64) for p in trainer.params]
        norm = np.sqrt(sum((g ** 2).sum() for g in grads))
        applied.append((norm, trainer.optimizer.param_groups[0]["lr"]))
        return original()

    trainer.optimizer.step = step
    return applied


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


def test_tiny_clip_bounds_the_applied_gradient_norm(tiny_config):
    trainer = Trainer(tiny_config(grad_clip=1e-3))
    applied = record_applied_gradients(trainer)
    metrics = trainer.step(toy_batch())
    applied_norm, _ = applied[0]
    assert metrics["grad_norm"] > 100 * 1e-3  # the logged norm is the one before clipping
    assert applied_norm == pytest.approx(1e-3, rel=1e-4)


def test_clip_zero_leaves_gradients_alone(tiny_config):
    trainer = Trainer(tiny_config(grad_clip=0.0))
    applied = record_applied_gradients(trainer)
    metrics = trainer.step(toy_batch())
    assert applied[0][0] == pytest.approx(metrics["grad_norm"], rel=1e-5)
    assert metrics["grad_norm"] > 1e-2


def test_warmup_learning_rates(tiny_config):
    cfg = tiny_config(lr=1e-3, warmup_steps=4)
    assert [warmup_lr(cfg, k) for k in range(6)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
    assert warmup_lr(tiny_config(lr=1e-3, warmup_steps=0), 0) == 1e-3
    trainer = Trainer(cfg)
    applied = record_applied_gradients(trainer)
    logged = [trainer.step(toy_batch(seed=k))["lr"] for k in range(5)]
    assert logged == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])
    assert [lr for _, lr in applied] == logged  # the optimizer really used them


def test_ema_matches_closed_form(tiny_config):
    decay, steps = 0.9, 4
    trainer = Trainer(tiny_config(ema_decay=decay))
    history = [params_numpy(trainer.model)]
    for k in range(steps):
        trainer.step(toy_batch(seed=k))
        history.append(params_numpy(trainer.model))
    # ema_k = d^k p_0 + (1 - d) * sum_{i=1..k} d^(k-i) p_i
    for j, ema_param in enumerate(params_numpy(trainer.ema)):
        expected = decay ** steps * history[0][j].astype(np.float64)
        for i in range(1, steps + 1):
            expected += (1 - decay) * decay ** (steps - i) * history[i][j]
        np.testing.assert_allclose(ema_param, expected, rtol=1e-5, atol=1e-6)
    assert not np.allclose(params_numpy(trainer.ema)[0], history[-1][0])


def test_non_finite_loss_stops_without_updating(tiny_config):
    trainer = Trainer(tiny_config())
    trainer.step(toy_batch())
    before, ema_before = params_numpy(trainer.model), params_numpy(trainer.ema)
    bad = toy_batch()
    bad[0, 0, 0, 0] = np.nan
    with pytest.raises(NonFiniteLossError, match="non-finite loss nan .* at step 1"):
        trainer.step(bad)
    assert trainer.step_count == 1
    for a, b in zip(before + ema_before, params_numpy(trainer.model) + params_numpy(trainer.ema)):
        np.testing.assert_array_equal(a, b)


IMPROVED = dict(var_type="learned_range", loss_type="hybrid", use_scale_shift_norm=True, num_heads=2,
                beta_schedule="cosine", rescale_timesteps=True, time_embedding="iddpm")


@pytest.mark.parametrize("recipe", [{}, IMPROVED], ids=["ddpm", "improved"])
def test_same_seed_same_run_and_state_round_trip(tiny_config, recipe):
    def run(seed, steps):
        trainer = Trainer(tiny_config(seed=seed, dropout=0.2, **recipe))
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
    for x, y in zip(params_numpy(a.model) + params_numpy(a.ema),
                    params_numpy(resumed.model) + params_numpy(resumed.ema)):
        np.testing.assert_array_equal(x, y)


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
