"""Published DDPM checkpoints: recognise the format from the content, read the network it describes, and map
every tensor onto megdiffusion's UNet (``convert``; ``scripts/convert.py`` writes the result as a checkpoint).

The formats (``FORMATS``), each Ho et al.'s network under its own names (``LAYOUTS``), but the last:

- ``diffusers``: a ``UNet2DModel`` directory: ``config.json`` and ``diffusion_pytorch_model.safetensors`` or
  ``.bin``, attention under current or pre-0.17 names; ``scheduler_config.json`` beside it (or in
  ``../scheduler/``) gives the schedule. The config must describe Ho's network (``check_diffusers_config``).
- ``pesser``: a torch state dict of pesser/pytorch_diffusion's ``Model`` (the layout ermongroup/ddim loads).
- ``pytorch_ddpm``: w86763777/pytorch-ddpm's ``ckpt.pt`` (``net_model``, ``ema_model``). Its network pads the
  downsample on every side, uses GroupNorm eps 1e-5 and an interleaved sinusoid table, recorded as model options.
- ``megengine_port``: a pickle of MegEngine/MegDiffusion's UNet state dict (its hub ``.pkl`` files) or its
  training ``ckpt.pkl`` (``model``, ``ema_model``). The stored time table tells which model code made it.
- ``improved_diffusion``: a torch state dict of openai/improved-diffusion's ``UNetModel`` (Nichol & Dhariwal 2021), or
  the MegEngine port's pickle of one (its ``iddpm_*_converted.pkl``, biases (1, C, 1, 1) and (1, C, 1)):
  symmetric downsample padding, GroupNorm eps 1e-5, its [cos | sin] time embedding, scale-shift norm and a
  learned variance read from the shapes, a fused qkv projection split into q, k and v per head. Its files record
  neither the image size, the head count nor the diffusion: published networks are recognised (``PUBLISHED``).

Reading files and naming keys import no MegEngine; ``describe`` and ``convert`` build the diffusion and network.
"""
import json
import os
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from megdiffusion.formats import torch_archive
from megdiffusion.diffusion.choices import LEARNED_VAR_TYPES
from megdiffusion.diffusion.schedules import make_beta_schedule
from megdiffusion.errors import MegdiffusionError, one_line
from megdiffusion.formats.safetensors_file import is_safetensors, read_safetensors
from megdiffusion.training.checkpoint import REQUIRED_KEYS, list_checkpoints
from megdiffusion.training.config import ConfigError, TrainConfig, validate

FORMATS = ("diffusers", "pesser", "pytorch_ddpm", "megengine_port", "improved_diffusion")
CHANNEL_ORDERS = ("rgb", "bgr")
DIFFUSERS_WEIGHTS = ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin")
TABLE_ATOL = 1e-3  # a float32 table is within ~6e-5 of its float64 formula; the two formulas differ by O(1)


class ConvertError(MegdiffusionError):
    """A checkpoint that cannot be converted faithfully; the message is one line that says why."""


@dataclass(frozen=True)
class Published:
    """A published network, recognised by its family and shape, and what its file does not record."""

    name: str
    family: str  # "ddpm": Ho et al.'s network (every format but improved_diffusion), or "improved_diffusion"
    image_size: int
    model_channels: int
    channel_mult: tuple
    num_res_blocks: int
    attention_levels: tuple
    var_type: str
    dropout: float
    settings: tuple = ()  # further (TrainConfig field, value) pairs


# Ho et al. 2020: linear betas 1e-4..0.02, T = 1000, eps prediction for all; fixedlarge for CIFAR-10's FID.
# improved-diffusion: the flags of its README (4 heads and attention at 16 and 8 pixels by default); its L_vlb
# models (``*_vlb_*``) have the same networks, trained with a loss megdiffusion does not have (hybrid is recorded).
_IDDPM_4000 = (("num_timesteps", 4000), ("beta_schedule", "cosine"), ("num_heads", 4), ("rescale_timesteps", True),
               ("loss_type", "hybrid"))
