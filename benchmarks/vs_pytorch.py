"""megdiffusion against PyTorch on the same CPU: the same UNet, training step, batch and DDIM sampler.

The PyTorch side is ``pytorch_twin.py`` (torch + numpy only, run by ``--torch_python``); megdiffusion's is
``megdiffusion_side.py`` (run by this interpreter). Models: ``cpu``, the CPU recipe
(configs/fashion_mnist_cpu.cfg, a batch of its images) and ``cifar``, the CIFAR-shaped model of
``train_step.py`` (3x32x32, 64 channels, 1 residual block per level, a random batch of 16).

1. Check (``--no_check`` skips it): the twin's parameter names, shapes and counts equal megdiffusion's for
   each model and for the paper model (35,746,307); with megdiffusion's weights, forward outputs, two training
   steps (loss, grad norm, weights and EMA after them) and a DDIM-5 sample agree (``pytorch_twin.TOLERANCES``).
2. Training: one process per measurement, alternating megdiffusion, torch, megdiffusion, torch, ...: both
   start from the same initial weights, run ``--warmup`` untimed steps, then ``--steps`` timed ones.
3. ``--sample``: the same for one DDIM-``--sample_steps`` sampling call of ``--sample_batch`` images (eval mode;
   the twin's forward under ``no_grad``).

Prints one JSON line per check and measurement, and a summary line per model and mode: the median images/s of
each side, ratio = megdiffusion / torch (above 1: megdiffusion is faster), the same for images per CPU-second
(CPU time of all threads of the process), and for sampling the seconds per image.

    .venv/bin/python benchmarks/vs_pytorch.py --torch_python /path/to/python-with-torch
    .venv/bin/python benchmarks/vs_pytorch.py --models cpu --rounds 3 --sample --no_check
    .venv/bin/python benchmarks/vs_pytorch.py --models cifar --no_train --sample --sample_batch 4

torch is not a dependency of megdiffusion: install the ``bench`` extra (``pip install -e '.[bench]'``) or point
``--torch_python`` (default: $MEGDIFFUSION_TORCH_PYTHON, else this interpreter) at any python with torch.
"""
import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from megdiffusion.diffusion.solvers import HEUN, SOLVERS  # noqa: E402  (numpy only)

TORCH_PYTHON_ENV = "MEGDIFFUSION_TORCH_PYTHON"
MODELS = ("cpu", "cifar")


class BenchmarkError(Exception):
    """A failed step of the benchmark; the message is one line."""


def last_line(text):
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no message"


def torch_python(path=None):
    """The interpreter for the twin: ``path``, else $MEGDIFFUSION_TORCH_PYTHON, else this one if it has torch."""
    path = path or os.environ.get(TORCH_PYTHON_ENV)
    if not path:
        if importlib.util.find_spec("torch") is None:
            raise BenchmarkError(f"no torch in {sys.executable}: install the bench extra (pip install -e '.[bench]') "
                                 "or pass --torch_python PATH, a python with torch and numpy")
        return sys.executable
    has_modules = "import importlib.util as u, sys; sys.exit(not (u.find_spec('torch') and u.find_spec('numpy')))"
    try:
        probe = subprocess.run([path, "-c", has_modules], capture_output=True, text=True, timeout=120)
    except OSError as err:
        raise BenchmarkError(f"--torch_python {path}: cannot run it ({err.strerror or err})") from None
    if probe.returncode:
        raise BenchmarkError(f"--torch_python {path} has no torch or no numpy")
    return path


def run(python, script, *args):
    """Run one side's command in a fresh process; its JSON lines, printed (also those before a failure) and
    returned."""
    result = subprocess.run([python, os.path.join(HERE, script), *map(str, args)], capture_output=True, text=True)
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    for row in rows:
        print(json.dumps(row), flush=True)
    if result.returncode:
        raise BenchmarkError(f"{script} {args[0]} failed (exit {result.returncode}): {last_line(result.stderr)}")
    return rows


def summary(model, mode, rows):
    """Medians of each side's measurements and their ratios (megdiffusion / torch)."""
    sides = {side: [r for r in rows if r["side"] == side] for side in ("megdiffusion", "torch")}
    median = {side: {key: statistics.median(r[key] for r in sides[side])
                     for key in ("images_per_s", "images_per_cpu_s")} for side in sides}
    first = {side: sides[side][0] for side in sides}
    line = {"model": model, "summary": True, "mode": mode, "batch": first["torch"]["batch"],
            "rounds": len(sides["torch"])}
    if mode == "train":
        line.update(steps=first["torch"]["steps"], warmup=first["torch"]["warmup"])
    else:
        steps = first["torch"]["sample_steps"]
        ours = first["megdiffusion"]["sampler"]
        line["sampler"] = f"ddim-{steps}" if ours == "ddim" else f"{ours} ({steps} calls) against ddim-{steps}"
        line.update({f"{side}_seconds_per_image": round(1 / median[side]["images_per_s"], 4) for side in sides})
    line.update({f"{side}_images_per_s": round(median[side]["images_per_s"], 3) for side in sides})
    line["ratio"] = round(median["megdiffusion"]["images_per_s"] / median["torch"]["images_per_s"], 3)
    line.update({f"{side}_images_per_cpu_s": round(median[side]["images_per_cpu_s"], 3) for side in sides})
    line["cpu_ratio"] = round(median["megdiffusion"]["images_per_cpu_s"] / median["torch"]["images_per_cpu_s"], 3)
    line.update({key: first["megdiffusion"][key] for key in ("megengine", "cpu_engine", "onednn")})
    line.update(torch=first["torch"]["torch"], torch_threads=first["torch"]["threads"], cpus=first["torch"]["cpus"],
                load=round(statistics.median(r["load"] for r in rows), 2))
    return line


