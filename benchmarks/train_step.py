"""Training-step throughput, native convolutions vs the fast numpy path, side by side in one process.

Times ``Trainer.step`` (training loss, GradManager backward, gradient clipping, Adam, EMA; on the fast path
the update too is numpy's, ``megdiffusion.cpu.flat_update``) on two models:

- ``cpu``: the CPU recipe, configs/fashion_mnist_cpu.cfg (its model and batch size; 28x28 gray);
- ``cifar``: a CIFAR-10-shaped small model (3x32x32, 64 channels, mult 1,2,2,2, attention at 16,
  1 residual block per level, batch 16).

The two paths alternate (native, fast, native, fast, ...) so that machine load hits both alike. Prints one
JSON line per measurement, then per model a summary line with the median images/s of each path and
their ratio (fast / native); ``cpu_seconds_ratio`` compares the CPU time of a step (all threads),
which is steadier than wall time on a loaded machine.

    python benchmarks/train_step.py                       # both models, 2 rounds, 1 step per measurement
    python benchmarks/train_step.py --models cpu --rounds 3 --steps 2
    python benchmarks/train_step.py --paths fast          # the fast path only
    python benchmarks/train_step.py --models cpu --paths fast,profiles --rounds 6   # post-hoc EMA's cost

``profiles``: the fast path tracking post-hoc EMA profiles (``--ema_profiles``, default EDM2's 0.05,0.10); with
``fast`` beside it the summary gives ``profiles_cost``, the share of a step they add (wall and CPU time).
"""
import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megdiffusion.compat import quiet_megengine  # noqa: E402

quiet_megengine()
from megdiffusion.files.images import to_float  # noqa: E402
from megdiffusion.cpu.choice import use_cpu_engine  # noqa: E402
from megdiffusion.training.config import CPU_RECIPE, TrainConfig  # noqa: E402
from megdiffusion.scripts.cli import config_from_flagfile  # noqa: E402
from megdiffusion.training.trainer import Trainer  # noqa: E402



def cpu_recipe(batch_size=None):
    """Config and a real batch of the CPU recipe (its flagfile; batch size overridden when given)."""
    cfg, images = config_from_flagfile(CPU_RECIPE, **({"batch_size": batch_size} if batch_size else {}))
    return cfg, to_float(images[:cfg.batch_size])


def cifar_shaped(batch_size, num_res_blocks):
    """A CIFAR-10-shaped small model and a random batch in [-1, 1]."""
    cfg = TrainConfig(image_size=32, image_channels=3, model_channels=64, channel_mult=(1, 2, 2, 2),
                      num_res_blocks=num_res_blocks, attention_resolutions=(16,), dropout=0.1,
                      batch_size=batch_size)
    x0 = np.random.default_rng(0).uniform(-1, 1, (batch_size, 3, 32, 32)).astype(np.float32)
    return cfg, x0


def measure(trainer, x0, steps):
    """Wall seconds and CPU seconds (all threads of this process) of ``steps`` training steps."""
    start, start_cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        trainer.step(x0)
    return time.perf_counter() - start, time.process_time() - start_cpu


def run(name, cfg, x0, rounds, steps, paths, profiles):
    trainers = {}
    for path in paths:  # one trainer per engine, from the same weights; a warm-up step each, not timed
        use_cpu_engine(path != "native")
        trainers[path] = Trainer(cfg.replace(ema_profiles=profiles) if path == "profiles" else cfg)
        trainers[path].step(x0)
    rates = {path: [] for path in paths}
    cpu_seconds = {path: [] for path in paths}
    for round_index in range(rounds):
        for path in paths:
            use_cpu_engine(path != "native")  # the convolutions choose at each call
            seconds, cpu = measure(trainers[path], x0, steps)
            rates[path].append(steps * len(x0) / seconds)
            cpu_seconds[path].append(cpu / steps)
            print(json.dumps({"model": name, "path": path, "round": round_index, "steps": steps,
                              "batch": len(x0), "seconds": round(seconds, 3), "cpu_seconds": round(cpu, 3),
                              "images_per_s": round(rates[path][-1], 3)}), flush=True)
    summary = {}
    for path in paths:
        summary[f"{path}_images_per_s"] = round(statistics.median(rates[path]), 3)
        summary[f"{path}_cpu_seconds_per_step"] = round(statistics.median(cpu_seconds[path]), 3)
    if {"fast", "profiles"} <= set(paths):
        summary["profiles_cost"] = round(1 - statistics.median(rates["profiles"]) / statistics.median(rates["fast"]), 4)
        summary["profiles_cpu_cost"] = round(statistics.median(cpu_seconds["profiles"])
                                             / statistics.median(cpu_seconds["fast"]) - 1, 4)
    if {"fast", "native"} <= set(paths):
        summary["ratio"] = round(statistics.median(rates["fast"]) / statistics.median(rates["native"]), 2)
        summary["cpu_seconds_ratio"] = round(statistics.median(cpu_seconds["native"])
                                             / statistics.median(cpu_seconds["fast"]), 2)
    print(json.dumps({"model": name, "summary": True, **summary, "cpus": os.cpu_count(),
                      "image_size": cfg.image_size, "channels": cfg.image_channels,
                      "model_channels": cfg.model_channels, "channel_mult": list(cfg.channel_mult),
                      "num_res_blocks": cfg.num_res_blocks,
                      "attention_resolutions": list(cfg.attention_resolutions)}), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="cpu,cifar", help="comma-separated: cpu, cifar")
    parser.add_argument("--paths", default="native,fast", help="comma-separated: native, fast (the fast path "
                        "alone skips MegEngine's slow native convolutions), profiles (fast with --ema_profiles)")
    parser.add_argument("--ema_profiles", default="0.05,0.10", help="the profiles of the profiles path")
    parser.add_argument("--rounds", type=int, default=2, help="native/fast pairs per model")
    parser.add_argument("--steps", type=int, default=1, help="training steps per measurement")
    parser.add_argument("--cpu_batch", type=int, default=None, help="batch size of the cpu model "
                        "(default: the recipe's)")
    parser.add_argument("--cifar_batch", type=int, default=16, help="batch size of the cifar model")
    parser.add_argument("--cifar_res_blocks", type=int, default=1, help="residual blocks per level (cifar)")
    args = parser.parse_args()
    models = args.models.split(",")
    unknown = sorted(set(models) - {"cpu", "cifar"})
    if unknown:
        parser.error(f"unknown --models {','.join(unknown)}; choose from cpu, cifar")
    paths = [path for path in ("native", "fast", "profiles") if path in args.paths.split(",")]
    if not paths or sorted(set(args.paths.split(",")) - {"native", "fast", "profiles"}):
        parser.error(f"--paths takes native, fast and/or profiles, not {args.paths}")
    counts = [args.rounds, args.steps, args.cifar_batch, args.cifar_res_blocks]
    if min(counts) < 1 or (args.cpu_batch is not None and args.cpu_batch < 1):
        parser.error("--rounds, --steps, --cpu_batch, --cifar_batch and --cifar_res_blocks must be >= 1")
    for name in models:
        if name == "cpu":
            cfg, x0 = cpu_recipe(args.cpu_batch)
        else:
            cfg, x0 = cifar_shaped(args.cifar_batch, args.cifar_res_blocks)
        run(name, cfg, x0, args.rounds, args.steps, paths, args.ema_profiles)


if __name__ == "__main__":
    main()
