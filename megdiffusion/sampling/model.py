"""A trained model as a Python object: ``megdiffusion.load(path)``.

``load`` reads a megdiffusion checkpoint, a run's directory (its newest checkpoint), a graph written by
``scripts.export --to mge``, or any checkpoint ``scripts.convert`` reads (converted in memory). The ``Model`` it
returns says what it is, is called on numpy arrays (``model(x, t, y)``: the raw network output) and samples images
(``model.sample``) as the scripts do.
"""
import os

import numpy as np

from megdiffusion.errors import MegdiffusionError


class LoadError(MegdiffusionError):
    """A path that holds no model megdiffusion can load; the message is one line that says why."""


class Model:
    """A denoising network and its diffusion. ``network`` is called as the samplers call it (MegEngine tensors);
    ``config`` is the run's ``TrainConfig``, ``step`` its training step, ``weights`` "ema", "raw" or "published" (a
    published file's one set), ``source`` where it came from (a file, and for a converted one its format)."""

    def __init__(self, network, config, step=0, weights="ema", source=None):
        from megdiffusion.training.config import build_diffusion

        self.network, self.config, self.step, self.weights = network, config, step, weights
        self.source = source or {}
        self.diffusion = build_diffusion(config)

    image_size = property(lambda self: self.config.image_size, doc="Height and width of the images, in pixels.")
    image_channels = property(lambda self: self.config.image_channels, doc="Channels of the images (3: RGB).")
    num_classes = property(lambda self: self.config.num_classes, doc="Classes it is conditioned on (0: none).")
    num_timesteps = property(lambda self: self.config.num_timesteps, doc="Diffusion steps T it was trained with.")
    beta_schedule = property(lambda self: self.config.beta_schedule, doc="The beta schedule's name.")
    mean_type = property(lambda self: self.config.mean_type, doc="What the network predicts: eps, xstart or v.")
    var_type = property(lambda self: self.config.var_type, doc="The sampling variance: fixed, or learned.")

    @property
    def out_channels(self):
        """Channels of the network's output: the image channels, twice them with a learned variance."""
        return self.image_channels * (2 if self.diffusion.learns_variance else 1)

    @property
    def deployed(self):
        """Whether the network is an exported graph (``.mge``) rather than MegEngine modules."""
        from megdiffusion.nn import UNet

        return not isinstance(self.network, UNet)

    def state_dict(self):
        """The network's weights, ``{name: float32 array}`` in the network's order (a deployed graph has none)."""
        if self.deployed:
            raise ValueError(f"{self.source.get('file')} is a deployed graph: its weights are folded into it")
        return {name: np.asarray(value) for name, value in self.network.state_dict().items()}

    def export(self, out, to, batch_size=1, opset=17):
        """Write the model to ``out`` as ``to`` (``formats.EXPORT_TARGETS``): a diffusers DDPMPipeline directory, a
        MegEngine graph traced at ``batch_size`` (it runs at any) or an ONNX graph of ``opset``; returns what was
        written, in words. ``ConvertError`` for a deployed graph or a network the target cannot describe."""
        from megdiffusion.formats import EXPORT_TARGETS, ConvertError

        if to not in EXPORT_TARGETS:
            raise ValueError(f"unknown export target {to!r}; choose one of {', '.join(EXPORT_TARGETS)}")
        if self.deployed:
            raise ConvertError(f"{self.source.get('file')} is already an exported graph; export the checkpoint it "
                               "came from")
        if to == "diffusers":
            from megdiffusion.formats.diffusers import write_diffusers

            write_diffusers(self.config, self.state_dict(), out)
            return f"a diffusers DDPMPipeline directory (open it with DDPMPipeline.from_pretrained({str(out)!r}))"
        if to == "mge":
            from megdiffusion.formats.mge_graph import dump_mge

            info = {"config": self.config.to_dict(), "step": self.step, "weights": self.weights,
                    "source": {k: str(v) for k, v in self.source.items()}}
            dump_mge(self.network, out, info, batch_size)
            return f"a MegEngine graph traced at batch {batch_size} (any batch runs)"
        from megdiffusion.formats.onnx_graph import write_onnx

        write_onnx(self.network, out, opset)
        return f"an ONNX graph, opset {opset}, dynamic batch"

    def __repr__(self):
        classes = f", {self.num_classes} classes" if self.num_classes else ""
        return (f"Model({self.image_size}x{self.image_size}x{self.image_channels}{classes}, T={self.num_timesteps} "
                f"{self.beta_schedule}, predicts {self.mean_type}, variance {self.var_type}, step {self.step}, "
                f"{self.weights} weights{', deployed graph' if self.deployed else ''})")

    def __call__(self, x, t, y=None):
        """The network's output (float32, (N, out_channels, H, W)) at images ``x`` (N, C, H, W) and integer timesteps
        ``t`` (0..T-1, one per image or one for all); ``y``: class labels of a class-conditional model (-1: none)."""
        import megengine as mge

        x = np.asarray(x, np.float32)
        expected = (self.image_channels, self.image_size, self.image_size)
        if x.ndim != 4 or x.shape[1:] != expected:
            raise ValueError(f"x must be (N, {', '.join(map(str, expected))}), got {x.shape}")
        t = _integers(t, "t", len(x))
        if t.min() < 0 or t.max() >= self.num_timesteps:
            raise ValueError(f"t must lie in 0..{self.num_timesteps - 1}, got {t.min()}..{t.max()}")
        labels = {}
        if self.num_classes:
            if y is None:
                raise ValueError(f"y (class labels 0..{self.num_classes - 1}, -1: none) is needed: the model is "
                                 "class-conditional")
            y = _integers(y, "y", len(x))
            if y.min() < -1 or y.max() >= self.num_classes:
                raise ValueError(f"y must lie in -1..{self.num_classes - 1}, got {y.min()}..{y.max()}")
            labels["y"] = mge.tensor(y, dtype="int32")
        elif y is not None:
            raise ValueError("y given, but the model is unconditional")
        return self.network(mge.tensor(x), self.diffusion.model_timesteps(t), **labels).numpy()

    def sample(self, num_images=1, seed=0, sampler="ddpm", steps=None, eta=0.0, batch_size=64, class_label=None,
               respacing=None, spacing=None, order=None, progress=False):
        """``num_images`` images as uint8 (N, H, W, C), image i from (seed, i) exactly as ``scripts.sample`` draws it;
        the sampler settings are ``scripts.sample``'s flags (``GaussianDiffusion.sample``)."""
        from megdiffusion.diffusion.generation import generate_images
        from megdiffusion.diffusion.sampler_settings import SamplerSettings
        from megdiffusion.progress import progress_bar

        settings = SamplerSettings(sampler, steps, eta, respacing, spacing, order)
        with progress_bar(total=num_images, disable=not progress, desc="images") as bar:
            return generate_images(self.network, self.diffusion, self.config.image_shape, range(num_images), seed,
                                   settings, batch_size, bar, class_label=class_label)


