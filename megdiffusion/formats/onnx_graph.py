"""megdiffusion's UNet as an ONNX graph (default opset 17; the graph's operators read the same in opsets 13-17).

``write_onnx`` walks the module tree the way ``UNet.forward`` does, one converter per layer type, and builds the
graph with ``onnx.helper``: inputs ``x`` (N, C, H, W) float32, ``t`` (N,) float32 and, for a class-conditional
network, ``y`` (N,) int32; output ``out``. The batch N is dynamic; every other size is the network's. The arithmetic
is the modules' (``nn.layers``, ``nn.unet``), in the same order, so onnxruntime's output equals MegEngine's up to
float32 rounding.
"""
import numpy as np

from megdiffusion.files.disk import atomic_write
from megdiffusion.formats import ConvertError

# ReduceMean takes its axes as an attribute up to opset 17 and as an input from 18; Split, Resize, Pad, Unsqueeze and
# Softmax have the forms used here from 13.
OPSETS = range(13, 18)

class _Graph:
    """The nodes and initializers of the graph being built; ``op`` and ``const`` return the new value's name."""

    def __init__(self):
        self.nodes, self.initializers = [], []
        self._count = 0

    def _name(self, stem):
        self._count += 1
        return f"{stem}_{self._count}"

    def op(self, op_type, *inputs, outputs=1, name=None, **attributes):
        from onnx import helper

        names = [name] if name else [self._name(op_type) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), names, name=self._name(f"{op_type}_node"),
                                           **attributes))
        return names[0] if outputs == 1 else names

    def const(self, array, stem="const"):
        from onnx import numpy_helper

        name = self._name(stem)
        self.initializers.append(numpy_helper.from_array(np.asarray(array), name))
        return name


def _weight(param):
    """A parameter's values; the graph is float32 throughout."""
    value = param.numpy()
    if value.dtype != np.float32:
        raise ConvertError(f"a parameter of shape {value.shape} is {value.dtype}: only float32 weights are supported")
    return value


def _conv2d(g, conv, x, name=None):
    if conv.groups != 1 or tuple(conv.dilation) != (1, 1) or conv.padding_mode != "zeros" \
            or conv.conv_mode != "cross_correlation":
        raise ConvertError(f"Conv2d with groups={conv.groups}, dilation={tuple(conv.dilation)}, padding_mode="
                           f"{conv.padding_mode}, conv_mode={conv.conv_mode} is not supported")
    weight = _weight(conv.weight)
    bias = _weight(conv.bias).reshape(-1)  # MegEngine keeps it as (1, C, 1, 1)
    ph, pw = conv.padding
    return g.op("Conv", x, g.const(weight, "conv_w"), g.const(bias, "conv_b"), kernel_shape=list(weight.shape[2:]),
                strides=list(conv.stride), pads=[ph, pw, ph, pw], name=name)


def _linear(g, layer, x):
    # MegEngine's weight is (out, in): Gemm transposes it.
    return g.op("Gemm", x, g.const(_weight(layer.weight), "linear_w"), g.const(_weight(layer.bias), "linear_b"),
                transB=1)


def _group_norm(g, norm, x):
    if not norm.affine:
        raise ConvertError("GroupNorm without affine parameters is not supported")
    grouped = g.op("Reshape", x, g.const(np.array([0, norm.num_groups, -1], np.int64), "groups"))
    mean = g.op("ReduceMean", grouped, axes=[2], keepdims=1)
    centred = g.op("Sub", grouped, mean)
    var = g.op("ReduceMean", g.op("Mul", centred, centred), axes=[2], keepdims=1)
    std = g.op("Sqrt", g.op("Add", var, g.const(np.float32(norm.eps), "eps")))
    normed = g.op("Reshape", g.op("Div", centred, std), g.op("Shape", x))
    scale = g.const(_weight(norm.weight).reshape(1, -1, 1, 1), "gn_w")
    shift = g.const(_weight(norm.bias).reshape(1, -1, 1, 1), "gn_b")
    return g.op("Add", g.op("Mul", normed, scale), shift)


def _silu(g, x):
    return g.op("Mul", x, g.op("Sigmoid", x))


