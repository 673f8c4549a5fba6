"""Gradient clipping, Adam and the moving averages (the EMA, and post-hoc EMA's profiles) of a ``Trainer`` in numpy,
on flat float32 buffers (the CPU engine).

MegEngine's ``clip_grad_norm``, ``Adam.step`` and the EMA update run ~20 small ops per parameter tensor
(184 tensors on the CPU recipe). Here the parameters, Adam's moments and the EMA weights live in flat
float32 arrays between steps, and a step is two passes over cache-sized chunks of them: the gradient
norm, then clip + Adam + EMA. The operations are MegEngine's, in its order and float32 rounding
(``megengine/optimizer/adam.py`` without ``MEGENGINE_INPLACE_UPDATE``, ``clip_grad.py``, and
``training.engine.DeviceEngine``'s EMA), but for two: the norm is summed in float64 (MegEngine's float32 sum may be
one bit off, and so then the clip scale), and ``np.sqrt`` stands for MegEngine's ``** 0.5`` (which
differs from the correctly rounded root by one bit on ~0.1% of elements). Chunk boundaries are fixed
and the sums run on one thread, so results do not depend on the number of threads.

After each step the new parameters are written into the model's ``Parameter`` objects; the EMA and
Adam's state are written into the EMA model and the ``Adam`` optimizer only by ``write_back`` (when the trainer
hands its state over, ``Trainer.state``), in Adam's own format, so checkpoints are the same on both engines.
"""
import numpy as np

import megengine

from megdiffusion.cpu.batch_threads import one_blas_thread
from megdiffusion.compat import assign_
from megdiffusion.errors import MegdiffusionError

CHUNK = 1 << 16  # floats per chunk: the chunk's slices of the six arrays fit in L2


class FlatUpdateError(MegdiffusionError):
    """Adam's state is of a kind the flat update does not reproduce."""


def _flat(arrays, total):
    """One float32 array of ``total`` elements holding ``arrays`` one after the other."""
    out = np.empty(total, np.float32)
    np.concatenate([np.asarray(a, np.float32).reshape(-1) for a in arrays], out=out)
    return out