def _integers(values, name, count):
    """``values`` (a scalar or ``count`` of them) as int64 (count,); ValueError when they are not integers."""
    array = np.asarray(values)
    if array.dtype.kind not in "iu" and not (array.dtype.kind == "f" and np.all(array == np.round(array))):
        raise ValueError(f"{name} must be integers, got {array.dtype} values")
    if array.ndim > 1 or array.ndim == 1 and len(array) != count:
        raise ValueError(f"{name} must be one integer or {count} of them (one per image), got shape {array.shape}")
    return np.ascontiguousarray(np.broadcast_to(array.astype(np.int64), (count,)))


def load(path, ema=True):
    """The model at ``path``: a megdiffusion checkpoint, a run's logdir (its newest checkpoint), a ``.mge`` graph of
    ``scripts.export``, or a checkpoint ``scripts.convert`` reads (a diffusers directory, Ho's, pytorch-ddpm's,
    improved-diffusion's, the MegEngine port's). ``ema``: the EMA weights where the file holds both (checkpoints
    always do); ``False``: the raw ones. Raises ``LoadError`` (or the checkpoint's and converter's own errors)."""
    return open_model(path, ema).build()


class OpenedModel:
    """A model read as ``load`` reads it, its network not built yet: the run's ``config`` and ``step``, which a command
    checks its input against before MegEngine is imported, ``source`` (``Model.source``) and ``build()``."""

    def __init__(self, config, step, source, make):
        self.config, self.step, self.source, self._make = config, step, source, make

    def build(self):
        """The ``Model`` (its weights checked against the network here), once: the weights read are let go, so that
        a run's checkpoint is not held beside the network while it samples."""
        make, self._make = self._make, None
        if make is None:
            raise RuntimeError("OpenedModel.build() was called before; open the model again")
        return make()


