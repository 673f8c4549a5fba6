"""Checkpoint files: atomic writes, rotation, corrupt-file fallback, rebuilding a model for sampling."""
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest

from megdiffusion import sampling
from megdiffusion.compat import quiet_megengine
from megdiffusion.files.torch_archive import load_array_pickle
from megdiffusion.training import checkpoint as ckpt
from megdiffusion.training.trainer import TrainingRun

mge = quiet_megengine()


def fake_state(step):
    return {"step": step, "config": {}, "model": {"w": np.full(3, step, np.float32)}, "ema": {},
            "optimizer": {}, "loader": {"epoch": 0, "position": step}}


@pytest.fixture
def tiny_run(tiny_config, tiny_images):
    """``tiny_run(logdir, **changes)``: a 4-step tiny run that saves every 2 steps."""
    def make(logdir, **changes):
        values = dict(batch_size=4, total_steps=4, save_every=2, keep_checkpoints=5, ema_decay=0.5, logdir=str(logdir))
        return TrainingRun(tiny_config(**{**values, **changes}), tiny_images(16), progress=False)

    return make


def test_save_is_atomic_and_round_trips(tmp_path):
    path = ckpt.checkpoint_path(str(tmp_path), 12)
    assert path == os.path.join(str(tmp_path), "checkpoints", "ckpt_0000012.pkl")
    ckpt.save_checkpoint(path, fake_state(12))
    assert os.listdir(tmp_path / "checkpoints") == ["ckpt_0000012.pkl"]  # no temporary file left
    loaded = ckpt.load_checkpoint(path)
    assert loaded["step"] == 12 and np.array_equal(loaded["model"]["w"], [12, 12, 12])


def test_failed_save_keeps_the_old_file(tmp_path):
    path = ckpt.checkpoint_path(str(tmp_path), 1)
    ckpt.save_checkpoint(path, fake_state(1))
    with pytest.raises((AttributeError, TypeError, pickle.PicklingError)):
        ckpt.save_checkpoint(path, {"unpicklable": lambda: None, **fake_state(2)})
    assert ckpt.load_checkpoint(path)["step"] == 1
    assert os.listdir(tmp_path / "checkpoints") == ["ckpt_0000001.pkl"]


def test_list_is_ordered_by_step_and_prune_keeps_the_newest(tmp_path):
    for step in (3, 100, 20, 7):
        ckpt.save_checkpoint(ckpt.checkpoint_path(str(tmp_path), step), fake_state(step))
    (tmp_path / "checkpoints" / "notes.txt").write_text("not a checkpoint")
    steps = [ckpt.load_checkpoint(p)["step"] for p in ckpt.list_checkpoints(str(tmp_path))]
    assert steps == [3, 7, 20, 100]
    assert ckpt.list_checkpoints(str(tmp_path / "checkpoints")) == ckpt.list_checkpoints(str(tmp_path))
    ckpt.prune_checkpoints(str(tmp_path), keep=2)
    assert [ckpt.load_checkpoint(p)["step"] for p in ckpt.list_checkpoints(str(tmp_path))] == [20, 100]
    assert ckpt.list_checkpoints(str(tmp_path / "nowhere")) == []


