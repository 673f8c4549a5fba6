"""Compiled kernels (numba) for the numpy pass: GroupNorm with its SiLU, forward and backward, in two passes over
an activation where numpy took eleven, and the attention's softmax in one.

Each kernel runs on the calling thread (no parallel loops: ``group_workers`` gives each core a process). The
exponential is our own (``_exp``: Cody-Waite reduction and a degree-6 polynomial, within 2 ulp of float32's exp
over its range) so that the loops compile to SIMD code on any x86 machine: numba's ``math.exp`` calls libm one
value at a time unless Intel's large SVML runtime is installed (benchmarks/README.md, "Ahead of PyTorch").

``available()`` is False where numba does not import (``MEGDIFFUSION_NUMBA=0`` does the same); ``numpy_unet``
then keeps its numpy layers, which the tests hold these kernels to.
"""
import sys
import warnings

import numpy as np
from megdiffusion import environment

# MegEngine's library turns on flush-to-zero when it loads; numba's first kernel load then imports scipy, whose
# module-level np.finfo calls warn that subnormals are zero. Nothing here depends on subnormals.
warnings.filterwarnings("ignore", message="The value of the smallest subnormal", category=UserWarning)

_missing = None  # why numba did not import, when it was wanted
njit = None
if environment.read("MEGDIFFUSION_NUMBA", True):
    try:
        from llvmlite import ir
        from numba import njit, types
        from numba.extending import intrinsic
    except ImportError as error:  # the numpy layers run
        _missing = error


def available():
    """Whether the compiled kernels can run (numba imported; ``MEGDIFFUSION_NUMBA=0`` turns them off)."""
    return njit is not None


def note_if_missing():
    """Print, once per process, a one-line note when numba was wanted but did not import."""
    global _missing
    if _missing is not None:
        print(f"note: numba did not import ({_missing}); the CPU path's GroupNorm, SiLU and softmax run in numpy, "
              "slower ('pip install numba==0.61.2' restores them)", file=sys.stderr)
        _missing = None


