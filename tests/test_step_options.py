"""The GPU step's options, proven on CPU: mixed precision (``--amp``), micro-batches (``--microbatch``), the same
update on 1 or N ranks (simulated in one process), and a traced step (``--trace``)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megdiffusion import sampling
from megdiffusion.compat import quiet_megengine
from megdiffusion.cpu import onednn
from megdiffusion.cpu.choice import cpu_engine_enabled, use_cpu_engine
from megdiffusion.nn.layers import AttnBlock
from megdiffusion.training import checkpoint as ckpt
from megdiffusion.training.config import ConfigError, validate
from megdiffusion.training.draws import PER_RANK, PER_SAMPLE, draw_step, first_sample
from megdiffusion.training.engine import LossScaler, pieces
from megdiffusion.training.trainer import Trainer, TrainingRun
from test_training import adam_state, fixed_loss, full_state, state_by_kind, toy_batch

mge = quiet_megengine()
from megengine.amp import autocast  # noqa: E402


@pytest.fixture
def engine_kernels():
    """MegEngine's own kernels for the whole step, as on a GPU (``MEGDIFFUSION_FAST_CONV=0``)."""
    previous = cpu_engine_enabled()
    use_cpu_engine(False)
    yield
    use_cpu_engine(previous)


@pytest.fixture(params=["megengine", "numpy"])
def cpu_path(request):
    """Both ends: MegEngine's autodiff, kernels and update, and the CPU engine's numpy pass and flat update."""
    if request.param == "megengine":
        previous = cpu_engine_enabled()
        use_cpu_engine(False)
        yield request.param
        use_cpu_engine(previous)
        return
    if not onednn.available():
        pytest.skip("the numpy pass needs oneDNN")
    yield request.param


def assert_states_close(got, expected, rtol=1e-5, atol=1e-6):
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)


# Mixed precision

# A loss scale at which this tiny network's float16 gradients do not overflow: at the default 2^16 its first step
# on random images overflows and is skipped, at 2^15 not (dynamic scaling finds the scale, as it does on GPUs).
SAFE_SCALE = 2.0 ** 8

def test_amp_runs_convolutions_in_float16_and_keeps_norms_loss_and_gradients_in_float32(tiny_config, engine_kernels):
    trainer = Trainer(tiny_config(amp=True, channel_mult=(1, 2), attention_resolutions=(4,)))
    dtypes = {}
    for module in trainer.model.modules():
        if type(module).__name__ in ("Conv2d", "Linear", "GroupNorm"):
            module.register_forward_hook(
                lambda m, inputs, out: dtypes.setdefault(type(m).__name__, set()).add(str(out.dtype)))
    metrics = trainer.step(toy_batch())
    full = Trainer(tiny_config(channel_mult=(1, 2), attention_resolutions=(4,))).step(toy_batch())
    assert metrics["grad_norm"] == pytest.approx(full["grad_norm"], rel=1e-2)  # unscaled before it is measured
    assert dtypes["Conv2d"] == {"float16"} and dtypes["Linear"] == {"float16"}
    assert dtypes["GroupNorm"] == {"float32"}
    assert metrics["loss_scale"] == LossScaler().scale and not metrics["update_skipped"]
    assert all(p.dtype == np.float32 for p in trainer.model.parameters())
    state = adam_state(trainer)
    assert all(state[i]["exp_avg"].dtype == np.float32 for i in state)


def test_amp_attention_does_not_overflow_where_float16_logits_would(engine_kernels):
    """Inputs whose q k^T reaches ~1e5 (beyond float16's 65504): the float16 block scales q and k before their
    product and takes the softmax in float32, so it stays finite and close to the float32 block."""
    mge.random.seed(0)
    block = AttnBlock(64, norm=lambda c: (lambda x: x))  # no norm: large inputs reach the product
    rng = np.random.default_rng(0)
    for conv in (block.q, block.k, block.v, block.proj_out):
        conv.weight._reset(mge.tensor(np.eye(64, dtype=np.float32).reshape(64, 64, 1, 1)))
    x = mge.tensor((40 * rng.standard_normal((2, 64, 4, 4)) / 8 + 40).astype(np.float32))
    with autocast():
        low = block(x).numpy().astype(np.float32)
    assert np.isfinite(low).all()
    np.testing.assert_allclose(low, block(x).numpy(), rtol=2e-2, atol=0.5)


@pytest.fixture
def synchronous_engine():
    """MegEngine's interpreter synchronous (``async_level`` 0): on CPU its asynchronous backward now and then
    returns wrong gradients, inf or NaN among them (benchmarks/megengine_backward_race.py in git's history,
    MegEngine alone)."""
    previous = mge.config.async_level
    mge.config.async_level = 0
    yield
    mge.config.async_level = previous


