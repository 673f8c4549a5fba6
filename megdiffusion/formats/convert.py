"""Converting a published checkpoint: read it (format from the content), describe its network and diffusion as a
``TrainConfig``, and map every tensor onto megdiffusion's UNet (``convert``)."""
import os
from dataclasses import dataclass

import numpy as np

from megdiffusion.diffusion.choices import LEARNED_VAR_TYPES
from megdiffusion.errors import one_line
from megdiffusion.files.disk import check_not_special
from megdiffusion.files import torch_archive
from megdiffusion.formats import ConvertError
from megdiffusion.formats.diffusers import DIFFUSERS_WEIGHTS, EMBEDDING_LAYER, diffusers_source, sin_cos_columns
from megdiffusion.formats.names import TIME_TABLE, detect_layout, format_of, mapping, qkv_part, split_qkv
from megdiffusion.formats.networks import network_from_shapes, table_embedding
from megdiffusion.formats.published import PORT_CHANNEL_ORDERS, PUBLISHED, family_of, find_published
from megdiffusion.formats.safetensors_file import is_safetensors, read_safetensors
from megdiffusion.training.checkpoint import REQUIRED_KEYS, list_checkpoints
from megdiffusion.training.config import ConfigError, TrainConfig, validate

@dataclass
class Source:
    """What a checkpoint holds: its format and layout, its tensors (name -> array), the ``TrainConfig`` fields
    (and ``attention_levels``) it states, and which of its weights were read."""

    path: str
    format: str
    layout: str
    tensors: dict
    stated: dict
    weights: str


def _state_dict(obj, ema, path):
    """The state dict to convert in a loaded file, and its name: the file itself, or with raw and EMA weights
    (pytorch-ddpm's ``net_model``/``ema_model``, the port's ``model``/``ema_model``) the one ``ema`` picks (None: the
    EMA weights where a file has both, else its one set)."""
    if isinstance(obj, dict) and "ema_model" in obj:
        key = "ema_model" if ema or ema is None else ("net_model" if "net_model" in obj else "model")
        state = obj.get(key)
    elif ema:
        raise ConvertError(f"{path} holds one set of weights; --ema picks the EMA weights of files that hold both "
                           "(pytorch-ddpm's ckpt.pt, the MegEngine port's ckpt.pkl)")
    else:
        key, state = "state dict", obj
    if not isinstance(state, dict) or not state or not all(isinstance(v, np.ndarray) for v in state.values()):
        raise ConvertError(f"{path}: its {key} is not a state dict (names mapped to tensors)")
    return state, key


def _read_weights(path):
    """Tensors of a safetensors file, or the object of a torch file or plain pickle, and whether torch wrote it."""
    if is_safetensors(path):
        return read_safetensors(path), True
    if torch_archive.is_torch_file(path):
        return torch_archive.load_torch_file(path), True
    return torch_archive.load_array_pickle(path), False


def _ours(path):
    """The error for a megdiffusion checkpoint (or a run's logdir) given to convert."""
    what = ("holds megdiffusion checkpoints, which need" if os.path.isdir(path)
            else "is a megdiffusion checkpoint: it needs")
    return ConvertError(f"{path} {what} no conversion; give it as it is to megdiffusion.scripts.sample, fid or nll "
                        "(--ckpt), or to megdiffusion.scripts.train (--init_from)")


def read_source(path, ema=False):
    """The checkpoint at ``path`` (a diffusers directory, or a file of any format), format from the content."""
    given = path
    try:
        if list_checkpoints(path):
            raise _ours(given)
        if os.path.isdir(path):
            model_dir = path
            if not os.path.isfile(os.path.join(path, "config.json")) and os.path.isdir(os.path.join(path, "unet")):
                model_dir = os.path.join(path, "unet")  # a pipeline directory
            found = [os.path.join(model_dir, name) for name in DIFFUSERS_WEIGHTS
                     if os.path.isfile(os.path.join(model_dir, name))]
            if not found:
                raise ConvertError(f"{path} holds no {' or '.join(DIFFUSERS_WEIGHTS)}")
            path = found[0]
        elif not os.path.isfile(path):
            check_not_special(path)
            raise ConvertError(f"no file or directory {path}")
        obj, torch_file = _read_weights(path)
    except torch_archive.WeightsError as err:
        raise ConvertError(str(err)) from None
    except OSError as err:
        raise ConvertError(f"cannot read {path}: {one_line(err)}") from None
    if isinstance(obj, dict) and all(key in obj for key in REQUIRED_KEYS):
        raise _ours(given)
    state, weights = _state_dict(obj, ema, given)
    layout = detect_layout(state, torch_file)
    if format_of(layout) == "diffusers":
        return Source(given, "diffusers", layout, state, diffusers_source(os.path.dirname(path) or "."), "state dict")
    return Source(given, layout, layout, state, {}, weights)


