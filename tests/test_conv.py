"""The fast-backward Conv2d against MegEngine's native convolution."""
import io
import itertools

import numpy as np
import pytest

from megdiffusion.compat import quiet_megengine

megengine = quiet_megengine()
import megengine.functional as F  # noqa: E402
import megengine.module as M  # noqa: E402
import megengine.optimizer as optim  # noqa: E402
from megengine.autodiff import GradManager  # noqa: E402

from megdiffusion.cpu import batch_threads  # noqa: E402
from megdiffusion.cpu import conv as conv_module  # noqa: E402
from megdiffusion.cpu import onednn  # noqa: E402
from megdiffusion.cpu import choice  # noqa: E402
from megdiffusion.cpu.choice import cpu_engine_enabled, use_cpu_engine  # noqa: E402
from megdiffusion.cpu.conv import Conv2d  # noqa: E402


@pytest.fixture(autouse=True)
def restore_setting():
    saved = choice._setting, choice._auto
    yield
    choice._setting, choice._auto = saved


@pytest.fixture(params=["numpy", "onednn"])
def cpu_kernel(request, monkeypatch):
    """Runs a test on each CPU kernel of the fast path: im2col + BLAS in numpy, and oneDNN (3x3 and larger)."""
    if request.param == "onednn" and not onednn.available():
        pytest.skip("oneDNN is not installed here")
    if request.param == "numpy":
        monkeypatch.setattr(onednn, "available", lambda: False)
    return request.param


@pytest.fixture
def weight_grad_calls(monkeypatch):
    """Counts calls of the weight-gradient routines (numpy's or oneDNN's), i.e. backward passes that took the
    fast path."""
    calls = []
    for owner, name in ((conv_module, "_weight_grad"), (onednn, "conv2d_backward")):
        def spy(*args, original=getattr(owner, name), **kwargs):
            calls.append(args[0].shape)
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, spy)
    return calls


def assert_close(actual, expected, rtol=1e-5):
    assert actual.shape == expected.shape
    scale = max(np.abs(expected).max(), 1e-30)
    assert np.abs(actual - expected).max() <= rtol * scale


def forward_backward(conv, x, dy, fast):
    """Output, input gradient and parameter gradients of ``conv`` for output gradient ``dy``."""
    use_cpu_engine(fast)
    inp = megengine.Parameter(x)
    gm = GradManager().attach([inp] + list(conv.parameters()))
    with gm:
        y = conv(inp)
        gm.backward(y, megengine.tensor(dy))
    grads = [inp.grad.numpy()] + [p.grad.numpy() for p in conv.parameters()]
    for p in conv.parameters():
        p.grad = None
    return y.numpy(), grads


