"""diffusers' ``UNet2DModel`` directories: the network its ``config.json`` describes and the diffusion of its
``scheduler_config.json``, checked to be what megdiffusion computes."""
import json
import os

import numpy as np

from megdiffusion.diffusion.choices import LEARNED_VAR_TYPES
from megdiffusion.diffusion.schedules import make_beta_schedule
from megdiffusion.errors import one_line
from megdiffusion.formats import ConvertError
from megdiffusion.formats.names import source_name
from megdiffusion.nn.options import attention_heads

DIFFUSERS_WEIGHTS = ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin")
# The diffusers release whose UNet2DModel and DDPMScheduler the written configs were checked against.
DIFFUSERS_VERSION = "0.42.1"


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
# The values a UNet2DModel of megdiffusion's network has (the time embedding, norm shift, heads and classes vary).
DIFFUSERS_FIXED = {
    "center_input_sample": False, "time_embedding_type": "positional", "mid_block_scale_factor": 1,
    "downsample_type": "conv", "upsample_type": "conv", "act_fn": "silu", "add_attention": True,
    "class_embed_type": None, "mid_block_type": "UNetMidBlock2D",
}
_DIFFUSERS_PADDING = {0: "bottom_right", 1: "symmetric"}  # downsample_padding 0: F.pad(x, (0, 1, 0, 1))
# (flip_sin_to_cos, freq_shift) of each time embedding diffusers' Timesteps computes: Ho's [sin | cos] over
# i / (half - 1), improved-diffusion's [cos | sin] over i / half. pytorch-ddpm's interleaved sin and cos over i / half
# are diffusers' [sin | cos] over i / half once the first time-embedding layer's inputs are reordered
# (``sin_cos_columns``): the same network.
_TIME_EMBEDDINGS = {(False, 1): "ho", (True, 0): "iddpm", (False, 0): "pytorch_ddpm"}
EMBEDDING_LAYER = "temb_dense0.weight"  # the layer that reads the embedding: (out, dim), ours
_SCALE_SHIFT = {"default": False, "scale_shift": True}


def sin_cos_columns(dim):
    """The input columns of ``EMBEDDING_LAYER`` that diffusers' [sin | cos] order takes from pytorch-ddpm's
    interleaved (sin f0, cos f0, sin f1, ...): its weight's ``[:, sin_cos_columns(dim)]``."""
    return np.concatenate([np.arange(0, dim, 2), np.arange(1, dim, 2)])


