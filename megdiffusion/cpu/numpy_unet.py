"""The UNet outside MegEngine: forward and backward in numpy on channels-last arrays, the convolutions and the
attention's products on oneDNN, GroupNorm with SiLU and the softmax as compiled kernels (``cpu.fused``).

The fast CPU path's training steps and eval calls (``megdiffusion.cpu.native``) run here. Through MegEngine a step of
the CPU recipe dispatched ~1,000 small ops and waited on MegEngine's worker thread at every hand-over to the numpy
convolutions, holding the GIL meanwhile (benchmarks/README.md, "What the remaining gap was made of"). Here a
group of samples goes forward as plain numpy calls; each layer returns its output and the closure of its
backward, and the backward pass calls them in reverse. Dropout is inverted dropout with masks from the given
generator (training mode); eval mode has none.

The network is a ``describe``d ``UNet``: the module tree as plain namespaces (picklable, no MegEngine), every
``Parameter`` replaced by its index in the parameter list, so that processes without MegEngine can run it
(``megdiffusion.cpu.group_workers``). Parameters are read from ``weights`` and gradients added into ``grads``, lists of
numpy arrays in that order. The arithmetic is the modules' (``nn.layers``, ``nn.unet``): outputs and gradients
equal MegEngine's up to float32 rounding (tests: 1e-4 relative). Two sums run in another order than MegEngine's:
SiLU(temb) is computed once for all residual blocks, and the q, k and v projections of an attention block are
one matmul.
"""
import types

import numpy as np

from megdiffusion.cpu import fused, onednn
from megdiffusion.errors import MegdiffusionError


# The allowlist of the pass: for each module class of the UNet (by exact class name: a subclass is another module),
# the attributes its kernels read, those they know and leave aside (sizes the weights carry, or facts the caller
# computes: the time embedding's sinusoid is MegEngine's, ``timestep_input``), and the only values implemented of
# the attributes named in "supports". Any other class, attribute or value is ``NotLowerable``: the pass never runs a
# network other than the one ``nn`` defines.
_BOOKKEEPING = {"name", "training", "quantize_disabled"}  # every MegEngine module's
LOWERING = {
    "UNet": dict(reads={"temb_dense0", "temb_dense1", "class_emb", "no_class", "conv_in", "down", "mid_block1",
                        "mid_attn", "mid_block2", "up", "norm_out", "conv_out"},
                 ignores={"config", "image_size", "model_channels", "num_classes", "time_embedding"}),
    "DownLevel": dict(reads={"blocks", "attns", "downsample"}),
    "UpLevel": dict(reads={"blocks", "attns", "upsample"}),
    "ResBlock": dict(reads={"norm1", "conv1", "temb_proj", "norm2", "dropout", "conv2", "skip", "scale_shift"}),
    "AttnBlock": dict(reads={"norm", "q", "k", "v", "proj_out", "num_heads"}),
    "Downsample": dict(reads={"conv", "bottom_right"}),
    "Upsample": dict(reads={"conv"}),  # nearest-neighbour 2x, then the convolution
    "Conv2d": dict(reads={"weight", "bias", "stride", "padding"},
                   ignores={"in_channels", "out_channels", "kernel_size"},
                   supports={"groups": (1,), "dilation": ((1, 1),), "padding_mode": ("zeros",),
                             "conv_mode": ("cross_correlation",), "output_padding": (0,),
                             "compute_mode": ("default",)}),
    "Linear": dict(reads={"weight", "bias"}, ignores={"in_features", "out_features"},
                   supports={"compute_mode": ("default",)}),
    "GroupNorm": dict(reads={"weight", "bias", "num_groups", "eps"}, ignores={"num_channels"},
                      supports={"affine": (True,)}),
    "Embedding": dict(reads={"weight"}, ignores={"num_embeddings", "embedding_dim", "freeze"},
                      supports={"max_norm": (None,), "norm_type": (None,), "padding_idx": (None,)}),
    "Dropout": dict(reads={"drop_prob"}),
}


