"""The recipes' networks exported: sizes, agreement with the checkpoint and ms per forward, eager vs .mge vs ONNX.

    .venv/bin/python benchmarks/export.py [--models cpu_recipe,cpu_recipe_classes,cifar10,iddpm_cifar10]
        [--batches 1,64] [--repeats 3] [--torch_python /path/to/python-with-diffusers] [--workdir DIR]
    .venv/bin/python benchmarks/export.py --models cpu_recipe --batches 1,2 --repeats 1   # seconds: a check

Each network has its recipe's shape and random weights (the initial ones, perturbed so that layers initialised to
zero count). It is saved as a checkpoint and exported with ``Model.export``: a ``.mge`` per batch size, traced at that
batch, and one ONNX file. Per batch it prints one JSON line per runtime: the relative difference (max |diff| / max
|ref|) to the checkpoint's output on random inputs and the best of ``--repeats`` timed forwards after one untimed:
``eager`` (``megdiffusion.load(ckpt)(x, t)``, MegEngine as the samplers call it), ``mge`` (``megdiffusion.load(.mge)``:
MegEngine Lite) and ``onnx`` (onnxruntime's CPU provider, in its own process, as the tests run it). With
``--torch_python``, diffusers' ``UNet2DModel`` and two ``DDPMScheduler`` steps of the exported pipeline are compared
too (``tests/diffusers_side.py``); a network diffusers cannot describe gets its refusal printed.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from megdiffusion.compat import quiet_megengine

quiet_megengine()
import megdiffusion  # noqa: E402
from megdiffusion.formats import ConvertError  # noqa: E402
from megdiffusion.scripts.cli import config_from_flagfile  # noqa: E402
from megdiffusion.training import checkpoint  # noqa: E402
from megdiffusion.training.config import build_model  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CIFAR_SHAPED = "cifar_shaped.npz"  # random 32x32 RGB images in the work directory, for the recipes' CIFAR-10
MODELS = {  # name: (recipe, flags changed)
    "cpu_recipe": ("configs/fashion_mnist_cpu.cfg", {}),
    "cpu_recipe_classes": ("configs/fashion_mnist_cpu.cfg", {"num_classes": 10}),
    "cifar10": ("configs/cifar10.cfg", {"dataset": "npz", "data_path": CIFAR_SHAPED}),
    "iddpm_cifar10": ("configs/iddpm_cifar10.cfg", {"dataset": "npz", "data_path": CIFAR_SHAPED}),
}


def onnxruntime_worker(onnx_path, feeds_path, out_path, repeats):
    """In its own process: onnxruntime's output on the feeds, written to ``out_path``, and its best time, printed."""
    import onnxruntime

    session = onnxruntime.InferenceSession(onnx_path, providers=["CPUExecutionProvider"])
    feeds = dict(np.load(feeds_path))
    seconds, out = best_time(lambda: session.run(["out"], feeds)[0], repeats)
    np.save(out_path, out)
    print(json.dumps({"seconds": seconds, "version": onnxruntime.__version__}))


def best_time(fn, repeats):
    """(the fastest of ``repeats`` timed calls of ``fn`` after an untimed one, in seconds; the last result)."""
    result, times = fn(), []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return min(times), result


def perturbed_weights(cfg, seed):
    """The initial weights of ``cfg``'s network plus noise of a tenth of each tensor's spread (0.01 where it is 0)."""
    rng = np.random.default_rng(seed)
    weights = {}
    for name, value in build_model(cfg).state_dict().items():
        value = np.asarray(value, np.float32)
        spread = float(value.std()) or 0.01
        weights[name] = (value + rng.standard_normal(value.shape) * 0.1 * spread).astype(np.float32)
    return weights


def relative(got, ref):
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def inputs(model, batch, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, model.image_channels, model.image_size, model.image_size)).astype(np.float32)
    t = rng.integers(0, model.num_timesteps, batch)
    y = rng.integers(0, model.num_classes, batch) if model.num_classes else None
    return x, t, y


