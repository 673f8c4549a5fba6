"""benchmarks/vs_pytorch.py: megdiffusion's side on tiny models, and the PyTorch twin checked against it when a
python with torch is at hand ($MEGDIFFUSION_TORCH_PYTHON, else this one; the CI venv has none: skipped)."""
import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import megdiffusion_side  # noqa: E402
import vs_pytorch  # noqa: E402

from megdiffusion.training.config import TrainConfig, build_diffusion, build_model  # noqa: E402
from megdiffusion.training.trainer import Trainer  # noqa: E402

# Two levels (a downsample) and attention at 4x4: every layer kind of the UNet, on 8x8 images.
SMALL = dict(channel_mult=(1, 2), attention_resolutions=(4,), lr=1e-3)
# The same network as pytorch-ddpm builds it: every option the twin has to follow, the other way round.
PYTORCH_DDPM = dict(downsample_padding="symmetric", time_embedding="pytorch_ddpm", norm_eps=1e-5)


def batch(n):
    return np.random.default_rng(5).uniform(-1, 1, (n, 1, 8, 8)).astype(np.float32)


def test_megdiffusion_side_writes_what_the_twin_reads_and_times_the_real_step(tmp_path, tiny_config):
    cfg = tiny_config(**SMALL)
    megdiffusion_side.write_prepared(tmp_path, "tiny", cfg, batch(4))
    prepared = json.loads((tmp_path / "tiny.json").read_text())
    assert TrainConfig.from_dict(prepared["config"]) == cfg
    assert prepared["betas"] == build_diffusion(cfg).betas.tolist()
    assert TrainConfig.from_dict({}).to_dict() == prepared["legacy"]
    _, x0, weights = megdiffusion_side.read_prepared(tmp_path, "tiny")
    initial = megdiffusion_side.weights_of(Trainer(cfg).model)
    assert weights.keys() == initial.keys() and all(np.array_equal(weights[k], initial[k]) for k in weights)

    (line,) = megdiffusion_side.reference(tmp_path, ["tiny"], paper=False)
    entry = json.loads((tmp_path / "reference.json").read_text())["configs"]["tiny"]
    assert line["params"] == entry["total"] == sum(v.size for v in initial.values())
    assert [s["lr"] for s in entry["steps"]] == [5e-4, 1e-3]  # the check's warmup over 2 steps
    ref = np.load(tmp_path / "tiny_reference.npz")
    init = {k[len("init."):]: ref[k] for k in ref.files if k.startswith("init.")}
    model = build_model(TrainConfig.from_dict(entry["step_config"]))
    model.load_state_dict(init)
    model.eval()
    y = model(megdiffusion_side.mge.tensor(ref["x"]), megdiffusion_side.mge.tensor(ref["t"])).numpy()
    np.testing.assert_allclose(y, ref["y"], rtol=1e-5, atol=1e-6 * np.abs(y).max())
    assert np.abs(y).max() > 0.5  # randomised weights: the output is not the init's near-zero
    moved = max(np.abs(ref[f"model.{k}"] - init[k]).max() for k in init)
    assert 5e-4 < moved < 2 * 1.5e-3 + 1e-6  # Adam moved the weights by about the summed lr

    args = argparse.Namespace(work_dir=tmp_path, model="tiny", round=0, warmup=0, steps=2)
    row = megdiffusion_side.train(args)
    reference_trainer = Trainer(cfg)
    with reference_trainer.state() as state:
        state.model.load_state_dict(weights)
    losses = [reference_trainer.step(x0)["loss"] for _ in range(2)]
    assert row["images"] == 8 and row["images_per_s"] > 0 and row["loss"] == round(losses[-1], 6)
    args = argparse.Namespace(work_dir=tmp_path, model="tiny", round=0, batch=3, sample_steps=2, sampler="ddim")
    row = megdiffusion_side.ddim(args)
    assert row["images"] == 3 and row["seconds_per_image"] > 0 and row["sampler"] == "ddim"
    row = megdiffusion_side.ddim(argparse.Namespace(**{**vars(args), "sampler": "heun", "sample_steps": 3}))
    assert row["sampler"] == "heun" and row["sample_steps"] == 3  # Heun-2: 3 network calls, as DDIM-3


def test_solvers_are_checked_before_anything_runs(capsys):
    for argv, message in ((["--sample", "--solvers", "dpmpp_2m,rk4"], "unknown --solvers rk4"),
                          (["--sample", "--solvers", "heun", "--sample_steps", "50"], "heun makes an odd number")):
        with pytest.raises(SystemExit):
            vs_pytorch.parse_args(argv)
        assert message in capsys.readouterr().err
    assert vs_pytorch.parse_args(["--sample", "--solvers", "unipc,heun", "--sample_steps", "9"]).solvers == [
        "unipc", "heun"]


def test_torch_python_errors_say_what_to_do(monkeypatch):
    with pytest.raises(vs_pytorch.BenchmarkError, match="--torch_python /no/such/python: cannot run it"):
        vs_pytorch.torch_python("/no/such/python")
    monkeypatch.delenv(vs_pytorch.TORCH_PYTHON_ENV, raising=False)
    monkeypatch.setattr(vs_pytorch.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(vs_pytorch.BenchmarkError, match=r"install the bench extra .*or pass --torch_python"):
        vs_pytorch.torch_python()


@pytest.fixture(scope="module")
def twin_python():
    try:
        return vs_pytorch.torch_python()
    except vs_pytorch.BenchmarkError as err:
        pytest.skip(str(err))


def run_twin(python, *args):
    return subprocess.run([python, str(ROOT / "benchmarks" / "pytorch_twin.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=300)


def test_twin_equals_megdiffusion_with_either_network_variant_and_catches_a_mismatch(tmp_path, tiny_config,
                                                                                     twin_python):
    for name, options in (("ho", {}), ("pytorch_ddpm", PYTORCH_DDPM)):
        megdiffusion_side.write_prepared(tmp_path, name, tiny_config(**SMALL, **options), batch(2))
    megdiffusion_side.reference(tmp_path, ["ho", "pytorch_ddpm"], paper=False)
    result = run_twin(twin_python, "check", tmp_path)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(r["check"], r["config"]) for r in lines] == [("parameters", "ho"), ("same_weights", "ho"),
                                                         ("parameters", "pytorch_ddpm"),
                                                         ("same_weights", "pytorch_ddpm")]
    assert all(r["forward_max_err"] < 2e-5 for r in lines if r["check"] == "same_weights")

    # The pytorch_ddpm reference, but the twin told to build Ho's padding: the check must fail on the outputs.
    reference = json.loads((tmp_path / "reference.json").read_text())
    del reference["configs"]["ho"]
    for key in ("config", "step_config"):
        reference["configs"]["pytorch_ddpm"][key]["downsample_padding"] = "bottom_right"
    (tmp_path / "reference.json").write_text(json.dumps(reference))
    result = run_twin(twin_python, "check", tmp_path)
    assert result.returncode != 0 and "pytorch_ddpm: forward error" in result.stderr

    # A choice the twin does not implement is refused, in one line, before anything runs.
    megdiffusion_side.write_prepared(tmp_path, "xstart", tiny_config(**SMALL, mean_type="xstart"), batch(2))
    result = run_twin(twin_python, "train", tmp_path, "xstart")
    assert result.returncode != 0
    assert result.stderr.strip() == "pytorch_twin.py train: xstart: the PyTorch twin implements mean_type eps, " \
                                    "not 'xstart'"