PUBLISHED = (
    Published("Ho et al.'s CIFAR-10 model", "ddpm", 32, 128, (1, 2, 2, 2), 2, (1,), "fixedlarge", 0.1),
    Published("Ho et al.'s 256x256 models (CelebA-HQ, LSUN bedroom, cat, church)", "ddpm", 256, 128,
              (1, 1, 2, 2, 4, 4), 2, (4,), "fixedsmall", 0.0),
    Published("improved-diffusion's CIFAR-10 models (cifar10_uncond_50M_500K, cifar10_uncond_vlb_50M_500K)",
              "improved_diffusion", 32, 128, (1, 2, 2, 2), 3, (1, 2), "learned_range", 0.3, _IDDPM_4000),
    Published("improved-diffusion's ImageNet-64 models (imagenet64_uncond_100M_1500K, "
              "imagenet64_uncond_vlb_100M_1500K)",
              "improved_diffusion", 64, 128, (1, 2, 3, 4), 3, (1, 2), "learned_range", 0.0, _IDDPM_4000),
    Published("improved-diffusion's LSUN bedroom models (lsun_uncond_100M_1200K_bs128, lsun_uncond_100M_2400K_bs64)",
              "improved_diffusion", 256, 128, (1, 1, 2, 2, 4, 4), 2, (4,), "learned_range", 0.0,
              (("num_timesteps", 1000), ("beta_schedule", "linear"), ("num_heads", 1), ("rescale_timesteps", False),
               ("loss_type", "mse"))),
)

# The MegEngine port's hub files (its megdiffusion/model/pretrain/ddpm.py): its own CIFAR-10 models take BGR
# images, the ones converted from Ho's checkpoints RGB. Other files of that format need --channel_order.
PORT_CHANNEL_ORDERS = {
    "ddpm_cifar10.pkl": "bgr", "ddpm_cifar10_ema.pkl": "bgr",
    **{f"ddpm_{name}{ema}_converted.pkl": "rgb" for name in ("cifar10", "lsun_bedroom", "lsun_cat", "lsun_church",
                                                             "celebahq_256") for ema in ("", "_ema")},
}


# --- names -------------------------------------------------------------------------------------------------

# megdiffusion's modules outside the levels; each layout names them in this order.
_FIXED = ("temb_dense0", "temb_dense1", "conv_in", "mid_block1", "mid_attn", "mid_block2", "norm_out", "conv_out")


def _parse(name):
    """``(place, sub-layer, parameter)`` of one of megdiffusion's UNet parameter names. A place is a module of
    ``_FIXED``, or ("block" | "attn" | "resample", "down" | "up", level, index within the level)."""
    *module, param = name.split(".")
    if module[0] in _FIXED:
        return module[0], (module[1] if len(module) > 1 else None), param
    path, level, part = module[0], int(module[1]), module[2]
    if part in ("downsample", "upsample"):
        return ("resample", path, level, None), None, param
    return ("block" if part == "blocks" else "attn", path, level, int(module[3])), module[4], param


def _pesser_stage(kind, path, level, index, levels, blocks, attention_levels):
    if kind == "resample":
        return f"{path}.{level}.{path}sample.conv"
    return f"{path}.{level}.{kind}.{index}"


def _diffusers_stage(kind, path, level, index, levels, blocks, attention_levels):
    stage = f"down_blocks.{level}" if path == "down" else f"up_blocks.{levels - 1 - level}"  # up: lowest first
    if kind == "resample":
        return f"{stage}.{path}samplers.0.conv"
    return f"{stage}.{'resnets' if kind == 'block' else 'attentions'}.{index}"


def _flat_stage(kind, path, level, index, levels, blocks, attention_levels):
    """pytorch-ddpm's (and the MegEngine port's) flat lists: down, each level's blocks then a DownSample;
    up, lowest resolution first, each level's blocks + 1 then an UpSample. Attention sits inside its block."""
    if path == "down":
        start, size = level * (blocks + 1), blocks
    else:
        start, size = (levels - 1 - level) * (blocks + 2), blocks + 1
    if kind == "resample":
        return f"{path}blocks.{start + size}.main"
    return f"{path}blocks.{start + index}" + (".attn" if kind == "attn" else "")


def _iddpm_stage(kind, path, level, index, levels, blocks, attention_levels):
    """improved-diffusion's ``input_blocks`` (the first conv, then each level's blocks and a Downsample ``op``) and
    ``output_blocks`` (lowest resolution first, blocks + 1 per level); in each, [0] is the residual block, then
    the attention, then (up, the level's last block) the Upsample."""
    if path == "down":
        start = 1 + level * (blocks + 1)
        return f"input_blocks.{start + blocks}.0.op" if kind == "resample" else \
            f"input_blocks.{start + index}.{1 if kind == 'attn' else 0}"
    start = (levels - 1 - level) * (blocks + 1)
    if kind == "resample":
        return f"output_blocks.{start + blocks}.{2 if level in attention_levels else 1}.conv"
    return f"output_blocks.{start + index}.{1 if kind == 'attn' else 0}"