def measure(name, args, workdir):
    recipe, changes = MODELS[name]
    if "data_path" in changes:
        changes = {**changes, "data_path": os.path.join(workdir, changes["data_path"])}
        images = np.random.default_rng(0).integers(0, 256, (128, 32, 32, 3), dtype=np.uint8)  # a batch
        np.savez(changes["data_path"], images)
    cfg, _ = config_from_flagfile(os.path.join(REPO, recipe), **changes)
    ckpt = os.path.join(workdir, f"{name}.pkl")
    checkpoint.save_checkpoint(ckpt, checkpoint.weights_snapshot(cfg, perturbed_weights(cfg, 0), {"format": "bench"}))
    model = megdiffusion.load(ckpt)
    parameters = sum(value.size for value in model.state_dict().values())
    sizes = {"checkpoint": os.path.getsize(ckpt)}
    onnx_path = os.path.join(workdir, f"{name}.onnx")
    model.export(onnx_path, "onnx")
    sizes["onnx"] = os.path.getsize(onnx_path)
    for batch in args.batches:
        mge_path = os.path.join(workdir, f"{name}_b{batch}.mge")
        model.export(mge_path, "mge", batch_size=batch)
        sizes[f"mge_b{batch}"] = os.path.getsize(mge_path)
        deployed = megdiffusion.load(mge_path)
        x, t, y = inputs(model, batch, seed=batch)
        eager_s, ref = best_time(lambda: model(x, t, y), args.repeats)
        mge_s, mge_out = best_time(lambda: deployed(x, t, y), args.repeats)
        onnx_s, onnx_out = run_onnxruntime(model, onnx_path, x, t, y, args.repeats, workdir)
        common = {"model": name, "parameters": int(parameters), "batch": batch, "cpus": os.cpu_count()}
        for runtime, seconds, out in (("eager", eager_s, ref), ("mge", mge_s, mge_out), ("onnx", onnx_s, onnx_out)):
            print(json.dumps({**common, "runtime": runtime, "ms_per_forward": round(seconds * 1000, 2),
                              "relative_diff": relative(out, ref), "load": round(os.getloadavg()[0], 2)}),
                  flush=True)
    if args.torch_python:
        sizes.update(compare_diffusers(model, name, args.torch_python, workdir))
    print(json.dumps({"model": name, "bytes": sizes}), flush=True)


def run_onnxruntime(model, onnx_path, x, t, y, repeats, workdir):
    """onnxruntime's (best seconds, output) on the inputs, from a fresh process of this script."""
    feeds = {"x": x, "t": np.asarray(model.diffusion.model_timesteps(t), np.float32)}
    if y is not None:
        feeds["y"] = y.astype(np.int32)
    feeds_path, out_path = os.path.join(workdir, "feeds.npz"), os.path.join(workdir, "out.npy")
    np.savez(feeds_path, **feeds)
    result = subprocess.run([sys.executable, __file__, "--onnxruntime_worker", onnx_path, feeds_path, out_path,
                             str(repeats)], capture_output=True, text=True, check=True)
    return json.loads(result.stdout.splitlines()[-1])["seconds"], np.load(out_path)


def compare_diffusers(model, name, torch_python, workdir):
    """diffusers' UNet2DModel and two DDPMScheduler steps against ours; the pipeline's size, as {"diffusers": bytes}."""
    pipe = os.path.join(workdir, f"{name}_diffusers")
    try:
        model.export(pipe, "diffusers")
    except ConvertError as refused:
        print(json.dumps({"model": name, "runtime": "diffusers", "refused": str(refused)}), flush=True)
        return {}
    import megengine as mge

    x, t, y = inputs(model, 3, seed=0)
    x_T = np.random.default_rng(1).standard_normal(x.shape).astype(np.float32)
    np.savez(os.path.join(workdir, "in.npz"), x=x, t=t, x_T=x_T, **({"y": y} if y is not None else {}))
    subprocess.run([torch_python, os.path.join(REPO, "tests", "diffusers_side.py"), pipe,
                    os.path.join(workdir, "in.npz"), os.path.join(workdir, "theirs.npz")], check=True,
                   capture_output=True)
    theirs = np.load(os.path.join(workdir, "theirs.npz"))
    labels = {"y": mge.tensor(y, dtype="int32")} if y is not None else {}
    sample, steps_diff = mge.tensor(x_T), []
    for step, noise, expected in zip(theirs["timesteps"], theirs["noises"], theirs["samples"]):
        steps = mge.tensor(np.full(len(x_T), step, np.int32))
        sample, _ = model.diffusion.p_sample_step(lambda h, s: model.network(h, s, **labels), sample, steps,
                                                  noise=mge.tensor(noise))
        steps_diff.append(relative(sample.numpy(), expected))
    print(json.dumps({"model": name, "runtime": "diffusers", "relative_diff": relative(theirs["out"], model(x, t, y)),
                      "ddpm_steps_relative_diff": max(steps_diff)}), flush=True)
    weights = os.path.join(pipe, "unet", "diffusion_pytorch_model.safetensors")
    return {"diffusers": os.path.getsize(weights)}


def main():
    if sys.argv[1:2] == ["--onnxruntime_worker"]:
        onnx_path, feeds_path, out_path, repeats = sys.argv[2:]
        return onnxruntime_worker(onnx_path, feeds_path, out_path, int(repeats))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--batches", default="1,64", help="comma-separated batch sizes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--torch_python", help="a python with torch and diffusers: compare diffusers' side too")
    parser.add_argument("--workdir", help="where the checkpoints and exports go (default: a temporary directory)")
    args = parser.parse_args()
    args.batches = [int(batch) for batch in args.batches.split(",")]
    with tempfile.TemporaryDirectory() as scratch:
        workdir = args.workdir or scratch
        os.makedirs(workdir, exist_ok=True)
        for name in args.models.split(","):
            measure(name, args, workdir)


if __name__ == "__main__":
    main()