def alternate(args, tpy, model, mode, options, ours=()):
    """``args.rounds`` measurements per side, megdiffusion first in each round (with ``options`` and ``ours``, the
    twin with ``options``); then the summary line."""
    rows = []
    for round_index in range(args.rounds):
        for python, script, extra in ((sys.executable, "megdiffusion_side.py", ours), (tpy, "pytorch_twin.py", ())):
            rows += run(python, script, mode, args.work_dir, model, "--round", round_index, *options, *extra)
    print(json.dumps(summary(model, mode, rows)), flush=True)


def benchmark(args):
    tpy = torch_python(args.torch_python)
    print(json.dumps({"megdiffusion_python": sys.executable, "torch_python": tpy, "work_dir": args.work_dir,
                      "load": os.getloadavg()}), flush=True)
    batches = [option for name in ("cpu_batch", "cifar_batch") if getattr(args, name) is not None
               for option in (f"--{name}", getattr(args, name))]
    run(sys.executable, "megdiffusion_side.py", "prepare", args.work_dir, "--models", ",".join(args.models), *batches)
    if args.check:
        run(sys.executable, "megdiffusion_side.py", "reference", args.work_dir, "--models", ",".join(args.models))
        run(tpy, "pytorch_twin.py", "check", args.work_dir)
    for model in args.models:
        if args.train:
            alternate(args, tpy, model, "train", ["--warmup", args.warmup, "--steps", args.steps])
        if args.sample:
            sampling = ["--batch", args.sample_batch, "--sample_steps", args.sample_steps]
            alternate(args, tpy, model, "ddim", sampling)
            for solver in args.solvers:  # the twin has DDIM only: the same network calls
                alternate(args, tpy, model, "ddim", sampling, ours=["--sampler", solver])


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="cpu,cifar", help="comma-separated: cpu, cifar")
    parser.add_argument("--rounds", type=int, default=3, help="measurements per side, model and mode")
    parser.add_argument("--steps", type=int, default=3, help="timed training steps per measurement")
    parser.add_argument("--warmup", type=int, default=1, help="untimed training steps before them")
    parser.add_argument("--check", dest="check", action="store_true", default=True,
                        help="compare the twin with megdiffusion before timing (default)")
    parser.add_argument("--no_check", dest="check", action="store_false", help="skip the comparison")
    parser.add_argument("--cpu_batch", type=int, default=None, help="batch of the cpu model (default: the recipe's)")
    parser.add_argument("--cifar_batch", type=int, default=None, help="batch of the cifar model (default: 16)")
    parser.add_argument("--sample", action="store_true", help="also time DDIM sampling")
    parser.add_argument("--no_train", dest="train", action="store_false", help="time only DDIM sampling (--sample)")
    parser.add_argument("--sample_steps", type=int, default=50, help="DDIM steps of --sample")
    parser.add_argument("--sample_batch", type=int, default=16, help="images per DDIM call of --sample")
    parser.add_argument("--solvers", default="", help="with --sample: comma-separated ODE solvers (dpmpp_2m, heun, "
                        "...) that megdiffusion times at --sample_steps network calls against the twin's DDIM")
    parser.add_argument("--torch_python", default=None, help=f"python with torch for the twin (default: "
                        f"${TORCH_PYTHON_ENV}, else this interpreter)")
    parser.add_argument("--work_dir", default=None, help="keep the configs, batches, weights and references "
                        "here (default: a temporary directory, removed after)")
    args = parser.parse_args(argv)
    args.models = args.models.split(",")
    unknown = sorted(set(args.models) - set(MODELS))
    if unknown:
        parser.error(f"unknown --models {','.join(unknown)}; choose from {', '.join(MODELS)}")
    args.solvers = [name for name in args.solvers.split(",") if name]
    unknown = sorted(set(args.solvers) - set(SOLVERS))
    if unknown:
        parser.error(f"unknown --solvers {','.join(unknown)}; choose from {', '.join(SOLVERS)}")
    if HEUN in args.solvers and args.sample_steps % 2 == 0:
        parser.error(f"heun makes an odd number of network calls per image (2 * steps - 1); --sample_steps "
                     f"{args.sample_steps} is even")
    counts = [args.rounds, args.steps, args.sample_steps, args.sample_batch]
    counts += [batch for batch in (args.cpu_batch, args.cifar_batch) if batch is not None]
    if not (args.train or args.sample):
        parser.error("--no_train leaves nothing to time without --sample")
    if min(counts) < 1 or args.warmup < 0:
        parser.error("--rounds, --steps, the batch sizes and --sample_steps must be >= 1, --warmup >= 0")
    return args


def main(argv=None):
    args = parse_args(argv)
    keep = args.work_dir is not None
    args.work_dir = args.work_dir or tempfile.mkdtemp(prefix="vs_pytorch.")
    try:
        benchmark(args)
    except BenchmarkError as err:
        sys.exit(f"vs_pytorch.py: {err}")
    finally:
        if not keep:
            shutil.rmtree(args.work_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
