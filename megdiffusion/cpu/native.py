"""The UNet outside MegEngine, the CPU engine: training steps (``NativeStep``, in ``training.engine``) and
eval-mode calls (``NativeModel``, in ``generation.generate_images``).

The batch is cut into fixed groups of ``GROUP`` samples; each group's pass (``cpu.numpy_unet``) runs in the calling
process or in a worker process (``group_workers``, one process per core), and the groups' gradients are summed in
group order, so results are bit-identical on any core count. The training loss is
``GaussianDiffusion.training_losses``' itself: its inputs and its terms after the network run in MegEngine here
(``training_inputs``, ``losses_of_output``), only the network in numpy, so every loss the diffusion defines trains.
``MEGDIFFUSION_NATIVE_STEP=0`` turns both off: MegEngine then runs the network (with the fast convolutions).
"""

import numpy as np

from megdiffusion.cpu.batch_threads import THREADS
from megdiffusion.compat import quiet_megengine
from megdiffusion.cpu.group_workers import GroupWorkers
from megdiffusion.cpu import fused, numpy_unet, onednn
from megdiffusion.cpu.choice import cpu_engine_enabled
from megdiffusion import environment

mge = quiet_megengine()
from megengine.autodiff import GradManager  # noqa: E402

GROUP = 8  # samples per forward and backward pass (the unit of determinism)
ENV_VAR = "MEGDIFFUSION_NATIVE_STEP"


def enabled():
    """Whether the next call may run here: the CPU engine (``choice.cpu_engine_enabled``), and
    ``MEGDIFFUSION_NATIVE_STEP`` is not 0."""
    return cpu_engine_enabled() and environment.read(ENV_VAR, True)


def unsupported(model, world_size):
    """Why ``NativeStep`` cannot train ``model`` over ``world_size`` processes (one phrase), or None when it can: every
    loss trains (it is the diffusion's own), so only the network and the machine decide."""
    if world_size > 1:
        return "gradients are averaged across processes by MegEngine"
    if not onednn.available():
        return "oneDNN is not available"
    try:
        numpy_unet.describe(model, list(model.parameters()))
    except numpy_unet.NotLowerable as err:
        return str(err)
    return None


def _groups(n):
    return [slice(start, start + GROUP) for start in range(0, n, GROUP)]


def _part(labels, rows):
    """The class labels of ``rows``, or None for an unconditional network."""
    return None if labels is None else labels[rows]


def _workers(model, shapes, groups):
    """A ``GroupWorkers`` with as many processes as the cores and the groups allow."""
    return GroupWorkers(model, shapes, min(THREADS, groups) - 1)


