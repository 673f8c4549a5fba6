"""megdiffusion's UNet as a MegEngine graph file (``.mge``) for MegEngine Lite and MegEngine's graph loader.

``dump_mge`` traces the network (``jit.trace(symbolic=True, capture_as_const=True)``) and dumps it with the inference
optimisations (conv + bias + nonlinearity fused): inputs ``x`` float32 (N, C, H, W), ``t`` float32 (N,) timesteps as
the network sees them and, for a class-conditional network, ``y`` int32 (N,); output ``out``. The graph is traced at
one batch size but MegEngine 1.13 keeps N dynamic: it runs at any batch. The run's config, step and source travel
in the file's ``user_info`` as JSON (``read_mge_info``), so sampling needs nothing else. ``DeployedNetwork`` runs
the file through ``megenginelite`` and is called like the UNet.
"""
import json

import numpy as np

from megdiffusion.files.disk import atomic_write
from megdiffusion.formats import ConvertError

MGE_MAGIC = b"mgv2"  # MegEngine's graph files name their format in the first 16 bytes
INFO_FORMAT = "megdiffusion.mge/1"  # the user_info's "format": what it holds


def is_mge(path):
    """Whether ``path`` starts like a MegEngine graph file."""
    with open(path, "rb") as f:
        return MGE_MAGIC in f.read(16)


def dump_mge(model, path, info, batch_size=1):
    """Write ``model`` (a megdiffusion ``UNet``, its weights as they are) to ``path`` as a MegEngine graph traced at
    ``batch_size`` (it runs at any), with ``info`` (a JSON-able dict: config, step, source) as its user info."""
    import megengine as mge
    from megengine import jit

    from megdiffusion.compat import megengine_errors_only
    from megdiffusion.diffusion.samplers import eval_mode

    conditional = model.class_emb is not None
    channels = model.conv_in.weight.shape[1]

    @jit.trace(symbolic=True, capture_as_const=True)
    def denoise(x, t, *y):
        return model(x, t, *y)

    inputs = [mge.tensor(np.zeros((batch_size, channels, model.image_size, model.image_size), np.float32)),
              mge.tensor(np.zeros(batch_size, np.float32))]
    if conditional:
        inputs.append(mge.tensor(np.zeros(batch_size, np.int32)))
    with eval_mode(model), megengine_errors_only():  # the class embedding's gather draws a performance warning
        denoise(*inputs)
    with atomic_write(path) as f, megengine_errors_only():
        # no_change_graph: without it 1.13's dump rewrites the upsample's reshape into a graph that fails to load
        # ("bad input shape for polyadic operator").
        # Traced at batch 1, the fusion takes the time embedding's (1, C, 1, 1) add for a convolution bias, and the
        # graph then fails at any other batch ("bias.shape[0] == 1"): fused only from batch 2.
        denoise.dump(f, arg_names=["x", "t", "y"][:len(inputs)], output_names=["out"], optimize_for_inference=True,
                     enable_fuse_conv_bias_nonlinearity=batch_size > 1, no_change_graph=True,
                     user_info=json.dumps({"format": INFO_FORMAT, **info}))


def read_mge_info(path):
    """The dict ``dump_mge`` stored in the graph file at ``path``; ``ConvertError`` when it holds none."""
    from megengine.core.tensor.megbrain_graph import load_graph

    from megdiffusion.files.torch_archive import load_plain_pickle

    try:
        with open(path, "rb") as f:
            info = json.loads(load_plain_pickle(load_graph(f).metadata.user_info))  # MegEngine pickles the user info
    except Exception as exc:  # MegEngine's loader raises RuntimeError or its own MegBrainError for a bad file
        raise ConvertError(f"{path} is not a graph megdiffusion exported ({type(exc).__name__}); export it with "
                           "megdiffusion.scripts.export --to mge") from None
    if not isinstance(info, dict) or info.get("format") != INFO_FORMAT:
        raise ConvertError(f"{path} is a MegEngine graph, but not one megdiffusion exported (no {INFO_FORMAT} "
                           "record); export the checkpoint with megdiffusion.scripts.export --to mge")
    return info


class DeployedNetwork:
    """The network of a ``.mge`` file through MegEngine Lite, called like the UNet: ``(x, t, y=None)`` as numpy
    arrays or MegEngine tensors, the output of the same kind (float32 NCHW)."""

    def __init__(self, path, num_classes=0):
        import megenginelite

        from megdiffusion.cpu.batch_threads import THREADS

        self.path, self.num_classes = path, num_classes
        # Lite runs one thread unless told; with one per core the output is the same bit for bit, sooner
        # (docs/elsewhere.md). Its threads warn that they spin-wait: a warning, not news to a user.
        megenginelite.set_log_level(megenginelite.LiteLogLevel.ERROR)
        self._network = megenginelite.LiteNetwork()
        self._network.threads_number = THREADS  # the cores this process may run on
        self._network.load(path)

    def __call__(self, x, t, y=None):
        import megengine as mge

        tensors = isinstance(x, mge.Tensor)
        if (y is None) != (self.num_classes == 0):
            raise ValueError(f"{self.path}: a network of {self.num_classes} classes needs class labels y"
                             if self.num_classes else f"{self.path}: the network takes no class labels")
        feeds = {"x": (x, np.float32), "t": (t, np.float32)}
        if y is not None:
            feeds["y"] = (y, np.int32)
        for name, (value, dtype) in feeds.items():
            value = value.numpy() if isinstance(value, mge.Tensor) else value
            self._network.get_io_tensor(name).set_data_by_copy(np.ascontiguousarray(value, dtype))
        self._network.forward()
        self._network.wait()
        out = self._network.get_io_tensor("out").to_numpy()
        return mge.tensor(out) if tensors else out
