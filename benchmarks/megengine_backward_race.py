"""MegEngine alone (no megdiffusion): on CPU, the same backward repeated does not always give the same gradients.

Three 3x3 convolutions with biases on one fixed batch; each step runs the forward and backward under a
GradManager and fetches the gradients. On MegEngine 1.13's CPU comp node with the interpreter asynchronous (the
default, ``async_level`` 2), a few steps in thousands return different gradients, often inf or NaN; more often
when the machine is loaded (run several at once). The same convolutions without biases, a single layer, and
the forward alone gave the same result every time in the same runs; ``async_level`` 1 still fails, 0 does
not (at ~7x the time). This is what broke ``test_amp_learns_like_float32``'s float32 run on a loaded machine
("gradient norm inf/nan at step N" at a different N each time).

    python benchmarks/megengine_backward_race.py --steps 2000 & python benchmarks/megengine_backward_race.py &
    python benchmarks/megengine_backward_race.py --async_level 0
    python benchmarks/megengine_backward_race.py --device cpu:default     # the same loop on the other CPU comp node

One JSON line per run: steps, distinct gradient results (1 when deterministic), steps with a non-finite gradient.
"""
import argparse
import json
import time

import numpy as np


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--async_level", type=int, choices=(0, 1, 2), default=2)
    parser.add_argument("--device", choices=("cpux", "cpu:default"), default="cpux",
                        help="the CPU comp node every tensor is made on: cpux (MegEngine's default: kernels on the "
                             "comp node's own worker queue) or cpu:default (kernels run by the interpreter's worker)")
    args = parser.parse_args()

    import megengine as mge
    import megengine.functional as F
    from megengine.autodiff import GradManager

    mge.config.async_level = args.async_level
    # set_default_device refuses the name cpu:default; the comp node's own setter takes it (before any tensor).
    from megengine.core._imperative_rt.common import CompNode

    CompNode._set_default_device(args.device)
    rng = np.random.default_rng(0)
    shapes = [(16, 1), (16, 16), (1, 16)]
    weights = [mge.Parameter(0.3 * rng.standard_normal((o, i, 3, 3)).astype(np.float32)) for o, i in shapes]
    biases = [mge.Parameter(rng.standard_normal((1, o, 1, 1)).astype(np.float32)) for o, _ in shapes]
    params = weights + biases
    x = rng.standard_normal((8, 1, 8, 8)).astype(np.float32)
    gm = GradManager().attach(params)
    results, non_finite = set(), 0
    start = time.perf_counter()
    for _ in range(args.steps):
        with gm:
            h = mge.tensor(x)
            for w, b in zip(weights, biases):
                h = F.conv2d(h, w, b, padding=1)
            gm.backward((h ** 2).mean())
        grads = [p.grad.numpy() for p in params]
        non_finite += not all(np.isfinite(g).all() for g in grads)
        results.add(b"".join(g.tobytes() for g in grads))
        for p in params:
            p.grad = None
    print(json.dumps({"steps": args.steps, "async_level": args.async_level, "device": str(params[0].device),
                      "distinct_results": len(results), "non_finite_steps": non_finite,
                      "seconds": round(time.perf_counter() - start, 2)}))


if __name__ == "__main__":
    main()
