"""The engine of a training step, chosen once when a ``Trainer`` is built (``make_engine``). It owns the network's
weights, their moving averages (the EMA and post-hoc EMA's profiles, ``posthoc_ema``) and Adam's state, and offers the
same calls on every path: ``gradients`` of a step's draws (the loss and the gradient norm, as floats; the gradients
stay inside), then ``update`` (clip, Adam, the averages) or ``discard``.

- ``CpuEngine`` (``"numpy"``, the CPU engine, ``megdiffusion.cpu.choice``): the network's forward and backward in
  the numpy pass (``cpu.native``), the loss between them the diffusion's own, the update in numpy on flat buffers
  (``cpu.flat_update``).
- ``DeviceEngine`` (``"megengine"``: GPUs, ``MEGDIFFUSION_FAST_CONV=0``, or a setup the numpy pass does not run,
  ``native.unsupported``): MegEngine's autodiff (``EngineSource``, float32 or mixed precision) and MegEngine's update
  on the device, eager or as two traced graphs (``--trace``).

Every source takes the batch in micro-batches (``--microbatch``) and gives the gradient of the whole batch's mean loss.
"""
import contextlib
import functools
import sys
from typing import NamedTuple

import numpy as np

from megdiffusion.compat import assign_, quiet_megengine
from megdiffusion.cpu import native
from megdiffusion.cpu.choice import cpu_engine_enabled
from megdiffusion.cpu.flat_update import FlatUpdate
from megdiffusion.errors import MegdiffusionError
from megdiffusion.training import distributed
from megdiffusion.training.config import check_step_options, profile_sigma_rels

mge = quiet_megengine()
import megengine.functional as F  # noqa: E402
from megengine.amp import autocast  # noqa: E402
from megengine.autodiff import GradManager  # noqa: E402
from megengine.jit import trace  # noqa: E402
from megengine.optimizer import Adam  # noqa: E402

ENGINES = ("numpy", "megengine")


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


class EngineSource:
    """The loss and gradients of a batch through MegEngine's autodiff (``grad_manager`` over ``params``).

    ``amp``: the forward and the loss under ``megengine.amp.autocast`` (float16 convolutions and matmuls; MegEngine
    keeps GroupNorm in float32, the UNet its softmax and time embedding) and the backward of the loss times the
    loss scale.
    """

    def __init__(self, model, diffusion, params, grad_manager, amp=False):
        self.model, self.diffusion, self.params, self.grad_manager = model, diffusion, params, grad_manager
        self.amp = amp

    def inputs(self, x0, draws, rows):
        """Seed dropout with the step's seed and put the network in training mode; the per-micro-batch arguments of
        ``batch`` for the batch ``x0`` with its ``draws`` cut into ``rows``."""
        mge.random.seed(draws.dropout_seed)
        if not self.model.training:  # walking MegEngine's module tree is a large share of a small model's step
            self.model.train()
        pieces = []
        for piece in rows:
            part = draws.piece(piece)
            pieces.append([mge.tensor(x0[piece]), mge.tensor(part.t), mge.tensor(part.noise),
                           None if part.perturbation is None else mge.tensor(part.perturbation),
                           None if part.labels is None else mge.tensor(part.labels)])
        return pieces

    def batch(self, pieces, batch_size, scale):
        """The batch's mean loss over ``batch_size`` samples and its gradients times ``scale`` (a list in ``params``
        order; None for a parameter without one), summed over the micro-batches ``pieces`` (``inputs``)."""
        loss, total = None, None
        for args in pieces:
            for param in self.params:
                param.grad = None
            piece_loss, grads = self._piece_gradients(*args, scale, batch_size=batch_size)
            loss = piece_loss if loss is None else loss + piece_loss
            total = list(grads) if total is None else [g if a is None else a if g is None else a + g
                                                       for a, g in zip(total, grads)]
        return loss, total

    def __call__(self, x0, draws, rows, loss_scale=1.0):
        """The batch's mean loss (a scalar tensor, on the device); its gradient times ``loss_scale`` is left in
        the parameters' ``.grad``. ``x0``, ``draws`` and ``rows`` as ``native.NativeStep.batch_gradients``'."""
        loss, grads = self.batch(self.inputs(x0, draws, rows), len(x0), mge.tensor(np.float32(loss_scale)))
        for param, grad in zip(self.params, grads):
            param.grad = grad
        return loss

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