def check_diffusers_config(config):
    """The network a ``UNet2DModel`` config describes, as ``TrainConfig`` fields (and attention_levels, and
    ``out_channels``; None where it says nothing: dropout, T); ``ConvertError`` naming the key when it is not a
    network megdiffusion computes."""
    values = {**DIFFUSERS_DEFAULTS, **{k: v for k, v in config.items() if not k.startswith("_")}}
    unknown = sorted(set(values) - set(DIFFUSERS_DEFAULTS))
    if unknown:
        raise ConvertError(f"config.json has keys this converter does not know: {', '.join(unknown)}")
    for key, needed in DIFFUSERS_FIXED.items():
        if values[key] != needed:
            raise ConvertError(f"config.json has {key}={values[key]!r}; megdiffusion's network needs {needed!r}")
    embedding = _TIME_EMBEDDINGS.get((values["flip_sin_to_cos"], values["freq_shift"]))
    if embedding is None:
        raise ConvertError(f"config.json has flip_sin_to_cos={values['flip_sin_to_cos']}, freq_shift="
                           f"{values['freq_shift']}; megdiffusion has (False, 1), Ho's, (True, 0), "
                           "improved-diffusion's, and (False, 0), pytorch-ddpm's reordered")
    if values["resnet_time_scale_shift"] not in _SCALE_SHIFT:
        raise ConvertError(f"config.json has resnet_time_scale_shift={values['resnet_time_scale_shift']!r}; "
                           f"megdiffusion has {', '.join(_SCALE_SHIFT)}")
    channels, downs, ups = list(values["block_out_channels"]), list(values["down_block_types"]), \
        list(values["up_block_types"])
    levels = len(channels)
    if len(downs) != levels or not set(downs) <= {"DownBlock2D", "AttnDownBlock2D"}:
        raise ConvertError(f"config.json: down_block_types {downs} must be {levels} DownBlock2D/AttnDownBlock2D")
    attn = tuple(level for level, kind in enumerate(downs) if kind == "AttnDownBlock2D")
    mirrored = ["AttnUpBlock2D" if levels - 1 - k in attn else "UpBlock2D" for k in range(levels)]
    if ups != mirrored:
        raise ConvertError(f"config.json: up_block_types {ups} do not mirror down_block_types (expected {mirrored})")
    attended = [channels[lv] for lv in attn] + channels[-1:]  # + the middle block
    head_dim = values["attention_head_dim"]  # null: one head as wide as each block's channels
    if head_dim is not None and any(c % head_dim for c in attended):
        raise ConvertError(f"config.json has attention_head_dim={head_dim}, which does not divide the attended "
                           f"channels {attended}")
    heads = {1} if head_dim is None else {c // head_dim for c in attended}
    num_heads, num_head_channels = (heads.pop(), 0) if len(heads) == 1 else (1, head_dim)
    if values["time_embedding_dim"] not in (None, 4 * channels[0]):
        raise ConvertError(f"config.json has time_embedding_dim={values['time_embedding_dim']}; megdiffusion's is "
                           f"4 * {channels[0]}")
    if values["attn_norm_num_groups"] is None and values["resnet_time_scale_shift"] != "default":
        # UNetMidBlock2D then builds its attention without a GroupNorm; megdiffusion's has one.
        raise ConvertError(f"config.json has resnet_time_scale_shift={values['resnet_time_scale_shift']!r} and "
                           "attn_norm_num_groups=null: its middle attention has no GroupNorm, which megdiffusion's "
                           "network has")
    if values["attn_norm_num_groups"] not in (None, values["norm_num_groups"]):
        raise ConvertError(f"config.json has attn_norm_num_groups={values['attn_norm_num_groups']}, "
                           f"not norm_num_groups={values['norm_num_groups']}")
    if values["downsample_padding"] not in _DIFFUSERS_PADDING:
        raise ConvertError(f"config.json has downsample_padding={values['downsample_padding']}; 0 or 1 convert")
    if values["out_channels"] not in (values["in_channels"], 2 * values["in_channels"]):
        raise ConvertError(f"config.json has in_channels={values['in_channels']} but "
                           f"out_channels={values['out_channels']} (the same, or twice for a learned variance)")
    size = values["sample_size"]
    if isinstance(size, (list, tuple)):
        if len(set(size)) != 1:
            raise ConvertError(f"config.json has sample_size={size}; megdiffusion's images are square")
        size = size[0]
    if any(c % channels[0] for c in channels):
        raise ConvertError(f"config.json: block_out_channels {channels} are not multiples of {channels[0]}")
    return dict(model_channels=channels[0], channel_mult=tuple(c // channels[0] for c in channels),
                num_res_blocks=values["layers_per_block"], attention_levels=attn, image_channels=values["in_channels"],
                out_channels=values["out_channels"], num_heads=num_heads, num_head_channels=num_head_channels,
                time_embedding=embedding, use_scale_shift_norm=_SCALE_SHIFT[values["resnet_time_scale_shift"]],
                num_classes=values["num_class_embeds"] or 0, beta_schedule="linear",
                image_size=size, norm_groups=values["norm_num_groups"], norm_eps=float(values["norm_eps"]),
                downsample_padding=_DIFFUSERS_PADDING[values["downsample_padding"]], dropout=config.get("dropout"),
                num_timesteps=values["num_train_timesteps"])


# diffusers' DDPMScheduler names of megdiffusion's variances, predictions and schedules. Its "learned" takes the
# network's output as the variance, not megdiffusion's log variance: not offered; "fixed_small_log" samples alike.
_VARIANCES = {"fixed_large": "fixedlarge", "fixed_small": "fixedsmall", "fixed_small_log": "fixedsmall",
              "learned_range": "learned_range"}
_PREDICTIONS = {"epsilon": "eps", "sample": "xstart", "v_prediction": "v"}  # v: the same definition as ours
_SCHEDULES = {"linear": "linear", "squaredcos_cap_v2": "cosine"}  # the cosine: the same alpha_bar, capped at 0.999


def check_scheduler_config(config):
    """``num_timesteps``, ``beta_schedule``, ``mean_type`` and ``var_type`` of a ``DDPMScheduler`` config;
    ``ConvertError`` unless its betas are one of megdiffusion's schedules and it clips x_0 to [-1, 1] as
    megdiffusion's samplers do."""
    steps = config.get("num_train_timesteps", 1000)
    schedule = _SCHEDULES.get(config.get("beta_schedule", "linear"))
    if schedule is None or config.get("trained_betas") is not None:
        raise ConvertError(f"scheduler_config.json: beta_schedule={config.get('beta_schedule')!r} "
                           f"(trained_betas={config.get('trained_betas')!r}); the linear and squaredcos_cap_v2 "
                           "schedules convert")
    betas = np.linspace(config.get("beta_start", 1e-4), config.get("beta_end", 0.02), steps)
    if schedule == "linear" and not np.allclose(betas, make_beta_schedule("linear", steps), rtol=1e-9, atol=0):
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
    return dict(num_timesteps=steps, beta_schedule=schedule, mean_type=_PREDICTIONS[prediction],
                var_type=_VARIANCES[variance])


def diffusers_configs(cfg):
    """``(config.json, scheduler_config.json)``: the ``UNet2DModel`` and ``DDPMScheduler`` of ``cfg``'s network and
    diffusion (a ``TrainConfig``); ``ConvertError`` naming what diffusers cannot describe."""
    embedding = {kind: key for key, kind in _TIME_EMBEDDINGS.items()}[cfg.time_embedding]  # every kind has one
    variance = {ours: theirs for theirs, ours in reversed(_VARIANCES.items())}.get(cfg.var_type)
    prediction = {ours: theirs for theirs, ours in _PREDICTIONS.items()}.get(cfg.mean_type)
    missing = [what for what, absent in (
        (f"var_type {cfg.var_type} (DDPMScheduler's 'learned' is a variance, not a log variance)", variance is None),
        (f"mean_type {cfg.mean_type}", prediction is None),
        ("rescaled timesteps at T != 1000 (UNet2DModel sees the scheduler's t as it is)",
         cfg.rescale_timesteps and cfg.num_timesteps != 1000)) if absent]
    channels = [cfg.model_channels * mult for mult in cfg.channel_mult]
    attn = [level for level in range(len(channels)) if cfg.image_size // 2 ** level in cfg.attention_resolutions]
    attended = [channels[level] for level in attn] + channels[-1:]
    heads = [attention_heads(c, cfg.num_heads, cfg.num_head_channels) for c in attended]
    widths = {c // h for c, h in zip(attended, heads)}
    if set(heads) != {1} and len(widths) > 1:
        missing.append(f"heads of different widths {sorted(widths)} (UNet2DModel has one attention_head_dim)")
    if missing:
        raise ConvertError(f"diffusers cannot describe this network: {'; '.join(missing)}")
    levels = len(channels)
    unet = {
        "_class_name": "UNet2DModel", "_diffusers_version": DIFFUSERS_VERSION, **DIFFUSERS_FIXED,
        "sample_size": cfg.image_size, "in_channels": cfg.image_channels,
        "out_channels": cfg.image_channels * (2 if variance == "learned_range" else 1),
        "flip_sin_to_cos": embedding[0], "freq_shift": embedding[1],
        "down_block_types": ["AttnDownBlock2D" if lv in attn else "DownBlock2D" for lv in range(levels)],
        "up_block_types": ["AttnUpBlock2D" if lv in attn else "UpBlock2D" for lv in reversed(range(levels))],
        "block_out_channels": channels, "layers_per_block": cfg.num_res_blocks,
        "downsample_padding": {pad: key for key, pad in _DIFFUSERS_PADDING.items()}[cfg.downsample_padding],
        "dropout": cfg.dropout, "attention_head_dim": None if set(heads) == {1} else widths.pop(),
        # attn_norm_num_groups stated: with scale_shift, null would build the middle attention without a GroupNorm.
        "norm_num_groups": cfg.norm_groups, "attn_norm_num_groups": cfg.norm_groups, "norm_eps": cfg.norm_eps,
        "resnet_time_scale_shift": "scale_shift" if cfg.use_scale_shift_norm else "default",
        "num_class_embeds": cfg.num_classes or None, "time_embedding_dim": None, "num_train_timesteps": None,
    }
    betas = make_beta_schedule(cfg.beta_schedule, cfg.num_timesteps)
    scheduler = {
        "_class_name": "DDPMScheduler", "_diffusers_version": DIFFUSERS_VERSION,
        "num_train_timesteps": cfg.num_timesteps, "beta_start": float(betas[0]), "beta_end": float(betas[-1]),
        "beta_schedule": {ours: theirs for theirs, ours in _SCHEDULES.items()}[cfg.beta_schedule],
        "trained_betas": None, "variance_type": variance, "clip_sample": True, "clip_sample_range": 1.0,
        "prediction_type": prediction, "thresholding": False, "timestep_spacing": "leading", "steps_offset": 0,
    }
    return unet, scheduler


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
    doubled = stated.pop("out_channels") == 2 * stated["image_channels"]
    if doubled != (stated.get("var_type") in LEARNED_VAR_TYPES):
        raise ConvertError(f"{model_dir}/config.json has {'twice' if doubled else 'as many'} output channels as "
                           f"input channels, but the scheduler's variance is {stated.get('var_type', 'not stated')}: "
                           "a learned variance (learned_range) doubles them")
    return {k: v for k, v in stated.items() if v is not None}


def diffusers_tensors(cfg, weights):
    """``{diffusers name: array}`` of megdiffusion's ``weights`` (a state dict of ``cfg``'s network) in
    ``UNet2DModel``'s names and shapes: attention projections as Linear (C, C), every bias (C,)."""
    levels = len(cfg.channel_mult)
    attention_levels = {level for level in range(levels) if cfg.image_size // 2 ** level in cfg.attention_resolutions}
    tensors = {}
    for name, array in weights.items():
        if name.endswith(".bias"):
            array = array.reshape(-1)  # MegEngine's convolutions keep theirs as (1, C, 1, 1)
        elif (".attns." in name or name.startswith("mid_attn.")) and array.ndim == 4:
            array = array.reshape(array.shape[:2])  # our 1x1 convolutions, diffusers' Linear layers
        if name == EMBEDDING_LAYER and cfg.time_embedding == "pytorch_ddpm":
            array = array[:, sin_cos_columns(array.shape[1])]
        tensors[source_name("diffusers", name, levels, cfg.num_res_blocks, attention_levels)] = \
            np.ascontiguousarray(array, np.float32)
    return tensors


def write_diffusers(cfg, weights, path):
    """Write ``weights`` (a state dict of ``cfg``'s network) as a diffusers ``DDPMPipeline`` directory at ``path``:
    ``model_index.json``, ``unet/`` (config.json, diffusion_pytorch_model.safetensors) and ``scheduler/``
    (scheduler_config.json), all or nothing; ``ConvertError`` for a network diffusers cannot describe."""
    from safetensors.numpy import save_file

    from megdiffusion.files.disk import atomic_directory

    unet, scheduler = diffusers_configs(cfg)
    tensors = diffusers_tensors(cfg, weights)
    index = {"_class_name": "DDPMPipeline", "_diffusers_version": DIFFUSERS_VERSION,
             "scheduler": ["diffusers", "DDPMScheduler"], "unet": ["diffusers", "UNet2DModel"]}
    with atomic_directory(path) as tmp:
        for name in ("unet", "scheduler"):
            os.mkdir(os.path.join(tmp, name))
        for file, value in (("model_index.json", index), ("unet/config.json", unet),
                            ("scheduler/scheduler_config.json", scheduler)):
            with open(os.path.join(tmp, file), "w") as f:
                json.dump(value, f, indent=2)
                f.write("\n")
        save_file(tensors, os.path.join(tmp, "unet", DIFFUSERS_WEIGHTS[0]), metadata={"format": "pt"})