@pytest.mark.slow  # ~3 minutes: the synchronous interpreter is ~7x slower on CPU
def test_amp_learns_like_float32(tiny_config, engine_kernels, synchronous_engine):
    """200 steps of the tiny network with attention: the loss at fixed draws within 10% of float32's."""
    def trained_loss(amp):
        trainer = Trainer(tiny_config(amp=amp, model_channels=16, attention_resolutions=(8,), lr=2e-3))
        for k in range(200):
            trainer.step(toy_batch(seed=k))
        return fixed_loss(trainer, toy_batch(64, seed=99))

    full, mixed = trained_loss(False), trained_loss(True)
    assert full < 0.1  # it learned: 1.02 before training
    assert mixed == pytest.approx(full, rel=0.1)


@pytest.mark.parametrize("trace", [False, True], ids=["eager", "traced"])
def test_an_overflow_skips_exactly_that_update_halves_the_scale_and_is_logged(tiny_config, tiny_images,
                                                                               engine_kernels, tmp_path, capsys, trace):
    run = TrainingRun(tiny_config(amp=True, trace=trace, dropout=0.0, logdir=str(tmp_path), total_steps=3,
                                  log_every=1), tiny_images(32), progress=False)
    trainer = run.trainer
    original_step = trainer.step

    def step_with_an_overflow_at_1(*batch):
        if trainer.step_count != 1:
            return original_step(*batch)
        trainer.scaler.scale = 2.0 ** 40  # the loss times this overflows float16 in the backward
        before = full_state(trainer)
        metrics = original_step(*batch)
        assert_states_close(full_state(trainer), before, rtol=0, atol=0)  # weights, EMA, Adam: untouched
        assert trainer.scaler.scale == 2.0 ** 39
        trainer.scaler.scale = SAFE_SCALE
        return metrics

    trainer.scaler.scale = SAFE_SCALE
    trainer.step = step_with_an_overflow_at_1
    run.run()
    skipped = [json.loads(line)["update_skipped"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert skipped == [False, True, False]
    assert trainer.scaler.skipped == 1 and trainer.step_count == 3
    assert float(adam_state(trainer)[0]["step"]) == 2  # two updates were applied
    assert "step 2: float16 gradients overflowed at loss scale 1.09951e+12; update skipped" in capsys.readouterr().err


def test_amp_resumes_bit_for_bit_across_a_skip(tiny_config, tiny_images, engine_kernels, tmp_path):
    cfg = tiny_config(amp=True, logdir=str(tmp_path), total_steps=5, ema_profiles="0.05,0.1")

    def advance(run, steps):
        for _ in range(steps):
            overflow = run.trainer.step_count == 2
            if overflow:
                run.trainer.scaler.scale = 2.0 ** 40
            run.trainer.step(*run.loader.next_batch())
            if overflow:
                run.trainer.scaler.scale /= 2.0 ** 32  # back where it does not overflow, with its halving kept

    whole = TrainingRun(cfg.replace(logdir=str(tmp_path / "whole")), tiny_images(32), progress=False)
    advance(whole, 5)
    first = TrainingRun(cfg, tiny_images(32), progress=False)
    advance(first, 3)
    first.save()
    resumed = TrainingRun(cfg.replace(resume=True), tiny_images(32), progress=False)
    assert resumed.resume() is not None
    assert resumed.trainer.scaler.state_dict() == first.trainer.scaler.state_dict()
    assert resumed.trainer.scaler.skipped >= 1 and resumed.trainer.scaler.scale == 2.0 ** 7
    advance(resumed, 2)
    assert_states_close(full_state(resumed.trainer), full_state(whole.trainer), rtol=0, atol=0)
    assert {value.dtype for weights in resumed.trainer.engine.profile_weights() for value in weights.values()} == \
        {np.dtype(np.float32)}  # under float16 forwards, the averages stay float32
    assert resumed.trainer.scaler.state_dict() == whole.trainer.scaler.state_dict()
    # The checkpoint samples like any other: a float32 network with the EMA weights.
    model, _, loaded_cfg, step = sampling.load_model(str(tmp_path))
    assert loaded_cfg.amp and step == 3
    x, t = mge.tensor(toy_batch(2)), mge.tensor(np.array([5, 30], np.int32))
    with first.trainer.state() as state:
        np.testing.assert_array_equal(model(x, t).numpy(), state.ema(x, t).numpy())


def test_loss_scaler_grows_after_clean_steps_and_backs_off():
    scaler = LossScaler(init_scale=8.0, growth_interval=3)
    assert [scaler.update(True) for _ in range(3)] == [True] * 3 and scaler.scale == 16.0
    assert scaler.update(True) and not scaler.update(False) and scaler.scale == 8.0 and scaler.clean_steps == 0
    assert [scaler.update(True) for _ in range(2)] == [True] * 2 and scaler.scale == 8.0  # the count restarted
    restored = LossScaler()
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict() == {
        "scale": 8.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 3, "clean_steps": 2,
        "skipped": 1}


# Micro-batches and ranks

def test_pieces_cover_the_batch_in_order():
    assert pieces(8, 0) == [slice(0, 8)]
    assert pieces(8, 2) == [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]


def test_per_sample_draws_do_not_depend_on_how_the_batch_is_split(tiny_config):
    """Sample i's timestep, noise, perturbation and class-dropout coin are the same whoever draws it."""
    cfg = tiny_config(input_perturbation=0.1, num_classes=3, class_dropout=0.5)
    labels = np.arange(16, dtype=np.int32) % 3
    whole = draw_step(PER_SAMPLE, cfg, 40, 7, (16, 1, 8, 8), labels)
    halves = [draw_step(PER_SAMPLE, cfg, 40, 7, (8, 1, 8, 8), labels[r * 8:(r + 1) * 8],
                        first_index=first_sample(16, 2, r)) for r in (0, 1)]
    for name in ("t", "noise", "perturbation", "labels"):
        np.testing.assert_array_equal(np.concatenate([getattr(h, name) for h in halves]), getattr(whole, name))
    assert halves[0].dropout_seed == whole.dropout_seed != halves[1].dropout_seed  # rank 1's masks differ
    assert len(set(whole.t)) > 5 and (whole.labels == -1).any()
    later = draw_step(PER_SAMPLE, cfg, 40, 8, (16, 1, 8, 8), labels)
    assert not np.array_equal(later.noise, whole.noise)
    old = draw_step(PER_RANK, cfg, 40, 7, (16, 1, 8, 8), labels)  # runs from before: one stream per rank
    assert not np.array_equal(old.noise, whole.noise)
    with pytest.raises(ValueError, match="unknown random-draw scheme"):
        draw_step("mine", cfg, 40, 7, (16, 1, 8, 8))


def test_a_checkpoint_names_its_draw_scheme_and_an_unknown_one_is_refused(tiny_config, tiny_images, tmp_path):
    cfg = tiny_config(logdir=str(tmp_path), total_steps=1)
    run = TrainingRun(cfg, tiny_images(32), progress=False)
    run.run()
    path = ckpt.checkpoint_path(str(tmp_path), 1)
    state = ckpt.load_checkpoint(path)
    assert state["rng"] == {"seed": 0, "scheme": PER_SAMPLE} and state["loss_scale"] is None
    ckpt.save_checkpoint(path, {**state, "rng": {"seed": 0, "scheme": "dice"}})
    with pytest.raises(ckpt.CheckpointError, match="random-draw scheme is damaged .*unknown random-draw scheme 'dice'"):
        TrainingRun(cfg.replace(resume=True), tiny_images(32), progress=False).resume()


def simulated_ranks_step(trainers, x0):
    """One step of N ranks simulated in one process: rank r's ``Trainer`` (world size 1, its draws those of
    samples ``first_sample(.., N, r)``..) computes the gradients of its shard; their mean is every rank's update."""
    n = len(trainers)
    shard = len(x0) // n
    gradients, losses = [], []
    for rank, trainer in enumerate(trainers):
        trainer.first_index = first_sample(len(x0), n, rank)
        part = x0[rank * shard:(rank + 1) * shard]
        draws = trainer.draws(part.shape)
        losses.append(float(trainer.engine.source(part, draws, pieces(shard, 0)).numpy()))
        gradients.append([p.grad.numpy() for p in trainer.engine.params])
        trainer.engine.discard()
    return float(np.mean(losses)), [np.mean(g, axis=0) for g in zip(*gradients)]


def test_n_ranks_one_rank_in_microbatches_and_the_whole_batch_compute_the_same_gradients(tiny_config,
                                                                                        engine_kernels):
    """Dropout 0: 2 and 4 simulated ranks (the mean of their shards' gradients, as the all-reduce takes it), one
    rank with --microbatch 2, and the whole batch give one loss and one gradient, to float32 summation error."""
    cfg = tiny_config(batch_size=8, channel_mult=(1, 2), attention_resolutions=(4,))
    x0 = toy_batch(8, seed=3)
    whole = Trainer(cfg)
    whole_loss = float(whole.engine.source(x0, whole.draws(x0.shape), pieces(8, 0)).numpy())
    expected = [p.grad.numpy() for p in whole.engine.params]
    micro = Trainer(cfg.replace(microbatch=2))
    micro_loss = float(micro.engine.source(x0, micro.draws(x0.shape), pieces(8, 2)).numpy())
    results = [(micro_loss, [p.grad.numpy() for p in micro.engine.params])]
    results += [simulated_ranks_step([Trainer(cfg) for _ in range(n)], x0) for n in (2, 4)]
    scale = max(np.abs(g).max() for g in expected)
    for loss, gradients in results:
        assert loss == pytest.approx(whole_loss, rel=1e-6)
        for got, want in zip(gradients, expected, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6 * scale)


@pytest.mark.parametrize("changes", [dict(), dict(num_classes=3, class_dropout=0.3, input_perturbation=0.1)],
                         ids=["plain", "classes-and-perturbation"])
def test_microbatched_steps_are_whole_batch_steps(tiny_config, cpu_path, changes):
    """Three full steps (clip, Adam, EMA) of batch 16 in micro-batches of 8 and 4 (4 only on MegEngine's path: the
    numpy pass works in groups of 8) against the whole batch: the same losses and weights to float32 rounding."""
    cfg = tiny_config(batch_size=16, lr=1e-3, grad_clip=0.5, ema_profiles="0.05,0.1", **changes)
    labels = (np.arange(16) % 3).astype(np.int32) if cfg.num_classes else None
    runs = {m: Trainer(cfg.replace(microbatch=m), engine=cpu_path)
            for m in ((0, 8, 4) if cpu_path == "megengine" else (0, 8))}
    losses = {m: [run.step(toy_batch(16, seed=k), labels)["loss"] for k in range(3)] for m, run in runs.items()}
    for m, run in runs.items():
        np.testing.assert_allclose(losses[m], losses[0], rtol=1e-5)
        assert_states_close(full_state(run), full_state(runs[0]), rtol=1e-4, atol=1e-6)


@pytest.mark.skipif(not onednn.available(), reason="the numpy pass needs oneDNN")
def test_numpy_pass_dropout_masks_are_the_same_for_any_cut_into_groups_of_8(tiny_config):
    """(On MegEngine's path the micro-batches draw dropout's masks in turn: they follow the cut.)"""
    cfg = tiny_config(batch_size=16, dropout=0.3)
    whole, micro = Trainer(cfg, engine="numpy"), Trainer(cfg.replace(microbatch=8), engine="numpy")
    for k in range(2):
        assert micro.step(toy_batch(16, seed=k))["loss"] == pytest.approx(whole.step(toy_batch(16, seed=k))["loss"],
                                                                          rel=1e-6)
    assert_states_close(full_state(micro), full_state(whole), rtol=1e-5, atol=1e-7)


# A traced step

@pytest.mark.parametrize("changes", [dict(), dict(microbatch=4, num_classes=3)], ids=["whole", "microbatch-classes"])
def test_a_traced_step_equals_the_eager_step_over_20_steps(tiny_config, engine_kernels, synchronous_engine, changes):
    # Synchronous: its 80 backward passes through MegEngine met the asynchronous backward's race (inf gradient norm
    # at step 5 in one suite run).
    cfg = tiny_config(lr=2e-3, ema_profiles="0.05,0.1", **changes)
    labels = (np.arange(8) % 3).astype(np.int32) if cfg.num_classes else None
    eager, traced = Trainer(cfg), Trainer(cfg.replace(trace=True))
    for k in range(20):
        got, expected = traced.step(toy_batch(seed=k), labels), eager.step(toy_batch(seed=k), labels)
        assert got["loss"] == pytest.approx(expected["loss"], rel=1e-5, abs=1e-6)
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
    traced_state, eager_state = state_by_kind(traced), state_by_kind(eager)
    names = [name for name, _ in eager.model.named_parameters()]
    weights = zip(names * 3, traced_state.pop("model") + traced_state.pop("profiles"),
                  eager_state.pop("model") + eager_state.pop("profiles"), strict=True)  # the profiles move with them
    for name, got, want in weights:
        if name.endswith("attn.k.bias"):
            # Its gradient is 0 but for rounding (a softmax ignores a shift shared by all keys), and Adam turns
            # rounding noise into steps of up to lr.
            assert np.abs(got - want).max() <= 20 * cfg.lr
        else:
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)
    for kind in eager_state:
        assert_states_close(traced_state[kind], eager_state[kind], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("first, then", [(True, False), (False, True), (True, True)],
                         ids=["traced-then-eager", "eager-then-traced", "traced-then-traced"])
def test_a_traced_runs_checkpoint_resumes_eagerly_and_back(tiny_config, tiny_images, engine_kernels, tmp_path,
                                                           first, then):
    """Against a run without the interruption (traced when both parts are): bit for bit when both parts are
    traced, to float32 rounding when one part is eager."""
    cfg = tiny_config(logdir=str(tmp_path / "run"), total_steps=4, save_every=2, ema_profiles="0.05,0.1")
    straight = TrainingRun(cfg.replace(logdir=str(tmp_path / "straight"), trace=first and then), tiny_images(32),
                           progress=False)
    straight.run()
    TrainingRun(cfg.replace(trace=first, total_steps=2), tiny_images(32), progress=False).run()
    resumed = TrainingRun(cfg.replace(trace=then, resume=True), tiny_images(32), progress=False)
    assert resumed.run() == 4
    exact = first == then
    assert_states_close(full_state(resumed.trainer), full_state(straight.trainer), rtol=0 if exact else 1e-5,
                        atol=0 if exact else 1e-6)


def test_a_megengine_step_reads_the_device_once(tiny_config, engine_kernels, monkeypatch):
    """The loss and the gradient norm reach the host in one read, the step's only synchronisation: every other value
    of the step stays on the device."""
    trainer = Trainer(tiny_config(), engine="megengine")
    trainer.step(toy_batch())
    reads, original = [], mge.Tensor.numpy
    monkeypatch.setattr(mge.Tensor, "numpy", lambda tensor: reads.append(tensor.shape) or original(tensor))
    trainer.step(toy_batch(seed=1))
    assert len(reads) == 1 and reads[0][0] == 2  # the loss and the norm, stacked


# Options where they cannot work

def test_step_options_refused_where_they_cannot_work(tiny_config):
    with pytest.raises(ConfigError, match="--microbatch 3 does not divide the per-device batch of 8"):
        validate(tiny_config(microbatch=3))
    with pytest.raises(ConfigError, match="--trace needs --dropout 0"):
        validate(tiny_config(trace=True, dropout=0.1))
    for engine in ("numpy", None):  # None: the engine this machine chooses
        with pytest.raises(ConfigError, match="^--amp and --trace run on MegEngine's own kernels, which this machin"):
            Trainer(tiny_config(amp=True, trace=True), engine=engine)


def test_the_gpu_benchmark_runs_every_row_and_its_losses_agree():
    """``benchmarks/gpu_step.py`` (what ``scripts/gpu_check.sh`` runs on a GPU) on the tiny network on CPU: a line
    per row, the same losses for the rows that must agree to rounding, mixed precision within 10%."""
    script = Path(__file__).parent.parent / "benchmarks" / "gpu_step.py"
    done = subprocess.run([sys.executable, str(script), "--tiny", "--device", "cpu", "--steps", "2", "--warmup", "1",
                           "--rows", "fp32,amp,trace,microbatch4,gpus1,gpus2"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    rows = {row["row"]: row for row in map(json.loads, done.stdout.splitlines())}
    assert list(rows) == ["fp32", "amp", "trace", "microbatch4", "gpus1", "gpus2"]
    assert rows["gpus2"]["skipped"] == "needs 2 GPUs"
    for name in ("trace", "microbatch4", "gpus1"):
        assert rows[name]["loss_vs_fp32"] == pytest.approx(1, abs=1e-5), name
    assert rows["amp"]["loss_vs_fp32"] == pytest.approx(1, abs=0.1) and rows["amp"]["loss_scale"] > 0
    assert all(rows[name]["images_per_s"] > 0 and rows[name]["peak_rss_mb"] > 0 for name in ("fp32", "amp"))


@pytest.mark.parametrize("flags", [["--amp"], ["--trace"], ["--amp", "--trace"]])
def test_the_train_command_refuses_amp_and_trace_on_the_fast_cpu_path(tmp_path, tiny_model_flags, flags):
    np.savez(tmp_path / "data.npz", np.zeros((16, 8, 8, 1), np.uint8))
    env = {**os.environ, "MEGDIFFUSION_FAST_CONV": "1"}
    done = subprocess.run([sys.executable, "-m", "megdiffusion.scripts.train", "--dataset=npz",
                           f"--data_path={tmp_path / 'data.npz'}", *tiny_model_flags, "--batch_size=8",
                           "--total_steps=1", f"--logdir={tmp_path / 'run'}", *flags], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith(f"error: {' and '.join(flags)} run") and "MEGDIFFUSION_FAST_CONV=0" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.npz"]