def _conventions(source, model_channels):
    """downsample_padding, time_embedding, norm_eps, num_heads, beta_schedule and num_timesteps (or norm_groups) a
    non-diffusers source states."""
    if source.layout == "improved_diffusion":  # GroupNorm32 with torch's eps; conv Downsample with padding 1
        return dict(downsample_padding="symmetric", time_embedding="iddpm", norm_eps=1e-5, norm_groups=32)
    ho = dict(downsample_padding="bottom_right", time_embedding="ho", norm_eps=1e-6, num_heads=1,
              beta_schedule="linear")
    if source.layout == "pesser":
        return ho
    table = source.tensors.get(TIME_TABLE)
    if table is None or table.ndim != 2 or table.shape[1] != model_channels:
        raise ConvertError(f"{source.path}: no [T, {model_channels}] time-embedding table {TIME_TABLE}")
    kind = table_embedding(table)
    if kind is None or (source.layout == "pytorch_ddpm" and kind != "pytorch_ddpm"):
        raise ConvertError(f"{source.path}: {TIME_TABLE} is not {'a' if kind is None else 'pytorch-ddpm’s'} sinusoid")
    if table.shape[0] != 1000:
        raise ConvertError(f"{source.path}: T={table.shape[0]}; its betas (1e-4..0.02 at any T) are megdiffusion's "
                           "linear schedule only at T=1000")
    # The port's first model code was pytorch-ddpm's network; its last (and Ho's weights) are Ho's.
    conventions = ho if kind == "ho" else dict(ho, downsample_padding="symmetric", time_embedding=kind, norm_eps=1e-5)
    return dict(conventions, num_timesteps=table.shape[0])


# What the formats' code uses where neither the file, a flag nor a published network says: 32 GroupNorm groups,
# T = 1000, linear betas (eps prediction is TrainConfig's default); improved-diffusion's rescaled timesteps and
# dropout 0 (its script defaults).
_FORMAT_DEFAULTS = {"ddpm": dict(norm_groups=32, num_timesteps=1000, beta_schedule="linear"),
                    "improved_diffusion": dict(norm_groups=32, num_timesteps=1000, beta_schedule="linear",
                                               rescale_timesteps=True, dropout=0.0)}


