"""How each format names the UNet's tensors (``LAYOUTS``), and the mapping of a file's tensors onto the network."""
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from megdiffusion.formats import ConvertError

# megdiffusion's modules outside the levels; each layout names them in this order.
_FIXED = ("temb_dense0", "temb_dense1", "conv_in", "mid_block1", "mid_attn", "mid_block2", "norm_out", "conv_out")
CLASS_EMBEDDING = "class_emb"  # a class-conditional network's, named only by the formats that have one


def _parse(name):
    """``(place, sub-layer, parameter)`` of one of megdiffusion's UNet parameter names. A place is a module of
    ``_FIXED``, or ("block" | "attn" | "resample", "down" | "up", level, index within the level)."""
    *module, param = name.split(".")
    if module[0] in _FIXED + (CLASS_EMBEDDING,):
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
    class_emb: Optional[str] = None  # the class embedding (``CLASS_EMBEDDING``), in the formats that have one


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
TIME_TABLE = "time_embedding.timembedding.0.weight"
LAYOUTS = {
    "pesser": Layout(dict(zip(_FIXED, ("temb.dense.0", "temb.dense.1", "conv_in", "mid.block_1", "mid.attn_1",
                                       "mid.block_2", "norm_out", "conv_out"))),
                     _pesser_stage, dict(zip(_OURS_BLOCK, _OURS_BLOCK[:5] + ("nin_shortcut",))),
                     dict(zip(_OURS_ATTN, _OURS_ATTN))),
    "diffusers": Layout(_DIFFUSERS_FIXED, _diffusers_stage, _DIFFUSERS_BLOCK,
                        dict(zip(_OURS_ATTN, ("group_norm", "to_q", "to_k", "to_v", "to_out.0"))),
                        class_emb="class_embedding"),
    "diffusers_legacy_attn": Layout(_DIFFUSERS_FIXED, _diffusers_stage, _DIFFUSERS_BLOCK,
                                    dict(zip(_OURS_ATTN, ("group_norm", "query", "key", "value", "proj_attn")))),
    "pytorch_ddpm": Layout(_FLAT_FIXED, _flat_stage, dict(zip(_OURS_BLOCK, _FLAT_BLOCK + ("shortcut",))), _FLAT_ATTN,
                           TIME_TABLE),
    "megengine_port": Layout(_FLAT_FIXED, _flat_stage, dict(zip(_OURS_BLOCK, _FLAT_BLOCK + ("short_cut",))),
                             _FLAT_ATTN, TIME_TABLE),
    "improved_diffusion": Layout(
        dict(zip(_FIXED, ("time_embed.0", "time_embed.2", "input_blocks.0.0", "middle_block.0", "middle_block.1",
                          "middle_block.2", "out.0", "out.2"))),
        _iddpm_stage,
        dict(zip(_OURS_BLOCK, ("in_layers.0", "in_layers.2", "emb_layers.1", "out_layers.0", "out_layers.3",
                               "skip_connection"))),
        dict(zip(_OURS_ATTN, ("norm", "qkv", "qkv", "qkv", "proj_out"))), fused_qkv=True, class_emb="label_emb"),
}
_QKV_PARTS = {"q": 0, "k": 1, "v": 2}


def source_name(layout, name, levels, blocks, attention_levels=()):
    """The name ``layout`` gives megdiffusion's parameter ``name`` in a network of ``levels`` resolution levels
    with ``blocks`` residual blocks per level on the way down, and attention at ``attention_levels``."""
    place, sub, param = _parse(name)
    names = LAYOUTS[layout]
    if place == CLASS_EMBEDDING:
        if names.class_emb is None:
            raise ConvertError(f"the {layout} format has no class embedding (a class-conditional network)")
        parts, is_attn = [names.class_emb], False
    elif isinstance(place, str):
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
