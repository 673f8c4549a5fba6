"""Conv2d used by every convolution of the UNet, computed outside MegEngine on CPUs.

MegEngine's x86 kernel for the convolution *weight* gradient is many times slower than its forward pass, and its default
forward kernels were slower than im2col + OpenBLAS on the CPU recipe's shapes (benchmarks/README.md, "Design choices
measured"). On the fast path the convolution is a ``megengine.autodiff.Function`` with two kernels:

- oneDNN's JIT convolutions (``megdiffusion.cpu.onednn``) for kernels larger than 1x1, forward and backward,
  when the library is installed (faster than the numpy kernels on the UNet's 3x3 shapes);
- numpy for 1x1 kernels (a plain matmul, where oneDNN's per-call overhead lost) and wherever oneDNN is
  missing: im2col of the input (a strided view, copied per batch chunk), one matmul per sample; weight
  gradient: the same im2col, one matmul per sample with dy, the products summed in batch order; input
  gradient: stride 1, a correlation of dy with the flipped, transposed kernel (padding k - 1 - p); other
  strides, W^T dy per window added back window by window (col2im); bias gradient: dy summed over batch and
  space (float64 accumulation).

Both split the batch into chunks that run on one thread per core while OpenBLAS is held to one thread
(``megdiffusion.cpu.batch_threads``); every sample's (numpy) or fixed group's (oneDNN) arithmetic is the same
whatever the chunking, so results are bit-identical on any core count. Outputs and gradients equal
MegEngine's up to float32 rounding (tests: 1e-5 relative).

In training mode every supported convolution takes the fast path. In eval mode (sampling, the EMA model)
only the oneDNN kernels do (cheaper than MegEngine's forward); 1x1 and numpy-kernel convolutions keep MegEngine's
forward, which sampled faster than numpy forwards. The ``.numpy()`` calls here used to
crash MegEngine's interpreter now and then (``insert_candidate: got wrong candidate index``; "an input tensor
is unusable due to previous error"): a race inside MegEngine between ``Tensor.numpy()`` and its worker thread
on the DTR candidate list, which ``import megdiffusion`` keeps empty
(``megdiffusion.compat.empty_dtr_candidates``).

The path is chosen per forward call: with the CPU engine (``choice.cpu_engine_enabled()``; on CPU-only machines
unless ``MEGDIFFUSION_FAST_CONV=0``) the fast one, else MegEngine's native kernels (``MEGDIFFUSION_ONEDNN=0`` keeps
the numpy kernels).
Only float32 inputs with dilation 1, groups 1, zero padding and cross-correlation take the fast
path, and never inside ``megengine.jit.trace``; everything else uses the native kernels.
Parameters and checkpoints are those of ``megengine.module.Conv2d`` on both paths.
"""

import numpy as np
from numpy.lib.stride_tricks import as_strided

import megengine
import megengine.module as M
from megengine.autodiff import Function
from megengine.jit.tracing import is_tracing

from megdiffusion.cpu.batch_threads import for_batch_chunks
from megdiffusion.cpu.choice import cpu_engine_enabled
from megdiffusion.cpu import onednn

# Upper bound on one im2col buffer (floats); a batch chunk holds fewer samples when needed.
_MAX_COLS = 1 << 24


def _windows(x_padded, kernel, stride, out_hw):
    """Read-only view (N, C, kh, kw, Ho, Wo) of every kernel window of a padded NCHW array."""
    n, c = x_padded.shape[:2]
    sn, sc, sh, sw = x_padded.strides
    return as_strided(x_padded, (n, c, kernel[0], kernel[1], out_hw[0], out_hw[1]),
                      (sn, sc, sh, sw, sh * stride[0], sw * stride[1]), writeable=False)


def _pad(x, padding):
    ph, pw = padding
    if ph == 0 and pw == 0:
        return x
    n, c, h, w = x.shape
    padded = np.zeros((n, c, h + 2 * ph, w + 2 * pw), x.dtype)
    padded[:, :, ph:ph + h, pw:pw + w] = x
    return padded