@dataclass(frozen=True)
class Layout:
    """How one format names the UNet's parameters: the modules of ``_FIXED``, the modules of a level (``stage``),
    and the sub-layers of a residual block (ours: norm1, conv1, temb_proj, norm2, conv2, skip) and of an
    attention block (ours: norm, q, k, v, proj_out)."""

    fixed: dict
    stage: Callable
    block: dict
    attn: dict
    table: Optional[str] = None  # the stored time-embedding table: checked, not mapped
    fused_qkv: bool = False  # q, k and v are parts of one projection (``qkv_part``)


_OURS_BLOCK = ("norm1", "conv1", "temb_proj", "norm2", "conv2", "skip")
_OURS_ATTN = ("norm", "q", "k", "v", "proj_out")
_DIFFUSERS_FIXED = dict(zip(_FIXED, ("time_embedding.linear_1", "time_embedding.linear_2", "conv_in",
                                     "mid_block.resnets.0", "mid_block.attentions.0", "mid_block.resnets.1",
                                     "conv_norm_out", "conv_out")))
_DIFFUSERS_BLOCK = dict(zip(_OURS_BLOCK, ("norm1", "conv1", "time_emb_proj", "norm2", "conv2", "conv_shortcut")))
_FLAT_FIXED = dict(zip(_FIXED, ("time_embedding.timembedding.1", "time_embedding.timembedding.3", "head",
                                "middleblocks.0", "middleblocks.0.attn", "middleblocks.1", "tail.0", "tail.2")))
_FLAT_BLOCK = ("block1.0", "block1.2", "temb_proj.1", "block2.0", "block2.3")
_FLAT_ATTN = dict(zip(_OURS_ATTN, ("group_norm", "proj_q", "proj_k", "proj_v", "proj")))
_TABLE = "time_embedding.timembedding.0.weight"
LAYOUTS = {
    "pesser": Layout(dict(zip(_FIXED, ("temb.dense.0", "temb.dense.1", "conv_in", "mid.block_1", "mid.attn_1",
                                       "mid.block_2", "norm_out", "conv_out"))),
                     _pesser_stage, dict(zip(_OURS_BLOCK, _OURS_BLOCK[:5] + ("nin_shortcut",))),
                     dict(zip(_OURS_ATTN, _OURS_ATTN))),
    "diffusers": Layout(_DIFFUSERS_FIXED, _diffusers_stage, _DIFFUSERS_BLOCK,
                        dict(zip(_OURS_ATTN, ("group_norm", "to_q", "to_k", "to_v", "to_out.0")))),
    "diffusers_legacy_attn": Layout(_DIFFUSERS_FIXED, _diffusers_stage, _DIFFUSERS_BLOCK,
                                    dict(zip(_OURS_ATTN, ("group_norm", "query", "key", "value", "proj_attn")))),
    "pytorch_ddpm": Layout(_FLAT_FIXED, _flat_stage, dict(zip(_OURS_BLOCK, _FLAT_BLOCK + ("shortcut",))), _FLAT_ATTN,
                           _TABLE),
    "megengine_port": Layout(_FLAT_FIXED, _flat_stage, dict(zip(_OURS_BLOCK, _FLAT_BLOCK + ("short_cut",))),
                             _FLAT_ATTN, _TABLE),
    "improved_diffusion": Layout(
        dict(zip(_FIXED, ("time_embed.0", "time_embed.2", "input_blocks.0.0", "middle_block.0", "middle_block.1",
                          "middle_block.2", "out.0", "out.2"))),
        _iddpm_stage,
        dict(zip(_OURS_BLOCK, ("in_layers.0", "in_layers.2", "emb_layers.1", "out_layers.0", "out_layers.3",
                               "skip_connection"))),
        dict(zip(_OURS_ATTN, ("norm", "qkv", "qkv", "qkv", "proj_out"))), fused_qkv=True),
}
_QKV_PARTS = {"q": 0, "k": 1, "v": 2}


def source_name(layout, name, levels, blocks, attention_levels=()):
    """The name ``layout`` gives megdiffusion's parameter ``name`` in a network of ``levels`` resolution levels
    with ``blocks`` residual blocks per level on the way down, and attention at ``attention_levels``."""
    place, sub, param = _parse(name)
    names = LAYOUTS[layout]
    if isinstance(place, str):
        parts, is_attn = [names.fixed[place]], place == "mid_attn"
    else:
        parts, is_attn = [names.stage(*place, levels, blocks, attention_levels)], place[0] == "attn"
    if sub is not None:
        parts.append((names.attn if is_attn else names.block)[sub])
    return ".".join(parts + [param])


