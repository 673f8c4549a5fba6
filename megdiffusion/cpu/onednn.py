"""2-D convolutions on oneDNN's x86 JIT kernels, through its C API (ctypes): the CPU kernels of ``cpu.conv``.

oneDNN comes from the ``onednn-cpu-gomp`` wheel (``libdnnl.so.3`` in the environment's ``lib/``, GNU OpenMP
threading). Its JIT convolutions (AVX2/AVX-512, blocked layouts) were faster than im2col + OpenBLAS on
the UNet's shapes; ``available()`` is False where the library is missing or does not load, and ``cpu.conv``
then keeps its numpy kernels.

Determinism: the batch is cut into fixed groups of ``GROUP`` samples, whatever the number of threads; each
group is one primitive execution on one OpenMP thread (the calling thread; ``cpu.conv`` runs groups in
parallel on ``batch_threads``), and the weight and bias gradients of the groups are summed in group order.
So results are bit-identical on any core count, and the same from run to run on one machine.

Memory layouts: weights are OIHW, activations NCHW, or NHWC with ``channels_last`` (the numpy training pass of
``cpu.numpy_unet``). For NCHW the primitives are created with layout "any" (oneDNN picks its blocked formats) and
reorders convert in and out; NHWC activations are used as they are: without the reorders they were faster
(benchmarks/README.md, "Design choices measured").

``InferenceConv`` is the forward alone (oneDNN's inference primitive, with a ReLU post-op) on NHWC activations, for
the FID Inception's CPU route.
"""
import ctypes
import os
import sys
import threading
from typing import NamedTuple

import numpy as np

from megdiffusion.errors import MegdiffusionError
from megdiffusion import environment

GROUP = 4  # samples per primitive execution (the unit of determinism)

_F32 = 3
_TAG_ANY, _TAG_A, _TAG_NCHW = 1, 2, 5  # dnnl_format_tag_t: any, a (1-D), nchw (= oihw)
_TAG_NHWC = b"acdb"  # by name (dnnl_memory_desc_create_with_string_tag): dims n, c, h, w stored as n, h, w, c
_FORWARD_TRAINING, _FORWARD_INFERENCE, _CONVOLUTION_DIRECT = 64, 96, 1
_ELTWISE_RELU = 0x20  # dnnl_alg_kind_t in oneDNN 3 (0x1f in 1.x)
_POOLING = {"max": 0x1FF, "average": 0x3FF}  # dnnl_pooling_max, dnnl_pooling_avg_exclude_padding
_SCRATCHPAD_MODE_USER = 1
_QUERY_SCRATCHPAD_MD = 136
_QUERY = {"src": 129, "diff_src": 130, "weights": 131, "diff_weights": 132, "dst": 133, "diff_dst": 134}
ARG_SRC, ARG_DST, ARG_WEIGHTS, ARG_BIAS = 1, 17, 33, 41
ARG_DIFF_SRC, ARG_DIFF_DST, ARG_DIFF_WEIGHTS, ARG_DIFF_BIAS, ARG_SCRATCHPAD = 129, 145, 161, 169, 80

_ptr = ctypes.c_void_p
_Dims = ctypes.c_int64 * 12


class _ExecArg(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_int), ("memory", _ptr)]