def _output_hw(input_hw, kernel, stride, padding):
    return tuple((size + 2 * p - k) // s + 1 for size, k, s, p in zip(input_hw, kernel, stride, padding))


def _correlate(x, weight, stride, padding):
    """What conv2d computes, without bias: x (N, C, H, W) with weight (O, C, kh, kw) -> (N, O, Ho, Wo)."""
    n, c = x.shape[:2]
    o, _, kh, kw = weight.shape
    ho, wo = _output_hw(x.shape[2:], (kh, kw), stride, padding)
    weight_2d = weight.reshape(o, c * kh * kw)
    out = np.empty((n, o, ho * wo), np.float32)

    def work(chunk):
        cols = _windows(_pad(x[chunk], padding), (kh, kw), stride, (ho, wo))
        np.matmul(weight_2d, cols.reshape(cols.shape[0], c * kh * kw, ho * wo), out=out[chunk])

    for_batch_chunks(n, work, _MAX_COLS // (c * kh * kw * ho * wo))
    return out.reshape(n, o, ho, wo)


def _weight_grad(x, dy, kernel, stride, padding):
    """dL/dW (O, C, kh, kw) of a conv with input ``x`` (N, C, H, W) and output gradient ``dy``."""
    n, c = x.shape[:2]
    o, ho, wo = dy.shape[1:]
    dy_flat = dy.reshape(n, o, ho * wo)
    products = np.empty((n, o, c * kernel[0] * kernel[1]), np.float32)  # one dL/dW per sample

    def work(chunk):
        cols = _windows(_pad(x[chunk], padding), kernel, stride, (ho, wo))
        cols = cols.reshape(cols.shape[0], -1, ho * wo)  # copies: (n, C*kh*kw, Ho*Wo)
        np.matmul(dy_flat[chunk], cols.transpose(0, 2, 1), out=products[chunk])

    for_batch_chunks(n, work, _MAX_COLS // (c * kernel[0] * kernel[1] * ho * wo))
    return products.sum(axis=0).reshape(o, c, kernel[0], kernel[1])


def _input_grad(dy, weight, input_hw, stride, padding):
    """dL/dx (N, C, H, W) of a conv with weight (O, C, kh, kw) and output gradient ``dy``.

    Stride 1: a correlation of ``dy`` with the flipped, transposed kernel (padding k - 1 - p), the
    fastest route measured. Other strides: col2im, i.e. W^T dy per window, added back window by window.
    """
    n, o, ho, wo = dy.shape
    _, c, kh, kw = weight.shape
    (sh, sw), (ph, pw) = stride, padding
    if (sh, sw) == (1, 1) and ph < kh and pw < kw:
        flipped = np.ascontiguousarray(weight[:, :, ::-1, ::-1].transpose(1, 0, 2, 3))
        return _correlate(dy, flipped, (1, 1), (kh - 1 - ph, kw - 1 - pw))
    weight_t = weight.reshape(o, -1).T
    # Rows/columns past the last window (odd sizes with stride 2) are never read: their gradient is 0.
    dx = np.zeros((n, c, input_hw[0] + 2 * ph, input_hw[1] + 2 * pw), np.float32)

    def work(chunk):
        dy_chunk = dy[chunk]
        dcols = np.matmul(weight_t, dy_chunk.reshape(len(dy_chunk), o, ho * wo))
        dcols = dcols.reshape(len(dy_chunk), c, kh, kw, ho, wo)
        for i in range(kh):
            for j in range(kw):
                dx[chunk, :, i:i + sh * (ho - 1) + 1:sh, j:j + sw * (wo - 1) + 1:sw] += dcols[:, :, i, j]

    for_batch_chunks(n, work, _MAX_COLS // (c * kh * kw * ho * wo))
    return dx[:, :, ph:ph + input_hw[0], pw:pw + input_hw[1]]


class _FastConv2d(Function):
    """conv2d on the fast path's kernels (oneDNN when ``on_onednn``, else numpy), forward and backward; one
    instance per call."""

    def __init__(self, stride, padding, on_onednn):
        super().__init__()
        self.stride = stride
        self.padding = padding
        self.on_onednn = on_onednn

    def forward(self, x, weight, bias=None):
        self.x, self.weight, self.has_bias = np.ascontiguousarray(x.numpy()), weight.numpy(), bias is not None
        bias_np = None if bias is None else bias.numpy().reshape(-1)
        if self.on_onednn:
            out_hw = _output_hw(self.x.shape[2:], self.weight.shape[2:], self.stride, self.padding)
            y = onednn.conv2d_forward(self.x, self.weight, bias_np, self.stride, self.padding, out_hw,
                                      for_batch_chunks)
        else:
            y = _correlate(self.x, self.weight, self.stride, self.padding)
            if bias is not None:
                y += bias_np.reshape(1, -1, 1, 1)
        return megengine.tensor(y, device=x.device)

    def backward(self, dy):
        if dy is None:
            return (None, None, None) if self.has_bias else (None, None)
        x, weight, dy_np = self.x, self.weight, dy.numpy()
        device = dy.device
        if self.on_onednn:
            dx, dw, db = onednn.conv2d_backward(x, weight, np.ascontiguousarray(dy_np), self.stride, self.padding,
                                                self.has_bias, for_batch_chunks)
        else:
            dx = _input_grad(dy_np, weight, x.shape[2:], self.stride, self.padding)
            dw = _weight_grad(x, dy_np, weight.shape[2:], self.stride, self.padding)
            db = dy_np.sum(axis=(0, 2, 3), dtype=np.float64).astype(np.float32) if self.has_bias else None
        grads = [megengine.tensor(dx, device=device), megengine.tensor(dw, device=device)]
        if self.has_bias:
            grads.append(megengine.tensor(db.reshape(1, -1, 1, 1), device=device))
        self.x = self.weight = None
        return tuple(grads)


class Conv2d(M.Conv2d):
    """Drop-in ``megengine.module.Conv2d`` (same parameters and checkpoint format) that takes the fast
    numpy route with the CPU engine (``choice.cpu_engine_enabled()``) and the configuration allows it."""

    def _fast_path_supported(self, inp):
        return (inp.dtype == np.float32 and self.groups == 1 and tuple(self.dilation) == (1, 1)
                and self.padding_mode == "zeros" and self.conv_mode == "cross_correlation"
                and self.compute_mode == "default")

    def forward(self, inp):
        # jit.trace cannot record a Function computed outside MegEngine: traced code uses native kernels.
        if is_tracing() or not (cpu_engine_enabled() and self._fast_path_supported(inp)):
            return self.calc_conv(inp, self.weight, self.bias)
        on_onednn = onednn.available() and tuple(self.kernel_size) != (1, 1)
        if not (self.training or on_onednn):  # eval mode: see the module docstring
            return self.calc_conv(inp, self.weight, self.bias)
        function = _FastConv2d(tuple(self.stride), tuple(self.padding), on_onednn)
        if self.bias is None:
            return function(inp, self.weight)
        return function(inp, self.weight, self.bias)