def describe(source, image_size=None, norm_groups=None, var_type=None, num_heads=None, num_timesteps=None,
             beta_schedule=None):
    """The ``TrainConfig`` of the network and diffusion ``source`` holds. Values the file states win (a flag that
    contradicts one is refused); the others come from the flags, else from ``PUBLISHED``, else the formats'
    defaults (``_FORMAT_DEFAULTS``), else ``ConvertError`` asking for the flag."""
    fields = dict(source.stated)
    if format_of(source.layout) != "diffusers":
        fields.update(network_from_shapes(source.layout, {n: a.shape for n, a in source.tensors.items()}))
        fields.update(_conventions(source, fields["model_channels"]))
    family = family_of(source.format)
    published = find_published(family, fields)
    recorded = {} if published is None else dict(image_size=published.image_size, var_type=published.var_type,
                                                 dropout=published.dropout, **dict(published.settings))
    flags = dict(image_size=image_size, norm_groups=norm_groups, var_type=var_type, num_heads=num_heads,
                 num_timesteps=num_timesteps, beta_schedule=beta_schedule)
    for name, given in flags.items():
        if name in fields and given is not None and given != fields[name]:
            raise ConvertError(f"--{name}={given}, but {source.path} states {fields[name]}")
        if name not in fields:
            fields[name] = next((value for value in (given, recorded.get(name), _FORMAT_DEFAULTS[family].get(name))
                                 if value is not None), None)
        if fields[name] is None:
            raise ConvertError(f"{source.path} does not record its {name} and is not a published network "
                               f"({', '.join(p.name for p in PUBLISHED if p.family == family)}); give --{name}")
    for name, value in {**_FORMAT_DEFAULTS[family], **recorded}.items():
        fields.setdefault(name, value)
    if family == "improved_diffusion" and fields["var_type"] in LEARNED_VAR_TYPES:
        fields.setdefault("loss_type", "hybrid")  # its rescale_learned_sigmas=True
    # The training grids' steps, a field of ours no file records: at most the chain a short-T model has.
    fields["sample_steps"] = min(TrainConfig.sample_steps, fields["num_timesteps"])
    levels = fields.pop("attention_levels")
    fields["attention_resolutions"] = tuple(fields["image_size"] // 2 ** level for level in levels)
    try:
        cfg = TrainConfig(**fields)
        validate(cfg)
    except ConfigError as err:
        raise ConvertError(f"{source.path}: {err}") from None
    return cfg


def _channel_order(source, given):
    recorded = PORT_CHANNEL_ORDERS.get(os.path.basename(source.path)) if source.format == "megengine_port" else "rgb"
    if source.format == "megengine_port" and recorded is not None and given not in (None, recorded):
        raise ConvertError(f"--channel_order={given}, but the MegEngine port's hub records {recorded} for "
                           f"{os.path.basename(source.path)}")
    if given is None and recorded is None:
        raise ConvertError(f"{source.path}: the MegEngine port's files do not record their channel order; give "
                           "--channel_order bgr (its own CIFAR-10 models) or rgb (those converted from Ho's)")
    return given or recorded


def convert(path, fmt="auto", ema=False, image_size=None, norm_groups=None, var_type=None, channel_order=None,
            num_heads=None, num_timesteps=None, beta_schedule=None):
    """Map the checkpoint at ``path`` onto megdiffusion's UNet: ``(cfg, weights, record)``, ``weights`` float32
    arrays by parameter name in the network's order (images in RGB), ``record`` where they came from."""
    from megdiffusion.compat import quiet_megengine
    from megdiffusion.nn.options import attention_heads
    from megdiffusion.training.config import build_model

    source = read_source(path, ema)
    if fmt not in ("auto", source.format):
        raise ConvertError(f"{source.path} is in the {source.format} format, not {fmt}")
    cfg = describe(source, image_size, norm_groups, var_type, num_heads, num_timesteps, beta_schedule)
    order = _channel_order(source, channel_order)
    if order == "bgr" and cfg.image_channels != 3:
        raise ConvertError(f"--channel_order bgr needs 3 image channels; the network has {cfg.image_channels}")
    quiet_megengine()
    targets = {name: tuple(value.shape) for name, value in build_model(cfg).state_dict().items()}
    pairs = mapping(source.layout, {n: a.shape for n, a in source.tensors.items()}, targets,
                    len(cfg.channel_mult), cfg.num_res_blocks)
    weights = {}
    for theirs, ours in pairs:
        array = source.tensors[theirs]
        if array.dtype.kind != "f":
            raise ConvertError(f"{theirs} holds {array.dtype} values, not floating point")
        if not np.isfinite(array).all():
            raise ConvertError(f"{theirs} holds NaN or infinite values")
        part = qkv_part(source.layout, ours)
        if part is not None:
            channels = targets[ours.rsplit(".", 1)[0] + ".weight"][0]  # of the q, k or v convolution
            if ours.endswith(".bias"):
                array = array.reshape(-1)  # (3C,), or (1, 3C, 1) in the MegEngine port's files
            array = split_qkv(array, part, attention_heads(channels, cfg.num_heads, cfg.num_head_channels))
        weights[ours] = np.ascontiguousarray(array, np.float32).reshape(targets[ours])
    if source.format == "diffusers" and cfg.time_embedding == "pytorch_ddpm":  # [sin | cos] back to interleaved
        columns = np.argsort(sin_cos_columns(weights[EMBEDDING_LAYER].shape[1]))
        weights[EMBEDDING_LAYER] = np.ascontiguousarray(weights[EMBEDDING_LAYER][:, columns])
    if order == "bgr":  # the same network for RGB images: conv_in's inputs and conv_out's outputs reversed
        weights["conv_in.weight"] = np.ascontiguousarray(weights["conv_in.weight"][:, ::-1])
        weights["conv_out.weight"] = np.ascontiguousarray(weights["conv_out.weight"][::-1])
        weights["conv_out.bias"] = np.ascontiguousarray(weights["conv_out.bias"][:, ::-1])
    record = {"format": source.format, "file": path, "weights": source.weights, "channel_order": order}
    return cfg, weights, record
