"""Post-hoc EMA (Karras et al. 2024, EDM2, §3 and Appendix C): power-function EMA profiles tracked during training,
and the EMA of any other length rebuilt afterwards from snapshots of them.

A profile of relative standard deviation ``sigma_rel`` averages the weights seen up to t (in images) with density
p(t') = (gamma + 1) t'^gamma / t^(gamma + 1); it is tracked with the decay ``beta`` of each step, and a target profile
is the least-squares combination of the snapshots' profiles (``coefficients``). Float64 throughout; numpy only.
"""
import numpy as np

MAX_SIGMA_REL = 0.28  # beyond it gamma < 0.2 or so: a profile weighted towards the first images, not an average


def parse_sigma_rels(texts, flag):
    """``texts`` as distinct relative standard deviations in (0, ``MAX_SIGMA_REL``], in their order; ValueError (one
    line naming ``flag``) otherwise: what --ema_profiles and --sigma_rel take."""
    try:
        values = tuple(float(text) for text in texts)
    except ValueError:
        raise ValueError(f"{flag} must be relative standard deviations, comma-separated (e.g. 0.05,0.10); got "
                         f"{','.join(texts)}") from None
    wrong = [v for v in values if not 0 < v <= MAX_SIGMA_REL]
    if wrong:
        raise ValueError(f"{flag}: sigma_rel {wrong[0]:g} is outside (0, {MAX_SIGMA_REL}]: EDM2 tracks 0.05 and "
                         "0.10; a profile beyond the bound weights the first images most, which no EMA does")
    if len(set(values)) != len(values):
        raise ValueError(f"{flag} names a length twice ({','.join(texts)}); give each once")
    return values


def gamma_of(sigma_rel):
    """The exponent gamma of a profile of relative standard deviation ``sigma_rel``: the largest real root of
    gamma^3 + 7 gamma^2 + (16 - sigma_rel^-2) gamma + (12 - sigma_rel^-2) (EDM2 Eq. 126), polished by Newton."""
    s = float(sigma_rel) ** -2
    coefficients = [1.0, 7.0, 16.0 - s, 12.0 - s]
    roots = np.roots(coefficients)
    gamma = float(roots[np.abs(roots.imag) < 1e-6].real.max())
    for _ in range(3):  # the companion-matrix root is good to ~1e-14; two steps of Newton make it exact
        gamma -= np.polyval(coefficients, gamma) / np.polyval([3.0, 14.0, 16.0 - s], gamma)
    return gamma


def sigma_rel_of(gamma):
    """The relative standard deviation of a profile of exponent ``gamma`` (the inverse of ``gamma_of``)."""
    return float(np.sqrt((gamma + 1) / ((gamma + 2) ** 2 * (gamma + 3))))


def beta(gamma, t_next, t_delta):
    """The decay of the step that brings the images seen from ``t_next - t_delta`` to ``t_next``: 0 at the first
    step, so a profile starts at the weights."""
    return float((1.0 - t_delta / t_next) ** (gamma + 1))


def inner(t_a, gamma_a, t_b, gamma_b):
    """The inner product of the profiles ended at ``t_a`` and ``t_b``, written in ratios <= 1 (the textbook
    t^(gamma + 1) overflows float64 for large gamma)."""
    m = min(t_a, t_b)
    return ((gamma_a + 1) * (gamma_b + 1) / (gamma_a + gamma_b + 1)
            * (m / t_a) ** (gamma_a + 1) * (m / t_b) ** (gamma_b + 1) / m)


def coefficients(snapshots, target):
    """``(weights, condition_number)``: the weights of ``snapshots`` (``(t, sigma_rel)`` each) whose combined profile
    best matches ``target`` (``(t, sigma_rel)``) in least squares, normalised to sum 1, and the condition number of
    the snapshots' Gram matrix (the weights' sensitivity)."""
    profiles = [(float(t), gamma_of(s)) for t, s in snapshots]
    gram = np.array([[inner(*a, *b) for b in profiles] for a in profiles])
    wanted = np.array([inner(*a, float(target[0]), gamma_of(target[1])) for a in profiles])
    weights = np.linalg.solve(gram, wanted)
    return weights / weights.sum(), float(np.linalg.cond(gram))


class Tracker:
    """Power-function EMAs of one array of weights, one per ``sigma_rels``, updated after each step in float64
    (the conformance reference; training keeps them in float32 inside the update, ``FlatUpdate`` and
    ``DeviceEngine``)."""

    def __init__(self, weights, sigma_rels):
        self.gammas = [gamma_of(s) for s in sigma_rels]
        self.averages = [np.array(weights, np.float64) for _ in sigma_rels]

    def update(self, weights, t_next, t_delta):
        """Fold in the weights after the step that reached ``t_next`` images (``t_delta`` of them)."""
        for gamma, average in zip(self.gammas, self.averages):
            b = beta(gamma, t_next, t_delta)
            average *= b
            average += (1 - b) * np.asarray(weights, np.float64)