class Gradients(NamedTuple):
    """What the host learns of a step's gradients: the batch's mean loss and the gradients' global L2 norm (of the
    unscaled gradients under ``--amp``, before clipping)."""

    loss: float
    norm: float


class Modules(NamedTuple):
    """The MegEngine objects of a run: the network, its EMA copy (eval mode) and Adam over the network's parameters."""

    model: object
    ema: object
    optimizer: object


class _Engine:
    def __init__(self, model, ema, optimizer):
        self.model, self.ema, self.optimizer = model, ema, optimizer
        self.params, self.ema_params = list(model.parameters()), list(ema.parameters())
        self.param_names = [name for name, _ in model.named_parameters()]  # the same order as ``parameters()``

    def current_model(self):
        """The network holding the current weights."""
        return self.model

    def _set_lr(self, lr):
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    @contextlib.contextmanager
    def handed_over(self):
        """``Modules`` holding the engine's state, to read or change in the block; the engine continues from them."""
        yield Modules(self.model, self.ema, self.optimizer)


class CpuEngine(_Engine):
    """The CPU engine: gradients from the numpy pass (``native_step``, a ``native.NativeStep``); clipping, Adam and the
    EMA in numpy on flat buffers (``FlatUpdate``), which own the state between steps: MegEngine's objects receive it
    only when it is ``handed_over`` (checkpoints, grids, evaluations), and the network's weights when it is read
    (``current_model``), not after every update."""

    def __init__(self, model, ema, optimizer, native_step, profiles=0):
        super().__init__(model, ema, optimizer)
        self.native_step = native_step
        self.flat = self._flat_update()
        self.flat.averages += [self.flat.param.copy() for _ in range(profiles)]  # they start at the weights
        self.model_stale = False  # the flat weights moved since the network last received them

    def current_model(self):
        if self.model_stale:
            self.flat.write_params()
            self.model_stale = False
        return self.model

    def _flat_update(self, profiles=()):
        return FlatUpdate(self.params, self.ema_params, self.optimizer, profiles)

    def profile_weights(self):
        """Post-hoc EMA's profiles (in ``posthoc_ema.profile_sigma_rels`` order): one ``{name: array}`` each."""
        return [dict(zip(self.param_names, (view.copy() for view in self.flat.views(average))))
                for average in self.flat.averages[1:]]

    def load_profile_weights(self, profiles):
        """Set the profiles from ``profile_weights``' form."""
        for average, weights in zip(self.flat.averages[1:], profiles, strict=True):
            average[:] = np.concatenate([np.asarray(weights[name], np.float32).reshape(-1)
                                         for name in self.param_names])

    def gradients(self, x0, draws, rows, loss_scale=1.0):
        """The ``Gradients`` of ``draws`` on the batch ``x0`` in the micro-batches ``rows`` (``loss_scale``: 1, as
        the CPU engine runs in float32)."""
        loss, self.flat.grad = self.native_step.batch_gradients(self.flat.param, x0, draws, rows)
        return Gradients(float(loss), float(self.flat.gradient_norm()))

    def update(self, gradients, lr, max_norm, decays):
        """Clip the last ``gradients`` to ``max_norm``, one Adam step at ``lr``, then the EMA and the profiles each
        moved with its decay in ``decays`` (the EMA's first)."""
        self._set_lr(lr)
        self.flat.step(gradients.norm, lr, max_norm, decays)
        self.flat.grad = None
        self.model_stale = True

    def discard(self):
        """Drop the last gradients without an update."""
        self.flat.grad = None

    @contextlib.contextmanager
    def handed_over(self):
        self.flat.write_back()
        self.model_stale = False
        profiles = self.flat.averages[1:]
        yield Modules(self.model, self.ema, self.optimizer)
        self.flat = self._flat_update(profiles)