class FlatUpdate:
    """The parameters, moving averages and Adam state of one model, flat; ``step`` does one update.

    Built from the current state of ``params`` (the model's, in optimizer order), ``ema_params`` (the EMA
    model's, same order), ``optimizer`` (MegEngine's ``Adam`` over ``params``, one parameter group) and ``profiles``
    (post-hoc EMA's, flat like the weights; ``averages`` holds the EMA, then them).
    """

    def __init__(self, params, ema_params, optimizer, profiles=()):
        self.params, self.ema_params, self.optimizer = params, ema_params, optimizer
        sizes = [int(np.prod(p.shape)) for p in params]
        self.bounds = np.concatenate([[0], np.cumsum(sizes)]).tolist()
        total = self.bounds[-1]
        state = optimizer.state_dict()
        [group] = state["param_groups"]
        per_param = [state["state"][i] for i in group["params"]]
        steps = {float(s["step"]) for s in per_param}
        if group["weight_decay"] != 0 or len(steps) != 1:
            raise FlatUpdateError(f"the fast update reproduces Adam without weight decay and with one step count "
                                  f"for all parameters; this one has weight_decay {group['weight_decay']} and "
                                  f"step counts {sorted(steps)}: run with MEGDIFFUSION_FAST_CONV=0")
        self.beta0, self.beta1 = (np.float32(b) for b in group["betas"])
        self.eps = np.float32(group["eps"])
        self.step_count = np.float32(steps.pop())
        self.param = _flat([p.numpy() for p in params], total)
        self.averages = [_flat([p.numpy() for p in ema_params], total), *profiles]
        self.exp_avg = _flat([s["exp_avg"] for s in per_param], total)
        self.exp_avg_sq = _flat([s["exp_avg_sq"] for s in per_param], total)
        self.grad = None  # the gradients of the current step, flat (set by the caller)
        self.chunks = [slice(start, min(start + CHUNK, total)) for start in range(0, total, CHUNK)]

    def views(self, flat):
        """``flat`` cut into arrays shaped like the parameters."""
        return [flat[a:b].reshape(p.shape) for p, a, b in zip(self.params, self.bounds, self.bounds[1:])]

    def gradient_norm(self):
        """The global L2 norm of the step's gradients (``grad``, flat) as a float32 (``clip_grad_norm``'s value),
        summed in float64."""
        squares, chunk = 0.0, np.empty(CHUNK, np.float64)
        with one_blas_thread():  # a threaded dot product would split its sum by the thread count
            for c in self.chunks:
                part = chunk[:c.stop - c.start]
                np.copyto(part, self.grad[c])
                squares += float(np.dot(part, part))
        return np.float32(np.sqrt(squares))

    def step(self, grad_norm, lr, max_norm, decays):
        """Clip the gathered gradients to ``max_norm`` (``inf``: no clipping) given their norm, one Adam step
        at ``lr``, then each of ``averages`` moved towards the new weights with its decay in ``decays``, in the flat
        buffers (``write_params`` puts the weights in the model)."""
        f32 = np.float32
        one = f32(1)
        scale = min(f32(max_norm) / (f32(grad_norm) + f32(1e-6)), one)  # all float32, like MegEngine's
        beta0, beta1 = self.beta0, self.beta1
        self.step_count += one
        correction0 = one - beta0 ** self.step_count
        correction1 = one - beta1 ** self.step_count
        lr = f32(lr)
        moves = [(average, f32(decay), f32(1.0 - decay)) for average, decay in zip(self.averages, decays, strict=True)]
        g, t = np.empty(CHUNK, np.float32), np.empty(CHUNK, np.float32)
        for c in self.chunks:
            g_, t_ = g[:c.stop - c.start], t[:c.stop - c.start]
            m, v, p = self.exp_avg[c], self.exp_avg_sq[c], self.param[c]
            np.multiply(self.grad[c], scale, out=g_)
            np.multiply(m, beta0, out=m)  # exp_avg = beta0 * exp_avg + grad * (1 - beta0)
            np.multiply(g_, one - beta0, out=t_)
            np.add(m, t_, out=m)
            np.multiply(v, beta1, out=v)  # exp_avg_sq = beta1 * exp_avg_sq + (1 - beta1) * grad * grad
            np.multiply(g_, g_, out=t_)
            np.multiply(t_, one - beta1, out=t_)
            np.add(v, t_, out=v)
            np.divide(m, correction0, out=g_)  # delta = m_hat / (sqrt(v_hat) + eps)
            np.divide(v, correction1, out=t_)
            np.sqrt(t_, out=t_)
            np.add(t_, self.eps, out=t_)
            np.divide(g_, t_, out=g_)
            np.multiply(g_, lr, out=g_)
            np.subtract(p, g_, out=p)
            for average, decay, weight in moves:  # average = average * decay + param * (1 - decay)
                e = average[c]
                np.multiply(e, decay, out=e)
                np.multiply(p, weight, out=t_)
                np.add(e, t_, out=e)

    def write_params(self):
        """Write the weights into the model's parameters (the buffers hold the state; the model is a view)."""
        for param, value in zip(self.params, self.views(self.param)):
            assign_(param, megengine.tensor(value, device=param.device))

    def write_back(self):
        """Write the weights into the model, the EMA weights into the EMA model and the moments and step count into
        the optimizer."""
        self.write_params()
        for param, value in zip(self.ema_params, self.views(self.averages[0])):
            assign_(param, megengine.tensor(value, device=param.device))
        state = self.optimizer.state_dict(keep_var=True)
        step = np.array(self.step_count, np.float32)
        for i, m, v in zip(state["param_groups"][0]["params"], self.views(self.exp_avg), self.views(self.exp_avg_sq)):
            state["state"][i] = {"exp_avg": m, "exp_avg_sq": v, "step": step}
        self.optimizer.load_state_dict(state)