def test_corrupt_newest_falls_back_with_a_warning(tmp_path):
    for step in (1, 2, 3):
        ckpt.save_checkpoint(ckpt.checkpoint_path(str(tmp_path), step), fake_state(step))
    newest = ckpt.checkpoint_path(str(tmp_path), 3)
    data = open(newest, "rb").read()
    open(newest, "wb").write(data[: len(data) // 2])  # a write cut short
    warnings = []
    state, path = ckpt.load_latest(str(tmp_path), warn=warnings.append)
    assert state["step"] == 2 and path == ckpt.checkpoint_path(str(tmp_path), 2)
    assert len(warnings) == 1 and "ckpt_0000003.pkl" in warnings[0]


def test_unloadable_checkpoints_raise_one_line_errors(tmp_path):
    assert ckpt.load_latest(str(tmp_path)) is None
    with pytest.raises(ckpt.CheckpointError, match="no checkpoint file"):
        ckpt.load_checkpoint(str(tmp_path / "missing.pkl"))
    path = ckpt.checkpoint_path(str(tmp_path), 5)
    os.makedirs(os.path.dirname(path))
    open(path, "wb").write(b"garbage")
    with pytest.raises(ckpt.CheckpointError, match="cannot read checkpoint"):
        ckpt.load_checkpoint(path)
    warnings = []
    with pytest.raises(ckpt.CheckpointError, match=r"none of the 1 checkpoints .* loads \(the newest: cannot read "
                       r"checkpoint .*ckpt_0000005.pkl: .*\); move them out of"):
        ckpt.load_latest(str(tmp_path), warn=warnings.append)
    assert warnings == []  # the error says it all: no warning line before it
    ckpt.save_checkpoint(path, {"step": 5})
    with pytest.raises(ckpt.CheckpointError, match="not a megdiffusion training checkpoint"):
        ckpt.load_checkpoint(path)


def test_resume_skips_a_corrupt_newest_checkpoint(tiny_run, tmp_path, capfd):
    first = tiny_run(tmp_path)
    first.run()
    assert [os.path.basename(p) for p in ckpt.list_checkpoints(str(tmp_path))] == [
        "ckpt_0000002.pkl", "ckpt_0000004.pkl"]
    open(ckpt.checkpoint_path(str(tmp_path), 4), "wb").write(b"\x80\x04truncated")
    resumed = tiny_run(tmp_path, resume=True)
    assert resumed.resume() == ckpt.checkpoint_path(str(tmp_path), 2)
    assert resumed.trainer.step_count == 2 and resumed.loader.state_dict() == {"epoch": 0, "position": 8}
    assert "warning: skipping checkpoint" in capfd.readouterr().err


def test_resume_refuses_a_different_model(tiny_run, tmp_path):
    tiny_run(tmp_path, total_steps=2).run()
    with pytest.raises(ckpt.CheckpointError, match=r"different model_channels \(--model_channels=32\)"):
        tiny_run(tmp_path, resume=True, model_channels=64).resume()


def test_load_model_rebuilds_the_ema_network(tiny_run, tmp_path):
    run = tiny_run(tmp_path)
    run.run()
    with run.trainer.state() as state:
        for ema in (True, False):
            model, diffusion, cfg, step = sampling.load_model(str(tmp_path), ema=ema)
            source = state.ema if ema else state.model
            assert step == 4 and cfg == run.cfg and diffusion.num_timesteps == 40
            assert not model.training
            for (name, a), (_, b) in zip(model.named_parameters(), source.named_parameters()):
                np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=name)
        model, *_ = sampling.load_model(ckpt.checkpoint_path(str(tmp_path), 2))
        assert not np.array_equal(next(model.parameters()).numpy(), next(state.ema.parameters()).numpy())
    (tmp_path / "empty").mkdir()
    with pytest.raises(ckpt.CheckpointError, match="no checkpoints"):
        sampling.load_model(str(tmp_path / "empty"))


OLD_RUN = Path(__file__).parent / "fixtures" / "checkpoint_9323ffd"


def test_a_checkpoint_written_at_9323ffd_loads_for_sampling_and_resumes(tmp_path):
    expected = np.load(OLD_RUN / "expected.npz")
    model, _, cfg, step = sampling.load_model(str(OLD_RUN))
    assert step == 2 and cfg.model_channels == 4 and cfg.image_shape == (1, 8, 8)
    out = model(mge.tensor(expected["x"]), mge.tensor(expected["t"])).numpy()
    np.testing.assert_allclose(out, expected["ema_out"], rtol=1e-5, atol=1e-6)

    logdir = tmp_path / "run"
    shutil.copytree(OLD_RUN / "checkpoints", logdir / "checkpoints")
    run = TrainingRun(cfg.replace(logdir=str(logdir), total_steps=3, resume=True), expected["images"],
                      progress=False)
    assert run.resume() == ckpt.checkpoint_path(str(logdir), 2)
    old = ckpt.load_checkpoint(ckpt.checkpoint_path(str(logdir), 2))
    # new since: the AMP state, and what the run trains on
    assert set(ckpt.snapshot(run.trainer, run.loader)) == set(old) | {"loss_scale", "data", "ema_profiles"}
    assert run.trainer.draw_scheme == old["rng"]["scheme"]  # it keeps drawing as it started
    assert run.loader.state_dict() == {"epoch": 0, "position": 8}
    loss = run.trainer.step(*run.loader.next_batch())["loss"]
    assert loss == pytest.approx(float(expected["next_loss"]), rel=1e-5)


class Payload:
    """Unpickling it creates the file ``path``: a crafted checkpoint's code."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return exec, (f"open({self.path!r}, 'w').close()",)


def test_a_crafted_checkpoint_is_refused_before_any_of_its_code_runs(tmp_path):
    pickle.loads(pickle.dumps(Payload(str(tmp_path / "proof"))))  # plain unpickling runs it
    assert (tmp_path / "proof").exists()
    path = str(tmp_path / "evil.pkl")
    ckpt.save_checkpoint(path, {**fake_state(1), "config": Payload(str(tmp_path / "ran"))})
    with pytest.raises(ckpt.CheckpointError, match=r"cannot read checkpoint .*refusing to load builtins\.exec"):
        ckpt.load_checkpoint(path)
    assert not (tmp_path / "ran").exists()


def test_numpy_arrays_load_in_every_pickle_spelling(tmp_path):
    """Protocol 5 (what save_checkpoint writes), protocol 2 (CIFAR-10's batches, Python 2), numpy 2's names."""
    state = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "s": np.float64(2.5), "b": b"bytes", "t": (1, "x")}
    protocol2 = pickle.dumps(state, protocol=2)
    for data in (pickle.dumps(state, protocol=5), protocol2, protocol2.replace(b"numpy.core", b"numpy._core")):
        assert b"numpy" in data
        (tmp_path / "c.pkl").write_bytes(data)
        loaded = load_array_pickle(tmp_path / "c.pkl")
        np.testing.assert_array_equal(loaded["w"], state["w"])
        assert loaded["s"] == 2.5 and loaded["b"] == b"bytes" and loaded["t"] == (1, "x")


def test_stored_configs_and_weights_that_do_not_fit_are_one_line_errors(tiny_run, tmp_path):
    tiny_run(tmp_path / "run", total_steps=2, save_every=0).run()
    [path] = ckpt.list_checkpoints(str(tmp_path / "run"))
    state = ckpt.load_checkpoint(path)
    model = sampling.load_model(path)[0]
    for config, message in (({**state["config"], "image_size": -4}, "--image_size must be >= 1 and <= 4096, got -4"),
                            ({**state["config"], "lr": float("inf")}, "--lr must be a finite number, got inf"),
                            ([1, 2], "a list where a dict belongs")):
        with pytest.raises(ckpt.CheckpointError, match=f"^{path} holds an unusable training config: {message}"):
            ckpt.config_of({**state, "config": config}, path)
    name = next(iter(state["ema"]))
    for weights, message in (({**state["ema"], name: np.zeros(3, np.float32)}, f"{name} is float32 \\(3,\\)"),
                             ({**state["ema"], name: np.zeros(state["ema"][name].shape, np.int64)}, "is int64"),
                             ({**state["ema"], "extra": np.zeros(1)}, "0 arrays missing \\(\\), 1 unknown \\(extra\\)"),
                             ([], "a list where a dict of arrays belongs")):
        with pytest.raises(ckpt.CheckpointError, match=f"^{path}: its weights do not fit .*{message}"):
            ckpt.load_weights(model, weights, path)
