"""The parts a training step is made of: a source of the batch's loss and gradients, then one update.

Sources (``Trainer.step`` picks one): ``native_gradients``, the numpy pass (``megdiffusion.cpu.native``, the fast CPU
path), and ``EngineSource``, MegEngine's autodiff: eager or traced (``--trace``), float32 or mixed precision
(``--amp``). Both take the batch in micro-batches (``--microbatch``) and return the gradient of the whole batch's
mean loss.
Updates: ``flat_update.FlatUpdate`` (numpy, the fast CPU path) and ``EngineUpdate`` (MegEngine's clipping, Adam and
the EMA, on the device, with ``LossScaler`` under ``--amp``).
"""
import functools

import numpy as np

from megdiffusion.compat import assign_, quiet_megengine
from megdiffusion.errors import MegdiffusionError
from megdiffusion.cpu.native import GROUP

mge = quiet_megengine()
import megengine.functional as F  # noqa: E402
from megengine.amp import autocast  # noqa: E402
from megengine.jit import trace  # noqa: E402
from megengine.optimizer import clip_grad_norm  # noqa: E402


class NonFiniteLossError(MegdiffusionError):
    """The loss or gradient norm became NaN/inf; the model was not updated."""

    exit_code = 1  # the input was fine; the run diverged

    @classmethod
    def at(cls, loss, grad_norm, step, advice="the model was not updated. Try a lower --lr or --grad_clip"):
        """The error of step ``step`` (0-based) whose loss or gradient norm is not finite, with ``advice`` (the
        training loop adds where a rerun starts)."""
        return cls(f"non-finite loss {loss} (gradient norm {grad_norm}) at step {step}; {advice}")


def pieces(batch, microbatch):
    """The micro-batches of a batch of ``batch`` samples, as slices (``microbatch`` 0: the whole batch)."""
    size = microbatch or batch
    return [slice(start, start + size) for start in range(0, batch, size)]