class DeviceEngine(_Engine):
    """MegEngine's kernels: the gradients from ``source`` (an ``EngineSource``), unscaled, and their norm, then
    clipping, Adam and the EMA, all on the device. The loss and the norm reach the host in one transfer, the step's
    only synchronisation.

    ``traced`` (``--trace``): each of the two halves runs as one ``jit.trace(symbolic=True)`` graph: the gradients of
    every micro-batch, summed, unscaled, and their norm; then clipping, Adam and the EMA (the learning rate, the
    bound and the decay enter as tensors, so one graph serves every step). Tracing runs a graph's first call eagerly,
    whose rounding differs from the compiled graph's; that call's result is dropped (its update undone) and the graph
    run again, so every step comes from the compiled graphs and a resumed run continues bit for bit.
    """

    def __init__(self, model, ema, optimizer, source, traced=False, profiles=0):
        super().__init__(model, ema, optimizer)
        self.source = source
        self.profiles = [[mge.tensor(param.numpy(), device=param.device) for param in self.params]
                         for _ in range(profiles)]  # post-hoc EMA's, started at the weights
        # The step's two halves: ``jit.trace`` objects under ``traced``, else the plain functions.
        self.gradient_graph = trace(self._gradients_and_norm, symbolic=True) if traced else self._gradients_and_norm
        self.update_graph = trace(self._clip_adam_ema, symbolic=True) if traced else self._clip_adam_ema
        self._untraced = {"gradients": traced, "update": traced}  # a graph is traced by its first call
        self._last = None  # the last gradients and their norm, on the device

    def gradients(self, x0, draws, rows, loss_scale=1.0):
        """The ``Gradients`` of ``draws`` on the batch ``x0`` in the micro-batches ``rows``, the backward run on the
        loss times ``loss_scale`` (``--amp``) and the gradients divided by it again."""
        pieces = self.source.inputs(x0, draws, rows)
        args = [tensor for piece in pieces for tensor in piece]
        args += [mge.tensor(np.float32(loss_scale)), mge.tensor(np.float32(1.0 / loss_scale))]
        if self._untraced["gradients"]:
            self.gradient_graph(*args, pieces=len(pieces), batch_size=len(x0))  # traces; the result is dropped
            self._untraced["gradients"] = False
        loss_and_norm, norm, *grads = self.gradient_graph(*args, pieces=len(pieces), batch_size=len(x0))
        self._last = norm, grads
        loss_value, norm_value = (float(v) for v in loss_and_norm.numpy())
        return Gradients(loss_value, norm_value)

    def _gradients_and_norm(self, *args, pieces, batch_size):
        """[loss and norm stacked, the norm, the gradients...] of the micro-batches in ``args`` (five tensors each,
        ``EngineSource.inputs``), then the loss scale and its inverse."""
        *inputs, scale, inverse = args
        per_piece = len(inputs) // pieces
        loss, grads = self.source.batch([inputs[i:i + per_piece] for i in range(0, len(inputs), per_piece)],
                                        batch_size, scale)
        for param in self.params:
            param.grad = None
        if self.source.amp:
            grads = [grad * inverse for grad in grads]
        norms = [F.norm(grad.flatten()) for grad in grads]  # ``clip_grad_norm``'s norm, op for op
        norm = F.norm(F.concat(norms)) if len(norms) > 1 else norms[0]
        return [F.stack([loss.astype("float32"), norm]), norm, *grads]

    def profile_weights(self):
        """Post-hoc EMA's profiles (in ``posthoc_ema.profile_sigma_rels`` order): one ``{name: array}`` each."""
        return [{name: tensor.numpy() for name, tensor in zip(self.param_names, profile)} for profile in self.profiles]

    def load_profile_weights(self, profiles):
        """Set the profiles from ``profile_weights``' form."""
        for profile, weights in zip(self.profiles, profiles, strict=True):
            for name, tensor in zip(self.param_names, profile):
                assign_(tensor, mge.tensor(np.asarray(weights[name], np.float32), device=tensor.device))

    def update(self, gradients, lr, max_norm, decays):
        """Clip the last gradients to ``max_norm`` (``clip_grad_norm``'s rule), one Adam step at ``lr``, then the
        EMA and the profiles each moved with its decay in ``decays`` (the EMA's first)."""
        norm, grads = self._last
        args = [mge.tensor(np.float32(value)) for value in (lr, max_norm)]
        args += [mge.tensor(np.float32(value)) for decay in decays for value in (decay, 1.0 - decay)]
        args += [norm, *grads]
        if self._untraced["update"]:
            kept = self._state_tensors()
            saved = [tensor.numpy() for tensor in kept]
            self.update_graph(*args)  # traces; the update it applied is undone
            for tensor, value in zip(kept, saved):
                assign_(tensor, mge.tensor(value, device=tensor.device))
            self._untraced["update"] = False
        self.update_graph(*args)
        self._set_lr(lr)  # the optimizer's state holds numbers (checkpoints), not the graph's tensor
        self.discard()

    def _clip_adam_ema(self, lr, max_norm, *args):
        """``args``: (decay, 1 - decay) of the EMA and of each profile, the gradients' norm, the gradients."""
        averages = [self.ema_params, *self.profiles]
        moves, (norm, *grads) = args[:2 * len(averages)], args[2 * len(averages):]
        scale = F.minimum(max_norm / (norm + 1e-6), 1)
        for param, grad in zip(self.params, grads):
            param.grad = grad * scale
        self._set_lr(lr)  # a tensor: one graph serves every learning rate
        self.optimizer.step()
        for average, decay, weight in zip(averages, moves[::2], moves[1::2]):
            for tensor, param in zip(average, self.params):
                assign_(tensor, tensor * decay + param * weight)

    def _state_tensors(self):
        """Every tensor an update changes: the weights, the moving averages and Adam's state."""
        state = self.optimizer.state_dict(keep_var=True)["state"]
        profiles = [tensor for profile in self.profiles for tensor in profile]
        return self.params + self.ema_params + profiles + [state[i][key] for i in sorted(state)
                                                           for key in sorted(state[i])]

    def discard(self):
        """Drop the last gradients without an update."""
        self.optimizer.clear_grad()
        self._last = None