def _timestep_embedding(g, t, dim, kind):
    from megdiffusion.nn.layers import timestep_frequencies
    from megdiffusion.nn.options import TIME_EMBEDDINGS

    if kind not in TIME_EMBEDDINGS:
        raise ConvertError(f"time_embedding {kind!r} is not supported (known: {', '.join(TIME_EMBEDDINGS)})")
    freqs = timestep_frequencies(dim, kind)
    args = g.op("Mul", g.op("Unsqueeze", t, g.const(np.array([1], np.int64), "axes")), g.const(freqs[None, :], "freqs"))
    sin, cos = g.op("Sin", args), g.op("Cos", args)
    if kind == "ho":
        return g.op("Concat", sin, cos, axis=1)
    if kind == "iddpm":
        return g.op("Concat", cos, sin, axis=1)
    axis2 = g.const(np.array([2], np.int64), "axes")
    pairs = g.op("Concat", g.op("Unsqueeze", sin, axis2), g.op("Unsqueeze", cos, axis2), axis=2)  # (N, half, 2)
    return g.op("Reshape", pairs, g.const(np.array([0, dim], np.int64), "shape"))


def _res_block(g, block, x, temb):
    if block.dropout.training and block.dropout.drop_prob > 0:
        raise ConvertError(f"dropout {block.dropout.drop_prob} in training mode is not supported: call model.eval()")
    h = _conv2d(g, block.conv1, _silu(g, _group_norm(g, block.norm1, x)))
    emb = g.op("Unsqueeze", _linear(g, block.temb_proj, _silu(g, temb)), g.const(np.array([2, 3], np.int64), "axes"))
    if block.scale_shift:
        half = block.conv2.weight.shape[0]
        scale, shift = g.op("Split", emb, g.const(np.array([half, half], np.int64), "split"), axis=1, outputs=2)
        one_plus = g.op("Add", g.const(np.float32(1.0), "one"), scale)
        h = g.op("Add", g.op("Mul", _group_norm(g, block.norm2, h), one_plus), shift)
    else:
        h = _group_norm(g, block.norm2, g.op("Add", h, emb))
    h = _conv2d(g, block.conv2, _silu(g, h))
    if block.skip is not None:
        x = _conv2d(g, block.skip, x)
    return g.op("Add", x, h)


def _attn_block(g, attn, x, channels, size):
    heads = attn.num_heads
    d = channels // heads
    h = _group_norm(g, attn.norm, x)
    # (N * heads, d, positions): head i is channels i*d .. (i+1)*d - 1, as the module's reshape makes it.
    per_head = g.const(np.array([-1, d, size * size], np.int64), "shape")
    q, k, v = (g.op("Reshape", _conv2d(g, conv, h), per_head) for conv in (attn.q, attn.k, attn.v))
    scale = g.const(np.float32(d ** -0.5), "scale")
    logits = g.op("Mul", g.op("MatMul", g.op("Transpose", q, perm=[0, 2, 1]), k), scale)
    weights = g.op("Softmax", logits, axis=2)  # (N * heads, query, key)
    h = g.op("MatMul", v, g.op("Transpose", weights, perm=[0, 2, 1]))  # sum over keys
    h = g.op("Reshape", h, g.const(np.array([-1, channels, size, size], np.int64), "shape"))
    return g.op("Add", x, _conv2d(g, attn.proj_out, h))


def _downsample(g, down, x):
    if down.bottom_right:
        # The conv itself has no padding: one zero row and column at the bottom and right.
        x = g.op("Pad", x, g.const(np.array([0, 0, 0, 0, 0, 0, 1, 1], np.int64), "pads"))
    return _conv2d(g, down.conv, x)


def _upsample(g, up, x):
    scales = g.const(np.array([1, 1, 2, 2], np.float32), "scales")
    # Output pixel i takes input pixel floor(i / 2), MegEngine's nearest interpolation.
    doubled = g.op("Resize", x, "", scales, mode="nearest", coordinate_transformation_mode="asymmetric",
                   nearest_mode="floor")
    return _conv2d(g, up.conv, doubled)


def _out_channels(block):
    return block.conv2.weight.shape[0]