class NativeStep:
    """``loss_and_gradients`` of ``model`` (a ``UNet``) under ``diffusion``, its parameters in ``params`` order.
    Worker processes start at the first batch of more than one group."""

    def __init__(self, model, diffusion, params):
        self.model = numpy_unet.describe(model, params)
        self.timestep_input = model.timestep_input
        fused.note_if_missing()
        self.diffusion = diffusion
        self.shapes = [tuple(p.shape) for p in params]
        self.workers = None

    def loss_and_gradients(self, flat_weights, x0, t, noise, dropout_seed=0, perturbation=None, labels=None,
                           batch_size=None, first_group=0):
        """(loss, flat gradient) for the batch x0 at timesteps ``t`` (int, (N,)) with ``noise`` (and
        ``perturbation`` added to the noise of x_t only) and, for a class-conditional network, the class ``labels``
        (N,); ``flat_weights``: the parameters' current values, one after the other in ``params`` order. The loss is
        ``diffusion.training_losses``' summed over x0 and divided by ``batch_size`` (default N): x_t and the loss
        of each group's output come from the diffusion itself (``training_inputs``, ``losses_of_output``, d loss /
        d output by MegEngine's autodiff), only the network runs here. x0 may be a micro-batch of a larger batch,
        whose first sample is sample ``first_group * GROUP`` of it; group g of that batch draws its dropout masks
        from ``np.random.default_rng([dropout_seed, g])``."""
        x0_t, t_t, noise_t = mge.tensor(x0), mge.tensor(t), mge.tensor(noise)
        x_t = self.diffusion.training_inputs(x0_t, t_t, noise_t,
                                             None if perturbation is None else mge.tensor(perturbation))
        temb_in = self.timestep_input(self.diffusion.model_timesteps(t)).numpy()
        parts = _groups(len(x0))
        x_t_values = x_t.numpy()
        groups = [(x_t_values[p], temb_in[p], _part(labels, p), [dropout_seed, g])
                  for g, p in enumerate(parts, start=first_group)]
        if self.workers is None:
            self.workers = _workers(self.model, self.shapes, len(groups))
        scale = 1.0 / (batch_size or len(x0))

        def head(index, output):
            rows = parts[index]
            leaf = mge.tensor(output)
            with GradManager().attach([leaf]) as gm:
                losses = self.diffusion.losses_of_output(leaf, x0_t[rows], x_t[rows], t_t[rows], noise_t[rows])
                loss = losses["loss"].sum() * scale
                gm.backward(loss)
            return float(loss.numpy()), leaf.grad.numpy()

        results = self.workers.gradients(flat_weights, groups, head)
        gradient = results[0][1].copy()
        for _, flat in results[1:]:
            gradient += flat
        return sum(loss for loss, _ in results), gradient

    def batch_gradients(self, flat_weights, x0, draws, rows):
        """(the batch's mean loss, its flat gradient) at ``flat_weights`` for the batch ``x0`` with its draws (a
        ``training.draws.StepDraws``), computed in the micro-batches ``rows`` (slices), summed in order."""
        loss, gradient, first_group = 0.0, None, 0
        for piece in rows:
            part = draws.piece(piece)
            piece_loss, piece_gradient = self.loss_and_gradients(
                flat_weights, x0[piece], part.t, part.noise, draws.dropout_seed, part.perturbation, part.labels,
                batch_size=len(x0), first_group=first_group)
            first_group += -(-len(part.t) // GROUP)  # dropout groups numbered through the batch
            loss += piece_loss
            gradient = piece_gradient if gradient is None else np.add(gradient, piece_gradient, out=gradient)
        return loss, gradient


class NativeModel:
    """``model`` (a ``UNet``) in eval mode, called like it (``native_model(x, t[, y])``, MegEngine tensors in and
    out) and computed by ``cpu.numpy_unet``, with the weights ``model`` had when this was made. ``for_sampling`` says
    when to use one; ``close()`` stops its worker processes."""

    def __init__(self, model):
        params = list(model.parameters())
        self.model = numpy_unet.describe(model, params)
        self.timestep_input, self.num_classes = model.timestep_input, model.num_classes
        fused.note_if_missing()
        self.shapes = [tuple(p.shape) for p in params]
        self.weights = np.concatenate([p.numpy().reshape(-1) for p in params])
        self.workers = None

    @staticmethod
    def for_sampling(model):
        """A ``NativeModel`` of ``model`` (a ``UNet``) where it runs (with the CPU engine), else ``model`` itself."""
        if not enabled() or not onednn.available():
            return model
        try:
            return NativeModel(model)
        except numpy_unet.NotLowerable:  # a network the pass has no kernel for: MegEngine computes it
            return model

    def __call__(self, x, t, y=None):
        x = x.numpy()
        temb_in = self.timestep_input(t).numpy()
        labels = None if y is None else y.numpy()
        groups = [(x[p], temb_in[p], _part(labels, p)) for p in _groups(len(x))]
        if self.workers is None:
            self.workers = _workers(self.model, self.shapes, len(groups))
        return mge.tensor(np.concatenate(self.workers.outputs(self.weights, groups)))

    def close(self):
        if self.workers is not None:
            self.workers.close()
