"""The host's share of a training step left on its critical path: a batch and its random draws, made in the step
or ahead by data workers (``megdiffusion.training.feed.StepFeed``).

A GPU step leaves the host waiting; this benchmark stands in for it with ``time.sleep(--step_ms)`` and times what
the training loop itself spends between two steps: ``StepFeed.next`` (the batch's images read from a prepared file by
memory map, flipped and converted to float, and the step's per-sample draws: timesteps, noise), with 0 workers (all
of it in the loop, as before the feed) and with 1 and 2 workers (made ahead while the step runs). Two recipes:

- ``256``: the paper's 256x256 recipe (configs/celebahq256.cfg): batch 64 of 3x256x256;
- ``cifar``: the CIFAR-10 recipe (configs/cifar10.cfg): batch 128 of 3x32x32.

Prints a JSON line per measurement (median and mean ms of ``next`` per step, and the same with the workers' first
steps left out) and a markdown table.

    python benchmarks/step_feed.py                       # both recipes, workers 0,1,2, 30 steps, 150 ms steps
    python benchmarks/step_feed.py --recipes 256 --workers 0,1 --steps 20 --step_ms 300
"""
import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megdiffusion.data.datasets import load_dataset  # noqa: E402
from megdiffusion.data.loader import BatchLoader  # noqa: E402
from megdiffusion.data.prepared import prepare  # noqa: E402
from megdiffusion.data.sources import ArraySource  # noqa: E402
from megdiffusion.training.config import TrainConfig  # noqa: E402
from megdiffusion.training.draws import PER_SAMPLE, draw_step  # noqa: E402
from megdiffusion.training.feed import StepFeed  # noqa: E402

RECIPES = {"256": (64, 256), "cifar": (128, 32)}  # batch, image size


def measure(path, batch, workers, steps, step_ms, warmup):
    """Per-step seconds of ``StepFeed.next`` over ``steps`` steps, each followed by a ``step_ms`` sleep."""
    images = load_dataset("prepared", path)
    cfg = TrainConfig(batch_size=batch, image_size=images.shape[1])
    loader = BatchLoader(images, batch, seed=0, random_flip=True)
    feed = StepFeed(loader, functools.partial(draw_step, PER_SAMPLE, cfg, 1000), workers)
    times = []
    try:
        for step in range(warmup + steps):
            start = time.perf_counter()
            x0, _, draws = feed.next(step)
            times.append(time.perf_counter() - start)
            assert x0.shape == draws.noise.shape == (batch, 3, images.shape[1], images.shape[1])
            time.sleep(step_ms / 1000)
    finally:
        feed.close()
    return times[warmup:]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", default="256,cifar", help="comma-separated: 256, cifar")
    parser.add_argument("--workers", default="0,1,2", help="comma-separated data worker counts")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per measurement")
    parser.add_argument("--warmup", type=int, default=3, help="untimed first steps (the workers' start)")
    parser.add_argument("--step_ms", type=float, default=150.0, help="the stand-in GPU step, milliseconds")
    parser.add_argument("--images", type=int, default=1024, help="images in the synthetic prepared file")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for recipe in args.recipes.split(","):
            batch, size = RECIPES[recipe]
            path = os.path.join(workdir, f"{recipe}.data")
            pixels = np.random.default_rng(0).integers(0, 256, (args.images, size, size, 3), dtype=np.uint8)
            prepare(ArraySource(pixels, None, "synthetic"), path, size, workers=0)
            del pixels
            for workers in map(int, args.workers.split(",")):
                times = measure(path, batch, workers, args.steps, args.step_ms, args.warmup)
                row = {"recipe": recipe, "batch": batch, "size": size, "workers": workers, "step_ms": args.step_ms,
                       "steps": args.steps, "median_ms": round(1000 * statistics.median(times), 2),
                       "mean_ms": round(1000 * statistics.mean(times), 2), "max_ms": round(1000 * max(times), 2),
                       "cpus": os.cpu_count(), "load": round(os.getloadavg()[0], 2)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    print("\n| recipe | batch | data workers | host ms per step on the critical path (median / mean / max) |")
    print("|---|---|---|---|")
    for row in rows:
        print(f"| {row['recipe']} ({row['size']}x{row['size']}) | {row['batch']} | {row['workers']} | "
              f"{row['median_ms']} / {row['mean_ms']} / {row['max_ms']} |")


if __name__ == "__main__":
    main()
