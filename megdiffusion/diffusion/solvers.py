"""Fast samplers of the probability-flow ODE (and one SDE) of a discrete-time DDPM: Euler and Heun (Karras et al.
2022), DPM-Solver++ 2M / 3M / 2M-SDE (Lu et al. 2022) and UniPC with B(h) = expm1(-h) ("bh2", Zhao et al. 2023).
Imports no MegEngine: the arithmetic works on numpy arrays and MegEngine tensors alike.

Every solver works on y = x_t / sqrt(alpha_bar) at noise level sigma = sqrt((1 - alpha_bar) / alpha_bar) (the
"VE" state; the model sees x_t = y / sqrt(1 + sigma^2)), from ``sigmas[0]`` down a grid that ends at sigma = 0.
``denoise(i, y)`` is the model's x_0 prediction at ``sigmas[i]``. With lambda = -log sigma and h = lambda_{i+1} -
lambda_i, DPM-Solver++ and UniPC are the VP formulas of diffusers' schedulers divided by alpha_{i+1}; the last step
of every solver returns the x_0 prediction of its last model call.

Timestep grids (``make_grid``), for a chain of n steps with alpha_bar table a_0..a_{n-1}; each follows the diffusers
scheduler of its sampler family, so published settings reproduce:

- ``leading``: t = (N-1..0) * (n // N), DDIM's paper and improved-diffusion's "ddimN";
- ``trailing``: round(arange(n, 0, -n / N)) - 1, from the last timestep down (Lin et al. 2024);
- ``linspace``: multistep solvers (DPM-Solver++, UniPC) N of the N + 1 rounded points of linspace(0, n - 1), the 0
  dropped (their step to sigma 0 replaces it); Euler and Heun the N fractional points linspace(n - 1, 0, N), sigma
  interpolated linearly between table entries; DDPM and DDIM the N rounded points including 0;
- ``karras``: sigma_i = (smax^(1/7) + i / (N - 1) (smin^(1/7) - smax^(1/7)))^7 between the table's ends;
- ``logsnr``: sigma evenly spaced in log between the table's ends (uniform log-SNR, DPM-Solver's own choice).
On ``karras`` and ``logsnr`` the model is called at the solver's sigma, its timestep the fractional t whose log
sigma interpolates the table linearly (diffusers' ``_sigma_to_t``).
"""
from dataclasses import dataclass

import numpy as np

EULER, HEUN, DPMPP_2M, DPMPP_3M, DPMPP_2M_SDE, UNIPC = "euler", "heun", "dpmpp_2m", "dpmpp_3m", "dpmpp_2m_sde", "unipc"
# name -> the orders it has (the first is the default): a solver of order p uses the last p model outputs.
ORDERS = {EULER: (1,), HEUN: (2,), DPMPP_2M: (2,), DPMPP_3M: (3,), DPMPP_2M_SDE: (2,), UNIPC: (2, 3)}
SOLVERS = tuple(ORDERS)
MULTISTEP = (DPMPP_2M, DPMPP_3M, DPMPP_2M_SDE, UNIPC)
INTEGER_SPACINGS = ("leading", "linspace", "trailing")
SPACINGS = INTEGER_SPACINGS + ("karras", "logsnr")
KARRAS_RHO = 7.0
DEFAULT_STEPS = 20
DEFAULT_SPACING = "karras"


def with_defaults(steps, spacing):
    """A solver's (steps, spacing), None standing for ``DEFAULT_STEPS`` and ``DEFAULT_SPACING``."""
    return DEFAULT_STEPS if steps is None else steps, spacing or DEFAULT_SPACING


def sampler_label(sampler, steps, respacing=None, spacing=None, order=None):
    """How outputs name a sampler setting: "ddim-50", "ddpm-respacing 50", "unipc3-20 karras"."""
    if respacing:
        return f"{sampler}-respacing {respacing}"
    if sampler not in SOLVERS:
        return f"{sampler}-{steps}" + (f" {spacing}" if spacing else "")
    steps, spacing = with_defaults(steps, spacing)
    return f"{sampler}{order or ''}-{steps} {spacing}"


