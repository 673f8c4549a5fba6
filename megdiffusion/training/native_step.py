"""The loss and gradients of a training step outside MegEngine (the fast CPU path of ``Trainer.step``).

The batch is cut into fixed groups of ``GROUP`` samples; each group's forward and backward pass
(``nn.numpy_unet``) runs in the calling process or in a worker process (``training.group_workers``, one process
per core), and the groups' gradients are summed in group order, so results are bit-identical on any core count.
The loss is ``GaussianDiffusion.training_losses``' for a fixed variance: the mse between the model's output and
its target (the noise, or x_0), weighted per timestep (``mse_weight``: 1, or Min-SNR's), averaged over the batch.
``MEGDIFFUSION_NATIVE_STEP=0`` turns it off: the step then runs through MegEngine's autodiff.
"""
import os

import numpy as np

from megdiffusion.batch_threads import THREADS
from megdiffusion.nn import numpy_unet
from megdiffusion.nn.layers import timestep_embedding
from megdiffusion.training.group_workers import GroupWorkers

GROUP = 8  # samples per forward and backward pass (the unit of determinism)
ENV_VAR = "MEGDIFFUSION_NATIVE_STEP"


def enabled():
    """Whether the next fast-path step may run here (``MEGDIFFUSION_NATIVE_STEP`` is not 0)."""
    return os.environ.get(ENV_VAR, "1").strip() != "0"


def unsupported(model, diffusion, world_size):
    """Why ``NativeStep`` cannot train this setup (one phrase), or None when it can."""
    if world_size > 1:
        return "gradients are averaged across processes by MegEngine"
    if diffusion.learns_variance:
        return "a learned variance is not implemented"
    if diffusion.mean_type not in ("eps", "xstart"):
        return f"mean_type {diffusion.mean_type!r} is not implemented"
    return numpy_unet.unsupported(model)


class NativeStep:
    """``loss_and_gradients`` of ``model`` (a ``UNet``) under ``diffusion``, its parameters in ``params`` order.
    Worker processes start at the first batch of more than one group."""

    def __init__(self, model, diffusion, params):
        self.model = numpy_unet.describe(model, params)
        self.diffusion = diffusion
        self.shapes = [tuple(p.shape) for p in params]
        self.coefficients = {name: getattr(diffusion, name).astype(np.float32) for name in
                             ("sqrt_alphas_cumprod", "sqrt_one_minus_alphas_cumprod", "mse_weight")}
        self.workers = None

    def loss_and_gradients(self, flat_weights, x0, t, noise):
        """(loss, flat gradient) for the batch x0 at timesteps ``t`` (int, (N,)) with ``noise``; ``flat_weights``:
        the parameters' current values, one after the other in ``params`` order."""
        coef = {name: values[t] for name, values in self.coefficients.items()}
        x_t = (coef["sqrt_alphas_cumprod"].reshape(-1, 1, 1, 1) * x0
               + coef["sqrt_one_minus_alphas_cumprod"].reshape(-1, 1, 1, 1) * noise)
        target = noise if self.diffusion.mean_type == "eps" else x0
        temb_in = timestep_embedding(self.diffusion.model_timesteps(t), self.model.model_channels,
                                     self.model.time_embedding).numpy()
        parts = [slice(start, start + GROUP) for start in range(0, len(x0), GROUP)]
        groups = [(x_t[p], target[p], coef["mse_weight"][p], temb_in[p]) for p in parts]
        if self.workers is None:
            self.workers = GroupWorkers(self.model, self.shapes, min(THREADS, len(groups)) - 1)
        results = self.workers.run(flat_weights, groups, len(x0))
        gradient = results[0][1].copy()
        for _, flat in results[1:]:
            gradient += flat
        return sum(loss for loss, _ in results) / len(x0), gradient