def random_case(rng, conv, batch, height, width):
    x = rng.standard_normal((batch, conv.in_channels, height, width)).astype("float32")
    (kh, kw), (sh, sw), (ph, pw) = conv.kernel_size, conv.stride, conv.padding
    out_shape = (batch, conv.out_channels, (height + 2 * ph - kh) // sh + 1, (width + 2 * pw - kw) // sw + 1)
    return x, rng.standard_normal(out_shape).astype("float32")


@pytest.mark.parametrize("stride,padding,kernel", list(itertools.product((1, 2), (0, 1), (1, 3))))
def test_fast_gradients_equal_native(stride, padding, kernel, weight_grad_calls, cpu_kernel):
    rng = np.random.default_rng(stride * 100 + padding * 10 + kernel)
    for bias, (batch, height, width) in itertools.product((True, False), ((1, 7, 9), (3, 8, 8), (2, 5, 6))):
        conv = Conv2d(3, 4, kernel, stride=stride, padding=padding, bias=bias)
        x, dy = random_case(rng, conv, batch, height, width)
        y_native, grads_native = forward_backward(conv, x, dy, fast=False)
        calls_before = len(weight_grad_calls)
        y_fast, grads_fast = forward_backward(conv, x, dy, fast=True)
        assert len(weight_grad_calls) == calls_before + 1  # the fast path really ran
        assert_close(y_fast, y_native)
        assert len(grads_fast) == (3 if bias else 2)
        for fast, native in zip(grads_fast, grads_native):
            assert_close(fast, native)


@pytest.mark.parametrize("kernel,stride,padding", [((1, 3), (2, 1), (0, 1)), (3, 1, 1)])
def test_rectangular_kernels_and_chunked_im2col(kernel, stride, padding, monkeypatch, cpu_kernel):
    monkeypatch.setattr(conv_module, "_MAX_COLS", 100)  # forces one im2col chunk per sample
    rng = np.random.default_rng(1)
    conv = Conv2d(2, 3, kernel, stride=stride, padding=padding)
    x, dy = random_case(rng, conv, 4, 7, 6)
    _, grads_native = forward_backward(conv, x, dy, fast=False)
    _, grads_fast = forward_backward(conv, x, dy, fast=True)
    for fast, native in zip(grads_fast, grads_native):
        assert_close(fast, native)


@pytest.mark.parametrize("stride", [1, 2])
def test_results_do_not_depend_on_thread_count(stride, monkeypatch, cpu_kernel):
    """The batch is split across threads; every output and gradient is bit-identical for 1, 2 or 3
    threads (odd batch: uneven chunks), and matches the single-threaded result of one sample at a time."""
    rng = np.random.default_rng(7)
    conv = Conv2d(3, 4, 3, stride=stride, padding=1)
    x, dy = random_case(rng, conv, 5, 9, 8)
    results = {}
    for threads in (1, 2, 3):
        monkeypatch.setattr(batch_threads, "THREADS", threads)
        results[threads] = forward_backward(conv, x, dy, fast=True)
    for threads in (2, 3):
        np.testing.assert_array_equal(results[threads][0], results[1][0])
        for parallel, serial in zip(results[threads][1], results[1][1]):
            np.testing.assert_array_equal(parallel, serial)
    monkeypatch.setattr(conv_module, "_MAX_COLS", 1)  # one sample per chunk
    y_per_sample, grads_per_sample = forward_backward(conv, x, dy, fast=True)
    np.testing.assert_array_equal(y_per_sample, results[1][0])
    for per_sample, serial in zip(grads_per_sample, results[1][1]):
        np.testing.assert_array_equal(per_sample, serial)


@pytest.mark.parametrize("kwargs", [dict(groups=2), dict(dilation=2), dict(padding_mode="reflect")])
def test_unsupported_configs_fall_back_to_native(kwargs, weight_grad_calls):
    rng = np.random.default_rng(2)
    conv = Conv2d(4, 4, 3, padding=1, **kwargs)
    x = rng.standard_normal((2, 4, 9, 9)).astype("float32")
    dy = rng.standard_normal(conv(megengine.tensor(x)).shape).astype("float32")
    y_native, grads_native = forward_backward(conv, x, dy, fast=False)
    y_fast, grads_fast = forward_backward(conv, x, dy, fast=True)
    assert weight_grad_calls == []
    np.testing.assert_array_equal(y_fast, y_native)
    for fast, native in zip(grads_fast, grads_native):
        np.testing.assert_array_equal(fast, native)


@pytest.mark.parametrize("symbolic", [False, True])
def test_traced_gradient_steps_use_native_kernels(symbolic):
    """jit.trace cannot record the numpy Function (symbolic tensors have no values): native inside."""
    from megengine import jit

    conv = Conv2d(2, 3, 3, padding=1)
    gm = GradManager().attach(conv.parameters())

    def weight_grad(x):
        with gm:
            gm.backward((conv(x) ** 2).sum())
        grad = conv.weight.grad * 1
        conv.weight.grad = None
        return grad

    rng = np.random.default_rng(6)
    inputs = [megengine.tensor(rng.standard_normal((2, 2, 6, 6)).astype("float32")) for _ in range(3)]
    use_cpu_engine(False)
    expected = [weight_grad(x).numpy() for x in inputs]
    use_cpu_engine(True)
    traced = jit.trace(weight_grad, symbolic=symbolic)
    for x, native in zip(inputs, expected):
        np.testing.assert_array_equal(traced(x).numpy(), native)


def test_switching_takes_effect_on_next_forward(weight_grad_calls, monkeypatch):
    rng = np.random.default_rng(3)
    conv = Conv2d(2, 2, 3, padding=1)
    x, dy = random_case(rng, conv, 1, 5, 5)
    for fast in (True, False, True, False):
        forward_backward(conv, x, dy, fast=fast)
    assert len(weight_grad_calls) == 2
    monkeypatch.setattr(choice, "cuda_available", lambda: False)
    choice._auto = None
    use_cpu_engine(None)
    assert cpu_engine_enabled()
    monkeypatch.setattr(choice, "cuda_available", lambda: True)
    choice._auto = None
    assert not cpu_engine_enabled()  # auto: native kernels when CUDA is there
    forward_backward(conv, x, dy, fast=None)
    assert len(weight_grad_calls) == 2


def test_environment_variable_and_bad_values(monkeypatch):
    from megdiffusion import environment

    for value, expected in (("1", True), ("yes", True), ("0", False), ("off", False), ("", None), ("auto", None)):
        monkeypatch.setenv(choice.ENV_VAR, value)
        assert environment.read(choice.ENV_VAR, "unset") is expected
    monkeypatch.setenv(choice.ENV_VAR, "maybe")
    with pytest.raises(environment.EnvironmentVariableError, match="MEGDIFFUSION_FAST_CONV='maybe' must be 1/0"):
        environment.check()
    with pytest.raises(ValueError, match="True, False or None"):
        use_cpu_engine("1")


def test_state_dict_interchangeable_with_native_module():
    rng = np.random.default_rng(4)
    native = M.Conv2d(3, 5, 3, stride=2, padding=1)
    native.weight._reset(megengine.tensor(rng.standard_normal((5, 3, 3, 3)).astype("float32")))
    native.bias._reset(megengine.tensor(rng.standard_normal((1, 5, 1, 1)).astype("float32")))
    x = megengine.tensor(rng.standard_normal((2, 3, 9, 9)).astype("float32"))
    buffer = io.BytesIO()
    megengine.save(native.state_dict(), buffer)
    buffer.seek(0)
    fast = Conv2d(3, 5, 3, stride=2, padding=1)
    fast.load_state_dict(megengine.load(buffer))
    use_cpu_engine(True)  # no GradManager: the forward alone, as when sampling
    assert_close(fast(x).numpy(), native(x).numpy())
    assert list(fast.state_dict()) == list(native.state_dict())
    back = M.Conv2d(3, 5, 3, stride=2, padding=1)
    back.load_state_dict(fast.state_dict())
    np.testing.assert_array_equal(back(x).numpy(), native(x).numpy())


@pytest.mark.parametrize("kernel", [1, 3])
def test_eval_mode_forward(kernel, monkeypatch, cpu_kernel):
    """Eval mode (sampling): oneDNN's forward for kernels above 1x1 when it is installed; otherwise MegEngine's
    forward, bit-identical to M.Conv2d. Training mode always takes the fast path."""
    fast_calls = []
    for owner, name in ((conv_module, "_correlate"), (onednn, "conv2d_forward")):
        original = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *args, original=original: fast_calls.append(name) or original(*args))
    rng = np.random.default_rng(8)
    fast, native = Conv2d(3, 4, kernel, padding=kernel // 2), M.Conv2d(3, 4, kernel, padding=kernel // 2)
    native.load_state_dict(fast.state_dict())
    x = megengine.tensor(rng.standard_normal((5, 3, 6, 6)).astype("float32"))
    use_cpu_engine(True)
    fast.eval()
    y_eval = fast(x).numpy()
    if cpu_kernel == "onednn" and kernel > 1:
        assert fast_calls == ["conv2d_forward"]
        assert_close(y_eval, native(x).numpy())
    else:
        assert fast_calls == []
        np.testing.assert_array_equal(y_eval, native(x).numpy())
    fast.train()
    calls_before = len(fast_calls)
    assert_close(fast(x).numpy(), native(x).numpy())
    assert len(fast_calls) == calls_before + 1


class TwoConvNet(M.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = Conv2d(2, 4, 3, padding=1)
        self.conv2 = Conv2d(4, 4, 3, stride=2, padding=1)
        self.conv3 = Conv2d(4, 2, 1)

    def forward(self, x):
        h = F.relu(self.conv1(x))
        h = F.relu(self.conv2(h))
        return self.conv3(h)


def train_two_steps(fast):
    """Parameters after two GradManager + clip_grad_norm + Adam steps on a fixed batch."""
    use_cpu_engine(fast)
    megengine.random.seed(0)
    net = TwoConvNet()
    rng = np.random.default_rng(5)
    x = megengine.tensor(rng.standard_normal((3, 2, 7, 7)).astype("float32"))
    target = megengine.tensor(rng.standard_normal((3, 2, 4, 4)).astype("float32"))
    gm = GradManager().attach(net.parameters())
    opt = optim.Adam(net.parameters(), lr=1e-2)
    norms = []
    for _ in range(2):
        with gm:
            loss = ((net(x) - target) ** 2).mean()
            gm.backward(loss)
        norms.append(float(optim.clip_grad_norm(net.parameters(), 0.5)))
        opt.step().clear_grad()
    return norms, [p.numpy() for p in net.parameters()]


def test_training_with_clipping_and_adam_matches_native(cpu_kernel):
    norms_native, params_native = train_two_steps(False)
    norms_fast, params_fast = train_two_steps(True)
    assert norms_native[0] > 0.5  # clipping is active, so the global norm matters
    np.testing.assert_allclose(norms_fast, norms_native, rtol=1e-5)
    for fast, native in zip(params_fast, params_native):
        assert_close(fast, native)