if njit is not None:
    def _compiled(**options):
        """numba's ``njit`` with our options, the machine code cached on disk where numba finds a writable place
        (beside this file, or the user's cache directory), else compiled once in each process."""
        options.update(fastmath=True, error_model="numpy")

        def decorate(function):
            try:
                return njit(cache=True, **options)(function)
            except RuntimeError:  # "cannot cache function ...: no locator available"
                return njit(**options)(function)

        return decorate

    _jit = _compiled(nogil=True)

    @intrinsic
    def _float_from_bits(typingctx, bits):
        """The float32 whose bit pattern is the int32 ``bits``."""

        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.FloatType())

        return types.float32(types.int32), codegen

    @_compiled(inline="always")
    def _exp(x):
        """exp(x) in float32: x = k ln2 + r, |r| <= ln2 / 2, exp(r) by Cephes' expf polynomial, times 2^k built
        from its bits. x is clamped to [-87.3, 88.3] so that 2^k stays a normal number: below, exp(-87.3) ~ 1e-38
        instead of a subnormal or 0."""
        x = min(max(x, np.float32(-87.3)), np.float32(88.3))
        k = np.floor(x * np.float32(1.4426950408889634) + np.float32(0.5))
        r = x - k * np.float32(0.693359375) + k * np.float32(2.12194440e-4)
        p = np.float32(1.9875691500e-4)
        p = p * r + np.float32(1.3981999507e-3)
        p = p * r + np.float32(8.3334519073e-3)
        p = p * r + np.float32(4.1665795894e-2)
        p = p * r + np.float32(1.6666665459e-1)
        p = p * r + np.float32(5.0000001201e-1)
        p = p * (r * r) + r + np.float32(1.0)
        return p * _float_from_bits((np.int32(k) + np.int32(127)) << np.int32(23))

    @_compiled(inline="always")
    def _silu_slope(h, silu):
        """d SiLU(h) / dh when ``silu``, else 1 (a select, not a branch: the loop around it stays vectorised)."""
        s = np.float32(1.0) / (np.float32(1.0) + _exp(-h))
        return s * (np.float32(1.0) + h * (np.float32(1.0) - s)) if silu else np.float32(1.0)

    @_jit
    def _norm_forward(x, shift, gamma, beta, groups, eps, silu, y, mean, rstd):
        n, positions, c = x.shape
        per_group = c // groups
        count = positions * per_group
        sums = np.empty(c, np.float64)
        squares = np.empty(c, np.float64)
        scale = np.empty(c, np.float32)
        offset = np.empty(c, np.float32)
        for i in range(n):
            sums[:] = 0.0
            squares[:] = 0.0
            for p in range(positions):
                for j in range(c):
                    v = np.float64(x[i, p, j] + shift[i, j])
                    sums[j] += v
                    squares[j] += v * v
            for g in range(groups):
                total = 0.0
                total_squares = 0.0
                for j in range(g * per_group, (g + 1) * per_group):
                    total += sums[j]
                    total_squares += squares[j]
                m = total / count
                variance = max(total_squares / count - m * m, 0.0)
                mean[i, g] = m
                rstd[i, g] = 1.0 / np.sqrt(variance + eps)
            for j in range(c):  # y = (x + shift - mean) * rstd * gamma + beta = x * scale + offset
                g = j // per_group
                scale[j] = rstd[i, g] * gamma[j]
                offset[j] = beta[j] + (shift[i, j] - mean[i, g]) * scale[j]
            for p in range(positions):
                for j in range(c):
                    h = x[i, p, j] * scale[j] + offset[j]
                    y[i, p, j] = h / (np.float32(1.0) + _exp(-h)) if silu else h

    @_jit
    def _norm_backward(x, shift, dy, gamma, beta, mean, rstd, groups, silu, dx, dgamma, dbeta, dshift):
        n, positions, c = x.shape
        per_group = c // groups
        count = positions * per_group
        slope = np.empty(c, np.float32)  # normed = x * slope + intercept
        intercept = np.empty(c, np.float32)
        dh_sums = np.empty(c, np.float32)  # float32 sums: twice float64's lanes, and numpy's rounding
        dh_normed_sums = np.empty(c, np.float32)
        a = np.empty(c, np.float32)  # dx = d(normed * gamma + beta) * a + b + x * b_x
        b = np.empty(c, np.float32)
        b_x = np.empty(c, np.float32)
        for i in range(n):
            for j in range(c):
                g = j // per_group
                slope[j] = rstd[i, g]
                intercept[j] = (shift[i, j] - mean[i, g]) * rstd[i, g]
            dh_sums[:] = 0.0
            dh_normed_sums[:] = 0.0
            for p in range(positions):
                for j in range(c):
                    normed = x[i, p, j] * slope[j] + intercept[j]
                    dh = dy[i, p, j] * _silu_slope(normed * gamma[j] + beta[j], silu)
                    dh_sums[j] += dh
                    dh_normed_sums[j] += dh * normed
            for j in range(c):
                dgamma[j] += dh_normed_sums[j]
                dbeta[j] += dh_sums[j]
            for g in range(groups):
                mean_dnormed = 0.0
                mean_dnormed_normed = 0.0
                for j in range(g * per_group, (g + 1) * per_group):
                    mean_dnormed += gamma[j] * dh_sums[j]
                    mean_dnormed_normed += gamma[j] * dh_normed_sums[j]
                mean_dnormed /= count
                mean_dnormed_normed /= count
                for j in range(g * per_group, (g + 1) * per_group):
                    a[j] = rstd[i, g] * gamma[j]
                    b[j] = -rstd[i, g] * (mean_dnormed + intercept[j] * mean_dnormed_normed)
                    b_x[j] = -rstd[i, g] * slope[j] * mean_dnormed_normed
            dshift[i, :] = 0.0
            for p in range(positions):
                for j in range(c):
                    h = (x[i, p, j] * slope[j] + intercept[j]) * gamma[j] + beta[j]
                    dh = dy[i, p, j] * _silu_slope(h, silu)
                    value = dh * a[j] + b[j] + x[i, p, j] * b_x[j]
                    dx[i, p, j] = value
                    dshift[i, j] += value

    @_jit
    def _softmax_rows(logits, scale):
        rows, columns = logits.shape
        for r in range(rows):
            top = logits[r, 0]
            for k in range(1, columns):
                top = max(top, logits[r, k])
            total = np.float32(0.0)
            for k in range(columns):
                e = _exp((logits[r, k] - top) * scale)
                logits[r, k] = e
                total += e
            inverse = np.float32(1.0) / total
            for k in range(columns):
                logits[r, k] *= inverse


def norm_forward(x, shift, gamma, beta, groups, eps, silu):
    """GroupNorm of ``x + shift`` (x (N, P, C) channels last, ``shift`` (N, C) added at every position), then
    SiLU when ``silu``: (output, mean, rstd), the statistics (N, groups) being what ``norm_backward`` needs."""
    y = np.empty(x.shape, np.float32)
    mean = np.empty((len(x), groups), np.float32)
    rstd = np.empty((len(x), groups), np.float32)
    _norm_forward(x, shift, gamma, beta, groups, np.float64(eps), silu, y, mean, rstd)
    return y, mean, rstd


def norm_backward(x, shift, dy, gamma, beta, mean, rstd, groups, silu, dgamma, dbeta):
    """(d x, d shift) of ``norm_forward`` for the output gradient ``dy``; the gradients of gamma and beta are added
    into ``dgamma`` and ``dbeta`` (float32, (C,))."""
    dx = np.empty(x.shape, np.float32)
    dshift = np.empty(shift.shape, np.float32)
    _norm_backward(x, shift, dy, gamma, beta, mean, rstd, groups, silu, dx, dgamma, dbeta, dshift)
    return dx, dshift


def softmax_rows(logits, scale):
    """softmax(``logits`` * ``scale``) along the last axis of a C-contiguous float32 2-D array, in place."""
    _softmax_rows(logits, np.float32(scale))