def qkv_part(layout, name):
    """Which part (0 q, 1 k, 2 v) of a fused qkv projection megdiffusion's parameter ``name`` is, or None."""
    place, sub, _ = _parse(name)
    is_attn = place == "mid_attn" or (not isinstance(place, str) and place[0] == "attn")
    return _QKV_PARTS.get(sub) if LAYOUTS[layout].fused_qkv and is_attn else None


def split_qkv(array, part, heads):
    """Part ``part`` (0 q, 1 k, 2 v) of a fused qkv projection's weight or bias (3C, ...) whose rows are laid out
    per head, [q_0 k_0 v_0 q_1 k_1 v_1 ...] (improved-diffusion's ``QKVAttention``), as a (C, ...) array whose
    head i is rows i*d .. (i+1)*d - 1 (megdiffusion's ``AttnBlock``)."""
    per_head = array.reshape(heads, 3, array.shape[0] // (3 * heads), *array.shape[1:])
    return np.ascontiguousarray(per_head[:, part].reshape(array.shape[0] // 3, *array.shape[1:]))


def detect_layout(names, torch_file=True):
    """The layout of a state dict with these tensor ``names`` (``torch_file``: read from a torch or safetensors
    file rather than a plain pickle, which only the MegEngine port writes); ``ConvertError`` when none fits."""
    names = set(names)
    if "temb.dense.0.weight" in names:
        return "pesser"
    if "time_embed.0.weight" in names and "input_blocks.0.0.weight" in names:
        return "improved_diffusion"
    if "time_embedding.linear_1.weight" in names:
        return "diffusers_legacy_attn" if any(n.endswith(".query.weight") for n in names) else "diffusers"
    if "time_embedding.timembedding.1.weight" in names:
        return "pytorch_ddpm" if torch_file else "megengine_port"
    raise ConvertError("the tensors follow none of the known layouts (no temb.dense.0.weight, "
                       "time_embedding.linear_1.weight, time_embedding.timembedding.1.weight or time_embed.0.weight)")


def format_of(layout):
    """The format (``FORMATS``) a layout belongs to."""
    return "diffusers" if layout.startswith("diffusers") else layout


# --- the network a file describes ------------------------------------------------------------------------

def _shape(shapes, name):
    if name not in shapes:
        raise ConvertError(f"no tensor {name}: an incomplete state dict")
    return tuple(shapes[name])


def _levels_from(channels_of, has_attn, num_levels, model_channels):
    mult = []
    for level in range(num_levels):
        channels = channels_of(level)
        if channels % model_channels:
            raise ConvertError(f"level {level} has {channels} channels, not a multiple of {model_channels}")
        mult.append(channels // model_channels)
    return tuple(mult), tuple(level for level in range(num_levels) if has_attn(level))


def _iddpm_network(shapes):
    """``network_from_shapes`` for improved-diffusion: also use_scale_shift_norm (the time projection gives 2 * out
    values), and var_type learned_range when the output has twice the input channels."""
    if "label_emb.weight" in shapes:
        raise ConvertError("a class-conditional model (label_emb.weight); megdiffusion's networks are unconditional")
    first = _shape(shapes, "input_blocks.0.0.weight")
    starts, index = [1], 1  # the input_blocks index of each level's first residual block
    while any(name.startswith(f"input_blocks.{index}.") for name in shapes):
        index += 1
        if f"input_blocks.{index - 1}.0.op.weight" in shapes:
            starts.append(index)
    levels, blocks = len(starts), (starts[1] - 2 if len(starts) > 1 else index - 1)
    mult, attn = _levels_from(lambda lv: _shape(shapes, f"input_blocks.{starts[lv]}.0.in_layers.2.weight")[0],
                              lambda lv: f"input_blocks.{starts[lv]}.1.qkv.weight" in shapes, levels, first[0])
    projection = _shape(shapes, "input_blocks.1.0.emb_layers.1.weight")[0]
    network = dict(model_channels=first[0], image_channels=first[1], channel_mult=mult, num_res_blocks=blocks,
                   attention_levels=attn, use_scale_shift_norm=projection == 2 * first[0] * mult[0])
    outputs = _shape(shapes, "out.2.weight")[0]
    if outputs not in (first[1], 2 * first[1]):
        raise ConvertError(f"the network maps {first[1]} image channels to {outputs}: neither the image nor the image "
                           "and a variance")
    if outputs == 2 * first[1]:
        network["var_type"] = "learned_range"  # improved-diffusion's learn_sigma
    return network


def network_from_shapes(layout, shapes):
    """The shape of the network a pesser, pytorch-ddpm, MegEngine-port or improved-diffusion state dict holds:
    model_channels, channel_mult, num_res_blocks, attention_levels and image_channels (``shapes``: name -> shape);
    for improved-diffusion also what ``_iddpm_network`` reads."""
    if layout == "improved_diffusion":
        return _iddpm_network(shapes)
    if layout == "pesser":
        first = _shape(shapes, "conv_in.weight")
        levels = 1 + max((int(n.split(".")[1]) for n in shapes if n.startswith("down.")), default=-1)
        blocks = sum(f"down.0.block.{j}.conv1.weight" in shapes for j in range(len(shapes)))
        mult, attn = _levels_from(lambda lv: _shape(shapes, f"down.{lv}.block.0.conv1.weight")[0],
                                  lambda lv: f"down.{lv}.attn.0.q.weight" in shapes, levels, first[0])
    else:
        first = _shape(shapes, "head.weight")
        starts, index = [0], 0  # the flat list index of each level's first block
        while f"downblocks.{index}.block1.2.weight" in shapes or f"downblocks.{index}.main.weight" in shapes:
            index += 1
            if f"downblocks.{index - 1}.main.weight" in shapes:
                starts.append(index)
        levels, blocks = len(starts), (starts[1] - 1 if len(starts) > 1 else index)
        mult, attn = _levels_from(lambda lv: _shape(shapes, f"downblocks.{starts[lv]}.block1.2.weight")[0],
                                  lambda lv: f"downblocks.{starts[lv]}.attn.proj_q.weight" in shapes, levels, first[0])
    return dict(model_channels=first[0], image_channels=first[1], channel_mult=mult, num_res_blocks=blocks,
                attention_levels=attn)


# diffusers' UNet2DModel defaults, for keys a config.json leaves out (configs written by older versions).
DIFFUSERS_DEFAULTS = {
    "sample_size": None, "in_channels": 3, "out_channels": 3, "center_input_sample": False,
    "time_embedding_type": "positional", "time_embedding_dim": None, "freq_shift": 0, "flip_sin_to_cos": True,
    "down_block_types": ["DownBlock2D", "AttnDownBlock2D", "AttnDownBlock2D", "AttnDownBlock2D"],
    "up_block_types": ["AttnUpBlock2D", "AttnUpBlock2D", "AttnUpBlock2D", "UpBlock2D"],
    "block_out_channels": [224, 448, 672, 896], "layers_per_block": 2, "mid_block_scale_factor": 1,
    "downsample_padding": 1, "downsample_type": "conv", "upsample_type": "conv", "dropout": 0.0, "act_fn": "silu",
    "attention_head_dim": 8, "norm_num_groups": 32, "attn_norm_num_groups": None, "norm_eps": 1e-5,
    "resnet_time_scale_shift": "default", "add_attention": True, "class_embed_type": None, "num_class_embeds": None,
    "num_train_timesteps": None, "mid_block_type": "UNetMidBlock2D",
}
# The values that make a UNet2DModel Ho's network (``flip_sin_to_cos`` false and ``freq_shift`` 1: Ho's sinusoid).
DIFFUSERS_HO = {
    "center_input_sample": False, "time_embedding_type": "positional", "flip_sin_to_cos": False, "freq_shift": 1,
    "mid_block_scale_factor": 1, "downsample_type": "conv", "upsample_type": "conv", "act_fn": "silu",
    "resnet_time_scale_shift": "default", "add_attention": True, "class_embed_type": None, "num_class_embeds": None,
    "mid_block_type": "UNetMidBlock2D",
}
_DIFFUSERS_PADDING = {0: "bottom_right", 1: "symmetric"}  # downsample_padding 0: F.pad(x, (0, 1, 0, 1))


def check_diffusers_config(config):
    """The network a ``UNet2DModel`` config describes, as ``TrainConfig`` fields (and attention_levels; None where
    it says nothing: dropout, T); ``ConvertError`` naming the key when it is not a network megdiffusion computes."""
    values = {**DIFFUSERS_DEFAULTS, **{k: v for k, v in config.items() if not k.startswith("_")}}
    unknown = sorted(set(values) - set(DIFFUSERS_DEFAULTS))
    if unknown:
        raise ConvertError(f"config.json has keys this converter does not know: {', '.join(unknown)}")
    for key, needed in DIFFUSERS_HO.items():
        if values[key] != needed:
            raise ConvertError(f"config.json has {key}={values[key]!r}; Ho's network needs {needed!r}")
    channels, downs, ups = list(values["block_out_channels"]), list(values["down_block_types"]), \
        list(values["up_block_types"])
    levels = len(channels)
    if len(downs) != levels or not set(downs) <= {"DownBlock2D", "AttnDownBlock2D"}:
        raise ConvertError(f"config.json: down_block_types {downs} must be {levels} DownBlock2D/AttnDownBlock2D")
    attn = tuple(level for level, kind in enumerate(downs) if kind == "AttnDownBlock2D")
    mirrored = ["AttnUpBlock2D" if levels - 1 - k in attn else "UpBlock2D" for k in range(levels)]
    if ups != mirrored:
        raise ConvertError(f"config.json: up_block_types {ups} do not mirror down_block_types (expected {mirrored})")
    heads = values["attention_head_dim"]
    if heads is not None and any(heads != c for c in [channels[lv] for lv in attn] + channels[-1:]):
        raise ConvertError(f"config.json has attention_head_dim={heads}: multi-head attention (Ho's is one head "
                           "as wide as the channels: null; a missing key means diffusers' default, 8)")
    if values["time_embedding_dim"] not in (None, 4 * channels[0]):
        raise ConvertError(f"config.json has time_embedding_dim={values['time_embedding_dim']}; Ho's is "
                           f"4 * {channels[0]}")
    if values["attn_norm_num_groups"] not in (None, values["norm_num_groups"]):
        raise ConvertError(f"config.json has attn_norm_num_groups={values['attn_norm_num_groups']}, "
                           f"not norm_num_groups={values['norm_num_groups']}")
    if values["downsample_padding"] not in _DIFFUSERS_PADDING:
        raise ConvertError(f"config.json has downsample_padding={values['downsample_padding']}; 0 or 1 convert")
    if values["in_channels"] != values["out_channels"]:
        raise ConvertError(f"config.json has in_channels={values['in_channels']} but "
                           f"out_channels={values['out_channels']}")
    size = values["sample_size"]
    if isinstance(size, (list, tuple)):
        if len(set(size)) != 1:
            raise ConvertError(f"config.json has sample_size={size}; megdiffusion's images are square")
        size = size[0]
    if any(c % channels[0] for c in channels):
        raise ConvertError(f"config.json: block_out_channels {channels} are not multiples of {channels[0]}")
    return dict(model_channels=channels[0], channel_mult=tuple(c // channels[0] for c in channels),
                num_res_blocks=values["layers_per_block"], attention_levels=attn, image_channels=values["in_channels"],
                num_heads=1, beta_schedule="linear",
                image_size=size, norm_groups=values["norm_num_groups"], norm_eps=float(values["norm_eps"]),
                downsample_padding=_DIFFUSERS_PADDING[values["downsample_padding"]], dropout=config.get("dropout"),
                num_timesteps=values["num_train_timesteps"])


_VARIANCES = {"fixed_large": "fixedlarge", "fixed_small": "fixedsmall", "fixed_small_log": "fixedsmall"}
_PREDICTIONS = {"epsilon": "eps", "sample": "xstart", "v_prediction": "v"}  # v: the same definition as ours


def check_scheduler_config(config):
    """``num_timesteps``, ``mean_type`` and ``var_type`` of a ``DDPMScheduler`` config; ``ConvertError`` unless its
    betas are megdiffusion's linear schedule and it clips x_0 to [-1, 1] as megdiffusion's samplers do."""
    steps = config.get("num_train_timesteps", 1000)
    if config.get("beta_schedule", "linear") != "linear" or config.get("trained_betas") is not None:
        raise ConvertError(f"scheduler_config.json: beta_schedule={config.get('beta_schedule')!r} "
                           f"(trained_betas={config.get('trained_betas')!r}); only the linear schedule converts")
    betas = np.linspace(config.get("beta_start", 1e-4), config.get("beta_end", 0.02), steps)
    if not np.allclose(betas, make_beta_schedule("linear", steps), rtol=1e-9, atol=0):
        raise ConvertError(f"scheduler_config.json: linear betas {betas[0]:g}..{betas[-1]:g} over T={steps} are not "
                           "megdiffusion's linear schedule (1e-4..0.02 scaled by 1000/T)")
    variance, prediction = config.get("variance_type", "fixed_small"), config.get("prediction_type", "epsilon")
    if variance not in _VARIANCES or prediction not in _PREDICTIONS:
        raise ConvertError(f"scheduler_config.json: variance_type={variance!r}, prediction_type={prediction!r}; "
                           f"megdiffusion has {', '.join(_VARIANCES)} and {', '.join(_PREDICTIONS)}")
    if not config.get("clip_sample", True) or config.get("clip_sample_range", 1.0) != 1.0 \
            or config.get("thresholding", False):
        raise ConvertError("scheduler_config.json does not clip x_0 to [-1, 1] (clip_sample, clip_sample_range, "
                           "thresholding); megdiffusion's samplers always do")
    return dict(num_timesteps=steps, mean_type=_PREDICTIONS[prediction], var_type=_VARIANCES[variance])


def _sinusoid_tables(steps, dim):
    """{time_embedding: [steps, dim] table} of both sinusoids, in float64 (``layers.timestep_embedding``)."""
    half = dim // 2
    t = np.arange(steps, dtype=np.float64)[:, None]
    ho = t * np.exp(-np.log(10000.0) * np.arange(half) / (half - 1))
    interleaved = t * np.exp(-np.log(10000.0) * 2 * np.arange(half) / dim)
    return {"ho": np.concatenate([np.sin(ho), np.cos(ho)], axis=1),
            "pytorch_ddpm": np.stack([np.sin(interleaved), np.cos(interleaved)], axis=2).reshape(steps, dim)}


def table_embedding(table):
    """Which sinusoid (``nn.options.TIME_EMBEDDINGS``) a stored [T, dim] time-embedding table holds, or None."""
    table = np.asarray(table, np.float64)
    for kind, formula in _sinusoid_tables(*table.shape).items():
        if np.abs(table - formula).max() < TABLE_ATOL:
            return kind
    return None


# --- reading a file ------------------------------------------------------------------------------------------

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


def _read_json(path):
    try:
        with open(path) as f:
            value = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConvertError(f"cannot read {path}: {one_line(exc)}") from None
    if not isinstance(value, dict):
        raise ConvertError(f"{path} is not a JSON object")
    return value


def _state_dict(obj, ema, path):
    """The state dict to convert in a loaded file, and its name: the file itself, or with raw and EMA weights
    (pytorch-ddpm's ``net_model``/``ema_model``, the port's ``model``/``ema_model``) the one ``ema`` picks."""
    if isinstance(obj, dict) and "ema_model" in obj:
        key = "ema_model" if ema else ("net_model" if "net_model" in obj else "model")
        state = obj.get(key)
    elif ema:
        raise ConvertError(f"{path} holds one set of weights; --ema picks the EMA weights of files that hold both "
                           "(pytorch-ddpm's ckpt.pt, the MegEngine port's ckpt.pkl)")
    else:
        key, state = "state dict", obj
    if not isinstance(state, dict) or not state or not all(isinstance(v, np.ndarray) for v in state.values()):
        raise ConvertError(f"{path}: its {key} is not a state dict (names mapped to tensors)")
    return state, key


def _diffusers_source(model_dir, layout, tensors, path):
    config = _read_json(os.path.join(model_dir, "config.json"))
    if config.get("_class_name", "UNet2DModel") != "UNet2DModel":
        raise ConvertError(f"{model_dir}/config.json describes a {config['_class_name']}, not a UNet2DModel")
    stated = check_diffusers_config(config)
    for scheduler in (os.path.join(model_dir, "scheduler_config.json"),
                      os.path.join(os.path.dirname(os.path.abspath(model_dir)), "scheduler", "scheduler_config.json")):
        if os.path.isfile(scheduler):
            stated.update(check_scheduler_config(_read_json(scheduler)))
            break
    return Source(path, "diffusers", layout, tensors, {k: v for k, v in stated.items() if v is not None},
                  "state dict")


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
    return ConvertError(f"{path} {what} no conversion; give it as it is to --ckpt (scripts.sample, scripts.fid, "
                        "scripts.nll) or --init_from (scripts.train)")


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
        return _diffusers_source(os.path.dirname(path) or ".", layout, state, given)
    return Source(given, layout, layout, state, {}, weights)


# --- converting ------------------------------------------------------------------------------------------------

def family_of(fmt):
    """The network family (``Published.family``) of a format: improved-diffusion's, or Ho et al.'s."""
    return "improved_diffusion" if fmt == "improved_diffusion" else "ddpm"


def _conventions(source, model_channels):
    """downsample_padding, time_embedding, norm_eps, num_heads, beta_schedule and num_timesteps (or norm_groups) a
    non-diffusers source states."""
    if source.layout == "improved_diffusion":  # GroupNorm32 with torch's eps; conv Downsample with padding 1
        return dict(downsample_padding="symmetric", time_embedding="iddpm", norm_eps=1e-5, norm_groups=32)
    ho = dict(downsample_padding="bottom_right", time_embedding="ho", norm_eps=1e-6, num_heads=1,
              beta_schedule="linear")
    if source.layout == "pesser":
        return ho
    table = source.tensors.get(_TABLE)
    if table is None or table.ndim != 2 or table.shape[1] != model_channels:
        raise ConvertError(f"{source.path}: no [T, {model_channels}] time-embedding table {_TABLE}")
    kind = table_embedding(table)
    if kind is None or (source.layout == "pytorch_ddpm" and kind != "pytorch_ddpm"):
        raise ConvertError(f"{source.path}: {_TABLE} is not {'a' if kind is None else 'pytorch-ddpm’s'} sinusoid")
    if table.shape[0] != 1000:
        raise ConvertError(f"{source.path}: T={table.shape[0]}; its betas (1e-4..0.02 at any T) are megdiffusion's "
                           "linear schedule only at T=1000")
    # The port's first model code was pytorch-ddpm's network; its last (and Ho's weights) are Ho's.
    conventions = ho if kind == "ho" else dict(ho, downsample_padding="symmetric", time_embedding=kind, norm_eps=1e-5)
    return dict(conventions, num_timesteps=table.shape[0])


def _published(family, fields):
    shape = tuple(fields[k] for k in ("model_channels", "channel_mult", "num_res_blocks", "attention_levels"))
    return next((p for p in PUBLISHED if p.family == family
                 and (p.model_channels, p.channel_mult, p.num_res_blocks, p.attention_levels) == shape), None)


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
    published = _published(family, fields)
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
    levels = fields.pop("attention_levels")
    fields["attention_resolutions"] = tuple(fields["image_size"] // 2 ** level for level in levels)
    try:
        cfg = TrainConfig(**fields)
        validate(cfg)
    except ConfigError as err:
        raise ConvertError(f"{source.path}: {err}") from None
    return cfg


def mapping(layout, source_shapes, target_shapes, levels, blocks):
    """``[(source name, target name)]`` for every target parameter, in target order. ``ConvertError`` naming the
    parameters the source lacks, the source tensors nothing maps (but a checked time table), or a shape that
    differs beyond unit axes (attention Linear [C, C] and conv [C, C, 1, 1]; bias [C] and [1, C, 1, 1]; a fused
    qkv projection has three times the rows of each of q, k and v)."""
    attention_levels = {int(name.split(".")[1]) for name in target_shapes
                        if name.startswith("up.") and ".attns." in name}
    pairs = [(source_name(layout, name, levels, blocks, attention_levels), name) for name in target_shapes]
    missing = [theirs for theirs, _ in pairs if theirs not in source_shapes]
    extra = sorted(set(source_shapes) - {theirs for theirs, _ in pairs} - {LAYOUTS[layout].table})
    if missing or extra:
        parts = [f"{len(names)} {what}: {', '.join(names[:4])}{', ...' if len(names) > 4 else ''}"
                 for names, what in ((missing, "parameters missing"), (extra, "tensors left over")) if names]
        raise ConvertError(f"the {layout} tensors do not fill the network exactly ({'; '.join(parts)})")
    for theirs, ours in pairs:
        squeezed = [tuple(n for n in shape if n != 1) for shape in (source_shapes[theirs], target_shapes[ours])]
        if qkv_part(layout, ours) is not None and squeezed[0] and squeezed[0][0] % 3 == 0:
            squeezed[0] = (squeezed[0][0] // 3,) + squeezed[0][1:]
        if squeezed[0] != squeezed[1]:
            raise ConvertError(f"{theirs} has shape {tuple(source_shapes[theirs])}; the network's {ours} needs "
                               f"{tuple(target_shapes[ours])}")
    return pairs


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
    from megdiffusion.nn.unet import attention_heads
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
    if order == "bgr":  # the same network for RGB images: conv_in's inputs and conv_out's outputs reversed
        weights["conv_in.weight"] = np.ascontiguousarray(weights["conv_in.weight"][:, ::-1])
        weights["conv_out.weight"] = np.ascontiguousarray(weights["conv_out.weight"][::-1])
        weights["conv_out.bias"] = np.ascontiguousarray(weights["conv_out.bias"][:, ::-1])
    record = {"format": source.format, "file": path, "weights": source.weights, "channel_order": order}
    return cfg, weights, record