def open_model(path, ema=True):
    """``load``'s reading of ``path`` without building the network (``OpenedModel``); a checkpoint in another format
    is converted here, network and all."""
    from megdiffusion.formats import ConvertError
    from megdiffusion.formats.mge_graph import is_mge
    from megdiffusion.training import checkpoint

    path = os.fspath(path)
    if os.path.isfile(path) and is_mge(path):
        return _open_graph(path, ema)
    if (os.path.isfile(path) and _published_file(path)
            or os.path.isdir(path) and not checkpoint.list_checkpoints(path) and _diffusers_directory(path)):
        return _converted(path, ema)
    try:
        state, path = checkpoint.load_file_or_newest(path)  # missing paths and empty logdirs get its errors
    except checkpoint.CheckpointError as not_ours:
        if not os.path.isfile(path):
            raise
        try:  # a plain pickle that is not ours, such as the MegEngine port's .pkl files
            return _converted(path, ema)
        except ConvertError:
            raise not_ours from None
    cfg, step, weights = checkpoint.config_of(state, path), state["step"], state["ema" if ema else "model"]
    source = {"file": os.path.abspath(path), **(state.get("source") or {})}
    # The rest of the state (the other weights, Adam's moments) is let go here.
    return OpenedModel(cfg, step, source, lambda: Model(_network(cfg, weights, path), cfg, step,
                                                        "ema" if ema else "raw", source))


def _diffusers_directory(path):
    return any(os.path.exists(os.path.join(path, name)) for name in ("config.json", "unet", "model_index.json"))


def _published_file(path):
    """Whether ``path`` is a torch or safetensors file: what only a published checkpoint is."""
    from megdiffusion.files import torch_archive
    from megdiffusion.formats.safetensors_file import is_safetensors

    return torch_archive.is_torch_file(path) or is_safetensors(path)


def _network(cfg, weights, path):
    """``cfg``'s UNet with ``weights`` (a state dict read from ``path``), in eval mode."""
    from megdiffusion.compat import quiet_megengine
    from megdiffusion.training.checkpoint import load_weights
    from megdiffusion.training.config import build_model

    quiet_megengine()  # when MegEngine was imported before megdiffusion
    network = build_model(cfg)
    load_weights(network, weights, path)
    network.eval()
    return network


def _converted(path, ema):
    from megdiffusion.formats.convert import convert

    cfg, weights, record = convert(path, ema=None if ema else False)
    kind = record["weights"]  # the state dict's key in the file: ema_model, net_model, model, or "state dict"
    weights_kind = "ema" if "ema" in kind else "raw" if kind in ("net_model", "model") else "published"
    model = Model(_network(cfg, weights, path), cfg, 0, weights_kind, record)
    return OpenedModel(cfg, 0, model.source, lambda: model)


def _open_graph(path, ema):
    from megdiffusion.compat import quiet_megengine
    from megdiffusion.formats.mge_graph import DeployedNetwork, read_mge_info
    from megdiffusion.training.checkpoint import config_of

    info = read_mge_info(path)
    cfg = config_of({"config": info.get("config")}, path)  # checked as a checkpoint's config is
    if not ema and info.get("weights") == "ema":
        raise LoadError(f"{path} holds the EMA weights; export the checkpoint again with --noema for the raw ones")
    step, kind, source = info.get("step", 0), info.get("weights", "ema"), {"file": os.path.abspath(path),
                                                                           "exported_from": info.get("source")}

    def build():
        quiet_megengine()
        return Model(DeployedNetwork(path, cfg.num_classes), cfg, step, kind, source)

    return OpenedModel(cfg, step, source, build)
