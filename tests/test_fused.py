"""The compiled kernels of the numpy pass (``cpu.fused``): the exponential against float64's, GroupNorm + SiLU and the
softmax against the numpy layers they replace, and the one-line note where numba does not import."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megdiffusion.cpu import fused
from megdiffusion.cpu.numpy_unet import _Layers
from types import SimpleNamespace

needs_kernels = pytest.mark.skipif(not fused.available(), reason="the compiled kernels are off (numba missing or "
                                   "MEGDIFFUSION_NUMBA=0)")


def relative(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


@needs_kernels
def test_the_exponential_is_within_two_ulp_over_float32s_range():
    x = np.concatenate([np.linspace(-87, 88, 20_001, dtype=np.float32),
                        np.random.default_rng(0).uniform(-3, 3, 5_000).astype(np.float32)])
    got = np.array([fused._exp(value) for value in x], np.float32)
    exact = np.exp(x.astype(np.float64))
    # Two units in the last place, relative: 2 * 2^-23 at most (np.spacing is 0 near float32's smallest normal once
    # MegEngine has turned on flush-to-zero).
    assert np.all(np.abs(got - exact) <= 2 * 2.0 ** -23 * exact)


def numpy_norm(x, shift, gamma, beta, groups, eps, silu, dy):
    """The numpy layers' GroupNorm (+ SiLU): output, d x, d shift, d gamma, d beta."""
    grads = [np.zeros_like(gamma), np.zeros_like(beta)]
    layers = _Layers([gamma, beta], grads, None)
    module = SimpleNamespace(num_groups=groups, eps=eps, weight=0, bias=1)
    y, backward = layers._numpy_norm(module, x, silu, shift, gamma, beta)
    dx, dshift = backward(dy)
    return y, dx, dshift, grads[0], grads[1]


@needs_kernels
@pytest.mark.parametrize("silu", [True, False])
@pytest.mark.parametrize("shape,groups,with_shift", [((3, 7, 5, 16), 4, True), ((2, 4, 4, 32), 32, False),
                                                     ((1, 9, 9, 6), 1, True)])
def test_norm_forward_and_backward_equal_the_numpy_layers(shape, groups, with_shift, silu):
    rng = np.random.default_rng(sum(shape) + groups)
    n, c = shape[0], shape[-1]
    x = (rng.standard_normal(shape) * 3 + 1.5).astype(np.float32)
    shift = rng.standard_normal((n, c)).astype(np.float32) if with_shift else None
    gamma, beta = (rng.standard_normal(c).astype(np.float32) for _ in range(2))
    dy = rng.standard_normal(shape).astype(np.float32)
    y_ref, dx_ref, dshift_ref, dgamma_ref, dbeta_ref = numpy_norm(x, shift, gamma, beta, groups, 1e-6, silu, dy)

    rows = x.reshape(n, -1, c)
    shift_rows = np.zeros((n, c), np.float32) if shift is None else shift
    y, mean, rstd = fused.norm_forward(rows, shift_rows, gamma, beta, groups, 1e-6, silu)
    dgamma, dbeta = np.full(c, 0.5, np.float32), np.full(c, 0.5, np.float32)  # gradients are added to these
    dx, dshift = fused.norm_backward(rows, shift_rows, dy.reshape(rows.shape), gamma, beta, mean, rstd, groups, silu,
                                     dgamma, dbeta)
    assert relative(y.reshape(shape), y_ref) < 1e-6
    assert relative(dx.reshape(shape), dx_ref) < 1e-5
    assert relative(dgamma - 0.5, dgamma_ref) < 1e-5 and relative(dbeta - 0.5, dbeta_ref) < 1e-5
    if shift is not None:
        assert relative(dshift, dshift_ref) < 1e-5


@needs_kernels
def test_the_norm_of_a_constant_group_is_beta():
    """Variance 0: rstd is 1/sqrt(eps), the normed values 0, the output beta (then SiLU(beta))."""
    x = np.full((2, 3, 4), 7.0, np.float32)
    gamma, beta = np.full(4, 2.0, np.float32), np.array([-1.0, 0.0, 1.0, 2.0], np.float32)
    y, mean, rstd = fused.norm_forward(x, np.zeros((2, 4), np.float32), gamma, beta, 2, 1e-6, False)
    np.testing.assert_allclose(y, np.broadcast_to(beta, x.shape), atol=1e-6)
    np.testing.assert_allclose(mean, 7.0)
    np.testing.assert_allclose(rstd, 1e3, rtol=1e-6)


@needs_kernels
def test_softmax_equals_numpy_and_survives_large_logits():
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal((40, 33)) * 30).astype(np.float32)
    logits[0, :] = [1e4] + [-1e4] * 32
    scaled = logits.astype(np.float64) * 0.25
    expected = np.exp(scaled - scaled.max(axis=1, keepdims=True))
    expected /= expected.sum(axis=1, keepdims=True)
    got = logits.copy()
    fused.softmax_rows(got, 0.25)
    assert np.abs(got - expected).max() < 1e-6
    # exp is clamped at exp(-87.3), no underflow to 0; the winner is 1 to the last bit of its reciprocal (1 - 2^-24
    # on this session's CPU, 1.0 on earlier ones: the compiled division's rounding)
    assert abs(got[0, 0] - 1.0) <= np.finfo(np.float32).eps and np.all(got[0, 1:] < 1e-37)


def run_python(code, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, **env))


def test_without_numba_the_numpy_layers_run_after_a_one_line_note():
    code = ("import sys; sys.modules['numba'] = None\n"
            "from megdiffusion.cpu import fused\n"
            "assert not fused.available()\n"
            "fused.note_if_missing(); fused.note_if_missing()\n")
    result = run_python(code, MEGDIFFUSION_NUMBA="1")  # wanted, but missing
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("note:")]
    assert len(lines) == 1 and "numba" in lines[0] and "pip install numba==" in lines[0]


def test_megdiffusion_numba_0_turns_the_kernels_off_without_a_note():
    result = run_python("from megdiffusion.cpu import fused\nassert not fused.available()\nfused.note_if_missing()",
                        MEGDIFFUSION_NUMBA="0")
    assert result.returncode == 0 and "note:" not in result.stderr, result.stderr


@needs_kernels
def test_the_kernels_compile_where_no_cache_directory_can_be_written(tmp_path):
    """A read-only install with no writable cache directory: numba cannot cache, the kernels still compile."""
    (tmp_path / "fused_copy.py").write_text(Path(fused.__file__).read_text())
    (tmp_path / "__pycache__").write_text("")  # a file where numba would make its cache directory
    blocked = tmp_path / "__pycache__" / "cache"
    code = ("import numpy as np, fused_copy\n"
            "x = np.ones((1, 2, 4), np.float32)\n"
            "y, _, _ = fused_copy.norm_forward(x, np.zeros((1, 4), np.float32), np.ones(4, np.float32), "
            "np.ones(4, np.float32), 2, 1e-6, False)\n"
            "assert np.allclose(y, 1.0)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                            env=dict(os.environ, PYTHONPATH=str(tmp_path), NUMBA_CACHE_DIR=str(blocked),
                                     XDG_CACHE_HOME=str(blocked), HOME=str(blocked)))
    assert result.returncode == 0, result.stderr
