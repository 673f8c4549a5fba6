"""Milliseconds of one group's numpy pass (``megdiffusion.cpu.numpy_unet``) in this process: the training pass
(forward, loss, backward) and the eval pass, and with ``--profile`` where the time goes (cProfile, by function).

    .venv/bin/python benchmarks/numpy_pass.py --model cifar --profile

One process, one thread (as each worker process runs a group); the machine's other core idle. ``cifar`` is
``train_step.cifar_shaped`` (64 channels, (1,2,2,2), attention at 16, ``--blocks`` residual blocks per level),
``cpu`` the CPU recipe's network. Prints one JSON line per pass, then the profiles.
"""
import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.train_step import cifar_shaped, cpu_recipe  # noqa: E402
from megdiffusion.compat import quiet_megengine  # noqa: E402
from megdiffusion.cpu import fused, numpy_unet  # noqa: E402
from megdiffusion.cpu.batch_threads import one_blas_thread  # noqa: E402
from megdiffusion.cpu.group_workers import keep_freed_memory  # noqa: E402
from megdiffusion.nn.layers import timestep_embedding  # noqa: E402
from megdiffusion.training.config import build_model  # noqa: E402

mge = quiet_megengine()


def passes(cfg, x):
    """The training and eval pass of one group ``x`` through ``cfg``'s network, as functions of nothing."""
    model = build_model(cfg)
    params = list(model.parameters())
    described = numpy_unet.describe(model, params)
    weights = [p.numpy() for p in params]
    grads = [np.zeros_like(w) for w in weights]
    n = len(x)
    t = mge.tensor(np.linspace(0, 999, n).astype(np.int32))
    temb = timestep_embedding(t, model.model_channels, model.time_embedding).numpy()
    doutput = np.random.default_rng(1).standard_normal(x.shape).astype(np.float32)  # a loss's gradient, standing in
    prepared = {}

    def train():
        _, backward = numpy_unet.training_pass(described, weights, grads, x, temb, None, 0)
        backward(doutput)

    return {"train": train, "eval": lambda: numpy_unet.unet_output(described, weights, x, temb, prepared=prepared)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("cpu", "cifar"), default="cifar")
    parser.add_argument("--blocks", type=int, default=1, help="residual blocks per level of the cifar model")
    parser.add_argument("--group", type=int, default=8, help="samples in the group")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--profile", action="store_true", help="also print the 15 costliest functions per pass")
    args = parser.parse_args()
    keep_freed_memory()
    cfg, x0 = cpu_recipe(args.group) if args.model == "cpu" else cifar_shaped(args.group, args.blocks)
    profiles = []
    with one_blas_thread():
        for name, run in passes(cfg, x0[:args.group]).items():
            for _ in range(3):  # warm-up: plans, compiled kernels, memory
                run()
            start = time.perf_counter()
            for _ in range(args.repeats):
                run()
            ms = (time.perf_counter() - start) / args.repeats * 1e3
            print(json.dumps({"model": args.model, "pass": name, "group": args.group, "ms": round(ms, 2),
                              "compiled_kernels": fused.available()}), flush=True)
            if args.profile:
                profile = cProfile.Profile()
                profile.enable()
                for _ in range(args.repeats):
                    run()
                profile.disable()
                out = io.StringIO()
                pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(15)
                profiles.append(f"# {name} pass, {args.repeats} repeats\n{out.getvalue()}")
    print("\n".join(profiles))


if __name__ == "__main__":
    main()
