"""diffusers' ``UNet2DModel`` directories: the network its ``config.json`` describes and the diffusion of its
``scheduler_config.json``, checked to be what megdiffusion computes."""
import json
import os

import numpy as np

from megdiffusion.diffusion.schedules import make_beta_schedule
from megdiffusion.errors import one_line
from megdiffusion.formats import ConvertError

DIFFUSERS_WEIGHTS = ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin")


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


def _read_json(path):
    try:
        with open(path) as f:
            value = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConvertError(f"cannot read {path}: {one_line(exc)}") from None
    if not isinstance(value, dict):
        raise ConvertError(f"{path} is not a JSON object")
    return value


def diffusers_source(model_dir):
    """The ``TrainConfig`` fields (and ``attention_levels``) a diffusers model directory states: its config.json and
    the scheduler_config.json beside it (or in ``../scheduler/``)."""
    config = _read_json(os.path.join(model_dir, "config.json"))
    if config.get("_class_name", "UNet2DModel") != "UNet2DModel":
        raise ConvertError(f"{model_dir}/config.json describes a {config['_class_name']}, not a UNet2DModel")
    stated = check_diffusers_config(config)
    for scheduler in (os.path.join(model_dir, "scheduler_config.json"),
                      os.path.join(os.path.dirname(os.path.abspath(model_dir)), "scheduler", "scheduler_config.json")):
        if os.path.isfile(scheduler):
            stated.update(check_scheduler_config(_read_json(scheduler)))
            break
    return {k: v for k, v in stated.items() if v is not None}