_SIGNATURES = {
    "dnnl_engine_create": [ctypes.POINTER(_ptr), ctypes.c_int, ctypes.c_size_t],
    "dnnl_stream_create": [ctypes.POINTER(_ptr), _ptr, ctypes.c_uint],
    "dnnl_stream_wait": [_ptr],
    "dnnl_primitive_attr_create": [ctypes.POINTER(_ptr)],
    "dnnl_primitive_attr_set_scratchpad_mode": [_ptr, ctypes.c_int],
    "dnnl_primitive_attr_set_post_ops": [_ptr, _ptr],
    "dnnl_post_ops_create": [ctypes.POINTER(_ptr)],
    "dnnl_post_ops_append_eltwise": [_ptr, ctypes.c_int, ctypes.c_float, ctypes.c_float],
    "dnnl_memory_desc_create_with_tag": [ctypes.POINTER(_ptr), ctypes.c_int, _Dims, ctypes.c_int, ctypes.c_int],
    "dnnl_memory_desc_create_with_string_tag": [ctypes.POINTER(_ptr), ctypes.c_int, _Dims, ctypes.c_int,
                                                ctypes.c_char_p],
    "dnnl_memory_desc_equal": [_ptr, _ptr],
    "dnnl_memory_desc_get_size": [_ptr],
    "dnnl_convolution_forward_primitive_desc_create": [ctypes.POINTER(_ptr), _ptr, ctypes.c_int, ctypes.c_int,
                                                        _ptr, _ptr, _ptr, _ptr, _Dims, _Dims, _Dims, _Dims, _ptr],
    "dnnl_convolution_backward_data_primitive_desc_create": [ctypes.POINTER(_ptr), _ptr, ctypes.c_int, _ptr, _ptr,
                                                              _ptr, _Dims, _Dims, _Dims, _Dims, _ptr, _ptr],
    "dnnl_convolution_backward_weights_primitive_desc_create": [ctypes.POINTER(_ptr), _ptr, ctypes.c_int, _ptr,
                                                                 _ptr, _ptr, _ptr, _Dims, _Dims, _Dims, _Dims,
                                                                 _ptr, _ptr],
    "dnnl_pooling_forward_primitive_desc_create": [ctypes.POINTER(_ptr), _ptr, ctypes.c_int, ctypes.c_int, _ptr, _ptr,
                                                    _Dims, _Dims, _Dims, _Dims, _Dims, _ptr],
    "dnnl_memory_desc_create_with_strides": [ctypes.POINTER(_ptr), ctypes.c_int, _Dims, ctypes.c_int, _Dims],
    "dnnl_matmul_primitive_desc_create": [ctypes.POINTER(_ptr), _ptr, _ptr, _ptr, _ptr, _ptr, _ptr],
    "dnnl_reorder_primitive_desc_create": [ctypes.POINTER(_ptr), _ptr, _ptr, _ptr, _ptr, _ptr],
    "dnnl_primitive_desc_query_md": [_ptr, ctypes.c_int, ctypes.c_int],
    "dnnl_primitive_create": [ctypes.POINTER(_ptr), _ptr],
    "dnnl_primitive_execute": [_ptr, _ptr, ctypes.c_int, ctypes.POINTER(_ExecArg)],
    "dnnl_memory_create": [ctypes.POINTER(_ptr), _ptr, _ptr, _ptr],
    "dnnl_memory_destroy": [_ptr],
}
_RETURNS = {"dnnl_memory_desc_equal": ctypes.c_int, "dnnl_memory_desc_get_size": ctypes.c_size_t,
            "dnnl_primitive_desc_query_md": _ptr}


class OneDNNError(MegdiffusionError):
    """A oneDNN call returned an error status."""

    exit_code = 1  # not the user's input


class _Library(NamedTuple):
    """The loaded library and the handles every call needs."""

    lib: ctypes.PyDLL  # bookkeeping calls, which keep the GIL
    set_threads: object  # libgomp's omp_set_num_threads
    engine: ctypes.c_void_p
    attr: ctypes.c_void_p  # primitive attributes: user-managed scratchpad
    execute: object  # dnnl_primitive_execute through CDLL, which releases the GIL


