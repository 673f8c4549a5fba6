"""megdiffusion's own training on MegEngine's CPU kernels, repeated: does the same run give the same weights?

Trains the tests' tiny UNet (8x8, one attention level) for ``--steps`` steps of ``Trainer.step`` on MegEngine's
kernels (the engine ``megengine``, as with ``MEGDIFFUSION_FAST_CONV=0`` or on a GPU) from the same seed and batches,
with the tensors on the CPU comp node ``--device``: ``cpux`` (MegEngine's default, where its backward races:
``megengine_backward_race.py``) or ``cpu:default`` (kernels run by the interpreter's worker). Run several at
once: equal ``weights_sha256`` across runs of one device means the run is deterministic there; ``recomputed_steps``
counts steps whose gradients came out non-finite once (the trainer's guard recomputes them), a race caught in the
act.

    for i in 1 2 3; do python benchmarks/megengine_training_race.py --device cpux & done; wait
    for i in 1 2 3; do python benchmarks/megengine_training_race.py --device cpu:default & done; wait

One JSON line per run.
"""
import argparse
import hashlib
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megdiffusion.compat import quiet_megengine  # noqa: E402

mge = quiet_megengine()
from megengine.core._imperative_rt.common import CompNode  # noqa: E402

TINY = dict(image_size=8, image_channels=1, model_channels=32, channel_mult=(1, 2), norm_groups=8,
            num_res_blocks=1, attention_resolutions=(4,), dropout=0.0, num_timesteps=100, batch_size=8, lr=2e-3)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--device", choices=("cpux", "cpu:default"), default="cpux")
    args = parser.parse_args()
    from megdiffusion.training.config import TrainConfig
    from megdiffusion.training.trainer import Trainer

    CompNode._set_default_device(args.device)  # before the model's tensors (set_default_device refuses the name)
    trainer = Trainer(TrainConfig(**TINY), engine="megengine")
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    for _ in range(args.steps):
        trainer.step(rng.uniform(-1, 1, (8, 1, 8, 8)).astype(np.float32))
    seconds = time.perf_counter() - start
    digest = hashlib.sha256(b"".join(p.numpy().tobytes() for p in trainer.model.parameters())).hexdigest()
    print(json.dumps({"device": args.device, "steps": args.steps, "weights_sha256": digest[:16],
                      "recomputed_steps": trainer.recomputed_steps, "seconds": round(seconds, 2),
                      "load": round(os.getloadavg()[0], 2)}), flush=True)


if __name__ == "__main__":
    main()