class NotLowerable(MegdiffusionError):
    """A module class, attribute or value of the network that the numpy pass has no kernel for (one line)."""


def describe(module, params):
    """``module`` as nested ``SimpleNamespace``s of the attributes ``LOWERING`` says the pass reads: sub-modules
    (also in lists) described the same way, each ``Parameter`` of ``params`` as its index there, plain values
    (numbers, strings, tuples, None) as they are. ``NotLowerable`` names the first class, attribute or value the
    allowlist does not hold."""
    from megengine import Parameter
    from megengine.module import Module

    index = {id(p): i for i, p in enumerate(params)}

    def convert(value, where):
        if isinstance(value, Parameter):
            return index[id(value)]
        if isinstance(value, Module):
            return lower(value, where)
        if isinstance(value, list):
            return [convert(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if value is None or isinstance(value, (bool, int, float, str, tuple)):
            return value
        raise NotLowerable(f"{where} is a {type(value).__name__}, which the CPU engine's numpy pass does not read")

    def lower(value, where):
        kind = type(value).__name__
        entry = LOWERING.get(kind)
        if entry is None:
            raise NotLowerable(f"{where} is a {kind}, a module the CPU engine's numpy pass has no kernel for "
                               "(megdiffusion/cpu/numpy_unet.py LOWERING)")
        read = {}
        for name, attribute in vars(value).items():
            if name.startswith("_") or name in _BOOKKEEPING or name in entry.get("ignores", ()):
                continue
            if name in entry.get("supports", {}):
                if attribute not in entry["supports"][name]:
                    raise NotLowerable(f"{kind}.{name}={attribute!r} ({where}) is not implemented by the CPU "
                                       "engine's numpy pass (megdiffusion/cpu/numpy_unet.py LOWERING)")
                continue
            if name not in entry["reads"]:
                raise NotLowerable(f"{kind}.{name} ({where}) is an attribute the CPU engine's numpy pass does not "
                                   "implement (megdiffusion/cpu/numpy_unet.py LOWERING)")
            read[name] = convert(attribute, f"{where}.{name}")
        return types.SimpleNamespace(**read)

    return convert(module, type(module).__name__)


def _serial(count, work):
    work(slice(0, count))


def _conv(weight, bias, x, stride=(1, 1), padding=(0, 0), out_hw=None, reordered=None):
    """conv2d(x, weight) + bias on oneDNN, x and the output NHWC, ``weight`` OIHW (1x1 too: oneDNN's kernels beat
    OpenBLAS's matmul): (output, backward(dy) -> (dx, dweight, dbias)). ``out_hw``: the
    output's height and width (default x's); ``reordered``: ``onednn.conv2d_forward``'s, for fixed weights."""
    x = np.ascontiguousarray(x)
    y = onednn.conv2d_forward(x, weight, bias, stride, padding, out_hw or x.shape[1:3], _serial, group=len(x),
                              channels_last=True, reordered=reordered)

    def backward(dy):
        return onednn.conv2d_backward(x, weight, np.ascontiguousarray(dy), stride, padding, True, _serial,
                                      group=len(x), channels_last=True)

    return y, backward


class _Layers:
    """The layer functions of one group's pass on NHWC arrays: each returns (output, backward), backward(dy) -> dx,
    adding parameter gradients into ``grads``. Dropout draws from ``rng`` (None: eval mode, no dropout).
    ``prepared``: a dict kept between eval passes at the same weights, where the layers keep what they derive from
    the weights (oneDNN's layouts of them, the concatenated q, k, v projections); None when the weights change."""

    def __init__(self, weights, grads, rng, prepared=None):
        self.weights, self.grads, self.rng, self.prepared = weights, grads, rng, prepared

    def kept(self, *key):
        """The dict kept under ``key`` in ``prepared`` (created empty), or None without ``prepared``."""
        return None if self.prepared is None else self.prepared.setdefault(key, {})

    def w(self, param):
        return self.weights[param]

    def add_grad(self, param, value):
        grad = self.grads[param]
        grad += value.reshape(grad.shape)

    def conv(self, module, x, bottom_right=False):
        """``module`` (a Conv2d) on x; ``bottom_right``: x padded by one row and column at the bottom and right
        first (``Downsample``'s TF padding)."""
        weight, bias = self.w(module.weight), self.w(module.bias).reshape(-1)
        stride, padding = tuple(module.stride), tuple(module.padding)
        size = [s + bottom_right for s in x.shape[1:3]]
        out_hw = tuple((s + 2 * p - k) // st + 1 for s, p, k, st in zip(size, padding, weight.shape[2:], stride))
        y, conv_back = _conv(weight, bias, x, stride, padding, out_hw, self.kept("conv", module.weight))

        def backward(dy):
            dx, dw, db = conv_back(dy)
            self.add_grad(module.weight, dw)
            self.add_grad(module.bias, db)
            return dx

        return y, backward

    def linear(self, module, x):
        weight, bias = self.w(module.weight), self.w(module.bias)
        y = x @ weight.T + bias

        def backward(dy):
            self.add_grad(module.weight, dy.T @ x)
            self.add_grad(module.bias, dy.sum(axis=0))
            return dy @ weight

        return y, backward

    def embedding(self, module, labels, no_class):
        """Rows ``labels`` of ``module``'s (an Embedding) table; zeros for the label ``no_class``."""
        known = labels != no_class

        def backward(dy):
            np.add.at(self.grads[module.weight], labels[known], dy[known])

        return np.where(known[:, None], self.w(module.weight)[np.where(known, labels, 0)], 0), backward

    def norm(self, module, x, silu, shift=None):
        """``module`` (a GroupNorm) on ``x + shift`` (``shift`` (N, C), added at every position; None: nothing),
        then SiLU when ``silu``: (output, backward), backward(dy) -> (dx, d shift or None). Compiled
        (``cpu.fused``) where numba runs, else numpy."""
        n, c = len(x), x.shape[-1]
        gamma, beta = self.w(module.weight).reshape(-1), self.w(module.bias).reshape(-1)
        if not fused.available():
            return self._numpy_norm(module, x, silu, shift, gamma, beta)
        rows = np.ascontiguousarray(x).reshape(n, -1, c)
        shift_rows = np.zeros((n, c), np.float32) if shift is None else np.ascontiguousarray(shift, np.float32)
        y, mean, rstd = fused.norm_forward(rows, shift_rows, gamma, beta, module.num_groups, module.eps, silu)

        def backward(dy):
            dx, dshift = fused.norm_backward(rows, shift_rows, np.ascontiguousarray(dy).reshape(rows.shape), gamma,
                                             beta, mean, rstd, module.num_groups, silu,
                                             self.grads[module.weight].reshape(-1), self.grads[module.bias].reshape(-1))
            return dx.reshape(x.shape), None if shift is None else dshift

        return y.reshape(x.shape), backward

    def _numpy_norm(self, module, x, silu, shift, gamma, beta):
        n, c = len(x), x.shape[-1]
        groups = module.num_groups
        count = np.float32(x.size // (n * groups))  # values per (sample, group)

        def per_channel(group_values):  # (n, groups) -> (n, 1, c)
            return np.repeat(group_values, c // groups, axis=1)[:, None, :]

        def group_mean(channel_sums):  # (n, c) -> (n, groups)
            return channel_sums.reshape(n, groups, -1).sum(axis=2) / count

        normed = x.reshape(n, -1, c)  # (n, h * w, c)
        if shift is not None:
            normed = normed + shift[:, None, :]
        normed = normed - per_channel(group_mean(normed.sum(axis=1)))
        variance = group_mean(np.einsum("npc,npc->nc", normed, normed))
        rstd = per_channel(1.0 / np.sqrt(variance + np.float32(module.eps)))
        normed *= rstd
        y = normed * gamma
        y += beta
        silu_back = None
        if silu:
            y, silu_back = self.silu(y)

        def backward(dy):
            dy = dy.reshape(normed.shape)
            if silu_back is not None:
                dy = silu_back(dy)
            self.add_grad(module.weight, np.einsum("npc,npc->c", dy, normed))
            self.add_grad(module.bias, dy.sum(axis=(0, 1)))
            dnormed = dy * gamma
            dx = dnormed - per_channel(group_mean(dnormed.sum(axis=1)))
            dx -= normed * per_channel(group_mean(np.einsum("npc,npc->nc", dnormed, normed)))
            dx *= rstd
            return dx.reshape(x.shape), None if shift is None else dx.sum(axis=1)

        return y.reshape(x.shape), backward

    @staticmethod
    def silu(x):
        sig = np.negative(x)
        np.exp(sig, out=sig)
        sig += 1.0
        np.reciprocal(sig, out=sig)

        def backward(dy):
            dx = 1.0 - sig  # d(x * s)/dx = s * (1 + x * (1 - s))
            dx *= x
            dx += 1.0
            dx *= sig
            dx *= dy
            return dx

        return x * sig, backward

    def res_block(self, block, x, temb_act):
        """``ResBlock`` on x given SiLU(temb): (output, backward(dy) -> (dx, d SiLU(temb)))."""
        h, back1 = self.norm(block.norm1, x, silu=True)
        h, back2 = self.conv(block.conv1, h)
        emb, back3 = self.linear(block.temb_proj, temb_act)
        if block.scale_shift:
            h, back4 = self.scale_shift_norm(block.norm2, h, emb)
        else:
            h, back4 = self.norm(block.norm2, h, silu=True, shift=emb)
        h, dropout_back = self.dropout(block.dropout.drop_prob, h)
        h, back5 = self.conv(block.conv2, h)
        skip, back6 = self.conv(block.skip, x) if block.skip is not None else (x, None)

        def backward(dy):
            dh, demb = back4(dropout_back(back5(dy)))
            dtemb = back3(demb)
            dx = back1(back2(dh))[0]
            dx += dy if back6 is None else back6(dy)
            return dx, dtemb

        return skip + h, backward

    def scale_shift_norm(self, module, x, emb):
        """SiLU(GN(x) * (1 + scale) + shift), (scale, shift) = ``emb`` (N, 2C) split in two (AdaGN, ``ResBlock``'s
        scale_shift): (output, backward(dy) -> (dx, d emb))."""
        c = x.shape[-1]
        scale, shift = emb[:, None, None, :c], emb[:, None, None, c:]
        normed, norm_back = self.norm(module, x, silu=False)
        y, silu_back = self.silu(normed * (1.0 + scale) + shift)

        def backward(dy):
            dy = silu_back(dy)
            demb = np.concatenate([np.sum(dy * normed, axis=(1, 2)), dy.sum(axis=(1, 2))], axis=1)
            return norm_back(dy * (1.0 + scale))[0], demb

        return y, backward

    def dropout(self, rate, x):
        """Inverted dropout: each value kept with probability 1 - ``rate`` and scaled by 1 / (1 - rate)."""
        if self.rng is None or rate == 0:
            return x, lambda dy: dy
        scaled_mask = (self.rng.random(x.shape, dtype=np.float32) >= rate) * np.float32(1.0 / (1.0 - rate))
        return x * scaled_mask, lambda dy: dy * scaled_mask

    def attention(self, attn, x):
        """``AttnBlock`` on x."""
        n, height, width, c = x.shape
        heads, positions = attn.num_heads, height * width
        d = c // heads
        scale = np.float32(d ** -0.5)

        def to_heads(a):  # (n, positions, c) -> (n * heads, positions, d)
            return a.reshape(n, positions, heads, d).transpose(0, 2, 1, 3).reshape(n * heads, positions, d)

        def from_heads(a):
            return a.reshape(n, heads, positions, d).transpose(0, 2, 1, 3).reshape(n, positions, c)

        h, norm_back = self.norm(attn.norm, x, silu=False)
        projections = (attn.q, attn.k, attn.v)
        kept = self.kept("qkv", attn.q.weight)
        kept = {} if kept is None else kept  # training: made afresh in each pass
        if not kept:  # one 1x1 convolution to 3c channels
            kept.update(w=np.concatenate([self.w(p.weight) for p in projections]),
                        b=np.concatenate([self.w(p.bias).reshape(c) for p in projections]), reordered={})
        w_qkv = kept["w"]
        qkv, qkv_back = _conv(w_qkv, kept["b"], h, reordered=kept["reordered"])
        qkv = qkv.reshape(-1, 3 * c)
        q, k, v = (to_heads(qkv[:, i * c:(i + 1) * c].reshape(n, positions, c)) for i in range(3))
        # (n * heads, query, key): the logits, made softmax(logits * scale) in place
        weights = onednn.matmul(q, k.transpose(0, 2, 1))
        if fused.available():
            fused.softmax_rows(weights.reshape(-1, positions), scale)
        else:
            weights *= scale
            weights -= weights.max(axis=2, keepdims=True)
            np.exp(weights, out=weights)
            weights /= weights.sum(axis=2, keepdims=True)
        mixed = from_heads(onednn.matmul(weights, v)).reshape(x.shape)
        out, proj_back = self.conv(attn.proj_out, mixed)

        def backward(dy):
            dmixed = to_heads(proj_back(dy).reshape(n, positions, c))
            dv = onednn.matmul(weights.transpose(0, 2, 1), dmixed)
            dweights = onednn.matmul(dmixed, v.transpose(0, 2, 1))
            dlogits = dweights - np.sum(dweights * weights, axis=2, keepdims=True)
            dlogits *= weights
            dlogits *= scale
            dq = onednn.matmul(dlogits, k)
            dk = onednn.matmul(dlogits.transpose(0, 2, 1), q)
            dqkv = np.concatenate([from_heads(g) for g in (dq, dk, dv)], axis=2).reshape(x.shape[:3] + (3 * c,))
            dh, dw, db = qkv_back(dqkv)
            for i, p in enumerate(projections):
                self.add_grad(p.weight, dw[i * c:(i + 1) * c])
                self.add_grad(p.bias, db[i * c:(i + 1) * c])
            dx = norm_back(dh)[0]
            dx += dy
            return dx

        return x + out, backward

    def upsample(self, module, x):
        """``Upsample``: nearest-neighbour 2x, then its convolution."""
        n, h, w, c = x.shape
        wide = np.broadcast_to(x[:, :, None, :, None, :], (n, h, 2, w, 2, c)).reshape(n, 2 * h, 2 * w, c)
        y, conv_back = self.conv(module.conv, wide)
        return y, lambda dy: conv_back(dy).reshape(n, h, 2, w, 2, c).sum(axis=(2, 4))

    def downsample(self, module, x):
        return self.conv(module.conv, x, bottom_right=module.bottom_right)


def unet_forward(model, weights, grads, x, temb_in, labels=None, rng=None, prepared=None):
    """The output of ``model`` (a ``describe``d UNet) on x (N, H, W, C: channels last, as the output) given the
    sinusoidal embedding ``temb_in`` (N, model_channels) of its timesteps and, for a class-conditional network, the
    class ``labels`` (N,): (output, backward); backward(d output) adds every parameter's gradient into ``grads``.
    Training mode draws dropout masks from ``rng``; eval mode (``rng`` None) has none. ``prepared``: see
    ``_Layers``."""
    layers = _Layers(weights, grads, rng, prepared)
    a, dense0_back = layers.linear(model.temb_dense0, temb_in)
    a, silu0_back = layers.silu(a)
    temb, dense1_back = layers.linear(model.temb_dense1, a)
    if (labels is None) != (model.class_emb is None):
        raise ValueError("class labels go with a class-conditional network, and only with one")
    class_back = None
    if model.class_emb is not None:
        class_temb, class_back = layers.embedding(model.class_emb, labels, model.no_class)
        temb = temb + class_temb
    temb_act, temb_back = layers.silu(temb)
    blocks = []  # (backward of a residual block, backward of its attention or None)

    def block(module, attn, h):
        h, back = layers.res_block(module, h, temb_act)
        attn_back = None
        if attn is not None:
            h, attn_back = layers.attention(attn, h)
        blocks.append((back, attn_back))
        return h

    # Down: every stage's output is a skip, and the next stage's input.
    h, back = layers.conv(model.conv_in, x)
    stages, hs = [back], [h]
    for level in model.down:
        for i, module in enumerate(level.blocks):
            hs.append(block(module, level.attns[i] if level.attns else None, hs[-1]))
            stages.append(len(blocks) - 1)
        if level.downsample is not None:
            h, back = layers.downsample(level.downsample, hs[-1])
            hs.append(h)
            stages.append(back)
    mid = len(blocks)
    h = block(model.mid_block1, model.mid_attn, hs[-1])
    h = block(model.mid_block2, None, h)
    ups = []  # per up block: its index in ``blocks`` and the channels of h in its input; or an upsample's backward
    for level in reversed(model.up):
        for i, module in enumerate(level.blocks):
            ups.append((len(blocks), h.shape[3]))
            h = block(module, level.attns[i] if level.attns else None, np.concatenate([h, hs.pop()], axis=3))
        if level.upsample is not None:
            h, back = layers.upsample(level.upsample, h)
            ups.append(back)
    h, out_back = layers.norm(model.norm_out, h, silu=True)
    out, conv_back = layers.conv(model.conv_out, h)

    def backward(dout):
        dtemb_act = np.zeros_like(temb_act)

        def block_back(index, dh):
            back, attn_back = blocks[index]
            dh, dtemb = back(dh if attn_back is None else attn_back(dh))
            dtemb_act[...] += dtemb
            return dh

        dh = out_back(conv_back(dout))[0]
        dskips = []  # gradients of hs, last first
        for up in reversed(ups):
            if callable(up):
                dh = up(dh)
                continue
            index, channels = up
            dcat = block_back(index, dh)
            dh, dskip = dcat[..., :channels], dcat[..., channels:]
            dskips.append(dskip)
        dh = block_back(mid, block_back(mid + 1, dh))
        for stage, dskip in zip(reversed(stages), reversed(dskips)):
            dh = dh + dskip
            dh = block_back(stage, dh) if isinstance(stage, int) else stage(dh)
        dtemb = temb_back(dtemb_act)
        if class_back is not None:
            class_back(dtemb)
        dense0_back(silu0_back(dense1_back(dtemb)))

    return out, backward


def training_pass(model, weights, grads, x_t, temb_in, labels, dropout_seed):
    """One group's training-mode pass of ``model`` at (x_t NCHW, ``temb_in``, ``labels``), dropout masks from
    ``np.random.default_rng(dropout_seed)``: (output NCHW, backward(d output NCHW)), the backward adding every
    parameter's gradient into ``grads``."""
    out, backward = unet_forward(model, weights, grads, np.ascontiguousarray(x_t.transpose(0, 2, 3, 1)), temb_in,
                                 labels, np.random.default_rng(dropout_seed))
    return (np.ascontiguousarray(out.transpose(0, 3, 1, 2)),
            lambda doutput: backward(np.ascontiguousarray(doutput.transpose(0, 2, 3, 1))))


def unet_output(model, weights, x, temb_in, labels=None, prepared=None):
    """``model``'s output on x (NCHW) given ``temb_in`` (and ``labels``), NCHW: an eval-mode call. ``prepared``: a
    dict kept between calls at the same ``weights`` (``_Layers``), or None."""
    out, _ = unet_forward(model, weights, None, np.ascontiguousarray(x.transpose(0, 2, 3, 1)), temb_in, labels,
                          prepared=prepared)
    return np.ascontiguousarray(out.transpose(0, 3, 1, 2))