def choose_engine(model, world_size):
    """``(engine, why)``: the engine a run takes on this machine (one of ``ENGINES``) and, where the CPU engine is
    chosen (``cpu.choice``) but cannot run the setup, why not (``native.unsupported``), else None."""
    if not cpu_engine_enabled():
        return "megengine", None
    if not native.enabled():
        return "megengine", f"{native.ENV_VAR}=0"
    why = native.unsupported(model, world_size)
    return ("megengine", why) if why else ("numpy", None)


def make_engine(cfg, model, ema, diffusion, world_size=1, engine=None):
    """The engine of a run of ``cfg`` (``engine``, one of ``ENGINES``; default ``choose_engine``'s, with a ``note:``
    on stderr when the CPU engine cannot run the setup) over ``model`` and its EMA copy ``ema``, with a new Adam;
    gradients are averaged over ``world_size`` processes."""
    check_step_options(cfg, engine)  # by the machine when the engine is chosen here: --amp not on the CPU path
    if engine is None:
        engine, why = choose_engine(model, world_size)
        if why:
            print(f"note: the CPU engine does not run this setup ({why}); MegEngine's autodiff trains it, slower",
                  file=sys.stderr)
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}; got {engine!r}")
    params = list(model.parameters())
    optimizer = Adam(params, lr=cfg.lr)
    profiles = len(profile_sigma_rels(cfg))
    if engine == "numpy":
        return CpuEngine(model, ema, optimizer, native.NativeStep(model, diffusion, params), profiles)
    grad_manager = GradManager().attach(params, callbacks=distributed.allreduce_mean_callbacks(world_size))
    source = EngineSource(model, diffusion, params, grad_manager, amp=cfg.amp)
    return DeviceEngine(model, ema, optimizer, source, traced=cfg.trace, profiles=profiles)