def calls_per_image(sampler, steps):
    """Network calls of one image (without guidance): Heun calls twice per step but not on the last."""
    return 2 * steps - 1 if sampler == HEUN else steps


def check_solver(sampler, steps, spacing, order):
    """ValueError (one line) unless ``sampler`` has ``order`` and ``spacing`` gives it ``steps`` steps."""
    if spacing not in SPACINGS:
        raise ValueError(f"unknown spacing {spacing!r}; choose one of {', '.join(SPACINGS)}")
    orders = ORDERS[sampler]
    if order is not None and order not in orders:
        raise ValueError(f"{sampler} has order {' or '.join(map(str, orders))}, not {order}")
    need = max(order or orders[0], 2 if spacing in ("karras", "logsnr") else 1)
    if int(steps) != steps or steps < need:
        raise ValueError(f"{sampler} with --spacing {spacing} needs --steps >= {need}, got {steps}")


@dataclass(frozen=True)
class Grid:
    """The noise levels of a solver run and where the model is called."""

    sigmas: np.ndarray  # (N + 1,) float64, decreasing, the last 0
    timesteps: np.ndarray  # (N,) float64: the chain index (fractional on karras / logsnr) of the call at sigmas[i]


def sigma_table(alphas_cumprod):
    """sigma_t = sqrt((1 - alpha_bar_t) / alpha_bar_t) of each timestep (float64, increasing)."""
    abar = np.asarray(alphas_cumprod, dtype=np.float64)
    return np.sqrt((1.0 - abar) / abar)