def _down_level(g, level, h, temb, size):
    outputs = []
    for i, block in enumerate(level.blocks):
        h = _res_block(g, block, h, temb)
        if level.attns:
            h = _attn_block(g, level.attns[i], h, _out_channels(block), size)
        outputs.append(h)
    if level.downsample is not None:
        outputs.append(_downsample(g, level.downsample, h))
    return outputs


def _up_level(g, level, h, temb, skips, size):
    for i, block in enumerate(level.blocks):
        h = _res_block(g, block, g.op("Concat", h, skips.pop(), axis=1), temb)
        if level.attns:
            h = _attn_block(g, level.attns[i], h, _out_channels(block), size)
    if level.upsample is not None:
        h = _upsample(g, level.upsample, h)
    return h


def _class_embedding(g, model, temb, y):
    labels = g.op("Max", y, g.const(np.int32(0), "zero"))
    known = g.op("Cast", g.op("Not", g.op("Equal", y, g.const(np.int32(model.no_class), "no_class"))), to=1)
    emb = g.op("Gather", g.const(_weight(model.class_emb.weight), "class_emb"), labels, axis=0)
    known = g.op("Unsqueeze", known, g.const(np.array([1], np.int64), "axes"))
    return g.op("Add", temb, g.op("Mul", emb, known))


def _unet(g, model, x, t, y):
    temb = _timestep_embedding(g, t, model.model_channels, model.time_embedding)
    temb = _linear(g, model.temb_dense1, _silu(g, _linear(g, model.temb_dense0, temb)))
    if y is not None:
        temb = _class_embedding(g, model, temb, y)
    size = model.image_size
    hs = [_conv2d(g, model.conv_in, x)]
    for level in model.down:
        hs.extend(_down_level(g, level, hs[-1], temb, size))
        if level.downsample is not None:
            size //= 2
    h = _res_block(g, model.mid_block1, hs[-1], temb)
    h = _attn_block(g, model.mid_attn, h, _out_channels(model.mid_block1), size)
    h = _res_block(g, model.mid_block2, h, temb)
    for level in reversed(model.up):
        h = _up_level(g, level, h, temb, hs, size)
        if level.upsample is not None:
            size *= 2
    return _conv2d(g, model.conv_out, _silu(g, _group_norm(g, model.norm_out, h)), name="out")


def write_onnx(model, path, opset=17):
    """Write ``model`` (a megdiffusion ``UNet`` in eval mode, weights as they are) to ``path`` as an ONNX graph (opset
    17): inputs ``x`` float32 (N, C, H, W), ``t`` float32 (N,) timesteps as the network sees them (fractional
    allowed), and for a class-conditional network ``y`` int32 (N,) (label -1 = no class: adds no class embedding);
    output ``out`` float32 (N, out_channels, H, W); N is a dynamic dimension."""
    try:
        import onnx
        from onnx import TensorProto, helper
    except ImportError:
        raise ConvertError("writing ONNX needs the onnx package: pip install 'megdiffusion[onnx]'") from None

    from megdiffusion.nn import UNet

    if opset not in OPSETS:
        raise ConvertError(f"opset {opset} is not supported (supported: {OPSETS.start}-{OPSETS.stop - 1})")
    if not isinstance(model, UNet):
        raise ConvertError(f"write_onnx converts a megdiffusion UNet, got {type(model).__name__}")
    size = model.image_size
    in_channels = model.conv_in.weight.shape[1]
    out_channels = model.conv_out.weight.shape[0]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", in_channels, size, size]),
              helper.make_tensor_value_info("t", TensorProto.FLOAT, ["N"])]
    if model.class_emb is not None:
        inputs.append(helper.make_tensor_value_info("y", TensorProto.INT32, ["N"]))
    g = _Graph()
    _unet(g, model, "x", "t", "y" if model.class_emb is not None else None)
    graph = helper.make_graph(g.nodes, "megdiffusion_unet", inputs,
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT,
                                                             ["N", out_channels, size, size])],
                              initializer=g.initializers)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="megdiffusion")
    onnx.checker.check_model(proto, full_check=True)
    with atomic_write(path) as f:
        f.write(proto.SerializeToString())
