"""``python -m megdiffusion.scripts.train`` end to end: outputs, exact resume, SIGTERM, bad input."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from megdiffusion.training.checkpoint import list_checkpoints, list_snapshots, load_checkpoint, load_snapshot
from megdiffusion.training.config import CPU_RECIPE

REPO = Path(__file__).resolve().parents[1]


def train(*args, hashseed=0, timeout=240):
    env = dict(os.environ, PYTHONHASHSEED=str(hashseed))
    return subprocess.run([sys.executable, "-m", "megdiffusion.scripts.train", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def error_lines(stderr):
    """stderr without MegEngine's CPU-mode banner lines."""
    return [line for line in stderr.splitlines() if line and not line.startswith(("info: ", "debug: "))]


@pytest.fixture
def npz_data(tmp_path, tiny_images):
    """32 gray 8x8 images in the npz format."""
    path = tmp_path / "data.npz"
    np.savez(path, tiny_images(32))
    return str(path)


def test_cpu_recipe_end_to_end(tiny_model_flags, tmp_path):
    logdir = tmp_path / "run"
    result = train("--flagfile=configs/fashion_mnist_cpu.cfg", "--total_steps=20", f"--logdir={logdir}",
                   *tiny_model_flags, "--batch_size=4", "--sample_every=20", "--sample_num=4", "--sample_steps=2")
    assert result.returncode == 0, result.stderr
    metrics = [json.loads(line) for line in (logdir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [10, 20]
    assert all(set(m) == {"step", "loss", "grad_norm", "lr", "images_per_s"} for m in metrics)
    assert all(np.isfinite(m["loss"]) and m["images_per_s"] > 0 for m in metrics)
    assert (logdir / "samples" / "step_0000020.png").is_file()
    [ckpt_path] = list_checkpoints(str(logdir))
    ckpt = load_checkpoint(ckpt_path)
    assert ckpt["step"] == 20 and ckpt["config"]["image_size"] == 28 and ckpt["config"]["image_channels"] == 1
    assert json.loads((logdir / "config.json").read_text()) == ckpt["config"]
    flags = (logdir / "flags.cfg").read_text()
    assert "--channel_mult=1\n" in flags and "--total_steps=20\n" in flags and "--image_size=28\n" in flags


# Improved DDPM: learned-range variances trained with the hybrid loss, scale-shift norm, two heads, cosine betas,
# rescaled timesteps and improved-diffusion's time embedding.
IMPROVED = ["--var_type=learned_range", "--loss_type=hybrid", "--use_scale_shift_norm", "--num_heads=2",
            "--beta_schedule=cosine", "--rescale_timesteps", "--time_embedding=iddpm"]


@pytest.mark.parametrize("recipe", [[], IMPROVED], ids=["ddpm", "improved"])
def test_exact_resume_in_a_new_process(tiny_model_flags, tmp_path, npz_data, recipe):
    common = ["--dataset=npz", f"--data_path={npz_data}", *tiny_model_flags, "--dropout=0.1", "--num_timesteps=50",
              "--batch_size=8", "--warmup_steps=3", "--ema_warmup", "--sample_every=0", "--save_every=0",
              "--log_every=1", "--ema_profiles=0.05,0.1", "--snapshot_every=2", *recipe]
    # --ema_warmup: the EMA decay depends on the step, so a resume must restore it; the post-hoc EMA's profiles too
    straight, split = tmp_path / "straight", tmp_path / "split"
    # 6 steps of 8 out of 32 images: the run crosses an epoch boundary after the resume.
    runs = [train(*common, "--total_steps=6", f"--logdir={straight}", hashseed=1),
            train(*common, "--total_steps=3", f"--logdir={split}", hashseed=2),
            # improved: continued from the checkpoint alone (its config); ddpm: with its flags spelt out again
            train(*([] if recipe else common), "--total_steps=6", f"--logdir={split}", "--resume", hashseed=3)]
    for result in runs:
        assert result.returncode == 0, result.stderr
    assert "resumed from" in runs[2].stderr
    a = load_checkpoint(list_checkpoints(str(straight))[-1])
    b = load_checkpoint(list_checkpoints(str(split))[-1])
    assert a["step"] == b["step"] == 6
    assert a["loader"] == b["loader"] == {"epoch": 1, "position": 16}
    for key in ("model", "ema"):
        assert list(a[key]) == list(b[key])
        for name in a[key]:
            np.testing.assert_array_equal(a[key][name], b[key][name], err_msg=f"{key}.{name}")
    for profile_a, profile_b in zip(a["ema_profiles"], b["ema_profiles"], strict=True):
        for name in profile_a:
            np.testing.assert_array_equal(profile_a[name], profile_b[name], err_msg=f"profile {name}")
    snapshots = [list_snapshots(str(run)) for run in (straight, split)]
    assert [step for step, _ in snapshots[0]] == [step for step, _ in snapshots[1]] == [2, 4, 6]
    for (_, path_a), (_, path_b) in zip(*snapshots):
        snap_a, snap_b = load_snapshot(path_a), load_snapshot(path_b)
        assert all(snap_a[key] == snap_b[key] for key in ("step", "t", "sigma_rel"))
        for profile_a, profile_b in zip(snap_a["profiles"], snap_b["profiles"], strict=True):
            for name in profile_a:
                np.testing.assert_array_equal(profile_a[name], profile_b[name], err_msg=f"snapshot {name}")
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
    assert sorted(a["optimizer"]["state"]) == sorted(b["optimizer"]["state"])
    for index, state in a["optimizer"]["state"].items():
        for name, value in state.items():
            np.testing.assert_array_equal(value, b["optimizer"]["state"][index][name])
    def losses(logdir):
        return [json.loads(line)["loss"] for line in (logdir / "metrics.jsonl").read_text().splitlines()]

    assert losses(split) == losses(straight)


@pytest.mark.parametrize("signum, to_group", [(signal.SIGINT, False), (signal.SIGTERM, False), (signal.SIGINT, True)],
                         ids=["SIGINT", "SIGTERM", "SIGINT-to-group"])
def test_a_signal_saves_a_loadable_checkpoint_then_exits_128_plus_it(tiny_model_flags, tmp_path, npz_data, signum,
                                                                   to_group):
    """To the process, or as a terminal's Ctrl-C does, to its process group (batch 16: a worker process runs half
    of each step, and must not die before the step and its checkpoint are done)."""
    logdir = tmp_path / "run"
    args = ["--dataset=npz", f"--data_path={npz_data}", *tiny_model_flags, f"--batch_size={16 if to_group else 8}",
            "--total_steps=100000", "--sample_every=0", "--save_every=0", "--log_every=1", f"--logdir={logdir}"]
    proc = subprocess.Popen([sys.executable, "-m", "megdiffusion.scripts.train", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=to_group)
    metrics = logdir / "metrics.jsonl"
    deadline = time.time() + 120
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read() if proc.poll() else "timeout"
        time.sleep(0.2)
    if to_group:
        os.killpg(proc.pid, signum)
    else:
        proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, stderr  # so that `train && sample` stops here
    line = stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: stopped by {signum.name} at step ") and line.endswith("continue with --resume")
    [path] = list_checkpoints(str(logdir))
    ckpt = load_checkpoint(path)
    assert 2 <= ckpt["step"] < 100000 and f"at step {ckpt['step']};" in line
    assert path.endswith(f"ckpt_{ckpt['step']:07d}.pkl")


@pytest.mark.parametrize("args, message", [
    (["--dataset=imagenet"], "--dataset=imagenet: value should be one of <fashion_mnist|cifar10|"),
    (["--dataset=npz", "--data_path=/nonexistent/data.npz"], "does not exist"),
    (["--dataset=folder", "--data_path={empty}", "--image_size=28"], "no images"),
    (["--image_size=30"], "must be divisible by"),
    (["--attention_resolutions=16"], "never occur"),
    (["--batch_size=10", "--world_size=4"], "not divisible by world size 4"),
    (["--num_gpus=2"], "--num_gpus 2 needs CUDA GPUs"),
    (["--batch_size=abc"], "batch_size"),
    (["positional"], "unexpected arguments"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, args, message):
    (tmp_path / "empty").mkdir()
    logdir = tmp_path / "run"
    args = [arg.replace("{empty}", str(tmp_path / "empty")) for arg in args]
    result = train(*args, f"--logdir={logdir}")
    assert result.returncode == 2, result.stderr
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], result.stderr
    assert not logdir.exists()


def test_help_shows_the_values_of_the_recipe_a_bare_run_reads():
    result = train("--help")
    assert f"reads {CPU_RECIPE} first" in result.stdout, result.stdout
    for name, value in (("model_channels", "16"), ("batch_size", "16"), ("total_steps", "20000")):
        assert re.search(rf"--{name}: [^\n]*\n(?:    [^\n]*\n)*?    \(default: '{value}'\)", result.stdout), name


def test_fresh_run_refuses_a_logdir_with_checkpoints(tiny_model_flags, tmp_path, npz_data):
    common = ["--dataset=npz", f"--data_path={npz_data}", *tiny_model_flags, "--batch_size=8", "--total_steps=1",
              "--sample_every=0", f"--logdir={tmp_path / 'run'}"]
    assert train(*common).returncode == 0
    result = train(*common)
    assert result.returncode == 2 and "pass --resume" in error_lines(result.stderr)[0]


def test_a_diverged_run_prints_one_error_line_that_names_where_to_continue(tiny_model_flags, tmp_path, npz_data):
    """No numpy warnings beside the error; it names the checkpoint to resume from only when one exists."""
    common = ["--dataset=npz", f"--data_path={npz_data}", *tiny_model_flags, "--batch_size=8", "--sample_every=0",
              "--lr=1e10", "--grad_clip=0", "--warmup_steps=0", f"--logdir={tmp_path / 'run'}"]
    for args, where in ((["--total_steps=5"], "no checkpoint had been written yet: train again from the start"),
                        (["--total_steps=1"], None),
                        (["--total_steps=5", "--resume"], "resume from the newest checkpoint, "
                         f"{tmp_path / 'run' / 'checkpoints' / 'ckpt_0000001.pkl'}, with --resume")):
        result = train(*common, *args)
        if where is None:  # one step before the loss blows up: it saves the checkpoint the next run resumes from
            assert result.returncode == 0, result.stderr
            continue
        lines = [line.rpartition("\r")[2] for line in error_lines(result.stderr)]
        assert result.returncode == 1 and "Warning" not in result.stderr, result.stderr
        assert lines[-1].startswith("error: non-finite loss nan") and lines[-1].endswith(where), result.stderr
        assert [line for line in lines if "error" in line.lower()] == lines[-1:]


def test_resume_continues_a_run_from_init_from_and_refuses_another(tiny_model_flags, tmp_path, npz_data):
    """The run's flags.cfg names its --init_from, so resuming with it continues; another --init_from conflicts."""
    first = tmp_path / "first"
    common = ["--dataset=npz", f"--data_path={npz_data}", *tiny_model_flags, "--batch_size=8", "--sample_every=0"]
    assert train(*common, "--total_steps=1", f"--logdir={first}").returncode == 0
    run = tmp_path / "run"
    assert train(*common, "--total_steps=1", f"--logdir={run}", f"--init_from={first}").returncode == 0
    resumed = train(f"--flagfile={run / 'flags.cfg'}", "--resume", "--total_steps=2")
    assert resumed.returncode == 0, resumed.stderr
    assert [os.path.basename(p) for p in list_checkpoints(str(run))] == ["ckpt_0000001.pkl", "ckpt_0000002.pkl"]
    other = list_checkpoints(str(first))[0]
    refused = train(f"--flagfile={run / 'flags.cfg'}", "--resume", "--total_steps=3", f"--init_from={other}")
    assert refused.returncode == 2 and error_lines(refused.stderr) == [
        f"error: --resume continues the run in {run}, which started from {first}, and --init_from {other} would "
        "start another; drop --init_from to continue the run, or give a new --logdir to start from it"]
    assert len(list_checkpoints(str(run))) == 2


def test_two_trainings_on_one_logdir_the_second_is_refused(tiny_model_flags, tmp_path, npz_data):
    logdir = tmp_path / "run"
    args = ["--dataset=npz", f"--data_path={npz_data}", *tiny_model_flags, "--batch_size=8", "--total_steps=100000",
            "--sample_every=0", "--save_every=0", "--log_every=1", f"--logdir={logdir}"]
    first = subprocess.Popen([sys.executable, "-m", "megdiffusion.scripts.train", *args], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (logdir / "metrics.jsonl").is_file():
        assert first.poll() is None and time.time() < deadline
        time.sleep(0.2)
    for extra in ([], ["--resume"]):
        second = train(*args, *extra)
        assert second.returncode == 2, second.stderr
        assert error_lines(second.stderr) == [f"error: --logdir {logdir} is in use by another megdiffusion command; "
                                              "wait for it to end or choose another --logdir"]
    first.send_signal(signal.SIGINT)
    _, stderr = first.communicate(timeout=120)
    assert first.returncode == 130, stderr
    steps = [json.loads(line)["step"] for line in (logdir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1))  # one run's steps, not two interleaved


def test_allow_changes_continues_with_new_training_settings_and_step_settings_change_freely(tiny_model_flags,
                                                                                             tmp_path, npz_data):
    """The resume rule by role: a changed --lr continues only with --allow_changes (one note naming it, the new lr
    in the continued run's config); --microbatch (the step's role) changes without it; the network never."""
    run = tmp_path / "run"
    common = ["--dataset=npz", f"--data_path={npz_data}", *tiny_model_flags, "--batch_size=8", "--sample_every=0"]
    assert train(*common, "--total_steps=1", f"--logdir={run}").returncode == 0
    refused = train(f"--logdir={run}", "--resume", "--total_steps=2", "--lr=0.001")
    assert refused.returncode == 2 and "--allow_changes" in refused.stderr
    assert len(list_checkpoints(str(run))) == 1
    allowed = train(f"--logdir={run}", "--resume", "--total_steps=2", "--lr=0.001", "--allow_changes",
                    "--microbatch=4")
    assert allowed.returncode == 0, allowed.stderr
    notes = [line for line in allowed.stderr.splitlines() if line.startswith("note: --allow_changes")]
    assert notes == ["note: --allow_changes: the run continues with --lr=0.001 (was --lr=0.002), so it no longer "
                     "equals an unbroken run"]
    continued = load_checkpoint(list_checkpoints(str(run))[-1])
    assert continued["step"] == 2 and continued["config"]["lr"] == 0.001 and continued["config"]["microbatch"] == 4
    stepped = train(f"--logdir={run}", "--resume", "--total_steps=3", "--microbatch=2")
    assert stepped.returncode == 0, stepped.stderr
    assert "note: --allow_changes" not in stepped.stderr  # the run now holds lr 0.001: nothing changes
    assert "--allow_changes" not in (run / "flags.cfg").read_text()  # asked per resume, never kept in the run
