"""Seconds per image of DDPM-1000 and DDIM-50/100 side by side, and eager vs jit-traced denoising steps; with
``--job N``, a ``sample`` job of N images with the sampling network built once (``sample_to_directory``) against once
per batch (``generate_images`` per batch, what ``sample`` did before), alternating.

    .venv/bin/python benchmarks/sample.py [--config configs/fashion_mnist_cpu.cfg] [--batch_size 16]
    .venv/bin/python benchmarks/sample.py --job 64 --batch_size 16 --samplers ddim-20 --rounds 3
    .venv/bin/python benchmarks/sample.py --batch_size 2 --repeats 1 --samplers ddim-2,ddpm-3   # seconds: a check

Prints one JSON line per measurement. Weights are freshly initialised: speed does not depend on them.
"""
import argparse
import json
import tempfile
import time

import numpy as np

from megdiffusion.compat import quiet_megengine

mge = quiet_megengine()
from megengine import jit  # noqa: E402

from megdiffusion.diffusion.generation import generate_images  # noqa: E402
from megdiffusion.diffusion.sampler_settings import SamplerSettings  # noqa: E402
from megdiffusion.sampling.jobs import sample_to_directory  # noqa: E402
from megdiffusion.training.config import CPU_RECIPE, build_diffusion, build_model  # noqa: E402
from megdiffusion.scripts.cli import config_from_flagfile  # noqa: E402


def time_steps(fn, x, t, repeats):
    fn(x, t).numpy()  # warm-up (and trace compilation)
    start = time.perf_counter()
    for _ in range(repeats):
        fn(x, t).numpy()
    return (time.perf_counter() - start) / repeats


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=CPU_RECIPE)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--samplers", default="ddim-50,ddim-100,ddpm",
                        help="comma-separated SAMPLER-STEPS timed one after the other (no -STEPS: the model's T)")
    parser.add_argument("--job", type=int, default=0, help="images of a sample job (0: time single calls instead)")
    parser.add_argument("--rounds", type=int, default=2, help="--job: alternating rounds of the two ways")
    args = parser.parse_args()

    cfg, _ = config_from_flagfile(args.config)
    model, diffusion = build_model(cfg), build_diffusion(cfg)
    model.eval()
    if args.job:
        return time_job(model, diffusion, cfg, args)
    shape = (args.batch_size,) + cfg.image_shape
    x = mge.tensor(np.random.default_rng(0).standard_normal(shape).astype(np.float32))
    t = mge.tensor(np.full((args.batch_size,), 500, np.int32))

    # One denoising network call: eager vs traced, alternating so that machine load affects both alike.
    traced = jit.trace(lambda x, t: model(x, t), symbolic=True, capture_as_const=True)
    eager_s, traced_s = [], []
    for _ in range(2):
        eager_s.append(time_steps(model, x, t, args.repeats))
        traced_s.append(time_steps(traced, x, t, args.repeats))
    for mode, seconds in (("eager", min(eager_s)), ("traced", min(traced_s))):
        print(json.dumps({"benchmark": "denoise_step", "mode": mode, "batch_size": args.batch_size,
                          "seconds_per_step": round(seconds, 5)}), flush=True)
    print(json.dumps({"benchmark": "denoise_step", "traced_speedup": round(min(eager_s) / min(traced_s), 3)}))

    # Whole samplers, one after the other in this run.
    seeds = list(range(args.batch_size))
    for sampler, _, steps in (name.partition("-") for name in args.samplers.split(",")):
        steps = int(steps or cfg.num_timesteps)
        start = time.perf_counter()
        diffusion.sample(model, shape, sampler=sampler, steps=steps, seeds=seeds).numpy()
        seconds = time.perf_counter() - start
        print(json.dumps({"benchmark": "sample", "sampler": f"{sampler}-{steps}", "batch_size": args.batch_size,
                          "image_size": cfg.image_size, "seconds_per_image": round(seconds / args.batch_size, 4),
                          "images_per_s": round(args.batch_size / seconds, 3)}), flush=True)


def time_job(model, diffusion, cfg, args):
    """``--job``: the first sampler of ``--samplers`` over ``args.job`` images, both ways, the faster round of each."""
    sampler, _, steps = args.samplers.split(",")[0].partition("-")
    steps = int(steps or cfg.num_timesteps)
    batches = [range(start, min(start + args.batch_size, args.job)) for start in range(0, args.job, args.batch_size)]
    seconds = {"once_per_job": [], "once_per_batch": []}
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as output:
            start = time.perf_counter()
            sample_to_directory(model, diffusion, cfg.image_shape, output, args.job, 0,
                                SamplerSettings(sampler, steps), batch_size=args.batch_size, progress=False)
            seconds["once_per_job"].append(time.perf_counter() - start)
        start = time.perf_counter()
        for indices in batches:
            generate_images(model, diffusion, cfg.image_shape, indices, 0, SamplerSettings(sampler, steps),
                            batch_size=args.batch_size)
        seconds["once_per_batch"].append(time.perf_counter() - start)
    best = {way: min(values) for way, values in seconds.items()}
    print(json.dumps({"benchmark": "sample_job", "sampler": f"{sampler}-{steps}", "images": args.job,
                      "batch_size": args.batch_size, **{f"{way}_s": round(v, 3) for way, v in best.items()},
                      "speedup": round(best["once_per_batch"] / best["once_per_job"], 3)}), flush=True)


if __name__ == "__main__":
    main()
