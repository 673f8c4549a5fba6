"""Images/s of the FID Inception forward (299x299 input -> pool3), both routes; prints JSON lines.

    python benchmarks/fid_features.py [--batch_sizes 16,50] [--repeats 2] [--routes numpy,megengine]
"""
import argparse
import json
import time

import numpy as np

from megdiffusion.compat import quiet_megengine

quiet_megengine()
from megdiffusion.metrics.fid import preprocess  # noqa: E402
from megdiffusion.metrics.inception import build_inception  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch_sizes", default="16,50")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--routes", default="numpy,megengine")
    args = parser.parse_args()
    for route in args.routes.split(","):
        net = build_inception(fast_cpu=route == "numpy")
        for batch_size in (int(b) for b in args.batch_sizes.split(",")):
            images = np.random.default_rng(0).integers(0, 256, (batch_size, 32, 32, 3), dtype=np.uint8)
            start = time.perf_counter()
            x = preprocess(images)
            preprocess_s = time.perf_counter() - start
            net(x[:2])  # warm-up
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                net(x)
                times.append(time.perf_counter() - start)
            best = min(times)
            print(json.dumps({"benchmark": "fid_inception_forward", "route": route, "batch_size": batch_size,
                              "images_per_s": round(batch_size / best, 3),
                              "seconds_per_batch": round(best, 3),
                              "preprocess_32px_s": round(preprocess_s, 4)}), flush=True)


if __name__ == "__main__":
    main()