def native_gradients(native_step, flat_weights, x0, draws, rows):
    """The numpy pass (a ``native.NativeStep``): (the batch's mean loss, its flat gradient) at ``flat_weights``
    for the batch ``x0`` with its ``StepDraws``, computed in the micro-batches ``rows`` (slices), summed in order."""
    loss, gradient, first_group = 0.0, None, 0
    for piece in rows:
        part = draws.piece(piece)
        piece_loss, piece_gradient = native_step.loss_and_gradients(
            flat_weights, x0[piece], part.t, part.noise, draws.dropout_seed, part.perturbation, part.labels,
            batch_size=len(x0), first_group=first_group)
        first_group += -(-len(part.t) // GROUP)  # dropout groups numbered through the batch
        loss += piece_loss
        gradient = piece_gradient if gradient is None else np.add(gradient, piece_gradient, out=gradient)
    return loss, gradient


class EngineSource:
    """The loss and gradients of a batch through MegEngine's autodiff (``grad_manager`` over ``params``).

    ``amp``: the forward and the loss under ``megengine.amp.autocast`` (float16 convolutions and matmuls; MegEngine
    keeps GroupNorm in float32, the UNet its softmax and time embedding) and the backward of the loss times the
    loss scale. ``traced``: each micro-batch's forward and backward runs as one ``jit.trace(symbolic=True)`` graph
    (every micro-batch has the same shapes); the gradients are summed outside it. Tracing runs the first call
    eagerly, whose rounding differs from the compiled graph's, so that call's result is dropped and the graph run
    again: every step then comes from the compiled graph, and a resumed run continues bit for bit.
    """

    def __init__(self, model, diffusion, params, grad_manager, amp=False, traced=False):
        self.model, self.diffusion, self.params, self.grad_manager = model, diffusion, params, grad_manager
        self.amp = amp
        self._piece = trace(self._piece_gradients, symbolic=True) if traced else self._piece_gradients
        self._untraced = traced  # the graph is traced by its first call

    def __call__(self, x0, draws, rows, loss_scale=1.0):
        """The batch's mean loss (a scalar tensor, on the device); its gradient times ``loss_scale`` is left in
        the parameters' ``.grad``. ``x0``, ``draws`` and ``rows`` as ``native_gradients``'."""
        loss, total = None, None
        scale = mge.tensor(np.float32(loss_scale))
        for piece in rows:
            part = draws.piece(piece)
            args = [mge.tensor(x0[piece]), mge.tensor(part.t), mge.tensor(part.noise)]
            args += [None if part.perturbation is None else mge.tensor(part.perturbation),
                     None if part.labels is None else mge.tensor(part.labels), scale]
            if self._untraced:
                self._fresh_piece(args, len(x0))  # traces the graph; its eager result is dropped
                self._untraced = False
            piece_loss, grads = self._fresh_piece(args, len(x0))
            loss = piece_loss if loss is None else loss + piece_loss
            total = list(grads) if total is None else [g if a is None else a if g is None else a + g
                                                       for a, g in zip(total, grads)]
        for param, grad in zip(self.params, total):
            param.grad = grad
        return loss

    def _fresh_piece(self, args, batch_size):
        """``_piece`` from parameters without gradients (a traced graph is the same on every call)."""
        for param in self.params:
            param.grad = None
        return self._piece(*args, batch_size=batch_size)

    def _piece_gradients(self, x0, t, noise, perturbation, labels, scale, *, batch_size):
        """One micro-batch: its summed loss over ``batch_size`` and that loss's gradients times ``scale``."""
        network = self.model if labels is None else functools.partial(self.model, y=labels)
        with self.grad_manager:
            with autocast(enabled=self.amp):
                losses = self.diffusion.training_losses(network, x0, t, noise, perturbation)["loss"]
            loss = losses.sum() / batch_size
            self.grad_manager.backward(loss, dy=scale)
        return loss, [param.grad for param in self.params]


class LossScaler:
    """Dynamic loss scaling for float16 gradients, ``megengine.amp.GradScaler``'s rule with its state on the host:
    the scale grows by ``growth_factor`` after ``growth_interval`` clean updates in a row, and a step whose gradients
    are not finite is skipped and shrinks it by ``backoff_factor``. Defaults: PyTorch's (2^16, 2, 0.5, 2000)."""

    MIN_SCALE = 1.0  # below it float16 gradients would overflow unscaled: no scale absorbs that

    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.clean_steps = 0  # clean updates since the scale last changed
        self.skipped = 0  # updates skipped over the whole run

    def update(self, finite):
        """Record a step whose gradients were ``finite`` or not; returns whether to apply its update."""
        if finite:
            self.clean_steps += 1
            if self.clean_steps >= self.growth_interval:
                self.scale *= self.growth_factor
                self.clean_steps = 0
            return True
        self.scale *= self.backoff_factor
        self.clean_steps = 0
        self.skipped += 1
        return False

    def state_dict(self):
        return {"scale": self.scale, "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "clean_steps": self.clean_steps, "skipped": self.skipped}

    def load_state_dict(self, state):
        self.scale = float(state["scale"])
        self.growth_factor, self.backoff_factor = float(state["growth_factor"]), float(state["backoff_factor"])
        self.growth_interval, self.clean_steps = int(state["growth_interval"]), int(state["clean_steps"])
        self.skipped = int(state["skipped"])


class EngineUpdate:
    """Unscale, clip, Adam and the EMA on the device, from the gradients in ``params``' ``.grad``; the loss and
    the gradient norm reach the host in one transfer, the step's only synchronisation."""

    def __init__(self, params, ema_params, optimizer):
        self.params, self.ema_params, self.optimizer = params, ema_params, optimizer

    def __call__(self, loss, step, max_norm, ema_decay, scaler=None):
        """Apply the update of step ``step`` (0-based, for messages) unless the gradients are not finite and the
        ``LossScaler`` skips it: (loss, gradient norm before clipping, whether it was applied), as floats."""
        if scaler is not None:
            inverse = mge.tensor(np.float32(1.0 / scaler.scale))
            for param in self.params:
                param.grad = param.grad * inverse
        norm = clip_grad_norm(self.params, max_norm)
        loss_value, norm_value = (float(v) for v in F.stack([loss.astype("float32"), norm]).numpy())
        finite = bool(np.isfinite(norm_value))
        if not np.isfinite(loss_value) or (not finite and scaler is None):
            self.optimizer.clear_grad()
            if scaler is None:
                raise NonFiniteLossError.at(loss_value, norm_value, step)
            raise NonFiniteLossError.at(loss_value, norm_value, step,
                                        "its float16 forward (--amp) overflowed; try without --amp")
        if scaler is not None and not finite and scaler.scale * scaler.backoff_factor < LossScaler.MIN_SCALE:
            self.optimizer.clear_grad()
            raise NonFiniteLossError(f"gradients not finite at step {step} with the loss scale at {scaler.scale:g}: "
                                     "they overflow float16 unscaled; train without --amp, or with a lower --lr")
        applied = scaler is None or scaler.update(finite)
        if applied:
            self.optimizer.step()
            for ema_param, param in zip(self.ema_params, self.params):
                assign_(ema_param, ema_param * ema_decay + param * (1.0 - ema_decay))
        self.optimizer.clear_grad()
        return loss_value, norm_value, applied
