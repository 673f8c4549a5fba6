"""MegEngine alone: on the ``cpu:default`` comp node, one float16 convolution changes how float32 ``tanh`` rounds.

Computes float32 ``tanh`` (and the tanh-approximated normal CDF's log-likelihood of a 8-bit bin, improved-diffusion's
``discretized_gaussian_log_likelihood``, where a difference of two CDFs near 1 amplifies one rounding step) on fixed
inputs, runs one convolution under ``megengine.amp.autocast`` (float16), and computes them again, with every tensor
on ``--device``. On MegEngine 1.13.0 here: ``cpux`` gives the same numbers before and after; ``cpu:default`` moves
``tanh`` by one float32 step (6e-8) on some inputs and the log-likelihood by up to ~11 where the bin's mass underflows
on one side of the floor. A process's float32 results there would depend on whether it had run float16 before,
which is why megdiffusion keeps MegEngine on ``cpux`` (docs/cpu.md).

    python benchmarks/megengine_float16_leak.py --device cpu:default
    python benchmarks/megengine_float16_leak.py --device cpux

One JSON line: the largest change of each value.
"""
import argparse
import json
import math

import numpy as np


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpux", "cpu:default"), default="cpu:default")
    args = parser.parse_args()

    import megengine as mge
    import megengine.functional as F
    import megengine.module as M
    from megengine.amp import autocast
    from megengine.core._imperative_rt.common import CompNode

    CompNode._set_default_device(args.device)  # before any tensor (set_default_device refuses the name)
    rng = np.random.default_rng(0)
    x = np.round(rng.uniform(-1, 1, (4, 1000)) * 127.5) / 127.5
    means, log_scales = x + rng.normal(0, 0.05, x.shape), rng.uniform(-5, -1, x.shape)
    x, means, log_scales = (mge.tensor(v.astype(np.float32)) for v in (x, means, log_scales))

    def cdf(v):
        return 0.5 * (1.0 + F.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v ** 3)))

    def values():
        inv = F.exp(-log_scales)
        arg = inv * (x - means + 1.0 / 255.0)
        delta = cdf(arg) - cdf(inv * (x - means - 1.0 / 255.0))
        return {"tanh": F.tanh(arg).numpy(), "log_likelihood": F.log(F.maximum(delta, 1e-12)).numpy()}

    before = values()
    with autocast(enabled=True):
        M.Conv2d(1, 4, 3, padding=1)(mge.tensor(rng.standard_normal((2, 1, 8, 8)).astype(np.float32))).numpy()
    after = values()
    print(json.dumps({"device": args.device, **{f"{name}_max_change": float(np.abs(after[name] - before[name]).max())
                                                for name in before}}), flush=True)


if __name__ == "__main__":
    main()