def integer_timesteps(n, steps, spacing, drop_zero=True, last=None):
    """The decreasing integer timesteps of ``spacing`` (leading, linspace, trailing) over a chain of ``n``.

    ``linspace``: with ``drop_zero`` (the multistep solvers) N of the N + 1 rounded points of linspace(0, last - 1),
    the 0 dropped; without (DDPM, DDIM) the N rounded points of linspace(0, n - 1). ``last`` (default n; diffusers'
    ``lambda_min_clipped`` lowers it) bounds ``linspace`` and ``trailing``.
    """
    last = n if last is None else last
    if spacing == "leading":
        return np.arange(steps - 1, -1, -1, dtype=np.float64) * (n // steps)
    if spacing == "trailing":
        return np.round(np.arange(last, 0, -last / steps)) - 1
    if not drop_zero:
        return np.round(np.linspace(0, n - 1, steps))[::-1]
    return np.round(np.linspace(0, last - 1, steps + 1))[::-1][:-1]


def make_grid(alphas_cumprod, steps, spacing, sampler, lambda_min_clipped=-np.inf):
    """The ``Grid`` of ``sampler`` over a chain with these ``alphas_cumprod``: ``steps`` model-call levels of
    ``spacing``, then sigma 0."""
    table = sigma_table(alphas_cumprod)
    n = len(table)
    index = np.arange(n, dtype=np.float64)
    if spacing in ("karras", "logsnr"):
        smin, smax = table[0], table[-1]
        if spacing == "karras":
            ramp = np.linspace(0.0, 1.0, steps)
            top, bottom = smax ** (1 / KARRAS_RHO), smin ** (1 / KARRAS_RHO)
            sigmas = (top + ramp * (bottom - top)) ** KARRAS_RHO
        else:
            sigmas = np.exp(np.linspace(np.log(smax), np.log(smin), steps))
        timesteps = np.interp(np.log(sigmas), np.log(table), index)
    elif spacing == "linspace" and sampler in (EULER, HEUN):
        timesteps = np.linspace(n - 1, 0, steps)
        sigmas = np.interp(timesteps, index, table)
    else:
        last = n - int(np.sum(-np.log(table) < lambda_min_clipped))  # lambda = -log sigma
        timesteps = integer_timesteps(n, steps, spacing, sampler in MULTISTEP, last)
        sigmas = table[timesteps.astype(np.int64)]
    return Grid(np.append(sigmas, 0.0), timesteps)


def distinct_levels(alphas_cumprod, steps, spacing, sampler):
    """Whether ``make_grid`` gives ``sampler`` ``steps`` model calls at strictly decreasing noise levels above 0 on
    this chain (more steps than an integer spacing has timesteps repeat levels, or reach t = 0 or t = -1)."""
    grid = make_grid(alphas_cumprod, steps, spacing, sampler)
    calls = grid.sigmas[:-1]
    return bool(np.all(calls > 0) and np.all(np.diff(calls) < 0) and np.all(grid.timesteps >= 0))


def _lambdas(sigmas):
    """lambda = -log sigma (+inf at sigma 0)."""
    with np.errstate(divide="ignore"):
        return -np.log(sigmas)


def multistep_orders(sampler, steps, order, lower_order_final=True):
    """The order of each step of a multistep solver, as diffusers takes them: step i uses at most i + 1 outputs
    (warm-up) and the last step is first order (its target is sigma 0). DPM-Solver++ under 15 steps takes the
    second-to-last at most at order 2 (``lower_order_final``); UniPC's order falls to the steps left at every N."""
    orders = []
    for i in range(steps):
        p = min(order, i + 1)
        if sampler == UNIPC:
            p = min(p, steps - i)
        elif i == steps - 1:
            p = 1
        elif i == steps - 2 and lower_order_final and steps < 15:
            p = min(p, 2)
        orders.append(p)
    return orders


def solve(sampler, y, sigmas, denoise, order=None, draw_noise=None, progress=None, lower_order_final=True):
    """Run ``sampler`` from y (the VE state at ``sigmas[0]``) down ``sigmas`` (ending at 0); returns the last x_0
    prediction. ``denoise(i, y)``: the model's x_0 at (y, sigmas[i]); ``draw_noise()``: a standard normal draw
    shaped like y (stochastic samplers); ``progress``: a tqdm bar advanced once per model call."""
    order = order or ORDERS[sampler][0]

    def call(i, state):
        out = denoise(i, state)
        if progress is not None:
            progress.update(1)
        return out

    sigmas = np.asarray(sigmas, dtype=np.float64)
    if sampler in (EULER, HEUN):
        return _euler_heun(sampler == HEUN, y, sigmas, call)
    if sampler == UNIPC:
        return _unipc(y, sigmas, call, order)
    return _dpmpp(y, sigmas, call, multistep_orders(sampler, len(sigmas) - 1, order, lower_order_final),
                  draw_noise if sampler == DPMPP_2M_SDE else None)


def _euler_heun(heun, y, sigmas, call):
    """Karras et al. 2022, Algorithm 1 without churn: dy/dsigma = (y - D) / sigma; Heun corrects each step with the
    slope at its end, except the last (to sigma 0)."""
    for i in range(len(sigmas) - 1):
        s, s_next = sigmas[i], sigmas[i + 1]
        x0 = call(i, y)
        if s_next == 0:
            return x0
        slope = (y - x0) * float(1.0 / s)
        euler = y + slope * float(s_next - s)
        if not heun:
            y = euler
            continue
        slope_next = (euler - call(i + 1, euler)) * float(1.0 / s_next)
        y = y + (slope + slope_next) * float(0.5 * (s_next - s))
    return y


def _dpmpp(y, sigmas, call, orders, draw_noise=None):
    """DPM-Solver++ multistep (data prediction, midpoint form of 2M), with ``draw_noise`` its SDE variant: per
    step y <- e^-h y + (1 - e^-h) x0 + corrections of the earlier x0, e^-h = sigma_{i+1} / sigma_i."""
    lam = _lambdas(sigmas)
    outputs = []
    for i, p in enumerate(orders):
        outputs.append(call(i, y))
        if sigmas[i + 1] == 0:
            return outputs[-1]
        h = lam[i + 1] - lam[i]
        d0 = outputs[-1]
        keep, gain = float(np.exp(-h)), float(-np.expm1(-h))  # e^-h, 1 - e^-h
        if draw_noise is not None:
            keep, gain = float(np.exp(-2 * h)), float(-np.expm1(-2 * h))
        if p == 1:
            y = y * keep + d0 * gain
        else:
            r0 = (lam[i] - lam[i - 1]) / h
            d1_0 = (d0 - outputs[-2]) * float(1 / r0)
            if p == 2:
                y = y * keep + (d0 + d1_0 * 0.5) * gain
            else:
                r1 = (lam[i - 1] - lam[i - 2]) / h
                d1_1 = (outputs[-2] - outputs[-3]) * float(1 / r1)
                d1 = d1_0 + (d1_0 - d1_1) * float(r0 / (r0 + r1))
                d2 = (d1_0 - d1_1) * float(1 / (r0 + r1))
                y = y * keep + d0 * gain + d1 * float(np.expm1(-h) / h + 1) \
                    - d2 * float((np.expm1(-h) + h) / h ** 2 - 0.5)
        if draw_noise is not None:
            y = y + draw_noise() * float(sigmas[i + 1] * np.sqrt(gain))
        del outputs[:-2]
    return y


def _unipc_coefficients(rks, h, order):
    """UniPC's (R, b) for B(h) = expm1(-h): R[k] = rks^k, b[k] = k! phi_{k+1}(-h) / B(h), k < order (Zhao et al.
    2023, with the recursion phi_{k+1}(x) = (phi_k(x) - 1 / k!) / x)."""
    hh = -h
    b_h = np.expm1(hh)
    phi = np.expm1(hh) / hh - 1.0
    factorial, rows, b = 1, [], []
    for k in range(1, order + 1):
        rows.append(np.power(rks, k - 1))
        b.append(phi * factorial / b_h)
        factorial *= k + 1
        phi = phi / hh - 1.0 / factorial
    return np.stack(rows), np.array(b), b_h


def _unipc_update(y, outputs, lam, i, order, corrected=None):
    """One UniPC move from level i (state y, outputs[-1] its x0, earlier outputs before it) to level i + 1: the
    predictor UniP of ``order``, or with ``corrected`` (the x0 at the predicted level i + 1) the corrector UniC."""
    h = lam[i + 1] - lam[i]
    m0 = outputs[-1]
    rks = np.array([(lam[i - k] - lam[i]) / h for k in range(1, order)] + [1.0])
    differences = [(outputs[-1 - k] - m0) * float(1 / rks[k - 1]) for k in range(1, order)]
    matrix, b, b_h = _unipc_coefficients(rks, h, order)
    if corrected is None:
        rhos = [0.5] if order == 2 else (np.linalg.solve(matrix[:-1, :-1], b[:-1]) if order > 2 else [])
    else:
        rhos = [0.5] if order == 1 else np.linalg.solve(matrix, b)
        differences.append(corrected - m0)
    result = y * float(np.exp(-h)) + m0 * float(-np.expm1(-h))
    for rho, difference in zip(rhos, differences):
        result = result - difference * float(b_h * rho)
    return result


def _unipc(y, sigmas, call, order):
    """UniPC (bh2): each step's predictor of order min(order, steps done + 1, steps left); from the second model
    call on, the corrector of the previous step's order first replaces the state with the new output (which is not
    recomputed)."""
    lam = _lambdas(sigmas)
    steps = len(sigmas) - 1
    orders = multistep_orders(UNIPC, steps, order)
    outputs, previous = [], None
    for i in range(steps):
        x0 = call(i, y)
        if previous is not None:
            last_y, last_order = previous
            y = _unipc_update(last_y, outputs, lam, i - 1, last_order, corrected=x0)
        outputs.append(x0)
        if sigmas[i + 1] == 0:
            return x0
        previous = (y, orders[i])
        y = _unipc_update(y, outputs, lam, i, orders[i])
        del outputs[:-order]
    return y