def _load():
    """The ``_Library``, or None when oneDNN cannot be used here."""
    if not environment.read("MEGDIFFUSION_ONEDNN", True):
        return None
    path = os.path.join(sys.prefix, "lib", "libdnnl.so.3")
    try:
        # Calls through PyDLL keep the GIL: oneDNN's bookkeeping calls take about a microsecond, and releasing
        # and re-taking the GIL around each of them made the batch threads hand it to each other ~20 times per
        # group. Only executing a primitive (the long call) goes through CDLL, which releases it.
        lib, releasing = ctypes.PyDLL(path), ctypes.CDLL(path)
        set_threads = ctypes.CDLL("libgomp.so.1").omp_set_num_threads
    except OSError:
        return None
    for name, argtypes in _SIGNATURES.items():
        for library in (lib, releasing):
            function = getattr(library, name)
            function.argtypes = argtypes
            function.restype = _RETURNS.get(name, ctypes.c_int)
    set_threads(1)  # primitives created on this thread are planned for one thread
    engine, attr = _ptr(), _ptr()
    if (lib.dnnl_engine_create(ctypes.byref(engine), 1, 0) or lib.dnnl_primitive_attr_create(ctypes.byref(attr))
            or lib.dnnl_primitive_attr_set_scratchpad_mode(attr, _SCRATCHPAD_MODE_USER)):
        return None
    return _Library(lib, set_threads, engine, attr, releasing.dnnl_primitive_execute)


_state = _load()
_threads = threading.local()


def available():
    """Whether oneDNN's library loaded (``MEGDIFFUSION_ONEDNN=0`` turns it off)."""
    return _state is not None


def _call(name, *args, function=None):
    status = (function or getattr(_state.lib, name))(*args)
    if status != 0:
        raise OneDNNError(f"oneDNN's {name} failed with status {status}; MEGDIFFUSION_ONEDNN=0 runs the numpy "
                          "kernels instead")


def _stream():
    """This thread's oneDNN stream; OpenMP is held to this one thread (each group runs on one core)."""
    stream = getattr(_threads, "stream", None)
    if stream is None:
        _state.set_threads(1)
        stream = _ptr()
        _call("dnnl_stream_create", ctypes.byref(stream), _state.engine, 1)
        _threads.stream = stream
    return stream


def _desc(shape, tag):
    """A float32 memory descriptor of logical ``shape`` in the layout ``tag`` (a dnnl_format_tag_t, or its name)."""
    desc = _ptr()
    if isinstance(tag, bytes):
        _call("dnnl_memory_desc_create_with_string_tag", ctypes.byref(desc), len(shape), _Dims(*shape), _F32, tag)
    else:
        _call("dnnl_memory_desc_create_with_tag", ctypes.byref(desc), len(shape), _Dims(*shape), _F32, tag)
    return desc


def _same(a, b):
    return bool(_state.lib.dnnl_memory_desc_equal(a, b))


def _buffer(desc):
    return np.empty(_state.lib.dnnl_memory_desc_get_size(desc) // 4, np.float32)


class _Primitive:
    """A primitive and its scratchpad size, executed with numpy buffers."""

    def __init__(self, primitive_desc):
        self.desc = primitive_desc  # kept alive: the memory descriptors queried from it belong to it
        self.primitive = _ptr()
        _call("dnnl_primitive_create", ctypes.byref(self.primitive), primitive_desc)
        scratchpad = self.query(_QUERY_SCRATCHPAD_MD)
        self.scratchpad = scratchpad if scratchpad and _state.lib.dnnl_memory_desc_get_size(scratchpad) else None

    def query(self, what):
        return _ptr(_state.lib.dnnl_primitive_desc_query_md(self.desc, what, 0))

    def __call__(self, args):
        """Execute on ``args``: {argument: (memory descriptor, numpy buffer)}; waits for completion."""
        if self.scratchpad is not None:
            args = {**args, ARG_SCRATCHPAD: (self.scratchpad, _buffer(self.scratchpad))}
        memories = []
        try:
            for desc, array in args.values():
                memory = _ptr()
                _call("dnnl_memory_create", ctypes.byref(memory), desc, _state.engine, _ptr(array.ctypes.data))
                memories.append(memory)
            exec_args = (_ExecArg * len(args))(*[_ExecArg(arg, memory) for arg, memory in zip(args, memories)])
            stream = _stream()
            _call("dnnl_primitive_execute", self.primitive, stream, len(args), exec_args, function=_state.execute)
            _call("dnnl_stream_wait", stream)
        finally:
            for memory in memories:
                _state.lib.dnnl_memory_destroy(memory)


class _Reorder:
    """Copy between two layouts of the same tensor (nothing to do when they are the same)."""

    def __init__(self, source, target):
        self.source, self.target = source, target
        self.primitive = None
        if not _same(source, target):
            desc = _ptr()
            _call("dnnl_reorder_primitive_desc_create", ctypes.byref(desc), source, _state.engine, target,
                  _state.engine, _state.attr)
            self.primitive = _Primitive(desc)

    def target_or_buffer(self, target):
        """Where to put data in the source layout that is to end up in ``target`` (an array in the target layout):
        ``target`` itself when the layouts are the same, else a new buffer."""
        return target if self.primitive is None else _buffer(self.source)

    def __call__(self, array, out=None):
        """``array`` in the source layout -> the target layout (``out`` when given, else a new buffer)."""
        if self.primitive is None:
            if out is None or out is array:
                return array
            out.reshape(-1)[:] = array.reshape(-1)
            return out
        out = _buffer(self.target) if out is None else out
        self.primitive({ARG_SRC: (self.source, array), ARG_DST: (self.target, out)})
        return out


def _right_padding(size, kernel, stride, left, out_size):
    return (out_size - 1) * stride + kernel - size - left


class _Plan:
    """The forward, backward-data and backward-weights primitives of one convolution for a group of ``mb``."""

    def __init__(self, mb, x_shape, w_shape, stride, padding, out_hw, bias, channels_last):
        _, c, h, w = x_shape
        o = w_shape[0]
        layout = _TAG_NHWC if channels_last else _TAG_NCHW
        plain_x, plain_w, plain_y = _desc((mb, c, h, w), layout), _desc(w_shape, _TAG_NCHW), \
            _desc((mb, o) + out_hw, layout)
        plain_b = _desc((o,), _TAG_A) if bias else None
        any_x, any_w, any_y = _desc((mb, c, h, w), _TAG_ANY), _desc(w_shape, _TAG_ANY), \
            _desc((mb, o) + out_hw, _TAG_ANY)
        if channels_last:
            any_x, any_y = plain_x, plain_y
        right = [_right_padding(size, k, s, p, out) for size, k, s, p, out in
                 zip((h, w), w_shape[2:], stride, padding, out_hw)]
        geometry = (_Dims(*stride), _Dims(0, 0), _Dims(*padding), _Dims(*right))
        attr = _state.attr
        desc = _ptr()
        _call("dnnl_convolution_forward_primitive_desc_create", ctypes.byref(desc), _state.engine, _FORWARD_TRAINING,
              _CONVOLUTION_DIRECT, any_x, any_w, plain_b, any_y, *geometry, attr)
        self.forward = _Primitive(desc)
        desc = _ptr()
        _call("dnnl_convolution_backward_data_primitive_desc_create", ctypes.byref(desc), _state.engine,
              _CONVOLUTION_DIRECT, any_x, any_w, any_y, *geometry, self.forward.desc, attr)
        self.backward_data = _Primitive(desc)
        desc = _ptr()
        _call("dnnl_convolution_backward_weights_primitive_desc_create", ctypes.byref(desc), _state.engine,
              _CONVOLUTION_DIRECT, any_x, any_w, plain_b, any_y, *geometry, self.forward.desc, attr)
        self.backward_weights = _Primitive(desc)
        self.plain_b = plain_b
        f, d, g = self.forward.query, self.backward_data.query, self.backward_weights.query
        self.fwd = {"x": f(_QUERY["src"]), "w": f(_QUERY["weights"]), "y": f(_QUERY["dst"])}
        self.bwd = {"dx": d(_QUERY["diff_src"]), "w": d(_QUERY["weights"]), "dy": d(_QUERY["diff_dst"]),
                    "x": g(_QUERY["src"]), "dw": g(_QUERY["diff_weights"]), "dy_w": g(_QUERY["diff_dst"])}
        self.x_in = _Reorder(plain_x, self.fwd["x"])
        self.w_in = _Reorder(plain_w, self.fwd["w"])
        self.y_out = _Reorder(self.fwd["y"], plain_y)
        self.w_in_backward = _Reorder(plain_w, self.bwd["w"])
        self.dy_in = _Reorder(plain_y, self.bwd["dy"])
        self.dy_in_weights = _Reorder(self.bwd["dy"], self.bwd["dy_w"])
        self.x_in_weights = _Reorder(plain_x, self.bwd["x"])
        self.dx_out = _Reorder(self.bwd["dx"], plain_x)
        self.dw_out = _Reorder(self.bwd["dw"], plain_w)


_plans = {}
_plans_lock = threading.Lock()


def _groups(n, size):
    return [slice(start, min(start + size, n)) for start in range(0, n, size)]


def _plans_for(n, x_shape, w_shape, stride, padding, out_hw, bias, group, channels_last):
    """The plan of each group size a batch of ``n`` needs, created (once per process) on this thread."""
    _stream()  # this thread's OpenMP setting applies to primitives created here
    plans = {}
    for mb in {part.stop - part.start for part in _groups(n, group)}:
        key = (mb, tuple(x_shape[1:]), tuple(w_shape), stride, padding, tuple(out_hw), bias, channels_last)
        with _plans_lock:
            if key not in _plans:
                _plans[key] = _Plan(mb, x_shape, w_shape, stride, padding, out_hw, bias, channels_last)
            plans[mb] = _plans[key]
    return plans


def _nchw(shape, channels_last):
    """The logical (N, C, H, W) shape of an activation array of ``shape``."""
    return (shape[0], shape[3], shape[1], shape[2]) if channels_last else tuple(shape)


def conv2d_forward(x, weight, bias, stride, padding, out_hw, run_groups, group=GROUP, channels_last=False,
                   reordered=None):
    """y = conv2d(x, weight) + bias for float32 NCHW ``x`` (NHWC with ``channels_last``, y too), OIHW ``weight``,
    (O,) ``bias`` or None.

    The batch is computed in groups of ``group`` samples, one primitive execution each; ``run_groups(count,
    work)`` calls ``work(slice)`` over slices of range(count) (in parallel). ``reordered``: a dict kept by the
    caller while ``weight`` stays the same (eval calls), holding the weights in the primitives' layouts."""
    n = len(x)
    plans = _plans_for(n, _nchw(x.shape, channels_last), weight.shape, stride, padding, out_hw, bias is not None,
                       group, channels_last)
    reordered = {} if reordered is None else reordered
    for plan in plans.values():
        if plan not in reordered:
            reordered[plan] = plan.w_in(weight)
    weights = {mb: reordered[plan] for mb, plan in plans.items()}
    o = weight.shape[0]
    y = np.empty((n,) + (tuple(out_hw) + (o,) if channels_last else (o,) + tuple(out_hw)), np.float32)
    groups = _groups(n, group)

    def work(chunk):
        for part in groups[chunk]:
            mb = part.stop - part.start
            plan = plans[mb]
            y_part = y[part]
            y_blocked = plan.y_out.target_or_buffer(y_part)
            args = {ARG_SRC: (plan.fwd["x"], plan.x_in(x[part])), ARG_WEIGHTS: (plan.fwd["w"], weights[mb]),
                    ARG_DST: (plan.fwd["y"], y_blocked)}
            if bias is not None:
                args[ARG_BIAS] = (plan.plain_b, bias)
            plan.forward(args)
            plan.y_out(y_blocked, out=y_part)

    run_groups(len(groups), work)
    return y


def conv2d_backward(x, weight, dy, stride, padding, bias, run_groups, group=GROUP, channels_last=False):
    """(dx, dweight, dbias or None) of ``conv2d_forward`` for the output gradient ``dy``; the weight and bias
    gradients are the per-group gradients summed in group order."""
    n = len(x)
    out_hw = _nchw(dy.shape, channels_last)[2:]
    plans = _plans_for(n, _nchw(x.shape, channels_last), weight.shape, stride, padding, out_hw, bias, group,
                       channels_last)
    weights = {mb: plan.w_in_backward(weight) for mb, plan in plans.items()}
    groups = _groups(n, group)
    dx = np.empty(x.shape, np.float32)
    dws = np.empty((len(groups),) + weight.shape, np.float32)
    dbs = np.zeros((len(groups), weight.shape[0]), np.float32)

    def work(chunk):
        for index in range(chunk.start, chunk.stop):
            part = groups[index]
            plan = plans[part.stop - part.start]
            dy_blocked = plan.dy_in(dy[part])
            dx_part = dx[part]
            dx_blocked = plan.dx_out.target_or_buffer(dx_part)
            plan.backward_data({ARG_DIFF_DST: (plan.bwd["dy"], dy_blocked),
                                ARG_WEIGHTS: (plan.bwd["w"], weights[part.stop - part.start]),
                                ARG_DIFF_SRC: (plan.bwd["dx"], dx_blocked)})
            plan.dx_out(dx_blocked, out=dx_part)
            dw_part = dws[index]
            dw_blocked = plan.dw_out.target_or_buffer(dw_part)
            args = {ARG_SRC: (plan.bwd["x"], plan.x_in_weights(x[part])),
                    ARG_DIFF_DST: (plan.bwd["dy_w"], plan.dy_in_weights(dy_blocked)),
                    ARG_DIFF_WEIGHTS: (plan.bwd["dw"], dw_blocked)}
            if bias:
                args[ARG_DIFF_BIAS] = (plan.plain_b, dbs[index])
            plan.backward_weights(args)
            plan.dw_out(dw_blocked, out=dw_part)

    run_groups(len(groups), work)
    # A sum over the leading axis adds the rows one after the other, as cpu.conv sums per-sample products.
    return dx, dws.sum(axis=0), dbs.sum(axis=0) if bias else None



def _relu_attr():
    """Primitive attributes with a user-managed scratchpad and a ReLU applied to the output (a post-op)."""
    attr, post_ops = _ptr(), _ptr()
    _call("dnnl_primitive_attr_create", ctypes.byref(attr))
    _call("dnnl_primitive_attr_set_scratchpad_mode", attr, _SCRATCHPAD_MODE_USER)
    _call("dnnl_post_ops_create", ctypes.byref(post_ops))
    _call("dnnl_post_ops_append_eltwise", post_ops, _ELTWISE_RELU, 0.0, 0.0)
    _call("dnnl_primitive_attr_set_post_ops", attr, post_ops)
    return attr


class _Inference:
    """A forward-only primitive on float32 arrays as they are (NHWC activations; a matmul's strided operands), one per
    input shape (or key), created once (on the first thread that meets it, planned for one OpenMP thread); calls may
    come from several threads at once, each running on its own stream. Subclasses make the primitive (``_create``)."""

    def __init__(self):
        self._plans = {}

    def _plan(self, key):
        with _plans_lock:
            plan = self._plans.get(key)
            if plan is None:
                _stream()  # primitives are planned for the OpenMP setting of the thread that creates them
                plan = self._plans[key] = self._create(key)
        return plan

    def __call__(self, x):
        """The NHWC output for the C-contiguous NHWC float32 array ``x``."""
        primitive, x_desc, y_desc, y_shape, args = self._plan(x.shape)
        y = np.empty(y_shape, np.float32)
        primitive({**args, ARG_SRC: (x_desc, x), ARG_DST: (y_desc, y)})
        return y


def _geometry(hw, kernel, stride, padding):
    """(output height and width, right/bottom padding) of a window of ``kernel`` over ``hw``."""
    out_hw = tuple((size + 2 * p - k) // s + 1 for size, k, s, p in zip(hw, kernel, stride, padding))
    right = [_right_padding(size, k, s, p, out) for size, k, s, p, out in zip(hw, kernel, stride, padding, out_hw)]
    return out_hw, right


class InferenceConv(_Inference):
    """relu(conv2d(x, weight) + bias) for inference (no gradients), ``weight`` OIHW and ``bias`` (O,); the weights
    are reordered once per primitive into the layout it prefers."""

    def __init__(self, weight, bias, stride, padding):
        super().__init__()
        self.weight = np.ascontiguousarray(weight, np.float32)
        self.bias = np.ascontiguousarray(bias, np.float32)
        self.stride, self.padding = tuple(stride), tuple(padding)

    def _create(self, shape):
        global _relu
        n, h, w, c = shape
        o = self.weight.shape[0]
        out_hw, right = _geometry((h, w), self.weight.shape[2:], self.stride, self.padding)
        x_desc, y_desc = _desc((n, c, h, w), _TAG_NHWC), _desc((n, o) + out_hw, _TAG_NHWC)
        b_desc = _desc((o,), _TAG_A)
        if _relu is None:
            _relu = _relu_attr()
        desc = _ptr()
        _call("dnnl_convolution_forward_primitive_desc_create", ctypes.byref(desc), _state.engine, _FORWARD_INFERENCE,
              _CONVOLUTION_DIRECT, x_desc, _desc(self.weight.shape, _TAG_ANY), b_desc, y_desc, _Dims(*self.stride),
              _Dims(0, 0), _Dims(*self.padding), _Dims(*right), _relu)
        primitive = _Primitive(desc)
        w_desc = primitive.query(_QUERY["weights"])
        weights = _Reorder(_desc(self.weight.shape, _TAG_NCHW), w_desc)(self.weight)
        args = {ARG_WEIGHTS: (w_desc, weights), ARG_BIAS: (b_desc, self.bias)}
        return primitive, x_desc, y_desc, (n,) + out_hw + (o,), args


class InferencePool(_Inference):
    """``size`` x ``size`` pooling with ``stride`` and ``padding``: ``kind`` "max" (padding never wins) or "average"
    (the padding not counted)."""

    def __init__(self, kind, size, stride, padding=0):
        super().__init__()
        self.kind, self.size, self.stride, self.padding = kind, size, stride, padding

    def _create(self, shape):
        n, h, w, c = shape
        kernel, stride, padding = (self.size,) * 2, (self.stride,) * 2, (self.padding,) * 2
        out_hw, right = _geometry((h, w), kernel, stride, padding)
        x_desc, y_desc = _desc((n, c, h, w), _TAG_NHWC), _desc((n, c) + out_hw, _TAG_NHWC)
        desc = _ptr()
        _call("dnnl_pooling_forward_primitive_desc_create", ctypes.byref(desc), _state.engine, _FORWARD_INFERENCE,
              _POOLING[self.kind], x_desc, y_desc, _Dims(*stride), _Dims(*kernel), _Dims(0, 0), _Dims(*padding),
              _Dims(*right), _state.attr)
        return _Primitive(desc), x_desc, y_desc, (n,) + out_hw + (c,), {}


class _MatMul(_Inference):
    """a @ b for float32 3-D arrays (a batch of matrices; views with any element strides, e.g. transposed ones, are
    read in place) on the calling thread: a new C-contiguous array. One primitive per shapes and strides."""

    def _create(self, key):
        a_shape, a_strides, b_shape, b_strides = key
        descs = []
        for shape, strides in ((a_shape, a_strides), (b_shape, b_strides)):
            desc = _ptr()
            _call("dnnl_memory_desc_create_with_strides", ctypes.byref(desc), 3, _Dims(*shape), _F32, _Dims(*strides))
            descs.append(desc)
        out_shape = a_shape[:2] + b_shape[2:]
        descs.append(_desc(out_shape, b"abc"))
        desc = _ptr()
        _call("dnnl_matmul_primitive_desc_create", ctypes.byref(desc), _state.engine, descs[0], descs[1], None,
              descs[2], _state.attr)
        return _Primitive(desc), descs, out_shape

    def __call__(self, a, b):
        key = (a.shape, tuple(s // 4 for s in a.strides), b.shape, tuple(s // 4 for s in b.strides))
        primitive, (a_desc, b_desc, out_desc), out_shape = self._plan(key)
        out = np.empty(out_shape, np.float32)
        primitive({ARG_SRC: (a_desc, a), ARG_WEIGHTS: (b_desc, b), ARG_DST: (out_desc, out)})
        return out


matmul = _MatMul()
_relu = None
